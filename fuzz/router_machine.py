"""The router machine: several workers behind one cache-aware router index, the router checked against them.

Two to four workers, each a prefix cache that publishes KV events (ours:
the reference or the optimized tree; drawn per worker), serve requests;
after every step each worker's new events go out as one batch on the wire
(``radixspec.optimized.kv_events``: msgpack in vLLM's format) to every
router under test (``--target dynamo``: NVIDIA Dynamo's ``RadixTree``
through our translation of its relay) and to ours (``radixspec-router``,
the spec's index, always beside them). Then the laws of
``radixspec.spec.router``, for every router:

* ``router_scores_match_workers``: every prompt requested so far, scored
  by the router, gives per worker exactly the pages that worker holds of it
  (read from its pages, so asking changes no LRU stamp);
* ``router_holds_live_blocks``: the router's index is exactly the workers'
  live pages;
* ``router_namespaces_apart``: no router entry stands for pages of two
  namespaces.

Requests go to a drawn worker, or to the worker the first router scores
best (ties to the lowest id), as a KV-aware router sends them; a worker
matches, evicts its least recently used pages when its pool is short, and
inserts the prompt. Workers also evict on their own and reset (every page
cleared). The summary reports the reach: workers, pages indexed at once,
removals relayed, scores checked.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixspec.spec.domains import Namespace
from radixspec.spec.prefix_cache import PageKey
from radixspec.spec.router import (
    longest_cached_pages,
    router_holds_live_blocks,
    router_namespaces_apart,
    router_scores_match_workers,
)

from .sequences import NAMESPACE_PALETTE, build_sequence, page_choices, tail_choices
from .stats import STATS
from .targets import resolve
from .targets.api import CacheCapabilities, PrefixCacheTarget, RouterTarget, TargetInfo
from .targets.ours import IMPLEMENTATIONS
from .targets.routers import SPEC_ROUTER

# prompts kept for scoring (the oldest dropped first): every one is scored against every worker after every step
PROMPTS_KEPT = 24
# namespaces the workers' requests use: none, and a few that hold equal tokens apart
namespaces = st.sampled_from(NAMESPACE_PALETTE[:4])
# the workers' pages, all together, from which a worker may reset
RESET_FROM_PAGES = 8


class Worker:
    """One worker: a prefix cache that emits KV events, its free pages, and the batches it has to publish."""

    def __init__(self, worker_id: int, info: TargetInfo, page_size: int, num_pages: int) -> None:
        assert info.cache_factory is not None, f"target {info.name} has no prefix cache"
        self.worker_id, self.name = worker_id, info.name
        self.page_size = page_size
        cache: PrefixCacheTarget[Any] = info.cache_factory(page_size, num_pages)
        caps = CacheCapabilities.of(cache)
        assert caps.pages and caps.evicts and caps.resets and caps.events, f"{info.name}: a worker shows its pages"
        self.cache, self.shows, self.evicts, self.resets, self.events = (
            cache,
            caps.pages,
            caps.evicts,
            caps.resets,
            caps.events,
        )
        self.free: deque[int] = deque(range(0, num_pages * page_size, page_size))

    def pages(self) -> dict[PageKey, int]:
        """What the worker holds (its truth), read without a match: no stamp changes."""
        return self.shows.cached_pages()

    def serve(self, tokens: list[int], namespace: Namespace) -> tuple[int, int]:
        """Match (the hit locked while room is made), evict when the pool is short, insert: (pages hit, pages
        cached after)."""
        p = self.page_size
        handle = self.cache.match_prefix(tokens, namespace)
        hit = self.cache.cached_len(handle)
        slots = self.cache.get_matched_indices(handle)
        want = len(tokens) // p - hit // p
        short = want - len(self.free)
        if short > 0:
            self.cache.lock(handle)
            self.evict(min(short, self.cache.size_info()[0] // p))
            self.cache.unlock(handle)
        new = min(want, len(self.free))
        for _ in range(new):
            start = self.free.popleft()
            slots.extend(range(start, start + p))
        length = hit + new * p
        if new:
            self.cache.insert_prefix(tokens[:length], slots, namespace)
        return hit // p, length // p

    def evict(self, pages: int) -> int:
        """Evict ``pages`` pages (least recently used first); how many."""
        if pages <= 0:
            return 0
        self.evicts.evict(pages * self.page_size)
        taken = 0
        for unit in self.cache.take_evicted():
            for slot in unit:
                if slot % self.page_size == 0:
                    self.free.append(slot)
                    taken += 1
        STATS.evicted_pages += taken
        STATS.record_reach(largest_evict_pages=taken)
        return taken

    def reset(self) -> None:
        for slot in self.resets.reset():
            if slot % self.page_size == 0:
                self.free.append(slot)

    def take_batch(self) -> bytes | None:
        """The events since the last batch, encoded as the worker publishes them (None when there are none)."""
        from radixspec.optimized import kv_events

        events = self.events.take_events()
        if not events:
            return None
        STATS.events_replayed += len(events)
        STATS.router_removals += sum(type(event).__name__ != "PageStored" for event in events)
        return kv_events.encode(events, self.page_size, ts=0.0)


class RouterMachine(RuleBasedStateMachine):
    """Workers behind routers: requests, evictions and resets, the router laws after every step."""

    # the routers under test (machine_for sets them from --target) and the caches the workers may be
    ROUTERS: ClassVar[tuple[TargetInfo, ...]] = ()
    WORKERS: ClassVar[tuple[str | TargetInfo, ...]] = tuple(IMPLEMENTATIONS)
    SHALLOW: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.page_size = 1
        self.workers: list[Worker] = []
        self.routers: list[RouterTarget] = []
        self.prompts: deque[tuple[tuple[int, ...], Namespace]] = deque(maxlen=PROMPTS_KEPT)

    @initialize(
        page_size=st.sampled_from([1, 2, 4, 16]),
        kinds=st.lists(st.integers(0, 7), min_size=2, max_size=4),
        num_pages=st.one_of(st.integers(2, 12), st.integers(13, 64)),
    )
    def setup(self, page_size: int, kinds: list[int], num_pages: int) -> None:
        self.page_size = page_size
        infos = [w if isinstance(w, TargetInfo) else resolve(w, check=False) for w in self.WORKERS]
        self.workers = [Worker(i, infos[kind % len(infos)], page_size, num_pages) for i, kind in enumerate(kinds)]
        routers = [*self.ROUTERS, SPEC_ROUTER]
        self.routers = [info.router_factory(page_size) for info in routers if info.router_factory is not None]
        STATS.record_reach(most_workers=len(self.workers))

    # ------------------------------------------------------------------------------------------- the rules

    @rule(
        which=st.integers(0, 3), base=st.integers(0, PROMPTS_KEPT), pages=page_choices, tail=tail_choices, ns=namespaces
    )
    def request(self, which: int, base: int, pages: list[int], tail: list[int], ns: Namespace) -> None:
        """A request sent to a drawn worker: a known prompt's prefix extended, or a fresh prompt."""
        self.serve(which % len(self.workers), self.prompt(base, pages, tail), ns)
        STATS.record_rule("router.request[drawn]")

    @rule(base=st.integers(0, PROMPTS_KEPT), pages=page_choices, tail=tail_choices, ns=namespaces)
    def request_routed(self, base: int, pages: list[int], tail: list[int], ns: Namespace) -> None:
        """A request sent where the first router scores it best (ties and no hit: the lowest worker id)."""
        tokens = self.prompt(base, pages, tail)
        scores = self.routers[0].scores(tokens, ns)
        best = max(scores.values(), default=0)
        self.serve(min((w for w, s in scores.items() if s == best), default=0), tokens, ns)
        STATS.record_rule("router.request[routed]")

    def prompt(self, base: int, pages: list[int], tail: list[int]) -> list[int]:
        """The drawn pages and tail after a known prompt's whole pages (``base``: which; past the known: none)."""
        known = list(self.prompts)
        return build_sequence(self.page_size, pages, tail, known[base][0] if base < len(known) else ())

    def serve(self, worker: int, tokens: list[int], ns: Namespace) -> None:
        self.workers[worker].serve(tokens, ns)
        STATS.record_reach(longest_key_tokens=len(tokens))
        self.prompts.append((tuple(tokens), ns))

    @precondition(lambda self: any(w.cache.size_info()[0] for w in self.workers))
    @rule(which=st.integers(0, 3), pages=st.integers(1, 8))
    def evict(self, which: int, pages: int) -> None:
        """A worker evicts on its own (memory pressure from elsewhere)."""
        worker = self.workers[which % len(self.workers)]
        evictable = worker.cache.size_info()[0] // self.page_size
        worker.evict(min(pages, evictable))
        STATS.record_rule("router.evict")

    # a reset empties a worker: only once the workers hold something worth losing
    @precondition(lambda self: sum(len(w.pages()) for w in self.workers) >= RESET_FROM_PAGES)
    @rule(which=st.integers(0, 3))
    def reset(self, which: int) -> None:
        """A worker clears its whole cache (AllBlocksCleared)."""
        self.workers[which % len(self.workers)].reset()
        STATS.record_rule("router.reset")

    # ------------------------------------------------------------------------------------------- the laws

    @invariant()
    def routers_agree_with_workers(self) -> None:
        """Publish every worker's new events, then check every router's laws."""
        if not self.workers:
            return
        for worker in self.workers:
            payload = worker.take_batch()
            if payload is not None:
                for router in self.routers:
                    router.apply(worker.worker_id, payload)
        truth = {worker.worker_id: worker.pages() for worker in self.workers}
        live = {worker: set(pages) for worker, pages in truth.items() if pages}
        STATS.record_reach(
            most_router_blocks=sum(len(pages) for pages in live.values()),
            largest_tree_pages=max(len(pages) for pages in truth.values()),
            most_namespaces=len({key[0] for pages in live.values() for key in pages}),
        )
        for router in self.routers:
            router_namespaces_apart(live, router.entry_of)
            router_holds_live_blocks(router.live(), live)
            for tokens, ns in self.prompts:
                expected = {w: longest_cached_pages(pages, tokens, ns, self.page_size) for w, pages in truth.items()}
                router_scores_match_workers(router.scores(list(tokens), ns), expected, tokens, ns)
                STATS.router_scores_checked += 1
