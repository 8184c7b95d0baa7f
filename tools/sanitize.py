"""``python -m tools.sanitize``: the C tree under AddressSanitizer and UndefinedBehaviorSanitizer, driven by the fuzzer.

A copy of the checkout gets its C modules (the tree through cffi, and the hot path's CPython extension,
csrc/hotpath.c) rebuilt with ``RADIXSPEC_SANITIZE=1`` (``-fsanitize=address,undefined``, see
``csrc/build_ffi.py`` and ``setup.py``); then one
campaign per machine (cache and manager by default) runs on the optimized
implementation in that copy, side by side, with the ASan runtime preloaded.
A memory error (use after free, overflow, double free) or undefined
behaviour stops the process with the sanitizer's report; a semantic
difference is reported as by ``radixspec fuzz``.

Exit status: 0 clean, 1 a sanitizer report or a fuzz failure, 2 usage error,
3 the sanitized build or the campaign broke.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radixspec.fuzz.registry import MACHINES
from tools.checkout import ROOT

COPY_IGNORE = (".git", ".tox", ".venv", "__pycache__", ".hypothesis", ".benchmarks", "build", "fuzz-failures")
SANITIZER_REPORT = re.compile(r"ERROR: AddressSanitizer: [^\n]*|runtime error: [^\n]*|ERROR: LeakSanitizer[^\n]*")


@dataclass
class SanitizedRun:
    """One machine's campaign in the sanitized copy."""

    machine: str
    returncode: int
    seconds: float
    stdout: str
    stderr: str

    @property
    def report(self) -> str | None:
        """The sanitizer's first error line, or None."""
        found = SANITIZER_REPORT.search(self.stderr)
        return found.group(0) if found else None

    @property
    def where(self) -> str | None:
        """The first frame of our C sources in the sanitizer's stack, e.g. ``radix_tree_evict csrc/tree.c:1024``."""
        found = re.search(r"#\d+ 0x[0-9a-f]+ in (\w+) (\S*csrc/\w+\.c:\d+)", self.stderr)
        return f"{found.group(1)} {found.group(2)}" if found else None


def copy_tree(destination: Path) -> Path:
    """A copy of the checkout (sources and the built module) at ``destination / 'tree'``."""
    tree = destination / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*COPY_IGNORE))
    return tree


def asan_runtime() -> str:
    """The path of gcc's ASan runtime, preloaded so that the sanitized module loads into a plain Python."""
    try:
        path = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"tools.sanitize: gcc is needed to find the ASan runtime ({exc})") from None
    if not os.path.isabs(path) or not Path(path).exists():
        raise SystemExit("tools.sanitize: gcc has no libasan.so (install libasan for this gcc)")
    return path


def build(tree: Path, sanitize: bool) -> None:
    """Rebuild the C modules of the copy at ``tree`` in place (with the sanitizers when ``sanitize``): the cffi
    module and the hot path's extension, both ``setup.py``'s; raise on failure."""
    env = {**os.environ, "RADIXSPEC_SANITIZE": "1" if sanitize else "0"}
    proc = subprocess.run(
        [sys.executable, "setup.py", "--quiet", "build_ext", "--inplace", "--force"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"building the C module failed (exit {proc.returncode}):\n{tail}")


def sanitized_env() -> dict[str, str]:
    """The environment of a process that loads the sanitized module."""
    return {
        **os.environ,
        "LD_PRELOAD": asan_runtime(),
        # Python's own allocations are not instrumented; a leak report at exit would be noise
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "PYTHONPATH": "",
    }


def start(
    tree: Path, machine: str, minutes: float, seed: int, extra: Sequence[str], env: dict[str, str]
) -> subprocess.Popen[str]:
    """A fuzz campaign of ``machine`` on the optimized implementation, in ``tree``, in its own process."""
    cmd = [sys.executable, "-m", "radixspec.fuzz", "--machine", machine, "--impl", "optimized", "--workers", "0"]
    cmd += ["--minutes", str(minutes), "--seed", str(seed), *extra]
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_campaigns(
    tree: Path, machines: Sequence[str], minutes: float, seed: int, extra: Sequence[str] = ()
) -> list[SanitizedRun]:
    """Run one sanitized campaign per machine, side by side; wait for all."""
    env = sanitized_env()
    began = time.monotonic()
    procs = [(machine, start(tree, machine, minutes, seed, extra, env)) for machine in machines]
    runs = []
    for machine, proc in procs:
        stdout, stderr = proc.communicate()
        runs.append(SanitizedRun(machine, proc.returncode, time.monotonic() - began, stdout, stderr))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.sanitize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="budget of each machine's campaign (default 1)")
    parser.add_argument(
        "--machine",
        nargs="+",
        default=["cache", "manager", "hybrid", "hostile", "tiered"],
        choices=list(MACHINES),
        help="machines to run, one process each, side by side (default: cache manager hybrid hostile tiered)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="build the sanitized copy here and keep it")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    with tempfile.TemporaryDirectory(prefix="radixspec-sanitize-") as tmp:
        where = args.keep if args.keep is not None else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        tree = where / "tree"
        if tree.exists():
            shutil.rmtree(tree)
        copy_tree(where)
        print(f"building the C module with -fsanitize=address,undefined in {tree} ...", flush=True)
        try:
            build(tree, sanitize=True)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 3
        print(f"running {', '.join(args.machine)} for {args.minutes:g} min each (optimized, ASan + UBSan)", flush=True)
        runs = run_campaigns(tree, args.machine, args.minutes, args.seed)
    status = 0
    for run in runs:
        summary = re.search(r"steps (\d+)", run.stdout)
        reach = re.search(r"^reach: (.*)$", run.stdout, re.MULTILINE)
        steps = (f", {summary.group(1)} steps" if summary else "") + (f"; reach: {reach.group(1)}" if reach else "")
        if run.report is not None:
            print(f"{run.machine}: SANITIZER after {run.seconds:.1f} s: {run.report} (in {run.where})")
            print(run.stderr[-4000:], file=sys.stderr)
            status = 1
        elif run.returncode == 0:
            print(f"{run.machine}: clean ({run.seconds:.0f} s{steps})")
        else:
            print(f"{run.machine}: campaign exit {run.returncode}")
            print(run.stdout[-6000:])
            print(run.stderr[-3000:], file=sys.stderr)
            status = max(status, 1 if run.returncode == 1 else 3)
    return status


if __name__ == "__main__":
    sys.exit(main())
