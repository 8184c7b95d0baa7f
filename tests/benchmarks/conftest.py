"""After a benchmark run: each group's mins and ratios to ours (same run), printed and saved as JSON.

Implementations are named by the ``impl`` parameter. A benchmark may record in
``extra_info``: ``calls`` (the min is divided by it: time per call), ``pages``
(time per evicted page), ``bytes`` (bandwidth is printed), ``bytes_per_page``
(memory: printed instead of a time). The ratios go to ``--ratios-json``
(default ``.benchmarks/ratios.json``); ``--benchmark-compare`` tracks the raw
times across runs (see README).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

BASELINE_FIRST = ("optimized", "store_cache")


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--ratios-json",
        default=".benchmarks/ratios.json",
        help="where the benchmark summary saves each group's per-call times and ratios to ours",
    )


def per_unit(bench: Any) -> float:
    """The min, per call or per evicted page when the benchmark says how many there were."""
    extra = bench.extra_info
    seconds = float(bench.stats.min)
    if extra.get("pages"):
        return seconds / float(extra["pages"])
    if extra.get("calls"):
        return seconds / float(extra["calls"])
    return seconds


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not getattr(session, "benchmarks", None):
        return
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for bench in session.benchmarks:
        if bench.stats is None or not bench.stats.data:
            continue  # it failed before a round ended
        impl = str(bench.params.get("impl", bench.name)) if bench.params else bench.name
        extra = dict(bench.extra_info)
        entry = {"seconds": per_unit(bench), "extra": extra}
        groups.setdefault(bench.group or "", {})[impl] = entry
    write = terminalreporter.write_line
    write("")
    write("min per call (per evicted page where marked), and how many times ours each takes (same run):")
    saved: dict[str, dict[str, dict[str, Any]]] = {}
    for group in sorted(groups, key=_natural):
        entries = groups[group]
        order = sorted(entries, key=lambda name: (name not in BASELINE_FIRST, name))
        memory = all("bytes_per_page" in entries[name]["extra"] for name in order)
        key = "bytes_per_page" if memory else "seconds"
        base_value = entries[order[0]]["extra"][key] if memory else entries[order[0]]["seconds"]
        cells = []
        saved[group] = {}
        for name in order:
            extra = entries[name]["extra"]
            value = extra[key] if memory else entries[name]["seconds"]
            ratio = value / base_value if base_value else float("nan")
            saved[group][name] = {key: value, f"x_{order[0]}": ratio, **extra}
            if memory:
                reported = f" (C: {extra['reported_bytes_per_page']} B)" if "reported_bytes_per_page" in extra else ""
                cells.append(f"{name} {value:8.1f} B/page{reported} (x{ratio:.2f})")
                continue
            rate = f" {extra['bytes'] / value / 1e9:6.2f} GB/s" if extra.get("bytes") else ""
            shown = f"{value * 1e6:9.2f} us" if value < 1e-3 else f"{value * 1e3:9.2f} ms"
            cells.append(f"{name} {shown}{rate} (x{ratio:.2f})")
        write(f"  {group:<52} " + "   ".join(cells))
    speedups = speedups_over_peers(groups)
    if speedups:
        write("")
        write("speedup of ours, per input format, over each peer (the peer's time / ours, same run; > 1: ours faster):")
        for group, table in speedups.items():
            for ours, row in table.items():
                cells = "   ".join(f"x{value:6.2f} over {peer}" for peer, value in row.items())
                write(f"  {group:<52} {ours:<17} {cells}")
    path = Path(config.getoption("--ratios-json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**saved, "speedups": speedups}, indent=2, sort_keys=True) + "\n")
    write(f"ratios saved to {path}")


PEER_NAMES = (
    "sglang-unified",
    "sglang-unified-list",
    "sglang-unified-python",
    "sglang",
    "sglang-list",
    "vllm",
    "minisgl",
)


def speedups_over_peers(groups: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """For every timed group, each of our input formats (``optimized*``) against each peer that ran in it:
    the peer's time divided by ours (per call, or per evicted page)."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for group in sorted(groups, key=_natural):
        entries = groups[group]
        if any("bytes_per_page" in entry["extra"] for entry in entries.values()):
            continue
        peers = [name for name in PEER_NAMES if name in entries]
        ours = sorted(name for name in entries if name.startswith("optimized"))
        for name in ours if peers else ():
            table.setdefault(group, {})[name] = {
                peer: entries[peer]["seconds"] / entries[name]["seconds"] for peer in peers
            }
    return table


def _natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]
