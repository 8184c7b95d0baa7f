"""Hit rate against a size (pool pages, workers), one line per curve: the replays' ``--plot`` (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

# identical curves (a differential's point) stay visible: each its own marker, size and dash
STYLES = (("o", 10, "-"), ("s", 7, "--"), ("^", 5, ":"), ("D", 4, "-."), ("v", 4, "-"))


def plot_hit_rates(curves: Mapping[str, Sequence[tuple[int, float]]], xlabel: str, path: Path) -> None:
    """Each curve's (size, hit rate in 0..1) points, sizes on a log-2 axis, written as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for number, (label, points) in enumerate(curves.items()):
        mine = sorted(points)
        marker, size, dash = STYLES[number % len(STYLES)]
        axes.plot(
            [x for x, _ in mine],
            [100 * y for _, y in mine],
            marker=marker,
            markersize=size,
            linestyle=dash,
            label=label,
        )
    axes.set_xscale("log", base=2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("token hit rate (%)")
    axes.set_ylim(0, 100)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
