"""The optimized radix cache: tensors in and out, the eviction heap, devices and dtypes."""

import pytest
import torch

from optimized import NaivePrefixCache, RadixPrefixCache
from reference import RadixPrefixCache as ReferenceCache
from spec.errors import InvalidInputError, InvalidTypeError, StaleHandleError


def test_slots_come_back_as_int32_tensors_on_the_cache_device() -> None:
    cache = RadixPrefixCache(page_size=2, device="cpu")
    cache.insert_prefix(torch.tensor([1, 1, 2, 2]), torch.tensor([6, 7, 0, 1]))
    matched = cache.match_prefix(torch.tensor([1, 1, 2, 2, 3], dtype=torch.int32)).get_matched_indices()
    assert matched.dtype == torch.int32 and matched.tolist() == [6, 7, 0, 1]
    assert cache.evict(3).tolist() == [0, 1, 6, 7]


def test_lists_are_accepted_as_well_as_tensors() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([4, 5], [0, 1])
    assert cache.match_prefix([4, 5]).cached_len == 2


def test_the_cache_keeps_its_own_copy_of_keys_and_slots() -> None:
    tokens, slots = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2], dtype=torch.int32)
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix(tokens, slots)
    tokens[:] = 9
    slots[:] = 5
    assert cache.match_prefix([1, 2, 3]).get_matched_indices().tolist() == [0, 1, 2]
    cache.check_integrity()


@pytest.mark.parametrize(
    ("tokens", "slots", "error"),
    [
        (torch.tensor([[1, 2]]), torch.tensor([0, 1]), InvalidTypeError),
        (torch.tensor([1.0, 2.0]), torch.tensor([0, 1]), InvalidTypeError),
        (torch.tensor([1, -2]), torch.tensor([0, 1]), InvalidInputError),
        (torch.tensor([1, 2]), torch.tensor([0, -1]), InvalidInputError),
        (torch.tensor([1, 2]), torch.tensor([0, 2**31]), InvalidInputError),
    ],
)
def test_bad_tensors_are_rejected_with_nothing_changed(tokens: torch.Tensor, slots: torch.Tensor, error: type) -> None:
    cache = RadixPrefixCache(page_size=1)
    with pytest.raises(error):
        cache.insert_prefix(tokens, slots)
    assert cache.abstract_state().entries == {} and cache.clock == 0


def test_eviction_pops_the_heap_in_lru_order_across_many_leaves() -> None:
    # re-stamped leaves (matches) and leaves exposed by eviction mix the queue and the heap
    fast, slow = RadixPrefixCache(page_size=2), ReferenceCache(page_size=2)
    for i in range(300):
        tokens = [7, 7, i, i]
        fast.insert_prefix(tokens, [0, 1, 2 * i + 2, 2 * i + 3])
        slow.insert_prefix(tokens, [0, 1, 2 * i + 2, 2 * i + 3])
    for i in range(0, 300, 7):
        fast.match_prefix([7, 7, i, i])
        slow.match_prefix([7, 7, i, i])
    for size in (1, 10, 33, 2, 100):
        assert fast.evict(size).tolist() == slow.evict(size)
    fast.check_integrity()
    assert fast.abstract_state() == slow.abstract_state()


def test_stale_heap_entries_are_compacted_and_never_evicted_twice() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1], [0])
    cache.insert_prefix([2], [1])
    for _ in range(500):  # every match re-stamps the leaf: one stale entry each time
        cache.match_prefix([1])
    stats = cache.tree_stats()
    assert stats["fifo_entries"] + stats["heap_entries"] <= 2 * stats["nodes"] + 64
    assert cache.evict(1).tolist() == [1]
    assert cache.evict(1).tolist() == [0]
    cache.check_integrity()


def test_a_handle_on_an_evicted_node_is_stale() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2], [0, 1])
    handle = cache.match_prefix([1, 2])
    cache.evict(1)
    with pytest.raises(StaleHandleError):
        handle.get_matched_indices()


def test_a_handle_from_another_cache_is_rejected() -> None:
    mine, theirs = RadixPrefixCache(1), RadixPrefixCache(1)
    theirs.insert_prefix([1], [0])
    with pytest.raises(InvalidTypeError):
        mine.lock(theirs.match_prefix([1]))


def test_slots_on_another_device_are_rejected() -> None:
    cache = RadixPrefixCache(page_size=1, device="meta")
    with pytest.raises(InvalidTypeError):
        cache.insert_prefix([1], torch.tensor([0]))


def test_the_naive_cache_returns_empty_int32_tensors() -> None:
    cache = NaivePrefixCache(page_size=2)
    handle = cache.insert_prefix(torch.tensor([1, 2]), torch.tensor([0, 1])).handle
    assert handle.get_matched_indices().dtype == torch.int32 and handle.get_matched_indices().numel() == 0
    assert cache.evict(0).numel() == 0


def test_a_leaf_extended_by_an_insert_is_evicted_after_its_new_child() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([0], [0])
    cache.insert_prefix([0, 0], [0, 1])  # stamps [0] and gives it a child under the same stamp
    assert cache.evict(1).tolist() == [1]
    cache.check_integrity()
    assert cache.evict(1).tolist() == [0]
    cache.check_integrity()
