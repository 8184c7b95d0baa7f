"""The ``vllm-offload`` target: vLLM 0.33.0's ``CPUOffloadingManager`` under the offload machine. A request's tour
pins the manager's answers (all-or-nothing stores, pending chunks skipped, loads pinning, reset); each law is seen
catching a bug of a historical class planted in vLLM's code, and a campaign without a plant is clean."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .campaigns import assert_caught, assert_clean

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

# replaces ``old`` by ``new`` in the source of a method of vLLM's CPU manager (exactly once), in its module
EDIT = """
import inspect, textwrap
manager = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
def edit(name, old, new):
    source = textwrap.dedent(inspect.getsource(getattr(manager.CPUOffloadingManager, name)))
    assert source.count(old) == 1, (name, old)
    found = {{}}
    exec(compile(source.replace(old, new), manager.__file__, "exec"), manager.__dict__, found)
    setattr(manager.CPUOffloadingManager, name, found[name])
edit({name!r}, {old!r}, {new!r})
"""

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
        "store_refused_only_when_short",
        "prepare_store",
        "protected = set(keys)",
        "protected = set()",
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
    # a chunk whose store is in flight looks ready to a lookup: a load would read a slot not yet written
    "pending_looks_ready": ("lookups_agree", "lookup", "if not chunk.is_ready:", "if False:"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_law_catches_its_planted_bug(plant: str, tmp_path: Path) -> None:
    law, name, old, new = PLANTS[plant]
    assert_caught("vllm-offload", law, EDIT.format(name=name, old=old, new=new), tmp_path, examples=600)


def test_a_campaign_without_a_plant_is_clean(tmp_path: Path) -> None:
    assert_clean("vllm-offload", tmp_path, examples=600)
