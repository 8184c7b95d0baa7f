"""The hybrid cache's operations, one test per rule of docs/hybrid.md, and each invariant with a breaking example."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import (
    CacheBusyError,
    CacheError,
    DuplicateSlotError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    LengthMismatchError,
    MisalignedPageError,
    MissingPageError,
    StaleHandleError,
    UnlockError,
)
from radixspec.spec.prefix_cache import Prefix
from radixspec.spec.types import SizeInfo

PROMPT = list(range(100, 116))


def two_groups() -> hy.HybridState:
    """P=4, a full group and a window of 8 that holds only pages 2 and 3 of PROMPT."""
    state = hy.new_state(4, (None, 8))
    hy.insert_prefix(state, PROMPT, ([0, 4, 8, 12], [None, None, 8, 12]))
    return state


def snapshot(state: hy.HybridState) -> tuple[object, ...]:
    return (tuple(dict(g) for g in state.groups), dict(state.locks), state.clock)


def test_new_state_rejects_windows_outside_the_domain() -> None:
    for windows, error in [
        ((), InvalidTypeError),
        ((0,), InvalidInputError),
        ((True,), InvalidTypeError),
        (None, InvalidTypeError),
    ]:
        with pytest.raises(error):
            hy.new_state(4, windows)  # type: ignore[arg-type]


def test_match_needs_only_the_window_pages_of_a_window_group() -> None:
    state = two_groups()
    assert hy.match_prefix(state, PROMPT).cached_len == 16
    # L = 12 would use window pages 1 and 2; page 1 is a hole, so the prompt cut to 12 tokens matches 0
    assert hy.match_prefix(state, PROMPT[:15]).cached_len == 0


def test_match_stops_at_the_first_hole_of_a_full_group() -> None:
    state = hy.new_state(2, (None, 1))
    hy.insert_prefix(state, [1, 2, 3, 4, 5, 6], ([0, 2, 4], [None, None, None]))
    assert hy.evict(state, 0, 2) == [4, 5]
    assert hy.match_prefix(state, [1, 2, 3, 4, 5, 6]).cached_len == 4


def test_match_never_crosses_namespaces() -> None:
    state = two_groups()
    assert hy.match_prefix(state, PROMPT, ("lora", 1)).cached_len == 0


def test_a_window_of_one_token_uses_no_page() -> None:
    state = hy.new_state(4, (1,))
    handle = hy.match_prefix(state, PROMPT)
    assert handle.cached_len == 16 and hy.get_matched_pages(state, handle) == [[None] * 4]


def test_match_stamps_only_the_pages_it_uses() -> None:
    state = hy.new_state(4, (None, 4))
    hy.insert_prefix(state, PROMPT, ([0, 4, 8, 12], [0, 4, 8, 12]))
    t = state.clock
    hy.match_prefix(state, PROMPT)
    window = state.groups[1]
    assert [window[k].last_access for k in hy.get_page_keys(state.view(1), None, PROMPT)] == [0, 0, 0, t]
    assert all(e.last_access == t for e in state.groups[0].values())


@pytest.mark.parametrize(
    "pages, error",
    [
        ([[0, 4, 8, 12]], LengthMismatchError),  # one row for two groups
        ([[0, 4, 8], [0, 4, 8, 12]], LengthMismatchError),  # a short row
        ([[0, None, 8, 12], [0, 4, 8, 12]], MissingPageError),  # the full group needs page 1
        ([[0, 4, 8, 12], [0, 5, 8, 12]], MisalignedPageError),
        ([[0, 4, 8, 12], [0, None, 9, 12]], MisalignedPageError),  # after a page the window group released
        ([[0, 4, 8, 12], [0, 4, 4, 12]], DuplicateSlotError),
        ([[0, 4, 8, -4], [0, 4, 8, 12]], InvalidInputError),
        ([[0, 4, 8, 12.0], [0, 4, 8, 12]], InvalidTypeError),
        ("0 4 8 12", InvalidTypeError),
    ],
)
def test_a_rejected_insert_changes_nothing(pages: object, error: type[Exception]) -> None:
    state = hy.new_state(4, (None, 8))
    hy.insert_prefix(state, PROMPT[:4], ([16], [16]))
    before = snapshot(state)
    with pytest.raises(error):
        hy.insert_prefix(state, [7, *PROMPT[1:]], pages)  # type: ignore[arg-type]
    assert snapshot(state) == before


def test_insert_checks_tokens_then_slots_then_namespace_then_lengths_then_pages() -> None:
    state = hy.new_state(4, (None,))
    with pytest.raises(InvalidTypeError, match="input_ids"):
        hy.insert_prefix(state, "x", "y")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="pages"):
        hy.insert_prefix(state, PROMPT, "y", namespace="bad")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="namespace"):
        hy.insert_prefix(state, PROMPT, ([0],), namespace="bad")  # type: ignore[arg-type]
    with pytest.raises(LengthMismatchError):
        hy.insert_prefix(state, PROMPT, ([1],))


def test_insert_heals_a_hole_it_is_given_and_returns_the_starts_it_did_not_take() -> None:
    state = two_groups()
    result = hy.insert_prefix(state, PROMPT, ([20, 24, 28, 32], [16, 4, 28, 32]))
    assert result.unused == ((20, 24, 28, 32), (28, 32))
    assert hy.get_matched_pages(state, hy.match_prefix(state, PROMPT[:12]))[1] == [None, 4, 8]


def test_lock_protects_exactly_the_pages_the_match_uses() -> None:
    state = two_groups()
    handle = hy.match_prefix(state, PROMPT)
    hy.lock(state, handle)
    assert [hy.size_info(state, g).protected_size for g in (0, 1)] == [16, 8]
    hy.check_hybrid_invariants(state, [hy.size_info(state, g) for g in (0, 1)])
    with pytest.raises(CacheBusyError):
        hy.reset(state)
    hy.unlock(state, handle)
    with pytest.raises(UnlockError):
        hy.unlock(state, handle)
    assert hy.reset(state) == [list(range(16)), list(range(8, 16))]


def test_a_shorter_match_on_a_locked_path_cannot_be_unlocked() -> None:
    state = hy.new_state(4, (None, 8))
    hy.insert_prefix(state, PROMPT, ([0, 4, 8, 12], [0, 4, 8, 12]))
    hy.lock(state, hy.match_prefix(state, PROMPT))
    with pytest.raises(UnlockError):
        hy.unlock(state, hy.match_prefix(state, PROMPT[:8]))


def test_a_handle_is_stale_once_a_page_it_uses_is_evicted() -> None:
    state = hy.new_state(4, (None, 8))
    hy.insert_prefix(state, PROMPT, ([0, 4, 8, 12], [0, 4, 8, 12]))
    handle = hy.match_prefix(state, PROMPT)
    # the window's pages 0 and 1 are not used by L = 16: evicting them leaves the handle live
    assert hy.evict(state, 1, 8) == list(range(8))
    assert hy.get_matched_pages(state, handle)[1] == [None, None, 8, 12]
    assert hy.evict(state, 1, 4) == [12, 13, 14, 15]
    with pytest.raises(StaleHandleError):
        hy.lock(state, handle)


def test_a_window_group_evicts_mid_path_and_a_full_group_only_leaves() -> None:
    state = hy.new_state(4, (None, 8))
    hy.insert_prefix(state, PROMPT[:8], ([0, 4], [0, 4]))
    hy.insert_prefix(state, PROMPT, ([0, 4, 8, 12], [0, 4, 8, 12]))
    # oldest stamps: pages 0, 1 (stamped by both inserts, last by the second); ties go deeper first
    assert hy.evict(state, 1, 4) == [12, 13, 14, 15]
    assert hy.evict(state, 0, 4) == [12, 13, 14, 15]
    hy.match_prefix(state, PROMPT[:4])  # page 0 is now the newest in both groups
    assert hy.evict(state, 1, 4) == [8, 9, 10, 11]
    assert hy.evict(state, 1, 4) == [4, 5, 6, 7]  # mid-path: page 0 stays
    assert hy.evict(state, 0, 4) == [8, 9, 10, 11]  # a full group: the leaf, never page 0 under page 1
    hy.check_hybrid_invariants(state)


def test_evict_rejects_a_bad_group_or_size_and_changes_nothing() -> None:
    state = two_groups()
    before = snapshot(state)
    for group, size, error in [
        (2, 1, InvalidInputError),
        ("0", 1, InvalidTypeError),
        (1, 9, Exception),
        (0, -1, InvalidInputError),
    ]:
        with pytest.raises(error):
            hy.evict(state, group, size)  # type: ignore[arg-type]
        assert snapshot(state) == before


def test_the_safety_law_needs_every_attended_page() -> None:
    windows = (None, 4)
    assert hy.attended_pages_are_held(windows, 4, {1: (10, ([0, 4, 8], [None, 4, 8]))}) is None
    assert hy.attended_pages_are_held(windows, 4, {1: (10, ([0, None, 8], [None, 4, 8]))}) is not None
    assert hy.attended_pages_are_held(windows, 4, {1: (10, ([0, 4], [None, 4]))}) is not None


# ---------------------------------------------------------------- invariants


def key(*tokens: int) -> pc.PageKey:
    prefix = None
    for start in range(0, len(tokens), 4):
        prefix = Prefix.extend(prefix, tuple(tokens[start : start + 4]))
    assert prefix is not None
    return (None, prefix)


def edit(state: hy.HybridState, group: int, page: pc.PageKey, **fields: int) -> hy.HybridState:
    state.groups[group][page] = state.groups[group][page]._replace(**fields)
    return state


BROKEN = {
    "groups_hold_their_cache_invariants": lambda s: edit(s, 1, key(*PROMPT[:12]), slot_start=12),
    "ref_counts_equal_outstanding_locks": lambda s: edit(s, 1, key(*PROMPT), ref_count=1),
    # a second page at depth 12 with the stamp of the first: evict could not choose between them
    "eviction_order_is_total": lambda s: s.groups[1].update({key(*PROMPT[:8], 1, 1, 1, 1): pc.Entry(40, 0, 0, 0)}) or s,
}


# what each invariant says on its breaking example
BROKEN_MESSAGES = {
    "groups_hold_their_cache_invariants": "group 1 (window 8): page_slots_are_unique: slots [12] are held by more "
    "than one page",
    "ref_counts_equal_outstanding_locks": "group 1: page ending at token 16 has ref_count 1, 0 outstanding locks "
    "use it",
    "eviction_order_is_total": "group 1: 2 pages share stamp 0 at depth 12 tokens",
}


def test_each_invariant_says_what_it_found() -> None:
    for name, message in BROKEN_MESSAGES.items():
        predicate = next(f for f in hy.HYBRID_INVARIANTS if f.__name__ == name)
        assert predicate(BROKEN[name](two_groups())) == message


def test_a_locked_page_missing_from_its_group_is_named() -> None:
    state = two_groups()
    hy.lock(state, hy.match_prefix(state, PROMPT))
    del state.groups[1][key(*PROMPT)]
    assert hy.ref_counts_equal_outstanding_locks(state) == "group 1: 1 pages used by outstanding locks are not cached"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: hy.evict(s, 5, 1), "group 5 is not one of the cache's 2 groups"),
        (
            lambda s: hy.insert_prefix(s, PROMPT, "0 4 8 12"),
            "pages must be a tuple with one sequence per group, got str",
        ),
        (
            lambda s: hy.insert_prefix(s, [7, *PROMPT[1:]], ([16, None, 24, 28], [16, 20, 24, 28])),
            "group 0 (full attention) needs page 1, which it does not cache",
        ),
    ],
)
def test_a_rejection_says_why(call: object, message: str) -> None:
    with pytest.raises(CacheError) as caught:
        call(two_groups())  # type: ignore[operator]
    assert str(caught.value) == message


def test_every_hybrid_invariant_has_a_breaking_example() -> None:
    assert set(BROKEN) == {f.__name__ for f in hy.HYBRID_INVARIANTS}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_hybrid_invariant_fails_on_its_breaking_example(name: str) -> None:
    state = two_groups()
    hy.check_hybrid_invariants(state)
    broken = BROKEN[name](state)
    predicate = next(f for f in hy.HYBRID_INVARIANTS if f.__name__ == name)
    assert predicate(broken) is not None
    with pytest.raises(IntegrityError, match=name):
        hy.check_hybrid_invariants(broken)


def test_a_window_group_keeps_holes_that_a_full_group_may_not() -> None:
    state = two_groups()
    state.groups[0].pop(key(*PROMPT[:4]))
    assert "entries_are_prefix_closed" in (hy.groups_hold_their_cache_invariants(state) or "")


# ---------------------------------------------------------------- the definition and the single-group cache


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.integers(1, 4),
    windows=st.lists(st.one_of(st.none(), st.integers(1, 12)), min_size=1, max_size=3),
    holes=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=3, max_size=3),
)
def test_the_match_is_the_longest_valid_length(
    page_size: int, windows: list[int | None], holes: list[list[bool]]
) -> None:
    state = hy.new_state(page_size, windows)
    tokens = list(range(6 * page_size))
    rows = [[None if hole else (g * 6 + k) * page_size for k, hole in enumerate(holes[g])] for g in range(len(windows))]
    rows = [
        [(g * 6 + k) * page_size if w is None else s for k, s in enumerate(row)]
        for g, (w, row) in enumerate(zip(windows, rows, strict=True))
    ]
    hy.insert_prefix(state, tokens, rows)
    keys = pc.get_page_keys(state.view(0), None, tokens)
    valid = [n * page_size for n in range(7) if hy.is_valid_match(state, keys, n * page_size)]
    assert hy.match_prefix(state, tokens).cached_len == max(valid)


OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]), st.integers(0, 3), st.integers(0, 12)),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPERATIONS)
def test_one_full_group_is_the_single_group_cache(ops: list[tuple[str, int, int]]) -> None:
    """With one full-attention group the hybrid model is spec/prefix_cache.py, operation for operation."""
    p = 2
    single, hybrid = pc.new_state(p), hy.new_state(p, (None,))
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 1, 2], [1, 2]]
    handles: list[tuple[pc.Handle, hy.HybridHandle]] = []
    next_slot = 0
    for op, which, size in ops:
        tokens = prompts[which]
        if op == "insert":
            slots = list(range(next_slot, next_slot + len(tokens)))
            next_slot += len(tokens)
            r1 = pc.insert_prefix(single, tokens, slots)
            r2 = hy.insert_prefix(hybrid, tokens, (slots[::p],))
            assert r1.handle.cached_len == r2.handle.cached_len
            handles.append((r1.handle, r2.handle))
        elif op == "match":
            handles.append((pc.match_prefix(single, tokens), hy.match_prefix(hybrid, tokens)))
            assert handles[-1][0].cached_len == handles[-1][1].cached_len
        elif op in ("lock", "unlock") and handles:
            h1, h2 = handles[which % len(handles)]
            outcomes = []
            for call, state, handle in [(getattr(pc, op), single, h1), (getattr(hy, op), hybrid, h2)]:
                try:
                    call(state, handle)
                    outcomes.append(None)
                except (StaleHandleError, UnlockError) as error:
                    outcomes.append(type(error))
            assert outcomes[0] == outcomes[1]
        elif op == "evict":
            size = min(size, pc.size_info(single).evictable_size)
            assert pc.evict(single, size) == hy.evict(hybrid, 0, size)
        assert dict(single.entries) == hybrid.groups[0]
        hy.check_hybrid_invariants(hybrid, [hy.size_info(hybrid, 0)])


def test_a_match_that_uses_no_page_holds_no_lock() -> None:
    """Regression (the single-group property above): an empty match locks and unlocks as a no-op, as in
    spec/prefix_cache.py, instead of refusing the unlock."""
    state = hy.new_state(2, (None,))
    handle = hy.match_prefix(state, [1, 2])
    assert handle.cached_len == 0
    hy.unlock(state, handle)
    hy.lock(state, handle)
    assert not state.locks
    hy.reset(state)


# ---------------------------------------------------------------- state groups (Mamba, linear attention)


def with_state() -> hy.HybridState:
    """P=4, a full group and a state group holding checkpoints after 4 and 12 tokens of PROMPT (slots 7, 3)."""
    state = hy.new_state(4, (None, hy.STATE))
    hy.insert_prefix(state, PROMPT[:12], ([0, 4, 8], [7, None, 3]))
    return state


def test_a_state_group_matches_only_where_a_checkpoint_is_cached() -> None:
    state = with_state()
    # 16 tokens: the full group caches 12 of them; the checkpoint after 12 serves L = 12
    assert hy.match_prefix(state, PROMPT).cached_len == 12
    # no checkpoint after 8: L = 8 is not valid, the next shorter one after 4 is
    handle = hy.match_prefix(state, PROMPT[:11])
    assert handle.cached_len == 4
    assert hy.get_matched_pages(state, handle) == [[0], [7]]


def test_a_state_group_counts_and_evicts_checkpoints_of_one_slot_anywhere_on_a_path() -> None:
    state = with_state()
    assert hy.size_info(state, 1) == (2, 0)
    # a checkpoint is one slot, not a page: no alignment; the one in the middle of the path may go
    handle = hy.match_prefix(state, PROMPT)
    hy.lock(state, handle)
    assert hy.size_info(state, 1) == (1, 1)
    assert hy.evict(state, 1, 1) == [7]
    hy.check_hybrid_invariants(state, [hy.size_info(state, g) for g in range(2)])
    hy.unlock(state, handle)
    assert hy.reset(state) == [list(range(12)), [3]]


def test_a_state_checkpoint_already_held_by_another_entry_is_refused() -> None:
    state = with_state()
    with pytest.raises(DuplicateSlotError):
        hy.insert_prefix(state, PROMPT, ([0, 4, 8, 12], [None, None, None, 3]))


def test_the_trees_refuse_a_state_group_they_do_not_model() -> None:
    with pytest.raises(InvalidInputError, match="no state groups"):
        hy.check_windows((None, hy.STATE))
    assert hy.check_windows((None, hy.STATE), state_groups=True) == (None, "state")


def test_a_state_group_keeps_the_invariants_that_do_not_need_whole_pages_of_slots() -> None:
    state = with_state()
    hy.check_hybrid_invariants(state)
    # two checkpoints in one slot
    broken = edit(state, 1, key(*PROMPT[:4]), slot_start=3)
    assert hy.groups_hold_their_cache_invariants(broken) == (
        "group 1 (state): page_slots_are_unique: slots [3] are held by more than one page"
    )
    # a size reported in tokens instead of checkpoints
    assert (
        hy.sizes_equal_entry_counts(with_state(), 1, SizeInfo(8, 0)) == "size_info reports (8, 0), entries give (2, 0)"
    )
