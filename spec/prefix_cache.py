"""The prefix cache as an abstract model: cached pages keyed by token prefix.

No tree here. The state is a dict of pages, each keyed by
``(namespace, tokens up to the end of the page)``; a tree is one way to
store it (see ``reference/`` and ``optimized/``, whose ``abstract_state()``
maps back to this). Every operation lists its guards first (``# CHECK``,
which raise before any change), then its effects.

Time is logical: every match_prefix and insert_prefix takes ``t = clock``,
advances the clock, and stamps every page on its path with ``t``.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

from .domains import (
    Immutable,
    Namespace,
    check_insert_inputs,
    check_namespace,
    check_page_size,
    check_token_ids,
)
from .errors import (
    CacheBusyError,
    DuplicateSlotError,
    EvictionError,
    InvalidSizeError,
    InvalidTypeError,
    MisalignedPageError,
    StaleHandleError,
    UnlockError,
)
from .helpers import align_down, compute_page_to_token, div_ceil, is_page_run
from .types import InsertResult, SizeInfo


class Prefix(Immutable):
    """A token prefix that ends at a page boundary, built page by page from its parent.

    Its hash is computed once, and equal prefixes are usually one object (an
    intern table), so hashing and comparing cost O(1) however long the prefix
    is, and a page's parent is one attribute away. Its meaning is its tokens
    (``tokens``); the links are how the spec avoids copying them.
    """

    __slots__ = ("_hash", "length", "page", "parent")
    # (parent, page) -> the prefix; emptied when it grows past INTERN_LIMIT (equality never depends on it)
    _interned: ClassVar[dict[tuple[Prefix | None, tuple[int, ...]], Prefix]] = {}
    INTERN_LIMIT: ClassVar[int] = 2_000_000

    parent: Prefix | None
    page: tuple[int, ...]
    length: int
    _hash: int

    @classmethod
    def extend(cls, parent: Prefix | None, page: tuple[int, ...]) -> Prefix:
        """``parent`` followed by the tokens of ``page``."""
        found = cls._interned.get((parent, page))
        if found is None:
            if len(cls._interned) >= cls.INTERN_LIMIT:
                cls._interned.clear()
            found = object.__new__(cls)
            found.parent, found.page = parent, page
            found.length = len(page) + (parent.length if parent is not None else 0)
            found._hash = hash((parent, page))
            cls._interned[(parent, page)] = found
        return found

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # one object in the common case; else the same tokens, page by page
        if self is other:
            return True
        if not isinstance(other, Prefix):
            return NotImplemented
        a: Prefix | None = self
        b: Prefix | None = other
        while a is not b:
            if a is None or b is None or (a._hash, a.length, a.page) != (b._hash, b.length, b.page):
                return False
            a, b = a.parent, b.parent
        return True

    @property
    def tokens(self) -> tuple[int, ...]:
        """Every token of the prefix, in order (O(length): for messages and conversions)."""
        pages: list[tuple[int, ...]] = []
        node: Prefix | None = self
        while node is not None:
            pages.append(node.page)
            node = node.parent
        return tuple(token for page in reversed(pages) for token in page)

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        tokens = self.tokens
        return f"Prefix({list(tokens) if len(tokens) <= 12 else [*tokens[:4], '...', *tokens[-4:]]})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Prefix.extend, (self.parent, self.page))


# (namespace, token prefix ending at a page boundary)
PageKey = tuple[Namespace, Prefix]


def compute_page_prefixes(tokens: Sequence[int], page_size: int) -> list[Prefix]:
    """The prefixes ending at each whole page of ``tokens``, shortest first."""
    prefixes: list[Prefix] = []
    parent: Prefix | None = None
    for end in range(page_size, align_down(len(tokens), page_size) + 1, page_size):
        parent = Prefix.extend(parent, tuple(tokens[end - page_size : end]))
        prefixes.append(parent)
    return prefixes


def page_key(namespace: Namespace, tokens: Sequence[int], page_size: int) -> PageKey:
    """The key of the page that ends ``tokens`` (whole pages)."""
    assert tokens and len(tokens) % page_size == 0, "a page key covers whole pages"
    return (namespace, compute_page_prefixes(tokens, page_size)[-1])


class Entry(NamedTuple):
    """One cached page."""

    # first of the page's P slots in the KV pool
    slot_start: int
    # clock value of the last match/insert whose path held this page
    last_access: int
    # outstanding locks on paths through this page
    ref_count: int
    # clock value of the insert that cached this page (a re-insert is a new generation)
    generation: int


@dataclass
class PrefixCacheState:
    """The whole abstract state of a prefix cache."""

    # tokens per page (P)
    page_size: int
    # cached pages; prefix-closed: a page's parent page is cached too
    entries: dict[PageKey, Entry] = field(default_factory=dict)
    # logical clock: the stamp the next match/insert takes
    clock: int = 0

    def copy(self) -> PrefixCacheState:
        """A copy the operations can change without touching this one (entries are immutable tuples)."""
        return PrefixCacheState(self.page_size, dict(self.entries), self.clock)

    def __deepcopy__(self, memo: dict[int, object]) -> PrefixCacheState:
        return self.copy()


@dataclass(frozen=True)
class Handle(Immutable):
    """A match or insert result: a path of cached pages, valid until one of them is evicted."""

    namespace: Namespace
    # the matched tokens; len(tokens) == cached_len, a multiple of P
    tokens: tuple[int, ...]
    # generation of each page of the path when the handle was made
    generations: tuple[int, ...]

    @property
    def cached_len(self) -> int:
        """Matched tokens (page aligned)."""
        return len(self.tokens)


def new_state(page_size: int) -> PrefixCacheState:
    """An empty cache with pages of ``page_size`` tokens."""
    return PrefixCacheState(page_size=check_page_size(page_size))


# ---------------------------------------------------------------- reads


def get_page_keys(state: PrefixCacheState, namespace: Namespace, tokens: Sequence[int]) -> list[PageKey]:
    """Keys of the whole pages of ``tokens``, shortest first."""
    return [(namespace, prefix) for prefix in compute_page_prefixes(tokens, state.page_size)]


def get_parent_key(key: PageKey) -> PageKey | None:
    """Key of the page before ``key`` on its path, or None for a first page."""
    namespace, prefix = key
    return None if prefix.parent is None else (namespace, prefix.parent)


def find_orphan_key(keys: Collection[PageKey]) -> PageKey | None:
    """A key of ``keys`` whose parent page is not among them, or None when they are prefix-closed."""
    for key in keys:
        parent = get_parent_key(key)
        if parent is not None and parent not in keys:
            return key
    return None


def count_child_locks(locks: Iterable[tuple[PageKey, int]]) -> Counter[PageKey]:
    """For each page, the locks its child pages hold together (from ``(key, ref_count)`` pairs)."""
    below: Counter[PageKey] = Counter()
    for key, ref_count in locks:
        parent = get_parent_key(key)
        if parent is not None:
            below[parent] += ref_count
    return below


def get_keys_with_children(state: PrefixCacheState) -> set[PageKey]:
    """Cached pages that some cached page extends by one page (one pass over the cache)."""
    return {parent for key in state.entries if (parent := get_parent_key(key)) is not None}


def get_child_keys(state: PrefixCacheState, key: PageKey) -> list[PageKey]:
    """Cached pages that extend ``key`` by one page."""
    return [other for other in state.entries if get_parent_key(other) == key]


def has_cached_child(state: PrefixCacheState, key: PageKey) -> bool:
    """True when some cached page extends ``key`` by one page."""
    return bool(get_child_keys(state, key))


def count_locks_ending_at(state: PrefixCacheState, key: PageKey) -> int:
    """Locks on paths that end at page ``key``: its ref_count minus those passing on to its children."""
    return state.entries[key].ref_count - sum(state.entries[child].ref_count for child in get_child_keys(state, key))


def is_evictable(state: PrefixCacheState, key: PageKey, with_children: set[PageKey] | None = None) -> bool:
    """True when the page ``key`` may be evicted now (``with_children``: get_keys_with_children, if at hand)."""
    return (
        # nobody holds a lock on it
        state.entries[key].ref_count == 0
        # and no cached page extends it
        and key not in (get_keys_with_children(state) if with_children is None else with_children)
    )


def get_evictable_leaves(state: PrefixCacheState) -> list[PageKey]:
    """Every page that evict() may take next."""
    with_children = get_keys_with_children(state)
    return [key for key in state.entries if is_evictable(state, key, with_children)]


def get_handle_keys(state: PrefixCacheState, handle: Handle) -> list[PageKey]:
    """Keys of the pages on the handle's path, shortest first."""
    return get_page_keys(state, handle.namespace, handle.tokens)


def is_handle_stale(state: PrefixCacheState, handle: Handle) -> bool:
    """True when a page of the handle's path was evicted since the handle was made."""
    keys = get_handle_keys(state, handle)
    return any(
        # the page is gone
        key not in state.entries
        # or it was evicted and cached again: a new generation
        or state.entries[key].generation != generation
        for key, generation in zip(keys, handle.generations, strict=True)
    )


def is_handle_locked(state: PrefixCacheState, handle: Handle) -> bool:
    """True when the handle is live and some lock ends at its last page (an empty path is always locked)."""
    keys = get_handle_keys(state, handle)
    return (
        # no page of its path was evicted
        not is_handle_stale(state, handle)
        # and a lock of this very path is outstanding, not only locks of longer paths through it
        and (not keys or count_locks_ending_at(state, keys[-1]) >= 1)
    )


def get_matched_indices(state: PrefixCacheState, handle: Handle) -> list[int]:
    """Slots of the handle's path in sequence order. Does not change the cache.

    The slots stay valid only while the handle is locked.
    """
    # CHECK
    if is_handle_stale(state, handle):
        raise StaleHandleError.lost_page(handle.cached_len)
    # WALK
    starts = [state.entries[key].slot_start for key in get_handle_keys(state, handle)]
    return compute_page_to_token(starts, state.page_size)


def size_info(state: PrefixCacheState) -> SizeInfo:
    """Evictable (ref 0) and protected (ref > 0) tokens."""
    p = state.page_size
    locked = sum(1 for entry in state.entries.values() if entry.ref_count > 0)
    return SizeInfo(evictable_size=(len(state.entries) - locked) * p, protected_size=locked * p)


# ---------------------------------------------------------------- operations


class HasClock(Protocol):
    """A state with a logical clock (the single-group and the hybrid cache)."""

    clock: int


def take_tick(state: HasClock) -> int:
    """Advance the logical clock; return the stamp of this operation."""
    t = state.clock
    state.clock += 1
    return t


def stamp(state: PrefixCacheState, keys: Sequence[PageKey], t: int) -> None:
    """Set last_access of every page in ``keys`` to ``t``."""
    for key in keys:
        state.entries[key] = state.entries[key]._replace(last_access=t)


# The cache's operations, in the seed's names: the list every other place is checked against (the caches of
# reference/ and optimized/ have a method of each name; the cache machine has a rule recording each, the
# exhaustive checker's alphabet drives each, spec/contracts.py has a contract for each: tests/test_layout.py).
OPERATIONS = ("match_prefix", "insert_prefix", "lock", "unlock", "evict", "reset", "size_info")


def match_prefix(state: PrefixCacheState, input_ids: Sequence[int], namespace: Namespace = None) -> Handle:
    """Longest cached page-aligned prefix of ``input_ids``; stamps its pages."""
    # CHECK
    tokens = check_token_ids(input_ids)
    namespace = check_namespace(namespace)
    # WALK
    keys = []
    for key in get_page_keys(state, namespace, tokens):
        if key not in state.entries:
            break
        keys.append(key)
    # UPDATE
    stamp(state, keys, take_tick(state))
    matched = keys[-1][1].tokens if keys else ()
    return Handle(namespace, matched, tuple(state.entries[key].generation for key in keys))


def insert_prefix(
    state: PrefixCacheState,
    input_ids: Sequence[int],
    indices: Sequence[int],
    namespace: Namespace = None,
) -> InsertResult:
    """Cache the whole pages of ``input_ids``; new pages take their slots from ``indices``.

    Pages already cached keep their slots; ``result.cached_len`` counts them, and
    the caller frees its own duplicates among them (``CacheManager.cache_req``).
    """
    # CHECK
    tokens, slots, namespace = check_insert_inputs(input_ids, indices, namespace)
    p = state.page_size
    keys = get_page_keys(state, namespace, tokens)
    num_cached = 0
    while num_cached < len(keys) and keys[num_cached] in state.entries:
        num_cached += 1
    cached_starts = {entry.slot_start for entry in state.entries.values()}
    new_starts: list[int] = []
    for page in range(num_cached, len(keys)):
        page_slots = slots[page * p : (page + 1) * p]
        if not is_page_run(page_slots, p):
            raise MisalignedPageError.not_a_run(page, list(page_slots), p)
        if page_slots[0] in cached_starts or page_slots[0] in new_starts:
            raise DuplicateSlotError.cached_slot(page, page_slots[0])
        new_starts.append(page_slots[0])
    # UPDATE
    t = take_tick(state)
    stamp(state, keys[:num_cached], t)
    for key, start in zip(keys[num_cached:], new_starts, strict=True):
        state.entries[key] = Entry(slot_start=start, last_access=t, ref_count=0, generation=t)
    handle = Handle(namespace, tokens[: len(keys) * p], tuple(state.entries[key].generation for key in keys))
    return InsertResult(cached_len=num_cached * p, handle=handle)


def lock(state: PrefixCacheState, handle: Handle) -> None:
    """Add one lock to every page of the handle's path; locked pages are never evicted."""
    # CHECK
    check_handle(state, handle)
    # UPDATE
    for key in get_handle_keys(state, handle):
        entry = state.entries[key]
        state.entries[key] = entry._replace(ref_count=entry.ref_count + 1)


def unlock(state: PrefixCacheState, handle: Handle) -> None:
    """Remove one lock from every page of the handle's path.

    Refused unless a lock of this very path is outstanding: unlocking a
    prefix of a locked path would leave a page with fewer locks than the
    pages below it.
    """
    # CHECK
    check_handle(state, handle)
    if not is_handle_locked(state, handle):
        raise UnlockError.no_lock_ends_here(handle.cached_len)
    # UPDATE
    for key in get_handle_keys(state, handle):
        entry = state.entries[key]
        state.entries[key] = entry._replace(ref_count=entry.ref_count - 1)


def evict(state: PrefixCacheState, size: int) -> list[int]:
    """Evict exactly ceil(size / P) pages, least recently used evictable leaf first.

    Returns the evicted slots, ascending.
    """
    # CHECK
    check_evict_size(size, size_info(state).evictable_size)
    # UPDATE: one page at a time, the oldest evictable leaf; taking a page may make its parent a leaf.
    # (The leaves sit in a heap by last_access so that big evictions stay fast; the rule is the one above.)
    children = Counter(parent for key in state.entries if (parent := get_parent_key(key)) is not None)
    leaves = [
        (entry.last_access, id(key[1]), key)
        for key, entry in state.entries.items()
        if entry.ref_count == 0 and not children[key]
    ]
    heapq.heapify(leaves)
    starts = []
    for _ in range(div_ceil(size, state.page_size)):
        last_access, _, oldest = heapq.heappop(leaves)
        # each operation stamps one root path, so two leaves never share a stamp
        assert not leaves or leaves[0][0] != last_access, f"two evictable leaves share the stamp {last_access}"
        starts.append(state.entries.pop(oldest).slot_start)
        parent = get_parent_key(oldest)
        if parent is not None:
            children[parent] -= 1
            if not children[parent] and state.entries[parent].ref_count == 0:
                heapq.heappush(leaves, (state.entries[parent].last_access, id(parent[1]), parent))
    return sorted(compute_page_to_token(starts, state.page_size))


def reset(state: PrefixCacheState) -> list[int]:
    """Empty the cache; returns every slot it held, ascending. Refused while any page is locked."""
    # CHECK
    locked = size_info(state).protected_size
    if locked:
        raise CacheBusyError.tokens_locked(locked)
    # UPDATE
    starts = [entry.slot_start for entry in state.entries.values()]
    state.entries.clear()
    return sorted(compute_page_to_token(starts, state.page_size))


def check_evict_size(size: object, evictable: int) -> None:
    """An eviction of ``size`` tokens may run when ``evictable`` tokens are evictable; else raise, in this order:
    InvalidTypeError (not an int, or a bool), InvalidSizeError (negative), EvictionError (more than evictable).
    The spec's ``evict`` and those of the reference caches and both hybrid caches call it. The optimized radix
    cache checks the type and the sign itself, in the same words, leaves the last test to C, and calls it for
    the error when C refuses (and, before C, for sizes past what could ever be evictable).
    """
    if not isinstance(size, int) or isinstance(size, bool):
        raise InvalidTypeError(f"size must be an int, got {type(size).__name__}")
    if size < 0:
        raise InvalidSizeError.negative_evict(size)
    if size > evictable:
        raise EvictionError.past_evictable(size, evictable)


def check_type(handle: object) -> Handle:
    """``handle`` if it is a spec handle, else raise InvalidTypeError."""
    if not isinstance(handle, Handle):
        raise InvalidTypeError(f"expected a spec Handle, got {type(handle).__name__}")
    return handle


def check_handle(state: PrefixCacheState, handle: object) -> Handle:
    """``handle`` if it is a spec handle whose path is still cached, else raise."""
    checked = check_type(handle)
    if is_handle_stale(state, checked):
        raise StaleHandleError.lost_page(checked.cached_len)
    return checked
