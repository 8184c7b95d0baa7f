"""Differential state machine for CacheManagers: spec vs reference (vs optimized).

It plays the seed's request lifecycle on every implementation with the
same calls: admit (match_req, check available_size, lock, check again,
copy the matched slots into the request's row), forward (allocate_paged
for a batch of prefill chunks and decode steps), cache_req after a
completed prefill, finish or abort (cache_req(finished=True)), all under
a small pool so that eviction and OutOfPagesError are constant. After
every step: equal available_size, equal abstract state, equal rows, and
check_integrity(live_reqs) on each.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from spec import cache_manager as sm
from spec import events as ev
from spec.types import Namespace

from .adapters import MANAGER_IMPLEMENTATIONS, ManagerAdapter, SpecManager
from .differential import apply_all, describe_difference
from .sequences import build_sequence, namespaces, page_choices, page_sizes, tail_choices
from .stats import STATS

ROWS = 6
MAX_PAGES_PER_REQ = 12


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


class CacheManagerMachine(RuleBasedStateMachine):
    """Spec and implementations driven through the same request lifecycles."""

    IMPLS: ClassVar[tuple[str, ...]] = ("reference", "optimized")

    prompts = Bundle("prompts")

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.impls: list[ManagerAdapter] = []
        self.live: list[LiveReq] = []
        self.page_size = 1
        # each implementation's KV events, replayed as a router would (spec/events.py)
        self.replayers: dict[str, ev.Replayer] = {}
        self.next_uid = 0

    # the implementations reject bad input (a target whose profile says errors == "none" does not)
    validates = True

    def ns(self, namespace: Namespace) -> Namespace:
        """The namespace requests use."""
        return namespace

    @property
    def spec(self) -> SpecManager:
        """The oracle."""
        return self.impls[0]  # type: ignore[return-value]

    @initialize(
        target=prompts,
        page_size=page_sizes,
        num_pages=st.integers(2, 24),
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
    )
    def setup(self, page_size: int, num_pages: int, first: list[tuple[list[int], list[int]]]) -> Any:
        self.page_size = page_size
        args = (num_pages, page_size, ROWS, MAX_PAGES_PER_REQ * page_size)
        self.impls = [SpecManager(*args)] + [MANAGER_IMPLEMENTATIONS[name](*args) for name in self.IMPLS]
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

    def try_admit(self, prompt: tuple[int, ...], namespace: Namespace, max_new_tokens: int) -> None:
        """Admit ``prompt`` on every implementation if each finds room (they must agree)."""
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        used = {live.reqs[0].table_idx for live in self.live}
        table_idx = min(set(range(ROWS)) - used)
        reqs = [impl.new_req(list(prompt), table_idx, namespace, uid) for impl in self.impls]
        matched = apply_all(
            "match_req",
            self.impls,
            lambda impl, i: impl.match_req(reqs[i]),
            lambda impl, h: (impl.cached_len(h), impl.get_matched_indices(h)),
            snapshot=self.snapshot,
        )
        if not matched.ok:
            return
        handles = matched.results
        estimated = len(prompt) - self.spec.cached_len(handles[0]) + max_new_tokens

        def try_lock(impl: ManagerAdapter, i: int) -> str:
            if estimated > impl.available_size():
                return "no room before lock"
            impl.lock(handles[i])
            # locking made the matched pages unevictable: check again
            if estimated > impl.available_size():
                impl.unlock(handles[i])
                return "no room after lock"
            impl.admit(reqs[i], handles[i])
            return "admitted"

        out = apply_all("admit", self.impls, try_lock, snapshot=self.snapshot)
        STATS.rules[f"manager.admit: {out.results[0]}"] += 1
        if out.results[0] == "admitted":
            cached = self.spec.cached_len(handles[0])
            self.live.append(LiveReq(uid, len(prompt), max_new_tokens, reqs, cached, tokens=list(prompt)))

    @precondition(lambda self: bool(self.live))
    @rule(chunk=st.integers(1, 40), lazy=st.booleans())
    def forward_all(self, chunk: int, lazy: bool) -> None:
        """One batch of every live request, in admission order."""
        STATS.record_rule("manager.forward_all")
        self.forward(list(self.live), chunk, lazy)

    @precondition(lambda self: bool(self.live))
    @rule(
        picks=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS, unique=True),
        chunk=st.integers(1, 40),
        lazy=st.booleans(),
    )
    def forward_some(self, picks: list[int], chunk: int, lazy: bool) -> None:
        """One batch of the picked live requests."""
        STATS.record_rule("manager.forward_some")
        self.forward([self.live[i] for i in dict.fromkeys(i % len(self.live) for i in picks)], chunk, lazy)

    def forward(self, batch: list[LiveReq], chunk: int, lazy: bool) -> None:
        """Allocate pages for prefill chunks and decode steps, then process the results."""
        targets = [
            min(live.cached_len + chunk, live.prompt_len) if live.in_prefill else live.cached_len + 1 for live in batch
        ]
        for impl_index, impl in enumerate(self.impls):
            for live, device_len in zip(batch, targets, strict=True):
                impl.set_lengths(live.reqs[impl_index], live.cached_len, device_len)
        cached_before = self.cached_page_count()
        out = apply_all(
            "allocate_paged",
            self.impls,
            lambda impl, i: impl.allocate_paged([live.reqs[i] for live in batch]),
            snapshot=self.snapshot,
        )
        STATS.evicted_pages += max(0, cached_before - self.cached_page_count())
        if not out.ok:
            for impl_index, impl in enumerate(self.impls):
                for live in batch:
                    impl.set_lengths(live.reqs[impl_index], live.cached_len, live.cached_len)
            return
        self.process_results(batch, targets, lazy)

    def process_results(self, batch: list[LiveReq], targets: list[int], lazy: bool) -> None:
        """After the forward: chunks advance; a completed prefill is cached; a finished request is released."""
        with ExitStack() as stack:
            if lazy:
                for impl in self.impls:
                    stack.enter_context(impl.lazy_free_region())
                self.check_nested_lazy_region_is_rejected()
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
        apply_all(
            "cache_req(finished=False)",
            self.impls,
            lambda impl, i: impl.cache_req(live.reqs[i], False),
            snapshot=self.snapshot,
        )

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, ROWS - 1), lazy=st.booleans())
    def abort(self, pick: int, lazy: bool) -> None:
        """Abort a live request between batches."""
        STATS.record_rule("manager.abort")
        live = self.live[pick % len(self.live)]
        with ExitStack() as stack:
            if lazy:
                for impl in self.impls:
                    stack.enter_context(impl.lazy_free_region())
            self.release(live, "abort")

    def release(self, live: LiveReq, why: str) -> None:
        """cache_req(finished=True) on every implementation; the request leaves the live set."""
        out = apply_all(
            f"cache_req(finished=True) on {why}",
            self.impls,
            lambda impl, i: impl.cache_req(live.reqs[i], True),
            snapshot=self.snapshot,
        )
        assert out.ok, f"releasing live request {live.uid} was rejected with {out.error}"
        self.live.remove(live)
        if not self.validates:
            STATS.skipped["cache_req(finished=True) again"] += 1
            return
        again = apply_all(
            "cache_req(finished=True) again",
            self.impls,
            lambda impl, i: impl.cache_req(live.reqs[i], True),
            snapshot=self.snapshot,
        )
        assert not again.ok, f"a second cache_req(finished=True) of request {live.uid} was accepted"

    def check_nested_lazy_region_is_rejected(self) -> None:
        """Opening a lazy free region inside another is rejected, changing nothing."""
        if not self.validates:
            STATS.skipped["nested lazy_free_region"] += 1
            return

        def nest(impl: ManagerAdapter, i: int) -> None:
            with impl.lazy_free_region():
                pass

        assert not apply_all("nested lazy_free_region", self.impls, nest, snapshot=self.snapshot).ok

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
        out = apply_all(
            "allocate_paged",
            self.impls,
            lambda impl, i: impl.allocate_paged([live.reqs[i]] * copies),
            snapshot=self.snapshot,
        )
        for impl_index, impl in enumerate(self.impls):
            impl.set_lengths(live.reqs[impl_index], live.cached_len, live.cached_len)
        assert not out.ok, f"allocate_paged accepted a batch with {how}"

    # ------------------------------------------------------------ checks

    def cached_page_count(self) -> int:
        """Pages the prefix cache holds now (to count evictions)."""
        return len(self.spec.state.cache.entries)

    def snapshot(self, impl: ManagerAdapter) -> tuple[Any, ...]:
        """What a rejected call must leave unchanged: abstract state and the live requests' fields."""
        index = self.impls.index(impl)
        reqs = [(r.cached_len, r.device_len, r.alloc_len) for r in (live.reqs[index] for live in self.live)]
        return (impl.abstract_state(), reqs)

    @invariant()
    def implementations_agree(self) -> None:
        if not self.impls:
            return
        spec_live = [live.reqs[0] for live in self.live]
        self.spec.check_integrity(spec_live)
        expected: sm.ManagerState = self.spec.abstract_state()
        STATS.record_tree(len(expected.cache.entries))
        for index, impl in enumerate(self.impls[1:], start=1):
            impl.check_integrity([live.reqs[index] for live in self.live])
            actual = impl.abstract_state()
            # the replay invariant: the cache's KV events so far describe exactly its cached pages
            replayer = self.replayers.setdefault(impl.name, ev.Replayer(self.page_size))
            ev.events_match_cache(
                replayer.apply(impl.take_events()).cached(),
                {key: e.slot_start for key, e in actual.cache.entries.items()},
            )
            assert (actual.cache, actual.free_slots, actual.lazy_frees) == (
                expected.cache,
                expected.free_slots,
                expected.lazy_frees,
            ), f"abstract state of {impl.name} differs from spec:\n{describe_difference(expected, actual)}"
            assert impl.available_size() == self.spec.available_size()
            for live in self.live:
                assert impl.row(live.reqs[index]) == self.spec.row(live.reqs[0]), (
                    f"row of request {live.uid}: spec {self.spec.row(live.reqs[0])},"
                    f" {impl.name} {impl.row(live.reqs[index])}"
                )

    def teardown(self) -> None:
        """Release every request: then every page is free or cached (no leak)."""
        if not self.impls:
            return
        for live in list(self.live):
            self.release(live, "teardown")
        self.implementations_agree()
        state = self.spec.abstract_state()
        assert len(state.free_slots) + len(state.cache.entries) == state.num_pages, (
            f"after releasing every request: {len(state.free_slots)} free + {len(state.cache.entries)} cached"
            f" != {state.num_pages} pages"
        )
