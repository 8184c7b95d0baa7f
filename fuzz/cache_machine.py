"""The cache machine: the spec beside any set of prefix-cache targets, each checked as its profile promises.

The machine keeps the spec's state as its model and a ledger of slots (the
pages it owns, the pages the caches hold). Every call goes to the model and
to every target (``radixspec.fuzz.targets.api``: ours, SGLang's, vLLM's, a user's);
what comes back is checked against the model:

* a match returns exactly the cached length and the slots inserted for that
  prefix, never a page of another namespace;
* an insert reports the pages already cached; new pages take the offered
  slots (or, for targets that allocate, fresh aligned pages);
* a call the spec rejects is rejected with the spec's error class (and, for
  targets with the differential capability, its message) and changes
  nothing; targets without validation are not sent it (counted as skipped);
* every slot a target gives back was cached, unlocked, and is given back
  once, deepest page first; eviction takes as many pages as the profile
  says. LRU, **strict**: the pages the spec (or the profile's LRU model)
  would take; **sync**: the model follows the target's choice once it is
  shown to be allowed, oldest first by the target's own clock;
* after every step: sizes equal the cached pages; then, every step for small
  trees and every CHECK_EVERY steps for big ones (and at the end): the
  spec's invariants, each target's integrity check, its content and stamps
  (the whole abstract state for targets with the differential capability),
  its KV events replayed, its metrics, the slot ledger.

Several targets run side by side when every profile follows the spec (exact
pages, the caller's slots, the spec's LRU): the model then needs no choice of
any target. A target that makes its own choices (whole nodes, its own pages,
its own LRU) runs alone, and the model follows it.
"""

from __future__ import annotations

from .cache.base import (
    BAD_SLOTS,
    EVICT_SIZES,
    FILLER,
    OUTGROW,
    TOUCHED_LEAVES,
    CacheMachineBase,
    Driven,
    HandleSet,
    describe,
)
from .cache.shaping import TreeShaping

__all__ = [
    "BAD_SLOTS",
    "EVICT_SIZES",
    "FILLER",
    "OUTGROW",
    "TOUCHED_LEAVES",
    "CacheMachine",
    "CacheMachineBase",
    "Driven",
    "HandleSet",
    "describe",
]


class CacheMachine(TreeShaping):
    """The spec and targets driven by match / insert / lock / unlock / evict / reset, checked as profiled.

    Its parts (``fuzz/cache/``), each building on the one before: the state and setup (``base``), the slot
    ledger (``ledger``), the oracle (``oracle``), the checks after every step (``checks``), the API's
    operations (``operations``) and the rules that shape trees (``shaping``).
    """
