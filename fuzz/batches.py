"""One batch of a campaign: a state machine run for some examples with its own seed, anywhere.

A batch is described by a picklable ``BatchSpec`` and run by ``run_batch``
in this process, in a worker process, or as a Ray task; it returns its
counters and its failures (``BatchResult``). A failure is announced through
``notify`` the moment its first failing example ends (before shrinking),
and shrinking stops at the batch's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis.errors import FlakyFailure, FlakyStrategyDefinition, Unsatisfiable
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

from . import profiles  # registers the settings profiles in worker processes too
from .engine_coverage import Arc, measured
from .hypothesis_compat import bound_shrinking, seed_machine, set_database_key
from .stats import STATS, CampaignStats

# a failure's first example has ended: (machine, batch seed, error text, time.time())
Notify = Callable[[str, int, str, float], None]


@dataclass(frozen=True)
class BatchSpec:
    """Everything a batch needs, picklable: machine and what it drives, seed, sizes, deadline, corpus."""

    machine: str
    # what the machine drives beside the spec: --impl and --target names (resolved in the worker)
    targets: tuple[str, ...]
    lru: str | None
    device: str
    seed: int
    examples: int
    steps: int
    shrink: bool
    # time.time() when the campaign started, and by when this batch must have finished (shrinking included)
    start: float
    deadline: float
    # --db: a directory or redis://host:port/n, or None
    database: str | None = None
    # a shallow batch: short examples, no big trees (radixspec.fuzz.profiles.SHALLOW_STEPS; the machine's SHALLOW)
    shallow: bool = False
    # --coverage: the engine modules whose lines and branches this batch measures (fuzz/engine_coverage.py)
    coverage: tuple[str, ...] = ()
    # a swarm batch: its seed picks the rules it turns off (fuzz/machines.py, swarm_off); None: every rule on
    swarm: int | None = None
    # a production batch: the machines that drive requests draw production pools (thousands of pages) too
    production: bool = False


@dataclass
class FailureReport:
    """A failing example of one batch: what broke, when, and the program that reproduces it."""

    machine: str
    seed: int
    # "module.Class: message" of the exception, its message in full
    error: str
    # Python statements of the (shrunk) failing program, one per element
    program: list[str]
    # time.time() of the first failing example, and of the report (after shrinking)
    found_at: float
    reported_at: float
    shrunk: bool
    # the @reproduce_failure line Hypothesis printed
    reproduce: str = ""
    # found by a shallow batch (its machine is rebuilt shallow to replay it)
    shallow: bool = False
    # found by a production batch (elsewhere a production pool drawn ran as a big one: replayed so)
    production: bool = False


@dataclass
class BatchResult:
    """What a batch did."""

    spec: BatchSpec
    stats: CampaignStats
    failures: list[FailureReport] = field(default_factory=list)
    # failing examples from the corpus that this batch replayed first
    replayed: int = 0
    # why the batch could not start (its machine or target failed to import or build): the campaign broke,
    # nothing was checked. "Type: message"; None when the batch ran
    error: str | None = None
    # --coverage: the arcs each engine module ran, by module name (modules that never ran are absent)
    arcs: dict[str, list[Arc]] = field(default_factory=dict)


def database_for(location: str | None) -> ExampleDatabase | None:
    """Hypothesis's example database for --db: a directory, or Redis (redis://host:port/db)."""
    if location is None:
        return None
    if location.startswith("redis://"):
        from hypothesis.extra.redis import RedisExampleDatabase
        from redis import Redis

        return RedisExampleDatabase(Redis.from_url(location))
    return DirectoryBasedExampleDatabase(location)


def database_key(spec: BatchSpec) -> bytes:
    """Where this machine's failing examples live in the corpus: one key per machine and what it drives."""
    driven = f"targets={','.join(spec.targets)}:{spec.lru}"
    return f"radixspec:{spec.machine}:{driven}".encode()


def machine_class(spec: BatchSpec) -> type[RuleBasedStateMachine]:
    """The state machine class the spec names (a target is resolved here, in the worker)."""
    from .machines import machine_for

    return machine_for(spec.machine, spec.targets, spec.device, spec.lru, spec.shallow, spec.swarm, spec.production)


def run_batch(spec: BatchSpec, notify: Notify | None = None) -> BatchResult:
    """Run one batch; its counters come back in the result (the process's STATS is reset first), and with
    --coverage the arcs of the engine modules it ran (the machine built and run under measurement)."""
    with measured(spec.coverage) as arcs:
        result = run_examples(spec, notify)
    result.arcs = arcs
    return result


def run_examples(spec: BatchSpec, notify: Notify | None) -> BatchResult:
    """The batch's examples, shrinking included, and what they found."""
    from .machines import FailureClock, Stop, record_swarm

    STATS.reset()
    Stop.deadline = spec.deadline
    try:
        machine = machine_class(spec)
        if spec.swarm is not None:
            record_swarm(spec.machine, machine)
        seed_machine(machine, spec.seed)
        base = settings.get_profile(profiles.PREFIX + "campaign")
        database = database_for(spec.database)
        batch_settings = settings(
            base,
            max_examples=spec.examples,
            stateful_step_count=spec.steps,
            database=database,
            phases=[phase for phase in base.phases if spec.shrink or phase != Phase.shrink],
        )
        test = get_state_machine_test(machine, settings=batch_settings)
    except Exception as exc:  # a module that does not import, a target that does not build: not a finding
        return BatchResult(spec, CampaignStats(), error=f"{type(exc).__name__}: {exc}")
    key = database_key(spec)
    set_database_key(test, key)
    replayed = len(list(database.fetch(key))) if database is not None else 0
    FailureClock.first = FailureClock.first_wall = None
    FailureClock.notify = (lambda message: notify(spec.machine, spec.seed, message, time.time())) if notify else None
    # shrinking ends by the deadline
    bound_shrinking(spec.deadline - time.time())
    reported: list[str] = []
    failures: list[FailureReport] = []
    try:
        with with_reporter(lambda value: reported.append(str(value))):
            test()
    except Unsatisfiable:
        pass  # the deadline came before any example ran: nothing to report
    except (FlakyStrategyDefinition, FlakyFailure) as exc:
        if FailureClock.first is not None or not Stop.now():
            failures = [failure_report(spec, exc, FailureClock.first_wall or time.time(), time.time())]
        # else: the deadline rejected a replay before any failure: the batch was only cut short
    except Exception as exc:
        now = time.time()
        found = FailureClock.first_wall or now
        failures = [
            failure_report(spec, sub, found, now)
            for sub in (exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc])
        ]
    stats = CampaignStats()
    stats.merge(STATS)
    return BatchResult(spec, stats, failures, replayed)


def failure_report(spec: BatchSpec, exc: BaseException, found_at: float, reported_at: float) -> FailureReport:
    """A failure as the campaign reports it, from the exception and the notes Hypothesis attached."""
    notes = [str(note) for note in getattr(exc, "__notes__", [])]
    if not any(" = state." in note or note.strip().startswith("state") for note in notes):
        # a flaky failure (an exception group): the program is in the notes of the run that failed
        for sub in getattr(exc, "exceptions", ()):
            notes += [str(note) for note in getattr(sub, "__notes__", [])]
    program = []
    reproduce = ""
    for note in notes:
        text = note.strip()
        if "@reproduce_failure(" in text:
            reproduce = text[text.index("@reproduce_failure(") :].split(" as a decorator")[0]
        elif text.startswith("(and ") and "verbosity" in text:
            continue  # Hypothesis's "(and 2 more with settings.verbosity >= verbose)": not a step
        elif text.startswith(("state", "(")) or " = state." in text:
            program.append(text)
    return FailureReport(
        machine=spec.machine,
        seed=spec.seed,
        error=f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}",
        program=program,
        found_at=found_at,
        reported_at=reported_at,
        shrunk=spec.shrink,
        reproduce=reproduce,
        shallow=spec.shallow,
        production=spec.production,
    )
