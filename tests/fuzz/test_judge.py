"""fuzz/judge.py: what a call gave, and what must be equal as a profile promises (each check seen failing)."""

from __future__ import annotations

import pytest

from radixspec.fuzz.judge import Outcome, expect_error, expect_same
from radixspec.spec.errors import CacheError, InvalidSizeError, SlotOutOfRangeError


def refused(error: CacheError) -> Outcome:
    return Outcome.raised(error)


def test_of_keeps_values_and_spec_errors_and_fails_on_others() -> None:
    assert Outcome.of(lambda: [1, 2], normalize=tuple) == Outcome(True, (1, 2))
    assert Outcome.of(lambda: (_ for _ in ()).throw(InvalidSizeError("x"))).error is InvalidSizeError
    with pytest.raises(AssertionError, match="raised builtins.ValueError"):
        Outcome.of(lambda: int("x"))
    assert Outcome.of(lambda: int("x"), foreign=True).error is ValueError


def test_a_foreign_targets_assertion_is_never_an_outcome() -> None:
    """An engine's failed assert is its own invariant broken, its state half-changed: the law fails."""

    def engine() -> None:
        assert 4 <= 3, "cache_protected_len=4"

    with pytest.raises(AssertionError, match="engine's own assertion failed builtins.AssertionError: cache_prot"):
        Outcome.of(engine, foreign=True)


def test_seen_as_normalizes_values_only() -> None:
    assert Outcome(True, [1]).seen_as(tuple) == Outcome(True, (1,))
    no = refused(InvalidSizeError("x"))
    assert no.seen_as(tuple) is no


@pytest.mark.parametrize(
    ("exact", "errors", "actual", "passes"),
    [
        (True, "ours", refused(InvalidSizeError("too big")), True),
        (True, "ours", refused(InvalidSizeError("over")), False),
        (False, "ours", refused(InvalidSizeError("over")), True),
        (False, "ours", refused(SlotOutOfRangeError("too big")), False),
        (False, "any", refused(SlotOutOfRangeError("too big")), True),
        (False, "any", Outcome(True, None), False),
    ],
)
def test_expect_same_as_the_profile_promises(exact: bool, errors: str, actual: Outcome, passes: bool) -> None:
    expected = refused(InvalidSizeError("too big"))
    if passes:
        expect_same("evict", expected, actual, "target", exact=exact, errors=errors)
    else:
        with pytest.raises(AssertionError, match="evict: the spec raised InvalidSizeError"):
            expect_same("evict", expected, actual, "target", exact=exact, errors=errors)


def test_expect_same_compares_values() -> None:
    expect_same("match", Outcome(True, 3), Outcome(True, 3), "t")
    with pytest.raises(AssertionError, match="match: the spec returned 3, t returned 4"):
        expect_same("match", Outcome(True, 3), Outcome(True, 4), "t")


def test_expect_error_accepts_what_the_model_predicts() -> None:
    expect_error("store", Outcome(True, None), None)
    expect_error("store", refused(SlotOutOfRangeError("row 2 slot 9")), SlotOutOfRangeError, "row 2 ")
    expect_error("store", refused(SlotOutOfRangeError("row 2 slot 9")), CacheError)


@pytest.mark.parametrize(
    ("actual", "error", "words"),
    [
        (Outcome(True, None), SlotOutOfRangeError, ""),
        (refused(SlotOutOfRangeError("row 2 slot 9")), None, ""),
        (refused(SlotOutOfRangeError("row 2 slot 9")), InvalidSizeError, ""),
        (refused(SlotOutOfRangeError("row 2 slot 9")), SlotOutOfRangeError, "row 3 "),
    ],
)
def test_expect_error_fails_on_anything_else(actual: Outcome, error: type[CacheError] | None, words: str) -> None:
    with pytest.raises(AssertionError, match="store: expected"):
        expect_error("store", actual, error, words)
