"""``radixspec replay TRACE --workers N --router POLICY``: a trace replayed over N workers behind a router.

    radixspec replay TRACE --workers 1,2,4,8 --router dynamo,radixspec,round-robin,least-loaded
                          [--pool-pages 1024] [--page-size 16] [--json rows.json] [--plot hit_vs_workers.png]

Each worker is our optimized cache over a pool of ``--pool-pages`` pages
(``pools.Pool``: match, lock, evict LRU pages when short, insert, unlock),
publishing its KV events; after every request the worker's batch goes on the
wire (``radixspec.optimized.kv_events``) to the router's index. The policies:

* ``dynamo``: NVIDIA Dynamo's ``RadixTree`` (through our relay,
  ``fuzz/targets/dynamo.py``) scores every worker; the request goes to the best
  score, ties to the least loaded worker, then the lowest id;
* ``radixspec``: the same rule on our own index (``spec/router.py``, fed the
  same batches): the reference for the others;
* ``round-robin``: request i to worker i mod N;
* ``least-loaded``: the least loaded worker (then the lowest id), blind to
  caches. A worker's load: the prompt tokens it computed so far (its misses:
  what prefill cost it).

Per policy and N the row gives the token hit rate overall and per worker, the
balance (requests and cached pages per worker: the most over the mean), and
for the KV-aware policies the hit the router predicted (its score of the
chosen worker, in tokens) against the hit the worker really gave, with the
requests where the two differ (a router in step with its workers predicts
exactly). A cache-aware policy sees every worker's batches before the next
request (no event lag).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from radixspec.spec.domains import Namespace

from .pools import Driver, Pool, Request, optimized_target
from .targets.api import RouterTarget

POLICIES = ("dynamo", "radixspec", "round-robin", "least-loaded")


@dataclass
class RoutingRow:
    """What one policy did with N workers."""

    policy: str
    workers: int
    pool_pages: int
    page_size: int
    requests: int
    asked_tokens: int
    hit_tokens: int
    hit_rate: float
    # per worker: requests served, token hit rate, pages cached at the end
    worker_requests: list[int] = field(default_factory=list)
    worker_hit_rates: list[float] = field(default_factory=list)
    worker_pages: list[int] = field(default_factory=list)
    # the most requests and cached pages of a worker over the mean (1.0: even)
    request_imbalance: float = 1.0
    page_imbalance: float = 1.0
    # KV-aware policies: tokens the router predicted would hit, and requests where that was not the hit (None: no
    # prediction)
    predicted_tokens: int | None = None
    mispredicted_requests: int | None = None
    seconds: float = 0.0


class Worker:
    """One worker: our optimized cache (events on) over its pool, and what it served."""

    def __init__(self, worker_id: int, pool_pages: int, page_size: int) -> None:
        target = optimized_target(page_size)
        self.target = target
        self.worker_id = worker_id
        self.pool = Pool(Driver(f"worker {worker_id}", target, page_size), pool_pages, page_size)
        self.requests = self.asked = self.hits = 0

    @property
    def load(self) -> int:
        """The prompt tokens it computed so far (its misses)."""
        return self.asked - self.hits

    def serve(self, tokens: list[int], namespace: Namespace) -> int | None:
        cached = self.pool.place(tokens, namespace)
        if cached is not None:
            self.requests += 1
            self.asked += len(tokens)
            self.hits += cached
        return cached

    def batch(self) -> bytes | None:
        """The events of its last request, on the wire (None when none)."""
        from radixspec.optimized import kv_events

        events = self.target.take_events()
        return kv_events.encode(events, self.pool.page_size, ts=0.0) if events else None


def make_router(policy: str, page_size: int) -> RouterTarget | None:
    """The index a KV-aware policy scores with (None for the others)."""
    if policy == "dynamo":
        from .targets.dynamo import DynamoRouter

        return DynamoRouter(page_size)
    if policy == "radixspec":
        from .targets.routers import SpecRouter

        return SpecRouter(page_size)
    return None


def route(requests: Iterator[Request], policy: str, workers: int, pool_pages: int, page_size: int) -> RoutingRow:
    """Every request of the trace through ``policy`` over ``workers`` workers; the row."""
    if policy not in POLICIES:
        raise ValueError(f"no router policy {policy!r}; choose from {', '.join(POLICIES)}")
    pool = [Worker(w, pool_pages, page_size) for w in range(workers)]
    router = make_router(policy, page_size)
    predicted = mispredicted = count = 0
    start = time.perf_counter()
    for tokens, namespace in requests:
        if router is not None:
            scores = router.scores(tokens, namespace)
            best = max(scores.values(), default=0)
            chosen = min((w for w in range(workers) if scores.get(w, 0) == best), key=lambda w: (pool[w].load, w))
            guess = scores.get(chosen, 0) * page_size
        elif policy == "round-robin":
            chosen, guess = count % workers, 0
        else:
            chosen, guess = min(range(workers), key=lambda w: (pool[w].load, w)), 0
        count += 1
        hit = pool[chosen].serve(tokens, namespace)
        if hit is None:
            continue  # longer than a worker's whole pool
        payload = pool[chosen].batch()
        if router is not None:
            predicted += guess
            mispredicted += guess != hit
            if payload is not None:
                router.apply(chosen, payload)
    asked = sum(w.asked for w in pool)
    hits = sum(w.hits for w in pool)
    served = [w.requests for w in pool]
    pages = [w.pool.driver.cached_page_count() for w in pool]
    return RoutingRow(
        policy=policy,
        workers=workers,
        pool_pages=pool_pages,
        page_size=page_size,
        requests=sum(served),
        asked_tokens=asked,
        hit_tokens=hits,
        hit_rate=hits / asked if asked else 0.0,
        worker_requests=served,
        worker_hit_rates=[round(w.hits / w.asked, 4) if w.asked else 0.0 for w in pool],
        worker_pages=pages,
        request_imbalance=imbalance(served),
        page_imbalance=imbalance(pages),
        predicted_tokens=predicted if router is not None else None,
        mispredicted_requests=mispredicted if router is not None else None,
        seconds=round(time.perf_counter() - start, 3),
    )


def imbalance(values: Sequence[int]) -> float:
    """The most over the mean (1.0 when even or all zero)."""
    mean = sum(values) / len(values) if values else 0
    return round(max(values) / mean, 3) if mean else 1.0


def header() -> str:
    return (
        f"{'router':<13} {'workers':>7} {'requests':>8} {'hit rate':>9} {'worker hit rates (%)':<30}"
        f" {'req max/mean':>12} {'pages max/mean':>14} {'predicted':>10} {'real hit':>10} {'mispredicted':>12}"
    )


def line(row: RoutingRow) -> str:
    rates = " ".join(f"{100 * rate:.0f}" for rate in row.worker_hit_rates)
    predicted = "-" if row.predicted_tokens is None else str(row.predicted_tokens)
    wrong = "-" if row.mispredicted_requests is None else str(row.mispredicted_requests)
    return (
        f"{row.policy:<13} {row.workers:>7} {row.requests:>8} {100 * row.hit_rate:>8.2f}% {rates:<30}"
        f" {row.request_imbalance:>12.2f} {row.page_imbalance:>14.2f} {predicted:>10} {row.hit_tokens:>10}"
        f" {wrong:>12}"
    )


def plot(rows: Sequence[RoutingRow], path: Path) -> None:
    """Hit rate against the number of workers, one line per policy."""
    from .plots import plot_hit_rates

    policies = dict.fromkeys(row.policy for row in rows)
    curves = {policy: [(row.workers, row.hit_rate) for row in rows if row.policy == policy] for policy in policies}
    plot_hit_rates(curves, f"workers (each {rows[0].pool_pages} pages of {rows[0].page_size} tokens)", path)


def check_policies(policies: Sequence[str]) -> str:
    """Why these policies cannot run here ('' when they can): Dynamo's needs its wheel, every KV-aware one the
    events extra."""
    import importlib.util

    if any(p not in POLICIES for p in policies):
        return f"--router: choose from {', '.join(POLICIES)}"
    if "dynamo" in policies and importlib.util.find_spec("dynamo") is None:
        return "--router dynamo needs Dynamo: radixspec targets install dynamo"
    if importlib.util.find_spec("msgspec") is None:
        return "--workers needs the events extra (pip install 'radixspec[events]'): the workers publish KV events"
    return ""


def as_json(rows: Sequence[RoutingRow]) -> list[dict[str, object]]:
    from dataclasses import asdict

    return [asdict(row) for row in rows]
