"""The hybrid machine's rules for a tiered target (HiCache's): the machine as the executor of its transfers.

A tiered request-lifecycle target copies KV between tiers on streams the machine runs
(``fuzz/targets/streams.py``). ``machine_for`` picks this machine for a target whose ``TargetInfo.executes``: its
streams run further, in order; a request is served whole in one step, so that prefixes are cached and, asked
again, found on one tier or another; the cache is flushed while no request runs. What each copy moves follows in
the KV shadow (``copied``).
"""

from __future__ import annotations

from typing import Protocol, cast

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from radixspec.spec.domains import Namespace

from .hybrid_machine import HybridMachine
from .sequences import NAMESPACE_PALETTE
from .stats import STATS


class Executes(Protocol):
    """A tiered target the machine is the executor of: its transfer streams, run ``count`` more operations at a
    time, and its cache flushed while no request runs."""

    executes: bool

    def execute(self, lane: int, count: int) -> None: ...

    def flush(self) -> None: ...


class TieredHybridMachine(HybridMachine):
    """The hybrid machine with the executor's rules, for a target whose ``TargetInfo.executes`` (``machine_for``
    picks it; the other targets' and ours keep the hybrid machine's draws)."""

    @rule(tokens=HybridMachine.seqs, namespace=st.sampled_from(NAMESPACE_PALETTE[:2]))
    def serve(self, tokens: tuple[int, ...], namespace: Namespace) -> None:
        """A request served whole in one step: matched, computed and finished, so that it is cached and its
        prefix, asked again later, is found on one tier or another."""
        STATS.record_rule("hybrid.serve")
        uid = self.next_uid
        self.new_request(tokens, [], namespace)
        if uid not in self.reqs:
            return
        self.allocate_and_store(sorted(self.reqs).index(uid), len(self.reqs[uid][0].input_ids))
        self.cache_req(sorted(self.reqs).index(uid), True)

    @precondition(lambda self: not self.reqs)
    @rule(wait=st.integers(0, 15))
    def flush(self, wait: int) -> None:
        """The cache flushed while no request runs (the scheduler's ``flush_cache``), about one idle step in
        sixteen (a flush empties every tier: the campaign's caches would stay small). Shrinking draws 0: no flush."""
        if wait != 9 or not self.managers:
            return
        STATS.record_rule("hybrid.flush")
        cast(Executes, self.managers[0]).flush()
        self.copied()

    @rule(lane=st.integers(0, 1), count=st.integers(1, 6))
    def execute(self, lane: int, count: int) -> None:
        """One of the target's streams runs ``count`` more operations, in order; what they copy moves in the KV
        shadow."""
        if not self.managers:
            return
        STATS.record_rule(f"hybrid.execute[stream {lane}]")
        cast(Executes, self.managers[0]).execute(lane, count)
        self.copied()
