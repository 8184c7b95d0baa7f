"""The reference hybrid tree and manager: the docs' rules on the tree, and the manager's laws with breaking examples."""

from __future__ import annotations

import pytest

from radixspec.reference.hybrid_cache import HybridRadixCache
from radixspec.reference.hybrid_manager import HybridCacheManager, HybridReq
from radixspec.spec import hybrid as hy
from radixspec.spec.errors import IntegrityError, OutOfPagesError, StaleHandleError

PROMPT = list(range(100, 116))


def test_the_tree_keeps_a_window_hole_and_matches_past_it() -> None:
    cache = HybridRadixCache(4, (None, 8))
    cache.insert_prefix(PROMPT, ([0, 4, 8, 12], [None, None, 8, 12]))
    handle = cache.match_prefix([*PROMPT, 1])
    assert handle.cached_len == 16
    assert cache.get_matched_pages(handle) == [[0, 4, 8, 12], [None, None, 8, 12]]
    assert cache.evict(1, 1) == [12, 13, 14, 15]
    assert cache.match_prefix(PROMPT).cached_len == 0
    cache.check_integrity()


def test_a_full_group_page_evicted_under_a_window_page_keeps_the_way_down() -> None:
    cache = HybridRadixCache(2, (None, 3))
    cache.insert_prefix([1, 2, 3, 4], ([0, 2], [0, 2]))
    assert cache.evict(0, 2) == [2, 3]
    state = cache.abstract_state()
    assert len(state.groups[0]) == 1 and len(state.groups[1]) == 2
    cache.check_integrity()
    # the window's page 1 alone serves no match: the full group lacks page 1
    assert cache.match_prefix([1, 2, 3, 4]).cached_len == 2


def test_windows_of_one_token_match_past_the_tree() -> None:
    cache = HybridRadixCache(4, (1,))
    handle = cache.match_prefix(PROMPT)
    assert handle.cached_len == 16 and cache.get_matched_pages(handle) == [[None] * 4]
    cache.lock(handle)
    cache.unlock(handle)
    assert not cache.roots or not any(root.children for root in cache.roots.values())


def test_evicting_a_used_window_page_makes_the_handle_stale() -> None:
    cache = HybridRadixCache(4, (None, 5))
    handle = cache.insert_prefix(PROMPT[:8], ([0, 4], [0, 4])).handle
    assert cache.evict(1, 4) == [4, 5, 6, 7]
    with pytest.raises(StaleHandleError):
        cache.lock(handle)


def test_the_tree_reports_a_broken_start_set() -> None:
    cache = HybridRadixCache(4, (None, 8))
    cache.insert_prefix(PROMPT, ([0, 4, 8, 12], [0, 4, 8, 12]))
    cache.starts[1].add(40)
    with pytest.raises(IntegrityError, match="start_sets_match_the_tree"):
        cache.check_integrity()


# ---------------------------------------------------------------- the manager


def running(windows: tuple[hy.Window, ...] = (None, 4), num_pages: int = 8) -> tuple[HybridCacheManager, HybridReq]:
    manager = HybridCacheManager(HybridRadixCache(4, windows), num_pages)
    req = HybridReq(1, list(range(14)))
    manager.match_req(req)
    return manager, req


def test_a_request_releases_window_pages_as_the_window_slides() -> None:
    manager, req = running()
    manager.allocate_paged(req, 14)
    assert [len(row) for row in req.rows] == [4, 4]
    manager.store(req, 10)
    # the token at 10 attends to [7, 10) in the window group: page 0 went back to the free list
    assert req.rows[1][0] is None and req.rows[0][0] is not None
    assert len(manager.free_slots[1]) == 5 and len(manager.free_slots[0]) == 4
    manager.check_integrity([req])
    manager.store(req, 4)
    assert req.rows[1][:2] == [None, None]
    manager.check_integrity([req])


def test_cache_req_caches_the_longest_valid_prefix_and_frees_the_rest() -> None:
    manager, req = running()
    manager.allocate_paged(req, 14)
    manager.store(req, 14)
    # pages 0 and 1 of the window group are gone, so L = 12 (window [9, 12): page 2) is the longest valid
    assert manager.cacheable_len(req) == 12
    manager.cache_req(req, finished=True)
    manager.check_integrity([])
    assert [len(q) for q in manager.free_slots] == [5, 7]
    assert manager.cache.match_prefix(list(range(14))).cached_len == 12


def test_cache_req_of_a_running_request_locks_its_new_match() -> None:
    manager, req = running()
    manager.allocate_paged(req, 14)
    manager.store(req, 14)
    manager.cache_req(req, finished=False)
    assert req.cached_len == 12
    manager.check_integrity([req])
    other = HybridReq(2, [0] * 30)
    manager.match_req(other)
    with pytest.raises(OutOfPagesError):
        # 4 free full-group pages and nothing evictable: the first request's prefix is locked
        manager.allocate_paged(other, 30)


def test_running_out_of_pages_changes_nothing() -> None:
    manager, req = running(num_pages=3)
    before = ([list(q) for q in manager.free_slots], [list(r) for r in req.rows])
    with pytest.raises(OutOfPagesError):
        manager.allocate_paged(req, 14)
    assert ([list(q) for q in manager.free_slots], [list(r) for r in req.rows]) == before


def test_a_window_page_released_one_token_too_early_breaks_the_safety_law() -> None:
    manager, req = running()
    manager.allocate_paged(req, 14)
    manager.store(req, 10)
    # the token at 10 still attends to token 7, on page 1 of the window group
    start = req.rows[1][1]
    assert start is not None
    req.rows[1][1] = None
    manager.free_slots[1].append(start)
    with pytest.raises(IntegrityError, match="attended_pages_are_held"):
        manager.check_integrity([req])


def test_a_page_freed_twice_breaks_conservation_in_its_group() -> None:
    manager, req = running()
    manager.allocate_paged(req, 14)
    manager.free_slots[0].append(req.rows[0][-1])
    with pytest.raises(IntegrityError, match="group 0 pages_are_partitioned"):
        manager.check_integrity([req])


def test_an_insert_that_no_group_takes_leaves_no_empty_nodes() -> None:
    """Regression (hybrid machine): pruning the new path page by page freed a parent twice (KeyError)."""
    cache = HybridRadixCache(1, (1,))
    result = cache.insert_prefix([0, 0, 0], ([None, None, None],))
    assert result.unused == ((),) and result.handle.cached_len == 3
    assert not any(root.children for root in cache.roots.values())
    cache.check_integrity()
