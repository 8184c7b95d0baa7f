"""The README and docs/ as a newcomer reads them: every Python block runs as written, every link resolves,
every ``python -m`` command names a runnable module."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p, "python")], ids=lambda p: p.name)
def test_every_python_block_runs_as_written(path: Path) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for number, source in enumerate(blocks(path, "python")):
        exec(compile(source, f"{path.name}[python block {number}]", "exec"), namespace)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_file_of_ours_the_text_names_exists(path: Path) -> None:
    """A path in backquotes under one of our folders (``fuzz/report.py``) names a file or folder of the checkout."""
    folders = "fuzz|spec|reference|optimized|tools|tests|csrc|docs"
    for named in re.findall(rf"`((?:{folders})/[A-Za-z0-9_/.]+)`", path.read_text()):
        assert (ROOT / named).exists(), f"{path.name} names {named}, which does not exist"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves_inside_the_repository(path: Path) -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.exists(), f"{path.name} links to {target}, which does not exist"
        assert ROOT in resolved.parents or resolved == ROOT, f"{path.name} links outside the repository: {target}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_python_dash_m_command_names_a_runnable_module(path: Path) -> None:
    for source in blocks(path, "sh"):
        for module in re.findall(r"python3? -m ([\w.]+)", source):
            if module in ("venv", "pip", "pytest"):
                continue
            spec = importlib.util.find_spec(module)
            assert spec is not None, f"{path.name}: python -m {module}: no such module"
            is_package = spec.submodule_search_locations is not None
            assert not is_package or importlib.util.find_spec(f"{module}.__main__"), f"{module} has no __main__"


def test_the_readme_never_points_outside_the_repository() -> None:
    assert "../shared" not in (ROOT / "README.md").read_text()


def target_examples() -> list[tuple[str, str]]:
    """(class name, source) of every Python block in docs/targets.md that defines a target class."""
    examples = []
    for source in blocks(ROOT / "docs" / "targets.md", "python"):
        for name in re.findall(r"^class (\w+)[:(]", source, flags=re.MULTILINE):
            if re.search(r"^\s+profile = ", source, flags=re.MULTILINE):
                examples.append((name, source))
    return examples


def run_fuzz(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    command = [
        sys.executable,
        "-m",
        "radixspec.fuzz",
        "--workers",
        "0",
        "--quiet",
        "--out",
        str(tmp_path / "out"),
        *args,
    ]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.installed
@pytest.mark.parametrize("name, source", target_examples(), ids=lambda x: x if len(x) < 40 else "source")
def test_every_target_example_in_the_docs_passes_its_own_campaign(tmp_path: Path, name: str, source: str) -> None:
    (tmp_path / "mycache.py").write_text(source)
    run = run_fuzz(tmp_path, "--target", f"mycache:{name}", "--examples", "10", "--steps", "30")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.installed
def test_a_target_without_a_method_its_profile_promises_is_a_usage_error(tmp_path: Path) -> None:
    [(name, source), *_] = target_examples()
    without_reset = re.sub(r"\n    def reset\(self\).*?\n\n", "\n", source, flags=re.DOTALL)
    assert "def reset" not in without_reset
    (tmp_path / "mycache.py").write_text(without_reset)
    run = run_fuzz(tmp_path, "--target", f"mycache:{name}", "--examples", "1")
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert "has no reset" in run.stderr and "reset='returns'" in run.stderr


@pytest.mark.installed
def test_the_testing_docs_example_runs_under_pytest_with_the_plugin(tmp_path: Path) -> None:
    """docs/testing.md's first block, saved as a user's test file: its machine and its fixture test pass."""
    (tmp_path / "test_mine.py").write_text(blocks(ROOT / "docs" / "testing.md", "python")[0])
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path / "test_mine.py")]
    command += ["--radixspec-examples", "10", "--radixspec-steps", "20", "--radixspec-seed", "random"]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 passed" in run.stdout and re.search(r"radixspec \S+: seed \d+, examples 10", run.stdout)


@pytest.mark.installed
def test_the_testing_docs_example_fails_for_a_cache_whose_lock_protects_nothing(tmp_path: Path) -> None:
    """The same user's file with a lock and an unlock that do nothing: its machines fail, with regression files."""
    source = blocks(ROOT / "docs" / "testing.md", "python")[0]
    for call in ("pc.lock(self.state, handle)", "pc.unlock(self.state, handle)"):
        assert source.count(call) == 1, call
        source = source.replace(call, "pass")
    (tmp_path / "test_mine.py").write_text(source)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path / "test_mine.py")]
    command += ["--radixspec-examples", "100", "--radixspec-seed", "0", "--radixspec-shrink-seconds", "3"]
    command += ["--radixspec-out", str(tmp_path / "out")]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    # both of its tests drive MyCache: the machine of the class, and the one made through a fixture
    assert run.returncode == 1 and "2 failed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "TestMyCache" in run.stdout and list((tmp_path / "out").glob("test_cache_*.py"))


def test_the_ci_workflow_parses_and_every_radixspec_command_and_option_in_it_exists() -> None:
    import yaml

    from radixspec.fuzz import commands, pytest_plugin

    (source,) = blocks(ROOT / "docs" / "ci.md", "yaml")
    workflow = yaml.safe_load(source)
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    runs = [line.strip() for step in steps for line in step.get("run", "").splitlines() if line.strip()]
    assert runs, "the workflow runs nothing"
    plugin_source = Path(pytest_plugin.__file__).read_text()
    checked = 0
    for line in runs:
        words = line.split()
        if words[0] == "radixspec":
            assert words[1] in commands.SUBCOMMANDS, f"{line}: no subcommand {words[1]}"
            parser_help = subprocess.run(
                [sys.executable, "-m", "radixspec", words[1], "--help"], capture_output=True, text=True, check=True
            ).stdout
            known = set(re.findall(r"(?<![\w-])--[\w-]+", parser_help))
            for option in (word for word in words[2:] if word.startswith("--")):
                assert option in known, f"{line}: radixspec {words[1]} has no option {option}"
            checked += 1
        elif words[0] == "pytest":
            for option in (word for word in words if word.startswith("--radixspec")):
                assert f'"{option}"' in plugin_source, f"{line}: the plugin has no option {option}"
            checked += 1
    assert checked >= 2
    uses = {step["uses"].split("@")[0] for step in steps if "uses" in step}
    assert {"actions/checkout", "actions/cache", "actions/upload-artifact"} <= uses


def test_every_machine_of_the_registry_has_a_row_in_the_machines_table() -> None:
    from radixspec.fuzz.registry import MACHINES

    text = (ROOT / "docs" / "campaigns.md").read_text()
    rows = set(re.findall(r"^\| `([a-z]+)` \|", text, flags=re.MULTILINE))
    assert set(MACHINES) <= rows, f"docs/campaigns.md lacks rows for {sorted(set(MACHINES) - rows)}"
