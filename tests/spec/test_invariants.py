"""Every named invariant fails on a state that breaks it (no check is a no-op)."""

import pytest

from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError
from radixspec.spec.invariants import (
    PREFIX_CACHE_INVARIANTS,
    check_invariants,
    free_slots_are_aligned_and_unique,
    pages_are_partitioned,
    private_rows_are_page_runs,
    ref_counts_equal_outstanding_locks,
    rows_match_handles,
    sizes_equal_page_counts,
)
from radixspec.spec.types import SizeInfo


def healthy() -> pc.PrefixCacheState:
    state = pc.new_state(2)
    pc.insert_prefix(state, [1, 1, 2, 2], [0, 1, 2, 3])
    pc.insert_prefix(state, [1, 1, 3, 3], [0, 1, 4, 5])
    return state


def key(*tokens: int) -> pc.PageKey:
    """The key of ``tokens`` in pages of 2 (a last page of 1 token breaks keys_are_whole_pages)."""
    prefix = None
    for start in range(0, len(tokens), 2):
        prefix = pc.Prefix.extend(prefix, tokens[start : start + 2])
    assert prefix is not None
    return (None, prefix)


def edit(state: pc.PrefixCacheState, page: pc.PageKey, **fields: int) -> pc.PrefixCacheState:
    state.entries[page] = state.entries[page]._replace(**fields)
    return state


def without(state: pc.PrefixCacheState, page: pc.PageKey) -> pc.PrefixCacheState:
    del state.entries[page]
    return state


BROKEN = {
    "keys_are_whole_pages": lambda s: s.entries.update({key(1, 1, 2): s.entries[key(1, 1)]}) or s,
    "entries_are_prefix_closed": lambda s: without(s, key(1, 1)),
    "ref_counts_cover_children": lambda s: edit(s, key(1, 1, 2, 2), ref_count=1),
    "page_slots_are_aligned": lambda s: edit(s, key(1, 1, 2, 2), slot_start=3),
    "page_slots_are_unique": lambda s: edit(s, key(1, 1, 2, 2), slot_start=4),
    "stamps_are_in_the_past": lambda s: edit(s, key(1, 1, 2, 2), last_access=99),
    "stamps_grow_toward_the_root": lambda s: edit(s, key(1, 1), last_access=0),
    "leaf_stamps_are_distinct": lambda s: edit(s, key(1, 1, 2, 2), last_access=1),
}


def test_every_prefix_cache_invariant_has_a_breaking_example() -> None:
    assert set(BROKEN) == {f.__name__ for f in PREFIX_CACHE_INVARIANTS}


def test_a_healthy_state_passes_every_invariant() -> None:
    check_invariants(healthy())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_invariants_names_the_broken_invariant(name: str) -> None:
    with pytest.raises(IntegrityError, match=f"^{name}: "):
        check_invariants(BROKEN[name](healthy()))


def test_sizes_must_equal_page_counts() -> None:
    assert sizes_equal_page_counts(healthy(), SizeInfo(6, 0)) is None
    assert "size_info reports" in (sizes_equal_page_counts(healthy(), SizeInfo(4, 0)) or "")


def test_ref_counts_must_equal_outstanding_locks() -> None:
    state = healthy()
    assert ref_counts_equal_outstanding_locks(state, {}) is None
    assert ref_counts_equal_outstanding_locks(state, {key(1, 1): 1}) is not None


def test_free_list_must_hold_each_page_start_once() -> None:
    assert free_slots_are_aligned_and_unique([0, 2, 4], 2, 3) is None
    assert "double free" in (free_slots_are_aligned_and_unique([0, 2, 0], 2, 3) or "")
    assert free_slots_are_aligned_and_unique([1], 2, 3) is not None
    assert free_slots_are_aligned_and_unique([6], 2, 3) is not None


def test_pages_must_be_partitioned_between_free_cached_and_private() -> None:
    assert pages_are_partitioned(3, 2, [0], [2], {0: [4, 5]}) is None
    assert "two owners" in (pages_are_partitioned(3, 2, [0], [2], {0: [2, 3]}) or "")
    assert "leaked pages [4]" in (pages_are_partitioned(3, 2, [0], [2], {}) or "")


def test_private_rows_must_be_whole_pages() -> None:
    assert private_rows_are_page_runs({0: [4, 5]}, 2) is None
    assert private_rows_are_page_runs({0: [5, 4]}, 2) is not None
    assert private_rows_are_page_runs({0: [4]}, 2) is not None


def test_rows_must_match_their_handles() -> None:
    assert rows_match_handles({0: ([0, 1], [0, 1])}) is None
    assert rows_match_handles({0: ([0, 1], [2, 3])}) is not None


def test_the_accounting_invariants_say_exactly_what_is_wrong_and_show_eight_pages_at_most() -> None:
    state = healthy()
    assert ref_counts_equal_outstanding_locks(state, {key(1, 1): 1}) == (
        "page ending at token 2 has ref_count 0, 1 locks cover it"
    )
    locked = edit(healthy(), key(1, 1, 3, 3), ref_count=2)
    assert ref_counts_equal_outstanding_locks(locked, {}) == "page ending at token 4 has ref_count 2, 0 locks cover it"
    assert ref_counts_equal_outstanding_locks(locked, {key(1, 1, 3, 3): 2, key(1, 1): 0}) is None
    assert ref_counts_equal_outstanding_locks(state, {key(5, 5): 0}) is None  # no lock: nothing missing
    assert ref_counts_equal_outstanding_locks(state, {key(5, 5): 1, key(7, 7): 2}) == "2 locked pages are not cached"
    odd = list(range(1, 21, 2))  # ten misaligned starts
    assert free_slots_are_aligned_and_unique(odd, 2, 16) == (
        "free list holds [1, 3, 5, 7, 9, 11, 13, 15], not page starts of a pool of 16 pages of 2"
    )
    twice = [2 * n for n in range(10)] * 2
    assert free_slots_are_aligned_and_unique(twice, 2, 16) == (
        "pages [0, 2, 4, 6, 8, 10, 12, 14] are on the free list twice (double free)"
    )
    assert pages_are_partitioned(20, 1, [], [], {}) == (
        "free 0 + cached 0 + private 0 != num_pages 20: leaked pages [0, 1, 2, 3, 4, 5, 6, 7], unknown pages []"
    )
    assert pages_are_partitioned(1, 1, list(range(10)), [], {}) == (
        "free 10 + cached 0 + private 0 != num_pages 1: leaked pages [], unknown pages [1, 2, 3, 4, 5, 6, 7, 8]"
    )
    assert pages_are_partitioned(3, 2, [0], [2], {1: [4, 5]}) is None
    assert pages_are_partitioned(4, 2, [0], [2], {1: [4, 5]}) == (
        "free 1 + cached 1 + private 1 != num_pages 4: leaked pages [6], unknown pages []"
    )
    assert private_rows_are_page_runs({3: [4, 5, 7, 6]}, 2) == "row 3: positions 2..3 map to [7, 6]"
    assert private_rows_are_page_runs({3: [4, 5, 6]}, 2) == "row 3: private part of 3 slots is not whole pages"
    assert rows_match_handles({2: (list(range(10)), list(range(1, 11)))}) == (
        "row 2 maps its cached prefix to [0, 1, 2, 3, 4, 5, 6, 7]..., the tree to [1, 2, 3, 4, 5, 6, 7, 8]..."
    )


def test_a_page_of_the_wrong_size_or_a_stamp_of_now_breaks_its_invariant() -> None:
    from radixspec.spec.invariants import keys_are_whole_pages, stamps_are_in_the_past

    state = healthy()
    assert keys_are_whole_pages(state) is None and stamps_are_in_the_past(state) is None
    # (1 1 2) then (2): 4 tokens, whole pages in length, but its pages are not of P = 2 tokens
    odd = pc.Prefix.extend(pc.Prefix.extend(None, (1, 1, 2)), (2,))
    state.entries[(None, odd)] = pc.Entry(slot_start=8, last_access=0, ref_count=0, generation=0)
    assert keys_are_whole_pages(state) is not None
    now = edit(healthy(), key(1, 1), last_access=healthy().clock)
    assert stamps_are_in_the_past(now) is not None
