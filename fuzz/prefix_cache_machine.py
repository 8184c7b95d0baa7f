"""Differential state machine for prefix caches: spec vs reference (vs optimized).

Rules apply the same call to every implementation and compare results,
rejections and abstract states. Sequences come from a small alphabet and
from prefixes of earlier sequences (Bundles), so sharing, splits and
partial matches are frequent. Bad input (stale handles, unlock without
lock, oversize evictions, mismatched lengths, misaligned or cached slots)
must be rejected with the same error class and no change.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis import target
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from spec import events as ev
from spec import prefix_cache as pc
from spec.domains import SLOT_LIMIT, Namespace
from spec.errors import InvalidTypeError
from spec.helpers import align_down
from spec.invariants import check_invariants

from .adapters import CACHE_IMPLEMENTATIONS, CacheAdapter, SpecCache
from .differential import apply_all, describe_difference
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

# bad slots for insert_prefix: shifted, out of order, already cached, given twice, one short, past 2**31
BAD_SLOTS = ("misaligned", "scrambled", "cached", "twice", "short", "past_limit")
# where fresh pages come from: the bottom of the slot domain, or its top (just below 2**31)
SLOT_RANGES = ("low", "low", "low", "high")
# reset only trees this large, so that most examples grow trees
RESET_AT_PAGES = 6
EVICT_SIZES = ("some", "some", "all", "zero", "over", "negative")
# the bulk rules stop growing a tree past this many pages (each step's checks are O(pages))
BIG_TREE_PAGES = 4000
# pages of a long key in a small example
LONG_KEY_PAGES = 256
# above this many pages, the whole-state comparison runs every CHECK_EVERY steps (and at the end), not every step
FULL_CHECK_PAGES, CHECK_EVERY = 300, 8


class HandleSet:
    """One handle per implementation, from the same call."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    @property
    def spec(self) -> pc.Handle:
        """The spec's handle (first implementation)."""
        return self.handles[0]  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"HandleSet(cached_len={self.spec.cached_len})"


class PrefixCacheMachine(RuleBasedStateMachine):
    """Spec and implementations driven by the same match / insert / lock / unlock / evict / reset calls."""

    # implementations beside the spec (see fuzz.adapters)
    IMPLS: ClassVar[tuple[str, ...]] = ("reference", "optimized")

    seqs = Bundle("seqs")
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.impls: list[CacheAdapter] = []
        self.page_size = 1
        # outstanding locks per page, as the machine counts them
        self.locks: Counter[pc.PageKey] = Counter()
        # steps since the last whole-state comparison
        self.unchecked = 0
        # this example's reach, handed to hypothesis.target() at the end (it steers towards bigger states)
        self.reach: Counter[str] = Counter()
        # a big example: the bulk rules run (most examples stay small, where most bugs are caught fast)
        self.big = False
        # each implementation's KV events, replayed as a router would (spec/events.py)
        self.replayers: dict[str, ev.Replayer] = {}

    @property
    def spec(self) -> SpecCache:
        """The oracle."""
        return self.impls[0]  # type: ignore[return-value]

    @initialize(
        target=seqs,
        page_size=page_sizes,
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
        big=st.sampled_from([False] * 9 + [True]),
    )
    def setup(self, page_size: int, first: list[tuple[list[int], list[int]]], big: bool = False) -> Any:
        self.page_size = page_size
        self.big = big
        self.impls = [SpecCache(page_size)] + [CACHE_IMPLEMENTATIONS[name](page_size) for name in self.IMPLS]
        return multiple(*[tuple(build_sequence(page_size, pages, tail)) for pages, tail in first])

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

        Small examples keep it to LONG_KEY_PAGES pages (long keys need big pages there); big ones do not.
        """
        STATS.record_rule("cache.long_seq")
        p = self.page_size
        count = max(1, tokens // p) if self.big else max(1, min(tokens // p, LONG_KEY_PAGES))
        pages = [page_pattern((salt + i * (i % 3)) % NUM_PATTERNS, p) for i in range(count)]
        return tuple(build_sequence(p, [], [], base) + [token for page in pages for token in page])

    # ------------------------------------------------------------ bulk: big, deep, wide trees

    def room(self) -> int:
        """Pages the bulk rules may still add to this example's tree."""
        return max(0, BIG_TREE_PAGES - len(self.spec.state.entries))

    def grows(self) -> bool:
        """True in a big example (drawn at setup) whose tree is not too big yet: the bulk rules may run."""
        return bool(self.impls) and self.big and len(self.spec.state.entries) < BIG_TREE_PAGES

    @precondition(grows)
    @rule(base=seqs, branches=st.sampled_from([8, 64, 256, 600]), depth=st.integers(1, 3), namespace=namespaces)
    def bulk_insert(self, base: tuple[int, ...], branches: int, depth: int, namespace: Namespace) -> None:
        """Many branches off ``base``'s whole pages at once: thousands of pages and leaves in one step."""
        STATS.record_rule("cache.bulk_insert")
        p = self.page_size
        stem = build_sequence(p, [], [], base)
        fresh = self.fresh_pages()
        for branch in range(branches):
            if not self.room():
                break
            pages = [token for level in range(depth) for token in distinct_page(branch * 3 + level, p)]
            self.insert_valid(tuple(stem + pages), namespace, fresh)

    @precondition(grows)
    @rule(base=seqs, depth=st.sampled_from([16, 16, 16, 128, 128, 600, 2000]), namespace=namespaces)
    def deep_chain(self, base: tuple[int, ...], depth: int, namespace: Namespace) -> None:
        """``base`` extended one page per insert: a path ``depth`` nodes deep (its cost grows as depth**2 * P)."""
        STATS.record_rule("cache.deep_chain")
        p = self.page_size
        depth = min(depth, int((4_000_000 / p) ** 0.5))
        tokens = build_sequence(p, [], [], base)
        fresh = self.fresh_pages()
        handles = None
        for level in range(depth):
            if not self.room():
                break
            tokens += distinct_page(level % 5 + 1000, p)
            handles = self.insert_valid(tuple(tokens), namespace, fresh)
        if handles is not None:
            self.note_depth(handles)

    @precondition(grows)
    @rule(seq=seqs, count=st.sampled_from([4, 32, 200]), salt=st.integers(0, 1 << 16))
    def many_namespaces(self, seq: tuple[int, ...], count: int, salt: int) -> None:
        """The same sequence in many namespaces: lines that share tokens but never pages."""
        STATS.record_rule("cache.many_namespaces")
        fresh = self.fresh_pages()
        for index in range(count):
            if self.room() < len(seq) // self.page_size:
                break
            self.insert_valid(seq, ("tenant", salt, index), fresh)

    def fresh_pages(self) -> Iterator[int]:
        """Page starts no page holds now, above every cached one (for the bulk rules: O(1) each)."""
        top = max((entry.slot_start for entry in self.spec.state.entries.values()), default=-self.page_size)
        return itertools.count(top + self.page_size, self.page_size)

    def insert_valid(self, seq: tuple[int, ...], namespace: Namespace, fresh: Iterator[int]) -> HandleSet | None:
        """An insert with fresh slots (it cannot be rejected): no snapshots, no rule count."""
        p = self.page_size
        keys = pc.get_page_keys(self.spec.state, namespace, seq)
        cached = next((i for i, key in enumerate(keys) if key not in self.spec.state.entries), len(keys))
        new = [start + k for _ in keys[cached:] for start in [next(fresh)] for k in range(p)]
        filler = [SLOT_LIMIT - 1] * (len(seq) - len(keys) * p)
        indices = [SLOT_LIMIT - 1] * (cached * p) + new + filler
        self.reach["longest_key_tokens"] = max(self.reach["longest_key_tokens"], len(seq))
        out = self.apply(
            "insert_prefix",
            lambda impl, i: impl.insert_prefix(list(seq), indices, namespace),
            lambda impl, r: r[0],
        )
        return HandleSet([r[1] for r in out.results]) if out.ok else None

    def note_depth(self, handles: HandleSet) -> None:
        """The depth in nodes of a handle's path, as the first implementation that can tell counts it."""
        for impl, handle in zip(self.impls, handles.handles, strict=True):
            depth = getattr(impl, "path_nodes", None)
            if depth is not None:
                self.reach["deepest_path_nodes"] = max(self.reach["deepest_path_nodes"], depth(handle))
                return

    # ------------------------------------------------------------ operations

    @rule(target=handles, seq=seqs, namespace=namespaces)
    def match_prefix(self, seq: tuple[int, ...], namespace: Namespace) -> Any:
        STATS.record_rule("cache.match_prefix")
        self.reach["longest_key_tokens"] = max(self.reach["longest_key_tokens"], len(seq))
        out = self.apply(
            "match_prefix",
            lambda impl, i: impl.match_prefix(list(seq), namespace),
            lambda impl, h: (impl.cached_len(h), impl.get_matched_indices(h)),
        )
        return HandleSet(out.results) if out.ok else multiple()

    @rule(target=handles, seq=seqs, namespace=namespaces, where=st.sampled_from(SLOT_RANGES))
    def insert_prefix(self, seq: tuple[int, ...], namespace: Namespace, where: str = "low") -> Any:
        """Insert with valid slots: fresh pages for the new part, low in the pool or just below 2**31."""
        return self.insert(seq, namespace, "fresh" if where == "low" else "high", 0)

    @rule(seq=seqs, namespace=bad_namespaces, insert=st.booleans())
    def bad_namespace(self, seq: tuple[int, ...], namespace: Any, insert: bool) -> None:
        """A namespace outside the domain (an alias of a valid one, a float, a subclass): InvalidTypeError."""
        STATS.record_rule(f"cache.bad_namespace[{'insert' if insert else 'match'}]")
        indices = self.choose_indices(list(seq), None, "fresh", 0)
        out = self.apply(
            "bad namespace",
            lambda impl, i: (
                impl.insert_prefix(list(seq), indices, namespace) if insert else impl.match_prefix(list(seq), namespace)
            ),
        )
        assert out.error is InvalidTypeError, f"namespace {namespace!r} was not rejected as InvalidTypeError"

    @rule(target=handles, seq=seqs, namespace=namespaces, slots=st.sampled_from(BAD_SLOTS), which=st.integers(0, 15))
    def insert_prefix_bad_slots(self, seq: tuple[int, ...], namespace: Namespace, slots: str, which: int) -> Any:
        """Insert with bad slots: rejected unless the bad part falls on pages already cached."""
        return self.insert(seq, namespace, slots, which)

    def insert(self, seq: tuple[int, ...], namespace: Namespace, slots: str, which: int) -> Any:
        STATS.record_rule(f"cache.insert_prefix[{slots}]")
        self.reach["longest_key_tokens"] = max(self.reach["longest_key_tokens"], len(seq))
        indices = self.choose_indices(list(seq), namespace, slots, which)
        out = self.apply(
            "insert_prefix",
            lambda impl, i: impl.insert_prefix(list(seq), indices, namespace),
            lambda impl, r: (r[0], impl.cached_len(r[1]), impl.get_matched_indices(r[1])),
        )
        if not out.ok:
            return multiple()
        handles = HandleSet([r[1] for r in out.results])
        self.note_depth(handles)
        return handles

    @rule(handle=handles)
    def lock(self, handle: HandleSet) -> None:
        STATS.record_rule("cache.lock")
        keys = self.handle_keys(handle)
        if self.apply("lock", lambda impl, i: impl.lock(handle.handles[i])).ok:
            self.locks.update(keys)

    @rule(handle=handles)
    def unlock(self, handle: HandleSet) -> None:
        STATS.record_rule("cache.unlock")
        keys = self.handle_keys(handle)
        if self.apply("unlock", lambda impl, i: impl.unlock(handle.handles[i])).ok:
            self.locks.subtract(keys)

    @rule(handle=handles)
    def get_matched_indices(self, handle: HandleSet) -> None:
        STATS.record_rule("cache.get_matched_indices")
        self.apply("get_matched_indices", lambda impl, i: impl.get_matched_indices(handle.handles[i]))

    @rule(size=st.sampled_from(EVICT_SIZES), fraction=st.integers(0, 100))
    def evict(self, size: str, fraction: int) -> None:
        STATS.record_rule(f"cache.evict[{size}]")
        evictable = self.spec.size_info()[0]
        amount = {
            "some": evictable * fraction // 100,
            "all": evictable,
            "zero": 0,
            "over": evictable + 1 + fraction,
            "negative": -1 - fraction,
        }[size]
        if size == "all":
            leaves = len(pc.get_evictable_leaves(self.spec.state))
            self.reach["most_evictable_leaves"] = max(self.reach["most_evictable_leaves"], leaves)
        out = self.apply("evict", lambda impl, i: impl.evict(amount))
        if out.ok:
            pages = len(out.results[0]) // self.page_size
            STATS.evicted_pages += pages
            self.reach["largest_evict_pages"] = max(self.reach["largest_evict_pages"], pages)

    @precondition(lambda self: len(self.spec.state.entries) >= RESET_AT_PAGES)
    @rule()
    def reset(self) -> None:
        STATS.record_rule("cache.reset")
        if self.apply("reset", lambda impl, i: impl.reset()).ok:
            assert not +self.locks, f"reset succeeded while the machine counts locks {dict(+self.locks)}"

    # ------------------------------------------------------------ checks

    @invariant()
    def implementations_agree(self) -> None:
        if not self.impls:
            return
        for impl in self.impls[1:]:
            assert impl.size_info() == self.spec.size_info(), (
                f"size_info: spec {self.spec.size_info()}, {impl.name} {impl.size_info()}"
            )
        self.replay_events()
        pages = len(self.spec.state.entries)
        self.unchecked += 1
        if pages > FULL_CHECK_PAGES and self.unchecked < CHECK_EVERY:
            return
        self.compare_states()

    def replay_events(self) -> None:
        """Each implementation's KV events so far, applied to its replayer (a router's mirror)."""
        for impl in self.impls[1:]:
            replayer = self.replayers.setdefault(impl.name, ev.Replayer(self.page_size))
            before = replayer.applied
            replayer.apply(impl.take_events())
            STATS.events_replayed += replayer.applied - before

    def compare_states(self) -> None:
        """The whole comparison: invariants of the spec's state, each implementation's integrity, equal states."""
        self.unchecked = 0
        # the events of the last step too (teardown compares without an invariant run after that step)
        self.replay_events()
        expected = self.spec.abstract_state()
        check_invariants(expected, locks=self.locks)
        STATS.record_tree(len(expected.entries))
        namespaces_held = {namespace for namespace, _ in expected.entries}
        self.reach["most_namespaces"] = max(self.reach["most_namespaces"], len(namespaces_held))
        for impl in self.impls[1:]:
            impl.check_integrity()
            actual = impl.abstract_state()
            assert actual == expected, (
                f"abstract state of {impl.name} differs from spec:\n{describe_difference(expected, actual)}"
            )
            # the replay invariant: the events so far describe exactly the cached pages
            ev.events_match_cache(
                self.replayers[impl.name].cached(), {key: e.slot_start for key, e in actual.entries.items()}
            )
            assert impl.size_info() == self.spec.size_info(), (
                f"size_info: spec {self.spec.size_info()}, {impl.name} {impl.size_info()}"
            )
        self.compare_metrics(expected)

    def compare_metrics(self, expected: pc.PrefixCacheState) -> None:
        """Every implementation counts the same metrics, and each namespace's pages are conserved:
        stored = cached now + evicted + dropped by reset."""
        counted = [(impl.name, impl.stats()) for impl in self.impls[1:] if hasattr(impl, "stats")]
        if not counted:
            return
        cached: Counter[Namespace] = Counter(namespace for namespace, _ in expected.entries)
        for name, stats in counted:
            for namespace, counts in stats.namespaces.items():
                assert counts.pages_stored == cached[namespace] + counts.pages_evicted + counts.pages_dropped, (
                    f"metrics of {name}, namespace {namespace!r}: {counts.pages_stored} pages stored,"
                    f" {cached[namespace]} cached, {counts.pages_evicted} evicted, {counts.pages_dropped} dropped"
                )
        first_name, first = counted[0]
        for name, stats in counted[1:]:
            assert stats == first, f"metrics: {first_name} {first.as_dict()}, {name} {stats.as_dict()}"
        assert first.eviction_age_sum >= 0, f"negative eviction age sum {first.eviction_age_sum}"

    # ------------------------------------------------------------ helpers

    def teardown(self) -> None:
        """A last whole comparison (sampling skipped some; a replayed program may end without an invariant run),
        then the example's reach to Hypothesis and the stats."""
        if not self.impls:
            return
        self.compare_states()
        self.reach["largest_tree_pages"] = len(self.spec.state.entries)
        if not self.big and currently_in_test_context():
            # steer the small examples towards bigger states (re-running big ones to climb would cost minutes)
            for name, value in self.reach.items():
                target(float(value), label=name)
        STATS.record_reach(**{name: value for name, value in self.reach.items() if name != "largest_tree_pages"})

    def apply(self, label: str, call: Any, observe: Any = lambda impl, result: result) -> Any:
        """apply_all over the spec and the implementations, with this machine's snapshots."""
        return apply_all(label, self.impls, call, observe, snapshot=self.snapshot)

    def snapshot(self, impl: CacheAdapter) -> Any:
        """What a rejected call must leave unchanged: the whole abstract state.

        For big trees, an implementation's sizes and clock only: the next whole
        comparison with the (snapshotted) spec, at most CHECK_EVERY steps later,
        sees any other change.
        """
        if impl is self.spec or len(self.spec.state.entries) <= FULL_CHECK_PAGES:
            return impl.abstract_state()
        return impl.fingerprint()

    def handle_keys(self, handle: HandleSet) -> list[pc.PageKey]:
        """Pages of the handle's path (whether or not still cached)."""
        return pc.get_handle_keys(self.spec.state, handle.spec)

    def choose_indices(self, seq: list[int], namespace: Namespace, mode: str, which: int) -> list[int]:
        """Slots for an insert of ``seq``: fresh pages for the new part, or one of the bad inputs."""
        p = self.page_size
        state = self.spec.state
        keys = pc.get_page_keys(state, namespace, seq)
        cached = 0
        while cached < len(keys) and keys[cached] in state.entries:
            cached += 1
        new_pages = len(keys) - cached
        taken = {entry.slot_start for entry in state.entries.values()}
        if mode == "high":  # the top of the slot domain: the last page ends at 2**31 - 1 at most
            top = (SLOT_LIMIT - p) // p * p
            fresh = [s for s in range(top, top - (len(taken) + new_pages + 1) * p, -p) if s not in taken][:new_pages]
        else:
            fresh = [s for s in range(0, (len(taken) + new_pages + 1) * p, p) if s not in taken][:new_pages]
        # positions the cache must ignore get slots no page ever uses
        filler = [1_000_000 + i for i in range(len(seq))]
        pages = [[start + k for k in range(p)] for start in fresh]
        pick = which % new_pages if new_pages else 0
        if mode == "misaligned" and new_pages:
            pages[pick] = [-1] if p == 1 else [s + 1 for s in pages[pick]]
        elif mode == "scrambled" and new_pages and p > 1:
            pages[pick] = pages[pick][::-1]
        elif mode == "cached" and new_pages and taken:
            start = sorted(taken)[which % len(taken)]
            pages[pick] = [start + k for k in range(p)]
        elif mode == "twice" and new_pages >= 2:
            pages[(pick + 1) % new_pages] = pages[pick]
        elif mode == "past_limit" and new_pages:
            start = (SLOT_LIMIT + p - 1) // p * p + which * p
            pages[pick] = [start + k for k in range(p)]
        indices = filler[: cached * p] + [s for page in pages for s in page] + filler[align_down(len(seq), p) :]
        if mode == "short" and indices:
            indices.pop()
        return indices
