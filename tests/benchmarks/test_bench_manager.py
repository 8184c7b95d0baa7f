"""CacheManager benchmarks: allocate_paged + cache_req for a batch of 256 requests (opt-in)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.benchmarks import workloads as w

pytestmark = pytest.mark.bench
PAGE_SIZES = [1, 16]


@pytest.mark.parametrize("impl", w.IMPLS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_e_allocate_and_cache_a_batch_of_256(benchmark: Any, impl: str, page_size: int) -> None:
    benchmark.group = f"e allocate_paged + cache_req batch=256 P={page_size}"
    setup = w.batch_of_requests(impl, page_size)
    benchmark.pedantic(w.prefill_batch, setup=lambda: (setup(), {}), rounds=5, iterations=1)


@pytest.mark.parametrize("impl", w.IMPLS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_e1_allocate_paged_a_batch_of_256(benchmark: Any, impl: str, page_size: int) -> None:
    benchmark.group = f"e1 allocate_paged only batch=256 P={page_size}"
    setup = w.batch_of_requests(impl, page_size)
    benchmark.pedantic(w.allocate_batch, setup=lambda: (setup(), {}), rounds=10, iterations=1)


@pytest.mark.parametrize("impl", w.IMPLS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_e2_cache_req_a_batch_of_256(benchmark: Any, impl: str, page_size: int) -> None:
    benchmark.group = f"e2 cache_req only batch=256 P={page_size}"
    setup = w.batch_of_requests(impl, page_size)

    def allocated() -> tuple[tuple[Any, Any], dict[str, Any]]:
        manager, reqs = setup()
        w.allocate_batch(manager, reqs)
        return (manager, reqs), {}

    benchmark.pedantic(w.cache_batch, setup=allocated, rounds=5, iterations=1)
