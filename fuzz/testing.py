"""Machines for a user's own cache, run by the user's own pytest (``radixspec.testing``).

    from radixspec.testing import cache_machine

    TestMyCache = cache_machine(lambda page_size, num_pages: MyCache(page_size, num_pages)).TestCase

Each function takes a factory (a class, a function, a lambda over a fixture's object) and returns the
``RuleBasedStateMachine`` a campaign runs, driving the spec beside what the factory makes, with every check a
campaign makes. Nothing here changes a Hypothesis setting of the user's: the machine's ``TestCase`` runs under
the settings profile the user loaded (or the ``settings`` given here), except where the ``--radixspec-examples``
and ``--radixspec-seed`` options of the pytest plugin say otherwise; while it runs, a failure's shrinking is
bounded (``--radixspec-shrink-seconds``, 60 by default; Hypothesis's own budget is restored after). A failure
writes the regression file a campaign writes (into ``--radixspec-out``, default ``fuzz-failures/``) and names
it in the error's notes. A test that ran no example fails (``NothingChecked``): it never passes having checked
nothing.

The factories take what the campaign's targets take (docs/targets.md):

* ``cache_machine(factory)``: ``factory(page_size, num_pages)`` -> a prefix-cache target;
* ``manager_machine(factory)``: ``factory(num_pages, page_size, rows, max_seq_len)`` -> a cache-manager target;
* ``hybrid_machine(factory)``: ``factory(page_size, windows, num_pages)`` -> a hybrid manager.

A factory that is importable by name (a module-level class or function) makes a regression file that replays
on its own; for a lambda or a closure the file names the target and says to make it importable.
"""

from __future__ import annotations

import re
import time
import unittest
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck
from hypothesis import settings as Settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from radixspec.spec.hit_rules import Window

from .hypothesis_compat import seed_machine, shrinking_bounded
from .machines import FailureClock, Stop, machine_for
from .options import Options, options
from .stats import STATS
from .targets import TargetError, check_methods, resolve
from .targets.api import CacheManagerTarget, PrefixCacheTarget, Profile, TargetInfo
from .targets.layers import LAYERS

# a factory's target's handle type, and its request type (a manager's)
H = TypeVar("H")
R = TypeVar("R")

__all__ = ["NothingChecked", "Options", "cache_machine", "hybrid_machine", "manager_machine", "options"]


class NothingChecked(AssertionError):
    """A machine's test ran no example against the user's target, so it checked nothing: a failure, not a pass."""


def cache_machine(
    factory: Callable[[int, int], PrefixCacheTarget[H]],
    *,
    profile: Profile | None = None,
    name: str | None = None,
    lru: str | None = None,
    settings: Settings | None = None,
) -> type[RuleBasedStateMachine]:
    """The cache machine driving the spec beside ``factory(page_size, num_pages)``'s cache. ``profile``:
    where the cache differs from the spec (default: the factory's ``profile`` attribute, else the exact
    one); ``lru``: "strict" or "sync" (default: the profile's)."""
    info = target_info("cache", factory, profile, name)
    return user_machine("cache", info, lru, settings)


def manager_machine(
    factory: Callable[[int, int, int, int], CacheManagerTarget[R, H]],
    *,
    profile: Profile | None = None,
    name: str | None = None,
    lru: str | None = None,
    settings: Settings | None = None,
) -> type[RuleBasedStateMachine]:
    """The manager machine driving the spec's page accounting beside ``factory(num_pages, page_size, rows,
    max_seq_len)``'s cache manager (request lifecycles: match, allocate, cache, free)."""
    info = target_info("manager", factory, profile, name)
    return user_machine("manager", info, lru, settings)


def hybrid_machine(
    factory: Callable[[int, tuple[Window, ...], int], object],
    *,
    name: str | None = None,
    settings: Settings | None = None,
) -> type[RuleBasedStateMachine]:
    """The hybrid machine driving ``factory(page_size, windows, num_pages)``'s manager of several attention
    groups (full attention and sliding windows) under the universal checks (docs/hybrid.md)."""
    info = target_info("hybrid", factory, None, name)
    return user_machine("hybrid", info, None, settings)


def importable_name(factory: object) -> str | None:
    """``module:qualname`` when ``factory`` can be imported back by that name (a module-level object)."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    try:
        found = resolve(f"{module}:{qualname}", check=False)
    except TargetError:
        return None
    return f"{module}:{qualname}" if found.name else None


def target_info(layer: str, factory: object, profile: Profile | None, name: str | None) -> TargetInfo:
    """A TargetInfo with ``factory`` as its factory of ``layer`` (fuzz/targets/layers.py); TypeError naming what
    is wrong, before any test runs."""
    if isinstance(factory, TargetInfo):
        return factory
    if not callable(factory):
        raise TypeError(f"radixspec.testing: {layer}_machine takes a factory (a class or a function), got {factory!r}")
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(f"radixspec.testing: profile must be a radixspec.fuzz.targets.api.Profile, got {profile!r}")
    label = name or importable_name(factory) or getattr(factory, "__qualname__", None) or "user-target"
    declared = getattr(factory, "profile", None)
    chosen = profile or (declared if isinstance(declared, Profile) else None)
    doc = (getattr(factory, "__doc__", None) or "").strip()
    description = doc.splitlines()[0] if doc else label
    made: dict[str, Any] = {LAYERS[layer].factory: factory}
    info = TargetInfo(name=label, description=description, **made)
    if chosen is not None:
        info = replace(info, profile=chosen)
    if LAYERS[layer].protocol is not None:
        try:
            check_methods(info)
        except TargetError as exc:
            raise TypeError(f"radixspec.testing: {exc}") from None
    return info


def user_machine(
    layer: str, info: TargetInfo, lru: str | None, settings: Settings | None
) -> type[RuleBasedStateMachine]:
    """``machine_for`` over one TargetInfo, with a ``TestCase`` that honours the plugin's options and writes a
    regression file when it fails."""
    machine = machine_for(layer, (info,), lru=lru)
    replay_name = importable_name(LAYERS[layer].factory_of(info)) or info.name
    # as Hypothesis's own TestCase: the user's loaded profile, no deadline, no health check; a user may set
    # TestMyCache.settings as for any state machine
    chosen = settings or Settings(deadline=None, suppress_health_check=list(HealthCheck))

    class TestCase(unittest.TestCase):
        settings = chosen

        def runTest(self) -> None:
            if options.seed is not None:
                seed_machine(machine, options.seed)
            # a campaign run earlier in this process leaves its batch's deadline and failure clock behind: under
            # pytest the machine runs its examples whatever came before
            Stop.deadline = float("inf")
            FailureClock.first = FailureClock.first_wall = FailureClock.notify = None
            examples = STATS.examples
            try:
                with shrinking_bounded(options.shrink_seconds):
                    run_state_machine_as_test(machine, settings=effective_settings(self.settings))
            except unittest.SkipTest as skip:
                # Hypothesis skips a test its settings let run no example: for a machine that is a test of nothing
                raise NothingChecked(
                    f"radixspec: the {layer} machine against {info.name} ran no example: {skip}"
                ) from None
            except Exception as exc:
                for path in write_regressions(layer, replay_name, lru, exc):
                    exc.add_note(f"radixspec: regression test written to {path} (python -m pytest {path})")
                raise
            if STATS.examples == examples:
                raise NothingChecked(
                    f"radixspec: the {layer} machine against {info.name} ran no example, so it checked nothing"
                    " (its settings' phases run no generated example, or every example was rejected)"
                )

    label = re.sub(r"\W", "_", info.name)
    TestCase.__name__ = TestCase.__qualname__ = f"Test_{label}_{layer}"
    # Hypothesis's TestCase is a read-only property of the machine class: a subclass defines its own, as
    # machine_for defines its attributes
    return type(machine.__name__, (machine,), {"TestCase": TestCase, "__module__": machine.__module__})


def effective_settings(given: Settings) -> Settings:
    """``given`` with the plugin's --radixspec-examples and --radixspec-steps where they were set."""
    if options.examples is not None:
        given = Settings(given, max_examples=options.examples)
    if options.steps is not None:
        given = Settings(given, stateful_step_count=options.steps)
    return given


def write_regressions(layer: str, target: str, lru: str | None, exc: BaseException) -> list[Path]:
    """The campaign's regression files for a failure of a machine run under pytest: one per distinct failure
    Hypothesis reports (an exception group holds several), each only where its program was found."""
    from .batches import BatchSpec, failure_report
    from .regression import regression_source, write_regression_test

    now = time.time()
    seed = options.seed if options.seed is not None else 0
    spec = BatchSpec(layer, (target,), lru, "cpu", seed, 0, 0, True, now, now)
    written = []
    failures = list(exc.exceptions) if isinstance(exc, BaseExceptionGroup) else [exc]
    for number, failure in enumerate(failures):
        report = failure_report(spec, failure, now, now)
        if not report.program:
            continue
        label = re.sub(r"\W", "_", target)
        name = f"test_{layer}_{label}_{int(now * 1000) % 10**9}_{number}.py"
        source = regression_source(
            report.program, layer, (target,), lru, "cpu", seed, report.error, True, name, report.reproduce
        )
        if ":" not in target:
            note = f"# {target!r} is not importable by name: make its factory a module-level object to replay this\n"
            source = source.replace('"""\n\n', f'"""\n\n{note}', 1)
        try:
            written.append(write_regression_test(options.out, name, source))
        except OSError:
            continue
    return written
