"""``python -m fuzz``: run differential state machines for a time budget and summarise.

Batches of examples run one after another, each with its own seed
(derived from ``--seed``), cycling through the chosen machines, until the
time budget or example count is spent. A failing machine is shrunk by
Hypothesis; its program is printed as Python (paste it into a regression
test) and that machine stops; the others go on.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from hypothesis import Phase, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

from .adapters import iter_impl_names
from .machines import MACHINES, FailureClock, machine_for, target_machines
from .stats import STATS
from .targets import TargetError, list_targets, resolve


@dataclass
class Failure:
    """One machine's failure: where, when, and the shrunk program."""

    machine: str
    seed: int
    found_after_s: float
    reported_after_s: float
    error: str
    program: list[str] = field(default_factory=list)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fuzz",
        description="Differential fuzz campaign: the spec against the chosen implementations.",
    )
    parser.add_argument("--machine", choices=[*MACHINES, "all"], default="all", help="state machine(s) to run")
    parser.add_argument(
        "--impl", default="reference", help="implementation(s) to drive: reference, optimized, or all (both)"
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=None, help="time budget (default 1)")
    budget.add_argument("--examples", type=int, default=None, help="stop after this many examples per machine")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed (batches derive theirs from it)")
    parser.add_argument("--batch", type=int, default=None, help="examples per batch (default: campaign profile)")
    parser.add_argument("--steps", type=int, default=None, help="steps per example (default: campaign profile)")
    parser.add_argument("--no-shrink", action="store_true", help="report the first failing example as found")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
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
    args = parser.parse_args(argv)
    if args.list_targets:
        print("\n".join(list_targets()))
        raise SystemExit(0)
    args.target_info = None
    if args.target is not None:
        try:
            args.target_info = resolve(args.target)
        except TargetError as exc:
            parser.error(str(exc))
        supported = target_machines(args.target_info)
        if args.machine != "all" and args.machine not in supported:
            parser.error(f"target {args.target!r} has no {args.machine} machine (it has: {', '.join(supported)})")
    elif args.lru is not None:
        parser.error("--lru applies to --target only")
    return args


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the campaign described by ``args``; print progress and a summary; return the exit status."""
    impls = tuple(iter_impl_names(args.impl))
    target = args.target_info
    if target is not None:
        names = target_machines(target) if args.machine == "all" else [args.machine]
    else:
        names = list(MACHINES) if args.machine == "all" else [args.machine]
    base = settings.get_profile("campaign")
    batch_settings = settings(
        base,
        max_examples=args.batch or base.max_examples,
        stateful_step_count=args.steps or base.stateful_step_count,
        phases=[phase for phase in base.phases if not (args.no_shrink and phase == Phase.shrink)],
    )
    budget_s = None if args.examples else 60.0 * (args.minutes if args.minutes is not None else 1.0)
    STATS.reset()
    FailureClock.first = None
    failures: list[Failure] = []
    examples_run = dict.fromkeys(names, 0)
    live = list(names)
    start = time.monotonic()
    progress = Progress(out, quiet=args.quiet)
    what = (
        f"target {target.name} (profile: {target.profile.name}; LRU mode: {args.lru or target.profile.default_lru})"
        if target is not None
        else f"implementations {', '.join(impls)} (the spec is the oracle of cache and manager)"
    )
    print(
        f"radixspec fuzz: machines {', '.join(names)}; {what}; seed {args.seed};"
        f" budget {f'{budget_s:.0f} s' if budget_s else f'{args.examples} examples per machine'}",
        file=out,
    )
    batch = 0
    while live:
        if budget_s is not None and time.monotonic() - start >= budget_s:
            break
        name = live[batch % len(live)]
        batch_seed = args.seed * 1_000_003 + batch
        batch += 1
        size = batch_settings.max_examples
        if args.examples:
            size = min(size, args.examples - examples_run[name])
        machine = machine_for(name, impls, args.device, target, args.lru)
        machine._hypothesis_internal_use_seed = batch_seed  # type: ignore[attr-defined]
        FailureClock.first = None
        exc, lines = run_batch(machine, settings(batch_settings, max_examples=size))
        if exc is not None:  # a failing example: record it, stop this machine
            now = time.monotonic()
            failures.append(
                Failure(
                    machine=name,
                    seed=batch_seed,
                    found_after_s=(FailureClock.first or now) - start,
                    reported_after_s=now - start,
                    error=f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}",
                    program=failing_program(exc, lines),
                )
            )
            live.remove(name)
        examples_run[name] += size
        if args.examples and examples_run[name] >= args.examples and name in live:
            live.remove(name)
        progress.update(time.monotonic() - start, budget_s, batch, failures)
    progress.done()
    print_summary(out, time.monotonic() - start, batch, failures, shrunk=not args.no_shrink)
    return 1 if failures else 0


def run_batch(machine: type[RuleBasedStateMachine], batch: settings) -> tuple[Exception | None, list[str]]:
    """Run one batch of examples; return its failure (None if it passed) and what Hypothesis reported."""
    lines: list[str] = []
    test = get_state_machine_test(machine, settings=batch)
    try:
        with with_reporter(lambda value: lines.append(str(value))):
            test()
    except Exception as exc:
        return exc, lines
    return None, lines


def failing_program(exc: BaseException, reported: list[str]) -> list[str]:
    """The shrunk program as Python lines, and the @reproduce_failure line, from the error's notes.

    When Hypothesis found several distinct failures (an ExceptionGroup), each one's program follows
    a line naming its error.
    """
    if isinstance(exc, BaseExceptionGroup):
        lines: list[str] = []
        for number, sub in enumerate(exc.exceptions, start=1):
            lines.append(f"# failure {number}: {type(sub).__name__}: {str(sub).splitlines()[0] if str(sub) else ''}")
            lines.extend(failing_program(sub, []))
        return lines
    text = [line for chunk in [*getattr(exc, "__notes__", []), *reported] for line in str(chunk).splitlines()]
    keep = [line for line in text if line.startswith(("state", "(", "@reproduce_failure")) or " = state." in line]
    return keep + [line for line in text if "reproduce_failure(" in line and not line.startswith("@")]


class Progress:
    """A progress line: rewritten in place on a terminal, every 10 s otherwise."""

    def __init__(self, out: TextIO, quiet: bool) -> None:
        self.out = out
        self.quiet = quiet
        self.tty = out.isatty()
        self.last = 0.0

    def update(self, elapsed: float, budget_s: float | None, batches: int, failures: list[Failure]) -> None:
        if self.quiet or (not self.tty and elapsed - self.last < 10):
            return
        self.last = elapsed
        of = f"/{budget_s:.0f}" if budget_s else ""
        line = (
            f"[{elapsed:5.0f}{of} s] batches {batches}  examples {STATS.examples}  steps {STATS.steps}"
            f"  largest tree {STATS.largest_tree_pages} pages  failures {len(failures)}"
        )
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=self.out, flush=True)

    def done(self) -> None:
        if self.tty and not self.quiet:
            print(file=self.out)


def print_summary(out: TextIO, elapsed: float, batches: int, failures: list[Failure], shrunk: bool = True) -> None:
    """The campaign's summary: volume, coverage of rules, rejections, failures with their programs."""

    def p(*parts: object) -> None:
        print(*parts, file=out)

    p("")
    p("== summary ==")
    p(
        f"time {elapsed:.1f} s   batches {batches}   examples {STATS.examples}   steps {STATS.steps}"
        f" ({STATS.steps / max(elapsed, 1e-9):.0f} steps/s)"
    )
    p(
        f"largest tree {STATS.largest_tree_pages} pages   evicted pages {STATS.evicted_pages}"
        f"   largest KV store {STATS.largest_store_rows} rows"
    )
    p("rules hit:")
    for rule_name, count in sorted(STATS.rules.items()):
        p(f"  {rule_name:<44} {count:>9}")
    p("rejected calls (same error class from every implementation, state unchanged):")
    for error, count in sorted(STATS.rejected.items()):
        p(f"  {error:<44} {count:>9}")
    if STATS.skipped:
        p("invalid calls not sent (the target does not validate; the spec rejects them):")
        for label, count in sorted(STATS.skipped.items()):
            p(f"  {label:<44} {count:>9}")
    if not failures:
        p("failures: none")
        return
    p(f"failures: {len(failures)}")
    for failure in failures:
        p("")
        p(
            f"--- {failure.machine}: first failing example after {failure.found_after_s:.1f} s,"
            f" {'' if shrunk else 'not '}shrunk and reported after {failure.reported_after_s:.1f} s"
            f" (batch seed {failure.seed})"
        )
        p(failure.error)
        p("shrunk program:" if shrunk else "failing program (not shrunk):")
        for line in failure.program:
            p(f"    {line}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m fuzz``."""
    return run(parse_args(argv))
