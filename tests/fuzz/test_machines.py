"""The differential state machines, run under the active profile (``ci`` in CI: deterministic)."""

from radixspec.fuzz.cache_machine import CacheMachine
from radixspec.fuzz.manager_machine import ManagerMachine

TestCacheMachine = CacheMachine.TestCase
TestManagerMachine = ManagerMachine.TestCase
from radixspec.fuzz.scheduler_machine import SchedulerMachine  # noqa: E402

TestSchedulerMachine = SchedulerMachine.TestCase
from radixspec.fuzz.hybrid_machine import HybridMachine  # noqa: E402

TestHybridMachine = HybridMachine.TestCase
from radixspec.fuzz.hostile_machine import HostileMachine  # noqa: E402

TestHostileMachine = HostileMachine.TestCase
