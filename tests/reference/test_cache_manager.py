"""The reference CacheManager: free list, allocation with eviction, cache_req, lazy frees, integrity."""

import pytest

from radixspec.spec.errors import CacheBusyError, IntegrityError, InvalidRequestError, InvalidSizeError, OutOfPagesError
from tests.lifecycle import admit, decode, new_manager, prefill


def test_the_free_list_starts_as_every_page_start_in_order() -> None:
    assert new_manager(4, 2).free_slots == [0, 2, 4, 6]


def test_allocate_paged_takes_pages_from_the_front_and_writes_them_into_the_row() -> None:
    manager = new_manager(4, 2)
    req = admit(manager, [1, 2, 3], 1)
    prefill(manager, req)
    assert manager.page_table[1][:4] == [0, 1, 2, 3]
    assert req.alloc_len == 4
    assert manager.free_slots == [4, 6]
    manager.check_integrity([req])


def test_allocate_paged_evicts_lru_pages_and_appends_them_ascending_before_taking() -> None:
    manager = new_manager(3, 1)
    old = admit(manager, [7, 8, 9], 0)
    prefill(manager, old)
    manager.cache_req(old, finished=True)  # [7, 8, 9] cached in slots 0, 1, 2
    assert manager.free_slots == [] and manager.available_size == 3
    req = admit(manager, [5, 6], 1)
    prefill(manager, req)  # needs 2 pages: evicts [7 8 9]'s last two pages
    assert manager.page_table[1][:2] == [1, 2]
    manager.check_integrity([req])


def test_allocate_paged_out_of_pages_raises_and_changes_nothing() -> None:
    manager = new_manager(2, 2)
    req = admit(manager, [1, 2, 3, 4, 5], 0)
    req.device_len = 5
    before = manager.abstract_state()
    with pytest.raises(OutOfPagesError):
        manager.allocate_paged([req])
    assert manager.abstract_state() == before and req.alloc_len == 0


def test_allocate_paged_rejects_two_requests_on_one_row() -> None:
    manager = new_manager(4, 1)
    req = admit(manager, [1, 2], 0)
    req.device_len = 2
    with pytest.raises(InvalidRequestError):
        manager.allocate_paged([req, req])


def test_cache_req_unfinished_inserts_whole_pages_and_keeps_the_tail_private() -> None:
    manager = new_manager(4, 2)
    req = admit(manager, [1, 2, 3], 0)
    prefill(manager, req)
    manager.cache_req(req, finished=False)
    assert req.cache_handle.cached_len == 2
    assert manager.prefix_cache.size_info == (0, 2)  # locked for the decode to come
    manager.check_integrity([req])


def test_cache_req_finished_frees_the_tail_that_cannot_enter_the_tree() -> None:
    manager = new_manager(4, 2)
    req = admit(manager, [1, 2, 3], 0)
    prefill(manager, req)
    manager.cache_req(req, finished=True)
    assert manager.free_slots == [4, 6, 2]  # page [3] could not enter: freed at the back
    assert manager.prefix_cache.size_info == (2, 0)
    manager.check_integrity([])


def test_cache_req_points_the_row_at_the_cached_slots_of_the_pages_it_freed() -> None:
    manager = new_manager(8, 1)
    first, second = admit(manager, [1, 2, 3], 0), admit(manager, [1, 2, 3], 1)
    prefill(manager, first)
    prefill(manager, second)
    manager.cache_req(first, finished=False)
    manager.cache_req(second, finished=False)  # [1, 2, 3] already cached by first: second frees its copies
    assert manager.page_table[1][:3] == manager.page_table[0][:3]
    manager.check_integrity([first, second])


def test_a_released_request_cannot_be_cached_again() -> None:
    manager = new_manager(4, 1)
    req = admit(manager, [1, 2], 0)
    prefill(manager, req)
    manager.cache_req(req, finished=True)
    free = list(manager.free_slots)
    with pytest.raises(InvalidRequestError):
        manager.cache_req(req, finished=True)
    assert manager.free_slots == free


def test_lazy_free_region_holds_frees_until_exit_even_when_it_raises() -> None:
    manager = new_manager(4, 1)
    req = admit(manager, [1, 2], 0)
    prefill(manager, req)
    with pytest.raises(RuntimeError), manager.lazy_free_region():
        manager.cache_req(req, finished=True)
        assert manager.lazy_frees == [] and manager.free_slots == [2, 3]
        raise RuntimeError("the batch failed")
    assert manager.lazy_frees is None
    manager.check_integrity([])


def test_cache_req_inside_lazy_free_region_holds_back_the_tail() -> None:
    manager = new_manager(4, 2)
    req = admit(manager, [1, 2, 3], 0)
    prefill(manager, req)
    with manager.lazy_free_region():
        manager.cache_req(req, finished=True)
        assert manager.lazy_frees == [2] and manager.free_slots == [4, 6]
        manager.check_integrity([])
    assert manager.free_slots == [4, 6, 2]


def test_a_nested_lazy_free_region_is_rejected() -> None:
    manager = new_manager(4, 1)
    with pytest.raises(CacheBusyError), manager.lazy_free_region(), manager.lazy_free_region():
        pass


def test_decode_allocates_a_page_only_when_the_last_one_is_full() -> None:
    manager = new_manager(4, 2)
    req = admit(manager, [1, 2, 3], 0)
    prefill(manager, req)
    free = len(manager.free_slots)
    decode(manager, req, 9)  # position 3 lives in the page of positions 2..3
    assert len(manager.free_slots) == free
    decode(manager, req, 9)  # position 4 needs a new page
    assert len(manager.free_slots) == free - 1
    manager.check_integrity([req])


def test_check_integrity_catches_a_leaked_page() -> None:
    manager = new_manager(4, 1)
    manager.free_slots.pop()
    with pytest.raises(IntegrityError, match="^pages_are_partitioned: .*leaked pages \\[3\\]"):
        manager.check_integrity([])


def test_check_integrity_catches_a_double_free() -> None:
    manager = new_manager(4, 1)
    manager.free_slots.append(0)
    with pytest.raises(IntegrityError, match="^free_slots_are_aligned_and_unique: .*double free"):
        manager.check_integrity([])


def test_check_integrity_catches_a_page_both_free_and_private() -> None:
    manager = new_manager(4, 1)
    req = admit(manager, [1, 2], 0)
    prefill(manager, req)
    manager.free_slots.append(manager.page_table[0][0])
    manager.free_slots.pop(0)
    with pytest.raises(IntegrityError, match="^pages_are_partitioned: .*two owners"):
        manager.check_integrity([req])


def test_check_integrity_catches_a_row_that_disagrees_with_its_handle() -> None:
    manager = new_manager(6, 1)
    req = admit(manager, [1, 2, 3], 0)
    prefill(manager, req)
    manager.cache_req(req, finished=False)
    manager.page_table[0][0] = 5
    with pytest.raises(IntegrityError, match="^rows_match_handles: "):
        manager.check_integrity([req])


def test_check_integrity_catches_a_lock_nobody_holds() -> None:
    manager = new_manager(6, 1)
    req = admit(manager, [1, 2, 3], 0)
    prefill(manager, req)
    manager.cache_req(req, finished=True)
    manager.lock(manager.prefix_cache.match_prefix([1, 2]))
    with pytest.raises(IntegrityError, match="^ref_counts_equal_outstanding_locks: "):
        manager.check_integrity([])


def test_the_naive_manager_frees_every_page_when_requests_finish() -> None:
    manager = new_manager(4, 1, type="naive")
    req = admit(manager, [1, 2, 3], 0)
    prefill(manager, req)
    manager.cache_req(req, finished=True)
    assert sorted(manager.free_slots) == [0, 1, 2, 3]
    assert admit(manager, [1, 2, 3], 0).cache_handle.cached_len == 0


@pytest.mark.parametrize("table", [[], [[0, 0], [0]]])
def test_a_page_table_must_be_rows_of_one_length(table: list[list[int]]) -> None:
    from radixspec import reference

    with pytest.raises(InvalidSizeError, match="rows of one length"):
        reference.CacheManager(4, 2, table)
