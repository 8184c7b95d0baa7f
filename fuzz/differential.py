"""Run one call on every implementation and demand the same outcome.

An outcome is a result (compared after normalising to lists and ints) or a
rejection (compared by error class and message: the twins say why in the same
words). A rejected call must leave the implementation's abstract state exactly
as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import CacheError

from .stats import STATS


@dataclass
class Outcome:
    """What one differential call produced on every implementation."""

    # per implementation: the raw result (None when rejected)
    results: list[Any]
    # the error class every implementation raised, or None when all succeeded
    error: type[CacheError] | None

    @property
    def ok(self) -> bool:
        """True when the call succeeded everywhere."""
        return self.error is None


def apply_all(
    label: str,
    impls: Sequence[Any],
    call: Callable[[Any, int], Any],
    observe: Callable[[Any, Any], Any] = lambda impl, result: result,
    snapshot: Callable[[Any], Any] = lambda impl: impl.abstract_state(),
) -> Outcome:
    """Run ``call(impl, i)`` on each implementation; assert identical observations or identical rejections
    (the same error class with the same message).

    ``observe(impl, result)`` turns a raw result into comparable lists and
    ints. ``snapshot(impl)`` is compared before and after a rejected call. The
    first implementation (the oracle) is snapshotted every time; the others
    only when the oracle rejected the call (a call the oracle accepts must
    not be rejected anyway, and snapshots of big trees are not free).
    """
    results: list[Any] = []
    seen: list[tuple[str, Any]] = []
    for i, impl in enumerate(impls):
        before = snapshot(impl) if i == 0 or seen[0][0] == "raises" else None
        try:
            result = call(impl, i)
        except CacheError as exc:
            if before is None:  # the oracle accepted this call: the outcomes differ, reported below
                results.append(None)
                seen.append(("raises", (type(exc), str(exc))))
                continue
            after = snapshot(impl)
            assert after == before, (
                f"{label}: {name_of(impl)} raised {type(exc).__name__} ({exc}) but changed its state:\n"
                f"{describe_difference(before, after)}"
            )
            results.append(None)
            seen.append(("raises", (type(exc), str(exc))))
            continue
        results.append(result)
        seen.append(("returns", observe(impl, result)))
    for impl, outcome in zip(impls[1:], seen[1:], strict=True):
        assert outcome == seen[0], f"{label}: {name_of(impls[0])} {_show(seen[0])} but {name_of(impl)} {_show(outcome)}"
    error = seen[0][1][0] if seen[0][0] == "raises" else None
    if error is not None:
        STATS.record_rejection(error)
    return Outcome(results, error)


def name_of(impl: Any) -> str:
    """An implementation's name for a message (a target without one: its class)."""
    return str(getattr(impl, "name", type(impl).__name__))


def _show(outcome: tuple[str, Any]) -> str:
    kind, value = outcome
    return f"raises {value[0].__name__}({value[1]!r})" if kind == "raises" else f"returns {value!r}"


def describe_difference(a: Any, b: Any) -> str:
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
