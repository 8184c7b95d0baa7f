"""The manager machine's state, setup and checks (``fuzz/manager_machine.py`` adds the request lifecycles and
bad input): the spec's relations observed around every call, the accounting after every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeGuard

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, MultipleResults, RuleBasedStateMachine, initialize, invariant, multiple

from radixspec.spec import cache_manager as sm
from radixspec.spec import events as ev
from radixspec.spec.domains import Namespace, copied_fields
from radixspec.spec.invariants import (
    free_slots_are_aligned_and_unique,
    pages_are_partitioned,
    private_rows_are_page_runs,
    raise_first,
    rows_match_handles,
)

from ..differential import describe_difference
from ..sequences import build_sequence, page_choices, page_sizes, tail_choices
from ..stats import STATS
from ..targets.api import CacheManagerTarget, ExactManager, TargetInfo
from ..targets.ours import IMPLEMENTATIONS

# a manager target, its requests and handles its own
Target = CacheManagerTarget[Any, Any]
# a target with the differential capability
Exact = ExactManager[Any, Any]
# uid -> one request per target
ReqsByUid = dict[int, list[Any]]
# per exact target (its index): its abstract state and its views of the requests observed
Observed = dict[int, tuple[sm.ManagerState, dict[int, sm.RequestView]]]

ROWS = 6
# how a batch's results or an abort run: outside a lazy free region, inside one, or inside one whose body then
# raises (an engine's forward that fails after freeing: the region must still hand back every page it held)
REGIONS = ("none", "lazy", "lazy, body raises")
MAX_PAGES_PER_REQ = 12


class BodyRaised(Exception):
    """Raised by the machine inside a lazy free region, after the frees: what a failing forward does."""


# per class, whether its instances have the differential capability: the exhaustive checker builds a machine per
# transition, and a runtime-checkable Protocol's isinstance reads every member of the Protocol (its members are
# methods, so the answer is the class's)
EXACT_CLASSES: dict[type, bool] = {}


def is_exact(impl: object) -> TypeGuard[Exact]:
    """Whether ``impl`` offers the differential capability (``ExactManager``), answered once per class."""
    cls = type(impl)
    if cls not in EXACT_CLASSES:
        EXACT_CLASSES[cls] = isinstance(impl, ExactManager)
    return EXACT_CLASSES[cls]


@dataclass
class LiveReq:
    """A request the machine has admitted: one Req object per implementation."""

    uid: int
    prompt_len: int
    max_new_tokens: int
    reqs: list[Any]
    # the Req the machine keeps in step with the others, to read lengths from
    cached_len: int = 0
    generated: int = 0
    tokens: list[int] = field(default_factory=list)

    @property
    def in_prefill(self) -> bool:
        """True until the whole prompt's KV is computed."""
        return self.cached_len < self.prompt_len


# the bundle of prompts the rules draw from and add to (module level: the rules of the machine name it)
prompts = Bundle("prompts")


class ManagerBase(RuleBasedStateMachine):
    """The state, the setup, the relations observed around a call and the checks after every step."""

    # what the machine drives (radixspec.fuzz.machines.machine_for sets these): --impl and --target name them alike
    TARGETS: ClassVar[tuple[TargetInfo, ...]] = tuple(IMPLEMENTATIONS.values())
    LRU: ClassVar[str] = "strict"
    prompts = prompts
    # the spec's relations are checked around every call on exact targets, and calls made only to see them
    # refused (a nested lazy free region, a second release) are made; the exhaustive checker turns both off
    # while it replays a path it checked when it found it
    relations = True
    # the fields Hypothesis's RuleBasedStateMachine sets (its rules, bundles, printer): a deep copy shares them
    RUNNER_FIELDS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        super().__init__()
        if not ManagerBase.RUNNER_FIELDS:
            ManagerBase.RUNNER_FIELDS = frozenset(vars(self))
        STATS.examples += 1
        self.impls: list[Target] = []
        # the targets with the differential capability (their indices in impls), each resolved once at setup: a
        # runtime-checkable Protocol's isinstance reads every member, far too slow for every step
        self.exact: list[int] = []
        self.exact_impls: dict[int, Exact] = {}
        self.live: list[LiveReq] = []
        self.page_size = 1
        # each target's KV events, replayed as a router would (spec/events.py)
        self.replayers: dict[int, ev.Replayer] = {}
        self.next_uid = 0
        # the namespace each prompt was last admitted in
        self.namespace_of: dict[tuple[int, ...], Namespace] = {}

    def __deepcopy__(self, memo: dict[int, object]) -> ManagerBase:
        """The machine in the same state, independent (the exhaustive checker's snapshot of a state, taken once
        instead of replaying its path for every transition): its targets, requests and replayers copied deep;
        Hypothesis's own fields shared (the exhaustive checker calls the rules directly, never its runner)."""
        return copied_fields(self, memo, shared=self.RUNNER_FIELDS)

    @property
    def validates(self) -> bool:
        """Whether every target rejects bad input (else bad input is not sent: a profile's errors == "none")."""
        return bool(self.impls) and all(impl.profile.errors != "none" for impl in self.impls)

    def ns(self, namespace: Namespace) -> Namespace:
        """The namespace requests use: as drawn, or None when a target has no namespaces."""
        return namespace if all(impl.profile.namespaces for impl in self.impls) else None

    @property
    def first(self) -> Target:
        """The target the lifecycle reads lengths from (all agree)."""
        return self.impls[0]

    def name(self, index: int) -> str:
        return self.TARGETS[index].name

    def observe(self, reqs: ReqsByUid) -> Observed | None:
        """Each exact target's state and its views of ``reqs`` (uid -> one Req per target), by target index."""
        if not self.relations or not self.exact:
            return None
        out = {}
        for index in self.exact:
            impl = self.exact_target(index)
            state = impl.abstract_state()
            out[index] = (state, {uid: impl.view(state, per_impl[index]) for uid, per_impl in reqs.items()})
        return out

    def observe_apart(self, mine: ReqsByUid, others: ReqsByUid) -> tuple[Observed | None, Observed | None]:
        """``observe(mine)`` and ``observe(others)`` (disjoint requests) from one abstract state per target."""
        both = self.observe({**mine, **others})
        if both is None:
            return None, None

        def part(uids: ReqsByUid) -> Observed:
            return {index: (state, {uid: views[uid] for uid in uids}) for index, (state, views) in both.items()}

        return part(mine), part(others)

    def live_reqs(self, but: list[LiveReq] | None = None) -> ReqsByUid:
        """uid -> the live request's Req per implementation (all of them, or those not in ``but``)."""
        skip = {live.uid for live in but or ()}
        return {live.uid: live.reqs for live in self.live if live.uid not in skip}

    @initialize(
        target=prompts,
        page_size=page_sizes,
        num_pages=st.integers(2, 24),
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
    )
    def setup(
        self, page_size: int, num_pages: int, first: list[tuple[list[int], list[int]]]
    ) -> MultipleResults[tuple[int, ...]]:
        for info in self.TARGETS:
            if info.page_sizes is not None:
                page_size = info.page_sizes[page_size % len(info.page_sizes)]
        self.page_size = page_size
        args = (num_pages, page_size, ROWS, MAX_PAGES_PER_REQ * page_size)
        for info in self.TARGETS:
            assert info.manager_factory is not None, f"target {info.name} has no cache manager"
            self.impls.append(info.manager_factory(*args))
        self.exact_impls = {index: impl for index, impl in enumerate(self.impls) if is_exact(impl)}
        self.exact = list(self.exact_impls)
        return multiple(*[tuple(build_sequence(page_size, pages, tail)) for pages, tail in first])

    def cached_page_count(self) -> int:
        """Pages the prefix cache holds now (to count evictions)."""
        if self.exact and self.exact[0] == 0:
            return int(self.exact_target(0).cached_page_count())
        return len(self.first.cached_slots())

    def snapshot(self, impl: Target) -> tuple[object, ...]:
        """What a rejected call must leave unchanged: an exact target's abstract state and the live requests'
        fields; another's free list, cached pages, sizes and live rows.

        Nothing while checks are off (the exhaustive checker replaying a path it already checked).
        """
        if not self.relations:
            return ()
        index = self.impls.index(impl)
        if index in self.exact:
            return self.exact_snapshot(index, self.exact_target(index).abstract_state())
        rows = [tuple(impl.row(live.reqs[index])) for live in self.live]
        return (tuple(impl.free_pages()), tuple(sorted(impl.cached_slots())), tuple(impl.size_info()), rows)

    def exact_snapshot(self, index: int, state: sm.ManagerState) -> tuple[object, ...]:
        """``snapshot`` of exact target ``index`` whose abstract state is ``state``."""
        reqs = [(r.cached_len, r.device_len, r.alloc_len) for r in (live.reqs[index] for live in self.live)]
        return (state, reqs)

    def known(self, observed: Observed | None) -> dict[int, tuple[object, ...]]:
        """The snapshots of the exact targets from the states ``observe`` just read (for ``apply_all(known=)``:
        the call that follows starts from them, nothing to read twice)."""
        if observed is None:
            return {}
        return {index: self.exact_snapshot(index, state) for index, (state, _) in observed.items()}

    @invariant()
    def targets_agree(self) -> None:
        """Every target's page accounting; an exact target's integrity, events, available_size law; all agree.

        An exact target's accounting is its ``check_integrity``: the spec's manager invariants over its abstract
        state (the free list, the private rows, the partition of the pool, rows that match their handles: the laws
        ``check_accounting`` reads through the protocol, which would check them a second time)."""
        if not self.impls:
            return
        for index in range(len(self.impls)):
            if index not in self.exact_impls:
                self.check_accounting(index)
        if not self.exact:
            return
        first = self.exact[0]
        first_state: sm.ManagerState = self.exact_target(first).abstract_state()
        for index in self.exact:
            impl = self.exact_target(index)
            impl.check_integrity([live.reqs[index] for live in self.live])
            actual = first_state if index == first else impl.abstract_state()
            STATS.record_tree(len(actual.cache.entries))
            # the replay invariant: the cache's KV events so far describe exactly its cached pages
            replayer = self.replayers.setdefault(index, ev.Replayer(self.page_size))
            before = replayer.applied
            replayer.apply(impl.take_events())
            STATS.events_replayed += replayer.applied - before
            ev.events_match_cache(
                replayer.cached(),
                {key: e.slot_start for key, e in actual.cache.entries.items()},
            )
            assert impl.available_size() == sm.available_size(actual), (
                f"available_size: {self.name(index)} reports {impl.available_size()}, its free pages and evictable"
                f" cache give {sm.available_size(actual)}"
            )
            if index == first:
                continue
            # the choices the spec leaves open (which free page, the free list's order) made the same way
            assert (actual.cache, actual.free_slots, actual.lazy_frees) == (
                first_state.cache,
                first_state.free_slots,
                first_state.lazy_frees,
            ), f"{self.name(index)} differs from {self.name(first)}:\n{describe_difference(first_state, actual)}"
            for live in self.live:
                assert impl.row(live.reqs[index]) == self.impls[first].row(live.reqs[first]), (
                    f"row of request {live.uid}: {self.name(first)} {self.impls[first].row(live.reqs[first])},"
                    f" {self.name(index)} {impl.row(live.reqs[index])}"
                )

    def exact_target(self, index: int) -> Exact:
        """The target at ``index`` with its differential capability (an index of ``exact``)."""
        return self.exact_impls[index]

    def check_accounting(self, index: int) -> None:
        """Page accounting of any manager, by the spec's own invariants (spec/invariants.py): the free list, the
        private rows, the partition of the pool, rows that match their handles; and no freed page reachable."""
        target = self.impls[index]
        p, num_pages = self.page_size, target.num_pages
        free = list(target.free_pages())
        cached = list(target.cached_slots())
        STATS.record_tree(len(cached))
        free_set = set(free)
        private: dict[int, list[int]] = {}
        matched_rows: dict[int, tuple[list[int], list[int]]] = {}
        for live in self.live:
            req = live.reqs[index]
            handle = target.handle_of(req)
            row = target.row(req)
            cached_len = target.cached_len(handle)
            # the target's row number names the request in a message (its uid when it keeps none)
            row_id = getattr(req, "table_idx", live.uid)
            private[row_id] = row[cached_len:]
            matched_rows[row_id] = (row[:cached_len], target.get_matched_indices(handle))
            reachable = sorted({slot - slot % p for slot in row} & free_set)
            assert not reachable, (
                f"no_freed_page_is_reachable: {self.name(index)}: live request {live.uid} still reads pages"
                f" {reachable[:8]} that are on the free list (the next allocation hands them to another request)"
            )
        raise_first(
            [
                ("free_slots_are_aligned_and_unique", free_slots_are_aligned_and_unique(free, p, num_pages)),
                ("private_rows_are_page_runs", private_rows_are_page_runs(private, p)),
                ("pages_are_partitioned", pages_are_partitioned(num_pages, p, free, cached, private)),
                ("rows_match_handles", rows_match_handles(matched_rows)),
            ]
        )
        evictable, protected = target.size_info()
        assert evictable + protected == len(cached) * p, (
            f"size_info of {self.name(index)}: {evictable} + {protected} tokens, the cache holds {len(cached)}"
            f" pages of {p}"
        )
        assert target.available_size() == evictable + len(free) * p, (
            f"available_size of {self.name(index)}: {target.available_size()} != evictable {evictable}"
            f" + {len(free)} free pages of {p}"
        )
