"""State machine for any CacheManager behind the target API: the request lifecycle, checked by page accounting.

The lifecycle is the manager machine's (admit with the lock-then-recheck,
forward with chunked prefill and decode, cache_req after a prefill, finish,
abort, lazy free regions); instead of comparing with the spec's state, each
step checks what must hold of any manager:

* **pages are partitioned**: every page is free, cached, or private to
  exactly one live request (free + cached + private == num_pages, set by set);
* **rows match handles**: the cached part of every live request's row holds
  the slots of its locked handle;
* **no freed page is reachable**: no live request's row points at a page on
  the free list (a page freed while a request still reads it is handed to
  the next request: silent KV corruption);
* size info and ``available_size`` agree with the free list and the cache.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, multiple

from spec.domains import Namespace
from spec.helpers import div_ceil
from spec.invariants import (
    free_slots_are_aligned_and_unique,
    pages_are_partitioned,
    private_rows_are_page_runs,
    raise_first,
    rows_match_handles,
)

from .cache_manager_machine import MAX_PAGES_PER_REQ, ROWS, CacheManagerMachine, LiveReq
from .sequences import build_sequence, page_choices, page_sizes, tail_choices
from .stats import STATS
from .targets.api import CacheManagerTarget, TargetInfo


class TargetManagerMachine(CacheManagerMachine):
    """A target's CacheManager driven through request lifecycles, checked by page accounting."""

    TARGET: ClassVar[TargetInfo]

    @property
    def target(self) -> CacheManagerTarget:
        return self.impls[0]  # type: ignore[return-value]

    # no abstract state to relate: page accounting on the target's own observations instead
    relations = False

    @property
    def first(self) -> Any:
        # the lifecycle reads lengths from the first implementation: here the target itself
        return self.impls[0]

    @property
    def validates(self) -> bool:  # type: ignore[override]
        return bool(self.impls) and self.target.profile.errors != "none"

    def ns(self, namespace: Namespace) -> Namespace:
        return namespace if self.impls and self.target.profile.namespaces else None

    @initialize(
        target=CacheManagerMachine.prompts,
        page_size=page_sizes,
        num_pages=st.integers(2, 24),
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
    )
    def setup(self, page_size: int, num_pages: int, first: list[tuple[list[int], list[int]]]) -> Any:
        info = self.TARGET
        if info.page_sizes is not None:
            page_size = info.page_sizes[page_size % len(info.page_sizes)]
        assert info.manager_factory is not None
        self.page_size = page_size
        self.impls = [info.manager_factory(num_pages, page_size, ROWS, MAX_PAGES_PER_REQ * page_size)]  # type: ignore[list-item]
        return multiple(*[tuple(build_sequence(page_size, pages, tail)) for pages, tail in first])

    def try_admit(self, prompt: tuple[int, ...], namespace: Namespace, max_new_tokens: int) -> None:
        if not prompt and not self.validates:
            STATS.skipped["admit of an empty prompt"] += 1
            return
        super().try_admit(prompt, namespace, max_new_tokens)

    def forward(self, batch: list[LiveReq], chunk: int, lazy: bool) -> None:
        """The manager machine's; an allocation the pool cannot satisfy is not sent to a non-validating target."""
        if not self.validates:
            p = self.page_size
            targets = [
                min(live.cached_len + chunk, live.prompt_len) if live.in_prefill else live.cached_len + 1
                for live in batch
            ]
            needed = sum(
                div_ceil(end, p) - div_ceil(live.cached_len, p) for live, end in zip(batch, targets, strict=True)
            )
            if needed * p > self.target.available_size():
                STATS.skipped["allocate_paged past available_size"] += 1
                return
        super().forward(batch, chunk, lazy)

    def cached_page_count(self) -> int:
        return len(self.target.cached_slots())

    def snapshot(self, impl: Any) -> tuple[Any, ...]:
        """What a rejected call must leave unchanged: the free list, the cache, sizes, the live requests' rows."""
        rows = [tuple(impl.row(live.reqs[0])) for live in self.live]
        return (tuple(impl.free_pages()), tuple(sorted(impl.cached_slots())), tuple(impl.size_info()), rows)

    @invariant()
    def implementations_agree(self) -> None:
        """Page accounting of any manager, by the spec's own invariants (spec/invariants.py): the free list, the
        private rows, the partition of the pool, rows that match their handles; and no freed page reachable."""
        if not self.impls:
            return
        target = self.target
        p, num_pages = self.page_size, target.num_pages
        free = list(target.free_pages())
        cached = list(target.cached_slots())
        STATS.record_tree(len(cached))
        free_set = set(free)
        private: dict[int, list[int]] = {}
        matched_rows: dict[int, tuple[list[int], list[int]]] = {}
        for live in self.live:
            req = live.reqs[0]
            handle = target.handle_of(req)
            row = target.row(req)
            cached_len = target.cached_len(handle)
            # the target's row number names the request in a message (its uid when it keeps none)
            row_id = getattr(req, "table_idx", live.uid)
            private[row_id] = row[cached_len:]
            matched_rows[row_id] = (row[:cached_len], target.get_matched_indices(handle))
            reachable = sorted({slot - slot % p for slot in row} & free_set)
            assert not reachable, (
                f"no_freed_page_is_reachable: live request {live.uid} still reads pages {reachable[:8]}"
                " that are on the free list (the next allocation hands them to another request)"
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
            f"size_info {evictable} + {protected} tokens, the cache holds {len(cached)} pages of {p}"
        )
        assert target.available_size() == evictable + len(free) * p, (
            f"available_size {target.available_size()} != evictable {evictable} + {len(free)} free pages of {p}"
        )

    def teardown(self) -> None:
        """Release every request: then every page is free or cached (no leak)."""
        if not self.impls:
            return
        for live in list(self.live):
            self.release(live, "teardown")
        self.implementations_agree()
