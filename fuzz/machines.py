"""The state machines a campaign can run, by name, for a chosen set of implementations."""

from __future__ import annotations

import importlib
import inspect
import random
import sys
import time
from collections.abc import Callable

from hypothesis import reject
from hypothesis.stateful import RuleBasedStateMachine, rule

from .registry import IMPLEMENTATIONS, MACHINES
from .targets import resolve
from .targets.api import TargetInfo


def machine_class(name: str) -> type[RuleBasedStateMachine]:
    """The machine class ``name`` (a key of the registry's MACHINES), its module imported now (the kv and
    scheduler machines import torch; a campaign of the cache machine over a pure-Python target does not)."""
    entry = MACHINES[name]
    machine: type[RuleBasedStateMachine] = getattr(importlib.import_module(entry.module), entry.attribute)
    return machine


class Stop:
    """When the examples of this process must stop: the batch's deadline, or a stop flag the campaign raised.

    Checked as each example starts, until the batch finds a failure: past it,
    the example is rejected (not failed), so generation ends within one
    example's time of the deadline. Once a failure is found it is no longer
    checked: the shrink is bounded on its own (``bound_shrinking`` in
    ``fuzz/batches.py``, by the same deadline), and keeps the smallest failing
    example it has.
    """

    deadline: float = float("inf")
    # set() when the campaign asks this machine to stop (another batch of it failed)
    flag: Callable[[], bool] = staticmethod(lambda: False)

    @classmethod
    def now(cls) -> bool:
        return time.time() > cls.deadline or cls.flag()


class FailureClock:
    """When the first example of a batch failed (before shrinking), and whom to tell."""

    # time.monotonic() and time.time() of the first failing example, or None
    first: float | None = None
    first_wall: float | None = None
    # called with the failure's message the moment it happens (the campaign prints it at once)
    notify: Callable[[str], None] | None = None

    @classmethod
    def failed(cls, failure: BaseException) -> None:
        """Note a failing example; the first one is announced."""
        if cls.first is None:
            cls.first, cls.first_wall = time.monotonic(), time.time()
            if cls.notify is not None:
                cls.notify(f"{type(failure).__name__}: {failure}")


def rule_names(machine: type[RuleBasedStateMachine]) -> list[str]:
    """The names of ``machine``'s rules (its initializers and invariants are not rules), sorted."""
    return sorted(name for name, member in inspect.getmembers(machine) if hasattr(member, "hypothesis_stateful_rule"))


def swarm_off(machine: type[RuleBasedStateMachine], seed: int) -> tuple[str, ...]:
    """The rules a swarm batch of seed ``seed`` turns off: each with probability one half (swarm testing: Groce et
    al., ISSTA 2012), never all of them."""
    draw = random.Random(seed)
    rules = rule_names(machine)
    off = [name for name in rules if draw.random() < 0.5]
    if len(off) == len(rules):
        off.pop(draw.randrange(len(off)))
    return tuple(off)


def swarm_idle(self: RuleBasedStateMachine) -> None:
    """A step that does nothing: a swarm machine's rule that can always run (where every rule it kept waits on a
    precondition, Hypothesis would call the machine broken). A plain method on every other machine, so that a
    program of a swarm batch replays on the whole machine."""


def without_rules(machine: type[RuleBasedStateMachine], names: tuple[str, ...]) -> dict[str, object]:
    """Class attributes that hide ``names`` from Hypothesis's rule list: each a plain method calling the rule's
    body (a regression program that names it still runs), with no rule marker."""

    def hidden(name: str) -> Callable[..., object]:
        body = getattr(machine, name)

        def call(self: RuleBasedStateMachine, *args: object, **kwargs: object) -> object:
            return body(self, *args, **kwargs)

        call.__name__ = call.__qualname__ = name
        return call

    return {name: hidden(name) for name in names}


def record_swarm(name: str, machine: type[RuleBasedStateMachine]) -> None:
    """Count a swarm batch of machine ``name`` and each rule it turned off (the summary's configurations)."""
    from .stats import STATS

    off: tuple[str, ...] = getattr(machine, "SWARM_OFF", ())
    STATS.rules[f"swarm[{name}] batches"] += 1
    for hidden in off:
        STATS.rules[f"swarm[{name}] off: {hidden}"] += 1


def executes(target: str | TargetInfo) -> bool:
    """Whether ``target`` is a tiered lifecycle target the machine runs the transfers of (ours never are)."""
    if isinstance(target, TargetInfo):
        return target.executes
    return target not in IMPLEMENTATIONS and resolve(target, check=False).executes


def machine_for(
    name: str,
    targets: tuple[str | TargetInfo, ...] = tuple(IMPLEMENTATIONS),
    device: str = "cpu",
    lru: str | None = None,
    shallow: bool = False,
    swarm: int | None = None,
    production: bool = False,
) -> type[RuleBasedStateMachine]:
    """The machine ``name`` driving the spec beside ``targets`` (names as --impl and --target take them, or
    TargetInfo objects: radixspec.testing passes a user's factory so; the
    kv machine: the pool on ``device``), in LRU mode ``lru`` (default: the profiles'); ``shallow``: a shallow
    batch's machine (the cache machine grows no big trees and no long keys); ``swarm``: a swarm batch's seed (the
    rules ``swarm_off`` picks are off); ``production``: a production batch's (the hybrid machine draws production
    pools too). Notes the time of its first failure."""
    base = machine_class(name)
    if name == "hybrid" and any(executes(target) for target in targets):
        from .hybrid_executor import TieredHybridMachine, TieredProductionMachine

        base = TieredProductionMachine if production else TieredHybridMachine

    def __init__(self: RuleBasedStateMachine) -> None:
        # before a failure only: once one is found, Hypothesis replays it and shrinks (bounded on its own)
        if FailureClock.first is None and Stop.now():
            reject()
        base.__init__(self)

    def teardown(self: RuleBasedStateMachine) -> None:
        # teardown runs in a finally: an exception in flight means this example failed
        failure = sys.exc_info()[1]
        if isinstance(failure, Exception) and not type(failure).__module__.startswith("hypothesis"):
            FailureClock.failed(failure)
        try:
            base.teardown(self)
        except Exception as exc:  # the teardown's own checks (drain, leaks) failed
            FailureClock.failed(exc)
            raise

    attributes: dict[str, object] = {
        "__init__": __init__,
        "teardown": teardown,
        "__module__": base.__module__,
        "SHALLOW": shallow,
        "PRODUCTION": production,
    }
    entry = MACHINES[name]
    if entry.layer is not None:
        attributes.update(entry.layer.configure(targets, lru))
    elif entry.drives == "device":
        attributes["DEVICE"] = device
    else:
        attributes["IMPLS"] = targets
    attributes["swarm_idle"] = swarm_idle
    if swarm is not None:
        attributes["SWARM_OFF"] = off = swarm_off(base, swarm)
        attributes.update(without_rules(base, off))
        attributes["swarm_idle"] = rule()(swarm_idle)
    return type(base.__name__, (base,), attributes)
