"""The hybrid machine's rules for a tiered target (HiCache's): the machine as the executor of its transfers.

A tiered request-lifecycle target copies KV between tiers on streams the machine runs
(``fuzz/targets/streams.py``). ``machine_for`` picks this machine for a target whose ``TargetInfo.executes``: its
streams run further, in order; a request is served whole in one step, so that prefixes are cached and, asked
again, found on one tier or another; the cache is flushed while no request runs. What each copy moves follows in
the KV shadow (``copied``).
"""

from __future__ import annotations

import sys
from typing import Protocol, cast

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from radixspec.spec.domains import Namespace

from .hybrid_machine import BURST_RULE, HybridMachine
from .sequences import NAMESPACE_PALETTE
from .stats import STATS


class Executes(Protocol):
    """A tiered target the machine is the executor of: its transfer streams, run ``count`` more operations at a
    time, and its cache flushed while no request runs."""

    executes: bool

    def execute(self, lane: int, count: int) -> None: ...

    def flush(self) -> None: ...

    def drain(self) -> None: ...

    def evict_tiers(self, tiers: int) -> None: ...


# refused requests the machine keeps to try again (the newest)
REFUSED_KEPT = 8


class TieredHybridMachine(HybridMachine):
    """The hybrid machine with the executor's rules, for a target whose ``TargetInfo.executes`` (``machine_for``
    picks it; the other targets' and ours keep the hybrid machine's draws)."""

    def serve_burst(self, kind: str, pick: int, count: int, pages: int) -> None:
        """Not a rule here (a plain method: a program that names it still runs): with bursts drawn, planted storage
        and state bugs of ``sglang-hicache`` went uncaught within 400 examples; its own ``serve`` warms its tiers."""
        HybridMachine.serve_burst(self, kind, pick, count, pages)

    @rule(tokens=HybridMachine.seqs, namespace=st.sampled_from(NAMESPACE_PALETTE[:2]))
    def serve(self, tokens: tuple[int, ...], namespace: Namespace) -> None:
        """A request served whole in one step: matched, computed and finished, so that it is cached and its
        prefix, asked again later, is found on one tier or another."""
        STATS.record_rule("hybrid.serve")
        uid = self.next_uid
        self.new_request(tokens, [], namespace)
        self.run_whole(uid)

    def __init__(self) -> None:
        super().__init__()
        # requests not admitted (the scheduler's waiting queue), by uid, with their prompt and namespace: the newest
        # few, which ``readmit`` tries again
        self.refused: dict[int, tuple[list[int], Namespace]] = {}

    def submit(self, uid: int, prompt: list[int], namespace: Namespace, workload: bool = False) -> None:
        super().submit(uid, prompt, namespace, workload)
        if uid not in self.reqs and self.managers:
            self.refused[uid] = (prompt, namespace)
            while len(self.refused) > REFUSED_KEPT:
                del self.refused[min(self.refused)]

    @precondition(lambda self: self.refused)
    @rule(which=st.integers(0, 7))
    def readmit(self, which: int) -> None:
        """A request not admitted, tried again some steps later (the scheduler's next pass over its waiting queue):
        one waiting on its prefetch from storage is admitted with what came in by then; then it runs whole."""
        uid = sorted(self.refused)[which % len(self.refused)]
        prompt, namespace = self.refused.pop(uid)
        STATS.record_rule("hybrid.readmit")
        self.submit(uid, prompt, namespace)
        self.run_whole(uid)

    def run_whole(self, uid: int) -> None:
        """An admitted request computed whole and finished (nothing if it was not admitted, or aborted on the way)."""
        if uid in self.reqs:
            self.allocate_and_store(sorted(self.reqs).index(uid), len(self.reqs[uid][0].input_ids))
        if uid in self.reqs:
            self.cache_req(sorted(self.reqs).index(uid), True)

    @rule(
        base=HybridMachine.seqs,
        cuts=st.lists(st.integers(0, 255), min_size=1, max_size=3),
        namespace=st.sampled_from(NAMESPACE_PALETTE[:2]),
        evict=st.integers(0, 2),
    )
    def admit_batch(self, base: tuple[int, ...], cuts: list[int], namespace: Namespace, evict: int) -> None:
        """Requests that share a prefix (a system prompt, a few-shot template) admitted in one scheduling step: the
        whole prompt matched first, then prefixes of it, while the loads the earlier matches started are still in
        flight, so a later match splits a node an earlier load pins (on both tiers); then the batch runs, each request
        computed and finished. With ``evict``, the device tier
        is evicted first (pressure from the previous batch): what was backed up is then found on the host."""
        STATS.record_rule(f"hybrid.admit_batch[{('as it stands', 'device evicted', 'device and host evicted')[evict]}]")
        if evict and self.managers:
            cast(Executes, self.managers[0]).evict_tiers(evict)
            self.copied()
        first = self.next_uid
        self.new_request(base, [], namespace)
        for cut in cuts:
            # the laws hold between one match and the next (a load started by the last may be in flight)
            self.managers_keep_the_laws()
            self.new_request(base[: cut % (len(base) + 1)], [], namespace)
        # then the batch runs: each request computed and finished
        for uid in range(first, self.next_uid):
            self.run_whole(uid)

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

    @rule(lane=st.integers(0, 2), count=st.integers(1, 6))
    def execute(self, lane: int, count: int) -> None:
        """One of the target's streams runs ``count`` more operations, in order; what they copy moves in the KV
        shadow."""
        if not self.managers:
            return
        STATS.record_rule(f"hybrid.execute[stream {lane}]")
        cast(Executes, self.managers[0]).execute(lane, count)
        self.copied()

    def teardown(self) -> None:
        """Every request finishes (the hybrid machine's teardown); then the idle cache is drained: every transfer
        run and acknowledged, every tier evicted whole, and nothing may stay (a lock left on a tier shows)."""
        super().teardown()
        if sys.exc_info()[0] is not None:
            return
        for manager in self.managers:
            cast(Executes, manager).drain()
            manager.check_integrity([])
        for laws in self.laws:
            laws.check([])


class TieredProductionMachine(TieredHybridMachine):
    """The executor's machine in a production batch (``machine_for`` picks it): bursts drawn as the hybrid machine
    draws them, for warm tiers and big trees (with a production pool, of the pages engines run: the hybrid machine's
    ``PRODUCTION_PAGE_SIZES``). Only there: in the other batches bursts hid planted storage and state bugs of
    ``sglang-hicache`` within 400 examples."""

    @BURST_RULE
    def serve_burst(self, kind: str, pick: int, count: int, pages: int) -> None:
        HybridMachine.serve_burst(self, kind, pick, count, pages)
