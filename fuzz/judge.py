"""One outcome judge for the machines: what a call gave (``Outcome``), and what must be equal between the spec's
outcome and a target's (``expect_same``), as the target's profile decides. A rule in any machine reads the same:
run the call on the spec and on each target, then judge.

What must be equal, by the profile's ``errors`` (``fuzz/targets/api.py``) and the differential capability:

* exact (the differential capability: ours): the value, the error class and the error's words;
* ``errors == "ours"``: the value, or an error of the spec's class (a subclass will do);
* ``errors == "any"``: the value, or some error (its class is the target's own);
* ``errors == "none"``: the target validates nothing, so an invalid call is not sent (the machines skip it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from radixspec.spec.errors import CacheError

from .messages import brief

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """A call's outcome: its value (normalized by the caller) or its error's class and words."""

    ok: bool
    value: Any = None
    error: type[BaseException] | None = None
    message: str = ""

    @classmethod
    def of(
        cls, call: Callable[..., T], normalize: Callable[[T], object] | None = None, foreign: bool = False
    ) -> Outcome:
        """Run ``call``. A CacheError is an outcome; any other exception fails the caller's law (an error not of
        spec/errors.py: a crash the process survived), unless ``foreign`` (a target whose errors are its own).
        A foreign target's failed ``assert`` is never an outcome: the engine's own invariant broke, and its state
        after a half-done call is not one the campaign may go on from."""
        try:
            value = call()
            return cls(True, value if normalize is None else normalize(value))
        except CacheError as error:
            return cls(False, error=type(error), message=str(error))
        except Exception as error:
            if foreign and not isinstance(error, AssertionError):
                return cls(False, error=type(error), message=str(error))
            what = "the engine's own assertion failed" if foreign else "raised"
            raise AssertionError(f"{what} {type(error).__module__}.{type(error).__name__}: {error}") from error

    def seen_as(self, normalize: Callable[[Any], object]) -> Outcome:
        """The same outcome with its value normalized (a refusal as it is)."""
        return Outcome(True, normalize(self.value)) if self.ok else self

    @property
    def error_class(self) -> type[BaseException]:
        """The class of the error of a refused call."""
        assert self.error is not None, f"the call was accepted ({self})"
        return self.error

    @classmethod
    def raised(cls, error: BaseException) -> Outcome:
        """The outcome of a call that raised ``error``."""
        return cls(False, error=type(error), message=str(error))

    def __str__(self) -> str:
        if self.ok:
            if self.value is None:
                return "accepted it"
            shown = brief(self.value) if isinstance(self.value, (list, tuple)) else repr(self.value)[:200]
            return f"returned {shown}"
        name = self.error.__name__ if self.error is not None else "an error"
        return f"raised {name}({self.message!r})"


def expect_same(
    label: str,
    expected: Outcome,
    actual: Outcome,
    name: str,
    exact: bool = True,
    errors: str = "ours",
    expected_from: str = "the spec",
) -> None:
    """``actual`` (target ``name``'s outcome) as ``expected`` (the spec's, or ``expected_from``'s: a twin
    implementation's), to the degree the profile promises; an AssertionError saying both otherwise."""
    if actual.ok != expected.ok:
        same = False
    elif actual.ok:
        same = actual.value == expected.value
    elif exact:
        same = (actual.error, actual.message) == (expected.error, expected.message)
    elif errors == "ours":
        same = expected.error is not None and actual.error is not None and issubclass(actual.error, expected.error)
    else:
        same = True
    # the words are written only when the law broke (they format both values: a cost per call otherwise)
    assert same, f"{label}: {expected_from} {expected}, {name} {actual}"


def expect_error(label: str, actual: Outcome, error: type[BaseException] | None, words: str = "") -> None:
    """``actual`` as a machine's own model predicts it: accepted when ``error`` is None, else refused with
    ``error`` (a subclass will do) in words that contain ``words``; an AssertionError saying both otherwise."""
    if error is None:
        met = actual.ok
    else:
        met = not actual.ok and issubclass(actual.error_class, error) and words in actual.message
    assert met, f"{label}: expected {wanted(error, words)}, {actual}"


def wanted(error: type[BaseException] | None, words: str) -> str:
    """What a machine's own model predicts, in words: acceptance, or the error's class and the words it names."""
    return "acceptance" if error is None else f"{error.__name__}" + (f" naming {words.strip()!r}" if words else "")
