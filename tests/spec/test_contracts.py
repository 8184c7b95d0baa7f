"""The cache operations' contracts (spec/contracts.py), driven by Hypothesis over the same bounded programs
CrossHair searches symbolically (``tox -e crosshair``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixspec.spec import contracts
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import CacheBusyError, EvictionError, LengthMismatchError, UnlockError
from radixspec.spec.prefix_cache import OPERATIONS
from radixspec.spec.types import SizeInfo

page_sizes = st.integers(1, 2)
programs = st.lists(st.integers(0, 10), max_size=5)
indices = st.integers(0, 2)


@settings(max_examples=300, deadline=None)
@given(page_sizes, programs, indices)
def test_match_prefix_contract(page_size: int, program: list[int], index: int) -> None:
    assert contracts.match_prefix_contract(page_size, program, index)


@settings(max_examples=300, deadline=None)
@given(page_sizes, st.lists(st.integers(0, 10), max_size=4), indices, st.integers(0, 3))
def test_insert_prefix_contract(page_size: int, program: list[int], index: int, bad: int) -> None:
    assert contracts.insert_prefix_contract(page_size, program, index, bad)


@settings(max_examples=300, deadline=None)
@given(page_sizes, programs, indices)
def test_lock_unlock_contract(page_size: int, program: list[int], index: int) -> None:
    assert contracts.lock_unlock_contract(page_size, program, index)


@settings(max_examples=300, deadline=None)
@given(page_sizes, programs, st.integers(-1, 12))
def test_evict_contract(page_size: int, program: list[int], size: int) -> None:
    assert contracts.evict_contract(page_size, program, size)


@settings(max_examples=300, deadline=None)
@given(page_sizes, programs)
def test_reset_contract(page_size: int, program: list[int]) -> None:
    assert contracts.reset_contract(page_size, program)


@settings(max_examples=300, deadline=None)
@given(page_sizes, programs)
def test_size_info_contract(page_size: int, program: list[int]) -> None:
    assert contracts.size_info_contract(page_size, program)


def test_the_size_info_contract_fails_when_a_locked_page_counts_as_evictable(monkeypatch: pytest.MonkeyPatch) -> None:
    # insert (1 1 2 2 3) at P = 2, lock its match: two pages protected; a size_info that forgets the locks fails
    assert contracts.size_info_contract(2, [0, 6])
    monkeypatch.setattr(contracts, "size_info", lambda state: SizeInfo(len(state.entries) * state.page_size, 0))
    assert not contracts.size_info_contract(2, [0, 6])


def test_every_operation_of_the_spec_has_a_contract() -> None:
    assert set(contracts.CONTRACTS) == set(OPERATIONS)


def test_a_locked_leaf_is_never_evicted_even_when_oldest() -> None:
    # insert (1 2 3), lock it, insert (1 5): the oldest leaf is locked, evict(1) must take (1 5)
    assert contracts.evict_contract(1, [0, 6, 2], 1)


# ---------------------------------------------------------------- the harness builds what it says


def test_the_sequences_share_prefixes_and_end_in_partial_pages() -> None:
    assert [contracts.sequence(2, k) for k in range(3)] == [[1, 1, 2, 2, 3], [1, 1, 2, 2, 4, 4], [1, 1, 5]]
    assert [contracts.sequence(1, k) for k in range(3)] == [[1, 2, 3], [1, 2, 4], [1, 5]]


def test_fresh_slots_reuse_the_cached_pages_then_take_the_lowest_free_ones() -> None:
    state, _ = contracts.build(2, [0])  # (1 1)(2 2) at slots 0 and 2; the partial (3) is not cached
    assert contracts.fresh_slots(state, [1, 1, 2, 2, 4, 4]) == [0, 1, 2, 3, 4, 5]
    assert contracts.fresh_slots(state, [7, 7, 8]) == [4, 5, 6]
    assert contracts.fresh_slots(pc.new_state(1), [5]) == [0]


def pages(state: pc.PrefixCacheState) -> dict[tuple[int, ...], tuple[int, int]]:
    """token prefix -> (slot_start, ref_count) of every cached page."""
    return {key[1].tokens: (entry.slot_start, entry.ref_count) for key, entry in state.entries.items()}


def test_build_runs_each_op_code_as_documented() -> None:
    state, locked = contracts.build(1, [0, 1, 2])  # three inserts: a shared (1), a shared (1 2)
    assert pages(state) == {(1,): (0, 0), (1, 2): (1, 0), (1, 2, 3): (2, 0), (1, 2, 4): (3, 0), (1, 5): (4, 0)}
    assert locked == [] and state.clock == 3
    state, locked = contracts.build(2, [0, 3, 6])  # insert, match, lock the match
    assert pages(state) == {(1, 1): (0, 1), (1, 1, 2, 2): (2, 1)} and state.clock == 2
    assert [handle.cached_len for handle in locked] == [4]
    assert pages(contracts.build(2, [0, 6, 7])[0]) == {(1, 1): (0, 0), (1, 1, 2, 2): (2, 0)}
    assert contracts.build(2, [0, 6, 7])[1] == []
    assert pages(contracts.build(2, [0, 8])[0]) == {(1, 1): (0, 0)}  # one page evicted
    assert pages(contracts.build(2, [2, 0, 9])[0]) == {}  # all evicted
    assert pages(contracts.build(2, [0, 10])[0]) == {}  # reset
    assert len(pages(contracts.build(2, [0, 6, 10])[0])) == 2  # a locked cache refuses the reset
    assert pages(contracts.build(2, [4, 5, 7, 6, 1])[0]) == {
        (1, 1): (0, 0),
        (1, 1, 2, 2): (2, 0),
        (1, 1, 2, 2, 4, 4): (4, 0),
    }


# ---------------------------------------------------------------- each contract fails on a broken operation


def test_the_match_contract_fails_when_a_match_moves_a_page(monkeypatch: pytest.MonkeyPatch) -> None:
    def locking_match(state: pc.PrefixCacheState, tokens: list[int]) -> pc.Handle:
        handle = pc.match_prefix(state, tokens)
        pc.lock(state, handle)
        return handle

    assert contracts.match_prefix_contract(2, [0], 0)
    monkeypatch.setattr(contracts, "match_prefix", locking_match)
    assert not contracts.match_prefix_contract(2, [0], 0)


def test_the_insert_contract_fails_on_a_short_insert_or_a_bad_one_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(contracts.insert_prefix_contract(2, [2], 1, bad) for bad in range(4))

    def short_insert(state: pc.PrefixCacheState, tokens: list[int], slots: list[int]) -> pc.InsertResult:
        return pc.insert_prefix(state, tokens[:-2], slots[:-2])

    monkeypatch.setattr(contracts, "insert_prefix", short_insert)
    assert not contracts.insert_prefix_contract(2, [2], 1, 0)

    def lenient_insert(state: pc.PrefixCacheState, tokens: list[int], slots: list[int]) -> pc.InsertResult:
        return pc.insert_prefix(state, tokens[: len(slots)], slots)  # takes the tokens it has slots for

    monkeypatch.setattr(contracts, "insert_prefix", lenient_insert)
    assert not contracts.insert_prefix_contract(2, [2], 1, 3)

    def confused_insert(state: pc.PrefixCacheState, tokens: list[int], slots: list[int]) -> pc.InsertResult:
        raise LengthMismatchError("whatever is wrong")  # the right refusal, the wrong reason

    monkeypatch.setattr(contracts, "insert_prefix", confused_insert)
    assert [contracts.insert_prefix_contract(2, [2], 1, bad) for bad in range(4)] == [False, False, False, True]


def test_the_lock_contract_fails_on_an_unlock_that_does_nothing_or_never_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert contracts.lock_unlock_contract(2, [0], 0)
    monkeypatch.setattr(contracts, "unlock", lambda state, handle: None)
    assert not contracts.lock_unlock_contract(2, [0], 0)

    def forgiving_unlock(state: pc.PrefixCacheState, handle: pc.Handle) -> None:
        if pc.is_handle_locked(state, handle):
            pc.unlock(state, handle)

    monkeypatch.setattr(contracts, "unlock", forgiving_unlock)
    assert not contracts.lock_unlock_contract(2, [0], 0)


def test_the_evict_contract_fails_on_one_page_too_many_or_unsorted_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    assert contracts.evict_contract(2, [0, 2], 2)
    monkeypatch.setattr(contracts, "evict", lambda state, size: pc.evict(state, size + 2))
    assert not contracts.evict_contract(2, [0, 2], 2)
    monkeypatch.setattr(contracts, "evict", lambda state, size: pc.evict(state, size)[::-1])
    assert not contracts.evict_contract(2, [0, 2], 4)


def test_the_reset_contract_fails_on_a_reset_of_a_locked_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    assert contracts.reset_contract(2, [0, 6])

    def forced_reset(state: pc.PrefixCacheState) -> list[int]:
        for entry in list(state.entries):
            state.entries[entry] = state.entries[entry]._replace(ref_count=0)
        return pc.reset(state)

    monkeypatch.setattr(contracts, "reset", forced_reset)
    assert not contracts.reset_contract(2, [0, 6])


def test_a_refusal_that_changed_the_cache_breaks_the_evict_and_reset_contracts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def evict_then_refuse(state: pc.PrefixCacheState, size: int) -> list[int]:
        pc.evict(state, min(size, pc.size_info(state).evictable_size))
        raise EvictionError("too late: some pages went")

    assert contracts.evict_contract(2, [0], 12)  # refused (12 > 4 evictable), nothing changed
    monkeypatch.setattr(contracts, "evict", evict_then_refuse)
    assert not contracts.evict_contract(2, [0], 12)

    def unlock_then_refuse(state: pc.PrefixCacheState) -> list[int]:
        for key, entry in list(state.entries.items()):
            state.entries[key] = entry._replace(ref_count=0)
        raise CacheBusyError("a path was locked")

    monkeypatch.setattr(contracts, "reset", unlock_then_refuse)
    assert not contracts.reset_contract(2, [0, 6])


def test_a_reset_refused_for_one_locked_token_keeps_the_contract() -> None:
    # P = 1: (1 5) cached, the match of (1 2 3) finds (1) and locks it: one protected token
    state, locked = contracts.build(1, [2, 3, 6])
    assert pc.size_info(state).protected_size == 1 and len(locked) == 1
    assert contracts.reset_contract(1, [2, 3, 6])


def test_a_lock_that_protects_nothing_breaks_the_lock_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    assert contracts.lock_unlock_contract(1, [2], 0)
    monkeypatch.setattr(contracts, "lock", lambda state, handle: None)
    monkeypatch.setattr(contracts, "unlock", lambda state, handle: None)
    assert not contracts.lock_unlock_contract(1, [2], 0)  # (1) matched, never protected


def test_the_insert_contract_fails_when_bad_slots_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """An insert that ignores the slots it is given (storing at good ones) accepts what it must refuse."""

    def deaf_insert(state: pc.PrefixCacheState, tokens: list[int], slots: list[int]) -> pc.InsertResult:
        return pc.insert_prefix(state, tokens, contracts.fresh_slots(state, tokens))

    assert contracts.insert_prefix_contract(2, [2], 1, 0) and contracts.insert_prefix_contract(2, [2], 0, 3)
    monkeypatch.setattr(contracts, "insert_prefix", deaf_insert)
    assert contracts.insert_prefix_contract(2, [2], 1, 0)  # good slots: the same insert
    assert [contracts.insert_prefix_contract(2, [2], 1, bad) for bad in (1, 2, 3)] == [False, False, False]
    # [1 1 2 2 3] ends in a partial page: one slot short still covers its whole pages, and must be refused
    assert not contracts.insert_prefix_contract(2, [2], 0, 3)


def test_the_lock_contract_fails_on_a_lock_that_protects_nothing_even_when_unlock_refuses_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The protected-size clause alone: a no-op lock whose unlocks look right (one accepted, then refused)."""
    calls: list[int] = []

    def unlock_once(state: pc.PrefixCacheState, handle: pc.Handle) -> None:
        calls.append(1)
        if len(calls) > 1:
            raise UnlockError("no lock ends here")

    assert contracts.lock_unlock_contract(2, [0], 0)
    monkeypatch.setattr(contracts, "lock", lambda state, handle: None)
    monkeypatch.setattr(contracts, "unlock", unlock_once)
    assert not contracts.lock_unlock_contract(2, [0], 0)


def test_the_lock_contract_asks_a_one_token_path_to_refuse_a_second_unlock(monkeypatch: pytest.MonkeyPatch) -> None:
    def forgiving_unlock(state: pc.PrefixCacheState, handle: pc.Handle) -> None:
        if pc.is_handle_locked(state, handle):
            pc.unlock(state, handle)

    state, _ = contracts.build(1, [0])
    assert pc.match_prefix(state, contracts.sequence(1, 2)).cached_len == 1  # (1 5) finds (1) of (1 2 3)
    assert contracts.lock_unlock_contract(1, [0], 2)
    monkeypatch.setattr(contracts, "unlock", forgiving_unlock)
    assert not contracts.lock_unlock_contract(1, [0], 2)


@pytest.mark.parametrize("refused", ["nothing", "all that is evictable"])
def test_the_evict_contract_fails_on_a_refusal_of_a_size_it_can_take(
    monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    def refusing_evict(state: pc.PrefixCacheState, size: int) -> list[int]:
        if size in (0, pc.size_info(state).evictable_size):
            raise EvictionError(f"refused {size}")
        return pc.evict(state, size)

    size = 0 if refused == "nothing" else 4  # [1 1 2 2] cached, 4 tokens evictable
    assert contracts.evict_contract(2, [0], size)
    monkeypatch.setattr(contracts, "evict", refusing_evict)
    assert not contracts.evict_contract(2, [0], size)


def test_the_reset_contract_fails_on_a_refusal_of_an_unlocked_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing_reset(state: pc.PrefixCacheState) -> list[int]:
        raise CacheBusyError("busy, says the reset")

    assert contracts.reset_contract(2, [0])
    monkeypatch.setattr(contracts, "reset", refusing_reset)
    assert not contracts.reset_contract(2, [0])  # nothing was locked: the refusal breaks the contract
    assert not contracts.reset_contract(2, [])
