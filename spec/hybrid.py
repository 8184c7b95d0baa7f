"""The hybrid prefix cache as an abstract model: several attention groups, one set of keys.

A model that mixes full-attention layers with sliding-window layers keeps
one KV cache *group* per kind of layer. Every group caches its own pages
under the same keys ``(namespace, token prefix up to the end of a page)``
as the single-group cache (``spec/prefix_cache.py``), with its own slots,
locks, stamps and eviction; the clock is shared. A group is described by
its window: ``None`` for full attention, ``W >= 1`` for a sliding window
whose query at position ``i`` attends to the tokens ``[i - (W - 1), i]``,
or ``STATE`` for a state group (Mamba, linear attention) that caches
checkpoints of a recurrent state, one slot each, sparse.

What a match of length ``L`` (page aligned) *uses* in each group::

    full attention:   every page holding a token in [0, L)
    window W:         every page holding a token in [L - (W - 1), L)
    state:            the checkpoint after exactly L tokens (on the page ending at L)

``L`` is valid when every group caches every page it uses; a match returns
the longest valid ``L`` (the rule, over any cache: ``spec/hit_rules.py``).
A sliding-window group may lack pages in the middle of a path (released
early, or evicted): a tombstone in SGLang's words. Such a hole costs nothing
as long as no valid ``L`` needs it.

Eviction is per group: the evictable page (ref 0, and in a full group no
cached child in that group) with the oldest stamp goes first, the deeper
page first between two stamped by the same operation. A window or state
group may evict an entry in the middle of a path; a full group only a leaf.
A state group counts its sizes and evictions in checkpoints.

The named choices against vLLM and SGLang are in ``docs/hybrid.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .domains import Namespace, check_namespace, check_page_size, check_slot_indices, check_token_ids
from .errors import (
    CacheBusyError,
    DuplicateSlotError,
    InvalidInputError,
    InvalidTypeError,
    LengthMismatchError,
    MisalignedPageError,
    MissingPageError,
    StaleHandleError,
    UnlockError,
)
from .helpers import compute_page_to_token, div_ceil
from .hit_rules import STATE as STATE
from .hit_rules import HitRule, IsCached, check_kinds, compute_longest_valid, is_valid_length
from .hit_rules import Window as Window
from .hit_rules import compute_used_pages as compute_used_pages
from .invariants import PREFIX_CACHE_INVARIANTS, STATE_GROUP_INVARIANTS, WINDOW_GROUP_INVARIANTS, raise_first
from .prefix_cache import (
    Entry,
    PageKey,
    PrefixCacheState,
    check_evict_size,
    get_keys_with_children,
    get_page_keys,
    take_tick,
)
from .types import SizeInfo


@dataclass
class HybridState:
    """The whole abstract state of a hybrid prefix cache."""

    # tokens per page (P), the same in every group
    page_size: int
    # one window per group, in the caller's order
    windows: tuple[Window, ...]
    # per group: its cached pages (a full group's are prefix-closed; a window group's need not be)
    groups: tuple[dict[PageKey, Entry], ...] = ()
    # outstanding locks, counted by the (namespace, matched tokens) of the handle that took them
    locks: Counter[tuple[Namespace, tuple[int, ...]]] = field(default_factory=Counter)
    # logical clock, shared by the groups: the stamp the next match/insert takes
    clock: int = 0

    def view(self, group: int) -> PrefixCacheState:
        """Group ``group`` as a single-group state (shares its entries: the single-group reads apply)."""
        return PrefixCacheState(page_size=self.page_size, entries=self.groups[group], clock=self.clock)


@dataclass(frozen=True)
class HybridHandle:
    """A match or insert result: a valid match length and, per group, the pages it uses."""

    namespace: Namespace
    # the matched tokens; len(tokens) == cached_len, a multiple of P
    tokens: tuple[int, ...]
    # per group, the generation of each page the match uses, in sequence order
    generations: tuple[tuple[int, ...], ...]

    @property
    def cached_len(self) -> int:
        """Matched tokens (page aligned)."""
        return len(self.tokens)


class HybridInsertResult(NamedTuple):
    """What insert_prefix returns."""

    # per group, the page starts the caller passed for pages that the group already caches at another
    # slot: the cache did not take them, the caller frees them (a start equal to the cached one is that page)
    unused: tuple[tuple[int, ...], ...]
    # handle on the longest valid match of the inserted tokens, after the insert (each implementation's own)
    handle: Any


def check_windows(windows: object, *, state_groups: bool = False) -> tuple[Window, ...]:
    """``windows`` as a non-empty tuple of group kinds, or raise (``state_groups``: whether STATE is admitted).

    The spec admits state groups; a cache that has none (the reference and optimized trees) refuses them.
    """
    return check_kinds(windows, state_groups=state_groups)


def new_state(page_size: int, windows: Sequence[Window]) -> HybridState:
    """An empty hybrid cache with pages of ``page_size`` tokens and one group per window."""
    checked = check_windows(windows, state_groups=True)
    return HybridState(page_size=check_page_size(page_size), windows=checked, groups=tuple({} for _ in checked))


def compute_slots_per_entry(window: Window, page_size: int) -> int:
    """Slots one cached entry of a group holds: a page of P, or one state checkpoint."""
    return 1 if window == STATE else page_size


def get_hit_rule(state: HybridState) -> HitRule:
    """The hit rule of this cache: its groups, whole pages, no EAGLE (``spec/hit_rules.py``)."""
    return HitRule(state.page_size, state.windows, state.page_size)


# ---------------------------------------------------------------- reads


def get_is_cached(state: HybridState, keys: Sequence[PageKey]) -> IsCached:
    """The hit rule's question on this state: does a group cache the page ending at ``end`` along ``keys``."""
    return lambda group, end: keys[end // state.page_size - 1] in state.groups[group]


def is_valid_match(state: HybridState, keys: Sequence[PageKey], length: int) -> bool:
    """True when every group caches every page a match of ``length`` tokens uses (``keys``: the path's keys)."""
    return is_valid_length(get_hit_rule(state), length, get_is_cached(state, keys))


def compute_match_len(state: HybridState, keys: Sequence[PageKey]) -> int:
    """The longest valid match length along ``keys`` (whole pages of one namespace, shortest first)."""
    # no match runs past a hole in a full group: start below the first one (the rule alone would also find it)
    longest = len(keys)
    for window, entries in zip(state.windows, state.groups, strict=True):
        if window is None:
            longest = next((i for i in range(longest) if keys[i] not in entries), longest)
    return compute_longest_valid(get_hit_rule(state), longest * state.page_size, get_is_cached(state, keys))


def get_used_keys(state: HybridState, handle: HybridHandle) -> list[list[PageKey]]:
    """Per group, the keys of the pages the handle's match uses, in sequence order."""
    keys = get_page_keys(state.view(0), handle.namespace, handle.tokens)
    return [
        [keys[page] for page in compute_used_pages(handle.cached_len, window, state.page_size)]
        for window in state.windows
    ]


def is_handle_stale(state: HybridState, handle: HybridHandle) -> bool:
    """True when a page the handle uses was evicted (or evicted and cached again) since the handle was made."""
    return any(
        # the page is gone
        key not in entries
        # or it was evicted and cached again: a new generation
        or entries[key].generation != generation
        for entries, keys, generations in zip(
            state.groups, get_used_keys(state, handle), handle.generations, strict=True
        )
        for key, generation in zip(keys, generations, strict=True)
    )


def uses_pages(state: HybridState, handle: HybridHandle) -> bool:
    """True when the handle's match uses a page in some group."""
    return any(len(compute_used_pages(handle.cached_len, w, state.page_size)) for w in state.windows)


def get_matched_pages(state: HybridState, handle: HybridHandle) -> list[list[int | None]]:
    """Per group, one entry per page of the match: its slot start where the match uses it, else None.

    Does not change the cache; the slots stay valid only while the handle is locked.
    """
    # CHECK
    check_handle(state, handle)
    # WALK
    rows: list[list[int | None]] = []
    for entries, keys in zip(state.groups, get_used_keys(state, handle), strict=True):
        row: list[int | None] = [None] * (handle.cached_len // state.page_size)
        for key in keys:
            row[len(key[1]) // state.page_size - 1] = entries[key].slot_start
        rows.append(row)
    return rows


def size_info(state: HybridState, group: int) -> SizeInfo:
    """Evictable (ref 0) and protected (ref > 0) slots of one group: tokens, or a state group's checkpoints."""
    # CHECK (-1 would read the last group)
    group = check_group(group, len(state.groups))
    locked = sum(1 for entry in state.groups[group].values() if entry.ref_count > 0)
    unit = compute_slots_per_entry(state.windows[group], state.page_size)
    return SizeInfo(evictable_size=(len(state.groups[group]) - locked) * unit, protected_size=locked * unit)


def is_evictable(state: HybridState, group: int, key: PageKey, with_children: set[PageKey]) -> bool:
    """True when page ``key`` of ``group`` may be evicted now (``with_children``: the group's pages with a child)."""
    return (
        # nobody holds a lock on it
        state.groups[group][key].ref_count == 0
        # and it is a leaf of its group, or its group is a window or a state group (which may leave a hole)
        and (state.windows[group] is not None or key not in with_children)
    )


# ---------------------------------------------------------------- operations


def stamp(entries: dict[PageKey, Entry], keys: Sequence[PageKey], t: int) -> None:
    """Set last_access of every page of ``keys`` that ``entries`` caches to ``t``."""
    for key in keys:
        if key in entries:
            entries[key] = entries[key]._replace(last_access=t)


def make_handle(state: HybridState, namespace: Namespace, keys: Sequence[PageKey], length: int) -> HybridHandle:
    """The handle of a valid match of ``length`` tokens along ``keys``."""
    p = state.page_size
    tokens = keys[length // p - 1][1].tokens if length else ()
    generations = tuple(
        tuple(entries[keys[page]].generation for page in compute_used_pages(length, window, p))
        for window, entries in zip(state.windows, state.groups, strict=True)
    )
    return HybridHandle(namespace, tokens, generations)


def match_prefix(state: HybridState, input_ids: Sequence[int], namespace: Namespace = None) -> HybridHandle:
    """Longest valid page-aligned match of ``input_ids``; stamps the pages it uses in every group."""
    # CHECK
    tokens = check_token_ids(input_ids)
    namespace = check_namespace(namespace)
    # WALK
    keys = get_page_keys(state.view(0), namespace, tokens)
    length = compute_match_len(state, keys)
    # UPDATE
    t = take_tick(state)
    for window, entries in zip(state.windows, state.groups, strict=True):
        stamp(entries, [keys[page] for page in compute_used_pages(length, window, state.page_size)], t)
    return make_handle(state, namespace, keys, length)


def check_group_pages(pages: object) -> list[list[int | None]]:
    """``pages`` as one list per group of page starts or None (a page the caller no longer holds), or raise."""
    if not isinstance(pages, (tuple, list)):
        raise InvalidTypeError(f"pages must be a tuple with one sequence per group, got {type(pages).__name__}")
    rows = []
    for group, row in enumerate(pages):
        if not isinstance(row, (tuple, list)):
            raise InvalidTypeError(f"pages[{group}] must be a sequence, got {type(row).__name__}")
        given = iter(check_slot_indices([start for start in row if start is not None], f"pages[{group}]"))
        rows.append([None if start is None else next(given) for start in row])
    return rows


def check_group_lengths(rows: Sequence[Sequence[int | None]], groups: int, whole_pages: int) -> None:
    """One row per group, each of one entry per whole page of the input, or raise LengthMismatchError."""
    if len(rows) != groups:
        raise LengthMismatchError(f"pages has {len(rows)} rows, the cache has {groups} groups")
    for group, row in enumerate(rows):
        if len(row) != whole_pages:
            raise LengthMismatchError(f"pages[{group}] has {len(row)} pages, input_ids has {whole_pages} whole pages")


def insert_prefix(
    state: HybridState,
    input_ids: Sequence[int],
    pages: Sequence[Sequence[int | None]],
    namespace: Namespace = None,
) -> HybridInsertResult:
    """Cache the whole pages of ``input_ids`` in every group; ``pages[g][k]`` is the slot start of page k in group g.

    A page already cached in a group keeps its slot (the caller frees its own copy, listed in
    ``result.unused``; passing the cached start itself is no copy). ``None`` marks a page the
    caller no longer holds (a window page released early); it stays uncached. A full group needs
    every page it does not cache yet.
    """
    # CHECK
    tokens = check_token_ids(input_ids)
    rows = check_group_pages(pages)
    namespace = check_namespace(namespace)
    p = state.page_size
    check_group_lengths(rows, len(state.windows), len(tokens) // p)
    keys = get_page_keys(state.view(0), namespace, tokens)
    for group, (window, entries, row) in enumerate(zip(state.windows, state.groups, rows, strict=True)):
        cached_starts = {entry.slot_start for entry in entries.values()}
        new_starts: set[int] = set()
        for page, (key, start) in enumerate(zip(keys, row, strict=True)):
            if key in entries:
                continue
            if start is None:
                if window is None:
                    raise MissingPageError.needs_page(group, page)
                continue
            if start % compute_slots_per_entry(window, p):
                raise MisalignedPageError.start_not_aligned(group, page, start, p)
            if start in cached_starts or start in new_starts:
                raise DuplicateSlotError.cached_slot(page, start, group)
            new_starts.add(start)
    # UPDATE
    t = take_tick(state)
    unused: list[tuple[int, ...]] = []
    for entries, row in zip(state.groups, rows, strict=True):
        stamp(entries, keys, t)
        unused.append(
            tuple(
                start
                for key, start in zip(keys, row, strict=True)
                if key in entries and start is not None and start != entries[key].slot_start
            )
        )
        for key, start in zip(keys, row, strict=True):
            if key not in entries and start is not None:
                entries[key] = Entry(slot_start=start, last_access=t, ref_count=0, generation=t)
    return HybridInsertResult(tuple(unused), make_handle(state, namespace, keys, compute_match_len(state, keys)))


def lock(state: HybridState, handle: HybridHandle) -> None:
    """Add one lock to every page the handle uses, in every group; locked pages are never evicted.

    A match that uses no page holds no lock (as the single-group cache's empty path).
    """
    # CHECK
    check_handle(state, handle)
    if not uses_pages(state, handle):
        return
    # UPDATE
    for entries, keys in zip(state.groups, get_used_keys(state, handle), strict=True):
        for key in keys:
            entries[key] = entries[key]._replace(ref_count=entries[key].ref_count + 1)
    state.locks[(handle.namespace, handle.tokens)] += 1


def unlock(state: HybridState, handle: HybridHandle) -> None:
    """Remove one lock from every page the handle uses. Refused unless a lock of this very match is outstanding.

    A match that uses no page (L = 0, or only windows of one token) holds no lock: both calls change nothing.
    """
    # CHECK
    check_handle(state, handle)
    if not uses_pages(state, handle):
        return
    if not state.locks[(handle.namespace, handle.tokens)]:
        raise UnlockError.no_lock_of_match(handle.cached_len)
    # UPDATE
    for entries, keys in zip(state.groups, get_used_keys(state, handle), strict=True):
        for key in keys:
            entries[key] = entries[key]._replace(ref_count=entries[key].ref_count - 1)
    state.locks[(handle.namespace, handle.tokens)] -= 1
    if not state.locks[(handle.namespace, handle.tokens)]:
        del state.locks[(handle.namespace, handle.tokens)]


def check_group(group: object, groups: int) -> int:
    """``group`` if it names one of ``groups`` groups, else raise."""
    if not isinstance(group, int) or isinstance(group, bool):
        raise InvalidTypeError(f"group must be an int, got {type(group).__name__}")
    if not 0 <= group < groups:
        raise InvalidInputError(f"group {group} is not one of the cache's {groups} groups")
    return group


def evict(state: HybridState, group: int, size: int) -> list[int]:
    """Evict exactly ceil(size / P) pages of ``group``, the oldest evictable first; returns their slots, ascending.

    Between two pages of the same stamp (one operation stamps one path), the deeper goes first.
    A state group counts in checkpoints: ``size`` of them, one slot each.
    """
    # CHECK
    check_group(group, len(state.windows))
    check_evict_size(size, size_info(state, group).evictable_size)
    # UPDATE: one page at a time; taking a leaf of a full group may make its parent a leaf
    entries = state.groups[group]
    unit = compute_slots_per_entry(state.windows[group], state.page_size)
    starts = []
    for _ in range(div_ceil(size, unit)):
        with_children = get_keys_with_children(state.view(group))
        oldest = min(
            (key for key in entries if is_evictable(state, group, key, with_children)),
            key=lambda key: (entries[key].last_access, -len(key[1])),
        )
        starts.append(entries.pop(oldest).slot_start)
    return sorted(compute_page_to_token(starts, unit))


def reset(state: HybridState) -> list[list[int]]:
    """Empty every group; returns per group every slot it held, ascending. Refused while any lock is outstanding."""
    # CHECK
    if state.locks:
        raise CacheBusyError.locks_outstanding(sum(state.locks.values()))
    # UPDATE
    slots = [
        sorted(
            compute_page_to_token(
                [e.slot_start for e in entries.values()], compute_slots_per_entry(window, state.page_size)
            )
        )
        for window, entries in zip(state.windows, state.groups, strict=True)
    ]
    for entries in state.groups:
        entries.clear()
    return slots


def check_handle(state: HybridState, handle: object) -> HybridHandle:
    """``handle`` if it is a hybrid handle whose used pages are all still cached, else raise."""
    if not isinstance(handle, HybridHandle):
        raise InvalidTypeError(f"expected a HybridHandle, got {type(handle).__name__}")
    if is_handle_stale(state, handle):
        raise StaleHandleError.lost_page(handle.cached_len)
    return handle


# ---------------------------------------------------------------- invariants


def groups_hold_their_cache_invariants(state: HybridState) -> str | None:
    """Each group is a single-group cache: a full group keeps every invariant of one, a window group those
    that do not need a prefix-closed path (whole pages, aligned and unique slots, stamps in the past), a
    state group those that do not need P slots per entry either."""
    kinds: dict[Window, tuple[Callable[[PrefixCacheState], str | None], ...]] = {
        None: PREFIX_CACHE_INVARIANTS,
        STATE: STATE_GROUP_INVARIANTS,
    }
    for group, window in enumerate(state.windows):
        for invariant in kinds.get(window, WINDOW_GROUP_INVARIANTS):
            problem = invariant(state.view(group))
            if problem is not None:
                return f"group {group} ({describe(window)}): {invariant.__name__}: {problem}"
    return None


def ref_counts_equal_outstanding_locks(state: HybridState) -> str | None:
    """Every page's ref_count is the number of outstanding locks whose match uses it."""
    for group, (window, entries) in enumerate(zip(state.windows, state.groups, strict=True)):
        expected: Counter[PageKey] = Counter()
        for (namespace, tokens), n in state.locks.items():
            keys = get_page_keys(state.view(group), namespace, tokens)
            for page in compute_used_pages(len(tokens), window, state.page_size):
                expected[keys[page]] += n
        missing = [key for key in expected if key not in entries]
        if missing:
            return f"group {group}: {len(missing)} pages used by outstanding locks are not cached"
        wrong = [key for key, entry in entries.items() if entry.ref_count != expected[key]]
        if wrong:
            key = wrong[0]
            return (
                f"group {group}: page ending at token {len(key[1])} has ref_count {entries[key].ref_count},"
                f" {expected[key]} outstanding locks use it"
            )
    return None


def eviction_order_is_total(state: HybridState) -> str | None:
    """No two pages of a group share a stamp and a depth (each operation stamps one path), so evict never ties."""
    for group, entries in enumerate(state.groups):
        seen = Counter((entry.last_access, len(key[1])) for key, entry in entries.items())
        tied = [place for place, n in seen.items() if n > 1]
        if tied:
            return f"group {group}: {seen[tied[0]]} pages share stamp {tied[0][0]} at depth {tied[0][1]} tokens"
    return None


HYBRID_INVARIANTS = (groups_hold_their_cache_invariants, ref_counts_equal_outstanding_locks, eviction_order_is_total)


def check_hybrid_invariants(state: HybridState, reported: Sequence[SizeInfo] | None = None) -> None:
    """Raise IntegrityError naming the first broken hybrid invariant (``reported``: each group's size_info)."""
    checks = [(f.__name__, f(state)) for f in HYBRID_INVARIANTS]
    for group, sizes in enumerate(reported or ()):
        checks.append((f"group {group} sizes_equal_page_counts", sizes_equal_entry_counts(state, group, sizes)))
    raise_first(checks)


def sizes_equal_entry_counts(state: HybridState, group: int, reported: SizeInfo) -> str | None:
    """A group's reported evictable and protected sizes equal its entry counts times the slots of one."""
    if tuple(reported) != tuple(size_info(state, group)):
        return f"size_info reports {tuple(reported)}, entries give {tuple(size_info(state, group))}"
    return None


def attended_pages_are_held(
    windows: Sequence[Window], page_size: int, requests: Mapping[int, tuple[int, Sequence[Sequence[int | None]]]]
) -> str | None:
    """Every page a live request can still attend is in its row, in every group (the safety law).

    ``requests``: per request, its computed tokens and its rows (one page start or None per page, per group).
    A window page released one token too early breaks it, even when no other request took the page yet.
    """
    for uid, (computed, rows) in requests.items():
        for group, (window, row) in enumerate(zip(windows, rows, strict=True)):
            for page in compute_used_pages(computed, window, page_size):
                if page >= len(row) or row[page] is None:
                    return (
                        f"request {uid}, group {group} ({describe(window)}): page {page} is not held"
                        f" although the token at position {computed} attends to it"
                    )
    return None


def describe(window: Window) -> str:
    """A group's kind in words."""
    if window == STATE:
        return "state"
    return "full attention" if window is None else f"window {window}"
