"""The ``radixspec`` console script: a subcommand per tool, ``--version``, usage errors before any import."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import radixspec
from radixspec.fuzz import commands

# what an installed wheel must do: CI runs this module against the wheel too (.ci/installed)
pytestmark = pytest.mark.installed


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


MALFORMED = {
    "exhaustive, a page size past the small scope (hung)": (
        ["exhaustive", "--page-sizes", "3000000000"],
        "--page-sizes must be in [1, 64]",
    ),
    "exhaustive, a depth that never ends": (["exhaustive", "--depth", "999999"], "--depth must be in [1, 12]"),
    "engine-run, a page past the slot domain (was a traceback)": (
        ["engine-run", "--page-size", "3000000000"],
        "page_size must be <= 2**31",
    ),
    "engine-run, a pool past the slot domain (was a traceback)": (
        ["engine-run", "--num-pages", "100000000000", "--page-size", "64"],
        "num_pages * page_size must be <= 2**31",
    ),
    "replay, a trace written into no directory (was a traceback)": (
        ["replay", "--generate", "/nonexistent/dir/t.jsonl", "--requests", "3"],
        "no directory /nonexistent/dir",
    ),
    "fuzz, a machine that does not exist": (["fuzz", "--machine", "nope"], "invalid choice: 'nope'"),
}


@pytest.mark.parametrize("argv, says", MALFORMED.values(), ids=MALFORMED.keys())
def test_every_subcommand_answers_a_malformed_option_with_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        commands.main(argv)
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and says in errors[0], errors
