"""The radix tree prefix cache of the seed, in plain Python (lists and ints).

Compressed nodes: a node holds a run of whole pages (``key`` token ids,
``value`` slots). Child key: the first token (P == 1) or the first page as
a tuple (P > 1). A walk that stops inside a node splits it first, keeping
the original node as the suffix so that handles on it stay valid.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator, Sequence

from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import (
    Namespace,
    check_insert_inputs,
    check_namespace,
    check_page_size,
    check_token_ids,
)
from radixspec.spec.errors import (
    CacheBusyError,
    DuplicateSlotError,
    IntegrityError,
    InvalidTypeError,
    MisalignedPageError,
    StaleHandleError,
    UnlockError,
)
from radixspec.spec.helpers import align_down, compute_match_len, div_ceil, is_page_run
from radixspec.spec.invariants import check_invariants
from radixspec.spec.metrics import CacheStats, StatsCounter
from radixspec.spec.types import InsertResult, SizeInfo

from .base import BaseCacheHandle, BasePrefixCache
from .threads import PREFIX_CACHE_CALLS, new_mutex, serialized


class RadixTreeNode:
    """A run of whole cached pages: ``key`` tokens mapped to ``value`` slots."""

    def __init__(self, page_size: int, timestamp: int, generation: int) -> None:
        self.page_size = page_size
        self.children: dict[Hashable, RadixTreeNode] = {}
        self.parent: RadixTreeNode | None = None
        # locks on paths through this node
        self.ref_count = 0
        # logical time of the last match/insert through this node
        self.timestamp = timestamp
        # logical time of the insert that cached these pages
        self.generation = generation
        # set when the node leaves the tree (evicted or reset): handles on it are stale
        self.detached = False
        self.key: list[int] = []
        self.value: list[int] = []
        # a root's namespace (what its events name)
        self.namespace: Namespace = None
        # with events on: the hash of each of its pages (spec/events.py), split with the node
        self.page_hashes: list[int] = []

    def set_key_value(self, key: list[int], value: list[int]) -> None:
        """Set the node's tokens and slots (equal lengths)."""
        assert len(key) == len(value)
        self.key = key
        self.value = value

    def set_parent(self, parent: RadixTreeNode) -> None:
        """Hang this node under ``parent`` by its child key."""
        self.parent = parent
        parent.children[self.child_key(self.key)] = self

    def child_key(self, tokens: Sequence[int], start: int = 0) -> Hashable:
        """Key of the child that starts with ``tokens[start:]``: first token, or first page as a tuple."""
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

    @property
    def length(self) -> int:
        """Tokens in this node."""
        return len(self.key)

    def is_leaf(self) -> bool:
        """True when no child extends this node."""
        return not self.children

    def get_match_len(self, input_ids: Sequence[int], start: int = 0) -> int:
        """Common prefix length of this node's key and ``input_ids[start:]`` (no copy of the input)."""
        return compute_match_len(self.key, input_ids, start)

    def split_at(self, pos: int) -> RadixTreeNode:
        """Split off ``key[:pos]`` into a new parent node; this node keeps the suffix.

        The new node copies ref_count: every lock through the suffix also
        covers the prefix.
        """
        assert 0 < pos < self.length and pos % self.page_size == 0
        parent = self.parent
        assert parent is not None
        new_node = RadixTreeNode(self.page_size, self.timestamp, self.generation)
        new_node.set_key_value(self.key[:pos], self.value[:pos])
        new_node.set_parent(parent)
        new_node.ref_count = self.ref_count
        pages = pos // self.page_size
        new_node.page_hashes, self.page_hashes = self.page_hashes[:pages], self.page_hashes[pages:]
        self.set_key_value(self.key[pos:], self.value[pos:])
        self.set_parent(new_node)
        return new_node


class RadixCacheHandle(BaseCacheHandle):
    """A matched path: the node where the match ended and the matched length (plus its namespace and cache)."""

    def __init__(self, cached_len: int, node: RadixTreeNode, namespace: Namespace, cache: RadixPrefixCache) -> None:
        self.cached_len = cached_len
        self.node = node
        # the path's namespace (the spec's handle names it)
        self.namespace = namespace
        # the cache that made it: a handle of another cache is rejected
        self.cache = cache

    def get_matched_indices(self) -> list[int]:
        """Walk from the handle's node up to the root, then reverse: each node stores only its own run."""
        with self.cache._mutex:
            return self._matched_indices()

    def _matched_indices(self) -> list[int]:
        if self.node.detached:
            raise StaleHandleError.lost_page(self.cached_len)
        values: list[list[int]] = []
        node = self.node
        while node.parent is not None:
            values.append(node.value)
            node = node.parent
        values.reverse()
        return [slot for value in values for slot in value]

    def __repr__(self) -> str:
        return f"RadixCacheHandle(cached_len={self.cached_len})"


# one call at a time (threads.py): two threads never interleave inside the tree
@serialized(*PREFIX_CACHE_CALLS)
class RadixPrefixCache(ev.EmitsEvents, BasePrefixCache):
    """The seed's radix tree, one root per namespace, with exact LRU eviction of pages. Safe to share between
    threads: its calls run one at a time."""

    def __init__(self, page_size: int = 1, enable_events: bool = False) -> None:
        self.page_size = check_page_size(page_size)
        self._mutex = new_mutex()
        # one root per namespace that holds pages: made by the first insert, dropped when it empties
        self.roots: dict[Namespace, RadixTreeNode] = {}
        self.clock = 0
        self.evictable_size = 0
        self.protected_size = 0
        # first slot of every cached page (an insert must not reuse one)
        self.cached_starts: set[int] = set()
        # KV events (spec/events.py) not yet taken, or None when the cache emits none
        self.events: list[ev.Event] | None = [] if enable_events else None
        # metrics (spec/metrics.py): counted as the operations run
        self.counter = StatsCounter(self._holds_pages)
        self.eviction_age_sum = 0

    def _holds_pages(self, namespace: Namespace) -> bool:
        """Whether a page of ``namespace`` is cached (the counter asks; a bound method, so a deep copy's counter
        asks the copy)."""
        return namespace in self.roots

    def __deepcopy__(self, memo: dict[int, object]) -> RadixPrefixCache:
        """An independent cache in the same state (``BasePrefixCache.__deepcopy__``). Every node of the tree is
        made first and filled after, so that the copy recurses no deeper however deep the tree."""
        with self._mutex:
            nodes = (*self.roots.values(), *self._iter_nodes())
            copies = {id(node): object.__new__(RadixTreeNode) for node in nodes}
            memo.update(copies)
            for node in nodes:
                copied = copies[id(node)]
                # its numbers and namespace as they are (immutable), its lists its own, its links to the copies
                vars(copied).update(vars(node))
                copied.key, copied.value, copied.page_hashes = list(node.key), list(node.value), list(node.page_hashes)
                copied.children = {key: copies[id(child)] for key, child in node.children.items()}
                copied.parent = None if node.parent is None else copies[id(node.parent)]
            clone = super().__deepcopy__(memo)
        assert isinstance(clone, RadixPrefixCache)
        return clone

    def stats(self) -> CacheStats:
        """Hit rates, pages stored / evicted / dropped per namespace, mean eviction age (spec/metrics.py)."""
        return self.counter.snapshot(self.eviction_age_sum)

    # ------------------------------------------------------------ operations

    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> RadixCacheHandle:
        """Longest cached page-aligned prefix; stamps its nodes, splitting the last one if needed."""
        # CHECK
        tokens = check_token_ids(input_ids)
        namespace = check_namespace(namespace)
        # WALK
        asked = len(tokens)
        tokens = tokens[: align_down(len(tokens), self.page_size)]
        node, prefix_len = self._tree_walk(self._find_root(namespace), tokens, self._take_tick())
        # ACCOUNT
        self.counter.matched(namespace, asked, prefix_len)
        return RadixCacheHandle(prefix_len, node, namespace, self)

    def insert_prefix(
        self, input_ids: Sequence[int], indices: Sequence[int], namespace: Namespace = None
    ) -> InsertResult:
        """Cache the whole pages of ``input_ids``; new pages take their slots from ``indices``."""
        # CHECK
        tokens, slots, namespace = check_insert_inputs(input_ids, indices, namespace)
        insert_len = align_down(len(tokens), self.page_size)
        tokens, slots = tokens[:insert_len], slots[:insert_len]
        root = self._find_root(namespace)
        self._check_new_pages(slots, self._find_prefix_len(root, tokens))
        # WALK
        t = self._take_tick()
        node, prefix_len = self._tree_walk(root, tokens, t)
        # UPDATE
        if prefix_len < insert_len:
            # the namespace's first page gives it a root
            self.roots.setdefault(namespace, root)
            new_node = RadixTreeNode(self.page_size, t, t)
            new_node.set_key_value(list(tokens[prefix_len:]), list(slots[prefix_len:]))
            new_node.set_parent(node)
            node_before = node
            # ACCOUNT
            self.evictable_size += new_node.length
            self.cached_starts.update(slots[prefix_len :: self.page_size])
            self.counter.stored(namespace, new_node.length // self.page_size)
            node = new_node
            if self.events is not None:
                parent_hash = node_before.page_hashes[-1] if node_before.page_hashes else None
                stored = ev.stored_pages(
                    namespace, parent_hash, new_node.key, self.page_size, new_node.value[:: self.page_size]
                )
                new_node.page_hashes = [page.page_hash for page in stored]
                self.events += stored
        return InsertResult(prefix_len, RadixCacheHandle(insert_len, node, namespace, self))

    def lock(self, handle: BaseCacheHandle) -> None:
        """+1 ref on every node from the handle's node up to the root."""
        # CHECK
        node = self._check_handle(handle).node
        # UPDATE
        while node.parent is not None:
            if node.ref_count == 0:
                # ACCOUNT
                self.evictable_size -= node.length
                self.protected_size += node.length
            node.ref_count += 1
            node = node.parent

    def unlock(self, handle: BaseCacheHandle) -> None:
        """-1 ref on every node from the handle's node up to the root."""
        # CHECK
        checked = self._check_handle(handle)
        if not self.is_handle_locked(checked):
            raise UnlockError.no_lock_ends_here(checked.cached_len)
        # UPDATE
        for node in _path_to_root(checked.node):
            node.ref_count -= 1
            if node.ref_count == 0:
                # ACCOUNT
                self.evictable_size += node.length
                self.protected_size -= node.length

    def is_handle_locked(self, handle: BaseCacheHandle) -> bool:
        """True when the handle is live and a lock ends at its node, not only locks of longer paths."""
        node = self._check_type(handle).node
        return (
            # no page of its path was evicted
            not node.detached
            # and the root (empty path) or a lock of this very path is outstanding
            and (node.parent is None or node.ref_count > sum(child.ref_count for child in node.children.values()))
        )

    def evict(self, size: int) -> list[int]:
        """Evict exactly ceil(size / P) pages, each time the last page of the LRU evictable leaf."""
        # CHECK
        pc.check_evict_size(size, self.evictable_size)
        # WALK
        leaves = [(node.timestamp, id(node), node) for node in self._iter_nodes() if self._is_evictable_leaf(node)]
        heapq.heapify(leaves)
        # UPDATE
        remaining = div_ceil(size, self.page_size)
        evicted: list[int] = []
        while remaining > 0:
            _, _, node = heapq.heappop(leaves)
            pages = node.length // self.page_size
            if pages > remaining:
                # evict only the last pages: the prefix stays cached as a new leaf
                node.split_at((pages - remaining) * self.page_size)
            evicted.extend(node.value)
            remaining -= node.length // self.page_size
            # ACCOUNT (metrics): the pages' namespace and how long ago they were used
            namespace = self._root_of(node).namespace
            self.counter.evicted(namespace, node.length // self.page_size)
            self.eviction_age_sum += (self.clock - node.timestamp) * (node.length // self.page_size)
            if self.events is not None:
                self.events += self._removed_pages(node)
            parent = self._detach(node)
            if self._is_evictable_leaf(parent):
                heapq.heappush(leaves, (parent.timestamp, id(parent), parent))
        # a namespace whose last page went keeps no root
        self.roots = {namespace: root for namespace, root in self.roots.items() if root.children}
        return sorted(evicted)

    def reset(self) -> list[int]:
        """Empty every namespace; returns every slot the cache held, ascending."""
        # CHECK
        if self.protected_size:
            raise CacheBusyError.tokens_locked(self.protected_size)
        # UPDATE
        slots: list[int] = []
        for namespace, root in self.roots.items():
            for node in _subtree(root):
                slots.extend(node.value)
                node.detached = True
                # ACCOUNT (metrics)
                self.counter.dropped(namespace, node.length // self.page_size)
        self.roots.clear()
        # ACCOUNT
        self.evictable_size = 0
        self.cached_starts.clear()
        if self.events is not None:
            self.events.append(ev.AllCleared())
        return sorted(slots)

    @property
    def size_info(self) -> SizeInfo:
        """Evictable and protected tokens, kept as running counters."""
        return SizeInfo(evictable_size=self.evictable_size, protected_size=self.protected_size)

    # ------------------------------------------------------------ checks and views

    def check_integrity(self) -> None:
        """Check the tree's structure, its counters, then the spec's invariants on its abstract state."""
        empty = [namespace for namespace, root in self.roots.items() if not root.children]
        if empty:
            raise IntegrityError(f"roots_hold_pages: namespaces {empty[:4]} keep a root without pages")
        evictable = protected = 0
        starts: list[int] = []
        for node in self._iter_nodes():
            problem = self._node_problem(node)
            if problem:
                raise IntegrityError(f"tree_is_well_formed: {problem}")
            if node.ref_count:
                protected += node.length
            else:
                evictable += node.length
            starts.extend(node.value[:: self.page_size])
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise IntegrityError(
                f"size_counters_match_tree: counters say ({self.evictable_size}, {self.protected_size}),"
                f" the tree holds ({evictable}, {protected})"
            )
        if sorted(starts) != sorted(self.cached_starts):
            raise IntegrityError(
                f"cached_starts_match_tree: {len(self.cached_starts)} starts recorded, {len(starts)} in the tree"
            )
        check_invariants(self.abstract_state(), reported=self.size_info)

    def _node_problem(self, node: RadixTreeNode) -> str | None:
        """What is wrong with a non-root node, or None."""
        parent = node.parent
        assert parent is not None
        p = self.page_size
        if node.detached:
            return f"detached node of {node.length} tokens is still in the tree"
        if node.length == 0 or node.length % p or len(node.value) != node.length:
            return f"node has {node.length} tokens and {len(node.value)} slots, P={p}"
        if parent.children.get(node.child_key(node.key)) is not node:
            return f"node of {node.length} tokens is not its parent's child under its key"
        if not all(is_page_run(node.value[i : i + p], p) for i in range(0, node.length, p)):
            return f"node slots {node.value[:8]}... are not whole aligned pages"
        below = sum(child.ref_count for child in node.children.values())
        if node.ref_count < 0 or node.ref_count < below:
            return f"node ref_count {node.ref_count} is below its children's {below}"
        return None

    def abstract_state(self) -> pc.PrefixCacheState:
        """The spec's state: one entry per cached page."""
        p = self.page_size
        entries: dict[pc.PageKey, pc.Entry] = {}
        for namespace, root in self.roots.items():
            stack: list[tuple[RadixTreeNode, pc.Prefix | None]] = [(child, None) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                for i in range(0, node.length, p):
                    prefix = pc.Prefix.extend(prefix, tuple(node.key[i : i + p]))
                    entries[(namespace, prefix)] = pc.Entry(
                        node.value[i], node.timestamp, node.ref_count, node.generation
                    )
                stack.extend((child, prefix) for child in node.children.values())
        return pc.PrefixCacheState(page_size=p, entries=entries, clock=self.clock)

    def abstract_handle(self, handle: BaseCacheHandle) -> pc.Handle:
        """The spec handle of the same path (works on stale handles too)."""
        checked = self._check_type(handle)
        nodes = list(_path_to_root(checked.node))
        nodes.reverse()
        tokens = tuple(t for node in nodes for t in node.key)
        generations = tuple(node.generation for node in nodes for _ in range(node.length // self.page_size))
        return pc.Handle(checked.namespace, tokens, generations)

    # ------------------------------------------------------------ internals

    def _removed_pages(self, node: RadixTreeNode) -> list[ev.Event]:
        """PageRemoved events of a leaf's pages, deepest first (a page goes before its parent)."""
        namespace = self._root_of(node).namespace
        return [ev.PageRemoved(namespace, page_hash) for page_hash in reversed(node.page_hashes)]

    @staticmethod
    def _root_of(node: RadixTreeNode) -> RadixTreeNode:
        """The root above a node (its namespace's)."""
        while node.parent is not None:
            node = node.parent
        return node

    def _take_tick(self) -> int:
        """Advance the logical clock; return the stamp of this operation."""
        t = self.clock
        self.clock += 1
        return t

    def _find_root(self, namespace: Namespace) -> RadixTreeNode:
        """The root of ``namespace``, or an empty root kept nowhere when it holds no pages (changes nothing)."""
        root = self.roots.get(namespace)
        if root is None:
            root = RadixTreeNode(self.page_size, -1, -1)
            root.namespace = namespace
        return root

    def _tree_walk(self, root: RadixTreeNode, input_ids: Sequence[int], t: int) -> tuple[RadixTreeNode, int]:
        """Follow ``input_ids`` (whole pages) down from ``root``; stamp every node passed with ``t``."""
        prefix_len = 0
        node = root
        while prefix_len < len(input_ids):
            child = node.children.get(node.child_key(input_ids, prefix_len))
            if child is None:
                return node, prefix_len
            node = child
            # the child key matched, so at least one page matches
            match_len = align_down(node.get_match_len(input_ids, prefix_len), self.page_size)
            prefix_len += match_len
            if match_len != node.length:
                node = node.split_at(match_len)
                node.timestamp = t
                return node, prefix_len
            node.timestamp = t
        return node, prefix_len

    def _find_prefix_len(self, root: RadixTreeNode, input_ids: Sequence[int]) -> int:
        """Cached length of ``input_ids`` (whole pages), changing nothing."""
        prefix_len = 0
        node = root
        while prefix_len < len(input_ids):
            child = node.children.get(node.child_key(input_ids, prefix_len))
            if child is None:
                break
            match_len = align_down(child.get_match_len(input_ids, prefix_len), self.page_size)
            prefix_len += match_len
            if match_len != child.length:
                break
            node = child
        return prefix_len

    def _check_new_pages(self, slots: Sequence[int], cached_len: int) -> None:
        """Raise unless every new page of an insert is an aligned run of slots not cached yet."""
        p = self.page_size
        seen: set[int] = set()
        for start in range(cached_len, len(slots), p):
            page = slots[start : start + p]
            if not is_page_run(page, p):
                raise MisalignedPageError.not_a_run(start // p, list(page), p)
            if page[0] in self.cached_starts or page[0] in seen:
                raise DuplicateSlotError.cached_slot(start // p, page[0])
            seen.add(page[0])

    def _check_type(self, handle: object) -> RadixCacheHandle:
        """``handle`` if it is a handle of this cache, else raise InvalidTypeError."""
        if not isinstance(handle, RadixCacheHandle):
            raise InvalidTypeError(f"expected a RadixCacheHandle, got {type(handle).__name__}")
        if handle.cache is not self:
            raise InvalidTypeError.foreign_handle()
        return handle

    def _check_handle(self, handle: object) -> RadixCacheHandle:
        """``handle`` if it is a live handle of this cache, else raise."""
        checked = self._check_type(handle)
        if checked.node.detached:
            raise StaleHandleError.lost_page(checked.cached_len)
        return checked

    def _is_evictable_leaf(self, node: RadixTreeNode) -> bool:
        """True when evict() may take ``node``'s last page now."""
        return (
            # a root holds no pages
            node.parent is not None
            # nobody holds a lock on it
            and node.ref_count == 0
            # and no cached page extends it
            and node.is_leaf()
        )

    def _detach(self, node: RadixTreeNode) -> RadixTreeNode:
        """Remove a leaf from the tree; handles on it become stale. Returns its parent."""
        parent = node.parent
        assert parent is not None and node.is_leaf()
        del parent.children[node.child_key(node.key)]
        node.detached = True
        # ACCOUNT
        self.evictable_size -= node.length
        self.cached_starts.difference_update(node.value[:: self.page_size])
        return parent

    def _iter_nodes(self) -> Iterator[RadixTreeNode]:
        """Every non-root node of every namespace."""
        for root in self.roots.values():
            yield from _subtree(root)


def _subtree(root: RadixTreeNode) -> Iterator[RadixTreeNode]:
    """Every node below ``root`` (not the root itself)."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _path_to_root(node: RadixTreeNode) -> Iterator[RadixTreeNode]:
    """``node`` and its ancestors, excluding the root."""
    while node.parent is not None:
        yield node
        node = node.parent
