"""The router machine: several workers behind one cache-aware router index, the router checked against them.

Two to four workers, each a prefix cache that publishes KV events (the caches
selected with ``--target``, e.g. SGLang's RadixCache with its own event
recorder, else ours: the reference or the optimized tree; drawn per worker),
serve requests;
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
inserts the prompt. Workers also evict on their own, reset (every page
cleared) and restart. Each batch is numbered and kept (as vLLM's publisher
keeps them for replay); the link to the routers may lose, repeat or reorder
the next batch, or the worker may restart without the routers being told;
the routers receive through ``SequencedSubscriber`` (a gap filled from the
publisher's kept batches). The laws are asserted for the workers the routers
are in sync with; for the others the machine measures how far off the
routers are, and for how long (``Divergence``; ``python -m tools.router_faults``
prints the table). The summary reports the reach: workers, pages indexed at
once, removals relayed, scores checked, faults and recoveries.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixspec.spec.domains import Namespace
from radixspec.spec.errors import EventStreamError
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
from .targets.api import CacheCapabilities, RouterTarget, TargetInfo
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
        self.worker_id, self.info = worker_id, info
        self.page_size, self.num_pages = page_size, num_pages
        self.start()

    def start(self) -> None:
        """Start (or restart) empty: a new cache, every page free, the publisher numbering from 0 again."""
        from radixspec.optimized.kv_events import ReplayBuffer

        page_size, num_pages, info = self.page_size, self.num_pages, self.info
        assert info.cache_factory is not None
        cache = info.cache_factory(page_size, num_pages)
        caps = CacheCapabilities.of(cache)
        assert caps.pages and caps.evicts and caps.resets and caps.events, (
            f"{info.name}: a worker shows its pages, evicts and resets on request and emits KV events"
        )
        self.cache, self.shows, self.evicts, self.resets, self.events = (
            cache,
            caps.pages,
            caps.evicts,
            caps.resets,
            caps.events,
        )
        self.free: deque[int] = deque(range(0, num_pages * page_size, page_size))
        # the publisher: the next batch's sequence number, and the batches it keeps for replay
        self.sequence = 0
        self.kept = ReplayBuffer()

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
        """Clear the cache: every page free again (a cache that returns its slots and one that drops them alike)."""
        self.resets.reset()
        self.free = deque(range(0, self.num_pages * self.page_size, self.page_size))

    def publish(self) -> tuple[int, bytes] | None:
        """The events since the last batch, encoded and numbered as the worker publishes them, and kept for replay
        (None when there are none)."""
        from radixspec.optimized import kv_events

        events = self.events.take_events()
        if not events:
            return None
        STATS.events_replayed += len(events)
        STATS.router_removals += sum(type(event).__name__ != "PageStored" for event in events)
        batch = (self.sequence, kv_events.encode(events, self.page_size, ts=0.0))
        self.kept.append(*batch)
        self.sequence += 1
        return batch


# faults of a worker's link: its next batch lost, twice, after the one after it; the worker restarted without the
# routers being told (its publisher numbers from 0 again: no subscriber can tell that from repeats)
FAULTS = ("drop", "duplicate", "reorder", "silent_restart")
# every fault the machines saw, with what the routers believed meanwhile (the fault table reads them)
DIVERGENCES: list[Divergence] = []


@dataclass
class Divergence:
    """One fault on a worker's link, and what the routers believed until they were in sync again."""

    kind: str
    worker: int
    since: int
    # steps until it ended (None while it lasts), and how: "replay" (the subscriber in sync again: the laws hold
    # from then on), "restart" (a restart the routers were told of), "open" (the example ended first)
    steps: int | None = None
    ended: str = "open"
    # steps until every router's view of the worker was right again (pages held and scores), if it ever was
    right_after: int | None = None
    # the largest over- and under-estimate of the worker's score, in pages, over the prompts scored meanwhile
    over: int = 0
    under: int = 0
    # batches a router refused meanwhile
    refused: int = 0
    # the faults that struck the worker's link while it lasted, this one first: more than one mixes their effects
    kinds: list[str] = field(default_factory=list)

    @property
    def strikes(self) -> int:
        return len(self.kinds)


class Link:
    """The way from one worker's publisher to the routers: the fault armed for its next batch, a batch held back
    (reorder), and the subscriber's sequence numbers (``SequencedSubscriber``: a gap is filled from the worker's
    kept batches, as over vLLM's replay socket; without recovery, batches are applied as they arrive)."""

    def __init__(self, worker: Worker, recover: bool) -> None:
        from radixspec.optimized.kv_events import SequencedSubscriber

        self.worker = worker
        self.recover = recover
        self.armed: str | None = None
        self.held: tuple[int, bytes] | None = None
        # restarted without the routers being told: never in sync again until a restart they are told of
        self.silent = False
        # the fault the last batch met (None: none)
        self.struck: str | None = None
        # why the subscriber cannot recover (None: it can)
        self.lost: str | None = None
        self.subscriber = SequencedSubscriber(lambda start: self.worker.kept.since(start))
        # since which step the routers' view of this worker may lag (a fault not yet recovered), and its kind
        self.outage: tuple[str, int] | None = None

    def deliver(self, batch: tuple[int, bytes] | None) -> list[bytes]:
        """What arrives of this step's batch (the fault armed, if any, applied), as payloads to apply in order."""
        arrived: list[tuple[int, bytes]] = []
        if batch is not None:
            fault, self.armed = self.armed, None
            self.struck = fault
            if fault == "reorder" and self.held is None:
                self.held = batch
            elif fault != "drop":
                arrived += [batch, batch] if fault == "duplicate" else [batch]
                # a batch held back arrives after the one after it
                if self.held is not None:
                    arrived.append(self.held)
                    self.held = None
        if not self.recover:
            return [payload for _, payload in arrived]
        out: list[bytes] = []
        for seq, data in arrived:
            try:
                out += self.subscriber.receive(seq, data)
            except EventStreamError as exc:
                # a gap the publisher no longer holds (a batch of a worker's earlier life arriving after it
                # restarted unannounced): lost for good, the routers never in sync with it until a told restart
                self.lost = str(exc)
        return out

    def in_sync(self) -> bool:
        """The routers have every batch the worker published (with recovery: in order, once)."""
        return (
            not self.silent
            and self.lost is None
            and self.armed is None
            and self.held is None
            and self.subscriber.expected == self.worker.sequence
        )

    def restart(self) -> None:
        self.armed, self.held, self.silent, self.lost = None, None, False, None
        self.subscriber.restart()


class RouterMachine(RuleBasedStateMachine):
    """Workers behind routers: requests, evictions and resets, the router laws after every step."""

    # the routers under test (machine_for sets them from --target) and the caches the workers may be
    ROUTERS: ClassVar[tuple[TargetInfo, ...]] = ()
    WORKERS: ClassVar[tuple[str | TargetInfo, ...]] = tuple(IMPLEMENTATIONS)
    SHALLOW: ClassVar[bool] = False
    # the subscriber recovers lost and reordered batches through the publisher's replay (else applies what arrives:
    # the fault table's other column, ``fault_table``)
    RECOVER: ClassVar[bool] = True
    # our router beside the routers under test (the fault table measures a router alone)
    WITH_OURS: ClassVar[bool] = True
    # faults per example (None: any number; the fault table takes one, so that each is seen alone)
    FAULT_BUDGET: ClassVar[int | None] = None

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.page_size = 1
        self.workers: list[Worker] = []
        self.links: list[Link] = []
        self.routers: list[RouterTarget] = []
        self.prompts: deque[tuple[tuple[int, ...], Namespace]] = deque(maxlen=PROMPTS_KEPT)
        self.one_namespace = False
        self.step = 0
        self.faults = 0
        # per fault: what the routers believed while it lasted (``Divergence``), finished ones last
        self.divergences: list[Divergence] = []

    @initialize(
        page_size=st.sampled_from([1, 2, 4, 16]),
        kinds=st.lists(st.integers(0, 7), min_size=2, max_size=4),
        num_pages=st.one_of(st.integers(2, 12), st.integers(13, 64)),
    )
    def setup(self, page_size: int, kinds: list[int], num_pages: int) -> None:
        self.page_size = page_size
        infos = [w if isinstance(w, TargetInfo) else resolve(w, check=False) for w in self.WORKERS]
        self.workers = [Worker(i, infos[kind % len(infos)], page_size, num_pages) for i, kind in enumerate(kinds)]
        # a worker whose events give two namespaces' equal pages one hash (SGLang's: finding 8) serves one namespace
        self.one_namespace = any(not w.info.profile.event_namespaces for w in self.workers)
        self.links = [Link(worker, self.RECOVER) for worker in self.workers]
        routers = [*self.ROUTERS, *([SPEC_ROUTER] if self.WITH_OURS or not self.ROUTERS else [])]
        self.routers = [info.router_factory(page_size) for info in routers if info.router_factory is not None]
        STATS.record_reach(most_workers=len(self.workers))

    # ------------------------------------------------------------------------------------------- the rules

    @rule(
        which=st.integers(0, 3), base=st.integers(0, PROMPTS_KEPT), pages=page_choices, tail=tail_choices, ns=namespaces
    )
    def request(self, which: int, base: int, pages: list[int], tail: list[int], ns: Namespace) -> None:
        """A request sent to a drawn worker: a known prompt's prefix extended, or a fresh prompt."""
        self.serve(which % len(self.workers), self.prompt(base, pages, tail), self.namespace(ns))
        STATS.record_rule("router.request[drawn]")

    @rule(base=st.integers(0, PROMPTS_KEPT), pages=page_choices, tail=tail_choices, ns=namespaces)
    def request_routed(self, base: int, pages: list[int], tail: list[int], ns: Namespace) -> None:
        """A request sent where the first router scores it best (ties and no hit: the lowest worker id)."""
        tokens, ns = self.prompt(base, pages, tail), self.namespace(ns)
        scores = self.routers[0].scores(tokens, ns)
        best = max(scores.values(), default=0)
        self.serve(min((w for w, s in scores.items() if s == best), default=0), tokens, ns)
        STATS.record_rule("router.request[routed]")

    def namespace(self, ns: Namespace) -> Namespace:
        """The drawn namespace, or None when a worker's events do not tell namespaces apart."""
        return None if self.one_namespace else ns

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

    @precondition(lambda self: self.FAULT_BUDGET is None or self.faults < self.FAULT_BUDGET)
    @rule(which=st.integers(0, 3), kind=st.sampled_from(FAULTS))
    def fault(self, which: int, kind: str) -> None:
        """The worker's next batch is lost, arrives twice, or arrives after the one after it."""
        link = self.links[which % len(self.links)]
        if kind == "silent_restart" and not link.worker.pages():
            STATS.record_rule("router.fault[silent_restart of an empty worker: nothing to lose]")
            return
        if kind == "silent_restart":
            link.worker.start()
            link.silent = True
            self.open_outage(link, kind)
        else:
            # it strikes the worker's next batch (deliver; counted there)
            link.armed = kind
        self.faults += 1
        STATS.record_rule(f"router.fault[{kind}]")

    @precondition(lambda self: sum(len(w.pages()) for w in self.workers) >= RESET_FROM_PAGES)
    @rule(which=st.integers(0, 3))
    def restart(self, which: int) -> None:
        """A worker restarts empty, its publisher numbering from 0; the routers are told (as when an instance
        leaves and comes back) and forget it."""
        link = self.links[which % len(self.links)]
        link.worker.start()
        link.restart()
        for router in self.routers:
            router.remove_worker(link.worker.worker_id)
        self.close_outage(link, "restart")
        STATS.record_rule("router.restart")

    def open_outage(self, link: Link, kind: str) -> None:
        """A fault struck: the routers' view of the worker may lag from now on (a second fault joins the first)."""
        STATS.router_faults[kind] += 1
        if link.outage is None:
            link.outage = (kind, self.step)
            self.divergences.append(Divergence(kind, link.worker.worker_id, self.step, kinds=[kind]))
            return
        for divergence in self.divergences:
            if divergence.worker == link.worker.worker_id and divergence.steps is None:
                divergence.kinds.append(kind)

    def close_outage(self, link: Link, how: str) -> None:
        if link.outage is None:
            return
        for divergence in self.divergences:
            if divergence.worker == link.worker.worker_id and divergence.steps is None:
                divergence.steps = self.step - divergence.since
                divergence.ended = how
                if how == "replay" and divergence.right_after is None:
                    divergence.right_after = divergence.steps  # in sync: the laws hold from now on
                if how == "replay":
                    STATS.router_recovered.update(divergence.kinds)
                STATS.record_reach(longest_router_outage_steps=divergence.steps)
        link.outage = None

    # ------------------------------------------------------------------------------------------- the laws

    @invariant()
    def routers_agree_with_workers(self) -> None:
        """Publish every worker's new events through its link, then check every router's laws on the workers the
        routers are in sync with, and measure how far they are off on the others."""
        if not self.workers:
            return
        self.step += 1
        for link in self.links:
            payloads = link.deliver(link.worker.publish())
            if link.struck is not None:
                self.open_outage(link, link.struck)
            if link.lost is not None and link.outage is None:
                raise AssertionError(f"worker {link.worker.worker_id}'s batches lost with no fault: {link.lost}")
            for payload in payloads:
                for router in self.routers:
                    try:
                        router.apply(link.worker.worker_id, payload)
                    except Exception as exc:
                        if link.outage is None:
                            raise
                        self.note_refusal(link, exc)
            if link.recover and link.outage is not None and link.in_sync():
                self.close_outage(link, "replay")
        truth = {worker.worker_id: worker.pages() for worker in self.workers}
        live = {worker: set(pages) for worker, pages in truth.items() if pages}
        STATS.record_reach(
            most_router_blocks=sum(len(pages) for pages in live.values()),
            largest_tree_pages=max(len(pages) for pages in truth.values()),
            most_namespaces=len({key[0] for pages in live.values() for key in pages}),
        )
        synced = {link.worker.worker_id for link in self.links if link.outage is None}
        right = {link.worker.worker_id for link in self.links if link.outage is not None}
        for router in self.routers:
            router_namespaces_apart(live, router.entry_of)
            held = router.live()
            right -= {w for w in right if held.get(w, set()) != live.get(w, set())}
            router_holds_live_blocks(
                {w: pages for w, pages in held.items() if w in synced},
                {w: pages for w, pages in live.items() if w in synced},
            )
            for tokens, ns in self.prompts:
                expected = {w: longest_cached_pages(pages, tokens, ns, self.page_size) for w, pages in truth.items()}
                scores = router.scores(list(tokens), ns)
                router_scores_match_workers(
                    {w: n for w, n in scores.items() if w in synced},
                    {w: n for w, n in expected.items() if w in synced},
                    tokens,
                    ns,
                )
                self.measure(scores, expected, synced)
                right -= {w for w in right if scores.get(w, 0) != expected.get(w, 0)}
                STATS.router_scores_checked += 1
        for divergence in self.divergences:
            if divergence.steps is None and divergence.right_after is None and divergence.worker in right:
                divergence.right_after = self.step - divergence.since

    def note_refusal(self, link: Link, error: Exception) -> None:
        """A router refused a batch of a worker it is out of sync with (Dynamo: an unknown parent or block)."""
        for divergence in self.divergences:
            if divergence.worker == link.worker.worker_id and divergence.steps is None:
                divergence.refused += 1
        STATS.rules[f"router refused a batch: {type(error).__name__}"] += 1

    def measure(self, scores: dict[int, int], expected: dict[int, int], synced: set[int]) -> None:
        """How far off the scores of the workers out of sync are: over- and under-estimates, in pages."""
        for divergence in self.divergences:
            if divergence.steps is not None or divergence.worker in synced:
                continue
            off = scores.get(divergence.worker, 0) - expected.get(divergence.worker, 0)
            divergence.over = max(divergence.over, off)
            divergence.under = max(divergence.under, -off)
            STATS.record_reach(most_router_over_pages=max(0, off), most_router_under_pages=max(0, -off))

    def teardown(self) -> None:
        for link in self.links:
            if link.outage is not None:
                # still out when the example ended (with recovery: no batch came after the fault)
                self.close_outage(link, "open")
        DIVERGENCES.extend(self.divergences)
