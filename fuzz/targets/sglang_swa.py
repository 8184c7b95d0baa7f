"""Target ``sglang-swa:legacy``: SGLang 0.5.23's ``UnifiedRadixCache`` with its FULL and SWA components and its real
``SWATokenToKVPoolAllocator``, driven request by request; ``sglang-swa:rust`` runs the wheel's Rust tree core.

What is real: the unified radix cache, its tree core (Python ``unified_tree_core.py`` or the compiled
``rust_tree_core``), the full and SWA components, the SWA allocator with its full-to-SWA index mapping.
What stands in: the KV pool (no tensors: only the mapping hooks the allocator calls), package
``__init__`` files and modules the cache never calls (triton kernels, HiCache, metrics, the scheduler's
request type); see ``import_swa_cache``. Page size 1 (the allocator's paged path needs the scheduler's
``last_loc`` bookkeeping, which is not modelled here).

The request lifecycle is the scheduler's, written here from SGLang's code: match the prompt less its
last token and lock the match; allocate slots (evicting full and SWA when short); store KV; free the
SWA slots of private tokens the window has passed (``free_swa``); when the request finishes, insert its
longest prefix whose window is held (``prev_prefix_len`` = the hit, the released span as
``component_evicted_seqlens``: the insert frees duplicate slots itself), free the rest, unlock. A running
request is cached only when it finishes.

The machine checks what holds whatever SGLang chooses: the hit is a valid match (``spec/hybrid.py``)
of what the tree holds (every full token before it; no SWA tombstone in its last W - 1 tokens), SGLang's
``sanity_check``; and the lifecycle laws (``fuzz/lifecycle.py``: the safety law, a shadow of every KV write,
both allocators' conservation), to which this shows its rows (a slot per token) and its two pools.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import types
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hybrid as hy
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError, OutOfPagesError

from ..lifecycle import Pool
from ..stats import STATS
from .api import TargetInfo, lifecycle_profile
from .sglang import VERSION
from .shims import bare, import_with_stand_ins, install, package_root, register, stub, stub_any

if TYPE_CHECKING:
    import torch

PROFILE = lifecycle_profile(
    f"sglang {VERSION} UnifiedRadixCache FULL + SWA",
    "window_tokens: after an SWA tombstone a match needs W live tokens, one more than the spec's W - 1",
    "holes: SWA tombstones; an insert over a tombstone adopts the request's new slots (healing)",
    "full_evicts_window: evicting a full leaf frees its SWA value too",
    "pools: one full pool and one SWA pool, tied by a full-to-SWA index mapping",
    "the insert frees the duplicates of [prev_prefix_len, prefix_len) itself, full and SWA",
)

# pure helpers of sglang/srt/utils/common.py (the module imports orjson, triton, psutil): their own source
COMMON_HELPERS = ("ceil_div", "ceil_align", "next_power_of_2", "get_num_new_pages", "assert_int64_array")


def common_helpers(root: Path) -> dict[str, object]:
    """SGLang's own definitions of COMMON_HELPERS, compiled from the installed file."""
    from typing import Optional

    import torch

    path = root / "srt" / "utils" / "common.py"
    functions = [
        node
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name in COMMON_HELPERS
    ]
    namespace: dict[str, object] = {"torch": torch, "Optional": Optional, "array": array, "List": list}
    body: list[ast.stmt] = list(functions)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in COMMON_HELPERS}


def import_swa_cache() -> types.ModuleType:
    """The unified radix cache, the SWA allocator and their parameter types, with bare packages and stubs."""
    loaded = sys.modules.get("sglang.__radixspec_swa__")
    if loaded is not None:
        return loaded
    if "sglang.srt.mem_cache.radix_cache" in sys.modules:
        raise ImportError("the sglang target's stubs are loaded in this process: run sglang-swa in its own")
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
    stand_ins = {} if importlib.util.find_spec("pydantic") else {"pydantic": stub("_pydantic", BaseModel=object)}
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


def mapping_pool(modules: types.ModuleType) -> object:
    """A KV pool with no tensors: only the full-to-SWA mapping hooks the allocator calls."""

    # SGLang's abstract pool, known only once its module loads: mypy cannot check a subclass of it
    base: Any = modules.swa_pool.BaseSWAKVPool

    class MappingOnlyPool(base):  # type: ignore[misc]
        full_kv_pool = None
        swa_kv_pool = None
        # no per-request SWA ring: the paged SWA pool
        swa_req_ring_size = None

        def __init__(self) -> None:
            self.full_to_swa_index_mapping: torch.Tensor | None = None

        def register_mapping(self, mapping: torch.Tensor) -> None:
            self.full_to_swa_index_mapping = mapping

        def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
            mapping = self.full_to_swa_index_mapping
            assert mapping is not None, "the allocator registers its mapping before it translates"
            return mapping[kv_indices]

        def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
            return [], [], []

    return MappingOnlyPool()


class SGLangSWAManager:
    """SGLang's SWA cache and allocator behind the hybrid manager's methods (``reference/hybrid_manager.py``)."""

    profile = PROFILE

    def __init__(self, page_size: int, windows: tuple[hy.Window, ...], num_pages: int, core: str = "python") -> None:
        import torch

        self.torch = torch
        v = self.v = import_swa_cache()
        window = next((w for w in windows if w is not None), 4)
        self.windows: tuple[hy.Window, ...] = (None, max(2, window))
        # page size 1: a drawn pool of pages becomes 8 slots per page, so that requests fit as they do in
        # the other targets' pools
        self.page_size, self.num_pages = 1, 8 * num_pages
        self.alloc = v.swa.SWATokenToKVPoolAllocator(
            size=self.num_pages,
            size_swa=self.num_pages,
            page_size=1,
            dtype=torch.float16,
            device="cpu",
            kvcache=mapping_pool(v),
            need_sort=False,
        )
        components = v.components
        self.cache = v.urc.UnifiedRadixCache(
            v.params.CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=self.alloc,
                page_size=1,
                sliding_window_size=self.windows[1],
                tree_components=(components.FULL, components.SWA),
                tree_core_backend=core,
            )
        )
        # the cache's lock of each request's match, passed back to unlock it
        self.locks: dict[int, object] = {}
        self.hits: dict[int, int] = {}

    # ------------------------------------------------------------ reading SGLang's state

    def key(self, tokens: list[int], namespace: Namespace) -> object:
        extra = None if namespace is None else repr(namespace)
        return self.v.radix.RadixKey(array("q", tokens), extra_key=extra)

    def swa_of(self, full: list[int]) -> list[int | None]:
        """The SWA slot paired with each full slot (None: released or tombstoned)."""
        mapping = self.alloc.full_to_swa_index_mapping
        return [None if (s := int(mapping[f])) == 0 else s for f in full]

    def valid_hit(self, tokens: list[int], namespace: Namespace, full_hit: int, hit: int) -> tuple[bool, int]:
        """(``hit`` is a valid match of what the tree holds, the spec's longest valid match)."""
        holes = [
            range(a, b) for a, b in self.cache.tree_core.swa_tombstone_ranges(self.key(tokens, namespace), 0, full_hit)
        ]

        def valid(length: int) -> bool:
            used = hy.compute_used_pages(length, self.windows[1], 1)
            return length <= full_hit and not any(set(used) & set(hole) for hole in holes)

        longest = next((n for n in range(min(full_hit, len(tokens)), -1, -1) if valid(n)), 0)
        return valid(hit), longest

    # ------------------------------------------------------------ the manager's operations

    def match_req(self, req: HybridReq) -> None:
        """match_prefix of the prompt less its last token, checked against the spec, then locked."""
        tokens = req.input_ids[:-1]
        result = self.cache.match_prefix(self.v.base.MatchPrefixParams(key=self.key(tokens, req.namespace)))
        hit = int(result.device_prefix_len)
        ok, longest = self.valid_hit(tokens, req.namespace, int(result.full_kv_hit_length), hit)
        if not ok:
            raise IntegrityError(
                f"hit_is_a_valid_match: request {req.uid} hit {hit} of {len(tokens)} tokens; the tree holds"
                f" full KV for {result.full_kv_hit_length} and SWA tombstones inside the window"
            )
        if hit < longest:
            STATS.record_rule("sglang-swa.hit_below_the_spec")
        self.locks[req.uid] = self.cache.lock(result.last_device_node)
        self.hits[req.uid] = hit
        full = [int(i) for i in self.cache.path_device_indices(result.last_device_node).tolist()][:hit]
        req.rows = [list(full), self.swa_of(full)]
        req.handle, req.computed = types.SimpleNamespace(cached_len=hit), hit

    def allocate_paged(self, req: HybridReq, length: int) -> None:
        """Slots for tokens up to ``length``; evicts full and SWA when the allocator is short."""
        need = length - len(req.rows[0])
        if need <= 0:
            return
        got = self.alloc.alloc(need)
        if got is None:
            self.cache.evict(self.v.base.EvictParams(num_tokens=need, swa_num_tokens=need))
            got = self.alloc.alloc(need)
        if got is None:
            raise OutOfPagesError(f"{need} slots needed; full {self.alloc.full_available_size()} free")
        full = [int(i) for i in got.tolist()]
        req.rows[0].extend(full)
        req.rows[1].extend(self.swa_of(full))

    def store(self, req: HybridReq, tokens: int) -> None:
        """KV written for ``tokens`` more tokens (the machine's shadow records where); SWA slots the window passed
        freed."""
        end = req.computed + tokens
        req.computed = end
        # free_swa_out_of_window_slots: private SWA slots no query from here on attends
        first = hy.compute_used_pages(end, self.windows[1], 1).start
        passed = [p for p in range(self.hits[req.uid], first) if req.rows[1][p] is not None]
        if passed:
            self.alloc.free_swa(self.torch.tensor([req.rows[0][p] for p in passed], dtype=self.torch.int64))
            for p in passed:
                req.rows[1][p] = None

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        """A finished request: insert its longest prefix whose window it holds, free the rest, unlock."""
        if not finished:
            return
        hit, full, swa = self.hits.pop(req.uid), req.rows[0], req.rows[1]
        length = next(
            n
            for n in range(req.computed, hit - 1, -1)
            if n == hit or all(swa[p] is not None for p in hy.compute_used_pages(n, self.windows[1], 1))
        )
        released = next((p for p in range(hit, length) if swa[p] is not None), length)
        evicted = {self.v.components.SWA: released} if released > hit else {}
        torch = self.torch
        self.cache.insert(
            self.v.base.InsertParams(
                key=self.key(req.input_ids[:length], req.namespace),
                value=torch.tensor(full[:length], dtype=torch.int64),
                prev_prefix_len=hit,
                component_evicted_seqlens=evicted,
            )
        )
        tail = full[length:]
        with_swa = [f for f, s in zip(tail, swa[length:], strict=True) if s is not None]
        if with_swa:
            self.alloc.free_swa(torch.tensor(with_swa, dtype=torch.int64))
        if tail:
            self.alloc.free_full(torch.tensor(tail, dtype=torch.int64))
        self.cache.unlock(self.locks.pop(req.uid))
        req.rows, req.handle = [], None

    # ------------------------------------------------------------ universal checks

    def check_integrity(self, live_reqs: list[HybridReq]) -> None:
        """SGLang's own check (the lifecycle laws are the machine's)."""
        self.cache.sanity_check()

    def pools(self, live_reqs: list[HybridReq]) -> list[Pool]:
        """Both allocators, in slots: free, cached, held privately by the live requests, size."""
        cache, alloc = self.cache, self.alloc
        private_full = sum(len(req.rows[0]) - self.hits[req.uid] for req in live_reqs)
        private_swa = sum(sum(1 for s in req.rows[1][self.hits[req.uid] :] if s is not None) for req in live_reqs)
        full_cached = cache.full_evictable_size() + cache.full_protected_size()
        swa_cached = cache.swa_evictable_size() + cache.swa_protected_size()
        return [
            Pool("group 0", alloc.full_available_size(), full_cached, private_full, self.num_pages),
            Pool("group 1", alloc.swa_available_size(), swa_cached, private_swa, self.num_pages),
        ]

    def cached_page_count(self) -> int:
        """Full-attention pages the tree holds (the reach of a campaign; SGLang's SWA cache runs at page size 1)."""
        return int(self.cache.full_evictable_size() + self.cache.full_protected_size()) // self.page_size


def probe() -> None:
    """Import the SWA cache here, or, where the sglang target's stubs are loaded already, in a fresh process."""
    if "sglang.srt.mem_cache.radix_cache" not in sys.modules or "sglang.__radixspec_swa__" in sys.modules:
        import_swa_cache()
        return
    import subprocess

    code = "from radixspec.fuzz.targets.sglang_swa import import_swa_cache; import_swa_cache()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if run.returncode:
        raise ImportError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "import failed")


def target(argument: str | None, name: str | None = None) -> TargetInfo:
    """The Python tree core or ``rust`` (the wheel's compiled one); ``sglang-swa:legacy`` and ``:legacy-rust``."""
    core = argument or "python"
    if core not in ("python", "rust"):
        from .api import TargetError

        raise TargetError(f"sglang-swa takes python or rust (the tree core), got {argument!r}")

    def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> SGLangSWAManager:
        return SGLangSWAManager(page_size, windows, num_pages, core)

    return TargetInfo(
        name=name or f"sglang-swa{'' if argument is None else ':' + argument}",
        description=f"SGLang {VERSION} UnifiedRadixCache, FULL + SWA components, {core} tree core, page size 1",
        requires=(("sglang", f"radixspec targets install sglang  (pip install --no-deps sglang=={VERSION})"),),
        hybrid_factory=factory,
        profile=PROFILE,
        page_sizes=(1,),
        how="the hybrid machine: requests as SGLang's scheduler drives them; the hit, the window law, the pools",
        probe=probe,
    )
