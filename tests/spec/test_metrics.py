"""Cache metrics (spec/metrics.py): counted the same by both caches, conserved, exposed to Prometheus."""

from __future__ import annotations

from typing import Any

import pytest

from radixspec import optimized, reference
from radixspec.spec.errors import InvalidInputError, SlotOutOfRangeError
from radixspec.spec.metrics import CacheStats, NamespaceStats


def run(cache: Any) -> CacheStats:
    cache.insert_prefix([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])  # 3 pages
    cache.match_prefix([1, 2, 3, 4, 9])  # asks 5, hits 4
    cache.match_prefix([7, 7], namespace=("a",))  # a miss in another namespace
    cache.insert_prefix([1, 2], [6, 7], namespace=("a",))
    cache.match_prefix([1, 2, 3, 4, 5, 6])  # hits 6
    cache.evict(3)  # 2 pages: (5, 6) then ("a", 1 2), the oldest leaves
    cache.reset()  # drops (1 2 3 4)
    cache.insert_prefix([8, 8], [0, 1])
    stats: CacheStats = cache.stats()
    return stats


@pytest.mark.parametrize("impl", [reference.RadixPrefixCache, optimized.RadixPrefixCache])
def test_counters_rates_and_ages(impl: Any) -> None:
    stats = run(impl(page_size=2))
    assert stats.of(None) == NamespaceStats(
        match_requests=2,
        hit_requests=2,
        match_tokens=11,
        hit_tokens=10,
        pages_stored=4,
        pages_evicted=1,
        pages_dropped=2,
    )
    assert stats.of(("a",)) == NamespaceStats(match_requests=1, match_tokens=2, pages_stored=1, pages_evicted=1)
    assert stats.total.token_hit_rate == pytest.approx(10 / 13)
    assert stats.total.request_hit_rate == pytest.approx(2 / 3)
    # page (5 6) was last used by the match at clock 4, ("a", 1 2) by the insert at clock 3; evict ran at clock 5
    assert stats.eviction_age_sum == (5 - 4) + (5 - 3) and stats.mean_eviction_age == 1.5
    assert stats.as_dict()["namespaces"]["('a',)"]["pages_evicted"] == 1


def test_a_rejected_call_counts_nothing() -> None:
    for cache in (reference.RadixPrefixCache(page_size=1), optimized.RadixPrefixCache(page_size=1)):
        with pytest.raises(InvalidInputError):
            cache.match_prefix([-1])
        with pytest.raises(SlotOutOfRangeError):
            cache.insert_prefix([1], [2**31])
        assert cache.stats() == CacheStats()


def test_prometheus_exposition_reads_the_stats_at_scrape_time() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from radixspec.optimized.metrics import register_cache_metrics

    cache = optimized.RadixPrefixCache(page_size=2)
    registry = prometheus_client.CollectorRegistry()
    register_cache_metrics(cache, registry=registry)
    cache.insert_prefix([1, 2], [0, 1])
    cache.match_prefix([1, 2, 3])
    text = prometheus_client.generate_latest(registry).decode()
    assert 'radixspec_cache_hit_tokens_total{namespace="None"} 2.0' in text
    assert 'radixspec_cache_hit_tokens_total{namespace="<retired>"} 0.0' in text
    assert "radixspec_cache_token_hit_rate 0.6666" in text


def test_the_cache_machine_catches_metrics_that_disagree_or_lose_pages() -> None:
    from radixspec.fuzz.cache_machine import CacheMachine

    state = CacheMachine()
    (seqs_0,) = state.setup(page_size=1, first=[([0, 0, 0], [])], big=False)
    state.insert_prefix(namespace=None, seq=seqs_0, where="low")
    state.evict(fraction=50, size="some")
    state.targets_agree()
    state.compare_metrics()
    reference_cache = state.runs[0].target.cache
    # the reference counts a page stored that is neither cached, evicted nor dropped: conservation fails
    reference_cache.counter.counts[None].pages_stored += 1
    with pytest.raises(AssertionError, match="metrics of reference, namespace None: 4 pages stored"):
        state.compare_metrics()
    reference_cache.counter.counts[None].pages_stored -= 1
    # it miscounts an eviction's age: conserved, but the two caches' metrics differ
    reference_cache.eviction_age_sum += 1
    with pytest.raises(AssertionError, match="metrics: reference"):
        state.compare_metrics()
    reference_cache.eviction_age_sum -= 1
    # a retired namespace's pages must be evicted or dropped: it holds none
    reference_cache.counter.retired.pages_stored += 1
    with pytest.raises(AssertionError, match="metrics of reference, retired namespaces: 1 pages stored"):
        state.compare_metrics()


def one_shot_namespaces(cache: Any, count: int, keep: int = 0) -> None:
    """``count`` tenants that each match, insert one page and lose it to an evict; ``keep`` locked ones stay."""
    for k in range(keep):
        cache.lock(cache.insert_prefix([k, k], [2 * k, 2 * k + 1], namespace=("kept", k)).handle)
    for k in range(count):
        namespace = ("one-shot", k)
        cache.match_prefix([1, 2, 3], namespace=namespace)
        cache.insert_prefix([1, 2], [1000, 1001], namespace=namespace)
        cache.evict(2)


@pytest.mark.parametrize("impl", [reference.RadixPrefixCache, optimized.RadixPrefixCache])
def test_namespaces_without_pages_are_retired_past_the_limit_and_totals_stay_exact(
    impl: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    unbounded = impl(page_size=2)
    one_shot_namespaces(unbounded, 50, keep=6)
    monkeypatch.setattr("radixspec.spec.metrics.STATS_NAMESPACE_LIMIT", 4)
    bounded = impl(page_size=2)
    one_shot_namespaces(bounded, 50, keep=6)
    full, kept = unbounded.stats(), bounded.stats()
    assert len(full.namespaces) == 56 and full.retired == NamespaceStats()
    # the table never holds more than twice what holds pages (6 kept + the last tenant) and the limit
    assert len(bounded.counter.counts) <= 2 * 7 and 0 < len(kept.namespaces) < 56
    assert kept.total == full.total and kept.eviction_age_sum == full.eviction_age_sum
    # every namespace that holds pages keeps its own counters, exactly
    for k in range(6):
        assert kept.of(("kept", k)) == full.of(("kept", k)) == NamespaceStats(pages_stored=1)
    assert kept.retired.pages_stored == kept.retired.pages_evicted > 0 and kept.retired.match_requests > 0
    assert kept.as_dict()["retired"]["pages_evicted"] == kept.retired.pages_evicted


@pytest.mark.parametrize("impl", [reference.RadixPrefixCache, optimized.RadixPrefixCache])
def test_a_stream_of_one_shot_namespaces_costs_bounded_memory(impl: Any) -> None:
    from radixspec.spec.metrics import STATS_NAMESPACE_LIMIT

    cache = impl(page_size=2)
    one_shot_namespaces(cache, 3 * STATS_NAMESPACE_LIMIT)
    assert len(cache.counter.counts) <= STATS_NAMESPACE_LIMIT
    assert cache.stats().total.match_requests == 3 * STATS_NAMESPACE_LIMIT


def test_as_dict_names_every_number_for_json() -> None:
    stats = run(reference.RadixPrefixCache(page_size=2))
    counters = ["match_requests", "hit_requests", "match_tokens", "hit_tokens"]
    assert stats.as_dict() == {
        **dict(zip(counters, [3, 2, 13, 10], strict=True)),
        "pages_stored": 5,
        "pages_evicted": 2,
        "pages_dropped": 2,
        "token_hit_rate": 10 / 13,
        "request_hit_rate": 2 / 3,
        "mean_eviction_age": 1.5,
        "namespaces": {
            "None": {
                **dict(zip(counters, [2, 2, 11, 10], strict=True)),
                "pages_stored": 4,
                "pages_evicted": 1,
                "pages_dropped": 2,
            },
            "('a',)": {
                **dict(zip(counters, [1, 0, 2, 0], strict=True)),
                "pages_stored": 1,
                "pages_evicted": 1,
                "pages_dropped": 0,
            },
        },
        "retired": {**dict.fromkeys(counters, 0), "pages_stored": 0, "pages_evicted": 0, "pages_dropped": 0},
    }
    assert stats.of(("never",)) == NamespaceStats() and CacheStats().mean_eviction_age == 0.0


def test_stats_of_reads_a_counting_cache_and_gives_empty_stats_for_others() -> None:
    from radixspec.spec.metrics import stats_of

    cache = optimized.RadixPrefixCache(page_size=1)
    cache.match_prefix([1])
    assert stats_of(cache) == cache.stats() != CacheStats()
    assert stats_of(reference.NaivePrefixCache(1)) == CacheStats()


def test_prometheus_exposition_names_help_and_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from radixspec.optimized.metrics import HELP, register_cache_metrics

    cache = optimized.RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3], ("t",))
    cache.match_prefix([1, 2, 9], ("t",))
    cache.evict(2)
    registry = prometheus_client.CollectorRegistry()
    register_cache_metrics(cache, registry=registry, prefix="x")
    lines = prometheus_client.generate_latest(registry).decode().splitlines()
    for name, text in HELP.items():
        assert f"# HELP x_{name}_total {text}" in lines
    assert "x_hit_tokens_total{namespace=\"('t',)\"} 2.0" in lines
    assert "x_pages_evicted_total{namespace=\"('t',)\"} 1.0" in lines
    assert "# HELP x_token_hit_rate matched tokens / asked tokens" in lines
    assert "# HELP x_request_hit_rate matches that hit / matches" in lines
    assert "# HELP x_mean_eviction_age cache operations since an evicted page's last use" in lines
    assert "x_request_hit_rate 1.0" in lines and "x_mean_eviction_age 2.0" in lines  # stored at clock 1, evicted at 3
    # with no registry given, the default one (unregistered again here)
    collector = register_cache_metrics(cache)
    try:
        assert (
            prometheus_client.REGISTRY.get_sample_value("radixspec_cache_hit_tokens_total", {"namespace": "('t',)"})
            == 2
        )
    finally:
        prometheus_client.REGISTRY.unregister(collector)


def test_a_collector_made_alone_names_its_metrics_radixspec_cache() -> None:
    pytest.importorskip("prometheus_client")
    from radixspec.optimized.metrics import CacheMetricsCollector

    cache = optimized.RadixPrefixCache(page_size=2)
    names = [family.name for family in CacheMetricsCollector(cache).collect()]
    assert names and all(name.startswith("radixspec_cache_") for name in names)
