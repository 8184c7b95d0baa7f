"""Per request, on a trace: each cache's bookkeeping for one prompt, as its scheduler does it.

A server takes a prompt (a Python list: what a scheduler holds) and its namespace and does what its engine
does for it: match, lock, take pages for the rest (evicting when the pool is short), insert the whole pages,
unlock, give the partial last page back. It returns the tokens the match hit. The caches:

* ``optimized``: our C tree over a stack of free pages and the request's row of the page table (numpy arrays,
  as an engine keeps them): the match with the list, its slots copied into the row, the new pages' slots
  written after them, the insert with the list and the row;
* ``sglang-unified``: SGLang 0.5.23's ``UnifiedRadixCache`` (FULL) on its Rust tree core over its real
  ``PagedTokenToKVPoolAllocator``, called as its scheduler calls it: the key built from the list
  (``_req_radix_key``), ``match_prefix``, ``lock``, ``evict_for_alloc`` of the shortfall and ``alloc``,
  ``insert`` with the match as the protected prefix, ``unlock``, the partial page freed;
* ``vllm``: vLLM 0.33.0's ``BlockPool`` with the calls ``KVCacheManager`` makes for one full-attention
  group: the request's block hashes (vLLM hashes a request when it arrives: inside the timing),
  ``find_longest_cache_hit``, ``touch``, ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks``.

Every server gets the same pages (``pool_pages``); the hit rates are printed beside the times, since the
caches evict differently (ours a page at a time, SGLang whole leaves, vLLM the free queue's head).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from radixspec import optimized
from radixspec.spec.domains import Namespace

Request = tuple[list[int], Namespace]
# the longest prompt of a trace (longer ones are left out)
MAX_PROMPT = 4_096


class Server:
    name: str

    def serve(self, tokens: list[int], namespace: Namespace) -> int:
        raise NotImplementedError


class OursServer(Server):
    name = "optimized"

    def __init__(self, page_size: int, pool_pages: int) -> None:
        self.p = page_size
        self.cache = optimized.RadixPrefixCache(page_size)
        # the free pages (their numbers): a stack, taken from and given back to its top
        self.free = numpy.arange(pool_pages, dtype=numpy.int32)
        self.top = pool_pages
        self.offsets = numpy.arange(page_size, dtype=numpy.int32)
        # the request's row of the page table (as an engine keeps one per request): its slots, token by token
        self.row = numpy.empty(MAX_PROMPT + page_size, dtype=numpy.int32)
        # evictions write into one kept buffer (evict's out=)
        self.out = torch.empty(pool_pages * page_size, dtype=torch.int32)
        self.out_view = self.out.numpy()

    def serve(self, tokens: list[int], namespace: Namespace) -> int:
        p, cache, free, row = self.p, self.cache, self.free, self.row
        n = len(tokens)
        # match_req: all but the last token (recomputed for the logits)
        handle = cache.match_prefix(tokens[:-1], namespace)
        hit = handle.cached_len
        cache.lock(handle)
        new = -(-n // p) - hit // p
        if new > self.top:
            short = new - self.top
            cache.evict(short * p, out=self.out)
            free[self.top : self.top + short] = self.out_view[: short * p : p] // p
            self.top += short
        self.top -= new
        pages = free[self.top : self.top + new]
        row[:hit] = handle.get_matched_indices().numpy()
        numpy.add(pages[:, None] * p, self.offsets, out=row[hit : hit + new * p].reshape(new, p))
        cache.insert_prefix(tokens, row[:n], namespace)
        cache.unlock(handle)
        if n % p:
            free[self.top] = pages[-1]
            self.top += 1
        return hit


class SGLangUnifiedServer(Server):
    name = "sglang-unified"

    def __init__(self, page_size: int, pool_pages: int) -> None:
        from tests.benchmarks.peers import unified_cache

        self.p = page_size
        v, self.allocator, self.cache = unified_cache(page_size, pool_pages, "rust")
        self.RadixKey, self.InsertParams = v.radix.RadixKey, v.base.InsertParams
        self.MatchPrefixParams, self.EvictParams = v.base.MatchPrefixParams, v.base.EvictParams
        self.salts: dict[Namespace, str | None] = {None: None}

    def serve(self, tokens: list[int], namespace: Namespace) -> int:
        p, cache, allocator = self.p, self.cache, self.allocator
        salt = self.salts[namespace] if namespace in self.salts else self.salts.setdefault(namespace, repr(namespace))
        # _req_radix_key: the prompt, limited to all but its last token (recomputed for the logits)
        key = self.RadixKey(array("q", tokens), None, limit=len(tokens) - 1, cache_salt=salt)
        result = cache.match_prefix(self.MatchPrefixParams(key=key))
        hit = int(result.device_prefix_len)
        lock = cache.lock(result.last_device_node)
        need = -(-len(tokens) // p) * p - hit
        short = need - allocator.available_size()
        if short > 0:
            cache.evict_for_alloc(self.EvictParams(num_tokens=short))
        out = allocator.alloc(need)
        aligned = len(tokens) // p * p
        values = torch.cat((cache.path_device_indices(result.last_device_node)[:hit], out[: aligned - hit]))
        whole = self.RadixKey(array("q", tokens[:aligned]), None, cache_salt=salt)
        cache.insert(self.InsertParams(key=whole, value=values, prev_prefix_len=hit))
        cache.unlock(lock)
        if aligned < len(tokens):
            allocator.free(out[aligned - hit :])
        return hit


class VLLMServer(Server):
    name = "vllm"

    def __init__(self, page_size: int, pool_pages: int) -> None:
        from radixspec.fuzz.targets import vllm

        self.p = page_size
        self.target = vllm.VLLMPrefixCache(page_size, pool_pages)
        self.pool, self.v, self.spec = self.target.pool, self.target.v, self.target.spec
        self.pool._maybe_evict_cached_block = type(self.pool)._maybe_evict_cached_block.__get__(self.pool)
        self.find = self.v.manager.find_longest_cache_hit
        self.requests = 0
        self.stand_in = vllm.RequestStandIn

    def serve(self, tokens: list[int], namespace: Namespace) -> int:
        p, pool = self.p, self.pool
        self.requests += 1
        request = self.stand_in(tokens, None if namespace is None else repr(namespace), self.requests)
        request.block_hashes = self.target.hasher(request)
        # KVCacheManager.get_computed_blocks: the last token is always recomputed
        longest = (len(tokens) - 1) // p
        hits, _ = self.find(request.block_hashes[:longest], longest * p, [0], pool, self.spec, False, p)
        blocks = list(hits[0])
        pool.touch(blocks)
        blocks += pool.get_new_blocks(-(-len(tokens) // p) - len(blocks))
        pool.cache_full_blocks(request, blocks, len(hits[0]), len(tokens) // p, p, 0)
        pool.free_blocks(reversed(blocks))
        return len(hits[0]) * p


SERVERS: dict[str, type[Server]] = {"optimized": OursServer, "sglang-unified": SGLangUnifiedServer, "vllm": VLLMServer}


def serve_all(server: Server, requests: Sequence[Request]) -> tuple[int, int]:
    """Every request through ``server``: (tokens hit, tokens asked)."""
    hit = asked = 0
    serve = server.serve
    for tokens, namespace in requests:
        hit += serve(tokens, namespace)
        asked += len(tokens)
    return hit, asked


def trace(requests: int = 2_000, seed: int = 0, limit: int = MAX_PROMPT) -> list[Request]:
    """``radixspec replay --generate``'s trace, in memory (prompts over ``limit`` tokens left out)."""
    import tempfile
    from pathlib import Path

    from radixspec.fuzz.replay import generate, read_trace

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.jsonl"
        generate(path, requests, seed)
        return [(list(tokens), namespace) for tokens, namespace in read_trace(path) if len(tokens) <= limit]


def make_server(name: str, page_size: int, pool_pages: int) -> Any:
    return SERVERS[name](page_size, pool_pages)
