"""Tiers: a prefix cache whose pages have copies in device memory, host memory and storage.

The index is the one of ``prefix_cache.py``: a page key ``(namespace, prefix)`` names the KV of that prefix.
A tiered cache keeps up to three copies of that KV, one per tier, each tier with its own pages and capacity:

* **device**: the pool the model reads (page starts, multiples of P); requests hold device pages privately
  from ``allocate`` until ``insert_prefix`` caches them or ``free`` gives them back.
* **host**: a pool in host memory (page starts); a page's host copy is its backup.
* **storage**: a store keyed by page key (no slots), shared by restarts in engines, emptied by ``reset`` here.

The tree (``entries``) holds the pages with a device or a host copy; storage holds copies by key beside it.
Copies move by **transfers**, which start, stay in flight and later complete or fail (a cancel ends like a
failure: the executor stops, then the pages go back). A transfer moves one run of pages along one path:

    backup      device -> host      write-through, write-through after N hits, or write-back (``write_back``)
    load_back   host -> device      a match's host hit brought back to the device
    store       host -> storage     started when a backup completes, where storage is on
    prefetch    storage -> host     a match's storage hit brought into the host tier

While in flight, its source copies are pinned (never evicted; a host copy read counts in ``host_locks``), its
destination pages are reserved (neither free nor serving), and the pages it hangs under stay in place.

A match reports three lengths: the device hit (pages with a device copy), the longer host hit (a device or a
host copy) and the storage hit (or a copy in storage); it stamps and counts the hits of the tree's pages up to
the host hit. Which copies a policy makes is a named choice (``WritePolicy``); the laws hold for all.

Each slot's content is modelled as what was written into it (``Written``: the key whose KV it is, and the
reset epoch it was written in), so the laws can say that every serving copy holds its own prefix's KV and that
no copy survives a reset. Every operation lists its guards (``# CHECK``) before its effects.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, NamedTuple, TypeVar

from .domains import (
    Namespace,
    check_insert_inputs,
    check_namespace,
    check_page_size,
    check_slot_indices,
    check_token_ids,
)
from .errors import (
    CacheBusyError,
    DuplicateSlotError,
    EvictionError,
    IntegrityError,
    InvalidInputError,
    InvalidSizeError,
    InvalidTypeError,
    MisalignedPageError,
    OutOfPagesError,
    StaleHandleError,
    StorageOfflineError,
    UnlockError,
)
from .helpers import is_page_run
from .prefix_cache import PageKey, compute_page_prefixes, count_child_locks, find_orphan_key, get_parent_key, take_tick

Tier = Literal["device", "host", "storage"]
# which copies the cache makes of its device pages (SGLang's hicache_write_policy names)
WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
WRITE_POLICIES: tuple[WritePolicy, ...] = ("write_through", "write_through_selective", "write_back")
TransferKind = Literal["backup", "load_back", "store", "prefetch"]
# each kind of transfer: (the tier it reads, the tier it writes)
ROUTES: dict[TransferKind, tuple[Tier, Tier]] = {
    "backup": ("device", "host"),
    "load_back": ("host", "device"),
    "store": ("host", "storage"),
    "prefetch": ("storage", "host"),
}


class Written(NamedTuple):
    """What a page (or a storage entry) holds: the KV of ``key``, written in reset epoch ``epoch``."""

    key: PageKey
    epoch: int


@dataclass
class TieredEntry:
    """A page of the tree: its copies and its accounting."""

    # the page start of its device copy, None when it has none
    device: int | None
    # the page start of its host copy (its backup), None when it has none
    host: int | None
    last_access: int
    # the stamp at which its device copy was made (a handle made before is stale once the copy left)
    device_since: int
    # requests' locks on the device path through it
    ref_count: int = 0
    # in-flight transfers reading its host copy (load_back, store)
    host_locks: int = 0
    # matches that reached it (write_through_selective backs it up at the threshold)
    hits: int = 0


@dataclass(frozen=True)
class Transfer:
    """One run of pages along one path, copied from one tier to another."""

    kind: TransferKind
    # the pages, shortest first
    keys: tuple[PageKey, ...]
    # the page starts it reads (empty when it reads storage)
    source: tuple[int, ...]
    # the page starts it writes (empty when it writes storage)
    destination: tuple[int, ...]


@dataclass(frozen=True)
class TieredHandle:
    """A device path from a match or an insert: lock it to keep it on the device."""

    namespace: Namespace
    keys: tuple[PageKey, ...]
    # each page's device_since when the handle was made
    since: tuple[int, ...]

    @property
    def cached_len(self) -> int:
        return len(self.keys[-1][1]) if self.keys else 0


# a handle's type: the spec's TieredHandle, or an implementation's (the results below are shared)
H = TypeVar("H")


class TieredMatch(NamedTuple, Generic[H]):
    """What match_prefix returns."""

    # the device hit: lock it before using its pages
    handle: H
    # tokens of the device hit, and of the longer hits counting host copies, then storage copies too
    device_len: int
    host_len: int
    storage_len: int


class TieredInsertResult(NamedTuple, Generic[H]):
    """What insert_prefix returns."""

    # tokens that had a device copy before the call: the caller frees its own pages among them
    cached_len: int
    # the device path inserted; pages past it (from a page being loaded back) stay the caller's
    handle: H


class TierUsage(NamedTuple):
    """One tier's pages: each in exactly one of these (storage: keys, no free list)."""

    free: int
    # serving copies
    cached: int
    # reserved as a transfer's destination
    in_flight: int
    # held by callers (device only)
    private: int
    capacity: int


@dataclass
class TieredState:
    """The tiered cache: the tree of pages with device or host copies, storage beside it, the transfers."""

    page_size: int
    device_pages: int
    host_pages: int
    storage_pages: int
    policy: WritePolicy = "write_through"
    # write_through_selective: the hits that make a device page worth a backup
    threshold: int = 2
    entries: dict[PageKey, TieredEntry] = field(default_factory=dict)
    storage: dict[PageKey, Written] = field(default_factory=dict)
    # free page starts, FIFO: taken from the front, given back at the end
    device_free: list[int] = field(default_factory=list)
    host_free: list[int] = field(default_factory=list)
    # device pages allocated to callers and not cached
    private: set[int] = field(default_factory=set)
    # what each page holds (stale content stays until overwritten, as in memory)
    device_kv: dict[int, Written] = field(default_factory=dict)
    host_kv: dict[int, Written] = field(default_factory=dict)
    transfers: dict[int, Transfer] = field(default_factory=dict)
    next_transfer: int = 0
    clock: int = 0
    # resets so far: a copy written before the last one must not serve
    epoch: int = 0
    # device pages evicted with no copy left in any tier (write-through may drop; write-back never)
    dropped_unbacked: int = 0
    # storage reachable: offline, a match sees no storage hit, no store starts and none in flight completes
    storage_online: bool = True


# The tiered cache's operations: the spec's names, which the reference and optimized twins keep.
OPERATIONS = (
    "match_prefix",
    "insert_prefix",
    "lock",
    "unlock",
    "allocate",
    "free",
    "evict_device",
    "evict_host",
    "write_back",
    "load_back",
    "prefetch",
    "complete_transfer",
    "fail_transfer",
    "set_storage_online",
    "reset",
)


def new_state(
    page_size: int,
    device_pages: int,
    host_pages: int,
    storage_pages: int = 0,
    policy: WritePolicy = "write_through",
    threshold: int = 2,
) -> TieredState:
    """An empty tiered cache: every device and host page free, storage empty (0 pages: no storage tier)."""
    # CHECK
    p = check_page_size(page_size)
    for name, value in (("device_pages", device_pages), ("host_pages", host_pages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidSizeError.not_positive(name, value)
    check_count("storage_pages", storage_pages)
    if policy not in WRITE_POLICIES:
        raise InvalidInputError(f"policy must be one of {', '.join(WRITE_POLICIES)}, got {policy!r}")
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
        raise InvalidSizeError.not_positive("threshold", threshold)
    # UPDATE
    return TieredState(
        page_size=p,
        device_pages=device_pages,
        host_pages=host_pages,
        storage_pages=storage_pages,
        policy=policy,
        threshold=threshold,
        device_free=[page * p for page in range(device_pages)],
        host_free=[page * p for page in range(host_pages)],
    )


# ---------------------------------------------------------------- reads


def get_page_keys(state: TieredState, namespace: Namespace, tokens: Sequence[int]) -> list[PageKey]:
    """Keys of the whole pages of ``tokens``, shortest first."""
    return [(namespace, prefix) for prefix in compute_page_prefixes(tokens, state.page_size)]


def get_moving_keys(state: TieredState, kind: TransferKind) -> set[PageKey]:
    """Pages that an in-flight transfer of ``kind`` moves."""
    return {key for transfer in state.transfers.values() if transfer.kind == kind for key in transfer.keys}


def get_pinned_keys(state: TieredState) -> set[PageKey]:
    """Pages no eviction may take now: every page a transfer moves, and the page each transfer's run hangs
    under (its completion extends that page's path)."""
    pinned: set[PageKey] = set()
    for transfer in state.transfers.values():
        pinned.update(transfer.keys)
        parent = get_parent_key(transfer.keys[0])
        if parent is not None:
            pinned.add(parent)
    return pinned


def get_children(state: TieredState) -> tuple[Counter[PageKey], Counter[PageKey]]:
    """Per page: the tree pages extending it, and those of them with a device copy."""
    below: Counter[PageKey] = Counter()
    on_device: Counter[PageKey] = Counter()
    for key, entry in state.entries.items():
        parent = get_parent_key(key)
        if parent is not None:
            below[parent] += 1
            on_device[parent] += entry.device is not None
    return below, on_device


def is_device_evictable(
    state: TieredState,
    key: PageKey,
    pinned: set[PageKey],
    children: Counter[PageKey],
    device_children: Counter[PageKey],
) -> bool:
    """True when ``key``'s device copy may be evicted now."""
    entry = state.entries[key]
    return (
        # it has a device copy that nobody locks
        entry.device is not None
        and entry.ref_count == 0
        # no transfer reads it, writes it or hangs under it
        and key not in pinned
        # no device copy extends it (the device copies stay prefix-closed)
        and not device_children[key]
        # and its KV survives elsewhere, or the policy lets a leaf page go (write-back never drops one)
        and (entry.host is not None or (state.policy != "write_back" and not children[key]))
    )


def is_host_evictable(state: TieredState, key: PageKey, pinned: set[PageKey], children: Counter[PageKey]) -> bool:
    """True when ``key``'s host copy may be evicted now (a page already off the device, a leaf of the tree)."""
    entry = state.entries[key]
    return (
        # it has a host copy that no transfer reads
        entry.host is not None
        and entry.host_locks == 0
        and key not in pinned
        # and it is the page's last copy in the tree, at a leaf: the entry leaves with it
        and entry.device is None
        and not children[key]
    )


def get_hit_lengths(state: TieredState, keys: Sequence[PageKey]) -> tuple[int, int, int]:
    """Pages of ``keys`` (a path, shortest first) with a device copy, then with a device or host copy, then with
    a copy in any tier (storage counted while it is online), each counted from the first page."""
    device = host = stored = 0
    for key in keys:
        entry = state.entries.get(key)
        if entry is None or entry.device is None:
            break
        device += 1
    host = device
    for key in keys[device:]:
        entry = state.entries.get(key)
        if entry is None or entry.host is None:
            break
        host += 1
    stored = host
    for key in keys[host:] if state.storage_online else ():
        if key not in state.storage:
            break
        stored += 1
    return device, host, stored


def is_handle_stale(state: TieredState, handle: TieredHandle) -> bool:
    """True when a page of the handle's path lost the device copy it had when the handle was made."""
    for key, since in zip(handle.keys, handle.since, strict=True):
        entry = state.entries.get(key)
        # the page is gone, or off the device
        if entry is None or entry.device is None:
            return True
        # or its device copy is a newer one
        if entry.device_since != since:
            return True
    return False


def get_tier_usage(state: TieredState) -> dict[Tier, TierUsage]:
    """Per tier, how its pages are used (tiers_are_conserved says they add up)."""
    device = sum(1 for entry in state.entries.values() if entry.device is not None)
    host = sum(1 for entry in state.entries.values() if entry.host is not None)
    moving: Counter[Tier] = Counter()
    for transfer in state.transfers.values():
        moving[ROUTES[transfer.kind][1]] += len(transfer.keys)
    return {
        "device": TierUsage(len(state.device_free), device, moving["device"], len(state.private), state.device_pages),
        "host": TierUsage(len(state.host_free), host, moving["host"], 0, state.host_pages),
        "storage": TierUsage(
            state.storage_pages - len(state.storage) - moving["storage"],
            len(state.storage),
            moving["storage"],
            0,
            state.storage_pages,
        ),
    }


# ---------------------------------------------------------------- operations


def match_prefix(
    state: TieredState, input_ids: Sequence[int], namespace: Namespace = None
) -> TieredMatch[TieredHandle]:
    """The device, host and storage hits of ``input_ids``; stamps the tree's pages up to the host hit and counts
    their hits. Under write_through_selective a device page whose hits reach the threshold starts its backup."""
    # CHECK
    tokens = check_token_ids(input_ids)
    namespace = check_namespace(namespace)
    # WALK
    keys = get_page_keys(state, namespace, tokens)
    device, host, stored = get_hit_lengths(state, keys)
    # UPDATE
    t = take_tick(state)
    for key in keys[:host]:
        entry = state.entries[key]
        entry.last_access, entry.hits = t, entry.hits + 1
    if state.policy == "write_through_selective":
        start_backups(state, [key for key in keys[:device] if state.entries[key].hits >= state.threshold])
    p = state.page_size
    return TieredMatch(make_handle(state, namespace, keys[:device]), device * p, host * p, stored * p)


def insert_prefix(
    state: TieredState, input_ids: Sequence[int], indices: Sequence[int], namespace: Namespace = None
) -> TieredInsertResult[TieredHandle]:
    """Cache the whole pages of ``input_ids`` on the device; new pages take the caller's pages from ``indices``.

    Pages with a device copy keep it (``cached_len`` counts them; the caller frees its own duplicates). A page
    being loaded back ends the insert there: the pages past it stay the caller's. A page with only a host
    copy gains the caller's page as its device copy. Under write_through every new device page starts its
    backup."""
    # CHECK
    tokens, slots, namespace = check_insert_inputs(input_ids, indices, namespace)
    p = state.page_size
    keys = get_page_keys(state, namespace, tokens)
    cached, _, _ = get_hit_lengths(state, keys)
    loading = get_moving_keys(state, "load_back")
    end = next((page for page in range(cached, len(keys)) if keys[page] in loading), len(keys))
    starts: list[int] = []
    for page in range(cached, end):
        run = slots[page * p : (page + 1) * p]
        if not is_page_run(run, p):
            raise MisalignedPageError.not_a_run(page, list(run), p)
        if run[0] not in state.private or run[0] in starts:
            raise DuplicateSlotError(f"page {page} takes slot {run[0]}, which the caller does not hold")
        starts.append(run[0])
    # UPDATE
    t = take_tick(state)
    for key in keys[:cached]:
        state.entries[key].last_access = t
    for key, start in zip(keys[cached:end], starts, strict=True):
        entry = state.entries.get(key)
        if entry is None:
            state.entries[key] = TieredEntry(device=start, host=None, last_access=t, device_since=t)
        else:
            entry.device, entry.device_since, entry.last_access = start, t, t
        state.private.discard(start)
        state.device_kv[start] = Written(key, state.epoch)
    if state.policy == "write_through":
        start_backups(state, keys[cached:end])
    return TieredInsertResult(cached * p, make_handle(state, namespace, keys[:end]))


def lock(state: TieredState, handle: TieredHandle) -> None:
    """One lock more on every page of the handle's device path: none of them leaves the device."""
    # CHECK
    check_handle(state, handle)
    # UPDATE
    for key in handle.keys:
        state.entries[key].ref_count += 1


def unlock(state: TieredState, handle: TieredHandle) -> None:
    """One lock less on every page of the handle's path; refused unless each holds one."""
    # CHECK
    check_handle(state, handle)
    if handle.keys and state.entries[handle.keys[-1]].ref_count == 0:
        raise UnlockError.no_lock_ends_here(handle.cached_len)
    # UPDATE
    for key in handle.keys:
        state.entries[key].ref_count -= 1


def allocate(state: TieredState, num_pages: int) -> list[int]:
    """``num_pages`` device pages for the caller (page starts), evicting device copies for what the free list
    lacks. OutOfPagesError, nothing changed, when even eviction cannot give them."""
    # CHECK
    check_count("num_pages", num_pages)
    plan = plan_device_eviction(state, num_pages - len(state.device_free))
    if len(state.device_free) + len(plan) < num_pages:
        raise OutOfPagesError(
            f"{num_pages} device pages asked, {len(state.device_free)} free and {len(plan)} evictable"
        )
    # UPDATE
    apply_device_eviction(state, plan)
    taken, state.device_free = state.device_free[:num_pages], state.device_free[num_pages:]
    state.private.update(taken)
    return taken


def check_pages_held(pages: object, held: Collection[int]) -> tuple[int, ...]:
    """The guards of ``free``: ``pages`` are page starts the caller holds (``held``), none named twice."""
    starts = check_slot_indices(pages, "pages")
    for start in starts:
        if start not in held:
            raise InvalidInputError(f"page {start} is not held by the caller")
    if len(set(starts)) != len(starts):
        raise DuplicateSlotError(f"pages {list(starts)} name a page twice")
    return starts


def free(state: TieredState, pages: Sequence[int]) -> None:
    """The caller gives back device pages it holds (page starts)."""
    # CHECK
    starts = check_pages_held(pages, state.private)
    # UPDATE
    state.private.difference_update(starts)
    state.device_free.extend(starts)


def evict_device(state: TieredState, num_pages: int) -> list[int]:
    """Evict exactly ``num_pages`` device copies, least recently used evictable first; a page with a host copy
    stays in the tree, one without leaves it. Returns the freed page starts, ascending."""
    # CHECK
    check_count("num_pages", num_pages)
    plan = plan_device_eviction(state, num_pages)
    if len(plan) < num_pages:
        raise EvictionError(f"cannot evict {num_pages} device pages: {len(plan)} evictable")
    # UPDATE
    freed = apply_device_eviction(state, plan)
    return sorted(freed)


def evict_host(state: TieredState, num_pages: int) -> list[int]:
    """Evict exactly ``num_pages`` host copies of pages already off the device (leaves of the tree, least
    recently used first); their entries leave the tree. Returns the freed page starts, ascending."""
    # CHECK
    check_count("num_pages", num_pages)
    plan = plan_host_eviction(state, num_pages, set())
    if len(plan) < num_pages:
        raise EvictionError(f"cannot evict {num_pages} host pages: {len(plan)} evictable")
    # UPDATE
    return sorted(apply_host_eviction(state, plan))


def write_back(state: TieredState, num_pages: int) -> list[int]:
    """Start backups of up to ``num_pages`` of the device pages eviction would take next but for their missing
    host copy (unlocked device leaves, least recently used first): what write-back does before it evicts. Host
    copies are evicted for room. Returns the transfers started."""
    # CHECK
    check_count("num_pages", num_pages)
    # WALK
    pinned = get_pinned_keys(state)
    _, device_children = get_children(state)
    unbacked = [
        key
        for key, entry in state.entries.items()
        if entry.device is not None
        and entry.host is None
        and entry.ref_count == 0
        and key not in pinned
        and not device_children[key]
    ]
    unbacked.sort(key=lambda key: (state.entries[key].last_access, len(key[1])))
    # UPDATE
    return [started for key in unbacked[:num_pages] if (started := start_backup_run(state, [key])) is not None]


def load_back(state: TieredState, input_ids: Sequence[int], namespace: Namespace = None) -> int | None:
    """Start loading the match's host hit past its device hit back to the device (up to a page already being
    loaded). Device pages come from the free list, then from eviction. Returns the transfer started, None when
    there is nothing to load; OutOfPagesError, nothing changed, when the device has no room."""
    # CHECK
    tokens = check_token_ids(input_ids)
    namespace = check_namespace(namespace)
    keys = get_page_keys(state, namespace, tokens)
    device, host, _ = get_hit_lengths(state, keys)
    run = take_until(keys[device:host], get_moving_keys(state, "load_back"))
    if not run:
        return None
    # the path's device pages stay: the run hangs under them
    plan = plan_device_eviction(state, len(run) - len(state.device_free), keep=set(keys[:device]))
    if len(state.device_free) + len(plan) < len(run):
        raise OutOfPagesError(f"loading {len(run)} pages back: {len(state.device_free)} free, {len(plan)} evictable")
    # UPDATE
    apply_device_eviction(state, plan)
    destination, state.device_free = state.device_free[: len(run)], state.device_free[len(run) :]
    return begin_transfer(state, Transfer("load_back", tuple(run), read_host_copies(state, run), tuple(destination)))


def prefetch(state: TieredState, input_ids: Sequence[int], namespace: Namespace = None) -> int | None:
    """Start bringing the match's storage hit past its host hit into the host tier (up to a page already being
    prefetched, or as many pages as the host tier can take, evicting host copies). Returns the transfer
    started, None when there is nothing to fetch or no room."""
    # CHECK
    tokens = check_token_ids(input_ids)
    namespace = check_namespace(namespace)
    keys = get_page_keys(state, namespace, tokens)
    _, host, stored = get_hit_lengths(state, keys)
    run = take_until(keys[host:stored], get_moving_keys(state, "prefetch"))
    # UPDATE
    return start_host_run(state, "prefetch", run, (), keep=set(keys[:host]))


def complete_transfer(state: TieredState, transfer_id: int) -> None:
    """The executor finished the transfer: its destination pages now serve copies of what its source held; its
    source pins are released. A backup's pages then start their store, where storage is on. A store or a
    prefetch cannot complete while storage is offline (StorageOfflineError: it may fail, or wait)."""
    # CHECK
    transfer = check_transfer(state, transfer_id)
    if "storage" in ROUTES[transfer.kind] and not state.storage_online:
        raise StorageOfflineError(f"transfer {transfer_id} ({transfer.kind}) cannot complete: storage is offline")
    # UPDATE
    del state.transfers[transfer_id]
    kind, keys = transfer.kind, transfer.keys
    if kind == "backup":
        for key, source, destination in zip(keys, transfer.source, transfer.destination, strict=True):
            state.entries[key].host = destination
            state.host_kv[destination] = state.device_kv[source]
        start_store(state, keys)
    elif kind == "load_back":
        t = take_tick(state)
        for key, source, destination in zip(keys, transfer.source, transfer.destination, strict=True):
            entry = state.entries[key]
            entry.device, entry.device_since, entry.host_locks = destination, t, entry.host_locks - 1
            state.device_kv[destination] = state.host_kv[source]
    elif kind == "store":
        for key, source in zip(keys, transfer.source, strict=True):
            state.entries[key].host_locks -= 1
            state.storage[key] = state.host_kv[source]
    else:
        t = take_tick(state)
        for key, destination in zip(keys, transfer.destination, strict=True):
            state.host_kv[destination] = state.storage[key]
            # a request may have cached the page on the device meanwhile: the fetched copy is its backup
            cached = state.entries.get(key)
            if cached is None:
                state.entries[key] = TieredEntry(device=None, host=destination, last_access=t, device_since=t)
            else:
                cached.host = destination


def fail_transfer(state: TieredState, transfer_id: int) -> None:
    """The executor gave the transfer up (an error, or the cache cancelled it and the executor stopped): its
    destination pages go back to their free list, its source pins are released, no copy is made."""
    # CHECK
    transfer = check_transfer(state, transfer_id)
    # UPDATE
    del state.transfers[transfer_id]
    source, destination = ROUTES[transfer.kind]
    if source == "host":
        for key in transfer.keys:
            state.entries[key].host_locks -= 1
    if destination == "device":
        state.device_free.extend(transfer.destination)
    elif destination == "host":
        state.host_free.extend(transfer.destination)


def set_storage_online(state: TieredState, online: bool) -> None:
    """Storage goes offline or comes back (its copies stay where they are). Offline, a match reports no storage
    hit, so nothing is prefetched; completed backups start no store; a store or a prefetch in flight cannot
    complete (the executor may fail it, or hold it until storage is back)."""
    # CHECK
    if not isinstance(online, bool):
        raise InvalidTypeError(f"online must be a bool, got {type(online).__name__}")
    # UPDATE
    state.storage_online = online


def reset(state: TieredState) -> None:
    """Empty every tier: the device and host copies go back to their free lists (ascending), storage is cleared,
    and no copy
    written before serves again. Refused while a page is locked or a transfer is in flight (its pages are the
    executor's until it ends); pages the callers hold stay theirs."""
    # CHECK
    locked = sum(1 for entry in state.entries.values() if entry.ref_count)
    if locked or state.transfers:
        raise CacheBusyError(f"reset refused: {locked} pages locked, {len(state.transfers)} transfers in flight")
    # UPDATE: the pages go back in ascending order
    state.device_free += sorted(entry.device for entry in state.entries.values() if entry.device is not None)
    state.host_free += sorted(entry.host for entry in state.entries.values() if entry.host is not None)
    state.entries.clear()
    state.storage.clear()
    state.epoch += 1


# ---------------------------------------------------------------- the steps operations share


def check_count(name: str, value: object) -> int:
    """``value`` if it is an int >= 0, else InvalidTypeError or InvalidSizeError."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise InvalidSizeError(f"{name} must be >= 0, got {value}")
    return value


def check_handle(state: TieredState, handle: object) -> TieredHandle:
    if not isinstance(handle, TieredHandle):
        raise InvalidTypeError(f"expected a TieredHandle, got {type(handle).__name__}")
    if is_handle_stale(state, handle):
        raise StaleHandleError(f"a page of the handle's {handle.cached_len} tokens left the device")
    return handle


def check_transfer(state: TieredState, transfer_id: object) -> Transfer:
    if not isinstance(transfer_id, int) or isinstance(transfer_id, bool):
        raise InvalidTypeError(f"a transfer id is an int, got {type(transfer_id).__name__}")
    if transfer_id not in state.transfers:
        raise InvalidInputError(f"no transfer {transfer_id} is in flight")
    return state.transfers[transfer_id]


def make_handle(state: TieredState, namespace: Namespace, keys: Sequence[PageKey]) -> TieredHandle:
    return TieredHandle(namespace, tuple(keys), tuple(state.entries[key].device_since for key in keys))


def take_until(keys: Sequence[PageKey], moving: set[PageKey]) -> list[PageKey]:
    """``keys`` up to the first one a transfer already moves."""
    run = []
    for key in keys:
        if key in moving:
            break
        run.append(key)
    return run


def read_host_copies(state: TieredState, keys: Sequence[PageKey]) -> tuple[int, ...]:
    """The host pages of ``keys``, each locked for a transfer that reads it."""
    source = []
    for key in keys:
        entry = state.entries[key]
        assert entry.host is not None, "a transfer reads host copies"
        entry.host_locks += 1
        source.append(entry.host)
    return tuple(source)


def begin_transfer(state: TieredState, transfer: Transfer) -> int:
    transfer_id = state.next_transfer
    state.next_transfer += 1
    state.transfers[transfer_id] = transfer
    return transfer_id


def plan_eviction(
    state: TieredState,
    num_pages: int,
    is_evictable: Callable[[PageKey], bool],
    take: Callable[[PageKey], None],
) -> list[PageKey]:
    """Up to ``num_pages`` pages to evict, one at a time, each the least recently used evictable one (``take``
    notes a page taken; its parent may become evictable then). Candidates never share a stamp and a length
    (each operation stamps one path), so the order is total."""
    heap = [
        (state.entries[key].last_access, len(key[1]), order, key)
        for order, key in enumerate(state.entries)
        if is_evictable(key)
    ]
    heapq.heapify(heap)
    plan: list[PageKey] = []
    while heap and len(plan) < num_pages:
        *_, key = heapq.heappop(heap)
        plan.append(key)
        take(key)
        parent = get_parent_key(key)
        if parent is not None and is_evictable(parent):
            heapq.heappush(heap, (state.entries[parent].last_access, len(parent[1]), -len(plan), parent))
    return plan


def plan_device_eviction(state: TieredState, num_pages: int, keep: Iterable[PageKey] = ()) -> list[PageKey]:
    """The device copies evict_device would take for ``num_pages`` (none of ``keep``)."""
    if num_pages <= 0:
        return []
    pinned = get_pinned_keys(state) | set(keep)
    children, device_children = get_children(state)

    def evictable(key: PageKey) -> bool:
        return is_device_evictable(state, key, pinned, children, device_children)

    def take(key: PageKey) -> None:
        parent = get_parent_key(key)
        if parent is not None:
            # the page's device copy goes; with no host copy its entry goes too
            device_children[parent] -= 1
            children[parent] -= state.entries[key].host is None
        pinned.add(key)

    return plan_eviction(state, num_pages, evictable, take)


def apply_device_eviction(state: TieredState, plan: Sequence[PageKey]) -> list[int]:
    """Evict the device copies of ``plan``; pages with no other copy in the tree leave it."""
    freed = []
    for key in plan:
        entry = state.entries[key]
        assert entry.device is not None
        freed.append(entry.device)
        if entry.host is None:
            del state.entries[key]
            if key not in state.storage:
                state.dropped_unbacked += 1
        else:
            entry.device = None
    state.device_free.extend(freed)
    return freed


def plan_host_eviction(state: TieredState, num_pages: int, keep: set[PageKey]) -> list[PageKey]:
    """The host copies evict_host would take for ``num_pages`` (none of ``keep``)."""
    pinned = get_pinned_keys(state) | keep
    children, _ = get_children(state)

    def evictable(key: PageKey) -> bool:
        return is_host_evictable(state, key, pinned, children)

    def take(key: PageKey) -> None:
        parent = get_parent_key(key)
        if parent is not None:
            children[parent] -= 1
        pinned.add(key)

    return plan_eviction(state, num_pages, evictable, take)


def apply_host_eviction(state: TieredState, plan: Sequence[PageKey]) -> list[int]:
    freed = []
    for key in plan:
        host = state.entries.pop(key).host
        assert host is not None
        freed.append(host)
    state.host_free.extend(freed)
    return freed


def start_host_run(
    state: TieredState, kind: TransferKind, run: Sequence[PageKey], source: tuple[int, ...], keep: set[PageKey]
) -> int | None:
    """Start a transfer of ``run`` into the host tier, as much of it (from its first page) as the host tier has
    room for, evicting host copies (none of ``keep``). None when no page fits."""
    if not run:
        return None
    plan = plan_host_eviction(state, len(run) - len(state.host_free), keep | set(run))
    fits = min(len(run), len(state.host_free) + len(plan))
    if not fits:
        return None
    apply_host_eviction(state, plan[: max(0, fits - len(state.host_free))])
    destination, state.host_free = state.host_free[:fits], state.host_free[fits:]
    return begin_transfer(state, Transfer(kind, tuple(run[:fits]), source[:fits], tuple(destination)))


def start_backup_run(state: TieredState, run: Sequence[PageKey]) -> int | None:
    """Start the backup of ``run`` (device pages without a host copy), as far as the host tier has room."""
    source = []
    for key in run:
        device = state.entries[key].device
        assert device is not None, "a backup reads device copies"
        source.append(device)
    return start_host_run(state, "backup", run, tuple(source), keep=set())


def start_backups(state: TieredState, pages: Sequence[PageKey]) -> None:
    """The write policy's backups: those of ``pages`` (device pages) with no host copy and none coming. Under
    write_through an insert backs up its new pages, under write_through_selective a match the pages its hits
    brought to the threshold; write_back backs up before it evicts (``write_back``)."""
    coming = get_moving_keys(state, "backup") | get_moving_keys(state, "prefetch")
    run = [key for key in pages if state.entries[key].host is None and key not in coming]
    if run:
        start_backup_run(state, run)


def start_store(state: TieredState, keys: Sequence[PageKey]) -> None:
    """Where storage is on and online, store the pages of a completed backup that storage lacks, as many as it
    has room for; their host copies are locked until the store ends."""
    if not state.storage_online:
        return
    storing = get_moving_keys(state, "store")
    room = get_tier_usage(state)["storage"].free
    run = [key for key in keys if key not in state.storage and key not in storing][:room]
    if run:
        begin_transfer(state, Transfer("store", tuple(run), read_host_copies(state, run), ()))


# ---------------------------------------------------------------- laws


def entries_are_prefix_closed(state: TieredState) -> str | None:
    """The parent page of every page of the tree is in the tree."""
    key = find_orphan_key(state.entries.keys())
    return None if key is None else f"page ending at token {len(key[1])} is in the tree, its parent page is not"


def entries_have_a_copy(state: TieredState) -> str | None:
    """Every page of the tree has a device or a host copy."""
    for key, entry in state.entries.items():
        if entry.device is None and entry.host is None:
            return f"page ending at token {len(key[1])} is in the tree with no device or host copy"
    return None


def device_copies_are_prefix_closed(state: TieredState) -> str | None:
    """The parent of every page with a device copy has a device copy (a device hit is a prefix)."""
    for key, entry in state.entries.items():
        parent = get_parent_key(key)
        if entry.device is not None and parent is not None and state.entries[parent].device is None:
            return f"page ending at token {len(key[1])} is on the device, its parent page is not"
    return None


def locked_pages_are_on_the_device(state: TieredState) -> str | None:
    """A locked page has a device copy, and holds at least as many locks as the pages extending it."""
    below = count_child_locks((key, entry.ref_count) for key, entry in state.entries.items())
    for key, entry in state.entries.items():
        if entry.ref_count and entry.device is None:
            return f"page ending at token {len(key[1])} has {entry.ref_count} locks and no device copy"
        if entry.ref_count < below[key]:
            return f"page ending at token {len(key[1])} has {entry.ref_count} locks, its child pages {below[key]}"
    return None


def copies_hold_their_prefix(state: TieredState) -> str | None:
    """Every copy that serves (device, host, storage) holds the KV of its own page's prefix."""
    for tier, key, held in get_serving_copies(state):
        if held is None or held.key != key:
            what = "nothing" if held is None else f"the KV of the page ending at token {len(held.key[1])}"
            return f"the {tier} copy of the page ending at token {len(key[1])} holds {what}"
    return None


def reset_left_no_copy(state: TieredState) -> str | None:
    """No copy written before the last reset serves."""
    for tier, key, held in get_serving_copies(state):
        if held is not None and held.epoch != state.epoch:
            return f"the {tier} copy of the page ending at token {len(key[1])} was written before reset {state.epoch}"
    return None


def tiers_are_conserved(state: TieredState) -> str | None:
    """Every page of the device and host tiers is in exactly one place: free, serving a copy, reserved by a
    transfer, or (device) held by a caller; storage holds no more than its capacity."""
    places: dict[str, list[tuple[str, Iterable[int]]]] = {
        "device": [
            ("free", state.device_free),
            ("cached", [e.device for e in state.entries.values() if e.device is not None]),
            ("private", state.private),
        ],
        "host": [("free", state.host_free), ("cached", [e.host for e in state.entries.values() if e.host is not None])],
    }
    for transfer in state.transfers.values():
        destination = ROUTES[transfer.kind][1]
        if destination in places:
            places[destination].append((f"{transfer.kind} destination", transfer.destination))
    sizes = {"device": state.device_pages, "host": state.host_pages}
    for tier, found in places.items():
        seen: Counter[int] = Counter()
        for _, pages in found:
            seen.update(pages)
        twice = sorted(page for page, count in seen.items() if count > 1)
        expected = {page * state.page_size for page in range(sizes[tier])}
        if twice or set(seen) != expected:
            counts = ", ".join(f"{name} {len(list(pages))}" for name, pages in found)
            missing = sorted(expected - set(seen))
            return f"{tier}: {counts} of {sizes[tier]} pages; in two places {twice[:4]}, in none {missing[:4]}"
    usage = get_tier_usage(state)["storage"]
    if usage.cached + usage.in_flight > state.storage_pages:
        return f"storage: {usage.cached} stored and {usage.in_flight} being stored, capacity {state.storage_pages}"
    return None


def free_lists_hold_no_page_twice(state: TieredState) -> str | None:
    """Each free list holds aligned page starts of its tier, each once."""
    for tier, pages, size in (
        ("device", state.device_free, state.device_pages),
        ("host", state.host_free, state.host_pages),
    ):
        twice = [page for page, count in Counter(pages).items() if count > 1]
        wrong = [page for page in pages if page % state.page_size or not 0 <= page < size * state.page_size]
        if twice or wrong:
            return f"the {tier} free list holds {sorted(twice)[:4]} twice, {wrong[:4]} not page starts of it"
    return None


def transfers_hold_both_ends(state: TieredState) -> str | None:
    """Every in-flight transfer still reads serving copies of its pages (nothing freed under it) and writes
    pages nobody else uses (nothing reused under it: checked by tiers_are_conserved)."""
    for transfer_id, transfer in state.transfers.items():
        tier = ROUTES[transfer.kind][0]
        for index, key in enumerate(transfer.keys):
            entry = state.entries.get(key)
            if tier == "storage":
                held = key in state.storage
            else:
                copy = None if entry is None else (entry.device if tier == "device" else entry.host)
                held = copy is not None and copy == transfer.source[index]
            if not held:
                return (
                    f"{transfer.kind} {transfer_id} reads the {tier} copy of the page ending at token"
                    f" {len(key[1])}, which is gone"
                )
    return None


def host_locks_are_balanced(state: TieredState) -> str | None:
    """Each page's host lock count equals the in-flight transfers reading its host copy."""
    reading: Counter[PageKey] = Counter()
    for transfer in state.transfers.values():
        if ROUTES[transfer.kind][0] == "host":
            reading.update(transfer.keys)
    for key, entry in state.entries.items():
        if entry.host_locks != reading[key]:
            return (
                f"page ending at token {len(key[1])} has {entry.host_locks} host locks,"
                f" {reading[key]} transfers read its host copy"
            )
    return None


def write_back_drops_nothing(state: TieredState) -> str | None:
    """Under write-back no device page leaves without a copy in another tier."""
    if state.policy == "write_back" and state.dropped_unbacked:
        return f"{state.dropped_unbacked} device pages left with no copy in any tier under write-back"
    return None


def get_serving_copies(state: TieredState) -> list[tuple[Tier, PageKey, Written | None]]:
    """Every serving copy: its tier, its page, what it holds."""
    found: list[tuple[Tier, PageKey, Written | None]] = []
    for key, entry in state.entries.items():
        if entry.device is not None:
            found.append(("device", key, state.device_kv.get(entry.device)))
        if entry.host is not None:
            found.append(("host", key, state.host_kv.get(entry.host)))
    found += [("storage", key, held) for key, held in state.storage.items()]
    return found


TIERED_INVARIANTS: tuple[Callable[[TieredState], str | None], ...] = (
    entries_are_prefix_closed,
    entries_have_a_copy,
    device_copies_are_prefix_closed,
    locked_pages_are_on_the_device,
    copies_hold_their_prefix,
    reset_left_no_copy,
    free_lists_hold_no_page_twice,
    tiers_are_conserved,
    transfers_hold_both_ends,
    host_locks_are_balanced,
    write_back_drops_nothing,
)


def check_tiered_invariants(state: TieredState) -> None:
    """Run every law; raise IntegrityError naming the first broken one, with the numbers."""
    for law in TIERED_INVARIANTS:
        problem = law(state)
        if problem is not None:
            raise IntegrityError(f"{law.__name__}: {problem}")
