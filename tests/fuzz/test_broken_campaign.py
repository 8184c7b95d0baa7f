"""A campaign that could not run says so everywhere: exit 3, the last lines of its summary, the JSON and the JUnit
report; it never reads "failures: none" as a clean campaign does."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from radixspec.fuzz import backends, batches, campaign, registry
from radixspec.fuzz.cli import EXIT_BROKEN

# what an installed wheel must do: CI runs this module against the wheel too (.ci/installed)
pytestmark = pytest.mark.installed


def run(tmp_path: Path, *argv: str) -> tuple[int, str, dict[str, object], ET.Element]:
    out = io.StringIO()
    reports = ["--json", str(tmp_path / "s.json"), "--junit-xml", str(tmp_path / "j.xml"), "--out", str(tmp_path)]
    args = campaign.parse_args(["--workers", "0", "--seed", "0", "--quiet", *reports, *argv])
    status = campaign.run(args, out)
    return status, out.getvalue(), json.loads((tmp_path / "s.json").read_text()), ET.parse(tmp_path / "j.xml").getroot()


def last_lines(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-3:])


@pytest.fixture
def planted_import_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The manager machine's module raises ImportError when a batch imports it (a module left out of a wheel)."""
    (tmp_path / "planted_manager_machine.py").write_text("import radixspec_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = dataclasses.replace(registry.MACHINES["manager"], module="planted_manager_machine")
    monkeypatch.setitem(registry.MACHINES, "manager", entry)
    sys.modules.pop("planted_manager_machine", None)
    return "radixspec_no_such_module"


def test_a_machine_module_that_does_not_import_breaks_the_campaign_and_the_others_still_run(
    tmp_path: Path, planted_import_error: str
) -> None:
    status, text, summary, junit = run(tmp_path, "--machine", "all", "--examples", "2", "--steps", "5")
    assert status == EXIT_BROKEN, text
    assert "failures: none\n" not in text and "failures: none found in what ran" in text
    ending = last_lines(text)
    assert "CAMPAIGN BROKEN (exit 3)" in text and "manager: could not start: ModuleNotFoundError" in ending
    assert planted_import_error in ending
    assert summary["broken"] == [
        {
            "machine": "manager",
            "reason": f"could not start: ModuleNotFoundError: No module named '{planted_import_error}'",
        }
    ]
    examples = summary["machine_examples"]
    assert isinstance(examples, dict) and examples["manager"] == 0 and examples["cache"] >= 2, examples
    assert junit.get("errors") == "1" and junit.get("failures") == "0"
    (error,) = junit.iter("error")
    assert planted_import_error in (error.text or "") and error.get("type") == "radixspec.broken"


def test_a_machine_that_ran_no_example_breaks_the_campaign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the batches' margin before the budget's end is longer than the budget: no batch starts
    monkeypatch.setattr(campaign, "MARGIN_S", 3600.0)
    status, text, summary, junit = run(tmp_path, "--machine", "cache", "--target", "reference", "--minutes", "0.01")
    assert status == EXIT_BROKEN, text
    assert "cache: ran no example: no batch of it started" in last_lines(text)
    assert summary["examples"] == 0 and summary["broken"] == [
        {"machine": "cache", "reason": "ran no example: no batch of it started"}
    ]
    assert junit.get("errors") == "1"


def test_a_backend_that_cannot_start_still_writes_the_summary_and_the_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(args: object) -> backends.InProcessBackend:
        raise RuntimeError("cannot reach Ray at 'ray://nowhere:1'")

    monkeypatch.setattr(campaign, "make_backend", unreachable)
    status, text, summary, junit = run(tmp_path, "--machine", "cache", "--target", "reference", "--examples", "2")
    assert status == EXIT_BROKEN, text
    assert "campaign: cannot reach Ray" in text and "cache: ran no example" in text
    assert {"machine": None, "reason": "cannot reach Ray at 'ray://nowhere:1'"} in summary["broken"]  # type: ignore[operator]
    cases = [case.get("name") for case in junit.iter("testcase")]
    assert "campaign" in cases and junit.get("errors") == "2" and junit.get("tests") == str(len(cases))


def test_a_worker_that_dies_breaks_the_campaign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class DyingBackend(backends.InProcessBackend):
        def collect(self, timeout: float, notify: batches.Notify) -> list[batches.BatchResult]:
            raise backends.BackendError("a worker process failed: BrokenProcessPool()")

    monkeypatch.setattr(campaign, "make_backend", DyingBackend)
    status, text, summary, _ = run(tmp_path, "--machine", "cache", "--target", "reference", "--examples", "2")
    assert status == EXIT_BROKEN and "campaign: a worker process failed" in last_lines(text), text
    assert summary["broken"][0]["machine"] is None  # type: ignore[index]


def test_a_batch_in_a_worker_process_reports_a_machine_that_cannot_start(tmp_path: Path) -> None:
    # the same path in a worker process of its own (the fork server imports the machines afresh)
    args = campaign.parse_args(["--workers", "1", "--machine", "cache", "--target", "reference"])
    backend = backends.ProcessBackend(args)
    try:
        spec = batches.BatchSpec("no-such-machine", ("reference",), None, "cpu", 0, 1, 5, False, 0.0, float("inf"))
        backend.submit(spec)
        results: list[batches.BatchResult] = []
        while backend.busy():
            results += backend.collect(timeout=30.0, notify=lambda *a: None)
    finally:
        backend.close()
    (result,) = results
    assert result.error == "KeyError: 'no-such-machine'" and result.stats.examples == 0
