"""The ``radixspec`` console script: a subcommand per tool, ``--version``, usage errors before any import."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import radixspec
from radixspec.fuzz import commands


def test_version_names_radixspec_python_hypothesis_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"radixspec {radixspec.__version__} python {sys.version.split()[0]} hypothesis ")
    assert " torch " in out


def test_an_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.main(["fuz"]) == 2
    assert "unknown subcommand 'fuz'" in capsys.readouterr().err
    assert commands.main([]) == 2


def test_every_subcommand_has_a_main_and_its_help_names_the_console_script(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, (module, _) in commands.SUBCOMMANDS.items():
        assert callable(importlib.import_module(module).main)
        with pytest.raises(SystemExit) as exit_:
            commands.main([name, "--help"])
        assert exit_.value.code == 0
        assert f"usage: radixspec {name}" in capsys.readouterr().out


def test_the_console_script_and_python_m_run_the_same_command() -> None:
    script = Path(sys.executable).parent / "radixspec"
    if not script.exists():
        script_path = shutil.which("radixspec")
        assert script_path is not None, "the radixspec console script is not installed"
        script = Path(script_path)
    for command in ([str(script)], [sys.executable, "-m", "radixspec"]):
        proc = subprocess.run([*command, "--version"], capture_output=True, text=True, check=False)
        assert proc.returncode == 0 and proc.stdout.startswith("radixspec "), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "radixspec.fuzz", "--machine", "x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage: radixspec fuzz" in proc.stderr
