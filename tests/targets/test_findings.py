"""The findings of the peer campaigns as plain-Python reproducers: each pins what the peer does, with its verdict.

No fuzzer here: each test drives the peer's own API with its own clock, the
way its engine does, and asserts the behaviour the campaign found. A test
failing here means the peer changed: re-run its campaign and update
docs/findings.md. Each peer's tests are skipped when it is not available:
sglang and vllm as installed wheels (``radixspec targets install sglang
vllm``), mini-sglang as a checkout named by ``RADIXSPEC_MINISGL`` (commit
20fcd7f; see fuzz/targets/minisgl.py).
"""

from __future__ import annotations

import importlib.util
import os
import time
from array import array
from typing import Any

import pytest
import torch

from radixspec.spec import prefix_cache as pc

MINISGL = os.environ.get("RADIXSPEC_MINISGL")
needs_minisgl = pytest.mark.skipif(not MINISGL, reason="RADIXSPEC_MINISGL names no mini-sglang checkout")
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int32)


@pytest.fixture
def minisgl(monkeypatch: pytest.MonkeyPatch) -> Any:
    """mini-sglang's modules with their own wall clock (the campaign's logical clock undone for the test)."""
    from radixspec.fuzz.targets.minisgl import checkout_root, import_minisgl

    assert MINISGL is not None
    modules = import_minisgl(checkout_root(MINISGL))
    monkeypatch.setattr(modules.radix_cache, "time", time)
    return modules


def minisgl_cache(modules: Any, page_size: int) -> Any:
    from radixspec.fuzz.targets.minisgl import set_page_size

    set_page_size(modules.core, page_size)
    return modules.radix_cache.RadixPrefixCache(torch.device("cpu"))


# ---------------------------------------------------------------- mini-sglang 20fcd7f


@needs_minisgl
def test_minisgl_a_match_that_splits_a_node_leaves_the_matched_prefix_with_its_old_timestamp(minisgl: Any) -> None:
    """BUG (fixed upstream by mini-sglang PR #124): LRU then evicts the prefix that was just used.

    Campaign: ``--target minisgl:PATH --machine cache`` (strict LRU) reports
    "strict LRU: the spec evicts page [3, 0, 0, 0] ...; the target evicted ...".
    """
    cache = minisgl_cache(minisgl, page_size=1)
    cache.insert_prefix(ids(3, 0, 0, 0), ids(0, 1, 2, 3))  # A
    cache.insert_prefix(ids(7), ids(4))  # B, used after A
    assert cache.match_prefix(ids(3, 0, 0)).cuda_handle.cached_len == 3  # uses A's first 3 tokens: splits A
    evicted = cache.evict(2).tolist()
    # the spec evicts A's unused last page and B: slots [3, 4]; mini-sglang keeps B and evicts what was just matched
    assert evicted == [3, 0, 1, 2]


@needs_minisgl
def test_minisgl_cache_req_unfinished_frees_pages_its_row_still_points_at(minisgl: Any) -> None:
    """BUG (open upstream, mini-sglang PR #142): a repeated prompt makes a live request read freed pages.

    Two requests with the same prompt prefill side by side; the second to call
    ``cache_req(finished=False)`` finds the prompt cached and frees its own
    pages ``[old_handle.cached_len, cached_len)``, but its page-table row still
    maps those positions to them. The next allocation hands them to another
    request. Campaign: ``--machine manager`` reports "rows_match_handles".
    """
    from radixspec.fuzz.targets.minisgl import set_page_size

    set_page_size(minisgl.core, 1)
    page_table = torch.zeros((2, 16), dtype=torch.int32)
    manager = minisgl.cache.CacheManager(16, 1, page_table, "radix")
    prompt = ids(5, 6, 7, 8, 9)
    reqs = []
    for row in (0, 1):
        pending = type("Pending", (), {"input_ids": prompt, "input_len": len(prompt)})()
        handle = manager.match_req(pending).cuda_handle
        manager.lock(handle)
        req = minisgl.core.Req(prompt, row, handle.cached_len, 1, row, minisgl.core.SamplingParams(), handle)
        manager.allocate_paged([req])  # pages for the whole prompt
        req.complete_one()  # the prefill ran: the prompt's KV is stored
        reqs.append(req)
    manager.cache_req(reqs[0], finished=False)
    manager.cache_req(reqs[1], finished=False)
    second_row = page_table[1, :5].tolist()
    assert reqs[1].cache_handle.get_matched_indices().tolist() == page_table[0, :5].tolist()
    # its row still holds its own pages, which are back on the free list
    assert set(second_row) <= set(manager.free_slots.tolist())


@needs_minisgl
def test_minisgl_matched_indices_of_an_empty_match_raise(minisgl: Any) -> None:
    """LATENT BUG: ``get_matched_indices`` on an empty match is ``torch.cat([])``; its callers check first.

    The adapter returns ``[]`` itself so that campaigns reach deeper states.
    """
    cache = minisgl_cache(minisgl, page_size=1)
    handle = cache.match_prefix(ids(1, 2)).cuda_handle
    assert handle.cached_len == 0
    with pytest.raises(ValueError, match="non-empty list"):
        handle.get_matched_indices()


# ---------------------------------------------------------------- SGLang 0.5.23


@pytest.fixture
def sglang(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's radix cache module with its own wall clock."""
    from radixspec.fuzz.targets.sglang import import_radix_cache

    module = import_radix_cache()
    monkeypatch.setattr(module, "time", time)
    return module


def sglang_cache(module: Any, page_size: int) -> tuple[Any, Any]:
    from radixspec.fuzz.targets.sglang import RecordingAllocator

    allocator = RecordingAllocator(page_size)
    return module.RadixCache.create_simulated(page_size=page_size, mock_allocator=allocator), allocator


def key(module: Any, *tokens: int) -> Any:
    return module.RadixKey(array("q", tokens))


@needs_sglang
def test_sglang_a_split_refreshes_the_unmatched_suffix_too(sglang: Any) -> None:
    """INTENDED DIFFERENCE (SGLang PR #24892 to change it was closed): in its profile; strict LRU reports it.

    The suffix no request used gets the match's timestamp, so a page used
    after it is evicted first.
    """
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

    cache, allocator = sglang_cache(sglang, page_size=1)
    cache.insert(InsertParams(key=key(sglang, 1, 2, 3, 4), value=torch.tensor([0, 1, 2, 3])))  # X
    cache.insert(InsertParams(key=key(sglang, 9), value=torch.tensor([4])))  # Y, used after X
    cache.match_prefix(MatchPrefixParams(key=key(sglang, 1, 2)))  # uses X's first half: splits X
    cache.evict(EvictParams(num_tokens=2))
    # the spec evicts X's unused pages [2, 3] and keeps Y; SGLang evicts Y first
    assert allocator.freed[0] == [4]


@needs_sglang
def test_sglang_a_handle_from_before_reset_cannot_be_unlocked_even_when_empty(sglang: Any) -> None:
    """INTENDED DIFFERENCE: handles belong to one tree; reset() builds a new root (profile: handles_survive_reset)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    cache, _ = sglang_cache(sglang, page_size=1)
    node = cache.match_prefix(MatchPrefixParams(key=key(sglang, 5))).last_device_node  # empty match: the root
    cache.reset()
    with pytest.raises(AssertionError, match="another tree"):
        cache.dec_lock_ref(node)


@needs_sglang
def test_sglang_evicts_whole_leaf_nodes_until_at_least_the_asked_tokens(sglang: Any) -> None:
    """INTENDED DIFFERENCE (profile: eviction_unit = node): asked for one token, it frees a four-token node."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

    cache, allocator = sglang_cache(sglang, page_size=1)
    cache.insert(InsertParams(key=key(sglang, 1, 2, 3, 4), value=torch.tensor([0, 1, 2, 3])))
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 4
    assert allocator.freed == [[0, 1, 2, 3]]


# ---------------------------------------------------------------- vLLM 0.33.0


@needs_vllm
def test_vllm_a_lookup_does_not_refresh_recency_a_request_that_uses_it_does() -> None:
    """INTENDED DIFFERENCE (profile: a match changes no recency): the spec stamps on match; vLLM on touch + free."""
    from radixspec.fuzz.targets.vllm import VLLMPrefixCache

    cache = VLLMPrefixCache(page_size=2, num_pages=2)
    cache.insert_prefix([1, 1], None, None)  # page 0
    cache.insert_prefix([2, 2], None, None)  # page 2
    cache.match_prefix([1, 1], None)  # a lookup only
    cache.insert_prefix([3, 3], None, None)  # needs a page: evicts the head of the free queue
    assert cache.take_evicted() == [[0, 1]]  # [1, 1], looked up but not used
    cache.lock(cache.match_prefix([2, 2], None))  # used now
    assert cache.cached_pages() == {pc.page_key(None, (2, 2), 2): 2, pc.page_key(None, (3, 3), 2): 0}


needs_events = pytest.mark.skipif(
    importlib.util.find_spec("msgspec") is None or importlib.util.find_spec("zmq") is None,
    reason="the peers' event modules need msgspec and pyzmq (pip install radixspec[events])",
)


@needs_sglang
@needs_events
def test_sglang_events_of_two_namespaces_with_the_same_tokens_carry_the_same_block_hash(sglang: Any) -> None:
    """INTENDED DIFFERENCE, a drift for routers (profile: event_namespaces=False; strict mode reports it).

    SGLang's event hashes omit the key's ``extra_key`` unless it names a
    registered LoRA adapter (``compute_node_event_hash_values``: "omit
    extra_key"). Two namespaces caching the same tokens publish the same
    block hash twice; when one of them is evicted, a router that indexes
    blocks by hash (vLLM's format) drops the block although the other
    namespace still holds it. Campaign: ``--target sglang:legacy --lru strict``,
    ``event 6 (PageStored): page ... is stored already``.
    """
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

    cache, _ = sglang_cache_with_events(sglang, page_size=1)
    assert [type(e).__name__ for e in cache.take_events()] == ["AllBlocksCleared"]  # the constructor's reset
    cache.insert(InsertParams(key=sglang.RadixKey(array("q", [1, 2]), "tenant-a"), value=torch.tensor([0, 1])))
    cache.insert(InsertParams(key=sglang.RadixKey(array("q", [1, 2]), "tenant-b"), value=torch.tensor([2, 3])))
    first, second = cache.take_events()
    assert type(first).__name__ == type(second).__name__ == "BlockStored"
    assert first.block_hashes == second.block_hashes  # one name for two namespaces' pages
    # a router keeping the set of announced hashes
    router = set(first.block_hashes) | set(second.block_hashes)
    cache.evict(EvictParams(num_tokens=2))  # evicts one namespace's leaf
    (removed,) = cache.take_events()
    router -= set(removed.block_hashes)
    assert cache.evictable_size() == 2  # the other namespace still caches its two pages
    assert not router  # ... and the router believes nothing is cached


def sglang_cache_with_events(module: Any, page_size: int) -> tuple[Any, Any]:
    from radixspec.fuzz.targets.sglang import RecordingAllocator

    allocator = RecordingAllocator(page_size)
    cache = module.RadixCache.create_simulated(
        page_size=page_size, mock_allocator=allocator, enable_kv_cache_events=True
    )
    return cache, allocator


# ---------------------------------------------------------------- vLLM's hybrid coordinator


def vllm_hybrid_run(prompts: list[list[int]], evict_window_page: int | None = None) -> list[Any]:
    """Requests one after another on a full + window-8 coordinator (P = 4), each run to its end and freed;
    before the last, optionally one window block of the first request's pages evicted (the pool's own
    ``evict_blocks``). Returns the managers' view of each request after its match."""
    from radixspec.fuzz.targets.vllm_hybrid import VllmHybridManager
    from radixspec.reference.hybrid_manager import HybridReq

    manager = VllmHybridManager(4, (None, 8), 32)
    seen = []
    for uid, prompt in enumerate(prompts):
        if uid == len(prompts) - 1 and evict_window_page is not None:
            hashes = manager.hasher_for(prompts[0])
            block = manager.pool.get_cached_block(hashes[evict_window_page], [1])[0]
            manager.pool.evict_blocks({block.block_id})
        req = HybridReq(uid, list(prompt))
        manager.match_req(req)
        seen.append((req.cached_len, [list(row) for row in req.rows]))
        manager.allocate_paged(req, len(prompt))
        manager.store(req, len(prompt) - req.computed)
        manager.check_integrity([req])
        manager.cache_req(req, finished=True)
    seen.append(manager)
    return seen


@needs_vllm
def test_vllm_hybrid_a_shared_prefix_hits_with_the_window_pages_only() -> None:
    prompt = list(range(100, 122))
    (_, _), (hit, rows), _ = vllm_hybrid_run([prompt, prompt[:16] + [7] * 6])
    # L = 16: the full group every page, the window group (W = 8) the pages of tokens [9, 16): 2 and 3
    assert hit == 16 and rows[1][:2] == [None, None] and None not in rows[0]


@needs_vllm
def test_vllm_hybrid_evicting_a_window_tail_page_cuts_the_hit_as_the_spec_does() -> None:
    prompt = list(range(100, 122))
    (_, _), (hit, rows), _ = vllm_hybrid_run([prompt, prompt], evict_window_page=3)
    # L = 20 needs window pages 3 and 4, L = 16 pages 2 and 3; L = 12 pages 1 and 2 (both cached)
    assert hit == 12 and rows[1] == [None, rows[1][1], rows[1][2]]


@needs_vllm
def test_vllm_hybrid_caches_a_recomputed_prefix_twice_in_one_group() -> None:
    prompt = list(range(100, 122))
    *_, manager = vllm_hybrid_run([prompt, prompt], evict_window_page=3)
    hashes = manager.hasher_for(prompt)
    # page 3 of the full group: cached by the first request, recomputed (the hit stopped at 12) and cached again
    utils = manager.utils
    copies = [
        block.block_id
        for block in manager.pool.blocks[1:]
        if block.block_hash is not None
        and utils.get_block_hash(block.block_hash) == hashes[3]
        and utils.get_group_id(block.block_hash) == 0
    ]
    assert len(copies) == 2


# ---------------------------------------------------------------- SGLang's SWA cache (its own process: its stubs
# differ from the sglang target's)

SGLANG_SWA_TOMBSTONE = """
import json, torch
from array import array
from radixspec.fuzz.targets.sglang_modules import import_unified_cache, mapping_pool
from radixspec.spec import hybrid as hy

# SGLang's unified cache, FULL + SWA, window 4, page size 1, over its SWA allocator
v = import_unified_cache()
alloc = v.swa.SWATokenToKVPoolAllocator(size=64, size_swa=64, page_size=1, dtype=torch.float16, device="cpu",
                                        kvcache=mapping_pool(v), need_sort=False)
cache = v.urc.UnifiedRadixCache(v.params.CacheInitParams(
    disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1, sliding_window_size=4,
    tree_components=(v.components.FULL, v.components.SWA), tree_core_backend=CORE))
A = list(range(100, 124))
full = alloc.alloc(24)
key = lambda n: v.radix.RadixKey(array("q", A[:n]))
cache.insert(v.base.InsertParams(key=key(8), value=full[:8].clone()))
alloc.free_swa(full[8:12])  # the request's window passed [8, 12): its SWA slots freed
cache.insert(v.base.InsertParams(key=key(24), value=full.clone(), prev_prefix_len=8,
                                 component_evicted_seqlens={v.components.SWA: 12}))
holes = [list(r) for r in cache.tree_core.swa_tombstone_ranges(key(24), 0, 24)]
hits = {n: int(cache.match_prefix(v.base.MatchPrefixParams(key=key(n))).device_prefix_len) for n in (13, 15, 16)}
# the spec's longest valid match of n tokens: no tombstoned token among those its last query attends to
valid = lambda n: not any(a <= t < b for a, b in holes for t in hy.compute_used_pages(n, 4, 1))
print(json.dumps({"tombstones": holes, "hits": hits,
                  "spec": {n: next(k for k in range(n, -1, -1) if valid(k)) for n in (13, 15, 16)}}))
"""


@needs_sglang
@pytest.mark.parametrize("core", ["python", "rust"])
def test_sglang_swa_after_a_tombstone_a_match_needs_w_live_tokens_where_w_minus_one_suffice(core: str) -> None:
    import json
    import subprocess
    import sys

    script = SGLANG_SWA_TOMBSTONE.replace("CORE", repr(core))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["tombstones"] == [[8, 12]]
    # W = 4: a match of L tokens attends to [L - 3, L); L = 15 finds 12, 13, 14 live, valid in the spec;
    # SGLang wants W live tokens after the tombstone and falls back to 8 until L = 16
    assert seen["spec"] == {"13": 8, "15": 15, "16": 16}
    assert seen["hits"] == {"13": 8, "15": 8, "16": 16}


SGLANG_0522_SWA_DOUBLE_FREE = """
import json
from array import array
from importlib.metadata import version
from radixspec.fuzz.targets.sglang_unified_swa import swa_manager
from radixspec.reference.hybrid_manager import HybridReq

# SGLang's unified cache, FULL + SWA, page size 4, window 5, over its SWA allocator (82 full pages)
m = swa_manager(4, 82, "rust", "lru", 5, False, True)
v, cache, alloc = m.v, m.cache, m.alloc
a = HybridReq(0, list(range(100, 110)), None)
m.match_req(a)                         # nothing cached
m.allocate_paged(a, 10)
m.store(a, 10)                         # the prompt's 10 tokens computed
a.input_ids.append(0)
m.allocate_paged(a, 11)                # decoding: evict_sliding_windows(req, 10) first
m.store(a, 1)
req = m.records[0]
evicted = req.kv.get_evicted_seqlen(v.components.SWA)
# release_kv_cache(req, tree_cache, checkpoint=True), SGLang's own steps
req.done = True
req.full_untruncated_fill_ids = array("q", a.input_ids)
cache.checkpoint(req, up_to=11)
protected = req.kv.cache_protected_len
cache.free_kv_row(req.kv, [(protected, 11)])
cache.unlock(req.lock)
tree = int(cache.full_evictable_size() + cache.full_protected_size()) // 4
print(json.dumps({"release": version("sglang"), "evicted": evicted, "protected": protected, "tree": tree,
                  "free": alloc.full_available_size() // 4}))
"""


@needs_sglang
def test_sglang_0522_frees_the_pages_a_finished_request_just_cached_after_its_window_slid() -> None:
    """Finding 13 (sglang-swa on SGLang 0.5.22): with W = 5 > P = 4, a decoding request frees its first page's
    SWA (the frontier 10 - max(W, P) = 5, floored to 4); when it finishes, the checkpoint inserts 8 tokens and
    repoints the request to a re-match of them, which stops at 0 (after the tombstone it wants W live tokens,
    4 are); cache_protected_len stays 0, and release frees the whole row: the two pages the tree just took go
    back to the free list while the tree maps them (the next allocation hands them out). 0.5.23 repoints from
    the insert's own node (and keeps ceil_align(max(W, P), P) behind the frontier): no page is freed.
    Run on the installed release; CI runs it on 0.5.22 too."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", SGLANG_0522_SWA_DOUBLE_FREE], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    if seen["release"] == "0.5.22":
        assert seen == {"release": "0.5.22", "evicted": 4, "protected": 0, "tree": 2, "free": 82}
        assert seen["free"] + seen["tree"] > 82  # two pages both free and cached
    else:
        assert seen == {"release": seen["release"], "evicted": 0, "protected": 8, "tree": 2, "free": 80}


VLLM_SPARSE_STORED_EVENT = """
import json
from types import SimpleNamespace
from radixspec.fuzz.targets.vllm_hybrid import import_hybrid

v = import_hybrid()  # vLLM's own modules on a CPU-only machine; in vLLM's environment, import them directly
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        SlidingWindowSpec)
import torch

# a model with full-attention and sliding-window (W = 5) layers, block size 4, vLLM's default retention (0)
specs = [FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32),
         SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=5)]
tensor = KVCacheTensor(size=64 * 32, layers=["f", "w"], layer_stride=0, block_stride=32)
config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[tensor],
                       kv_cache_groups=[KVCacheGroupSpec(["f"], specs[0]), KVCacheGroupSpec(["w"], specs[1])],
                       prefix_cache_retention_interval=0)
coordinator = get_kv_cache_coordinator(config, max_model_len=4096, max_in_flight_tokens=4096, use_eagle=False,
                                       enable_caching=True, enable_kv_cache_events=True, dcp_world_size=1,
                                       pcp_world_size=1, scheduler_block_size=4, hash_block_size=4)
tokens = list(range(100, 122))  # 22 tokens: 5 whole blocks
request = SimpleNamespace(request_id="0", all_token_ids=tokens, num_tokens=22, num_prompt_tokens=22,
                          num_computed_tokens=0, block_hashes=[], lora_request=None, cache_salt=None,
                          mm_features=[], prompt_embeds=None, session_id=None, shared_prefix_boundary=0)
request.block_hashes = get_request_block_hasher(4, sha256)(request)
# KVCacheManager.allocate_slots for the whole prompt (no hit), then its blocks are cached
coordinator.allocate_new_blocks("0", 22, 22)
coordinator.cache_blocks(request, 22)
events = coordinator.block_pool.take_events()
wire = [maybe_convert_block_hash(h) for h in request.block_hashes]  # the hashes as the events carry them
print(json.dumps([{"group": e.group_idx, "hashes": [wire.index(h) for h in e.block_hashes],
                   "tokens": len(e.token_ids), "block_size": e.block_size, "parent": e.parent_block_hash}
                  for e in events]))
"""


@needs_vllm
def test_vllm_window_block_stored_under_default_retention_names_one_hash_for_five_blocks_of_tokens() -> None:
    """Finding 14 (vllm-hybrid, vLLM's default retention 0): the window group caches only the tail a resend can
    hit (the replay boundary 21, aligned to 20: with W = 5 the one block [16, 20)), and its BlockStored carries
    that one hash with the tokens of all five blocks, block_size 4 and no parent: a consumer that pairs the
    i-th hash with the i-th block of tokens (Dynamo's relay, llm-d) files block 4's hash under tokens [0, 4).
    Known upstream: vllm#44451 (reported for Mamba align), fix open in PR #44488 (block_offsets)."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_SPARSE_STORED_EVENT], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    full, window = json.loads(run.stdout.strip().splitlines()[-1])
    assert full == {"group": 0, "hashes": [0, 1, 2, 3, 4], "tokens": 20, "block_size": 4, "parent": None}
    assert window == {"group": 1, "hashes": [4], "tokens": 20, "block_size": 4, "parent": None}


VLLM_REANNOUNCED_NULL_BLOCKS = """import json
from types import SimpleNamespace
from radixspec.fuzz.targets.vllm_hybrid import import_hybrid

v = import_hybrid()  # vLLM's own modules on a CPU-only machine; in vLLM's environment, import them directly
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        SlidingWindowSpec)
import torch

# a model with full-attention and sliding-window (W = 5) layers, block size 4, vLLM's default retention (0)
specs = [FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32),
         SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=5)]
tensor = KVCacheTensor(size=64 * 32, layers=["f", "w"], layer_stride=0, block_stride=32)
config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[tensor],
                       kv_cache_groups=[KVCacheGroupSpec(["f"], specs[0]), KVCacheGroupSpec(["w"], specs[1])],
                       prefix_cache_retention_interval=0)
coordinator = get_kv_cache_coordinator(config, max_model_len=4096, max_in_flight_tokens=4096, use_eagle=False,
                                       enable_caching=True, enable_kv_cache_events=True, dcp_world_size=1,
                                       pcp_world_size=1, scheduler_block_size=4, hash_block_size=4)
hasher = get_request_block_hasher(4, sha256)
tokens = list(range(100, 122))  # 22 tokens: 5 whole blocks


def request(rid, mode):
    r = SimpleNamespace(request_id=rid, all_token_ids=tokens, num_tokens=22, num_prompt_tokens=22,
                        num_computed_tokens=0, block_hashes=[], lora_request=None, cache_salt=None,
                        mm_features=[], prompt_embeds=None, session_id=None, shared_prefix_boundary=0,
                        kv_cache_report_mode=mode)
    r.block_hashes = hasher(r)
    return r


wire = lambda hashes: [maybe_convert_block_hash(h) for h in hashes]  # the hashes as the events carry them
a = request("a", "incremental")
# KVCacheManager.allocate_slots for the whole prompt (no hit), then its blocks are cached; A finishes
coordinator.allocate_new_blocks("a", 22, 22)
coordinator.cache_blocks(a, 22)
stored = coordinator.block_pool.take_events()
coordinator.free("a")
# B, the same prompt, from a gateway (kv_cache_report_mode "full"): KVCacheManager.get_computed_blocks
b = request("b", "full")
blocks, hit, _ = coordinator.find_longest_cache_hit(b.block_hashes, 21)
coordinator.emit_cached_block_events(b, blocks)  # what get_computed_blocks does for a "full" request with a hit
reannounced = coordinator.block_pool.take_events()
names = wire(a.block_hashes)
pool = coordinator.block_pool
print(json.dumps({
    "hit": hit,
    "hit_blocks": [[blk.block_id if not blk.is_null else None for blk in g] for g in blocks],
    "stored": [{"group": e.group_idx, "hashes": [names.index(h) for h in e.block_hashes]} for e in stored],
    "reannounced": [{"group": e.group_idx, "hashes": [names.index(h) for h in e.block_hashes],
                     "tokens": len(e.token_ids)} for e in reannounced],
    "window_group_caches": [i for i, h in enumerate(a.block_hashes) if pool.get_cached_block(h, [1])],
}))
"""


@needs_vllm
def test_vllm_a_hit_reannounced_names_window_blocks_the_window_group_never_cached() -> None:
    """Finding 33 (vllm-hybrid, a request of kv_cache_report_mode "full", as a gateway sends them): the full group
    caches blocks 0-4 of a 22-token prompt (P = 4), the window group (W = 5, vLLM's default retention) only block 4,
    and the stream says so. A second request with the same prompt hits 20 tokens: its window blocks 0-3 are null
    blocks, yet get_computed_blocks' re-announcement names hashes 0-4 for the window group too. A consumer that
    indexes each group learns four window blocks never stored, and no BlockRemoved ever takes them back. vllm#57358
    (open) reports the same cause as a crash (an IndexError under Mamba align) and would skip null blocks."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_REANNOUNCED_NULL_BLOCKS], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["hit"] == 20 and [block is None for block in seen["hit_blocks"][1]] == [True] * 4 + [False]
    assert seen["stored"] == [{"group": 0, "hashes": [0, 1, 2, 3, 4]}, {"group": 1, "hashes": [4]}]
    assert seen["window_group_caches"] == [4]
    assert seen["reannounced"] == [
        {"group": 0, "hashes": [0, 1, 2, 3, 4], "tokens": 20},
        {"group": 1, "hashes": [0, 1, 2, 3, 4], "tokens": 20},
    ]


VLLM_EAGLE_VERIFIED_STALE = """import json
from types import SimpleNamespace
from radixspec.fuzz.targets.vllm_mamba import import_mamba

import_mamba()  # vLLM's own modules on a CPU-only machine; in vLLM's environment, import them directly
import torch
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        MambaSpec, SlidingWindowSpec)

P = 4
common = dict(block_size=P, num_kv_heads=1, head_size=1, dtype=torch.float32)
specs = [FullAttentionSpec(**common), SlidingWindowSpec(**common, sliding_window=3),
         MambaSpec(block_size=P, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")]
names = ["full", "window", "mamba"]
config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[KVCacheTensor(size=64 * 32, layers=names, layer_stride=0,
                                                                       block_stride=32)],
                       kv_cache_groups=[KVCacheGroupSpec([n], s) for n, s in zip(names, specs)])
# EAGLE's block drop (use_eagle, no lookahead hashes); no group annotated as a draft group: all are flagged
coordinator = get_kv_cache_coordinator(config, max_model_len=4096, max_in_flight_tokens=4096, use_eagle=True,
                                       enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1,
                                       pcp_world_size=1, scheduler_block_size=P, hash_block_size=P)
pool = coordinator.block_pool
tokens = list(range(100, 117))  # 17 tokens: blocks [0,4) [4,8) [8,12) [12,16)
request = SimpleNamespace(request_id="a", all_token_ids=tokens, num_tokens=17, num_prompt_tokens=17,
                          num_computed_tokens=0, block_hashes=[], lora_request=None, cache_salt=None,
                          mm_features=[], prompt_embeds=None, session_id=None, shared_prefix_boundary=0)
request.block_hashes = get_request_block_hasher(P, sha256)(request)
# the cache: full attention holds blocks 0-3, the window blocks 0, 2 and 3, Mamba the state after block 0 only
blocks = [pool.get_new_blocks(4) for _ in range(3)]
for group, keep in ((0, [0, 1, 2, 3]), (1, [0, 2, 3]), (2, [0])):
    for i in keep:
        pool.cache_full_blocks(request, blocks[group], i, i + 1, P, group)
for group in blocks:
    pool.free_blocks(reversed(group))
found, hit, _ = coordinator.find_longest_cache_hit(request.block_hashes, 16)
# the window group's own EAGLE rule at that length (one contiguous block more, then dropped): no hit
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
_, own = SlidingWindowManager.find_longest_cache_hit(request.block_hashes, hit + P, [1], pool, specs[1], True, P)
print(json.dumps({"hit": hit, "cached_window_blocks": [i for i in range(4)
                  if pool.get_cached_block(request.block_hashes[i], [1])], "window_rule_at_hit": own}))
"""


@needs_vllm
def test_vllm_eagle_hit_keeps_a_window_proof_made_at_a_longer_length_after_mamba_cuts_it() -> None:
    """Finding 15 (vllm-mamba, seed 21, after 505 s): full attention, a window (W = 3) and Mamba, EAGLE's block
    drop, every group flagged for EAGLE. The first pass proves the window's drop at 12 (blocks 2, 3); Mamba, whose
    finder never drops but is marked verified all the same, cuts the length to 4; the window group is not asked
    again with the drop, so the hit is 4 though the window group holds block 0 and not block 1, which its EAGLE
    rule needs for a hit of 4 (that rule alone gives 0)."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_EAGLE_VERIFIED_STALE], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"hit": 4, "cached_window_blocks": [0, 2, 3], "window_rule_at_hit": 0}


# Finding 32, standalone: vLLM's own modules only (KVCacheManager with a full-attention and a Mamba `align` group,
# block size 8, hash unit 2, EAGLE's block drop, internal prefill checkpoints), with the scheduler's split and the
# worker's checkpoint rule compiled from vLLM's own source. A (41 tokens) is served; B continues A's 42 tokens with
# 12 more, hits 38 inside a block, and one chunk [38, 54) runs; the block B copied the state of 38 tokens into is
# cached under the 40-token hash. C, sharing B's first 48 tokens, then hits 40 and resumes from that block.
VLLM_MAMBA_PARTIAL_HIT_CHECKPOINT = """import __future__, ast, json, os, types
from radixspec.fuzz.targets.vllm_mamba import import_mamba
from radixspec.fuzz.targets.vllm_offload_connector import import_connector

v = import_connector()  # vLLM's own modules on a CPU-only machine; in vLLM's environment, import them directly
import_mamba()  # and MambaManager registered for MambaSpec (the registry fills itself from a platform)
import vllm
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        get_mamba_prefill_checkpoint_position, is_mamba_prefill_checkpoint_valid)


def vllm_function(relative_path, name):
    # vLLM's own function, compiled from its source file: its module does not import on a CPU-only machine. In
    # vLLM's environment: `from vllm.v1.core.sched.scheduler import Scheduler` (Scheduler._mamba_block_aligned_split)
    # and `from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints`
    path = os.path.join(vllm.__path__[0], relative_path)
    tree = ast.parse(open(path).read())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = dict(cdiv=cdiv, get_mamba_prefill_checkpoint_position=get_mamba_prefill_checkpoint_position,
                 is_mamba_prefill_checkpoint_valid=is_mamba_prefill_checkpoint_valid)
    exec(compile(ast.Module([node], []), path, "exec", __future__.annotations.compiler_flag, True), scope)
    return scope[name]


split = vllm_function("v1/core/sched/scheduler.py", "_mamba_block_aligned_split")  # scheduler.py 546-662
checkpoints = vllm_function("model_executor/layers/mamba/checkpoint.py", "compute_mamba_prefill_checkpoints")

P, U, K = 8, 2, 1  # block size, hash unit (prefix_match_unit), speculative tokens (EAGLE/MTP)
# the Mamba layers' spec as MambaBase.get_kv_cache_spec builds it with num_speculative_tokens=K, plus one internal
# prefill checkpoint block on the hash unit's grid (as Qwen's GDN layer declares it where it exports them)
mamba = MambaSpec(block_size=P, shapes=((1,),), dtypes=(v.torch.float32,), mamba_cache_mode="align",
                  num_speculative_blocks=K, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=U)
attention = FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=1, dtype=v.torch.float32)
config = KVCacheConfig(num_blocks=40, kv_cache_tensors=[], prefix_cache_retention_interval=0,  # vLLM's default
                       kv_cache_groups=[KVCacheGroupSpec(["attn"], attention), KVCacheGroupSpec(["mamba"], mamba)])
# EAGLE's trailing-block drop (no lookahead hashes), as Scheduler.__init__ passes it
kvm = KVCacheManager(config, max_model_len=4096, scheduler_block_size=P, hash_block_size=U, use_eagle=True)
assert kvm.coordinator.enable_partial_hash_hits
init_none_hash(sha256)
hasher = get_request_block_hasher(U, sha256)
pool = kvm.block_pool
# what _mamba_block_aligned_split reads of the Scheduler, as Scheduler.__init__ sets it (scheduler.py 296-345,
# 432-464): mamba_partial_cache_hit, checkpoint blocks on every Mamba group, no shared-prefix checkpoint option
scheduler = types.SimpleNamespace(
    block_size=P, hash_block_size=U, cache_config=types.SimpleNamespace(block_size=P), use_eagle_block_drop=True,
    num_hash_lookahead_tokens=0, mamba_has_prefill_checkpoint_blocks=True, mamba_prefill_checkpoint_alignment=U,
    mamba_partial_cache_hit=True, mamba_shared_prefix_checkpoint=kvm.mamba_shared_prefix_checkpoint,
    max_num_scheduled_tokens=8192, scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0))
state = {}  # the worker: block id -> the number of tokens whose Mamba state it holds (written by a forward only)
state_idx = {}  # the worker's mamba_state_idx


def new_request(rid, tokens):
    r = types.SimpleNamespace(
        request_id=rid, all_token_ids=list(tokens), num_prompt_tokens=len(tokens), num_tokens=len(tokens),
        num_computed_tokens=0, block_hashes=[], mm_features=[], lora_request=None, cache_salt=None,
        prompt_embeds=None, session_id=None, shared_prefix_boundary=0, skip_reading_prefix_cache=False,
        num_in_flight_tokens=0, num_preemptions=0, status=v.status.WAITING)
    r.block_hashes.extend(hasher(r))
    return r


def schedule(r):
    # Scheduler.schedule for a waiting request: the lookup, the split, allocate_slots (which caches the blocks)
    kvm.new_step_starts()
    blocks, hit, r.shared_prefix_boundary = kvm.get_computed_blocks(r)
    num_new = split(scheduler, r, r.num_tokens - hit, hit, 0)
    new = kvm.allocate_slots(r, num_new, num_new_computed_tokens=hit, new_computed_blocks=blocks if hit else None,
                             num_lookahead_tokens=K)
    assert new is not None
    r.status = v.status.RUNNING
    return hit, num_new


def forward(r, hit, num_new):
    # the worker: the copy-on-write copies, preprocess_mamba (mamba_utils.py 1446-1549: the running state copied
    # from the block of the step before to the step's last block), the forward, and the internal checkpoint at
    # compute_mamba_prefill_checkpoints' position, exported into its column
    copies, retained = kvm.take_kv_cache_block_copies()
    row = [b.block_id for b in kvm.get_blocks(r.request_id).blocks[1]]
    copies = [[c.src_block_id, c.dst_block_id] for c in copies if c.dst_block_id in row]  # the Mamba group's
    for source, copy in copies:
        state[copy] = state[source]
    begin, end = hit, hit + num_new
    previous = state_idx.get(r.request_id, (begin - 1) // P)
    num_blocks = cdiv(end, P) + K
    current = num_blocks - 1 - K
    state_idx[r.request_id] = current
    resumes_from = None if previous == -1 else dict(block=row[previous], state_of=state[row[previous]])
    if previous not in (-1, current):
        state[row[current]] = state[row[previous]]
    (offset,), (column,) = checkpoints([end], [num_new], U, P, U, True, U)
    if column >= 0:
        state[row[column]] = begin + offset
    state[row[current]] = end
    pool.free_blocks(retained)  # Scheduler._free_cow_retained_blocks once the copies ran
    r.num_computed_tokens = end
    checkpoint = begin + offset if column >= 0 else None
    return dict(hit=hit, chunk=[begin, end], checkpoint=checkpoint, mamba_row=row, copies=copies,
                resumes_from=resumes_from)


def finish(r, sampled):  # the step samples one token and the request ends (max_tokens=1)
    r.all_token_ids.append(sampled)
    r.num_tokens += 1
    r.block_hashes.extend(hasher(r))
    kvm.free(r)


def cached_under(r, tokens, group=1):
    # the BlockPool's block-hash-to-block map: the blocks the group caches under the hash of r's first tokens
    entry = pool.cached_block_hash_to_block._cache.get(
        make_block_hash_with_group_id(r.block_hashes[tokens // U - 1], group))
    return [] if entry is None else [entry.block_id] if hasattr(entry, "block_id") else sorted(entry)


A = new_request("A", range(1000, 1041))  # 41 tokens
a = forward(A, *schedule(A))
finish(A, 2000)
B = new_request("B", A.all_token_ids + list(range(3000, 3012)))  # A's 42 tokens and 12 more: 54
b = forward(B, *schedule(B))
finish(B, 4000)
held = cached_under(B, 40)
C = new_request("C", B.all_token_ids[:48] + list(range(5000, 5006)))  # B's first 48 tokens and 6 more
c = forward(C, *schedule(C))
print(json.dumps(dict(A=a, B=b, cached_under_40=held, state_of=[state.get(block) for block in held],
                      C=dict(hit=c["hit"], resumes_from=c["resumes_from"]))))
"""


@needs_vllm
def test_vllm_mamba_a_partial_hit_then_an_internal_checkpoint_caches_a_block_under_the_wrong_state() -> None:
    """Finding 32 (vllm-mamba, seed 21; docs/findings.md): full attention and a Mamba group in ``align`` mode, blocks
    of 8, hash unit 2, EAGLE's block drop, internal prefill checkpoints. A (41 tokens) leaves its checkpoint of 38 in
    its block [32, 40). B, continuing A's 42 tokens with 12 more, hits 38: ``MambaManager.allocate_new_blocks`` copies
    that state into a fresh block at index 4 and leaves ``num_cached_block`` at 4; the scheduler's split runs [38, 54)
    as one chunk (the internal checkpoint at 52 lifts the stop at 40), so no forward writes the state of 40, yet
    ``allocate_slots`` caches the block under the 40-token hash. C, sharing B's first 48 tokens, hits 40 there and
    resumes from the state of 38 tokens (two tokens of its prefix never enter its recurrent state)."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_MAMBA_PARTIAL_HIT_CHECKPOINT], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    a, b, c = seen["A"], seen["B"], seen["C"]
    # A: one chunk, its checkpoint at 38 exported into its block at index 4
    assert (a["hit"], a["chunk"], a["checkpoint"]) == (0, [0, 41], 38)
    # B: a hit inside A's block at index 4, copied on write into a fresh block there; one chunk to its prompt's end
    assert (b["hit"], b["chunk"], b["checkpoint"]) == (38, [38, 54], 52)
    assert b["copies"] == [[a["mamba_row"][4], b["mamba_row"][4]]]
    assert b["resumes_from"] == {"block": b["mamba_row"][4], "state_of": 38}
    # the 40-token hash names that block, which holds the state of 38 tokens
    assert seen["cached_under_40"] == [b["mamba_row"][4]]
    assert seen["state_of"] == [38]
    # a later request hits 40 and resumes from it
    assert c == {"hit": 40, "resumes_from": {"block": b["mamba_row"][4], "state_of": 38}}


# Finding 18, standalone: vLLM's KV offloading modules only. A promotion the tiering manager completes inside
# reset_cache publishes a CPU "stored" event after the reset, for a key the CPU tier no longer holds.
VLLM_TIERING_RESET_STALE_EVENT = """import hashlib, json, os, sys, types
from radixspec.fuzz.targets.vllm_offload import import_offload

import_offload()  # vLLM's own modules on a CPU-only machine; in vLLM's environment, import them directly
# two modules the shared region's import chain reaches (psutil, CUDA): a /dev/shm space check, and pinning,
# which a region that is never pinned never calls
sys.modules["vllm.distributed.device_communicators.shm_broadcast"] = types.SimpleNamespace(
    check_shm_free_space=lambda *args, **kwargs: None)
import vllm.v1.kv_offload.cpu
sys.modules["vllm.v1.kv_offload.cpu.host_register"] = types.SimpleNamespace(host_register=None, host_unregister=None)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

K1, K2, K3 = (make_offload_key(hashlib.sha256(name.encode()).digest(), 0) for name in ("k1", "k2", "k3"))
NAMES = {K1: "K1", K2: "K2", K3: "K3"}
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
size = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
region = SharedOffloadRegion(engine_id=f"finding18_{os.getpid()}", num_chunks=2, rank=None,
                             kv_bytes_per_chunk=size, cpu_page_size=size)
primary = CPUPrimaryTierOffloadingManager(num_chunks=2, mmap_region=region, enable_events=True)
tier = ExampleSecondaryTierManager(offloading_spec=None, primary_kv_view=primary.get_kv_memoryview(),
                                   tier_type="example")
manager = TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0)
shown = lambda events: [("removed" if e.removed else "stored", e.medium.value, [NAMES[k] for k in e.keys])
                        for e in events]
try:
    for name, keys in (("A", [K1]), ("B", [K2, K3])):  # K1 stored, cascaded to the tier, then evicted by K2, K3
        request = ReqContext(req_id=name)
        manager.on_new_request(request)
        manager.prepare_store(keys, request)
        manager.complete_store(keys, request)
        manager.on_request_finished(request)
        manager.on_schedule_end(END)
        list(manager.take_events())
    c = ReqContext(req_id="C")
    manager.on_new_request(c)
    promoting = manager.lookup(K1, c).name  # a tier hit: a promotion into the CPU tier starts
    manager.on_schedule_end(END)  # the tier finishes its load; the manager has not processed it yet
    drained = shown(manager.take_events())  # the connector drains every step
    manager.reset_cache()  # reset_prefix_cache(reset_connector=True)
    after = shown(manager.take_events())
    lookup = primary.lookup(K1, c).name
    manager.on_reset_flushed()
    manager.on_request_finished(c)
    manager.on_schedule_end(END)
    later = shown(manager.take_events())
finally:
    manager.shutdown()
print(json.dumps({"promoting": promoting, "drained_before_reset": drained, "after_reset": after,
                  "cpu_lookup_after_reset": lookup, "next_step": later}))
"""


@needs_vllm
def test_vllm_tiering_reset_publishes_a_promotion_the_reset_then_drops() -> None:
    """Finding 18 (found reading the offloading connector's reset path for the ``vllm-offload`` target, not by a
    campaign: the offload machine drives ``CPUOffloadingManager``, not the tiering manager): ``reset_cache`` of
    ``TieringOffloadingManager`` completes a finished promotion (a CPU ``complete_store``, queuing a stored event)
    and only then resets the CPU tier, whose ``reset_cache`` keeps the queued events. The first events after the
    reset say the CPU tier holds K1; it does not, and no removal follows."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_TIERING_RESET_STALE_EVENT], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {
        "promoting": "HIT_PENDING",
        "drained_before_reset": [["removed", "CPU", ["K3"]]],
        "after_reset": [["stored", "CPU", ["K1"]]],
        "cpu_lookup_after_reset": "MISS",
        "next_step": [],
    }


# Finding 22, standalone: vLLM's own modules only (the connector's scheduler, the KV cache manager, the CPU manager).
# A store job is in flight when reset_prefix_cache(reset_connector=True) comes; a second one before the engine's next
# step fails the connector's assertion.
VLLM_CONNECTOR_STEP = """import hashlib, json, types
from radixspec.fuzz.targets.vllm_offload_connector import import_connector

v = import_connector()  # vLLM's own modules on a CPU-only machine; in vLLM's environment, import them directly
from vllm.utils.hashing import sha256

P = 4
spec = v.interface.FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=1, dtype=v.torch.float32)
kv_config = v.interface.KVCacheConfig(num_blocks=17, kv_cache_tensors=[],
                                      kv_cache_groups=[v.interface.KVCacheGroupSpec(["layer.0"], spec)])
kvm = v.manager.KVCacheManager(kv_config, max_model_len=4096, scheduler_block_size=P, hash_block_size=P,
                               enable_kv_cache_events=True)
v.utils.init_none_hash(sha256)
cpu = v.cpu.CPUOffloadingManager(num_chunks=8, cache_policy="lru", enable_events=True)


class Spec(v.base.OffloadingSpec):  # the CPU manager, as CPUOffloadingSpec.get_manager builds it
    def get_manager(self):
        return cpu

    def get_worker(self, kv_caches):
        raise NotImplementedError


offloading = v.config.OffloadingConfig(
    groups=(v.config.OffloadingGroupConfig(tokens_per_block=P, layer_names=("layer.0",), group_id=0),),
    worker_kv_bytes_per_block=1, enable_kv_cache_events=True, extra_config={}, engine_id="e",
    model=v.config.OffloadingModelConfig(name="m", dtype="float32"),
    cache=v.config.OffloadingCacheConfig(tokens_per_hash=P, blocks_per_chunk=1),
    parallel=v.config.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, 0, False))
engine = types.SimpleNamespace(
    cache_config=types.SimpleNamespace(prefix_cache_retention_interval=None, enable_prefix_caching=True),
    speculative_config=None, parallel_config=types.SimpleNamespace(world_size=1, decode_context_parallel_size=1))
connector = v.scheduler.OffloadingConnectorScheduler(Spec(offloading), engine, kv_config)

# one request of 8 tokens (what the scheduler, the manager and the connector read of a Request)
request = types.SimpleNamespace(
    request_id="A", all_token_ids=list(range(1, 9)), num_prompt_tokens=8, num_tokens=8, num_computed_tokens=0,
    block_hashes=[], mm_features=[], lora_request=None, cache_salt=None, prompt_embeds=None, session_id=None,
    kv_transfer_params=None, kv_hints=None, skip_reading_prefix_cache=False, shared_prefix_boundary=0,
    sampling_params=None, num_in_flight_tokens=0, num_output_placeholders=0, spec_token_ids=[],
    status=v.status.WAITING, is_finished=lambda: False)
request.block_hashes.extend(v.utils.get_request_block_hasher(P, sha256)(request))
connector.on_new_request(request)
blocks, local, _ = kvm.get_computed_blocks(request)
connector.get_num_new_matched_tokens(request, local)
kvm.allocate_slots(request, 8)
connector.update_state_after_alloc(request, kvm.get_blocks("A"), 0)
request.status = v.status.RUNNING
output = v.output.SchedulerOutput(
    scheduled_new_reqs=[v.output.NewRequestData("A", request.all_token_ids, [], None, None, kvm.get_block_ids("A"),
                                                0, None)],
    scheduled_cached_reqs=v.output.CachedRequestData.make_empty(), num_scheduled_tokens={"A": 8},
    total_num_scheduled_tokens=8, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
    finished_req_ids=set(), free_encoder_mm_hashes=[])
meta = connector.build_connector_meta(output)  # the step: A's two blocks offered, a store job to the worker
seen = {"store_jobs": sorted(meta.store_jobs)}
"""
VLLM_DOUBLE_RESET = (
    VLLM_CONNECTOR_STEP
    + """
# Scheduler.reset_prefix_cache(reset_connector=True), twice, as a client may call it (the worker not yet reported)
for name in ("first_reset", "second_reset"):
    kvm.reset_prefix_cache()  # refused (A holds its blocks); the connector is reset anyway
    try:
        connector.reset_cache()
        seen[name] = "ok"
    except AssertionError as error:
        seen[name] = "AssertionError at " + error.__traceback__.tb_next.tb_frame.f_code.co_name
print(json.dumps(seen))
"""
)


# Finding 23, standalone: the same step, its store reported done by the worker; then a reset while A still runs.
VLLM_SILENT_HOST_RESET = (
    VLLM_CONNECTOR_STEP
    + """
worker = v.common.OffloadingWorkerMetadata(completed_jobs={0: 1})
connector.update_connector_output(v.outputs.KVConnectorOutput(kv_connector_worker_meta=worker))
events = kvm.take_events() + list(connector.take_events())
published = [(type(e).__name__, e.medium, len(e.block_hashes)) for e in events]
# Scheduler.reset_prefix_cache(reset_connector=True) while A runs: the GPU pool refuses, the connector resets
seen["device_reset"] = kvm.reset_prefix_cache()
connector.reset_cache()
seen["published_before"] = published
seen["events_after_reset"] = [type(e).__name__ for e in kvm.take_events() + list(connector.take_events())]
key = v.base.make_offload_key(request.block_hashes[0], 0)
seen["cpu_lookup_after"] = cpu.lookup(key, v.base.ReqContext(req_id="B")).name
print(json.dumps(seen))
"""
)


@needs_vllm
def test_vllm_offloading_connector_a_reset_the_device_refuses_empties_the_host_tier_silently() -> None:
    """Finding 23 (the ``vllm-offload-connector`` target's host-event law, seed 0): with a request running,
    ``Scheduler.reset_prefix_cache(reset_connector=True)`` finds the GPU pool's reset refused (blocks in use: no
    ``AllBlocksCleared``) and resets the connector anyway, whose ``reset_cache`` empties the CPU tier and publishes
    nothing. A consumer of the KV events keeps the two CPU blocks; the tier holds none."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_SILENT_HOST_RESET], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["published_before"][-1] == ["BlockStored", "CPU", 1]
    assert sum(1 for kind, medium, _ in seen["published_before"] if medium == "CPU") == 2
    assert seen["device_reset"] is False
    assert seen["events_after_reset"] == []
    assert seen["cpu_lookup_after"] == "MISS"


@needs_vllm
def test_vllm_offloading_connector_a_second_reset_before_a_step_fails_an_assertion() -> None:
    """Finding 22 (the ``vllm-offload-connector`` campaign, seed 0): ``OffloadingConnectorScheduler.reset_cache``
    flushes the jobs in flight into ``_current_batch_jobs_to_flush`` and leaves them there for the next step's
    metadata; it also asserts that set is empty on entry ("cannot be called in the middle of a schedule step"). So a
    second ``reset_prefix_cache(reset_connector=True)`` before the engine's next step raises."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_DOUBLE_RESET], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"store_jobs": [0], "first_reset": "ok", "second_reset": "AssertionError at reset_cache"}


# Finding 27, standalone: vLLM's own modules only (the KV cache manager of a full-attention and a sliding-window group,
# the offloading connector's scheduler, the CPU manager). A request prefilled in chunks, each step's store reported
# done (the window's blocks that left the window freed and allocated again to its later positions); then a reset
# while it runs, and its next chunk.
VLLM_WINDOW_RESET = """import json, types
from radixspec.fuzz.targets.vllm_offload_connector import import_connector

v = import_connector()  # vLLM's own modules on a CPU-only machine; in vLLM's environment, import them directly
from vllm.utils.hashing import sha256

P, W, BLOCKS = 4, 8, 16  # 15 usable GPU blocks: A's 10 full-attention blocks and its window's few
shape = dict(block_size=P, num_kv_heads=1, head_size=1, dtype=v.torch.float32)
groups = [v.interface.KVCacheGroupSpec(["full"], v.interface.FullAttentionSpec(**shape)),
          v.interface.KVCacheGroupSpec(["swa"], v.interface.SlidingWindowSpec(**shape, sliding_window=W))]
kv_config = v.interface.KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
kvm = v.manager.KVCacheManager(kv_config, max_model_len=4096, scheduler_block_size=P, hash_block_size=P,
                               enable_kv_cache_events=True)
v.utils.init_none_hash(sha256)
cpu = v.cpu.CPUOffloadingManager(num_chunks=64, cache_policy="lru", enable_events=True)


class Spec(v.base.OffloadingSpec):  # the CPU manager, as CPUOffloadingSpec.get_manager builds it
    def get_manager(self):
        return cpu

    def get_worker(self, kv_caches):
        raise NotImplementedError


window_chunks = v.offload_config.get_sliding_window_size_in_chunks(groups[1].kv_cache_spec, P)
offloading = v.config.OffloadingConfig(
    groups=(v.config.OffloadingGroupConfig(tokens_per_block=P, layer_names=("full",), group_id=0),
            v.config.OffloadingGroupConfig(tokens_per_block=P, layer_names=("swa",), group_id=1,
                                           sliding_window_size_in_chunks=window_chunks)),
    worker_kv_bytes_per_block=1, enable_kv_cache_events=True, extra_config={}, engine_id="e",
    model=v.config.OffloadingModelConfig(name="m", dtype="float32"),
    cache=v.config.OffloadingCacheConfig(tokens_per_hash=P, blocks_per_chunk=1),
    parallel=v.config.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, 0, False))
engine = types.SimpleNamespace(
    cache_config=types.SimpleNamespace(prefix_cache_retention_interval=None, enable_prefix_caching=True),
    speculative_config=None, parallel_config=types.SimpleNamespace(world_size=1, decode_context_parallel_size=1))
connector = v.scheduler.OffloadingConnectorScheduler(Spec(offloading), engine, kv_config)

# one request of 40 tokens, prefilled 8 tokens a step (chunked prefill): its window's blocks freed as it goes
N, CHUNK = 40, 8
request = types.SimpleNamespace(
    request_id="A", all_token_ids=list(range(1, N + 1)), num_prompt_tokens=N, num_tokens=N, num_computed_tokens=0,
    block_hashes=[], mm_features=[], lora_request=None, cache_salt=None, prompt_embeds=None, session_id=None,
    kv_transfer_params=None, kv_hints=None, skip_reading_prefix_cache=False, shared_prefix_boundary=0,
    sampling_params=None, num_in_flight_tokens=0, num_output_placeholders=0, spec_token_ids=[],
    status=v.status.WAITING, is_finished=lambda: False)
request.block_hashes.extend(v.utils.get_request_block_hasher(P, sha256)(request))
connector.on_new_request(request)
_, local, _ = kvm.get_computed_blocks(request)
connector.get_num_new_matched_tokens(request, local)
seen = {"window_rows": [], "store_jobs": []}  # per step: A's window row, each store job's blocks


def step(first):  # one engine step: A's next chunk scheduled, the connector's metadata built
    new = kvm.allocate_slots(request, CHUNK)
    if first:
        connector.update_state_after_alloc(request, kvm.get_blocks("A"), 0)
        request.status = v.status.RUNNING
        new_reqs = [v.output.NewRequestData("A", request.all_token_ids, [], None, None, kvm.get_block_ids("A"), 0,
                                            None)]
        cached = v.output.CachedRequestData.make_empty()
    else:
        new_reqs = []
        cached = v.output.CachedRequestData(
            req_ids=["A"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
            new_block_ids=[new.get_block_ids(allow_none=True)], num_computed_tokens=[request.num_computed_tokens],
            num_output_tokens=[0])
    output = v.output.SchedulerOutput(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached, num_scheduled_tokens={"A": CHUNK},
        total_num_scheduled_tokens=CHUNK, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[])
    meta = connector.build_connector_meta(output)
    request.num_computed_tokens += CHUNK  # _update_after_schedule
    seen["window_rows"].append(list(kvm.get_block_ids("A")[1]))
    for job, spec in meta.store_jobs.items():
        seen["store_jobs"].append([int(b) for b in spec.src_spec.block_ids])
    return meta


def report(meta):  # the worker reports the step's store jobs done
    done = v.common.OffloadingWorkerMetadata(completed_jobs={job: 1 for job in meta.store_jobs})
    connector.update_connector_output(v.outputs.KVConnectorOutput(kv_connector_worker_meta=done))


report(step(True))
for _ in range(3):
    report(step(False))
# Scheduler.reset_prefix_cache(reset_connector=True) while A runs: the GPU pool refuses, the connector resets
seen["device_reset"] = kvm.reset_prefix_cache()
connector.reset_cache()
meta = step(False)  # A's last chunk
(job, spec), = meta.store_jobs.items()
full_size = spec.src_spec.group_sizes[0]
seen["window_row_now"] = list(kvm.get_block_ids("A")[1])
seen["job_window_blocks"] = [int(b) for b in spec.src_spec.block_ids[full_size:]]
try:
    report(meta)
    seen["report"] = "ok"
except KeyError as error:
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    seen["report"] = f"KeyError {error} in {tb.tb_frame.f_code.co_name}"
print(json.dumps(seen))
"""


@needs_vllm
def test_vllm_offloading_connector_a_reset_re_offloads_a_window_groups_stale_blocks() -> None:
    """Finding 27 (the ``vllm-offload-connector`` campaign with a sliding-window group, seed 104):
    ``reset_cache`` sets every running request's ``next_stored_chunk_idx`` back to 0, but the connector's own list of
    the window group's block ids still names the blocks that left the window, which the allocator has since given to
    the request's later positions (#42959 zeroes such stale ids only past the stored chunks). The next store job
    copies them under the early chunks' keys (another position's KV) and, with one block listed twice, its
    completion raises ``KeyError`` in ``_remove_pending_job``."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_WINDOW_RESET], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["device_reset"] is False
    now, stored = seen["window_row_now"], seen["job_window_blocks"]
    # the window's positions 0 to 5 left it (null); the job stores blocks that are not in the row at their position
    assert now[:6] == [0] * 6
    assert [block for block in stored if block not in now] != []
    assert len(set(stored)) < len(stored)  # one block named twice
    assert seen["report"].startswith("KeyError") and seen["report"].endswith("in _remove_pending_job")


# Finding 24, standalone: vLLM's own modules only (the KV cache manager and SimpleCPUOffloadScheduler). A request's
# blocks stored to the CPU and published on both tiers; a reset while another request runs.
VLLM_SIMPLE_RESET_CLEARS_EVERY_TIER = """import json, types
from radixspec.fuzz.targets.vllm_simple_offload import import_simple

s = import_simple()  # vLLM's own modules on a CPU-only machine; in vLLM's environment, import them directly
import torch
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

P, BLOCKS, PAGE = 4, 9, 2 * 4 * 4  # 8 usable GPU blocks, K and V of one float32 head of size 1
spec = FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=1, dtype=torch.float32)
tensor = KVCacheTensor(size=BLOCKS * PAGE, layers=["layer.0"], layer_stride=BLOCKS * PAGE, block_stride=PAGE)
kv_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor],
                          kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
kvm = KVCacheManager(kv_config, max_model_len=4096, scheduler_block_size=P, hash_block_size=P,
                     enable_kv_cache_events=True)
utils.init_none_hash(sha256)
engine = types.SimpleNamespace(  # the VllmConfig fields the connector's scheduler reads (KV events on, one rank)
    kv_events_config=types.SimpleNamespace(enable_kv_cache_events=True),
    parallel_config=types.SimpleNamespace(world_size=1, decode_context_parallel_size=1), speculative_config=None,
    model_config=types.SimpleNamespace(max_model_len=4096), max_in_flight_tokens=4096,
    num_prefill_lookahead_tokens=0, scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64))
connector = SimpleCPUOffloadScheduler(engine, kv_config, cpu_capacity_bytes=16 * PAGE, scheduler_block_size=P,
                                      hash_block_size=P)  # eager mode, 16 CPU blocks
connector.bind_gpu_block_pool(kvm.block_pool)


def request(rid, tokens):  # what the scheduler, the manager and the connector read of a Request
    r = types.SimpleNamespace(
        request_id=rid, all_token_ids=list(tokens), num_prompt_tokens=len(tokens), num_tokens=len(tokens),
        num_computed_tokens=0, block_hashes=[], mm_features=[], lora_request=None, cache_salt=None,
        prompt_embeds=None, session_id=None, kv_transfer_params=None, kv_hints=None,
        skip_reading_prefix_cache=False, shared_prefix_boundary=0, sampling_params=None, num_in_flight_tokens=0,
        num_output_placeholders=0, spec_token_ids=[], status=RequestStatus.WAITING)
    r.block_hashes.extend(utils.get_request_block_hasher(P, sha256)(r))
    return r


def admit(r):  # the scheduler's admission of a waiting request
    blocks, local, _ = kvm.get_computed_blocks(r)
    hit, _ = connector.get_num_new_matched_tokens(r, local)
    kvm.allocate_slots(r, r.num_tokens - local, num_new_computed_tokens=local, new_computed_blocks=blocks)
    connector.update_state_after_alloc(r, kvm.get_blocks(r.request_id), 0)
    r.status = RequestStatus.RUNNING
    return NewRequestData(r.request_id, r.all_token_ids, [], None, None, kvm.get_block_ids(r.request_id), local, None)


def step(new, finished=()):
    out = SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={n.req_id: len(n.prompt_token_ids) for n in new},
        total_num_scheduled_tokens=sum(len(n.prompt_token_ids) for n in new), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(finished), free_encoder_mm_hashes=[])
    return connector.build_connector_meta(out)


def events():
    return [(type(e).__name__, getattr(e, "medium", None)) for e in kvm.take_events() + list(connector.take_events())]


a = request("A", range(1, 9))  # A computes 8 tokens: two GPU blocks
step([admit(a)])
a.num_computed_tokens = 8
# A finishes: its confirmed blocks are queued for the CPU; the scheduler frees them (they stay cached on the GPU)
connector.request_finished_all_groups(a, kvm.get_block_ids_for_computed_tokens("A", 8))
kvm.free(a)
b = request("B", range(100, 104))  # B runs: it holds a GPU block
meta = step([admit(b)], finished={"A"})
# the worker copies A's two blocks and reports the store event
connector.update_connector_output(KVConnectorOutput(
    kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1})))
seen = {"store_event": meta.store_event, "published": events()}
# Scheduler.reset_prefix_cache(reset_connector=True) while B runs: the GPU pool refuses, the connector resets
seen["device_reset"] = kvm.reset_prefix_cache()
seen["connector_reset"] = connector.reset()
seen["events_after_reset"] = events()
# the GPU still serves A's prefix: the consumer that applied AllBlocksCleared no longer knows those blocks
seen["gpu_hit_after"] = kvm.get_computed_blocks(request("C", [*range(1, 9), 50]))[1]
print(json.dumps(seen))
"""


@needs_vllm
def test_vllm_simple_cpu_offload_a_reset_the_device_refuses_publishes_a_clear_of_every_tier() -> None:
    """Finding 24 (the ``vllm-simple-offload`` campaign, seed 1, after 1.1 s): with a request running,
    ``Scheduler.reset_prefix_cache(reset_connector=True)`` finds the GPU pool's reset refused and resets the
    connector, whose CPU pool publishes ``AllBlocksCleared``. The event names no tier (it has no ``medium``): a
    consumer drops the GPU's blocks too, while the GPU still serves them."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", VLLM_SIMPLE_RESET_CLEARS_EVERY_TIER], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {
        "store_event": 0,
        "published": [["BlockStored", "GPU"], ["BlockStored", "GPU"], ["BlockStored", "CPU"], ["BlockStored", "CPU"]],
        "device_reset": False,
        "connector_reset": True,
        "events_after_reset": [["AllBlocksCleared", None]],
        "gpu_hit_after": 8,
    }


# ------------------------------------------------------------------ NVIDIA Dynamo 1.6.1's router index

needs_dynamo = pytest.mark.skipif(importlib.util.find_spec("dynamo") is None, reason="Dynamo is not installed")

# Finding 16, standalone: only Dynamo's wheel (ai-dynamo-runtime 1.6.1) and the standard library.
DYNAMO_SCORES_KEYED_BY_RANK = """import json
from dynamo._core import RadixTree, compute_block_hash_for_seq

tree = RadixTree()
local = compute_block_hash_for_seq([1, 2, 3, 4], 2)
blocks = [{"block_hash": 100 + i, "tokens_hash": h} for i, h in enumerate(local)]
tree.apply_event(7, json.dumps({"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}).encode())
scores = tree.find_matches(local).scores
# the type stub (dynamo/_core.pyi) and the API docs: "Dict[int, int]: Map of worker_id to the score"
print(json.dumps({"keys": [list(k) if isinstance(k, tuple) else k for k in scores], "by_worker_id": scores.get(7)}))
"""

# Finding 17, standalone: a block stored twice by one worker, then removed once.
DYNAMO_STORE_TWICE_REMOVE_ONCE = """import json
from dynamo._core import RadixTree, compute_block_hash_for_seq

tree = RadixTree()
(local,) = compute_block_hash_for_seq([1, 2], 2)
stored = {"parent_hash": None, "blocks": [{"block_hash": 100, "tokens_hash": local}]}
for event_id in (1, 2):
    tree.apply_event(0, json.dumps({"event_id": event_id, "data": {"stored": stored}}).encode())
before = tree.find_matches([local]).scores
tree.apply_event(0, json.dumps({"event_id": 3, "data": {"removed": {"block_hashes": [100]}}}).encode())
after = tree.find_matches([local]).scores
print(json.dumps({"before": list(before.values()), "after": list(after.values())}))
"""


def run_script(script: str, *args: str) -> Any:
    """Run a standalone reproducer (its arguments after it); what it printed last, as JSON."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_dynamo
def test_dynamo_overlap_scores_are_keyed_by_worker_and_dp_rank_where_its_stub_says_by_worker() -> None:
    """Finding 16 (found writing the router target; the router machine's scores law depends on it): Dynamo 1.6.1's
    ``OverlapScores.scores`` maps ``(worker_id, dp_rank)`` to matched blocks, where its type stub and API docs say
    ``Dict[int, int]``, worker id to blocks: code written to the stub reads ``scores.get(worker_id)`` and gets
    None for a worker that holds the prompt."""
    seen = run_script(DYNAMO_SCORES_KEYED_BY_RANK)
    assert seen == {"keys": [[7, 0]], "by_worker_id": None}


@needs_dynamo
def test_dynamo_a_block_stored_twice_by_one_worker_is_one_block_a_removal_drops_it() -> None:
    """Finding 17: a worker's second store of a block it holds changes nothing and is not counted; one removal
    drops the block. Intended: the engines never announce a cached block twice (vLLM stores new blocks only; our
    caches likewise). It matters with SGLang's events, whose hashes omit a non-LoRA extra key (finding 8): two
    namespaces' equal pages are one block to Dynamo, and evicting either drops it for both."""
    seen = run_script(DYNAMO_STORE_TWICE_REMOVE_ONCE)
    assert seen == {"before": [1], "after": []}


# ------------------------------------------------------------------ TokenSpeed's scheduler 0.1.42

needs_tokenspeed = pytest.mark.skipif(
    importlib.util.find_spec("tokenspeed_scheduler") is None, reason="tokenspeed-scheduler is not installed"
)

TOKENSPEED_ORPHAN_AFTER_RESTORE = """import json
import tokenspeed_scheduler as ts

config = ts.SchedulerConfig()
config.prefix_granularity = 1
config.max_scheduled_tokens = 8
config.max_batch_size = 1
config.num_device_pages = 9  # 8 pages and the null page
config.num_host_pages = 4
config.num_snapshot_pages = 9  # retraction on, forced every third plan (a pool under pressure retracts the same way)
config.max_retracted_requests = 2
config.debug_force_retraction_interval = 3
config.enable_kv_cache_events = True
config.cache_groups = [ts.CacheGroupConfig("full", 1, 9, ts.AttnKind.Full)]
scheduler = ts.Scheduler(config)
request = ts.RequestSpec()
request.request_id, request.tokens, request.max_new_tokens = "r1", [4, 6, 4, 4, 3], 3
scheduler.submit_requests([request])
DONE = {"WriteBackOp": ts.Cache.WriteBackDoneEvent, "LoadBackOp": ts.Cache.LoadBackDoneEvent,
        "SnapshotOp": ts.Cache.SnapshotDoneEvent, "RestoreOp": ts.Cache.RestoreDoneEvent}
published, seen, sampled = {}, [], iter([104, 106, 108])
for step in range(6):
    plan = scheduler.next_execution_plan()
    done = ts.ExecutionEvent()
    for op in plan.cache:  # the executor: every copy done at once
        seen.append(type(op).__name__)
        for op_id in op.op_ids:
            event = DONE[type(op).__name__]()
            event.op_id = op_id
            done.add_event(event)
    scheduler.advance(done)
    for batch in plan.forward:
        for rid in batch.request_ids:
            result = ts.ForwardEvent.ExtendResult()
            result.request_id, result.tokens = rid, [next(sampled)]
            scheduler.advance(ts.ExecutionEvent().add_event(result))
    for event in scheduler.drain_kv_events():
        for block in event.block_hashes:
            if event.kind == "BlockRemoved":
                seen.append(("removed", published.pop(block)))
            elif event.parent_block_hash is None or event.parent_block_hash in published:
                published[block] = published.get(event.parent_block_hash, []) + list(event.token_ids)
            else:  # a router's index drops a block whose parent it does not hold
                seen.append(("orphan", list(event.token_ids)))
print(json.dumps(seen))
"""


# Finding 28, standalone: TokenSpeed's scheduler only. A full-attention group and, with a window given (argv[1], in
# tokens; 0: none), a sliding-window group. One request of 13 tokens prefilled in one pass, finished; its events;
# then a request with the same 13 tokens and its hit.
TOKENSPEED_WINDOW_UNPUBLISHED = """import json, os, sys
os.environ.setdefault("SPDLOG_LEVEL", "warn")
import tokenspeed_scheduler as ts

P, W = 4, int(sys.argv[1]) if len(sys.argv) > 1 else 6
DEVICE = 25
config = ts.SchedulerConfig()
config.prefix_granularity = P
config.max_scheduled_tokens = 16
config.max_batch_size = 8
config.num_device_pages = DEVICE
config.num_host_pages = DEVICE
config.enable_kv_cache_events = True
config.num_snapshot_pages = 1  # no retraction
config.cache_groups = [ts.CacheGroupConfig("full", P, DEVICE, ts.AttnKind.Full)]
if W:
    config.cache_groups = [*config.cache_groups, ts.CacheGroupConfig("swa", P, DEVICE, ts.AttnKind.SlidingWindow, W)]
scheduler = ts.Scheduler(config)


def advance(event):
    scheduler.advance(ts.ExecutionEvent().add_event(event))


def drain():  # the KV events: kind, hashes, whether a parent is named, tokens
    for event in scheduler.drain_kv_events():
        seen["events"].append([event.kind, len(event.block_hashes), event.parent_block_hash is not None,
                               list(event.token_ids)])


spec = ts.RequestSpec()
spec.request_id, spec.tokens, spec.max_new_tokens = "A", list(range(1, 14)), 1  # 13 tokens: 3 full pages cached
scheduler.submit_requests([spec])
seen = {"passes": [], "events": []}
plan = scheduler.next_execution_plan()  # A's prefill, 13 tokens in one pass
if True:
    for batch in plan.forward:
        for i, rid in enumerate(batch.request_ids):
            rows = {g: list(table[i]) for g, table in batch.block_tables.items()}
            seen["passes"].append([rid, batch.extend_prefix_lens[i], batch.input_lengths[i], rows])
            result = ts.ForwardEvent.ExtendResult()
            result.request_id, result.tokens = rid, [100]
            advance(result)
    drain()
finish = ts.ForwardEvent.Finish()
finish.request_id = "A"
advance(finish)
drain()
# B shares A's 13 tokens: its hit
spec = ts.RequestSpec()
spec.request_id, spec.tokens, spec.max_new_tokens = "B", list(range(1, 14)) + [50], 1
scheduler.submit_requests([spec])
plan = scheduler.next_execution_plan()
for batch in plan.forward:
    for i, rid in enumerate(batch.request_ids):
        if rid == "B":
            seen["B_hit"] = batch.extend_prefix_lens[i]
            seen["B_rows"] = {g: list(rows[i]) for g, rows in batch.block_tables.items()}
print(json.dumps(seen))
"""


@needs_tokenspeed
def test_tokenspeed_with_a_window_group_a_page_that_left_the_window_is_served_and_never_published() -> None:
    """Finding 28 (the ``tokenspeed`` target with a window group, seed 5, in seconds): a page that leaves the window
    in the pass that computes it (pages of 4, a window of 6, a 13-token prefill) is never published, though the full
    group caches it and serves it: the request after hits all 13 tokens. The next page is published with that page's
    hash as its parent. Without the window group the first page is published, with no parent."""
    seen = {window: run_script(TOKENSPEED_WINDOW_UNPUBLISHED, window) for window in ("6", "0")}
    stored = [(parent, tokens) for kind, _, parent, tokens in seen["6"]["events"] if kind == "BlockStored"]
    assert stored[0] == (True, [5, 6, 7, 8])  # the first page published is the second, under a parent never stored
    assert all(tokens != [1, 2, 3, 4] for _, tokens in stored)
    assert seen["6"]["B_hit"] == 13 and seen["6"]["B_rows"]["full"][0] == seen["6"]["passes"][0][3]["full"][0]
    stored = [(parent, tokens) for kind, _, parent, tokens in seen["0"]["events"] if kind == "BlockStored"]
    assert stored[0] == (False, [1, 2, 3, 4]) and seen["0"]["B_hit"] == 13


TOKENSPEED_RETRACTED_WINDOW_ABORT = """import sys
import tokenspeed_scheduler as ts

WINDOW = int(sys.argv[1]) if len(sys.argv) > 1 else 6
config = ts.SchedulerConfig()
config.prefix_granularity = 1
config.max_scheduled_tokens = 32
config.max_batch_size = 4
config.num_device_pages = 25  # 24 pages and the null page
config.num_host_pages = 12
config.overlap_schedule_depth = 1
config.num_snapshot_pages = 25  # retraction on, forced every third plan
config.max_retracted_requests = 2
config.debug_force_retraction_interval = 3
config.enable_kv_cache_events = True
config.cache_groups = [ts.CacheGroupConfig("full", 1, 25, ts.AttnKind.Full),
                       ts.CacheGroupConfig("swa", 1, 25, ts.AttnKind.SlidingWindow, WINDOW)]
config.enable_l3_storage = True
config.storage_config = ts.StorageConfig(4, 16, 6, 64, 64, 1, 10**6, 10**6, ts.StoragePressure(8, 1 << 30, 10**7),
                                         ts.StoragePressure(2, 1 << 20, 10**6))
s = ts.Scheduler(config)
# the calls of one executor (a storage completion: its op id and keys, negative when every key failed)
CALLS = [
    ('plan',), ('plan',), ('submit', 'r2', [6, 4, 6, 3, 5], 1), ('plan',), ('done', 'query', 1, -8), ('plan',),
    ('plan',), ('result', 'r2', [106]), ('finish', 'r2'), ('done', 'backup', 0), ('plan',), ('result', 'r2', []),
    ('done', 'put', 2, 3), ('plan',), ('done', 'put', 3, 3), ('plan',), ('done', 'put', 4, 3), ('plan',), ('plan',),
    ('plan',), ('done', 'put', 5, -1), ('plan',), ('plan',), ('plan',), ('plan',), ('plan',),
    ('submit', 'r3', [5, 5, 4], 1), ('submit', 'r4', [5, 5, 1, 1], 2), ('submit', 'r5', [2, 1, 1], 3), ('plan',),
    ('submit', 'r6', [7, 7], 3), ('done', 'query', 7, -6), ('submit', 'r7', [6, 2, 4], 4),
    ('done', 'query', 6, -4), ('plan',), ('plan',), ('result', 'r3', [102]), ('finish', 'r3'),
    ('result', 'r4', [103]), ('plan',), ('result', 'r3', []), ('result', 'r4', [105]), ('finish', 'r4'),
    ('submit', 'r8', [3, 1, 2], 1), ('plan',), ('result', 'r4', []), ('plan',), ('plan',), ('plan',), ('plan',),
    ('done', 'query', 8, -4), ('done', 'backup', 2), ('submit', 'r10', [5, 5, 1, 4, 1, 5], 1),
    ('done', 'query', 11, -4), ('done', 'query', 10, -2), ('submit', 'r11', [2, 7], 3), ('done', 'query', 9, -2),
    ('submit', 'r12', [7, 7], 4), ('plan',), ('done', 'backup', 1), ('plan',), ('result', 'r5', [104]), ('plan',),
    ('result', 'r6', [101]), ('done', 'backup', 3), ('plan',), ('result', 'r5', [102]), ('result', 'r6', [102]),
    ('plan',), ('result', 'r11', [102]), ('plan',), ('result', 'r8', [105]), ('finish', 'r8'), ('plan',),
    ('result', 'r8', []), ('result', 'r11', [102]), ('plan',), ('result', 'r7', [106]), ('plan',),
    ('result', 'r7', [105]), ('result', 'r11', [102]), ('finish', 'r11'), ('done', 'snapshot', 7),
    ('done', 'backup', 6), ('done', 'snapshot', 5), ('done', 'backup', 4), ('plan',), ('done', 'restore', 8),
    ('plan',), ('done', 'restore', 11), ('drain',), ('plan',), ('result', 'r6', [106]), ('finish', 'r6'),
]
def advance(event):
    s.advance(ts.ExecutionEvent().add_event(event))
now = 0
for i, (call, *args) in enumerate(CALLS):
    print(i, call, *args, flush=True)
    if call == "plan":  # a storage clock tick, then the plan (the executor reads op ids from it)
        now += 1000
        advance(ts.Cache.StorageTick(now, True, True, ts.StoragePressure(0, 0, 0)))
        s.next_execution_plan()
    elif call == "submit":
        r = ts.RequestSpec(); r.request_id, r.tokens, r.max_new_tokens = args; s.submit_requests([r])
    elif call in ("result", "finish"):
        e = ts.ForwardEvent.ExtendResult() if call == "result" else ts.ForwardEvent.Finish()
        e.request_id = args[0]
        if call == "result":
            e.tokens = args[1]
        advance(e)
    elif call == "drain":
        s.drain_kv_events()
    else:  # "done": a transfer the plan asked for is complete
        kind, op = args[:2]
        if kind == "backup":
            e = ts.Cache.WriteBackDoneEvent(); e.op_id = op
        elif kind in ("snapshot", "restore"):
            e = ts.Cache.SnapshotDoneEvent() if kind == "snapshot" else ts.Cache.RestoreDoneEvent(); e.op_id = op
        else:
            e = ts.Cache.StorageDone(op, [int(args[2] > 0)] * abs(args[2]), True, [0] * abs(args[2]))
        advance(e)
print("no abort")
"""


@needs_tokenspeed
def test_tokenspeed_with_a_window_group_a_restored_requests_finish_aborts_the_process() -> None:
    """Finding 29 (the ``tokenspeed`` target with a window group and retraction forced, seed 106, within 600
    examples): 94 calls of one executor, shrunk from the campaign's 189 by delta debugging. Request r6 is retracted
    and restored while decoding. A ``drain_kv_events`` comes after the restore, and then r6's ``Finish`` ends the
    process in ``markKvEventBoundaryForReconcile``'s ``FatalCheck``. A window of 100, longer than every request,
    aborts the same way, so a page sliding out of the window is not needed. Each of the 94 calls is needed: without
    any one of them the trace runs on, or is refused with an error."""
    import subprocess
    import sys

    for window in ("6", "100"):
        run = subprocess.run(
            [sys.executable, "-c", TOKENSPEED_RETRACTED_WINDOW_ABORT, window], capture_output=True, text=True
        )
        assert run.returncode == -6, (run.returncode, run.stderr[-3000:])  # SIGABRT
        assert "cache mutation on a KV event boundary with no token descriptor" in run.stdout + run.stderr
        calls = [line for line in run.stdout.splitlines() if line[:1].isdigit()]  # beside the wheel's own log
        assert calls[-1] == "93 finish r6", run.stdout[-500:]


TOKENSPEED_STATE_UNPUBLISHED = """import json, os, sys

os.environ.setdefault("SPDLOG_LEVEL", "warn")
import tokenspeed_scheduler as ts

STATE = sys.argv[1] == "state"
config = ts.SchedulerConfig()
config.prefix_granularity = 4
config.max_scheduled_tokens = 64
config.max_batch_size = 2
config.num_device_pages = 17  # 16 pages and the null page
config.num_host_pages = 8
config.num_snapshot_pages = 1  # no retraction
config.enable_kv_cache_events = True
config.cache_groups = [ts.CacheGroupConfig("full", 4, 17, ts.AttnKind.Full)]
if STATE:  # a recurrent state group beside it (a linear-attention or Mamba layer's states)
    config.cache_groups = [*config.cache_groups, ts.CacheGroupConfig("state", 0, 17, ts.AttnKind.State)]
s = ts.Scheduler(config)
def advance(event):
    s.advance(ts.ExecutionEvent().add_event(event))
def submit(rid, tokens):
    r = ts.RequestSpec(); r.request_id, r.tokens, r.max_new_tokens = rid, tokens, 1; s.submit_requests([r])
events, hits = [], {}
def run(rid):
    # plan until rid has sampled its token, then finish it; each backup done at once
    for _ in range(4):
        plan = s.next_execution_plan()
        for op in plan.cache:
            for op_id in op.op_ids:
                e = ts.Cache.WriteBackDoneEvent(); e.op_id = op_id; advance(e)
        for batch in plan.forward:
            for i, name in enumerate(batch.request_ids):
                hits.setdefault(name, batch.extend_prefix_lens[i])
                e = ts.ForwardEvent.ExtendResult(); e.request_id, e.tokens = name, [100]; advance(e)
                e = ts.ForwardEvent.Finish(); e.request_id = name; advance(e)
        for event in s.drain_kv_events():
            if event.kind == "BlockStored":
                events.append([event.kind, len(event.block_hashes), event.parent_block_hash is not None,
                               list(event.token_ids)])
            else:
                events.append([event.kind])
submit("A", list(range(1, 14)))
run("A")
submit("B", list(range(1, 14)) + [7])
run("B")
print(json.dumps({"events": events, "B_hit": hits["B"]}))
"""


@needs_tokenspeed
def test_tokenspeed_with_a_state_group_only_state_checkpoints_are_published_under_parents_never_stored() -> None:
    """Finding 30 (the ``tokenspeed`` target with a state group, seed 3, in its first second): a 13-token prompt on
    pages of 4 with a recurrent state group beside the full one. The events publish one block, the 1-token tail
    ``[13]`` where the state is cached, with a parent; pages ``[1..4]``, ``[5..8]``, ``[9..12]`` are never
    published, though the next request hits all 13 tokens through them. Without the state group every page is
    published, the first with no parent."""
    seen = {groups: run_script(TOKENSPEED_STATE_UNPUBLISHED, groups) for groups in ("state", "full")}
    assert seen["state"]["B_hit"] == seen["full"]["B_hit"] == 13
    stored = [(parent, tokens) for _, _, parent, tokens in seen["state"]["events"]]
    assert stored == [(True, [13]), (True, [13, 7])]  # two tails, under parents never stored
    stored = [(parent, tokens) for _, _, parent, tokens in seen["full"]["events"]]
    assert stored[:3] == [(False, [1, 2, 3, 4]), (True, [5, 6, 7, 8]), (True, [9, 10, 11, 12])]


TOKENSPEED_STATE_OVERLAP = """import json, os, sys
os.environ.setdefault("SPDLOG_LEVEL", "warn")
import tokenspeed_scheduler as ts

OVERLAP = int(sys.argv[1])
P = 4
config = ts.SchedulerConfig()
config.prefix_granularity = P
config.max_scheduled_tokens = 64
config.max_batch_size = 2
config.num_device_pages = 17  # 16 pages and the null page (pages of 4)
config.num_host_pages = 8
config.num_snapshot_pages = 1  # no retraction
config.overlap_schedule_depth = OVERLAP
config.cache_groups = [ts.CacheGroupConfig("full", P, 17, ts.AttnKind.Full),
                       ts.CacheGroupConfig("state", 0, 17, ts.AttnKind.State)]
s = ts.Scheduler(config)
def advance(event):
    s.advance(ts.ExecutionEvent().add_event(event))
# the executor and the model: each state slot holds the tokens its state took in (the pass reads the slot the plan
# names, 0: its destination, in place, and writes the state after its tokens to the destination)
tokens, wanted, slots, reads = {}, {}, {}, []
def submit(rid, prompt, n):
    r = ts.RequestSpec(); r.request_id, r.tokens, r.max_new_tokens = rid, prompt, n; s.submit_requests([r])
    tokens[rid], wanted[rid] = list(prompt), n
def forward():
    plan = s.next_execution_plan()
    for slot in plan.pages_to_zero.get("state", []):
        slots[slot] = []
    for src, dst in plan.pages_to_copy.get("state", []):
        slots[dst] = slots.get(src)
    results = []
    for batch in plan.forward:
        for i, rid in enumerate(batch.request_ids):
            src, dst = map(int, batch.block_tables["state"][i])
            prefill = i < batch.num_extends()
            start = batch.extend_prefix_lens[i] if prefill else len(tokens[rid]) - 1
            count = batch.input_lengths[i]
            reads.append([rid, "prefill" if prefill else "decode", start, src or dst, slots.get(src or dst)])
            slots[dst] = tokens[rid][: start + count]
            if (not prefill or start + count >= batch.prefill_lengths[i]) and wanted[rid]:
                wanted[rid] -= 1
                tokens[rid].append(100 + len(tokens[rid]))  # the sampled token
                results.append((rid, [tokens[rid][-1]], not wanted[rid]))
            else:  # a chunk that is not the last, or a row planned before its request's finish
                results.append((rid, [], False))
    return results
def report(results):  # each result, then a finish after a request's last token
    for rid, sampled, last in results:
        e = ts.ForwardEvent.ExtendResult(); e.request_id, e.tokens = rid, sampled; advance(e)
        if last:
            e = ts.ForwardEvent.Finish(); e.request_id = rid; advance(e)
def serve(rounds):
    late = []
    for _ in range(rounds):
        results = forward()
        report(late if OVERLAP else results)  # overlap: a forward's results once the next one is launched
        late = results
    report(late)
submit("A", list(range(1, 8)), 2)  # samples 107, then 108
serve(5)
submit("B", list(range(1, 8)) + [107], 2)  # A's prompt and its first sampled token: 8 tokens, two pages
serve(3)
print(json.dumps({"A": tokens["A"], "reads": reads}))
"""


@needs_tokenspeed
def test_tokenspeed_with_overlap_a_finished_requests_cached_state_is_updated_by_its_last_decode() -> None:
    """Finding 31 (the ``tokenspeed`` target with a state group, seed 3: four failing examples in 40 s, the first
    in 1 s, all with overlap scheduling): pages of 4; A (``[1..7]``, two tokens to sample) decodes position 7 into
    state slot 7; its finish, reported while the decode of position 8 planned before it is in flight, caches slot 7
    as the state after its first 8 tokens (two pages); that decode then updates slot 7 in place. B (A's prompt and
    first sampled token, 8 tokens) decodes position 8 from slot 7, which holds the state after 9 tokens: one ahead.
    Without overlap B reads the state after its 8."""
    seen = {overlap: run_script(TOKENSPEED_STATE_OVERLAP, overlap) for overlap in ("1", "0")}
    a8, a9 = [*range(1, 8), 107], [*range(1, 8), 107, 108]
    assert ["A", "decode", 8, 7, a8] in seen["1"]["reads"]  # A's last decode, planned before its finish, in place
    assert ["B", "decode", 8, 7, a9] in seen["1"]["reads"]
    assert ["B", "decode", 8, 7, a8] in seen["0"]["reads"]


@needs_tokenspeed
def test_tokenspeed_a_restored_request_stores_its_next_block_under_a_parent_the_events_removed() -> None:
    """Finding 19 (the ``tokenspeed`` target's planner machine, ``events_replay_to_the_cache``, within seconds of a
    campaign with retraction on): a decoding request is retracted (its pages to the snapshot pool) and restored
    into other pages; at the restore the KV events remove its last two blocks (their pages were evicted to make
    room), and never store the restored copies again. At the next retraction the events store its next block,
    whose parent is one of the removed ones: a consumer of the events (a router's index) holds no such parent."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", TOKENSPEED_ORPHAN_AFTER_RESTORE], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == [
        "WriteBackOp",
        "SnapshotOp",
        "RestoreOp",
        ["removed", [4, 6, 4, 4, 3, 104]],
        ["removed", [4, 6, 4, 4, 3]],
        "SnapshotOp",
        ["orphan", [106]],
    ]


TOKENSPEED_CLEAR_WITH_A_FORWARD_IN_FLIGHT = """import json
import tokenspeed_scheduler as ts

config = ts.SchedulerConfig()
config.prefix_granularity = 16
config.max_scheduled_tokens = 8
config.max_batch_size = 4
config.num_device_pages = 17
config.num_host_pages = 67
config.num_snapshot_pages = 1
config.overlap_schedule_depth = 1  # overlap scheduling: the next plan is made before the last forward's results land
config.enable_kv_cache_events = True
config.cache_groups = [ts.CacheGroupConfig("full", 16, 17, ts.AttnKind.Full)]
s = ts.Scheduler(config)
def advance(event):
    s.advance(ts.ExecutionEvent().add_event(event))
def result(rid, tokens):
    e = ts.ForwardEvent.ExtendResult(); e.request_id, e.tokens = rid, tokens; advance(e)
def spec(rid, tokens, n):
    r = ts.RequestSpec(); r.request_id, r.tokens, r.max_new_tokens = rid, tokens, n; return r
def run_plan():
    plan = s.next_execution_plan()
    for op in plan.cache:  # every backup done at once
        for op_id in op.op_ids:
            e = ts.Cache.WriteBackDoneEvent(); e.op_id = op_id; advance(e)
    return [(list(b.request_ids), list(b.extend_prefix_lens)) for b in plan.forward if list(b.request_ids)]

seen = []
s.submit_requests([spec("a", [7, 7], 2)])
seen.append(run_plan())                      # a's prefill
seen.append(run_plan()); result("a", [101])  # a's first decode planned; the prefill's token lands
seen.append(run_plan()); result("a", [102])  # a's second decode planned; the first decode's token lands: a is done
finish = ts.ForwardEvent.Finish(); finish.request_id = "a"; advance(finish)
seen.append([s.can_clear_cache(), s.clear_cache()])
s.drain_kv_events()
seen.append(run_plan()); result("a", [])     # the second decode, planned before the finish, lands
seen.append([(e.kind, list(e.token_ids)) for e in s.drain_kv_events()])
s.submit_requests([spec("b", [7, 7, 101, 102], 1)])
seen.append(run_plan())                      # b hits KV computed before the clear
print(json.dumps(seen))
"""


@needs_tokenspeed
def test_tokenspeed_clears_its_cache_with_a_forward_in_flight_which_then_caches_kv_from_before_the_clear() -> None:
    """Finding 21 (the ``tokenspeed`` target's planner machine, ``reset_leaves_no_tier_serving``, in a campaign
    with overlap scheduling): a request finishes while the decode planned after its last token is still in flight;
    ``can_clear_cache()`` says yes and ``clear_cache()`` clears; when the in-flight row's result lands, the
    finished request's pages are cached into the cleared cache (a ``BlockStored`` after the clear), and the next
    request with that prefix hits KV computed before the clear (after a weight update, KV of the old weights)."""
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", TOKENSPEED_CLEAR_WITH_A_FORWARD_IN_FLIGHT], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == [
        [[["a"], [0]]],
        [[["a"], []]],
        [[["a"], []]],
        [True, True],
        [],
        [["BlockStored", [7, 7, 101]]],
        [[["b"], [3]]],
    ]


TOKENSPEED_TAIL_HASH_ASSERT = """import tokenspeed_scheduler as ts

config = ts.SchedulerConfig()
config.prefix_granularity = 4
config.max_scheduled_tokens = 16
config.max_batch_size = 2
config.num_device_pages = 9  # 8 pages and the null page
config.num_host_pages = 17
config.enable_mixed_prefill_decode = True
config.num_snapshot_pages = 9  # retraction enabled (none happens before the assertion)
config.max_retracted_requests = 2
config.enable_kv_cache_events = True
config.cache_groups = [ts.CacheGroupConfig("full", 4, 9, ts.AttnKind.Full)]
config.enable_l3_storage = True
config.storage_config = ts.StorageConfig(4, 16, 8, 64, 64, 1, 10**6, 10**6, ts.StoragePressure(8, 1 << 30, 10**7),
                                         ts.StoragePressure(2, 1 << 20, 10**6))
s = ts.Scheduler(config)
def advance(event):
    s.advance(ts.ExecutionEvent().add_event(event))
def spec(rid, tokens):
    r = ts.RequestSpec(); r.request_id, r.tokens, r.max_new_tokens = rid, tokens, 0; return r  # budget undeclared
for rid, tokens in (("r1", [1, 1, 1, 2] + [1] * 13), ("r2", [7, 7]), ("r3", [7, 7]), ("r4", [7, 7]), ("r5", [1] * 11)):
    s.submit_requests([spec(rid, tokens)])
sampled = 200
for step in range(3):
    advance(ts.Cache.StorageTick(1000 * (step + 1), True, True, ts.StoragePressure(0, 0, 0)))
    try:
        plan = s.next_execution_plan()
    except RuntimeError as crash:
        print(f"plan {step}: {crash}")
        break
    for op in plan.cache:  # the executor: storage holds nothing, every backup done at once
        if type(op).__name__ == "WriteBackOp":
            for op_id in op.op_ids:
                e = ts.Cache.WriteBackDoneEvent(); e.op_id = op_id; advance(e)
        elif type(op).__name__ != "StorageCancelOp":
            advance(ts.Cache.StorageDone(op.op_id, [0] * len(op.keys), True, [0] * len(op.keys)))
    for batch in plan.forward:
        for row, rid in enumerate(batch.request_ids):
            result = ts.ForwardEvent.ExtendResult(); result.request_id = rid
            prefill = row < batch.num_extends()
            ends = not prefill or batch.extend_prefix_lens[row] + batch.input_lengths[row] >= batch.prefill_lengths[row]
            sampled += 1
            result.tokens = [sampled] if ends else []  # no token for a prefill chunk that is not the last
            advance(result)
    s.drain_kv_events()
"""


@needs_tokenspeed
def test_tokenspeed_planning_fails_its_assertion_on_a_tail_pages_kv_event_hash() -> None:
    """Finding 20 (the ``tokenspeed`` target's planner machine, within seconds of campaigns with retraction on):
    five requests with undeclared budgets on 8 pages of 4 tokens, retraction enabled, mixed batches, storage on;
    the second plan runs a 15-token chunk of a 17-token prompt beside a decode whose prompt page was backed up;
    the third ``next_execution_plan`` raises from TokenSpeed's own ``_assert`` in
    ``Scheduler::registerKvEventPublication``: the scheduler cannot plan any more."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", TOKENSPEED_TAIL_HASH_ASSERT], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "plan 2: the tail's parent page has its KV event hash" in run.stdout, run.stdout[-2000:]
