"""``radixspec replay --target T`` for a request-lifecycle target: each request of a trace served by the engine's
cache as its scheduler drives it, beside our hybrid manager with the same groups and pool.

A target of the hybrid layer (``TargetInfo.hybrid_factory``: SGLang's unified caches, vLLM's coordinators, their
tiered variants) has no prefix cache to call page by page: it matches a request, allocates and stores its KV in
chunks, and caches it when the request finishes. The replay serves the trace's requests so, one at a time, in
order: match (the hit), allocate and store the prompt in chunks of ``CHUNK_TOKENS`` (chunked prefill), finish.
Output tokens are not replayed. A request the engine cannot hold (not admitted, or its pages not found) is
counted apart and aborted. The engine's own checks run every ``CHECK_EVERY`` requests and at the end, and its
adapter's hit law on every match; a broken one stops the replay (``LawBroken``).

The target's configuration (EAGLE, eviction policy, tree core, ...) is drawn from the pool size as in a campaign
(the row names it), and its pool may differ from the one asked (SGLang's adapters double it): the row gives the
engine's pool, and ours runs with that pool and the engine's groups (less a recurrent-state group, which our
hybrid manager has not), so that the two hit rates compare at equal pool size.
"""

from __future__ import annotations

from typing import cast

from radixspec.reference.hybrid_manager import HybridCacheManager, HybridReq
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError, OutOfPagesError

from .hybrid_executor import Executes
from .stats import STATS
from .targets.api import CountsPages, LifecycleTarget, TargetInfo

# tokens a request prefills per step (the budget of a chunked prefill, as the hybrid machine's serve_running)
CHUNK_TOKENS = 2048
# requests between two runs of the target's own integrity checks
CHECK_EVERY = 64
# operations run on each transfer stream of a tiered target after each request (all that are queued)
STREAM_OPERATIONS = 1 << 16


class LawBroken(Exception):
    """A target broke one of its own checks (or its adapter's hit law) during a replay: a finding, not bad input."""


class LifecyclePlacer:
    """A lifecycle target serving a trace's requests one at a time: ``replay.replay_trace``'s ``place``."""

    def __init__(self, name: str, manager: LifecycleTarget, pool_pages: int, config: str = "") -> None:
        self.name, self.manager, self.pool_pages, self.config = name, manager, pool_pages, config
        self.page_size = manager.page_size
        self.counter = manager if isinstance(manager, CountsPages) else None
        self.executes = bool(getattr(manager, "executes", False))
        self.served = 0

    def place(self, tokens: list[int], namespace: Namespace) -> int | None:
        """Serve one request whole; the tokens its match hit, or None when the engine could not hold it (or it is
        empty). LawBroken when the target's checks or its hit law fail."""
        if not tokens:
            return None
        self.served += 1
        req = HybridReq(self.served, list(tokens), namespace)
        try:
            return self.serve(req)
        except (IntegrityError, AssertionError) as exc:
            raise LawBroken(f"{self.name}, request {self.served} ({len(tokens)} tokens): {exc}") from exc

    def serve(self, req: HybridReq) -> int | None:
        manager = self.manager
        try:
            manager.match_req(req)
        except OutOfPagesError:
            return None
        hit = req.cached_len
        while req.computed < len(req.input_ids):
            length = min(len(req.input_ids), req.computed + CHUNK_TOKENS)
            try:
                manager.allocate_paged(req, length)
            except OutOfPagesError:
                manager.cache_req(req, True)  # aborted: what it computed is cached, the rest freed
                self.run_streams()
                return None
            manager.store(req, length - req.computed)
        manager.cache_req(req, True)
        self.run_streams()
        if self.served % CHECK_EVERY == 0:
            manager.check_integrity([])
        return hit

    def run_streams(self) -> None:
        """A tiered target's transfers, all run (the machine is their executor): its backups and loads land."""
        if self.executes:
            for lane in range(3):
                cast(Executes, self.manager).execute(lane, STREAM_OPERATIONS)

    def finish(self) -> None:
        """The end of the replay: the target's own checks, no request running."""
        try:
            self.manager.check_integrity([])
        except (IntegrityError, AssertionError) as exc:
            raise LawBroken(f"{self.name}, at the end of the replay: {exc}") from exc

    def cached_page_count(self) -> int | None:
        """Pages the target caches, where it tells (``CountsPages``; ours: its full-attention group's)."""
        if self.counter is not None:
            return self.counter.cached_page_count()
        if isinstance(self.manager, HybridCacheManager):
            info = self.manager.cache.size_info(0)
            return (info.evictable_size + info.protected_size) // self.manager.page_size
        return None

    def evicted_pages(self) -> int | None:
        """Not told: the lifecycle surface does not count evictions."""
        return None


def engine_placer(
    info: TargetInfo, page_size: int, pool_pages: int, windows: tuple[hy.Window, ...] = (None,)
) -> LifecyclePlacer:
    """The target's manager for ``pool_pages`` pages and the groups ``windows`` (those it takes; its configuration
    drawn from the pool size, named in the row's ``config``: the rules its factory records)."""
    assert info.hybrid_factory is not None, f"target {info.name} has no request lifecycle"
    before = dict(STATS.rules)
    manager = info.hybrid_factory(page_size, windows, pool_pages)
    config = "; ".join(sorted(name for name, count in STATS.rules.items() if count > before.get(name, 0)))
    return LifecyclePlacer(info.name, manager, engine_pool(manager, pool_pages), config)


def engine_pool(manager: LifecycleTarget, asked: int) -> int:
    """The pages of the engine's full-attention pool: its ``num_pages`` (both tree cores: the first's), else the
    pages asked."""
    inner = getattr(manager, "managers", None)
    source = inner[0] if isinstance(inner, list) and inner else manager
    pages = getattr(source, "num_pages", asked)
    return pages if isinstance(pages, int) else asked


def ours_beside(engine: LifecyclePlacer) -> LifecyclePlacer:
    """Our hybrid manager over our optimized hybrid cache, with the engine's pool and groups (less a recurrent-state
    group), beside the engine."""
    from .targets.layers import our_hybrid_caches

    windows: tuple[hy.Window, ...] = tuple(w for w in engine.manager.windows if w != hr.STATE) or (None,)
    caches = our_hybrid_caches()
    make = caches.get("optimized") or caches["reference"]
    manager = HybridCacheManager(make(engine.manager.page_size, windows), engine.pool_pages)
    groups = ", ".join("full" if w is None else f"window {w}" for w in windows)
    return LifecyclePlacer(f"ours@{engine.name}", manager, engine.pool_pages, f"groups: {groups}")
