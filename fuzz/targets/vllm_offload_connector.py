"""Target ``vllm-offload-connector``: vLLM 0.33.0's KV offloading as its engine runs it. The device tier is vLLM's
``KVCacheManager`` of a full-attention group (a sliding-window group beside it in half the examples; prefix
caching on or off); the host tier is the
``OffloadingConnector``'s scheduler side, ``OffloadingConnectorScheduler`` over ``CPUOffloadingManager`` (lru or
arc), both imported and driven together under the planner machine (``fuzz/planner_machine.py``).

What drives them is vLLM's scheduler, replayed (``vllm/v1/core/sched/scheduler.py`` needs the whole engine to
import): each step the running requests first (``allocate_slots``; when the pool is short the last one running is
preempted, its blocks freed, and it waits again at the head of the queue), then the waiting ones in order: the
device hit (``get_computed_blocks``), the connector's (``get_num_new_matched_tokens``), ``allocate_slots`` with the
external tokens, ``update_state_after_alloc``; a request whose hit loads asynchronously waits for its KV
(``WAITING_FOR_REMOTE_KVS``) until the worker reports the load, then its blocks are cached and it is scheduled as
vLLM does. Then ``build_connector_meta`` with the step's ``SchedulerOutput`` (new, resumed and running requests,
their new blocks, the finished and preempted ones), and the tokens computed. A finished or aborted request goes
through ``request_finished`` and frees its blocks (an aborted one whose load is in flight only once the load is
reported); a reset is ``reset_prefix_cache(reset_connector=True)``.

The machine plays the worker as ``OffloadingConnectorWorker`` does: a step's store jobs are submitted at the start
of the next step (``prepare_store_kv`` defers them), so they are that plan's transfers ("backup", device block ->
host chunk block); the jobs the metadata names in ``jobs_to_flush`` are that plan's ``flush`` (copied before its
loads and its forward, as ``handle_preemptions`` waits for them); loads ("load") are submitted in their own step and
may land as late as their report (the request runs no pass until then). A job reported done reaches the scheduler
at once as ``update_from_output`` hands it over (a ``KVConnectorOutput``: its ``OffloadingWorkerMetadata``, and the
load's request in ``finished_recving``); with two workers the second reports a step after the first. The KV the
planner machine keeps per slot then checks every tier: a store that reads a block after it was reused, a load
into a reused block, a chunk served after a reset, all fail ``attended_kv_is_the_requests`` or
``reset_leaves_no_tier_serving`` where a request reads them. The host tier's KV events, replayed as a consumer does,
must name exactly its ready chunks (``host_events_replay_to_the_tier``).

Configurations drawn (``Config``): page size, device blocks, host chunks (0.5x to 4x), blocks per chunk (1 or 2),
policy, store threshold, token budget per step (chunked prefill), prefix caching, ``offload_prompt_only``, a
sync-load budget, one or two workers, EAGLE (the device and the connector drop the volatile last block; two
lookahead slots a step), a sliding-window group of 8 or 32 tokens (each pass carries its row: the machine checks
there only the positions the window attends; the connector's jobs split by group; the group's device events
counted, not replayed).

What is shimmed, and why it cannot hide a bug of the connector or the KV cache manager (``import_connector``):
the packages of ``import_vllm`` and ``import_offload`` (bare ``__init__`` files; the block pool's stubs); five
modules the connector's import chain reaches for the worker or the model and the scheduler side never calls
(attention backends and layers, the platform, CUDA graphs, the encoder cache's config), registered as stand-ins
whose names raise if called; names read by annotations or the worker only (``KVConnectorBase_V1`` and its
siblings, ``async_tensor_h2d``, ``PIN_MEMORY``, ``strip_covered_mm_data``, ``PrefixCacheStats``: log stats are off);
three stand-ins that answer: ``get_current_vllm_config_or_none`` (None: no engine config is current, as outside an
engine), the platform's ``register_custom_kv_cache_specs`` (a CPU platform registers none), ``get_dtype_size`` (the
element size torch reports). ``RequestStatus`` is vLLM's statuses in vLLM's order (its ``is_finished`` compares by
order), and the request is a stand-in holding what the scheduler, the manager and the connector read of one
(its block hashes computed by vLLM's own hasher). The connector's ``OffloadingSpec`` is ours: it builds the
``CPUOffloadingManager`` as ``CPUOffloadingSpec.get_manager`` does, without the platform's pinned buffers.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
import types
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

from radixspec.spec.errors import IntegrityError

from ..stats import STATS
from .api import BlockEvent, Pass, Plan, Profile, TargetError, TargetInfo, Transfer, choose_from, draw_choosing
from .shims import Never, bare, install, never, package_root, register, stub
from .vllm import CONNECTOR_MODULES, VERSION, import_vllm
from .vllm_offload import ChunkStatus, check_counts, import_offload, policy_chunks

PAGE_SIZES = (1, 2, 4, 8, 16)
DEVICE_BLOCKS = (8, 12, 16, 24, 48)
HOST_RATIOS = (0.5, 1, 2, 4)
CHUNK_BLOCKS = (1, 2)
POLICIES = ("lru", "arc")
THRESHOLDS = (1, 2)
BUDGETS = (8, 16, 32, 128)
SYNC_BUDGETS = (0, 0, 256, 65536)
WORKERS = (1, 2)
# a sliding-window group beside the full-attention one (its window in tokens), in half the examples: a model of
# interleaved window layers (Gemma 3, gpt-oss)
WINDOWS = (None, None, 8, 32)
# EAGLE's draft tokens a step allocates slots for (num_speculative_tokens)
LOOKAHEAD = 2
# requests running at once, at most (vLLM's max_num_seqs)
MAX_RUNNING = 8
MAX_MODEL_LEN = 4096


class RequestStatus(enum.IntEnum):
    """vLLM's request statuses, in its order (a status past PREEMPTED is a finished one)."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


def import_connector() -> types.ModuleType:
    """vLLM's KV cache manager, the offloading connector's scheduler, the CPU manager and the dataclasses they
    exchange, with the stand-ins of the module docstring."""
    cached = sys.modules.get("vllm.__radixspec_connector__")
    if cached is not None:
        return cached
    import importlib

    import torch

    import_vllm()
    import_offload()
    root = package_root("vllm")
    for name in ("vllm.model_executor", "vllm.model_executor.layers"):
        bare(name, root.joinpath(*name.split(".")[1:]))
    for name in (
        "vllm.config.ec_manager_config",
        "vllm.config.kv_transfer",
        "vllm.model_executor.layers.attention_layer_base",
        "vllm.v1.attention.backend",
        "vllm.compilation.cuda_graph",
    ):
        stub_classes(name)
    stub("vllm.platforms", current_platform=types.SimpleNamespace(register_custom_kv_cache_specs=lambda config: None))
    install(
        sys.modules["vllm.config"],
        get_current_vllm_config_or_none=lambda: None,
        get_layers_from_vllm_config=never,
        set_current_vllm_config=never,
    )
    install(
        sys.modules["vllm.distributed.kv_transfer.kv_connector.v1"],
        KVConnectorBase_V1=Never,
        KVConnectorRole=Never,
        supports_hma=never,
    )
    install(sys.modules["vllm.utils.torch_utils"], async_tensor_h2d=never, PIN_MEMORY=False)
    install(sys.modules["vllm.multimodal.utils"], strip_covered_mm_data=never)
    install(sys.modules["vllm.v1.metrics.stats"], PrefixCacheStats=Never)
    request = sys.modules["vllm.v1.request"]
    if not hasattr(request, "RequestStatus"):
        install(request, RequestStatus=RequestStatus)
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    install(interface, get_dtype_size=lambda dtype: torch.tensor([], dtype=dtype).element_size())
    # vLLM's registry of spec classes fills itself while empty; another target of this process (vllm-mamba) may
    # have registered its one spec by hand first: the two this target builds, by hand too (the same registration)
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry.register(
        interface.FullAttentionSpec, FullAttentionManager, uniform_type_base_spec=interface.FullAttentionSpec
    )
    KVCacheSpecRegistry.register(
        interface.SlidingWindowSpec, SlidingWindowManager, uniform_type_base_spec=interface.SlidingWindowSpec
    )
    scheduler = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    # they warn on every store the host tier refuses and every reset refused while blocks are in use, thousands of
    # lines a minute under the fuzzer
    for module in (scheduler.__name__, "vllm.v1.core.block_pool"):
        logging.getLogger(module).setLevel(logging.ERROR)
    return register(
        "vllm.__radixspec_connector__",
        scheduler=scheduler,
        common=importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"),
        offload_config=importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"),
        base=importlib.import_module("vllm.v1.kv_offload.base"),
        config=importlib.import_module("vllm.v1.kv_offload.config"),
        cpu=importlib.import_module("vllm.v1.kv_offload.cpu.manager"),
        interface=interface,
        manager=importlib.import_module("vllm.v1.core.kv_cache_manager"),
        output=importlib.import_module("vllm.v1.core.sched.output"),
        outputs=importlib.import_module("vllm.v1.outputs"),
        utils=importlib.import_module("vllm.v1.core.kv_cache_utils"),
        status=request.RequestStatus,
        torch=torch,
    )


def stub_classes(name: str) -> types.ModuleType:
    """Register module ``name`` whose every attribute is ``Never`` (a class: annotations combine it with ``|``)."""
    module = stub(name)

    def module_getattr(attribute: str) -> type[Never]:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Never

    install(module, __getattr__=module_getattr)
    return module


class Config(NamedTuple):
    """One configuration of the engine: a draw picks one value of each field from CHOICES."""

    page_size: int
    device_blocks: int
    host_ratio: float
    blocks_per_chunk: int
    policy: str
    threshold: int
    budget: int
    caching: bool = True
    prompt_only: bool = True
    # KV bytes a step may load synchronously (sync_load_budget_bytes; 8 bytes a token here): 0 every load async
    sync_budget: int = 0
    # workers reporting each job (tensor parallel): with 2 the second reports a step after the first
    workers: int = 1
    # EAGLE speculative decoding: the one group holds the drafter's layers too (``is_eagle_group``), the device hit
    # drops its last block (``use_eagle``), the connector its volatile trailing chunk, and each step allocates
    # lookahead slots for the draft tokens (none accepted: a step decodes one token)
    eagle: bool = False
    # a sliding-window group (``SlidingWindowSpec``, its window in tokens) beside the full-attention one: the hybrid
    # coordinator, the connector's per-group keys and window lookups, its stores skipping the blocks that left the
    # window
    window: int | None = None


CHOICES: tuple[tuple[object, ...], ...] = (
    PAGE_SIZES,
    DEVICE_BLOCKS,
    HOST_RATIOS,
    CHUNK_BLOCKS,
    POLICIES,
    THRESHOLDS,
    BUDGETS,
    (True, False),
    (True, False),
    SYNC_BUDGETS,
    WORKERS,
    (False, True),
    WINDOWS,
)


def choose(draw: int) -> Config:
    return Config._make(choose_from(CHOICES, draw))


def draw_for(config: Config) -> int:
    """A draw that picks ``config``: tests name a configuration so."""
    return draw_choosing(CHOICES, config)


@dataclass(eq=False)
class Request:
    """What vLLM's scheduler, ``KVCacheManager`` and the connector read of a ``vllm.v1.request.Request``."""

    request_id: str
    all_token_ids: list[int]
    max_tokens: int
    hasher: Callable[[Request], list[object]]
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    shared_prefix_boundary: int = 0
    block_hashes: list[object] = field(default_factory=list)
    # the pass that computed its last token ran (its next ones decode), since it was last admitted
    prefilled: bool = False
    num_prompt_tokens: int = 0
    # read by the manager and the connector, constant here
    mm_features: tuple[()] = ()
    lora_request: None = None
    cache_salt: None = None
    prompt_embeds: None = None
    session_id: None = None
    kv_transfer_params: None = None
    kv_hints: None = None
    skip_reading_prefix_cache: bool = False
    sampling_params: None = None
    num_in_flight_tokens: int = 0
    num_output_placeholders: int = 0
    spec_token_ids: tuple[()] = ()

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)
        self.block_hashes.extend(self.hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append(self, tokens: Sequence[int]) -> None:
        """``append_output_token_ids``: the tokens, and the hash of every block they complete."""
        self.all_token_ids.extend(tokens)
        self.block_hashes.extend(self.hasher(self))


@dataclass
class Step:
    """What one schedule did: the requests it ran (request, first position, tokens), and those it preempted."""

    scheduled: list[tuple[Request, int, int]] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)
    running: list[tuple[Request, object]] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class LoadStoreSpec(Protocol):
    """What the worker reads of a job's side: its blocks (device blocks, or host chunks)."""

    block_ids: Sequence[int]


class DeviceSpec(LoadStoreSpec, Protocol):
    """A ``GPULoadStoreSpec`` also says where in the request's blocks it starts."""

    block_indices: Sequence[int]


class Job(Protocol):
    """A ``TransferJob``."""

    req_id: str
    src_spec: LoadStoreSpec
    dst_spec: LoadStoreSpec


class ConnectorMeta(Protocol):
    """An ``OffloadingConnectorMetadata``: the step's jobs, and those the worker must finish before its forward."""

    load_jobs: Mapping[int, Job]
    store_jobs: Mapping[int, Job]
    jobs_to_flush: set[int] | None


class OffloadWorker:
    """The connector's jobs as ``OffloadingConnectorWorker`` submits them, as the planner layer's transfers."""

    def __init__(self, blocks_per_chunk: int) -> None:
        self.bpc = blocks_per_chunk
        # the last step's store jobs, submitted with the next plan
        self.deferred: list[Transfer] = []
        # our transfer's op -> (job id, the request of a load)
        self.jobs: dict[Hashable, tuple[int, str | None]] = {}

    def submit(self, meta: ConnectorMeta, forward: bool) -> tuple[tuple[Transfer, ...], tuple[Hashable, ...]]:
        """The plan's transfers: the last step's stores, this step's stores it must flush, this step's loads;
        this step's other stores wait for the next plan (``forward``: this one runs a forward they must follow;
        with none, the engine's next step starts at once, so they go now). Then the flushed ones."""
        flush = set(meta.jobs_to_flush or ())
        submitted, self.deferred = self.deferred, []
        for job, entry in meta.store_jobs.items():
            transfer = self.transfer(job, entry, "backup")
            (self.deferred if forward and job not in flush else submitted).append(transfer)
        for job, entry in meta.load_jobs.items():
            submitted.append(self.transfer(job, entry, "load"))
        ops = tuple(("job", job) for job in sorted(flush) if ("job", job) in self.jobs)
        return tuple(submitted), ops

    def transfer(self, job: int, entry: Job, kind: str) -> Transfer:
        """A job's pairs: the device blocks and the host chunks' blocks, in order, group by group (each group's
        ``group_sizes`` blocks from its first chunk on), each group's first chunk's leading blocks skipped where its
        blocks start inside it (the CPU worker's ``skip_count``, from ``block_indices``)."""
        gpu = cast(DeviceSpec, entry.dst_spec if kind == "load" else entry.src_spec)
        host = entry.src_spec if kind == "load" else entry.dst_spec
        blocks = [int(block) for block in gpu.block_ids]
        chunks = [int(chunk) for chunk in host.block_ids]
        # 0.32.0's single-group specs have no group sizes
        sizes = list(getattr(gpu, "group_sizes", None) or [len(blocks)])
        starts = list(gpu.block_indices) or [0]
        # each group's chunks: its blocks and the leading blocks skipped in its first chunk, whole chunks (a group
        # without its block index is named below)
        counts = [
            -(-(size + int(first) % self.bpc) // self.bpc) if size else 0
            for size, first in zip(sizes, starts, strict=False)
        ]
        if len(sizes) != len(starts) or (sum(sizes), sum(counts)) != (len(blocks), len(chunks)):
            raise IntegrityError(
                f"offload_jobs_are_whole: job {job} names {len(blocks)} device blocks and {len(chunks)} host chunks;"
                f" its groups' sizes {sizes} from block indices {starts} cover {sum(sizes)} and {sum(counts)}"
            )
        pairs: list[tuple[Hashable, Hashable]] = []
        at_block = at_chunk = 0
        for size, first, count in zip(sizes, starts, counts, strict=True):
            skip = int(first) % self.bpc
            chunk_blocks = [(chunk, i) for chunk in chunks[at_chunk : at_chunk + count] for i in range(self.bpc)]
            pairs += zip(blocks[at_block : at_block + size], chunk_blocks[skip : skip + size], strict=True)
            at_block, at_chunk = at_block + size, at_chunk + count
        if any(sizes[1:]):
            STATS.rules[f"vllm-offload-connector.job[{kind}, the window group's blocks too]"] += 1
        op = ("job", job)
        if kind == "load":
            # a synchronous load's request runs in its step: the worker reports no finished_recving for it (0.32.0's
            # jobs have no such flag: every load is asynchronous)
            sync = bool(getattr(entry, "sync", False))
            self.jobs[op] = (job, None if sync else entry.req_id)
            return Transfer(op, "load", tuple((chunk, block) for block, chunk in pairs), awaited=sync)
        self.jobs[op] = (job, None)
        return Transfer(op, "backup", tuple(pairs))


class Blocks(Protocol):
    """A ``KVCacheBlocks``."""

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None: ...


class CacheManager(Protocol):
    """What the replayed scheduler calls of vLLM's ``KVCacheManager``."""

    empty_kv_cache_blocks: Blocks

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int, int]: ...
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Blocks | None: ...
    def get_blocks(self, request_id: str) -> Blocks: ...
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]: ...
    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None: ...
    def free(self, request: Request) -> None: ...


class Connector(Protocol):
    """What the replayed scheduler calls of a connector's scheduler side."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]: ...
    def update_state_after_alloc(self, request: Request, blocks: Blocks, num_external_tokens: int) -> None: ...


class ConnectorScheduler(Connector, Protocol):
    """What the engine calls of a connector's scheduler side besides: its metadata for a step, the workers' output,
    its events."""

    def build_connector_meta(self, scheduler_output: object) -> object: ...
    def update_connector_output(self, connector_output: object) -> None: ...
    def take_events(self) -> Iterable[object]: ...


class VllmScheduler:
    """vLLM's scheduler, replayed: its queues, and ``schedule`` over the KV cache manager and the connector."""

    def __init__(
        self, v: types.ModuleType, kvm: CacheManager, connector: Connector, budget: int, lookahead: int = 0
    ) -> None:
        self.v, self.kvm, self.connector, self.budget = v, kvm, connector, budget
        # slots allocated past the scheduled tokens for draft tokens (the scheduler's num_lookahead_tokens)
        self.lookahead = lookahead
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # requests whose load was reported, not yet scheduled again (the scheduler's finished_recving_kv_req_ids)
        self.loaded: set[str] = set()

    def cached(self, step: Step) -> object:
        ids = [r.request_id for r, _ in step.running] + [r.request_id for r in step.resumed]
        blocks = [new for _, new in step.running] + [self.kvm.get_block_ids(r.request_id) for r in step.resumed]
        everyone = [r for r, _ in step.running] + step.resumed
        return self.v.output.CachedRequestData(
            req_ids=ids,
            resumed_req_ids={r.request_id for r in step.resumed},
            new_token_ids=[[] for _ in ids],
            all_token_ids={},
            new_block_ids=blocks,
            num_computed_tokens=[r.num_computed_tokens for r in everyone],
            num_output_tokens=[r.num_tokens - r.num_prompt_tokens for r in everyone],
        )

    def schedule(self) -> Step:
        """vLLM's ``schedule``: the running requests, preempting from the back when the pool is short, then (when
        none was preempted) the waiting ones in order."""
        step, budget = Step(), self.budget
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            blocks = None
            while True:
                blocks = self.kvm.allocate_slots(request, count, num_lookahead_tokens=self.lookahead)
                if blocks is not None:
                    break
                victim = self.running.pop()
                self.preempt(victim, step)
                if victim is request:
                    break
            if blocks is None:
                break
            step.scheduled.append((request, request.num_computed_tokens, count))
            step.running.append((request, blocks.get_block_ids(allow_none=True)))
            budget -= count
            index += 1
        if step.preempted:
            return step
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < MAX_RUNNING:
            request = self.waiting[0]
            admitted = self.admit(request, budget, step)
            if admitted is None:
                break
            self.waiting.pop(0)
            if admitted:
                budget -= admitted
            else:
                skipped.append(request)
        self.waiting[:0] = skipped
        return step

    def admit(self, request: Request, budget: int, step: Step) -> int | None:
        """One waiting request: the tokens it was scheduled for; 0 when it is skipped (its KV still loading, or
        now loading); None when the pool cannot take it (the waiting queue stops)."""
        status = self.v.status
        if request.status == status.WAITING_FOR_REMOTE_KVS:
            if request.request_id not in self.loaded:
                return 0
            # _update_waiting_for_remote_kv: the loaded blocks cached, the last token recomputed
            self.kvm.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                request.num_computed_tokens -= 1
            self.loaded.discard(request.request_id)
            request.status = status.PREEMPTED if request.num_preemptions else status.WAITING
        blocks, local, external, loading = self.kvm.empty_kv_cache_blocks, 0, 0, False
        if request.num_computed_tokens == 0:
            blocks, local, request.shared_prefix_boundary = self.kvm.get_computed_blocks(request)
            hit, loading = self.connector.get_num_new_matched_tokens(request, local)
            if hit is None:
                return 0
            external = hit
            computed = local + external
        else:
            computed = request.num_computed_tokens
        count = 0 if loading else min(request.num_tokens - computed, budget)
        if count == 0 and not loading:
            return 0
        allocated = self.kvm.allocate_slots(
            request,
            count,
            num_new_computed_tokens=local,
            new_computed_blocks=blocks,
            # a request whose KV loads asynchronously takes its lookahead slots once it runs
            num_lookahead_tokens=0 if loading else self.lookahead,
            num_external_computed_tokens=external,
            delay_cache_blocks=loading,
        )
        if allocated is None:
            return None
        self.connector.update_state_after_alloc(request, self.kvm.get_blocks(request.request_id), external)
        request.num_computed_tokens = computed
        if loading:
            request.status = status.WAITING_FOR_REMOTE_KVS
            return 0
        self.running.append(request)
        (step.new if request.status == status.WAITING else step.resumed).append(request)
        request.status = status.RUNNING
        request.prefilled = False
        step.scheduled.append((request, computed, count))
        return count

    def preempt(self, request: Request, step: Step) -> None:
        """``_preempt_request``: its blocks freed, back to the head of the waiting queue, to recompute."""
        self.kvm.free(request)
        request.status = self.v.status.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.prefilled = False
        self.waiting.insert(0, request)
        step.preempted.append(request)


class ConnectorEngine:
    """vLLM's KV cache manager (a full-attention group, a window group beside it or not) and a KV connector's
    scheduler side under a replay of vLLM's
    scheduler, behind the planner layer's protocol: the requests' lifecycle, each step's ``SchedulerOutput`` and
    passes, the workers' reports as ``update_from_output`` hands them over, and the device's KV events. A
    connector's class builds ``self.connector`` and plays its worker (``submit``, ``done``), its host tier's events
    (``replay_host``, ``host_held``) and its reset."""

    overlap = False
    orphans: str | None = None
    # two requests computing one prefix at once both cache it, each in its own block, and both are published
    duplicates = True
    # reset_prefix_cache(reset_connector=True) resets the connector even while requests run
    resets_busy = True
    # the connector's scheduler side, as this class calls it (its class keeps it under its own name too)
    connector: ConnectorScheduler
    scheduler: VllmScheduler

    def __init__(
        self,
        v: types.ModuleType,
        page_size: int,
        device_blocks: int,
        caching: bool,
        workers: int,
        tensors: Sequence[object] = (),
        eagle: bool = False,
        window: int | None = None,
    ) -> None:
        self.v, self.page_size, self.workers, self.window = v, page_size, workers, window
        self.device_blocks = device_blocks + 1  # block 0 is the null block
        self.max_request_tokens = MAX_MODEL_LEN
        # with prefix caching off the device caches nothing, and publishes no block: every hit is a load
        self.publishes_hits = caching
        shape = {"block_size": page_size, "num_kv_heads": 1, "head_size": 1, "dtype": v.torch.float32}
        groups = [
            v.interface.KVCacheGroupSpec(["layer.0"], v.interface.FullAttentionSpec(**shape), is_eagle_group=eagle)
        ]
        if window is not None:
            spec = v.interface.SlidingWindowSpec(**shape, sliding_window=window)
            groups.append(v.interface.KVCacheGroupSpec(["layer.1"], spec))
        self.kv_config = v.interface.KVCacheConfig(
            num_blocks=self.device_blocks, kv_cache_tensors=list(tensors), kv_cache_groups=groups
        )
        self.kvm = v.manager.KVCacheManager(
            self.kv_config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=page_size,
            hash_block_size=page_size,
            enable_caching=caching,
            use_eagle=eagle,
            enable_kv_cache_events=True,
        )
        from vllm.utils.hashing import sha256

        v.utils.init_none_hash(sha256)
        self.hasher = v.utils.get_request_block_hasher(page_size, sha256)
        self.requests: dict[str, Request] = {}
        # requests finished since the last schedule (for its SchedulerOutput)
        self.finished: set[str] = set()
        # the other workers' reports (their worker metadata, the loads they finished), delivered with the next step's
        # output: with two workers the second reports a step after the first
        self.late: list[tuple[object, set[str]]] = []
        self.host_events = 0
        # whether the last reset cleared the host tier (the connector's reset may refuse)
        self.host_cleared = True
        # the host tier's blocks its events published and not since removed or cleared, replayed as a consumer does
        self.host_published: Counter[object] = Counter()

    # ------------------------------------------------------------ requests

    def submit(self, request: str, tokens: Sequence[int], max_new: int) -> None:
        new = Request(request, list(tokens), max_new, self.hasher)
        self.requests[request] = new
        self.scheduler.waiting.append(new)

    def result(self, request: str, tokens: Sequence[int]) -> None:
        if tokens:
            self.requests[request].append(tokens)

    def finish(self, request: str) -> None:
        self._finish(self.requests[request], RequestStatus.FINISHED_LENGTH_CAPPED)

    def abort(self, request: str) -> None:
        found = self.requests.get(request)
        if found is not None and not found.is_finished():
            self._finish(found, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """``finish_requests`` / the stop check, then ``_free_request``: the connector first, then the blocks (an
        aborted request whose load is in flight keeps them until its report)."""
        if request in self.scheduler.running:
            self.scheduler.running.remove(request)
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        delay = (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and request.request_id not in self.scheduler.loaded
        )
        self.scheduler.loaded.discard(request.request_id)
        request.status = status
        delay_free = self.connector_finished(request)
        self.finished.add(request.request_id)
        if not (delay or delay_free):
            self._free_blocks(request)

    def connector_finished(self, request: Request) -> bool:
        """``_connector_finished``: whether the connector keeps the request's blocks."""
        raise NotImplementedError

    def _free_blocks(self, request: Request) -> None:
        self.kvm.free(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------ plans

    def plan(self) -> Plan:
        late, self.late = self.late, []
        for meta, recving in late:
            self._report(meta, recving)
        step = self.scheduler.schedule()
        meta = self.connector.build_connector_meta(self.scheduler_output(step))
        self.finished = set()
        passes = []
        for request, start, count in step.scheduled:
            request.num_computed_tokens = start + count  # _update_after_schedule
            rows = self.kvm.get_block_ids(request.request_id)
            pages = tuple(rows[0])
            # the window group's row: the blocks that left the window are the null block
            windows = tuple((tuple(row), self.window) for row in rows[1:] if self.window is not None)
            if request.prefilled:
                passes.append(Pass(request.request_id, -1, count, None, pages, False, windows))
            else:
                inputs = tuple(request.all_token_ids[start : start + count])
                passes.append(Pass(request.request_id, start, count, inputs, pages, True, windows))
                request.prefilled = start + count == request.num_tokens
        transfers, flush = self.submit_jobs(meta, bool(passes))
        return Plan(transfers, passes=tuple(passes), flush=flush, restarted=tuple(r.request_id for r in step.preempted))

    def submit_jobs(self, meta: object, forward: bool) -> tuple[tuple[Transfer, ...], tuple[Hashable, ...]]:
        """The worker: the transfers the step's connector metadata asks for, and those it flushes first."""
        raise NotImplementedError

    def scheduler_output(self, step: Step) -> object:
        """The step's ``SchedulerOutput``: new, resumed and running requests, their blocks, finished, preempted."""
        v = self.v
        return v.output.SchedulerOutput(
            scheduled_new_reqs=[
                v.output.NewRequestData(
                    r.request_id,
                    list(r.all_token_ids),
                    [],
                    None,
                    None,
                    self.kvm.get_block_ids(r.request_id),
                    r.num_computed_tokens,
                    None,
                )
                for r in step.new
            ],
            scheduled_cached_reqs=self.scheduler.cached(step),
            num_scheduled_tokens={r.request_id: count for r, _, count in step.scheduled},
            total_num_scheduled_tokens=sum(count for _, _, count in step.scheduled),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=self.finished,
            free_encoder_mm_hashes=[],
            preempted_req_ids={r.request_id for r in step.preempted},
        )

    def _report(self, meta: object, recving: set[str]) -> None:
        """``update_from_output``: the connector gets the workers' metadata and the loads' requests in
        ``finished_recving``, then the scheduler wakes or frees each of those (``_update_from_kv_xfer_finished``)."""
        output = self.v.outputs.KVConnectorOutput(
            finished_sending=set(), finished_recving=set(recving), kv_connector_worker_meta=meta
        )
        self.connector.update_connector_output(output)
        for loaded in sorted(recving):
            request = self.requests.get(loaded)
            if request is None:
                continue
            if request.status == self.v.status.WAITING_FOR_REMOTE_KVS:
                self.scheduler.loaded.add(request.request_id)
            elif request.is_finished():
                self._free_blocks(request)

    # ------------------------------------------------------------ what it shows

    def take_events(self) -> list[BlockEvent]:
        """The step's KV events as the engine publishes them: the device's (the KV cache manager's, for the machine
        to replay), then the connector's (its host tier's, replayed here: ``replay_host``)."""
        events: list[BlockEvent] = []
        p = self.page_size
        for event in self.kvm.take_events():
            kind = type(event).__name__
            if getattr(event, "group_idx", None):
                # a window group's blocks: their events are vllm-hybrid's to replay (by count: finding 14); here the
                # full-attention group's events stand for the device's cache
                STATS.rules[f"planner.events[window group: {kind}, not replayed]"] += 1
                continue
            if kind == "BlockStored":
                parent, tokens = event.parent_block_hash, tuple(event.token_ids)
                for i, block in enumerate(event.block_hashes):
                    events.append(BlockEvent("stored", block, parent, tokens[i * p : (i + 1) * p]))
                    parent = block
            elif kind == "BlockRemoved":
                events += [BlockEvent("removed", block) for block in event.block_hashes]
            else:
                events.append(BlockEvent("cleared"))
                self.host_published.clear()
        return events + self.replay_host(self.connector.take_events())

    def replay_host(self, events: Iterable[object]) -> list[BlockEvent]:
        """The connector's events as a consumer replays them (a CPU block stored or removed by its hash, a cleared
        event clears every tier); what they say of the device, for the machine."""
        said: list[BlockEvent] = []
        for event in events:
            self.host_events += 1
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                self.host_published.clear()
                said.append(BlockEvent("cleared"))
            for block in getattr(event, "block_hashes", ()):
                if kind == "BlockStored":
                    self.host_published[block] += 1
                elif self.host_published[block] > 1:
                    self.host_published[block] -= 1
                elif block in self.host_published:
                    del self.host_published[block]
                else:
                    raise IntegrityError(f"host_events_replay_to_the_tier: CPU block {block!r} removed, not published")
        return said

    def host_held(self) -> Counter[object]:
        """The hashes the host tier holds ready, as its events name them (a hash held twice counted twice)."""
        raise NotImplementedError

    def check_host_events(self) -> None:
        ready = self.host_held()
        if self.host_published != ready:
            raise IntegrityError(
                f"host_events_replay_to_the_tier: the CPU tier's events name {sum(self.host_published.values())}"
                f" blocks, {sum((self.host_published - ready).values())} of them not held; it holds"
                f" {sum(ready.values())} ready, {sum((ready - self.host_published).values())} of them not published"
            )

    def check_quiescent(self, held: Mapping[str, int]) -> None:
        """``offload_quiescent_holds_nothing``: with no request live and no transfer in flight, no device block in
        use, no request left, and nothing of ``held`` (the connector's own)."""
        busy = {"device blocks in use": self.device_in_use(), **held, "requests live": len(self.requests)}
        left = {what: n for what, n in busy.items() if n}
        if left:
            raise IntegrityError(
                f"offload_quiescent_holds_nothing: with no request live and no transfer in flight it holds {left}"
            )

    def device_in_use(self) -> int:
        return int(self.device_blocks - 1 - self.kvm.block_pool.get_num_free_blocks())

    def reach(self) -> Mapping[str, int]:
        cached = sum(1 for block in self.kvm.block_pool.blocks[1:] if block.block_hash is not None)
        return {"device pages in use": self.device_in_use(), "device pages cached": cached}


class VllmOffloadEngine(ConnectorEngine):
    """vLLM's KV cache manager and offloading connector (scheduler side) under a replay of vLLM's scheduler, behind
    the planner layer's protocol."""

    def __init__(self, draw: int, policy: str | None = None) -> None:
        v = import_connector()
        # the policy: the one the target names (vllm-offload-connector:arc), else drawn
        config = self.choice = choose(draw)._replace(policy=policy or choose(draw).policy)
        super().__init__(
            v,
            config.page_size,
            config.device_blocks,
            config.caching,
            config.workers,
            eagle=config.eagle,
            window=config.window,
        )
        p = config.page_size
        self.host_chunks = max(2, int(config.device_blocks * config.host_ratio) // config.blocks_per_chunk)
        self.bpc = config.blocks_per_chunk
        self.config = (
            f"P={p}, device {config.device_blocks}, host {self.host_chunks} chunks of {self.bpc},"
            f" {config.policy}{f', threshold {config.threshold}' if config.threshold > 1 else ''},"
            f" budget {config.budget}, caching {'on' if config.caching else 'off'},"
            f" {'prompt only' if config.prompt_only else 'prompt and decode'}"
            f"{f', sync loads {config.sync_budget} B' if config.sync_budget else ''}"
            f"{f', {config.workers} workers' if config.workers > 1 else ''}"
            f"{', EAGLE' if config.eagle else ''}"
            f"{f', window {config.window}' if config.window else ''}"
        )
        # finding 22 (docs/findings.md): a second reset before a step, with jobs flushed by the first, fails an
        # assertion; counted (tests turn it off to see it raised)
        self.known_double_reset = True
        # finding 23: a reset the device refuses still empties the host tier, and no event says so; counted (tests
        # turn it off to see host_events_replay_to_the_tier fail)
        self.known_silent_host_reset = True
        # finding 27: with a window group, a reset while a request runs re-offloads that request from its first chunk
        # with the window's block ids the connector kept, some of them since given to the request's later positions
        # (another position's KV stored, and a block named twice fails the job's completion); such a reset is
        # counted and not taken (tests turn it off to see it fail)
        self.known_window_reset = True
        # each group offloaded, as vLLM's build_offloading_config makes them: a window group keeps as many chunks
        # per request as its window spans (0.32.0's scheduler computes that itself)
        windowed = "sliding_window_size_in_chunks" in {
            f.name for f in dataclasses.fields(v.config.OffloadingGroupConfig)
        }
        groups = tuple(
            v.config.OffloadingGroupConfig(
                tokens_per_block=p,
                layer_names=tuple(group.layer_names),
                group_id=i,
                **(
                    {
                        "sliding_window_size_in_chunks": v.offload_config.get_sliding_window_size_in_chunks(
                            group.kv_cache_spec, p * self.bpc
                        )
                    }
                    if windowed
                    else {}
                ),
            )
            for i, group in enumerate(self.kv_config.kv_cache_groups)
        )
        offloading = v.config.OffloadingConfig(
            groups=groups,
            worker_kv_bytes_per_block=1,
            enable_kv_cache_events=True,
            extra_config={"offload_prompt_only": config.prompt_only, "sync_load_budget_bytes": config.sync_budget},
            engine_id="radixspec",
            model=v.config.OffloadingModelConfig(name="radixspec", dtype="float32"),
            cache=v.config.OffloadingCacheConfig(tokens_per_hash=p, blocks_per_chunk=self.bpc),
            parallel=v.config.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, 0, False),
        )
        self.cpu = v.cpu.CPUOffloadingManager(
            num_chunks=self.host_chunks,
            cache_policy=config.policy,
            enable_events=True,
            store_threshold=config.threshold,
        )
        engine = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(
                prefix_cache_retention_interval=None, enable_prefix_caching=config.caching
            ),
            # EAGLE with a KV connector drops the volatile last block (no lookahead hashes)
            speculative_config=types.SimpleNamespace(use_eagle_block_drop=lambda: True) if config.eagle else None,
            parallel_config=types.SimpleNamespace(world_size=config.workers, decode_context_parallel_size=1),
        )
        self.offloading = v.scheduler.OffloadingConnectorScheduler(
            _spec_class(v)(offloading, self.cpu), engine, self.kv_config
        )
        self.connector = self.offloading
        self.scheduler = VllmScheduler(v, self.kvm, self.offloading, config.budget, LOOKAHEAD * config.eagle)
        self.worker = OffloadWorker(self.bpc)

    def submit(self, request: str, tokens: Sequence[int], max_new: int) -> None:
        super().submit(request, tokens, max_new)
        self.offloading.on_new_request(self.requests[request])

    def connector_finished(self, request: Request) -> bool:
        return bool(self.offloading.request_finished(request)[0])

    def reset(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: the device's cache, then the connector's. A second reset
        before the engine's next step fails the connector's assertion when the first flushed jobs in flight (finding
        22): the engine hands the error to the caller, the device's cache cleared, the connector's state unchanged;
        counted, and no clear reported (nothing more was cleared)."""
        if self.known_window_reset and self.stale_window_blocks():
            STATS.rules["planner.known: a reset re-offloads a running request's stale window blocks (finding 27)"] += 1
            self.host_cleared = False
            return False
        cleared: bool = self.kvm.reset_prefix_cache()
        if not cleared and self.host_published and self.known_silent_host_reset:
            # finding 23: the device refused (a block in use), so no AllBlocksCleared; the connector's reset below
            # empties the host tier and publishes no removal: a consumer keeps every CPU block. Counted, and the
            # consumer's view cleared, so the law goes on checking what follows
            STATS.rules["planner.known: a reset the device refuses empties the host tier silently (finding 23)"] += 1
            self.host_published.clear()
        if self.offloading._current_batch_jobs_to_flush and self.known_double_reset:
            STATS.rules["planner.known: a second reset before a step fails the connector's assertion (finding 22)"] += 1
            self.host_cleared = False
            return False
        self.offloading.reset_cache()
        self.host_cleared = True
        return cleared

    def stale_window_blocks(self) -> bool:
        """Whether a running request's window group, as the connector keeps its block ids, names a block its row no
        longer holds (it left the window: the null block there now)."""
        if self.window is None:
            return False
        for request_id, status in self.offloading._req_status.items():
            if request_id not in self.kvm.coordinator.single_type_managers[1].req_to_blocks:
                continue
            row = self.kvm.get_block_ids(request_id)[1]
            if any(kept and not now for kept, now in zip(status.group_states[1].block_ids, row, strict=False)):
                return True
        return False

    def submit_jobs(self, meta: object, forward: bool) -> tuple[tuple[Transfer, ...], tuple[Hashable, ...]]:
        return self.worker.submit(cast(ConnectorMeta, meta), forward)

    def done(self, transfer: Transfer, ok: Sequence[bool]) -> None:
        """The worker reports a job; with two workers the first reports now and the other a step later (the
        connector completes a job once every worker reported it; a load's request is in ``finished_recving`` once
        all have, as vLLM's output aggregator says)."""
        job, loading = self.worker.jobs.pop(transfer.op)
        worker = self.v.common.OffloadingWorkerMetadata
        recving = {loading} if loading is not None else set()
        if self.workers > 1:
            self._report(worker(completed_jobs={job: 1}), set())
            self.late.append((worker(completed_jobs={job: self.workers - 1}), recving))
        else:
            self._report(worker(completed_jobs={job: 1}), recving)

    def host_held(self) -> Counter[object]:
        """The hashes the host tier's events name its ready chunks by (one per chunk: its last block's)."""
        base, utils = self.v.base, self.v.utils
        return Counter(
            utils.maybe_convert_block_hash(base.get_offload_block_hash(key))
            for key, chunk in self.chunks().items()
            if chunk.ref_cnt != -1
        )

    def chunks(self) -> dict[Hashable, ChunkStatus]:
        return policy_chunks(self.cpu)

    def check_integrity(self, quiescent: bool) -> None:
        """The CPU manager's counts of its chunks; with nothing live and nothing in flight, nothing held anywhere."""
        cpu = self.cpu
        chunks = self.chunks()
        check_counts(cpu, chunks)
        held = [int(chunk.chunk_id) for chunk in chunks.values()]
        free = [*map(int, cpu._free_list), *range(cpu._num_allocated_chunks, self.host_chunks)]
        if sorted(held + free) != list(range(self.host_chunks)):
            raise IntegrityError(
                f"host_slots_are_conserved: chunks hold slots {sorted(held)}, free {sorted(free)}, of"
                f" {self.host_chunks}"
            )
        self.check_host_events()
        if not quiescent:
            return
        self.check_quiescent(
            {
                "host chunks pinned or pending": sum(chunk.ref_cnt != 0 for chunk in chunks.values()),
                "connector jobs": len(self.offloading._jobs),
                "connector requests": len(self.offloading._req_status),
            }
        )

    def reach(self) -> Mapping[str, int]:
        return {**super().reach(), "host blocks cached": len(self.chunks()) * self.bpc}


def _spec_class(v: types.ModuleType) -> type:
    """Our ``OffloadingSpec``: the CPU manager given, no worker (the machine is the worker)."""

    class Spec(v.base.OffloadingSpec):  # type: ignore[misc, name-defined]
        def __init__(self, config: object, manager: object) -> None:
            super().__init__(config)
            self.manager = manager

        def get_manager(self) -> object:
            return self.manager

        def get_worker(self, kv_caches: object) -> object:
            never(kv_caches)

    return Spec


PROFILE = Profile(
    name=f"vllm {VERSION} KV offloading as its engine runs it (KVCacheManager + OffloadingConnectorScheduler)",
    notes=(
        "vLLM's scheduler is replayed (FCFS, chunked prefill, preemption from the back when the pool is short);"
        " its KV cache manager and the connector's scheduler side are vLLM's own",
        "the worker is the machine: stores copied from the step after their job (or at a flush), loads landed as"
        " late as their report; both tiers' events replayed",
        "a second reset before a step fails the connector's assertion (finding 22, a bug), and a reset the device"
        " refuses empties the host tier with no event (finding 23, a bug): both counted",
        "with a window group, a reset while a request runs re-offloads its stale window blocks (finding 27, a bug):"
        " counted, and such a reset not taken",
    ),
)


# what vLLM's connector targets import: vLLM's wheel, its metrics, and what its KV events need
REQUIRES = (
    ("vllm", f"radixspec targets install vllm  (pip install --no-deps vllm=={VERSION} prometheus_client)"),
    ("prometheus_client", "radixspec targets install vllm  (pip install prometheus_client)"),
    ("msgspec", "radixspec targets install vllm  (pip install msgspec pyzmq: the device's KV events)"),
    ("zmq", "radixspec targets install vllm  (pip install msgspec pyzmq: the device's KV events)"),
)


def target(argument: str | None) -> TargetInfo:
    """``vllm-offload-connector`` (each example draws its policy), ``vllm-offload-connector:lru``, ``...:arc``."""
    if argument is not None and argument not in POLICIES:
        raise TargetError(f"vllm-offload-connector takes a policy ({', '.join(POLICIES)}), got {argument!r}")

    def factory(draw: int) -> VllmOffloadEngine:
        return VllmOffloadEngine(draw, argument)

    return TargetInfo(
        name="vllm-offload-connector" if argument is None else f"vllm-offload-connector:{argument}",
        description=f"vLLM {VERSION} KV offloading: KVCacheManager + OffloadingConnectorScheduler +"
        f" CPUOffloadingManager ({argument or 'lru, arc'})",
        requires=REQUIRES,
        planner_factory=factory,
        profile=PROFILE,
        how="the planner machine: vLLM's scheduler replayed, the connector's jobs run as its worker does (late,"
        " flushed)",
        probe=import_connector,
        engine_modules=CONNECTOR_MODULES,
    )


TARGET = target(None)
