"""Run one call on every implementation and demand the same outcome, as the judge says (``fuzz/judge.py``).

An outcome is a result (compared after normalising to lists and ints) or a
rejection (compared by error class and message: the twins say why in the same
words). A rejected call must leave the implementation's abstract state exactly
as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import CacheError

from .judge import Outcome, expect_same
from .stats import STATS

# an implementation, and what the call returns on it
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Outcomes(Generic[R]):
    """What one differential call produced on every implementation."""

    # per implementation: the raw result (None when rejected)
    results: list[R]
    # the error class every implementation raised, or None when all succeeded
    error: type[CacheError] | None

    @property
    def ok(self) -> bool:
        """True when the call succeeded everywhere."""
        return self.error is None


def apply_all(
    label: str,
    impls: Sequence[T],
    call: Callable[[T, int], R],
    observe: Callable[[T, R], object] = lambda impl, result: result,
    snapshot: Callable[[T], object] = lambda impl: abstract_state_of(impl),
    names: Sequence[str] | None = None,
    known: Mapping[int, object] | None = None,
) -> Outcomes[R]:
    """Run ``call(impl, i)`` on each implementation; the judge demands identical observations or identical
    rejections (the same error class with the same words), and a rejection must change nothing.

    ``observe(impl, result)`` turns a raw result into comparable lists and
    ints. ``snapshot(impl)`` is compared before and after a rejected call. The
    first implementation (the oracle) is snapshotted every time; the others
    only when the oracle rejected the call (a call the oracle accepts must
    not be rejected anyway, and snapshots of big trees are not free).
    ``names``: the implementations' names in messages (else each one's ``name``). ``known``: snapshots the
    caller took of the state the call starts from (by implementation index), used rather than taken again.
    """
    named = list(names) if names is not None else [name_of(impl) for impl in impls]
    results: list[R] = []
    outcomes: list[Outcome] = []
    for i, impl in enumerate(impls):
        before = None
        if i == 0 or not outcomes[0].ok:
            before = known[i] if known is not None and i in known else snapshot(impl)
        raw = Outcome.of(functools.partial(call, impl, i))
        results.append(raw.value)
        outcome = raw.seen_as(functools.partial(observe, impl))
        if not outcome.ok and before is not None:
            after = snapshot(impl)
            assert after == before, (
                f"{label}: {named[i]} {outcome} but changed its state:\n{describe_difference(before, after)}"
            )
        outcomes.append(outcome)
    for name, outcome in zip(named[1:], outcomes[1:], strict=True):
        expect_same(label, outcomes[0], outcome, name, expected_from=named[0])
    error = outcomes[0].error
    assert error is None or issubclass(error, CacheError), error  # Outcome.of lets no other error through
    if error is not None:
        STATS.record_rejection(error)
    return Outcomes(results, error)


class Differential(Protocol):
    """An implementation with the differential capability: its abstract state."""

    def abstract_state(self) -> object: ...


def abstract_state_of(impl: object) -> object:
    """What ``apply_all`` compares around a rejected call by default: the implementation's abstract state."""
    return cast(Differential, impl).abstract_state()


def name_of(impl: object) -> str:
    """An implementation's name for a message (a target without one: its class)."""
    return str(getattr(impl, "name", type(impl).__name__))


def describe_difference(a: object, b: object) -> str:
    """A short account of how two abstract states differ (page by page for caches)."""
    cache_a = getattr(a, "cache", a)
    cache_b = getattr(b, "cache", b)
    lines: list[str] = []
    if isinstance(cache_a, pc.PrefixCacheState) and isinstance(cache_b, pc.PrefixCacheState):
        if cache_a.clock != cache_b.clock:
            lines.append(f"clock {cache_a.clock} != {cache_b.clock}")
        for key in sorted(cache_a.entries.keys() | cache_b.entries.keys(), key=repr):
            ea, eb = cache_a.entries.get(key), cache_b.entries.get(key)
            if ea != eb:
                lines.append(f"page {key}: {ea} != {eb}")
    for name in ("free_slots", "lazy_frees"):
        if getattr(a, name, None) != getattr(b, name, None):
            lines.append(f"{name}: {getattr(a, name)} != {getattr(b, name)}")
    return "\n".join(lines[:20]) or f"{a!r}\n!=\n{b!r}"
