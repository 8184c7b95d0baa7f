"""Target ``vllm-simple-offload``: vLLM 0.33.0's ``SimpleCPUOffloadConnector`` as its engine runs it. The device tier
is vLLM's ``KVCacheManager`` of a full-attention group (a sliding-window group beside it in half the examples); the
host tier is the connector's scheduler side,
``SimpleCPUOffloadScheduler``, which keeps its CPU blocks in a second ``BlockPool`` of vLLM's (its own coordinator,
LRU, hashes and events) and pins the GPU blocks it copies with the GPU pool's own reference counts. Both are imported
and driven together under the planner machine (``fuzz/planner_machine.py``), vLLM's scheduler replayed as for
``vllm-offload-connector`` (``ConnectorEngine``: the waiting and running queues, preemption, chunked prefill, loads
that wait in ``WAITING_FOR_REMOTE_KVS``, ``request_finished_all_groups`` with the blocks of the computed tokens,
``reset_prefix_cache(reset_connector=True)``).

Its two modes are drawn: eager (each request's blocks stored once computed, and at its finish the blocks not yet
stored) and lazy (the GPU free queue's next blocks stored before the allocator would evict them). With a window
group the connector's CPU pool has the same two groups under vLLM's hybrid coordinator, and its eager stores skip
the blocks that left the window.

The machine plays the worker as ``SimpleCPUOffloadWorker`` does: a step's load event is launched before its forward
(``start_load_kv``) and its store event after it (``wait_for_save``: the planner layer's next plan, or this one when
the step runs no forward); when the metadata says ``need_flush`` (a preemption), every transfer launched before is
copied first (``handle_preemptions``). Each stream completes in order: the worker reports a load or store event once
it and every event launched before it on its stream are done (``_poll_stream_events``'s high-water mark), a load as
its requests in ``finished_recving`` (the metadata's ``load_event_to_reqs``), a store in its worker metadata; with two
workers the second reports a step later. The KV the planner machine keeps per slot checks both tiers.

Laws of this target besides the planner machine's: each pool's free queue is exactly its unreferenced blocks
(``device_free_queue_is_the_unreferenced`` and ``host_free_queue_is_the_unreferenced``); every reference the connector
holds on a CPU block is one it accounts for (``host_pins_are_accounted``: a pending hit, a load, a store), and so on
the GPU (``device_pins_are_accounted``: the requests' block tables and the connector's loads and stores); the host
tier's events, replayed as a consumer does, name exactly the hashes its blocks hold
(``host_events_replay_to_the_tier``); nothing is held once idle (``offload_quiescent_holds_nothing``).

What is shimmed is ``vllm-offload-connector``'s (``import_connector``), and the engine's ``VllmConfig`` is a namespace
of the fields the connector's scheduler reads (KV events on, one rank, no speculative decoding, the model length and
the token budget); the CPU pool is sized by its byte capacity as the connector sizes it (the GPU's blocks scaled by
the capacity over the size of the GPU's ``KVCacheTensor``, a single layer's).
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol, cast

from radixspec.spec.errors import IntegrityError

from ..stats import STATS
from .api import BlockEvent, Profile, TargetInfo, Transfer, choose_from, draw_choosing
from .shims import register
from .vllm import SIMPLE_OFFLOAD_MODULES, VERSION
from .vllm_offload_connector import (
    MAX_MODEL_LEN,
    REQUIRES,
    WINDOWS,
    ConnectorEngine,
    Request,
    VllmScheduler,
    import_connector,
)

PAGE_SIZES = (1, 2, 4, 8, 16)
DEVICE_BLOCKS = (8, 12, 16, 24, 48)
HOST_RATIOS = (0.5, 1, 2, 4)
BUDGETS = (8, 16, 32, 128)
WORKERS = (1, 2)


class Config(NamedTuple):
    """One configuration of the engine: a draw picks one value of each field from CHOICES."""

    page_size: int
    device_blocks: int
    host_ratio: float
    lazy: bool
    budget: int
    # workers reporting each event (tensor parallel): with 2 the second reports a step after the first
    workers: int = 1
    # a sliding-window group beside the full-attention one (its window in tokens): the CPU pool's coordinator is
    # then vLLM's hybrid one too
    window: int | None = None


CHOICES: tuple[tuple[object, ...], ...] = (
    PAGE_SIZES,
    DEVICE_BLOCKS,
    HOST_RATIOS,
    (False, True),
    BUDGETS,
    WORKERS,
    WINDOWS,
)


def choose(draw: int) -> Config:
    return Config._make(choose_from(CHOICES, draw))


def draw_for(config: Config) -> int:
    """A draw that picks ``config``: tests name a configuration so."""
    return draw_choosing(CHOICES, config)


def import_simple() -> types.ModuleType:
    """vLLM's ``SimpleCPUOffloadScheduler`` and its metadata, over ``import_connector``'s modules."""
    cached = sys.modules.get("vllm.__radixspec_simple__")
    if cached is not None:
        return cached
    import_connector()
    manager = importlib.import_module("vllm.v1.simple_kv_offload.manager")
    # it warns when a store finds the CPU pool full, thousands of lines a minute under the fuzzer
    logging.getLogger(manager.__name__).setLevel(logging.ERROR)
    return register(
        "vllm.__radixspec_simple__",
        manager=manager,
        metadata=importlib.import_module("vllm.v1.simple_kv_offload.metadata"),
    )


class SimpleMeta(Protocol):
    """A ``SimpleCPUOffloadMetadata``."""

    load_event: int
    load_gpu_blocks: list[int]
    load_cpu_blocks: list[int]
    load_event_to_reqs: dict[int, list[str]]
    store_event: int
    store_gpu_blocks: list[int]
    store_cpu_blocks: list[int]
    need_flush: bool


class SimpleWorker:
    """The connector's events as ``SimpleCPUOffloadWorker`` launches and reports them, as the planner layer's
    transfers: one stream of loads and one of stores, each reported in order."""

    def __init__(self) -> None:
        # the last step's store event, launched after its forward: submitted with the next plan
        self.deferred: list[Transfer] = []
        # per stream, the events launched and not yet reported, in order; and those the machine reported done
        self.launched: dict[str, list[int]] = {"load": [], "store": []}
        self.finished: set[tuple[str, int]] = set()
        # the last metadata's map of load events to their requests (the worker reads it when it reports)
        self.load_reqs: dict[int, list[str]] = {}

    def submit(self, meta: SimpleMeta, forward: bool) -> tuple[tuple[Transfer, ...], tuple[Hashable, ...]]:
        """The plan's transfers: the last step's store event, this step's load event, this step's store event when
        no forward runs (else the next plan's). With ``need_flush``, every event launched before this step's load
        first (``handle_preemptions``)."""
        submitted, self.deferred = self.deferred, []
        flush: tuple[Hashable, ...] = ()
        if meta.need_flush:
            flush = tuple(("load", e) for e in self.launched["load"]) + tuple(
                ("store", e) for e in self.launched["store"]
            )
        self.load_reqs = {event: list(reqs) for event, reqs in meta.load_event_to_reqs.items()}
        if meta.load_event >= 0:
            self.launched["load"].append(meta.load_event)
            pairs = tuple(zip(map(int, meta.load_cpu_blocks), map(int, meta.load_gpu_blocks), strict=True))
            submitted.append(Transfer(("load", meta.load_event), "load", pairs, awaited=False))
        if meta.store_event >= 0:
            self.launched["store"].append(meta.store_event)
            pairs = tuple(zip(map(int, meta.store_gpu_blocks), map(int, meta.store_cpu_blocks), strict=True))
            store = Transfer(("store", meta.store_event), "backup", pairs)
            (self.deferred if forward else submitted).append(store)
        return tuple(submitted), flush

    def done(self, op: Hashable) -> tuple[dict[int, int], set[str]]:
        """The machine copied ``op``'s event: the store events and the loads' requests the worker reports now (each
        stream's events up to the first one not done)."""
        self.finished.add(cast(tuple[str, int], op))
        stores: dict[int, int] = {}
        recving: set[str] = set()
        for stream, events in self.launched.items():
            while events and (stream, events[0]) in self.finished:
                event = events.pop(0)
                self.finished.discard((stream, event))
                if stream == "store":
                    stores[event] = 1
                else:
                    recving.update(self.load_reqs.get(event, ()))
        return stores, recving

    def in_flight(self) -> int:
        return sum(map(len, self.launched.values()))


class VllmSimpleOffloadEngine(ConnectorEngine):
    """vLLM's KV cache manager and ``SimpleCPUOffloadScheduler`` under a replay of vLLM's scheduler, behind the planner
    layer's protocol."""

    def __init__(self, draw: int) -> None:
        v = import_connector()
        s = import_simple()
        self.worker_meta = s.metadata.SimpleCPUOffloadWorkerMetadata
        config = self.choice = choose(draw)
        p = config.page_size
        page_bytes = 2 * p * 4  # K and V of one head of size 1, float32
        blocks = config.device_blocks + 1
        # the window group's layer shares the tensor (a block belongs to one group at a time), as vLLM's hybrid
        # allocator lays them out
        layers = ["layer.0"] if config.window is None else ["layer.0", "layer.1"]
        tensor = v.interface.KVCacheTensor(
            size=blocks * page_bytes, layers=layers, layer_stride=blocks * page_bytes, block_stride=page_bytes
        )
        # prefix caching on: the connector turns itself off without it
        super().__init__(v, p, config.device_blocks, True, config.workers, tensors=[tensor], window=config.window)
        self.host_blocks = max(2, int(config.device_blocks * config.host_ratio)) + 1  # block 0 is the null block
        self.config = (
            f"P={p}, device {config.device_blocks}, host {self.host_blocks - 1} blocks,"
            f" {'lazy' if config.lazy else 'eager'}, budget {config.budget}"
            f"{f', {config.workers} workers' if config.workers > 1 else ''}"
            f"{f', window {config.window}' if config.window else ''}"
        )
        engine = types.SimpleNamespace(
            kv_events_config=types.SimpleNamespace(enable_kv_cache_events=True),
            parallel_config=types.SimpleNamespace(world_size=config.workers, decode_context_parallel_size=1),
            speculative_config=None,
            model_config=types.SimpleNamespace(max_model_len=MAX_MODEL_LEN),
            max_in_flight_tokens=MAX_MODEL_LEN,
            num_prefill_lookahead_tokens=0,
            scheduler_config=types.SimpleNamespace(max_num_batched_tokens=config.budget),
        )
        self.manager = s.manager.SimpleCPUOffloadScheduler(
            engine,
            self.kv_config,
            # its CPU blocks: the GPU's blocks scaled by the capacity over the GPU tensor's size
            cpu_capacity_bytes=self.host_blocks * page_bytes,
            scheduler_block_size=p,
            hash_block_size=p,
            lazy_offload=config.lazy,
        )
        assert self.manager.num_cpu_blocks == self.host_blocks
        self.connector = self.manager
        self.manager.bind_gpu_block_pool(self.kvm.block_pool)
        # finding 24 (docs/findings.md): a reset the device refuses and the connector takes publishes the CPU pool's
        # AllBlocksCleared, which names no tier, so a consumer drops the device's blocks too; counted (tests turn it
        # off to see the device's event law fail)
        self.known_clear_names_no_tier = True
        # whether the last reset's device refused it (until its events are taken)
        self.device_refused = False
        self.cpu_pool = self.manager.cpu_block_pool
        self.scheduler = VllmScheduler(v, self.kvm, self.manager, config.budget)
        self.worker = SimpleWorker()

    def connector_finished(self, request: Request) -> bool:
        """``_connector_finished`` for a connector of the hybrid allocator's interface: the blocks of the computed
        tokens, by group."""
        ids = self.kvm.get_block_ids_for_computed_tokens(request.request_id, request.num_computed_tokens)
        return bool(self.manager.request_finished_all_groups(request, ids)[0])

    def reset(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: the device's cache, then the connector's, which abandons its
        transfers in flight and keeps its CPU blocks while any runs (it returns False)."""
        cleared: bool = self.kvm.reset_prefix_cache()
        self.host_cleared = bool(self.manager.reset())
        self.device_refused = not cleared
        return cleared

    # ------------------------------------------------------------ the worker

    def submit_jobs(self, meta: object, forward: bool) -> tuple[tuple[Transfer, ...], tuple[Hashable, ...]]:
        return self.worker.submit(cast(SimpleMeta, meta), forward)

    def done(self, transfer: Transfer, ok: Sequence[bool]) -> None:
        """The worker reports the events done in order; with two workers the first now, the other a step later (a
        store completes at its last report; a load's requests are in ``finished_recving`` once all reported)."""
        stores, recving = self.worker.done(transfer.op)
        if not stores and not recving:
            return
        worker = self.worker_meta
        if self.workers > 1:
            self._report(worker(completed_store_events=dict(stores)) if stores else None, set())
            late = {event: self.workers - 1 for event in stores}
            self.late.append((worker(completed_store_events=late) if late else None, recving))
        else:
            self._report(worker(completed_store_events=stores) if stores else None, recving)

    # ------------------------------------------------------------ what it shows

    def replay_host(self, events: Iterable[object]) -> list[BlockEvent]:
        """The connector's events as a consumer replays them; after a reset the device refused, the CPU pool's
        cleared event (finding 24) counted and, where the profile names it, kept from the device's replay."""
        said = super().replay_host(events)
        refused, self.device_refused = self.device_refused, False
        if said and refused and self.known_clear_names_no_tier:
            STATS.rules["planner.known: a host reset the device refused clears every tier's blocks (finding 24)"] += 1
            return []
        return said

    def host_held(self) -> Counter[object]:
        """The hashes the CPU blocks hold (their own and those they took of their GPU block), as events name them."""
        utils = self.v.utils
        held: Counter[object] = Counter()
        for block in self.cpu_pool.blocks[1:]:
            hashes = [block.block_hash] if block.block_hash is not None else []
            hashes += self.cpu_pool.cached_block_hashes_by_block.get(block.block_id, ())
            held.update(utils.maybe_convert_block_hash(utils.get_block_hash(h)) for h in hashes)
        return held

    def host_pins(self) -> tuple[Counter[int], Counter[int]]:
        """The references the connector accounts for, on CPU blocks and on GPU blocks: pending hits (CPU), loads
        (both), store transfers in flight, abandoned or queued at a finish (both)."""
        c = self.manager
        cpu: Counter[int] = Counter()
        gpu: Counter[int] = Counter()
        for hit_blocks, _, _ in c._pending_cpu_hits.values():
            cpu.update(block.block_id for group in hit_blocks for block in group if not block.is_null)
        for load in (*c._reqs_to_load.values(), *c._abandoned_reqs_to_load.values()):
            cpu.update(load.transfer_meta.cpu_block_ids)
            gpu.update(load.transfer_meta.gpu_block_ids)
        for store in (
            *c._store_event_to_blocks.values(),
            *c._abandoned_store_event_to_blocks.values(),
            *c._pending_finished_stores,
        ):
            cpu.update(store.cpu_block_ids)
            gpu.update(store.gpu_block_ids)
        return cpu, gpu

    def check_integrity(self, quiescent: bool) -> None:
        """Both pools' free queues, every pin accounted for, the host tier's events; once idle, nothing held."""
        cpu_pins, gpu_pins = self.host_pins()
        for tier, pool in (("device", self.kvm.block_pool), ("host", self.cpu_pool)):
            free = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
            unreferenced = sorted(block.block_id for block in pool.blocks[1:] if block.ref_cnt == 0)
            if sorted(free) != unreferenced:
                raise IntegrityError(
                    f"{tier}_free_queue_is_the_unreferenced: free queue {sorted(free)}, blocks of no reference"
                    f" {unreferenced}"
                )
        held = Counter({block.block_id: block.ref_cnt for block in self.cpu_pool.blocks[1:] if block.ref_cnt})
        if held != cpu_pins:
            raise IntegrityError(
                f"host_pins_are_accounted: CPU blocks referenced {dict(held)}, the connector accounts for"
                f" {dict(cpu_pins)}"
            )
        tables: Counter[int] = Counter()
        for group in self.kvm.coordinator.single_type_managers:
            for blocks in group.req_to_blocks.values():
                tables.update(block.block_id for block in blocks if not block.is_null)
        gpu = Counter({block.block_id: block.ref_cnt for block in self.kvm.block_pool.blocks[1:] if block.ref_cnt})
        if gpu != tables + gpu_pins:
            raise IntegrityError(
                f"device_pins_are_accounted: GPU blocks referenced {dict(gpu)}, the block tables hold {dict(tables)}"
                f" and the connector accounts for {dict(gpu_pins)}"
            )
        self.check_host_events()
        if not quiescent:
            return
        c = self.manager
        self.check_quiescent(
            {
                "CPU blocks pinned": sum(cpu_pins.values()),
                "events in flight": self.worker.in_flight() + len(self.late),
                "stores queued": int(c.has_pending_stores()),
                "loads tracked": len(c._reqs_to_load) + len(c._abandoned_reqs_to_load),
                "stores tracked": len(c._reqs_to_store),
            }
        )

    def reach(self) -> Mapping[str, int]:
        cached = sum(1 for block in self.cpu_pool.blocks[1:] if block.block_hash is not None)
        return {**super().reach(), "host blocks cached": cached}


PROFILE = Profile(
    name=f"vllm {VERSION} SimpleCPUOffloadConnector as its engine runs it (KVCacheManager + SimpleCPUOffloadScheduler)",
    notes=(
        "vLLM's scheduler is replayed (FCFS, chunked prefill, preemption from the back when the pool is short);"
        " its KV cache manager and the connector's scheduler side are vLLM's own, eager or lazy",
        "the worker is the machine: loads before their forward, stores after it, each stream reported in order,"
        " every launched event copied first at a preemption; both tiers' events replayed",
        "a reset with transfers in flight keeps the CPU tier (the connector refuses, and says so)",
        "a reset the device refuses and the connector takes publishes a cleared event that names no tier (finding"
        " 24, a bug): counted",
    ),
)


TARGET = TargetInfo(
    name="vllm-simple-offload",
    description=f"vLLM {VERSION} SimpleCPUOffloadConnector: KVCacheManager + SimpleCPUOffloadScheduler",
    requires=REQUIRES,
    planner_factory=VllmSimpleOffloadEngine,
    profile=PROFILE,
    how="the planner machine: vLLM's scheduler replayed, the connector's events run as its worker does (in order)",
    probe=import_simple,
    engine_modules=SIMPLE_OFFLOAD_MODULES,
)
