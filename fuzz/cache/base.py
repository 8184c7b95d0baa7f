"""The cache machine's state and setup, the constants its parts share, and what a driven target is
(its capabilities resolved once). The parts build on it in one line: ``ledger``, ``oracle``, ``checks``,
``operations``, ``shaping``; ``fuzz/cache_machine.py`` is the whole machine."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, MultipleResults, RuleBasedStateMachine, initialize, multiple

from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import SLOT_LIMIT, Namespace

from ..sequences import (
    build_sequence,
    page_choices,
    page_sizes,
    tail_choices,
)
from ..stats import STATS
from ..targets.api import (
    CacheCapabilities,
    Evicts,
    LruModel,
    PageKey,
    PrefixCacheTarget,
    Profile,
    Resets,
    TargetInfo,
)
from ..targets.ours import IMPLEMENTATIONS

EVICT_SIZES = ("some", "some", "all", "one", "zero", "over", "negative")
# bad slots for insert_prefix: shifted, out of order, one slot inside a page wrong (its start right), already
# cached, given twice, one short, more than the tokens, past 2**31
BAD_SLOTS = ("misaligned", "scrambled", "interior", "cached", "twice", "short", "long", "past_limit")
# where fresh pages come from: the bottom of the slot domain, or its top (just below 2**31), for targets that
# take any slot; pool targets always draw from their pool
SLOT_RANGES = ("low", "low", "low", "high")
# reset only trees this large, so that most examples grow trees
RESET_AT_PAGES = 6
# the bulk rules stop growing a tree past this many pages (each step's checks are O(pages))
BIG_TREE_PAGES = 4000
# pages of a long key in a small example, and in a shallow batch's example
LONG_KEY_PAGES, SHALLOW_KEY_PAGES = 256, 16
# touch_parents_out_of_order and rematch_leaves: the leaves they touch; the most pages the first then evicts one by one
TOUCHED_LEAVES, DRAIN_PAGES = 12, 48
# rematch_leaves: rounds enough to outgrow the tree's nodes (see there), when this many matches do; and at most
# this many tokens matched in all (long keys: a match costs each implementation time linear in its tokens)
OUTGROW, OUTGROW_MATCHES, REMATCH_TOKENS = -1, 200, 20_000
# a small example of a deep batch takes bulk inserts while its tree is below this many pages
SMALL_BULK_PAGES = 100
# branches of one bulk insert: small examples, big ones
BRANCHES = ((2, 8, 16, 64), (8, 64, 256, 600))
# above this many pages, the whole-state comparison runs every CHECK_EVERY steps (and at the end), not every step
FULL_CHECK_PAGES, CHECK_EVERY = 300, 8
# a slot for positions the cache must ignore (pages already cached, the partial last page)
FILLER = SLOT_LIMIT - 1


def describe(key: PageKey) -> str:
    """A page for a message: its namespace and the tokens of its path (the last ones when long)."""
    namespace, prefix = key
    tokens = prefix.tokens
    shown = list(tokens) if len(tokens) <= 8 else ["...", *tokens[-6:]]
    where = "" if namespace is None else f" in namespace {namespace!r}"
    return f"page {shown} ({len(tokens)} tokens{where})"


@dataclass
class Driven:
    """One target the machine drives beside the spec, with what it offers beyond the protocol (resolved once)."""

    name: str
    target: PrefixCacheTarget[object]
    caps: CacheCapabilities
    # its KV events replayed as a router would (targets that emit them)
    replayer: ev.Replayer | None = None

    @property
    def profile(self) -> Profile:
        return self.target.profile

    @property
    def exact(self) -> bool:
        """The differential capability (ExactCache): state, messages and events compared exactly."""
        return self.caps.exact is not None

    @property
    def evicts(self) -> Evicts:
        """Its evict(), which a profile with ``eviction_trigger == "evict"`` promises (checked when resolved)."""
        assert self.caps.evicts is not None, f"{self.name}: its profile evicts on request but it has no evict()"
        return self.caps.evicts

    @property
    def resets(self) -> Resets:
        """Its reset(), which a profile with ``reset != "none"`` promises (checked when resolved)."""
        assert self.caps.resets is not None, f"{self.name}: its profile resets but it has no reset()"
        return self.caps.resets


class HandleSet:
    """The spec's handle and each target's, from the same call, and how many resets came before."""

    def __init__(self, spec: pc.Handle, handles: list[object], epoch: int) -> None:
        self.spec = spec
        self.handles = handles
        self.epoch = epoch

    def __repr__(self) -> str:
        return f"HandleSet(cached_len={self.spec.cached_len})"


# the bundles the rules draw from and add to (module level: every part's rules name them)
seqs = Bundle("seqs")
handles = Bundle("handles")


class CacheMachineBase(RuleBasedStateMachine):
    """The machine's state, its setup and the profile helpers every part reads."""

    # what the machine drives (radixspec.fuzz.machines.machine_for sets these): --impl and --target name them alike
    TARGETS: ClassVar[tuple[TargetInfo, ...]] = tuple(IMPLEMENTATIONS.values())
    LRU: ClassVar[str] = "strict"
    # a shallow batch (radixspec.fuzz.machines.machine_for): no big example, long keys cut to SHALLOW_KEY_PAGES pages
    SHALLOW: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.runs: list[Driven] = []
        self.model = pc.new_state(1)
        self.page_size = 1
        # the slot ledger: pages the machine owns, in the order it hands them out; how many pages exist
        self.free: deque[int] = deque()
        self.num_pages = 0
        # pool targets: a fixed pool; else the ledger grows (low pages from 0 up, high ones from 2**31 down)
        self.bounded = False
        self.next_low = 0
        self.high_taken = 0
        # outstanding locks per page, as the machine counts them
        self.locks: Counter[pc.PageKey] = Counter()
        # the target the model follows (a profile with choices of its own), or None: the spec decides
        self.follow: Driven | None = None
        self.lru_model: LruModel | None = None
        # resets so far
        self.epoch = 0
        # steps since the last whole comparison
        self.unchecked = 0
        # this example's reach (recorded in the campaign's stats at the end)
        self.reach: Counter[str] = Counter()
        # a big example: the bulk rules grow thousands of pages (most examples stay small)
        self.big = False

    @initialize(
        target=seqs,
        page_size=page_sizes,
        # pool targets: small pools evict often; big ones let trees, keys and namespaces grow
        num_pages=st.one_of(st.integers(2, 48), st.integers(2, 48), st.integers(49, 2048)),
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
        big=st.sampled_from([False] * 19 + [True]),
    )
    def setup(
        self, page_size: int, first: list[tuple[list[int], list[int]]], num_pages: int = 48, big: bool = False
    ) -> MultipleResults[tuple[int, ...]]:
        for info in self.TARGETS:
            if info.page_sizes is not None:
                page_size = info.page_sizes[page_size % len(info.page_sizes)]
        self.page_size, self.big = page_size, big and not self.SHALLOW
        self.model = pc.new_state(page_size)
        for info in self.TARGETS:
            assert info.cache_factory is not None, f"target {info.name} has no prefix cache"
            target = info.cache_factory(page_size, num_pages)
            self.runs.append(Driven(info.name, target, CacheCapabilities.of(target)))
        profiles = [run.profile for run in self.runs]
        if len(self.runs) == 1 and (not profiles[0].follows_spec or self.LRU == "sync"):
            self.follow = self.runs[0]
            if self.LRU == "strict" and profiles[0].lru_model is not None:
                self.lru_model = profiles[0].lru_model(num_pages, page_size)
        self.bounded = any(p.slot_domain == "pool" or p.slots == "target" for p in profiles)
        if self.bounded:
            self.num_pages = num_pages
            self.free = deque(range(0, num_pages * page_size, page_size))
        for run in self.runs:
            if run.caps.events is not None:
                # ours use the spec's hashes (checked); an engine's own hashes name its pages (not recomputed)
                count_repeats = not run.exact and not self.event_namespaces(run)
                run.replayer = ev.Replayer(page_size, check_hashes=run.exact, count_repeats=count_repeats)
        return multiple(*[tuple(build_sequence(page_size, pages, tail)) for pages, tail in first])

    def event_namespaces(self, run: Driven) -> bool:
        """Whether the replay tells namespaces apart: the profile says so, or strict mode asks for it."""
        return run.profile.event_namespaces or self.LRU == "strict"

    def every(self, promise: Callable[[Profile], bool]) -> bool:
        """True when every target's profile makes ``promise`` (and the machine is set up)."""
        return bool(self.runs) and all(promise(run.profile) for run in self.runs)

    def ns(self, namespace: Namespace) -> Namespace:
        """The namespace a call uses: as drawn, or None when a target has no namespaces."""
        return namespace if self.every(lambda p: p.namespaces) else None
