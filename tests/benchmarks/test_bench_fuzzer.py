"""The fuzzer's own throughput (opt-in: ``make bench ARGS="-k fuzzer"``): time per step of every machine and of
the main engine targets on a fixed seed and example count, and the exhaustive checker per alphabet at a fixed
depth. Bugs are found per example, so these are figures radixspec promises; ``python -m tools.bench_compare``
runs them side by side with a past tree (docs/campaigns.md, "The fuzzer's own speed")."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import pytest

from radixspec.fuzz.batches import BatchSpec, run_batch
from radixspec.fuzz.exhaustive import explore

pytestmark = pytest.mark.bench

SEED, EXAMPLES, STEPS = 7, 40, 80
# each machine driving what a default campaign drives: our implementations beside the spec
OURS = ("reference", "optimized")
MACHINES: list[tuple[str, tuple[str, ...]]] = [
    ("cache", OURS),
    ("manager", OURS),
    ("scheduler", OURS),
    ("kv", OURS),
    ("hybrid", OURS),
    ("hostile", OURS),
    ("router", ("radixspec-router",)),
]
# the engine targets a campaign drives most, each where its engine is installed (radixspec targets install)
ENGINES: list[tuple[str, str, str]] = [
    ("hybrid", "sglang", "sglang"),
    ("cache", "sglang:legacy", "sglang"),
    ("cache", "vllm", "vllm"),
    ("hybrid", "vllm-hybrid", "vllm"),
]


def one_batch(machine: str, targets: tuple[str, ...]) -> dict[str, int]:
    """One batch of the campaign's shape, in this process, no deadline, no shrinking: its steps and examples."""
    spec = BatchSpec(machine, targets, None, "cpu", SEED, EXAMPLES, STEPS, False, time.time(), float("inf"))
    result = run_batch(spec)
    assert result.error is None and not result.failures, (result.error, result.failures)
    return {"steps": result.stats.steps, "examples": result.stats.examples}


def bench_batch(benchmark: Any, machine: str, targets: tuple[str, ...]) -> None:
    counted: dict[str, int] = {}
    benchmark.pedantic(lambda: counted.update(one_batch(machine, targets)), rounds=3, iterations=1, warmup_rounds=1)
    # the conftest divides the min by calls: the time per step; steps per second is its inverse
    benchmark.extra_info.update(calls=counted["steps"], examples=counted["examples"])
    if benchmark.enabled:
        benchmark.extra_info["steps_per_s"] = round(counted["steps"] / benchmark.stats.stats.min, 1)


@pytest.mark.parametrize("machine, targets", MACHINES, ids=[name for name, _ in MACHINES])
def test_fuzzer_steps_of_each_machine(benchmark: Any, machine: str, targets: tuple[str, ...]) -> None:
    benchmark.group = f"fuzzer: a batch of {EXAMPLES} examples x {STEPS} steps, seed {SEED}, per step"
    benchmark.name = machine
    bench_batch(benchmark, machine, targets)


@pytest.mark.parametrize("machine, target, engine", ENGINES, ids=[target for _, target, _ in ENGINES])
def test_fuzzer_steps_of_each_engine_target(benchmark: Any, machine: str, target: str, engine: str) -> None:
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed (radixspec targets install {engine})")
    benchmark.group = f"fuzzer: engine targets, a batch of {EXAMPLES} examples x {STEPS} steps, per step"
    bench_batch(benchmark, machine, (target,))


@pytest.mark.parametrize("machine, depth", [("cache", 4), ("manager", 4)])
def test_exhaustive_checker_of_each_alphabet(benchmark: Any, machine: str, depth: int) -> None:
    benchmark.group = f"fuzzer: exhaustive checker, P=1, one worker, per transition ({machine} depth {depth})"
    explored: dict[str, int] = {}

    def run() -> None:
        result = explore(1, depth, 1, progress=False, machine=machine)
        assert result.failure is None, result.failure
        explored.update(states=result.states, transitions=result.transitions)

    benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info.update(calls=explored["transitions"], states=explored["states"])
