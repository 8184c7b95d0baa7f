"""Every named invariant fails on a state that breaks it (no check is a no-op)."""

import pytest

from spec import prefix_cache as pc
from spec.errors import IntegrityError
from spec.invariants import (
    PREFIX_CACHE_INVARIANTS,
    check_invariants,
    free_slots_are_aligned_and_unique,
    pages_are_partitioned,
    private_rows_are_page_runs,
    ref_counts_equal_outstanding_locks,
    rows_match_handles,
    sizes_equal_page_counts,
)
from spec.types import SizeInfo


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
