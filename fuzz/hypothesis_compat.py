"""Everything radixspec takes from Hypothesis beyond its public API, in one place.

A campaign runs state machines in batches that Hypothesis's public API does
not quite offer: a batch's seed set on the machine class, a database key of
our own (so that a corpus is shared by every batch of one machine, whatever
its seed), and shrinking bounded by the campaign's deadline. Each is an
attribute Hypothesis reads but does not document; ``check()`` proves that the
installed Hypothesis still reads each one (``tests/fuzz/test_hypothesis_compat.py``
runs it and fails with its message when an upgrade breaks one). This is why
pyproject.toml pins Hypothesis below 6.171.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import hypothesis.core
import hypothesis.stateful
from hypothesis.internal.conjecture import engine as _engine
from hypothesis.stateful import RuleBasedStateMachine

# the attributes, and the module of Hypothesis whose source reads each
SEED_ATTRIBUTE = "_hypothesis_internal_use_seed"
DATABASE_KEY_ATTRIBUTE = "_hypothesis_internal_database_key"
SHRINK_BUDGET = "MAX_SHRINKING_SECONDS"
READERS: tuple[tuple[str, Any], ...] = (
    (SEED_ATTRIBUTE, hypothesis.stateful),
    (DATABASE_KEY_ATTRIBUTE, hypothesis.core),
    (SHRINK_BUDGET, _engine),
)


def seed_machine(machine: type[RuleBasedStateMachine], seed: int) -> None:
    """Every run of ``machine``'s test draws from ``seed`` (what ``@seed`` does for a test function)."""
    setattr(machine, SEED_ATTRIBUTE, seed)


def set_database_key(test: Callable[..., Any], key: bytes) -> None:
    """Failing examples of ``test`` are saved and replayed under ``key`` in the example database."""
    setattr(test, DATABASE_KEY_ATTRIBUTE, key)


def bound_shrinking(seconds: float) -> None:
    """Shrinking stops after ``seconds`` (Hypothesis reads this when a shrink starts; its default is 300)."""
    setattr(_engine, SHRINK_BUDGET, 300 if seconds == float("inf") else max(1, int(seconds)))


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
