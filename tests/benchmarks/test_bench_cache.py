"""Prefix-cache benchmarks (opt-in: ``pytest -m bench`` or ``tox -e bench``).

Implementations of one workload share a group; compare their mins within
one run (the summary at the end prints the ratios).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.benchmarks import workloads as w

pytestmark = pytest.mark.bench
PAGE_SIZES = [1, 16]


@pytest.mark.parametrize("impl", w.IMPLS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_shared_prompt_insert_all_then_match_all(benchmark: Any, impl: str, page_size: int) -> None:
    benchmark.group = f"a shared 1k prompt + 20k branches P={page_size}"
    work = w.shared_prompt(impl, page_size)
    benchmark.pedantic(
        w.run_shared_prompt, setup=lambda: ((w.make_cache(impl, page_size), work), {}), rounds=3, iterations=1
    )


@pytest.mark.parametrize("impl", w.IMPLS)
@pytest.mark.parametrize("leaves", [1_000, 10_000, 20_000, 100_000])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_b_evict_one_page_under_pressure(benchmark: Any, impl: str, leaves: int, page_size: int) -> None:
    if impl != "optimized" and leaves > 20_000:
        pytest.skip("the reference (full scan) takes seconds per call at this size")
    benchmark.group = f"b evict one page P={page_size} leaves={leaves}"
    bench_evictions(benchmark, w.LeafFarm(impl, page_size, leaves), rounds=200 if impl == "optimized" else 20)


@pytest.mark.parametrize("impl", ["optimized"])
@pytest.mark.parametrize("leaves", [1_000, 10_000, 100_000])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_b2_evict_one_page_when_leaves_were_unlocked_out_of_order(
    benchmark: Any, impl: str, leaves: int, page_size: int
) -> None:
    benchmark.group = f"b2 evict one page, heap path P={page_size} leaves={leaves}"
    farm = w.LeafFarm(impl, page_size, leaves, shuffled=True)
    bench_evictions(benchmark, farm, rounds=200)
    assert farm.cache.tree_stats()["heap_entries"] > 0, "the out-of-order leaves should still be on the heap"


def bench_evictions(benchmark: Any, farm: w.LeafFarm, rounds: int) -> None:
    """Time one-page evictions; between rounds (untimed) a new leaf replaces the evicted one."""
    last: list[Any] = []

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        if last:
            farm.refill(last.pop())
        return (), {}

    def evict() -> None:
        last.append(farm.evict_one_page())

    benchmark.pedantic(evict, setup=setup, rounds=rounds, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("impl", w.IMPLS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_c_match_a_fully_cached_32k_prompt(benchmark: Any, impl: str, page_size: int) -> None:
    benchmark.group = f"c match cached 32k prompt P={page_size}"
    cache, tokens = w.long_prompt(impl, page_size)
    handle = benchmark.pedantic(cache.match_prefix, args=(tokens,), rounds=50, iterations=1, warmup_rounds=2)
    assert handle.cached_len == 32_768 - 32_768 % page_size


@pytest.mark.parametrize("impl", w.IMPLS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_d_serving_loop_trace(benchmark: Any, impl: str, page_size: int) -> None:
    benchmark.group = f"d serving loop trace P={page_size}"
    trace = w.trace_for(impl, TRACES.setdefault(page_size, w.serving_trace(page_size)))
    benchmark.pedantic(w.replay, setup=lambda: ((w.make_cache(impl, page_size), trace), {}), rounds=3, iterations=1)


TRACES: dict[int, list[Any]] = {}


@pytest.mark.parametrize("impl", ["optimized", "optimized-without-lock"])
def test_h_the_cost_of_the_lock_on_a_short_match(benchmark: Any, impl: str) -> None:
    """The threading policy's price (reference/threads.py): one short match, with the cache's lock and through
    the method the lock wraps, in the same run."""
    import torch

    from radixspec import optimized

    benchmark.group = "h one short match (64 tokens, P=16): the lock's cost"
    cache = optimized.RadixPrefixCache(page_size=16, device="cpu")
    tokens = torch.arange(64, dtype=torch.int64)
    cache.insert_prefix(tokens, torch.arange(64, dtype=torch.int32))
    calls = 1000
    match = type(cache).match_prefix
    call = match if impl == "optimized" else match.__wrapped__  # type: ignore[attr-defined]

    def run() -> None:
        for _ in range(calls):
            call(cache, tokens)

    benchmark.extra_info["calls"] = calls
    benchmark.pedantic(run, rounds=20, iterations=1)
