"""The declarative manager spec: each relation holds of a correct transition and names the law a wrong one breaks."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from radixspec.fuzz.targets.ours import ReferenceManager
from radixspec.spec import cache_manager as sm
from radixspec.spec.errors import InvalidRequestError, OutOfPagesError
from radixspec.spec.requests import Req

from .managers import PROMPT, admitted, manager_with_a_cached_prefix, observe


@pytest.fixture
def two_pages_free() -> tuple[ReferenceManager, Req]:
    """P=2, 5 pages; the prompt's first 2 pages cached, 3 free; a request on it admitted (4 tokens matched)."""
    return manager_with_a_cached_prefix()


def test_a_correct_allocation_satisfies_the_relation(two_pages_free: tuple[ReferenceManager, Req]) -> None:
    manager, req = two_pages_free
    manager.set_lengths(req, 4, 8)
    before, view_before = observe(manager, req)
    manager.allocate_paged([req])
    after, view_after = observe(manager, req)
    sm.allocate_paged(before, after, [view_before], [view_after], None)
    # a wrong after-state is named by the law it breaks
    broken = copy.deepcopy(after)
    broken.free_slots.append(broken.free_slots[0] if broken.free_slots else 0)
    with pytest.raises(sm.ManagerLawError, match="free pages after it"):
        sm.allocate_paged(before, broken, [view_before], [view_after], None)
    with pytest.raises(sm.ManagerLawError, match="the guards say accepted, the implementation rejected"):
        sm.allocate_paged(before, before, [view_before], [view_before], OutOfPagesError)


def test_an_allocation_past_the_pool_must_be_rejected(two_pages_free: tuple[ReferenceManager, Req]) -> None:
    manager, req = two_pages_free
    manager.set_lengths(req, 4, 8 + 1)  # past max_seq_len: InvalidRequestError before OutOfPagesError
    state, view = observe(manager, req)
    assert sm.allocate_paged_guard(state, [view]) is InvalidRequestError
    assert sm.allocate_paged_guard(state, [view, view]) is InvalidRequestError  # one row twice
    with pytest.raises(sm.ManagerLawError, match="the guards say rejected with InvalidRequestError"):
        sm.allocate_paged(state, state, [view], [view], None)


def test_cache_req_frees_the_duplicates_and_rewrites_the_row(two_pages_free: tuple[ReferenceManager, Req]) -> None:
    manager, req = two_pages_free
    twin = admitted(manager, PROMPT, 2, 2)  # the same prompt, admitted before either is cached
    for r in (req, twin):
        manager.set_lengths(r, 4, 6)
    manager.allocate_paged([req, twin])
    for r in (req, twin):
        manager.set_lengths(r, 6, 6)
    manager.cache_req(twin, False)  # page (3 3) enters the cache from the twin's row
    before, view_before = observe(manager, req)
    manager.cache_req(req, False)  # req's own copy of (3 3) is a duplicate: freed, its row rewritten
    after, view_after = observe(manager, req)
    sm.cache_req(before, after, view_before, view_after, False, None)
    assert view_after.row != view_before.row
    # mini-sglang's #142 class: the row still points at the pages the call freed
    stale_row = sm.RequestView(**{**view_after.__dict__, "row": view_before.row})
    with pytest.raises(sm.ManagerLawError, match="free pages after it|rows_match_handles"):
        sm.cache_req(before, after, view_before, stale_row, False, None)


def test_a_double_free_breaks_cache_req(two_pages_free: tuple[ReferenceManager, Req]) -> None:
    manager, req = two_pages_free
    manager.set_lengths(req, 4, 6)
    manager.allocate_paged([req])
    manager.set_lengths(req, 4, 4)
    before, view_before = observe(manager, req)
    manager.cache_req(req, True)
    after, view_after = observe(manager, req)
    sm.cache_req(before, after, view_before, view_after, True, None)
    freed_again = copy.deepcopy(before)
    tail = sm.private_pages(before, view_before)  # past its locked path (4 tokens): the page at slot 4
    assert tail == {view_before.row[4]} and view_before.handle is not None
    assert sm.private_pages(before, sm.RequestView(**{**view_before.__dict__, "handle": None})) == set(
        view_before.row[::2]
    )
    freed_again.free_slots.extend(tail)  # the tail already on the free list
    with pytest.raises(sm.ManagerLawError, match="double free"):
        sm.cache_req(freed_again, after, view_before, view_after, True, None)
    # a released request cannot be cached again
    released, view = observe(manager, req)
    assert sm.cache_req_guard(released, view) is InvalidRequestError


def test_the_lazy_region_holds_frees_until_it_closes(two_pages_free: tuple[ReferenceManager, Req]) -> None:
    manager, req = two_pages_free
    manager.set_lengths(req, 4, 6)
    manager.allocate_paged([req])
    manager.set_lengths(req, 4, 4)
    region = manager.lazy_free_region()
    region.__enter__()
    before, view_before = observe(manager, req)
    manager.cache_req(req, True)
    inside, view_inside = observe(manager, req)
    sm.cache_req(before, inside, view_before, view_inside, True, None)
    assert inside.lazy_frees  # held back
    region.__exit__(None, None, None)
    after = manager.abstract_state()
    sm.lazy_free_region(inside, after)
    with pytest.raises(sm.ManagerLawError, match="free and the held ones"):
        sm.lazy_free_region(inside, inside.__class__(**{**inside.__dict__, "lazy_frees": None}))


def test_match_req_and_the_available_size_law(two_pages_free: tuple[ReferenceManager, Req]) -> None:
    manager, _ = two_pages_free
    req = manager.new_req([1, 1, 2, 2, 9], 2, None, 7)
    before, view = observe(manager, req)
    handle: Any = manager.match_req(req)
    after = manager.abstract_state()
    sm.match_req(before, after, view, handle.cached_len, None)
    with pytest.raises(sm.ManagerLawError, match="matched 2 tokens, the cache holds 4"):
        sm.match_req(before, after, view, 2, None)
    assert manager.available_size() == sm.available_size(after)


def test_the_unlock_relation_says_what_moved(two_pages_free: tuple[ReferenceManager, Req]) -> None:
    manager, req = two_pages_free
    before, _ = observe(manager, req)
    handle = req.cache_handle
    manager.unlock(handle)
    after, _ = observe(manager, req)
    spec_handle = manager.spec_handle(handle)
    sm.unlock(before, after, spec_handle)
    with pytest.raises(sm.ManagerLawError) as error:
        sm.unlock(before, before, spec_handle)  # nothing released
    assert str(error.value) == "unlock: the cache after it is not the cache after that unlock"
    moved = copy.deepcopy(after)
    moved.free_slots.append(moved.free_slots.pop(0) + 1000)
    with pytest.raises(sm.ManagerLawError) as error:
        sm.unlock(before, moved, spec_handle)
    assert str(error.value) == "unlock: changed the free pages"
