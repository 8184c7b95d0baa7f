"""Target ``sglang:legacy``: ``sglang.srt.mem_cache.radix_cache.RadixCache`` from the released sglang 0.5.23
wheel (0.5.23 builds it for no dense model any more: ``sglang`` is its ``UnifiedRadixCache``, in
``fuzz/targets/sglang_unified.py``).

Installed without its dependency tree (``radixspec targets install
sglang``); built with ``RadixCache.create_simulated`` and a mock allocator
that records what the cache frees. Only modules the cache never calls (with
events and metrics off) are stubbed, see ``import_radix_cache``.

Harness choices, each stated in the profile's notes: SGLang's wall clock
(``time.monotonic``) is replaced by a logical clock that ticks once per call,
so LRU order is deterministic and replayable; a namespace becomes the key's
``extra_key`` (its ``repr``, injective on the spec's domain).

``RADIXSPEC_SGLANG_RADIX_CACHE=/path/radix_cache.py`` loads a patched copy of
the module instead (``python -m tools.planted --peer sglang`` plants known
SGLang bugs that way).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias

from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace

from .api import PageKey, Profile, TargetInfo
from .shims import (
    InsertionOrderedSet,
    LogicalClock,
    Recorded,
    bare,
    import_with_stand_ins,
    importable,
    install,
    load_file_as,
    never,
    package_root,
    stub,
    stub_any,
)

if TYPE_CHECKING:
    import torch

VERSION = "0.5.23"
CLOCK = LogicalClock()

PROFILE = Profile(
    name=f"sglang {VERSION} RadixCache",
    eviction_unit="node",
    eviction_trigger="evict",
    clock="order",
    errors="none",
    namespaces=True,
    reset="drops",
    handles_survive_reset=False,
    slots="caller",
    default_lru="sync",
    slot_domain="pool",
    notes=(
        "evicts whole leaf nodes until at least the asked tokens (the spec: exactly ceil(size / P) pages)",
        "LRU by last_access_time; the harness replaces time.monotonic with a logical clock ticking once per call",
        "ties between evictable leaves go by the harness's insertion-ordered set (SGLang's set of nodes iterates"
        " by memory address, which differs from run to run)",
        "a split also refreshes the unmatched suffix's timestamp (SGLang PR #24892 closed): strict mode reports it",
        "no input validation: invalid calls are not sent",
        "reset drops the tree without freeing its slots (the engine resets its allocator)",
        "a handle from before reset() belongs to the old tree: locking or unlocking it fails, even when empty",
        "KV events (msgspec and pyzmq installed): its KVCacheEventRecorder's stream replayed after every step",
        "event hashes omit the extra key (namespace) unless it names a registered LoRA adapter: sync mode replays"
        " them on token prefixes, counting repeats; strict mode reports the aliasing",
    ),
    event_namespaces=False,
)


def events_available() -> bool:
    """Whether SGLang's event module can load for real (it needs msgspec and pyzmq)."""
    return importable("msgspec") and importable("zmq")


def import_radix_cache() -> types.ModuleType:
    """``sglang.srt.mem_cache.radix_cache`` with bare packages and stubs; its clock made logical."""
    loaded = sys.modules.get("sglang.srt.mem_cache.radix_cache")
    if loaded is not None and getattr(loaded, "__radixspec_clock__", False):
        return loaded
    root = package_root("sglang")
    # package __init__ files that import transformers, orjson, triton, the allocators
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.mem_cache", "sglang.srt.mem_cache.allocator"):
        bare(name, root.joinpath(*name.split(".")[1:]))
    # imported, never called with events and metrics off
    stub("sglang.srt.utils.common", ceil_align=lambda x, align: -(-x // align) * align)
    bare("sglang.srt.disaggregation", root / "srt" / "disaggregation")
    if events_available():
        # SGLang's own event classes and hashing: its KVCacheEventRecorder runs for real under the fuzzer.
        # The module also holds the publisher's config (pydantic) and its address parsing: never used here.
        stub_any("sglang.srt.utils.network")
        stand_ins = {} if importable("pydantic") else {"pydantic": stub("_pydantic", BaseModel=object)}
        import_with_stand_ins("sglang.srt.disaggregation.kv_events", **stand_ins)
    else:
        stub(
            "sglang.srt.disaggregation.kv_events",
            BlockStored=Recorded,
            BlockRemoved=Recorded,
            AllBlocksCleared=Recorded,
            StorageMedium=types.SimpleNamespace(GPU="GPU", CPU="CPU", CPU_TIER2="CPU_TIER2"),
            kv_event_namespace_seed=never,
            namespaced_block_hash=never,
        )
    for name in ("sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.kvcache"):
        stub(name)
    stub_any("sglang.kernels.ops.kvcache.mla_buffer")  # triton kernels re-exported by mem_cache/utils
    stub_any("sglang.srt.mem_cache.memory_pool")  # ReqToTokenPool: an annotation only
    stub("sglang.srt.observability")
    stub_any("sglang.srt.observability.metrics_collector")
    stub_any("sglang.srt.runtime_context")
    allocator_base = importlib.import_module("sglang.srt.mem_cache.allocator.base")
    install(
        sys.modules["sglang.srt.mem_cache.allocator"],
        BaseTokenToKVPoolAllocator=allocator_base.BaseTokenToKVPoolAllocator,
    )
    override = os.environ.get("RADIXSPEC_SGLANG_RADIX_CACHE")
    module = (
        load_file_as("sglang.srt.mem_cache.radix_cache", Path(override))
        if override
        else importlib.import_module("sglang.srt.mem_cache.radix_cache")
    )
    # the wall clock, replaced by the logical one (perf_counter stays: metrics only)
    clock = types.SimpleNamespace(monotonic=CLOCK.read, perf_counter=__import__("time").perf_counter)
    install(module, time=clock, __radixspec_clock__=True)
    return module


class RadixKeyView(Protocol):
    """What the adapter reads of SGLang's ``RadixKey``."""

    token_ids: Sequence[int]
    extra_key: str | None


class TreeNodeView(Protocol):
    """What the adapter reads of SGLang's ``TreeNode`` (walking the tree for its pages)."""

    key: RadixKeyView
    # the node's slots, one per token
    value: torch.Tensor
    children: Mapping[object, TreeNodeView]
    # the logical clock's reading (time.monotonic in SGLang)
    last_access_time: float


# a handle: (SGLang's last matched node, passed back to the cache only; the tokens it matched)
Handle: TypeAlias = tuple[object, int]


class RecordingAllocator:
    """The mock allocator ``create_simulated`` takes: records every free, in order."""

    device = "cpu"

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.freed: list[list[int]] = []

    def free_segment(self, indices: torch.Tensor, *, start_pos: int = 0) -> None:
        self.freed.append([int(i) for i in indices.tolist()])

    def free(self, indices: torch.Tensor) -> None:
        self.freed.append([int(i) for i in indices.tolist()])


class SGLangRadixCache:
    """SGLang's RadixCache behind the target protocol."""

    profile = PROFILE

    def __init__(self, page_size: int, num_pages: int) -> None:
        self.rc = import_radix_cache()
        from sglang.srt.mem_cache import base_prefix_cache as base

        self.base = base
        self.page_size = page_size
        self.allocator = RecordingAllocator(page_size)
        # SGLang's event recorder runs for real when its event module loads (msgspec, pyzmq installed)
        self.events_enabled = events_available()
        self.cache = self.rc.RadixCache.create_simulated(
            page_size=page_size, mock_allocator=self.allocator, enable_kv_cache_events=self.events_enabled
        )
        # SGLang breaks ties between leaves of equal last access by its set's order (memory addresses): one
        # program would take another path on its replay; insertion order is one of the orders that set may give
        self.cache.evictable_leaves = InsertionOrderedSet(self.cache.evictable_leaves)
        self.namespaces: dict[str | None, Namespace] = {None: None}
        # the cache's events so far, as the spec's; a stored page's namespace is the call's (SGLang's
        # events carry no extra key)
        self.events: list[ev.Event] = []
        if self.events_enabled:
            self.take_events = self._take_events

    def key(self, tokens: list[int], namespace: Namespace) -> object:
        extra_key = None if namespace is None else repr(namespace)
        self.namespaces[extra_key] = namespace
        return self.rc.RadixKey(array("q", tokens), extra_key)

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> Handle:
        CLOCK.tick()
        result = self.cache.match_prefix(self.base.MatchPrefixParams(key=self.key(tokens, namespace)))
        return (result.last_device_node, result.device_prefix_len)

    def insert_prefix(self, tokens: list[int], indices: list[int] | None, namespace: Namespace) -> tuple[int, Handle]:
        import torch

        CLOCK.tick()
        assert indices is not None
        params = self.base.InsertParams(key=self.key(tokens, namespace), value=torch.tensor(indices, dtype=torch.int64))
        result = self.cache.insert(params)
        self.drain_events(namespace)
        return result.prefix_len, (result.last_device_node, len(tokens) - len(tokens) % self.page_size)

    def drain_events(self, namespace: Namespace) -> None:
        """The recorder's queued events, converted while the call's namespace is known."""
        if self.events_enabled:
            self.events.extend(ev.from_block_events(self.cache.take_events(), lambda extra: namespace))

    def _take_events(self) -> list[ev.Event]:
        events, self.events = self.events, []
        return events

    def cached_len(self, handle: Handle) -> int:
        return int(handle[1])

    def get_matched_indices(self, handle: Handle) -> list[int]:
        return [int(s) for s in self.cache.path_device_indices(handle[0]).tolist()]

    def lock(self, handle: Handle) -> None:
        self.cache.inc_lock_ref(handle[0])

    def unlock(self, handle: Handle) -> None:
        self.cache.dec_lock_ref(handle[0])

    def evict(self, size: int) -> None:
        self.cache.evict(self.base.EvictParams(num_tokens=size))
        self.drain_events(None)

    def reset(self) -> None:
        self.cache.reset()
        self.drain_events(None)

    def size_info(self) -> tuple[int, int]:
        return int(self.cache.evictable_size()), int(self.cache.protected_size())

    def take_evicted(self) -> list[list[int]]:
        freed, self.allocator.freed = self.allocator.freed, []
        return freed

    def pages(self) -> list[tuple[PageKey, int, float]]:
        """(page key, first slot, last_access_time) of every cached page."""
        p = self.page_size
        out: list[tuple[PageKey, int, float]] = []
        stack: list[tuple[TreeNodeView, pc.Prefix | None]] = [
            (child, None) for child in self.cache.root_node.children.values()
        ]
        while stack:
            node, prefix = stack.pop()
            namespace = self.namespaces.get(node.key.extra_key, ("?", node.key.extra_key))
            tokens, values = list(node.key.token_ids), node.value.tolist()
            for offset in range(0, len(values), p):
                prefix = pc.Prefix.extend(prefix, tuple(tokens[offset : offset + p]))
                out.append(((namespace, prefix), int(values[offset]), node.last_access_time))
            stack.extend((child, prefix) for child in node.children.values())
        return out

    def cached_pages(self) -> dict[PageKey, int]:
        return {key: start for key, start, _ in self.pages()}

    def page_stamps(self) -> dict[PageKey, float]:
        return {key: stamp for key, _, stamp in self.pages()}


TARGET = TargetInfo(
    name="sglang:legacy",
    description=f"SGLang {VERSION} RadixCache (released wheel, simulated mode, mock allocator)",
    requires=(("sglang", f"radixspec targets install sglang  (pip install --no-deps sglang=={VERSION})"),),
    cache_factory=SGLangRadixCache,
    profile=PROFILE,
    how="no manager machine: SGLang's scheduler-side accounting needs its allocators and request objects",
    probe=import_radix_cache,
    engine_modules=("sglang.srt.mem_cache.radix_cache",),
)
