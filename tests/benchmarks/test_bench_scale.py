"""Scale (opt-in: ``pytest -m bench``): ours and SGLang's unified cache on its Rust core from 1k to 1M cached
pages (P=16; ``peers.scale_prompts``: a shared page and four pages of each prompt's own).

At each size, on a cache holding that many pages: insert 1,000 new prompts (5 rounds of 200), match up to
1,000 cached ones (5 rounds), evict one page 500 times (5 rounds of 100; 125 at 1k pages); the fastest
round, per call, and per evicted page for eviction (SGLang evicts whole leaves). A full collection runs
before each round. The times should stay flat from 1k to 1M. Memory: the resident growth per cached page at
1M pages, each cache built in a fresh process (ours also as its C tree counts it).
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

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("optimized", "sglang-unified")
SIZES = (1_000, 1_000_000)
CALLS = 1_000
_BUILT: dict[tuple[str, int], tuple[pp.Loaded, pp.Loaded]] = {}


def built(impl: str, pages: int) -> tuple[pp.Loaded, pp.Loaded]:
    """A cache holding ``pages`` pages, and 1,000 more prompts in its format (not inserted)."""
    if (impl, pages) not in _BUILT:
        reason = pp.available(impl)
        if reason is not None:
            pytest.skip(reason)
        _BUILT.clear()  # one big cache at a time
        work = pp.scale_prompts(pages + 4 * CALLS)
        cached = pp.SharedPrompts(work.prompts[:-CALLS], work.slots[:-CALLS], work.page_size, work.shared)
        loaded = pp.load(impl, cached)
        extra = pp.SharedPrompts(work.prompts[-CALLS:], work.slots[-CALLS:], work.page_size, work.shared)
        fresh = pp.Loaded(
            loaded.driver,
            [loaded.driver.tokens(t) for t in extra.prompts],
            [loaded.driver.slots(s) for s in extra.slots],
        )
        _BUILT[impl, pages] = (loaded, fresh)
    return _BUILT[impl, pages]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pages", SIZES)
def test_scale_match(benchmark: Any, impl: str, pages: int) -> None:
    loaded, _ = built(impl, pages)
    benchmark.group = f"scale match P=16 cached={pages} pages"
    step = max(1, len(loaded.tokens) // CALLS)
    sample = loaded.tokens[::step][:CALLS]
    benchmark.extra_info["calls"] = len(sample)
    benchmark.pedantic(pp.match_some, args=(loaded.driver, sample, len(sample)), rounds=5, iterations=1)


ROUNDS = 5


def collected() -> tuple[tuple[()], dict[str, Any]]:
    """A round's setup: a full collection first, so that none lands in the timed calls (the 1M-page caches
    and their inputs are millions of Python objects: a collection then takes milliseconds)."""
    gc.collect()
    return (), {}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pages", SIZES)
def test_scale_insert(benchmark: Any, impl: str, pages: int) -> None:
    """Insert 1,000 new prompts into the cache holding ``pages`` pages, in 5 rounds of 200 (per call)."""
    _, fresh = built(impl, pages)
    benchmark.group = f"scale insert P=16 cached={pages} pages"
    per_round = CALLS // ROUNDS
    benchmark.extra_info["calls"] = per_round
    chunks = iter(range(0, CALLS, per_round))

    def insert_next() -> None:
        start = next(chunks)
        pp.insert_all(fresh.driver, fresh.tokens[start : start + per_round], fresh.slots[start : start + per_round])

    benchmark.pedantic(insert_next, setup=collected, rounds=ROUNDS, iterations=1)
    _BUILT.pop((impl, pages))  # the cache changed: the tests after this one build it again


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pages", SIZES)
def test_scale_evict_one_page(benchmark: Any, impl: str, pages: int) -> None:
    """Evict one page at a time, 5 rounds of 100 (of 25 at 1k pages; per evicted page: SGLang evicts whole
    leaves)."""
    loaded, _ = built(impl, pages)
    benchmark.group = f"scale evict one page P=16 cached={pages} pages (per evicted page)"
    results: list[list[Any]] = []

    # at most half the cache over all rounds, though SGLang takes a whole 4-page leaf a call
    calls = min(100, pages // (2 * 4 * ROUNDS))

    def evict_some() -> None:
        evict, done = loaded.driver.evict, []
        for _ in range(calls):
            done.append(evict(16))
        results.append(done)

    benchmark.pedantic(evict_some, setup=collected, rounds=ROUNDS, iterations=1)
    # per evicted page of the fastest round (the rounds evict alike: one leaf page, or one leaf, each)
    fastest = min(range(len(results)), key=lambda i: benchmark.stats.stats.data[i])
    benchmark.extra_info["pages"] = sum(len(loaded.driver.evicted_starts(r)) for r in results[fastest])
    _BUILT.pop((impl, pages))


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_memory_per_cached_page_at_1m(benchmark: Any, impl: str) -> None:
    """Resident bytes per cached page at 1M cached pages, each cache in a fresh process."""
    reason = pp.available(impl)
    if reason is not None:
        pytest.skip(reason)
    benchmark.group = "scale memory: bytes per cached page at 1M pages (P=16)"
    measured: dict[str, float] = {}

    def measure() -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.benchmarks.peers", impl, str(SIZES[-1])],
            capture_output=True,
            text=True,
            cwd=ROOT,  # where ``tests`` imports from, whatever the run's working directory
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured.update(json.loads(proc.stdout.strip().splitlines()[-1]))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    assert measured["pages"] >= SIZES[-1]
    benchmark.extra_info["bytes_per_page"] = measured["bytes_per_page"]
    if "reported_bytes_per_page" in measured:
        benchmark.extra_info["reported_bytes_per_page"] = measured["reported_bytes_per_page"]
