"""The ``vllm`` target's dense model: one full-attention group through the request lifecycle (vLLM's unitary
coordinator behind KVCacheManager's calls), EAGLE off, dropping or hashing ahead, as most deployments run it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .campaigns import assert_caught, assert_clean, edit

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def test_the_vllm_target_runs_the_block_pool_and_a_dense_models_requests() -> None:
    from radixspec.fuzz.registry import machines_for
    from radixspec.fuzz.targets import resolve

    info = resolve("vllm", check=False)
    assert machines_for(("vllm",), {"vllm": info}) == ["cache", "hybrid"]
    assert info.hybrid_factory is not None and info.cache_factory is not None


@pytest.mark.parametrize(("num_pages", "eagle", "hit"), [(3, "off", 1), (4, "drop", 0)])
def test_a_prompt_cached_whole_hits_one_block_less_with_eagles_drop(num_pages: int, eagle: str, hit: int) -> None:
    """Pages of 1, a 2-token prompt computed and cached, then the same prompt: the limit is 1 token (the last is
    recomputed). Without EAGLE the hit is 1; with the drop the unitary coordinator finds 1 block and drops it: 0.
    The hybrid coordinator looks one block past the limit first (its proof margin) and hits 1: the machine once
    judged the dense model by that rule (a harness artefact, the shrunk program below)."""
    from radixspec.fuzz.regression import build_machine

    state = build_machine("hybrid", targets=("vllm",), lru=None, device="cpu")()
    (seq,) = state.setup(page_size=1, num_pages=num_pages, windows=[None], first=[([0, 0], [])])
    assert state.managers[0].eagle == eagle and state.managers[0].windows == (None,)
    state.new_request(extra=[], namespace=None, tokens=seq)
    state.allocate_and_store(tokens=1, which=0)
    state.allocate_and_store(tokens=1, which=0)
    state.managers_keep_the_laws()
    state.new_request(extra=[], namespace=None, tokens=seq)
    assert state.reqs[1][0].cached_len == hit
    state.managers_keep_the_laws()
    state.teardown()


# vLLM's full-attention finder without EAGLE's drop: a dense model with EAGLE keeps the block the drafter must
# recompute (the class of vLLM #32802 and #42784); behind a window group, the window's drop masked it
KEEPS_THE_EAGLE_BLOCK = edit(
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.find_longest_cache_hit",
    "if drop_eagle_block and hit_length > 0:",
    "if False and drop_eagle_block and hit_length > 0:",
)


def test_the_dense_model_catches_full_attention_keeping_the_block_eagle_must_recompute(tmp_path: Path) -> None:
    assert_caught("vllm", "hit_is_the_longest_valid_match", KEEPS_THE_EAGLE_BLOCK, tmp_path, examples=200)


def test_a_campaign_of_the_vllm_target_without_a_plant_is_clean(tmp_path: Path) -> None:
    assert_clean("vllm", tmp_path, examples=200)
