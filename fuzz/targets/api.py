"""The public target API: what a prefix cache (or cache manager) offers to be fuzzed against the spec.

A *target* wraps someone else's cache behind a small Protocol and declares a
``Profile``: what it promises exactly as the spec says, and where it
legitimately differs. The machines in ``fuzz.target_machine`` then check
the spec's exact semantics where the profile promises them and universal
properties everywhere (docs/targets.md has the whole contract).

Calling convention: token ids and slots are plain lists of ints; a namespace
is ``None`` or a tuple from the spec's domain (targets without namespaces
only ever see ``None``); handles are whatever the target returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from spec.domains import Namespace
from spec.prefix_cache import PageKey, Prefix, page_key

# a page is named by the spec's key: (namespace, Prefix); build one from tokens with page_key(namespace, tokens, P)
__all__ = ["PageKey", "Prefix", "page_key"]


@dataclass(frozen=True)
class Profile:
    """A target's semantic profile: where it follows the spec exactly and where it legitimately differs."""

    # a name for the summary
    name: str
    # "page": evict(size) takes exactly ceil(size / P) pages; "node": whole eviction units (radix nodes,
    # blocks) until at least ``size`` tokens, stopping as soon as that many are evicted
    eviction_unit: Literal["page", "node"] = "page"
    # "evict": pages leave only through evict(); "allocate": a cached free page is evicted when the
    # target allocates its page for new data (vLLM's free queue); the target then has no evict()
    eviction_trigger: Literal["evict", "allocate"] = "evict"
    # "logical": page_stamps() must equal the spec's logical stamps; "order": page_stamps() is the
    # target's own clock, only its order is meaningful; "none": no clock is observable
    clock: Literal["logical", "order", "none"] = "logical"
    # "ours": rejects bad input with the spec's error classes, changing nothing; "any": raises some
    # exception and changes nothing; "none": no validation, so the spec serves as the precondition
    # oracle and invalid calls are not sent (the summary counts them as skipped)
    errors: Literal["ours", "any", "none"] = "ours"
    # whether match/insert take a namespace (else every call uses None)
    namespaces: bool = True
    # "returns": reset() returns every slot the cache held; "drops": it empties the cache and the
    # caller takes every slot back; "none": no reset
    reset: Literal["returns", "drops", "none"] = "returns"
    # whether a handle made before reset() may still be locked and unlocked when it covers no page (the
    # spec: an empty path is always valid); when False, such calls are invalid and follow ``errors``
    handles_survive_reset: bool = True
    # "caller": insert_prefix takes the caller's slots for new pages; "target": it allocates its own
    # (the caller passes None and reads them from the handle)
    slots: Literal["caller", "target"] = "caller"
    # the LRU check run by default: "strict" (the target evicts what the spec would) or "sync" (the
    # spec follows the target's choice after checking it was allowed)
    default_lru: Literal["strict", "sync"] = "strict"
    # why this profile differs from the spec, in a sentence per difference (printed in the summary)
    notes: tuple[str, ...] = ()
    # strict LRU for targets whose rule is not the spec's page LRU: factory(num_pages, page_size) of a model
    # with match(pages), insert(hit_pages, new_count) -> (new_pages, evicted_pages), lock(pages),
    # unlock(pages), reset() (pages as first slots, in path order)
    lru_model: Callable[[int, int], Any] | None = None
    # whether the target's KV events tell namespaces apart (different hashes for equal tokens in two
    # namespaces); when False, --lru sync replays them as a router that counts repeats would, on token
    # prefixes alone, and --lru strict still asks for distinct hashes
    event_namespaces: bool = True


EXACT = Profile(name="exact (the spec's semantics)")


@runtime_checkable
class PrefixCacheTarget(Protocol):
    """A prefix cache seen through lists and ints. Optional methods are listed in ``OPTIONAL_CACHE_METHODS``."""

    profile: Profile
    page_size: int

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> Any:
        """The longest cached page-aligned prefix: a handle."""

    def insert_prefix(self, tokens: list[int], indices: list[int] | None, namespace: Namespace) -> tuple[int, Any]:
        """Cache the whole pages of ``tokens``: (tokens already cached before the call, handle of the whole path)."""

    def cached_len(self, handle: Any) -> int:
        """Matched tokens of a handle."""

    def matched_slots(self, handle: Any) -> list[int]:
        """Slots of a handle's path in sequence order."""

    def lock(self, handle: Any) -> None:
        """Protect the handle's path from eviction."""

    def unlock(self, handle: Any) -> None:
        """Release one lock of the handle's path."""

    def size_info(self) -> tuple[int, int]:
        """(evictable tokens, protected tokens)."""

    def take_evicted(self) -> list[list[int]]:
        """Slots the cache gave back since the last call, one list per eviction unit, in eviction order."""


# methods a PrefixCacheTarget may offer: evict(size) when eviction_trigger == "evict"; reset() when
# reset != "none"; check_integrity() (raise on a broken invariant); cached_pages() -> {PageKey: first
# slot} (introspection: the whole content, compared with the spec's after every step); page_stamps()
# -> {PageKey: comparable} (the target's clock, when clock != "none"); take_events() -> the KV events
# emitted since the last call, as spec.events' (spec.events.from_block_events converts vLLM-style ones),
# replayed by the machine after every step: the replay must give exactly the cached pages
OPTIONAL_CACHE_METHODS = ("evict", "reset", "check_integrity", "cached_pages", "page_stamps", "take_events")


@runtime_checkable
class CacheManagerTarget(Protocol):
    """A CacheManager seen through lists and ints; requests are whatever ``new_req`` returns."""

    profile: Profile
    page_size: int
    num_pages: int

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> Any:
        """A request of ``prompt`` using page-table row ``table_idx`` (not admitted yet)."""

    def match_req(self, req: Any) -> Any:
        """Match the request's prompt but its last token: a handle."""

    def lock(self, handle: Any) -> None: ...
    def unlock(self, handle: Any) -> None: ...
    def cached_len(self, handle: Any) -> int: ...

    def get_matched_indices(self, handle: Any) -> list[int]:
        """Slots of a handle's path."""

    def available_size(self) -> int:
        """Tokens an allocation may use now (free pages plus evictable cache)."""

    def admit(self, req: Any, handle: Any) -> None:
        """Give the request its locked handle and write the matched slots into its row."""

    def set_lengths(self, req: Any, cached_len: int, device_len: int) -> None: ...
    def append_token(self, req: Any, token: int) -> None: ...
    def allocate_paged(self, reqs: Sequence[Any]) -> None: ...
    def cache_req(self, req: Any, finished: bool) -> None: ...
    def lazy_free_region(self) -> AbstractContextManager[None]: ...

    def row(self, req: Any) -> list[int]:
        """The request's page-table row up to its allocated length."""

    def handle_of(self, req: Any) -> Any:
        """The request's current cache handle."""

    def free_pages(self) -> list[int]:
        """Page starts on the free list (lazily freed ones included)."""

    def cached_slots(self) -> list[int]:
        """First slot of every cached page."""

    def size_info(self) -> tuple[int, int]:
        """(evictable tokens, protected tokens) of its prefix cache."""


@dataclass(frozen=True)
class TargetInfo:
    """How to make a target, and what it needs: one entry of ``python -m fuzz --list-targets``."""

    # the name --target takes
    name: str
    # one line for the listing
    description: str
    # packages that must be installed (found, not imported: their __init__ may not import here), with how to get them
    requires: tuple[tuple[str, str], ...] = ()
    # makes the prefix cache: factory(page_size, num_pages) -> PrefixCacheTarget (the caller's slots, or the
    # target's own pages, lie below num_pages * page_size); None when the target has no prefix cache
    cache_factory: Callable[[int, int], PrefixCacheTarget] | None = None
    # makes the manager: factory(num_pages, page_size, rows, max_seq_len) -> CacheManagerTarget
    manager_factory: Callable[[int, int, int, int], CacheManagerTarget] | None = None
    # the profile both factories' targets declare (for the listing before anything is built)
    profile: Profile = EXACT
    # extra words for the listing (e.g. how to install it)
    how: str = ""
    # page sizes this target accepts (None: any)
    page_sizes: tuple[int, ...] | None = None
    # imports the target's modules (with their shims) to prove it works here; raises ImportError otherwise
    probe: Callable[[], Any] | None = field(default=None, compare=False)
