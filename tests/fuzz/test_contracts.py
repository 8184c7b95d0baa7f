"""The CacheManager's contract (fuzz/contracts.py): the programs CrossHair searches (``tox -e crosshair``),
driven by Hypothesis on both managers, over the contract's pool and a larger one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixspec import reference
from radixspec.fuzz.contracts import (
    NUM_PAGES,
    PAGES_PER_ROW,
    ROWS,
    ManagerProgram,
    manager_contract,
    run_manager_program,
)
from radixspec.fuzz.targets.ours import ReferenceManager
from radixspec.fuzz.targets.ours_optimized import OptimizedManager
from radixspec.spec.errors import IntegrityError, ManagerLawError

page_sizes = st.integers(1, 2)
programs = st.lists(st.integers(0, 9), max_size=14)


@settings(max_examples=300, deadline=None)
@given(page_sizes, st.lists(st.integers(0, 9), max_size=6))
def test_the_reference_manager_keeps_its_contract(page_size: int, program: list[int]) -> None:
    assert manager_contract(page_size, program)


@settings(max_examples=200, deadline=None)
@given(page_sizes, programs, st.sampled_from([NUM_PAGES, 6]))
def test_both_managers_keep_the_contract_on_longer_programs(page_size: int, program: list[int], pages: int) -> None:
    for adapter in (ReferenceManager, OptimizedManager):
        assert run_manager_program(adapter(pages, page_size, ROWS, PAGES_PER_ROW * page_size), page_size, program)


def test_the_bounded_programs_reach_an_eviction_and_a_rejected_allocation() -> None:
    # P = 2: (1 1 2 2 4 4) prefilled and finished fills the cache; (1 1 5) must evict to prefill
    manager = ReferenceManager(NUM_PAGES, 2, ROWS, PAGES_PER_ROW * 2)
    run = ManagerProgram(manager, 2)
    for code in [1, 4, 7, 2, 4]:
        run.step(code)
        run.check_invariants()
    assert manager.manager.evicted_pages == 1
    # a second request (1 1 2 2 4 4) cannot get its two pages: one free page, the rest locked
    run.step(1)
    assert run.allocate(run.live[-1:], [6]) is not None
    run.check_invariants()


def test_a_leaked_page_breaks_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    # the planted bug CrossHair finds as manager_contract(2, [0, 4, 7]): every free drops its last page
    free = reference.CacheManager._free

    def leaky_free(self: reference.CacheManager, indices: list[int]) -> None:
        free(self, indices[: -self.page_size])

    monkeypatch.setattr(reference.CacheManager, "_free", leaky_free)
    with pytest.raises(ManagerLawError, match="free pages after it are not the free and freed ones"):
        manager_contract(2, [0, 4, 7])


def test_a_lost_lazy_free_breaks_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    # inside a lazy region, a free that reaches neither the free list nor the held pages: conservation fails
    free = reference.CacheManager._free

    def lossy_free(self: reference.CacheManager, indices: list[int]) -> None:
        if self.lazy_frees is None:
            free(self, indices)

    monkeypatch.setattr(reference.CacheManager, "_free", lossy_free)
    with pytest.raises((ManagerLawError, IntegrityError)):
        manager_contract(2, [0, 4, 8, 7])


def test_a_request_without_room_is_unlocked_again() -> None:
    # P = 2, 3 pages: (1 1 2 2 4 4) prefilled takes them all; (1 1 2 2 3) finds no room, its lock is released
    run = ManagerProgram(ReferenceManager(NUM_PAGES, 2, ROWS, PAGES_PER_ROW * 2), 2)
    for code in [1, 4, 0]:
        run.step(code)
        run.check_invariants()
    assert len(run.live) == 1
    assert run.manager.manager.prefix_cache.size_info.protected_size == 0
