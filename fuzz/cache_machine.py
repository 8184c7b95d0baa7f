"""The cache machine: the spec beside any set of prefix-cache targets, each checked as its profile promises.

The machine keeps the spec's state as its model and a ledger of slots (the
pages it owns, the pages the caches hold). Every call goes to the model and
to every target (``radixspec.fuzz.targets.api``: ours, SGLang's, vLLM's, a user's);
what comes back is checked against the model:

* a match returns exactly the cached length and the slots inserted for that
  prefix, never a page of another namespace;
* an insert reports the pages already cached; new pages take the offered
  slots (or, for targets that allocate, fresh aligned pages);
* a call the spec rejects is rejected with the spec's error class (and, for
  targets with the differential capability, its message) and changes
  nothing; targets without validation are not sent it (counted as skipped);
* every slot a target gives back was cached, unlocked, and is given back
  once, deepest page first; eviction takes as many pages as the profile
  says. LRU, **strict**: the pages the spec (or the profile's LRU model)
  would take; **sync**: the model follows the target's choice once it is
  shown to be allowed, oldest first by the target's own clock;
* after every step: sizes equal the cached pages; then, every step for small
  trees and every CHECK_EVERY steps for big ones (and at the end): the
  spec's invariants, each target's integrity check, its content and stamps
  (the whole abstract state for targets with the differential capability),
  its KV events replayed, its metrics, the slot ledger.

Several targets run side by side when every profile follows the spec (exact
pages, the caller's slots, the spec's LRU): the model then needs no choice of
any target. A target that makes its own choices (whole nodes, its own pages,
its own LRU) runs alone, and the model follows it.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import SLOT_LIMIT, Namespace
from radixspec.spec.errors import (
    CacheError,
    IntegrityError,
    InvalidTypeError,
    NamespaceDepthError,
    StaleHandleError,
    UnlockError,
)
from radixspec.spec.helpers import compute_page_starts, compute_page_to_token, div_ceil
from radixspec.spec.invariants import check_invariants

from .differential import describe_difference
from .messages import brief, list_diff
from .sequences import (
    NUM_PATTERNS,
    bad_namespaces,
    build_sequence,
    distinct_page,
    namespaces,
    page_choices,
    page_pattern,
    page_sizes,
    tail_choices,
)
from .stats import STATS
from .targets.api import ExactCache, PageKey, PrefixCacheTarget, Profile, TargetInfo
from .targets.ours import IMPLEMENTATIONS

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
# break_the_tree: each field of the C tree it changes, with a change that breaks an invariant whatever the node
# (a length by that many pages; a slot modulo 2**32, so 2**31 makes it negative; a queue stamp past any clock)
BROKEN_FIELDS = (
    ("ref_count", 1),
    ("length", 1),
    ("length", -1),
    ("parent", 1),
    ("child_count", 1),
    ("child_refs", -1),
    ("queue_stamp", 2**40),
    ("slot", 2**31),
    ("evictable", 1),
    ("protected", 1),
    ("nodes", -1),
    ("pages", 1),
    ("roots", 1),
    ("children", 1),
    ("starts", -1),
    ("segment_bytes", 1),
    ("segment_refs", 1),
)
# the invariants csrc/tree.c's radix_tree_check names
TREE_INVARIANTS = (
    "tree_is_well_formed",
    "children_find_every_node",
    "page_slots_are_aligned",
    "cached_starts_match_tree",
    "evictable_leaves_are_queued",
    "ref_counts_cover_children",
    "size_counters_match_tree",
    "tables_match_tree",
    "segments_are_counted",
)
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
    """One target the machine drives beside the spec."""

    name: str
    target: PrefixCacheTarget[Any]
    # the differential capability (ExactCache): state, messages and events compared exactly
    exact: bool
    # its KV events replayed as a router would (targets that emit them)
    replayer: ev.Replayer | None = None

    @property
    def profile(self) -> Profile:
        return self.target.profile


class HandleSet:
    """The spec's handle and each target's, from the same call, and how many resets came before."""

    def __init__(self, spec: pc.Handle, handles: list[Any], epoch: int) -> None:
        self.spec = spec
        self.handles = handles
        self.epoch = epoch

    def __repr__(self) -> str:
        return f"HandleSet(cached_len={self.spec.cached_len})"


class CacheMachine(RuleBasedStateMachine):
    """The spec and targets driven by match / insert / lock / unlock / evict / reset, checked as profiled."""

    # what the machine drives (radixspec.fuzz.machines.machine_for sets these): --impl and --target name them alike
    TARGETS: ClassVar[tuple[TargetInfo, ...]] = tuple(IMPLEMENTATIONS.values())
    LRU: ClassVar[str] = "strict"
    # a shallow batch (radixspec.fuzz.machines.machine_for): no big example, long keys cut to SHALLOW_KEY_PAGES pages
    SHALLOW: ClassVar[bool] = False

    seqs = Bundle("seqs")
    handles = Bundle("handles")

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
        self.lru_model: Any = None
        # resets so far
        self.epoch = 0
        # steps since the last whole comparison
        self.unchecked = 0
        # this example's reach (recorded in the campaign's stats at the end)
        self.reach: Counter[str] = Counter()
        # a big example: the bulk rules grow thousands of pages (most examples stay small)
        self.big = False

    # ------------------------------------------------------------ setup

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
    ) -> Any:
        for info in self.TARGETS:
            if info.page_sizes is not None:
                page_size = info.page_sizes[page_size % len(info.page_sizes)]
        self.page_size, self.big = page_size, big and not self.SHALLOW
        self.model = pc.new_state(page_size)
        for info in self.TARGETS:
            assert info.cache_factory is not None, f"target {info.name} has no prefix cache"
            target = info.cache_factory(page_size, num_pages)
            exact = isinstance(target, ExactCache)
            self.runs.append(Driven(info.name, target, exact))
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
            if callable(getattr(run.target, "take_events", None)):
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

    # ------------------------------------------------------------ sequences

    @rule(target=seqs, base=seqs, keep=st.booleans(), pages=page_choices, tail=tail_choices)
    def new_seq(self, base: tuple[int, ...], keep: bool, pages: list[int], tail: list[int]) -> tuple[int, ...]:
        """A sequence of drawn pages, after the whole pages of ``base`` when ``keep``."""
        STATS.record_rule("cache.new_seq")
        return tuple(build_sequence(self.page_size, pages, tail, base if keep else ()))

    @rule(target=seqs, base=seqs, cut=st.integers(0, 255))
    def prefix_of(self, base: tuple[int, ...], cut: int) -> tuple[int, ...]:
        """A prefix of ``base``, often ending inside a page."""
        STATS.record_rule("cache.prefix_of")
        return base[: cut % (len(base) + 1)]

    @rule(target=seqs, base=seqs, tokens=st.sampled_from([256, 1024, 4096, 8192]), salt=st.integers(0, 7))
    def long_seq(self, base: tuple[int, ...], tokens: int, salt: int) -> tuple[int, ...]:
        """A key thousands of tokens long (past the C compare's 1 KiB blocks), after ``base``'s whole pages.

        Small examples keep it to LONG_KEY_PAGES pages (long keys need big pages there), shallow ones to
        SHALLOW_KEY_PAGES; big ones do not.
        """
        STATS.record_rule("cache.long_seq")
        p = self.page_size
        cap = None if self.big else SHALLOW_KEY_PAGES if self.SHALLOW else LONG_KEY_PAGES
        count = max(1, tokens // p if cap is None else min(tokens // p, cap))
        pages = [page_pattern((salt + i * (i % 3)) % NUM_PATTERNS, p) for i in range(count)]
        return tuple(build_sequence(p, [], [], base) + [token for page in pages for token in page])

    # ------------------------------------------------------------ bulk: big, deep, wide trees

    def room(self) -> int:
        """Pages the bulk rules may still add to this example's tree."""
        return max(0, BIG_TREE_PAGES - len(self.model.entries))

    def grows(self) -> bool:
        """True in a big example (drawn at setup) whose tree is not too big yet: the deep rules may run."""
        return bool(self.runs) and self.big and len(self.model.entries) < BIG_TREE_PAGES

    def bulks(self) -> bool:
        """Bulk inserts: in a big example (its tree may still grow), for a target the model follows (wide nodes
        make its eviction units), or in a small example of a deep batch while its tree is below SMALL_BULK_PAGES
        (dozens of leaves: the C tree's children table grows, its eviction queues churn); shallow batches
        spend their steps on the single operations."""
        return (
            self.grows()
            or (self.follow is not None and len(self.model.entries) < BIG_TREE_PAGES)
            or (bool(self.runs) and not self.SHALLOW and len(self.model.entries) < SMALL_BULK_PAGES)
        )

    @precondition(bulks)
    @rule(base=seqs, width=st.integers(0, 3), depth=st.integers(1, 3), namespace=namespaces)
    def bulk_insert(self, base: tuple[int, ...], width: int, depth: int, namespace: Namespace) -> None:
        """Many branches off ``base``'s whole pages at once (a shared system prompt): wide nodes, many leaves;
        in a big example, thousands of pages in one step."""
        STATS.record_rule("cache.bulk_insert")
        p, ns = self.page_size, self.ns(namespace)
        stem = build_sequence(p, [], [], base)
        for branch in range(BRANCHES[self.big][width]):
            if not self.room():
                break
            pages = [token for level in range(depth) for token in distinct_page(branch * 3 + level, p)]
            self.insert_valid(tuple(stem + pages), ns, bulk=True)

    @precondition(grows)
    @rule(base=seqs, depth=st.sampled_from([16, 16, 16, 128, 128, 600, 1414]), namespace=namespaces)
    def deep_chain(self, base: tuple[int, ...], depth: int, namespace: Namespace) -> None:
        """``base`` extended one page per insert: a path ``depth`` nodes deep (its cost grows as depth**2 * P, kept
        to 2M page tokens: 1,414 levels at P=1, a thousand at P=2)."""
        STATS.record_rule("cache.deep_chain")
        p, ns = self.page_size, self.ns(namespace)
        depth = min(depth, int((2_000_000 / p) ** 0.5))
        tokens = build_sequence(p, [], [], base)
        handles = None
        for level in range(depth):
            if not self.room():
                break
            tokens += distinct_page(level % 5 + 1000, p)
            handles = self.insert_valid(tuple(tokens), ns, bulk=True) or handles
        if handles is not None:
            self.note_depth(handles)

    @precondition(lambda self: self.grows() and self.every(lambda p: p.namespaces))
    @rule(seq=seqs, count=st.sampled_from([4, 32, 200]), salt=st.integers(0, 1 << 16))
    def many_namespaces(self, seq: tuple[int, ...], count: int, salt: int) -> None:
        """The same sequence in many namespaces: lines that share tokens but never pages."""
        STATS.record_rule("cache.many_namespaces")
        for index in range(count):
            if self.room() < len(seq) // self.page_size:
                break
            self.insert_valid(seq, ("tenant", salt, index), bulk=True)

    def note_depth(self, handles: HandleSet) -> None:
        """The depth in nodes of a handle's path, from each target that can tell: a path of k pages has between
        1 and k nodes (none when it is empty), since a node holds at least a page and every page is in one."""
        pages = handles.spec.cached_len // self.page_size
        for run, handle in zip(self.runs, handles.handles, strict=True):
            path_nodes = getattr(run.target, "path_nodes", None)
            if path_nodes is None:
                continue
            depth = path_nodes(handle)
            assert min(pages, 1) <= depth <= pages, (
                f"{run.name}: path_nodes is {depth} for a path of {pages} pages (1 to {pages} nodes expected)"
            )
            self.reach["deepest_path_nodes"] = max(self.reach["deepest_path_nodes"], depth)

    # ------------------------------------------------------------ operations

    @rule(target=handles, seq=seqs, namespace=namespaces)
    def match_prefix(self, seq: tuple[int, ...], namespace: Namespace) -> Any:
        """A match returns the longest cached prefix and exactly the slots inserted for it."""
        STATS.record_rule("cache.match_prefix")
        ns, tokens = self.ns(namespace), list(seq)
        self.reach["longest_key_tokens"] = max(self.reach["longest_key_tokens"], len(tokens))
        expected = pc.match_prefix(self.model, tokens, ns)
        handles = []
        for run in self.runs:
            handles.append(run.target.match_prefix(tokens, ns))
            self.expect_no_frees(run, "match_prefix")
            self.check_handle(run, "match_prefix", handles[-1], expected)
        if self.lru_model is not None:
            self.lru_model.match(self.page_starts(expected))
        matched = HandleSet(expected, handles, self.epoch)
        self.note_depth(matched)
        return matched

    @precondition(lambda self: bool(self.model.entries))
    @rule(target=handles, which=st.integers(0, 1 << 16), extra=tail_choices)
    def match_cached(self, which: int, extra: list[int]) -> Any:
        """A hit: the path of a page the cache holds (the ``which``-th, in caching order), maybe with tokens
        after it: what an engine mostly matches.

        Drawn from the model's pages, so that hits, and the recency order they make (an old page used again
        while newer ones are not), are as common in small examples as in an engine."""
        STATS.record_rule("cache.match_cached")
        pages = list(self.model.entries)
        namespace, prefix = pages[which % len(pages)]
        return self.match_prefix(prefix.tokens + tuple(extra), namespace)

    @precondition(lambda self: len(self.model.entries) >= 2)
    @rule(order=st.permutations(range(TOUCHED_LEAVES)), evict_pages=st.sampled_from([0, 1, 4, DRAIN_PAGES]))
    def touch_parents_out_of_order(self, order: list[int], evict_pages: int = 0) -> None:
        """Match the parent page's path of each evictable leaf (up to TOUCHED_LEAVES, in caching order) in the
        drawn order, then evict up to ``evict_pages`` pages one at a time.

        The leaves keep their older stamps and go first; each exposes its parent, an evictable leaf now whose
        stamp is out of order with the ones queued: the C tree's eviction heap (not its in-order ring) then
        orders the parents. Each one-page eviction shows which leaf went (a larger one's slots come back
        sorted, so only its set is seen)."""
        STATS.record_rule("cache.touch_parents_out_of_order")
        leaves = pc.get_evictable_leaves(self.model)[:TOUCHED_LEAVES]
        for index in order:
            if index < len(leaves):
                namespace, prefix = leaves[index]
                self.match_prefix(prefix.tokens[: len(prefix.tokens) - self.page_size], namespace)
        self.evict_one_by_one(evict_pages)

    def evict_one_by_one(self, pages: int) -> None:
        """Evict up to ``pages`` pages, one per call (where the profile evicts on request)."""
        for _ in range(pages):
            if not self.every(lambda p: p.eviction_trigger == "evict") or not pc.size_info(self.model).evictable_size:
                return
            self.checked_evict(1)

    @precondition(lambda self: bool(self.model.entries) and not self.SHALLOW)
    @rule(
        rounds=st.sampled_from([2, 12, OUTGROW]),
        order=st.permutations(range(TOUCHED_LEAVES)),
        evict_pages=st.sampled_from([0, 1, 4]),
    )
    def rematch_leaves(self, rounds: int, order: list[int], evict_pages: int = 0) -> None:
        """Match every evictable leaf (up to TOUCHED_LEAVES, in the drawn order) ``rounds`` times over, then
        evict a few pages one at a time: each match queues the leaf again at its new stamp, so the C tree's
        queues fill with stale entries until it compacts them (its queue rebuild), as an engine's hot prompts do.

        ``OUTGROW``: as many rounds as it takes for the touches alone to outnumber twice the tree's nodes plus
        64 (a node holds at least a page), so that a queue holding every touch must be compacted; the order then
        is the leaves' new stamp order, unlike their creation order."""
        STATS.record_rule("cache.rematch_leaves")
        leaves = pc.get_evictable_leaves(self.model)[:TOUCHED_LEAVES]
        leaves = [leaves[index] for index in order if index < len(leaves)]
        if not leaves:
            return
        if rounds == OUTGROW:
            # past OUTGROW_MATCHES the touches could not outgrow the tree: two rounds then, as the others
            nodes = len(self.model.entries) + len({namespace for namespace, _ in self.model.entries}) + 1
            touches = 2 * nodes + 65
            rounds = touches // len(leaves) + 1 if touches <= OUTGROW_MATCHES else 2
        # no more than REMATCH_TOKENS tokens matched (two rounds whatever the keys)
        rounds = max(2, min(rounds, REMATCH_TOKENS // sum(len(prefix) for _, prefix in leaves)))
        for _ in range(rounds):
            for namespace, prefix in leaves:
                self.match_prefix(prefix.tokens, namespace)
        self.evict_one_by_one(evict_pages)

    @rule(target=handles, seq=seqs, namespace=namespaces, where=st.sampled_from(SLOT_RANGES))
    def insert_prefix(self, seq: tuple[int, ...], namespace: Namespace, where: str = "low") -> Any:
        """An insert keeps cached pages, takes new slots for the rest, and reports what was cached."""
        STATS.record_rule("cache.insert_prefix")
        handles = self.insert_valid(seq, self.ns(namespace), high=where == "high")
        if handles is None:
            return multiple()
        self.note_depth(handles)
        return handles

    def insert_valid(
        self, seq: tuple[int, ...], ns: Namespace, high: bool = False, bulk: bool = False
    ) -> HandleSet | None:
        """An insert with valid slots (it cannot be rejected); None when the pool has no room.

        ``bulk``: the targets with the differential capability are not asked for their slots (their next
        whole comparison sees them), so that bulk rules stay O(new pages).
        """
        p, tokens = self.page_size, list(seq)
        keys = pc.get_page_keys(self.model, ns, tokens)
        cached = self.cached_pages_of(keys)
        self.reach["longest_key_tokens"] = max(self.reach["longest_key_tokens"], len(tokens))
        if self.follow is not None and self.follow.profile.slots == "target":
            return self.insert_target_slots(tokens, keys, cached, ns)
        # a pool target gets fresh pages for every whole page (an engine's way: the duplicates freed after);
        # else fresh pages for the new ones only, and slots the cache must ignore for the rest
        fresh = len(keys) if self.bounded else len(keys) - cached
        if self.bounded and fresh > len(self.free):
            self.make_room(fresh - len(self.free))
            cached = self.cached_pages_of(keys)
            if fresh > len(self.free):
                STATS.skipped["insert: pool full of locked pages"] += 1
                return None
        offered = self.take_pages(fresh, high and not self.bounded)
        ignored = [] if self.bounded else [FILLER] * (cached * p)
        indices = ignored + compute_page_to_token(offered, p) + [FILLER] * (len(tokens) % p)
        handles = []
        for run in self.runs:
            cached_len, handle = run.target.insert_prefix(tokens, indices, ns)
            self.expect_no_frees(run, "insert_prefix")
            assert cached_len == cached * p, (
                f"insert_prefix: {run.name} reported {cached_len} tokens already cached, the spec {cached * p}"
            )
            handles.append(handle)
        if self.bounded:
            # the caller frees its own copies of the pages the cache had
            self.free.extend(offered[:cached])
        expected = pc.insert_prefix(self.model, tokens, indices, ns).handle
        for run, handle in zip(self.runs, handles, strict=True):
            if not (bulk and run.exact):
                self.check_handle(run, "insert_prefix", handle, expected)
        return HandleSet(expected, handles, self.epoch)

    def insert_target_slots(
        self, tokens: list[int], keys: list[PageKey], cached: int, ns: Namespace
    ) -> HandleSet | None:
        """Insert into a target that allocates its own pages (and may evict for them): it runs alone."""
        assert self.follow is not None
        run, target = self.follow, self.follow.target
        # pages the allocation can draw from: all but the locked ones and the hits it pins
        pinned = {key for key, entry in self.model.entries.items() if entry.ref_count} | set(keys[:cached])
        if len(keys) - cached > self.num_pages - len(pinned):
            STATS.skipped["insert: pool full of locked pages"] += 1
            return None
        stamps_before = self.stamps_if_sync()
        hit_starts = [self.model.entries[key].slot_start for key in keys[:cached]]
        prediction = self.lru_model.insert(hit_starts, len(keys) - cached) if self.lru_model else None
        cached_len, handle = target.insert_prefix(tokens, None, ns)
        assert cached_len == cached * self.page_size, (
            f"insert_prefix reported {cached_len} tokens already cached, the spec {cached * self.page_size}"
        )
        groups = target.take_evicted()
        # the hits are in use while the pages are allocated: not candidates
        self.apply_evictions("insert_prefix (allocation)", groups, None, stamps_before, pinned=set(keys[:cached]))
        slots = target.matched_slots(handle)
        new_starts = compute_page_starts(slots[cached * self.page_size :], self.page_size)
        held = {entry.slot_start for entry in self.model.entries.values()}
        for start in new_starts:
            assert start not in held, f"insert_prefix allocated page {start}, which is still cached"
        if prediction is not None:
            predicted_new, predicted_evicted = prediction
            evicted = [start for group in groups for start in compute_page_starts(group, self.page_size)]
            assert new_starts == predicted_new, (
                f"allocation took other pages than the profile's LRU model predicts (taken, predicted):"
                f" {list_diff(new_starts, predicted_new)}"
            )
            assert evicted == predicted_evicted, (
                f"allocation evicted other pages than the profile's LRU model predicts (evicted, predicted):"
                f" {list_diff(evicted, predicted_evicted)}"
            )
        indices = slots + [FILLER] * (len(tokens) - len(slots))
        expected = pc.insert_prefix(self.model, tokens, indices, ns).handle
        self.check_handle(run, "insert_prefix", handle, expected)
        return HandleSet(expected, [handle], self.epoch)

    @rule(handle=handles)
    def lock(self, handle: HandleSet) -> None:
        """Lock a handle's path; a stale handle is rejected."""
        STATS.record_rule("cache.lock")
        error = self.spec_try(lambda: pc.lock(self.model, handle.spec))
        if self.each(handle, "lock", error, StaleHandleError, lambda run, h: run.target.lock(h)):
            self.locks.update(pc.get_handle_keys(self.model, handle.spec))
            if self.lru_model is not None:
                self.lru_model.lock(self.page_starts(handle.spec))

    @rule(handle=handles)
    def unlock(self, handle: HandleSet) -> None:
        """Release one lock of a handle's path; without its lock (or stale) it is rejected."""
        STATS.record_rule("cache.unlock")
        error = self.spec_try(lambda: pc.unlock(self.model, handle.spec))
        if self.each(handle, "unlock", error, None, lambda run, h: run.target.unlock(h)):
            self.locks.subtract(pc.get_handle_keys(self.model, handle.spec))
            if self.lru_model is not None:
                self.lru_model.unlock(self.page_starts(handle.spec))

    # targets with the differential capability: another target's handle may not outlive a later split
    @precondition(lambda self: bool(self.runs) and all(run.exact for run in self.runs))
    @rule(handle=handles)
    def get_matched_indices(self, handle: HandleSet) -> None:
        """The slots of a live handle's path; a stale handle is rejected."""
        STATS.record_rule("cache.get_matched_indices")
        want: list[int] = []

        def spec() -> None:
            want.extend(pc.get_matched_indices(self.model, handle.spec))

        error = self.spec_try(spec)

        def call(run: Driven, h: Any) -> None:
            slots = run.target.matched_slots(h)
            assert slots == want, f"get_matched_indices of {run.name} (got, held): {list_diff(slots, want)}"

        self.each(handle, "get_matched_indices", error, StaleHandleError, call)

    def each(
        self,
        handle: HandleSet,
        label: str,
        error: CacheError | None,
        after_reset: type[CacheError] | None,
        call: Callable[[Driven, Any], None],
    ) -> bool:
        """``call`` with each target's handle: rejected where the spec rejected (``error``), and for a handle
        from before a reset on targets whose handles do not survive one (``after_reset``, or UnlockError)."""
        for index, run in enumerate(self.runs):
            h = handle.handles[index]

            def bound(r: Driven, h: Any = h) -> None:
                call(r, h)

            if handle.epoch != self.epoch and not run.profile.handles_survive_reset and error is None:
                expected = (after_reset or UnlockError)(f"{label} of a handle from before reset")
                self.rejected(f"{label} of a handle from before reset", bound, expected, [run])
            elif error is not None:
                self.rejected(label, bound, error, [run])
            else:
                call(run, h)
                self.expect_no_frees(run, label)
        return error is None

    @precondition(lambda self: self.every(lambda p: p.eviction_trigger == "evict"))
    @rule(size=st.sampled_from(EVICT_SIZES), fraction=st.integers(0, 100))
    def evict(self, size: str, fraction: int) -> None:
        """Evict some, all, one, none, too many or a negative number of tokens."""
        STATS.record_rule(f"cache.evict[{size}]")
        evictable = pc.size_info(self.model).evictable_size
        amount = {
            "some": evictable * fraction // 100,
            "all": evictable,
            "one": min(1, evictable),
            "zero": 0,
            "over": evictable + 1 + fraction,
            "negative": -1 - fraction,
        }[size]
        if amount < 0 or amount > evictable:
            plan = pc.PrefixCacheState(self.page_size, dict(self.model.entries), self.model.clock)
            error = self.spec_try(lambda: pc.evict(plan, amount))
            assert error is not None, f"the spec accepted evict({amount}) of {evictable} evictable tokens"
            self.rejected(f"evict({amount})", lambda run: run.target.evict(amount), error)  # type: ignore[attr-defined]
            return
        if size == "all":
            self.reach["most_evictable_leaves"] = max(
                self.reach["most_evictable_leaves"], len(pc.get_evictable_leaves(self.model))
            )
        self.checked_evict(amount)

    @precondition(lambda self: self.every(lambda p: p.reset != "none") and len(self.model.entries) >= RESET_AT_PAGES)
    @rule()
    def reset(self) -> None:
        """Empty the cache: refused while anything is locked."""
        STATS.record_rule("cache.reset")
        if pc.size_info(self.model).protected_size:
            plan = pc.PrefixCacheState(self.page_size, dict(self.model.entries), self.model.clock)
            error = self.spec_try(lambda: pc.reset(plan))
            assert error is not None, "the spec reset a cache with locked pages"
            self.rejected("reset", lambda run: run.target.reset(), error)  # type: ignore[attr-defined]
            return
        held = sorted(compute_page_to_token(self.model_starts(), self.page_size))
        for run in self.runs:
            returned = run.target.reset()  # type: ignore[attr-defined]
            self.expect_no_frees(run, "reset")
            if run.profile.reset == "returns":
                got = list(returned) if run.exact else sorted(returned)
                assert got == held, (
                    f"reset: {run.name} returned other slots than the cache held: {list_diff(got, held)}"
                )
        assert not +self.locks, f"reset succeeded while the machine counts locks {dict(+self.locks)}"
        self.free.extend(sorted(self.model_starts()))
        pc.reset(self.model)
        self.epoch += 1
        if self.lru_model is not None:
            self.lru_model.reset()

    # ------------------------------------------------------------ the integrity check, checked

    @precondition(
        lambda self: bool(self.model.entries) and any(hasattr(run.target, "break_invariant") for run in self.runs)
    )
    @rule(broken=st.sampled_from(BROKEN_FIELDS), which=st.integers(0, 63), position=st.integers(0, 3))
    def break_the_tree(self, broken: tuple[str, int], which: int, position: int) -> None:
        """The C tree's own integrity check is checked: one field of a node (a root's included) or one counter
        changed must fail ``check_integrity`` with the name of an invariant of the tree; put back, the check
        passes again (the field is the only thing changed)."""
        field, delta = broken
        STATS.record_rule(f"cache.break_the_tree[{field}]")
        delta *= self.page_size if field == "length" else 1
        for run in self.runs:
            target: Any = run.target
            if not hasattr(target, "break_invariant"):
                continue
            done = target.break_invariant(field, which, position, delta)
            if done is None:
                continue
            assert done, f"{run.name}: break_invariant refused {field} of a live node ({which}, {position})"
            try:
                target.check_integrity()
                caught = None
            except IntegrityError as error:
                caught = str(error)
            finally:
                target.break_invariant(field, which, position, -delta)
            assert caught is not None, (
                f"{run.name}: check_integrity passed with {field} of node {which} changed by {delta}"
            )
            assert caught.split(":")[0] in TREE_INVARIANTS, f"{run.name}: {caught!r} names no invariant of the tree"
            target.check_integrity()

    # ------------------------------------------------------------ bad input

    @rule(seq=seqs, namespace=namespaces, slots=st.sampled_from(BAD_SLOTS), which=st.integers(0, 15))
    def insert_bad_slots(self, seq: tuple[int, ...], namespace: Namespace, slots: str, which: int) -> None:
        """Bad slots for the new pages: rejected with the spec's error, nothing changed."""
        STATS.record_rule(f"cache.insert_bad_slots[{slots}]")
        p, ns, tokens = self.page_size, self.ns(namespace), list(seq)
        keys = pc.get_page_keys(self.model, ns, tokens)
        cached = self.cached_pages_of(keys)
        new = len(keys) - cached
        lengths = slots in ("short", "long")
        if (new == 0 and not lengths) or (self.follow is not None and self.follow.profile.slots == "target"):
            return
        starts = [self.model.entries[key].slot_start for key in keys[:cached]]
        fresh = list(itertools.islice(self.peek_pages(), new))
        if len(fresh) < new:
            return
        pages = [[s + k for k in range(p)] for s in starts + fresh]
        pick = cached + which % new if new else 0
        if slots == "misaligned":
            pages[pick] = [s + 1 for s in pages[pick]] if p > 1 else [SLOT_LIMIT if which % 2 else -1]
        elif slots == "scrambled" and p > 1:
            pages[pick] = pages[pick][::-1]
        elif slots == "interior" and p > 1:
            # the slot at offset k of the page taken from the next page: every check of the start passes
            k = 1 + which % (p - 1)
            pages[pick][k] += p
        elif slots == "cached" and self.model.entries:
            taken = sorted(self.model_starts())
            pages[pick] = [taken[which % len(taken)] + k for k in range(p)]
        elif slots == "twice" and new >= 2:
            pages[cached + (pick - cached + 1) % new] = pages[pick]
        elif slots == "past_limit":
            pages[pick] = [(SLOT_LIMIT + p - 1) // p * p + which * p + k for k in range(p)]
        indices = [s for page in pages for s in page] + [FILLER] * (len(tokens) % p)
        if slots == "short":
            if not indices:
                return
            indices.pop()
        elif slots == "long":
            indices += [FILLER] * (1 + which % 3)
        plan = pc.PrefixCacheState(p, dict(self.model.entries), self.model.clock)
        error = self.spec_try(lambda: pc.insert_prefix(plan, tokens, indices, ns))
        if error is not None:
            self.rejected(
                f"insert with {slots} slots", lambda run: run.target.insert_prefix(tokens, indices, ns), error
            )

    @precondition(lambda self: self.every(lambda p: p.namespaces))
    @rule(seq=seqs, namespace=bad_namespaces, insert=st.booleans())
    def bad_namespace(self, seq: tuple[int, ...], namespace: Any, insert: bool) -> None:
        """A namespace outside the domain (an alias of a valid one, a float, a subclass, one tuple too deep):
        InvalidTypeError or NamespaceDepthError."""
        STATS.record_rule(f"cache.bad_namespace[{'insert' if insert else 'match'}]")
        tokens = list(seq)
        indices = list(itertools.islice((s + k for s in self.peek_pages() for k in range(self.page_size)), len(tokens)))
        if len(indices) < len(tokens):
            return
        plan = pc.PrefixCacheState(self.page_size, dict(self.model.entries), self.model.clock)

        def call(run: Driven) -> object:
            if insert:
                return run.target.insert_prefix(tokens, indices, namespace)
            return run.target.match_prefix(tokens, namespace)

        if insert:
            error = self.spec_try(lambda: pc.insert_prefix(plan, tokens, indices, namespace))
        else:
            error = self.spec_try(lambda: pc.match_prefix(plan, tokens, namespace))
        assert isinstance(error, (InvalidTypeError, NamespaceDepthError)), f"the spec took {namespace!r}: {error!r}"
        self.rejected(f"{'insert' if insert else 'match'}, bad namespace", call, error)

    # ------------------------------------------------------------ checks

    @invariant()
    def targets_agree(self) -> None:
        """Sizes every step; the whole comparison every step while the tree is small."""
        if not self.runs:
            return
        expected = tuple(pc.size_info(self.model))
        for run in self.runs:
            actual = tuple(run.target.size_info())
            assert actual == expected, (
                f"size_info: {run.name} {actual}, the cached pages give {expected} (P={self.page_size})"
            )
        self.replay_events()
        self.unchecked += 1
        if len(self.model.entries) > FULL_CHECK_PAGES and self.unchecked < CHECK_EVERY:
            return
        self.compare_states()

    def replay_events(self) -> None:
        """Each target's KV events so far, applied to its replayer (a router's mirror)."""
        for run in self.runs:
            if run.replayer is None:
                continue
            events = run.target.take_events()  # type: ignore[attr-defined]
            if not self.event_namespaces(run):
                # a router that cannot tell namespaces apart sees token prefixes only
                events = [replace(e, namespace=None) if isinstance(e, ev.PageStored) else e for e in events]
            before = run.replayer.applied
            run.replayer.apply(events)
            STATS.events_replayed += run.replayer.applied - before

    def compare_states(self) -> None:
        """The whole comparison: the spec's invariants, each target's integrity, content, stamps, events,
        metrics (abstract states for targets with the differential capability), and the slot ledger."""
        self.unchecked = 0
        # the events of the last step too (teardown compares without an invariant run after that step)
        self.replay_events()
        check_invariants(self.model, locks=self.locks)
        STATS.record_tree(len(self.model.entries))
        self.reach["most_namespaces"] = max(self.reach["most_namespaces"], len({ns for ns, _ in self.model.entries}))
        content = {key: entry.slot_start for key, entry in self.model.entries.items()}
        for run in self.runs:
            target: Any = run.target
            if hasattr(target, "check_integrity"):
                target.check_integrity()
            if run.exact:
                actual = target.abstract_state()
                assert actual == self.model, (
                    f"abstract state of {run.name} differs from spec:\n{describe_difference(self.model, actual)}"
                )
            else:
                self.compare_content(run, content)
            if run.replayer is not None:
                # the replay invariant: the events so far describe exactly the cached pages
                cached = content
                if not self.event_namespaces(run):
                    cached = {(None, prefix): slot for (_, prefix), slot in content.items()}
                ev.events_match_cache(run.replayer.cached(), cached)
        self.compare_metrics()
        # the slot ledger: for targets compared page by page only (an exact target's slots equal the spec's)
        if any(not run.exact for run in self.runs) and not (self.follow and self.follow.profile.slots == "target"):
            owned, held = set(self.free), set(content.values())
            assert not owned & held and len(owned) + len(held) == self.num_pages, (
                f"slot ledger: {len(owned)} free + {len(held)} cached != {self.num_pages} pages"
                f" (shared: {sorted(owned & held)[:8]})"
            )

    def compare_content(self, run: Driven, content: dict[PageKey, int]) -> None:
        """A target without the differential capability: the pages and stamps it exposes, if it does."""
        target: Any = run.target
        if hasattr(target, "cached_pages"):
            actual = target.cached_pages()
            if actual != content:
                extra = sorted(set(actual.items()) - set(content.items()), key=repr)[:4]
                missing = sorted(set(content.items()) - set(actual.items()), key=repr)[:4]
                raise AssertionError(
                    f"cached pages of {run.name} differ from the model: it has {extra}, lacks {missing}"
                )
        if run.profile.clock == "logical" and hasattr(target, "page_stamps"):
            stamps = {key: entry.last_access for key, entry in self.model.entries.items()}
            assert target.page_stamps() == stamps, f"page stamps of {run.name} differ from the spec's logical clock"

    def compare_metrics(self) -> None:
        """Targets that count metrics count the same, and each namespace's pages are conserved:
        stored = cached now + evicted + dropped by reset."""
        counted = [(run.name, run.target.stats()) for run in self.runs if hasattr(run.target, "stats")]
        if not counted:
            return
        cached: Counter[Namespace] = Counter(namespace for namespace, _ in self.model.entries)
        for name, stats in counted:
            for namespace, counts in stats.namespaces.items():
                assert counts.pages_stored == cached[namespace] + counts.pages_evicted + counts.pages_dropped, (
                    f"metrics of {name}, namespace {namespace!r}: {counts.pages_stored} pages stored,"
                    f" {cached[namespace]} cached, {counts.pages_evicted} evicted, {counts.pages_dropped} dropped"
                )
            retired = stats.retired
            assert retired.pages_stored == retired.pages_evicted + retired.pages_dropped, (
                f"metrics of {name}, retired namespaces: {retired.pages_stored} pages stored,"
                f" {retired.pages_evicted} evicted, {retired.pages_dropped} dropped"
            )
        first_name, first = counted[0]
        for name, stats in counted[1:]:
            assert stats == first, f"metrics: {first_name} {first.as_dict()}, {name} {stats.as_dict()}"
        assert first.eviction_age_sum >= 0, f"negative eviction age sum {first.eviction_age_sum}"

    def teardown(self) -> None:
        """A last whole comparison (sampling skipped some; a replayed program may end without an invariant run),
        then the example's reach to the stats.

        No ``hypothesis.target()``: measured (issue 23), steering small examples by their reach bought no reach
        in a minute (the big examples make it) and took a third of the campaign's time, mostly re-running
        examples to climb, so that shallow bugs were found later."""
        if not self.runs:
            return
        self.compare_states()
        self.reach["largest_tree_pages"] = len(self.model.entries)
        STATS.record_reach(**{name: value for name, value in self.reach.items() if name != "largest_tree_pages"})

    # ------------------------------------------------------------ eviction

    def checked_evict(self, amount: int) -> None:
        """evict(amount) on every target, every page it gives back checked; the model follows."""
        pages = div_ceil(amount, self.page_size)
        if self.follow is None:
            want = pc.evict(self.model, amount)
            for run in self.runs:
                run.target.evict(amount)  # type: ignore[attr-defined]
                got = [slot for group in run.target.take_evicted() for slot in group]
                if not run.exact:
                    got.sort()
                assert got == want, (
                    f"evict({amount}): {run.name} gave back other slots than the spec: {list_diff(got, want)}"
                )
            self.free.extend(compute_page_starts(want, self.page_size))
            STATS.evicted_pages += pages
            self.reach["largest_evict_pages"] = max(self.reach["largest_evict_pages"], pages)
            return
        target: Any = self.follow.target
        stamps_before = self.stamps_if_sync()
        strict = self.strict_plan()
        target.evict(amount)
        self.apply_evictions(f"evict({amount})", target.take_evicted(), pages, stamps_before, strict)

    def make_room(self, pages: int) -> None:
        """Evict so that an insert finds free pages (as an engine's allocator would), if enough is evictable."""
        if self.every(lambda p: p.eviction_trigger == "evict") and (
            pages * self.page_size <= pc.size_info(self.model).evictable_size
        ):
            STATS.rules["cache.evict[for an insert]"] += 1
            self.checked_evict(pages * self.page_size)

    def strict_plan(self) -> pc.PrefixCacheState | None:
        """A copy of the model the spec's LRU will pop from (strict mode, spec LRU), or None."""
        if self.LRU != "strict" or self.lru_model is not None:
            return None
        return pc.PrefixCacheState(self.page_size, dict(self.model.entries), self.model.clock)

    def apply_evictions(
        self,
        label: str,
        groups: list[list[int]],
        needed: int | None,
        stamps: dict[PageKey, Any] | None,
        strict: pc.PrefixCacheState | None = None,
        pinned: set[PageKey] | None = None,
    ) -> None:
        """Check the pages the followed target gave back, unit by unit, and remove them from the model."""
        assert self.follow is not None
        profile = self.follow.profile
        total = 0
        for number, group in enumerate(groups):
            starts = self.whole_pages(label, group)
            by_start = {entry.slot_start: key for key, entry in self.model.entries.items()}
            keys = []
            for start in starts:
                assert start in by_start, (
                    f"{label}: gave back page {start}, which it does not hold (never cached, or given back twice)"
                )
                keys.append(by_start[start])
            for key in keys:
                assert self.model.entries[key].ref_count == 0, f"{label}: evicted locked {describe(key)}"
            if stamps is not None:
                self.check_oldest(label, keys, stamps, pinned or set())
            if strict is not None:
                self.check_spec_choice(label, strict, keys)
            # deepest first: a page leaves only after every page that extends it
            for key, start in sorted(zip(keys, starts, strict=True), key=lambda pair: len(pair[0][1]), reverse=True):
                assert not pc.has_cached_child(self.model, key), (
                    f"{label}: evicted {describe(key)} while a page extending it stays cached"
                )
                del self.model.entries[key]
                if profile.slots == "caller":
                    self.free.append(start)
            if needed is not None and profile.eviction_unit == "node" and number == len(groups) - 1:
                assert total < needed, f"{label}: evicted {total} pages before its last unit; {needed} were asked"
            total += len(keys)
            STATS.evicted_pages += len(keys)
        # the pages one call gave back (an evict(), or an allocation that reused cached pages)
        self.reach["largest_evict_pages"] = max(self.reach["largest_evict_pages"], total)
        if needed is not None:
            if profile.eviction_unit == "page":
                assert total == needed, f"{label}: evicted {total} pages, the spec evicts exactly {needed}"
            else:
                assert total >= needed, f"{label}: evicted {total} pages, at least {needed} were asked"

    def check_spec_choice(self, label: str, plan: pc.PrefixCacheState, group: list[PageKey]) -> None:
        """Strict LRU: the unit holds exactly the spec's next pops (oldest evictable leaf page first)."""
        for _ in group:
            leaves = pc.get_evictable_leaves(plan)
            oldest = min(leaves, key=lambda key: plan.entries[key].last_access)
            assert oldest in group, (
                f"{label}: strict LRU: the spec evicts {describe(oldest)} (last access"
                f" {plan.entries[oldest].last_access}); the target evicted {brief([describe(k) for k in group], 4)}"
            )
            del plan.entries[oldest]

    def check_oldest(self, label: str, keys: list[PageKey], stamps: dict[PageKey, Any], pinned: set[PageKey]) -> None:
        """Sync LRU: the unit is the oldest evictable leaf by the target's own clock."""
        leaves = [key for key in pc.get_evictable_leaves(self.model) if key not in keys and key not in pinned]
        deepest = max(keys, key=lambda k: len(k[1]))
        others = [stamps[key] for key in leaves if key in stamps]
        if deepest in stamps and others:
            assert stamps[deepest] <= min(others), (
                f"{label}: evicted a unit of age {stamps[deepest]} while an evictable leaf of age {min(others)} stays"
            )

    def whole_pages(self, label: str, slots: list[int]) -> list[int]:
        """The page starts of ``slots``, after checking they are whole aligned pages."""
        p = self.page_size
        assert len(slots) % p == 0, f"{label}: gave back {len(slots)} slots, not whole pages of {p}"
        starts = compute_page_starts(slots, p)
        for start, page in zip(starts, (slots[i : i + p] for i in range(0, len(slots), p)), strict=True):
            assert start % p == 0 and list(page) == list(range(start, start + p)), (
                f"{label}: gave back {brief(list(page))}, not one whole page"
            )
        assert len(set(starts)) == len(starts), f"{label}: gave back the same page twice in one call"
        return starts

    def stamps_if_sync(self) -> dict[PageKey, Any] | None:
        """The followed target's clock before an eviction, when sync mode checks the oldest-first rule."""
        target: Any = self.follow.target if self.follow is not None else None
        if self.LRU != "sync" or target is None or target.profile.clock == "none" or not hasattr(target, "page_stamps"):
            return None
        return dict(target.page_stamps())

    # ------------------------------------------------------------ the slot ledger

    def take_pages(self, count: int, high: bool = False) -> list[int]:
        """``count`` page starts the machine owns, handed out (from the top of the slot domain when ``high``)."""
        p = self.page_size
        if high:
            top = (SLOT_LIMIT - p) // p * p
            pages = [top - (self.high_taken + k) * p for k in range(count)]
            self.high_taken += count
            self.num_pages += count
            return pages
        while not self.bounded and len(self.free) < count:
            self.free.append(self.next_low)
            self.next_low += p
            self.num_pages += 1
        return [self.free.popleft() for _ in range(count)]

    def peek_pages(self) -> Iterator[int]:
        """The page starts the next take_pages() would hand out (for calls that must be rejected)."""
        if self.bounded:
            return iter(list(self.free))
        return itertools.chain(list(self.free), itertools.count(self.next_low, self.page_size))

    # ------------------------------------------------------------ helpers

    def spec_try(self, call: Callable[[], object]) -> CacheError | None:
        """Run ``call`` on the model: None when it succeeds, else its error (and the model is unchanged)."""
        before = self.model_view()
        try:
            call()
        except CacheError as exc:
            assert self.model_view() == before, f"the spec raised {type(exc).__name__} ({exc}) but changed its state"
            return exc
        return None

    def model_view(self) -> object:
        """What a rejected call must leave unchanged in the model (its sizes and clock for big trees)."""
        if len(self.model.entries) <= FULL_CHECK_PAGES:
            return (dict(self.model.entries), self.model.clock)
        return (len(self.model.entries), self.model.clock, pc.size_info(self.model))

    def rejected(
        self, label: str, call: Callable[[Driven], object], error: CacheError, runs: list[Driven] | None = None
    ) -> None:
        """An invalid call: not sent to targets without validation; else the spec's error, nothing changed.

        Targets with the differential capability raise the spec's class with the spec's words; targets whose
        profile says ``errors == "ours"`` its class; ``"any"``: some exception.
        """
        sent = False
        for run in self.runs if runs is None else runs:
            errors = run.profile.errors
            if errors == "none":
                STATS.skipped[label] += 1
                continue
            sent = True
            before = self.observe(run)
            try:
                call(run)
            except Exception as exc:
                if run.exact:
                    assert (type(exc), str(exc)) == (type(error), str(error)), (
                        f"{label}: the spec raises {type(error).__name__}({str(error)!r}) but {run.name}"
                        f" raises {type(exc).__name__}({str(exc)!r})"
                    )
                elif errors == "ours":
                    assert isinstance(exc, type(error)), (
                        f"{label}: expected {type(error).__name__}, got {type(exc).__name__}: {exc}"
                    )
                after = self.observe(run)
                assert after == before, (
                    f"{label}: {run.name} raised {type(exc).__name__} ({exc}) but changed its state:\n"
                    f"{describe_difference(before, after)}"
                )
                continue
            raise AssertionError(
                f"{label}: {run.name} accepted it; the spec rejects it with {type(error).__name__} ({error})"
            )
        if sent:
            STATS.record_rejection(type(error))

    def observe(self, run: Driven) -> object:
        """What a rejected call must leave unchanged: the abstract state (sizes and clock for big trees) of a
        target with the differential capability; else sizes, the content where exposed, nothing given back."""
        target: Any = run.target
        if run.exact:
            return target.abstract_state() if len(self.model.entries) <= FULL_CHECK_PAGES else target.fingerprint()
        content = target.cached_pages() if hasattr(target, "cached_pages") else None
        return (tuple(target.size_info()), content, target.take_evicted())

    def expect_no_frees(self, run: Driven, label: str) -> None:
        """Calls other than evict (and, for allocating targets, insert) give nothing back."""
        groups = run.target.take_evicted()
        assert not groups, (
            f"{label}: {run.name} gave back slots {brief([brief(g) for g in groups], 2)} (only an eviction may)"
        )

    def check_handle(self, run: Driven, label: str, handle: Any, expected: pc.Handle) -> None:
        """The target's handle matches the spec's: same length, exactly the cached slots of that prefix."""
        got = run.target.cached_len(handle)
        assert got == expected.cached_len, f"{label}: {run.name} cached_len {got}, the spec {expected.cached_len}"
        returned = run.target.matched_slots(handle)
        want = pc.get_matched_indices(self.model, expected)
        assert returned == want, (
            f"{label}: {run.name} returns other slots than the cache holds for that prefix (got, held):"
            f" {list_diff(returned, want)}"
        )

    def cached_pages_of(self, keys: list[PageKey]) -> int:
        """How many leading pages of ``keys`` the model holds."""
        cached = 0
        while cached < len(keys) and keys[cached] in self.model.entries:
            cached += 1
        return cached

    def page_starts(self, handle: pc.Handle) -> list[int]:
        """First slots of a live handle's pages, in path order."""
        return [self.model.entries[key].slot_start for key in pc.get_handle_keys(self.model, handle)]

    def model_starts(self) -> list[int]:
        return [entry.slot_start for entry in self.model.entries.values()]
