"""The state machines a campaign can run, by name, for a chosen set of implementations."""

from __future__ import annotations

import sys
import time

from hypothesis.stateful import RuleBasedStateMachine

from .cache_manager_machine import CacheManagerMachine
from .kv_machine import KVStoreMachine
from .prefix_cache_machine import PrefixCacheMachine
from .scheduler_machine import SchedulerMachine

MACHINES: dict[str, type[RuleBasedStateMachine]] = {
    "cache": PrefixCacheMachine,
    "manager": CacheManagerMachine,
    "scheduler": SchedulerMachine,
    "kv": KVStoreMachine,
}


class FailureClock:
    """When the first example of a campaign failed (before shrinking), by time.monotonic()."""

    first: float | None = None


def machine_for(name: str, impls: tuple[str, ...], device: str = "cpu") -> type[RuleBasedStateMachine]:
    """The machine ``name`` driving the spec beside ``impls`` (the kv machine: the pool on ``device``).

    Notes the time of its first failure.
    """
    base = MACHINES[name]

    def teardown(self: RuleBasedStateMachine) -> None:
        # teardown runs in a finally: an exception in flight means this example failed
        failure = sys.exc_info()[1]
        if isinstance(failure, Exception) and not type(failure).__module__.startswith("hypothesis"):
            FailureClock.first = FailureClock.first or time.monotonic()
        base.teardown(self)

    attributes = {"IMPLS": impls, "teardown": teardown, "__module__": base.__module__}
    if base is KVStoreMachine:
        attributes = {"DEVICE": device, "teardown": teardown, "__module__": base.__module__}
    return type(base.__name__, (base,), attributes)
