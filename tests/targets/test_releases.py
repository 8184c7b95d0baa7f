"""The engine releases the targets support: checked before a campaign, named when refused, installable."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from radixspec.fuzz import campaign
from radixspec.fuzz.targets import TargetError, releases, resolve
from radixspec.fuzz.targets.__main__ import main as targets_main

# what an installed wheel must do: CI runs this module against the wheel too (.ci/installed)
pytestmark = pytest.mark.installed


def test_each_engine_supports_its_two_newest_releases_by_name() -> None:
    # Dynamo's router index: the one release its relay was written from; TokenSpeed's scheduler: its one release on
    # PyPI (2026-12-05)
    assert releases.RELEASES == {
        "sglang": ("0.5.22", "0.5.23"),
        "vllm": ("0.32.0", "0.33.0"),
        "dynamo": ("1.6.1",),
        "tokenspeed": ("0.1.42",),
    }
    assert releases.distribution("dynamo") == "ai-dynamo-runtime"
    assert releases.distribution("tokenspeed") == "tokenspeed-scheduler"
    assert releases.parse_requirement("sglang==0.5.22") == ("sglang", "0.5.22")
    assert releases.parse_requirement("vllm") == ("vllm", "0.33.0")
    with pytest.raises(TargetError, match="radixspec drives 0.5.22 and 0.5.23"):
        releases.parse_requirement("sglang==0.5.21")
    with pytest.raises(TargetError, match="no engine 'lmdeploy'"):
        releases.parse_requirement("lmdeploy")


def test_an_engine_imported_under_another_name_has_its_release_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    # the tokenspeed target requires the import name tokenspeed_scheduler; its release is the engine's
    real = importlib.metadata.version
    monkeypatch.setattr(
        releases.importlib.metadata,
        "version",
        lambda name: "0.1.40" if name == "tokenspeed-scheduler" else real(name),
    )
    with pytest.raises(TargetError, match="tokenspeed 0.1.40 is installed; radixspec's tokenspeed targets support"):
        releases.check_release("tokenspeed_scheduler")


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


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_the_campaign_header_names_the_release_that_runs_beside_the_profile_written_for_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    # the sglang profile is written for 0.5.23; a campaign on 0.5.22 says which release it runs
    monkeypatch.setattr(campaign, "installed_release", lambda package: "0.5.22" if package == "sglang" else None)
    out = io.StringIO()
    args = campaign.parse_args(["--target", "sglang", "--examples", "1", "--steps", "5", "--workers", "0"])
    assert campaign.run(args, out=out) == 0
    header = out.getvalue().splitlines()[0]
    assert "profile: sglang 0.5.23 UnifiedRadixCache FULL" in header
    assert "; running sglang 0.5.22)" in header


def test_install_takes_the_wheel_without_its_dependencies_and_the_light_packages_with_theirs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess

    ran: list[list[str]] = []
    monkeypatch.setattr(
        subprocess, "run", lambda command, check: ran.append(command[3:]) or subprocess.CompletedProcess(command, 0)
    )
    monkeypatch.setattr("radixspec.fuzz.targets.__main__.readiness", lambda names: dict.fromkeys(names))
    assert targets_main(["install", "dynamo"]) == 0
    assert ran == [
        ["install", "--quiet", "--no-warn-conflicts", "--no-deps", "ai-dynamo-runtime==1.6.1"],
        ["install", "--quiet", "--no-warn-conflicts", "pydantic", "uvloop", "msgspec"],
    ]
    assert (
        "dynamo: ready: dynamo (radixspec fuzz --machine router --target dynamo --minutes 1)" in capsys.readouterr().out
    )


def test_install_probes_every_target_of_the_engine_and_names_each_that_is_not_ready(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda command, check: subprocess.CompletedProcess(command, 0))
    probed: list[str] = []

    def readiness(names: list[str]) -> dict[str, str | None]:
        probed.extend(names)
        planted = "target 'sglang-mamba:python' is installed but does not import here: planted"
        return {name: planted if name == "sglang-mamba:python" else None for name in names}

    monkeypatch.setattr("radixspec.fuzz.targets.__main__.readiness", readiness)
    assert targets_main(["install", "sglang"]) == 1
    assert probed == list(releases.VARIANTS["sglang"])
    assert {"sglang", "sglang:python", "sglang:both", "sglang:legacy", "sglang-swa", "sglang-mamba"} <= set(probed)
    out, err = capsys.readouterr()
    assert "sglang: ready: sglang, sglang:python" in out
    assert "sglang: NOT READY: sglang-mamba:python: target 'sglang-mamba:python' is installed but" in err


def test_every_target_of_an_engine_resolves_by_its_listed_name() -> None:
    # a variant the listing names but the targets do not know would be probed as an error after every install
    for engine, variants in releases.VARIANTS.items():
        for variant in variants:
            info = resolve(variant, check=False)
            engines = {releases.ENGINE_OF_IMPORT.get(package, package) for package, _ in info.requires}
            assert info.name == variant and engine in engines, (variant, info)


def test_installing_an_unsupported_release_is_refused_before_pip_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert targets_main(["install", "sglang==0.5.21"]) == 2
    assert "radixspec drives 0.5.22 and 0.5.23" in capsys.readouterr().err


def test_readiness_resolves_each_target_in_a_fresh_interpreter() -> None:
    from radixspec.fuzz.targets import readiness

    found = readiness(["reference", "no.such.module:Cache"])
    assert found["reference"] is None
    assert (
        found["no.such.module:Cache"]
        == "target 'no.such.module:Cache': cannot import 'no.such.module' (No module named 'no')"
    )


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_sglangs_legacy_target_and_its_unified_ones_are_each_ready_though_they_cannot_share_a_process() -> None:
    # the legacy cache's stand-ins for SGLang's modules, loaded first, break the MAMBA component's import in the
    # same process (a metaclass conflict): the listing once said sglang-mamba was not ready after sglang:legacy
    from radixspec.fuzz.targets import readiness

    assert readiness(["sglang:legacy", "sglang-mamba", "sglang-swa", "sglang"]) == dict.fromkeys(
        ["sglang:legacy", "sglang-mamba", "sglang-swa", "sglang"]
    )
