"""Scale (opt-in: ``pytest -m bench``): ours and SGLang's unified cache on its Rust core from 1k to 1M cached
pages (P=16; ``peers.scale_prompts``: a shared page and four pages of each prompt's own).

At each size, on a cache holding that many pages: insert 1,000 new prompts, match up to 1,000 cached ones,
evict one page 1,000 times (500 at 1k pages); per call, and per evicted page for eviction (SGLang evicts
whole leaves). The times should stay flat from 1k to 1M. Memory: the resident growth per cached page at 1M
pages, each cache built in a fresh process (ours also as its C tree counts it).
"""

from __future__ import annotations

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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pages", SIZES)
def test_scale_insert(benchmark: Any, impl: str, pages: int) -> None:
    """Insert 1,000 new prompts into the cache holding ``pages`` pages (per call)."""
    _, fresh = built(impl, pages)
    benchmark.group = f"scale insert P=16 cached={pages} pages"
    benchmark.extra_info["calls"] = CALLS
    benchmark.pedantic(pp.insert_all, args=(fresh.driver, fresh.tokens, fresh.slots), rounds=1, iterations=1)
    _BUILT.pop((impl, pages))  # the cache changed: the tests after this one build it again


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pages", SIZES)
def test_scale_evict_one_page(benchmark: Any, impl: str, pages: int) -> None:
    loaded, _ = built(impl, pages)
    benchmark.group = f"scale evict one page P=16 cached={pages} pages (per evicted page)"
    results: list[Any] = []

    def evict_many() -> None:
        evict = loaded.driver.evict
        for _ in range(min(CALLS, pages // 2)):  # half the cache at most (SGLang takes whole leaves)
            results.append(evict(16))

    benchmark.pedantic(evict_many, rounds=1, iterations=1)
    benchmark.extra_info["pages"] = sum(len(loaded.driver.evicted_starts(r)) for r in results)
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
