"""The ``vllm-mamba`` target: vLLM 0.33.0's coordinator with full attention and a Mamba group in align mode, a
hash unit below the block. A lifecycle pins the scheduler's chunk split, a hit inside a block (the tail block and
the state copied on write) and the state shadow; each check is seen catching a bug planted in vLLM's code."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from .campaigns import assert_caught, assert_clean

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def run(manager: Any, uid: int, prompt: list[int], chunk: int = 100) -> tuple[int, list[int]]:
    """One request to its end (chunks of at most ``chunk`` tokens, as the split leaves them): its hit, its chunk
    ends."""
    from radixspec.reference.hybrid_manager import HybridReq

    req = HybridReq(uid, list(prompt))
    manager.match_req(req)
    manager.check_integrity([req])
    hit, ends = req.computed, []
    while req.computed < len(prompt):
        manager.allocate_paged(req, min(len(prompt), req.computed + chunk))
        manager.store(req, chunk)
        manager.check_integrity([req])
        ends.append(req.computed)
    manager.cache_req(req, finished=True)
    manager.check_integrity([])
    return hit, ends


def test_a_resend_hits_inside_a_block_and_copies_the_tail_and_the_state() -> None:
    from radixspec.fuzz.targets.vllm_hybrid import VllmHybridManager
    from radixspec.fuzz.targets.vllm_mamba import MambaGroup

    manager = VllmHybridManager(8, (None,), 64, unit=2, mamba=MambaGroup(checkpoints=False))
    assert manager.partial_hits and manager.rule.unit == 2
    prompt = list(range(100, 130))  # 30 tokens, blocks of 8, hashes every 2
    # the split: the last block boundary before the prompt's end (24), the prompt's last hash boundary (28)
    assert run(manager, 0, prompt) == (0, [24, 28, 30])
    # the resend hits the partial entry at 28 in both groups: block 3's first 4 tokens and the state, copied
    copies = manager.pool.get_num_free_blocks()
    assert run(manager, 1, prompt) == (28, [30])
    assert manager.pool.get_num_free_blocks() == copies
    # a sibling sharing 27 tokens: no state at 26, the hit falls back to the block boundary's (24)
    assert run(manager, 2, [*prompt[:27], 1, 2, 3]) == (24, [28, 30])


def test_a_cached_state_overwritten_after_the_check_found_it_is_read_again() -> None:
    """The check skips a cached Mamba block it found holding its entry's state while that state is not written
    again; one written since is read again."""
    from radixspec.fuzz.targets.vllm_hybrid import VllmHybridManager
    from radixspec.fuzz.targets.vllm_mamba import MambaGroup
    from radixspec.spec.errors import IntegrityError

    manager = VllmHybridManager(8, (None,), 64, unit=8, mamba=MambaGroup(checkpoints=False))
    run(manager, 0, list(range(100, 130)))
    mamba = manager.mamba
    assert mamba is not None and mamba.verified, "the check found no cached state"
    block = next(iter(mamba.verified))
    namespace, tokens = mamba.state.get(block) or (None, ())
    mamba.check(manager, [])  # skipped: nothing written since
    mamba.state.write(block, namespace, tokens[:-1])
    with pytest.raises(IntegrityError, match="cached_states_are_their_prefix: the cache"):
        mamba.check(manager, [])


def test_a_window_group_turns_hits_inside_a_block_off() -> None:
    from radixspec.fuzz.targets.vllm_hybrid import VllmHybridManager
    from radixspec.fuzz.targets.vllm_mamba import MambaGroup

    manager = VllmHybridManager(8, (None, 5), 64, unit=2, mamba=MambaGroup(checkpoints=False))
    assert manager.windows == (None, 5, "state") and not manager.partial_hits and manager.rule.unit == 8
    prompt = list(range(100, 130))
    assert run(manager, 0, prompt) == (0, [24, 30])
    assert run(manager, 1, prompt) == (24, [30])


# bugs planted in vLLM's code, each in a path only this target reaches: (the law that catches it, the plant)
PLANTS = {
    # a partial entry is keyed one hash unit short of the state its block holds
    "partial_short": (
        "cached_states_are_their_prefix",
        """
bp = importlib.import_module("vllm.v1.core.block_pool")
partial = bp.BlockPool.cache_partial_block
def short(self, request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes=False):
    if num_tokens > self.hash_block_size and kv_cache_group_id == 1:  # the Mamba group beside full attention
        num_tokens -= self.hash_block_size
    return partial(self, request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes)
bp.BlockPool.cache_partial_block = short
""",
    ),
    # a hit inside a block hands the request a fresh Mamba block, the state never copied into it
    "state_not_copied": (
        "state_resumes_from_its_prefix",
        """
st = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
apply = st.SingleTypeKVCacheManager._apply_cow
def uncopied(self, request_id, block_idx, source_block, cow_block):
    apply(self, request_id, block_idx, source_block, cow_block)
    if isinstance(self, st.MambaManager):
        source, cow = self._pending_cow_copies.pop()
        self.block_pool.free_blocks([source, cow])
st.SingleTypeKVCacheManager._apply_cow = uncopied
""",
    ),
    # the Mamba group's lookup ignores the entries inside blocks: hits fall back to block boundaries
    "no_fine_lookup": (
        "hit_is_the_longest_valid_match",
        """
st = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
find = st.MambaManager.find_longest_cache_hit.__func__
def coarse(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
           alignment_tokens, dcp_world_size=1, pcp_world_size=1):
    blocks, hit = find(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                       drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size)
    if hit % kv_cache_spec.block_size:
        return tuple([] for _ in blocks), 0
    return blocks, hit
st.MambaManager.find_longest_cache_hit = classmethod(coarse)
""",
    ),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_check_catches_its_planted_bug(plant: str, tmp_path: Path) -> None:
    law, code = PLANTS[plant]
    assert_caught("vllm-mamba", law, code, tmp_path, examples=300)


def test_a_campaign_without_a_plant_is_clean(tmp_path: Path) -> None:
    assert_clean("vllm-mamba", tmp_path, examples=300)


@pytest.mark.parametrize("eagle", ["off", "drop", "lookahead"])
def test_the_split_and_the_checkpoints_follow_each_eagle_mode(eagle: str) -> None:
    """Each mode reaches vLLM's checkpoint rule with its own arguments (0.32.0 takes no lookahead tokens: the
    campaign on it raised TypeError before), and a resend still hits."""
    from radixspec.fuzz.targets.vllm_hybrid import VllmHybridManager
    from radixspec.fuzz.targets.vllm_mamba import MambaGroup

    manager = VllmHybridManager(8, (None,), 64, eagle=eagle, unit=2, mamba=MambaGroup(checkpoints=True))
    prompt = list(range(100, 130))
    assert run(manager, 0, prompt)[0] == 0
    assert run(manager, 1, prompt)[0] > 0


@pytest.mark.parametrize("counted", ["counted", "uncounted"])
def test_finding_32_a_partial_hit_then_an_internal_checkpoint_caches_a_block_under_a_state_it_does_not_hold(
    counted: str,
) -> None:
    """Finding 32 (docs/findings.md; standalone: ``VLLM_MAMBA_PARTIAL_HIT_CHECKPOINT``). Pages of
    8, hash unit 2, partial hits, prefill checkpoints, EAGLE's drop. Request 0 (41 tokens) is served and cached;
    request 3 continues its 42 tokens with 12 more and hits 38 (inside the block of [32, 40)): the copy on write
    puts the 38-token state in a fresh block at index 4, and the scheduler's split runs [38, 54) as one chunk (an
    internal checkpoint at 52 lifts the stop at the block boundary). Nothing writes the state at 40, yet the manager
    caches that block under the 40-token hash: a later hit of 40 tokens would resume from the state of 38. The
    target counts it (``counted``); uncounted, ``cached_states_are_their_prefix`` names it."""
    from radixspec.fuzz.regression import build_machine
    from radixspec.fuzz.stats import STATS
    from radixspec.fuzz.targets.vllm_mamba import FINDING_32
    from radixspec.spec.errors import IntegrityError

    state = build_machine("hybrid", targets=("vllm-mamba",), lru=None, device="cpu")()
    state.setup(page_size=8, num_pages=30, first=[([], [])], windows=[None])
    manager = state.managers[0]
    manager.mamba.known_partial_checkpoint = counted == "counted"
    assert (manager.unit, manager.partial_hits, manager.mamba.checkpoints, manager.eagle) == (2, True, True, "drop")
    state.workload_request(kind="multi-turn", pages=1, pick=0)
    state.workload_request(kind="system prompt", pages=1, pick=0)
    state.workload_request(kind="system prompt", pages=1, pick=0)
    state.serve_running(answer=0, which=0)
    state.managers_keep_the_laws()
    state.workload_request(kind="multi-turn", pages=2, pick=0)
    assert state.reqs[3][0].cached_len == 38
    if counted == "counted":
        before = STATS.rules[f"vllm-mamba.known: {FINDING_32}"]
        state.serve_running(answer=0, which=20)
        state.managers_keep_the_laws()
        assert STATS.rules[f"vllm-mamba.known: {FINDING_32}"] == before + 1
        return
    with pytest.raises(IntegrityError, match=r"cached_states_are_their_prefix: .* the state of 38 tokens, not .* 40"):
        state.serve_running(answer=0, which=20)
        state.managers_keep_the_laws()


@pytest.mark.parametrize("counted", ["counted", "uncounted"])
def test_finding_33_a_gateways_hit_inside_the_prompts_last_block_raises_index_error_in_vllm(counted: str) -> None:
    """Finding 33's crash (vllm#57358): pages of 8, hash unit 2, a 30-token prompt served, then sent again by a
    gateway (``kv_cache_report_mode`` "full": request uid % REANNOUNCED == REANNOUNCED - 1). Its hit, 28 tokens, ends
    inside block 3, the block the prompt ends in, which has no whole hash: vLLM's re-announcement indexes past the
    request's block hashes. Counted, the match goes on with the hit; uncounted, the IndexError reaches the caller."""
    from radixspec.fuzz.stats import STATS
    from radixspec.fuzz.targets.vllm_hybrid import FINDING_33, REANNOUNCED, VllmHybridManager
    from radixspec.fuzz.targets.vllm_mamba import MambaGroup
    from radixspec.reference.hybrid_manager import HybridReq

    manager = VllmHybridManager(8, (None,), 64, unit=2, mamba=MambaGroup(checkpoints=False))
    assert manager.replay is not None and manager.partial_hits
    manager.replay.known_reannounced = counted == "counted"
    prompt = list(range(100, 130))
    assert run(manager, 0, prompt) == (0, [24, 28, 30])
    known = f"vllm-hybrid.known: {FINDING_33}: IndexError (vllm#57358)"
    before = STATS.rules[known]
    req = HybridReq(REANNOUNCED - 1, list(prompt))
    if counted == "uncounted":
        with pytest.raises(IndexError):
            manager.match_req(req)
        return
    manager.match_req(req)
    manager.check_integrity([req])
    assert req.cached_len == 28 and STATS.rules[known] == before + 1
