"""Workloads of the benchmarks, built once outside the timed region, each in every implementation's format.

Reference takes lists; optimized takes CPU token tensors and device slot tensors.
The reference is also the full-scan baseline of eviction: it collects every
evictable leaf on each evict call (mini-sglang's way).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixspec import optimized, reference
from radixspec.spec.helpers import div_ceil

IMPLS = ("optimized", "reference")


def make_cache(impl: str, page_size: int) -> Any:
    if impl == "reference":
        return reference.RadixPrefixCache(page_size)
    return optimized.RadixPrefixCache(page_size)


def as_impl_tokens(impl: str, tokens: list[int]) -> Any:
    return tokens if impl == "reference" else torch.tensor(tokens, dtype=torch.int64)


def as_impl_slots(impl: str, slots: list[int]) -> Any:
    return slots if impl == "reference" else torch.tensor(slots, dtype=torch.int32)


def page_slots(first_page: int, num_tokens: int, page_size: int) -> list[int]:
    """Slots of consecutive pages starting at page ``first_page``, for ``num_tokens`` tokens."""
    return list(range(first_page * page_size, first_page * page_size + num_tokens))


@dataclass
class SharedPromptWorkload:
    """(a) a shared system prompt and many branches: insert all, then match all."""

    inserts: list[tuple[Any, Any]]
    matches: list[Any]


def shared_prompt(
    impl: str, page_size: int, prompt_len: int = 1024, branches: int = 20_000, branch_len: int = 64
) -> SharedPromptWorkload:
    rnd = random.Random(1)
    system = [rnd.randrange(32_000) for _ in range(prompt_len)]
    inserts, matches = [], []
    pages_per_branch = div_ceil(branch_len, page_size)
    system_pages = div_ceil(prompt_len, page_size)
    for b in range(branches):
        tokens = system + [rnd.randrange(32_000) for _ in range(branch_len)]
        # the system prompt's pages are the same for every branch (cached after the first)
        slots = page_slots(0, prompt_len, page_size) + page_slots(
            system_pages + b * pages_per_branch, branch_len, page_size
        )
        inserts.append((as_impl_tokens(impl, tokens), as_impl_slots(impl, slots)))
        matches.append(as_impl_tokens(impl, tokens))
    return SharedPromptWorkload(inserts, matches)


def run_shared_prompt(cache: Any, work: SharedPromptWorkload) -> None:
    for tokens, slots in work.inserts:
        cache.insert_prefix(tokens, slots)
    for tokens in work.matches:
        cache.match_prefix(tokens)


class LeafFarm:
    """(b) a tree with ``leaves`` evictable one-page leaves under a shared prefix; refilled after each evict."""

    def __init__(self, impl: str, page_size: int, leaves: int, shuffled: bool = False) -> None:
        self.impl, self.page_size = impl, page_size
        self.cache = make_cache(impl, page_size)
        self.next_id = 0
        self.free_pages: list[int] = []
        self.next_page = 1
        prefix = [1] * page_size
        self.cache.insert_prefix(as_impl_tokens(impl, prefix), as_impl_slots(impl, page_slots(0, page_size, page_size)))
        self.prefix = prefix
        tokens = [self.add_leaf() for _ in range(leaves)]
        if shuffled:
            # lock every leaf but one, evict that one (the queue's locked entries are dropped on the
            # way), then unlock in random order: the stamps come back out of order, so eviction
            # works from the heap rather than the in-order queue
            handles = [self.cache.match_prefix(as_impl_tokens(impl, t)) for t in tokens]
            for handle in handles[:-1]:
                self.cache.lock(handle)
            self.refill(self.evict_one_page())
            handles = handles[:-1]
            random.Random(5).shuffle(handles)
            for handle in handles:
                self.cache.unlock(handle)

    def add_leaf(self) -> list[int]:
        p = self.page_size
        self.next_id += 1
        leaf = [2 + self.next_id + k for k in range(p)]
        page = self.free_pages.pop() if self.free_pages else self.next_page
        if page == self.next_page:
            self.next_page += 1
        tokens = self.prefix + leaf
        slots = page_slots(0, p, p) + page_slots(page, p, p)
        self.cache.insert_prefix(as_impl_tokens(self.impl, tokens), as_impl_slots(self.impl, slots))
        return tokens

    def evict_one_page(self) -> Any:
        return self.cache.evict(self.page_size)

    def refill(self, evicted: Any) -> None:
        first = evicted[0] if self.impl == "reference" else int(evicted[0])
        self.free_pages.append(first // self.page_size)
        self.add_leaf()


def long_prompt(impl: str, page_size: int, length: int = 32_768, chunk: int = 1024) -> tuple[Any, Any]:
    """(c) a cache holding a ``length``-token prompt inserted chunk by chunk, and the prompt to match."""
    rnd = random.Random(2)
    tokens = [rnd.randrange(32_000) for _ in range(length)]
    cache = make_cache(impl, page_size)
    for end in range(chunk, length + 1, chunk):
        cache.insert_prefix(as_impl_tokens(impl, tokens[:end]), as_impl_slots(impl, list(range(end))))
    return cache, as_impl_tokens(impl, tokens)


@dataclass
class Trace:
    """(d) a recorded serving loop: operations with their exact arguments, replayable on any implementation."""

    ops: list[tuple[Any, ...]]


def serving_trace(
    page_size: int, requests: int = 2000, pool_tokens: int = 32_768, seed: int = 3
) -> list[tuple[Any, ...]]:
    """Record a serving loop on the reference: match, lock, insert, unlock, evict under a bounded pool.

    Prompts are one of a few system prompts, a few-shot block, then a random
    suffix; generated tokens extend them. Handles are numbered by creation.
    """
    rnd = random.Random(seed)
    p = page_size
    systems = [[rnd.randrange(32_000) for _ in range(rnd.choice([256, 512, 768]))] for _ in range(4)]
    shots = [[rnd.randrange(32_000) for _ in range(128)] for _ in range(8)]
    cache = reference.RadixPrefixCache(page_size)
    free = list(range(pool_tokens // page_size))
    ops: list[tuple[Any, ...]] = []
    handles = 0
    for _ in range(requests):
        tokens = rnd.choice(systems) + rnd.choice(shots) + [rnd.randrange(32_000) for _ in range(rnd.randrange(16, 96))]
        ops.append(("match", tokens))
        handle = cache.match_prefix(tokens)
        matched = handle.cached_len
        ops.append(("lock", handles))
        cache.lock(handle)
        handles += 1
        output = tokens + [rnd.randrange(32_000) for _ in range(rnd.randrange(8, 64))]
        need = div_ceil(len(output), p) - matched // p
        if need > len(free):
            shortfall = (need - len(free)) * p
            ops.append(("evict", min(shortfall, cache.size_info.evictable_size)))
            evicted = cache.evict(min(shortfall, cache.size_info.evictable_size))
            free.extend(s // p for s in evicted[::p])
        if need > len(free):  # the pool is full of locked pages: give this request up
            ops.append(("unlock", handles - 1))
            cache.unlock(handle)
            continue
        pages, free = free[:need], free[need:]
        slots = handle.get_matched_indices() + [s * p + k for s in pages for k in range(p)]
        slots = slots[: len(output)]
        ops.append(("insert", output, slots))
        cached, new_handle = cache.insert_prefix(output, slots)
        free.extend(s // p for s in slots[matched:cached:p])  # duplicates another request cached meanwhile
        tail = slots[(len(output) // p) * p :: p]
        free.extend(s // p for s in tail)  # the partial last page cannot enter the tree
        ops.append(("unlock", handles - 1))
        cache.unlock(handle)
        handles += 1
        del new_handle
    return ops


def trace_for(impl: str, ops: list[tuple[Any, ...]]) -> Trace:
    converted = []
    for op in ops:
        if op[0] == "match":
            converted.append(("match", as_impl_tokens(impl, op[1])))
        elif op[0] == "insert":
            converted.append(("insert", as_impl_tokens(impl, op[1]), as_impl_slots(impl, op[2])))
        else:
            converted.append(op)
    return Trace(converted)


def replay(cache: Any, trace: Trace) -> list[Any]:
    """Run the trace; returns the evicted slots of every evict (to compare implementations)."""
    handles: list[Any] = []
    evicted: list[Any] = []
    for op in trace.ops:
        kind = op[0]
        if kind == "match":
            handles.append(cache.match_prefix(op[1]))
        elif kind == "insert":
            handles.append(cache.insert_prefix(op[1], op[2]).handle)
        elif kind == "lock":
            cache.lock(handles[op[1]])
        elif kind == "unlock":
            cache.unlock(handles[op[1]])
        else:
            evicted.append(cache.evict(op[1]))
    return evicted


def batch_of_requests(
    impl: str, page_size: int, batch: int = 256, prompt_len: int = 512
) -> Callable[[], tuple[Any, list[Any]]]:
    """(e) a manager with ``batch`` admitted requests sharing a prompt prefix; returns a setup function."""
    rnd = random.Random(4)
    shared = [rnd.randrange(32_000) for _ in range(prompt_len // 2)]
    prompts = [shared + [rnd.randrange(32_000) for _ in range(prompt_len // 2)] for _ in range(batch)]
    num_pages = batch * div_ceil(prompt_len + 1, page_size) + 64
    lib: Any = reference if impl == "reference" else optimized
    from radixspec.spec.requests import Req

    def setup() -> tuple[Any, list[Any]]:
        manager = lib.CacheManager(num_pages, page_size, lib.make_page_table(batch, prompt_len + 64))
        reqs = []
        for row, prompt in enumerate(prompts):
            ids = prompt if impl == "reference" else torch.tensor(prompt, dtype=torch.int64)
            req = Req(input_ids=ids, table_idx=row, cache_handle=None, uid=row)  # type: ignore[arg-type]
            handle = manager.match_req(req)
            manager.lock(handle)
            req.cache_handle = handle
            req.cached_len = req.alloc_len = handle.cached_len
            req.device_len = len(prompt)
            reqs.append(req)
        return manager, reqs

    return setup


def allocate_batch(manager: Any, reqs: list[Any]) -> None:
    """allocate_paged for the whole batch; the prefill's KV is then computed."""
    manager.allocate_paged(reqs)
    for req in reqs:
        req.cached_len = req.device_len


def cache_batch(manager: Any, reqs: list[Any]) -> None:
    """cache_req(finished=False) for each request of the batch, frees held back as in the seed."""
    with manager.lazy_free_region():
        for req in reqs:
            manager.cache_req(req, finished=False)


def prefill_batch(manager: Any, reqs: list[Any]) -> None:
    """allocate_paged for the whole batch, then cache_req(finished=False) for each request."""
    allocate_batch(manager, reqs)
    cache_batch(manager, reqs)
