"""The engine releases the targets support: checked before a campaign, named when refused, installable."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from radixspec.fuzz import campaign
from radixspec.fuzz.targets import TargetError, releases
from radixspec.fuzz.targets.__main__ import main as targets_main


def test_each_engine_supports_its_two_newest_releases_by_name() -> None:
    # Dynamo's router index: the one release its relay was written from
    assert releases.RELEASES == {"sglang": ("0.5.22", "0.5.23"), "vllm": ("0.32.0", "0.33.0"), "dynamo": ("1.6.1",)}
    assert releases.distribution("dynamo") == "ai-dynamo-runtime"
    assert releases.parse_requirement("sglang==0.5.22") == ("sglang", "0.5.22")
    assert releases.parse_requirement("vllm") == ("vllm", "0.33.0")
    with pytest.raises(TargetError, match="radixspec drives 0.5.22 and 0.5.23"):
        releases.parse_requirement("sglang==0.5.21")
    with pytest.raises(TargetError, match="no engine 'lmdeploy'"):
        releases.parse_requirement("lmdeploy")


def test_an_unsupported_installed_release_is_refused_naming_the_supported_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(
        releases.importlib.metadata, "version", lambda name: "0.5.21" if name == "sglang" else real(name)
    )
    with pytest.raises(TargetError) as refused:
        releases.check_release("sglang")
    assert str(refused.value) == (
        "sglang 0.5.21 is installed; radixspec's sglang targets support 0.5.22 and 0.5.23"
        " (radixspec targets install sglang==0.5.23)"
    )
    # a package of no engine, or an engine not installed, is not this check's business
    releases.check_release("pytest")
    monkeypatch.setattr(releases, "installed_release", lambda package: None)
    releases.check_release("sglang")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_a_campaign_on_an_unsupported_release_exits_2_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(releases, "installed_release", lambda package: "0.5.21")
    with pytest.raises(SystemExit) as exit_info:
        campaign.parse_args(["--target", "sglang:legacy"])
    assert exit_info.value.code == 2
    assert "support 0.5.22 and 0.5.23" in capsys.readouterr().err


def test_install_takes_the_wheel_without_its_dependencies_and_the_light_packages_with_theirs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess

    ran: list[list[str]] = []
    monkeypatch.setattr(
        subprocess, "run", lambda command, check: ran.append(command[3:]) or subprocess.CompletedProcess(command, 0)
    )
    monkeypatch.setattr("radixspec.fuzz.targets.__main__.resolve", lambda name: None)
    assert targets_main(["install", "dynamo"]) == 0
    assert ran == [
        ["install", "--quiet", "--no-deps", "ai-dynamo-runtime==1.6.1"],
        ["install", "--quiet", "pydantic", "uvloop"],
    ]
    assert "dynamo: ready (radixspec fuzz --machine router --target dynamo --minutes 1)" in capsys.readouterr().out


def test_installing_an_unsupported_release_is_refused_before_pip_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert targets_main(["install", "sglang==0.5.21"]) == 2
    assert "radixspec drives 0.5.22 and 0.5.23" in capsys.readouterr().err
