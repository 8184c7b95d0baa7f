"""The router machine: workers behind routers, every law checked after every step; each law seen failing on a
bug planted in a router (ours without Dynamo, Dynamo's through our relay when it is installed)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from radixspec.fuzz.machines import machine_for
from radixspec.fuzz.registry import machines_for
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
    run(("radixspec-router",))
    assert STATS.router_scores_checked > 1000 and STATS.router_removals > 100
    assert STATS.most_workers == 4 and STATS.most_router_blocks is not None and STATS.most_router_blocks > 20
    assert STATS.most_namespaces == 4
    assert {"router.request[drawn]", "router.request[routed]", "router.evict", "router.reset"} <= set(STATS.rules)


def test_a_router_that_loses_removals_breaks_holds_live_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    original = our_routers.SpecRouter.apply

    def apply(self: our_routers.SpecRouter, worker: int, payload: bytes) -> None:
        from radixspec.optimized import kv_events

        batch = kv_events.decode(payload)
        kept = [event for event in batch.events if type(event).__name__ != "BlockRemoved"]
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
    monkeypatch.setattr(
        dynamo,
        "relay",
        lambda events, hasher, first: [
            e for e in original(events, hasher, first) if e["data"] == "cleared" or "removed" not in e["data"]
        ],
    )
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

    monkeypatch.setattr(dynamo, "cache_namespace", lambda namespace: None)
    caught(("dynamo",), "router_namespaces_apart")
