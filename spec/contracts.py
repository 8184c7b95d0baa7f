"""Contracts on the spec's cache operations, checked by CrossHair (``tox -e crosshair``).

Each ``*_contract`` function builds a state the only way states arise (a
short program of operations from an empty cache, ``build``), applies the
operation under test with a drawn argument, and returns whether its laws
held; ``post: __return__`` asks CrossHair to search the bounded inputs (``pre:``)
for a program where they do not. The laws: the invariants hold after every
call; a rejected call changes nothing; ``evict(size)`` returns exactly
``ceil(size / P)`` pages, all cached, unlocked, and gone after; a match
changes no page but its stamps; lock then unlock restores every ref count;
reset empties the cache unless a path is locked.

Bounds (the small scope): P in {1, 2}; programs of at most 5 operations over
three token sequences that share prefixes and end in partial pages; sizes in
[-1, 12]. ``radixspec exhaustive`` covers the same alphabet exhaustively
to depth 6; CrossHair covers the arguments symbolically within these bounds.
"""

from __future__ import annotations

from .errors import (
    CacheBusyError,
    CacheError,
    DuplicateSlotError,
    LengthMismatchError,
    MisalignedPageError,
    UnlockError,
)
from .helpers import div_ceil
from .invariants import check_invariants
from .prefix_cache import (
    Handle,
    Prefix,
    PrefixCacheState,
    evict,
    get_matched_indices,
    insert_prefix,
    is_handle_locked,
    lock,
    match_prefix,
    new_state,
    reset,
    size_info,
    unlock,
)

# insert_prefix_contract's bad slots -> the error that must reject them
INSERT_REJECTIONS: dict[int, type[CacheError]] = {
    1: DuplicateSlotError,
    2: MisalignedPageError,
    3: LengthMismatchError,
}

# the alphabet's token sequences for P (they share the first page; the first two share two)
SEQUENCES = ((1, 1, 2, 2, 3), (1, 1, 2, 2, 4, 4), (1, 1, 5))


def sequence(page_size: int, index: int) -> list[int]:
    """Token sequence ``index`` for page size P (for P = 1, each run of two is one token)."""
    tokens = SEQUENCES[index % len(SEQUENCES)]
    return list(tokens) if page_size == 2 else list(tokens[::2])


def fresh_slots(state: PrefixCacheState, tokens: list[int]) -> list[int]:
    """Slots for an insert of ``tokens``: the cached pages' own, then the lowest page starts no page holds."""
    p = state.page_size
    used = {entry.slot_start for entry in state.entries.values()}
    handle = match_prefix(state.copy(), tokens)
    out = list(get_matched_indices(state, handle)) if handle.cached_len else []
    start = 0
    while len(out) < len(tokens):
        if start not in used:
            out.extend(range(start, start + p))
        start += p
    return out[: len(tokens)]


def build(page_size: int, program: list[int]) -> tuple[PrefixCacheState, list[Handle]]:
    """The state after ``program`` (op codes: 0-2 insert, 3-5 match, 6 lock, 7 unlock, 8 evict a page,
    9 evict all, 10 reset); rejected calls are skipped. Returns the state and the locked handles."""
    # a fresh intern table: the same decisions then take the same paths (CrossHair replays them); equality
    # never depends on the table
    Prefix._interned.clear()
    state = new_state(page_size)
    handles: list[Handle] = []
    locked: list[Handle] = []
    for code in program:
        try:
            if code < 3:
                tokens = sequence(page_size, code)
                handles.append(insert_prefix(state, tokens, fresh_slots(state, tokens)).handle)
            elif code < 6:
                handles.append(match_prefix(state, sequence(page_size, code)))
            elif code == 6 and handles:
                lock(state, handles[-1])
                locked.append(handles[-1])
            elif code == 7 and locked:
                unlock(state, locked.pop())
            elif code == 8:
                evict(state, min(page_size, size_info(state).evictable_size))
            elif code == 9:
                evict(state, size_info(state).evictable_size)
            elif code == 10:
                reset(state)
        except CacheError:
            pass
    return state, locked


def invariants_hold(state: PrefixCacheState) -> bool:
    """check_invariants, as a bool."""
    check_invariants(state)
    return True


def match_prefix_contract(page_size: int, program: list[int], index: int) -> bool:
    """A match returns the longest cached page-aligned prefix and changes no page but its stamps.

    pre: 1 <= page_size <= 2
    pre: len(program) <= 5
    pre: all(0 <= code <= 10 for code in program)
    pre: 0 <= index <= 2
    post: __return__
    """
    state, _ = build(page_size, program)
    before = state.copy()
    tokens = sequence(page_size, index)
    handle = match_prefix(state, tokens)
    pages = {key: (e.slot_start, e.ref_count, e.generation) for key, e in state.entries.items()}
    return (
        handle.cached_len % page_size == 0
        and handle.cached_len <= len(tokens)
        and pages == {key: (e.slot_start, e.ref_count, e.generation) for key, e in before.entries.items()}
        and len(get_matched_indices(state, handle)) == handle.cached_len
        and invariants_hold(state)
    )


def insert_prefix_contract(page_size: int, program: list[int], index: int, bad: int) -> bool:
    """An insert caches every whole page of the tokens at the slots given, or is rejected, with the error its
    bad slots call for, changing nothing.

    ``bad``: 0 valid slots, 1 a cached page's slot for the first new page, 2 a misaligned page, 3 one slot short.

    pre: 1 <= page_size <= 2
    pre: len(program) <= 4
    pre: all(0 <= code <= 10 for code in program)
    pre: 0 <= index <= 2
    pre: 0 <= bad <= 3
    post: __return__
    """
    state, _ = build(page_size, program)
    before = state.copy()
    tokens = sequence(page_size, index)
    slots = fresh_slots(state, tokens)
    cached = match_prefix(state.copy(), tokens).cached_len
    whole = len(tokens) - len(tokens) % page_size
    planted = False  # a bad slot the insert must refuse
    if bad == 1 and state.entries and cached < whole:
        taken = min(e.slot_start for e in state.entries.values())
        slots[cached : cached + page_size] = range(taken, taken + page_size)
        planted = True
    elif bad == 2 and page_size > 1 and cached < whole:
        slots[cached] += 1
        planted = True
    elif bad == 3:
        slots = slots[:-1]
        planted = True
    try:
        result = insert_prefix(state, tokens, slots)
    except CacheError as error:
        return state == before and planted and isinstance(error, INSERT_REJECTIONS[bad])
    pages = len(result.handle.tokens) // page_size
    return (
        not planted
        and result.handle.cached_len == whole
        and len(state.entries) == len(before.entries) + pages - cached // page_size
        and list(get_matched_indices(state, result.handle)) == slots[:whole]
        and invariants_hold(state)
    )


def lock_unlock_contract(page_size: int, program: list[int], index: int) -> bool:
    """Lock then unlock of a path restores every ref count; an unlock without its lock is rejected, no change.

    pre: 1 <= page_size <= 2
    pre: len(program) <= 5
    pre: all(0 <= code <= 10 for code in program)
    pre: 0 <= index <= 2
    post: __return__
    """
    state, _ = build(page_size, program)
    handle = match_prefix(state, sequence(page_size, index))
    before = state.copy()
    lock(state, handle)
    locked_ok = invariants_hold(state) and size_info(state).protected_size >= handle.cached_len
    unlock(state, handle)
    restored = state == before
    if handle.cached_len == 0 or is_handle_locked(state, handle):
        return locked_ok and restored  # an empty path, or another lock of this path: a second unlock is valid
    try:
        unlock(state, handle)
    except UnlockError:
        return locked_ok and restored and state == before
    return False


def evict_contract(page_size: int, program: list[int], size: int) -> bool:
    """evict(size) takes exactly ceil(size / P) pages, unlocked and cached before, gone after; else rejects.

    pre: 1 <= page_size <= 2
    pre: len(program) <= 5
    pre: all(0 <= code <= 10 for code in program)
    pre: -1 <= size <= 12
    post: __return__
    """
    state, _ = build(page_size, program)
    before = state.copy()
    try:
        slots = evict(state, size)
    except CacheError:
        return state == before and (size < 0 or size > size_info(before).evictable_size)
    starts = set(slots[::page_size])
    held_before = {e.slot_start: e.ref_count for e in before.entries.values()}
    held_after = {e.slot_start for e in state.entries.values()}
    return (
        len(slots) == div_ceil(size, page_size) * page_size
        and slots == sorted(slots)
        and all(held_before.get(start) == 0 for start in starts)
        and not starts & held_after
        and len(state.entries) == len(before.entries) - len(starts)
        and invariants_hold(state)
    )


def reset_contract(page_size: int, program: list[int]) -> bool:
    """reset returns every cached slot and empties the cache, unless a path is locked (CacheBusyError, no change).

    pre: 1 <= page_size <= 2
    pre: len(program) <= 5
    pre: all(0 <= code <= 10 for code in program)
    post: __return__
    """
    state, _ = build(page_size, program)
    before = state.copy()
    try:
        slots = reset(state)
    except CacheBusyError:
        return state == before and size_info(before).protected_size > 0
    cached = sorted(s for e in before.entries.values() for s in range(e.slot_start, e.slot_start + page_size))
    unlocked = size_info(before).protected_size == 0
    return unlocked and slots == cached and not state.entries and invariants_hold(state)


def size_info_contract(page_size: int, program: list[int]) -> bool:
    """size_info reports the cached pages: protected = the locked pages times P, evictable = the others times P;
    it changes nothing.

    pre: 1 <= page_size <= 2
    pre: len(program) <= 5
    pre: all(0 <= code <= 10 for code in program)
    post: __return__
    """
    state, _ = build(page_size, program)
    before = state.copy()
    info = size_info(state)
    locked = sum(1 for entry in state.entries.values() if entry.ref_count > 0)
    return (
        state == before
        and info.protected_size == locked * page_size
        and info.evictable_size == (len(state.entries) - locked) * page_size
    )


# each operation of the spec (prefix_cache.OPERATIONS) -> the contract that checks it
CONTRACTS = {
    "match_prefix": match_prefix_contract,
    "insert_prefix": insert_prefix_contract,
    "lock": lock_unlock_contract,
    "unlock": lock_unlock_contract,
    "evict": evict_contract,
    "reset": reset_contract,
    "size_info": size_info_contract,
}
