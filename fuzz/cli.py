"""The command line of ``python -m fuzz``: its options, their checks, and the exit statuses.

Light imports only: a usage error must not wait for torch (the machines, the
adapters and the regression writer import it; a campaign imports them when it
starts). Every bad option is a usage error (exit 2) before anything runs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from .batches import database_for
from .profiles import CAMPAIGN_EXAMPLES, CAMPAIGN_STEPS
from .targets import TargetError, list_targets, resolve

# our implementations (fuzz.adapters.CACHE_IMPLEMENTATIONS) and the machines (fuzz.machines.MACHINES), by name
IMPLEMENTATIONS = ("reference", "optimized")
MACHINE_NAMES = ("cache", "manager", "scheduler", "kv")

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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fuzz",
        description="Differential fuzz campaign: the spec against our implementations or any target.",
        epilog="Exit status: 0 clean, 1 failures found, 2 usage error, 3 the campaign broke.",
        formatter_class=DefaultsShown,
    )
    parser.add_argument("--machine", choices=[*MACHINE_NAMES, "all"], default="all", help="state machine(s) to run")
    parser.add_argument(
        "--impl",
        choices=[*IMPLEMENTATIONS, "all"],
        default=None,
        help="our implementation(s) driven beside the spec; default: all (the three-way differential)",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=positive_float, default=None, help="time budget; default: 1")
    budget.add_argument("--examples", type=positive_int, default=None, help="stop after this many examples per machine")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed (batches derive theirs from it)")
    parser.add_argument("--batch", type=positive_int, default=CAMPAIGN_EXAMPLES, help="examples per batch")
    parser.add_argument("--steps", type=positive_int, default=CAMPAIGN_STEPS, help="steps per example")
    parser.add_argument("--no-shrink", action="store_true", help="report the first failing example as found")
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
        default=None,
        help="fuzz this target instead of our implementations: a built-in name (sglang, vllm, minisgl:PATH,"
        " reference, optimized), module:attribute, or an entry point of group radixspec.targets",
    )
    parser.add_argument(
        "--lru",
        choices=["strict", "sync"],
        default=None,
        help="with --target: strict (it evicts what the spec would) or sync (the spec follows its allowed"
        " choice); default: the target profile's",
    )
    parser.add_argument("--list-targets", action="store_true", help="list the targets and what each needs; exit")
    parser.add_argument(
        "--workers",
        type=non_negative_int,
        default=os.cpu_count() or 1,
        help="worker processes (every core; 0: run in this process)",
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
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write a JSON summary here")
    args = parser.parse_args(argv)
    if args.list_targets:
        print("\n".join(list_targets()))
        raise SystemExit(EXIT_OK)
    args.target_info = None
    if args.target is not None:
        try:
            args.target_info = resolve(args.target)
        except TargetError as exc:
            parser.error(str(exc))
        from .machines import target_machines

        if args.impl is not None:
            parser.error(
                "--impl drives our implementations; with --target the target is driven (name ours as"
                " --target reference or --target optimized)"
            )
        supported = target_machines(args.target_info)
        if args.machine != "all" and args.machine not in supported:
            parser.error(f"target {args.target!r} has no {args.machine} machine (it has: {', '.join(supported)})")
    elif args.lru is not None:
        parser.error("--lru applies to --target only")
    if args.impl is None:
        args.impl = "all"
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
