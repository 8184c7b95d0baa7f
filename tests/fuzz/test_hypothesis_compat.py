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


@pytest.mark.parametrize("name", [compat.SEED_ATTRIBUTE, compat.DATABASE_KEY_ATTRIBUTE, compat.SHRINK_BUDGET])
def test_a_release_that_stops_reading_an_attribute_degrades_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(compat, "is_read", lambda attribute: attribute != name)
    compat.warn_degraded.cache_clear()
    machine = recording_machine([])
    test = get_state_machine_test(machine, settings=settings(max_examples=1, database=None))
    # the test's own value, put back after it (monkeypatch restores what was there before its first setattr)
    monkeypatch.setattr(engine, compat.SHRINK_BUDGET, 300)
    with pytest.warns(RuntimeWarning, match=f"no longer reads {name}") as caught:
        compat.seed_machine(machine, 3)
        compat.set_database_key(test, b"radixspec:degraded")
        compat.bound_shrinking(5)
        compat.bound_shrinking(6)
    assert len([w for w in caught if name in str(w.message)]) == 1
    # the attribute that is no longer read was not set; the others were
    assert hasattr(machine, compat.SEED_ATTRIBUTE) == (name != compat.SEED_ATTRIBUTE)
    assert hasattr(test, compat.DATABASE_KEY_ATTRIBUTE) == (name != compat.DATABASE_KEY_ATTRIBUTE)
    assert (getattr(engine, compat.SHRINK_BUDGET) == 6) == (name != compat.SHRINK_BUDGET)
    compat.warn_degraded.cache_clear()
