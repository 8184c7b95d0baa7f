"""The differential state machines, run under the active profile (``ci`` in CI: deterministic)."""

import importlib.util

import pytest

from radixspec.fuzz.cache_machine import CacheMachine
from radixspec.fuzz.hostile_machine import HostileMachine
from radixspec.fuzz.hybrid_machine import HybridMachine, manager_outcome
from radixspec.fuzz.manager_machine import ManagerMachine
from radixspec.fuzz.router_machine import RouterMachine
from radixspec.fuzz.scheduler_machine import SchedulerMachine

TestCacheMachine = CacheMachine.TestCase
TestManagerMachine = ManagerMachine.TestCase
TestSchedulerMachine = SchedulerMachine.TestCase
TestHybridMachine = HybridMachine.TestCase
TestHostileMachine = HostileMachine.TestCase
# the workers publish their events on the wire (the events extra: msgspec); the router beside them is ours
if importlib.util.find_spec("msgspec") is not None:
    TestRouterMachine = RouterMachine.TestCase


def test_a_broken_law_inside_a_managers_call_fails_and_a_refusal_does_not() -> None:
    """An IntegrityError raised inside a foreign manager's call (its own check, sglang:both's cores_agree) was
    taken for a refusal (an IntegrityError is a CacheError) and swallowed; now it fails the law."""
    from radixspec.spec.errors import IntegrityError, OutOfPagesError

    def raising(error: Exception) -> None:
        raise error

    with pytest.raises(AssertionError, match="cores_agree: cache_req of request 3"):
        manager_outcome(lambda: raising(IntegrityError("cores_agree: cache_req of request 3: rust, python")), True)
    assert manager_outcome(lambda: raising(OutOfPagesError("no row")), True).error is OutOfPagesError
