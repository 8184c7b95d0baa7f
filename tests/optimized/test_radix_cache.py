"""The optimized radix cache: tensors in and out, the eviction heap, devices and dtypes."""

import pytest
import torch

from radixspec.fuzz.targets.ours_optimized import BROKEN_FIELDS, TREE_INVARIANTS
from radixspec.optimized import NaivePrefixCache, RadixPrefixCache
from radixspec.reference import RadixPrefixCache as ReferenceCache
from radixspec.spec.errors import (
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    MisalignedPageError,
    StaleHandleError,
)


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


@pytest.mark.parametrize("cache_type", [RadixPrefixCache, ReferenceCache])
def test_a_page_with_its_start_right_and_an_inner_slot_wrong_is_rejected(cache_type: type) -> None:
    # the second page's start (4) is aligned; its slot at offset 1 belongs to the next page
    cache = cache_type(page_size=4)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    before = cache.abstract_state()
    with pytest.raises(MisalignedPageError):
        cache.insert_prefix([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 9, 6, 7])
    assert cache.abstract_state() == before
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_every_field_the_machines_break_fails_the_check_and_put_back_passes(page_size: int) -> None:
    # the cache machine's break_the_tree, on every node of a small tree: a root, a split, a lock, two leaves
    p, cache = page_size, RadixPrefixCache(page_size=page_size)
    cache.insert_prefix(list(range(4 * p)), list(range(4 * p)))
    cache.insert_prefix(list(range(2 * p)) + [99] * (2 * p), list(range(2 * p)) + list(range(8 * p, 10 * p)))
    cache.lock(cache.match_prefix(list(range(3 * p))))
    stats = cache.tree_stats()
    before = cache.abstract_state()
    broken = 0
    for field, delta in BROKEN_FIELDS:
        delta *= p if field == "length" else 1
        for nth in range(stats["nodes"] + stats["roots"]):
            for position in (0, p - 1, 3 * p):
                if not cache.break_invariant(field, nth, position, delta):
                    continue
                with pytest.raises(IntegrityError) as caught:
                    cache.check_integrity()
                cache.break_invariant(field, nth, position, -delta)
                assert str(caught.value).split(":")[0] in TREE_INVARIANTS
                cache.check_integrity()
                broken += 1
    # at 3 positions each: 7 node changes on each of the 4 nodes (a split prefix, its two halves, a leaf) and the
    # root, a slot and a segment's refs of each of the 4, 8 counters (whatever the node)
    assert (stats["nodes"], stats["roots"]) == (4, 1)
    assert broken == 3 * (7 * 5 + 4 + 4 + 8 * 5)
    assert cache.abstract_state() == before
    with pytest.raises(InvalidInputError, match="break_invariant: no field 'colour'"):
        cache.break_invariant("colour", 0, 0, 1)
    assert not cache.break_invariant("slot", 4, 0, 1)


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
    # (a cache on the meta device is refused itself: tests/optimized/test_hostile_inputs.py)
    cache = RadixPrefixCache(page_size=1, device="cpu")
    with pytest.raises(InvalidTypeError):
        cache.insert_prefix([1], torch.tensor([0], device="meta"))


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


def test_tree_stats_count_what_the_reference_tree_holds() -> None:
    # two namespaces, a split, a locked path: every count against the reference tree's own
    fast, slow = RadixPrefixCache(page_size=2), ReferenceCache(page_size=2)
    for cache in (fast, slow):
        cache.insert_prefix([1, 1, 2, 2, 3, 3], [0, 1, 2, 3, 4, 5])
        cache.insert_prefix([1, 1, 2, 2, 4, 4], [0, 1, 2, 3, 6, 7])
        cache.insert_prefix([5, 5], [8, 9], ("tenant",))
        cache.lock(cache.match_prefix([1, 1, 2, 2, 4, 4]))
    stats = fast.tree_stats()
    leaves = [node for node in slow._iter_nodes() if not node.children]
    assert (stats["evictable_size"], stats["protected_size"]) == (4, 6) == tuple(slow.size_info)
    assert stats["nodes"] == len(list(slow._iter_nodes())) == 4
    assert stats["pages"] == len(slow.abstract_state().entries) == 5
    assert stats["roots"] == len(slow.roots) == 2
    assert stats["fifo_entries"] + stats["heap_entries"] >= sum(1 for leaf in leaves if not leaf.ref_count) == 2
    before = stats["memory_bytes"]
    fast.insert_prefix([6, 6, 7, 7], [10, 11, 12, 13])
    assert fast.tree_stats()["memory_bytes"] > before > 0


def test_path_nodes_counts_the_nodes_up_to_the_root() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2, 3], [0, 1, 2])
    cache.insert_prefix([1, 2, 4], [0, 1, 3])  # splits (1 2 3) into (1 2) and (3)
    cache.insert_prefix([1, 2, 4, 5], [0, 1, 3, 4])
    # a match splits at its end: (1 2) becomes (1)(2) on the match of (1)
    depths = [cache.path_nodes(cache.match_prefix(t)) for t in ([9], [1], [1, 2], [1, 2, 3], [1, 2, 4, 5])]
    assert depths == [0, 1, 2, 3, 4]
    stale = cache.match_prefix([1, 2, 3])
    cache.match_prefix([1, 2, 4, 5])
    cache.evict(1)  # the oldest leaf: (3)
    with pytest.raises(StaleHandleError):
        cache.path_nodes(stale)
    with pytest.raises(InvalidTypeError):
        cache.path_nodes(ReferenceCache(1).match_prefix([1]))


@pytest.mark.parametrize("namespaces", [15, 16, 17, 40])
def test_one_eviction_may_empty_more_namespaces_than_the_first_buffer_holds(namespaces: int) -> None:
    """The C evict lists the roots it emptied in a buffer of 16, grown with the namespaces: none is lost."""
    cache = RadixPrefixCache(page_size=1)
    for n in range(namespaces):
        cache.insert_prefix([n + 1], [n], ("t", n))
    assert len(cache.roots) == namespaces
    assert sorted(cache.evict(namespaces).tolist()) == list(range(namespaces))
    assert cache.roots == {} and not cache.abstract_state().entries
    cache.check_integrity()
    cache.insert_prefix([1], [0], ("t", 0))  # a namespace emptied by eviction comes back as new
    cache.check_integrity()


def test_a_parent_made_a_leaf_by_an_eviction_waits_on_the_heap_in_lru_order() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    cache.insert_prefix([1, 2, 5, 6], [0, 1, 4, 5])  # splits (1 2); (1 2) and (5 6) stamped now
    cache.insert_prefix([9, 9], [6, 7])  # the newest leaf: the FIFO's last stamp
    assert cache.evict(4).tolist() == [2, 3, 4, 5]  # (1 2) is a leaf now, older than (9 9): it goes on the heap
    stats = cache.tree_stats()
    assert (stats["nodes"], stats["pages"], stats["fifo_entries"], stats["heap_entries"]) == (2, 2, 1, 1)
    assert cache.evict(2).tolist() == [0, 1]  # the heap's leaf is the least recently used
    cache.check_integrity()


def test_an_empty_tensor_of_any_dtype_is_no_slots() -> None:
    from radixspec.optimized.inputs import as_slots

    for dtype in (torch.float32, torch.int64, torch.bool):
        slots = as_slots(torch.empty(0, dtype=dtype), torch.device("cpu"))
        assert (slots.dtype, slots.numel()) == (torch.int32, 0)
