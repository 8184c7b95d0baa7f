"""Named invariants of the prefix cache and of page accounting.

Each predicate says its property in one sentence. ``check_invariants`` and
``check_manager_invariants`` run them all and raise ``IntegrityError``
naming the broken one, with the numbers. The trees of ``reference/`` and
``optimized/`` run the same predicates on their ``abstract_state()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from .errors import IntegrityError
from .helpers import compute_page_starts, is_page_run
from .prefix_cache import (
    Handle,
    PageKey,
    PrefixCacheState,
    count_child_locks,
    find_orphan_key,
    get_handle_keys,
    get_parent_key,
    size_info,
)
from .types import SizeInfo

# ---------------------------------------------------------------- prefix cache


def keys_are_whole_pages(state: PrefixCacheState) -> str | None:
    """Every cached key ends on a page boundary."""
    for _, prefix in state.entries:
        if len(prefix.page) != state.page_size or len(prefix) % state.page_size:
            return f"key of {len(prefix)} tokens ends in a page of {len(prefix.page)}, P={state.page_size}"
    return None


def entries_are_prefix_closed(state: PrefixCacheState) -> str | None:
    """The parent page of every cached page is cached."""
    key = find_orphan_key(state.entries.keys())
    return None if key is None else f"page ending at token {len(key[1])} is cached but its parent page is not"


def ref_counts_cover_children(state: PrefixCacheState) -> str | None:
    """Each page holds at least as many locks as its child pages together (a lock covers a whole root path)."""
    below = count_child_locks((key, entry.ref_count) for key, entry in state.entries.items())
    for key, entry in state.entries.items():
        if entry.ref_count < 0 or entry.ref_count < below[key]:
            return (
                f"page ending at token {len(key[1])} has ref_count {entry.ref_count},"
                f" its child pages hold {below[key]} locks"
            )
    return None


def page_slots_are_aligned(state: PrefixCacheState) -> str | None:
    """Every cached page starts at a non-negative multiple of P."""
    for key, entry in state.entries.items():
        if entry.slot_start < 0 or entry.slot_start % state.page_size:
            return (
                f"page ending at token {len(key[1])} starts at slot {entry.slot_start},"
                f" not aligned to P={state.page_size}"
            )
    return None


def page_slots_are_unique(state: PrefixCacheState) -> str | None:
    """No two cached pages share a slot."""
    counts = Counter(entry.slot_start for entry in state.entries.values())
    shared = sorted(start for start, n in counts.items() if n > 1)
    return f"slots {shared} are held by more than one page" if shared else None


def stamps_are_in_the_past(state: PrefixCacheState) -> str | None:
    """Every page was inserted no later than its last access, and both precede the clock."""
    for key, entry in state.entries.items():
        if not entry.generation <= entry.last_access < state.clock:
            return (
                f"page ending at token {len(key[1])}: generation {entry.generation},"
                f" last_access {entry.last_access}, clock {state.clock}"
            )
    return None


def stamps_grow_toward_the_root(state: PrefixCacheState) -> str | None:
    """A parent page is as recent as its children and no younger (each operation stamps a root path)."""
    for key, entry in state.entries.items():
        parent = get_parent_key(key)
        if parent is None or parent not in state.entries:
            continue
        up = state.entries[parent]
        if up.last_access < entry.last_access or up.generation > entry.generation:
            return (
                f"page ending at token {len(key[1])} (access {entry.last_access}, generation {entry.generation})"
                f" vs parent (access {up.last_access}, generation {up.generation})"
            )
    return None


def leaf_stamps_are_distinct(state: PrefixCacheState) -> str | None:
    """No two leaf pages share a last_access stamp, so LRU order is total."""
    parents = {get_parent_key(key) for key in state.entries}
    stamps = Counter(entry.last_access for key, entry in state.entries.items() if key not in parents)
    shared = sorted(t for t, n in stamps.items() if n > 1)
    return f"leaves share stamps {shared}" if shared else None


PREFIX_CACHE_INVARIANTS: tuple[Callable[[PrefixCacheState], str | None], ...] = (
    keys_are_whole_pages,
    entries_are_prefix_closed,
    ref_counts_cover_children,
    page_slots_are_aligned,
    page_slots_are_unique,
    stamps_are_in_the_past,
    stamps_grow_toward_the_root,
    leaf_stamps_are_distinct,
)

# what a sliding-window group of a hybrid cache keeps of them: its paths may have holes (spec/hybrid.py)
WINDOW_GROUP_INVARIANTS: tuple[Callable[[PrefixCacheState], str | None], ...] = (
    keys_are_whole_pages,
    page_slots_are_aligned,
    page_slots_are_unique,
    stamps_are_in_the_past,
)


# what a state group keeps: one slot per checkpoint, anywhere in its pool, holes allowed (spec/hit_rules.py)
STATE_GROUP_INVARIANTS: tuple[Callable[[PrefixCacheState], str | None], ...] = (
    keys_are_whole_pages,
    page_slots_are_unique,
    stamps_are_in_the_past,
)


def sizes_equal_page_counts(state: PrefixCacheState, reported: SizeInfo) -> str | None:
    """The reported evictable and protected sizes equal the page counts times P."""
    expected = size_info(state)
    if tuple(reported) != tuple(expected):
        return f"size_info reports {tuple(reported)}, pages give {tuple(expected)}"
    return None


def count_locks(state: PrefixCacheState, locked: Iterable[Handle]) -> Counter[PageKey]:
    """Outstanding locks per page when each handle in ``locked`` holds one lock."""
    counts: Counter[PageKey] = Counter()
    for handle in locked:
        counts.update(get_handle_keys(state, handle))
    return counts


def ref_counts_equal_outstanding_locks(state: PrefixCacheState, locks: Mapping[PageKey, int]) -> str | None:
    """Each page's ref_count equals the number of outstanding locks on paths through it."""
    for key, entry in state.entries.items():
        if entry.ref_count != locks.get(key, 0):
            return (
                f"page ending at token {len(key[1])} has ref_count {entry.ref_count},"
                f" {locks.get(key, 0)} locks cover it"
            )
    missing = [key for key, n in locks.items() if n and key not in state.entries]
    return f"{len(missing)} locked pages are not cached" if missing else None


def check_invariants(
    state: PrefixCacheState,
    reported: SizeInfo | None = None,
    locks: Mapping[PageKey, int] | None = None,
) -> None:
    """Raise IntegrityError naming the first broken prefix-cache invariant."""
    checks: list[tuple[str, str | None]] = [(f.__name__, f(state)) for f in PREFIX_CACHE_INVARIANTS]
    if reported is not None:
        checks.append((sizes_equal_page_counts.__name__, sizes_equal_page_counts(state, reported)))
    if locks is not None:
        checks.append((ref_counts_equal_outstanding_locks.__name__, ref_counts_equal_outstanding_locks(state, locks)))
    raise_first(checks)


def raise_first(checks: Iterable[tuple[str, str | None]]) -> None:
    """Raise IntegrityError for the first check that reported a problem."""
    for name, problem in checks:
        if problem is not None:
            raise IntegrityError(f"{name}: {problem}")


# ---------------------------------------------------------------- page accounting


def free_slots_are_aligned_and_unique(free_pages: Sequence[int], page_size: int, num_pages: int) -> str | None:
    """Every free-list entry is a page start inside the pool, listed once."""
    bad = [s for s in free_pages if s < 0 or s % page_size or s >= num_pages * page_size]
    if bad:
        return f"free list holds {bad[:8]}, not page starts of a pool of {num_pages} pages of {page_size}"
    twice = sorted(s for s, n in Counter(free_pages).items() if n > 1)
    return f"pages {twice[:8]} are on the free list twice (double free)" if twice else None


def private_rows_are_page_runs(private_rows: Mapping[int, Sequence[int]], page_size: int) -> str | None:
    """The private part of every live request's page-table row is a sequence of whole pages."""
    for table_idx, row in private_rows.items():
        if len(row) % page_size:
            return f"row {table_idx}: private part of {len(row)} slots is not whole pages"
        for i in range(0, len(row), page_size):
            if not is_page_run(row[i : i + page_size], page_size):
                return f"row {table_idx}: positions {i}..{i + page_size - 1} map to {list(row[i : i + page_size])}"
    return None


def pages_are_partitioned(
    num_pages: int,
    page_size: int,
    free_pages: Sequence[int],
    cached_pages: Sequence[int],
    private_rows: Mapping[int, Sequence[int]],
) -> str | None:
    """Every page is free, cached, or private to exactly one live request: free + cached + private == num_pages."""
    owners: dict[int, list[str]] = {}
    for start in free_pages:
        owners.setdefault(start, []).append("free")
    for start in cached_pages:
        owners.setdefault(start, []).append("cached")
    for table_idx, row in private_rows.items():
        for start in compute_page_starts(row, page_size):
            owners.setdefault(start, []).append(f"request row {table_idx}")
    shared = {s: o for s, o in sorted(owners.items()) if len(o) > 1}
    if shared:
        start, where = next(iter(shared.items()))
        return f"{len(shared)} pages have two owners, e.g. page {start}: {where}"
    everything = set(range(0, num_pages * page_size, page_size))
    lost = sorted(everything - owners.keys())
    extra = sorted(owners.keys() - everything)
    n_private = sum(len(row) // page_size for row in private_rows.values())
    if lost or extra:
        return (
            f"free {len(free_pages)} + cached {len(cached_pages)} + private {n_private} != num_pages {num_pages}:"
            f" leaked pages {lost[:8]}, unknown pages {extra[:8]}"
        )
    return None


def rows_match_handles(matched_rows: Mapping[int, tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """The cached part of every live request's row maps to the slots of its locked handle."""
    for table_idx, (row, matched) in matched_rows.items():
        if list(row) != list(matched):
            return f"row {table_idx} maps its cached prefix to {list(row)[:8]}..., the tree to {list(matched)[:8]}..."
    return None
