"""The router machine: workers behind routers, every law checked after every step; each law seen failing on a
bug planted in a router (ours without Dynamo, Dynamo's through our relay when it is installed)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from radixspec.fuzz import router_machine
from radixspec.fuzz.machines import machine_for
from radixspec.fuzz.registry import machines_for
from radixspec.fuzz.router_machine import FAULTS
from radixspec.fuzz.stats import STATS
from radixspec.fuzz.targets import resolve
from radixspec.fuzz.targets import routers as our_routers
from radixspec.spec.errors import RouterLawError

pytest.importorskip("msgspec")
needs_dynamo = pytest.mark.skipif(
    importlib.util.find_spec("dynamo") is None, reason="Dynamo is not installed (radixspec targets install dynamo)"
)


def run(targets: tuple[str, ...], examples: int = 40, steps: int = 30, shrink: bool = True) -> None:
    machine = machine_for("router", targets)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            report_multiple_bugs=False,
            phases=tuple(Phase) if shrink else (Phase.generate,),
        ),
    )


def caught(targets: tuple[str, ...], law: str) -> None:
    """The machine fails on the planted bug, and the first law that fails is ``law``."""
    with pytest.raises(RouterLawError, match=law):
        run(targets, examples=200, shrink=False)


def test_only_the_router_machine_drives_a_router_and_its_workers_are_ours() -> None:
    spec_router = resolve("radixspec-router")
    assert machines_for(["radixspec-router"], {"radixspec-router": spec_router}) == ["router"]
    # no router selected: no router machine (the default campaign is unchanged)
    assert "router" not in machines_for(["reference"], {})
    machine = machine_for("router", ("radixspec-router", "reference"))
    assert [info.name for info in machine.ROUTERS] == ["radixspec-router"]
    assert [info.name for info in machine.WORKERS] == ["reference"]


def test_our_router_follows_the_workers_and_the_summary_counts_its_reach() -> None:
    STATS.reset()
    run(("radixspec-router",), examples=60, steps=40)
    assert STATS.router_scores_checked > 1000 and STATS.router_removals > 100
    assert STATS.most_workers == 4 and STATS.most_router_blocks is not None and STATS.most_router_blocks > 20
    assert STATS.most_namespaces == 4
    rules = {"router.request[drawn]", "router.request[routed]", "router.evict", "router.reset", "router.restart"}
    assert rules | {f"router.fault[{kind}]" for kind in FAULTS} <= set(STATS.rules)
    # every kind of fault struck, and lost, repeated and reordered batches were recovered through the replay
    assert set(STATS.router_faults) == set(FAULTS)
    assert all(STATS.router_recovered[kind] > 0 for kind in ("drop", "duplicate", "reorder"))
    assert STATS.router_recovered["silent_restart"] == 0
    assert STATS.most_router_under_pages is not None and STATS.most_router_under_pages > 0


def test_without_recovery_the_faults_are_measured_not_failed_and_each_kind_misleads_the_router() -> None:
    router_machine.DIVERGENCES.clear()
    base = machine_for("router", ("radixspec-router",))
    raw = type(base.__name__, (base,), {"RECOVER": False})
    run_state_machine_as_test(
        raw,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    found = router_machine.DIVERGENCES
    # the first fault on a link opens its divergence (without recovery it lasts until a restart the routers are
    # told of): most kinds come first somewhere
    assert len({d.kind for d in found}) >= 3 and {d.kind for d in found} <= set(FAULTS)
    # nothing ends by replay without it; the router over- and under-estimates while a fault lasts
    assert not any(d.ended == "replay" for d in found)
    assert max(d.over for d in found) > 0 and max(d.under for d in found) > 0


def test_a_subscriber_that_does_not_replay_a_gap_is_caught_once_it_believes_it_is_in_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixspec.optimized import kv_events

    def receive(self: kv_events.SequencedSubscriber, sequence: int, payload: bytes) -> list[bytes]:
        if sequence < self.expected:
            return []
        self.expected = sequence + 1  # a gap skipped: the lost batches never applied
        return [payload]

    monkeypatch.setattr(kv_events.SequencedSubscriber, "receive", receive)
    with pytest.raises(RouterLawError, match="router_holds_live_blocks|router_scores_match_workers"):
        run(("radixspec-router",), examples=200, shrink=False)


def test_a_router_that_loses_removals_breaks_holds_live_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    original = our_routers.SpecRouter.apply

    def apply(self: our_routers.SpecRouter, worker: int, payload: bytes) -> None:
        from radixspec.optimized import kv_events

        batch = kv_events.decode(payload)
        kept = [event for event in batch.events if not isinstance(event, kv_events.ReadRemoved)]
        original(self, worker, kv_events.msgspec.msgpack.encode(kv_events.KVEventBatch(0.0, kept)))

    monkeypatch.setattr(our_routers.SpecRouter, "apply", apply)
    caught(("radixspec-router",), "router_holds_live_blocks")


def test_a_router_that_scores_one_page_short_breaks_router_scores_match_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = our_routers.SpecRouter.scores

    def scores(self: our_routers.SpecRouter, tokens: list[int], namespace: Any) -> dict[int, int]:
        return {w: n - 1 if n > 2 else n for w, n in original(self, tokens, namespace).items()}

    monkeypatch.setattr(our_routers.SpecRouter, "scores", scores)
    caught(("radixspec-router",), "router_scores_match_workers")


def test_a_router_keyed_by_tokens_alone_breaks_router_namespaces_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(our_routers.SpecRouter, "entry_of", lambda self, key: key[1])
    caught(("radixspec-router",), "router_namespaces_apart")


# ------------------------------------------------------------------------------------ Dynamo through our relay


@needs_dynamo
def test_dynamo_follows_the_workers() -> None:
    STATS.reset()
    run(("dynamo",))
    assert STATS.router_scores_checked > 1000 and STATS.most_workers == 4


@needs_dynamo
def test_a_relay_that_drops_removals_leaves_stale_blocks_in_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixspec.fuzz.targets import dynamo

    original = dynamo.relay

    def relay(*args: Any) -> list[dynamo.Relayed]:
        return [one for one in original(*args) if "removed" not in str(one.event["data"])]

    monkeypatch.setattr(dynamo, "relay", relay)
    caught(("dynamo",), "router_holds_live_blocks")


@needs_dynamo
def test_a_prompt_hashed_one_token_late_breaks_dynamos_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixspec.fuzz.targets import dynamo

    original = dynamo.DynamoRouter.scores
    monkeypatch.setattr(dynamo.DynamoRouter, "scores", lambda self, tokens, ns: original(self, tokens[1:], ns))
    caught(("dynamo",), "router_scores_match_workers")


@needs_dynamo
def test_a_relay_that_folds_namespaces_breaks_router_namespaces_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixspec.fuzz.targets import dynamo

    original = dynamo.Hasher.of_blocks

    def of_blocks(self: dynamo.Hasher, tokens: list[int], namespace: str | None, lora: str | None = None) -> list[int]:
        return original(self, tokens, None, lora)  # the salt left out: relay, prompts, entries alike

    monkeypatch.setattr(dynamo.Hasher, "of_blocks", of_blocks)
    # an over-estimate when a prompt of one namespace meets another's pages first; the law itself once two
    # namespaces' equal pages are live together
    caught(("dynamo",), "router_namespaces_apart|router_scores_match_workers")


@needs_dynamo
def test_sglangs_radix_cache_serves_as_workers_behind_dynamo_in_one_namespace() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    from radixspec.fuzz.targets.sglang import events_available

    if not events_available():
        pytest.skip("SGLang's event recorder needs msgspec and pyzmq")
    STATS.reset()
    run(("dynamo", "sglang:legacy"))
    machine = machine_for("router", ("dynamo", "sglang:legacy"))
    assert [info.name for info in machine.WORKERS] == ["sglang:legacy"]
    # SGLang's event hashes do not tell namespaces apart (finding 8): its workers serve one namespace
    assert STATS.most_namespaces == 1 and STATS.router_scores_checked > 1000 and STATS.router_removals > 50


@pytest.mark.parametrize("cache", ["tests.targets.toy:ToyCache", "vllm"], ids=["no KV events", "picks its own pages"])
def test_a_cache_that_cannot_be_a_worker_is_a_usage_error(cache: str) -> None:
    from radixspec.fuzz import campaign

    if cache == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    with pytest.raises(SystemExit) as exit_info:
        campaign.parse_args(["--machine", "router", "--target", "radixspec-router", "--target", cache])
    assert exit_info.value.code == 2
    args = campaign.parse_args(["--machine", "router", "--target", "radixspec-router", "--target", "reference"])
    assert args.targets == ("radixspec-router", "reference")


def test_regression_a_late_batch_of_a_workers_earlier_life_is_lost_for_good_not_a_crash() -> None:
    """Found by ``radixspec fuzz --machine router --target dynamo --target sglang:legacy --seed 0`` (11 s): batch 1
    lost, batch 2 held back, the worker restarts unannounced, and batch 2 of its earlier life arrives after the
    new life's batch 0. The subscriber asks the publisher for batch 1, which its new life does not hold: the
    subscriber raised out of the machine. Now the link is lost for good (out of sync until a restart the routers
    are told of), the fault measured, nothing raised."""
    from radixspec.fuzz.router_machine import Link, Worker
    from radixspec.fuzz.targets.ours import REFERENCE

    worker = Worker(0, REFERENCE, 1, 8)
    link = Link(worker, recover=True)

    def step(tokens: list[int], fault: str | None = None) -> list[bytes]:
        link.armed = fault
        worker.serve(tokens, None)
        return link.deliver(worker.publish())

    assert len(step([1])) == 1 and link.in_sync()
    assert step([2], "drop") == [] and not link.in_sync()
    assert step([3], "reorder") == [] and link.held is not None
    worker.start()  # unannounced
    link.silent = True
    assert step([4]) == []  # its new batch 0 looks like a repeat; the old batch 2 cannot be preceded by 1
    assert link.lost is not None and "batches 1..1 were lost" in link.lost and not link.in_sync()
    link.restart()  # a restart the routers are told of
    assert link.lost is None and step([5]) and link.in_sync()
