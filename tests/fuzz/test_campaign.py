"""``radixspec fuzz``: a clean campaign, a planted bug with its regression file, the CLI's honesty, workers, corpus."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixspec.fuzz import campaign, report
from radixspec.reference.radix_cache import RadixPrefixCache
from tools.planted import BUGS, PEER_BUGS, ROOT


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    # seed 0 unless a test names one: a test's verdict must not depend on a fresh seed's draw
    seed = [] if "--seed" in argv else ["--seed", "0"]
    status = campaign.run(campaign.parse_args(["--workers", "0", *seed, *argv]), out)
    return status, out.getvalue()


def test_a_clean_campaign_passes_and_prints_a_summary(tmp_path: Path) -> None:
    status, text = run(
        "--machine",
        "all",
        "--examples",
        "8",
        "--batch",
        "4",
        "--steps",
        "20",
        "--quiet",
        "--json",
        str(tmp_path / "s.json"),
    )
    assert status == 0, text
    assert "== summary ==" in text and "failures: none" in text
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["examples"] >= 32 and summary["failures"] == []
    for key in ("steps", "steps_per_s", "calls", "calls_per_s", "largest_tree_pages", "longest_key_tokens", "rules"):
        assert key in summary, key
    # the hybrid machine's bursts and served requests nest rule calls in one step; the summary names them
    assert summary["calls"] > summary["steps"] > 0 and f"rule calls {summary['calls']} " in text
    assert any(rule.startswith("cache.match_prefix") for rule in summary["rules"])
    # the radix depth is observed on every insert, not only by the deep-chain rule
    assert summary["deepest_path_nodes"] >= 1 and summary["largest_tree_pages"] >= 1
    assert any(rule.startswith("manager.admit") for rule in summary["rules"])
    # --quiet: a short summary, no line per rule
    assert "distinct" in text and "  cache.match_prefix" not in text


def test_figures_no_machine_recorded_are_not_shown_as_zeros() -> None:
    status, text = run("--machine", "kv", "--examples", "2", "--batch", "2", "--steps", "5", "--quiet")
    assert status == 0, text
    reach = next(line for line in text.splitlines() if line.startswith("reach:"))
    assert "largest tree n/a" in reach and "deepest path n/a" in reach
    assert re.search(r"largest KV store \d+ rows", reach), reach


def test_the_counts_list_no_empty_heading() -> None:
    lines: list[str] = []
    counts = campaign.CampaignStats()
    counts.record_rule("cache.match_prefix")
    report.print_counts(lambda *parts: lines.append(" ".join(map(str, parts))), counts)
    assert "cache.match_prefix" in "\n".join(lines) and "rejected calls" not in "\n".join(lines)
    counts.record_rejection(ValueError)
    report.print_counts(lambda *parts: lines.append(" ".join(map(str, parts))), counts)
    assert "rejected calls" in "\n".join(lines)


def test_by_default_the_campaign_is_the_differential_of_every_implementation() -> None:
    args = campaign.parse_args([])
    assert args.targets == ("reference", "optimized") and args.machine == "all"
    from radixspec.fuzz.machines import machine_class
    from radixspec.fuzz.registry import MACHINES
    from radixspec.fuzz.targets.layers import our_hybrid_caches, our_tiered_caches

    assert tuple(MACHINES) == campaign.MACHINE_NAMES
    # every entry of the registry names a machine class that exists
    for name in MACHINES:
        assert machine_class(name).__name__ == MACHINES[name].attribute
    # the hybrid machine joins when every selected implementation has a hybrid twin
    hybrid = set(args.targets) <= set(our_hybrid_caches())
    # the router machine runs only when a router target is selected, the offload machine only when an offloading
    # manager is (we have none); the tiered one, as the hybrid one, when every selected implementation has a tiered
    # twin (both of ours have)
    tiered = set(args.targets) <= set(our_tiered_caches())
    expected = [
        name
        for name in campaign.MACHINE_NAMES
        if (name != "hybrid" or hybrid)
        and (name != "tiered" or tiered)
        and name not in ("router", "offload", "planner")
    ]
    assert "tiered" in expected
    assert campaign.machines_for(args.targets, args.foreign) == expected
    assert "hybrid" in campaign.machines_for(("reference",), {})
    assert "tiered" in campaign.machines_for(("reference",), {})


@pytest.mark.parametrize("core", ["python", "rust"])
def test_sglang_swa_runs_a_clean_campaign_in_its_own_process(core: str, tmp_path: Path) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    command = [
        sys.executable,
        "-m",
        "radixspec.fuzz",
        "--target",
        f"sglang-swa:{core}",
        "--seed",
        "0",
        "--examples",
        "30",
        "--workers",
        "0",
    ]
    run = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "machines hybrid" in run.stdout and "hybrid.match_req" in run.stdout


def test_the_sglang_swa_manager_tells_its_page_count_for_the_reach() -> None:
    """The hybrid machine reads a foreign manager's reach through the CountsPages capability (it read a method
    sglang-swa did not have: its largest tree was never recorded)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    script = (
        "from radixspec.fuzz.targets import resolve\n"
        "from radixspec.fuzz.targets.api import CountsPages\n"
        "from radixspec.reference.hybrid_manager import HybridReq\n"
        "manager = resolve('sglang-swa:python', check=False).hybrid_factory(1, (None, 4), 16)\n"
        "assert isinstance(manager, CountsPages) and manager.cached_page_count() == 0\n"
        "req = HybridReq(0, [1, 2, 3, 4, 5], None)\n"
        "manager.match_req(req)\n"
        "manager.allocate_paged(req, 5)\n"
        "manager.store(req, 5)\n"
        "manager.cache_req(req, True)\n"
        "print(manager.cached_page_count())\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "5", run.stdout[-2000:] + run.stderr[-2000:]


def test_the_vllm_hybrid_target_runs_in_the_hybrid_machine_only() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    args = campaign.parse_args(["--target", "vllm-hybrid"])
    assert campaign.machines_for(args.targets, args.foreign) == ["hybrid"]


def test_impl_and_target_are_two_spellings_of_one_selection() -> None:
    assert campaign.parse_args(["--impl", "reference"]).targets == ("reference",)
    assert campaign.parse_args(["--target", "reference"]).targets == ("reference",)
    both = campaign.parse_args(["--impl", "optimized", "--target", "reference", "--target", "optimized"])
    assert both.targets == ("optimized", "reference")


def test_a_usage_error_does_not_wait_for_torch() -> None:
    probe = (
        "import sys\n"
        "from radixspec.fuzz import campaign\n"
        "try:\n"
        "    campaign.parse_args(['--machine', 'nope'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported before the arguments were parsed'\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_failure_is_reported_with_its_difference_and_a_regression_file_that_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    original = RadixPrefixCache.lock

    def lock_from_parent(self: RadixPrefixCache, handle: object) -> None:  # mini-sglang issue #52
        checked = self._check_handle(handle)
        if checked.node.parent is not None and checked.node.parent.parent is not None:
            original(self, type(checked)(checked.cached_len, checked.node.parent, checked.namespace, self))

    monkeypatch.setattr(RadixPrefixCache, "lock", lock_from_parent)
    out = tmp_path / "failures"
    status, text = run(
        "--machine",
        "cache",
        "--examples",
        "300",
        "--no-shrink",
        "--quiet",
        "--out",
        str(out),
        "--json",
        str(tmp_path / "s.json"),
    )
    assert status == 1
    assert "failing example found" in text and "failures: 1" in text
    # bounded output: the summary and the program fit a terminal; the file holds the rest
    assert max(len(line) for line in text.splitlines()) <= 420
    assert "@reproduce_failure" not in text
    # the difference itself is printed, not only its class
    assert "size_info: spec" in text or "differs from spec" in text or "ref_count" in text
    (failure,) = json.loads((tmp_path / "s.json").read_text())["failures"]
    assert failure["machine"] == "cache" and failure["found_after_s"] <= failure["reported_after_s"]
    test_file = Path(failure["regression_test"])
    assert test_file.exists() and "build_machine('cache'" in test_file.read_text()
    # the file fails while the bug is in (run in this process: the monkeypatch is in force)
    namespace: dict[str, object] = {}
    exec(compile(test_file.read_text(), str(test_file), "exec"), namespace)
    test = next(value for name, value in namespace.items() if name.startswith("test_"))
    with pytest.raises(Exception):  # noqa: B017  (whatever the bug breaks first)
        test()  # type: ignore[operator]
    monkeypatch.undo()
    test()  # type: ignore[operator]


def test_a_hybrid_machine_failure_writes_a_regression_file_that_replays_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The hybrid machine's setup draws plain arguments: its program replays (it drew through st.data(), and
    its regression files failed with NameError: data)."""
    from radixspec.reference.hybrid_cache import HybridRadixCache

    original = HybridRadixCache.match_len

    def short(self: HybridRadixCache, path: object, whole_pages: int) -> int:
        return max(0, original(self, path, whole_pages) - self.page_size)  # type: ignore[arg-type]

    monkeypatch.setattr(HybridRadixCache, "match_len", short)
    status, _ = run(
        "--machine", "hybrid", "--target", "reference", "--examples", "300", "--no-shrink", "--quiet",
        "--out", str(tmp_path), "--json", str(tmp_path / "s.json"),
    )  # fmt: skip
    assert status == 1
    (failure,) = json.loads((tmp_path / "s.json").read_text())["failures"]
    source = Path(failure["regression_test"]).read_text()
    assert "build_machine('hybrid'" in source and "data(" not in source
    namespace: dict[str, object] = {}
    exec(compile(source, "regression", "exec"), namespace)
    test = next(value for name, value in namespace.items() if name.startswith("test_"))
    with pytest.raises(AssertionError):
        test()  # type: ignore[operator]
    monkeypatch.undo()
    test()  # type: ignore[operator]


@pytest.mark.parametrize(
    "argv",
    [
        ["--minutes", "0"],
        ["--minutes", "-1"],
        ["--examples", "0"],
        ["--steps", "0"],
        ["--batch", "0"],
        ["--workers", "-1"],
        ["--impl", "foo"],
        ["--machine", "foo"],
        ["--target", "nope"],
        ["--lru", "sync"],
        ["--minutes", "1", "--examples", "3"],
        ["--impl", "reference", "--target", "sglang"],
        ["--target", "reference", "--machine", "scheduler", "--target", "tests.targets.toy:ToyCache"],
    ],
)
def test_bad_options_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        campaign.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_planted_demo_rejects_an_unknown_machine() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.planted", "--machine", "foo"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_every_planted_bug_still_applies_to_the_tree() -> None:
    for bug in BUGS:
        assert (ROOT / bug.path).read_text().count(bug.old) == 1, bug.name
    assert all(bug.peer == "sglang" for bug in PEER_BUGS)


def test_worker_processes_run_a_campaign_within_its_budget(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [
            *(
                sys.executable,
                "-m",
                "radixspec.fuzz",
                "--seed",
                "0",
                "--machine",
                "cache",
                "--minutes",
                "0.25",
                "--workers",
                "2",
                "--quiet",
            ),
            *("--json", str(tmp_path / "s.json")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.monotonic() - started < 15 + 10 + 10  # budget + 10 s, plus interpreter start
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["backend"] == "2 worker processes" and summary["examples"] > 0


def test_a_rerun_with_a_corpus_replays_the_saved_failure_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(RadixPrefixCache, "evict", lambda self, size: [])  # evicts nothing: caught at once
    db = str(tmp_path / "corpus")
    first_status, _ = run("--machine", "cache", "--examples", "200", "--no-shrink", "--quiet", "--db", db)
    assert first_status == 1
    second_status, text = run("--machine", "cache", "--examples", "200", "--no-shrink", "--quiet", "--db", db)
    assert second_status == 1
    assert "saved failing examples of cache; they are replayed first" in text


def test_help_shows_the_defaults_that_mean_something(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        campaign.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("examples per batch (default: 40)", "steps per example (default: 80)", "default: a fresh one"):
        assert shown in text, shown
    assert "(default: fuzz-failures)" in text and "all (the three-way differential)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_a_failure_announced_by_a_batch_that_never_returned_still_fails_the_campaign() -> None:
    # found by the campaign itself: a batch shrinking past the budget's grace was cancelled, and its failure,
    # already printed, was dropped (summary "failures: none", exit 0)
    out = io.StringIO()
    run = campaign.Campaign(campaign.parse_args(["--machine", "cache"]), out)
    run.machines = {"cache": campaign.MachineState("cache")}
    run.on_notify("cache", 7, "IndexError: pop from empty list", time.time())
    run.keep_announced()
    failure = run.machines["cache"].failure
    assert failure is not None and failure.seed == 7 and failure.error == "IndexError: pop from empty list"
    assert not failure.shrunk and "did not return" in out.getvalue()


def test_a_failure_report_keeps_only_the_program_steps() -> None:
    """Hypothesis's '(and 2 more with settings.verbosity >= verbose)' note is not a step: the program stays Python."""
    from radixspec.fuzz.batches import BatchSpec, failure_report

    spec = BatchSpec("cache", ("reference",), None, "cpu", 1, 10, 10, True, 0.0, 1.0, None)
    error = AssertionError("differs")
    for note in (
        "state = CacheMachine()",
        "(seqs_0, seqs_1) = state.setup(page_size=1)",
        "state.evict(fraction=25, size='some')",
        "state.teardown()",
        "(and 2 more with settings.verbosity >= verbose)",
        "Hypothesis replays the same example with: @reproduce_failure('6.170.17', b'AXic') as a decorator",
    ):
        error.add_note(note)
    report = failure_report(spec, error, 1.0, 2.0)
    assert report.program == [
        "state = CacheMachine()",
        "(seqs_0, seqs_1) = state.setup(page_size=1)",
        "state.evict(fraction=25, size='some')",
        "state.teardown()",
    ]
    compile("\n".join(report.program), "program", "exec")
    assert report.reproduce == "@reproduce_failure('6.170.17', b'AXic')"


def test_every_other_batch_of_a_machine_is_shallow_and_its_failures_replay_shallow() -> None:
    from radixspec.fuzz.batches import failure_report
    from radixspec.fuzz.profiles import SHALLOW_STEPS
    from radixspec.fuzz.regression import build_machine, regression_source

    out = io.StringIO()
    run = campaign.Campaign(campaign.parse_args(["--machine", "cache", "--minutes", "1"]), out)
    run.start = time.time()
    run.machines = {"cache": campaign.MachineState("cache")}
    specs = [run.next_spec() for _ in range(4)]
    assert [(s.shallow, s.steps) for s in specs if s] == [
        (True, SHALLOW_STEPS),
        (False, run.args.steps),
        (True, SHALLOW_STEPS),
        (False, run.args.steps),
    ]
    error = AssertionError("differs")
    error.add_note("state = CacheMachine()")
    report = failure_report(specs[0], error, 1.0, 2.0)  # type: ignore[arg-type]
    assert report.shallow
    source = regression_source(
        ["state = CacheMachine()"], "cache", ("reference",), None, "cpu", 1, "e", False, "t.py", "", report.shallow
    )
    assert (
        "build_machine('cache', targets=('reference',), lru=None, device='cpu', shallow=True, production=False)()"
        in source
    )
    assert build_machine("cache", ("reference",), shallow=True).SHALLOW  # type: ignore[attr-defined]
    assert not build_machine("cache", ("reference",)).SHALLOW  # type: ignore[attr-defined]


def test_a_regression_file_replays_the_pool_its_batch_ran() -> None:
    """Outside a production batch a production pool drawn runs as a big one: the file of a failure there says so
    and replays that pool; a production batch's keeps the pool drawn."""
    from radixspec.fuzz.batches import BatchSpec, failure_report
    from radixspec.fuzz.regression import build_machine, regression_source

    error = AssertionError("differs")
    error.add_note("state = HybridMachine()")
    for production, pages in ((False, 41 + 5000 % 360), (True, 5000)):
        spec = BatchSpec("hybrid", ("reference",), None, "cpu", 1, 0, 0, True, 0.0, 0.0, production=production)
        report = failure_report(spec, error, 1.0, 2.0)
        source = regression_source(
            report.program, "hybrid", ("reference",), None, "cpu", 1, "e", False, "t.py", production=report.production
        )
        assert f"device='cpu', production={production})()" in source
        state = build_machine("hybrid", ("reference",), production=production)()
        state.setup(page_size=4, num_pages=5000, windows=[None], first=[([1], [1])])
        assert state.num_pages == pages
