"""The manager machine: the seed's request lifecycle on any set of CacheManager targets, checked by the spec.

It plays the lifecycle on every target with the same calls: admit
(match_req, check available_size, lock, check again, copy the matched slots
into the request's row), forward (allocate_paged for a batch of prefill
chunks and decode steps), cache_req after a completed prefill, finish or
abort (cache_req(finished=True)), all under a small pool so that eviction
and OutOfPagesError are constant. The targets must agree on every outcome.

After every step, on every target, what must hold of any manager (the
spec's own invariants, spec/invariants.py):

* **pages are partitioned**: every page is free, cached, or private to
  exactly one live request (free + cached + private == num_pages, set by set);
* **rows match handles**: the cached part of every live request's row holds
  the slots of its locked handle;
* **no freed page is reachable**: no live request's row points at a page on
  the free list (a page freed while a request still reads it is handed to
  the next request: silent KV corruption);
* size info and ``available_size`` agree with the free list and the cache.

Targets with the differential capability (``ExactManager``: ours) are held
to more: around every call the machine observes their abstract states and
checks the operation's declarative relation (spec/cache_manager.py: its
guards, then what must be true after); after every step their own integrity
check, the available_size law and their KV events; and they agree with each
other state for state and row for row (the choices the spec leaves open,
made the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from radixspec.spec import cache_manager as sm
from radixspec.spec import events as ev
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import CacheBusyError
from radixspec.spec.helpers import div_ceil
from radixspec.spec.invariants import (
    free_slots_are_aligned_and_unique,
    pages_are_partitioned,
    private_rows_are_page_runs,
    raise_first,
    rows_match_handles,
)

from .differential import apply_all, describe_difference
from .sequences import build_sequence, namespaces, page_choices, page_sizes, tail_choices
from .stats import STATS
from .targets.api import CacheManagerTarget, ExactManager, TargetInfo
from .targets.ours import IMPLEMENTATIONS

# a manager target, its requests and handles its own
Target = CacheManagerTarget[Any, Any]

ROWS = 6
# how a batch's results or an abort run: outside a lazy free region, inside one, or inside one whose body then
# raises (an engine's forward that fails after freeing: the region must still hand back every page it held)
REGIONS = ("none", "lazy", "lazy, body raises")
MAX_PAGES_PER_REQ = 12


class BodyRaised(Exception):
    """Raised by the machine inside a lazy free region, after the frees: what a failing forward does."""


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


class ManagerMachine(RuleBasedStateMachine):
    """The spec and manager targets driven through the same request lifecycles."""

    # what the machine drives (radixspec.fuzz.machines.machine_for sets these): --impl and --target name them alike
    TARGETS: ClassVar[tuple[TargetInfo, ...]] = tuple(IMPLEMENTATIONS.values())
    LRU: ClassVar[str] = "strict"

    prompts = Bundle("prompts")

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.impls: list[Target] = []
        # the targets with the differential capability (their indices in impls)
        self.exact: list[int] = []
        self.live: list[LiveReq] = []
        self.page_size = 1
        # each target's KV events, replayed as a router would (spec/events.py)
        self.replayers: dict[int, ev.Replayer] = {}
        self.next_uid = 0
        # the namespace each prompt was last admitted in
        self.namespace_of: dict[tuple[int, ...], Namespace] = {}

    # the spec's relations are checked around every call on exact targets (the exhaustive checker turns them
    # off while it replays a path it already checked)
    relations = True

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

    # ------------------------------------------------------------ the spec's relations

    def observe(
        self, reqs: dict[int, list[Any]]
    ) -> dict[int, tuple[sm.ManagerState, dict[int, sm.RequestView]]] | None:
        """Each exact target's state and its views of ``reqs`` (uid -> one Req per target), by target index."""
        if not self.relations or not self.exact:
            return None
        out = {}
        for index in self.exact:
            impl: Any = self.impls[index]
            state = impl.abstract_state()
            out[index] = (state, {uid: impl.view(state, per_impl[index]) for uid, per_impl in reqs.items()})
        return out

    def live_reqs(self, but: list[LiveReq] | None = None) -> dict[int, list[Any]]:
        """uid -> the live request's Req per implementation (all of them, or those not in ``but``)."""
        skip = {live.uid for live in but or ()}
        return {live.uid: live.reqs for live in self.live if live.uid not in skip}

    @initialize(
        target=prompts,
        page_size=page_sizes,
        num_pages=st.integers(2, 24),
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
    )
    def setup(self, page_size: int, num_pages: int, first: list[tuple[list[int], list[int]]]) -> Any:
        for info in self.TARGETS:
            if info.page_sizes is not None:
                page_size = info.page_sizes[page_size % len(info.page_sizes)]
        self.page_size = page_size
        args = (num_pages, page_size, ROWS, MAX_PAGES_PER_REQ * page_size)
        for info in self.TARGETS:
            assert info.manager_factory is not None, f"target {info.name} has no cache manager"
            self.impls.append(info.manager_factory(*args))
        self.exact = [index for index, impl in enumerate(self.impls) if isinstance(impl, ExactManager)]
        return multiple(*[tuple(build_sequence(page_size, pages, tail)) for pages, tail in first])

    # ------------------------------------------------------------ lifecycle

    @precondition(lambda self: len(self.live) < ROWS)
    @rule(
        target=prompts,
        base=prompts,
        keep=st.booleans(),
        pages=page_choices,
        tail=tail_choices,
        namespace=namespaces,
        max_new_tokens=st.integers(1, 6),
    )
    def admit(
        self,
        base: tuple[int, ...],
        keep: bool,
        pages: list[int],
        tail: list[int],
        namespace: Namespace,
        max_new_tokens: int,
    ) -> Any:
        """The seed's PrefillAdder._try_allocate_one: match, check, lock, check again, fill the row.

        The prompt is ``base`` when ``keep`` and no pages are drawn, else the drawn
        pages after ``base``'s whole pages (when ``keep``); it joins the bundle.
        """
        STATS.record_rule("manager.admit")
        prompt = (
            base if keep and not pages else tuple(build_sequence(self.page_size, pages, tail, base if keep else ()))
        )
        if len(prompt) + max_new_tokens > MAX_PAGES_PER_REQ * self.page_size:
            return prompt
        self.try_admit(prompt, self.ns(namespace), max_new_tokens)
        return prompt

    @precondition(lambda self: len(self.live) < ROWS)
    @rule(target=prompts, base=prompts, max_new_tokens=st.integers(1, 6))
    def admit_cached_prefix(self, base: tuple[int, ...], max_new_tokens: int) -> Any:
        """Admit the whole pages of an earlier prompt, in its namespace: often every page is cached, so the
        match must stop a token short (match_req leaves the last token to be recomputed)."""
        STATS.record_rule("manager.admit_cached_prefix")
        prompt = base[: len(base) - len(base) % self.page_size]
        if prompt and len(prompt) + max_new_tokens <= MAX_PAGES_PER_REQ * self.page_size:
            self.try_admit(prompt, self.namespace_of.get(base), max_new_tokens)
        return prompt

    def try_admit(self, prompt: tuple[int, ...], namespace: Namespace, max_new_tokens: int) -> None:
        """Admit ``prompt`` on every target if each finds room (they must agree)."""
        if not prompt and not self.validates:
            STATS.skipped["admit of an empty prompt"] += 1
            return
        self.namespace_of[prompt] = namespace
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        used = {live.reqs[0].table_idx for live in self.live}
        table_idx = min(set(range(ROWS)) - used)
        reqs = [impl.new_req(list(prompt), table_idx, namespace, uid) for impl in self.impls]
        before = self.observe({uid: reqs})
        matched = apply_all(
            "match_req",
            self.impls,
            lambda impl, i: impl.match_req(reqs[i]),
            lambda impl, h: (impl.cached_len(h), impl.get_matched_indices(h)),
            snapshot=self.snapshot,
        )
        after = self.observe({uid: reqs})
        if before is not None and after is not None:
            for index in self.exact:
                cached = self.impls[index].cached_len(matched.results[index]) if matched.ok else 0
                sm.match_req(before[index][0], after[index][0], before[index][1][uid], cached, matched.error)
        if not matched.ok:
            return
        handles = matched.results
        estimated = len(prompt) - self.first.cached_len(handles[0]) + max_new_tokens

        def try_lock(impl: Target, i: int) -> str:
            if estimated > impl.available_size():
                return "no room before lock"
            impl.lock(handles[i])
            # locking made the matched pages unevictable: check again
            if estimated > impl.available_size():
                impl.unlock(handles[i])
                return "no room after lock"
            impl.admit(reqs[i], handles[i])
            return "admitted"

        before = after
        out = apply_all("admit", self.impls, try_lock, snapshot=self.snapshot)
        after = self.observe({})
        if before is not None and after is not None:
            for index in self.exact:
                exact: Any = self.impls[index]
                if out.results[index] == "admitted":
                    sm.lock(before[index][0], after[index][0], exact.spec_handle(handles[index]))
                else:  # locked and unlocked again, or never locked: the cache as it was
                    assert after[index][0].cache == before[index][0].cache, f"{self.name(index)}: {out.results[index]}"
        STATS.rules[f"manager.admit: {out.results[0]}"] += 1
        if out.results[0] == "admitted":
            cached = self.first.cached_len(handles[0])
            self.live.append(LiveReq(uid, len(prompt), max_new_tokens, reqs, cached, tokens=list(prompt)))

    @precondition(lambda self: bool(self.live))
    @rule(chunk=st.integers(1, 40), region=st.sampled_from(REGIONS))
    def forward_all(self, chunk: int, region: str) -> None:
        """One batch of every live request, in admission order."""
        STATS.record_rule("manager.forward_all")
        self.forward(list(self.live), chunk, region)

    @precondition(lambda self: bool(self.live))
    @rule(
        picks=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS, unique=True),
        chunk=st.integers(1, 40),
        region=st.sampled_from(REGIONS),
    )
    def forward_some(self, picks: list[int], chunk: int, region: str) -> None:
        """One batch of the picked live requests."""
        STATS.record_rule("manager.forward_some")
        self.forward([self.live[i] for i in dict.fromkeys(i % len(self.live) for i in picks)], chunk, region)

    def forward(self, batch: list[LiveReq], chunk: int, region: str) -> None:
        """Allocate pages for prefill chunks and decode steps, then process the results.

        An allocation the pool cannot satisfy is not sent to targets that do not validate.
        """
        targets = [
            min(live.cached_len + chunk, live.prompt_len) if live.in_prefill else live.cached_len + 1 for live in batch
        ]
        if not self.validates:
            p = self.page_size
            needed = sum(
                div_ceil(end, p) - div_ceil(live.cached_len, p) for live, end in zip(batch, targets, strict=True)
            )
            if needed * p > self.first.available_size():
                STATS.skipped["allocate_paged past available_size"] += 1
                return
        for impl_index, impl in enumerate(self.impls):
            for live, device_len in zip(batch, targets, strict=True):
                impl.set_lengths(live.reqs[impl_index], live.cached_len, device_len)
        cached_before = self.cached_page_count()
        out = self.allocate(batch)
        STATS.evicted_pages += max(0, cached_before - self.cached_page_count())
        if not out.ok:
            for impl_index, impl in enumerate(self.impls):
                for live in batch:
                    impl.set_lengths(live.reqs[impl_index], live.cached_len, live.cached_len)
            return
        # after the forward: chunks advance, a completed prefill is cached, a finished request is released
        self.in_region(region, lambda: self.advance(batch, targets))

    def allocate(self, batch: list[LiveReq], copies: int = 1) -> Any:
        """allocate_paged of the batch on every implementation, checked against the spec's relation."""
        mine = {live.uid: live.reqs for live in batch}
        others = self.live_reqs(but=batch)
        before, others_before = self.observe(mine), self.observe(others)
        out = apply_all(
            "allocate_paged",
            self.impls,
            lambda impl, i: impl.allocate_paged([live.reqs[i] for live in batch] * copies),
            snapshot=self.snapshot,
        )
        after, others_after = self.observe(mine), self.observe(others)
        if before is not None and after is not None and others_before is not None and others_after is not None:
            for index in self.exact:
                views_before = [before[index][1][live.uid] for live in batch] * copies
                views_after = [after[index][1][live.uid] for live in batch] * copies
                sm.allocate_paged(
                    before[index][0],
                    after[index][0],
                    views_before,
                    views_after,
                    out.error,
                    others_before[index][1],
                    others_after[index][1],
                )
        return out

    def cache(self, live: LiveReq, finished: bool, label: str) -> Any:
        """cache_req of one request on every implementation, checked against the spec's relation."""
        mine = {live.uid: live.reqs}
        others = self.live_reqs(but=[live])
        before, others_before = self.observe(mine), self.observe(others)
        out = apply_all(
            label, self.impls, lambda impl, i: impl.cache_req(live.reqs[i], finished), snapshot=self.snapshot
        )
        after, others_after = self.observe(mine), self.observe(others)
        if before is not None and after is not None and others_before is not None and others_after is not None:
            for index in self.exact:
                sm.cache_req(
                    before[index][0],
                    after[index][0],
                    before[index][1][live.uid],
                    after[index][1][live.uid],
                    finished,
                    out.error,
                    others_before[index][1],
                    others_after[index][1],
                )
        return out

    def lazy_exit_law(self, inside: dict[int, tuple[sm.ManagerState, dict[int, sm.RequestView]]] | None) -> None:
        """After a lazy free region closed: the held pages joined the free list, nothing else moved."""
        after = self.observe({})
        if inside is not None and after is not None:
            for index in self.exact:
                sm.lazy_free_region(inside[index][0], after[index][0])

    def in_region(self, region: str, body: Callable[[], None]) -> None:
        """Run ``body`` on every target as ``region`` says (see REGIONS); after a lazy region, its exit law."""
        lazy = region != "none"
        inside = None
        try:
            with ExitStack() as stack:
                if lazy:
                    for impl in self.impls:
                        stack.enter_context(impl.lazy_free_region())
                    self.check_nested_lazy_region_is_rejected()
                body()
                inside = self.observe({}) if lazy else None
                if region == "lazy, body raises":
                    raise BodyRaised("the body of the lazy free region raised after its frees")
        except BodyRaised:
            STATS.record_rule("manager.lazy_free_region[body raises]")
        self.lazy_exit_law(inside)

    def advance(self, batch: list[LiveReq], targets: list[int]) -> None:
        """Chunks advance, tokens are sampled; finished requests are released, completed prefills cached."""
        for live, device_len in zip(batch, targets, strict=True):
            was_prefill = live.in_prefill
            live.cached_len = device_len
            for impl_index, impl in enumerate(self.impls):
                impl.set_lengths(live.reqs[impl_index], device_len, device_len)
            if live.in_prefill:
                continue  # a chunk: no token sampled yet
            token = sum(live.tokens) % 4
            live.tokens.append(token)
            live.generated += 1
            for impl_index, impl in enumerate(self.impls):
                impl.append_token(live.reqs[impl_index], token)
            if live.generated >= live.max_new_tokens:
                self.release(live, "finish")
            elif was_prefill:
                self.cache_unfinished(live)

    def cache_unfinished(self, live: LiveReq) -> None:
        """cache_req(finished=False) after a completed prefill: the prompt enters the cache, locked."""
        self.cache(live, False, "cache_req(finished=False)")

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, ROWS - 1), region=st.sampled_from(REGIONS))
    def abort(self, pick: int, region: str) -> None:
        """Abort a live request between batches."""
        STATS.record_rule("manager.abort")
        live = self.live[pick % len(self.live)]
        self.in_region(region, lambda: self.release(live, "abort"))

    def release(self, live: LiveReq, why: str) -> None:
        """cache_req(finished=True) on every implementation; the request leaves the live set."""
        out = self.cache(live, True, f"cache_req(finished=True) on {why}")
        assert out.ok, f"releasing live request {live.uid} was rejected with {out.error}"
        if not self.validates:
            self.live.remove(live)
            STATS.skipped["cache_req(finished=True) again"] += 1
            return
        again = self.cache(live, True, "cache_req(finished=True) again")
        self.live.remove(live)
        assert not again.ok, f"a second cache_req(finished=True) of request {live.uid} was accepted"

    def check_nested_lazy_region_is_rejected(self) -> None:
        """Opening a lazy free region inside another is rejected, changing nothing."""
        if not self.validates:
            STATS.skipped["nested lazy_free_region"] += 1
            return

        def nest(impl: Target, i: int) -> None:
            with impl.lazy_free_region():
                pass

        out = apply_all("nested lazy_free_region", self.impls, nest, snapshot=self.snapshot)
        assert out.error is CacheBusyError, f"a lazy free region inside another: {out.error or 'accepted'}"

    # ------------------------------------------------------------ bad input

    @precondition(lambda self: bool(self.live) and self.validates)
    @rule(pick=st.integers(0, ROWS - 1), how=st.sampled_from(["same row twice", "past max_seq_len", "backwards"]))
    def allocate_bad_batch(self, pick: int, how: str) -> None:
        """allocate_paged with an impossible batch: rejected, nothing changed."""
        STATS.record_rule(f"manager.allocate_bad_batch[{how}]")
        live = self.live[pick % len(self.live)]
        device_len = {
            "same row twice": live.cached_len + 1,
            "past max_seq_len": MAX_PAGES_PER_REQ * self.page_size + 1,
            "backwards": live.cached_len - 1,
        }[how]
        for impl_index, impl in enumerate(self.impls):
            impl.set_lengths(live.reqs[impl_index], live.cached_len, device_len)
        copies = 2 if how == "same row twice" else 1
        out = self.allocate([live], copies)
        for impl_index, impl in enumerate(self.impls):
            impl.set_lengths(live.reqs[impl_index], live.cached_len, live.cached_len)
        assert not out.ok, f"allocate_paged accepted a batch with {how}"

    # ------------------------------------------------------------ checks

    def cached_page_count(self) -> int:
        """Pages the prefix cache holds now (to count evictions)."""
        first: Any = self.first
        return int(first.cached_pages()) if self.exact and self.exact[0] == 0 else len(first.cached_slots())

    def snapshot(self, impl: Target) -> tuple[Any, ...]:
        """What a rejected call must leave unchanged: an exact target's abstract state and the live requests'
        fields; another's free list, cached pages, sizes and live rows.

        Nothing while checks are off (the exhaustive checker replaying a path it already checked).
        """
        if not self.relations:
            return ()
        index = self.impls.index(impl)
        if index in self.exact:
            exact: Any = impl
            reqs = [(r.cached_len, r.device_len, r.alloc_len) for r in (live.reqs[index] for live in self.live)]
            return (exact.abstract_state(), reqs)
        rows = [tuple(impl.row(live.reqs[index])) for live in self.live]
        return (tuple(impl.free_pages()), tuple(sorted(impl.cached_slots())), tuple(impl.size_info()), rows)

    @invariant()
    def targets_agree(self) -> None:
        """Every target's page accounting; an exact target's integrity, events, available_size law; all agree."""
        if not self.impls:
            return
        for index in range(len(self.impls)):
            self.check_accounting(index)
        if not self.exact:
            return
        first = self.exact[0]
        first_state: sm.ManagerState = self.exact_target(first).abstract_state()
        for index in self.exact:
            impl = self.exact_target(index)
            impl.check_integrity([live.reqs[index] for live in self.live])
            actual = first_state if index == first else impl.abstract_state()
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

    def exact_target(self, index: int) -> ExactManager[Any, Any]:
        impl = self.impls[index]
        assert isinstance(impl, ExactManager)
        return impl

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

    def teardown(self) -> None:
        """Release every request: then every page is free or cached (no leak)."""
        if not self.impls:
            return
        for live in list(self.live):
            self.release(live, "teardown")
        self.targets_agree()
