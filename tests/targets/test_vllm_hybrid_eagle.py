"""vLLM's hybrid coordinator under EAGLE, as the scheduler configures it: the hit of a prompt cached whole is
the hit rule's (``spec/hit_rules.py``) in each mode, and the target's check catches a rule that forgets the drop."""

from __future__ import annotations

import importlib.util

import pytest

from radixspec.spec import hit_rules as hr
from radixspec.spec.errors import IntegrityError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def second_hit(eagle: str, prompt: list[int], rule: hr.HitRule | None = None) -> int:
    """The hit of ``prompt`` after the same prompt ran to its end (full + window 8, P = 4)."""
    from radixspec.fuzz.targets.vllm_hybrid import VllmHybridManager
    from radixspec.reference.hybrid_manager import HybridReq

    manager = VllmHybridManager(4, (None, 8), 32, eagle)
    if rule is not None:
        manager.rule = rule
    hit = 0
    for uid in range(2):
        req = HybridReq(uid, list(prompt))
        manager.match_req(req)
        hit = req.cached_len
        manager.allocate_paged(req, len(prompt))
        manager.store(req, len(prompt) - req.computed)
        manager.check_integrity([req])
        manager.cache_req(req, finished=True)
    return hit


@pytest.mark.parametrize(("n", "off", "drop"), [(18, 16, 12), (17, 16, 12), (16, 12, 12), (13, 12, 8)])
def test_eagle_drop_finds_one_block_more_then_drops_it(n: int, off: int, drop: int) -> None:
    prompt = list(range(100, 100 + n))
    # off: floor((n - 1) / P) * P; the hybrid coordinator's drop: floor(n / P) * P - P
    assert second_hit("off", prompt) == off == (n - 1) // 4 * 4
    assert second_hit("drop", prompt) == drop == n // 4 * 4 - 4


def test_eagle_lookahead_hashes_cost_no_block_of_a_repeated_prompt() -> None:
    from radixspec.fuzz.targets.vllm import import_vllm
    from radixspec.fuzz.targets.vllm_hybrid import lookahead_hashes

    if not lookahead_hashes(import_vllm()):
        pytest.skip("this vLLM has no lookahead hashes (0.32.0)")
    assert second_hit("lookahead", list(range(100, 118))) == 16


def test_a_rule_without_the_drop_is_caught_by_the_hit_check() -> None:
    with pytest.raises(IntegrityError, match="hit_is_the_longest_valid_match"):
        second_hit("drop", list(range(100, 118)), rule=hr.HitRule(4, (None, 8), 4))
