"""Prometheus exposition of a cache's metrics (spec/metrics.py), read at scrape time: nothing on the hot path.

    from prometheus_client import start_http_server
    from radixspec.optimized.metrics import register_cache_metrics

    register_cache_metrics(cache)          # cache: any object with stats() -> radixspec.spec.metrics.CacheStats
    start_http_server(9400)

Counters are per namespace (label ``namespace``: its ``repr``); the mean
eviction age is a gauge. Needs ``prometheus_client`` (the ``metrics`` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from radixspec.spec.metrics import RETIRED_LABEL, CacheStats, NamespaceStats

HELP = {
    "match_requests": "match_prefix calls",
    "hit_requests": "match_prefix calls that found a cached prefix",
    "match_tokens": "tokens asked for by match_prefix",
    "hit_tokens": "tokens match_prefix found cached",
    "pages_stored": "pages an insert cached",
    "pages_evicted": "pages evict took",
    "pages_dropped": "pages reset dropped",
}


class CacheMetricsCollector:
    """A prometheus_client collector over ``cache.stats()``."""

    def __init__(self, cache: Any, prefix: str = "radixspec_cache") -> None:
        self.cache = cache
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats: CacheStats = self.cache.stats()
        for item in fields(NamespaceStats):
            family = CounterMetricFamily(f"{self.prefix}_{item.name}", HELP[item.name], labels=["namespace"])
            for namespace, counts in stats.namespaces.items():
                family.add_metric([repr(namespace)], getattr(counts, item.name))
            family.add_metric([RETIRED_LABEL], getattr(stats.retired, item.name))
            yield family
        total = stats.total
        for name, value, text in (
            ("token_hit_rate", total.token_hit_rate, "matched tokens / asked tokens"),
            ("request_hit_rate", total.request_hit_rate, "matches that hit / matches"),
            ("mean_eviction_age", stats.mean_eviction_age, "cache operations since an evicted page's last use"),
        ):
            yield GaugeMetricFamily(f"{self.prefix}_{name}", text, value=value)


def register_cache_metrics(cache: Any, registry: Any = None, prefix: str = "radixspec_cache") -> CacheMetricsCollector:
    """Register a collector for ``cache`` (in prometheus_client's default registry unless given one)."""
    from prometheus_client import REGISTRY

    collector = CacheMetricsCollector(cache, prefix)
    (registry or REGISTRY).register(collector)
    return collector
