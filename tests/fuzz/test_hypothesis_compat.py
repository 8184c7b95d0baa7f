"""The Hypothesis internals a campaign relies on (fuzz/hypothesis_compat.py) still work in the installed release:
if an upgrade breaks one, these tests fail naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, rule

from radixspec.fuzz import hypothesis_compat as compat


def test_the_installed_hypothesis_still_reads_every_attribute_we_set() -> None:
    assert compat.check() == []


def recording_machine(draws: list[int], fail: bool = False) -> type[RuleBasedStateMachine]:
    class Recording(RuleBasedStateMachine):
        @rule(value=st.integers(0, 2**40))
        def draw(self, value: int) -> None:
            draws.append(value)
            assert not (fail and value > 10), "a planted failure"

    return Recording


def run(machine: type[RuleBasedStateMachine], **options: object) -> None:
    base = settings(max_examples=5, stateful_step_count=5, database=None, deadline=None, phases=[Phase.generate])
    get_state_machine_test(machine, settings=settings(base, **options))()  # type: ignore[arg-type]


def test_a_seeded_machine_draws_the_same_values_every_run() -> None:
    first: list[int] = []
    again: list[int] = []
    other: list[int] = []
    for draws, seed in ((first, 7), (again, 7), (other, 8)):
        machine = recording_machine(draws)
        compat.seed_machine(machine, seed)
        run(machine)
    assert first == again and first != other


def test_a_failure_is_saved_under_our_database_key(tmp_path: Path) -> None:
    database = DirectoryBasedExampleDatabase(str(tmp_path))
    machine = recording_machine([], fail=True)
    compat.seed_machine(machine, 1)
    base = settings(max_examples=50, stateful_step_count=5, database=database, deadline=None)
    test = get_state_machine_test(machine, settings=base)
    compat.set_database_key(test, b"radixspec:test")
    with pytest.raises(AssertionError, match="a planted failure"):
        test()
    assert list(database.fetch(b"radixspec:test"))


def test_shrinking_is_bounded_by_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", engine.MAX_SHRINKING_SECONDS)  # restored after
    compat.bound_shrinking(12.7)
    assert engine.MAX_SHRINKING_SECONDS == 12
    compat.bound_shrinking(0.2)
    assert engine.MAX_SHRINKING_SECONDS == 1
    compat.bound_shrinking(float("inf"))
    assert engine.MAX_SHRINKING_SECONDS == 300
