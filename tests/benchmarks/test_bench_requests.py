"""Per request on a replayed trace (opt-in: ``pytest -m bench``): ours, SGLang's unified cache on its Rust
core, vLLM's block pool, each doing its engine's bookkeeping for every prompt (``tests/benchmarks/requests.py``).

The trace is ``radixspec replay --generate``'s (2,000 requests, seed 0: shared system prompts, multi-turn
chats, few-shot blocks, four tenants), P=16, at two pool sizes: one that evicts all the time and one that
holds most of the trace. Per request: the min over rounds of the whole trace, divided by its requests; each
round starts from an empty cache. The hit rate of each run is recorded beside it (``hit_rate``), and the
caches must agree on it within two points (they evict differently).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.benchmarks import peers as pp
from tests.benchmarks import requests as rq

pytestmark = pytest.mark.bench

_TRACE: list[rq.Request] = []
HIT_RATES: dict[tuple[str, int], float] = {}


@pytest.mark.parametrize("impl", list(rq.SERVERS))
@pytest.mark.parametrize("pool_pages", [512, 4096])
def test_requests_of_a_trace(benchmark: Any, impl: str, pool_pages: int) -> None:
    """Every request of the trace through the cache as its scheduler does it (per request)."""
    reason = pp.available(impl if impl != "sglang-unified" else "sglang")
    if reason is not None:
        pytest.skip(reason)
    if not _TRACE:
        _TRACE.extend(rq.trace())
    benchmark.group = f"requests of a trace P=16 pool={pool_pages} pages (per request)"
    results: list[tuple[int, int]] = []

    def fresh() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (rq.make_server(impl, 16, pool_pages), _TRACE), {}

    benchmark.pedantic(lambda server, trace: results.append(rq.serve_all(server, trace)), setup=fresh, rounds=3)
    hit, asked = results[-1]
    assert all(r == results[0] for r in results), "the same trace gave different hits on an empty cache"
    benchmark.extra_info["calls"] = len(_TRACE)
    benchmark.extra_info["hit_rate"] = round(hit / asked, 4)
    HIT_RATES[impl, pool_pages] = hit / asked
    for (other, pages), rate in HIT_RATES.items():
        if pages == pool_pages:
            assert abs(rate - hit / asked) < 0.02, f"hit rates part: {impl} {hit / asked:.3f}, {other} {rate:.3f}"
