"""Swarm batches: past a machine's first batches, every fourth turns each of its rules off with probability one
half."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from radixspec.fuzz import campaign
from radixspec.fuzz.machines import machine_for, rule_names, swarm_off

CACHE_RULES = rule_names(machine_for("cache", ("reference",)))


def test_a_swarm_turns_off_about_half_the_rules_the_same_way_for_the_same_seed() -> None:
    offs = [swarm_off(machine_for("cache", ("reference",)), seed) for seed in range(200)]
    assert offs[7] == swarm_off(machine_for("cache", ("reference",)), 7)
    assert len(set(offs)) == 200
    shares = [len(off) / len(CACHE_RULES) for off in offs]
    assert 0.4 < sum(shares) / len(shares) < 0.6 and max(shares) < 1
    # every rule is off in some swarm and on in others
    assert set().union(*offs) == set(CACHE_RULES) and not set.intersection(*map(set, offs))


def test_a_swarm_machine_runs_without_its_rules_off_and_still_answers_them_by_name() -> None:
    swarm = machine_for("cache", ("reference",), swarm=11)
    off = swarm.SWARM_OFF  # type: ignore[attr-defined]
    # the rules off are gone, and a step that does nothing can always run (no state where no rule can)
    assert off and set(rule_names(swarm)) == set(CACHE_RULES) - set(off) | {"swarm_idle"}
    run_state_machine_as_test(swarm, settings=settings(max_examples=20, stateful_step_count=20, deadline=None))
    # a regression program names rules on the whole machine; the swarm's hidden ones still run by name
    assert callable(getattr(swarm, off[0]))
    whole = machine_for("cache", ("reference",))
    assert "swarm_idle" not in rule_names(whole) and callable(whole.swarm_idle)  # type: ignore[attr-defined]


def test_a_swarm_of_the_manager_machine_never_finds_every_rule_it_kept_waiting() -> None:
    """Every rule of the manager machine has a precondition: a swarm that kept only `admit` stopped examples with
    Hypothesis's "No progress can be made" (an InvalidDefinition) before swarm_idle."""
    for seed in (1, 4, 9):
        swarm = machine_for("manager", ("reference",), swarm=seed)
        run_state_machine_as_test(swarm, settings=settings(max_examples=8, stateful_step_count=15, deadline=None))


def test_past_the_first_batches_every_fourth_batch_is_a_swarm_batch_unless_turned_off() -> None:
    first = [False] * campaign.SWARM_FROM
    for argv, expected in (
        (["--minutes", "1"], first + [False, False, False, True] * 2),
        (["--no-swarm"], first + [False] * 8),
    ):
        run = campaign.Campaign(campaign.parse_args(["--machine", "cache", *argv]), io.StringIO())
        run.start = time.time()
        run.machines = {"cache": campaign.MachineState("cache")}
        specs = [run.next_spec() for _ in range(len(expected))]
        assert [spec is not None and spec.swarm is not None for spec in specs] == expected
        swarms = {spec.swarm for spec in specs if spec is not None and spec.swarm is not None}
        assert len(swarms) == expected.count(True)


def test_a_campaign_counts_its_swarm_batches_and_the_rules_they_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(campaign, "SWARM_FROM", 4)
    argv = ["--machine", "cache", "--impl", "reference", "--examples", "300", "--batch", "25", "--steps", "10"]
    argv += ["--workers", "0"]
    args = campaign.parse_args([*argv, "--seed", "3", "--out", str(tmp_path), "--json", str(tmp_path / "s.json")])
    out = io.StringIO()
    assert campaign.run(args, out) == 0
    rules = json.loads((tmp_path / "s.json").read_text())["rules"]
    assert rules["swarm[cache] batches"] == 2
    assert sum(count for rule, count in rules.items() if rule.startswith("swarm[cache] off: ")) > 2
    assert "swarm batches: cache 2" in out.getvalue()


def test_past_the_first_batches_every_fourth_batch_is_a_production_batch() -> None:
    """Production batches (production pools drawn) start at PRODUCTION_FROM, on the deep batches that are not swarm
    batches; a campaign of a few hundred examples (the suite's) runs none."""
    expected = [False] * campaign.PRODUCTION_FROM + [False, True, False, False] * 2
    run = campaign.Campaign(campaign.parse_args(["--machine", "hybrid", "--minutes", "1"]), io.StringIO())
    run.start = time.time()
    run.machines = {"hybrid": campaign.MachineState("hybrid")}
    specs = [run.next_spec() for _ in range(len(expected))]
    assert [spec is not None and spec.production for spec in specs] == expected
    assert not any(spec is not None and spec.production and spec.swarm is not None for spec in specs)
