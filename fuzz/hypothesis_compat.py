"""Everything radixspec takes from Hypothesis beyond its public API, in one place.

A campaign runs state machines in batches that Hypothesis's public API does
not quite offer: a batch's seed set on the machine class, a database key of
our own (so that a corpus is shared by every batch of one machine, whatever
its seed), and shrinking bounded by the campaign's deadline. Each is an
attribute Hypothesis reads but does not document; ``check()`` proves that the
installed Hypothesis still reads each one (``tests/fuzz/test_hypothesis_compat.py``
runs it and fails with its message when an upgrade breaks one).

pyproject.toml admits every Hypothesis 6 from 6.140 on (older ones want an argument of the state machine
test that a batch does not pass; 6.140, 6.150, 6.160 and 6.170.17 were run): each attribute is set only where
the installed release still reads it. Where a release stops reading one, what it gave degrades, with one
warning saying what (a batch's draws no longer follow its seed; batches no longer share a corpus; shrinking
takes Hypothesis's own budget), and the campaign goes on.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from collections.abc import Callable, Iterator

import hypothesis.core
import hypothesis.stateful
from hypothesis.internal.conjecture import engine as _engine
from hypothesis.stateful import RuleBasedStateMachine

# the attributes, and the module of Hypothesis whose source reads each
SEED_ATTRIBUTE = "_hypothesis_internal_use_seed"
DATABASE_KEY_ATTRIBUTE = "_hypothesis_internal_database_key"
SHRINK_BUDGET = "MAX_SHRINKING_SECONDS"
READERS: tuple[tuple[str, types.ModuleType], ...] = (
    (SEED_ATTRIBUTE, hypothesis.stateful),
    (DATABASE_KEY_ATTRIBUTE, hypothesis.core),
    (SHRINK_BUDGET, _engine),
)


# what is lost when the installed Hypothesis no longer reads an attribute
DEGRADED = {
    SEED_ATTRIBUTE: "a batch's draws no longer follow its seed (a campaign does not reproduce from --seed)",
    DATABASE_KEY_ATTRIBUTE: "the batches of a machine no longer share one corpus in --db",
    SHRINK_BUDGET: "shrinking is no longer bounded by the campaign's deadline (Hypothesis's own 300 s apply)",
}


@functools.cache
def is_read(name: str) -> bool:
    """True when the installed Hypothesis still reads the attribute ``name`` (checked once per process)."""
    module = dict(READERS)[name]
    try:
        read = name in inspect.getsource(module)
    except (OSError, TypeError):  # no source shipped (a zipped or compiled install): trust the attribute
        read = True
    if name == SHRINK_BUDGET:
        read = read and isinstance(getattr(_engine, SHRINK_BUDGET, None), int)
    return read


@functools.cache
def warn_degraded(name: str) -> None:
    """One warning per process and attribute: what the campaign no longer gets, and why."""
    warnings.warn(
        f"radixspec: hypothesis {hypothesis.__version__} no longer reads {name}; {DEGRADED[name]}."
        " Everything else works; fuzz/hypothesis_compat.py says more.",
        RuntimeWarning,
        stacklevel=3,
    )


def seed_machine(machine: type[RuleBasedStateMachine], seed: int) -> None:
    """Every run of ``machine``'s test draws from ``seed`` (what ``@seed`` does for a test function)."""
    if is_read(SEED_ATTRIBUTE):
        setattr(machine, SEED_ATTRIBUTE, seed)
    else:
        warn_degraded(SEED_ATTRIBUTE)


def set_database_key(test: Callable[..., object], key: bytes) -> None:
    """Failing examples of ``test`` are saved and replayed under ``key`` in the example database."""
    if is_read(DATABASE_KEY_ATTRIBUTE):
        setattr(test, DATABASE_KEY_ATTRIBUTE, key)
    else:
        warn_degraded(DATABASE_KEY_ATTRIBUTE)


def bound_shrinking(seconds: float) -> None:
    """Shrinking stops after ``seconds`` (Hypothesis reads this when a shrink starts; its default is 300)."""
    if is_read(SHRINK_BUDGET):
        setattr(_engine, SHRINK_BUDGET, 300 if seconds == float("inf") else max(1, int(seconds)))
    else:
        warn_degraded(SHRINK_BUDGET)


@contextlib.contextmanager
def shrinking_bounded(seconds: float) -> Iterator[None]:
    """Shrinking stops after ``seconds`` inside the block; Hypothesis's budget as it was after it."""
    before = getattr(_engine, SHRINK_BUDGET, None)
    bound_shrinking(seconds)
    try:
        yield
    finally:
        if is_read(SHRINK_BUDGET) and before is not None:
            setattr(_engine, SHRINK_BUDGET, before)


def check() -> list[str]:
    """What no longer holds in the installed Hypothesis: an attribute its source stopped reading."""
    problems = []
    for name, module in READERS:
        if name not in inspect.getsource(module):
            problems.append(
                f"hypothesis {hypothesis.__version__}: {module.__name__} no longer reads {name};"
                " fuzz/hypothesis_compat.py must find another way (or pin Hypothesis to a release that reads it)"
            )
    if not isinstance(getattr(_engine, SHRINK_BUDGET, None), int):
        problems.append(f"hypothesis {hypothesis.__version__}: {_engine.__name__}.{SHRINK_BUDGET} is gone")
    return problems
