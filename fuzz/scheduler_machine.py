"""Differential state machine for schedulers: reference vs optimized, under a small pool, with aborts.

Requests are built from a few shared system prompts and few-shot blocks
plus random suffixes, in random namespaces, with random max_tokens and
ignore_eos; aborts hit waiting, chunked, running, in-flight and finished
requests; steps run in normal or overlap mode. After every step both
schedulers agree on the batch (uids, phase, chunk sizes), the tokens, the
page-table rows, available_size and the abstract cache; check_integrity
holds on each; the HashModels found no corrupted KV (they raise). At the
end every request finished or was aborted, every page is free or
evictable, and the outputs equal a run with no sharing and an unbounded pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixspec import optimized, reference
from radixspec.optimized.model import HashModel as OptimizedHashModel
from radixspec.reference.model import HashModel as ReferenceHashModel
from radixspec.spec import scheduler as laws
from radixspec.spec.domains import Namespace
from radixspec.spec.requests import SchedulerConfig

from .differential import Outcomes, apply_all, describe_difference
from .sequences import bad_namespaces, build_sequence, namespaces, page_sizes
from .stats import STATS

EOS = 0
# when an abort arrives
ABORT_TIMINGS = (
    "waiting",
    "chunked",
    "running",
    "in the in-flight batch",
    "finished by the in-flight batch",
    "already ended",
)
EOS_PER_MILLE = 150
VOCAB_SIZE = 1000  # the HashModels' default
MAX_STEPS_TO_DRAIN = 3000

# shared parts of prompts: (pages as pattern choices) per system prompt and few-shot block
SYSTEMS = ((), (0, 1), (3, 3, 5))
SHOTS = ((), (2,), (7, 4))


# a scheduler of ours (the twins share their API)
Scheduler = reference.Scheduler | optimized.Scheduler


def make_scheduler(impl: str, config: SchedulerConfig) -> Scheduler:
    """A scheduler of implementation ``impl`` with its HashModel."""
    if impl == "reference":
        return reference.Scheduler(config, ReferenceHashModel(eos_token_id=EOS, eos_per_mille=EOS_PER_MILLE))
    model = OptimizedHashModel(config.num_pages, config.page_size, eos_token_id=EOS, eos_per_mille=EOS_PER_MILLE)
    return optimized.Scheduler(config, model)


def view_of(scheduler: Scheduler) -> laws.SchedulerView:
    """What the scheduler laws read of a scheduler (either implementation) before a step."""
    waiting = []
    for pending in scheduler.prefill_manager.pending_list:
        chunk = pending.chunked_req
        waiting.append(
            laws.WaitingView(
                uid=pending.uid,
                prompt=tuple(pending.input_ids),
                max_tokens=pending.sampling_params.max_tokens,
                namespace=pending.namespace,
                chunked=chunk is not None,
                cached_len=chunk.cached_len if chunk is not None else 0,
                alloc_len=chunk.alloc_len if chunk is not None else 0,
            )
        )
    running = [
        laws.RunningView(req.uid, req.max_device_len, req.alloc_len)
        for req in scheduler.decode_manager.running_reqs.values()
    ]
    manager = scheduler.cache_manager
    return laws.SchedulerView(
        waiting=tuple(waiting),
        running=tuple(running),
        available=int(manager.available_size),
        free_rows=scheduler.table_manager.available_size,
        cache=manager.prefix_cache.abstract_state(),
        cache_type=scheduler.config.cache_type,
    )


def row_of(scheduler: Scheduler, uid: int) -> list[int]:
    """The page-table row of live request ``uid`` up to its allocated length, as a list."""
    req = scheduler.live[uid]
    row = scheduler.page_table[req.table_idx]
    return list(row[: req.alloc_len]) if isinstance(row, list) else row[: req.alloc_len].tolist()


class SchedulerMachine(RuleBasedStateMachine):
    """Reference and optimized schedulers driven by the same requests, aborts and steps."""

    IMPLS: ClassVar[tuple[str, ...]] = ("reference", "optimized")

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.schedulers: list[Scheduler] = []
        self.requests: dict[int, tuple[list[int], int, bool, Namespace]] = {}
        self.next_uid = 0
        self.evicted_seen = 0
        self.config = SchedulerConfig()

    @initialize(
        page_size=page_sizes,
        num_pages=st.integers(4, 24),
        rows=st.integers(1, 5),
        budget_pages=st.integers(1, 6),
        overlap=st.booleans(),
    )
    def setup(self, page_size: int, num_pages: int, rows: int, budget_pages: int, overlap: bool) -> None:
        self.config = SchedulerConfig(
            page_size=page_size,
            num_pages=num_pages,
            max_running_reqs=rows,
            max_seq_len=12 * page_size,
            max_extend_tokens=budget_pages * page_size - (1 if page_size > 1 else 0) + 1,
            overlap=overlap,
            eos_token_id=EOS,
        )
        impls = ("reference", *[name for name in self.IMPLS if name != "reference"])
        self.schedulers = [make_scheduler(name, self.config) for name in impls]
        self.names = impls

    # ------------------------------------------------------------ rules

    @rule(
        system=st.integers(0, len(SYSTEMS) - 1),
        shots=st.integers(0, len(SHOTS) - 1),
        suffix_pages=st.lists(st.integers(0, 7), max_size=2),
        tail=st.lists(st.integers(1, 3), max_size=4),
        namespace=namespaces,
        max_tokens=st.integers(1, 8),
        ignore_eos=st.booleans(),
    )
    def add_request(
        self,
        system: int,
        shots: int,
        suffix_pages: list[int],
        tail: list[int],
        namespace: Namespace,
        max_tokens: int,
        ignore_eos: bool,
    ) -> None:
        """A request of a shared system prompt, a few-shot block and its own suffix."""
        STATS.record_rule("scheduler.add_request")
        pages = [*SYSTEMS[system], *SHOTS[shots], *suffix_pages]
        self.submit(build_sequence(self.config.page_size, pages, tail) or [1], namespace, max_tokens, ignore_eos)

    @precondition(lambda self: bool(self.requests))
    @rule(
        pick=st.integers(0, 1 << 16),
        keep=st.integers(0, 1 << 16),
        suffix_pages=st.lists(st.integers(0, 7), max_size=2),
        max_tokens=st.integers(1, 8),
    )
    def add_follow_up(self, pick: int, keep: int, suffix_pages: list[int], max_tokens: int) -> None:
        """A request that continues part of an earlier one (a multi-turn chat): long shared prefixes."""
        STATS.record_rule("scheduler.add_follow_up")
        uid = sorted(self.requests)[pick % len(self.requests)]
        prompt, _, ignore_eos, namespace = self.requests[uid]
        base = prompt + self.schedulers[0].outputs[uid]
        base = base[: keep % (len(base) + 1)]
        self.submit(
            build_sequence(self.config.page_size, suffix_pages, [1], base) or [1], namespace, max_tokens, ignore_eos
        )

    def submit(self, prompt: list[int], namespace: Namespace, max_tokens: int, ignore_eos: bool) -> None:
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        outcome = self.on_all("add_request", lambda s: s.add_request(uid, prompt, max_tokens, ignore_eos, namespace))
        if outcome.ok:
            self.requests[uid] = (prompt, outcome.results[0], ignore_eos, namespace)

    @rule(
        bad=st.sampled_from(["empty prompt", "duplicate uid", "too long", "never fits", "max_tokens 0", "namespace"]),
        namespace=bad_namespaces,
    )
    def add_bad_request(self, bad: str, namespace: Any) -> None:
        STATS.record_rule(f"scheduler.add_bad_request[{bad}]")
        p = self.config.page_size
        uid, prompt, max_tokens = self.next_uid, [1, 2, 3], 1
        if bad != "namespace":
            namespace = None
        if bad == "empty prompt":
            prompt = []
        elif bad == "duplicate uid":
            uid = max(self.requests, default=-1)
        elif bad == "too long":
            prompt = [1] * self.config.max_seq_len
        elif bad == "never fits":
            prompt, max_tokens = [1] * (self.config.max_seq_len - 1), 1
            if (self.config.max_seq_len - 1 + p - 1) // p <= self.config.num_pages:
                return  # the pool is large enough for any request
        elif bad == "max_tokens 0":
            max_tokens = 0
        if uid < 0:
            return
        outcome = self.on_all(
            f"add_request[{bad}]", lambda s: s.add_request(uid, prompt, max_tokens, namespace=namespace)
        )
        assert not outcome.ok, f"{bad}: accepted"

    @precondition(lambda self: bool(self.requests))
    @rule(which=st.integers(0, len(ABORT_TIMINGS) - 1), pick=st.integers(0, 1 << 16))
    def abort(self, which: int, pick: int) -> None:
        """Abort a request at one of the moments of its life that exist now (mini-sglang #111 hid in these)."""
        moments = [(timing, uids) for timing in ABORT_TIMINGS if (uids := self.abort_candidates(timing))]
        if not moments:
            return
        timing, candidates = moments[which % len(moments)]
        uid = candidates[pick % len(candidates)]
        STATS.record_rule(f"scheduler.abort[{timing}]")
        self.on_all("abort", lambda s: s.abort(uid))

    @precondition(lambda self: bool(self.requests))
    @rule(which=st.integers(0, len(ABORT_TIMINGS) - 1), pick=st.integers(0, 1 << 16))
    def step_then_abort(self, which: int, pick: int) -> None:
        """A step, then at once an abort of a request in the batch it left in flight (overlap) or any other.

        The in-flight moments exist only right after a step; this rule makes them common.
        """
        STATS.record_rule("scheduler.step_then_abort")
        self.step_all()
        in_flight = [timing for timing in ABORT_TIMINGS[3:5] if self.abort_candidates(timing)]
        if in_flight:
            timing = in_flight[which % len(in_flight)]
            uids = self.abort_candidates(timing)
            uid = uids[pick % len(uids)]
            STATS.record_rule(f"scheduler.abort[{timing}]")
            self.on_all("abort", lambda s: s.abort(uid))
        else:
            self.abort(which, pick)

    def abort_candidates(self, timing: str) -> list[int]:
        """Requests at ``timing`` of their life, as the first scheduler sees them."""
        first = self.schedulers[0]
        status = first.status
        in_flight = [req for req in first.last_data[0].reqs] if first.last_data is not None else []
        if timing == "waiting":
            return [uid for uid in sorted(self.requests) if status[uid] == "waiting"]
        if timing == "running":
            return [uid for uid in sorted(self.requests) if status[uid] == "running"]
        if timing == "in the in-flight batch":
            return [req.uid for req in in_flight if status[req.uid] == "running"]
        if timing == "finished by the in-flight batch":
            # its last token comes with the batch in flight: the batch frees it, the abort must not again
            return [
                req.uid
                for req in in_flight
                if status[req.uid] == "running" and first.sampled[req.uid] + 1 >= req.sampling_params.max_tokens
            ]
        if timing == "chunked":
            return [r.uid for r in first.prefill_manager.pending_list if r.chunked_req is not None]
        # finished, aborted, or already freed: nothing may happen
        return [uid for uid in sorted(self.requests) if status[uid] in ("finished", "aborted")]

    @rule()
    def step(self) -> None:
        STATS.record_rule("scheduler.step")
        self.step_all()

    @rule(times=st.integers(2, 6))
    def steps(self, times: int) -> None:
        STATS.record_rule("scheduler.steps")
        for _ in range(times):
            self.step_all()

    # ------------------------------------------------------------ checks

    def on_all(self, label: str, call: Callable[[Scheduler], object]) -> Outcomes:
        """Apply ``call`` to every scheduler; the judge demands the same value or the same refusal in the same
        words, and a refused call leaves each scheduler's requests and queue as they were."""
        return apply_all(
            label,
            self.schedulers,
            lambda scheduler, i: call(scheduler),
            snapshot=lambda s: (dict(s.status), [r.uid for r in s.prefill_manager.pending_list]),
            names=self.names,
        )

    def step_all(self) -> None:
        views = [view_of(scheduler) for scheduler in self.schedulers]
        reports = [scheduler.step() for scheduler in self.schedulers]
        # the independent oracle: each scheduler's batch is the one the admission law gives
        for view, report in zip(views, reports, strict=True):
            laws.check_step(self.config, view, report)
        for name, report in zip(self.names[1:], reports[1:], strict=True):
            assert report == reports[0], f"step: reference {reports[0]} but {name} {report}"
        if reports[0].phase:
            STATS.rules[f"scheduler.batch[{reports[0].phase}]"] += 1
        evicted = self.schedulers[0].cache_manager.evicted_pages
        STATS.evicted_pages += evicted - self.evicted_seen
        self.evicted_seen = evicted

    @invariant()
    def schedulers_agree(self) -> None:
        if not self.schedulers:
            return
        first = self.schedulers[0]
        expected_cache = first.cache_manager.prefix_cache.abstract_state()
        STATS.record_tree(len(expected_cache.entries))
        for name, scheduler in zip(self.names, self.schedulers, strict=True):
            scheduler.check_integrity()
            if scheduler is first:
                continue
            assert scheduler.status == first.status, f"status: reference {first.status}, {name} {scheduler.status}"
            assert scheduler.outputs == first.outputs, f"outputs differ between reference and {name}"
            assert scheduler.cache_manager.available_size == first.cache_manager.available_size
            actual = scheduler.cache_manager.prefix_cache.abstract_state()
            assert actual == expected_cache, f"cache of {name}:\n{describe_difference(expected_cache, actual)}"
            assert sorted(scheduler.live) == sorted(first.live)
            for uid in first.live:
                assert row_of(scheduler, uid) == row_of(first, uid), f"row of request {uid} differs in {name}"

    def teardown(self) -> None:
        """Drain; then every request ended, no page leaked, outputs equal a run without sharing."""
        if not self.schedulers:
            return
        for _ in range(MAX_STEPS_TO_DRAIN):
            if all(scheduler.idle for scheduler in self.schedulers):
                break
            self.step_all()
        self.schedulers_agree()
        for scheduler in self.schedulers:
            assert scheduler.idle, f"not idle after {MAX_STEPS_TO_DRAIN} steps: a request starves"
            assert set(scheduler.status.values()) <= {"finished", "aborted"}, scheduler.status
            cache = scheduler.cache_manager
            assert cache.prefix_cache.size_info.protected_size == 0, "a lock outlived every request"
            free = len(cache.free_slots)
            cached = len(cache.prefix_cache.abstract_state().entries)
            assert free + cached == self.config.num_pages, f"{free} free + {cached} cached != {self.config.num_pages}"
        self.compare_with_unshared_run()

    def compare_with_unshared_run(self) -> None:
        """Outputs obey the generation law; they equal runs with no sharing and with an unbounded pool."""
        if not self.requests:
            return
        for scheduler in self.schedulers:
            for uid, (prompt, max_tokens, ignore_eos, namespace) in self.requests.items():
                expected = laws.expected_output(
                    prompt, namespace, max_tokens, ignore_eos, EOS, VOCAB_SIZE, EOS_PER_MILLE
                )
                laws.check_output(expected, scheduler.outputs[uid], scheduler.status[uid] == "finished", uid)
        for cache_type in ("naive", "radix"):
            baseline = self.unbounded_run(cache_type)
            first = self.schedulers[0]
            for uid in self.requests:
                got, want = first.outputs[uid], baseline.outputs[uid]
                if first.status[uid] == "finished":
                    assert got == want, f"request {uid}: {got} here, {want} with an unbounded {cache_type} cache"
                else:
                    assert got == want[: len(got)], f"aborted request {uid}: {got} is not a prefix of {want}"

    def unbounded_run(self, cache_type: str) -> Scheduler:
        """Every request of this example, run to completion with room for all of them at once."""
        total_pages = sum(len(prompt) + n for prompt, n, _, _ in self.requests.values())
        config = SchedulerConfig(
            page_size=self.config.page_size,
            num_pages=total_pages,
            max_running_reqs=len(self.requests),
            max_seq_len=self.config.max_seq_len,
            max_extend_tokens=self.config.max_seq_len * len(self.requests),
            cache_type=cache_type,
            eos_token_id=EOS,
        )
        baseline = make_scheduler("reference", config)
        for uid, (prompt, max_tokens, ignore_eos, namespace) in self.requests.items():
            baseline.add_request(uid, prompt, max_tokens, ignore_eos, namespace)
        baseline.run_until_idle(MAX_STEPS_TO_DRAIN)
        return baseline
