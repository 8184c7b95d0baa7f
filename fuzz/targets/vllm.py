"""Target ``vllm``: vLLM 0.33.0's prefix caching (``BlockPool`` with its block hashing) mapped onto the page model.

A block is a page keyed by its prefix: its hash chains the hashes of the
blocks before it (``kv_cache_utils``' sha256 hasher, through vLLM's own
``get_request_block_hasher``), so the pool's hash map is the spec's page
dict. The operations are the ones ``KVCacheManager`` performs for one
request of one full-attention group:

* ``match_prefix``: ``FullAttentionManager.find_longest_cache_hit`` (no
  recency change: vLLM refreshes on use, not on lookup);
* ``insert_prefix``: touch the hit blocks, ``get_new_blocks`` for the rest
  (the pool picks them, evicting cached free blocks from the head of its
  free queue), ``cache_full_blocks``, then ``free_blocks`` in reverse, as a
  finished request does;
* ``lock`` / ``unlock``: ``touch`` / ``free_blocks(reversed(...))``.

Eviction is implicit: a cached free block is evicted when the pool hands it
out again. The profile's LRU rule is the free queue (``FreeQueueModel``,
written here from vLLM's documented behaviour, not copied): blocks freed with
a hash go to the tail (oldest evicted first), blocks freed without one to the
head, allocation pops from the head. A namespace becomes the request's
``cache_salt`` (its ``repr``). Block 0 is vLLM's null block; block ``b`` holds
slots ``(b - 1) * P ...``.
"""

from __future__ import annotations

import bisect
import importlib.util
import re
import sys
import types
from collections import Counter, OrderedDict
from typing import Protocol

from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace

from .api import PageKey, Profile, TargetInfo
from .shims import Recorded, bare, compiled_from, importable, never, package_root, register, stub, stub_any

VERSION = "0.33.0"
# vLLM's cache modules that --coverage measures: the block pool (with the prefix hashes), the coordinator and its
# per-group managers, the request-level manager, the CPU offloading manager and its policies, the connectors
CORE = "vllm.v1.core"
BLOCK_POOL_MODULES = (f"{CORE}.block_pool", f"{CORE}.kv_cache_utils")
COORDINATOR_MODULES = (*BLOCK_POOL_MODULES, f"{CORE}.kv_cache_coordinator", f"{CORE}.single_type_kv_cache_manager")
OFFLOAD_MANAGER_MODULES = tuple(
    f"vllm.v1.kv_offload.cpu.{name}" for name in ("manager", "policies.lru", "policies.arc")
)
CONNECTOR_MODULES = (
    *COORDINATOR_MODULES,
    f"{CORE}.kv_cache_manager",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
    *OFFLOAD_MANAGER_MODULES,
)
SIMPLE_OFFLOAD_MODULES = (*COORDINATOR_MODULES, f"{CORE}.kv_cache_manager", "vllm.v1.simple_kv_offload.manager")


class FreeQueueModel:
    """vLLM's eviction rule as a model the strict mode checks: a free queue of pages, head evicted first."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        # free pages (first slots), head first; initially every page in order
        self.queue: OrderedDict[int, None] = OrderedDict((page * page_size, None) for page in range(num_pages))
        self.refs: Counter[int] = Counter()
        # pages holding a cached prefix (a hash, in vLLM's words)
        self.cached: set[int] = set()

    def match(self, pages: list[int]) -> None:
        """A lookup changes no recency."""

    def lock(self, pages: list[int]) -> None:
        """touch: a page in use leaves the free queue."""
        for page in pages:
            if self.refs[page] == 0:
                del self.queue[page]
            self.refs[page] += 1

    def unlock(self, pages: list[int]) -> None:
        """free_blocks of the path in reverse: cached pages join the tail, the others the head."""
        head: list[int] = []
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.cached:
                    self.queue[page] = None
                else:
                    head.append(page)
        for page in reversed(head):
            self.queue[page] = None
            self.queue.move_to_end(page, last=False)

    def insert(self, hits: list[int], new_count: int) -> tuple[list[int], list[int]]:
        """A request's lifetime: touch the hits, take pages from the head (evicting cached ones), free all."""
        self.lock(hits)
        new, evicted = [], []
        for _ in range(new_count):
            page, _ = self.queue.popitem(last=False)
            if page in self.cached:
                self.cached.discard(page)
                evicted.append(page)
            self.refs[page] = 1
            new.append(page)
        self.cached.update(new)
        self.unlock(hits + new)
        return new, evicted

    def reset(self) -> None:
        """Every hash dropped; the queue keeps its order."""
        self.cached.clear()


PROFILE = Profile(
    name=f"vllm {VERSION} BlockPool (prefix caching)",
    eviction_unit="node",
    eviction_trigger="allocate",
    clock="order",
    errors="none",
    namespaces=True,
    reset="drops",
    slots="target",
    default_lru="strict",
    lru_model=FreeQueueModel,
    notes=(
        "the pool picks the pages of an insert; a cached free page is evicted when it is handed out again",
        "LRU rule: the free queue (freed cached blocks join the tail in reverse path order; allocation pops the head)",
        "a match changes no recency (vLLM refreshes on use); an insert touches and frees its hits, as a request does",
        "no input validation: invalid calls are not sent; reset drops every hash (only when nothing is in use)",
        "KV events (msgspec and pyzmq installed): the pool's BlockStored / BlockRemoved / AllBlocksCleared replayed",
    ),
)


def import_vllm() -> types.ModuleType:
    """vLLM's block pool, hashing and full-attention lookup, with bare packages and stubs."""
    cached = sys.modules.get("vllm.__radixspec__")
    if cached is not None:
        return cached
    root = package_root("vllm")
    # __init__ files that patch torch (vllm), build every config (vllm.config), start parallel state
    for name in ("vllm", "vllm.distributed", "vllm.config", "vllm.multimodal", "vllm.v1", "vllm.v1.core", "vllm.utils"):
        bare(name, root.joinpath(*name.split(".")[1:]))
    bare("vllm.v1.metrics", root / "v1" / "metrics")
    # the prefix hasher's one multimodal helper (its module imports PIL and the media loaders), from its own source
    window = compiled_from(root / "multimodal" / "utils.py", ["get_mm_features_in_window"], {"bisect": bisect})
    stub("vllm.multimodal.utils", **window)
    stub("vllm.v1.metrics.stats", KVCacheEvictionEvent=Recorded)
    stub("vllm.v1.request", Request=object)  # annotations only: the adapter passes its own stand-in
    stub("vllm.v1.utils", tensor_data=never, ConstantList=list)
    stub("vllm.utils.torch_utils", get_dtype_size=never)
    stub("vllm.config", VllmConfig=object)
    sys.modules.setdefault("regex", re)  # vLLM imports the regex package for patterns re handles
    if not importable("psutil"):
        # 0.32.0's kv_cache_utils imports a size formatter from mem_utils, which imports psutil
        stub("vllm.utils.mem_utils", format_gib=lambda size: f"{size / 2**30:.2f}")
    # 0.32.0's kv_cache_utils imports HiSparse's layout helpers (a config of KV transfer), never called here
    stub_any("vllm.v1.hisparse.layout")
    if not importable("cbor2"):
        stub_any("cbor2")  # only sha256_cbor uses it; the default hash is sha256 over pickle
    real_events = importable("msgspec") and importable("zmq")
    if real_events:
        # vLLM's own event classes (msgspec structs): its event recorder runs for real under the fuzzer
        stub("vllm.config.kv_events", KVEventsConfig=object)  # the publisher's config: not used here
        stub(
            "vllm.utils.network_utils",
            get_ip=never,
            get_tcp_uri=never,
            is_valid_ipv6_address=never,
            split_zmq_path=never,
        )
        importlib.import_module("vllm.v1.core.kv_cache_utils")
        importlib.import_module("vllm.distributed.kv_events")
    else:
        stub(
            "vllm.distributed.kv_events",
            MEDIUM_GPU="GPU",
            MEDIUM_CPU="CPU",
            BlockStored=Recorded,
            BlockRemoved=Recorded,
            AllBlocksCleared=Recorded,
            KVCacheEvent=Recorded,
        )
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core import block_pool, kv_cache_utils
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kv_cache_utils.init_none_hash(sha256)
    return register(
        "vllm.__radixspec__",
        block_pool=block_pool,
        utils=kv_cache_utils,
        manager=FullAttentionManager,
        spec=FullAttentionSpec,
        hash_fn=sha256,
        torch=torch,
        kv_events=sys.modules["vllm.distributed.kv_events"] if real_events else None,
    )


class BlockView(Protocol):
    """What the adapters read of vLLM's ``KVCacheBlock``."""

    # block b holds slots (b - 1) * P ... (block 0 is the null block)
    block_id: int
    # the live requests holding it
    ref_cnt: int
    # its BlockHashWithGroupId while it is cached, else None
    block_hash: bytes | None
    is_null: bool


class CachedBlockView(BlockView, Protocol):
    """A block the pool caches: it has a hash."""

    block_hash: bytes


class RequestStandIn:
    """What the block pool and the hasher read of a ``vllm.v1.request.Request``."""

    def __init__(self, tokens: list[int], cache_salt: str | None, request_id: int) -> None:
        self.all_token_ids = tokens
        self.num_tokens = len(tokens)
        self.block_hashes: list[bytes] = []
        self.mm_features: list[object] = []
        self.lora_request: object | None = None
        self.cache_salt = cache_salt
        self.prompt_embeds = None
        self.request_id = str(request_id)
        self.session_id = None
        # "full": a hit's blocks are announced again as events (a gateway's requests; vllm_hybrid.REANNOUNCED)
        self.kv_cache_report_mode = "incremental"


class VLLMPrefixCache:
    """vLLM's BlockPool behind the target protocol (see the module docstring)."""

    profile = PROFILE

    def __init__(self, page_size: int, num_pages: int) -> None:
        self.v = import_vllm()
        self.page_size = page_size
        # vLLM's event recorder runs for real when its event classes import (msgspec, pyzmq installed)
        self.events_enabled = self.v.kv_events is not None
        self.pool = self.v.block_pool.BlockPool(
            num_gpu_blocks=num_pages + 1,
            enable_caching=True,
            hash_block_size=page_size,
            enable_kv_cache_events=self.events_enabled,
        )
        # the pool's events so far, as the spec's; a stored block's namespace is the call's (the wire
        # names it only through the hash, which folds in the cache salt)
        self.events: list[ev.Event] = []
        if self.events_enabled:
            self.take_events = self._take_events
        self.spec = self.v.spec(block_size=page_size, num_kv_heads=1, head_size=1, dtype=self.v.torch.float32)
        self.hasher = self.v.utils.get_request_block_hasher(page_size, self.v.hash_fn)
        self.evicted: list[list[int]] = []
        self.key_of_hash: dict[bytes, PageKey] = {}
        self.requests = 0
        # observe evictions where they happen: the pool's own hook, called for every block it hands out
        evict_one = self.pool._maybe_evict_cached_block

        def recording_evict(block: BlockView) -> bool:
            evicted: bool = evict_one(block)
            if evicted:
                self.evicted.append(self.slots_of([block]))
            return evicted

        self.pool._maybe_evict_cached_block = recording_evict

    def slots_of(self, blocks: list[BlockView]) -> list[int]:
        p = self.page_size
        return [(block.block_id - 1) * p + offset for block in blocks for offset in range(p)]

    def request(self, tokens: list[int], namespace: Namespace) -> RequestStandIn:
        self.requests += 1
        request = RequestStandIn(tokens, None if namespace is None else repr(namespace), self.requests)
        request.block_hashes = self.hasher(request)
        prefixes = pc.compute_page_prefixes(tokens, self.page_size)
        for block_hash, prefix in zip(request.block_hashes, prefixes, strict=True):
            key = self.v.utils.make_block_hash_with_group_id(block_hash, 0)
            self.key_of_hash[key] = (namespace, prefix)
        return request

    def hits(self, request: RequestStandIn) -> list[BlockView]:
        length = len(request.block_hashes) * self.page_size
        blocks, _ = self.v.manager.find_longest_cache_hit(
            request.block_hashes, length, [0], self.pool, self.spec, False, self.page_size
        )
        return list(blocks[0])

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> list[BlockView]:
        return self.hits(self.request(tokens, namespace))

    def insert_prefix(
        self, tokens: list[int], indices: list[int] | None, namespace: Namespace
    ) -> tuple[int, list[BlockView]]:
        request = self.request(tokens, namespace)
        hits = self.hits(request)
        self.pool.touch(hits)
        blocks = hits + self.pool.get_new_blocks(len(request.block_hashes) - len(hits))
        self.pool.cache_full_blocks(request, blocks, len(hits), len(blocks), self.page_size, 0)
        self.pool.free_blocks(reversed(blocks))
        self.drain_events(namespace)
        return len(hits) * self.page_size, blocks

    def drain_events(self, namespace: Namespace) -> None:
        """The pool's queued events, converted while the call's namespace is known."""
        if self.events_enabled:
            self.events.extend(ev.from_block_events(self.pool.take_events(), lambda extra: namespace))

    def _take_events(self) -> list[ev.Event]:
        events, self.events = self.events, []
        return events

    def cached_len(self, handle: list[BlockView]) -> int:
        return len(handle) * self.page_size

    def get_matched_indices(self, handle: list[BlockView]) -> list[int]:
        return self.slots_of(handle)

    def lock(self, handle: list[BlockView]) -> None:
        self.pool.touch(handle)

    def unlock(self, handle: list[BlockView]) -> None:
        self.pool.free_blocks(reversed(handle))

    def reset(self) -> None:
        assert self.pool.reset_prefix_cache(), "reset_prefix_cache refused (a block is in use)"
        self.drain_events(None)

    def cached_blocks(self) -> list[CachedBlockView]:
        return [block for block in self.pool.blocks[1:] if block.block_hash is not None]

    def size_info(self) -> tuple[int, int]:
        blocks = self.cached_blocks()
        locked = sum(1 for block in blocks if block.ref_cnt > 0)
        return (len(blocks) - locked) * self.page_size, locked * self.page_size

    def take_evicted(self) -> list[list[int]]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def cached_pages(self) -> dict[PageKey, int]:
        return {
            self.key_of_hash[block.block_hash]: (block.block_id - 1) * self.page_size for block in self.cached_blocks()
        }

    def page_stamps(self) -> dict[PageKey, int]:
        """Position in the free queue (lower: evicted sooner); pages in use have none."""
        order = {
            block.block_id: position for position, block in enumerate(self.pool.free_block_queue.get_all_free_blocks())
        }
        return {
            self.key_of_hash[block.block_hash]: order[block.block_id]
            for block in self.cached_blocks()
            if block.block_id in order
        }


TARGET = TargetInfo(
    name="vllm",
    description=f"vLLM {VERSION} BlockPool prefix caching (released wheel; sha256 block hashes; free-queue LRU)",
    requires=(("vllm", f"radixspec targets install vllm  (pip install --no-deps vllm=={VERSION} cbor2)"),),
    cache_factory=VLLMPrefixCache,
    profile=PROFILE,
    how="no manager machine: KVCacheManager needs vLLM's scheduler config; its per-request calls are the cache's",
    probe=import_vllm,
    engine_modules=BLOCK_POOL_MODULES,
)
