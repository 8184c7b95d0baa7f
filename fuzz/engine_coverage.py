"""Coverage of the engine's code as reach (``radixspec fuzz --coverage``): which lines and branches of the target
engine's cache modules a campaign ran, and which it never reached.

Each target names its engine's cache modules (``TargetInfo.engine_modules``, dotted names of files). A batch
measures only those files with coverage.py (branch coverage), in the worker process that runs it, and hands back
the arcs it ran, keyed by module name (so that a Ray worker's paths need not be the campaign's). The campaign
unions them and at the end reads each module's statements and branches from the files installed here: lines and
branches reached, and the lines never reached, listed.

Some lines cannot run on a CPU-only machine (a CUDA stream, a kernel with no CPU path, a process group of several
ranks, an external store): ``fuzz/targets/cpu_unreachable.py`` names those functions, each with its reason, and the
coverage of each module is also given of the lines reachable on a CPU (the issue's measure). A listed function that
ran, or a listed name the installed file lacks (a newer release), is reported: the list is wrong there.

Measured in worker processes only: the campaign's own process imported the engine when it checked the target, so
the lines that run at import (a module's ``def`` and ``class`` statements) would read as never reached there.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias, cast

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
    # of those, the lines of functions that cannot run on a CPU (fuzz/targets/cpu_unreachable.py), ascending
    cpu_only: tuple[int, ...] = ()
    # listed functions that ran nonetheless, and listed names the file lacks: the list is wrong there
    ran_though_listed: tuple[str, ...] = ()
    stale_names: tuple[str, ...] = ()

    @property
    def line_percent(self) -> float:
        return 100.0 * self.covered / self.statements if self.statements else 0.0

    @property
    def branch_percent(self) -> float:
        return 100.0 * self.covered_branches / self.branches if self.branches else 0.0

    @property
    def reachable(self) -> int:
        """Statements a CPU-only machine can run."""
        return self.statements - len(self.cpu_only)

    @property
    def reachable_percent(self) -> float:
        return 100.0 * self.covered / self.reachable if self.reachable else 0.0

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
            "cpu_only_lines": list(self.cpu_only),
            "reachable_statements": self.reachable,
            "reachable_line_percent": round(self.reachable_percent, 1),
            "ran_though_listed": list(self.ran_though_listed),
            "stale_names": list(self.stale_names),
        }

    def describe(self, ranges: int = SHOWN_RANGES) -> str:
        """One line: the module, its lines and branches reached (and of its lines reachable on a CPU, where some are
        not), and the first ``ranges`` ranges of reachable lines never reached (none listed when ``ranges`` is 0:
        their count only); a wrong list of CPU-only functions is named."""
        if self.path is None:
            return f"{self.module}: not installed here"
        heading = (
            f"{self.module}: lines {self.line_percent:.1f} % ({self.covered}/{self.statements}),"
            f" branches {self.branch_percent:.1f} % ({self.covered_branches}/{self.branches})"
        )
        if self.cpu_only:
            heading += (
                f", of the lines reachable on a CPU {self.reachable_percent:.1f} % ({self.covered}/{self.reachable};"
                f" {len(self.cpu_only)} CPU-only)"
            )
        if self.ran_though_listed or self.stale_names:
            wrong = [f"{name} ran" for name in self.ran_though_listed] + [f"no {name}" for name in self.stale_names]
            heading += f"; CPU-only list wrong: {', '.join(wrong)}"
        only = set(self.cpu_only)
        spans = line_ranges(line for line in self.missing if line not in only)
        if not spans:
            return heading
        if ranges == 0:
            return f"{heading}; {len(spans)} ranges never reached (listed without --quiet, and in --json)"
        more = f", ... ({len(spans) - ranges} more ranges, all in --json)" if len(spans) > ranges else ""
        return f"{heading}; never reached: {', '.join(spans[:ranges])}{more}"


def listed_bodies(source: str, names: Iterable[str]) -> tuple[dict[str, list[range]], tuple[str, ...]]:
    """The lines of the bodies of each function ``names`` lists by qualified name (``Class.method``; a class: every
    method's; a name defined twice: both), and the names the source does not define."""
    bodies = all_bodies(source)
    wanted = list(names)
    return {name: bodies[name] for name in wanted if name in bodies}, tuple(
        name for name in wanted if name not in bodies
    )


def all_bodies(source: str) -> dict[str, list[range]]:
    """The lines of the body of every function and class the source defines, by qualified name (a class: every
    method's; a function nested in another is the outer one's). Bodies only: a ``def`` line and a class's own
    statements run when the module is imported."""
    bodies: dict[str, list[range]] = {}

    def visit(node: ast.AST, prefix: str) -> list[range]:
        found: list[range] = []
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                own = [range(child.body[0].lineno, (child.end_lineno or child.lineno) + 1)]
            elif isinstance(child, ast.ClassDef):
                own = visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.stmt):
                found += visit(child, prefix)  # a definition under if, try or with keeps its scope's name
                continue
            else:
                continue
            bodies.setdefault(prefix + child.name, []).extend(own)
            found += own
        return found

    visit(ast.parse(source), "")
    return bodies


def set_apart(
    source: str, listed: Iterable[str], executed: Iterable[int], missing: Iterable[int]
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]:
    """Of a module's never-reached lines, those in the bodies of the functions ``listed`` as CPU-only; the listed
    functions that ran nonetheless (their lines stay counted); the listed names the source lacks."""
    bodies, stale = listed_bodies(source, listed)
    ran_lines, unran = set(executed), set(missing)
    ran = tuple(name for name, spans in bodies.items() if any(ran_lines.intersection(span) for span in spans))
    cpu_only = {line for name, spans in bodies.items() if name not in ran for span in spans for line in span}
    return tuple(sorted(cpu_only & unran)), ran, stale


def line_ranges(lines: Iterable[int]) -> list[str]:
    """Ascending line numbers as ranges: ``[3, 4, 5, 9]`` -> ``["3-5", "9"]``."""
    spans: list[list[int]] = []
    for line in sorted(lines):
        if spans and line == spans[-1][1] + 1:
            spans[-1][1] = line
        else:
            spans.append([line, line])
    return [f"{first}-{last}" if last > first else str(first) for first, last in spans]


def analyse(
    modules: tuple[str, ...],
    arcs: Mapping[str, Iterable[Arc]],
    cpu_unreachable: Mapping[str, Mapping[str, str]] | None = None,
) -> tuple[ModuleCoverage, ...]:
    """Each module's coverage from the arcs the batches ran, its statements and branches read from the file
    installed here (coverage.py's analysis of the source), the lines of the functions ``cpu_unreachable`` lists
    for it (by default ``fuzz/targets/cpu_unreachable.py``'s) set apart."""
    import coverage

    from .targets.cpu_unreachable import CPU_UNREACHABLE

    table = CPU_UNREACHABLE if cpu_unreachable is None else cpu_unreachable
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
        summary = cast(dict[str, int], entry.get("summary", {}))
        missing = cast(list[int], entry.get("missing_lines", []))
        executed = cast(list[int], entry.get("executed_lines", []))
        listed = table.get(module, {})
        apart = set_apart(path.read_text(), listed, executed, missing) if path is not None and listed else ((), (), ())
        result.append(
            ModuleCoverage(
                module,
                path,
                summary.get("num_statements", 0),
                summary.get("covered_lines", 0),
                summary.get("num_branches", 0),
                summary.get("covered_branches", 0),
                tuple(missing),
                *apart,
            )
        )
    return tuple(result)
