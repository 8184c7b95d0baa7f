"""``python -m tools.bench_compare --against REF``: the fuzzer's own speed, this tree beside a past one, in one run.

Bugs are found per example, so the fuzzer's throughput is part of what radixspec promises. A figure saved on
another day (or another machine) says little on shared, noisy cores; this command measures both trees in one
run, interleaved, so that what slows the machine slows both:

1. REF (a tag or commit) is unpacked with ``git archive`` into a temporary folder, and this checkout (its
   working tree: tracked and new files) copied beside it; each copy's C modules are built in place, the same
   way (``setup.py build_ext --inplace``).
2. Each workload runs on both, alternating which goes first, ``--rounds`` times: one machine's batch
   (``tools/bench_batch.py``: the tree's own ``run_batch`` beside the spec on the reference and optimized
   implementations, the batch's shape the same in both trees: ``--examples`` examples of at most 80 steps, no
   shrinking; Hypothesis's steps per second) and the exhaustive checker of one alphabet at a fixed depth (its
   wall time, one worker). Round r draws the programs from seed ``--seed`` + r on both trees. A campaign's own
   steps per second are not compared: they depend on how the campaign shapes its batches (shallow 20-step
   batches alternate with deep ones since 0ba7a2f) and on what a machine counts as a step, which is not the
   fuzzer's speed. A tree from before the modules moved under ``radixspec`` is driven as the package ``fuzz``
   (``python -m fuzz.exhaustive``); a newer one as ``radixspec.fuzz``.
3. Per workload: the ratio this / REF of each round (higher is faster) and their spread; the verdict reads the
   median of the rounds in which both trees ran the same program (equal steps and rule counts), or of every
   round when none did. A machine whose strategies changed draws other programs from the same seed, and a
   scheduler example's cost follows its prompts' lengths: a ratio of different programs measures the data,
   not the code. The run exits 1 naming every workload whose median ratio is below ``--threshold`` (a
   regression), 2 on a usage error or a tree that does not build or run.

    python -m tools.bench_compare --against 79b4c1f                        # every machine both trees have
    python -m tools.bench_compare --against 79b4c1f --machines manager --exhaustive manager:5 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.checkout import ROOT
from tools.sanitize import COPY_IGNORE, build

# one machine's batch in a tree, its shape held fixed (run from that tree's root)
DRIVER = Path(__file__).with_name("bench_batch.py")

# the machines a workload may name (a tree lacking one is told apart: its batch does not build, exit 2)
MACHINES = ("cache", "manager", "scheduler", "kv", "hybrid", "hostile", "router")
# as the issue that introduced this tool measured them: the scheduler and kv machines' examples are longer
EXAMPLES = {"scheduler": 200, "kv": 200}


@dataclass(frozen=True)
class Workload:
    """One thing timed on both trees: a batch of one machine, or the exhaustive checker of one alphabet."""

    kind: str  # "machine" (a batch of it) or "exhaustive"
    machine: str
    # machine: examples per batch; exhaustive: depth
    size: int

    @property
    def name(self) -> str:
        return f"{self.machine} machine" if self.kind == "machine" else f"exhaustive {self.machine} depth {self.size}"

    @property
    def unit(self) -> str:
        return "steps/s" if self.kind == "machine" else "s"


@dataclass
class Tree:
    """A copy of a tree, built, and how to run its fuzzer."""

    label: str
    path: Path

    @property
    def module(self) -> str:
        """The fuzzer's package: ``radixspec.fuzz`` once the modules moved under the one import name."""
        return "radixspec.fuzz" if (self.path / "radixspec" / "__init__.py").is_file() else "fuzz"


@dataclass
class Measured:
    """A workload's figures on both trees, round by round (steps/s for a machine, seconds for the exhaustive),
    and whether both trees ran the same program in that round."""

    workload: Workload
    ref: list[float] = field(default_factory=list)
    this: list[float] = field(default_factory=list)
    # per round: the trees ran the same work (a machine: equal Hypothesis steps and rule counts on the round's
    # seed; the exhaustive checker: always, the same states and transitions)
    same: list[bool] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """This tree's speed over REF's, per round (higher is faster): steps/s this / REF; seconds REF / this."""
        pairs = zip(self.this, self.ref, strict=True)
        if self.workload.kind == "machine":
            return [this / ref for this, ref in pairs]
        return [ref / this for this, ref in pairs]

    def judged(self) -> list[float]:
        """The ratios the verdict reads: the rounds in which both trees ran the same program, when there are any
        (a machine whose strategies changed draws other programs from the same seed: their cost is the data's,
        not the code's); else every round."""
        ratios = self.ratios()
        same = [ratio for ratio, alike in zip(ratios, self.same, strict=False) if alike]
        return same or ratios

    def median_ratio(self) -> float:
        return statistics.median(self.judged())


def unpack(ref: str, into: Path) -> Path:
    """REF's tree (``git archive``) in ``into``; SystemExit(2) when git does not know REF."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"bench_compare: git does not know {ref!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def copy_checkout(into: Path) -> Path:
    """This checkout's working tree, its build outputs and caches left out."""
    shutil.copytree(ROOT, into, ignore=shutil.ignore_patterns(*COPY_IGNORE, "*.so", "*.egg-info", "_radix_c.c"))
    return into


def run_workload(tree: Tree, workload: Workload, seed: int, scratch: Path) -> tuple[float, object]:
    """Run ``workload`` on ``tree`` once: its steps per second (a machine's batch) or its wall seconds
    (exhaustive), and what identifies the work done (a machine: its Hypothesis steps and rule counts)."""
    if workload.kind == "machine":
        # the driver from this checkout, run from the tree's root: only that tree's modules import
        command = [sys.executable, "-c", DRIVER.read_text(), "--package", tree.module, "--machine", workload.machine]
        command += ["--examples", str(workload.size), "--seed", str(seed)]
    else:
        out = scratch / f"{tree.label}-{workload.kind}-{workload.machine}"
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, "-m", f"{tree.module}.exhaustive", "--machine", workload.machine, "--depth"]
        command += [str(workload.size), "--page-sizes", "1", "--workers", "1", "--out", str(out)]
    # the tree's own modules first: a checkout copy runs as it would from its root
    env = {**os.environ, "PYTHONPATH": str(tree.path), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=tree.path, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise SystemExit(f"bench_compare: {workload.name} on {tree.label} exited {proc.returncode}:\n{tail}")
    if workload.kind == "machine":
        figures = json.loads(proc.stdout.strip().splitlines()[-1])
        return float(figures["steps_per_s"]), (figures["steps"], figures["rules"])
    return seconds, workload.size


def measure(
    trees: tuple[Tree, Tree], workloads: Sequence[Workload], rounds: int, seed: int, scratch: Path
) -> list[Measured]:
    """Every workload on both trees, ``rounds`` times, interleaved: REF then this in even rounds, this then REF
    in odd ones; round r draws the machines' programs from seed ``seed + r`` (the same on both trees); progress
    on stderr."""
    ref, this = trees
    results = [Measured(workload) for workload in workloads]
    for number in range(rounds):
        for result in results:
            order = (ref, this) if number % 2 == 0 else (this, ref)
            work = {}
            for tree in order:
                value, work[tree.label] = run_workload(tree, result.workload, seed + number, scratch)
                (result.ref if tree is ref else result.this).append(value)
            result.same.append(work[ref.label] == work[this.label])
            print(
                f"[round {number + 1}/{rounds}] {result.workload.name}: REF {result.ref[-1]:.1f}, this"
                f" {result.this[-1]:.1f} {result.workload.unit}"
                + ("" if result.same[-1] else f" (other programs: REF {work[ref.label]}, this {work[this.label]})"),
                file=sys.stderr,
                flush=True,
            )
    return results


def regressions(results: Sequence[Measured], threshold: float) -> list[Measured]:
    """The workloads whose median ratio (this / REF, higher is faster) is below ``threshold``."""
    return [result for result in results if result.median_ratio() < threshold]


def table(results: Sequence[Measured], ref: str, threshold: float) -> list[str]:
    """The comparison as lines: per workload the medians, the median ratio (of the rounds the verdict reads) and
    the spread of every round's ratio, and in how many rounds both trees ran the same program."""
    lines = [
        f"{'workload':<30} {'REF ' + ref[:12]:>18} {'this tree':>14} {'ratio':>7} {'spread':>13} {'same':>5}  verdict",
    ]
    for result in results:
        ratios = result.ratios()
        unit = result.workload.unit
        verdict = "REGRESSION" if result.median_ratio() < threshold else "ok"
        same = f"{sum(result.same)}/{len(result.same)}" if result.same else "-"
        lines.append(
            f"{result.workload.name:<30} {statistics.median(result.ref):>10.1f} {unit:<7}"
            f" {statistics.median(result.this):>6.1f} {unit:<7} {result.median_ratio():>6.2f}x"
            f" {min(ratios):>5.2f}-{max(ratios):.2f}x {same:>5}  {verdict}"
        )
    return lines


def parse_exhaustive(text: str) -> Workload:
    """``manager:5`` as the exhaustive workload of that alphabet at that depth."""
    machine, _, depth = text.partition(":")
    if machine not in ("cache", "manager") or not depth.isdigit() or not 1 <= int(depth) <= 8:
        raise argparse.ArgumentTypeError(f"expected cache:DEPTH or manager:DEPTH (depth 1-8), got {text!r}")
    return Workload("exhaustive", machine, int(depth))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_compare",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--against", required=True, metavar="REF", help="the past tree: a tag or a commit")
    parser.add_argument(
        "--machines",
        default="cache,manager,scheduler,kv",
        help="machine workloads, comma-separated (of " + ", ".join(MACHINES) + "; default: those 79b4c1f has)",
    )
    parser.add_argument(
        "--examples", type=int, default=100, help="examples per machine's batch (scheduler, kv: 2/3 of it)"
    )
    parser.add_argument(
        "--exhaustive",
        type=parse_exhaustive,
        action="append",
        default=None,
        metavar="MACHINE:DEPTH",
        help="an exhaustive workload, page size 1, one worker (repeatable; default: manager:5)",
    )
    parser.add_argument("--no-exhaustive", action="store_true", help="no exhaustive workload")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each workload on each tree")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--threshold", type=float, default=0.9, help="a median ratio this / REF below it is a regression"
    )
    args = parser.parse_args(argv)
    machines = [name for name in args.machines.split(",") if name]
    unknown = [name for name in machines if name not in MACHINES]
    if unknown or args.rounds < 1 or args.examples < 1 or not args.threshold > 0:
        parser.error(f"unknown machines {unknown}" if unknown else "--rounds, --examples and --threshold must be > 0")
    workloads = [Workload("machine", name, max(1, args.examples * EXAMPLES.get(name, 300) // 300)) for name in machines]
    if not args.no_exhaustive:
        workloads += args.exhaustive or [Workload("exhaustive", "manager", 5)]
    if not workloads:
        parser.error("nothing to measure")
    # both trees built alike, as a user's pip install builds them: CI's warnings-as-errors is for this tree's own
    # build (a past tree's warnings under today's compiler are not a speed question)
    os.environ.pop("RADIXSPEC_WERROR", None)
    with tempfile.TemporaryDirectory(prefix="radixspec-bench-compare-") as tmp:
        scratch = Path(tmp)
        trees = (
            Tree(f"REF {args.against}", unpack(args.against, scratch / "ref")),
            Tree("this tree", copy_checkout(scratch / "this")),
        )
        for tree in trees:
            print(f"building {tree.label} ...", file=sys.stderr, flush=True)
            try:
                build(tree.path, sanitize=False)
            except RuntimeError as exc:
                raise SystemExit(f"bench_compare: {tree.label}: {exc}") from None
        results = measure(trees, workloads, args.rounds, args.seed, scratch)
    print(
        f"this tree ({ROOT}) against {args.against}: {args.rounds} rounds each, interleaved, round r on seed"
        f" {args.seed}+r; ratio = this / REF speed (higher is faster), the median of the rounds in which both trees"
        f" ran the same program (same; all rounds when none did); spread = every round's lowest and highest ratio"
    )
    print("\n".join(table(results, args.against, args.threshold)))
    slower = regressions(results, args.threshold)
    for result in slower:
        print(
            f"REGRESSION: {result.workload.name} runs at {result.median_ratio():.2f}x of {args.against}'s speed"
            f" (threshold {args.threshold:.2f}x)"
        )
    return 1 if slower else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            sys.exit(2)
        raise
