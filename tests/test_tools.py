"""The maintainer tools live in tools/ of a checkout, not in the installed package; outside one they say so."""

import subprocess
import sys
from pathlib import Path

import pytest

from tools.checkout import ROOT, find_root


def test_the_tools_find_the_checkout_they_live_in() -> None:
    assert find_root() == ROOT == Path(__file__).resolve().parent.parent
    assert (ROOT / "csrc" / "tree.c").exists()


def test_outside_a_checkout_a_tool_exits_with_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "spec").mkdir()
    with pytest.raises(SystemExit, match=r"lacks pyproject.toml, csrc, fuzz .*clone the repository"):
        find_root(tmp_path)


def test_the_router_fault_table_has_a_row_per_fault_and_way_of_applying_batches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("msgspec")
    from tools import router_faults

    assert router_faults.main(["--router", "radixspec-router", "--examples", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| router | batches applied | fault | injected | router right again")
    cells = [line.split(" | ") for line in lines[2:]]
    assert {(cell[1], cell[2]) for cell in cells} <= {
        (mode, kind) for mode in router_faults.MODES for kind in router_faults.FAULTS
    }
    sequenced = {cell[2]: cell for cell in cells if cell[1] == "sequenced + replay"}
    # with the replay, a lost batch ends in sync; a silent restart never does
    assert int(sequenced["drop"][5]) > 0 and sequenced["silent_restart"][5] == "0"


def test_a_planted_bug_whose_target_cannot_start_is_skipped_and_counted_apart(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from radixspec.fuzz.targets import TargetError
    from tools import planted

    def not_installed(name: str) -> None:
        raise TargetError(f"target {name!r} needs dynamo (radixspec targets install dynamo)")

    def never(*args: object) -> None:
        raise AssertionError("no campaign runs for a bug whose target cannot start")

    monkeypatch.setattr(planted, "resolve", not_installed)
    monkeypatch.setattr(planted, "run_one", never)
    dynamo_bugs = [bug for bug in planted.BUGS if bug.impl == "dynamo"]
    assert planted.main(["--impl", "dynamo"]) == 1
    out = capsys.readouterr().out
    assert f"0 of 0 run caught (0 missed, 0 errors); {len(dynamo_bugs)} skipped, their target not ready" in out
    assert "skipped: dynamo: target 'dynamo' needs dynamo (radixspec targets install dynamo)" in out
    assert "not caught" not in out and "MISSED" not in out
    assert planted.main(["--impl", "dynamo", "--allow-skips"]) == 0


def test_a_planted_bug_on_our_implementations_is_never_skipped() -> None:
    from tools import planted

    assert all(planted.cannot_start(bug) is None for bug in planted.BUGS if bug.impl in ("reference", "optimized"))


def test_bench_compare_names_a_workload_slower_than_the_threshold_a_regression_with_its_ratio() -> None:
    from tools.bench_compare import Measured, Workload, regressions, table

    # the manager machine at half its past speed (steps/s), the exhaustive checker 2.3x as long (seconds)
    manager = Measured(Workload("machine", "manager", 300), ref=[655.0, 640.0, 660.0], this=[354.0, 330.0, 350.0])
    cache = Measured(Workload("machine", "cache", 300), ref=[169.0, 170.0, 168.0], this=[608.0, 600.0, 610.0])
    deep = Measured(Workload("exhaustive", "manager", 5), ref=[35.0, 36.0, 34.0], this=[81.4, 80.0, 82.0])
    assert [r.workload.name for r in regressions([manager, cache, deep], 0.9)] == [
        "manager machine",
        "exhaustive manager depth 5",
    ]
    assert deep.median_ratio() == pytest.approx(35.0 / 81.4) and cache.median_ratio() > 3.5
    lines = table([manager, cache, deep], "79b4c1f", 0.9)
    assert "0.54x" in lines[1] and lines[1].endswith("REGRESSION") and lines[2].endswith("ok")


def test_bench_compare_judges_the_rounds_that_ran_the_same_program_when_there_are_any() -> None:
    from tools.bench_compare import Measured, Workload, table

    # rounds 1 and 3 ran other programs on the two trees (a longer prompt costs more per step): not the code
    scheduler = Measured(
        Workload("machine", "scheduler", 66),
        ref=[700.0, 335.0, 288.0],
        this=[230.0, 350.0, 210.0],
        same=[False, True, False],
    )
    assert scheduler.judged() == [pytest.approx(350.0 / 335.0)] and scheduler.median_ratio() > 1.0
    assert table([scheduler], "79b4c1f", 0.9)[1].split()[-2:] == ["1/3", "ok"]
    # no round alike: every round is read
    scheduler.same = [False, False, False]
    assert scheduler.median_ratio() == pytest.approx(210.0 / 288.0)  # the median of 0.33x, 1.04x and 0.73x


def test_bench_compare_runs_a_tree_from_before_the_move_under_radixspec_as_python_m_fuzz(tmp_path: Path) -> None:
    from tools.bench_compare import Tree

    assert Tree("this", ROOT).module == "radixspec.fuzz"
    (tmp_path / "fuzz").mkdir()
    assert Tree("79b4c1f", tmp_path).module == "fuzz"


def test_bench_batch_builds_one_batch_shape_from_either_trees_batch_spec() -> None:
    import types
    from dataclasses import dataclass

    from tools.bench_batch import batch_spec

    @dataclass(frozen=True)
    class Before:  # 79b4c1f's BatchSpec: our implementations as impls, a foreign target apart, no shallow batches
        machine: str
        impls: tuple[str, ...]
        target: str | None
        lru: str | None
        device: str
        seed: int
        examples: int
        steps: int
        shrink: bool
        start: float
        deadline: float

    from radixspec.fuzz.batches import BatchSpec

    old = batch_spec(types.SimpleNamespace(BatchSpec=Before), "manager", 7, 100, 80)
    new = batch_spec(types.SimpleNamespace(BatchSpec=BatchSpec), "manager", 7, 100, 80)
    assert (old.impls, old.target) == (("reference", "optimized"), None)
    assert new.targets == ("reference", "optimized") and new.shallow is False and new.shrink is False
    for spec in (old, new):
        assert (spec.machine, spec.seed, spec.examples, spec.steps) == ("manager", 7, 100, 80)


def test_bench_batch_measures_a_machine_of_this_tree_and_refuses_one_that_broke(tmp_path: Path) -> None:
    import json
    import os

    from tools.bench_compare import DRIVER

    # this checkout's modules, run from elsewhere: Hypothesis keeps its files (.hypothesis/) where it runs
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-c", DRIVER.read_text(), "--machine", "kv", "--examples", "3", "--steps", "5"]
    done = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["steps"] > 0 and figures["steps_per_s"] == pytest.approx(
        figures["steps"] / figures["seconds"], rel=0.05
    )  # seconds rounded to 1 ms
    broken = subprocess.run(
        [*run[:4], "no-such-machine", *run[5:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert broken.returncode != 0 and "did not run clean" in broken.stderr


def test_coverage_classes_sets_apart_what_no_target_draws_and_keeps_the_reach_gaps(tmp_path: Path) -> None:
    """The union of two campaigns' coverage: a line either reached is reached; each line left is put in the class
    of the function it is in, and the module's share is given over the lines outside the classes set apart."""
    import json

    from tools.coverage_classes import UNCLASSED, main, union

    source = tmp_path / "block_pool.py"
    source.write_text(
        "def resolve_kv_cache_block_sizes(x):\n    a = x\n    return a\n\n\n"
        "class BlockPool:\n    def get_new_blocks(self, n):\n        b = n\n        return b\n"
    )
    entry = {"module": "vllm.v1.core.block_pool", "path": str(source), "statements": 10}
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"coverage": [dict(entry, missing_lines=[2, 3, 8, 9])]}))
    second.write_text(json.dumps({"coverage": [dict(entry, missing_lines=[2, 3, 9])]}))
    module = union([first, second])["vllm.v1.core.block_pool"]
    assert module.missing == {2, 3, 9}
    module.classify()
    assert module.classes == {
        "start-up sizing (run once as the engine sizes its pool, never by the cache after)": {
            "resolve_kv_cache_block_sizes": 2
        },
        UNCLASSED: {"BlockPool.get_new_blocks": 1},
    }
    assert module.report()[0].endswith("7 reached (70.0 %); of the 8 outside the classes set apart, 87.5 %")
    empty = tmp_path / "none.json"
    empty.write_text(json.dumps({"coverage": None}))
    assert main([str(empty)]) == 2
