"""The differential state machines, run under the active profile (``ci`` in CI: deterministic)."""

from fuzz.cache_manager_machine import CacheManagerMachine
from fuzz.prefix_cache_machine import PrefixCacheMachine

TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestCacheManagerMachine = CacheManagerMachine.TestCase
from fuzz.scheduler_machine import SchedulerMachine  # noqa: E402

TestSchedulerMachine = SchedulerMachine.TestCase
