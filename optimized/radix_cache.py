"""The radix tree prefix cache on torch tensors. Twin of ``reference.radix_cache``.

Optimized for speed rather than clarity: token keys are int64 CPU tensors
compared in C on raw pointers (no slice tensors on the walk), slot values
are int32 tensors on the cache's device, and evictable leaves are ordered
by timestamp with lazy deletion (a queue for stamps pushed in order, a
min-heap for the rest), so ``evict`` costs O(1) per page for the usual
fresh leaves and O(log n) at worst, however large the tree. Ref counts keep,
per node, the sum of its children's counts (``child_refs``), so lock checks
are O(1) per node.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterator, Sequence

import torch

from spec import prefix_cache as pc
from spec.errors import (
    CacheBusyError,
    DuplicateSlotError,
    EvictionError,
    IntegrityError,
    InvalidSizeError,
    InvalidTypeError,
    MisalignedPageError,
    StaleHandleError,
    UnlockError,
)
from spec.helpers import align_down, div_ceil
from spec.invariants import check_invariants
from spec.types import InsertResult, Namespace, SizeInfo, check_namespace, check_page_size

from .inputs import as_insert_args, as_tokens, device_of
from .radix_kernel import PageKeyReader, first_bad_page

_INT64_BYTES = 8


class RadixTreeNode:
    """A run of whole cached pages. Twin of ``reference.radix_cache.RadixTreeNode``."""

    __slots__ = (
        "child_key",
        "child_refs",
        "children",
        "detached",
        "generation",
        "heap_ts",
        "key",
        "key_ptr",
        "length",
        "parent",
        "ref_count",
        "starts",
        "timestamp",
        "value",
    )

    def __init__(
        self, key: torch.Tensor, value: torch.Tensor, starts: list[int], timestamp: int, generation: int
    ) -> None:
        self.children: dict[Hashable, RadixTreeNode] = {}
        # this node's key in its parent's children (set when attached)
        self.child_key: Hashable = None
        # first slot of each page, on the host (what evict hands back to the cached_starts set)
        self.starts = starts
        self.parent: RadixTreeNode | None = None
        self.ref_count = 0
        # sum of the children's ref counts: locks that pass on below this node
        self.child_refs = 0
        self.timestamp = timestamp
        self.generation = generation
        self.detached = False
        # timestamp of this node's live heap entry, or None when it has none
        self.heap_ts: int | None = None
        self.set_key_value(key, value)

    def set_key_value(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key = key
        self.key_ptr = key.data_ptr()
        self.value = value
        self.length = key.numel()


class RadixCacheHandle:
    """A matched path. Twin of ``reference.radix_cache.RadixCacheHandle``."""

    __slots__ = ("cache", "cached_len", "namespace", "node")

    def __init__(self, cached_len: int, node: RadixTreeNode, namespace: Namespace, cache: RadixPrefixCache) -> None:
        self.cached_len = cached_len
        self.node = node
        self.namespace = namespace
        self.cache = cache

    def get_matched_indices(self) -> torch.Tensor:
        """Slots of the path in sequence order: a new int32 tensor on the cache's device; stale once evicted."""
        node = self.node
        if node.detached:
            raise StaleHandleError(f"handle of cached_len {self.cached_len} lost a page to eviction")
        values = []
        while node.parent is not None:
            values.append(node.value)
            node = node.parent
        if len(values) == 1:
            # a copy: the caller may write into what it gets, never into the tree
            return values[0].clone()
        values.reverse()
        return torch.cat(values) if values else node.value.new_empty(0)

    def __repr__(self) -> str:
        return f"RadixCacheHandle(cached_len={self.cached_len})"


class RadixPrefixCache:
    """Radix tree prefix cache on tensors. Twin of ``reference.RadixPrefixCache``."""

    def __init__(self, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.page_size = check_page_size(page_size)
        self.device = device_of(device)
        # one root per namespace that holds pages: made by the first insert, dropped when it empties
        self.roots: dict[Namespace, RadixTreeNode] = {}
        self.clock = 0
        self.evictable_size = 0
        self.protected_size = 0
        self.cached_starts: set[int] = set()
        self.num_nodes = 0
        # Evictable leaves by timestamp (LRU order), with lazy deletion: stamps pushed in increasing
        # order (fresh inserts and matches: the common case) queue up in ``fresh`` at O(1); the rest
        # (a leaf exposed by eviction, an old leaf unlocked) go to the min-heap ``heap``; the oldest
        # is the smaller of the two fronts. Distinct leaves never share a timestamp, so a stamp names
        # its leaf (``leaf_at``); stale stamps are skipped on pop.
        self.fresh: deque[int] = deque()
        self.heap: list[int] = []
        self.leaf_at: dict[int, RadixTreeNode] = {}
        # set when an eviction took a namespace's last page (its root goes at the end of evict)
        self._emptied_root = False
        self._empty_key = torch.empty(0, dtype=torch.int64)
        self._offsets = torch.arange(self.page_size, dtype=torch.int32, device=self.device)
        self._keys = PageKeyReader(self.page_size)

    # ------------------------------------------------------------ operations

    def match_prefix(self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None) -> RadixCacheHandle:
        """Longest cached page-aligned prefix; stamps its nodes, splitting the last one if needed."""
        # CHECK
        ids, _ = as_tokens(input_ids)
        namespace = check_namespace(namespace)
        # WALK
        root = self._find_root(namespace)
        path, partial, prefix_len = self._find(root, ids, align_down(ids.numel(), self.page_size))
        # UPDATE
        node = self._stamp_path(root, path, partial, self._take_tick())
        return RadixCacheHandle(prefix_len, node, namespace, self)

    def insert_prefix(
        self,
        input_ids: torch.Tensor | Sequence[int],
        indices: torch.Tensor | Sequence[int],
        namespace: Namespace = None,
    ) -> InsertResult:
        """Cache the whole pages of ``input_ids``; new pages take their slots from ``indices``."""
        # CHECK
        ids, ids_owned, slots, slots_owned, namespace = as_insert_args(input_ids, indices, namespace, self.device)
        insert_len = align_down(ids.numel(), self.page_size)
        root = self._find_root(namespace)
        path, partial, prefix_len = self._find(root, ids, insert_len)
        new_starts = self._check_new_pages(slots, prefix_len, insert_len)
        # WALK
        t = self._take_tick()
        node = self._stamp_path(root, path, partial, t)
        # UPDATE
        if prefix_len < insert_len:
            self.roots.setdefault(namespace, root)
            key = ids[prefix_len:insert_len]
            value = slots[prefix_len:insert_len]
            new_node = RadixTreeNode(
                key if ids_owned else key.clone(), value if slots_owned else value.clone(), new_starts, t, t
            )
            self._attach(new_node, node, self._keys(new_node.key_ptr, 0))
            # ACCOUNT
            self.evictable_size += new_node.length
            self.cached_starts.update(new_starts)
            self._push(new_node)
            node = new_node
        return InsertResult(prefix_len, RadixCacheHandle(insert_len, node, namespace, self))

    def lock(self, handle: RadixCacheHandle) -> None:
        """+1 ref on every node from the handle's node up to the root. O(depth)."""
        # CHECK
        node = self._check_handle(handle).node
        # UPDATE
        parent = node.parent
        while parent is not None:
            if node.ref_count == 0:
                self.evictable_size -= node.length
                self.protected_size += node.length
            node.ref_count += 1
            parent.child_refs += 1
            node, parent = parent, parent.parent

    def unlock(self, handle: RadixCacheHandle) -> None:
        """-1 ref on every node from the handle's node up to the root. O(depth)."""
        # CHECK
        checked = self._check_handle(handle)
        if not self.is_handle_locked(checked):
            raise UnlockError(f"no lock ends at the last node of this handle (cached_len {checked.cached_len})")
        # UPDATE
        node = checked.node
        parent = node.parent
        while parent is not None:
            node.ref_count -= 1
            parent.child_refs -= 1
            if node.ref_count == 0:
                self.evictable_size += node.length
                self.protected_size -= node.length
                if not node.children:
                    self._push(node)
            node, parent = parent, parent.parent

    def is_handle_locked(self, handle: RadixCacheHandle) -> bool:
        """True when the handle is live and a lock ends at its node, not only locks of longer paths."""
        node = self._check_type(handle).node
        return not node.detached and (node.parent is None or node.ref_count > node.child_refs)

    def evict(self, size: int) -> torch.Tensor:
        """Evict exactly ceil(size / P) pages, LRU evictable leaf first; slots ascending (int32)."""
        # CHECK
        if not isinstance(size, int) or isinstance(size, bool):
            raise InvalidTypeError(f"size must be an int, got {type(size).__name__}")
        if size < 0:
            raise InvalidSizeError(f"cannot evict a negative size ({size})")
        if size > self.evictable_size:
            raise EvictionError(f"cannot evict {size} tokens, only {self.evictable_size} are evictable")
        # UPDATE
        p = self.page_size
        remaining = div_ceil(size, p)
        evicted: list[torch.Tensor] = []
        while remaining > 0:
            node = self._pop_evictable()
            pages = node.length // p
            if pages > remaining:
                self._split(node, (pages - remaining) * p)
            evicted.append(node.value)
            remaining -= node.length // p
            parent = self._detach(node)
            if parent.parent is not None and parent.ref_count == 0 and not parent.children:
                self._push(parent)
            elif parent.parent is None and not parent.children:
                self._emptied_root = True
        if self._emptied_root:
            # a namespace whose last page went keeps no root
            self.roots = {namespace: root for namespace, root in self.roots.items() if root.children}
            self._emptied_root = False
        if not evicted:
            return self._offsets[:0]
        slots = evicted[0] if len(evicted) == 1 else torch.cat(evicted)
        # one page is already ascending
        return slots if slots.numel() == p else torch.sort(slots).values

    def reset(self) -> torch.Tensor:
        """Empty every namespace; returns every slot the cache held, ascending (int32)."""
        # CHECK
        if self.protected_size:
            raise CacheBusyError(f"cannot reset: {self.protected_size} tokens are locked")
        # UPDATE
        values = []
        for node in list(self._iter_nodes()):
            values.append(node.value)
            node.detached = True
        self.roots.clear()
        # ACCOUNT
        self.evictable_size = 0
        self.cached_starts.clear()
        self.num_nodes = 0
        self.fresh.clear()
        self.heap.clear()
        self.leaf_at.clear()
        return torch.sort(torch.cat(values)).values if values else self._offsets[:0]

    @property
    def size_info(self) -> SizeInfo:
        """Evictable and protected tokens, kept as running counters."""
        return SizeInfo(evictable_size=self.evictable_size, protected_size=self.protected_size)

    # ------------------------------------------------------------ checks and views

    def check_integrity(self) -> None:
        """The tree's structure, its counters and heap, then the spec's invariants on its abstract state."""
        empty = [namespace for namespace, root in self.roots.items() if not root.children]
        if empty:
            raise IntegrityError(f"roots_hold_pages: namespaces {empty[:4]} keep a root without pages")
        evictable = protected = nodes = 0
        starts: list[int] = []
        live_entries = {
            id(node)
            for ts in [*self.fresh, *self.heap]
            if (node := self.leaf_at.get(ts)) and node.heap_ts == ts and not node.detached
        }
        for node in self._iter_nodes():
            nodes += 1
            problem = self._node_problem(node)
            if (
                problem is None
                and node.ref_count == 0
                and not node.children
                and (id(node) not in live_entries or node.heap_ts != self._lru_key(node))
            ):
                problem = f"evictable leaf of {node.length} tokens has no heap entry"
            if problem:
                raise IntegrityError(f"tree_is_well_formed: {problem}")
            if node.ref_count:
                protected += node.length
            else:
                evictable += node.length
            if node.starts != node.value[:: self.page_size].tolist():
                raise IntegrityError(f"tree_is_well_formed: node page starts {node.starts[:8]} disagree with its slots")
            starts.extend(node.starts)
        if (evictable, protected, nodes) != (self.evictable_size, self.protected_size, self.num_nodes):
            raise IntegrityError(
                f"size_counters_match_tree: counters say ({self.evictable_size}, {self.protected_size},"
                f" {self.num_nodes} nodes), the tree holds ({evictable}, {protected}, {nodes} nodes)"
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
        if node.length == 0 or node.length % p or node.value.numel() != node.length:
            return f"node has {node.length} tokens and {node.value.numel()} slots, P={p}"
        if node.key.dtype != torch.int64 or node.value.dtype != torch.int32 or node.value.device != self.device:
            return f"node holds {node.key.dtype} keys and {node.value.dtype} slots on {node.value.device}"
        if node.child_key != self._keys(node.key_ptr, 0) or parent.children.get(node.child_key) is not node:
            return f"node of {node.length} tokens is not its parent's child under its key"
        pages = node.value.view(-1, p)
        if bool(((pages[:, 0] % p != 0) | (pages != pages[:, :1] + self._offsets).any(dim=1)).any()):
            return f"node slots {node.value[:8].tolist()}... are not whole aligned pages"
        below = sum(child.ref_count for child in node.children.values())
        if node.ref_count < below or node.child_refs != below:
            return f"node ref_count {node.ref_count}, child_refs {node.child_refs}, children hold {below}"
        return None

    def abstract_state(self) -> pc.PrefixCacheState:
        """The spec's state: one entry per cached page."""
        p = self.page_size
        entries: dict[pc.PageKey, pc.Entry] = {}
        for namespace, root in self.roots.items():
            stack: list[tuple[RadixTreeNode, pc.Prefix | None]] = [(child, None) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                key = node.key.tolist()
                for page, start in enumerate(node.value[::p].tolist()):
                    prefix = pc.Prefix.extend(prefix, tuple(key[page * p : (page + 1) * p]))
                    entries[(namespace, prefix)] = pc.Entry(start, node.timestamp, node.ref_count, node.generation)
                stack.extend((child, prefix) for child in node.children.values())
        return pc.PrefixCacheState(page_size=p, entries=entries, clock=self.clock)

    def abstract_handle(self, handle: RadixCacheHandle) -> pc.Handle:
        """The spec handle of the same path (works on stale handles too)."""
        checked = self._check_type(handle)
        nodes = []
        node = checked.node
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        tokens = tuple(t for n in nodes for t in n.key.tolist())
        generations = tuple(n.generation for n in nodes for _ in range(n.length // self.page_size))
        return pc.Handle(checked.namespace, tokens, generations)

    # ------------------------------------------------------------ internals

    def _take_tick(self) -> int:
        t = self.clock
        self.clock += 1
        return t

    def _find_root(self, namespace: Namespace) -> RadixTreeNode:
        """The root of ``namespace``, or an empty root kept nowhere (an insert of its first page keeps it)."""
        root = self.roots.get(namespace)
        if root is None:
            root = RadixTreeNode(self._empty_key, self._offsets[:0], [], -1, -1)
        return root

    def _find(
        self, root: RadixTreeNode, ids: torch.Tensor, n: int
    ) -> tuple[list[RadixTreeNode], tuple[RadixTreeNode, int] | None, int]:
        """Follow ``ids[:n]`` (whole pages) down from ``root``, changing nothing.

        Returns the fully matched nodes, the node matched only in part with
        its matched length (or None), and the matched length.
        """
        p = self.page_size
        keys = self._keys
        path: list[RadixTreeNode] = []
        node, prefix_len = root, 0
        base = ids.data_ptr()
        while prefix_len < n:
            child = node.children.get(keys(base, prefix_len))
            if child is None:
                break
            m = keys.compare(child.key_ptr, base + prefix_len * _INT64_BYTES, min(child.length, n - prefix_len))
            m = m - m % p
            prefix_len += m
            if m != child.length:
                return path, (child, m), prefix_len
            path.append(child)
            node = child
        return path, None, prefix_len

    def _stamp_path(
        self,
        root: RadixTreeNode,
        path: list[RadixTreeNode],
        partial: tuple[RadixTreeNode, int] | None,
        t: int,
    ) -> RadixTreeNode:
        """Stamp the walked nodes with ``t``, splitting the partly matched one; return the last node."""
        for node in path:
            node.timestamp = t
        if partial is not None:
            child, m = partial
            node = self._split(child, m)
            node.timestamp = t
            return node
        if not path:
            return root
        last = path[-1]
        if not last.children and last.ref_count == 0:
            self._push(last)
        return last

    def _split(self, node: RadixTreeNode, pos: int) -> RadixTreeNode:
        """Split off ``key[:pos]`` into a new parent node; ``node`` keeps the suffix and its identity."""
        parent = node.parent
        assert parent is not None and 0 < pos < node.length
        page = pos // self.page_size
        new_node = RadixTreeNode(node.key[:pos], node.value[:pos], node.starts[:page], node.timestamp, node.generation)
        new_node.ref_count = node.ref_count
        new_node.child_refs = node.ref_count
        self._attach(new_node, parent, node.child_key)
        node.set_key_value(node.key[pos:], node.value[pos:])
        node.starts = node.starts[page:]
        self._attach(node, new_node, self._keys(node.key_ptr, 0), count=False)
        return new_node

    def _attach(self, node: RadixTreeNode, parent: RadixTreeNode, child_key: Hashable, count: bool = True) -> None:
        node.parent = parent
        node.child_key = child_key
        parent.children[child_key] = node
        if count:
            self.num_nodes += 1

    def _detach(self, node: RadixTreeNode) -> RadixTreeNode:
        """Remove an unlocked leaf; handles on it become stale. Returns its parent."""
        parent = node.parent
        assert parent is not None and not node.children and node.ref_count == 0
        del parent.children[node.child_key]
        node.detached = True
        node.heap_ts = None
        self.num_nodes -= 1
        self.evictable_size -= node.length
        self.cached_starts.difference_update(node.starts)
        return parent

    def _push(self, node: RadixTreeNode) -> None:
        """Give an evictable leaf a heap entry at its current timestamp (once per timestamp)."""
        key = self._lru_key(node)
        if node.heap_ts == key and self.leaf_at.get(key) is node:
            return
        node.heap_ts = key
        self.leaf_at[key] = node
        if not self.fresh or key > self.fresh[-1]:
            self.fresh.append(key)
        else:
            heapq.heappush(self.heap, key)
        if len(self.fresh) + len(self.heap) > 2 * self.num_nodes + 64:
            self._compact_heap()

    def _pop_evictable(self) -> RadixTreeNode:
        """Pop the evictable leaf with the oldest timestamp, skipping stale entries."""
        while True:
            if self.heap and (not self.fresh or self.heap[0] < self.fresh[0]):
                ts = heapq.heappop(self.heap)
            else:
                ts = self.fresh.popleft()
            node = self.leaf_at.pop(ts, None)
            if node is None or node.heap_ts != ts or node.detached:
                continue
            node.heap_ts = None
            if node.ref_count == 0 and not node.children and self._lru_key(node) == ts:
                return node

    @staticmethod
    def _lru_key(node: RadixTreeNode) -> int:
        """Eviction order: least recently used first (the last access stamp)."""
        return node.timestamp

    def _compact_heap(self) -> None:
        """Drop stale entries (amortized: runs after as many pushes as there are nodes); O(n log n)."""
        self.leaf_at = {ts: n for ts, n in self.leaf_at.items() if n.heap_ts == ts and not n.detached}
        self.fresh = deque(sorted(self.leaf_at))
        self.heap = []

    def _check_new_pages(self, slots: torch.Tensor, start: int, end: int) -> list[int]:
        """Page starts of the new pages ``slots[start:end]``; raise unless aligned, whole and not cached."""
        p = self.page_size
        if start == end:
            return []
        new = slots[start:end]
        page = first_bad_page(new, p) if p > 1 else new.numel()
        if page < new.numel() // p:
            raise MisalignedPageError(
                f"page {start // p + page} has slots {new[page * p : (page + 1) * p].tolist()}:"
                f" not a run start..start+{p - 1} with start % {p} == 0"
            )
        new_starts = new[::p].tolist()
        seen: set[int] = set()
        for page, first in enumerate(new_starts):
            if first in self.cached_starts or first in seen:
                raise DuplicateSlotError(f"page {start // p + page} takes slot {first}, which is already cached")
            seen.add(first)
        return new_starts

    def _check_type(self, handle: object) -> RadixCacheHandle:
        if not isinstance(handle, RadixCacheHandle):
            raise InvalidTypeError(f"expected an optimized RadixCacheHandle, got {type(handle).__name__}")
        if handle.cache is not self:
            raise InvalidTypeError("the handle belongs to another cache")
        return handle

    def _check_handle(self, handle: object) -> RadixCacheHandle:
        checked = self._check_type(handle)
        if checked.node.detached:
            raise StaleHandleError(f"handle of cached_len {checked.cached_len} lost a page to eviction")
        return checked

    def _iter_nodes(self) -> Iterator[RadixTreeNode]:
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
