"""The radix tree prefix cache, its tree in C. Twin of ``radixspec.reference.radix_cache``.

Optimized for speed rather than clarity: the nodes, their children maps,
keys, slots, ref counts and the LRU order of evictable leaves live in C
(``csrc/tree.c``, through cffi); Python holds handles, which name a node by
(id, version), and the namespaces' roots. The operations (match, insert,
lock, unlock, evict) make no Python object and no torch call per node: each
is one C call on the caller's buffers, and a result tensor (matched slots,
evicted slots) is built once per call on the cache's device. ``reset()`` and
``stats()`` (the pages per namespace), and the introspection (``nodes()``,
``abstract_state()``), do walk the nodes in Python.

Same operations, same rules and the same errors as the reference: a walk
stamps every node it passes and splits the node a match ends in; eviction
takes exactly ceil(size / P) pages, the least recently used evictable leaf
page first, O(1) per page for leaves stamped in order and O(log n) at worst.
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from radixspec.reference.base import NotCopyable
from radixspec.reference.threads import PREFIX_CACHE_CALLS, new_mutex, serialized
from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace, check_namespace, check_page_size
from radixspec.spec.errors import (
    CacheBusyError,
    CacheError,
    DuplicateSlotError,
    IntegrityError,
    InvalidInputError,
    InvalidSizeError,
    InvalidTypeError,
    LengthMismatchError,
    MisalignedPageError,
    SlotOutOfRangeError,
    StaleHandleError,
    UnavailableError,
    UnlockError,
)
from radixspec.spec.invariants import check_invariants
from radixspec.spec.metrics import CacheStats, NamespaceStats, StatsCounter
from radixspec.spec.types import InsertResult, SizeInfo

from ._c import load_c, load_hotpath
from .inputs import as_insert_args, as_slots, as_tokens, device_of, int_view

if TYPE_CHECKING:
    from . import _hotpath
else:
    _hotpath = load_hotpath()

# the statuses of csrc/tree.h (enum radix_tree_status), by name from the compiled module
_FFI, _C = load_c()
read_int64 = _hotpath.read_int64
_OK, _ROOTS_EMPTIED, _BAD_ARGS = _C.RADIX_TREE_OK, _C.RADIX_TREE_ROOTS_EMPTIED, _C.RADIX_TREE_BAD_ARGS
_MISALIGNED, _DUPLICATE, _NO_MEMORY = _C.RADIX_TREE_MISALIGNED, _C.RADIX_TREE_DUPLICATE, _C.RADIX_TREE_NO_MEMORY
_STALE, _NOT_LOCKED, _NOT_EVICTABLE = _C.RADIX_TREE_STALE, _C.RADIX_TREE_NOT_LOCKED, _C.RADIX_TREE_NOT_EVICTABLE
_BUSY, _CORRUPT = _C.RADIX_TREE_BUSY, _C.RADIX_TREE_CORRUPT
_BAD_TOKEN, _BAD_SLOT = _C.RADIX_TREE_BAD_TOKEN, _C.RADIX_TREE_BAD_SLOT
_T = TypeVar("_T")
# bytes per token id or slot of the tensors C reads in place
_WIDTH = {torch.int64: 8, torch.int32: 4}
# the node of a handle that matched nothing: the namespace's root, which never goes stale
_ROOT = -1
# evict sizes above this are checked against the evictable size before the result buffer is allocated
_LARGE_EVICT = 1 << 20


class RadixTreeNode(NamedTuple):
    """A snapshot of one node of the C tree (``RadixPrefixCache.nodes()``). Twin of ``reference.RadixTreeNode``.

    Only for tests, checks and debugging: the hot path has no Python object per node.
    """

    namespace: Namespace
    # index of the parent in the same snapshot, or -1 for a child of the namespace's root
    parent: int
    key: tuple[int, ...]
    # first slot of each page
    starts: tuple[int, ...]
    timestamp: int
    generation: int
    ref_count: int


class RadixCacheHandle(_hotpath.Handle):
    """A matched path: the node it ends at, by (id, version). Twin of ``reference.radix_cache.RadixCacheHandle``.

    ``RadixCacheHandle(cached_len, node, version, namespace, cache)``; its fields live in its C base class
    (csrc/hotpath.c), which the hot path fills without running Python code."""

    __slots__ = ()

    cache: RadixPrefixCache

    def __deepcopy__(self, memo: dict[int, object]) -> RadixCacheHandle:
        """The same path in the deep copy of its cache (a copied tree keeps every node's name)."""
        cache = copy.deepcopy(self.cache, memo)
        return type(self)(self.cached_len, self.node, self.version, self.namespace, cache)

    def get_matched_indices(self) -> torch.Tensor:
        """Slots of the path in sequence order: a new int32 tensor on the cache's device; stale once evicted."""
        return self.cache._path_slots(self)

    def __repr__(self) -> str:
        return f"RadixCacheHandle(cached_len={self.cached_len})"


class CountedStats(_hotpath.Counts, NamespaceStats):
    """A namespace's counters (spec/metrics.py) whose fields are C integers (csrc/hotpath.c): the hot path adds to
    them without making Python ints."""


# the state fields of the C base class (csrc/hotpath.c's Core members), which a deep copy copies: the counter's table
# last (it is the copied counter's own)
_CORE_STATE = ("clock", "roots", "_namespace_of", "_evict_clock_sum", "events", "_counts")


# one call at a time (reference/threads.py): cffi lets other threads run during a C call, and the calls share
# scratch buffers (the walk, the token and slot rooms). match_prefix, insert_prefix and evict are the C base class's
# (csrc/hotpath.c): they take the common case in C with the GIL held, while no method here holds the mutex, and
# hand every other call to _match_prefix / _insert_prefix / _evict, which take the mutex
_SERIALIZED = tuple(name for name in PREFIX_CACHE_CALLS if name not in ("match_prefix", "insert_prefix", "evict"))


@serialized(
    *_SERIALIZED,
    "_match_prefix",
    "_insert_prefix",
    "_evict",
    "nodes",
    "path_nodes",
    "tree_stats",
    "break_invariant",
    "_path_slots",
)
class RadixPrefixCache(_hotpath.Core, NotCopyable, ev.EmitsEvents):
    """Radix tree prefix cache, its tree in C. Twin of ``reference.RadixPrefixCache``. Safe to share between
    threads: its calls run one at a time.

    ``match_prefix``, ``insert_prefix`` and ``evict`` come from the C base class (csrc/hotpath.c): a call with a
    torch tensor, a list or tuple of ints or a buffer of native int32/int64, in a namespace that holds pages (an
    exact-int size and an int32 ``out=`` for evict), runs whole in C; every other call (and every error) goes to
    ``_match_prefix`` / ``_insert_prefix`` / ``_evict`` below, the same operations in Python.
    """

    def __init__(self, page_size: int = 1, device: torch.device | str = "cpu", enable_events: bool = False) -> None:
        self.page_size = check_page_size(page_size)
        self.device = device_of(device)
        self._ffi, self._lib = load_c()
        self._own(self._lib.radix_tree_new(self.page_size))
        # one root per namespace that holds pages: made by the first insert, dropped when it empties
        self.roots: dict[Namespace, int] = {}
        self._namespace_of: dict[int, Namespace] = {}
        self.clock = 0
        # KV events (spec/events.py) not yet taken, or None when the cache emits none; with them, what each
        # cached page is by its first slot (namespace, page hash, depth): evict reports slots only
        self.events: list[ev.Event] | None = [] if enable_events else None
        self._announced: dict[int, tuple[Namespace, int, int]] = {}
        # metrics (spec/metrics.py): counted here as the operations run; evictions per namespace are
        # what was stored less what is cached and what reset dropped; C sums the evicted pages' stamps
        self.counter = StatsCounter(self._holds_pages, new_stats=CountedStats)
        # the hot path counts into the counter's table itself (a namespace already in it)
        self._counts = self.counter.counts
        self._evict_clock_sum = 0

    def _own(self, tree: Any) -> None:
        """Drive ``tree`` (a new C tree, or NULL when C ran out of memory): the lock, the hot path's binding and
        the buffers of the C calls, this cache's own (a deep copy makes its own too)."""
        if tree == self._ffi.NULL:
            raise MemoryError("radix_tree_new: out of memory")
        self._mutex = _hotpath.Mutex(new_mutex())
        self._tree = self._ffi.gc(tree, self._lib.radix_tree_free)
        # the hot path's tree (it keeps the owner alive too)
        self._bind_tree(self._tree, int(self._ffi.cast("uintptr_t", tree)), self.page_size, self.device.type == "cpu")
        # out-parameters of the C calls, allocated once: a walk's result and the counters (csrc/tree.h)
        self._walk = self._ffi.new("radix_tree_walk *")
        self._counters = self._ffi.new("radix_tree_counters *")
        # roots an evict emptied: C reports them here (room for every root), and says so by a status
        self._emptied_room = 16
        self._emptied = self._ffi.new("int64_t[]", self._emptied_room)
        self._n_emptied = self._ffi.new("int64_t *")
        # the hot calls, looked up once
        self._cast = self._ffi.cast
        self._from_buffer = self._ffi.from_buffer
        # where lists of token ids and slots are read to (grown as needed)
        self._token_room = _ListRoom(self._ffi, 256)
        self._slot_room = _ListRoom(self._ffi, 256)
        self._evict_c = self._lib.radix_tree_evict
        # evict(out=): the caller's buffer of the last call, its address and C pointer (checked once)
        self._out: torch.Tensor | None = None
        self._out_address = 0
        self._out_pointer: Any = None
        self._match_c = self._lib.radix_tree_match
        self._insert_c = self._lib.radix_tree_insert
        self._on_host = self.device.type == "cpu"

    def _holds_pages(self, namespace: Namespace) -> bool:
        """Whether a page of ``namespace`` is cached (the counter asks; a bound method, so a deep copy's counter
        asks the copy)."""
        return namespace in self.roots

    def __deepcopy__(self, memo: dict[int, object]) -> RadixPrefixCache:
        """An independent cache in the same state: a copy of the C tree (``radix_tree_clone``: the same nodes under
        the same names), the state fields copied deep (those of the C base class too), the machinery of
        ``_own`` its own. Handles copied in the same ``deepcopy`` call name the same paths in the copy."""
        with self._mutex:
            clone = type(self).__new__(type(self))
            memo[id(self)] = clone
            clone.page_size, clone.device, clone._ffi, clone._lib = self.page_size, self.device, self._ffi, self._lib
            clone._own(self._lib.radix_tree_clone(self._tree))
            state = [name for name in vars(self) if name not in vars(clone)]
            for name in (*state, *_CORE_STATE):
                setattr(clone, name, copy.deepcopy(getattr(self, name), memo))
        return clone

    def stats(self) -> CacheStats:
        """Hit rates, pages stored / evicted / dropped per namespace, mean eviction age (spec/metrics.py)."""
        cached: dict[Namespace, int] = {}
        for node in self.nodes():
            cached[node.namespace] = cached.get(node.namespace, 0) + len(node.starts)
        evicted = {
            namespace: counts.pages_stored - counts.pages_dropped - cached.get(namespace, 0)
            for namespace, counts in self.counter.counts.items()
        }
        age_sum = self._evict_clock_sum - self._lib.radix_tree_evicted_stamp_sum(self._tree)
        return self.counter.snapshot(age_sum, evicted)

    # ------------------------------------------------------------ operations

    if TYPE_CHECKING:

        def match_prefix(
            self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None
        ) -> RadixCacheHandle: ...

        def insert_prefix(
            self,
            input_ids: torch.Tensor | Sequence[int],
            indices: torch.Tensor | Sequence[int],
            namespace: Namespace = None,
        ) -> InsertResult: ...

        def evict(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def _match_prefix(self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None) -> RadixCacheHandle:
        """``match_prefix`` in Python: every call the C base class does not take (csrc/hotpath.c)."""
        # CHECK (the tokens' range in C, with the walk)
        tokens, n, width, values = self._tokens(input_ids)
        if namespace is not None:
            namespace = self._in_order(check_namespace, namespace, input_ids=input_ids)
        root = self.roots.get(namespace)
        if root is None or n < self.page_size:
            as_tokens(input_ids)  # no walk: the range checked here
            self.clock += 1
            self.counter.matched(namespace, n, 0)
            return RadixCacheHandle(0, _ROOT, 0, namespace, self)
        # WALK + UPDATE: stamp the path, split the node the match ends in
        walk = self._walk
        status = self._match_c(self._tree, root, tokens, width, n - n % self.page_size, n, self.clock, walk)
        if status != _OK:
            self._raise_for(status, tokens=values, bad=walk.bad)
        self.clock += 1
        length = walk.length
        self.counter.matched(namespace, n, length)
        if length == 0:
            return RadixCacheHandle(0, _ROOT, 0, namespace, self)
        return RadixCacheHandle(length, walk.node, walk.version, namespace, self)

    def _insert_prefix(
        self,
        input_ids: torch.Tensor | Sequence[int],
        indices: torch.Tensor | Sequence[int],
        namespace: Namespace = None,
    ) -> InsertResult:
        """``insert_prefix`` in Python: every call the C base class does not take (csrc/hotpath.c)."""
        # CHECK in the reference's order (tokens, slots, namespace, lengths, new pages): types here, the
        # ranges and the new pages in C; an error found here first looks for one the reference finds before
        tokens, n, width, values = self._tokens(input_ids)
        try:
            slots, n_slots, slot_width, slot_values = self._slots(indices)
        except CacheError:
            as_tokens(input_ids)  # type: ignore[arg-type]  # an error the reference finds first
            raise
        if namespace is not None:
            namespace = self._in_order(check_namespace, namespace, input_ids=input_ids, indices=indices)
        if n != n_slots:
            self._in_order(_length_mismatch, n, n_slots, input_ids=input_ids, indices=indices)
        end = n - n % self.page_size
        if end == 0:
            as_insert_args(input_ids, indices, namespace, self.device)  # no C call: the ranges checked here
            self.clock += 1
            return InsertResult(0, RadixCacheHandle(0, _ROOT, 0, namespace, self))
        found = self.roots.get(namespace)
        new_root = found is None
        root = self._new_root(namespace) if found is None else found
        # WALK + UPDATE (C checks first and changes nothing on error)
        walk = self._walk
        status = self._insert_c(self._tree, root, tokens, width, slots, slot_width, end, n, self.clock, walk)
        if status != _OK:
            if new_root:
                self._drop_root(root)
            self._raise_for(status, tokens=values, slots=slot_values, bad=walk.bad)
        self.clock += 1
        cached_len = walk.length
        handle = RadixCacheHandle(end, walk.node, walk.version, namespace, self)
        if cached_len < end:
            self.counter.stored(namespace, (end - cached_len) // self.page_size)
            if self.events is not None:
                self._announce_stored(namespace, values, slot_values, cached_len, end, handle)
        return InsertResult(cached_len, handle)

    def lock(self, handle: RadixCacheHandle) -> None:
        """+1 ref on every node from the handle's node up to the root. O(depth)."""
        # CHECK
        checked = self._check_type(handle)
        # UPDATE
        if checked.node != _ROOT:
            self._raise_for(self._lib.radix_tree_lock(self._tree, checked.node, checked.version), handle=checked)

    def unlock(self, handle: RadixCacheHandle) -> None:
        """-1 ref on every node from the handle's node up to the root. O(depth)."""
        # CHECK
        checked = self._check_type(handle)
        # UPDATE
        if checked.node != _ROOT:
            self._raise_for(self._lib.radix_tree_unlock(self._tree, checked.node, checked.version), handle=checked)

    def is_handle_locked(self, handle: RadixCacheHandle) -> bool:
        """True when the handle is live and a lock ends at its node, not only locks of longer paths."""
        checked = self._check_type(handle)
        if checked.node == _ROOT:
            return True
        locked = self._lib.radix_tree_is_locked(self._tree, checked.node, checked.version)
        return bool(locked == 1)

    def _evict(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``evict`` in Python: every call the C base class does not take (csrc/hotpath.c). Evict exactly
        ceil(size / P) pages, LRU evictable leaf first; slots ascending (int32).

        ``out``: for a cache on the CPU, a 1-D contiguous int32 CPU tensor of at least ceil(size / P) * P
        slots. The slots are written to its front and ``out`` itself is returned (nothing is allocated: an
        engine that evicts a page at a time keeps one buffer). Without it, a new tensor of exactly the slots.
        """
        # CHECK (more than is evictable: in C, which changes nothing then)
        if type(size) is not int:
            if not isinstance(size, int) or isinstance(size, bool):
                raise InvalidTypeError(f"size must be an int, got {type(size).__name__}")
            size = int(size)
        if size < 0:
            raise InvalidSizeError.negative_evict(size)
        if size > _LARGE_EVICT:
            # past what is ever evictable at once: the spec's EvictionError before a buffer that large is made
            # (evict(10**10) was a torch error); smaller sizes C checks against the evictable pages
            pc.check_evict_size(size, self.size_info.evictable_size)
        p = self.page_size
        pages = (size + p - 1) // p
        if out is None:
            slots = torch.empty(pages * p, dtype=torch.int32)
            pointer = self._cast("int32_t *", slots.data_ptr())
        elif (
            out is self._out
            and out.data_ptr() == self._out_address
            # the same object may have changed since: its dtype (out.data = ...), shape, strides, size, device
            and out.dtype is torch.int32
            and out.dim() == 1
            and out.is_contiguous()
            and out.is_cpu
            and out.numel() >= pages * p
        ):
            slots, pointer = out, self._out_pointer  # the buffer of the last call, whose address was cast then
        else:
            slots = self._check_out(out, pages * p)
            pointer = self._cast("int32_t *", slots.data_ptr())
            self._out, self._out_address, self._out_pointer = slots, slots.data_ptr(), pointer
        # UPDATE
        status = self._evict_c(self._tree, pages, pointer, self._emptied, self._emptied_room, self._n_emptied)
        if status:
            self._after_evict(status, size)
        self._evict_clock_sum += self.clock * pages
        if self.events is not None:
            self._announce_removed(slots[: pages * p])
        return slots if self._on_host else slots.to(self.device)

    def _check_out(self, out: object, needed: int) -> torch.Tensor:
        """``out`` if it can take ``needed`` evicted slots (see ``evict``), else raise InvalidTypeError."""
        if not (
            type(out) is torch.Tensor
            and out.dtype is torch.int32
            and out.is_cpu
            and out.dim() == 1
            and out.is_contiguous()
            and out.numel() >= needed
            and self._on_host
        ):
            raise InvalidTypeError(
                f"out must be a 1-D contiguous int32 CPU tensor of at least {needed} slots, for a cache on the CPU;"
                f" got {describe_tensor(out)} for a cache on {self.device}"
            )
        return out

    def _after_evict(self, status: int, size: int) -> None:
        """After a C evict that did not simply succeed: drop the roots it emptied; raise its error, if any."""
        if status == _NOT_EVICTABLE:
            pc.check_evict_size(size, self.size_info.evictable_size)  # raises the spec's EvictionError
        self._drop_emptied_roots()
        if status != _ROOTS_EMPTIED:
            self._raise_for(status)

    def _drop_emptied_roots(self) -> None:
        """A namespace whose last page went keeps no root."""
        for k in range(self._n_emptied[0]):
            self._drop_root(self._emptied[k])

    def reset(self) -> torch.Tensor:
        """Empty every namespace; returns every slot the cache held, ascending (int32)."""
        # CHECK
        info = self.size_info
        if info.protected_size:
            raise CacheBusyError.tokens_locked(info.protected_size)
        # UPDATE
        dropped = [(node.namespace, len(node.starts)) for node in self.nodes()]
        slots = torch.empty(info.evictable_size, dtype=torch.int32)
        written = self._lib.radix_tree_reset(self._tree, self._ffi.cast("int32_t *", slots.data_ptr()), slots.numel())
        self._raise_for(min(written, 0))
        for namespace, pages in dropped:
            self.counter.dropped(namespace, pages)
        for root in list(self.roots.values()):
            self._drop_root(root)
        if self.events is not None:
            self.events.append(ev.AllCleared())
            self._announced.clear()
        return slots if self._on_host else slots.to(self.device)

    @property
    def size_info(self) -> SizeInfo:
        """Evictable and protected tokens, kept as running counters in C."""
        counters = self._counters
        self._lib.radix_tree_counts(self._tree, counters)
        return SizeInfo(evictable_size=counters.evictable, protected_size=counters.protected_)

    # ------------------------------------------------------------ checks and views

    def check_integrity(self) -> None:
        """The C tree's structure, counters, tables and queues, then the spec's invariants on its abstract state."""
        message = self._ffi.new("char[]", 512)
        status = self._lib.radix_tree_check(self._tree, message, len(message))
        if status == _CORRUPT:
            raise IntegrityError(self._ffi.string(message).decode())
        self._raise_for(status)
        nodes = self.nodes()
        holding = {node.namespace for node in nodes if node.parent == -1}
        empty = [namespace for namespace in self.roots if namespace not in holding]
        if empty:
            raise IntegrityError(f"roots_hold_pages: namespaces {empty[:4]} keep a root without pages")
        counters = self._counters
        self._lib.radix_tree_counts(self._tree, counters)
        if counters.roots != len(self.roots):
            raise IntegrityError(
                f"roots_hold_pages: the tree holds {counters.roots} roots, {len(self.roots)} namespaces"
            )
        stray = set(self._namespace_of) ^ set(self.roots.values())
        if stray:
            raise IntegrityError(f"roots_hold_pages: roots {sorted(stray)[:4]} are named by one root table only")
        check_invariants(self._abstract_state(nodes), reported=self.size_info)

    def nodes(self) -> list[RadixTreeNode]:
        """Every node of every namespace, parents before children (a snapshot, from ``radix_tree_export``)."""
        ffi, lib = self._ffi, self._lib
        sizes = ffi.new("int64_t[3]")
        self._raise_for(lib.radix_tree_export(self._tree, ffi.NULL, ffi.NULL, ffi.NULL, sizes, sizes + 1, sizes + 2))
        records = ffi.new("radix_tree_record[]", max(sizes[0], 1))
        tokens = ffi.new("int64_t[]", max(sizes[1], 1))
        starts = ffi.new("int64_t[]", max(sizes[2], 1))
        self._raise_for(lib.radix_tree_export(self._tree, records, tokens, starts, sizes, sizes + 1, sizes + 2))
        token_list = ffi.unpack(tokens, sizes[1])
        start_list = ffi.unpack(starts, sizes[2])
        nodes = []
        for record in records[0 : sizes[0]]:
            pages = record.length // self.page_size
            nodes.append(
                RadixTreeNode(
                    namespace=self._namespace_of[record.root],
                    parent=record.parent,
                    key=tuple(token_list[record.token_offset : record.token_offset + record.length]),
                    starts=tuple(start_list[record.page_offset : record.page_offset + pages]),
                    timestamp=record.timestamp,
                    generation=record.generation,
                    ref_count=record.ref_count,
                )
            )
        return nodes

    def abstract_state(self) -> pc.PrefixCacheState:
        """The spec's state: one entry per cached page."""
        return self._abstract_state(self.nodes())

    def _abstract_state(self, nodes: list[RadixTreeNode]) -> pc.PrefixCacheState:
        p = self.page_size
        entries: dict[pc.PageKey, pc.Entry] = {}
        # the prefix each node ends with (parents come first in the snapshot)
        ends: list[pc.Prefix | None] = []
        for node in nodes:
            prefix = ends[node.parent] if node.parent >= 0 else None
            for page, start in enumerate(node.starts):
                prefix = pc.Prefix.extend(prefix, node.key[page * p : (page + 1) * p])
                entries[(node.namespace, prefix)] = pc.Entry(start, node.timestamp, node.ref_count, node.generation)
            ends.append(prefix)
        return pc.PrefixCacheState(page_size=p, entries=entries, clock=self.clock)

    def abstract_handle(self, handle: RadixCacheHandle) -> pc.Handle:
        """The spec handle of the same path (a live handle; a stale one raises StaleHandleError)."""
        checked = self._check_type(handle)
        if checked.node == _ROOT:
            return pc.Handle(checked.namespace, (), ())
        n = checked.cached_len
        tokens = self._ffi.new("int64_t[]", max(n, 1))
        generations = self._ffi.new("int64_t[]", max(n // self.page_size, 1))
        written = self._lib.radix_tree_path_tokens(self._tree, checked.node, checked.version, tokens, generations, n)
        self._raise_for(min(written, 0), handle=checked)
        return pc.Handle(
            checked.namespace,
            tuple(self._ffi.unpack(tokens, written)),
            tuple(self._ffi.unpack(generations, written // self.page_size)),
        )

    def path_nodes(self, handle: RadixCacheHandle) -> int:
        """Nodes from the handle's node up to its root (the root not counted)."""
        checked = self._check_type(handle)
        if checked.node == _ROOT:
            return 0
        depth = self._lib.radix_tree_depth(self._tree, checked.node, checked.version)
        self._raise_for(min(depth, 0), handle=checked)
        return int(depth)

    def tree_stats(self) -> dict[str, int]:
        """Nodes, pages, roots, queue entries (stale ones included) and the bytes the C tree holds.

        ``memory_bytes`` counts nodes, token and slot segments, the children and slot tables and the leaf queues.
        """
        c = self._counters
        self._lib.radix_tree_counts(self._tree, c)
        return {
            "evictable_size": c.evictable,
            "protected_size": c.protected_,
            "nodes": c.nodes,
            "pages": c.pages,
            "roots": c.roots,
            "fifo_entries": c.fifo,
            "heap_entries": c.heap,
            "memory_bytes": int(self._lib.radix_tree_memory(self._tree)),
        }

    def break_invariant(self, field: str, nth: int, position: int, delta: int) -> bool:
        """Test support, so that ``check_integrity`` is itself checked: add ``delta`` to one field of the C tree
        (``radix_tree_break_invariant``: ``field`` is a ``RADIX_FIELD_`` name in lower case, of the ``nth`` live
        node or of the tree; a slot modulo 2**32); the same call with ``-delta`` puts it back. False, and
        nothing changed, when the tree has no such node."""
        code = getattr(_C, f"RADIX_FIELD_{field.upper()}", None)
        if code is None:
            raise InvalidInputError(f"break_invariant: no field {field!r}")
        return bool(self._lib.radix_tree_break_invariant(self._tree, code, nth, position, delta) == _OK)

    # ------------------------------------------------------------ internals

    def _tokens(self, input_ids: object) -> tuple[Any, int, int, Any]:
        """Token ids for C: a pointer, their count, their width in bytes (8: int64, 4: int32), and the object
        that owns the buffer (which also gives the values for messages and events).

        Twin of ``radixspec.spec.domains.check_token_ids``. Read in place: a 1-D contiguous int32/int64 CPU tensor and a
        buffer of native int32/int64 (numpy, ``array('q')``); their range (no negative id) is checked in C by the
        call that reads them, which widens int32. A list or tuple of ints is copied once into an ``array('q')``;
        anything else is converted and checked here.
        """
        if type(input_ids) is torch.Tensor:
            width = _WIDTH.get(input_ids.dtype)
            if width is not None and input_ids.is_cpu and input_ids.dim() == 1 and input_ids.is_contiguous():
                return self._cast("void *", input_ids.data_ptr()), input_ids.numel(), width, input_ids
        read = self._read_in_place(input_ids, "_token_room")
        if read is not None:
            return read
        ids = as_tokens(input_ids)  # type: ignore[arg-type]
        return self._cast("void *", ids.data_ptr()), ids.numel(), 8, ids

    def _slots(self, indices: object) -> tuple[Any, int, int, Any]:
        """Slot indices for C, on the host: a pointer, their count, their width in bytes, and their owner.

        Twin of ``radixspec.spec.domains.check_slot_indices``. Read in place: a 1-D contiguous int32/int64 tensor on the
        cache's CPU device and a buffer of native int32/int64; C checks their range ([0, 2**31)) and narrows
        int64. A list or tuple of exact ints is read in one C pass into a buffer the cache keeps; a tensor on
        the cache's GPU is copied to the host once; anything else is converted and checked here.
        """
        if type(indices) is torch.Tensor:
            width = _WIDTH.get(indices.dtype)
            if (
                width is not None
                and self._on_host
                and indices.is_cpu
                and indices.dim() == 1
                and indices.is_contiguous()
            ):
                return self._cast("void *", indices.data_ptr()), indices.numel(), width, indices
        read = self._read_in_place(indices, "_slot_room")
        if read is not None:
            return read
        slots = as_slots(indices, self.device).cpu().contiguous()  # type: ignore[arg-type]
        return self._cast("void *", slots.data_ptr()), slots.numel(), 4, slots

    def _read_in_place(self, values: object, room: str) -> tuple[Any, int, int, Any] | None:
        """A list or tuple of exact ints, read in one C pass into the buffer named ``room`` (grown as needed), or
        a buffer of native int32/int64 as it is: (pointer, count, width, owner) for C; None for anything else."""
        if type(values) is list or type(values) is tuple:
            n = len(values)
            kept: _ListRoom = getattr(self, room)
            if n > kept.capacity:
                kept = _ListRoom(self._ffi, 2 * n)
                setattr(self, room, kept)
            if read_int64(values, kept.address, kept.capacity) != n:
                return None
            # the owner is what C read, not the caller's list: the events of this call are built from it, and the
            # list may change while C runs (cffi lets other threads run then)
            return kept.pointer, n, 8, memoryview(kept.buffer)[:n]
        view = int_view(values)
        return None if view is None else (self._from_buffer(view), len(view), view.itemsize, view)

    def _in_order(self, check: Callable[..., _T], *args: Any, input_ids: object, indices: object = None) -> _T:
        """``check(*args)``; when it raises, first raise what the reference checks before it (tokens, slots)."""
        try:
            return check(*args)
        except CacheError:
            as_tokens(input_ids)  # type: ignore[arg-type]
            if indices is not None:
                as_slots(indices, self.device)  # type: ignore[arg-type]
            raise

    def _path_slots(self, handle: RadixCacheHandle) -> torch.Tensor:
        """The slots of a handle's path, built once on the cache's device."""
        checked = self._check_type(handle)
        slots = torch.empty(checked.cached_len, dtype=torch.int32)
        if checked.node != _ROOT:
            written = self._lib.radix_tree_path_slots(
                self._tree, checked.node, checked.version, self._ffi.cast("int32_t *", slots.data_ptr()), slots.numel()
            )
            self._raise_for(min(written, 0), handle=checked)
        return slots if self._on_host else slots.to(self.device)

    def _announce_stored(
        self, namespace: Namespace, tokens: Any, slots: Any, cached: int, end: int, handle: RadixCacheHandle
    ) -> None:
        """PageStored events of an insert's new pages (and what each page is, by its first slot); ``handle``
        is the insert's whole path."""
        p = self.page_size
        parent_hash = None
        if cached:
            # the cached page before the new ones: its slot is the tree's, not the caller's
            path = self._path_slots(handle)
            parent_hash = self._announced[int(path[cached - p])][1]
        starts = _values(slots, cached, end)[::p]
        new_tokens = _values(tokens, cached, end)
        stored = ev.stored_pages(namespace, parent_hash, new_tokens, p, starts)
        self.events += stored  # type: ignore[operator]
        for depth, page in enumerate(stored, start=cached // p + 1):
            self._announced[page.slot] = (namespace, page.page_hash, depth)

    def _announce_removed(self, slots: torch.Tensor) -> None:
        """PageRemoved events of evicted pages, deepest first (a page goes before its parent)."""
        gone = sorted((self._announced.pop(start) for start in slots[:: self.page_size].tolist()), key=lambda x: -x[2])
        self.events += [ev.PageRemoved(namespace, page_hash) for namespace, page_hash, _ in gone]  # type: ignore[operator]

    def _new_root(self, namespace: Namespace) -> int:
        root = int(self._lib.radix_tree_new_root(self._tree))
        self._raise_for(min(root, 0))
        self.roots[namespace] = root
        self._namespace_of[root] = namespace
        if len(self.roots) > self._emptied_room:
            self._emptied_room = 2 * len(self.roots)
            self._emptied = self._ffi.new("int64_t[]", self._emptied_room)
        return root

    def _drop_root(self, root: int) -> None:
        del self.roots[self._namespace_of.pop(root)]
        self._raise_for(self._lib.radix_tree_drop_root(self._tree, root))

    def _check_type(self, handle: object) -> RadixCacheHandle:
        if not isinstance(handle, RadixCacheHandle):
            raise InvalidTypeError(f"expected an optimized RadixCacheHandle, got {type(handle).__name__}")
        if handle.cache is not self:
            raise InvalidTypeError.foreign_handle()
        return handle

    def _raise_for(
        self,
        status: int,
        handle: RadixCacheHandle | None = None,
        tokens: Any = None,
        slots: object = None,
        bad: int = -1,
    ) -> None:
        """Raise the error a C status stands for (nothing for OK)."""
        if status == _OK:
            return
        p = self.page_size
        if status == _BAD_TOKEN:
            raise InvalidInputError(f"input_ids[{bad}] = {_values(tokens, bad, bad + 1)[0]} is outside [0, 2**63)")
        if status == _BAD_SLOT:
            raise SlotOutOfRangeError(f"indices[{bad}] = {_values(slots, bad, bad + 1)[0]} is outside [0, 2**31)")
        if status in (_MISALIGNED, _DUPLICATE):
            bad_page = bad
            page_slots = _values(slots, bad_page * p, (bad_page + 1) * p)
            if status == _MISALIGNED:
                raise MisalignedPageError.not_a_run(bad_page, page_slots, p)
            raise DuplicateSlotError.cached_slot(bad_page, page_slots[0])
        cached_len = handle.cached_len if handle is not None else 0
        if status == _STALE:
            raise StaleHandleError.lost_page(cached_len)
        if status == _NOT_LOCKED:
            raise UnlockError.no_lock_ends_here(cached_len)
        if status == _NO_MEMORY:
            raise MemoryError("the C radix tree is out of memory")
        if status == _CORRUPT:
            raise IntegrityError("the C radix tree found no evictable leaf for its evictable tokens")
        raise UnavailableError(f"csrc/tree.c rejected its arguments (status {status})")


def _length_mismatch(n_tokens: int, n_slots: int) -> None:
    raise LengthMismatchError.tokens_and_slots(n_tokens, n_slots)


def describe_tensor(value: object) -> str:
    """A short description of a tensor (dimensions, dtype, size, device) or of another object's type."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor of {value.numel()} on {value.device}"
    return type(value).__name__


def _values(owner: Any, start: int, end: int) -> list[int]:
    """``owner[start:end]`` as a list of ints: the values a call read, from a tensor, an array or a list."""
    part = owner[start:end]
    return [int(value) for value in (part.tolist() if hasattr(part, "tolist") else part)]


class _ListRoom:
    """An int64 buffer that lists of ints are read into (``radixspec.optimized._pyints.read_int64``) for one C call."""

    __slots__ = ("address", "buffer", "capacity", "pointer")

    def __init__(self, ffi: Any, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = array("q", bytes(8 * self.capacity))
        self.address = self.buffer.buffer_info()[0]
        self.pointer = ffi.cast("void *", self.address)


# the hot path's bindings (csrc/hotpath.c), once per process: the tree's match, insert, evict and drop_root, torch's
# tensor class and integer dtypes, how a new int32 CPU tensor of n slots is made, and the classes it makes
_hotpath.setup(
    int(_FFI.cast("uintptr_t", _FFI.addressof(_C, "radix_tree_match"))),
    int(_FFI.cast("uintptr_t", _FFI.addressof(_C, "radix_tree_insert"))),
    int(_FFI.cast("uintptr_t", _FFI.addressof(_C, "radix_tree_evict"))),
    int(_FFI.cast("uintptr_t", _FFI.addressof(_C, "radix_tree_drop_root"))),
    torch.Tensor,
    torch.int32,
    torch.int64,
    torch.empty(0, dtype=torch.int32).new_empty,
    RadixCacheHandle,
    InsertResult,
)
