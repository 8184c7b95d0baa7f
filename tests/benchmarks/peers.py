"""Drivers of the peers benchmark: our caches and the released caches of SGLang, vLLM and mini-sglang.

Each driver calls its cache's own API (not the fuzzer's targets: their
bookkeeping is not the cache's cost) with inputs in the cache's own format,
built before the timed region:

* ``optimized``: int64 CPU token tensors, int32 slot tensors (what an engine on torch holds);
* ``reference``: lists;
* ``sglang`` 0.5.23 ``RadixCache`` (``create_simulated``): ``RadixKey`` over an ``array('q')``,
  int64 value tensors; its eviction takes whole leaves;
* ``sglang-unified`` and ``sglang-unified-python``: 0.5.23's default cache for a dense model,
  ``UnifiedRadixCache`` with its FULL component, on the compiled Rust tree core and on the Python
  one, over SGLang's real ``PagedTokenToKVPoolAllocator`` (evictions free into it); an insert
  frees no duplicates (``prev_prefix_len``: the caller's, as ours); events and metrics off, as an
  engine runs by default. ``sglang-unified-list`` builds its key from a Python list inside the call
  (what a scheduler holds: ``req.fill_ids``);
* ``vllm`` 0.33.0 ``BlockPool``: block hashes computed before timing (a request's hashes are
  computed once when it arrives); insert is what a request's lifetime does to the pool (hits,
  new blocks, ``cache_full_blocks``, free); eviction is a pop of a cached free block
  (``get_new_blocks(1)``), the pool choosing the pages;
* ``minisgl`` (a checkout: ``RADIXSPEC_MINISGL=/path``): int32 tensors, its C compare stood in
  by ours (``radixspec.fuzz.targets.minisgl``).

A peer that is not installed is skipped with the command that installs it.
"""

from __future__ import annotations

import functools
import gc
import os
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixspec import optimized, reference
from radixspec.fuzz.targets import TargetError, resolve

PEERS = ("optimized", "reference", "sglang", "sglang-unified", "sglang-unified-python", "vllm", "minisgl")
# ours evicting into its own buffer: the eviction groups run it too
EVICT_VARIANTS = ("optimized-out",)
# ours in every input format it takes, and SGLang with its list key: the insert and match groups run these too
FORMATS = (
    "optimized-int32",
    "optimized-int64",
    "optimized-list",
    "optimized-numpy",
    "optimized-array",
    "sglang-list",
    "sglang-unified-list",
)


def minisgl_root() -> Path | None:
    """The mini-sglang checkout named by RADIXSPEC_MINISGL, if any."""
    path = os.environ.get("RADIXSPEC_MINISGL")
    return Path(path) if path else None


def available(peer: str) -> str | None:
    """None when ``peer`` can run here, else why not (for pytest.skip)."""
    if peer.startswith(("optimized", "reference")):
        return None
    if peer == "sglang-list" or peer.startswith("sglang-unified"):
        return available("sglang")
    if peer == "minisgl":
        root = minisgl_root()
        if root is None:
            return "mini-sglang: set RADIXSPEC_MINISGL to a checkout (git clone https://github.com/sgl-project/mini-sglang)"
        name = f"minisgl:{root}"
    else:
        name = peer
    try:
        resolve(name)
    except TargetError as exc:
        return f"{peer}: {exc} (radixspec targets install {peer})"
    return None


class Driver:
    """One cache, driven through its own API."""

    name: str
    page_size: int

    def tokens(self, ids: list[int]) -> Any:
        """A token sequence in the cache's input format (built outside the timed region)."""
        raise NotImplementedError

    def slots(self, slots: list[int]) -> Any:
        return slots

    def insert(self, tokens: Any, slots: Any) -> Any:
        raise NotImplementedError

    def match(self, tokens: Any) -> Any:
        raise NotImplementedError

    def lock(self, handle: Any) -> None:
        raise NotImplementedError

    def unlock(self, handle: Any) -> None:
        raise NotImplementedError

    def evict(self, num_tokens: int) -> Any:
        """Evict at least ``num_tokens`` tokens, as the cache does it; returns what the cache returns."""
        raise NotImplementedError

    def evicted_starts(self, evicted: Any) -> list[int]:
        """First slots of the pages an ``evict`` gave back (outside the timed region)."""
        raise NotImplementedError

    def handle_of_insert(self, result: Any) -> Any:
        return result

    def memory_bytes(self) -> int | None:
        """Bytes the cache reports holding, when it can tell (our C tree does)."""
        return None


class OursDriver(Driver):
    def __init__(self, page_size: int, pool_pages: int) -> None:
        self.name, self.page_size = "optimized", page_size
        self.cache = optimized.RadixPrefixCache(page_size)

    def tokens(self, ids: list[int]) -> Any:
        return torch.tensor(ids, dtype=torch.int64)

    def slots(self, slots: list[int]) -> Any:
        return torch.tensor(slots, dtype=torch.int32)

    def insert(self, tokens: Any, slots: Any) -> Any:
        return self.cache.insert_prefix(tokens, slots)

    def handle_of_insert(self, result: Any) -> Any:
        return result.handle

    def match(self, tokens: Any) -> Any:
        return self.cache.match_prefix(tokens)

    def lock(self, handle: Any) -> None:
        self.cache.lock(handle)

    def unlock(self, handle: Any) -> None:
        self.cache.unlock(handle)

    def evict(self, num_tokens: int) -> Any:
        return self.cache.evict(num_tokens)

    def evicted_starts(self, evicted: Any) -> list[int]:
        return [int(s) for s in evicted[:: self.page_size].tolist()]

    def memory_bytes(self) -> int | None:
        return self.cache.tree_stats()["memory_bytes"]


class OursFormatDriver(OursDriver):
    """Ours with token ids and slots in another input format (``FORMAT_CONVERTERS``)."""

    def __init__(self, page_size: int, pool_pages: int, name: str = "optimized") -> None:
        super().__init__(page_size, pool_pages)
        self.name = name
        self.convert_tokens, self.convert_slots = FORMAT_CONVERTERS[name]

    def tokens(self, ids: list[int]) -> Any:
        return self.convert_tokens(ids)

    def slots(self, slots: list[int]) -> Any:
        return self.convert_slots(slots)


def _int32(values: list[int]) -> Any:
    return torch.tensor(values, dtype=torch.int32)


def _int64(values: list[int]) -> Any:
    return torch.tensor(values, dtype=torch.int64)


def _numpy(values: list[int]) -> Any:
    import numpy

    return numpy.array(values, dtype=numpy.int64)


# ours in each input format beside the int64 tokens / int32 slots of "optimized": (tokens, slots) converters
FORMAT_CONVERTERS: dict[str, tuple[Callable[[list[int]], Any], Callable[[list[int]], Any]]] = {
    "optimized-int32": (_int32, _int32),  # mini-sglang's format
    "optimized-int64": (_int64, _int64),
    "optimized-list": (list, list),  # what SGLang's and vLLM's requests hold
    "optimized-numpy": (_numpy, _numpy),
    "optimized-array": (lambda values: array("q", values), lambda values: array("q", values)),  # SGLang's key
}


class OursOutDriver(OursDriver):
    """Ours evicting into one buffer it keeps (``evict(size, out=)``): nothing allocated per call."""

    def __init__(self, page_size: int, pool_pages: int) -> None:
        super().__init__(page_size, pool_pages)
        self.name = "optimized-out"
        self.out = torch.empty(1 << 16, dtype=torch.int32)

    def evict(self, num_tokens: int) -> Any:
        n = -(-num_tokens // self.page_size) * self.page_size
        return self.cache.evict(num_tokens, out=self.out), n

    def evicted_starts(self, evicted: Any) -> list[int]:
        out, n = evicted
        return [int(s) for s in out[: n : self.page_size].tolist()]


class ReferenceDriver(OursDriver):
    def __init__(self, page_size: int, pool_pages: int) -> None:
        self.name, self.page_size = "reference", page_size
        self.cache = reference.RadixPrefixCache(page_size)  # type: ignore[assignment]

    def tokens(self, ids: list[int]) -> Any:
        return ids

    def slots(self, slots: list[int]) -> Any:
        return slots

    def evicted_starts(self, evicted: Any) -> list[int]:
        return list(evicted[:: self.page_size])

    def memory_bytes(self) -> int | None:
        return None


class SGLangDriver(Driver):
    def __init__(self, page_size: int, pool_pages: int) -> None:
        from radixspec.fuzz.targets import sglang

        self.name, self.page_size = "sglang", page_size
        self.rc = sglang.import_radix_cache()
        from sglang.srt.mem_cache import base_prefix_cache as base

        self.base = base
        self.allocator = sglang.RecordingAllocator(page_size)
        self.cache = self.rc.RadixCache.create_simulated(page_size=page_size, mock_allocator=self.allocator)
        self.clock = sglang.CLOCK

    def tokens(self, ids: list[int]) -> Any:
        return self.rc.RadixKey(array("q", ids), None)

    def slots(self, slots: list[int]) -> Any:
        return torch.tensor(slots, dtype=torch.int64)

    def insert(self, tokens: Any, slots: Any) -> Any:
        self.clock.tick()
        return self.cache.insert(self.base.InsertParams(key=tokens, value=slots))

    def handle_of_insert(self, result: Any) -> Any:
        return result.last_device_node

    def match(self, tokens: Any) -> Any:
        self.clock.tick()
        return self.cache.match_prefix(self.base.MatchPrefixParams(key=tokens)).last_device_node

    def lock(self, handle: Any) -> None:
        self.cache.inc_lock_ref(handle)

    def unlock(self, handle: Any) -> None:
        self.cache.dec_lock_ref(handle)

    def evict(self, num_tokens: int) -> Any:
        return self.cache.evict(self.base.EvictParams(num_tokens=num_tokens))

    def evicted_starts(self, evicted: Any) -> list[int]:
        freed, self.allocator.freed = self.allocator.freed, []
        return [slot for group in freed for slot in group[:: self.page_size]]


class SGLangListDriver(SGLangDriver):
    """SGLang's RadixCache with its key over a Python list (what its requests hold before the array)."""

    def __init__(self, page_size: int, pool_pages: int) -> None:
        super().__init__(page_size, pool_pages)
        self.name = "sglang-list"

    def tokens(self, ids: list[int]) -> Any:
        return self.rc.RadixKey(list(ids), None)


def unified_cache(page_size: int, allocator_pages: int, core: str) -> tuple[Any, Any, Any]:
    """SGLang's modules, its ``PagedTokenToKVPoolAllocator`` of ``allocator_pages`` pages (page 0 kept back, as
    SGLang keeps it) and a ``UnifiedRadixCache`` (FULL) on tree core ``core`` over it; events and metrics off."""
    from radixspec.fuzz.targets.sglang_modules import import_unified_cache, mapping_pool

    v = import_unified_cache()
    paged = __import__("sglang.srt.mem_cache.allocator.paged", fromlist=["PagedTokenToKVPoolAllocator"])
    allocator = paged.PagedTokenToKVPoolAllocator(
        size=allocator_pages * page_size,
        page_size=page_size,
        dtype=torch.float16,
        device="cpu",
        kvcache=mapping_pool(v),
        need_sort=False,
    )
    cache = v.urc.UnifiedRadixCache(
        v.params.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            tree_core_backend=core,
            eviction_policy="lru",
            tree_components=(v.components.FULL,),
        )
    )
    return v, allocator, cache


class SGLangUnifiedDriver(Driver):
    """SGLang's ``UnifiedRadixCache`` (FULL) on a tree core, over its real paged allocator."""

    core = "rust"

    def __init__(self, page_size: int, pool_pages: int) -> None:
        self.name, self.page_size = f"sglang-unified{'' if self.core == 'rust' else '-' + self.core}", page_size
        # the workloads' slots start at page 0 and run to the pool's last page
        v, self.allocator, self.cache = unified_cache(page_size, pool_pages + 2, self.core)
        self.RadixKey, self.InsertParams = v.radix.RadixKey, v.base.InsertParams
        self.MatchPrefixParams, self.EvictParams = v.base.MatchPrefixParams, v.base.EvictParams
        self.free_seen = len(self.allocator.free_pages)
        self.locks: dict[Any, list[Any]] = {}

    def tokens(self, ids: list[int]) -> Any:
        return self.RadixKey(array("q", ids), None)

    def slots(self, slots: list[int]) -> Any:
        return torch.tensor(slots, dtype=torch.int64)

    def insert(self, tokens: Any, slots: Any) -> Any:
        return self.cache.insert(self.InsertParams(key=tokens, value=slots, prev_prefix_len=len(slots)))

    def handle_of_insert(self, result: Any) -> Any:
        return result.last_device_node

    def match(self, tokens: Any) -> Any:
        return self.cache.match_prefix(self.MatchPrefixParams(key=tokens)).last_device_node

    def lock(self, handle: Any) -> None:
        # the cache's lock is a receipt its unlock takes back (SGLang's scheduler keeps it on the request)
        self.locks.setdefault(handle, []).append(self.cache.lock(handle))

    def unlock(self, handle: Any) -> None:
        self.cache.unlock(self.locks[handle].pop())

    def evict(self, num_tokens: int) -> Any:
        return self.cache.evict(self.EvictParams(num_tokens=num_tokens))

    def evicted_starts(self, evicted: Any) -> list[int]:
        # the allocator puts freed pages in front of its free list
        free = self.allocator.free_pages
        new, self.free_seen = len(free) - self.free_seen, len(free)
        return [int(page) * self.page_size for page in free[:new].tolist()]


class SGLangUnifiedPythonDriver(SGLangUnifiedDriver):
    core = "python"


class SGLangUnifiedListDriver(SGLangUnifiedDriver):
    """The Rust core with its key built from a Python list inside the call, as a scheduler builds it (the Rust
    core takes an ``array('q')`` only)."""

    def __init__(self, page_size: int, pool_pages: int) -> None:
        super().__init__(page_size, pool_pages)
        self.name = "sglang-unified-list"

    def tokens(self, ids: list[int]) -> Any:
        return list(ids)

    def insert(self, tokens: Any, slots: Any) -> Any:
        return super().insert(self.RadixKey(array("q", tokens), None), slots)

    def match(self, tokens: Any) -> Any:
        return super().match(self.RadixKey(array("q", tokens), None))


class VLLMDriver(Driver):
    """vLLM's BlockPool; ``pool_pages`` blocks (plus its null block), every one of them cacheable."""

    def __init__(self, page_size: int, pool_pages: int) -> None:
        from radixspec.fuzz.targets import vllm

        self.name, self.page_size = "vllm", page_size
        self.target = vllm.VLLMPrefixCache(page_size, pool_pages)
        self.pool = self.target.pool
        self.v = self.target.v
        self.requests = 0
        # take the adapter's eviction hook off: it records for the fuzzer
        self.pool._maybe_evict_cached_block = type(self.pool)._maybe_evict_cached_block.__get__(self.pool)

    def tokens(self, ids: list[int]) -> Any:
        from radixspec.fuzz.targets.vllm import RequestStandIn

        self.requests += 1
        request = RequestStandIn(ids, None, self.requests)
        request.block_hashes = self.target.hasher(request)
        return request

    def slots(self, slots: list[int]) -> Any:
        return None  # the pool picks the blocks

    def _hits(self, request: Any) -> list[Any]:
        length = len(request.block_hashes) * self.page_size
        blocks, _ = self.v.manager.find_longest_cache_hit(
            request.block_hashes, length, [0], self.pool, self.target.spec, False, self.page_size
        )
        return list(blocks[0])

    def insert(self, request: Any, slots: Any) -> Any:
        hits = self._hits(request)
        self.pool.touch(hits)
        blocks = hits + self.pool.get_new_blocks(len(request.block_hashes) - len(hits))
        self.pool.cache_full_blocks(request, blocks, len(hits), len(blocks), self.page_size, 0)
        self.pool.free_blocks(reversed(blocks))
        return blocks

    def match(self, request: Any) -> Any:
        return self._hits(request)

    def lock(self, handle: Any) -> None:
        self.pool.touch(handle)

    def unlock(self, handle: Any) -> None:
        self.pool.free_blocks(reversed(handle))

    def evict(self, num_tokens: int) -> Any:
        # the pool evicts a cached block when it hands it out (to an engine, which then uses it)
        return self.pool.get_new_blocks(-(-num_tokens // self.page_size))

    def evicted_starts(self, evicted: Any) -> list[int]:
        # the engine is done with them: back to the pool, without a hash (outside the timed region)
        self.pool.free_blocks(evicted)
        return [(block.block_id - 1) * self.page_size for block in evicted]


class MiniSGLangDriver(Driver):
    def __init__(self, page_size: int, pool_pages: int) -> None:
        from radixspec.fuzz.targets import minisgl

        root = minisgl.checkout_root(str(minisgl_root()))
        self.name, self.page_size = "minisgl", page_size
        self.target = minisgl.MiniSGLangRadixCache(root, page_size)
        self.cache = self.target.cache
        self.clock = minisgl.CLOCK

    def tokens(self, ids: list[int]) -> Any:
        return torch.tensor(ids, dtype=torch.int32)

    def slots(self, slots: list[int]) -> Any:
        return torch.tensor(slots, dtype=torch.int32)

    def insert(self, tokens: Any, slots: Any) -> Any:
        self.clock.tick()
        return self.cache.insert_prefix(tokens, slots)

    def handle_of_insert(self, result: Any) -> Any:
        return result[1]

    def match(self, tokens: Any) -> Any:
        self.clock.tick()
        return self.cache.match_prefix(tokens).cuda_handle

    def lock(self, handle: Any) -> None:
        self.cache.lock_handle(handle, unlock=False)

    def unlock(self, handle: Any) -> None:
        self.cache.lock_handle(handle, unlock=True)

    def evict(self, num_tokens: int) -> Any:
        return self.cache.evict(num_tokens)

    def evicted_starts(self, evicted: Any) -> list[int]:
        return [int(s) for s in evicted[:: self.page_size].tolist()]


DRIVERS: dict[str, Callable[[int, int], Driver]] = {
    "optimized": OursDriver,
    "reference": ReferenceDriver,
    **{name: functools.partial(OursFormatDriver, name=name) for name in FORMAT_CONVERTERS},
    "optimized-out": OursOutDriver,
    "sglang": SGLangDriver,
    "sglang-list": SGLangListDriver,
    "sglang-unified": SGLangUnifiedDriver,
    "sglang-unified-python": SGLangUnifiedPythonDriver,
    "sglang-unified-list": SGLangUnifiedListDriver,
    "vllm": VLLMDriver,
    "minisgl": MiniSGLangDriver,
}


def make(peer: str, page_size: int, pool_pages: int) -> Driver:
    return DRIVERS[peer](page_size, pool_pages)


# ---------------------------------------------------------------- the table's workload


@dataclass
class SharedPrompts:
    """20,000 prompts of a 1,024-token shared prefix and 64 own tokens (P=16): the issue's table."""

    prompts: list[list[int]]
    slots: list[list[int]]
    page_size: int

    @property
    def pages(self) -> int:
        """Distinct pages all prompts cache."""
        p = self.page_size
        return len(self.prompts[0]) // p + len(self.prompts) * ((len(self.prompts[0]) - self.shared) // p)

    shared: int = 1024


def shared_prompts(page_size: int = 16, prompts: int = 20_000, shared: int = 1024, own: int = 64) -> SharedPrompts:
    rnd = random.Random(1)
    system = [rnd.randrange(32_000) for _ in range(shared)]
    all_prompts, all_slots = [], []
    for b in range(prompts):
        all_prompts.append(system + [rnd.randrange(32_000) for _ in range(own)])
        all_slots.append(list(range(shared)) + list(range(shared + b * own, shared + (b + 1) * own)))
    return SharedPrompts(all_prompts, all_slots, page_size, shared)


@dataclass
class Loaded:
    """A driver holding the whole workload, and the workload in its format."""

    driver: Driver
    tokens: list[Any]
    slots: list[Any]


def load(peer: str, work: SharedPrompts, insert: bool = True) -> Loaded:
    """A fresh driver with every prompt converted (and inserted unless ``insert`` is False)."""
    driver = make(peer, work.page_size, work.pages)
    tokens = [driver.tokens(ids) for ids in work.prompts]
    slots = [driver.slots(s) for s in work.slots]
    if insert:
        insert_all(driver, tokens, slots)
    return Loaded(driver, tokens, slots)


def insert_all(driver: Driver, tokens: list[Any], slots: list[Any]) -> None:
    for t, s in zip(tokens, slots, strict=True):
        driver.insert(t, s)


def match_some(driver: Driver, tokens: list[Any], count: int = 5000) -> None:
    for t in tokens[:count]:
        driver.match(t)


def resident_bytes() -> int:
    """This process's resident memory (bytes), after a collection."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- (b) evict under pressure


class LeafFarm:
    """(b) ``leaves`` evictable one-page leaves under a one-page prefix; an evicted leaf is replaced (untimed).

    ``shuffled``: the leaves were locked and unlocked out of order first, so their stamps are not in
    the order they were inserted (our C tree then pops from its heap, not its in-order queue).
    """

    def __init__(self, peer: str, page_size: int, leaves: int, shuffled: bool = False) -> None:
        self.page_size = page_size
        self.driver = make(peer, page_size, leaves + 1)
        self.prefix = [1] * page_size
        self.next_leaf = 0
        self.free_pages = list(range(leaves + 1, 0, -1))  # page 0 holds the prefix
        self.driver.insert(self.driver.tokens(self.prefix), self.driver.slots(list(range(page_size))))
        handles = [self.add_leaf() for _ in range(leaves)]
        if shuffled:
            # lock every leaf but the newest and evict that one: the queue drops the locked leaves' entries on
            # the way; unlocked in random order, they come back with stamps out of order (our heap path)
            for handle in handles[:-1]:
                self.driver.lock(handle)
            self.refill(self.evict_one_page())
            handles = handles[:-1]
            random.Random(5).shuffle(handles)
            for handle in handles:
                self.driver.unlock(handle)

    def add_leaf(self) -> Any:
        """Insert one new leaf on a free page; its insert handle."""
        p = self.page_size
        self.next_leaf += 1
        leaf = [2 + (self.next_leaf * p + k) % (1 << 40) for k in range(p)]
        page = self.free_pages.pop()
        slots = list(range(p)) + list(range(page * p, page * p + p))
        result = self.driver.insert(self.driver.tokens(self.prefix + leaf), self.driver.slots(slots))
        return self.driver.handle_of_insert(result)

    def evict_one_page(self) -> Any:
        return self.driver.evict(self.page_size)

    def refill(self, evicted: Any) -> None:
        for start in self.driver.evicted_starts(evicted):
            self.free_pages.append(start // self.page_size)
            self.add_leaf()


# ---------------------------------------------------------------- (c) one long prompt


def long_prompt(peer: str, page_size: int, length: int = 32_768, chunk: int = 1024) -> tuple[Driver, Any]:
    """(c) a cache holding a ``length``-token prompt inserted chunk by chunk, and the prompt to match."""
    rnd = random.Random(2)
    ids = [rnd.randrange(32_000) for _ in range(length)]
    driver = make(peer, page_size, length // page_size + 1)
    for end in range(chunk, length + 1, chunk):
        driver.insert(driver.tokens(ids[:end]), driver.slots(list(range(end))))
    return driver, driver.tokens(ids)


# ---------------------------------------------------------------- (d) a serving loop


def trace_for(driver: Driver, ops: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A recorded serving trace (``workloads.serving_trace``) in the driver's input format."""
    converted: list[tuple[Any, ...]] = []
    for op in ops:
        if op[0] == "match":
            converted.append(("match", driver.tokens(op[1])))
        elif op[0] == "insert":
            converted.append(("insert", driver.tokens(op[1]), driver.slots(op[2])))
        else:
            converted.append(op)
    return converted


def replay(driver: Driver, ops: list[tuple[Any, ...]]) -> None:
    """Run the trace: match, lock, insert, unlock, evict (vLLM: take the pages and give them back)."""
    handles: list[Any] = []
    for op in ops:
        kind = op[0]
        if kind == "match":
            handles.append(driver.match(op[1]))
        elif kind == "insert":
            handles.append(driver.handle_of_insert(driver.insert(op[1], op[2])))
        elif kind == "lock":
            driver.lock(handles[op[1]])
        elif kind == "unlock":
            driver.unlock(handles[op[1]])
        elif op[1] > 0:
            evicted = driver.evict(op[1])
            if isinstance(driver, VLLMDriver):
                driver.evicted_starts(evicted)


# ---------------------------------------------------------------- memory


def measure_memory(peer: str, page_size: int = 16, prompts: int = 20_000) -> dict[str, float]:
    """Bytes per cached page of the table's workload, in this (fresh) process: resident growth over the build.

    The inputs are converted first, by another instance, so that only the cache's own bytes count.
    """
    work = shared_prompts(page_size, prompts)
    inputs = load(peer, work, insert=False)
    before = resident_bytes()
    driver = make(peer, page_size, work.pages)
    insert_all(driver, inputs.tokens, inputs.slots)
    grown = resident_bytes() - before
    result = {"pages": float(work.pages), "bytes_per_page": round(grown / work.pages, 1)}
    reported = driver.memory_bytes()
    if reported is not None:
        result["reported_bytes_per_page"] = round(reported / work.pages, 1)
    return result


# ---------------------------------------------------------------- scale: 1k to 1M cached pages


def scale_prompts(pages: int, page_size: int = 16, own_pages: int = 4, seed: int = 3) -> SharedPrompts:
    """Prompts of one shared page and ``own_pages`` pages of their own, enough for ``pages`` cached pages: a
    wide tree (one leaf run per prompt), the shape a busy cache has."""
    rnd = random.Random(seed)
    p, count = page_size, max(1, -(-(pages - 1) // own_pages))
    head = [rnd.randrange(32_000) for _ in range(p)]
    prompts, slots = [], []
    for b in range(count):
        prompts.append(head + [rnd.randrange(1 << 40) for _ in range(own_pages * p)])
        slots.append(list(range(p)) + list(range(p + b * own_pages * p, p + (b + 1) * own_pages * p)))
    return SharedPrompts(prompts, slots, page_size, shared=p)


def measure_scale_memory(peer: str, pages: int, page_size: int = 16) -> dict[str, float]:
    """Bytes per cached page at ``pages`` cached pages (``scale_prompts``), in this (fresh) process."""
    work = scale_prompts(pages, page_size)
    inputs = load(peer, work, insert=False)
    before = resident_bytes()
    driver = make(peer, page_size, work.pages)
    insert_all(driver, inputs.tokens, inputs.slots)
    grown, distinct = (
        resident_bytes() - before,
        1 + len(work.prompts) * (len(work.prompts[0]) - work.shared) // page_size,
    )
    result = {"pages": float(distinct), "bytes_per_page": round(grown / distinct, 1)}
    reported = driver.memory_bytes()
    if reported is not None:
        result["reported_bytes_per_page"] = round(reported / distinct, 1)
    return result


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) > 2:
        print(json.dumps(measure_scale_memory(sys.argv[1], int(sys.argv[2]))))
    else:
        print(json.dumps(measure_memory(sys.argv[1])))
