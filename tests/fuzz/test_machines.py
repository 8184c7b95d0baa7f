"""The differential state machines, run under the active profile (``ci`` in CI: deterministic)."""

from radixspec.fuzz.cache_machine import CacheMachine
from radixspec.fuzz.hostile_machine import HostileMachine
from radixspec.fuzz.hybrid_machine import HybridMachine
from radixspec.fuzz.manager_machine import ManagerMachine
from radixspec.fuzz.scheduler_machine import SchedulerMachine

TestCacheMachine = CacheMachine.TestCase
TestManagerMachine = ManagerMachine.TestCase
TestSchedulerMachine = SchedulerMachine.TestCase
TestHybridMachine = HybridMachine.TestCase
TestHostileMachine = HostileMachine.TestCase
