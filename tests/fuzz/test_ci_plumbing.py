"""What a CI job needs of a campaign: a fresh seed that is printed and reproduces, the CPUs it may use, a JUnit
report, a versioned JSON summary."""

import io
import json
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from radixspec.fuzz import campaign, cli
from radixspec.fuzz.summary import SCHEMA_VERSION

# what an installed wheel must do: CI runs this module against the wheel too (.ci/installed)
pytestmark = pytest.mark.installed

FAILING = ["--target", "tests.targets.toy:ForgetfulToyCache", "--machine", "cache", "--no-shrink"]


def run(tmp_path: Path, *args: str) -> int:
    return campaign.main(["--workers", "0", "--quiet", "--out", str(tmp_path / "out"), *args])


def summary_of(tmp_path: Path, *args: str) -> str:
    out = io.StringIO()
    options = ["--target", "reference", "--machine", "cache", "--examples", "3", "--workers", "0", "--quiet", *args]
    assert campaign.run(cli.parse_args([*options, "--out", str(tmp_path / "out")]), out=out) == 0
    return out.getvalue()


def test_the_seed_is_fresh_unless_given_and_the_summary_says_how_to_rerun(tmp_path: Path) -> None:
    seeds = [cli.parse_args(["--target", "reference"]).seed for _ in range(4)]
    assert len(set(seeds)) > 1, "the default seed is not fresh"
    given = cli.parse_args(["--target", "reference", "--seed", "7"])
    assert (given.seed, given.fresh_seed) == (7, False)
    assert "seed 11: radixspec fuzz --seed 11 with the same options reruns it" in summary_of(tmp_path, "--seed", "11")
    assert "(fresh): radixspec fuzz --seed" in summary_of(tmp_path)


def test_workers_default_to_the_cpus_of_the_affinity_mask_and_the_cgroup_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cli.cgroup_cpu_quota(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cli.cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cli.cgroup_cpu_quota(tmp_path) == 3
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cli.cgroup_cpu_quota(tmp_path) is None
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(cli, "cgroup_cpu_quota", lambda: 2)
    assert cli.available_cpus() == 2
    monkeypatch.setattr(cli, "cgroup_cpu_quota", lambda: None)
    assert cli.available_cpus() == 8
    assert cli.parse_args(["--target", "reference"]).workers == 8


def test_a_failing_campaign_writes_junit_and_a_versioned_json_naming_its_regression_file(tmp_path: Path) -> None:
    status = run(
        tmp_path,
        *FAILING,
        "--examples",
        "300",
        "--seed",
        "3",
        "--json",
        str(tmp_path / "summary.json"),
        "--junit-xml",
        str(tmp_path / "junit.xml"),
    )
    assert status == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["schema_version"] == SCHEMA_VERSION and summary["seed"] == 3
    assert not summary["seed_was_fresh"]
    versions = summary["versions"]
    assert {"radixspec", "python", "hypothesis", "torch", "targets"} <= set(versions)
    assert list(versions["targets"]) == ["tests.targets.toy:ForgetfulToyCache"]
    (failure,) = summary["failures"]
    regression = Path(failure["regression_test"])
    assert regression.exists() and "campaign: radixspec fuzz --seed 3" in regression.read_text()
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert (suite.tag, suite.get("tests"), suite.get("failures")) == ("testsuite", "1", "1")
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert properties["seed"] == "3" and properties["radixspec"] == versions["radixspec"]
    (case,) = suite.iter("testcase")
    (element,) = case.iter("failure")
    assert case.get("name") == "cache[tests.targets.toy:ForgetfulToyCache]"
    assert f"regression test: {regression}" in (element.text or "") and "state = " in (element.text or "")


def test_a_clean_campaign_writes_a_junit_case_per_machine_without_failures(tmp_path: Path) -> None:
    args = ["--target", "reference", "--machine", "all", "--examples", "2", "--junit-xml", str(tmp_path / "j.xml")]
    assert run(tmp_path, *args) == 0
    suite = ET.parse(tmp_path / "j.xml").getroot()
    names = [case.get("classname") for case in suite.iter("testcase")]
    machines = ("cache", "manager", "scheduler", "kv", "hybrid", "hostile", "tiered")
    assert names == [f"radixspec.fuzz.{name}" for name in machines]
    assert suite.get("failures") == "0" and not list(suite.iter("failure"))
