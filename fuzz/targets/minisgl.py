"""Target ``minisgl:PATH``: mini-sglang's ``RadixPrefixCache`` and ``CacheManager`` from a source checkout.

mini-sglang is not on PyPI. Get it with::

    git clone https://github.com/sgl-project/mini-sglang
    git -C mini-sglang checkout 20fcd7f     # the commit the findings in docs/findings.md refer to
    radixspec fuzz --target minisgl:mini-sglang --minutes 1

PATH is the checkout (holding ``python/minisgl``) or its ``python`` folder.
Nothing is installed: bare packages point at the checkout, and only what
the cache and the manager never call is stood in for (``import_minisgl``).

Harness choices, each in the profile's notes: the C key compare
(``minisgl.kernel.fast_compare_key``, a tvm-ffi kernel) is replaced by torch
code returning the same first-mismatch index; the wall clock
(``time.monotonic_ns``) by a logical clock ticking once per call; the
manager's ``pin_memory=True`` host buffers by plain ones (a CPU-only torch
cannot pin); ``get_matched_indices`` of an empty match returns ``[]`` without
calling mini-sglang's (which raises on ``torch.cat([])``; a latent bug, pinned
in tests/targets/test_findings.py).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace

from .api import PageKey, Profile, TargetInfo
from .shims import LogicalClock, bare, install, register

if TYPE_CHECKING:
    import torch

CLOCK = LogicalClock()
COMMIT = "20fcd7f"

PROFILE = Profile(
    name="mini-sglang RadixPrefixCache / CacheManager",
    eviction_unit="node",
    eviction_trigger="evict",
    clock="order",
    errors="none",
    namespaces=False,
    reset="none",
    slots="caller",
    default_lru="strict",
    slot_domain="pool",
    notes=(
        "evicts whole leaf nodes until at least the asked tokens, slots in eviction order",
        "LRU by node timestamp; the harness replaces time.monotonic_ns with a logical clock ticking once per call",
        "no namespaces, no reset, no input validation (invalid calls are not sent)",
        "its check_integrity is empty: the machines check the invariants themselves",
    ),
)


def checkout_root(argument: str) -> Path:
    """The folder holding the ``minisgl`` package, from what ``minisgl:PATH`` named."""
    path = Path(argument).expanduser().resolve()
    for candidate in (path / "python", path, path.parent):
        if (candidate / "minisgl" / "kvcache" / "radix_cache.py").exists():
            return candidate
    raise ImportError(f"no mini-sglang checkout at {path} (expected python/minisgl/kvcache/radix_cache.py)")


def commit_of(root: Path) -> str:
    """The checkout's commit, when it is a git checkout."""
    proc = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown commit"


def fast_compare_key(key: torch.Tensor, input_ids: torch.Tensor) -> int:
    """Stand-in for mini-sglang's C ``fast_compare_key``: the length of the common prefix."""
    n = min(len(key), len(input_ids))
    differ = (key[:n] != input_ids[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


class TorchWithoutPinning:
    """``torch`` for mini-sglang's manager module, with ``pin_memory`` dropped (no CUDA host pinning here)."""

    def __getattr__(self, name: str) -> object:
        import torch

        return getattr(torch, name)

    @staticmethod
    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        import torch

        return torch.empty(*args, **kwargs)


def import_minisgl(root: Path) -> types.ModuleType:
    """mini-sglang's core, radix cache and manager modules from the checkout at ``root``."""
    loaded = sys.modules.get("minisgl.scheduler.cache")
    if loaded is not None and getattr(loaded, "__radixspec_root__", None) == str(root):
        return sys.modules["minisgl.__radixspec__"]
    for name in [name for name in sys.modules if name == "minisgl" or name.startswith("minisgl.")]:
        del sys.modules[name]  # another checkout was loaded before
    package = root / "minisgl"
    bare("minisgl", package)
    utils = bare("minisgl.utils", package / "utils")  # its __init__ imports transformers and zmq
    misc = importlib.import_module("minisgl.utils.misc")
    install(utils, align_down=misc.align_down, div_ceil=misc.div_ceil)
    install(utils, Registry=importlib.import_module("minisgl.utils.registry").Registry)
    kernel = bare("minisgl.kernel", package / "kernel")  # its __init__ loads triton and tvm-ffi kernels
    install(kernel, fast_compare_key=fast_compare_key)
    bare("minisgl.scheduler", package / "scheduler")  # its __init__ imports the whole scheduler
    core = importlib.import_module("minisgl.core")
    radix_cache = importlib.import_module("minisgl.kvcache.radix_cache")
    cache = importlib.import_module("minisgl.scheduler.cache")
    install(radix_cache, time=types.SimpleNamespace(monotonic_ns=CLOCK.read))
    install(cache, torch=TorchWithoutPinning(), __radixspec_root__=str(root))
    return register("minisgl.__radixspec__", core=core, radix_cache=radix_cache, cache=cache, commit=commit_of(root))


def set_page_size(core: types.ModuleType, page_size: int) -> None:
    """mini-sglang reads the page size from its global context when a cache is built."""
    install(core, _GLOBAL_CTX=core.Context(page_size=page_size))


class CacheHandle(Protocol):
    """What the adapters read of mini-sglang's ``BaseCacheHandle`` (passed back to lock and unlock its match)."""

    cached_len: int

    def get_matched_indices(self) -> torch.Tensor: ...


class EngineReq(Protocol):
    """What the adapter reads and writes of mini-sglang's ``Req`` (made when the request is admitted)."""

    cached_len: int
    device_len: int
    cache_handle: CacheHandle

    def append_host(self, token: torch.Tensor) -> None: ...


class TreeNodeView(Protocol):
    """What ``tree_pages`` reads of mini-sglang's ``RadixTreeNode``."""

    _key: torch.Tensor
    _value: torch.Tensor
    children: Mapping[object, TreeNodeView]
    # the logical clock's reading (time.monotonic_ns in mini-sglang)
    timestamp: int


class RadixTreeView(Protocol):
    """What ``tree_pages`` reads of mini-sglang's ``RadixPrefixCache``."""

    root_node: TreeNodeView


def tree_pages(cache: RadixTreeView, page_size: int) -> Iterator[tuple[PageKey, int, int]]:
    """(page key, first slot, node timestamp) of every cached page of a mini-sglang radix tree."""
    stack: list[tuple[TreeNodeView, pc.Prefix | None]] = [(child, None) for child in cache.root_node.children.values()]
    while stack:
        node, prefix = stack.pop()
        key = [int(t) for t in node._key.tolist()]
        values = node._value.tolist()
        for offset in range(0, len(values), page_size):
            prefix = pc.Prefix.extend(prefix, tuple(key[offset : offset + page_size]))
            yield (None, prefix), int(values[offset]), node.timestamp
        stack.extend((child, prefix) for child in node.children.values())


class MiniSGLangRadixCache:
    """mini-sglang's RadixPrefixCache behind the target protocol (no namespaces)."""

    profile = PROFILE

    def __init__(self, root: Path, page_size: int) -> None:
        import torch

        self.torch = torch
        self.modules = import_minisgl(root)
        set_page_size(self.modules.core, page_size)
        self.cache = self.modules.radix_cache.RadixPrefixCache(torch.device("cpu"))
        self.page_size = page_size
        self.evicted: list[list[int]] = []

    def ids(self, tokens: list[int]) -> torch.Tensor:
        return self.torch.tensor(tokens, dtype=self.torch.int32)

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> CacheHandle:
        CLOCK.tick()
        handle: CacheHandle = self.cache.match_prefix(self.ids(tokens)).cuda_handle
        return handle

    def insert_prefix(
        self, tokens: list[int], indices: list[int] | None, namespace: Namespace
    ) -> tuple[int, CacheHandle]:
        CLOCK.tick()
        cached_len, handle = self.cache.insert_prefix(self.ids(tokens), self.ids(indices or []))
        return int(cached_len), handle

    def cached_len(self, handle: CacheHandle) -> int:
        return int(handle.cached_len)

    def get_matched_indices(self, handle: CacheHandle) -> list[int]:
        # mini-sglang's get_matched_indices raises on an empty match (torch.cat of no tensors)
        return [int(s) for s in handle.get_matched_indices().tolist()] if handle.cached_len else []

    def lock(self, handle: CacheHandle) -> None:
        self.cache.lock_handle(handle, unlock=False)

    def unlock(self, handle: CacheHandle) -> None:
        self.cache.lock_handle(handle, unlock=True)

    def evict(self, size: int) -> None:
        slots = [int(s) for s in self.cache.evict(size).tolist()]
        if slots:
            self.evicted.append(slots)  # one flat tensor: node boundaries are not visible

    def size_info(self) -> tuple[int, int]:
        info = self.cache.size_info
        return int(info.evictable_size), int(info.protected_size)

    def take_evicted(self) -> list[list[int]]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def cached_pages(self) -> dict[PageKey, int]:
        return {key: start for key, start, _ in tree_pages(self.cache, self.page_size)}

    def page_stamps(self) -> dict[PageKey, int]:
        return {key: stamp for key, _, stamp in tree_pages(self.cache, self.page_size)}


class MiniReq:
    """A request of the manager machine: the prompt until admitted, then mini-sglang's own ``Req``."""

    def __init__(self, prompt: list[int], table_idx: int, uid: int) -> None:
        import torch

        self.input_ids = torch.tensor(prompt, dtype=torch.int32)
        self.input_len = len(prompt)
        self.table_idx = table_idx
        self.uid = uid
        # mini-sglang's own Req, once admitted
        self.engine: EngineReq | None = None
        # positions of the row backed by pages (mini-sglang derives them; the machine needs them)
        self.alloc_len = 0

    @property
    def req(self) -> EngineReq:
        """mini-sglang's own Req (the request is admitted)."""
        assert self.engine is not None, f"request {self.uid} is not admitted"
        return self.engine


class MiniSGLangManager:
    """mini-sglang's CacheManager behind the manager target protocol."""

    profile = PROFILE

    def __init__(self, root: Path, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        import torch

        self.torch = torch
        self.modules = import_minisgl(root)
        set_page_size(self.modules.core, page_size)
        self.page_table = torch.zeros((rows, max_seq_len), dtype=torch.int32)
        self.manager = self.modules.cache.CacheManager(num_pages, page_size, self.page_table, "radix")
        self.page_size, self.num_pages = page_size, num_pages

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> MiniReq:
        return MiniReq(prompt, table_idx, uid)

    def match_req(self, req: MiniReq) -> CacheHandle:
        CLOCK.tick()
        handle: CacheHandle = self.manager.match_req(req).cuda_handle
        return handle

    def lock(self, handle: CacheHandle) -> None:
        self.manager.lock(handle)

    def unlock(self, handle: CacheHandle) -> None:
        self.manager.unlock(handle)

    def cached_len(self, handle: CacheHandle) -> int:
        return int(handle.cached_len)

    def get_matched_indices(self, handle: CacheHandle) -> list[int]:
        return [int(s) for s in handle.get_matched_indices().tolist()] if handle.cached_len else []

    def available_size(self) -> int:
        return int(self.manager.available_size)

    def admit(self, req: MiniReq, handle: CacheHandle) -> None:
        core = self.modules.core
        cached = int(handle.cached_len)
        if cached:
            self.page_table[req.table_idx, :cached] = handle.get_matched_indices()
        req.engine = core.Req(
            input_ids=req.input_ids,
            table_idx=req.table_idx,
            cached_len=cached,
            output_len=1,
            uid=req.uid,
            sampling_params=core.SamplingParams(),
            cache_handle=handle,
        )
        req.alloc_len = cached

    def set_lengths(self, req: MiniReq, cached_len: int, device_len: int) -> None:
        req.req.cached_len, req.req.device_len = cached_len, device_len

    def append_token(self, req: MiniReq, token: int) -> None:
        req.req.append_host(self.torch.tensor([token], dtype=self.torch.int32))

    def allocate_paged(self, reqs: Sequence[MiniReq]) -> None:
        CLOCK.tick()
        self.manager.allocate_paged([req.req for req in reqs])
        p = self.page_size
        for req in reqs:
            req.alloc_len = max(req.alloc_len, -(-req.req.device_len // p) * p)

    def cache_req(self, req: MiniReq, finished: bool) -> None:
        CLOCK.tick()
        self.manager.cache_req(req.req, finished=finished)
        if finished:
            req.alloc_len = 0

    def lazy_free_region(self) -> AbstractContextManager[None]:
        region: AbstractContextManager[None] = self.manager.lazy_free_region()
        return region

    def row(self, req: MiniReq) -> list[int]:
        return [int(s) for s in self.page_table[req.table_idx, : req.alloc_len].tolist()]

    def handle_of(self, req: MiniReq) -> CacheHandle:
        handle: CacheHandle = req.req.cache_handle
        return handle

    def free_pages(self) -> list[int]:
        return [int(s) for s in self.manager.free_slots.tolist()]

    def cached_slots(self) -> list[int]:
        return [start for _, start, _ in tree_pages(self.manager.prefix_cache, self.page_size)]

    def size_info(self) -> tuple[int, int]:
        info = self.manager.prefix_cache.size_info
        return int(info.evictable_size), int(info.protected_size)


def target(argument: str | None) -> TargetInfo:
    """The ``minisgl:PATH`` target for the checkout at PATH."""
    from .api import TargetError

    if not argument:
        raise TargetError(
            "target minisgl needs the path of a mini-sglang checkout: --target minisgl:PATH"
            f" (git clone https://github.com/sgl-project/mini-sglang; git checkout {COMMIT})"
        )
    try:
        root = checkout_root(argument)
    except ImportError as exc:
        raise TargetError(str(exc)) from None
    return TargetInfo(
        name=f"minisgl:{argument}",
        description=f"mini-sglang RadixPrefixCache and CacheManager from the checkout at {root}",
        cache_factory=lambda page_size, num_pages: MiniSGLangRadixCache(root, page_size),
        manager_factory=lambda num_pages, page_size, rows, max_seq_len: MiniSGLangManager(
            root, num_pages, page_size, rows, max_seq_len
        ),
        profile=PROFILE,
        how=f"not on PyPI: git clone https://github.com/sgl-project/mini-sglang (findings: commit {COMMIT})",
        probe=lambda: import_minisgl(root),
    )
