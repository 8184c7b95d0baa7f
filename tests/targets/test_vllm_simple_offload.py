"""The ``vllm-simple-offload`` target: vLLM 0.33.0's ``KVCacheManager`` and ``SimpleCPUOffloadScheduler`` under the
planner machine, vLLM's scheduler replayed and the machine as the worker (each stream reported in order). Tours pin
a load from the host tier in both modes, the in-order reports, a reset refused while a store runs; each law is seen
catching a bug of the tiers issue's classes planted in vLLM's code; a campaign without a plant is clean."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .campaigns import DrivenPlanner, assert_caught, assert_clean, driven, edit, load_after_eviction

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("msgspec") is None,
    reason="vllm (and msgspec) are not installed",
)

from radixspec.fuzz.stats import STATS  # noqa: E402
from radixspec.spec.errors import IntegrityError  # noqa: E402

TARGET = "vllm-simple-offload"
PLANT_EXAMPLES = 3000
MANAGER = "vllm.v1.simple_kv_offload.manager:SimpleCPUOffloadScheduler"

# bugs of the tiers issue's classes, planted in vLLM's code: (the law that catches it, method, old, new)
PLANTS = {
    # reset leaving the host tier serving: the CPU pool is said reset and keeps its blocks (the device's cleared event
    # made a consumer drop them; a later hit would load a block cached before the reset)
    "reset_keeps_the_host_tier": (
        "host_events_replay_to_the_tier",
        f"{MANAGER}.reset",
        "return self.cpu_block_pool.reset_prefix_cache()",
        "return True",
    ),
    # a stored block never made reachable: a completed store event is dropped, its blocks never cached and their
    # references never released
    "store_never_completed": (
        "host_pins_are_accounted",
        f"{MANAGER}._process_store_event",
        "self._process_store_completion(",
        "(lambda *_: None)(",
    ),
    # a host lock left: a load's references on its CPU blocks are never released
    "load_keeps_its_pins": (
        "host_pins_are_accounted",
        f"{MANAGER}._cleanup_load_request",
        "self.cpu_block_pool.free_blocks(",
        "(lambda _: None)(",
    ),
    # a load reading the wrong host copy: its CPU blocks in another order than its GPU blocks
    "load_blocks_reordered": (
        "attended_kv_is_the_requests",
        f"{MANAGER}.update_state_after_alloc",
        "request=request, transfer_meta=TransferMeta(gpu_block_ids, cpu_block_ids)",
        "request=request, transfer_meta=TransferMeta(gpu_block_ids, cpu_block_ids[::-1])",
    ),
    # write-back evicting an unbacked page: a lazy store takes a block of the GPU free queue without pinning it, so
    # the allocator may hand it out while the copy reads it
    "lazy_store_unpinned": (
        "device_pins_are_accounted",
        f"{MANAGER}._prepare_lazy_store_specs",
        "gpu_pool.touch([gpu_pool.blocks[bid] for bid in gpu_ids])",
        "pass",
    ),
    # duplicate host free slots after a reset: the CPU blocks of the stores queued at a finish are released twice
    "reset_releases_twice": (
        "host_free_queue_is_the_unreferenced",
        f"{MANAGER}.reset",
        "self._release_transfer_refs(transfer)",
        "self._release_transfer_refs(transfer);"
        " self.cpu_block_pool.free_blocks([self.cpu_block_pool.blocks[b] for b in transfer.cpu_block_ids])",
    ),
    # the window group frees a block one token early: the last position of the window reads a block given back
    "window_freed_a_token_early": (
        "attended_kv_is_the_requests",
        "vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager.get_num_skipped_tokens",
        "num_computed_tokens - self.sliding_window + 1",
        "num_computed_tokens - self.sliding_window + 2",
    ),
    # a completed store publishes no event: a router never learns the host tier holds it
    "stored_event_lost": (
        "host_events_replay_to_the_tier",
        f"{MANAGER}._process_store_completion",
        "self.cpu_block_pool.kv_event_queue.append(",
        "(lambda _: None)(",
    ),
}


def engine(**fields: object) -> object:
    """An engine in the configuration named (P = 4, 8 device blocks, host 2x, eager, budget 128, one worker,
    unless named)."""
    from radixspec.fuzz.targets.vllm_simple_offload import Config, VllmSimpleOffloadEngine, draw_for

    config = Config(4, 8, 2, False, 128)._replace(**fields)
    made = VllmSimpleOffloadEngine(draw_for(config))
    assert made.choice == config
    return made


def Driven(target: object) -> DrivenPlanner:
    return driven(TARGET, target)


def test_a_prefix_evicted_from_the_device_is_loaded_from_the_host() -> None:
    # no hit, a device hit, then (the prefix evicted from the device) a hit loaded from the host
    assert load_after_eviction(Driven(engine())) == (0, 12, 12, 1)


def test_with_a_window_group_the_hit_is_loaded_to_both_groups() -> None:
    """A sliding-window group of 8 tokens beside the full-attention group (P = 4): the host hit of 12 tokens loads
    the full group's 3 blocks and the window group's 2 that the window reaches (positions 5 to 11); the machine
    checks the window's KV in that group's row."""
    made = engine(device_blocks=16, window=8)
    loads: list[int] = []
    submit = made.worker.submit

    def recorded(meta: object, forward: bool) -> object:
        transfers, flush = submit(meta, forward)
        loads.extend(len(t.pairs) for t in transfers if t.kind == "load")
        return transfers, flush

    made.worker.submit = recorded
    assert load_after_eviction(Driven(made)) == (0, 12, 12, 1)
    assert loads == [5]


def test_in_lazy_mode_the_free_queues_blocks_are_stored_before_they_are_evicted() -> None:
    target = engine(lazy=True)
    machine = Driven(target)
    shared = list(range(1, 13))
    machine.serve([*shared, 50])
    backups = STATS.rules["planner.transfer[backup]"]
    machine.step(plans=2, late=False, report="all")  # the freed blocks stored from the free queue
    assert STATS.rules["planner.transfer[backup]"] == backups + 1
    assert sum(target.host_held().values()) == 3  # type: ignore[attr-defined]
    machine.serve(list(range(200, 230)))
    assert machine.serve([*shared, 70]) == 12
    machine.teardown()


def test_events_are_reported_in_the_order_they_were_launched() -> None:
    """A store event done before the one launched before it waits for it, as the worker's high-water mark does."""
    from radixspec.fuzz.targets.vllm_simple_offload import SimpleWorker

    worker = SimpleWorker()
    worker.launched["store"] += [3, 4]
    assert worker.done(("store", 4)) == ({}, set())
    assert worker.done(("store", 3)) == ({3: 1, 4: 1}, set())
    worker.launched["load"].append(7)
    worker.load_reqs = {7: ["a", "b"]}
    assert worker.done(("load", 7)) == ({}, {"a", "b"})
    assert worker.in_flight() == 0


def test_a_reset_with_a_store_in_flight_keeps_the_host_tier_and_says_so() -> None:
    """The connector abandons the store and refuses: the machine keeps serving the host tier's older copies; the
    abandoned store, once reported, caches nothing and releases its blocks."""
    target = engine()
    machine = Driven(target)
    machine.serve([*range(1, 13), 50])
    machine.step(plans=1, late=True, report="none")  # the finished request's store launched, not copied
    assert target.connector._store_event_to_blocks  # type: ignore[attr-defined]
    refused = STATS.rules["planner.reset[host refused]"]
    machine.reset_busy(now=0)
    assert not target.host_cleared  # type: ignore[attr-defined]
    assert STATS.rules["planner.reset[host refused]"] == refused + 1
    machine.step(plans=2, late=False, report="all")
    assert not target.connector.has_pending_stores()  # type: ignore[attr-defined]
    machine.teardown()


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_law_catches_its_planted_bug(plant: str, tmp_path: Path) -> None:
    law, name, old, new = PLANTS[plant]
    assert_caught(TARGET, law, edit(name, old, new), tmp_path, examples=PLANT_EXAMPLES)


def test_a_campaign_without_a_plant_is_clean(tmp_path: Path) -> None:
    assert_clean(TARGET, tmp_path, examples=600)


def test_a_cpu_block_referenced_and_free_is_named() -> None:
    """``host_free_queue_is_the_unreferenced`` and ``host_pins_are_accounted`` by hand."""
    target = engine()
    machine = Driven(target)
    machine.serve([*range(1, 13), 50])
    machine.step(plans=2, late=False, report="all")
    target.check_integrity(quiescent=True)  # type: ignore[attr-defined]
    pool = target.cpu_pool  # type: ignore[attr-defined]
    cached = next(block for block in pool.blocks[1:] if block.block_hash is not None)
    cached.ref_cnt += 1
    with pytest.raises(IntegrityError, match="host_free_queue_is_the_unreferenced"):
        target.check_integrity(quiescent=False)  # type: ignore[attr-defined]
    pool.free_block_queue.remove(cached)
    with pytest.raises(IntegrityError, match="host_pins_are_accounted"):
        target.check_integrity(quiescent=False)  # type: ignore[attr-defined]


def test_finding_24_a_host_reset_the_device_refused_is_counted_where_the_profile_names_it() -> None:
    """A request's blocks stored and published on both tiers; a reset while another runs: the device refuses, the
    connector resets its CPU pool, whose cleared event names no tier (finding 24, docs/findings.md). Counted where
    the profile names it; otherwise the device's blocks, dropped by the consumer, are found still served."""
    name = "planner.known: a host reset the device refused clears every tier's blocks (finding 24)"
    for known in (True, False):
        target = engine()
        target.known_clear_names_no_tier = known  # type: ignore[attr-defined]
        machine = Driven(target)
        machine.serve([*range(1, 13), 50])
        machine.step(plans=2, late=False, report="all")  # its blocks stored and published on the CPU
        machine.submit(prompt=(16, 1.0, list(range(100, 110)), 8))
        machine.step(plans=1, late=False, report="all")  # it runs: it holds GPU blocks
        counted = STATS.rules[name]
        machine.reset_busy(now=0)
        assert target.host_cleared  # type: ignore[attr-defined]
        if known:
            assert STATS.rules[name] == counted + 1
            assert machine.serve([*range(1, 13), 60]) == 12  # the device's hit, still published
            machine.teardown()
        else:
            with pytest.raises(IntegrityError, match="device_hits_are_published|events_replay_to_the_cache"):
                machine.serve([*range(1, 13), 60])


def test_a_store_queued_at_a_finish_is_held_until_the_next_step() -> None:
    """``offload_quiescent_holds_nothing``: a finished request's blocks queued for the CPU are held until the next
    step's metadata sends them; after it, and the worker's report, nothing is."""
    target = engine()
    machine = Driven(target)
    machine.serve([*range(1, 13), 50])
    with pytest.raises(IntegrityError, match="offload_quiescent_holds_nothing.*stores queued"):
        target.check_integrity(quiescent=True)  # type: ignore[attr-defined]
    machine.step(plans=2, late=False, report="all")
    target.check_integrity(quiescent=True)  # type: ignore[attr-defined]
