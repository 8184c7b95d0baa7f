"""``python -m fuzz``: differential state machines for a budget, on every core or a Ray cluster, then a summary.

Batches of examples run with their own seeds (derived from ``--seed``, the
machine and the batch number, so a run is replayable whatever the worker
count), cycling through the chosen machines. Where they run: in worker
processes (``--workers``, default all cores), in this process
(``--workers 0``), or as Ray tasks (``--ray ADDRESS|auto|local``).

A failure is printed the moment its first example fails (before shrinking);
shrinking stops with the budget; the failure is then written as a runnable
pytest file under ``--out`` and that machine stops (the others go on). The
wall time stays within the budget plus 10 s. ``--db`` keeps a corpus of
failing examples (a directory, or Redis for a cluster): a rerun replays them
first and says so.

Exit status: 0 no failure; 1 failures found (each has a regression file);
2 usage error (bad option, unknown machine, implementation or target);
3 the campaign itself broke (a worker died, Ray unreachable).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TextIO

# light imports only: a usage error must not wait for torch (the machines, adapters and regression writer
# import it, so they are imported where a campaign starts)
from .batches import BatchResult, BatchSpec, FailureReport, database_for, database_key, run_batch
from .messages import bounded, cut, one_line
from .profiles import CAMPAIGN_EXAMPLES, CAMPAIGN_STEPS
from .stats import REACH, CampaignStats, shown
from .targets import TargetError, list_targets, resolve

# our implementations (fuzz.adapters.CACHE_IMPLEMENTATIONS) and the machines (fuzz.machines.MACHINES), by name
IMPLEMENTATIONS = ("reference", "optimized")
MACHINE_NAMES = ("cache", "manager", "scheduler", "kv")

EXIT_OK, EXIT_FAILURES, EXIT_USAGE, EXIT_BROKEN = 0, 1, 2, 3
# seconds a batch keeps free before the budget ends (its shrinking ends there), and the grace after it
MARGIN_S, GRACE_S = 4.0, 5.0


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
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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


def signature(error: str) -> str:
    """What makes two failures the same one: the error's first line with its numbers blanked."""
    first = error.splitlines()[0] if error else ""
    return re.sub(r"\d+", "#", first.split(": ", 1)[-1])[:200]


def batch_seed(seed: int, machine: str, index: int) -> int:
    """A batch's seed: stable for (campaign seed, machine, batch number), whatever runs it."""
    digest = hashlib.sha256(f"{seed}:{machine}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass
class MachineState:
    """How far one machine got."""

    name: str
    batches: int = 0
    examples: int = 0
    stopped: bool = False
    # distinct failures (one, unless --keep-going), each with its regression file (None if not written)
    failures: list[tuple[FailureReport, Path | None]] = field(default_factory=list)
    # failing batches whose failure repeated one already recorded
    extra_failures: int = 0
    replayed: int = 0

    @property
    def failure(self) -> FailureReport | None:
        return self.failures[0][0] if self.failures else None


@dataclass
class Campaign:
    """One campaign: the options, what ran, and what it found."""

    args: argparse.Namespace
    out: TextIO
    stats: CampaignStats = field(default_factory=CampaignStats)
    machines: dict[str, MachineState] = field(default_factory=dict)
    start: float = 0.0
    # machines (and, with --keep-going, (machine, failure signature) pairs) whose failure was announced
    notified: set[object] = field(default_factory=set)
    backend_name: str = ""

    def print(self, *parts: object) -> None:
        print(*parts, file=self.out, flush=True)

    @property
    def budget_s(self) -> float | None:
        if self.args.examples:
            return None
        return 60.0 * (self.args.minutes if self.args.minutes is not None else 1.0)

    @property
    def impls(self) -> tuple[str, ...]:
        return IMPLEMENTATIONS if self.args.impl == "all" else (self.args.impl,)

    def machine_names(self) -> list[str]:
        from .machines import target_machines

        target = self.args.target_info
        if target is not None:
            return target_machines(target) if self.args.machine == "all" else [self.args.machine]
        return list(MACHINE_NAMES) if self.args.machine == "all" else [self.args.machine]

    # ------------------------------------------------------------ scheduling

    def next_spec(self) -> BatchSpec | None:
        """The next batch to run, round robin over the machines still going; None when all are done."""
        live = [state for state in self.machines.values() if not state.stopped and not self.examples_done(state)]
        if not live or self.out_of_time():
            return None
        state = min(live, key=lambda s: (s.batches, list(self.machines).index(s.name)))
        examples = self.args.batch
        if self.args.examples:
            examples = min(examples, self.args.examples - state.examples)
        index = state.batches
        state.batches += 1
        state.examples += examples
        deadline = (self.start + self.budget_s - MARGIN_S) if self.budget_s else float("inf")
        return BatchSpec(
            machine=state.name,
            impls=self.impls,
            target=self.args.target,
            lru=self.args.lru,
            device=self.args.device,
            seed=batch_seed(self.args.seed, state.name, index),
            examples=examples,
            steps=self.args.steps,
            shrink=not self.args.no_shrink,
            start=self.start,
            deadline=deadline,
            database=self.args.db,
        )

    def examples_done(self, state: MachineState) -> bool:
        return bool(self.args.examples) and state.examples >= self.args.examples

    def out_of_time(self) -> bool:
        budget = self.budget_s
        return budget is not None and time.time() - self.start >= budget - MARGIN_S

    # ------------------------------------------------------------ results

    def on_notify(self, machine: str, seed: int, message: str, at: float) -> None:
        """A failure's first example ended: print it now, before shrinking."""
        key = (machine, signature(message))
        if machine in self.notified and (not self.args.keep_going or key in self.notified):
            return
        self.notified.add(machine)
        self.notified.add(key)
        state = self.machines[machine]
        state.stopped = not self.args.keep_going
        shrink = "" if self.args.no_shrink else f" (shrinking, at most until {self.remaining_s():.0f} s from now)"
        self.print(f"\n[{at - self.start:6.1f} s] {machine}: failing example found (batch seed {seed}){shrink}:")
        for line in bounded(message):
            self.print(f"    {line}")

    def remaining_s(self) -> float:
        budget = self.budget_s
        return float("inf") if budget is None else max(0.0, budget - MARGIN_S - (time.time() - self.start))

    def on_result(self, result: BatchResult) -> None:
        """Merge a finished batch's counters; record and write its failure."""
        self.stats.merge(result.stats)
        state = self.machines[result.spec.machine]
        if result.replayed and not state.replayed:
            state.replayed = result.replayed
            self.print(f"{state.name}: replayed {result.replayed} saved failing examples from {self.args.db} first")
        for failure in result.failures:
            seen = {signature(known.error) for known, _ in state.failures}
            if (state.failures and not self.args.keep_going) or signature(failure.error) in seen:
                state.extra_failures += 1
                continue
            state.stopped = not self.args.keep_going
            if (state.name, signature(failure.error)) not in self.notified:
                self.on_notify(state.name, failure.seed, failure.error, failure.found_at)
            name = f"test_{state.name}_seed_{failure.seed}.py"
            if not failure.program:
                state.failures.append((failure, None))
                self.print(
                    f"{state.name}: the failure did not replay (Hypothesis printed no program, e.g. a flaky"
                    f" failure); no regression file, seed {failure.seed} and the error are in the summary"
                )
                continue
            from .regression import regression_source, write_regression_test

            source = regression_source(
                failure.program,
                state.name,
                self.impls,
                self.args.target,
                self.args.lru,
                self.args.device,
                failure.seed,
                failure.error,
                failure.shrunk,
                name,
                failure.reproduce,
            )
            path: Path | None = None
            try:
                path = write_regression_test(self.args.out, name, source)
            except SyntaxError as exc:
                # kept as text beside the tests, so that nothing is lost; the line says what Hypothesis printed
                self.args.out.mkdir(parents=True, exist_ok=True)
                kept = self.args.out / f"{name}.txt"
                kept.write_text(source)
                self.print(
                    f"{state.name}: the failing program does not compile as Python ({exc.msg}, line {exc.lineno}:"
                    f" {(exc.text or '').strip()[:120]}); kept as {kept}"
                )
            state.failures.append((failure, path))
            self.print(
                f"[{failure.reported_at - self.start:6.1f} s] {state.name}: reported;"
                f" regression test: {path or '(not written)'}"
            )

    # ------------------------------------------------------------ the run

    def run(self) -> int:
        self.start = time.time()
        self.machines = {name: MachineState(name) for name in self.machine_names()}
        self.print_header()
        if self.args.db is not None:
            self.report_corpus()
        progress = Progress(self)
        try:
            backend = make_backend(self)
        except RuntimeError as exc:
            self.print(f"error: {exc}")
            return EXIT_BROKEN
        self.backend_name = backend.name
        broken = False
        try:
            while True:
                while backend.has_room() and (spec := self.next_spec()) is not None:
                    backend.submit(spec)
                if not backend.busy():
                    break
                for result in backend.collect(timeout=1.0, notify=self.on_notify):
                    self.on_result(result)
                progress.update()
                if self.budget_s is not None and time.time() - self.start > self.budget_s + GRACE_S:
                    backend.cancel()
                    break
        except BackendError as exc:
            self.print(f"\nerror: {exc}")
            broken = True
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM: stop the workers, then report what ran
            backend.cancel()
            self.print("\ninterrupted: the summary covers the batches that finished")
            broken = True
        finally:
            backend.close()
        progress.done()
        elapsed = time.time() - self.start
        self.print_summary(elapsed)
        if self.args.json is not None:
            self.write_json(elapsed)
        if broken:
            return EXIT_BROKEN
        return EXIT_FAILURES if any(state.failure for state in self.machines.values()) else EXIT_OK

    def print_header(self) -> None:
        target = self.args.target_info
        mode = self.args.lru or (target.profile.default_lru if target is not None else "")
        what = (
            f"target {target.name} (profile: {target.profile.name}; LRU mode: {mode})"
            if target is not None
            else f"implementations {', '.join(self.impls)} (the spec is the oracle of cache and manager)"
        )
        budget = f"{self.budget_s:.0f} s" if self.budget_s else f"{self.args.examples} examples per machine"
        where = (
            f"Ray ({self.args.ray})"
            if self.args.ray
            else (f"{self.args.workers} workers" if self.args.workers else "this process")
        )
        self.print(
            f"radixspec fuzz: machines {', '.join(self.machines)}; {what}; seed {self.args.seed}; budget {budget};"
            f" batches of {self.args.batch} examples x {self.args.steps} steps on {where}"
        )

    def report_corpus(self) -> None:
        database = database_for(self.args.db)
        assert database is not None
        for name in self.machines:
            spec = BatchSpec(name, self.impls, self.args.target, self.args.lru, self.args.device, 0, 1, 1, False, 0, 0)
            saved = len(list(database.fetch(database_key(spec))))
            if saved:
                self.print(f"corpus {self.args.db}: {saved} saved failing examples of {name}; they are replayed first")

    # ------------------------------------------------------------ summary

    def print_summary(self, elapsed: float) -> None:
        p, s = self.print, self.stats
        p("")
        p("== summary ==")
        p(
            f"time {elapsed:.1f} s   batches {sum(m.batches for m in self.machines.values())}   examples {s.examples}"
            f"   steps {s.steps} ({s.steps / max(elapsed, 1e-9):.0f} steps/s)   on {self.backend_name}"
        )
        p(
            f"reach: largest tree {shown(s.largest_tree_pages, ' pages')},"
            f" longest key {shown(s.longest_key_tokens, ' tokens')},"
            f" deepest path {shown(s.deepest_path_nodes, ' nodes')},"
            f" most evictable leaves {shown(s.most_evictable_leaves)},"
            f" largest eviction {shown(s.largest_evict_pages, ' pages')}, most namespaces {shown(s.most_namespaces)},"
            f" largest KV store {shown(s.largest_store_rows, ' rows')}  (n/a: not observable by these machines)"
        )
        p(f"evicted pages {s.evicted_pages}   KV events replayed {s.events_replayed}")
        if self.args.quiet:
            p(
                f"rules hit: {len(s.rules)} distinct, {sum(s.rejected.values())} rejected calls,"
                f" {sum(s.skipped.values())} invalid calls not sent (listed without --quiet, and in --json)"
            )
        else:
            self.print_counts(s)
        failed = [(state, failure, path) for state in self.machines.values() for failure, path in state.failures]
        if not failed:
            p("failures: none")
            return
        p(f"failures: {len(failed)}")
        for state, failure, path in failed:
            p("")
            p(
                f"--- {state.name}: first failing example after {failure.found_at - self.start:.1f} s,"
                f" {'' if failure.shrunk else 'not '}shrunk and reported after {failure.reported_at - self.start:.1f} s"
                f" (batch seed {failure.seed})"
            )
            for line in bounded(failure.error):
                p(line)
            if path is not None:
                p(f"regression test: {path}  (python -m pytest {path}; it holds the whole message)")
            else:
                p(f"regression test: none written (the program did not replay as Python); batch seed {failure.seed}")
            if state.extra_failures:
                p(f"({state.extra_failures} more batches of this machine failed too)")
            p("shrunk program:" if failure.shrunk else "failing program (not shrunk):")
            for statement in failure.program:
                for line in one_line(statement).splitlines():
                    p(f"    {cut(line)}")

    def print_counts(self, s: CampaignStats) -> None:
        """Every rule's steps, every rejection and every call not sent, by name."""
        p = self.print
        p("rules hit:")
        for rule_name, count in sorted(s.rules.items()):
            p(f"  {rule_name:<52} {count:>9}")
        if s.rejected:
            p("rejected calls (same error class from every implementation, state unchanged):")
            for error, count in sorted(s.rejected.items()):
                p(f"  {error:<52} {count:>9}")
        if s.skipped:
            p("invalid calls not sent (the target does not validate; the spec rejects them):")
            for label, count in sorted(s.skipped.items()):
                p(f"  {label:<52} {count:>9}")

    def write_json(self, elapsed: float) -> None:
        s = self.stats
        summary: dict[str, Any] = {
            "elapsed_s": round(elapsed, 3),
            "budget_s": self.budget_s,
            "seed": self.args.seed,
            "machines": list(self.machines),
            "implementations": list(self.impls) if self.args.target is None else [],
            "target": self.args.target,
            "lru": self.args.lru,
            "backend": self.backend_name,
            "batches": sum(m.batches for m in self.machines.values()),
            "examples": s.examples,
            "steps": s.steps,
            "steps_per_s": round(s.steps / max(elapsed, 1e-9), 1),
            **{name: getattr(s, name) for name in REACH},
            "evicted_pages": s.evicted_pages,
            "events_replayed": s.events_replayed,
            "rules": dict(s.rules),
            "rejected": dict(s.rejected),
            "skipped": dict(s.skipped),
            "failures": [
                {
                    "machine": state.name,
                    "error": failure.error,
                    "found_after_s": round(failure.found_at - self.start, 3),
                    "reported_after_s": round(failure.reported_at - self.start, 3),
                    "seed": failure.seed,
                    "shrunk": failure.shrunk,
                    "regression_test": str(path) if path else None,
                }
                for state in self.machines.values()
                for failure, path in state.failures
            ],
        }
        self.args.json.parent.mkdir(parents=True, exist_ok=True)
        self.args.json.write_text(json.dumps(summary, indent=2))


class Progress:
    """A progress line: rewritten in place on a terminal, every 10 s otherwise."""

    def __init__(self, campaign: Campaign) -> None:
        self.campaign = campaign
        self.tty = campaign.out.isatty()
        self.last = 0.0

    def update(self) -> None:
        campaign = self.campaign
        elapsed = time.time() - campaign.start
        if campaign.args.quiet or (not self.tty and elapsed - self.last < 10):
            return
        self.last = elapsed
        budget = campaign.budget_s
        of = f"/{budget:.0f}" if budget else ""
        s = campaign.stats
        shrinking = [
            name for name, state in campaign.machines.items() if name in campaign.notified and state.failure is None
        ]
        reach = [
            f"{what} {value}{unit}"
            for what, value, unit in (
                ("largest tree", s.largest_tree_pages, " pages"),
                ("longest key", s.longest_key_tokens, ""),
                ("largest KV store", s.largest_store_rows, " rows"),
            )
            if value is not None
        ]
        line = "  ".join(
            [
                f"[{elapsed:5.0f}{of} s] examples {s.examples}",
                f"steps {s.steps}",
                *reach,
                f"failures {sum(1 for m in campaign.machines.values() if m.failure)}",
                *([f"shrinking: {', '.join(shrinking)}"] if shrinking else []),
            ]
        )
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=campaign.out, flush=True)

    def done(self) -> None:
        if self.tty and not self.campaign.args.quiet:
            print(file=self.campaign.out)


# ---------------------------------------------------------------- where batches run


class BackendError(RuntimeError):
    """The campaign's own machinery failed (a worker died, Ray is unreachable)."""


class InProcessBackend:
    """Batches one at a time in this process (``--workers 0``)."""

    name = "this process"

    def __init__(self, campaign: Campaign) -> None:
        self.pending: list[BatchSpec] = []

    def has_room(self) -> bool:
        return not self.pending

    def submit(self, spec: BatchSpec) -> None:
        self.pending.append(spec)

    def busy(self) -> bool:
        return bool(self.pending)

    def collect(self, timeout: float, notify: Any) -> list[BatchResult]:
        spec = self.pending.pop()
        return [run_batch(spec, notify)]

    def cancel(self) -> None:
        self.pending.clear()

    def close(self) -> None:
        pass


_NOTIFY_QUEUE: Any = None


def _init_worker(notify_queue: Any) -> None:
    """A worker process: keep the queue failures are announced on; one torch thread (the cores are the workers)."""
    global _NOTIFY_QUEUE
    _NOTIFY_QUEUE = notify_queue
    import torch

    torch.set_num_threads(1)


def _run_batch_in_worker(spec: BatchSpec) -> BatchResult:
    return run_batch(spec, lambda *event: _NOTIFY_QUEUE.put(event))


class ProcessBackend:
    """Batches in worker processes, one per core by default (``--workers N``)."""

    def __init__(self, campaign: Campaign) -> None:
        # a fork server that imported the machines once: each worker starts in milliseconds, not seconds
        context = get_context("forkserver")
        context.set_forkserver_preload(["fuzz.batches", "fuzz.machines"])
        self.workers: int = campaign.args.workers
        self.name = f"{self.workers} worker processes"
        self.notify_queue = context.Queue()
        self.pool = ProcessPoolExecutor(
            max_workers=self.workers, mp_context=context, initializer=_init_worker, initargs=(self.notify_queue,)
        )
        self.futures: set[Future[BatchResult]] = set()

    def has_room(self) -> bool:
        return len(self.futures) < int(self.workers)

    def submit(self, spec: BatchSpec) -> None:
        self.futures.add(self.pool.submit(_run_batch_in_worker, spec))

    def busy(self) -> bool:
        return bool(self.futures)

    def collect(self, timeout: float, notify: Any) -> list[BatchResult]:
        done, self.futures = wait(self.futures, timeout=timeout, return_when=FIRST_COMPLETED)
        self.drain(notify)
        results = []
        for future in done:
            try:
                results.append(future.result())
            except Exception as exc:  # a worker that died takes its batch with it: the campaign is broken
                raise BackendError(f"a worker process failed: {exc!r}") from exc
        return results

    def drain(self, notify: Any) -> None:
        while True:
            try:
                event = self.notify_queue.get_nowait()
            except queue.Empty:
                return
            notify(*event)

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()
        for process in list(getattr(self.pool, "_processes", {}).values()):
            process.terminate()
        self.futures.clear()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class RayBackend:
    """Batches as Ray tasks on a cluster (``--ray ADDRESS|auto``) or a local one (``--ray local``)."""

    def __init__(self, campaign: Campaign) -> None:
        import ray

        self.ray = ray
        address = campaign.args.ray
        try:
            if address == "local":
                ray.init(num_cpus=max(1, campaign.args.workers), include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        except Exception as exc:
            raise RuntimeError(f"cannot reach Ray at {address!r}: {exc}") from exc
        self.capacity = max(1, int(ray.cluster_resources().get("CPU", 1)))  # type: ignore[no-untyped-call]
        self.name = f"Ray ({address}, {self.capacity} CPUs)"
        self.remote = ray.remote(num_cpus=1)(run_batch)
        self.refs: dict[Any, BatchSpec] = {}

    def has_room(self) -> bool:
        return len(self.refs) < self.capacity

    def submit(self, spec: BatchSpec) -> None:
        self.refs[self.remote.remote(spec)] = spec

    def busy(self) -> bool:
        return bool(self.refs)

    def collect(self, timeout: float, notify: Any) -> list[BatchResult]:
        done, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=timeout)
        results = []
        for ref in done:
            del self.refs[ref]
            try:
                results.append(self.ray.get(ref))
            except Exception as exc:
                raise BackendError(f"a Ray task failed: {exc!r}") from exc
        return results

    def cancel(self) -> None:
        for ref in self.refs:
            self.ray.cancel(ref, force=True)
        self.refs.clear()

    def close(self) -> None:
        self.ray.shutdown()


def make_backend(campaign: Campaign) -> InProcessBackend | ProcessBackend | RayBackend:
    if campaign.args.ray is not None:
        return RayBackend(campaign)
    if campaign.args.workers == 0:
        return InProcessBackend(campaign)
    return ProcessBackend(campaign)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the campaign described by ``args``; print progress and a summary; return the exit status."""
    return Campaign(args, out).run()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m fuzz``; SIGTERM stops the campaign like Ctrl-C (workers included)."""
    signal.signal(signal.SIGTERM, _interrupt)
    return run(parse_args(argv))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
