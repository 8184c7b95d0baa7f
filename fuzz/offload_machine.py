"""The offload machine: a KV-offloading manager's host tier (``OffloadTarget``) beside the spec of
``spec/offload.py``, the machine playing both its scheduler and its executor.

As the scheduler, each request: ``begin`` with its page keys; every key looked up (the target's answer must be the
spec's); its hit (the ready keys from the first, none when a pending one comes first: the scheduler asks again
later) loaded, or not; the keys past the hit offered for store in one or two parts (as a request computes them);
then ``finish``, now or later. As the executor, the machine ends the jobs in flight in any order: a store completed
or failed, a load completed. Now and then a reset, whatever is in flight (the engine abandons its jobs).

Each target runs beside its own copy of the spec, which takes the target's choices (which chunks it evicts, which
slots the new chunks take) after checking that the rules allow them (``check_store_choice``). After every step:
the spec's laws on its state, the slot laws on the target's view, the target's chunks equal to the spec's (slots
and pins), the target's own accounting, and its events replayed: the keys published stored and not since removed
must be exactly the ready chunks (a reset clears them, as a consumer of the engine's cleared-cache event does).

The summary counts stores stored, refused and with nothing new, loads, jobs ended each way, resets with jobs in
flight, and the configurations drawn (``offload.config[...]``); the reach is the chunks held and the jobs in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixspec.spec import offload as of
from radixspec.spec.errors import IntegrityError
from radixspec.spec.prefix_cache import PageKey, compute_page_prefixes

from .stats import STATS
from .targets import resolve
from .targets.api import OffloadTarget, TargetInfo
from .tiered_machine import PAGE_SIZE, Prompt, prompts


@dataclass
class Run:
    """One target beside its own copy of the spec."""

    name: str
    target: OffloadTarget
    state: of.OffloadState
    # the keys its events published stored and not since removed
    published: set[PageKey] = field(default_factory=set)
    # each job in flight: the request it serves
    owner: dict[int, int] = field(default_factory=dict)

    @contextmanager
    def named(self) -> Iterator[None]:
        """A broken law raised within names the target."""
        try:
            yield
        except IntegrityError as error:
            raise IntegrityError(f"{self.name}: {error}") from error


class OffloadMachine(RuleBasedStateMachine):
    """The spec's offloading store beside each of ``IMPLS`` (targets with an offload layer)."""

    IMPLS: ClassVar[tuple[str | TargetInfo, ...]] = ()

    @initialize(
        # small tiers most often: offers must evict, and are refused
        capacity=st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(9, 32)),
        draw=st.integers(0, 2**16),
    )
    def configure(self, capacity: int, draw: int) -> None:
        STATS.examples += 1
        self.runs: list[Run] = []
        for chosen in self.IMPLS:
            info = chosen if isinstance(chosen, TargetInfo) else resolve(chosen)
            assert info.offload_factory is not None, f"target {info.name} has no offload layer"
            target = info.offload_factory(capacity, draw)
            STATS.rules[f"offload.config[{target.config}, capacity {'1-8' if capacity <= 8 else '9-32'}]"] += 1
            self.runs.append(Run(info.name, target, of.new_state(capacity, target.threshold, target.tracker_size)))
        self.next_request = 0
        # requests begun and not finished
        self.open: list[int] = []

    # ------------------------------------------------------------ the scheduler

    @rule(prompt=prompts, load=st.booleans(), whole=st.booleans(), split=st.integers(0, 3), finish=st.booleans())
    def request(self, prompt: Prompt, load: bool, whole: bool, split: int, finish: bool) -> None:
        """A request: its keys looked up, its hit loaded (``load``), the rest (``whole``: every key, as a
        request-level offloading policy offers them) offered in one part or two (``split``: where the first part
        ends), finished now or later."""
        STATS.record_rule("offload.request")
        request = self.next_request
        self.next_request += 1
        keys = [(prompt.namespace, prefix) for prefix in compute_page_prefixes(prompt.tokens, PAGE_SIZE)]
        for run in self.runs:
            with run.named():
                self.serve(run, request, keys, load, whole, split)
        if finish:
            self.finish_request(request)
        else:
            self.open.append(request)

    def serve(self, run: Run, request: int, keys: list[PageKey], load: bool, whole: bool, split: int) -> None:
        run.target.begin(request, keys)
        for key in keys:
            found, expected = run.target.lookup(request, key), of.lookup(run.state, key)
            if found != expected:
                raise IntegrityError(f"lookups_agree: {key!r} is {expected} in the spec, {found} in the target")
        hit = of.get_hit_run(run.state, keys)
        if hit is None:
            STATS.rules["offload.request[deferred: a pending chunk first]"] += 1
            return
        if hit and load:
            self.load(run, request, hit)
        rest = keys if whole else keys[len(hit) :]
        for part in (rest[:split], rest[split:]) if 0 < split < len(rest) else (rest,):
            self.store(run, request, part)

    def load(self, run: Run, request: int, hit: tuple[PageKey, ...]) -> None:
        job = of.prepare_load(run.state, hit)
        expected = of.get_load_slots(run.state, job)
        found = tuple(run.target.prepare_load(request, hit))
        if found != expected:
            raise IntegrityError(
                f"loads_read_their_chunks: a load of {len(hit)} chunks reads slots {found}, not {expected}"
            )
        run.owner[job] = request
        STATS.rules["offload.load"] += 1

    def store(self, run: Run, request: int, keys: list[PageKey]) -> None:
        of.record_offer(run.state, keys)
        plan = of.plan_store(run.state, keys)
        output = run.target.prepare_store(request, keys)
        if (plan is None) != (output is None):
            raise IntegrityError(
                f"store_refused_only_when_short: an offer of {len(keys)} keys ({len(run.state.free)} free slots, "
                f"{len(of.get_idle_keys(run.state, keep=set(keys)))} idle outside it) was "
                f"{'refused' if output is None else 'served'} by the target, "
                f"{'served' if plan else 'refused'} by the spec"
            )
        if plan is None or output is None:
            STATS.rules["offload.store[refused: no room]"] += 1
            return
        if output.new != plan.new:
            raise IntegrityError(
                f"store_takes_the_new_keys: stores {output.new!r}, the offer's new keys are {plan.new!r}"
            )
        job = of.prepare_store(run.state, keys, output.evicted, output.slots)
        STATS.rules[f"offload.store[{'stored' if job is not None else 'nothing new'}]"] += 1
        STATS.evicted_pages += len(output.evicted)
        if job is not None:
            run.owner[job] = request

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A request still running finishes (its jobs may still be in flight)."""
        STATS.record_rule("offload.finish")
        self.finish_request(self.open.pop(data.draw(st.integers(0, len(self.open) - 1))))

    def finish_request(self, request: int) -> None:
        for run in self.runs:
            run.target.finish(request)

    # ------------------------------------------------------------ the executor

    @precondition(lambda self: any(run.state.stores or run.state.loads for run in self.runs))
    @rule(index=st.integers(0, 2**16), ok=st.booleans())
    def end(self, index: int, ok: bool) -> None:
        """The executor ends any job in flight: a store completed (``ok``) or failed, a load completed."""
        STATS.record_rule("offload.end")
        for run in self.runs:
            jobs = sorted([*run.state.stores, *run.state.loads])
            if jobs:
                self.end_job(run, jobs[index % len(jobs)], ok)

    def end_job(self, run: Run, job: int, ok: bool) -> None:
        request = run.owner.pop(job)
        if job in run.state.stores:
            run.target.complete_store(request, run.state.stores[job].keys, ok)
            of.complete_store(run.state, job, ok)
            STATS.rules[f"offload.store[{'completed' if ok else 'failed'}]"] += 1
        else:
            run.target.complete_load(request, run.state.loads[job])
            of.complete_load(run.state, job)
            STATS.rules["offload.load[completed]"] += 1

    @rule(now=st.integers(0, 3))
    def drain(self, now: int) -> None:
        """Now and then (one draw in four), the executor completes every store in flight, oldest first."""
        STATS.record_rule("offload.drain")
        if now:
            return
        for run in self.runs:
            for job in sorted(run.state.stores):
                self.end_job(run, job, True)

    @rule(now=st.integers(0, 7))
    def reset(self, now: int) -> None:
        """Now and then (one draw in eight), a reset, whatever is in flight."""
        STATS.record_rule("offload.reset")
        if now:
            return
        for run in self.runs:
            busy = bool(run.state.stores or run.state.loads)
            STATS.rules[f"offload.reset[{'jobs in flight' if busy else 'idle'}]"] += 1
            run.target.reset()
            of.reset(run.state)
            run.owner.clear()
            run.published.clear()

    # ------------------------------------------------------------ after every step

    @invariant()
    def targets_keep_the_laws(self) -> None:
        for run in self.runs:
            with run.named():
                self.check(run)

    def check(self, run: Run) -> None:
        of.check_offload_invariants(run.state)
        STATS.record_reach(
            largest_host_pages=len(run.state.chunks),
            most_transfers_in_flight=len(run.state.stores) + len(run.state.loads),
        )
        found = run.target.view()
        of.check_view(found)
        counted = list(run.state.offers.items())
        if list(found.offers) != counted:
            raise IntegrityError(
                f"offer_counts_agree: the target counts {list(found.offers)[:4]}..., the spec {counted[:4]}..."
            )
        if found.chunks != run.state.chunks:
            differ = sorted(
                (
                    key
                    for key in {*found.chunks, *run.state.chunks}
                    if found.chunks.get(key) != run.state.chunks.get(key)
                ),
                key=repr,
            )
            raise IntegrityError(
                "states_agree: chunks differ at "
                + ", ".join(
                    f"{key!r} (spec {run.state.chunks.get(key)}, target {found.chunks.get(key)})" for key in differ[:3]
                )
            )
        run.target.check_integrity()
        events = run.target.take_events()
        STATS.events_replayed += len(events)
        for key, removed in events:
            if removed:
                run.published.discard(key)
            else:
                run.published.add(key)
        broken = of.published_are_the_ready_chunks(run.state, run.published)
        if broken is not None:
            raise IntegrityError(broken)
