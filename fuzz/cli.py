"""The command line of ``radixspec fuzz``: its options, their checks, and the exit statuses.

Light imports only: a usage error must not wait for torch (the machines, our
targets and the regression writer import it; a campaign imports them when it
starts). Every bad option is a usage error (exit 2) before anything runs.

``--impl`` and ``--target`` are two spellings of one selection: ``--impl
reference`` is ``--target reference``, and both may be given (the machines
drive the spec beside every selected target).
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from .batches import database_for
from .profiles import CAMPAIGN_EXAMPLES, CAMPAIGN_STEPS
from .registry import IMPLEMENTATIONS, MACHINES, machines_for
from .targets import TargetError, list_targets, resolve
from .targets.api import TargetInfo

# the machines and our implementations, by name (fuzz/registry.py)
MACHINE_NAMES = tuple(MACHINES)

EXIT_OK, EXIT_FAILURES, EXIT_USAGE, EXIT_BROKEN = 0, 1, 2, 3


class DefaultsShown(argparse.HelpFormatter):
    """``--help`` with each option's default, except where it is None or False (its help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # by identity: a default of 0 is shown (0 == False)
        shown = all(action.default is not value for value in (None, False, argparse.SUPPRESS))
        if action.option_strings and shown and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask, bounded by its cgroup's CPU quota (a container limited
    to 2 CPUs on a 64-core host gets 2), at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(count, quota) if quota is not None else count)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """CPUs the cgroup's quota allows (rounded up), or None without a quota: cgroup v2's cpu.max
    ("QUOTA PERIOD" or "max PERIOD"), else v1's cpu.cfs_quota_us / cpu.cfs_period_us (-1: none)."""
    try:
        fields = (root / "cpu.max").read_text().split()
        if fields and fields[0] != "max":
            return max(1, -(-int(fields[0]) // int(fields[1])))
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return max(1, -(-quota // period)) if quota > 0 and period > 0 else None


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def select(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.targets`` (names) and ``args.target_infos`` from --impl and --target, checked; a usage error
    when a name is unknown, a set cannot run side by side, or the machine asked for cannot drive them."""
    names: list[str] = []
    if args.impl is not None:
        names += list(IMPLEMENTATIONS) if args.impl == "all" else [args.impl]
    names += args.target or []
    if not names:
        names = list(IMPLEMENTATIONS)
    names = list(dict.fromkeys(names))
    # ours follow the spec and have every layer: resolved by the machines (importing them here imports torch)
    foreign: dict[str, TargetInfo] = {}
    for name in names:
        if name not in IMPLEMENTATIONS:
            try:
                foreign[name] = resolve(name)
            except TargetError as exc:
                parser.error(str(exc))
    # the router machine runs caches as workers side by side, each under its own profile (no spec beside them)
    routed = any(info.router_factory is not None for info in foreign.values())
    if len(names) > 1 and not routed:
        own = [info for info in foreign.values() if not info.profile.follows_spec]
        if own:
            parser.error(
                f"target {own[0].name} makes its own eviction or allocation choices (profile {own[0].profile.name!r}):"
                " the spec follows one such target only; run it alone"
            )
        if args.lru == "sync":
            parser.error("--lru sync makes the spec follow one target's choices: select one target")
    supported = machines_for(names, foreign)
    if args.machine != "all" and args.machine not in supported:
        parser.error(f"{', '.join(names)}: no {args.machine} machine drives it (there are: {', '.join(supported)})")
    args.targets, args.foreign = tuple(names), foreign


def check_coverage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.engine_modules``, what --coverage measures: every selected target's engine modules; a usage error
    when coverage.py is missing, the batches would run in this process, or no target names a module."""
    from .engine_coverage import is_available

    if not is_available():
        parser.error("--coverage needs coverage.py: pip install 'radixspec[coverage]' (or pip install coverage)")
    if args.workers == 0 and args.ray is None:
        parser.error(
            "--coverage measures in worker processes (--workers >= 1): this process imported the engine when it"
            " checked the target, so the lines its import ran would read as never reached"
        )
    modules = [module for info in args.foreign.values() for module in info.engine_modules]
    if not modules:
        parser.error(
            f"--coverage: {', '.join(args.targets)} names no engine module to measure (TargetInfo.engine_modules):"
            " ours are measured by the test suite, TokenSpeed's and Dynamo's caches are compiled (no Python lines),"
            " and a mini-sglang checkout is not measured"
        )
    args.engine_modules = tuple(dict.fromkeys(modules))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="radixspec fuzz",
        description="Differential fuzz campaign: the spec against our implementations or any target.",
        epilog="Exit status: 0 clean, 1 failures found, 2 usage error, 3 the campaign broke.",
        formatter_class=DefaultsShown,
    )
    parser.add_argument("--machine", choices=[*MACHINE_NAMES, "all"], default="all", help="state machine(s) to run")
    parser.add_argument(
        "--impl",
        choices=[*IMPLEMENTATIONS, "all"],
        default=None,
        help="our implementation(s) driven beside the spec (the same as --target reference / optimized); default,"
        " when no --target is given: all (the three-way differential)",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=positive_float, default=None, help="time budget; default: 1")
    budget.add_argument("--examples", type=positive_int, default=None, help="stop after this many examples per machine")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="campaign seed (batches derive theirs from it); default: a fresh one, printed with the summary, in"
        " the JSON and in every regression file, so that a run reproduces with --seed",
    )
    parser.add_argument("--batch", type=positive_int, default=CAMPAIGN_EXAMPLES, help="examples per batch")
    parser.add_argument("--steps", type=positive_int, default=CAMPAIGN_STEPS, help="steps per example")
    parser.add_argument("--no-shrink", action="store_true", help="report the first failing example as found")
    parser.add_argument(
        "--no-swarm",
        action="store_true",
        help="every batch runs every rule (by default, past a machine's first 32 batches, every fourth is a swarm"
        " batch: each of its rules off with probability one half; the summary counts them)",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="after a failure, keep running that machine and report every distinct failure (to survey a target)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress lines, and a short summary (no per-rule counts)"
    )
    parser.add_argument("--device", default="cpu", help="torch device of the kv machine's pool (cpu, cuda)")
    parser.add_argument(
        "--target",
        action="append",
        default=None,
        help="drive this target beside the spec (repeatable): a built-in name (sglang, vllm, minisgl:PATH,"
        " reference, optimized), module:attribute, or an entry point of group radixspec.targets. Several run"
        " side by side when each profile follows the spec; one that makes its own eviction choices runs alone",
    )
    parser.add_argument(
        "--lru",
        choices=["strict", "sync"],
        default=None,
        help="strict (each target evicts what the spec would) or sync (the spec follows one target's allowed"
        " choice); default: the target profile's",
    )
    parser.add_argument(
        "--list-targets",
        action="store_true",
        help="list the targets (every engine's variants), what each needs and whether it is ready (each engine's"
        " target resolved in a fresh interpreter: seconds); exit",
    )
    parser.add_argument(
        "--workers",
        type=non_negative_int,
        default=available_cpus(),
        help="worker processes (the CPUs this process may use: its affinity and its cgroup's quota; 0: run in"
        " this process)",
    )
    parser.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the batches as Ray tasks: a cluster address, 'auto' (RAY_ADDRESS or a running cluster),"
        " or 'local' (start one here with --workers CPUs)",
    )
    parser.add_argument(
        "--db", default=None, help="corpus of failing examples: a directory, or redis://HOST:PORT/N (shared)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("fuzz-failures"), help="where failures are written as pytest files"
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write a JSON summary here (docs/campaigns.md: schema)"
    )
    parser.add_argument(
        "--coverage",
        action="store_true",
        help="measure the line and branch coverage of the target engine's cache modules (in the worker processes;"
        " needs coverage.py: pip install 'radixspec[coverage]'); the summary and the JSON list each module's lines"
        " never reached",
    )
    parser.add_argument(
        "--junit-xml",
        type=Path,
        default=None,
        metavar="PATH",
        help="write a JUnit XML report here: one test case per machine, its failures with their regression files",
    )
    args = parser.parse_args(argv)
    args.fresh_seed = args.seed is None
    if args.seed is None:
        args.seed = secrets.randbelow(2**32)
    if args.list_targets:
        print("\n".join(list_targets()))
        raise SystemExit(EXIT_OK)
    select(parser, args)
    if args.device != "cpu":
        # torch is imported only for a device other than the CPU: a device this machine lacks is a usage error
        from radixspec.optimized.inputs import device_of
        from radixspec.spec.errors import CacheError

        try:
            device_of(args.device)
        except CacheError as exc:
            parser.error(f"--device {args.device}: {exc}")
    if args.coverage:
        check_coverage(parser, args)
    if args.ray is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            parser.error("--ray needs Ray: pip install 'radixspec[ray]' (or pip install ray)")
    if args.db is not None and args.db.startswith("redis://"):
        try:
            database_for(args.db)
        except Exception as exc:  # a bad URL or a missing redis package: the user's setup, reported as usage
            parser.error(f"--db {args.db}: {exc}")
    return args
