"""After a benchmark run, print each group's mins and ratios to its first implementation (same run).

Implementations are named by the ``impl`` parameter; where a benchmark records
``extra_info["bytes"]``, the bandwidth at the min is printed too.
"""

from __future__ import annotations

import re
from typing import Any

BASELINE_FIRST = ("optimized", "store_cache")


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not getattr(session, "benchmarks", None):
        return
    groups: dict[str, dict[str, tuple[float, int | None]]] = {}
    for bench in session.benchmarks:
        if bench.stats is None:
            continue
        impl = str(bench.params.get("impl", bench.name)) if bench.params else bench.name
        groups.setdefault(bench.group or "", {})[impl] = (bench.stats.min, bench.extra_info.get("bytes"))
    write = terminalreporter.write_line
    write("")
    write("min per call, and how many times slower than the group's first implementation (same run):")
    for group in sorted(groups, key=_natural):
        mins = groups[group]
        order = sorted(mins, key=lambda name: (name not in BASELINE_FIRST, name))
        base = mins[order[0]][0]
        cells = []
        for name in order:
            seconds, nbytes = mins[name]
            rate = f" {nbytes / seconds / 1e9:6.2f} GB/s" if nbytes else ""
            shown = f"{seconds * 1e6:9.2f} us" if seconds < 1e-3 else f"{seconds * 1e3:9.2f} ms"
            cells.append(f"{name} {shown}{rate} (x{seconds / base:.1f})")
        write(f"  {group:<46} " + "   ".join(cells))


def _natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]
