"""apply_all judges every implementation's outcome against the first's with fuzz/judge.py."""

from __future__ import annotations

import pytest

from radixspec.fuzz.differential import Outcomes, apply_all
from radixspec.spec.errors import InvalidSizeError, StaleHandleError


class Twin:
    """An implementation whose call returns ``value`` or raises ``error``, and whose state ``changes`` on it."""

    def __init__(self, name: str, value: object = None, error: BaseException | None = None, changes: bool = False):
        self.name, self.value, self.error, self.changes, self.state = name, value, error, changes, 0

    def call(self) -> object:
        if self.changes:
            self.state += 1
        if self.error is not None:
            raise self.error
        return self.value

    def abstract_state(self) -> int:
        return self.state


def run(*twins: Twin) -> Outcomes:
    return apply_all("op", twins, lambda impl, i: impl.call(), observe=lambda impl, result: [result])


def test_same_values_give_each_raw_result() -> None:
    out = run(Twin("a", 1), Twin("b", 1))
    assert out.ok and out.results == [1, 1]


def test_same_refusal_gives_its_class() -> None:
    out = run(Twin("a", error=InvalidSizeError("too big")), Twin("b", error=InvalidSizeError("too big")))
    assert out.error is InvalidSizeError and out.results == [None, None]


@pytest.mark.parametrize(
    ("second", "said"),
    [
        (Twin("b", 2), r"a returned \[1\], b returned \[2\]"),
        (Twin("b", error=InvalidSizeError("too big")), r"a returned \[1\], b raised InvalidSizeError"),
    ],
)
def test_a_different_value_or_a_refusal_fails(second: Twin, said: str) -> None:
    with pytest.raises(AssertionError, match=said):
        run(Twin("a", 1), second)


def test_the_same_class_in_other_words_fails() -> None:
    with pytest.raises(AssertionError, match="'too big'.*'over'"):
        run(Twin("a", error=InvalidSizeError("too big")), Twin("b", error=InvalidSizeError("over")))


def test_another_class_fails() -> None:
    with pytest.raises(AssertionError, match="StaleHandleError"):
        run(Twin("a", error=InvalidSizeError("x")), Twin("b", error=StaleHandleError("x")))


def test_a_refusal_that_changed_state_fails() -> None:
    error = InvalidSizeError("x")
    with pytest.raises(AssertionError, match="b raised InvalidSizeError.*but changed its state"):
        run(Twin("a", error=error), Twin("b", error=error, changes=True))


def test_an_error_not_of_the_spec_fails() -> None:
    with pytest.raises(AssertionError, match="raised builtins.KeyError"):
        run(Twin("a", 1), Twin("b", error=KeyError("x")))
