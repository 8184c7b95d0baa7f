"""The hybrid prefix cache (several attention groups) on a C tree: optimized for speed rather than clarity.

Twin of ``reference/hybrid_cache.py`` (same operations, same rules, the meaning
in ``spec/hybrid.py``). The tree lives in C (``csrc/hybrid.c``): one node per
page with every group's value, a children hash table, and one eviction heap
per group, so that match, insert and evict cost no Python object per page.
Tokens are taken as the optimized cache takes them (a 1-D int tensor or a
list); the starts of each group's pages as a sequence per group, ``None``
for a page the caller no longer holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixspec.reference.base import NotCopyable
from radixspec.reference.threads import new_mutex, serialized
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace, check_namespace, check_page_size
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

from ._c import load_c
from .inputs import as_tokens


@dataclass(frozen=True)
class HybridHandle:
    """A valid match: its namespace and tokens, and the C tree's names for the pages it uses."""

    namespace: Namespace
    tokens: tuple[int, ...]
    # per page of the match: its node and the node's version (node -1 past the tree)
    nodes: torch.Tensor
    versions: torch.Tensor
    # per group, per page: the generation of each page the match uses (-1 where unused), groups x pages
    gens: torch.Tensor
    # the cache that made it: a handle of another cache (or one built by hand) is refused
    cache: object = field(default=None, compare=False, repr=False)

    @property
    def cached_len(self) -> int:
        """Matched tokens (page aligned)."""
        return len(self.tokens)


# one call at a time (reference/threads.py): a cache may be shared between threads
@serialized(
    "match_prefix",
    "insert_prefix",
    "check_handle",
    "get_matched_pages",
    "lock",
    "unlock",
    "size_info",
    "evict",
    "reset",
    "abstract_state",
    "abstract_handle",
    "check_integrity",
)
class HybridRadixCache(NotCopyable):
    """A prefix cache for several attention groups on the C tree (``windows``: None for full attention, W)."""

    def __init__(self, page_size: int, windows: Sequence[hy.Window]) -> None:
        self.page_size = check_page_size(page_size)
        self._mutex = new_mutex()
        self.windows = hy.check_windows(windows)
        self._ffi, self._lib = load_c()
        c_windows = self._ffi.new("int64_t[]", [0 if w is None else w for w in self.windows])
        tree = self._lib.hybrid_new(page_size, len(self.windows), c_windows)
        if tree == self._ffi.NULL:
            raise MemoryError("hybrid_new: out of memory")
        self._tree = self._ffi.gc(tree, self._lib.hybrid_free)
        self._walk = self._ffi.new("hybrid_walk *")
        self.roots: dict[Namespace, int] = {}
        self.locks: Counter[tuple[Namespace, tuple[int, ...]]] = Counter()
        self.clock = 0

    # ------------------------------------------------------------ the C boundary

    def _ptr(self, tensor: torch.Tensor) -> Any:
        return self._ffi.cast("int64_t *", tensor.data_ptr())

    def _check(
        self,
        status: int,
        what: str,
        rows: Sequence[Sequence[int | None]] = (),
        handle: HybridHandle | None = None,
    ) -> None:
        """Raise the spec's error, in the spec's words, for a C status (HYBRID_OK returns); ``rows``: the pages an
        insert was given, ``handle``: the handle a call was given (their numbers are in the words)."""
        lib = self._lib
        if status == lib.HYBRID_OK:
            return
        group, page = self._walk.bad_group, self._walk.bad
        # the slot C refused (read only for the statuses that name one: the walk's page is theirs)
        start = rows[group][page] if rows and status in (lib.HYBRID_MISALIGNED, lib.HYBRID_DUPLICATE) else None
        if status == lib.HYBRID_MISSING:
            raise MissingPageError.needs_page(group, page)
        if status == lib.HYBRID_MISALIGNED and start is not None:
            raise MisalignedPageError.start_not_aligned(group, page, start, self.page_size)
        if status == lib.HYBRID_DUPLICATE and start is not None:
            raise DuplicateSlotError.cached_slot(page, start, group)
        if status == lib.HYBRID_STALE and handle is not None:
            raise StaleHandleError.lost_page(handle.cached_len)
        if status == lib.HYBRID_NOT_LOCKED and handle is not None:
            raise UnlockError.no_lock_of_match(handle.cached_len)
        if status == lib.HYBRID_NO_MEMORY:
            raise MemoryError(f"{what}: out of memory (nothing changed)")
        raise IntegrityError(f"{what}: C status {status}")

    def _root(self, namespace: Namespace) -> int:
        root = self.roots.get(namespace)
        if root is None:
            root = int(self._lib.hybrid_new_root(self._tree))
            if root < 0:
                raise MemoryError("hybrid_new_root: out of memory")
            self.roots[namespace] = root
        return root

    def _handle(self, namespace: Namespace, tokens: torch.Tensor, arrays: tuple[torch.Tensor, ...]) -> HybridHandle:
        """The handle of the match the C call reported (its length in self._walk)."""
        nodes, versions, gens = arrays
        n = int(self._walk.length) // self.page_size
        used = gens.view(-1)[: len(self.windows) * n].view(len(self.windows), n).clone()
        return HybridHandle(
            namespace, tuple(tokens[: n * self.page_size].tolist()), nodes[:n].clone(), versions[:n].clone(), used, self
        )

    def _arrays(self, pages: int) -> tuple[torch.Tensor, ...]:
        return (
            torch.empty(pages, dtype=torch.int64),
            torch.empty(pages, dtype=torch.int64),
            torch.empty(len(self.windows) * max(pages, 1), dtype=torch.int64),
        )

    # ------------------------------------------------------------ operations

    def match_prefix(self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None) -> HybridHandle:
        """Longest valid page-aligned match; stamps the pages it uses in every group."""
        # CHECK
        tokens = as_tokens(input_ids).to(torch.int64).contiguous()
        namespace = check_namespace(namespace)
        # WALK + UPDATE
        pages = len(tokens) // self.page_size
        arrays = self._arrays(pages)
        status = self._lib.hybrid_match(
            self._tree, self._root(namespace), self._ptr(tokens), pages, self.clock, *map(self._ptr, arrays), self._walk
        )
        self._check(status, "match_prefix")
        self.clock += 1
        return self._handle(namespace, tokens, arrays)

    def insert_prefix(
        self,
        input_ids: torch.Tensor | Sequence[int],
        pages: Sequence[Sequence[int | None]],
        namespace: Namespace = None,
    ) -> hy.HybridInsertResult:
        """Cache the whole pages of ``input_ids`` in every group (``pages[g][k]``: page k's start in group g)."""
        # CHECK in the spec's order: tokens, starts, namespace, lengths here; the pages in C
        tokens = as_tokens(input_ids).to(torch.int64).contiguous()
        rows = hy.check_group_pages(pages)
        namespace = check_namespace(namespace)
        n = len(tokens) // self.page_size
        hy.check_group_lengths(rows, len(self.windows), n)
        starts = torch.tensor([-1 if s is None else s for row in rows for s in row], dtype=torch.int64)
        unused = torch.empty(max(len(starts), 1), dtype=torch.int64)
        arrays = self._arrays(n)
        status = self._lib.hybrid_insert(
            self._tree,
            self._root(namespace),
            self._ptr(tokens),
            n,
            self._ptr(starts),
            self.clock,
            self._ptr(unused),
            *map(self._ptr, arrays),
            self._walk,
        )
        self._check(status, "insert_prefix", rows=rows)
        self.clock += 1
        # UPDATE done in C; report what the caller frees
        rows_unused = unused[: len(starts)].view(len(self.windows), n).tolist() if n else [[] for _ in self.windows]
        result_unused = tuple(tuple(s for s in row if s >= 0) for row in rows_unused)
        return hy.HybridInsertResult(result_unused, self._handle(namespace, tokens, arrays))

    def check_handle(self, handle: object) -> HybridHandle:
        """``handle`` if this cache made it and its arrays are as this cache made them (C reads them by the
        handle's length and the number of groups), else InvalidTypeError; staleness is C's to tell."""
        if not isinstance(handle, HybridHandle):
            raise InvalidTypeError(f"expected an optimized HybridHandle, got {type(handle).__name__}")
        if handle.cache is not self:
            raise InvalidTypeError.foreign_handle()
        n, groups = handle.cached_len // self.page_size, len(self.windows)
        shapes = ((handle.nodes, (n,)), (handle.versions, (n,)), (handle.gens, (groups, n)))
        if handle.cached_len % self.page_size or not all(
            type(array) is torch.Tensor
            and array.dtype is torch.int64
            and array.is_cpu
            and array.is_contiguous()
            and tuple(array.shape) == shape
            for array, shape in shapes
        ):
            raise InvalidTypeError("the handle's arrays were changed: they no longer match its length and groups")
        return handle

    def _on_handle(self, op: int, handle: object, slots: torch.Tensor | None = None) -> HybridHandle:
        handle = self.check_handle(handle)
        out = self._ffi.NULL if slots is None else self._ptr(slots)
        status = self._lib.hybrid_handle(
            self._tree,
            op,
            self._ptr(handle.nodes),
            self._ptr(handle.versions),
            self._ptr(handle.gens),
            min(handle.nodes.numel(), handle.versions.numel(), handle.gens.numel() // len(self.windows)),
            handle.cached_len,
            out,
        )
        self._check(status, "handle", handle=handle)
        return handle

    def _uses_pages(self, handle: HybridHandle) -> bool:
        return bool((handle.gens >= 0).any()) if handle.gens.numel() else False

    def get_matched_pages(self, handle: HybridHandle) -> list[list[int | None]]:
        """Per group, one entry per page of the match: its slot start where the match uses it, else None."""
        n = handle.cached_len // self.page_size
        slots = torch.empty(max(len(self.windows) * n, 1), dtype=torch.int64)
        self._on_handle(self._lib.HYBRID_MATCHED, handle, slots)
        rows = slots[: len(self.windows) * n].view(len(self.windows), n).tolist() if n else [[] for _ in self.windows]
        return [[None if s < 0 else s for s in row] for row in rows]

    def lock(self, handle: HybridHandle) -> None:
        """Add one lock to every page the handle uses; a match that uses no page holds no lock."""
        self._on_handle(self._lib.HYBRID_CHECK, handle)
        if self._uses_pages(handle):
            self._on_handle(self._lib.HYBRID_LOCK, handle)
            self.locks[(handle.namespace, handle.tokens)] += 1

    def unlock(self, handle: HybridHandle) -> None:
        """Remove one lock from every page the handle uses; refused unless a lock of this very match is outstanding."""
        self._on_handle(self._lib.HYBRID_CHECK, handle)
        if not self._uses_pages(handle):
            return
        key = (handle.namespace, handle.tokens)
        if not self.locks[key]:
            raise UnlockError.no_lock_of_match(handle.cached_len)
        self._on_handle(self._lib.HYBRID_UNLOCK, handle)
        self.locks[key] -= 1
        if not self.locks[key]:
            del self.locks[key]

    def size_info(self, group: int) -> SizeInfo:
        """Evictable (ref 0) and protected (ref > 0) tokens of one group."""
        # CHECK (C reads the group's counters by index)
        group = int(hy.check_group(group, len(self.windows)))
        counts = self._ffi.new("int64_t[3]")
        self._lib.hybrid_counts(self._tree, group, counts)
        return SizeInfo(counts[0] * self.page_size, counts[1] * self.page_size)

    def evict(self, group: int, size: int) -> list[int]:
        """Evict exactly ceil(size / P) pages of ``group``, oldest evictable first (deeper first on a tie)."""
        # CHECK
        hy.check_group(group, len(self.windows))
        check_evict_size(size, self.size_info(group).evictable_size)
        # UPDATE
        pages = div_ceil(size, self.page_size)
        out = torch.empty(max(pages, 1), dtype=torch.int64)
        self._check(self._lib.hybrid_evict(self._tree, group, pages, self._ptr(out)), "evict")
        return sorted(compute_page_to_token(out[:pages].tolist(), self.page_size))

    def reset(self) -> list[list[int]]:
        """Empty every group; returns per group every slot it held, ascending. Refused while a lock is outstanding."""
        # CHECK
        if self.locks:
            raise CacheBusyError.locks_outstanding(sum(self.locks.values()))
        # UPDATE
        state = self.abstract_state()
        self._lib.hybrid_reset(self._tree)
        self.roots.clear()
        return [sorted(compute_page_to_token([e.slot_start for e in g.values()], self.page_size)) for g in state.groups]

    # ------------------------------------------------------------ meaning and integrity

    def abstract_state(self) -> hy.HybridState:
        """This tree as the spec's hybrid state."""
        groups, p = len(self.windows), self.page_size
        counts = self._ffi.new("int64_t[3]")
        self._lib.hybrid_counts(self._tree, 0, counts)
        capacity = int(counts[2])
        parent = torch.empty(max(capacity, 1), dtype=torch.int64)
        tokens = torch.empty(max(capacity * p, 1), dtype=torch.int64)
        values = torch.empty(max(capacity * groups * 4, 1), dtype=torch.int64)
        count = int(self._lib.hybrid_export(self._tree, *map(self._ptr, (parent, tokens, values)), capacity))
        assert count >= 0, "the export holds every node"
        namespaces = {root: namespace for namespace, root in self.roots.items()}
        state = hy.new_state(p, self.windows)
        state.clock, state.locks = self.clock, Counter(self.locks)
        prefixes: list[tuple[Namespace, pc.Prefix]] = []
        parents, pages, rows = (
            parent[:count].tolist(),
            tokens[: count * p].tolist(),
            values[: count * groups * 4].tolist(),
        )
        for i in range(count):
            up = parents[i]
            namespace, above = (namespaces[-1 - up], None) if up < 0 else prefixes[up]
            prefix = pc.Prefix.extend(above, tuple(pages[i * p : (i + 1) * p]))
            prefixes.append((namespace, prefix))
            for g in range(groups):
                slot, stamp, refs, gen = rows[(i * groups + g) * 4 : (i * groups + g) * 4 + 4]
                if slot >= 0:
                    state.groups[g][(namespace, prefix)] = pc.Entry(slot, stamp, refs, gen)
        return state

    def abstract_handle(self, handle: HybridHandle) -> hy.HybridHandle:
        """A handle as the spec's handle (same match, same generations)."""
        handle = self.check_handle(handle)
        gens = tuple(tuple(g for g in row if g >= 0) for row in handle.gens.tolist())
        return hy.HybridHandle(handle.namespace, handle.tokens, gens)

    def check_integrity(self) -> None:
        """Check the C tree's own invariants, then every invariant of its abstract state."""
        message = self._ffi.new("char[512]")
        if self._lib.hybrid_check(self._tree, message, 512) != self._lib.HYBRID_OK:
            raise IntegrityError(self._ffi.string(message).decode())
        hy.check_hybrid_invariants(self.abstract_state(), [self.size_info(g) for g in range(len(self.windows))])
