"""The reference radix tree: splits, locks, LRU eviction, staleness, integrity checks."""

import pytest

from radixspec.reference import RadixPrefixCache
from radixspec.reference.radix_cache import RadixTreeNode
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError, InvalidTypeError, StaleHandleError, UnlockError


def test_a_match_that_stops_inside_a_node_splits_it_and_keeps_the_original_as_suffix() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([10, 11, 12, 13], [0, 1, 2, 3])
    (node,) = cache.roots[None].children.values()
    handle = cache.match_prefix([10, 11, 99, 99])
    assert handle.cached_len == 2
    assert handle.node is not node and handle.node.key == [10, 11]
    assert node.key == [12, 13] and node.parent is handle.node


def test_split_at_copies_ref_count_to_the_new_prefix_node() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2, 3], [0, 1, 2])
    cache.lock(cache.match_prefix([1, 2, 3]))
    short = cache.match_prefix([1, 5])  # splits the locked node at 1
    assert short.node.ref_count == 1
    cache.check_integrity()
    assert cache.size_info == (0, 3)


def test_child_key_is_the_first_token_or_the_first_page_tuple() -> None:
    assert RadixTreeNode(1, 0, 0).child_key([7, 8]) == 7
    assert RadixTreeNode(2, 0, 0).child_key([7, 8, 9]) == (7, 8)


def test_eviction_of_part_of_a_node_splits_it_and_evicts_the_tail() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 1, 2, 2, 3, 3], [4, 5, 0, 1, 2, 3])
    handle = cache.match_prefix([1, 1, 2, 2, 3, 3])
    assert cache.evict(2) == [2, 3]
    assert cache.match_prefix([1, 1, 2, 2, 3, 3]).cached_len == 4
    with pytest.raises(StaleHandleError):
        handle.get_matched_indices()
    cache.check_integrity()


def test_evict_takes_the_least_recently_used_leaf_not_the_oldest_insert() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1], [0])
    cache.insert_prefix([2], [1])
    cache.match_prefix([1])  # [1] was inserted first but used last
    assert cache.evict(1) == [1]


def test_handles_on_other_paths_survive_an_eviction() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2], [0, 1])
    cache.insert_prefix([1, 3], [2, 3])
    keep = cache.match_prefix([1, 3])
    cache.match_prefix([1, 3])
    assert cache.evict(1) == [1]
    assert keep.get_matched_indices() == [0, 3]


def test_each_namespace_has_its_own_root() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2], [0, 1], namespace=("tenant", "a"))
    cache.insert_prefix([1, 2], [2, 3], namespace=("tenant", "b"))
    assert set(cache.roots) == {("tenant", "a"), ("tenant", "b")}
    assert cache.match_prefix([1, 2], ("tenant", "b")).get_matched_indices() == [2, 3]


def test_unlock_needs_a_lock_of_this_very_path() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2], [0, 1])
    cache.lock(cache.match_prefix([1, 2]))
    with pytest.raises(UnlockError):
        cache.unlock(cache.match_prefix([1]))
    cache.check_integrity()


def test_a_handle_of_another_cache_is_rejected() -> None:
    mine, theirs = RadixPrefixCache(1), RadixPrefixCache(1)
    theirs.insert_prefix([1], [0])
    with pytest.raises(InvalidTypeError):
        mine.lock(theirs.match_prefix([1]))


def test_abstract_state_has_one_entry_per_page() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 1, 2, 2], [6, 7, 0, 1])
    state = cache.abstract_state()
    assert state.entries == {
        pc.page_key(None, (1, 1), 2): pc.Entry(slot_start=6, last_access=0, ref_count=0, generation=0),
        pc.page_key(None, (1, 1, 2, 2), 2): pc.Entry(slot_start=0, last_access=0, ref_count=0, generation=0),
    }


def test_abstract_handle_names_the_same_path_and_generations() -> None:
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2], [0, 1])
    assert cache.abstract_handle(cache.match_prefix([1, 2, 3])) == pc.Handle(None, (1, 2), (0, 0))


def broken(how: str) -> RadixPrefixCache:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 1, 2, 2], [0, 1, 2, 3])
    cache.insert_prefix([1, 1, 3, 3], [0, 1, 4, 5])
    top = cache.roots[None].children[(1, 1)]
    leaf = top.children[(2, 2)]
    if how == "detached":
        leaf.detached = True
    elif how == "odd length":
        leaf.set_key_value([2, 2, 9], [2, 3, 9])
    elif how == "wrong child key":
        top.children[(9, 9)] = top.children.pop((2, 2))
    elif how == "misaligned value":
        leaf.value = [3, 4]
    elif how == "ref below children":
        leaf.ref_count = 1
        cache.evictable_size -= 2
        cache.protected_size += 2
    elif how == "counters":
        cache.evictable_size += 2
    elif how == "cached starts":
        cache.cached_starts.add(8)
    elif how == "leaf stamps":
        leaf.timestamp = top.children[(3, 3)].timestamp
    elif how == "short value":
        leaf.value = [2]
    elif how == "empty root":
        cache.roots[("x",)] = RadixTreeNode(2, 0, 0)
    elif how == "five empty roots":
        for k in range(5):
            cache.roots[(f"x{k}",)] = RadixTreeNode(2, 0, 0)
    return cache


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("detached", "tree_is_well_formed: detached node of 2 tokens is still in the tree"),
        ("odd length", "tree_is_well_formed: node has 3 tokens and 3 slots, P=2"),
        ("short value", "tree_is_well_formed: node has 2 tokens and 1 slots, P=2"),
        ("wrong child key", "tree_is_well_formed: node of 2 tokens is not its parent's child under its key"),
        ("misaligned value", "tree_is_well_formed: node slots [3, 4]... are not whole aligned pages"),
        ("ref below children", "tree_is_well_formed: node ref_count 0 is below its children's 1"),
        ("counters", "size_counters_match_tree: counters say (8, 0), the tree holds (6, 0)"),
        ("cached starts", "cached_starts_match_tree: 4 starts recorded, 3 in the tree"),
        ("leaf stamps", "leaf_stamps_are_distinct: "),
        ("empty root", "roots_hold_pages: namespaces [('x',)] keep a root without pages"),
        (
            "five empty roots",
            "roots_hold_pages: namespaces [('x0',), ('x1',), ('x2',), ('x3',)] keep a root without pages",
        ),
    ],
)
def test_check_integrity_catches_a_broken_tree(how: str, message: str) -> None:
    broken("none").check_integrity()
    with pytest.raises(IntegrityError) as raised:
        broken(how).check_integrity()
    assert str(raised.value).startswith(message) and (message.endswith(": ") or str(raised.value) == message)


def test_a_long_node_shows_its_first_eight_slots() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix(list(range(1, 13)), list(range(12)))
    node = cache.roots[None].children[(1, 2)]
    node.value = [*range(10), 11, 10]
    with pytest.raises(IntegrityError) as raised:
        cache.check_integrity()
    assert (
        str(raised.value) == "tree_is_well_formed: node slots [0, 1, 2, 3, 4, 5, 6, 7]... are not whole aligned pages"
    )
