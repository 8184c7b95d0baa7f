"""SGLang 0.5.23's unified radix cache as the ``sglang-unified``, ``sglang-swa`` and ``sglang-mamba`` targets load it:
the cache, its tree cores and components, the SWA allocator and the parameter types, from the installed wheel with
bare packages and stand-ins for what the cache never calls (triton kernels, HiCache, metrics, the scheduler's
request type); and the KV pool as the allocator sees it (``mapping_pool``: the full-to-SWA index mapping, no
tensors). One process holds either these stubs or the legacy ``sglang`` target's, not both (``probe``)."""

from __future__ import annotations

import importlib
import os
import sys
import types
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .shims import (
    bare,
    compiled_from,
    import_with_stand_ins,
    importable,
    install,
    package_root,
    register,
    stub,
    stub_any,
)

if TYPE_CHECKING:
    import torch

# the unified cache's modules --coverage measures: the cache, each tree core's, each component's (with its
# allocator), and HiCache's (the controller, the host pool, the storage backends)
MEM_CACHE = "sglang.srt.mem_cache"
UNIFIED_MODULES = (
    f"{MEM_CACHE}.unified_radix_cache",
    f"{MEM_CACHE}.unified_cache.components.base",
    f"{MEM_CACHE}.unified_cache.components.full",
    f"{MEM_CACHE}.allocator.paged",
)
CORE_MODULES = {
    "rust": (f"{MEM_CACHE}.rust_tree_core.adapter",),
    "python": (f"{MEM_CACHE}.unified_cache.unified_tree_core",),
}
COMPONENT_MODULES = {
    "swa": (f"{MEM_CACHE}.unified_cache.components.swa", f"{MEM_CACHE}.allocator.swa"),
    "mamba": (f"{MEM_CACHE}.unified_cache.components.mamba", f"{MEM_CACHE}.allocator.mamba"),
    "hicache": (
        "sglang.srt.managers.cache_controller",
        f"{MEM_CACHE}.pool_host.base",
        f"{MEM_CACHE}.pool_host.mha",
        f"{MEM_CACHE}.hicache_storage",
        f"{MEM_CACHE}.storage.file.lru_file_evictor",
    ),
}


# the unified targets' page sizes: the small ones (splits and partial pages often), and those engines run
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def engine_modules(cores: tuple[str, ...], *components: str) -> tuple[str, ...]:
    """The modules of SGLang's unified cache that a target on ``cores`` with ``components`` runs."""
    modules = [*UNIFIED_MODULES]
    for core in cores:
        modules += CORE_MODULES[core]
    for component in components:
        modules += COMPONENT_MODULES[component]
    return tuple(modules)


# pure helpers of sglang/srt/utils/common.py (the module imports orjson, triton, psutil): their own source
COMMON_HELPERS = ("ceil_div", "ceil_align", "next_power_of_2", "get_num_new_pages", "assert_int64_array")


def common_helpers(root: Path) -> dict[str, object]:
    """SGLang's own definitions of COMMON_HELPERS, compiled from the installed file."""
    from typing import Optional

    import torch

    namespace: dict[str, object] = {"torch": torch, "Optional": Optional, "array": array, "List": list}
    return compiled_from(root / "srt" / "utils" / "common.py", COMMON_HELPERS, namespace)


def import_unified_cache() -> types.ModuleType:
    """The unified radix cache, the SWA allocator and their parameter types, with bare packages and stubs (once a
    process: the module registered under ``sglang.__radixspec_swa__``)."""
    loaded = sys.modules.get("sglang.__radixspec_swa__")
    if loaded is not None:
        return loaded
    if "sglang.srt.mem_cache.radix_cache" in sys.modules:
        raise ImportError("the sglang target's stubs are loaded in this process: run the unified targets in their own")
    root = package_root("sglang")
    for name in (
        "sglang",
        "sglang.srt",
        "sglang.srt.utils",
        "sglang.srt.mem_cache",
        "sglang.srt.mem_cache.allocator",
        "sglang.srt.disaggregation",
        "sglang.srt.managers",
        "sglang.srt.layers",
        "sglang.srt.distributed",
        "sglang.srt.session",
        "sglang.srt.platforms",
    ):
        bare(name, root.joinpath(*name.split(".")[1:]))
    helpers = dict(
        common_helpers(root),
        is_npu=lambda: False,
        is_hip=lambda: False,
        is_cuda=lambda: False,
        get_bool_env_var=lambda name, default="false": os.getenv(name, default).lower() in ("1", "true"),
    )
    stub_any("sglang.srt.utils.common", **helpers)
    sys.modules["sglang.srt.utils"].__dict__.update(helpers, get_device_module=lambda: None)
    stub_any("sglang.srt.utils.network")
    stand_ins = {} if importable("pydantic") else {"pydantic": stub("_pydantic", BaseModel=object)}
    import_with_stand_ins("sglang.srt.disaggregation.kv_events", **stand_ins)
    # triton kernels: the CPU paths never call them
    for name in ("sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.kvcache", "sglang.kernels.ops.memory"):
        stub(name)
    for name in ("kvcache.mla_buffer", "memory.allocator", "memory.common"):
        stub_any(f"sglang.kernels.ops.{name}")
    platform = types.SimpleNamespace(
        capabilities=types.SimpleNamespace(supports_triton=False), get_paged_allocator_cls=lambda: None
    )
    stub("sglang.srt.platforms", current_platform=platform)

    # class names the cache uses as bases, in isinstance checks or annotations (the real modules hold KV tensors)
    def named(name: str, *bases: type) -> type:
        return type(name, bases or (object,), {})

    kv_cache = named("KVCache")
    stub_any(
        "sglang.srt.mem_cache.memory_pool",
        KVCache=kv_cache,
        MHATokenToKVPool=named("MHATokenToKVPool", kv_cache),
        ReqToTokenPool=object,
        HybridReqToTokenPool=named("HybridReqToTokenPool"),
    )
    stub("sglang.srt.mem_cache.swa_memory_pool", SWAKVPool=named("SWAKVPool"))
    stub("sglang.srt.mem_cache.allocator.hisparse", DeepSeekV4HiSparseTokenToKVPoolAllocator=named("HiSparse"))
    stub("sglang.srt.mem_cache.allocator.unified_hybrid_swa", UnifiedSWAAllocatorBase=named("UnifiedSWA"))
    # HiCache, the scheduler's request type, metrics: never built here
    for name in (
        "sglang.srt.managers.cache_controller",
        "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
        "sglang.srt.mem_cache.buffer_mode.pipeline",
        "sglang.srt.managers.schedule_batch",
    ):
        stub_any(name)
    stub("sglang.srt.observability")
    stub_any(
        "sglang.srt.observability.metrics_collector",
        STAT_LOGGER_ROLE_STORAGE="storage",
        STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
    )
    allocator_base = importlib.import_module("sglang.srt.mem_cache.allocator.base")
    install(
        sys.modules["sglang.srt.mem_cache.allocator"],
        BaseTokenToKVPoolAllocator=allocator_base.BaseTokenToKVPoolAllocator,
    )
    return register(
        "sglang.__radixspec_swa__",
        urc=importlib.import_module("sglang.srt.mem_cache.unified_radix_cache"),
        base=importlib.import_module("sglang.srt.mem_cache.base_prefix_cache"),
        params=importlib.import_module("sglang.srt.mem_cache.cache_init_params"),
        radix=importlib.import_module("sglang.srt.mem_cache.radix_cache"),
        swa=importlib.import_module("sglang.srt.mem_cache.allocator.swa"),
        swa_pool=importlib.import_module("sglang.srt.mem_cache.base_swa_memory_pool"),
        components=importlib.import_module("sglang.srt.mem_cache.unified_cache.component_type").ComponentType,
    )


def mapping_pool(modules: types.ModuleType, full: object = None, swa: object = None, tier: object = None) -> object:
    """A KV pool with no tensors: only the full-to-SWA mapping hooks the allocator calls. With HiCache, SGLang's
    ``SWAKVPool`` as the host tier reads it: its full and SWA pools (``full``, ``swa``: ``sglang_hicache.DevicePool``
    each), the tier that built them, the layer counter it registers."""

    # SGLang's abstract pool, known only once its module loads: mypy cannot check a subclass of it
    base: Any = modules.swa_pool.BaseSWAKVPool

    class MappingOnlyPool(base):  # type: ignore[misc]
        # no per-request SWA ring: the paged SWA pool
        swa_req_ring_size = None
        host_capacity_tokens = None
        device = "cpu"

        def __init__(self) -> None:
            self.full_kv_pool, self.swa_kv_pool, self.tier = full, swa, tier
            self.full_to_swa_index_mapping: torch.Tensor | None = None
            self.layer_transfer_counter: object = None
            # SWAKVPool's: the full layers and the SWA layers
            self.layer_num = sum(getattr(pool, "layer_num", 0) for pool in (full, swa))

        def register_layer_transfer_counter(self, counter: object) -> None:
            self.layer_transfer_counter = counter

        def register_mapping(self, mapping: torch.Tensor) -> None:
            self.full_to_swa_index_mapping = mapping

        def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
            mapping = self.full_to_swa_index_mapping
            assert mapping is not None, "the allocator registers its mapping before it translates"
            return mapping[kv_indices]

        def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
            return [], [], []

    return MappingOnlyPool()


def probe() -> None:
    """Import the unified cache here, or, where the sglang target's stubs are loaded already, in a fresh process."""
    if "sglang.srt.mem_cache.radix_cache" not in sys.modules or "sglang.__radixspec_swa__" in sys.modules:
        import_unified_cache()
        return
    import subprocess

    code = "from radixspec.fuzz.targets.sglang_modules import import_unified_cache; import_unified_cache()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if run.returncode:
        raise ImportError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "import failed")
