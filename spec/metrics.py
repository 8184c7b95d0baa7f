"""Cache metrics: what a capacity planner and a router's operator read off a prefix cache.

Counted by every implementation the same way, so that the differential can
compare them:

* a *match request* is one ``match_prefix`` call; it *hits* when it returns a
  non-empty prefix. Token hit rate: matched tokens over asked tokens.
* a page is *stored* when an insert caches it (a page already cached is not
  stored again), *evicted* when ``evict`` takes it, *dropped* when ``reset``
  empties the cache.
* the *eviction age* of a page is the logical clock at the eviction minus the
  page's last access stamp: how many cache operations ago it was last used.

Per namespace, except the eviction age, which is over all pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .domains import Namespace


@dataclass
class NamespaceStats:
    """The counters of one namespace."""

    match_requests: int = 0
    hit_requests: int = 0
    match_tokens: int = 0
    hit_tokens: int = 0
    pages_stored: int = 0
    pages_evicted: int = 0
    pages_dropped: int = 0

    def add(self, other: NamespaceStats) -> None:
        """Add ``other``'s counters to these."""
        for item in fields(self):
            setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))

    @property
    def token_hit_rate(self) -> float:
        """Matched tokens / asked tokens (0 when nothing was asked)."""
        return self.hit_tokens / self.match_tokens if self.match_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        """Matches that found a cached page / matches (0 when none)."""
        return self.hit_requests / self.match_requests if self.match_requests else 0.0


@dataclass
class CacheStats:
    """A cache's metrics: counters per namespace, and the eviction age over all evicted pages."""

    namespaces: dict[Namespace, NamespaceStats] = field(default_factory=dict)
    # sum over evicted pages of (clock at eviction - the page's last access stamp)
    eviction_age_sum: int = 0

    @property
    def total(self) -> NamespaceStats:
        """Every namespace's counters summed."""
        total = NamespaceStats()
        for stats in self.namespaces.values():
            total.add(stats)
        return total

    @property
    def mean_eviction_age(self) -> float:
        """Mean eviction age of the evicted pages, in cache operations (0 when none was evicted)."""
        evicted = self.total.pages_evicted
        return self.eviction_age_sum / evicted if evicted else 0.0

    def of(self, namespace: Namespace) -> NamespaceStats:
        """The counters of ``namespace`` (zeros if it never showed up)."""
        return self.namespaces.get(namespace, NamespaceStats())

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers: totals, rates, and one entry per namespace (keyed by ``repr``), for JSON."""
        total = self.total
        return {
            **{item.name: getattr(total, item.name) for item in fields(total)},
            "token_hit_rate": total.token_hit_rate,
            "request_hit_rate": total.request_hit_rate,
            "mean_eviction_age": self.mean_eviction_age,
            "namespaces": {
                repr(namespace): {item.name: getattr(stats, item.name) for item in fields(stats)}
                for namespace, stats in self.namespaces.items()
            },
        }


class StatsCounter:
    """The counting both caches share: per-namespace counters kept as the operations run."""

    def __init__(self) -> None:
        self.counts: dict[Namespace, NamespaceStats] = {}

    def _ns(self, namespace: Namespace) -> NamespaceStats:
        found = self.counts.get(namespace)
        if found is None:
            found = self.counts[namespace] = NamespaceStats()
        return found

    def matched(self, namespace: Namespace, asked: int, cached_len: int) -> None:
        """One match_prefix call: ``asked`` tokens, ``cached_len`` of them cached."""
        stats = self._ns(namespace)
        stats.match_requests += 1
        stats.match_tokens += asked
        if cached_len:
            stats.hit_requests += 1
            stats.hit_tokens += cached_len

    def stored(self, namespace: Namespace, pages: int) -> None:
        """An insert cached ``pages`` new pages."""
        if pages:
            self._ns(namespace).pages_stored += pages

    def dropped(self, namespace: Namespace, pages: int) -> None:
        """A reset dropped ``pages`` pages of the namespace."""
        if pages:
            self._ns(namespace).pages_dropped += pages

    def snapshot(self, evicted: dict[Namespace, int], eviction_age_sum: int) -> CacheStats:
        """The stats now, with the pages evicted per namespace as the cache counts them."""
        out = CacheStats(eviction_age_sum=eviction_age_sum)
        for namespace, stats in self.counts.items():
            copy = NamespaceStats()
            copy.add(stats)
            copy.pages_evicted = evicted.get(namespace, 0)
            out.namespaces[namespace] = copy
        return out


def stats_of(cache: Any) -> CacheStats:
    """``cache.stats()`` for caches that count (the radix caches), empty stats for those that do not."""
    stats = getattr(cache, "stats", None)
    return stats() if stats is not None else CacheStats()
