"""``radixspec fuzz``: differential state machines for a budget, on every core or a Ray cluster, then a summary.

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
2 usage error (bad option, unknown machine, implementation or target, a
target that is not ready); 3 the campaign itself broke: a worker died, Ray
was unreachable, a machine or its target failed to import or build in a
batch, a machine ran no example, or the run was interrupted. A broken
campaign says why in the last lines of its summary, in the JSON
(``broken``) and in the JUnit report (an error per machine); it never
reads as clean.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

# light imports only (see fuzz/cli.py); the command line, the backends and the report live in their own modules
from .backends import BackendError, make_backend
from .batches import BatchResult, BatchSpec, FailureReport, database_for, database_key
from .cli import (
    EXIT_BROKEN,
    EXIT_FAILURES,
    EXIT_OK,
    EXIT_USAGE,
    MACHINE_NAMES,
    parse_args,
)
from .engine_coverage import Arc, analyse
from .messages import bounded
from .profiles import SHALLOW_STEPS
from .registry import IMPLEMENTATIONS, machines_for
from .report import print_summary, write_json, write_junit
from .stats import CampaignStats
from .summary import CampaignSummary, FailureSummary, MachineSummary, versions
from .targets.releases import installed_release

__all__ = [
    "EXIT_BROKEN",
    "EXIT_FAILURES",
    "EXIT_OK",
    "EXIT_USAGE",
    "IMPLEMENTATIONS",
    "MACHINE_NAMES",
    "Campaign",
    "CampaignStats",
    "machines_for",
    "main",
    "parse_args",
    "run",
]

# a machine's batches before its first swarm batch
SWARM_FROM = 32
# a machine's batches before its first production batch
PRODUCTION_FROM = 16
# seconds a batch keeps free before the budget ends (its shrinking ends there), and the grace after it
MARGIN_S, GRACE_S = 4.0, 5.0


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
    # failures announced by a worker the moment they happened: (batch seed, message, time.time())
    announced: list[tuple[int, str, float]] = field(default_factory=list)
    # examples that ran (``examples`` counts those handed to batches)
    ran: int = 0
    # why this machine could not run (a batch could not start it, or it ran no example); None when it ran
    broken: str | None = None

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
    # why the campaign as a whole broke (the backend failed, the run was interrupted); the machines' own reasons
    # are theirs
    problems: list[str] = field(default_factory=list)
    # --coverage: the arcs each engine module ran, over every batch
    arcs: dict[str, set[Arc]] = field(default_factory=dict)

    def print(self, *parts: object) -> None:
        print(*parts, file=self.out, flush=True)

    @property
    def budget_s(self) -> float | None:
        if self.args.examples:
            return None
        return 60.0 * (self.args.minutes if self.args.minutes is not None else 1.0)

    @property
    def targets(self) -> tuple[str, ...]:
        """What the machines drive beside the spec (--impl and --target), by name."""
        targets: tuple[str, ...] = self.args.targets
        return targets

    def machine_names(self) -> list[str]:
        if self.args.machine != "all":
            return [self.args.machine]
        return machines_for(self.targets, self.args.foreign)

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
        # every other batch of a machine is shallow, its first included: cheap examples first, so that the
        # deep states cost shallow bugs no time; past the first SWARM_FROM batches (where the common bugs are
        # found: a swarm batch there doubled a planted bug's catch time), every other deep batch is a swarm batch,
        # half its rules off, so that rare interleavings are not drowned by the common ones
        # past PRODUCTION_FROM, every other deep batch that is not a swarm batch is a production batch: the
        # machines that drive requests draw production pools too (an example there costs as much as hundreds)
        shallow = index % 2 == 0
        swarm = index >= SWARM_FROM and index % 4 == 3 and not getattr(self.args, "no_swarm", False)
        production = index >= PRODUCTION_FROM and index % 4 == 1
        state.examples += examples
        deadline = (self.start + self.budget_s - MARGIN_S) if self.budget_s else float("inf")
        return BatchSpec(
            machine=state.name,
            targets=self.targets,
            lru=self.args.lru,
            device=self.args.device,
            seed=batch_seed(self.args.seed, state.name, index),
            examples=examples,
            steps=min(self.args.steps, SHALLOW_STEPS) if shallow else self.args.steps,
            shrink=not self.args.no_shrink,
            start=self.start,
            deadline=deadline,
            database=self.args.db,
            shallow=shallow,
            coverage=self.engine_modules,
            swarm=batch_seed(self.args.seed, f"{state.name}:swarm", index) if swarm else None,
            production=production,
        )

    @property
    def engine_modules(self) -> tuple[str, ...]:
        """What --coverage measures (none without it)."""
        modules: tuple[str, ...] = (
            getattr(self.args, "engine_modules", ()) if getattr(self.args, "coverage", False) else ()
        )
        return modules

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
        state.announced.append((seed, message, at))
        state.stopped = not self.args.keep_going
        shrink = "" if self.args.no_shrink else f" (shrinking, at most until {self.remaining_s():.0f} s from now)"
        self.print(f"\n[{at - self.start:6.1f} s] {machine}: failing example found (batch seed {seed}){shrink}:")
        for line in bounded(message):
            self.print(f"    {line}")

    def keep_announced(self) -> None:
        """A failure announced by a batch that never returned (cancelled after the grace, or lost with its
        worker) still counts: it is recorded as found, unshrunk and without a program, so the exit status is 1."""
        for state in self.machines.values():
            if state.failures or not state.announced:
                continue
            seed, message, at = state.announced[0]
            self.print(
                f"{state.name}: the batch of seed {seed} did not return before the budget's grace ended; its failure"
                " is reported as announced, without a program (rerun with --no-shrink to get one)"
            )
            failure = FailureReport(state.name, seed, message, [], at, time.time(), shrunk=False)
            state.failures.append((failure, None))

    def remaining_s(self) -> float:
        budget = self.budget_s
        return float("inf") if budget is None else max(0.0, budget - MARGIN_S - (time.time() - self.start))

    def on_result(self, result: BatchResult) -> None:
        """Merge a finished batch's counters; record and write its failure; stop a machine that cannot start."""
        self.stats.merge(result.stats)
        for module, arcs in result.arcs.items():
            self.arcs.setdefault(module, set()).update(arcs)
        state = self.machines[result.spec.machine]
        if result.error is not None:
            if state.broken is None:
                state.broken = f"could not start: {result.error}"
                self.print(f"[{time.time() - self.start:6.1f} s] {state.name}: error: {state.broken}")
            state.stopped = True
            return
        state.ran += result.stats.examples
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
                self.targets,
                self.args.lru,
                self.args.device,
                failure.seed,
                failure.error,
                failure.shrunk,
                name,
                failure.reproduce,
                failure.shallow,
                campaign_seed=self.args.seed,
                production=failure.production,
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
            backend = make_backend(self.args)
        except RuntimeError as exc:
            self.print(f"error: {exc}")
            self.problems.append(str(exc))
            return self.finish(progress)
        self.backend_name = backend.name
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
            self.problems.append(str(exc))
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM: stop the workers, then report what ran
            backend.cancel()
            self.print("\ninterrupted: the summary covers the batches that finished")
            self.problems.append("interrupted (Ctrl-C or SIGTERM) before the budget ended")
        finally:
            backend.close()
        self.keep_announced()
        return self.finish(progress)

    def finish(self, progress: Progress) -> int:
        """Name the machines that ran nothing, write the summary (text, JSON, JUnit), and return the exit status."""
        for state in self.machines.values():
            if state.broken is None and not state.failures and state.ran == 0:
                state.broken = (
                    f"ran no example: its {state.batches} batches ended before their first example"
                    if state.batches
                    else "ran no example: no batch of it started"
                )
        progress.done()
        summary = self.summary(time.time() - self.start)
        print_summary(summary, self.print, quiet=self.args.quiet)
        if self.args.json is not None:
            write_json(summary, self.args.json)
        if self.args.junit_xml is not None:
            write_junit(summary, self.args.junit_xml)
        if summary.broken:
            return EXIT_BROKEN
        return EXIT_FAILURES if summary.failures else EXIT_OK

    def summary(self, elapsed: float) -> CampaignSummary:
        """What ran and what it found, for the writers (times relative to the start)."""
        machines = tuple(
            MachineSummary(
                state.name,
                state.batches,
                state.examples,
                tuple(
                    FailureSummary(
                        state.name,
                        failure.error,
                        failure.seed,
                        failure.found_at - self.start,
                        failure.reported_at - self.start,
                        failure.shrunk,
                        path,
                        tuple(failure.program),
                    )
                    for failure, path in state.failures
                ),
                state.extra_failures,
                state.ran,
                state.broken,
            )
            for state in self.machines.values()
        )
        return CampaignSummary(
            elapsed_s=elapsed,
            budget_s=self.budget_s,
            seed=self.args.seed,
            seed_was_fresh=bool(getattr(self.args, "fresh_seed", False)),
            machines=machines,
            targets=self.targets,
            lru=self.args.lru,
            backend=self.backend_name,
            stats=self.stats,
            started_at=self.start,
            versions=versions(self.targets),
            problems=tuple(self.problems),
            coverage=analyse(self.engine_modules, self.arcs) if self.engine_modules else None,
        )

    def print_header(self) -> None:
        foreign = list(self.args.foreign.values())
        routers = [info.name for info in foreign if info.router_factory is not None]
        if routers:
            workers = [name for name in self.targets if name not in routers] or ["reference", "optimized"]
            what = (
                f"routers {', '.join(routers)} and ours, over workers {', '.join(workers)} (their own pages the oracle)"
            )
        elif len(self.targets) == 1 and foreign:
            target = foreign[0]
            mode = self.args.lru or target.profile.default_lru
            # the profile names the release it was written for; the engine that runs may be another it supports
            engine = next(iter(target.requires), None)
            running = "" if engine is None else f"; running {engine[0]} {installed_release(engine[0])}"
            what = f"target {target.name} (profile: {target.profile.name}; LRU mode: {mode}{running})"
        else:
            what = f"targets {', '.join(self.targets)} (the spec is the oracle of cache and manager)"
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
            spec = BatchSpec(name, self.targets, self.args.lru, self.args.device, 0, 1, 1, False, 0, 0)
            saved = len(list(database.fetch(database_key(spec))))
            if saved:
                self.print(f"corpus {self.args.db}: {saved} saved failing examples of {name}; they are replayed first")


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


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the campaign described by ``args``; print progress and a summary; return the exit status."""
    return Campaign(args, out).run()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``radixspec fuzz``; SIGTERM stops the campaign like Ctrl-C (workers included)."""
    signal.signal(signal.SIGTERM, _interrupt)
    return run(parse_args(argv))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
