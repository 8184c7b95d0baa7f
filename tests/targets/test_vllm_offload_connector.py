"""The ``vllm-offload-connector`` target: vLLM 0.33.0's ``KVCacheManager`` and ``OffloadingConnectorScheduler``
(over ``CPUOffloadingManager``) under the planner machine, vLLM's scheduler replayed and the machine as the worker.
Tours pin a load from the host tier and a flush of a store whose blocks are reused; each law is seen catching a bug
of the tiers issue's classes planted in vLLM's code; a campaign without a plant is clean."""

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

TARGET = "vllm-offload-connector"
PLANT_EXAMPLES = 3000
SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler:OffloadingConnectorScheduler"
CPU = "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager"

# bugs of the tiers issue's classes, planted in vLLM's code: (the law that catches it, method, old, new)
PLANTS = {
    # reset leaving the host tier serving: the connector forgets its own state, the manager keeps its chunks (the
    # reset's cleared event makes a consumer drop them; a later load of a kept chunk fails
    # reset_leaves_no_tier_serving, a flushed store's chunk pending for good offload_quiescent_holds_nothing)
    "reset_keeps_the_host_tier": (
        "host_events_replay_to_the_tier",
        f"{SCHEDULER}._reset_cache",
        "self.manager.reset_cache()",
        "pass",
    ),
    # a load reads its chunks in another order than its keys: the worker copies chunks into the wrong blocks
    "load_slots_reordered": (
        "attended_kv_is_the_requests",
        f"{CPU}._prepare_load",
        "return self._get_load_store_spec(keys, chunks)",
        "return self._get_load_store_spec(keys, chunks[::-1])",
    ),
    # a stored block never made reachable: the workers' store reports never reach the manager
    "store_never_completed": (
        "offload_quiescent_holds_nothing",
        f"{SCHEDULER}._update_connector_output",
        "self.manager.complete_store(job_status.keys, req_status.req_context)",
        "pass",
    ),
    # a host lock left: a load's pins on its chunks are never released
    "load_keeps_its_pins": (
        "offload_quiescent_holds_nothing",
        f"{SCHEDULER}._update_connector_output",
        "self.manager.complete_load(job_status.keys, req_status.req_context)",
        "pass",
    ),
    # nothing reused under a transfer: a block re-allocated in this step is not known, so the store still reading
    # it is not flushed (the store copies another request's KV into the host tier)
    "reallocation_not_flushed": (
        "attended_kv_is_the_requests",
        f"{SCHEDULER}._build_connector_meta",
        "self._update_req_states(scheduler_output)",
        "self._update_req_states(scheduler_output); self._current_batch_allocated_block_ids.clear()",
    ),
    # a copy applied to a reused page: a reset does not flush the jobs in flight, so a store from before it writes
    # its chunk's slot after a store made since took it
    "reset_does_not_flush": (
        "attended_kv_is_the_requests",
        f"{SCHEDULER}._reset_cache",
        "self._current_batch_jobs_to_flush.update(self._jobs.keys())",
        "pass",
    ),
    # with a sliding-window group: a hit's load into the window group starts one block late (a load completion
    # applied to the wrong blocks: the window's first block keeps what it held)
    "window_load_starts_a_block_late": (
        "attended_kv_is_the_requests",
        f"{SCHEDULER}.update_state_after_alloc",
        "load_start_gpu_block_idx = i\n",
        "load_start_gpu_block_idx = i + (group_config.sliding_window_size_in_chunks is not None and i + 1 <"
        " num_gpu_blocks)\n",
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
        f"{CPU}.complete_store",
        "if stored_keys and self.events is not None:",
        "if False:",
    ),
}


def engine(**fields: object) -> object:
    """An engine in the configuration named (P = 4, 8 device blocks, host 2x, chunks of one block, LRU, budget
    128, prefix caching on, prompts only, unless named)."""
    from radixspec.fuzz.targets.vllm_offload_connector import Config, VllmOffloadEngine, draw_for

    config = Config(4, 8, 2, 1, "lru", 1, 128)._replace(**fields)
    made = VllmOffloadEngine(draw_for(config))
    assert made.choice == config
    return made


def Driven(target: object) -> DrivenPlanner:
    return driven(TARGET, target)


def test_a_prefix_evicted_from_the_device_is_loaded_from_the_host() -> None:
    # no hit, a device hit, then (the prefix evicted from the device) a hit loaded from the host
    assert load_after_eviction(Driven(engine())) == (0, 12, 12, 1)


def test_under_eagle_both_tiers_drop_the_volatile_last_block() -> None:
    """EAGLE (the group holds the drafter's layers): the device hit drops its last block (``use_eagle``) and the
    connector queries one chunk past the hit and drops it (the drafter's KV of a chunk's last position needs the
    next token): the 12 cached tokens of the 13-token prompt are a hit of 8 on either tier."""
    assert load_after_eviction(Driven(engine(eagle=True))) == (0, 8, 8, 1)


def test_with_a_window_group_the_hit_is_loaded_to_both_groups() -> None:
    """A sliding-window group of 8 tokens beside the full-attention group: the connector's lookup finds the
    prefix's chunks of both groups on the host, and the load fills the window's blocks (the KV of the window's last
    7 positions is checked in the window group's row, the rest in the full group's)."""
    loads = STATS.rules["vllm-offload-connector.job[load, the window group's blocks too]"]
    assert load_after_eviction(Driven(engine(device_blocks=16, window=8))) == (0, 12, 12, 1)
    assert STATS.rules["vllm-offload-connector.job[load, the window group's blocks too]"] == loads + 1


def job(blocks: list[int], sizes: list[int], starts: list[int], chunks: list[int]) -> object:
    from types import SimpleNamespace

    device = SimpleNamespace(block_ids=blocks, group_sizes=sizes, block_indices=starts)
    return SimpleNamespace(src_spec=device, dst_spec=SimpleNamespace(block_ids=chunks))


def test_a_jobs_pairs_follow_its_groups_and_a_job_they_do_not_cover_is_named() -> None:
    """A store of two groups (chunks of 2 blocks): the full group's 3 blocks from block 1 (its first chunk's first
    block skipped), then the window group's 2 from block 4; a job whose sizes do not cover its blocks or chunks
    fails ``offload_jobs_are_whole``."""
    from radixspec.fuzz.targets.vllm_offload_connector import OffloadWorker

    worker = OffloadWorker(2)
    made = worker.transfer(0, job([11, 12, 13, 21, 22], [3, 2], [1, 4], [7, 8, 9]), "backup")
    assert made.pairs == ((11, (7, 1)), (12, (8, 0)), (13, (8, 1)), (21, (9, 0)), (22, (9, 1)))
    for bad in (
        job([11, 12, 13], [2, 0], [0, 0], [7]),
        job([11, 12], [2, 2], [0, 0], [7, 8]),
        job([11, 12], [1, 1], [0], [7, 8]),
    ):
        with pytest.raises(IntegrityError, match="offload_jobs_are_whole: job 1"):
            worker.transfer(1, bad, "backup")


def test_with_prefix_caching_off_every_hit_is_a_load() -> None:
    machine = Driven(engine(caching=False))
    shared = list(range(1, 13))
    machine.serve([*shared, 50])
    loads = STATS.rules["planner.transfer[load]"]
    assert machine.serve([*shared, 60]) == 12
    assert STATS.rules["planner.transfer[load]"] == loads + 1
    machine.teardown()


def test_a_finished_requests_store_is_flushed_when_its_blocks_are_reused() -> None:
    """The request's store is submitted in the step after it finished, and copied late; the next request takes its
    blocks in that step, so the connector flushes the store and the machine copies it before the forward."""
    machine = Driven(engine(caching=False))
    flushed = STATS.rules["planner.transfer[backup flushed]"]
    machine.serve(list(range(1, 30)), late=True)
    machine.serve(list(range(100, 130)), late=True)
    assert STATS.rules["planner.transfer[backup flushed]"] > flushed
    assert machine.serve(list(range(1, 30)), late=True) == 28  # the first prompt's store read before the reuse
    machine.teardown()


def test_a_preempted_request_starts_again_at_a_hit() -> None:
    """Two requests whose decodes outgrow the pool: one is preempted, and recomputes from its hit."""
    machine = Driven(engine(page_size=2, device_blocks=8, budget=8))
    restarted = STATS.rules["planner.restarted"]
    machine.submit(prompt=(16, 1.0, list(range(1, 8)), 6))
    machine.submit(prompt=(16, 1.0, list(range(20, 27)), 6))
    for _ in range(40):
        machine.step(plans=1, late=False, report="all")
        if not machine.requests:
            break
    assert not machine.requests
    assert STATS.rules["planner.restarted"] > restarted
    machine.teardown()


def test_a_synchronous_load_lands_before_the_forward_of_its_own_step() -> None:
    """With a sync-load budget the connector loads a hit within the step that runs the request: the plan holds the
    load (awaited) and the request's pass from the hit, and the load lands first even where others land late."""
    machine = Driven(engine(caching=False, sync_budget=65536))
    shared = list(range(1, 13))
    machine.serve([*shared, 50])
    machine.step(plans=2, late=False, report="all")  # the finished request's store, submitted and reported
    machine.submit(prompt=(16, 1.0, [*shared, 60], 1))
    plan = machine.target.plan()
    loads = [transfer for transfer in plan.transfers if transfer.kind == "load"]
    assert len(loads) == 1 and loads[0].awaited
    assert [(one.start, one.count) for one in plan.passes] == [(12, 1)]
    machine.run(plan, late=True)  # the pass reads the loaded blocks: attended_kv_is_the_requests holds
    for transfer in list(machine.in_flight):
        machine.report_transfer(transfer, fail=False)
    machine.after_step()
    machine.teardown()


def test_with_two_workers_a_job_completes_at_the_second_report() -> None:
    """Each job is reported by both workers, the second a step later: until then the connector keeps it."""
    target = engine(workers=2)
    machine = Driven(target)
    machine.serve([*range(1, 13), 50])
    machine.step(plans=1, late=False, report="all")  # the finished request's store, reported by one worker
    pending = [job for meta, _ in target.late for job in meta.completed_jobs]  # type: ignore[attr-defined]
    assert pending and all(job in target.connector._jobs for job in pending)  # type: ignore[attr-defined]
    machine.step(plans=1, late=False, report="all")  # the other worker's report
    assert not any(job in target.connector._jobs for job in pending)  # type: ignore[attr-defined]
    machine.teardown()


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_law_catches_its_planted_bug(plant: str, tmp_path: Path) -> None:
    law, name, old, new = PLANTS[plant]
    assert_caught(TARGET, law, edit(name, old, new), tmp_path, examples=PLANT_EXAMPLES)


def test_a_campaign_without_a_plant_is_clean(tmp_path: Path) -> None:
    assert_clean(TARGET, tmp_path, examples=600)


def test_finding_27_a_reset_under_a_window_group_is_counted_where_the_profile_names_it() -> None:
    """A campaign's program (seed 104, shrunk): nine requests under a window group of 8 tokens (P = 1, two workers,
    sync loads), four steps, then a reset while they run. It re-offloads the running requests from their first chunk
    with window blocks since given to their later positions, and the store's completion raises ``KeyError`` (finding
    27, docs/findings.md). The target counts it and does not take the reset; with the finding not named, it is
    raised."""
    from radixspec.fuzz.regression import build_machine
    from radixspec.fuzz.targets.vllm_offload_connector import Config, draw_for

    config = Config(1, 24, 4, 1, "arc", 2, 128, True, False, 65536, 2, False, 8)
    key = "planner.known: a reset re-offloads a running request's stale window blocks (finding 27)"
    prompts = [(0, 0.5, [], 1), (0, 0.5, [1] * 9, 3), (0, 0.5, [], 1), (0, 0.25, [], 1), *[(0, 0.25, [], 2)] * 3]
    for known in (True, False):
        machine = build_machine("planner", targets=(TARGET,), lru=None, device="cpu")()
        machine.configure(draw=draw_for(config))
        machine.target.known_window_reset = known
        for prompt in (*prompts, (5, 1.0, [4, 5, 4, 4, 2, 1, 4, 3], 4), (7, 1.0, [], 4)):
            machine.submit(prompt=prompt)
        for late, plans, report in (
            (False, 1, "all, reversed"),
            (True, 1, "none"),
            (False, 2, "none"),
            (False, 4, "none"),
        ):
            machine.step(late=late, plans=plans, report=report)
        counted = STATS.rules[key]
        machine.reset_busy(now=0)
        if known:
            assert STATS.rules[key] == counted + 1
            machine.teardown()
        else:
            with pytest.raises(KeyError):
                machine.teardown()


def test_finding_22_a_second_reset_before_a_step_is_counted_where_the_profile_names_it() -> None:
    """A store in flight, two resets before the next step: the second fails the connector's assertion (finding 22,
    docs/findings.md). The target counts it and reports no clear; with the finding not named, it is raised."""
    for known in (True, False):
        target = engine()
        target.known_double_reset = known  # type: ignore[attr-defined]
        machine = Driven(target)
        machine.submit(prompt=(16, 1.0, list(range(1, 10)), 2))
        machine.step(plans=1, late=False, report="none")
        assert target.connector._jobs  # type: ignore[attr-defined]  # the step's store, submitted with the next plan
        counted = STATS.rules[
            "planner.known: a second reset before a step fails the connector's assertion (finding 22)"
        ]
        machine.reset_busy(now=0)
        if known:
            machine.reset_busy(now=0)
            assert (
                STATS.rules["planner.known: a second reset before a step fails the connector's assertion (finding 22)"]
                == counted + 1
            )
            machine.teardown()
        else:
            with pytest.raises(AssertionError):
                machine.reset_busy(now=0)


def test_finding_23_a_reset_the_device_refuses_leaves_the_host_tier_published() -> None:
    """A request running, its prompt's chunks stored and published; a reset: the device refuses, the host tier is
    emptied, no event says so (finding 23, docs/findings.md). Counted where the profile names it; otherwise the
    host tier's events name blocks it does not hold."""
    for known in (True, False):
        target = engine()
        target.known_silent_host_reset = known  # type: ignore[attr-defined]
        machine = Driven(target)
        machine.submit(prompt=(16, 1.0, list(range(1, 10)), 4))
        machine.step(plans=3, late=False, report="all")  # its prefill's store submitted, copied and reported
        assert target.host_published  # type: ignore[attr-defined]
        counted = STATS.rules["planner.known: a reset the device refuses empties the host tier silently (finding 23)"]
        if known:
            machine.reset_busy(now=0)
            assert (
                STATS.rules["planner.known: a reset the device refuses empties the host tier silently (finding 23)"]
                == counted + 1
            )
            machine.teardown()
        else:
            with pytest.raises(IntegrityError, match="host_events_replay_to_the_tier"):
                machine.reset_busy(now=0)


def test_a_host_slot_both_held_and_free_is_named() -> None:
    """``host_slots_are_conserved``: the CPU manager's chunks and its free slots partition the tier (no campaign of
    this target frees a slot to the list: its workers never fail a store, so the check is seen failing here)."""
    target = engine()
    machine = Driven(target)
    machine.serve([*range(1, 13), 50])
    machine.step(plans=2, late=False, report="all")  # the finished request's chunks stored
    target.check_integrity(quiescent=False)  # type: ignore[attr-defined]
    held = next(iter(target.chunks().values())).chunk_id  # type: ignore[attr-defined]
    target.cpu._free_list.append(held)  # type: ignore[attr-defined]
    with pytest.raises(IntegrityError, match="host_slots_are_conserved"):
        target.check_integrity(quiescent=False)  # type: ignore[attr-defined]


def test_a_policy_named_after_the_target_is_every_examples() -> None:
    """``vllm-offload-connector:arc`` pins the policy; without it each example draws one."""
    from radixspec.fuzz.targets import resolve

    for policy in ("lru", "arc"):
        factory = resolve(f"vllm-offload-connector:{policy}").planner_factory
        assert factory is not None
        assert {factory(draw).choice.policy for draw in range(12)} == {policy}  # type: ignore[attr-defined]
    drawn = resolve("vllm-offload-connector").planner_factory
    assert drawn is not None
    assert {drawn(draw).choice.policy for draw in range(12)} == {"lru", "arc"}  # type: ignore[attr-defined]
