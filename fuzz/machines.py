"""The state machines a campaign can run, by name, for a chosen set of implementations."""

from __future__ import annotations

import sys
import time

from hypothesis.stateful import RuleBasedStateMachine

from .cache_manager_machine import CacheManagerMachine
from .kv_machine import KVStoreMachine
from .prefix_cache_machine import PrefixCacheMachine
from .scheduler_machine import SchedulerMachine
from .target_machine import TargetCacheMachine
from .target_manager_machine import TargetManagerMachine
from .targets.api import TargetInfo

MACHINES: dict[str, type[RuleBasedStateMachine]] = {
    "cache": PrefixCacheMachine,
    "manager": CacheManagerMachine,
    "scheduler": SchedulerMachine,
    "kv": KVStoreMachine,
}


class FailureClock:
    """When the first example of a campaign failed (before shrinking), by time.monotonic()."""

    first: float | None = None


def target_machines(target: TargetInfo) -> list[str]:
    """The machines that can drive ``target``: cache and/or manager."""
    return [name for name, factory in (("cache", target.cache_factory), ("manager", target.manager_factory)) if factory]


def machine_for(
    name: str,
    impls: tuple[str, ...],
    device: str = "cpu",
    target: TargetInfo | None = None,
    lru: str | None = None,
) -> type[RuleBasedStateMachine]:
    """The machine ``name`` driving the spec beside ``impls`` (the kv machine: the pool on ``device``).

    With ``target``, the target machines drive that target instead (LRU mode ``lru``, default: the
    profile's). Notes the time of its first failure.
    """
    base: type[RuleBasedStateMachine] = MACHINES[name]
    if target is not None:
        base = TargetCacheMachine if name == "cache" else TargetManagerMachine

    def teardown(self: RuleBasedStateMachine) -> None:
        # teardown runs in a finally: an exception in flight means this example failed
        failure = sys.exc_info()[1]
        if isinstance(failure, Exception) and not type(failure).__module__.startswith("hypothesis"):
            FailureClock.first = FailureClock.first or time.monotonic()
        base.teardown(self)

    attributes: dict[str, object] = {"IMPLS": impls, "teardown": teardown, "__module__": base.__module__}
    if target is not None:
        attributes = {"TARGET": target, "LRU": lru or target.profile.default_lru, "teardown": teardown}
        attributes["__module__"] = base.__module__
    elif base is KVStoreMachine:
        attributes = {"DEVICE": device, "teardown": teardown, "__module__": base.__module__}
    return type(base.__name__, (base,), attributes)
