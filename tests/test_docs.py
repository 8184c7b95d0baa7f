"""The README and docs/ as a newcomer reads them: every Python block runs as written, every link resolves,
every ``python -m`` command names a runnable module."""

from __future__ import annotations

import importlib.util
import re
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
