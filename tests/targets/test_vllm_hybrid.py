"""The ``vllm-hybrid`` target as vLLM 0.33.0 is configured today: two to four groups (several windows, several
full-attention groups), sparse retention of the window groups' checkpoints (vLLM's default), the scheduler's
deferred frees and the KV events. A lifecycle pins what each does; each new check is seen catching a bug
planted by monkeypatch in the path it guards."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from .campaigns import assert_caught, assert_clean

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def run_prompts(
    prompts: list[list[int]], retention: int | None, windows: tuple[int | None, ...] = (None, 8)
) -> tuple[list[int], Any]:
    """Requests one after another (P = 4), each run to its end and freed; their hits and the manager."""
    from radixspec.fuzz.targets.vllm_hybrid import VllmHybridManager
    from radixspec.reference.hybrid_manager import HybridReq

    manager = VllmHybridManager(4, windows, 64, retention=retention)
    hits = []
    for uid, prompt in enumerate(prompts):
        req = HybridReq(uid, list(prompt))
        manager.match_req(req)
        hits.append(req.cached_len)
        manager.allocate_paged(req, len(prompt))
        manager.store(req, len(prompt) - req.computed)
        manager.check_integrity([req])
        manager.cache_req(req, finished=True)
    manager.check_integrity([])
    return hits, manager


def window_blocks(manager: Any) -> int:
    """Blocks the pool caches for group 1."""
    keys = [block.block_hash for block in manager.pool.blocks[1:] if block.block_hash is not None]
    return sum(1 for key in keys if manager.utils.get_group_id(key) == 1)


def test_sparse_retention_keeps_the_replay_boundary_and_the_junction() -> None:
    prompt = list(range(100, 122))
    sibling = prompt[:14] + [7] * 8
    # dense: every window block is cached, the resend hits 20 and the sibling its shared 12
    assert run_prompts([prompt, prompt, sibling], None)[0] == [0, 20, 12]
    # vLLM's default (0): the window group keeps only the tail of the replay boundary (21 -> 20: pages 3, 4),
    # so the resend hits 20 and the sibling, sharing 14 tokens, misses. Its full-attention hit (12) is longer
    # than the reconciled one (0), which pins the junction: it keeps pages 1 and 2 too, and a request sharing
    # 13 tokens with it hits 12; with neither kept (the junction not pinned), it would miss
    hits, manager = run_prompts([prompt, prompt, sibling, sibling[:13] + [5] * 9], 0)
    assert hits == [0, 20, 0, 12]
    # the window blocks: the prompt's pages 3, 4; the sibling's 1 to 4; the last request's boundary pages 3, 4
    assert window_blocks(manager) == 8


def test_groups_of_one_window_and_of_two_windows_hit_where_every_group_can() -> None:
    prompt = list(range(100, 134))
    # a window of 5 (one page before a hit) and of 13 (three pages): the longest hit valid for both
    hits, manager = run_prompts([prompt, [*prompt[:30], 1, 2, 3, 4]], None, (None, 5, 13, None))
    assert hits == [0, 28] and len(manager.coordinator.single_type_managers) == 4


def test_deferred_frees_hold_a_finished_requests_blocks_until_the_step_completes() -> None:
    from radixspec.fuzz.targets.vllm_hybrid import VllmHybridManager
    from radixspec.reference.hybrid_manager import HybridReq

    manager = VllmHybridManager(4, (None, 8), 16, defer_free=True)
    a, b = HybridReq(0, list(range(100, 110))), HybridReq(1, list(range(200, 203)))
    for req in (a, b):
        manager.match_req(req)
        manager.allocate_paged(req, len(req.input_ids))
        manager.store(req, len(req.input_ids))
    free = manager.pool.get_num_free_blocks()
    manager.cache_req(a, finished=True)
    manager.check_integrity([b])
    # a's blocks wait (the step in flight may still write them), and a prefix of a still hits them
    assert manager.pool.get_num_free_blocks() == free and len(manager.deferred) == 1
    b.input_ids.append(7)  # b decodes a token: the next step
    manager.allocate_paged(b, 4)
    manager.store(b, 1)
    manager.check_integrity([b])
    assert manager.deferred == [] and manager.pool.get_num_free_blocks() > free


# bugs planted in vLLM's code, each in a path the new configurations reach: (the law that catches it, the plant)
PLANTS = {
    # the pool forgets to announce every other removal of a window group's block
    "lost_removals": (
        "events_replay_to_the_pool",
        """
bp = importlib.import_module("vllm.v1.core.block_pool")
emit, calls = bp.BlockPool._emit_block_removed_events, [0]
def forgetful(self, hashes):
    calls[0] += 1
    kept = [h for h in hashes if calls[0] % 2 or bp.get_group_id(h) == 0]
    return emit(self, kept)
bp.BlockPool._emit_block_removed_events = forgetful
""",
    ),
    # a deferred free gives back all of a request's blocks but its last one
    "deferred_leak": (
        "pool_counts_its_holders",
        """
st = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
pop = st.SingleTypeKVCacheManager.pop_blocks_for_free
def short(self, request_id):
    blocks = pop(self, request_id)
    return blocks[:-1] if len(blocks) > 2 else blocks
st.SingleTypeKVCacheManager.pop_blocks_for_free = short
""",
    ),
    # sparse retention keys a retained window block's hash on the block before it: the stored event names
    # the block the pool does not cache it on
    "retention_shift": (
        "events_replay_to_the_pool",
        """
bp = importlib.import_module("vllm.v1.core.block_pool")
cache = bp.BlockPool.cache_full_blocks
def shifted(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
            block_mask=None):
    if block_mask is not None and not all(block_mask):
        blocks = list(blocks)
        for i, keep in enumerate(block_mask):
            j = num_cached_blocks + i
            if keep and j > 0 and not blocks[j - 1].is_null and blocks[j - 1].block_hash is None:
                blocks[j] = blocks[j - 1]
    return cache(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                 block_mask)
bp.BlockPool.cache_full_blocks = shifted
""",
    ),
}

# the pool hands out every fifth cached block again without dropping its hash (vLLM #44237's class): the block is
# rewritten while the hash still names the old prefix. With the KV events on, their replay sees it first; off (a
# deployment without events), the KV shadow of the cached blocks does
PLANTS["stale_hash"] = (
    "cached_blocks_hold_their_prefix",
    """
sys.modules["vllm.__radixspec__"].kv_events = None
bp = importlib.import_module("vllm.v1.core.block_pool")
evict, calls = bp.BlockPool._maybe_evict_cached_block, [0]
def sticky(self, block):
    if block.block_hash is not None:
        calls[0] += 1
        if calls[0] % 5 == 0:
            return False
    return evict(self, block)
bp.BlockPool._maybe_evict_cached_block = sticky
""",
)

# vLLM's pool raising where the driver checked the free blocks first: a crash, never taken for a refusal (before,
# any exception of a foreign target's was one, and a TypeError inside vLLM went by unseen)
PLANTS["crash"] = (
    "raised builtins.ValueError",
    """
bp = importlib.import_module("vllm.v1.core.block_pool")
get, calls = bp.BlockPool.get_new_blocks, [0]
def failing(self, num_blocks):
    calls[0] += 1
    if calls[0] % 50 == 0:
        raise ValueError("the pool failed")
    return get(self, num_blocks)
bp.BlockPool.get_new_blocks = failing
""",
)


# the prefix hasher ignores a request's images: two images at one place share blocks (events off: the KV shadow
# names it; with events on, the replay does first)
PLANTS["images_ignored"] = (
    "cached_blocks_hold_their_prefix",
    """
ku = importlib.import_module("vllm.v1.core.kv_cache_utils")
make = ku.get_request_block_hasher
def blind(*args):
    hasher = make(*args)
    def without_images(request):
        features, request.mm_features = request.mm_features, []
        try:
            return hasher(request)
        finally:
            request.mm_features = features
    return without_images
ku.get_request_block_hasher = blind
from radixspec.fuzz.targets.vllm_hybrid import import_hybrid
import_hybrid().kv_events = None
""",
)
# the prefix hasher ignores a request's LoRA adapter (events off): two tenants' adapters share blocks
PLANTS["lora_ignored"] = (
    "attended_kv_is_the_requests",
    """
ku = importlib.import_module("vllm.v1.core.kv_cache_utils")
ku._gen_lora_extra_hash_keys = lambda request: []
from radixspec.fuzz.targets.vllm_hybrid import import_hybrid
import_hybrid().kv_events = None
""",
)
# the events name no image: a router cannot tell two images' blocks apart by their tokens
PLANTS["events_without_images"] = (
    "events_replay_to_the_cache",
    """
bp = importlib.import_module("vllm.v1.core.block_pool")
keys = bp.to_event_extra_keys
bp.to_event_extra_keys = lambda extra: keys([tuple(k for k in b if k[0] != "mm") if b else b for b in extra or []])
""",
)


def test_an_image_is_told_by_its_feature_not_its_placeholder_tokens() -> None:
    """Images (fuzz/workloads.py: image k's placeholders are IMAGE_TOKEN + k) reach vLLM as its prompts hold them:
    one placeholder id, the image a multimodal feature. Two prompts with one text and another image at one place
    (inside block 1) share block 0 only; the first prompt again hits its whole blocks."""
    from radixspec.fuzz.targets.vllm_hybrid import PLACEHOLDER, HybridRequest
    from radixspec.fuzz.workloads import IMAGE_TOKEN

    text = [1, 2, 3, 4, 5, 6]
    first, second = (text + [IMAGE_TOKEN + image] * 5 + [7, 8, 9] for image in (0, 1))
    hits, manager = run_prompts([first, second, first], retention=None)
    assert hits == [0, 4, 12]
    request = HybridRequest(first, None, 9, manager.hasher)
    assert request.all_token_ids == text + [PLACEHOLDER] * 5 + [7, 8, 9] and request.tokens == first
    assert [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in request.mm_features] == [
        ("image-0", 6, 5)
    ]


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_check_catches_its_planted_bug(plant: str, tmp_path: Path) -> None:
    law, code = PLANTS[plant]
    assert_caught("vllm-hybrid", law, code, tmp_path, examples=400)


def test_a_campaign_without_a_plant_is_clean(tmp_path: Path) -> None:
    assert_clean("vllm-hybrid", tmp_path, examples=400)


@pytest.mark.parametrize(
    ("groups", "counted"), [("window", "counted"), ("window", "uncounted"), ("dense", "uncounted")]
)
def test_finding_33_a_hit_reannounced_names_the_window_blocks_it_skipped(groups: str, counted: str) -> None:
    """Finding 33 (docs/findings.md; standalone: ``VLLM_REANNOUNCED_NULL_BLOCKS``). P = 4, W = 5, vLLM's default
    retention: three requests of one 22-token prompt are served; the fourth is a gateway's (kv_cache_report_mode
    "full") and hits 20 tokens, its window blocks 0-3 null. vLLM re-announces hashes 0-4 for the window group, which
    caches only block 4: the target counts the four (``counted``); uncounted, ``reannounced_blocks_are_cached``
    names block 0 of the window group. A dense model's re-announcement names only what its group caches."""
    from radixspec.fuzz.stats import STATS
    from radixspec.fuzz.targets.vllm_hybrid import FINDING_33, REANNOUNCED, VllmDenseManager, VllmHybridManager
    from radixspec.reference.hybrid_manager import HybridReq
    from radixspec.spec.errors import IntegrityError

    make = VllmHybridManager if groups == "window" else VllmDenseManager
    manager = make(4, (None, 5), 32, retention=0)
    assert manager.replay is not None
    manager.replay.known_reannounced = counted == "counted"
    prompt = list(range(100, 122))
    for uid in range(REANNOUNCED - 1):
        req = HybridReq(uid, list(prompt))
        manager.match_req(req)
        manager.allocate_paged(req, len(prompt))
        manager.store(req, len(prompt) - req.computed)
        manager.cache_req(req, finished=True)
    known, announced = f"vllm-hybrid.known: {FINDING_33}", "vllm-hybrid.events[a hit re-announced]"
    before = (STATS.rules[known], STATS.rules[announced])
    req = HybridReq(REANNOUNCED - 1, list(prompt))
    if groups == "window" and counted == "uncounted":
        with pytest.raises(
            IntegrityError, match="reannounced_blocks_are_cached: request 3's hit re-announces block 0 of group 1"
        ):
            manager.match_req(req)
        return
    manager.match_req(req)
    manager.check_integrity([req])
    found = 4 if groups == "window" else 0
    assert req.cached_len == 20 and (STATS.rules[known], STATS.rules[announced]) == (before[0] + found, before[1] + 1)


def test_a_lora_namespace_reaches_vllm_as_an_adapter_and_any_other_as_a_salt() -> None:
    """("lora", x) is a LoRA adapter's namespace: vLLM keys its blocks by the adapter's name and path (no salt);
    another namespace is a cache salt. The same prompt under each hashes apart, and the events name the adapter."""
    from radixspec.fuzz.targets.vllm_hybrid import HybridRequest, VllmHybridManager

    manager = VllmHybridManager(4, (None,), 32)
    prompt = list(range(100, 112))
    adapter, tenant, plain = (
        HybridRequest(prompt, namespace, 0, manager.hasher) for namespace in (("lora", 1), ("tenant", "b"), None)
    )
    assert adapter.lora_request is not None and adapter.cache_salt is None
    assert (adapter.lora_request.lora_name, adapter.lora_request.lora_path) == ("adapter-1", "/adapters/1")
    assert tenant.lora_request is None and tenant.cache_salt == repr(("tenant", "b"))
    assert len({adapter.block_hashes[0], tenant.block_hashes[0], plain.block_hashes[0]}) == 3
