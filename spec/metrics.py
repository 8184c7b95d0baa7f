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

Per namespace, except the eviction age, which is over all pages. The table
is bounded: a namespace that holds no cached page may be *retired*, its
counters folded into one ``retired`` bucket, once the table passes
``STATS_NAMESPACE_LIMIT`` namespaces. Totals stay exact; per-namespace
detail stays for every namespace that holds pages (and for up to the limit
of others), so a stream of one-shot namespaces costs bounded memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from .domains import Namespace, copied_fields

# namespaces whose counters a cache keeps apart before it retires those holding no page
STATS_NAMESPACE_LIMIT = 1024
# the label of the retired bucket in an exposition (no namespace's repr reads so)
RETIRED_LABEL = "<retired>"


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

    def __deepcopy__(self, memo: dict[int, object]) -> NamespaceStats:
        """The same counters, of the same class (the optimized cache keeps them as C integers)."""
        clone = type(self)()
        clone.add(self)
        return clone

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
    # the counters of namespaces retired from the table (they held no page then), summed
    retired: NamespaceStats = field(default_factory=NamespaceStats)
    # sum over evicted pages of (clock at eviction - the page's last access stamp)
    eviction_age_sum: int = 0

    @property
    def total(self) -> NamespaceStats:
        """Every namespace's counters summed, the retired ones included."""
        total = NamespaceStats()
        total.add(self.retired)
        for stats in self.namespaces.values():
            total.add(stats)
        return total

    @property
    def mean_eviction_age(self) -> float:
        """Mean eviction age of the evicted pages, in cache operations (0 when none was evicted)."""
        evicted = self.total.pages_evicted
        return self.eviction_age_sum / evicted if evicted else 0.0

    def of(self, namespace: Namespace) -> NamespaceStats:
        """The counters of ``namespace`` (zeros if it never showed up or was retired)."""
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
            "retired": {item.name: getattr(self.retired, item.name) for item in fields(self.retired)},
        }


class StatsCounter:
    """The counting both caches share: per-namespace counters kept as the operations run.

    ``holds_pages(namespace)`` tells whether the cache holds a page of the namespace now. When a namespace
    new to the table would pass its room, every namespace holding no page is retired: its counters are added
    to ``retired`` (its evicted pages being, by conservation, those stored less those dropped) and its entry
    goes. The room then doubles past what is left, so retiring costs O(1) per namespace, amortized.
    """

    def __init__(
        self,
        holds_pages: Callable[[Namespace], bool],
        limit: int | None = None,
        new_stats: Callable[[], NamespaceStats] = NamespaceStats,
    ) -> None:
        # new_stats: how an entry of the table is made (the optimized cache keeps its counters as C integers)
        self._new_stats = new_stats
        self.counts: dict[Namespace, NamespaceStats] = {}
        self.retired = NamespaceStats()
        self._holds_pages = holds_pages
        self._limit = STATS_NAMESPACE_LIMIT if limit is None else limit
        self._room = self._limit

    def __deepcopy__(self, memo: dict[int, object]) -> StatsCounter:
        """The same counts, asking the deep copy of the cache (``holds_pages`` is the cache's bound method)."""
        return copied_fields(self, memo, shared=("_new_stats",))

    def _ns(self, namespace: Namespace) -> NamespaceStats:
        found = self.counts.get(namespace)
        if found is None:
            if len(self.counts) >= self._room:
                self._retire()
            found = self.counts[namespace] = self._new_stats()
        return found

    def _retire(self) -> None:
        for namespace in [ns for ns in self.counts if not self._holds_pages(ns)]:
            stats = self.counts.pop(namespace)
            stats.pages_evicted = stats.pages_stored - stats.pages_dropped
            self.retired.add(stats)
        self._room = max(self._limit, 2 * len(self.counts))

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

    def evicted(self, namespace: Namespace, pages: int) -> None:
        """An evict took ``pages`` pages of the namespace (a cache that counts evictions one by one)."""
        self._ns(namespace).pages_evicted += pages

    def dropped(self, namespace: Namespace, pages: int) -> None:
        """A reset dropped ``pages`` pages of the namespace."""
        if pages:
            self._ns(namespace).pages_dropped += pages

    def snapshot(self, eviction_age_sum: int, evicted: dict[Namespace, int] | None = None) -> CacheStats:
        """The stats now; ``evicted``, when given, the pages evicted per namespace as the cache counts them."""
        out = CacheStats(eviction_age_sum=eviction_age_sum)
        out.retired.add(self.retired)
        for namespace, stats in self.counts.items():
            copy = NamespaceStats()
            copy.add(stats)
            if evicted is not None:
                copy.pages_evicted = evicted.get(namespace, 0)
            out.namespaces[namespace] = copy
        return out


def stats_of(cache: Any) -> CacheStats:
    """``cache.stats()`` for caches that count (the radix caches), empty stats for those that do not."""
    stats = getattr(cache, "stats", None)
    return stats() if stats is not None else CacheStats()
