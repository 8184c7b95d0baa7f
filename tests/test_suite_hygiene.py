"""The suite leaves nothing behind: a pytest run's temporary folders (Hypothesis's database, pytest-benchmark's
storage) go when it exits, in each process, so runs do not pile up directories under the system's temporary
folder."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_of_the_suite_removes_its_temporary_folders(tmp_path: Path) -> None:
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    test_file = ROOT / "tests" / "test_suite_hygiene.py"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            f"{test_file}::test_hypothesis_writes_its_database_here",
            "--basetemp",
            str(tmp_path / "base"),
        ],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(system_tmp), "RADIXSPEC_HYGIENE_INNER": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout, run.stdout
    left = sorted(path.name for path in system_tmp.iterdir() if path.name.startswith("radixspec-"))
    assert left == [], left


def test_hypothesis_writes_its_database_here() -> None:
    # the inner run of the test above: the conftest made its folders under this run's TMPDIR, so the run has
    # something to remove
    made = sorted(path.name for path in Path(tempfile.gettempdir()).iterdir() if path.name.startswith("radixspec-"))
    assert any(name.startswith("radixspec-hypothesis-") for name in made), made
    if os.environ.get("RADIXSPEC_HYGIENE_INNER") == "1":
        assert Path(tempfile.gettempdir()).name == "system-tmp"
