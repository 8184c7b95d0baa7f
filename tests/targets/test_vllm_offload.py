"""The ``vllm-offload`` target: vLLM 0.33.0's ``CPUOffloadingManager`` under the offload machine. A request's tour
pins the manager's answers (all-or-nothing stores, pending chunks skipped, loads pinning, reset); each law is seen
catching a bug of a historical class planted in vLLM's code, and a campaign without a plant is clean."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .campaigns import assert_caught, assert_clean, edit

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


# a plant's method, named as "module:Class.method" under vllm.v1.kv_offload.cpu (the manager's when only the
# method is named)
def cpu_method(name: str) -> str:
    where, _, method = name.rpartition(".")
    module, _, owner = (where or "manager:CPUOffloadingManager").partition(":")
    return f"vllm.v1.kv_offload.cpu.{module}:{owner}.{method}"


# bugs of the tiers issue's classes, planted in vLLM's manager: (the law that catches it, method, old, new)
PLANTS = {
    # a reset leaves the CPU tier serving (vLLM #57727's class)
    "reset_keeps_chunks": ("slots_are_conserved", "reset_cache", "self._policy.clear()", "pass"),
    # a reset restarts the slot numbers but keeps the free list: a slot free twice (SGLang #26009's class)
    "reset_keeps_free_list": ("slots_are_conserved", "reset_cache", "self._free_list.clear()", "pass"),
    # a stored chunk never becomes reachable: the last of a job's chunks stays pending (vLLM #53498's class)
    "stored_never_ready": (
        "states_agree",
        "complete_store",
        "chunk.ref_cnt = 0",
        "chunk.ref_cnt = 0 if key != list(keys)[-1] or len(keys) == 1 else -1",
    ),
    # a failed store keeps its slot
    "failed_store_keeps_slot": ("slots_are_conserved", "complete_store", "self._free_chunk(chunk)", "pass"),
    # a load leaves a pin behind on the last of its chunks (SGLang PR #38480's class: a host lock left)
    "load_keeps_pin": (
        "states_agree",
        "complete_load",
        "chunk.ref_cnt -= 1",
        "chunk.ref_cnt -= 0 if len(keys) > 1 and key == list(keys)[-1] else 1",
    ),
    # an offer's eviction takes the offer's own stored chunks: a page reused under the request that needs it
    "evicts_the_offer": (
        "store_evicts_only_what_it_lacks",
        "prepare_store",
        "protected = set(keys)",
        "protected = set()",
    ),
    # an offer that could evict exactly what it lacks is refused (ARC's spurious refusals, PR #55461's class)
    "refuses_when_just_enough": (
        "store_refused_only_when_short",
        "prepare_store",
        "if num_chunks_to_evict > self._num_evictable_cache_chunks:",
        "if num_chunks_to_evict >= self._num_evictable_cache_chunks:",
    ),
    # an offer evicts one chunk more than it lacks
    "evicts_one_more": (
        "store_evicts_only_what_it_lacks",
        "prepare_store",
        "self._policy.evict(num_chunks_to_evict, protected)",
        "self._policy.evict(num_chunks_to_evict + 1, protected) or self._policy.evict(num_chunks_to_evict, protected)",
    ),
    # a reused slot is handed out without leaving the free list
    "slot_stays_free": ("store_takes_free_slots", "_allocate_chunks", "self._free_list.pop()", "self._free_list[-1]"),
    # a completed store publishes no event: a router never learns the CPU tier holds it
    "stored_event_lost": (
        "published_are_the_ready_chunks",
        "complete_store",
        "if stored_keys and self.events is not None:",
        "if False:",
    ),
    # ARC's eviction takes a chunk a load is reading: its slot reused under the load (a load completion applied
    # to a reused page)
    "arc_evicts_a_read_chunk": (
        "store_evicts_only_what_it_lacks",
        "policies.arc:ARCCachePolicy.evict",
        "if chunk.ref_cnt == 0 and key not in protected:",
        "if chunk.ref_cnt >= 0 and key not in protected:",
    ),
    # a load's slots come in another order than its keys: the worker copies chunks into the wrong pages
    "load_slots_reordered": (
        "loads_read_their_chunks",
        "_prepare_load",
        "return self._get_load_store_spec(keys, chunks)",
        "return self._get_load_store_spec(keys, chunks[::-1])",
    ),
    # a store names its keys in another order than its slots: each chunk filed under a neighbour's slot
    "store_keys_reordered": (
        "store_takes_the_new_keys",
        "prepare_store",
        "keys_to_store=keys_to_store,",
        "keys_to_store=keys_to_store[::-1],",
    ),
    # a load forgets to count its chunk out of the evictable ones
    "load_miscounts": (
        "manager_counts_its_chunks",
        "_prepare_load",
        "self._num_evictable_cache_chunks -= 1  # ref_cnt 0 -> 1",
        "pass",
    ),
    # a load leaves its chunk in LRU's evictable set: the next eviction may take it
    "load_stays_evictable": (
        "policy_knows_the_idle_chunks",
        "_prepare_load",
        "self._policy.mark_non_evictable(key)",
        "pass",
    ),
    # the admission tracker, full, forgets a key of the offer it is counting: a chunk offered often enough is never
    # stored (vLLM PR #54759's class)
    "tracker_forgets_the_offer": ("offer_counts_agree", "_record_accesses", "if num_unprotected == 0:", "if False:"),
    # a chunk whose store is in flight looks ready to a lookup: a load would read a slot not yet written
    "pending_looks_ready": ("lookups_agree", "lookup", "if not chunk.is_ready:", "if False:"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_law_catches_its_planted_bug(plant: str, tmp_path: Path) -> None:
    law, name, old, new = PLANTS[plant]
    assert_caught("vllm-offload", law, edit(cpu_method(name), old, new), tmp_path, examples=600)


def test_a_campaign_without_a_plant_is_clean(tmp_path: Path) -> None:
    assert_clean("vllm-offload", tmp_path, examples=600)


def test_a_lookup_answer_outside_the_spec_is_named() -> None:
    """The manager may answer RETRY (its interface allows it; the CPU manager never does): the adapter names it
    rather than reading it as a miss."""
    from radixspec.fuzz.targets.vllm_offload import VllmOffloadStore
    from radixspec.spec.errors import IntegrityError
    from radixspec.spec.prefix_cache import compute_page_prefixes

    store = VllmOffloadStore(2, 0)
    key = (None, compute_page_prefixes([1, 2], 2)[0])
    store.begin(0, [key])
    assert store.lookup(0, key) == "miss"
    store.manager.lookup = lambda offload_key, context: store.base.LookupResult.RETRY
    with pytest.raises(IntegrityError, match="lookup_answers"):
        store.lookup(0, key)


def test_a_policy_named_after_the_target_is_every_examples() -> None:
    """``vllm-offload:arc`` pins the policy (a ten-minute campaign per policy); without it each example draws one."""
    from radixspec.fuzz.targets import resolve

    for policy in ("lru", "arc"):
        factory = resolve(f"vllm-offload:{policy}").offload_factory
        assert factory is not None
        assert {factory(8, draw).config.split(",")[0] for draw in range(8)} == {policy}
    drawn = resolve("vllm-offload").offload_factory
    assert drawn is not None
    assert {drawn(8, draw).config.split(",")[0] for draw in range(8)} == {"lru", "arc"}
