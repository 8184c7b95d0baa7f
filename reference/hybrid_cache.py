"""The hybrid prefix cache (several attention groups) as a tree, in plain Python.

One node per page: each group's value differs page by page (a window group
has holes, and a lock covers only the window at the end of a match), so a
compressed node would split at nearly every page anyway. A node holds, per
group, the page's slot, stamp, lock count and generation, or ``None`` where
the group does not cache the page. A node stays in the tree while some
group caches it or some node below it; a path may run through nodes that
only hold the way down (a full group's page evicted under a window's).

The meaning is ``spec/hybrid.py``; ``abstract_state()`` maps this tree to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace, check_namespace, check_page_size, check_token_ids
from radixspec.spec.errors import (
    CacheBusyError,
    DuplicateSlotError,
    IntegrityError,
    InvalidTypeError,
    MisalignedPageError,
    MissingPageError,
    StaleHandleError,
    UnlockError,
)
from radixspec.spec.helpers import compute_page_to_token, div_ceil
from radixspec.spec.prefix_cache import check_evict_size
from radixspec.spec.types import SizeInfo

from .base import NotCopyable
from .threads import new_mutex, serialized


@dataclass
class PageValue:
    """One group's copy of a page."""

    # first of the page's P slots in that group's pool
    slot_start: int
    # clock value of the last match/insert that used (or cached) the page
    last_access: int
    # outstanding locks whose match uses the page
    ref_count: int
    # clock value of the insert that cached it
    generation: int


class HybridNode:
    """One page of a path: its tokens, and per group its value or None."""

    def __init__(self, parent: HybridNode | None, page: tuple[int, ...], groups: int) -> None:
        self.parent = parent
        self.page = page
        self.children: dict[tuple[int, ...], HybridNode] = {}
        self.values: list[PageValue | None] = [None] * groups
        # tokens from the root to the end of this page
        self.depth: int = 0 if parent is None else parent.depth + len(page)


@dataclass(frozen=True)
class HybridHandle:
    """A valid match: its namespace, tokens, and per group the (node, generation) of each page it uses."""

    namespace: Namespace
    tokens: tuple[int, ...]
    used: tuple[tuple[tuple[HybridNode, int], ...], ...]
    # the cache that made it: a handle of another cache (or one built by hand) is refused
    cache: object = field(default=None, compare=False, repr=False)

    @property
    def cached_len(self) -> int:
        """Matched tokens (page aligned)."""
        return len(self.tokens)


# one call at a time (reference/threads.py): a cache may be shared between threads
@serialized(
    "walk",
    "match_len",
    "used_values",
    "make_handle",
    "is_stale",
    "check_handle",
    "get_matched_pages",
    "nodes",
    "size_info",
    "take_tick",
    "match_prefix",
    "insert_prefix",
    "lock",
    "unlock",
    "add_refs",
    "evict",
    "is_evictable",
    "has_group_below",
    "prune",
    "reset",
    "abstract_state",
    "abstract_handle",
    "check_integrity",
)
class HybridRadixCache(NotCopyable):
    """A prefix cache for several attention groups (``windows``: None for full attention, W for a window)."""

    def __init__(self, page_size: int, windows: Sequence[hy.Window]) -> None:
        self.page_size = check_page_size(page_size)
        self._mutex = new_mutex()
        self.windows = hy.check_windows(windows)
        self.roots: dict[Namespace, HybridNode] = {}
        # per group: the slot starts it caches (to refuse a duplicate in O(1))
        self.starts: list[set[int]] = [set() for _ in self.windows]
        self.locks: Counter[tuple[Namespace, tuple[int, ...]]] = Counter()
        self.clock = 0

    # ------------------------------------------------------------ reads

    def walk(self, namespace: Namespace, tokens: Sequence[int], create: bool = False) -> list[HybridNode]:
        """The nodes of the whole pages of ``tokens`` that the tree holds (all of them with ``create``)."""
        p = self.page_size
        node = self.roots.get(namespace)
        if node is None:
            if not create:
                return []
            node = self.roots[namespace] = HybridNode(None, (), len(self.windows))
        path = []
        for end in range(p, len(tokens) - len(tokens) % p + 1, p):
            page = tuple(tokens[end - p : end])
            child = node.children.get(page)
            if child is None:
                if not create:
                    break
                child = node.children[page] = HybridNode(node, page, len(self.windows))
            path.append(child)
            node = child
        return path

    def match_len(self, path: Sequence[HybridNode], whole_pages: int) -> int:
        """The longest valid match of ``whole_pages`` pages along ``path`` (spec: hy.compute_match_len).

        The path may be shorter than the input: past it no group caches a page, which only a match
        that uses none there (windows of one token) may run through.
        """
        p = self.page_size

        def cached(page: int, group: int) -> bool:
            return page < len(path) and path[page].values[group] is not None

        longest = whole_pages
        for group, window in enumerate(self.windows):
            if window is None:
                longest = next((i for i in range(longest) if not cached(i, group)), longest)
        for pages in range(longest, 0, -1):
            if all(
                cached(page, group)
                for group, window in enumerate(self.windows)
                if window is not None
                for page in hy.compute_used_pages(pages * p, window, p)
            ):
                return pages * p
        return 0

    def used_values(self, path: Sequence[HybridNode], length: int) -> list[list[tuple[HybridNode, PageValue]]]:
        """Per group, the (node, value) of each page a match of ``length`` along ``path`` uses."""
        used = []
        for group, window in enumerate(self.windows):
            row = []
            for page in hy.compute_used_pages(length, window, self.page_size):
                value = path[page].values[group]
                assert value is not None, "a valid match uses only cached pages"
                row.append((path[page], value))
            used.append(row)
        return used

    def make_handle(
        self, namespace: Namespace, tokens: Sequence[int], path: Sequence[HybridNode], length: int
    ) -> HybridHandle:
        """The handle of a valid match of ``tokens[:length]`` along ``path``."""
        used = tuple(tuple((node, value.generation) for node, value in row) for row in self.used_values(path, length))
        return HybridHandle(namespace, tuple(tokens[:length]), used, self)

    def is_stale(self, handle: HybridHandle) -> bool:
        """True when a page the handle uses was evicted (or evicted and cached again) since it was made."""
        return any(
            (value := node.values[group]) is None or value.generation != generation
            for group, row in enumerate(handle.used)
            for node, generation in row
        )

    def check_handle(self, handle: object) -> HybridHandle:
        """``handle`` if it is a live handle of this cache, else raise."""
        if not isinstance(handle, HybridHandle):
            raise InvalidTypeError(f"expected a reference HybridHandle, got {type(handle).__name__}")
        if handle.cache is not self:
            raise InvalidTypeError.foreign_handle()
        if self.is_stale(handle):
            raise StaleHandleError.lost_page(handle.cached_len)
        return handle

    def get_matched_pages(self, handle: HybridHandle) -> list[list[int | None]]:
        """Per group, one entry per page of the match: its slot start where the match uses it, else None."""
        # CHECK
        self.check_handle(handle)
        # WALK
        rows: list[list[int | None]] = []
        for group, row in enumerate(handle.used):
            out: list[int | None] = [None] * (handle.cached_len // self.page_size)
            for node, _ in row:
                value = node.values[group]
                assert value is not None
                out[node.depth // self.page_size - 1] = value.slot_start
            rows.append(out)
        return rows

    def nodes(self) -> Iterator[HybridNode]:
        """Every node below the roots, parents before children."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def size_info(self, group: int) -> SizeInfo:
        """Evictable (ref 0) and protected (ref > 0) tokens of one group."""
        # CHECK (-1 would read the last group)
        group = hy.check_group(group, len(self.windows))
        values = [v for node in self.nodes() if (v := node.values[group]) is not None]
        locked = sum(1 for v in values if v.ref_count)
        return SizeInfo((len(values) - locked) * self.page_size, locked * self.page_size)

    # ------------------------------------------------------------ operations

    def take_tick(self) -> int:
        """Advance the logical clock; return this operation's stamp."""
        self.clock += 1
        return self.clock - 1

    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> HybridHandle:
        """Longest valid page-aligned match; stamps the pages it uses in every group."""
        # CHECK
        tokens = check_token_ids(input_ids)
        namespace = check_namespace(namespace)
        # WALK
        path = self.walk(namespace, tokens)
        length = self.match_len(path, len(tokens) // self.page_size)
        # UPDATE
        t = self.take_tick()
        for row in self.used_values(path, length):
            for _, value in row:
                value.last_access = t
        return self.make_handle(namespace, tokens, path, length)

    def insert_prefix(
        self, input_ids: Sequence[int], pages: Sequence[Sequence[int | None]], namespace: Namespace = None
    ) -> hy.HybridInsertResult:
        """Cache the whole pages of ``input_ids`` in every group (``pages[g][k]``: page k's start in group g)."""
        # CHECK
        tokens = check_token_ids(input_ids)
        rows = hy.check_group_pages(pages)
        namespace = check_namespace(namespace)
        p = self.page_size
        hy.check_group_lengths(rows, len(self.windows), len(tokens) // p)
        path = self.walk(namespace, tokens)
        for group, (window, row) in enumerate(zip(self.windows, rows, strict=True)):
            new_starts: set[int] = set()
            for page, start in enumerate(row):
                if page < len(path) and path[page].values[group] is not None:
                    continue
                if start is None:
                    if window is None:
                        raise MissingPageError.needs_page(group, page)
                    continue
                if start % p:
                    raise MisalignedPageError.start_not_aligned(group, page, start, p)
                if start in self.starts[group] or start in new_starts:
                    raise DuplicateSlotError.cached_slot(page, start, group)
                new_starts.add(start)
        # UPDATE
        path = self.walk(namespace, tokens, create=True)
        t = self.take_tick()
        unused: list[tuple[int, ...]] = []
        for group, row in enumerate(rows):
            taken = []
            for node, start in zip(path, row, strict=True):
                value = node.values[group]
                if value is not None:
                    value.last_access = t
                    if start is not None and start != value.slot_start:
                        taken.append(start)
                elif start is not None:
                    node.values[group] = PageValue(start, t, 0, t)
                    self.starts[group].add(start)
            unused.append(tuple(taken))
        if path:
            # pages no group took (None everywhere) hold no way down past the last cached one
            self.prune(path[-1])
        path = self.walk(namespace, tokens)
        length = self.match_len(path, len(tokens) // p)
        return hy.HybridInsertResult(tuple(unused), self.make_handle(namespace, tokens, path, length))

    def lock(self, handle: HybridHandle) -> None:
        """Add one lock to every page the handle uses; a match that uses no page holds no lock."""
        # CHECK
        self.check_handle(handle)
        if not any(handle.used):
            return
        # UPDATE
        self.add_refs(handle, +1)
        self.locks[(handle.namespace, handle.tokens)] += 1

    def unlock(self, handle: HybridHandle) -> None:
        """Remove one lock from every page the handle uses; refused unless a lock of this very match is outstanding."""
        # CHECK
        self.check_handle(handle)
        if not any(handle.used):
            return
        if not self.locks[(handle.namespace, handle.tokens)]:
            raise UnlockError.no_lock_of_match(handle.cached_len)
        # UPDATE
        self.add_refs(handle, -1)
        self.locks[(handle.namespace, handle.tokens)] -= 1
        if not self.locks[(handle.namespace, handle.tokens)]:
            del self.locks[(handle.namespace, handle.tokens)]

    def add_refs(self, handle: HybridHandle, delta: int) -> None:
        """Add ``delta`` to the lock count of every page the handle uses."""
        for group, row in enumerate(handle.used):
            for node, _ in row:
                value = node.values[group]
                assert value is not None
                value.ref_count += delta

    def evict(self, group: int, size: int) -> list[int]:
        """Evict exactly ceil(size / P) pages of ``group``, oldest evictable first (deeper first on a tie)."""
        # CHECK
        hy.check_group(group, len(self.windows))
        check_evict_size(size, self.size_info(group).evictable_size)
        # UPDATE
        starts = []
        for _ in range(div_ceil(size, self.page_size)):
            node = min(
                (n for n in self.nodes() if self.is_evictable(n, group)),
                key=lambda n: (n.values[group].last_access, -n.depth),  # type: ignore[union-attr]
            )
            value = node.values[group]
            assert value is not None
            starts.append(value.slot_start)
            self.starts[group].discard(value.slot_start)
            node.values[group] = None
            self.prune(node)
        return sorted(compute_page_to_token(starts, self.page_size))

    def is_evictable(self, node: HybridNode, group: int) -> bool:
        """True when the node's page of ``group`` may be evicted now."""
        value = node.values[group]
        return (
            # the group caches the page
            value is not None
            # nobody holds a lock on it
            and value.ref_count == 0
            # and it is a leaf of its group, or its group is a sliding window (which may leave a hole)
            and (self.windows[group] is not None or not self.has_group_below(node, group))
        )

    def has_group_below(self, node: HybridNode, group: int) -> bool:
        """True when ``group`` caches a page of some child of ``node``."""
        return any(child.values[group] is not None for child in node.children.values())

    def prune(self, node: HybridNode) -> None:
        """Drop ``node`` and its ancestors while they cache nothing and hold no way down."""
        while node.parent is not None and not node.children and all(v is None for v in node.values):
            del node.parent.children[node.page]
            node = node.parent

    def reset(self) -> list[list[int]]:
        """Empty every group; returns per group every slot it held, ascending. Refused while a lock is outstanding."""
        # CHECK
        if self.locks:
            raise CacheBusyError.locks_outstanding(sum(self.locks.values()))
        # UPDATE
        slots = [sorted(compute_page_to_token(sorted(starts), self.page_size)) for starts in self.starts]
        for node in list(self.nodes()):
            node.values = [None] * len(self.windows)
        self.roots.clear()
        self.starts = [set() for _ in self.windows]
        return slots

    # ------------------------------------------------------------ meaning and integrity

    def abstract_state(self) -> hy.HybridState:
        """This tree as the spec's hybrid state."""
        state = hy.new_state(self.page_size, self.windows)
        state.clock = self.clock
        state.locks = Counter(self.locks)
        for namespace, root in self.roots.items():
            stack: list[tuple[HybridNode, pc.Prefix | None]] = [(child, None) for child in root.children.values()]
            while stack:
                node, parent = stack.pop()
                prefix = pc.Prefix.extend(parent, node.page)
                for entries, value in zip(state.groups, node.values, strict=True):
                    if value is not None:
                        entries[(namespace, prefix)] = pc.Entry(
                            value.slot_start, value.last_access, value.ref_count, value.generation
                        )
                stack.extend((child, prefix) for child in node.children.values())
        return state

    def abstract_handle(self, handle: HybridHandle) -> hy.HybridHandle:
        """A handle as the spec's handle (same match, same generations)."""
        if not isinstance(handle, HybridHandle) or handle.cache is not self:
            raise InvalidTypeError("expected a HybridHandle of this cache")
        return hy.HybridHandle(handle.namespace, handle.tokens, tuple(tuple(g for _, g in row) for row in handle.used))

    def check_integrity(self) -> None:
        """Check the tree's own invariants, then every invariant of its abstract state."""
        for node in self.nodes():
            if not node.children and all(v is None for v in node.values):
                raise IntegrityError(f"tree_has_no_empty_leaves: node ending at token {node.depth} holds nothing")
        for group, starts in enumerate(self.starts):
            held = {v.slot_start for node in self.nodes() if (v := node.values[group]) is not None}
            if held != starts:
                raise IntegrityError(
                    f"start_sets_match_the_tree: group {group} lists {len(starts)} starts, holds {len(held)}"
                )
        hy.check_hybrid_invariants(self.abstract_state(), [self.size_info(g) for g in range(len(self.windows))])
