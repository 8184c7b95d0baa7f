"""Peers benchmark (opt-in: ``pytest -m bench``, ``tox -e bench``): our caches beside SGLang's, vLLM's, mini-sglang's.

The issue's table (P=16; 20,000 prompts of a 1,024-token shared prefix and
64 own tokens; insert all, match 5,000, evict one page 400 times) and
workloads (a)-(d) run on every cache installed (``radixspec targets
install sglang vllm``; mini-sglang: ``RADIXSPEC_MINISGL=/path/to/checkout``),
each through its own API with inputs built before timing
(``tests/benchmarks/peers.py``). (e) is a cache-manager workload: it runs on
our two managers (``test_bench_manager.py``); SGLang's and vLLM's managers do
not run outside their engines.

The summary at the end prints, per group, each cache's min and its ratio to
ours (per call, per evicted page where pages differ), and saves the ratios
as JSON (``--ratios-json``, default ``.benchmarks/ratios.json``).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks import peers as pp
from tests.benchmarks import workloads as w

pytestmark = pytest.mark.bench

TABLE = {"page_size": 16, "prompts": 20_000, "matches": 5_000, "evictions": 400}
_WORK: dict[int, pp.SharedPrompts] = {}


def needs(peer: str) -> None:
    """Skip unless ``peer`` is installed here (the reason names the install command)."""
    reason = pp.available(peer)
    if reason is not None:
        pytest.skip(reason)


def table_work(page_size: int) -> pp.SharedPrompts:
    if page_size not in _WORK:
        _WORK[page_size] = pp.shared_prompts(page_size, TABLE["prompts"])
    return _WORK[page_size]


@pytest.mark.parametrize("impl", pp.PEERS + pp.FORMATS)
@pytest.mark.parametrize("page_size", [16, 1])
def test_table_insert_20k_prompts(benchmark: Any, impl: str, page_size: int) -> None:
    """(a) and the table: insert every prompt into an empty cache (per call: min / 20,000)."""
    needs(impl)
    benchmark.group = f"table insert x20000 P={page_size}"
    work = table_work(page_size)
    loaded = pp.load(impl, work, insert=False)

    def fresh() -> tuple[tuple[Any, ...], dict[str, Any]]:
        driver = pp.make(impl, page_size, work.pages)
        gc.collect()
        return (driver, loaded.tokens, loaded.slots), {}

    benchmark.extra_info["calls"] = len(work.prompts)
    benchmark.pedantic(pp.insert_all, setup=fresh, rounds=2, iterations=1)


@pytest.mark.parametrize("impl", pp.PEERS + pp.FORMATS)
@pytest.mark.parametrize("page_size", [16, 1])
def test_table_match_5000(benchmark: Any, impl: str, page_size: int) -> None:
    """(a) and the table: match 5,000 cached prompts (per call: min / 5,000)."""
    needs(impl)
    benchmark.group = f"table match x5000 P={page_size}"
    loaded = pp.load(impl, table_work(page_size))
    benchmark.extra_info["calls"] = TABLE["matches"]
    benchmark.pedantic(pp.match_some, args=(loaded.driver, loaded.tokens, TABLE["matches"]), rounds=7, iterations=1)


@pytest.mark.parametrize("impl", pp.PEERS + pp.EVICT_VARIANTS)
def test_table_evict_one_page_400_times(benchmark: Any, impl: str) -> None:
    """The table: evict one page (P=16), 400 times, from the loaded cache; per evicted page. Three rounds, each on
    a freshly loaded cache that has evicted one page already (untimed: a first eviction's one-off work, such as
    ordering the leaves, is not the steady state this row measures); the fastest round is kept."""
    needs(impl)
    benchmark.group = "table evict one page x400 P=16 (per evicted page)"
    results: list[Any] = []

    def loaded_and_warm() -> tuple[tuple[Any, ...], dict[str, Any]]:
        loaded = pp.load(impl, table_work(16))
        loaded.driver.evict(16)
        drivers.append(loaded.driver)
        results.clear()
        gc.collect()
        return (loaded.driver,), {}

    def evict_400(driver: pp.Driver) -> None:
        evict = driver.evict
        for _ in range(TABLE["evictions"]):
            results.append(evict(16))

    drivers: list[pp.Driver] = []
    benchmark.pedantic(evict_400, setup=loaded_and_warm, rounds=3, iterations=1)
    # the pages of one round (each round evicts the same pages from the same cache)
    benchmark.extra_info["pages"] = sum(len(drivers[-1].evicted_starts(r)) for r in results)


@pytest.mark.parametrize("impl", pp.PEERS + pp.EVICT_VARIANTS)
def test_table_evict_64_pages_per_call(benchmark: Any, impl: str) -> None:
    """The table's cache, evicting 64 pages (1,024 tokens: one prefill's worth) per call, 100 times; per page."""
    needs(impl)
    benchmark.group = "table evict 64 pages per call x100 P=16 (per evicted page)"
    loaded = pp.load(impl, table_work(16))
    results: list[Any] = []

    def evict_100() -> None:
        evict = loaded.driver.evict
        for _ in range(100):
            results.append(evict(64 * 16))

    benchmark.pedantic(evict_100, rounds=1, iterations=1)
    benchmark.extra_info["pages"] = sum(len(loaded.driver.evicted_starts(r)) for r in results)


@pytest.mark.parametrize("impl", pp.PEERS + pp.EVICT_VARIANTS)
@pytest.mark.parametrize("leaves", [1_000, 20_000])
def test_b_peers_evict_one_page_at_n_leaves(benchmark: Any, impl: str, leaves: int) -> None:
    """(b) evict one page from ``leaves`` one-page leaves (P=16); a new leaf replaces it between rounds."""
    needs(impl)
    if impl == "reference" and leaves > 1_000:
        pytest.skip("the reference collects every leaf per evict (seconds per round at this size): see b at 1k")
    benchmark.group = f"b evict one page P=16 leaves={leaves} (per evicted page)"
    farm = pp.LeafFarm(impl, 16, leaves)
    bench_farm(benchmark, farm, rounds=200 if impl in ("optimized", "vllm") else 30)


@pytest.mark.parametrize("impl", ["optimized"])
@pytest.mark.parametrize("leaves", [1_000, 1_000_000])
@pytest.mark.parametrize("shuffled", [False, True], ids=["in-order", "heap"])
def test_b_flat_from_1k_to_1m_leaves(benchmark: Any, impl: str, leaves: int, shuffled: bool) -> None:
    """(b) our evict cost from 1k to 1M leaves, in stamp order and out of order (the heap path); P=1."""
    benchmark.group = f"b flat {'heap' if shuffled else 'in-order'} P=1 leaves={leaves}"
    farm = pp.LeafFarm(impl, 1, leaves, shuffled=shuffled)
    if shuffled:
        assert farm.driver.cache.tree_stats()["heap_entries"] >= leaves - 1, "the shuffled leaves should be on the heap"
    # fewer rounds than leaves: every timed eviction of the heap case pops from the heap
    bench_farm(benchmark, farm, rounds=min(2000, leaves // 2))


def bench_farm(benchmark: Any, farm: pp.LeafFarm, rounds: int) -> None:
    """Time single evictions (one page each: every leaf is one page); between rounds (untimed) a leaf replaces it."""
    last: list[Any] = []

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        if last:
            farm.refill(last.pop())
        return (), {}

    def evict() -> None:
        last.append(farm.evict_one_page())

    benchmark.pedantic(evict, setup=setup, rounds=rounds, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("impl", pp.PEERS)
def test_c_peers_match_a_cached_32k_prompt(benchmark: Any, impl: str) -> None:
    """(c) match a fully cached 32k-token prompt (P=16)."""
    needs(impl)
    benchmark.group = "c match cached 32k prompt P=16"
    driver, tokens = pp.long_prompt(impl, 16)
    benchmark.pedantic(driver.match, args=(tokens,), rounds=50, iterations=1, warmup_rounds=2)


_TRACE: list[tuple[Any, ...]] = []


@pytest.mark.parametrize("impl", pp.PEERS)
def test_d_peers_serving_loop_trace(benchmark: Any, impl: str) -> None:
    """(d) a recorded serving loop (match, lock, insert, unlock, evict) of 2,000 requests, P=16."""
    needs(impl)
    benchmark.group = "d serving loop trace P=16"
    if not _TRACE:
        _TRACE.extend(w.serving_trace(16))
    pool_pages = 32_768 // 16
    ops = pp.trace_for(pp.make(impl, 16, pool_pages), _TRACE)
    benchmark.pedantic(pp.replay, setup=lambda: ((pp.make(impl, 16, pool_pages), ops), {}), rounds=7, iterations=1)


@pytest.mark.parametrize("impl", pp.PEERS)
def test_memory_per_cached_page(benchmark: Any, impl: str) -> None:
    """Bytes per cached page for the table's workload: resident growth in a fresh process (ours: also as C counts)."""
    needs(impl)
    benchmark.group = "memory: bytes per cached page (table workload, P=16)"
    measured: dict[str, float] = {}

    def measure() -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.benchmarks.peers", impl],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[2],  # where ``tests`` imports from
        )
        measured.update(json.loads(proc.stdout.strip().splitlines()[-1]))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info["bytes_per_page"] = measured["bytes_per_page"]
    if "reported_bytes_per_page" in measured:
        benchmark.extra_info["reported_bytes_per_page"] = measured["reported_bytes_per_page"]
