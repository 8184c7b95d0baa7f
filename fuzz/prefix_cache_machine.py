"""Differential state machine for prefix caches: spec vs reference (vs optimized).

Rules apply the same call to every implementation and compare results,
rejections and abstract states. Sequences come from a small alphabet and
from prefixes of earlier sequences (Bundles), so sharing, splits and
partial matches are frequent. Bad input (stale handles, unlock without
lock, oversize evictions, mismatched lengths, misaligned or cached slots)
must be rejected with the same error class and no change.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from spec import prefix_cache as pc
from spec.errors import InvalidTypeError
from spec.helpers import align_down
from spec.invariants import check_invariants
from spec.types import SLOT_LIMIT, Namespace

from .adapters import CACHE_IMPLEMENTATIONS, CacheAdapter, SpecCache
from .differential import apply_all, describe_difference
from .sequences import PAGE_SIZES, bad_namespaces, build_sequence, namespaces, page_choices, tail_choices
from .stats import STATS

# bad slots for insert_prefix: shifted, out of order, already cached, given twice, one short, past 2**31
BAD_SLOTS = ("misaligned", "scrambled", "cached", "twice", "short", "past_limit")
# where fresh pages come from: the bottom of the slot domain, or its top (just below 2**31)
SLOT_RANGES = ("low", "low", "low", "high")
# reset only trees this large, so that most examples grow trees
RESET_AT_PAGES = 6
EVICT_SIZES = ("some", "some", "all", "zero", "over", "negative")


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

    @property
    def spec(self) -> SpecCache:
        """The oracle."""
        return self.impls[0]  # type: ignore[return-value]

    @initialize(
        target=seqs,
        page_size=st.sampled_from(PAGE_SIZES),
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
    )
    def setup(self, page_size: int, first: list[tuple[list[int], list[int]]]) -> Any:
        self.page_size = page_size
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

    # ------------------------------------------------------------ operations

    @rule(target=handles, seq=seqs, namespace=namespaces)
    def match_prefix(self, seq: tuple[int, ...], namespace: Namespace) -> Any:
        STATS.record_rule("cache.match_prefix")
        out = apply_all(
            "match_prefix",
            self.impls,
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
        out = apply_all(
            "bad namespace",
            self.impls,
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
        indices = self.choose_indices(list(seq), namespace, slots, which)
        out = apply_all(
            "insert_prefix",
            self.impls,
            lambda impl, i: impl.insert_prefix(list(seq), indices, namespace),
            lambda impl, r: (r[0], impl.cached_len(r[1]), impl.get_matched_indices(r[1])),
        )
        return HandleSet([r[1] for r in out.results]) if out.ok else multiple()

    @rule(handle=handles)
    def lock(self, handle: HandleSet) -> None:
        STATS.record_rule("cache.lock")
        keys = self.handle_keys(handle)
        if apply_all("lock", self.impls, lambda impl, i: impl.lock(handle.handles[i])).ok:
            self.locks.update(keys)

    @rule(handle=handles)
    def unlock(self, handle: HandleSet) -> None:
        STATS.record_rule("cache.unlock")
        keys = self.handle_keys(handle)
        if apply_all("unlock", self.impls, lambda impl, i: impl.unlock(handle.handles[i])).ok:
            self.locks.subtract(keys)

    @rule(handle=handles)
    def get_matched_indices(self, handle: HandleSet) -> None:
        STATS.record_rule("cache.get_matched_indices")
        apply_all("get_matched_indices", self.impls, lambda impl, i: impl.get_matched_indices(handle.handles[i]))

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
        out = apply_all("evict", self.impls, lambda impl, i: impl.evict(amount))
        if out.ok:
            STATS.evicted_pages += len(out.results[0]) // self.page_size

    @precondition(lambda self: len(self.spec.state.entries) >= RESET_AT_PAGES)
    @rule()
    def reset(self) -> None:
        STATS.record_rule("cache.reset")
        if apply_all("reset", self.impls, lambda impl, i: impl.reset()).ok:
            assert not +self.locks, f"reset succeeded while the machine counts locks {dict(+self.locks)}"

    # ------------------------------------------------------------ checks

    @invariant()
    def implementations_agree(self) -> None:
        if not self.impls:
            return
        expected = self.spec.abstract_state()
        check_invariants(expected, locks=self.locks)
        STATS.record_tree(len(expected.entries))
        for impl in self.impls[1:]:
            impl.check_integrity()
            actual = impl.abstract_state()
            assert actual == expected, (
                f"abstract state of {impl.name} differs from spec:\n{describe_difference(expected, actual)}"
            )
            assert impl.size_info() == self.spec.size_info(), (
                f"size_info: spec {self.spec.size_info()}, {impl.name} {impl.size_info()}"
            )

    # ------------------------------------------------------------ helpers

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
