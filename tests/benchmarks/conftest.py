"""After a benchmark run, print each group's mins and the ratios to ``optimized`` (measured in this run)."""

from __future__ import annotations

import re
from typing import Any


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not getattr(session, "benchmarks", None):
        return
    groups: dict[str, dict[str, float]] = {}
    for bench in session.benchmarks:
        if bench.stats is None:
            continue
        impl = re.search(r"impl=?(\w+)|-(optimized|reference|fullscan)[\]-]", bench.name)
        name = next((g for g in (impl.groups() if impl else ()) if g), bench.name)
        groups.setdefault(bench.group or "", {})[name] = bench.stats.min
    write = terminalreporter.write_line
    write("")
    write("min per call and ratio to optimized (same run):")
    write(f"  {'workload':<48} {'optimized':>12} {'reference':>12} {'x':>8} {'fullscan':>12} {'x':>8}")
    for group in sorted(groups):
        mins = groups[group]
        fast = mins.get("optimized")

        def cell(name: str, mins: dict[str, float] = mins, fast: float | None = fast) -> str:
            value = mins.get(name)
            if value is None:
                return f"{'-':>12} {'-':>8}"
            ratio = f"{value / fast:8.1f}" if fast else f"{'-':>8}"
            return f"{value * 1e3:10.3f}ms {ratio}"

        fast_cell = f"{fast * 1e3:10.3f}ms" if fast else f"{'-':>12}"
        write(f"  {group:<48} {fast_cell} {cell('reference')} {cell('fullscan')}")
