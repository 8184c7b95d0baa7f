"""Target ``sglang-hicache``: SGLang 0.5.23's ``UnifiedRadixCache`` with HiCache on (a host tier behind the device
pool), driven through the scheduler's request lifecycle with the fuzzer as the executor of its transfers.

The cache is the ``sglang`` target's (``sglang_unified.py``: the FULL component, the paged allocator, the
scheduler's match, allocate, checkpoint and release), built with ``init_hicache``: SGLang's own
``HybridCacheController``, ``MHATokenToKVPoolHost``, ``HostPoolGroup`` and ``L2TransferEngine``. What the
scheduler adds with HiCache is written here from SGLang's code (``managers/schedule_policy.py``,
``managers/scheduler.py``): ``check_hicache_events`` at every step (write and load acks, pending backups
flushed); a match's host hit pinned and loaded back (``init_load_back`` under the match's device and host locks,
all of the hit or none, then ``ready_to_load_host_cache``); the forward waiting for the loads. Drawn per example:
the write policy (``write_through``, ``write_through_selective``: a backup after two hits, ``write_back``: on
eviction), the host tier's size (half the device pool to four times it), the page size, and a storage tier behind
the host (SGLang's file backend, by prefetch policy; ``sglang_hicache_storage.py``) or none. ``:swa`` adds the SWA
component (an SWA host pool beside the anchor's), ``:mamba`` the MAMBA component (a host pool of recurrent states:
``sglang_hicache_mamba.py``).

**The executor.** SGLang submits each transfer on a stream and polls its finish event. Here the streams are
``streams.Lane``s: a copy runs only when the machine's ``execute`` rule runs its stream (in stream order, the
two streams in any order), or when SGLang itself blocks on it (a ``synchronize``: write-back's eviction, the
forward's wait for its loads). So a backup may still be reading a device page, and a load writing one, while the
scheduler goes on: whatever SGLang frees or reuses before the finish event shows.

**What stands in, and why it cannot hide a bug of the tree or the controller** (docs/targets.md):

* the device module (``get_device_module()``): ``streams.Executor``'s, in place of ``torch.cuda``; the copies
  are deferred, never reordered within a stream, never dropped;
* ``sgl_kernel``'s ``transfer_kv_direct`` (the ``direct`` I/O backend, ``layer_first`` host layout): torch index
  copies of the same indices, per layer, K and V, put on the current stream; each one also reports its copies to
  the KV shadow (host slots are pool 1 of the shadow). Under the ``page_first_direct`` layout (drawn in half the
  examples), its two kernels ``transfer_kv_all_layer_direct_lf_pf`` and ``transfer_kv_per_layer_direct_pf_lf``:
  page copies as the kernels make them, each page named by the first of its indices (``page_first_copy``), the
  shadow moved by the slots each page copy covers;
* the device KV pool: per layer a K and a V tensor of one int64 per token, with the buffer description the host
  pool reads (``MHABufferInfo``); the host pool is SGLang's, unpinned (``pin_memory=False``);
* ``hybrid_pool_assembler``: its strategy for a flat MHA pool (``build_kv_only_stack`` and
  ``_apply_stack_result``), written again here because the module imports NCCL's allocator: one anchor host
  pool, the controller, the FULL component's host pool, the layer counter;
* the runtime context's getters (the HiCache arguments above, one rank, no storage), ``psutil`` (host memory
  ample), the data-parallel attention flag (off), SGLang's CUDA kernel modules (``never``: no CPU path calls
  them).

Checks, beside the ``sglang`` target's (the device hit by the spec's hit rule over the device pages the events
hold, the device events against the tree, SGLang's ``sanity_check``, the lifecycle laws with the KV shadow now
following every copy between the tiers):

* ``host_events_are_coherent``: the host tier's events store a page only where none is held and remove only
  pages held, each under a parent some event stored;
* ``host_hit_is_held``: a match's host hit covers only pages whose host copy the events announce;
* ``load_back_is_all_or_nothing``: a load back commits the whole host hit or none of it (the scheduler's own check);
* ``host_events_replay_to_the_pool``: the host pages the events hold (announced at a backup's ack), the host
  pool's free slots and the slots of backups not yet acknowledged make its size;
* ``free_lists_hold_no_page_twice``: neither the allocator's free pages nor the host pool's free slots repeat;
* ``transfers_hold_both_ends``: no page a copy in flight (or queued) reads or writes is free (on either tier) or
  a live request's own;
* ``idle_tiers_drain``: at the end of an example, every copy run and acknowledged, evicting both tiers whole
  leaves nothing cached and the host pool all free (a lock left on either tier shows here).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, cast

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError

from ..lifecycle import SLOTS_PER_POOL, KVCopy, Pool, StateShadow
from ..stats import STATS
from .releases import installed_release
from .sglang import VERSION
from .sglang_hicache_events import HostEvents
from .sglang_hicache_storage import PREFETCH_POLICIES, StorageLane
from .sglang_modules import import_unified_cache, mapping_pool
from .sglang_unified import MatchView, Record, SGLangUnifiedManager
from .shims import install, never, register, stub, stub_any
from .streams import Executor, Lane

if TYPE_CHECKING:
    import torch

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# the host tier's size, in device pools (SGLang's --hicache-ratio)
HOST_RATIOS = (0.5, 1.0, 2.0, 4.0)
# pages of 2 to 16 tokens: a host hit is loaded back from 10 tokens on (SGLang's load_back_threshold)
PAGE_SIZES = (2, 4, 8, 16)
# the storage tier (SGLang's file backend) by its prefetch policy; None: none. The third policy, ``timeout``, takes the
# place of ``wait_complete`` in half the examples (it waits as that one does, up to its deadline)
STORAGE = (None, *PREFETCH_POLICIES[:2])
# the host pools' layouts under the ``direct`` I/O backend: token rows by layer, or pages of every layer's rows
LAYOUTS = ("layer_first", "page_first_direct")
# the storage's space, in host tiers (SGLang's file evictor's max_size); None: unbounded
STORAGE_CAPACITIES = (None, None, 1.0, 0.5)
LAYERS = 2
# the rounds of every stream run and the scheduler's poll a flush waits at most for the tiers to be idle
FLUSH_ROUNDS = 8
# the pools of the KV shadow (fuzz/lifecycle.py): the device's full pool 0, its host tier 1, the storage 2
# (sglang_hicache_storage.py); with SWA, the device's SWA pool 3 and its host tier 4; with MAMBA, the state slots:
# the device's 5 and the host's 6 (sglang_hicache_mamba.py)
HOST_POOL = 1
SWA_DEVICE_POOL, SWA_HOST_POOL = 3, 4
MAMBA_DEVICE_POOL, MAMBA_HOST_POOL = 5, 6
POOL_NAMES = {
    0: "device",
    HOST_POOL: "host",
    SWA_DEVICE_POOL: "device SWA",
    SWA_HOST_POOL: "host SWA",
    MAMBA_DEVICE_POOL: "device state",
    MAMBA_HOST_POOL: "host state",
}
# the process's streams: SGLang's controller binds its device module once, when it is imported
EXECUTOR = Executor()
# SGLang's --hicache-* arguments as its runtime context gives them (set before each cache is built)
MEMORY = types.SimpleNamespace(
    hicache_host_memory_mode="cache",
    hicache_storage_backend=None,
    hicache_storage_backend_extra_config=None,
    hicache_storage_prefetch_policy="best_effort",
    hicache_write_policy="write_through",
    hicache_io_backend="direct",
    hicache_mem_layout="layer_first",
    hicache_ratio=2.0,
    hicache_size=0,
)


class CacheParams(Protocol):
    """What ``attach`` reads of SGLang's ``CacheInitParams``."""

    token_to_kv_pool_allocator: Allocator
    page_size: int


class Component(Protocol):
    """A component's host pool as ``_apply_stack_result`` sets it (FULL's, or SWA's)."""

    _full_kv_pool_host: object
    _swa_kv_pool_host: object


class UnifiedCache(Protocol):
    """What ``attach`` sets on SGLang's ``UnifiedRadixCache``, and calls for the SWA pool's reclaim."""

    host_pool_group: object
    cache_controller: object
    full_kv_pool_host: object
    swa_kv_pool_host: object
    components: Mapping[object, Component]

    def evict_host(self, num_tokens: int, component_type: object) -> int: ...

    def evict_for_alloc(self, params: object) -> object: ...


class SwaAllocator(Protocol):
    """What the SWA host pool's entry takes of SGLang's ``SWATokenToKVPoolAllocator``."""

    swa_attn_allocator: PagedAllocator

    def swa_available_size(self) -> int: ...


class PagedAllocator(Protocol):
    def alloc(self, need_size: int) -> object: ...

    def free(self, free_index: object) -> None: ...


class HostPages(Protocol):
    """What the checks read of a SGLang host pool: its free slots, those queued for release, its free size."""

    free_slots: torch.Tensor
    release_slots: list[torch.Tensor]

    def available_size(self) -> int: ...


class Allocator(Protocol):
    def get_kvcache(self) -> DeviceKV: ...


class DeviceKV(Protocol):
    """The allocator's KV pool as ``attach`` reads it: a ``DevicePool``, or with SWA the mapping pool of
    ``sglang_modules.mapping_pool`` over two of them."""

    tier: HostTier | None
    full_kv_pool: DevicePool | None
    swa_kv_pool: DevicePool | None

    def register_layer_transfer_counter(self, counter: object) -> None: ...


class KernelModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``sglang.kernels.*`` module: a package whose names are ``never`` (no CPU path calls a kernel)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name.startswith("sglang.kernels.") and name not in sys.modules:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = stub_any(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` as torch copies, put on the current stream: they run when the
    stream runs them. The tier that owns the destination hears of each copy (``HostTier.copied``)."""
    tier = HostTier.owner(dst_layers[0]) or HostTier.owner(src_layers[0])
    lane = EXECUTOR.current
    epoch = -1 if tier is None else tier.submitted(src_layers[0], dst_layers[0], src_indices, dst_indices)

    def run() -> None:
        for source, target in zip(src_layers, dst_layers, strict=True):
            target[dst_indices] = source[src_indices]
        if tier is not None:
            tier.copied(src_layers[0], dst_layers[0], src_indices, dst_indices, epoch)

    lane.enqueue(run)


def page_slots(indices: torch.Tensor, page_size: int, paged: bool) -> tuple[list[int], torch.Tensor]:
    """What a ``page_first_direct`` kernel reads of its indices: the first of each page's ``page_size``, and every
    token slot the page copy covers from there: ``page_size`` slots in a row on the device's side, the whole page
    it falls in on the host's (``paged``: a page-first buffer is indexed by page)."""
    import torch

    starts = indices[::page_size].tolist()
    firsts = [start - start % page_size if paged else start for start in starts]
    span = torch.arange(page_size, dtype=torch.int64)
    return starts, torch.cat([first + span for first in firsts]) if firsts else indices[:0].to(torch.int64)


def page_first_copy(
    sources: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    source_indices: torch.Tensor,
    target_indices: torch.Tensor,
    page_size: int,
    layer: int | None,
) -> None:
    """``sgl_kernel``'s two ``page_first_direct`` kernels of the KV host pool as torch copies on the current stream,
    page by page as the kernels copy (the first index of each page's ``page_size`` names the page; the rows after
    it follow, ``page_slots``): ``layer`` None, a backup of every layer (``sources`` the device's K layers then V
    layers, ``targets`` the host's K and V buffers, ``[page, layer, token, ...]``); else a load of that layer
    (``sources`` the host's K and V buffers, ``targets`` the device layer's K and V). The tier that owns the host
    buffer hears of each copy (``HostTier.copied``)."""
    backup = layer is None
    read, written = sources[0], targets[0]
    tier = HostTier.owner(written if backup else read)
    source_starts, source_slots = page_slots(source_indices, page_size, not backup)
    target_starts, target_slots = page_slots(target_indices, page_size, backup)
    epoch = -1 if tier is None else tier.submitted(read, written, source_slots, target_slots)
    sources, targets = list(sources), list(targets)

    def run() -> None:
        for source_start, target_start in zip(source_starts, target_starts, strict=True):
            if backup:
                layers = len(sources) // 2
                for j, source in enumerate(sources):
                    page = targets[j // layers][target_start // page_size, j % layers]
                    page.copy_(source[source_start : source_start + page_size])
            else:
                for source, target in zip(sources, targets, strict=True):
                    target[target_start : target_start + page_size] = source[source_start // page_size, layer]
        if tier is not None:
            tier.copied(read, written, source_slots, target_slots, epoch)

    EXECUTOR.current.enqueue(run)


def backup_page_first(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``transfer_kv_all_layer_direct_lf_pf`` as the KV host pool calls it (``page_first_copy``)."""
    page_first_copy(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size, None)


def load_page_first(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """``transfer_kv_per_layer_direct_pf_lf`` as the KV host pool calls it (``page_first_copy``)."""
    page_first_copy(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size, layer_id)


def import_hicache() -> types.ModuleType:
    """The unified cache's modules (``import_unified_cache``) and HiCache's, with the stand-ins above (once a
    process: the module registered under ``sglang.__radixspec_hicache__``)."""
    loaded = sys.modules.get("sglang.__radixspec_hicache__")
    if loaded is not None:
        return loaded
    release = installed_release("sglang")
    if release is not None and release != VERSION:
        raise ImportError(
            f"sglang-hicache drives SGLang {VERSION}'s HiCache only (its controller and host pools differ in other"
            f" releases): {release} is installed; radixspec targets install sglang"
        )
    v = import_unified_cache()
    device = EXECUTOR.module()
    stub("psutil", virtual_memory=lambda: types.SimpleNamespace(available=1 << 50, total=1 << 50))
    stub("sglang.srt.layers.dp_attention", is_dp_attention_enabled=lambda: False)
    # the unified targets stub HiCache's modules: the real ones now
    for name in ("sglang.srt.managers.cache_controller", "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"):
        sys.modules.pop(name, None)
    for name in ("sglang.srt.utils", "sglang.srt.utils.common"):
        install(
            sys.modules[name],
            get_device_module=lambda: device,
            is_xpu=lambda: False,
            is_mps=lambda: False,
            is_musa=lambda: False,
            broadcast_pyobj=never,
        )
    pools = sys.modules["sglang.srt.mem_cache.memory_pool"]
    for name in ("MLATokenToKVPool", "HybridLinearKVPool", "MHATokenToKOnlyPool", "MLATokenToKVPoolFP4"):
        install(pools, **{name: type(name, (), {})})
    if not any(isinstance(finder, KernelModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, KernelModules())
    for name in ("sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.kvcache", "sglang.kernels.ops.memory"):
        sys.modules[name].__path__ = []
    for name in ("sglang.kernels.ops.kvcache.hicache", "sglang.kernels.ops.kvcache.hisparse"):
        stub_any(
            name, can_use_hicache_jit_kernel=lambda *a, **k: False, can_use_write_back_jit_kernel=lambda *a, **k: False
        )
    stub_any("sglang.srt.distributed.parallel_state")
    if "sglang.srt.mem_cache.page_interleave_pool" not in sys.modules:
        interleave = stub_any(
            "sglang.srt.mem_cache.page_interleave_pool",
            PageInterleaveKVPoolMixin=type("PageInterleaveKVPoolMixin", (), {}),
        )
        install(sys.modules["sglang.srt.mem_cache"], page_interleave_pool=interleave)
    stub_any(
        "sglang.srt.mem_cache.pool_host.page_interleave", PageInterleaveHostPool=type("PageInterleaveHostPool", (), {})
    )
    context = importlib.import_module("sglang.srt.runtime_context")
    getters = {
        "get_memory": lambda: MEMORY,
        "get_parallel": lambda: types.SimpleNamespace(
            attn_dcp_rank=0, attn_dcp_size=1, launch_world_size=1, nnodes=1, pp_group=None, dcp_enabled=False
        ),
        "get_model": lambda: types.SimpleNamespace(context_length=1 << 16),
        "get_observability": lambda: types.SimpleNamespace(extra_metric_labels=None),
        "get_serving": lambda: types.SimpleNamespace(served_model_name="radixspec"),
    }
    install(context, **getters)
    stub_any("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler", attach_hybrid_pool_to_unified_cache=attach)
    # a host pool no larger than its device pool is drawn on purpose (half the device pool and up): its warning on
    # every cache built is set to errors
    logging.getLogger("sglang.srt.mem_cache.pool_host.base").setLevel(logging.ERROR)
    mha = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
    install(
        mha,
        transfer_kv_direct=transfer_kv_direct,
        transfer_kv_all_layer_direct_lf_pf=backup_page_first,
        transfer_kv_per_layer_direct_pf_lf=load_page_first,
    )
    controller = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
    for name in ("sglang.srt.mem_cache.pool_host.common", "sglang.srt.mem_cache.pool_host.base", v.urc.__name__):
        module = importlib.import_module(name)
        install(module, **{getter: value for getter, value in getters.items() if hasattr(module, getter)})
    install(v.urc, HybridCacheController=controller.HybridCacheController)
    return register(
        "sglang.__radixspec_hicache__",
        v=v,
        mha=mha,
        controller=controller,
        group=importlib.import_module("sglang.srt.mem_cache.pool_host.group"),
        info=importlib.import_module("sglang.srt.mem_cache.device_pool_info"),
        storage=importlib.import_module("sglang.srt.mem_cache.hicache_storage"),
    )


class DevicePool:
    """The device KV pool as the host pool reads it: per layer a K and a V tensor, one int64 per token (the
    allocator's page 0 and a padding page included), and the mapping hooks the allocator calls."""

    full_kv_pool = None
    swa_kv_pool = None
    swa_req_ring_size = None
    host_capacity_tokens = None
    hicache_write_back_staging = None
    # the tier that built it (attach reads it)
    tier: HostTier | None = None

    def __init__(self, size: int, page_size: int) -> None:
        import torch

        self.torch, self.size, self.page_size, self.device = torch, size, page_size, "cpu"
        self.layer_num, self.start_layer, self.end_layer = LAYERS, 0, LAYERS
        shape = (size + page_size, 1, 1)
        self.k = tuple(torch.full(shape, -1, dtype=torch.int64) for _ in range(LAYERS))
        self.v = tuple(torch.full(shape, -1, dtype=torch.int64) for _ in range(LAYERS))
        self.counter: object = None

    def get_device_pool_infos(self) -> list[types.SimpleNamespace]:
        m, t = import_hicache(), self.torch

        def pointers(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
            table: torch.Tensor = t.tensor([tensor.data_ptr() for tensor in tensors], dtype=t.uint64)
            return table

        buffers = m.info.KVBuffers(
            k=self.k,
            v=self.v,
            k_data_ptrs=pointers(self.k),
            v_data_ptrs=pointers(self.v),
            layout=m.info.KVBufferLayout.NHD,
        )
        info = m.info.MHABufferInfo(
            buffers=buffers,
            page_size=self.page_size,
            head_num=1,
            head_dim=1,
            v_head_dim=1,
            dtype=t.int64,
            device=t.device("cpu"),
        )
        return [types.SimpleNamespace(buffer_info=info)]

    def register_layer_transfer_counter(self, counter: object) -> None:
        self.counter = counter

    def get_kv_size_bytes(self) -> int:
        return 2 * LAYERS * (self.size + self.page_size) * 8

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        return [], [], []


def attach(
    cache: UnifiedCache,
    params: CacheParams,
    server_args: object,
    *,
    load_cache_event: object,
    storage_backend: str | None = None,
    storage_extra_config: dict[str, object] | None = None,
    storage_prefetch_threshold: int = 256,
) -> None:
    """``attach_hybrid_pool_to_unified_cache`` for our device pools, as SGLang's strategies build the host pools:
    for a flat MHA pool and the FULL component the kv-only one (``build_kv_only_stack``: one anchor host pool);
    for an SWA pool and FULL + SWA ``_SwaStrategy`` (``build_hybrid_swa_group``: the anchor over the full pool, an
    SWA host pool beside it, reclaimed by evicting the SWA component on either tier, its device slots from the SWA
    allocator; transfer layers numbered full first, then SWA). Then the controller and ``_apply_stack_result``
    (each component's host pool, the device pool's layer counter)."""
    m = import_hicache()
    allocator = params.token_to_kv_pool_allocator
    kvcache = allocator.get_kvcache()
    tier = kvcache.tier
    assert tier is not None, "the device pool of a HiCache target names its tier"
    names, components = m.storage.PoolName, m.v.components

    def host_pool(device: DevicePool, pages: int, label: str) -> object:
        return m.mha.MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            MEMORY.hicache_ratio,
            0,
            params.page_size,
            MEMORY.hicache_mem_layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            pool_label=label,
            host_token_capacity=pages * params.page_size,
        )

    def mapper(layers: dict[int, int], bound: int) -> Callable[[int], int | None]:
        return lambda layer: layers.get(layer) if 0 <= layer < bound else None

    swa = kvcache.swa_kv_pool
    # the anchor: the flat pool, or with SWA the full one (labelled as SGLang labels each)
    anchor = cast(DevicePool, kvcache) if swa is None else kvcache.full_kv_pool
    assert anchor is not None, "an SWA pool has a full pool beside it"
    # transfer layers: full attention first, then SWA's or the state layer
    bound = LAYERS if swa is None else 2 * LAYERS
    bound += tier.states is not None
    entries = [
        m.group.PoolEntry(
            name=names.KV,
            host_pool=host_pool(anchor, tier.host_pages, "kv" if swa is None else "full"),
            device_pool=anchor,
            layer_mapper=mapper({layer: layer for layer in range(LAYERS)}, bound),
            is_primary_index_anchor=True,
        )
    ]
    if swa is not None:
        swa_allocator = cast(SwaAllocator, allocator).swa_attn_allocator

        def device_evict(size: int) -> None:
            # _evict_swa_for_device_alloc: the SWA shortfall evicted from the device
            shortfall = size - int(cast(SwaAllocator, allocator).swa_available_size())
            if shortfall > 0:
                cache.evict_for_alloc(m.v.base.EvictParams(swa_num_tokens=shortfall))

        entries.append(
            m.group.PoolEntry(
                name=names.SWA,
                host_pool=host_pool(swa, tier.swa_host_pages, "swa"),
                device_pool=swa,
                layer_mapper=mapper({LAYERS + layer: layer for layer in range(LAYERS)}, bound),
                host_evict_fn=lambda size: cache.evict_host(size, components.SWA),
                device_evict_fn=device_evict,
                device_alloc_fn=swa_allocator.alloc,
                device_free_fn=swa_allocator.free,
            )
        )
    if tier.states is not None:
        entries.append(tier.states.entry(cache, params, bound))
    group = m.group.HostPoolGroup(entries)
    controller = m.controller.HybridCacheController(
        allocator,
        group,
        params.page_size,
        None,
        load_cache_event=load_cache_event,
        write_policy=MEMORY.hicache_write_policy,
        io_backend=MEMORY.hicache_io_backend,
        storage_backend=storage_backend,
        prefetch_threshold=storage_prefetch_threshold,
        transfer_layer_id_max=bound,
        host_memory_mode=MEMORY.hicache_host_memory_mode,
    )
    cache.host_pool_group, cache.cache_controller = group, controller
    cache.full_kv_pool_host = group.get_pool(names.KV)
    cache.components[components.FULL]._full_kv_pool_host = cache.full_kv_pool_host
    if swa is not None:
        cache.swa_kv_pool_host = group.get_pool(names.SWA)
        cache.components[components.SWA]._swa_kv_pool_host = cache.swa_kv_pool_host
    if tier.states is not None:
        tier.states.attach(cache, params, controller)
    kvcache.register_layer_transfer_counter(controller.layer_done_counter)


class StateTier(Protocol):
    """The MAMBA component's host tier as ``HostTier`` calls it (``sglang_hicache_mamba.HostStates``)."""

    # the state host pool's slots, the pool, and the shadow of what each slot's state is of
    slots: int
    host: object
    shadow: StateShadow

    def entry(self, cache: object, params: object, bound: int) -> object: ...
    def attach(self, cache: object, params: object, controller: object) -> None: ...
    def free_lists(self, m: SGLangUnifiedManager) -> dict[int, list[int]]: ...
    def host_free(self) -> int: ...


def storage_pools(m: SGLangUnifiedManager, states: StateTier | None) -> list[tuple[object, int | StateTier]]:
    """The host pools whose pages the storage tier writes to files and reads back, each with its pool in the KV
    shadow (the full KV's; SWA's) or, for the states, the MAMBA component's host tier."""
    group = m.cache.cache_controller.mem_pool_host
    names = import_hicache().storage.PoolName
    pools: list[tuple[object, int | StateTier]] = [(m.cache.cache_controller.storage_host_pool, HOST_POOL)]
    if m.swa is not None:
        pools.append((group.get_pool(names.SWA), SWA_HOST_POOL))
    if states is not None:
        pools.append((states.host, states))
    return pools


def busy_transfers(m: SGLangUnifiedManager, lanes: Sequence[Lane | StorageLane]) -> list[str]:
    """What keeps SGLang's ``Scheduler.is_fully_idle`` false under HiCache (sglang PR #20746), and our streams' pending
    copies: empty when a flush may run."""
    c = m.cache
    busy = {
        # a write-through backup submitted and not acknowledged, or still queued
        "ongoing_write_through": len(c.ongoing_write_through) + len(c.cache_controller.write_queue),
        # a load back not acknowledged
        "ongoing_load_back": len(c.ongoing_load_back),
        # with storage: a prefetch, or a backup to storage, not over
        "ongoing_prefetch": len(c.ongoing_prefetch) if c.enable_storage else 0,
        "ongoing_backup": len(c.ongoing_backup) if c.enable_storage else 0,
        # a copy of our streams not run
        "copies pending": sum(lane.pending for lane in lanes),
    }
    return [f"{name} {count}" for name, count in busy.items() if count]


class HostTier:
    """HiCache's host tier for one manager (``sglang_unified.TierComponent``): builds it, runs the scheduler's
    part of it, follows its copies and checks its laws."""

    # the live tiers by the storage of their tensors, with the pool each is: a copy names the tier it reads or
    # writes (weakly held: a campaign builds a tier per example)
    by_storage: ClassVar[dict[int, tuple[weakref.ref[HostTier], int]]] = {}

    def __init__(self, policy: str, ratio: float, storage: str | None = None) -> None:
        self.policy, self.ratio = policy, ratio
        # the storage tier's prefetch policy (None: no storage tier), and the tier once attached
        self.storage_policy = storage
        # whether the storage's files fail now and then (a write refused, a read finding no file: StorageLane)
        self.storage_faults = False
        # the storage's space in host tiers (SGLang's file evictor's max_size: as many pages as it holds, or a
        # fraction; None: unbounded)
        self.storage_capacity: float | None = None
        # the host pools' layout (``LAYOUTS``)
        self.layout = LAYOUTS[0]
        self.storage: StorageLane | None = None
        self.host_pages = self.swa_host_pages = 0
        self.lanes: list[Lane | StorageLane] = []
        self.copies: list[KVCopy] = []
        # slots (pool * SLOTS_PER_POOL + slot) that copies in flight read or write, with how many copies
        self.reading: Counter[int] = Counter()
        self.writing: Counter[int] = Counter()
        # flushes so far: a copy in flight at a flush is orphaned (its slots no longer the cache's)
        self.epoch = 0
        # the host tier's events as a consumer replays them
        self.events = HostEvents()
        self.loads = 0
        # with a MAMBA component, its host tier (sglang_hicache_mamba.py: set by the target)
        self.states: StateTier | None = None

    @classmethod
    def owner(cls, tensor: torch.Tensor) -> HostTier | None:
        found = cls.by_storage.get(tensor.untyped_storage().data_ptr())
        return None if found is None else found[0]()

    def pool_of(self, tensor: torch.Tensor) -> int:
        return self.by_storage[tensor.untyped_storage().data_ptr()][1]

    def register(self, tensors: Sequence[torch.Tensor], pool: int) -> None:
        """The tensors of this tier's pool ``pool`` (0 the device's, 1 the host's); entries of dead tiers go."""
        for key in [key for key, (tier, _) in HostTier.by_storage.items() if tier() is None]:
            del HostTier.by_storage[key]
        for tensor in tensors:
            HostTier.by_storage[tensor.untyped_storage().data_ptr()] = (weakref.ref(self), pool)

    # ------------------------------------------------------------ building

    def device_pool(self, m: SGLangUnifiedManager) -> object:
        """The device KV pool of the cache's allocator: one ``DevicePool``; with SWA, a full and an SWA one under
        the SWA allocator's mapping pool. Each host pool holds ``ratio`` times its device pool's pages."""
        p = m.page_size
        self.host_pages = max(1, int(m.num_pages * self.ratio))
        self.device = DevicePool(m.num_pages * p, p)
        self.register((*self.device.k, *self.device.v), 0)
        self.device.tier = self
        if m.swa is None:
            return self.device
        self.swa_host_pages = max(1, int(m.swa.pages * self.ratio))
        self.swa_device = DevicePool(m.swa.pages * p, p)
        self.register((*self.swa_device.k, *self.swa_device.v), SWA_DEVICE_POOL)
        return mapping_pool(m.v, self.device, self.swa_device, self)

    def kv_pools(self, windows: tuple[hy.Window, ...]) -> tuple[int, ...]:
        """The shadow's pool of each group: full attention the device's pool 0, a window the SWA pool."""
        return tuple(0 if window is None else SWA_DEVICE_POOL for window in windows)

    def attach(self, m: SGLangUnifiedManager, params: object) -> None:
        import_hicache()
        MEMORY.hicache_write_policy, MEMORY.hicache_mem_layout = self.policy, self.layout
        m.cache.init_hicache(types.SimpleNamespace(file_storage_path=None), params)
        # init_hicache registers the cache's shutdown to run at exit (one cache a process in SGLang; a campaign
        # builds one per example, which that reference would keep alive to the end)
        atexit.unregister(m.cache.shutdown)
        # the controller's two streams: device to host, host to device
        engine = m.cache.cache_controller.l2_transfer_engine
        self.lanes = [engine.device_to_host_stream, engine.host_to_device_stream]
        if self.storage_policy is not None:
            pools = storage_pools(m, self.states)
            capacity = None if self.storage_capacity is None else max(1, int(self.host_pages * self.storage_capacity))
            self.storage = StorageLane(
                self.storage_policy, self.copies, m, import_hicache(), pools, self.storage_faults, capacity
            )
            self.lanes.append(self.storage)
        if m.swa is not None:
            self.events.follow(m)
        names = import_hicache().storage.PoolName
        host = m.cache.cache_controller.mem_pool_host.get_pool(names.KV)
        self.register((*host.k_data_refs, *host.v_data_refs), HOST_POOL)
        self.host = host
        if m.swa is not None:
            swa = m.cache.cache_controller.mem_pool_host.get_pool(names.SWA)
            self.register((*swa.k_data_refs, *swa.v_data_refs), SWA_HOST_POOL)
            self.swa_host = swa

    # ------------------------------------------------------------ the copies

    def submitted(self, read: torch.Tensor, written: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> int:
        """A copy put on a stream (from tensor ``read`` to ``written``): its slots are in flight until it runs.
        Returns the reset epoch it belongs to."""
        self.flight(self.pool_of(read), self.pool_of(written), sources, targets, 1)
        return self.epoch

    def copied(
        self, read: torch.Tensor, written: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor, epoch: int
    ) -> None:
        """A copy ran: the shadow follows it; its slots leave the flight (unless a reset orphaned it)."""
        into, source_pool = self.pool_of(written), self.pool_of(read)
        for source, slot in zip(sources.tolist(), targets.tolist(), strict=True):
            self.copies.append(KVCopy(into, source, slot, 1, source_pool))
        if epoch == self.epoch:
            self.flight(source_pool, into, sources, targets, -1)

    def flight(self, source_pool: int, into: int, sources: torch.Tensor, targets: torch.Tensor, sign: int) -> None:
        """A copy's slots (``sources`` of pool ``source_pool``, ``targets`` of ``into``) enter the flight (``sign``
        1) or leave it (-1)."""
        for source, slot in zip(sources.tolist(), targets.tolist(), strict=True):
            self.reading[source_pool * SLOTS_PER_POOL + source] += sign
            self.writing[into * SLOTS_PER_POOL + slot] += sign
        self.reading, self.writing = +self.reading, +self.writing

    def take_kv_copies(self) -> list[KVCopy]:
        # emptied in place: the storage tier appends to the same list
        taken = list(self.copies)
        self.copies.clear()
        return taken

    def incoming_kv(self) -> set[int]:
        return set(self.writing)

    def execute(self, lane: int, count: int) -> None:
        ran = self.lanes[lane % len(self.lanes)].step(count)
        if ran:
            STATS.record_rule(f"sglang-hicache.execute[{('to host', 'to device', 'storage')[lane % len(self.lanes)]}]")

    # ------------------------------------------------------------ the scheduler's part

    def step(self, m: SGLangUnifiedManager, req: HybridReq | None = None, release: bool = False) -> None:
        """The scheduler's per-step poll: acks of finished writes and loads, backups still queued submitted; before a
        request's match, with a storage tier, its prefetch (``StorageLane.arrive``). With MAMBA, before a request's
        release its batch's forward ran, which waited for its loads: one may write the request's own state slot (a
        KV load writes the tree's pages, under the load's own lock, and may still be in flight then)."""
        if release and self.states is not None:
            self.forward(m)
        m.cache.check_hicache_events()
        STATS.record_reach(most_transfers_in_flight=sum(lane.pending for lane in self.lanes))
        if self.storage is not None:
            self.storage.poll()
        if req is not None and self.storage is not None:
            self.storage.arrive(m, req)

    def device_events(self, m: SGLangUnifiedManager, events: list[object]) -> list[object]:
        """The device tier's events, for the manager's replay; the host tier's replayed here (``HostEvents``)."""
        return self.events.replay(m, events)

    def host_pages_held(self, m: SGLangUnifiedManager) -> set[pc.PageKey]:
        m.cached_pages()
        return set(self.events.host_held.values())

    def load_back(
        self, m: SGLangUnifiedManager, req: HybridReq, record: Record, result: MatchView
    ) -> tuple[int, object]:
        """The match's host hit: pinned (the match's node and the host node locked, as the prefill adder does),
        loaded back whole or not at all, and the load started (``ready_to_load_host_cache``)."""
        v, hit, host_hit = m.v, int(result.device_prefix_len), int(result.host_hit_length)
        last = result.last_device_node
        # with SWA, the device hit may end in a window whose SWA KV is on the host only: loaded back the same way
        # (the scheduler's needs_host_load_back)
        record.swa_host_hit_length = int(result.swa_host_hit_length) if m.swa is not None else 0
        # with MAMBA, likewise a device hit whose state is on the host only
        record.mamba_host_hit_length = int(result.mamba_host_hit_length) if m.mamba is not None else 0
        if not host_hit and not record.swa_host_hit_length and not record.mamba_host_hit_length:
            return hit, last
        if not host_hit:
            only = "SWA" if record.swa_host_hit_length else "state"
            STATS.record_rule(f"sglang-hicache.match[{only} host hit only]")
        passed = self.events.check_host_hit(m, req, hit, host_hit)
        STATS.record_rule("sglang-hicache.match[host hit]")
        best = result.best_match_node
        host_lock = m.cache.inc_host_lock_ref(best).to_dec_params()
        lock = m.cache.lock(last)
        try:
            loaded = m.cache.init_load_back(
                v.base.InitLoadBackParams(best_match_node=best, host_hit_length=host_hit, req=record)
            )
        finally:
            m.cache.unlock(lock)
            m.cache.dec_host_lock_ref(best, host_lock)
        if loaded is None:
            return hit, last
        length, node = int(loaded[0]), loaded[1]
        if 0 < length < host_hit + passed:
            raise IntegrityError(
                f"load_back_is_all_or_nothing: request {req.uid}'s host hit of {host_hit} tokens loaded {length}"
            )
        if not length:
            short = host_hit < m.cache.load_back_threshold
            STATS.record_rule(f"sglang-hicache.load_back[declined: {'too short' if short else 'no room'}]")
            return hit, last
        STATS.record_rule("sglang-hicache.load_back")
        self.loads += 1
        # a new prefill batch: the batch before the previous one ran its forward, which waited for its loads
        # (overlap scheduling keeps one batch ahead; SGLang's layer counter has a slot for each)
        for ack in m.cache.cache_controller.ack_load_queue[:-1]:
            ack.finish_event.synchronize()
        m.cache.ready_to_load_host_cache()
        return hit + length, node

    def before_reset(self, m: SGLangUnifiedManager) -> None:
        """Before ``flush_cache``: SGLang flushes only a fully idle scheduler (``is_fully_idle``); a flush asked
        before that is refused, or deferred until then (``SchedulerFlushWrapper``). So every copy runs and is
        acknowledged first, in rounds (a write-through's ack may queue a backup to storage). A backup left in flight
        over the reset would write, when run, a host slot given out again since (a prefetch's, then loaded back)."""
        in_flight = bool(busy_transfers(m, self.lanes))
        self.forward(m)
        if self.storage is not None:
            self.storage.abort_waiting()
        # a write-through's copy, its ack, the backup to storage the ack queues and that one's ack: three rounds
        for _ in range(FLUSH_ROUNDS):
            for lane in self.lanes:
                lane.synchronize()
            self.step(m)
            if not (busy := busy_transfers(m, self.lanes)):
                break
        else:
            raise IntegrityError(f"flush_waits_for_idle: after {FLUSH_ROUNDS} rounds the tiers are busy: {busy}")
        self.reading.clear()
        self.writing.clear()
        self.epoch += 1
        STATS.record_rule(f"sglang-hicache.flush[{'deferred until the transfers were done' if in_flight else 'idle'}]")

    def forward(self, m: SGLangUnifiedManager) -> None:
        """A forward: it waits for the loads it reads (SGLang's layer counter), which finishes them."""
        if self.lanes:
            self.lanes[1].synchronize()

    def evict_tiers(self, m: SGLangUnifiedManager, tiers: int) -> None:
        """Pressure: everything evictable on the device evicted (``evict``, as an allocation short of pages calls
        it), what was backed up staying on the host; with ``tiers`` 2 the host tier too (``evict_host``), what was
        backed up to storage staying there. Before a host eviction the backups have caught up (time passed: the
        copies to the host ran and were acknowledged, the storage workers wrote what that queued)."""
        if tiers > 1:
            for lane in self.lanes[::2]:
                lane.synchronize()
                self.step(m)
        evictable = int(m.cache.full_evictable_size())
        if evictable:
            STATS.record_rule("sglang-hicache.evict[whole device]")
            m.cache.evict(m.v.base.EvictParams(num_tokens=evictable))
        held = len(self.host_pages_held(m)) * m.page_size
        if tiers > 1 and held:
            STATS.record_rule("sglang-hicache.evict[whole host]")
            m.cache.evict_host(held)

    def drain(self, m: SGLangUnifiedManager) -> None:
        """At idle (no request runs): every copy run and acknowledged, then the device tier evicted whole and the
        host tier after it, a few rounds (write-back backs up what it evicts). Nothing may stay: a lock left on either
        tier (a host lock a split kept, a load's pin never released) holds pages that stay (``idle_tiers_drain``)."""
        assert not m.records, f"a drain with {len(m.records)} requests running"
        p = m.page_size
        if self.storage is not None:
            self.storage.abort_waiting()
        for _ in range(3):
            for lane in self.lanes:
                lane.synchronize()
            self.step(m)
            device = int(m.cache.full_evictable_size())
            if device:
                m.cache.evict(m.v.base.EvictParams(num_tokens=device))
            for lane in self.lanes:
                lane.synchronize()
            self.step(m)
            host = len(self.host_pages_held(m)) * p
            if host:
                m.cache.evict_host(host)
        # the tier's own laws first: a slot lost or freed twice on the way names its law
        self.check(m, [])
        if self.storage is not None:
            self.storage.check_idle()
        device_left = int(m.cache.full_evictable_size() + m.cache.full_protected_size()) // p
        host_left, host_free = len(self.host_pages_held(m)), int(self.host.available_size()) // p
        swa_free = self.swa_host_pages if m.swa is None else int(self.swa_host.available_size()) // p
        states_held = 0 if self.states is None else self.states.slots - self.states.host_free()
        if device_left or host_left or host_free != self.host_pages or swa_free != self.swa_host_pages or states_held:
            raise IntegrityError(
                f"idle_tiers_drain: with no request running and every copy acknowledged, evicting both tiers whole"
                f" left {device_left} device pages and {host_left} host pages cached; the host pool has {host_free}"
                f" of {self.host_pages} pages free"
                + ("" if m.swa is None else f", the SWA host pool {swa_free} of {self.swa_host_pages}")
                + ("" if self.states is None else f", the state host pool {states_held} slots held")
            )
        STATS.record_rule("sglang-hicache.drain")

    # ------------------------------------------------------------ checks

    def checkable(self, m: SGLangUnifiedManager) -> bool:
        """Whether SGLang's ``sanity_check`` holds now: not while a write-through load back is in flight (a node
        split off a host-only one and loaded is on both tiers but joins the duplicate tracking only at the ack; the
        check, on either core, calls it missing: a false alarm of SGLang's check,
        ``test_sanity_check_misreads_a_split_node_loaded_back``)."""
        if self.policy == "write_back" or not m.cache.ongoing_load_back:
            return True
        STATS.record_rule("sglang-hicache.sanity_check[not run: a load back in flight]")
        return False

    def writing_tokens(self, m: SGLangUnifiedManager) -> int:
        """Host slots of backups not yet acknowledged (queued, or submitted and unacked): their pages enter the
        events at the ack (``finish_write_through``); slots queued for release (a prefetch's pages the tree already
        held), freed at the next poll (``_drain_release``); and the storage prefetches' (``StorageLane.holding``)."""
        controller = m.cache.cache_controller
        queued = sum(len(op.host_indices) for op in controller.write_queue)
        release = controller.host_mem_release_queue
        releasing = 0 if release is None else sum(len(page) for page in list(release.queue))
        prefetching = 0 if self.storage is None else self.storage.holding()
        return queued + releasing + prefetching + sum(int(ack.num_tokens) for ack in controller.ack_write_queue)

    @staticmethod
    def free_host_slots(host: HostPages) -> list[int]:
        """A host pool's free slots: its free list and the slots queued for release."""
        return host.free_slots.tolist() + [slot for part in host.release_slots for slot in part.tolist()]

    def pool(self, m: SGLangUnifiedManager) -> Pool:
        p = m.page_size
        held = self.host_pages_held(m)
        free, writing = int(self.host.available_size()) // p, self.writing_tokens(m) // p
        return Pool("host", free, len(held), writing, self.host_pages)

    def check(self, m: SGLangUnifiedManager, live_reqs: list[HybridReq]) -> None:
        p = m.page_size
        held = self.host_pages_held(m)
        names = import_hicache().storage.PoolName
        # per pool of the shadow, its free slots: the allocators' free pages, the host pools' free slots
        alloc = getattr(m.alloc, "full_attn_allocator", m.alloc)
        free_lists = {0: [s for page in alloc.get_all_free_pages().tolist() for s in range(page * p, page * p + p)]}
        free_lists[HOST_POOL] = free_host = self.free_host_slots(self.host)
        # the pools a queued copy names (the anchor's, and each side pool's by its name)
        pools = {names.KV: (0, HOST_POOL)}
        if m.swa is not None:
            swa = m.alloc.swa_attn_allocator.get_all_free_pages().tolist()
            free_lists[SWA_DEVICE_POOL] = [s for page in swa for s in range(page * p, page * p + p)]
            free_lists[SWA_HOST_POOL] = self.free_host_slots(self.swa_host)
            pools[names.SWA] = (SWA_DEVICE_POOL, SWA_HOST_POOL)
        if self.states is not None:
            free_lists.update(self.states.free_lists(m))
            pools[names.MAMBA] = (MAMBA_DEVICE_POOL, MAMBA_HOST_POOL)
        for pool, slots in free_lists.items():
            twice = [slot for slot, count in Counter(slots).items() if count > 1]
            if twice:
                raise IntegrityError(
                    f"free_lists_hold_no_page_twice: the {POOL_NAMES[pool]} pool's free slots hold {twice[0]} twice"
                )
        # a copy in flight reads or writes the tree's pages: none of them free, none a request's own
        free = {pool * SLOTS_PER_POOL + slot: "free" for pool, slots in free_lists.items() for slot in slots}
        for req in live_reqs:
            kv = m.records[req.uid].kv
            own = m.row(m.records[req.uid], kv.kv_allocated_len)[kv.cache_protected_len :]
            for slot in own:
                free[slot] = f"request {req.uid}'s own"
            if m.swa is not None:
                for swa_slot in m.swa.column(m, own):
                    if swa_slot is not None:
                        free[SWA_DEVICE_POOL * SLOTS_PER_POOL + swa_slot] = f"request {req.uid}'s own"
        reading, writing = set(self.reading), set(self.writing)
        # and the copies SGLang queued but has not put on a stream yet (``write_queue``, ``load_queue``)
        controller = m.cache.cache_controller
        for queue, to_host in ((controller.write_queue, True), (controller.load_queue, False)):
            for op in queue:
                parts = [(names.KV, op.device_indices, op.host_indices)]
                parts += [(t.name, t.device_indices, t.host_indices) for t in op.pool_transfers or ()]
                for name, device, host in parts:
                    if device is None or host is None:
                        continue
                    device_pool, host_pool = pools[name]
                    device_slots = {device_pool * SLOTS_PER_POOL + slot for slot in device.tolist()}
                    host_slots = {host_pool * SLOTS_PER_POOL + slot for slot in host.tolist()}
                    reading |= device_slots if to_host else host_slots
                    writing |= host_slots if to_host else device_slots
        for what, ends in (("reads", reading), ("writes", writing)):
            busy = sorted(ends & free.keys())
            if busy:
                pool, slot = divmod(busy[0], SLOTS_PER_POOL)
                raise IntegrityError(
                    f"transfers_hold_both_ends: a copy in flight or queued {what} {POOL_NAMES[pool]} slot {slot},"
                    f" which is {free[busy[0]]}"
                )
        unacked = self.writing_tokens(m)
        if len(held) * p + len(free_host) + unacked != self.host_pages * p:
            raise IntegrityError(
                f"host_events_replay_to_the_pool: the events hold {len(held)} host pages, the host pool has"
                f" {len(free_host)} free slots and copies in flight (backups, prefetches, slots queued for release)"
                f" hold {unacked}, of {self.host_pages * p}"
            )
        STATS.record_reach(largest_host_pages=len(held))
