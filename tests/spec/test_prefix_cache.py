"""The spec's prefix cache, one operation at a time."""

import pytest

from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import (
    CacheBusyError,
    DuplicateSlotError,
    EvictionError,
    InvalidInputError,
    InvalidSizeError,
    InvalidTypeError,
    LengthMismatchError,
    MisalignedPageError,
    StaleHandleError,
    UnlockError,
)
from radixspec.spec.invariants import check_invariants


def cache_with(page_size: int, *inserts: tuple[list[int], list[int]]) -> pc.PrefixCacheState:
    state = pc.new_state(page_size)
    for tokens, slots in inserts:
        pc.insert_prefix(state, tokens, slots)
    return state


def test_match_prefix_finds_the_longest_cached_whole_page_prefix() -> None:
    state = cache_with(2, ([1, 2, 3, 4], [6, 7, 0, 1]))
    handle = pc.match_prefix(state, [1, 2, 3, 9, 9])
    assert handle.cached_len == 2
    assert pc.get_matched_indices(state, handle) == [6, 7]


def test_match_prefix_never_shares_a_partial_page() -> None:
    state = cache_with(4, ([1, 2, 3, 4], [0, 1, 2, 3]))
    assert pc.match_prefix(state, [1, 2, 3]).cached_len == 0
    assert pc.match_prefix(state, [1, 2, 3, 5]).cached_len == 0


def test_match_prefix_stamps_every_page_on_its_path_with_a_new_tick() -> None:
    state = cache_with(1, ([1, 2, 3], [0, 1, 2]))
    pc.match_prefix(state, [1, 2])
    stamps = {key[1].tokens: entry.last_access for key, entry in state.entries.items()}
    assert stamps == {(1,): 1, (1, 2): 1, (1, 2, 3): 0}
    assert state.clock == 2


def test_a_match_never_crosses_namespaces() -> None:
    state = pc.new_state(1)
    pc.insert_prefix(state, [1, 2], [0, 1], namespace=("lora", 1))
    assert pc.match_prefix(state, [1, 2]).cached_len == 0
    assert pc.match_prefix(state, [1, 2], namespace=("lora", 2)).cached_len == 0
    assert pc.match_prefix(state, [1, 2], namespace=("lora", 1)).cached_len == 2


def test_namespace_must_be_a_tuple_not_a_joined_string() -> None:
    state = pc.new_state(1)
    with pytest.raises(InvalidTypeError):
        pc.match_prefix(state, [1], namespace="lora-1")  # type: ignore[arg-type]


def test_insert_prefix_keeps_cached_pages_and_reports_how_many_were_cached() -> None:
    state = cache_with(2, ([1, 2], [4, 5]))
    result = pc.insert_prefix(state, [1, 2, 3, 4, 5], [8, 9, 0, 1, 7])
    assert result.cached_len == 2
    assert result.handle.cached_len == 4  # the odd last token cannot enter
    assert pc.get_matched_indices(state, result.handle) == [4, 5, 0, 1]


@pytest.mark.parametrize(
    ("tokens", "slots", "error"),
    [
        ([1, 2], [0], LengthMismatchError),
        ([5, 6], [1, 2], MisalignedPageError),
        ([5, 6], [2, 1], MisalignedPageError),
        ([5, 6, 7, 8], [2, 3, 2, 3], DuplicateSlotError),
        ([7, 7], [4, 5], DuplicateSlotError),  # slot 4 is cached under [1, 2]
        ([1, -2], [0, 1], InvalidInputError),
        ([1, 2], [0.0, 1.0], InvalidTypeError),
    ],
)
def test_insert_prefix_rejects_bad_input_and_changes_nothing(tokens: list, slots: list, error: type) -> None:
    state = cache_with(2, ([1, 2], [4, 5]))
    before = pc.PrefixCacheState(state.page_size, dict(state.entries), state.clock)
    with pytest.raises(error):
        pc.insert_prefix(state, tokens, slots)
    assert state == before


def test_insert_prefix_ignores_slots_of_pages_already_cached() -> None:
    state = cache_with(2, ([1, 2], [4, 5]))
    # the caller's own slots for the cached page are not validated: it frees them itself
    result = pc.insert_prefix(state, [1, 2, 3, 4], [99, 98, 0, 1])
    assert result.cached_len == 2


def test_lock_then_unlock_moves_pages_between_protected_and_evictable() -> None:
    state = cache_with(1, ([1, 2, 3], [0, 1, 2]))
    handle = pc.match_prefix(state, [1, 2])
    pc.lock(state, handle)
    assert pc.size_info(state) == (1, 2)
    pc.unlock(state, handle)
    assert pc.size_info(state) == (3, 0)


def test_unlock_without_lock_is_rejected() -> None:
    state = cache_with(1, ([1, 2], [0, 1]))
    with pytest.raises(UnlockError):
        pc.unlock(state, pc.match_prefix(state, [1, 2]))


def test_unlock_of_a_prefix_of_a_locked_path_is_rejected() -> None:
    # found by the fuzzer: allowing it left page (1,) with 0 locks under page (1, 2) with 1
    state = cache_with(1, ([1, 2], [0, 1]))
    pc.lock(state, pc.match_prefix(state, [1, 2]))
    with pytest.raises(UnlockError):
        pc.unlock(state, pc.match_prefix(state, [1]))
    check_invariants(state)


def test_evict_takes_exactly_ceil_size_over_p_pages_lru_leaf_first() -> None:
    state = cache_with(2, ([1, 1, 2, 2], [0, 1, 2, 3]), ([5, 5, 6, 6], [4, 5, 6, 7]))
    pc.match_prefix(state, [1, 1, 2, 2])  # [1 1 2 2] is now the most recent
    assert pc.evict(state, 3) == [4, 5, 6, 7]  # ceil(3/2) = 2 pages, both of the older path
    assert pc.evict(state, 1) == [2, 3]


def test_evict_results_are_sorted_ascending() -> None:
    state = cache_with(1, ([1, 2, 3], [9, 4, 7]))
    assert pc.evict(state, 3) == [4, 7, 9]


def test_evict_never_frees_a_locked_page() -> None:
    state = cache_with(1, ([1, 2], [0, 1]), ([3], [2]))
    pc.lock(state, pc.match_prefix(state, [1, 2]))
    assert pc.evict(state, 1) == [2]
    with pytest.raises(EvictionError):
        pc.evict(state, 1)


def test_evict_rejects_negative_and_oversize_requests() -> None:
    state = cache_with(1, ([1], [0]))
    with pytest.raises(InvalidSizeError):
        pc.evict(state, -1)
    with pytest.raises(EvictionError):
        pc.evict(state, 2)
    assert pc.evict(state, 0) == []
    assert len(state.entries) == 1


def test_a_handle_is_stale_once_a_page_of_its_path_was_evicted_even_if_cached_again() -> None:
    state = cache_with(1, ([1, 2], [0, 1]))
    handle = pc.match_prefix(state, [1, 2])
    pc.evict(state, 1)
    pc.insert_prefix(state, [1, 2], [0, 1])  # same tokens, same slot, new generation
    for operation in (pc.lock, pc.unlock, pc.get_matched_indices):
        with pytest.raises(StaleHandleError):
            operation(state, handle)


def test_reset_returns_every_slot_ascending_and_is_refused_while_locked() -> None:
    state = cache_with(2, ([1, 1, 2, 2], [6, 7, 0, 1]))
    handle = pc.match_prefix(state, [1, 1])
    pc.lock(state, handle)
    with pytest.raises(CacheBusyError):
        pc.reset(state)
    pc.unlock(state, handle)
    assert pc.reset(state) == [0, 1, 6, 7]
    assert state.entries == {}


def test_evictable_pages_are_the_unlocked_leaves() -> None:
    state = pc.new_state(1)
    pc.insert_prefix(state, [1, 2, 3], [0, 1, 2])
    pc.insert_prefix(state, [1, 2, 4], [0, 1, 3])
    pc.insert_prefix(state, [5], [4], ("t",))
    pc.lock(state, pc.match_prefix(state, [1, 2, 4]))
    keys = {tokens: key for key in state.entries for tokens in [key[1].tokens]}
    leaf, locked, inner, other = keys[(1, 2, 3)], keys[(1, 2, 4)], keys[(1, 2)], keys[(5,)]
    assert pc.get_keys_with_children(state) == {keys[(1,)], inner}
    assert sorted(pc.get_evictable_leaves(state), key=repr) == sorted([leaf, other], key=repr)
    with_children = pc.get_keys_with_children(state)
    assert [pc.is_evictable(state, k, with_children) for k in (leaf, locked, inner, other)] == [
        True,
        False,
        False,
        True,
    ]
    assert [pc.is_evictable(state, k) for k in (leaf, locked, inner, other)] == [True, False, False, True]
    assert [pc.has_cached_child(state, k) for k in (leaf, locked, inner, other)] == [False, False, True, False]


def test_a_prefix_prints_its_tokens_or_both_ends_of_a_long_one() -> None:
    short = pc.Prefix.extend(None, tuple(range(12)))
    assert repr(short) == f"Prefix({list(range(12))})"
    long = pc.Prefix.extend(short, (12,))
    assert repr(long) == "Prefix([0, 1, 2, 3, '...', 9, 10, 11, 12])"


def test_a_page_key_names_the_last_whole_page_only() -> None:
    assert pc.page_key(("t",), [1, 2, 3, 4], 2) == (("t",), pc.Prefix.extend(pc.Prefix.extend(None, (1, 2)), (3, 4)))
    for tokens in ([], [1, 2, 3]):
        # the message starts so (pytest, which loads radixspec's plugin, may add its own explanation after it)
        with pytest.raises(AssertionError, match="^a page key covers whole pages"):
            pc.page_key(None, tokens, 2)


def test_prefixes_equal_by_their_tokens_even_when_not_one_object(monkeypatch: pytest.MonkeyPatch) -> None:
    first = pc.Prefix.extend(pc.Prefix.extend(None, (1, 2)), (3, 4))
    monkeypatch.setattr(pc.Prefix, "_interned", {})  # as after the intern table was cleared at its limit
    again = pc.Prefix.extend(pc.Prefix.extend(None, (1, 2)), (3, 4))
    assert again is not first and again.parent is not first.parent
    assert again == first and first == again and hash(again) == hash(first) and first == first
    assert {first: "kept"}[again] == "kept"
    assert first != pc.Prefix.extend(pc.Prefix.extend(None, (1, 9)), (3, 4))  # same last page, another parent
    assert first != pc.Prefix.extend(pc.Prefix.extend(None, (1, 2)), (3, 5))
    assert first != pc.Prefix.extend(None, (1, 2)) and pc.Prefix.extend(None, (1, 2)) != first
    assert first != (1, 2, 3, 4) and first.__eq__((1, 2, 3, 4)) is NotImplemented


def test_equal_prefixes_are_one_object_until_the_intern_table_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc.Prefix, "_interned", {})
    monkeypatch.setattr(pc.Prefix, "INTERN_LIMIT", 3)
    first = pc.Prefix.extend(None, (1, 2))
    assert pc.Prefix.extend(None, (1, 2)) is first and len(pc.Prefix._interned) == 1
    second = pc.Prefix.extend(first, (3, 4))
    pc.Prefix.extend(None, (5, 6))
    assert len(pc.Prefix._interned) == 3 and pc.Prefix.extend(first, (3, 4)) is second
    pc.Prefix.extend(None, (7, 8))  # the table was full: emptied, then this one kept
    assert len(pc.Prefix._interned) == 1
    assert pc.Prefix.extend(None, (1, 2)) == first and pc.Prefix.extend(None, (1, 2)) is not first
