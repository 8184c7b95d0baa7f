"""The tiered prefix cache (device, host memory, storage): optimized for speed rather than clarity.

Twin of ``reference/tiered_cache.py`` (the meaning in ``spec/tiers.py``; every operation keeps the spec's name).
Two things differ from the reference, both in representation:

* The index is C (``csrc/tiers.c``): one node per page (as ``csrc/hybrid.c`` does), each with its residency (its
  device and host page starts), its stamps, its locks (requests' locks and the host locks of the transfers reading
  its host copy) and the counts a guard needs, kept as they change: the pages below a page and those of them on the
  device, the transfers that pin it or move it. A guard reads fields; it never scans the transfers or splits a
  node. Eviction plans are made there too. The controller's queue, the keys of the pages and storage stay here.
* The pools hold KV. The device pool is a tensor on the cache's device, the host pool a CPU tensor (pinned beside a
  CUDA device), storage a pair of CPU tensors per page key; every copy into a pool (a backup, a load back, a
  prefetch, the forward pass's writes) moves the rows through the store path (``store_cache``: C on the CPU, the
  CUDA kernel on a GPU); a store keeps a copy of the host rows. A row holds what the spec's ``Written``
  names: the code of the page's key, the reset epoch, and the row's position in the page (negated in V). The
  abstract state reads each copy's content back from those bytes, so a torn, shifted or misplaced copy shows as
  the KV of no prefix and ``copies_hold_their_prefix`` names it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixspec.spec import tiers as st
from radixspec.spec.domains import Namespace, check_namespace
from radixspec.spec.errors import (
    CacheBusyError,
    DuplicateSlotError,
    EvictionError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    LengthMismatchError,
    MisalignedPageError,
    OutOfPagesError,
    StaleHandleError,
    StorageOfflineError,
    UnlockError,
)
from radixspec.spec.helpers import is_page_run
from radixspec.spec.prefix_cache import PageKey, Prefix, compute_page_prefixes

from ._c import load_c
from .inputs import as_slots, as_tokens, device_of
from .store import store_cache

# the key a page's content decodes to when its rows do not hold one page's KV (never a page's key: a negative token)
TORN: PageKey = (None, Prefix.extend(None, (-1,)))
# columns of a KV row: the key's code, the reset epoch, the position in the page
ROW = 3
# no copy in a tier (csrc/tiers.c)
NONE = -1


@dataclass(frozen=True)
class TieredHandle:
    """A device path: its pages (nodes of the index), each node's version and ``device_since`` when the handle was
    made."""

    namespace: Namespace
    pages: tuple[int, ...]
    versions: tuple[int, ...]
    since: tuple[int, ...]
    page_size: int
    # the cache that made it: another cache's handle is refused
    cache: object = field(compare=False, repr=False)

    @property
    def cached_len(self) -> int:
        """Tokens of the device path."""
        return len(self.pages) * self.page_size


@dataclass
class InFlight:
    """A transfer in flight: its pages by key (and by node where they are in the index: all but a prefetch's),
    the page its run hangs under, the page starts it reads and writes."""

    kind: st.TransferKind
    keys: tuple[PageKey, ...]
    pages: tuple[int, ...]
    parent: int | None
    source: tuple[int, ...]
    destination: tuple[int, ...]


class TierIndex:
    """The C index of csrc/tiers.c: pages by node, their fields read and written by name."""

    def __init__(self, page_size: int) -> None:
        self.ffi, self.lib = load_c()
        self.page_size = page_size
        self.tree = self.ffi.gc(self.lib.tier_new(page_size), self.lib.tier_free)
        if self.tree == self.ffi.NULL:
            raise MemoryError("the tier index could not be made")

    def _array(self, values: Sequence[int]) -> Any:
        return self.ffi.new("int64_t[]", list(values) or [0])

    def _ok(self, status: int, what: str) -> None:
        if status == self.lib.TIER_NO_MEMORY:
            raise MemoryError(f"the tier index ran out of memory ({what})")
        assert status == self.lib.TIER_OK, f"tier index: {what} returned {status}"

    def new_root(self) -> int:
        root = int(self.lib.tier_new_root(self.tree))
        if root < 0:
            raise MemoryError("the tier index ran out of memory (a root)")
        return root

    def walk(self, root: int | None, tokens: Sequence[int]) -> tuple[list[int], int, int]:
        """The pages along the whole pages of ``tokens`` from the first, then how many of them from the first have
        a device copy, and a device or host copy."""
        pages = len(tokens) // self.page_size
        if root is None or not pages:
            return [], 0, 0
        nodes = self.ffi.new("int64_t[]", pages)
        runs = self.ffi.new("int64_t[2]")
        length = self.lib.tier_walk(self.tree, root, self._array(tokens[: pages * self.page_size]), pages, nodes, runs)
        return list(nodes[0:length]), int(runs[0]), int(runs[1])

    def child(self, parent: int, page: Sequence[int]) -> int | None:
        node = int(self.lib.tier_child(self.tree, parent, self._array(page)))
        return None if node == NONE else node

    def add_pages(self, parent: int, tokens: Sequence[int], pins: Sequence[int], stamp: int) -> list[int]:
        """A chain of new pages under ``parent``, one per ``pins`` entry, with no copy yet."""
        nodes = self.ffi.new("int64_t[]", max(1, len(pins)))
        status = self.lib.tier_add_pages(
            self.tree, parent, self._array(tokens), len(pins), self._array(pins), stamp, nodes
        )
        self._ok(status, "add_pages")
        return list(nodes[0 : len(pins)])

    def remove(self, node: int) -> None:
        self._ok(self.lib.tier_remove(self.tree, node), "remove")

    def get(self, node: int, name: int) -> int:
        return int(self.lib.tier_get(self.tree, node, name))

    def add(self, nodes: Sequence[int], name: int, delta: int) -> None:
        if nodes:
            self._ok(self.lib.tier_add(self.tree, self._array(nodes), len(nodes), name, delta), "add")

    def set(self, nodes: Sequence[int], name: int, value: int) -> None:
        if nodes:
            self._ok(self.lib.tier_set(self.tree, self._array(nodes), len(nodes), name, value), "set")

    def handle(self, op: int, handle: TieredHandle) -> int:
        n = len(handle.pages)
        arrays = (self._array(handle.pages), self._array(handle.versions), self._array(handle.since))
        return int(self.lib.tier_handle(self.tree, op, *arrays, n))

    def plan(self, tier: int, pages: int, may_drop: bool, keep: Sequence[int]) -> list[int]:
        if pages <= 0:
            return []
        out = self.ffi.new("int64_t[]", pages)
        length = self.lib.tier_plan(self.tree, tier, pages, may_drop, self._array(keep), len(keep), out)
        if length < 0:
            self._ok(length, "plan")
        return list(out[0:length])

    def unbacked(self, room: int) -> list[int]:
        if room <= 0:
            return []
        out = self.ffi.new("int64_t[]", room)
        length = self.lib.tier_unbacked(self.tree, out, room)
        if length < 0:
            self._ok(length, "unbacked")
        return list(out[0:length])

    def export(self) -> list[tuple[int, list[int]]]:
        """Every page and its fields (``TIER_FIELDS`` of them, in the header's order)."""
        counts = self.counts()
        fields = self.lib.TIER_FIELDS
        nodes = self.ffi.new("int64_t[]", max(1, counts[0]))
        values = self.ffi.new("int64_t[]", max(1, counts[0] * fields))
        length = self.lib.tier_export(self.tree, nodes, values, counts[0])
        assert length == counts[0], "the export holds every page"
        return [(int(nodes[i]), list(values[i * fields : (i + 1) * fields])) for i in range(length)]

    def counts(self) -> tuple[int, int, int]:
        """Pages, pages with a lock, roots."""
        out = self.ffi.new("int64_t[3]")
        self.lib.tier_counts(self.tree, out)
        return int(out[0]), int(out[1]), int(out[2])

    def reset(self) -> None:
        self.lib.tier_reset(self.tree)

    def check(self) -> None:
        """The index's own laws (IntegrityError naming the broken one)."""
        message = self.ffi.new("char[]", 256)
        status = self.lib.tier_check(self.tree, message, 256)
        if status != self.lib.TIER_OK:
            raise IntegrityError(self.ffi.string(message).decode())


class TieredRadixCache:
    """The tiered cache of ``spec/tiers.py``: a C index of pages and KV pools as tensors (twin of
    ``reference.tiered_cache.TieredRadixCache``)."""

    def __init__(
        self,
        page_size: int,
        device_pages: int,
        host_pages: int,
        storage_pages: int = 0,
        policy: st.WritePolicy = "write_through",
        threshold: int = 2,
        device: torch.device | str = "cpu",
    ) -> None:
        # the spec's guards on the configuration, in its words
        st.new_state(page_size, device_pages, host_pages, storage_pages, policy, threshold)
        self.device = device_of(device)
        p = self.page_size = page_size
        self.device_pages, self.host_pages, self.storage_pages = device_pages, host_pages, storage_pages
        self.policy, self.threshold = policy, threshold
        self.index = TierIndex(page_size)
        # the index's constants (its fields, handle ops, tiers)
        self.c = self.index.lib
        self.roots: dict[Namespace, int] = {}
        # the key of each page of the index, by node
        self.key_of: dict[int, PageKey] = {}
        self.device_free = [page * p for page in range(device_pages)]
        self.host_free = [page * p for page in range(host_pages)]
        self.private: set[int] = set()
        # KV rows (-1: never written); the host pool is page-locked beside a CUDA device (the copies stay blocking:
        # the store reads the rows next)
        self.device_k = torch.full((device_pages * p, ROW), -1.0, dtype=torch.float64, device=self.device)
        self.device_v = torch.full_like(self.device_k, -1.0)
        # the device as the pools hold it ("cuda" resolved to its index), so that slots on it are the cache's
        self.device = self.device_k.device
        self.host_k, self.host_v = (torch.full((host_pages * p, ROW), -1.0, dtype=torch.float64) for _ in "kv")
        if self.device.type == "cuda":
            self.host_k, self.host_v = self.host_k.pin_memory(), self.host_v.pin_memory()
        self.storage: dict[PageKey, tuple[torch.Tensor, torch.Tensor]] = {}
        # the code each key's KV is written with, and back
        self.codes: dict[PageKey, int] = {}
        self.keys: list[PageKey] = []
        self.queue: dict[int, InFlight] = {}
        # keys an in-flight prefetch brings (a page a request caches meanwhile is pinned by it)
        self.fetching: Counter[PageKey] = Counter()
        # pages of the stores in flight (storage's room)
        self.storing_pages = 0
        self.next_transfer = 0
        self.clock = 0
        self.epoch = 0
        self.dropped_unbacked = 0
        self.storage_online = True

    # ------------------------------------------------------------ operations

    def match_prefix(
        self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None
    ) -> st.TieredMatch[TieredHandle]:
        """The device, host and storage hits; stamps the pages up to the host hit and counts their hits; under
        write_through_selective, backs up the device pages that reached the threshold (spec: match_prefix)."""
        # CHECK
        tokens = tuple(as_tokens(input_ids).tolist())
        namespace = check_namespace(namespace)
        # WALK
        path, device, host = self._walk(namespace, tokens)
        stored = self._stored_run(namespace, tokens, host)
        # UPDATE
        t = self._tick()
        self.index.set(path[:host], self.c.TIER_LAST_ACCESS, t)
        self.index.add(path[:host], self.c.TIER_HITS, 1)
        if self.policy == "write_through_selective":
            hits = self.c.TIER_HITS
            self._start_backups([page for page in path[:device] if self.index.get(page, hits) >= self.threshold])
        p = self.page_size
        return st.TieredMatch(self._handle(namespace, path[:device]), device * p, host * p, stored * p)

    def insert_prefix(
        self,
        input_ids: torch.Tensor | Sequence[int],
        indices: torch.Tensor | Sequence[int],
        namespace: Namespace = None,
    ) -> st.TieredInsertResult[TieredHandle]:
        """Cache the whole pages on the device with the caller's pages, writing their KV (spec: insert_prefix)."""
        # CHECK: tokens, slots, namespace, lengths, in the spec's order
        ids = as_tokens(input_ids)
        # slots as the caller holds them: a list, or a tensor on the cache's device
        slots = as_slots(indices, self.device).tolist()
        namespace = check_namespace(namespace)
        if ids.numel() != len(slots):
            raise LengthMismatchError.tokens_and_slots(ids.numel(), len(slots))
        tokens = tuple(ids.tolist())
        p = self.page_size
        whole = len(tokens) // p
        path, cached, _ = self._walk(namespace, tokens)
        loading = self.c.TIER_LOADING
        end = next((page for page in range(cached, len(path)) if self.index.get(path[page], loading)), whole)
        starts: list[int] = []
        for index in range(cached, end):
            run = slots[index * p : (index + 1) * p]
            if not is_page_run(run, p):
                raise MisalignedPageError.not_a_run(index, list(run), p)
            if run[0] not in self.private or run[0] in starts:
                raise DuplicateSlotError(f"page {index} takes slot {run[0]}, which the caller does not hold")
            starts.append(run[0])
        # UPDATE
        t = self._tick()
        self.index.set(path[:cached], self.c.TIER_LAST_ACCESS, t)
        if end > len(path):
            parent = path[-1] if path else self._root(namespace)
            path += self._new_pages(namespace, parent, tokens[len(path) * p : end * p], t)
        for page, start in zip(path[cached:end], starts, strict=True):
            self.index.set([page], self.c.TIER_DEVICE, start)
            self.private.discard(start)
        self.index.set(path[cached:end], self.c.TIER_DEVICE_SINCE, t)
        self.index.set(path[cached:end], self.c.TIER_LAST_ACCESS, t)
        self._write_kv(path[cached:end])
        if self.policy == "write_through":
            self._start_backups(path[cached:end])
        return st.TieredInsertResult(cached * p, self._handle(namespace, path[:end]))

    def lock(self, handle: object) -> None:
        """One lock more on every page of the handle's device path (spec: lock)."""
        # CHECK, then UPDATE (in C)
        self._on_handle(self.c.TIER_LOCK, handle)

    def unlock(self, handle: object) -> None:
        """One lock less on every page of the handle's path; refused unless each holds one (spec: unlock)."""
        # CHECK, then UPDATE (in C)
        self._on_handle(self.c.TIER_UNLOCK, handle)

    def allocate(self, num_pages: int) -> list[int]:
        """Device pages for the caller, evicting for what the free list lacks (spec: allocate)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        plan = self._plan_device_eviction(num_pages - len(self.device_free), [])
        if len(self.device_free) + len(plan) < num_pages:
            raise OutOfPagesError(
                f"{num_pages} device pages asked, {len(self.device_free)} free and {len(plan)} evictable"
            )
        # UPDATE
        self._apply_device_eviction(plan)
        taken, self.device_free = self.device_free[:num_pages], self.device_free[num_pages:]
        self.private.update(taken)
        return taken

    def free(self, pages: Sequence[int]) -> None:
        """The caller gives back device pages it holds (spec: free)."""
        # CHECK
        starts = st.check_pages_held(pages, self.private)
        # UPDATE
        self.private.difference_update(starts)
        self.device_free.extend(starts)

    def evict_device(self, num_pages: int) -> list[int]:
        """Evict exactly ``num_pages`` device copies, least recently used first (spec: evict_device)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        plan = self._plan_device_eviction(num_pages, [])
        if len(plan) < num_pages:
            raise EvictionError(f"cannot evict {num_pages} device pages: {len(plan)} evictable")
        # UPDATE
        return sorted(self._apply_device_eviction(plan))

    def evict_host(self, num_pages: int) -> list[int]:
        """Evict exactly ``num_pages`` host copies of pages off the device (spec: evict_host)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        plan = self._plan_host_eviction(num_pages, [])
        if len(plan) < num_pages:
            raise EvictionError(f"cannot evict {num_pages} host pages: {len(plan)} evictable")
        # UPDATE
        return sorted(self._apply_host_eviction(plan))

    def write_back(self, num_pages: int) -> list[int]:
        """Back up the unlocked device leaves without a host copy, least recently used first (spec: write_back)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        # WALK (in C), then UPDATE: one transfer a page
        unbacked = self.index.unbacked(num_pages)
        return [started for page in unbacked if (started := self._start_backup_run([page])) is not None]

    def load_back(self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None) -> int | None:
        """Start loading the host hit past the device hit back to the device (spec: load_back)."""
        # CHECK
        tokens = tuple(as_tokens(input_ids).tolist())
        namespace = check_namespace(namespace)
        path, device, host = self._walk(namespace, tokens)
        run: list[int] = []
        for page in path[device:host]:
            if self.index.get(page, self.c.TIER_LOADING):
                break
            run.append(page)
        if not run:
            return None
        # the path's device pages stay: the run hangs under them
        plan = self._plan_device_eviction(len(run) - len(self.device_free), path[:device])
        if len(self.device_free) + len(plan) < len(run):
            raise OutOfPagesError(f"loading {len(run)} pages back: {len(self.device_free)} free, {len(plan)} evictable")
        # UPDATE
        self._apply_device_eviction(plan)
        destination, self.device_free = self.device_free[: len(run)], self.device_free[len(run) :]
        keys = [self.key_of[page] for page in run]
        return self._begin("load_back", keys, run, self._read_host(run), tuple(destination))

    def prefetch(self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None) -> int | None:
        """Start bringing the storage hit past the host hit into the host tier (spec: prefetch)."""
        # CHECK
        tokens = tuple(as_tokens(input_ids).tolist())
        namespace = check_namespace(namespace)
        path, _, host = self._walk(namespace, tokens)
        stored = self._stored_run(namespace, tokens, host)
        prefixes = compute_page_prefixes(tokens[: stored * self.page_size], self.page_size)
        run: list[PageKey] = []
        for index in range(host, stored):
            key = (namespace, prefixes[index])
            if self.fetching[key]:
                break
            run.append(key)
        # UPDATE
        return self._start_host_run("prefetch", run, [], (), path[:host])

    def complete_transfer(self, transfer_id: int) -> None:
        """The executor finished the transfer: the rows are copied, the copies serve (spec: complete_transfer)."""
        # CHECK
        transfer = self._check_transfer(transfer_id)
        if "storage" in st.ROUTES[transfer.kind] and not self.storage_online:
            raise StorageOfflineError(f"transfer {transfer_id} ({transfer.kind}) cannot complete: storage is offline")
        # UPDATE
        del self.queue[transfer_id]
        self._release(transfer)
        kind, pages = transfer.kind, list(transfer.pages)
        if kind == "backup":
            self._copy(self.device_k, self.device_v, transfer.source, self.host_k, self.host_v, transfer.destination)
            for page, destination in zip(pages, transfer.destination, strict=True):
                self.index.set([page], self.c.TIER_HOST, destination)
            self._start_store(pages)
        elif kind == "load_back":
            t = self._tick()
            self._copy(self.host_k, self.host_v, transfer.source, self.device_k, self.device_v, transfer.destination)
            for page, destination in zip(pages, transfer.destination, strict=True):
                self.index.set([page], self.c.TIER_DEVICE, destination)
            self.index.set(pages, self.c.TIER_DEVICE_SINCE, t)
            self.index.add(pages, self.c.TIER_HOST_LOCKS, -1)
        elif kind == "store":
            rows = self._rows(transfer.source)
            p = self.page_size
            self.index.add(pages, self.c.TIER_HOST_LOCKS, -1)
            for index, page in enumerate(pages):
                at = rows[index * p : (index + 1) * p]
                self.storage[self.key_of[page]] = (self.host_k[at].clone(), self.host_v[at].clone())
        else:
            self._attach_fetched(transfer)

    def fail_transfer(self, transfer_id: int) -> None:
        """The executor gave the transfer up: its destination pages go back, no copy is made (spec: fail_transfer)."""
        # CHECK
        transfer = self._check_transfer(transfer_id)
        # UPDATE
        del self.queue[transfer_id]
        self._release(transfer)
        source, destination = st.ROUTES[transfer.kind]
        if source == "host":
            self.index.add(transfer.pages, self.c.TIER_HOST_LOCKS, -1)
        if destination == "device":
            self.device_free.extend(transfer.destination)
        elif destination == "host":
            self.host_free.extend(transfer.destination)

    def set_storage_online(self, online: bool) -> None:
        """Storage goes offline or comes back, its copies kept (spec: set_storage_online)."""
        # CHECK
        if not isinstance(online, bool):
            raise InvalidTypeError(f"online must be a bool, got {type(online).__name__}")
        # UPDATE
        self.storage_online = online

    def reset(self) -> None:
        """Empty every tier (spec: reset); refused under locks and transfers."""
        # CHECK
        _, locked, _ = self.index.counts()
        if locked or self.queue:
            raise CacheBusyError(f"reset refused: {locked} pages locked, {len(self.queue)} transfers in flight")
        # UPDATE: the pages go back in ascending order
        pages = [values for _, values in self.index.export()]
        self.device_free += sorted(v[self.c.TIER_DEVICE] for v in pages if v[self.c.TIER_DEVICE] != NONE)
        self.host_free += sorted(v[self.c.TIER_HOST] for v in pages if v[self.c.TIER_HOST] != NONE)
        self.index.reset()
        self.key_of.clear()
        self.roots.clear()
        self.storage.clear()
        self.epoch += 1

    # ------------------------------------------------------------ the spec's view

    def abstract_state(self) -> st.TieredState:
        """The state as spec/tiers.py keeps it, each copy's content read back from the pools' rows."""
        state = st.TieredState(
            page_size=self.page_size,
            device_pages=self.device_pages,
            host_pages=self.host_pages,
            storage_pages=self.storage_pages,
            policy=self.policy,
            threshold=self.threshold,
            device_free=list(self.device_free),
            host_free=list(self.host_free),
            private=set(self.private),
            next_transfer=self.next_transfer,
            clock=self.clock,
            epoch=self.epoch,
            dropped_unbacked=self.dropped_unbacked,
            storage_online=self.storage_online,
        )
        f = self.c
        for node, values in self.index.export():
            device, host = values[f.TIER_DEVICE], values[f.TIER_HOST]
            state.entries[self.key_of[node]] = st.TieredEntry(
                device=None if device == NONE else device,
                host=None if host == NONE else host,
                last_access=values[f.TIER_LAST_ACCESS],
                device_since=values[f.TIER_DEVICE_SINCE],
                ref_count=values[f.TIER_REFS],
                host_locks=values[f.TIER_HOST_LOCKS],
                hits=values[f.TIER_HITS],
            )
        for key, (k, v) in self.storage.items():
            content = self._decode(k.tolist(), v.tolist())
            assert content is not None, "storage holds written pages only"
            state.storage[key] = content
        state.device_kv = self._pool_contents(self.device_k, self.device_v)
        state.host_kv = self._pool_contents(self.host_k, self.host_v)
        for number, transfer in self.queue.items():
            state.transfers[number] = st.Transfer(transfer.kind, transfer.keys, transfer.source, transfer.destination)
        return state

    def check_integrity(self) -> None:
        """The index's own laws (csrc/tiers.c: its counts, its children table), then every law of spec/tiers.py on
        the abstract state (IntegrityError naming the broken one)."""
        self.index.check()
        st.check_tiered_invariants(self.abstract_state())

    # ------------------------------------------------------------ the index

    def _tick(self) -> int:
        t = self.clock
        self.clock += 1
        return t

    def _root(self, namespace: Namespace) -> int:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = self.index.new_root()
        return root

    def _new_pages(self, namespace: Namespace, parent: int, tokens: Sequence[int], stamp: int) -> list[int]:
        """The pages of ``tokens`` (whole pages) in a chain under ``parent`` (a root or a page of ``namespace``),
        each pinned by the prefetches in flight that bring it."""
        p = self.page_size
        prefix = self.key_of[parent][1] if parent in self.key_of else None
        keys: list[PageKey] = []
        for at in range(0, len(tokens), p):
            prefix = Prefix.extend(prefix, tuple(tokens[at : at + p]))
            keys.append((namespace, prefix))
        nodes = self.index.add_pages(parent, tokens, [self.fetching[key] for key in keys], stamp)
        self.key_of.update(zip(nodes, keys, strict=True))
        return nodes

    def _remove(self, page: int) -> None:
        """A page with no copy left (and no child) leaves the index."""
        self.index.remove(page)
        del self.key_of[page]

    def _walk(self, namespace: Namespace, tokens: Sequence[int]) -> tuple[list[int], int, int]:
        """The pages of the index along the whole pages of ``tokens`` from the first; how many from the first have a
        device copy, and a device or a host copy."""
        return self.index.walk(self.roots.get(namespace), tokens)

    def _find(self, key: PageKey) -> int | None:
        """The page of ``key`` in the index, or None."""
        pages: list[tuple[int, ...]] = []
        prefix: Prefix | None = key[1]
        while prefix is not None:
            pages.append(prefix.page)
            prefix = prefix.parent
        path, _, _ = self._walk(key[0], [token for page in reversed(pages) for token in page])
        return path[-1] if len(path) == len(pages) else None

    def _stored_run(self, namespace: Namespace, tokens: tuple[int, ...], start: int) -> int:
        """The end of the run of pages from ``start`` that storage holds (none while it is offline)."""
        if not self.storage_online or not self.storage:
            return start
        prefixes = compute_page_prefixes(tokens, self.page_size)
        page = start
        while page < len(prefixes) and (namespace, prefixes[page]) in self.storage:
            page += 1
        return page

    def _handle(self, namespace: Namespace, pages: Sequence[int]) -> TieredHandle:
        versions = tuple(self.index.get(page, self.c.TIER_VERSION) for page in pages)
        since = tuple(self.index.get(page, self.c.TIER_DEVICE_SINCE) for page in pages)
        return TieredHandle(namespace, tuple(pages), versions, since, self.page_size, self)

    def _on_handle(self, op: int, handle: object) -> None:
        if not isinstance(handle, TieredHandle) or handle.cache is not self:
            raise InvalidTypeError(f"expected a TieredHandle of this cache, got {type(handle).__name__}")
        status = self.index.handle(op, handle)
        if status == self.c.TIER_STALE:
            # a page left the index, or the device, or its device copy is a newer one
            raise StaleHandleError(f"a page of the handle's {handle.cached_len} tokens left the device")
        if status == self.c.TIER_NOT_LOCKED:
            raise UnlockError.no_lock_ends_here(handle.cached_len)
        assert status == self.c.TIER_OK, f"tier index: a handle op returned {status}"

    # ------------------------------------------------------------ eviction

    def _plan_device_eviction(self, num_pages: int, keep: Sequence[int]) -> list[int]:
        """The device copies an eviction of ``num_pages`` takes (none of ``keep``)."""
        return self.index.plan(self.c.TIER_ON_DEVICE, num_pages, self.policy != "write_back", keep)

    def _apply_device_eviction(self, plan: Sequence[int]) -> list[int]:
        freed = []
        for page in plan:
            device = self.index.get(page, self.c.TIER_DEVICE)
            assert device != NONE
            freed.append(device)
            self.index.set([page], self.c.TIER_DEVICE, NONE)
            if self.index.get(page, self.c.TIER_HOST) == NONE:
                self.dropped_unbacked += self.key_of[page] not in self.storage
                self._remove(page)
        self.device_free.extend(freed)
        return freed

    def _plan_host_eviction(self, num_pages: int, keep: Sequence[int]) -> list[int]:
        """The host copies an eviction of ``num_pages`` takes (pages off the device, leaves; none of ``keep``)."""
        return self.index.plan(self.c.TIER_ON_HOST, num_pages, False, keep)

    def _apply_host_eviction(self, plan: Sequence[int]) -> list[int]:
        freed = []
        for page in plan:
            host = self.index.get(page, self.c.TIER_HOST)
            assert host != NONE
            freed.append(host)
            self.index.set([page], self.c.TIER_HOST, NONE)
            self._remove(page)
        self.host_free.extend(freed)
        return freed

    # ------------------------------------------------------------ the controller

    def _begin(
        self,
        kind: st.TransferKind,
        keys: Sequence[PageKey],
        pages: Sequence[int],
        source: tuple[int, ...],
        destination: tuple[int, ...],
    ) -> int:
        """Queue a transfer; pin what it moves and the page its run hangs under."""
        namespace, first = keys[0]
        parent = None if first.parent is None else self._find((namespace, first.parent))
        assert parent is not None or first.parent is None, "a run hangs under a page of the index"
        transfer = InFlight(kind, tuple(keys), tuple(pages), parent, source, destination)
        self._pin(transfer, +1)
        number = self.next_transfer
        self.next_transfer += 1
        self.queue[number] = transfer
        return number

    def _release(self, transfer: InFlight) -> None:
        """Unpin what the transfer pinned."""
        self._pin(transfer, -1)

    def _pin(self, transfer: InFlight, delta: int) -> None:
        f = self.c
        if transfer.parent is not None:
            self.index.add([transfer.parent], f.TIER_PINS, delta)
        if transfer.kind == "prefetch":
            for key in transfer.keys:
                self.fetching[key] += delta
                # a page a request cached meanwhile was pinned when it entered the index
                page = self._find(key)
                if page is not None:
                    self.index.add([page], f.TIER_PINS, delta)
            self.fetching = +self.fetching
            return
        moving = {"backup": f.TIER_BACKING, "load_back": f.TIER_LOADING, "store": f.TIER_STORING}[transfer.kind]
        self.index.add(transfer.pages, f.TIER_PINS, delta)
        self.index.add(transfer.pages, moving, delta)
        if transfer.kind == "store":
            self.storing_pages += delta * len(transfer.pages)

    def _attach_fetched(self, transfer: InFlight) -> None:
        """A completed prefetch: pages a request cached meanwhile get the fetched copy as their backup; the rest
        enter the index as host copies."""
        t = self._tick()
        # the run hangs under its parent page (pinned while it was in flight), or under the root
        parent = self._root(transfer.keys[0][0]) if transfer.parent is None else transfer.parent
        for key, destination in zip(transfer.keys, transfer.destination, strict=True):
            k, v = self.storage[key]
            store_cache(self.host_k, self.host_v, self._rows([destination]), k, v)
            page = self.index.child(parent, key[1].page)
            if page is None:
                (page,) = self._new_pages(key[0], parent, key[1].page, t)
            self.index.set([page], self.c.TIER_HOST, destination)
            parent = page

    def _start_host_run(
        self,
        kind: st.TransferKind,
        keys: Sequence[PageKey],
        pages: Sequence[int],
        source: tuple[int, ...],
        keep: Sequence[int],
    ) -> int | None:
        """A transfer of ``keys`` into the host tier, as many (from the first) as it has room for, evicting host
        copies (none of ``keep``)."""
        if not keys:
            return None
        plan = self._plan_host_eviction(len(keys) - len(self.host_free), [*keep, *pages])
        fits = min(len(keys), len(self.host_free) + len(plan))
        if not fits:
            return None
        self._apply_host_eviction(plan[: max(0, fits - len(self.host_free))])
        destination, self.host_free = self.host_free[:fits], self.host_free[fits:]
        return self._begin(kind, keys[:fits], pages[:fits], source[:fits], tuple(destination))

    def _start_backup_run(self, run: Sequence[int]) -> int | None:
        """The backup of ``run`` (device pages without a host copy), as far as the host tier has room."""
        source = tuple(self.index.get(page, self.c.TIER_DEVICE) for page in run)
        assert NONE not in source, "a backup reads device copies"
        return self._start_host_run("backup", [self.key_of[page] for page in run], run, source, [])

    def _start_backups(self, pages: Sequence[int]) -> None:
        """The write policy's backups of ``pages`` with no host copy and none coming."""
        f = self.c
        run = [
            page
            for page in pages
            if self.index.get(page, f.TIER_HOST) == NONE
            and not self.index.get(page, f.TIER_BACKING)
            and not self.fetching[self.key_of[page]]
        ]
        if run:
            self._start_backup_run(run)

    def _start_store(self, pages: Sequence[int]) -> None:
        """Store the pages of a completed backup that storage lacks, as many as it has room for."""
        if not self.storage_online:
            return
        room = self.storage_pages - len(self.storage) - self.storing_pages
        run = [
            page
            for page in pages
            if self.key_of[page] not in self.storage and not self.index.get(page, self.c.TIER_STORING)
        ][: max(0, room)]
        if run:
            self._begin("store", [self.key_of[page] for page in run], run, self._read_host(run), ())

    def _read_host(self, pages: Sequence[int]) -> tuple[int, ...]:
        """The host pages of ``pages``, each locked for a transfer that reads it."""
        source = tuple(self.index.get(page, self.c.TIER_HOST) for page in pages)
        assert NONE not in source, "a transfer reads host copies"
        self.index.add(pages, self.c.TIER_HOST_LOCKS, 1)
        return source

    def _check_transfer(self, transfer_id: object) -> InFlight:
        if not isinstance(transfer_id, int) or isinstance(transfer_id, bool):
            raise InvalidTypeError(f"a transfer id is an int, got {type(transfer_id).__name__}")
        if transfer_id not in self.queue:
            raise InvalidInputError(f"no transfer {transfer_id} is in flight")
        return self.queue[transfer_id]

    # ------------------------------------------------------------ the pools

    def _rows(self, starts: Sequence[int]) -> torch.Tensor:
        """The rows of the pages starting at ``starts``, in order, as an int64 CPU tensor."""
        p = self.page_size
        return torch.tensor([start + offset for start in starts for offset in range(p)], dtype=torch.int64)

    def _copy(
        self,
        from_k: torch.Tensor,
        from_v: torch.Tensor,
        sources: Sequence[int],
        to_k: torch.Tensor,
        to_v: torch.Tensor,
        destinations: Sequence[int],
    ) -> None:
        """Copy the rows of the pages ``sources`` into the pages ``destinations``, through the store path."""
        read = self._rows(sources).to(from_k.device)
        # blocking: the store reads these rows next
        k = from_k[read].to(to_k.device)
        v = from_v[read].to(to_v.device)
        store_cache(to_k, to_v, self._rows(destinations).to(to_k.device), k, v)

    def _write_kv(self, pages: Sequence[int]) -> None:
        """What the forward pass stored for ``pages`` (their device copies): their keys' KV, this epoch's."""
        if not pages:
            return
        p = self.page_size
        k, v = [], []
        for page in pages:
            key = self.key_of[page]
            code = self.codes.get(key)
            if code is None:
                code = self.codes[key] = len(self.keys)
                self.keys.append(key)
            for offset in range(p):
                k.append((code, self.epoch, offset))
                v.append((code, self.epoch, -1 - offset))
        starts = [self.index.get(page, self.c.TIER_DEVICE) for page in pages]
        to = self.device
        store_cache(
            self.device_k,
            self.device_v,
            self._rows(starts).to(to),
            torch.tensor(k, dtype=torch.float64, device=to),
            torch.tensor(v, dtype=torch.float64, device=to),
        )

    def _decode(self, k: list[list[float]], v: list[list[float]]) -> st.Written | None:
        """What one page's rows hold: None when never written, TORN when they are not one page's KV."""
        code, epoch = int(k[0][0]), int(k[0][1])
        if code == -1 and all(row == [-1.0] * ROW for row in (*k, *v)):
            return None
        whole = all(
            k[offset] == [code, epoch, offset] and v[offset] == [code, epoch, -1 - offset] for offset in range(len(k))
        )
        if not whole or not 0 <= code < len(self.keys):
            return st.Written(TORN, epoch)
        return st.Written(self.keys[code], epoch)

    def _pool_contents(self, k: torch.Tensor, v: torch.Tensor) -> dict[int, st.Written]:
        """Each written page of a pool: its start, what it holds."""
        p = self.page_size
        rows_k, rows_v = k.tolist(), v.tolist()
        contents = {}
        for start in range(0, len(rows_k), p):
            content = self._decode(rows_k[start : start + p], rows_v[start : start + p])
            if content is not None:
                contents[start] = content
        return contents
