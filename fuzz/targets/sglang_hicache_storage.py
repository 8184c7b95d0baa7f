"""The storage tier (L3) of the ``sglang-hicache`` target: SGLang 0.5.23's file backend (``HiCacheFile``) behind the
host tier, attached as the scheduler attaches one at run time (``attach_storage_backend``), its prefetch and backup
run by the machine.

**The workers.** SGLang's controller runs its storage work on four threads (the hit query, the prefetch I/O, the
ack reduction, the backups). Here the threads are inert (``Inert``: ``start`` does nothing) and ``StorageLane``
runs their loop bodies, one queue item at a time, through SGLang's own per-item methods (``_storage_hit_query``,
``_sync_prefetch_hit_query``, ``_page_transfer``, ``_reduce_prefetch_ack``, ``_page_backup_or_log``): the machine's
``execute`` rule runs it as a third stream, so backups to storage stay queued while requests come and go. The
threads never read the tree, so one item at a time is a schedule they could run.

**A request's prefetch** (``arrive``, the scheduler's ``_prefetch_kvcache`` at arrival and its admission check): the
prompt is matched; if the host path's end is backed up (or the root), ``prefetch_from_storage`` is asked for the rest;
then, before admission, the workers run a few items (a number fixed by the request's id: none to all), and
``check_prefetch_progress`` decides by the drawn policy (``best_effort`` ends the prefetch where it is,
``wait_complete`` waits for the workers, ``timeout`` waits up to its deadline: the scheduler's clock is the machine's,
``Clock``, and each poll moves it by an interval the request's id picks, from a twentieth of a second to two seconds, so
a deadline passes before, during or after the workers' I/O); what came in is popped (``pop_prefetch_loaded_span``) and
the match that follows must find it on the host (``prefetch_is_served``; unless a host eviction ran after SGLang
inserted it, ``check_served``), and the prefetch's queues are drained. One request in five is aborted before its
admission (``release_aborted_request``): its prefetch's queued work runs on in later steps, its host slots coming back
at its last ack (``holding``); one in five more waits past its step, its prefetch running on while other requests come
and go, and gives up some polls later (``poll``). In half the examples the
files fail now and then (``fails``: a write refused, a read finding no file). In half the files' space is bounded (as
many pages as the host tier holds, or half that), and SGLang's own evictor removes the least recently used files past
it. A request tried again (the machine's ``readmit``) while it waits on its prefetch is admitted then, with what came
in.

**The KV shadow.** The storage is pool 2 of the shadow: each stored key has slots of its own; a backup copies the
host page's KV there (a key already stored is not written again, as the file backend skips it), a prefetch copies
it back into the host slots SGLang chose. So a load back of a prefetched page is checked against what the backup
read (``attended_kv_is_the_requests``).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import types
import weakref
import zlib
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, cast

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError, OutOfPagesError

from ..lifecycle import KVCopy, StateShadow
from ..stats import STATS
from .api import TargetError
from .shims import install, register, stub

if TYPE_CHECKING:
    from .sglang_unified import SGLangUnifiedManager

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# under ``timeout``, how far the scheduler's clock moves between two admission polls of a request (its id picks one):
# SGLang's deadline is 1 s and 0.25 s per 1,024 tokens, from the first poll that waited
POLL_INTERVALS = (0.05, 0.5, 2.0)
# each storage tier's folder: FOLDER_PREFIX, the pid of the process that made it, a random tail
FOLDER_PREFIX = "radixspec-l3-"
# the storage's slots in the KV shadow (fuzz/lifecycle.py): pool 2; the host's full KV pool 1
STORAGE_POOL, HOST_POOL = 2, 1


class Clock:
    """The scheduler's clock as SGLang's prefetch deadline reads it (``PollTimer``: ``time.perf_counter``), moved by
    the machine: a request's admission polls move it (``POLL_INTERVALS``), nothing else does."""

    now = 0.0

    @classmethod
    def read(cls) -> float:
        return cls.now


def files_base() -> str | None:
    """Where the storage tiers' folders go: memory, where there is a /dev/shm (``sweep``: once a process)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    sweep(base or tempfile.gettempdir())
    return base


@functools.cache
def sweep(root: str) -> None:
    """The folders in ``root`` of processes that are gone, removed: a campaign's workers end without running their
    finalizers (``os._exit``)."""
    for name in os.listdir(root):
        pid = name[len(FOLDER_PREFIX) :].split("-", 1)[0]
        if name.startswith(FOLDER_PREFIX) and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


class HostStates(Protocol):
    """The MAMBA component's host tier as the storage reads it (``sglang_hicache_mamba.HostStates``): the shadow of
    its host slots."""

    shadow: StateShadow


class HostPages(Protocol):
    """What the storage path reads and writes of SGLang's host pool, a page at a time."""

    def get_data_page(self, index: int, *args: object, **kwargs: object) -> object: ...

    def set_from_flat_data_page(self, index: int, data: object, *args: object, **kwargs: object) -> object: ...

    def get_size_per_token(self) -> int: ...


class Files(Protocol):
    """What the storage path calls of SGLang's file backend, a key at a time."""

    def set(self, key: str, value: object = None, *args: object, **kwargs: object) -> bool: ...

    def get(self, key: str, target: object = None, *args: object, **kwargs: object) -> object: ...

    def exists(self, key: str) -> bool: ...


class Inert:
    """``threading.Thread`` for the controller's storage workers: never started (``StorageLane`` runs their work)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


def import_storage(m: types.ModuleType) -> types.ModuleType:
    """What the storage path needs beside ``import_hicache``'s modules (once a process): one rank's parallel
    getters in the controller, its threads inert, the names the cache and the attachment read from it."""
    loaded = sys.modules.get("sglang.__radixspec_hicache_storage__")
    if loaded is not None:
        return loaded

    stub(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool", DeepSeekV4TokenToKVPool=type("DeepSeekV4TokenToKVPool", (), {})
    )
    controller = importlib.import_module("sglang.srt.managers.cache_controller")
    # a prefetch whose trailing state or SWA pages are not all in storage is discarded with a warning for each (the
    # summary counts it among the prefetches that loaded nothing)
    logging.getLogger(m.v.urc.__name__).setLevel(logging.ERROR)
    # and each file that fails (``StorageLane.fails``) with one, as the file backend does for a file it finds
    # missing (a state's file never written: its prefetch is discarded): counted too
    logging.getLogger(controller.__name__).setLevel(logging.ERROR)
    logging.getLogger("sglang.srt.mem_cache.hicache_storage").setLevel(logging.ERROR)
    parallel = types.SimpleNamespace(
        attn_dcp_rank=0,
        attn_dcp_size=1,
        launch_world_size=1,
        nnodes=1,
        pp_group=None,
        dcp_enabled=False,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
    )
    install(controller, get_parallel=lambda: parallel)
    install(importlib.import_module("sglang.srt.utils.poll_timer"), time=types.SimpleNamespace(perf_counter=Clock.read))
    install(controller, threading=types.SimpleNamespace(Thread=Inert, Event=threading.Event, Lock=threading.Lock))
    attachment = sys.modules["sglang.srt.mem_cache.unified_cache.storage_attachment"]
    install(attachment, HybridCacheController=m.controller.HybridCacheController)
    install(
        m.v.urc,
        PPPrefetchDecision=m.controller.PPPrefetchDecision,
        PrefetchOperation=m.controller.PrefetchOperation,
        CacheOperation=controller.CacheOperation,
    )
    return register("sglang.__radixspec_hicache_storage__", controller=controller)


class PrefetchOperation(Protocol):
    """What ``PrefetchInsertions`` reads of SGLang's prefetch operation."""

    # the prefetch's handle (the request's)
    handle: object


class PrefetchInserts(Protocol):
    """The two methods of SGLang's tree ``PrefetchInsertions`` wraps."""

    evict_host: Callable[..., object]
    _handle_prefetch_result: Callable[[PrefetchOperation], object]


class PrefetchInsertions:
    """The prefetches SGLang inserted into the tree before their request's admission, for ``prefetch_is_served``. A
    request waiting past its step has its prefetch's result inserted at the ack's drain (``check_hicache_events`` ->
    ``_handle_prefetch_result``), which releases the anchor's host lock and pins nothing it inserted: a host eviction
    before the admission may take it. SGLang still reports the span loaded and accounts the gap at admission
    (``fulfilled_storage_hit_len``; reason ``cache_admission_shortfall``: "an L3-loaded L2 span was no longer
    reusable when cache-mode admission ran"; sglang PR #37503)."""

    def __init__(self, cache: PrefetchInserts, waiting: Mapping[object, int], served: Callable[[object], int]) -> None:
        # the requests waiting past their step, and what a match of a key finds on the device and the host now
        self.waiting, self.served = waiting, served
        # host evictions that freed something, so far
        self.host_evictions = 0
        # a waiting request's prefetch inserted: the host evictions then, and what a match served just after
        self.inserted: dict[object, tuple[int, int]] = {}
        # each prefetch's request key, by handle
        self.keys: dict[object, object] = {}
        self.follow(cache)

    def follow(self, cache: PrefetchInserts) -> None:
        """Counts the host evictions (``evict_host``: the machine's and SGLang's own, a backup's or a prefetch's host
        allocation short of room) and notes each waiting request's prefetch inserted into the tree."""
        evict_host, handle_result = cache.evict_host, cache._handle_prefetch_result

        def counted_evict_host(*args: object, **kwargs: object) -> object:
            freed = evict_host(*args, **kwargs)
            if freed:
                self.host_evictions += 1
            return freed

        def noted_handle_result(operation: PrefetchOperation) -> object:
            done = handle_result(operation)
            if operation.handle in self.waiting:
                self.inserted[operation.handle] = (self.host_evictions, self.served(self.keys[operation.handle]))
            return done

        cache.evict_host = counted_evict_host
        cache._handle_prefetch_result = noted_handle_result

    def is_evicted_since_served(self, handle: object, end: int) -> bool:
        """True when the request waited past its step, its prefetch was inserted meanwhile and a match just after
        served up to ``end``, and a host eviction has freed pages since."""
        if handle not in self.inserted:
            return False
        evictions, served = self.inserted[handle]
        return (
            # the span was servable once inserted
            served >= end
            # and the host tier was evicted after that
            and self.host_evictions > evictions
        )

    def forget(self, handle: object) -> None:
        self.inserted.pop(handle, None)
        self.keys.pop(handle, None)


class StorageLane:
    """SGLang's storage tier for one cache: the file backend in a folder of its own (removed with it), the workers
    run as a stream (``step``), the copies reported to the KV shadow."""

    def __init__(
        self,
        policy: str,
        copies: list[KVCopy],
        m: SGLangUnifiedManager,
        hicache: types.ModuleType,
        pools: Sequence[tuple[object, int | HostStates]],
        faults: bool = False,
        capacity: int | None = None,
    ) -> None:
        """Attached to ``m``'s cache as the scheduler attaches a backend at run time (``attach_storage_backend``);
        ``pools``: the host pools whose pages it writes to files (``follow``); ``faults``: one file operation in
        four fails (``fails``); ``capacity``: the files' space, in pages of the full KV (None: unbounded), past
        which SGLang's own evictor (``LRUFileEvictor``, ``max_size``) removes the least recently used files."""
        self.policy, self.faults = policy, faults
        # file operations so far: what a fault is drawn from
        self.operations = 0
        # the host tier's list of copies: storage copies take their place among the host tier's, in order
        self.copies = copies
        # storage keys and the slot each has in the shadow's pool 2 (pages of P slots)
        self.keys: dict[str, int] = {}
        # with MAMBA, the state each state file holds (None: written from a slot of no known state)
        self.state_files: dict[str, tuple[Namespace, tuple[int, ...]] | None] = {}
        # requests waiting on their prefetch past the step they arrived in, with the polls left before they give up
        self.waiting: dict[object, int] = {}
        # requests whose prefetch was asked for, and those of them aborted (at arrival, or given up while waiting)
        self.arrived: set[object] = set()
        self.aborted: set[object] = set()
        self.cache, self.page_size = m.cache, m.page_size
        self.params = m.v.base.MatchPrefixParams
        self.acks = import_storage(hicache).controller.PrefetchAck
        self.insertions = PrefetchInsertions(m.cache, self.waiting, self.served)
        folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=files_base())
        weakref.finalize(self, shutil.rmtree, folder, True)
        config: dict[str, object] = {
            "prefetch_threshold": m.page_size,
            "file_storage_path": folder,
            "enable_metadata_cache": False,
        }
        if capacity is not None:
            config["max_size"] = capacity * m.page_size * cast(HostPages, pools[0][0]).get_size_per_token()
        ok, message = m.cache.attach_storage_backend(
            "file", json.dumps(config), served_model_name="radixspec", hicache_storage_prefetch_policy=policy
        )
        if not ok:
            raise TargetError(f"sglang-hicache: SGLang's file storage backend did not attach: {message}")
        controller = m.cache.cache_controller
        self.follow(controller.storage_backend, pools)
        if capacity is not None:
            # a file the evictor removes is read no more (``get`` finds none) and written anew; counted
            evictor = controller.storage_backend._evictor
            evictor._on_evict = lambda key: STATS.record_rule("sglang-hicache.storage[file evicted]")

    # ------------------------------------------------------------ the copies

    def slot(self, key: str) -> int:
        return self.keys.setdefault(key, len(self.keys)) * self.page_size

    def follow(self, backend: Files, pools: Sequence[tuple[object, int | HostStates]]) -> None:
        """The copies between the host pools and the files, at the lowest level SGLang's code reaches: a page read
        from a host pool (``get_data_page``) and written to a file (the backend's ``set``, a key already stored
        skipped as the backend skips it); a file read (``get``) and written into a host slot
        (``set_from_flat_data_page``). Each page's data object names where it came from. ``pools``: each host pool
        with its pool in the KV shadow (the full KV's, SWA's), or the MAMBA component's ``HostStates``: a state's
        file holds the state its host slot held when it was written (``state_files``), and a file read into a host
        slot gives it that state (or none, if its writing was not seen)."""
        # id(data) -> (data, the pool read, a host slot or a file's key)
        origins: dict[int, tuple[object, int | HostStates | None, int | str]] = {}
        put, get, exists = backend.set, backend.get, backend.exists
        p = self.page_size

        def reader(read_page: Callable[..., object], pool: int | HostStates) -> Callable[..., object]:
            def get_data_page(index: int, *args: object, **kwargs: object) -> object:
                data = read_page(index, *args, **kwargs)
                origins[id(data)] = (data, pool, int(index))
                return data

            return get_data_page

        def set_page(key: str, value: object = None, *args: object, **kwargs: object) -> bool:
            stored = exists(key)
            _, pool, origin = origins.pop(id(value), (None, None, -p))
            if not stored and self.fails("set", key):
                return False
            done = bool(put(key, value, *args, **kwargs))
            if not done or stored:
                return done
            if pool is None or isinstance(pool, int):
                self.copies.append(KVCopy(STORAGE_POOL, int(origin), self.slot(key), p, pool or HOST_POOL))
                STATS.record_rule("sglang-hicache.storage[page backed up]")
                STATS.record_reach(largest_storage_pages=len(self.keys))
            else:
                self.state_files[key] = pool.shadow.get(int(origin))
                STATS.record_rule("sglang-hicache.storage[state backed up]")
            return done

        def get_page(key: str, target: object = None, *args: object, **kwargs: object) -> object:
            if self.fails("get", key):
                return None
            data = get(key, target, *args, **kwargs)
            if data is not None:
                origins[id(data)] = (data, None, key)
            return data

        def writer(write_page: Callable[..., object], pool: int | HostStates) -> Callable[..., object]:
            def set_from_flat_data_page(index: int, data: object, *args: object, **kwargs: object) -> object:
                key = origins.pop(id(data), (None, None, None))[2]
                if isinstance(pool, int):
                    # a page whose file the shadow never saw written holds nothing known
                    source = self.keys[key] * p if isinstance(key, str) and key in self.keys else -p
                    self.copies.append(KVCopy(pool, source, int(index), p, STORAGE_POOL))
                    STATS.record_rule("sglang-hicache.storage[page prefetched]")
                else:
                    held = self.state_files.get(key) if isinstance(key, str) else None
                    if held is None:
                        pool.shadow.clear(int(index))
                    else:
                        pool.shadow.write(int(index), *held)
                    STATS.record_rule("sglang-hicache.storage[state prefetched]")
                return write_page(index, data, *args, **kwargs)

            return set_from_flat_data_page

        followed: list[tuple[object, str, Callable[..., object]]] = [
            (backend, "set", set_page),
            (backend, "get", get_page),
        ]
        for host, pool in pools:
            pages = cast(HostPages, host)
            followed.append((host, "get_data_page", reader(pages.get_data_page, pool)))
            followed.append((host, "set_from_flat_data_page", writer(pages.set_from_flat_data_page, pool)))
        for owner, name, wrapper in followed:
            setattr(owner, name, wrapper)

    def fails(self, operation: str, key: str) -> bool:
        """Whether this file operation fails (with ``faults``, one in four, drawn from the key and the operations so
        far: a program replays its faults): a write the backend refuses (``set`` False, as on a full disk), a read
        that finds no file (``get`` None, as after another process removed it)."""
        self.operations += 1
        if not self.faults or zlib.crc32(f"{key}:{self.operations}".encode()) % 4:
            return False
        STATS.record_rule(f"sglang-hicache.storage[{operation} failed]")
        return True

    # ------------------------------------------------------------ the workers

    def work(self) -> bool:
        """One item of one worker, the first with work in the threads' order (query, I/O, acks, backups): each
        thread's loop body, SGLang's own per-item methods."""
        c = self.cache.cache_controller
        for queue in (c.prefetch_queue, c.prefetch_buffer, c.prefetch_sync_queue, c.backup_queue):
            if queue.empty():
                continue
            item = queue.get_nowait()
            if item is None:
                # a stop mark, which SGLang queues when it stops its threads
                return True
            if queue is c.prefetch_queue:
                # the hit query: the storage's hit, reduced across ranks, for the scheduler to allocate
                keys, hit = ([], 0) if item.is_terminated() else c._storage_hit_query(item)
                hit = c._sync_prefetch_hit_query(item, hit)
                item.hash_value, item.storage_hit_count = keys[: hit // c.page_size], hit
                c.prefetch_hit_queue.put(item)
            elif queue is c.prefetch_buffer:
                # the I/O: the pages read into their host slots, then the request's last ack
                try:
                    c._page_transfer(item)
                finally:
                    c.prefetch_sync_queue.put(self.acks(rid=item.request_id, completed_req=True, operation=item))
            elif queue is c.prefetch_sync_queue:
                # the ack reduction, for the scheduler's poll
                c._reduce_prefetch_ack(item)
                c.ack_prefetch_queue.put(item)
            else:
                # the backup: the pages written to the files, then its ack
                c._page_backup_or_log(item)
                c.ack_backup_queue.put(item)
            return True
        return False

    @property
    def pending(self) -> int:
        c = self.cache.cache_controller
        queues = (c.prefetch_queue, c.prefetch_buffer, c.prefetch_sync_queue, c.backup_queue)
        return sum(queue.qsize() for queue in queues)

    def step(self, count: int) -> int:
        ran = 0
        while ran < count and self.work():
            ran += 1
        return ran

    def synchronize(self) -> None:
        while self.work():
            pass

    # ------------------------------------------------------------ the scheduler's part

    def arrive(self, m: SGLangUnifiedManager, req: HybridReq) -> None:
        """The scheduler's prefetch at a request's arrival, then its admission check: the prompt's rest past the host
        path asked of the storage; the workers run a few items (the request's id picks how many) before the policy
        decides; what came in is popped (the match that follows finds it on the host). The prefetch's queues are
        then drained: no prefetch spans two admissions. A request tried again (the machine's ``readmit``) that
        waits on its prefetch is admitted with what came in by then; one whose prefetch is over is matched as it
        is; one aborted stays out."""
        base = m.v.base
        salt = m.salt(req.namespace)
        tokens = array("q", req.input_ids[:-1])
        key = m.v.radix.RadixKey(tokens, None, cache_salt=salt)
        handle = base.CacheRequestHandle(str(req.uid), 0)
        if handle in self.aborted:
            raise OutOfPagesError(f"request {req.uid} was aborted")
        if handle in self.waiting:
            # its waiting ends: admitted now, steps after its arrival
            del self.waiting[handle]
            STATS.record_rule("sglang-hicache.storage[admitted steps after its arrival]")
        elif handle in self.arrived:
            return  # its prefetch ended at an earlier try (a refusal after it): matched as the tree is now
        elif not self.prefetch(m, req, handle, key, tokens):
            return
        operation = self.cache.ongoing_prefetch[handle].operation if handle in self.cache.ongoing_prefetch else None
        for _ in range(64):
            if self.cache.check_prefetch_progress(handle):
                break
            self.step(1)
            self.cache.check_hicache_events()
            Clock.now += POLL_INTERVALS[req.uid % len(POLL_INTERVALS)]
        else:
            raise IntegrityError(f"prefetch_finishes: request {req.uid}'s prefetch did not finish ({self.policy})")
        late = ", past its deadline" if operation is not None and operation.deadline_expired else ""
        loaded, start = self.cache.pop_prefetch_loaded_span(handle)
        STATS.record_rule(f"sglang-hicache.storage[{self.policy}{late}: {'loaded' if loaded else 'nothing'}]")
        if loaded:
            self.check_served(m, req, handle, key, int(start or 0) + loaded)
        self.insertions.forget(handle)
        # the rest of the prefetch's work (a terminated one's I/O tail freed at its last ack)
        while self.step(1) or not self.cache.cache_controller.ack_prefetch_queue.empty():
            self.cache.check_hicache_events()
        if handle in self.cache.ongoing_prefetch:
            raise IntegrityError(f"prefetch_finishes: request {req.uid}'s prefetch is left after its admission")

    def prefetch(self, m: SGLangUnifiedManager, req: HybridReq, handle: object, key: object, tokens: array) -> bool:
        """A request's prefetch at its arrival (``arrive``): started, and the workers' first items run; whether it is
        to be admitted now (the request aborted, or left waiting past this step, raises OutOfPagesError)."""
        found = self.cache.match_prefix(m.v.base.MatchPrefixParams(key=key, req=None))
        matched = int(found.device_prefix_len) + int(found.host_hit_length)
        anchor = found.last_host_node
        if matched >= len(tokens) or not (self.cache.is_backuped(anchor) or self.cache.is_root(anchor)):
            return False
        self.arrived.add(handle)
        self.insertions.keys[handle] = key
        self.cache.prefetch_from_storage(
            handle,
            anchor,
            tokens[matched:],
            self.cache.get_last_hash_value(anchor),
            None,
            matched_prefix_tokens=tokens[:matched],
            extra_key=None,
            cache_salt=m.salt(req.namespace),
        )
        if handle not in self.cache.ongoing_prefetch:
            STATS.record_rule("sglang-hicache.storage[no prefetch]")
            return False
        # the workers' progress before admission: the query, the I/O and the ack take a poll between them
        for _ in range(req.uid % 4):
            self.step(1)
            self.cache.check_hicache_events()
        if req.uid % 5 == 4:
            # the request leaves the queue before admission (aborted: the scheduler's release of a waiting request);
            # what its prefetch queued runs on, and its host slots come back at its last ack
            STATS.record_rule("sglang-hicache.storage[aborted while prefetching]")
            self.aborted.add(handle)
            self.cache.release_aborted_request(handle)
            raise OutOfPagesError(f"request {req.uid} aborted while its prefetch ran")
        if req.uid % 5 == 3:
            # the request stays queued, its prefetch running on (and its anchor host-locked) while other requests
            # come and go; a later poll gives up on it (``poll``), unless it is tried again before (``arrive``)
            STATS.record_rule("sglang-hicache.storage[waiting past this step]")
            self.waiting[handle] = 1 + req.uid % 7
            raise OutOfPagesError(f"request {req.uid} waits for its prefetch")
        return True

    def check_served(self, m: SGLangUnifiedManager, req: HybridReq, handle: object, key: object, end: int) -> None:
        """What the prefetch reports loaded (up to ``end``) is on the host now: the request's match finds its full
        KV there, and serves it. Unless a host eviction took it before the admission (``is_evicted_since_served``;
        counted). Under SWA a mid-tree span shorter than the window is fetched without its SWA KV
        (``SWAComponent.prepare_prefetch``: "the window head would have to come from the device prefix"): its full
        KV is held, but no match can end in it. SGLang still reports it loaded (the request's
        ``storage_hit_length``); counted."""
        found = self.cache.match_prefix(m.v.base.MatchPrefixParams(key=key, req=None))
        served = int(found.device_prefix_len) + int(found.host_hit_length)
        held = int(found.full_kv_hit_length)
        if served >= end:
            return
        if self.insertions.is_evicted_since_served(handle, end):
            STATS.record_rule("sglang-hicache.storage[loaded, evicted from the host before its admission]")
            return
        if m.swa is None or held < end:
            raise IntegrityError(
                f"prefetch_is_served: request {req.uid}'s prefetch loaded up to {end} tokens, but its match then finds"
                f" {served} tokens on the device and the host ({held} of full KV)"
            )
        STATS.record_rule("sglang-hicache.storage[loaded, not servable: a span shorter than the SWA window]")

    def served(self, key: object) -> int:
        """The tokens a match of ``key`` finds on the device and the host now."""
        found = self.cache.match_prefix(self.params(key=key, req=None))
        return int(found.device_prefix_len) + int(found.host_hit_length)

    def poll(self) -> None:
        """A scheduler poll for the requests waiting on their prefetch: each gives up (is aborted) after the polls
        it was given, its prefetch wherever the workers left it."""
        for handle in list(self.waiting):
            self.waiting[handle] -= 1
            if self.waiting[handle] <= 0:
                self.give_up(handle)

    def give_up(self, handle: object) -> None:
        del self.waiting[handle]
        self.insertions.forget(handle)
        self.aborted.add(handle)
        STATS.record_rule("sglang-hicache.storage[waited, then aborted]")
        self.cache.release_aborted_request(handle)

    def abort_waiting(self) -> None:
        """Every waiting request aborted (before a flush or a drain: SGLang flushes only with nothing waiting)."""
        for handle in list(self.waiting):
            self.give_up(handle)

    def holding(self) -> int:
        """Host slots the prefetches hold (a part of the host pool's partition): an ongoing prefetch's whole
        allocation; an ended one's tail past what it completed, until its last ack is drained (SGLang frees it
        there)."""
        ongoing = {id(info.operation): info for info in self.cache.ongoing_prefetch.values()}
        held = sum(len(info.host_indices) for info in ongoing.values() if info.host_indices is not None)
        c = self.cache.cache_controller
        ended = {id(op): op for op in list(c.prefetch_buffer.queue) if op is not None and op.host_indices is not None}
        for queue in (c.prefetch_sync_queue, c.ack_prefetch_queue):
            ended |= {
                id(ack.operation): ack.operation for ack in list(queue.queue) if ack is not None and ack.completed_req
            }
        for key, op in ended.items():
            # the Python transfer worker (``work``) leaves the tail to the ack's drain
            if key not in ongoing and op.host_indices is not None:
                held += len(op.host_indices) - int(op.completed_tokens)
        return held

    def check_idle(self) -> None:
        """At a drain: nothing of the storage's left in flight."""
        left = self.pending + len(self.cache.ongoing_backup) + len(self.cache.ongoing_prefetch) + len(self.waiting)
        if left or self.cache.cache_controller.prefetch_tokens_occupied:
            raise IntegrityError(
                f"idle_tiers_drain: the storage tier has {left} operations in flight and"
                f" {self.cache.cache_controller.prefetch_tokens_occupied} prefetch tokens held after a drain"
            )
