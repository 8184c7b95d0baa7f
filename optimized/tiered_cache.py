"""The tiered prefix cache (device, host memory, storage): optimized for speed rather than clarity.

Twin of ``reference/tiered_cache.py`` (the meaning in ``spec/tiers.py``; every operation keeps the spec's name).
Two things differ from the reference, both in representation:

* The index holds one node per page (as ``csrc/hybrid.c`` does), each with its copies and counts, and keeps the
  counts a guard needs as it changes: the pages below a page and those of them on the device, the transfers
  that pin it, move it or read its host copy. A guard reads fields; it never scans the transfers or splits a node.
* The pools hold KV. The device pool is a tensor on the cache's device, the host pool a CPU tensor (pinned beside a
  CUDA device), storage a pair of CPU tensors per page key; every copy into a pool (a backup, a load back, a
  prefetch, the forward pass's writes) moves the rows through the store path (``store_cache``: C on the CPU, the
  CUDA kernel on a GPU); a store keeps a copy of the host rows. A row holds what the spec's ``Written``
  names: the code of the page's key, the reset epoch, and the row's position in the page (negated in V). The
  abstract state reads each copy's content back from those bytes, so a torn, shifted or misplaced copy shows as
  the KV of no prefix and ``copies_hold_their_prefix`` names it.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from radixspec.spec import tiers as st
from radixspec.spec.domains import Namespace, check_namespace
from radixspec.spec.errors import (
    CacheBusyError,
    DuplicateSlotError,
    EvictionError,
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

from .inputs import as_slots, as_tokens, device_of
from .store import store_cache

# the key a page's content decodes to when its rows do not hold one page's KV (never a page's key: a negative token)
TORN: PageKey = (None, Prefix.extend(None, (-1,)))
# columns of a KV row: the key's code, the reset epoch, the position in the page
ROW = 3


class TierPage:
    """One page of the index: its copies, its stamps, its counts."""

    __slots__ = (
        "alive",
        "backing",
        "children",
        "depth",
        "device",
        "device_since",
        "hits",
        "host",
        "host_locks",
        "last_access",
        "loading",
        "namespace",
        "on_device_below",
        "parent",
        "pins",
        "prefix",
        "ref_count",
        "storing",
    )

    def __init__(self, namespace: Namespace, prefix: Prefix | None, parent: TierPage | None, stamp: int) -> None:
        # the page's key: its namespace and its prefix (a root's prefix is None)
        self.namespace, self.prefix = namespace, prefix
        self.parent = parent
        # pages from the root through it
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.children: dict[tuple[int, ...], TierPage] = {}
        self.device: int | None = None
        self.host: int | None = None
        self.last_access = self.device_since = stamp
        self.ref_count = self.host_locks = self.hits = 0
        # transfers that move it or hang under it (no eviction takes it)
        self.pins = 0
        # children with a device copy (the device copies stay prefix-closed)
        self.on_device_below = 0
        # transfers of each kind moving it
        self.backing = self.loading = self.storing = 0
        # False once it left the index: a handle through it is stale
        self.alive = True

    @property
    def key(self) -> PageKey:
        """The spec's key of the page (not of a root)."""
        assert self.prefix is not None, "a root is no page"
        return self.namespace, self.prefix


@dataclass(frozen=True)
class TieredHandle:
    """A device path: its pages and each page's ``device_since`` when the handle was made."""

    namespace: Namespace
    pages: tuple[TierPage, ...]
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
    pages: tuple[TierPage, ...]
    parent: TierPage | None
    source: tuple[int, ...]
    destination: tuple[int, ...]


class TieredRadixCache:
    """The tiered cache of ``spec/tiers.py``: an index of pages and KV pools as tensors (twin of
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
        self.roots: dict[Namespace, TierPage] = {}
        self.live: dict[TierPage, None] = {}
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
        path = self._walk(namespace, tokens)
        device, host = self._runs(path)
        stored = self._stored_run(namespace, tokens, host)
        # UPDATE
        t = self._tick()
        for page in path[:host]:
            page.last_access, page.hits = t, page.hits + 1
        if self.policy == "write_through_selective":
            self._start_backups([page for page in path[:device] if page.hits >= self.threshold])
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
        path = self._walk(namespace, tokens)
        cached, _ = self._runs(path)
        end = next((page for page in range(cached, len(path)) if path[page].loading), whole)
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
        for page in path[:cached]:
            page.last_access = t
        parent = path[-1] if path else self._root(namespace)
        for index in range(len(path), end):
            parent = self._new_page(parent, tokens[index * p : (index + 1) * p], t)
            path.append(parent)
        for page, start in zip(path[cached:end], starts, strict=True):
            self._set_device(page, start)
            page.device_since = page.last_access = t
            self.private.discard(start)
        self._write_kv(path[cached:end])
        if self.policy == "write_through":
            self._start_backups(path[cached:end])
        return st.TieredInsertResult(cached * p, self._handle(namespace, path[:end]))

    def lock(self, handle: object) -> None:
        """One lock more on every page of the handle's device path (spec: lock)."""
        # CHECK
        checked = self._check_handle(handle)
        # UPDATE
        for page in checked.pages:
            page.ref_count += 1

    def unlock(self, handle: object) -> None:
        """One lock less on every page of the handle's path; refused unless each holds one (spec: unlock)."""
        # CHECK
        checked = self._check_handle(handle)
        if checked.pages and checked.pages[-1].ref_count == 0:
            raise UnlockError.no_lock_ends_here(checked.cached_len)
        # UPDATE
        for page in checked.pages:
            page.ref_count -= 1

    def allocate(self, num_pages: int) -> list[int]:
        """Device pages for the caller, evicting for what the free list lacks (spec: allocate)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        plan = self._plan_device_eviction(num_pages - len(self.device_free), set())
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
        plan = self._plan_device_eviction(num_pages, set())
        if len(plan) < num_pages:
            raise EvictionError(f"cannot evict {num_pages} device pages: {len(plan)} evictable")
        # UPDATE
        return sorted(self._apply_device_eviction(plan))

    def evict_host(self, num_pages: int) -> list[int]:
        """Evict exactly ``num_pages`` host copies of pages off the device (spec: evict_host)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        plan = self._plan_host_eviction(num_pages, set())
        if len(plan) < num_pages:
            raise EvictionError(f"cannot evict {num_pages} host pages: {len(plan)} evictable")
        # UPDATE
        return sorted(self._apply_host_eviction(plan))

    def write_back(self, num_pages: int) -> list[int]:
        """Back up the unlocked device leaves without a host copy, least recently used first (spec: write_back)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        # WALK
        unbacked = [
            page
            for page in self.live
            if page.device is not None
            and page.host is None
            and page.ref_count == 0
            and page.pins == 0
            and page.on_device_below == 0
        ]
        unbacked.sort(key=lambda page: (page.last_access, page.depth))
        # UPDATE: one transfer a page
        return [started for page in unbacked[:num_pages] if (started := self._start_backup_run([page])) is not None]

    def load_back(self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None) -> int | None:
        """Start loading the host hit past the device hit back to the device (spec: load_back)."""
        # CHECK
        tokens = tuple(as_tokens(input_ids).tolist())
        namespace = check_namespace(namespace)
        path = self._walk(namespace, tokens)
        device, host = self._runs(path)
        run: list[TierPage] = []
        for page in path[device:host]:
            if page.loading:
                break
            run.append(page)
        if not run:
            return None
        # the path's device pages stay: the run hangs under them
        plan = self._plan_device_eviction(len(run) - len(self.device_free), set(path[:device]))
        if len(self.device_free) + len(plan) < len(run):
            raise OutOfPagesError(f"loading {len(run)} pages back: {len(self.device_free)} free, {len(plan)} evictable")
        # UPDATE
        self._apply_device_eviction(plan)
        destination, self.device_free = self.device_free[: len(run)], self.device_free[len(run) :]
        return self._begin("load_back", [page.key for page in run], run, self._read_host(run), tuple(destination))

    def prefetch(self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None) -> int | None:
        """Start bringing the storage hit past the host hit into the host tier (spec: prefetch)."""
        # CHECK
        tokens = tuple(as_tokens(input_ids).tolist())
        namespace = check_namespace(namespace)
        path = self._walk(namespace, tokens)
        _, host = self._runs(path)
        stored = self._stored_run(namespace, tokens, host)
        prefixes = compute_page_prefixes(tokens[: stored * self.page_size], self.page_size)
        run: list[PageKey] = []
        for index in range(host, stored):
            key = (namespace, prefixes[index])
            if self.fetching[key]:
                break
            run.append(key)
        # UPDATE
        return self._start_host_run("prefetch", run, [], (), set(path[:host]))

    def complete_transfer(self, transfer_id: int) -> None:
        """The executor finished the transfer: the rows are copied, the copies serve (spec: complete_transfer)."""
        # CHECK
        transfer = self._check_transfer(transfer_id)
        if "storage" in st.ROUTES[transfer.kind] and not self.storage_online:
            raise StorageOfflineError(f"transfer {transfer_id} ({transfer.kind}) cannot complete: storage is offline")
        # UPDATE
        del self.queue[transfer_id]
        self._release(transfer)
        kind = transfer.kind
        if kind == "backup":
            self._copy(self.device_k, self.device_v, transfer.source, self.host_k, self.host_v, transfer.destination)
            for page, destination in zip(transfer.pages, transfer.destination, strict=True):
                page.host = destination
            self._start_store(transfer.pages)
        elif kind == "load_back":
            t = self._tick()
            self._copy(self.host_k, self.host_v, transfer.source, self.device_k, self.device_v, transfer.destination)
            for page, destination in zip(transfer.pages, transfer.destination, strict=True):
                self._set_device(page, destination)
                page.device_since = t
                page.host_locks -= 1
        elif kind == "store":
            rows = self._rows(transfer.source)
            p = self.page_size
            for index, page in enumerate(transfer.pages):
                page.host_locks -= 1
                at = rows[index * p : (index + 1) * p]
                self.storage[page.key] = (self.host_k[at].clone(), self.host_v[at].clone())
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
            for page in transfer.pages:
                page.host_locks -= 1
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
        locked = sum(1 for page in self.live if page.ref_count)
        if locked or self.queue:
            raise CacheBusyError(f"reset refused: {locked} pages locked, {len(self.queue)} transfers in flight")
        # UPDATE: the pages go back in ascending order
        self.device_free += sorted(page.device for page in self.live if page.device is not None)
        self.host_free += sorted(page.host for page in self.live if page.host is not None)
        for page in self.live:
            page.alive = False
        self.live.clear()
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
        for page in self.live:
            state.entries[page.key] = st.TieredEntry(
                device=page.device,
                host=page.host,
                last_access=page.last_access,
                device_since=page.device_since,
                ref_count=page.ref_count,
                host_locks=page.host_locks,
                hits=page.hits,
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
        """Every law of spec/tiers.py on the abstract state (IntegrityError naming the broken one)."""
        st.check_tiered_invariants(self.abstract_state())

    # ------------------------------------------------------------ the index

    def _tick(self) -> int:
        t = self.clock
        self.clock += 1
        return t

    def _root(self, namespace: Namespace) -> TierPage:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = TierPage(namespace, None, None, 0)
        return root

    def _new_page(self, parent: TierPage, tokens: tuple[int, ...], stamp: int) -> TierPage:
        """A page of ``tokens`` under ``parent``, pinned by the prefetches in flight that bring it."""
        page = TierPage(parent.namespace, Prefix.extend(parent.prefix, tokens), parent, stamp)
        page.pins = self.fetching[page.key]
        parent.children[tokens] = page
        self.live[page] = None
        return page

    def _remove(self, page: TierPage) -> None:
        """A page with no copy left (and no child) leaves the index."""
        parent = page.parent
        assert parent is not None and not page.children
        del parent.children[self._tokens_of(page)]
        del self.live[page]
        page.alive = False

    def _set_device(self, page: TierPage, start: int | None) -> None:
        """Give ``page`` a device copy at ``start``, or take it (None), keeping its parent's count."""
        parent = page.parent
        assert parent is not None
        parent.on_device_below += (start is not None) - (page.device is not None)
        page.device = start

    def _walk(self, namespace: Namespace, tokens: Sequence[int]) -> list[TierPage]:
        """The pages of the index along the whole pages of ``tokens``, from the first."""
        root = self.roots.get(namespace)
        path: list[TierPage] = []
        p = self.page_size
        for at in range(0, len(tokens) // p * p, p):
            if root is None:
                break
            root = root.children.get(tuple(tokens[at : at + p]))
            if root is not None:
                path.append(root)
        return path

    def _find(self, key: PageKey) -> TierPage | None:
        """The page of ``key`` in the index, or None."""
        pages: list[tuple[int, ...]] = []
        prefix: Prefix | None = key[1]
        while prefix is not None:
            pages.append(prefix.page)
            prefix = prefix.parent
        page = self.roots.get(key[0])
        for tokens in reversed(pages):
            if page is None:
                return None
            page = page.children.get(tokens)
        return page

    @staticmethod
    def _tokens_of(page: TierPage) -> tuple[int, ...]:
        """Its own tokens (its key among its parent's children)."""
        return page.key[1].page

    def _runs(self, path: Sequence[TierPage]) -> tuple[int, int]:
        """Pages with a device copy from the first, then with a device or a host copy."""
        device = 0
        while device < len(path) and path[device].device is not None:
            device += 1
        host = device
        while host < len(path) and path[host].host is not None:
            host += 1
        return device, host

    def _stored_run(self, namespace: Namespace, tokens: tuple[int, ...], start: int) -> int:
        """The end of the run of pages from ``start`` that storage holds (none while it is offline)."""
        if not self.storage_online or not self.storage:
            return start
        prefixes = compute_page_prefixes(tokens, self.page_size)
        page = start
        while page < len(prefixes) and (namespace, prefixes[page]) in self.storage:
            page += 1
        return page

    def _handle(self, namespace: Namespace, pages: Sequence[TierPage]) -> TieredHandle:
        return TieredHandle(namespace, tuple(pages), tuple(page.device_since for page in pages), self.page_size, self)

    def _check_handle(self, handle: object) -> TieredHandle:
        if not isinstance(handle, TieredHandle) or handle.cache is not self:
            raise InvalidTypeError(f"expected a TieredHandle of this cache, got {type(handle).__name__}")
        for page, since in zip(handle.pages, handle.since, strict=True):
            # the page left the index, or the device, or its device copy is a newer one
            if not page.alive or page.device is None or page.device_since != since:
                raise StaleHandleError(f"a page of the handle's {handle.cached_len} tokens left the device")
        return handle

    # ------------------------------------------------------------ eviction

    def _plan(
        self, num_pages: int, is_evictable: Callable[[TierPage], bool], take: Callable[[TierPage], None]
    ) -> list[TierPage]:
        """Up to ``num_pages`` pages, one at a time, each the least recently used evictable one (its parent may
        become evictable then). Candidates never share a stamp and a depth, so the order is total."""
        if num_pages <= 0:
            return []
        heap = [
            (page.last_access, page.depth, order, page) for order, page in enumerate(self.live) if is_evictable(page)
        ]
        heapq.heapify(heap)
        plan: list[TierPage] = []
        while heap and len(plan) < num_pages:
            *_, page = heapq.heappop(heap)
            plan.append(page)
            take(page)
            parent = page.parent
            if parent is not None and parent.parent is not None and is_evictable(parent):
                heapq.heappush(heap, (parent.last_access, parent.depth, -len(plan), parent))
        return plan

    def _plan_device_eviction(self, num_pages: int, keep: set[TierPage]) -> list[TierPage]:
        """The device copies an eviction of ``num_pages`` takes (none of ``keep``)."""
        taken: set[TierPage] = set()
        # what the plan so far took below each page: device copies, and pages that leave the index
        off_device: Counter[TierPage] = Counter()
        leaving: Counter[TierPage] = Counter()
        may_drop = self.policy != "write_back"

        def evictable(page: TierPage) -> bool:
            return (
                page.device is not None
                and page.ref_count == 0
                and page.pins == 0
                and page not in keep
                and page not in taken
                and page.on_device_below == off_device[page]
                and (page.host is not None or (may_drop and len(page.children) == leaving[page]))
            )

        def take(page: TierPage) -> None:
            assert page.parent is not None
            off_device[page.parent] += 1
            leaving[page.parent] += page.host is None
            taken.add(page)

        return self._plan(num_pages, evictable, take)

    def _apply_device_eviction(self, plan: Sequence[TierPage]) -> list[int]:
        freed = []
        for page in plan:
            assert page.device is not None
            freed.append(page.device)
            self._set_device(page, None)
            if page.host is None:
                self.dropped_unbacked += page.key not in self.storage
                self._remove(page)
        self.device_free.extend(freed)
        return freed

    def _plan_host_eviction(self, num_pages: int, keep: set[TierPage]) -> list[TierPage]:
        """The host copies an eviction of ``num_pages`` takes (pages off the device, leaves; none of ``keep``)."""
        taken: set[TierPage] = set()
        leaving: Counter[TierPage] = Counter()

        def evictable(page: TierPage) -> bool:
            return (
                page.host is not None
                and page.host_locks == 0
                and page.pins == 0
                and page not in keep
                and page not in taken
                and page.device is None
                and len(page.children) == leaving[page]
            )

        def take(page: TierPage) -> None:
            assert page.parent is not None
            leaving[page.parent] += 1
            taken.add(page)

        return self._plan(num_pages, evictable, take)

    def _apply_host_eviction(self, plan: Sequence[TierPage]) -> list[int]:
        freed = []
        for page in plan:
            assert page.host is not None
            freed.append(page.host)
            self._remove(page)
        self.host_free.extend(freed)
        return freed

    # ------------------------------------------------------------ the controller

    def _begin(
        self,
        kind: st.TransferKind,
        keys: Sequence[PageKey],
        pages: Sequence[TierPage],
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
        if transfer.parent is not None:
            transfer.parent.pins += delta
        if transfer.kind == "prefetch":
            for key in transfer.keys:
                self.fetching[key] += delta
                # a page a request cached meanwhile was pinned when it entered the index
                page = self._find(key)
                if page is not None:
                    page.pins += delta
            self.fetching = +self.fetching
            return
        for page in transfer.pages:
            page.pins += delta
            if transfer.kind == "backup":
                page.backing += delta
            elif transfer.kind == "load_back":
                page.loading += delta
            else:
                page.storing += delta
        if transfer.kind == "store":
            self.storing_pages += delta * len(transfer.pages)

    def _attach_fetched(self, transfer: InFlight) -> None:
        """A completed prefetch: pages a request cached meanwhile get the fetched copy as their backup; the rest
        enter the index as host copies."""
        t = self._tick()
        # the run hangs under its parent page (pinned while it was in flight), or under the root
        parent = transfer.parent or self._root(transfer.keys[0][0])
        for key, destination in zip(transfer.keys, transfer.destination, strict=True):
            k, v = self.storage[key]
            store_cache(self.host_k, self.host_v, self._rows([destination]), k, v)
            page = parent.children.get(key[1].page) or self._new_page(parent, key[1].page, t)
            page.host = destination
            parent = page

    def _start_host_run(
        self,
        kind: st.TransferKind,
        keys: Sequence[PageKey],
        pages: Sequence[TierPage],
        source: tuple[int, ...],
        keep: set[TierPage],
    ) -> int | None:
        """A transfer of ``keys`` into the host tier, as many (from the first) as it has room for, evicting host
        copies (none of ``keep``)."""
        if not keys:
            return None
        plan = self._plan_host_eviction(len(keys) - len(self.host_free), keep | set(pages))
        fits = min(len(keys), len(self.host_free) + len(plan))
        if not fits:
            return None
        self._apply_host_eviction(plan[: max(0, fits - len(self.host_free))])
        destination, self.host_free = self.host_free[:fits], self.host_free[fits:]
        return self._begin(kind, keys[:fits], pages[:fits], source[:fits], tuple(destination))

    def _start_backup_run(self, run: Sequence[TierPage]) -> int | None:
        """The backup of ``run`` (device pages without a host copy), as far as the host tier has room."""
        source = tuple(page.device for page in run if page.device is not None)
        assert len(source) == len(run), "a backup reads device copies"
        return self._start_host_run("backup", [page.key for page in run], run, source, set())

    def _start_backups(self, pages: Sequence[TierPage]) -> None:
        """The write policy's backups of ``pages`` with no host copy and none coming."""
        run = [page for page in pages if page.host is None and not page.backing and not self.fetching[page.key]]
        if run:
            self._start_backup_run(run)

    def _start_store(self, pages: Sequence[TierPage]) -> None:
        """Store the pages of a completed backup that storage lacks, as many as it has room for."""
        if not self.storage_online:
            return
        room = self.storage_pages - len(self.storage) - self.storing_pages
        run = [page for page in pages if page.key not in self.storage and not page.storing][: max(0, room)]
        if run:
            self._begin("store", [page.key for page in run], run, self._read_host(run), ())

    def _read_host(self, pages: Iterable[TierPage]) -> tuple[int, ...]:
        """The host pages of ``pages``, each locked for a transfer that reads it."""
        source = []
        for page in pages:
            assert page.host is not None, "a transfer reads host copies"
            page.host_locks += 1
            source.append(page.host)
        return tuple(source)

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

    def _write_kv(self, pages: Sequence[TierPage]) -> None:
        """What the forward pass stored for ``pages`` (their device copies): their keys' KV, this epoch's."""
        if not pages:
            return
        p = self.page_size
        k, v = [], []
        for page in pages:
            code = self.codes.get(page.key)
            if code is None:
                code = self.codes[page.key] = len(self.keys)
                self.keys.append(page.key)
            for offset in range(p):
                k.append((code, self.epoch, offset))
                v.append((code, self.epoch, -1 - offset))
        starts = [page.device for page in pages if page.device is not None]
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
