"""The seed chapter's walkthrough, end to end: a request that hits the cache.

match -> lock -> allocate -> store -> insert -> unlock, on the optimized
stack (radix tree, CacheManager, MHAKVCache), with every step's effect on
the mapping (tree, page table) and on the physical KV (the pool) checked.
"""

import torch

from radixspec.optimized import CacheManager, MHAKVCache, make_page_table
from radixspec.spec.requests import Req

P = 4
SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]  # two pages of shared system prompt


def kv_of(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for a layer's K/V of each token: a function of the token and its position."""
    k = torch.tensor([[float(t), float(i)] for i, t in enumerate(tokens)]).view(-1, 1, 2)
    return k, -k


def prefill(manager: CacheManager, pool: MHAKVCache, prompt: list[int], row: int) -> Req:
    req = Req(input_ids=list(prompt), table_idx=row, cache_handle=None, uid=row)
    # 1. match: the longest cached prefix (all but the last token, which must be computed)
    handle = manager.match_req(req)
    # 2. lock: the matched pages cannot be evicted while this request reads them
    manager.lock(handle)
    manager.page_table[row, : handle.cached_len] = handle.get_matched_indices()
    req.cache_handle = handle
    req.cached_len = req.alloc_len = handle.cached_len
    req.device_len = len(prompt)
    # 3. allocate: pages only for the positions not in the cache
    manager.allocate_paged([req])
    # 4. store: compute K/V of the new positions and write them where the page table says
    out_loc = manager.page_table[row, req.cached_len : req.device_len]
    k, v = kv_of(prompt)
    pool.store_kv(k[req.cached_len :], v[req.cached_len :], out_loc, layer_id=0)
    req.cached_len = req.device_len
    # 5. insert + 6. unlock (the old handle) and lock (the new one): cache_req does both
    manager.cache_req(req, finished=False)
    return req


def test_a_request_that_hits_the_cache_reuses_pages_and_reads_the_same_kv() -> None:
    manager = CacheManager(num_pages=16, page_size=P, page_table=make_page_table(2, 32))
    pool = MHAKVCache(
        num_kv_heads=1, num_layers=1, head_dim=2, num_pages=16, page_size=P, dtype=torch.float32, device="cpu"
    )

    first = prefill(manager, pool, [*SYSTEM, 1, 2, 3], row=0)
    assert first.cache_handle.cached_len == 8  # the system prompt's two pages entered the tree

    free_before = manager.free_slots.numel()
    second = prefill(manager, pool, [*SYSTEM, 7, 7, 7, 7, 9], row=1)
    # the hit: the second request's row starts with the first request's slots
    assert torch.equal(manager.page_table[1, :8], manager.page_table[0, :8])
    # and only its own 5 tokens needed pages (2 pages of 4)
    assert free_before - manager.free_slots.numel() == 2
    # attention of the second request reads its whole prompt through its row: the right K/V everywhere
    k, v = pool.gather_kv(manager.page_table[1, : second.device_len], layer_id=0)
    expected_k, expected_v = kv_of(second.input_ids)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)

    # finishing returns the tail page; the cached prefix stays for the next request
    for req in (first, second):
        manager.cache_req(req, finished=True)
    manager.check_integrity([])
    assert manager.prefix_cache.size_info.protected_size == 0
    assert manager.prefix_cache.size_info.evictable_size == 12  # system prompt (8) + [7 7 7 7] (4)
