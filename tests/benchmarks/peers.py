"""Drivers of the peers benchmark: our caches and the released caches of SGLang, vLLM and mini-sglang.

Each driver calls its cache's own API (not the fuzzer's adapters: their
bookkeeping is not the cache's cost) with inputs in the cache's own format,
built before the timed region:

* ``optimized``: int64 CPU token tensors, int32 slot tensors (what an engine on torch holds);
* ``reference``: lists;
* ``sglang`` 0.5.23 ``RadixCache`` (``create_simulated``): ``RadixKey`` over an ``array('q')``,
  int64 value tensors; its eviction takes whole leaves;
* ``vllm`` 0.33.0 ``BlockPool``: block hashes computed before timing (a request's hashes are
  computed once when it arrives); insert is what a request's lifetime does to the pool (hits,
  new blocks, ``cache_full_blocks``, free); eviction is a pop of a cached free block
  (``get_new_blocks(1)``), the pool choosing the pages;
* ``minisgl`` (a checkout: ``RADIXSPEC_MINISGL=/path``): int32 tensors, its C compare stood in
  by ours (``fuzz.targets.minisgl``).

A peer that is not installed is skipped with the command that installs it.
"""

from __future__ import annotations

import gc
import os
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import optimized
import reference
from fuzz.targets import TargetError, resolve

PEERS = ("optimized", "reference", "sglang", "vllm", "minisgl")


def minisgl_root() -> Path | None:
    """The mini-sglang checkout named by RADIXSPEC_MINISGL, if any."""
    path = os.environ.get("RADIXSPEC_MINISGL")
    return Path(path) if path else None


def available(peer: str) -> str | None:
    """None when ``peer`` can run here, else why not (for pytest.skip)."""
    if peer in ("optimized", "reference"):
        return None
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
        return f"{peer}: {exc} (python -m fuzz.targets install {peer})"
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

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` tokens (as the cache does it); return the pages evicted."""
        raise NotImplementedError

    def handle_of_insert(self, result: Any) -> Any:
        return result


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

    def evict(self, num_tokens: int) -> int:
        return int(self.cache.evict(num_tokens).numel()) // self.page_size


class ReferenceDriver(OursDriver):
    def __init__(self, page_size: int, pool_pages: int) -> None:
        self.name, self.page_size = "reference", page_size
        self.cache = reference.RadixPrefixCache(page_size)  # type: ignore[assignment]

    def tokens(self, ids: list[int]) -> Any:
        return ids

    def slots(self, slots: list[int]) -> Any:
        return slots

    def evict(self, num_tokens: int) -> int:
        return len(self.cache.evict(num_tokens)) // self.page_size


class SGLangDriver(Driver):
    def __init__(self, page_size: int, pool_pages: int) -> None:
        from fuzz.targets import sglang

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

    def evict(self, num_tokens: int) -> int:
        before = len(self.allocator.freed)
        self.cache.evict(self.base.EvictParams(num_tokens=num_tokens))
        freed = self.allocator.freed[before:]
        del self.allocator.freed[before:]
        return sum(len(group) for group in freed) // self.page_size


class VLLMDriver(Driver):
    """vLLM's BlockPool; ``pool_pages`` blocks (plus its null block), every one of them cacheable."""

    def __init__(self, page_size: int, pool_pages: int) -> None:
        from fuzz.targets import vllm

        self.name, self.page_size = "vllm", page_size
        self.target = vllm.VLLMPrefixCache(page_size, pool_pages)
        self.pool = self.target.pool
        self.v = self.target.v
        self.requests = 0
        # take the adapter's eviction hook off: it records for the fuzzer
        self.pool._maybe_evict_cached_block = type(self.pool)._maybe_evict_cached_block.__get__(self.pool)
        self.taken: list[Any] = []

    def tokens(self, ids: list[int]) -> Any:
        from fuzz.targets.vllm import RequestStandIn

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

    def evict(self, num_tokens: int) -> int:
        pages = -(-num_tokens // self.page_size)
        # the pool evicts a cached block when it hands it out: keep what it hands out (an engine would use it)
        self.taken.extend(self.pool.get_new_blocks(pages))
        return pages


class MiniSGLangDriver(Driver):
    def __init__(self, page_size: int, pool_pages: int) -> None:
        from fuzz.targets import minisgl

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

    def evict(self, num_tokens: int) -> int:
        return int(self.cache.evict(num_tokens).numel()) // self.page_size


DRIVERS: dict[str, Callable[[int, int], Driver]] = {
    "optimized": OursDriver,
    "reference": ReferenceDriver,
    "sglang": SGLangDriver,
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
