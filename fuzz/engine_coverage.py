"""Coverage of the engine's code as reach (``radixspec fuzz --coverage``): which lines and branches of the target
engine's cache modules a campaign ran, and which it never reached.

Each target names its engine's cache modules (``TargetInfo.engine_modules``, dotted names of files). A batch
measures only those files with coverage.py (branch coverage), in the worker process that runs it, and hands back
the arcs it ran, keyed by module name (so that a Ray worker's paths need not be the campaign's). The campaign
unions them and at the end reads each module's statements and branches from the files installed here: lines and
branches reached, and the lines never reached, listed.

Measured in worker processes only: the campaign's own process imported the engine when it checked the target, so
the lines that run at import (a module's ``def`` and ``class`` statements) would read as never reached there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

# a line-to-line transition coverage.py records (negative numbers: entering or leaving a code object)
Arc: TypeAlias = tuple[int, int]
# how many never-reached ranges the text summary lists per module (the JSON lists every line)
SHOWN_RANGES = 12


def is_available() -> bool:
    """True when coverage.py is installed (``pip install radixspec[coverage]``)."""
    return importlib.util.find_spec("coverage") is not None


def module_pattern(module: str) -> str:
    """The path pattern of a module's file, wherever its package is installed (``*/pkg/sub/mod.py``)."""
    return "*/" + module.replace(".", "/") + ".py"


def module_file(module: str) -> Path | None:
    """The installed file of ``module``, found without importing it or its packages; None when absent."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root, *rest.split(".")).with_suffix(".py") if rest else Path(root, "__init__.py")
        if path.is_file():
            return path
    return None


@contextmanager
def measured(modules: tuple[str, ...]) -> Iterator[dict[str, list[Arc]]]:
    """Measure ``modules`` while the block runs; the dict yielded is filled at its end with each module's arcs
    (modules that never ran are absent). Nothing is measured, and the dict stays empty, when ``modules`` is."""
    arcs: dict[str, list[Arc]] = {}
    if not modules:
        yield arcs
        return
    import coverage

    patterns = {module_pattern(module): module for module in modules}
    measure = coverage.Coverage(data_file=None, branch=True, config_file=False, include=list(patterns))
    # a batch cut short before its first example ran none of them: not worth a warning on the campaign's output
    measure.set_option("run:disable_warnings", ["no-data-collected", "module-not-measured"])
    measure.start()
    try:
        yield arcs
    finally:
        measure.stop()
        data = measure.get_data()
        for path in data.measured_files():
            module = next((module for pattern, module in patterns.items() if path.endswith(pattern[1:])), None)
            if module is not None:
                arcs.setdefault(module, []).extend(data.arcs(path) or ())


@dataclass(frozen=True)
class ModuleCoverage:
    """What a campaign reached of one engine module."""

    module: str
    # the installed file read for its statements; None when the module is not installed here
    path: Path | None
    statements: int
    covered: int
    branches: int
    covered_branches: int
    # statements never reached, ascending
    missing: tuple[int, ...]

    @property
    def line_percent(self) -> float:
        return 100.0 * self.covered / self.statements if self.statements else 0.0

    @property
    def branch_percent(self) -> float:
        return 100.0 * self.covered_branches / self.branches if self.branches else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "module": self.module,
            "path": str(self.path) if self.path else None,
            "statements": self.statements,
            "covered_lines": self.covered,
            "line_percent": round(self.line_percent, 1),
            "branches": self.branches,
            "covered_branches": self.covered_branches,
            "branch_percent": round(self.branch_percent, 1),
            "missing_lines": list(self.missing),
        }

    def describe(self, ranges: int = SHOWN_RANGES) -> str:
        """One line: the module, its lines and branches reached, and the first ``ranges`` ranges never reached
        (none listed when ``ranges`` is 0: their count only)."""
        if self.path is None:
            return f"{self.module}: not installed here"
        heading = (
            f"{self.module}: lines {self.line_percent:.1f} % ({self.covered}/{self.statements}),"
            f" branches {self.branch_percent:.1f} % ({self.covered_branches}/{self.branches})"
        )
        spans = line_ranges(self.missing)
        if not spans:
            return heading
        if ranges == 0:
            return f"{heading}; {len(spans)} ranges never reached (listed without --quiet, and in --json)"
        more = f", ... ({len(spans) - ranges} more ranges, all in --json)" if len(spans) > ranges else ""
        return f"{heading}; never reached: {', '.join(spans[:ranges])}{more}"


def line_ranges(lines: Iterable[int]) -> list[str]:
    """Ascending line numbers as ranges: ``[3, 4, 5, 9]`` -> ``["3-5", "9"]``."""
    spans: list[list[int]] = []
    for line in sorted(lines):
        if spans and line == spans[-1][1] + 1:
            spans[-1][1] = line
        else:
            spans.append([line, line])
    return [f"{first}-{last}" if last > first else str(first) for first, last in spans]


def analyse(modules: tuple[str, ...], arcs: Mapping[str, Iterable[Arc]]) -> tuple[ModuleCoverage, ...]:
    """Each module's coverage from the arcs the batches ran, its statements and branches read from the file
    installed here (coverage.py's analysis of the source)."""
    import coverage

    files = {module: module_file(module) for module in modules}
    installed = {module: path for module, path in files.items() if path is not None}
    report: dict[str, dict[str, object]] = {}
    if installed:
        analysis = coverage.Coverage(data_file=None, branch=True, config_file=False)
        data = analysis.get_data()
        data.add_arcs({str(path): list(arcs.get(module, ())) for module, path in installed.items()})
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder, "coverage.json")
            analysis.json_report(morfs=[str(path) for path in installed.values()], outfile=str(out))
            # keyed by each file's name as coverage.py shows it: relative to the working directory when the file
            # lies under it (an engine installed in a virtualenv inside the folder the campaign runs in)
            named = json.loads(out.read_text())["files"]
            report = {os.path.realpath(name): entry for name, entry in named.items()}
    result = []
    for module in modules:
        path = files[module]
        entry = report.get(os.path.realpath(path), {}) if path is not None else {}
        summary: dict[str, int] = entry.get("summary", {})  # type: ignore[assignment]
        missing: list[int] = entry.get("missing_lines", [])  # type: ignore[assignment]
        result.append(
            ModuleCoverage(
                module,
                path,
                summary.get("num_statements", 0),
                summary.get("covered_lines", 0),
                summary.get("num_branches", 0),
                summary.get("covered_branches", 0),
                tuple(missing),
            )
        )
    return tuple(result)
