"""The Engine end to end (opt-in): 1,000 requests of the shared-prompt workload, reference against optimized.

Both run the same scheduler core; the optimized one prepares tensors in a few
ops, keeps its tree in C and runs a batched HashModel. Same outputs and stats
are asserted: a faster engine that answers differently is a bug.
"""

from __future__ import annotations

from typing import Any

import pytest

from radixspec import optimized, reference
from radixspec.fuzz.engine_run import shared_prompt_workload
from radixspec.spec.requests import SchedulerConfig

pytestmark = pytest.mark.bench
CONFIG = SchedulerConfig(page_size=16, num_pages=512, max_running_reqs=32, max_seq_len=1024, max_extend_tokens=2048)
RESULTS: dict[str, Any] = {}


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_engine_1000_requests(benchmark: Any, impl: str) -> None:
    benchmark.group = "engine 1000 requests P=16 pages=512"
    workload = shared_prompt_workload(1000)
    lib: Any = reference if impl == "reference" else optimized

    def run() -> Any:
        return lib.Engine(CONFIG).generate(workload)

    result = benchmark.pedantic(run, rounds=1, iterations=1)
    RESULTS[impl] = (result.outputs, result.stats, result.evicted_pages)
    if len(RESULTS) == 2:
        assert RESULTS["reference"] == RESULTS["optimized"], "the engines answered differently"
