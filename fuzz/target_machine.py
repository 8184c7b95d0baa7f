"""State machine for any prefix cache behind the target API: the spec where its profile promises, properties elsewhere.

The machine keeps the spec's state as its model of the target and a ledger
of slots (the pages it owns, the pages the cache holds). Every call goes to
the target; what comes back is checked against the model:

* a match returns exactly the cached length and the slots inserted for that
  prefix, never a page of another namespace;
* an insert reports the pages already cached; new pages take the offered
  slots (or, for targets that allocate, fresh aligned pages);
* every slot the target gives back was cached, unlocked, and is given back
  once; giving it back keeps the cache prefix-closed (a page never leaves
  before its extensions); eviction takes as many pages as the profile says;
* LRU, **strict**: the evicted pages are the ones the spec (or the profile's
  LRU model) would take; **sync**: the model follows the target's choice once
  it is shown to be allowed, oldest first by the target's own clock;
* after every step: size info equals the cached pages, the content and
  stamps the target exposes equal the model's, its own integrity check
  passes, and a rejected call changed nothing observable.

Calls the profile does not validate are never sent when invalid (the spec
decides); they are counted as skipped.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import replace
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from spec import events as ev
from spec import prefix_cache as pc
from spec.domains import SLOT_LIMIT, Namespace
from spec.errors import (
    CacheBusyError,
    CacheError,
    EvictionError,
    InvalidSizeError,
    InvalidTypeError,
    LengthMismatchError,
    StaleHandleError,
    UnlockError,
)
from spec.helpers import compute_page_starts, compute_page_to_token, div_ceil
from spec.invariants import check_invariants

from .messages import brief, list_diff
from .sequences import bad_namespaces, build_sequence, namespaces, page_choices, page_sizes, tail_choices
from .stats import STATS
from .targets.api import PageKey, TargetInfo

EVICT_SIZES = ("some", "some", "all", "one", "zero", "over", "negative")
BAD_SLOTS = ("misaligned", "cached", "twice", "short", "past_limit")


def describe(key: PageKey) -> str:
    """A page for a message: its namespace and the tokens of its path (the last ones when long)."""
    namespace, prefix = key
    tokens = prefix.tokens
    shown = list(tokens) if len(tokens) <= 8 else ["...", *tokens[-6:]]
    where = "" if namespace is None else f" in namespace {namespace!r}"
    return f"page {shown} ({len(tokens)} tokens{where})"


class TargetHandle:
    """The target's handle and the spec's, from the same call."""

    def __init__(self, target: Any, spec: pc.Handle, epoch: int) -> None:
        self.target = target
        self.spec = spec
        # how many resets came before the handle was made
        self.epoch = epoch

    def __repr__(self) -> str:
        return f"TargetHandle(cached_len={self.spec.cached_len})"


class TargetCacheMachine(RuleBasedStateMachine):
    """A target's prefix cache driven by match / insert / lock / unlock / evict / reset, checked against the spec."""

    # set by fuzz.machines.machine_for
    TARGET: ClassVar[TargetInfo]
    LRU: ClassVar[str] = "strict"

    seqs = Bundle("seqs")
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        # the target (Any: its optional methods are looked up by name, see OPTIONAL_CACHE_METHODS)
        self.target: Any = None
        self.model = pc.new_state(1)
        self.page_size = 1
        self.num_pages = 0
        # pages the machine owns (for targets that take the caller's slots), in the order it hands them out
        self.free: deque[int] = deque()
        self.locks: Counter[pc.PageKey] = Counter()
        self.lru_model: Any = None
        # resets so far
        self.epoch = 0
        # the target's KV events replayed as a router would, for targets that emit them (take_events)
        self.replayer: ev.Replayer | None = None

    # ------------------------------------------------------------ setup

    @initialize(
        target=seqs,
        page_size=page_sizes,
        # small pools evict often; big ones let trees, keys and namespaces grow
        num_pages=st.one_of(st.integers(2, 48), st.integers(2, 48), st.integers(49, 2048)),
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
    )
    def setup(self, page_size: int, num_pages: int, first: list[tuple[list[int], list[int]]]) -> Any:
        info = self.TARGET
        if info.page_sizes is not None:
            page_size = info.page_sizes[page_size % len(info.page_sizes)]
        assert info.cache_factory is not None
        self.target = info.cache_factory(page_size, num_pages)
        self.page_size = page_size
        self.num_pages = num_pages
        self.model = pc.new_state(page_size)
        self.free = deque(range(0, num_pages * page_size, page_size))
        profile = self.profile
        if self.LRU == "strict" and profile.lru_model is not None:
            self.lru_model = profile.lru_model(num_pages, page_size)
        if callable(getattr(self.target, "take_events", None)):
            # the engine's own hashes name its pages: they are not ours to recompute
            self.replayer = ev.Replayer(page_size, check_hashes=False, count_repeats=not self.event_namespaces)
        return multiple(*[tuple(build_sequence(page_size, pages, tail)) for pages, tail in first])

    @property
    def profile(self) -> Any:
        assert self.target is not None
        return self.target.profile

    @property
    def event_namespaces(self) -> bool:
        """Whether the replay tells namespaces apart: the profile says so, or strict mode asks for it."""
        return bool(self.profile.event_namespaces or self.LRU == "strict")

    def ns(self, namespace: Namespace) -> Namespace:
        """The namespace a call uses: as drawn, or None for targets without namespaces."""
        return namespace if self.profile.namespaces else None

    # ------------------------------------------------------------ sequences

    @rule(target=seqs, base=seqs, keep=st.booleans(), pages=page_choices, tail=tail_choices)
    def new_seq(self, base: tuple[int, ...], keep: bool, pages: list[int], tail: list[int]) -> tuple[int, ...]:
        STATS.record_rule("target.new_seq")
        return tuple(build_sequence(self.page_size, pages, tail, base if keep else ()))

    @rule(target=seqs, base=seqs, cut=st.integers(0, 255))
    def prefix_of(self, base: tuple[int, ...], cut: int) -> tuple[int, ...]:
        STATS.record_rule("target.prefix_of")
        return base[: cut % (len(base) + 1)]

    @rule(target=seqs, base=seqs, pages=st.lists(st.integers(0, 7), min_size=16, max_size=256))
    def long_seq(self, base: tuple[int, ...], pages: list[int]) -> tuple[int, ...]:
        """A long key (hundreds of pages) on top of a drawn one: long compares, long paths."""
        STATS.record_rule("target.long_seq")
        return tuple(build_sequence(self.page_size, pages, [], base))

    @rule(base=seqs, branches=st.integers(2, 64), namespace=namespaces)
    def bulk_insert(self, base: tuple[int, ...], branches: int, namespace: Namespace) -> None:
        """Many branches under one prefix (a shared system prompt): wide nodes, many evictable leaves."""
        STATS.record_rule("target.bulk_insert")
        for branch in range(branches):
            self.insert_prefix(base + tuple(build_sequence(self.page_size, [branch % 8, branch // 8], [])), namespace)

    # ------------------------------------------------------------ operations

    @rule(target=handles, seq=seqs, namespace=namespaces)
    def match_prefix(self, seq: tuple[int, ...], namespace: Namespace) -> Any:
        """A match returns the longest cached prefix and exactly the slots inserted for it."""
        assert self.target is not None
        STATS.record_rule("target.match_prefix")
        ns = self.ns(namespace)
        expected = pc.match_prefix(self.model, list(seq), ns)
        handle = self.target.match_prefix(list(seq), ns)
        self.expect_no_frees("match_prefix")
        self.check_handle("match_prefix", handle, expected)
        if self.lru_model is not None:
            self.lru_model.match(self.page_starts(expected))
        return TargetHandle(handle, expected, self.epoch)

    @rule(target=handles, seq=seqs, namespace=namespaces)
    def insert_prefix(self, seq: tuple[int, ...], namespace: Namespace) -> Any:
        """An insert keeps cached pages, takes new slots for the rest, and reports what was cached."""
        assert self.target is not None
        STATS.record_rule("target.insert_prefix")
        ns = self.ns(namespace)
        tokens = list(seq)
        keys = pc.get_page_keys(self.model, ns, tokens)
        cached = self.cached_pages_of(keys)
        STATS.record_reach(longest_key_tokens=len(tokens), most_namespaces=len(self.model_namespaces()) + 1)
        if self.profile.slots == "target":
            return self.insert_target_slots(tokens, keys, cached, ns)
        # like an engine: fresh pages for every whole page, the duplicates freed after the insert
        if len(keys) > len(self.free):
            self.make_room(len(keys) - len(self.free))
            cached = self.cached_pages_of(keys)
        if len(keys) > len(self.free):
            STATS.skipped["insert: pool full of locked pages"] += 1
            return multiple()
        offered = [self.free.popleft() for _ in keys]
        indices = compute_page_to_token(offered, self.page_size) + [SLOT_LIMIT - 1] * (len(tokens) % self.page_size)
        cached_len, handle = self.target.insert_prefix(tokens, indices, ns)
        self.expect_no_frees("insert_prefix")
        assert cached_len == cached * self.page_size, (
            f"insert_prefix reported {cached_len} tokens already cached, the spec {cached * self.page_size}"
        )
        # the caller frees its own copies of the pages the cache had
        self.free.extend(offered[:cached])
        expected = pc.insert_prefix(self.model, tokens, indices, ns).handle
        self.check_handle("insert_prefix", handle, expected)
        return TargetHandle(handle, expected, self.epoch)

    def insert_target_slots(self, tokens: list[int], keys: list[PageKey], cached: int, ns: Namespace) -> Any:
        """Insert into a target that allocates its own pages (and may evict for them)."""
        assert self.target is not None
        # pages the allocation can draw from: all but the locked ones and the hits it pins
        pinned = {key for key, entry in self.model.entries.items() if entry.ref_count} | set(keys[:cached])
        if len(keys) - cached > self.num_pages - len(pinned):
            STATS.skipped["insert: pool full of locked pages"] += 1
            return multiple()
        stamps_before = self.stamps_if_sync()
        hit_starts = [self.model.entries[key].slot_start for key in keys[:cached]]
        prediction = self.lru_model.insert(hit_starts, len(keys) - cached) if self.lru_model else None
        cached_len, handle = self.target.insert_prefix(tokens, None, ns)
        assert cached_len == cached * self.page_size, (
            f"insert_prefix reported {cached_len} tokens already cached, the spec {cached * self.page_size}"
        )
        groups = self.target.take_evicted()
        # the hits are in use while the pages are allocated: not candidates
        self.apply_evictions("insert_prefix (allocation)", groups, None, stamps_before, pinned=set(keys[:cached]))
        slots = self.target.matched_slots(handle)
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
        indices = slots + [SLOT_LIMIT - 1] * (len(tokens) - len(slots))
        expected = pc.insert_prefix(self.model, tokens, indices, ns).handle
        self.check_handle("insert_prefix", handle, expected)
        return TargetHandle(handle, expected, self.epoch)

    @rule(handle=handles)
    def lock(self, handle: TargetHandle) -> None:
        assert self.target is not None
        STATS.record_rule("target.lock")
        if self.outlived_reset(handle):
            self.rejected(
                "lock of a handle from before reset", lambda: self.target.lock(handle.target), StaleHandleError
            )
            return
        if pc.is_handle_stale(self.model, handle.spec):
            self.rejected("lock of a stale handle", lambda: self.target.lock(handle.target), StaleHandleError)
            return
        self.target.lock(handle.target)
        self.expect_no_frees("lock")
        pc.lock(self.model, handle.spec)
        self.locks.update(pc.get_handle_keys(self.model, handle.spec))
        if self.lru_model is not None:
            self.lru_model.lock(self.page_starts(handle.spec))

    @rule(handle=handles)
    def unlock(self, handle: TargetHandle) -> None:
        assert self.target is not None
        STATS.record_rule("target.unlock")
        if self.outlived_reset(handle):
            self.rejected(
                "unlock of a handle from before reset", lambda: self.target.unlock(handle.target), UnlockError
            )
            return
        if not pc.is_handle_locked(self.model, handle.spec):
            stale = pc.is_handle_stale(self.model, handle.spec)
            error = StaleHandleError if stale else UnlockError
            self.rejected("unlock without its lock", lambda: self.target.unlock(handle.target), error)
            return
        self.target.unlock(handle.target)
        self.expect_no_frees("unlock")
        pc.unlock(self.model, handle.spec)
        self.locks.subtract(pc.get_handle_keys(self.model, handle.spec))
        if self.lru_model is not None:
            self.lru_model.unlock(self.page_starts(handle.spec))

    @precondition(lambda self: self.target is not None and self.profile.eviction_trigger == "evict")
    @rule(size=st.sampled_from(EVICT_SIZES), fraction=st.integers(0, 100))
    def evict(self, size: str, fraction: int) -> None:
        assert self.target is not None
        evictable = pc.size_info(self.model).evictable_size
        amount = {
            "some": evictable * fraction // 100,
            "all": evictable,
            "one": min(1, evictable),
            "zero": 0,
            "over": evictable + 1 + fraction,
            "negative": -1 - fraction,
        }[size]
        STATS.record_rule(f"target.evict[{size}]")
        if amount < 0:
            self.rejected("evict of a negative size", lambda: self.target.evict(amount), InvalidSizeError)
            return
        if amount > evictable:
            self.rejected("evict past the evictable size", lambda: self.target.evict(amount), EvictionError)
            return
        if size == "all":
            STATS.record_reach(most_evictable_leaves=len(pc.get_evictable_leaves(self.model)))
        STATS.record_reach(largest_evict_pages=div_ceil(amount, self.page_size))
        self.checked_evict(amount)

    # a reset only once something is cached (a rule without arguments is drawn often: it would keep trees tiny)
    @precondition(
        lambda self: self.target is not None and self.profile.reset != "none" and len(self.model.entries) >= 8
    )
    @rule()
    def reset(self) -> None:
        assert self.target is not None
        STATS.record_rule("target.reset")
        if pc.size_info(self.model).protected_size:
            self.rejected("reset while locked", self.target.reset, CacheBusyError)
            return
        returned = self.target.reset()
        self.expect_no_frees("reset")
        held = sorted(compute_page_to_token(self.model_starts(), self.page_size))
        if self.profile.reset == "returns":
            assert sorted(returned) == held, (
                f"reset returned other slots than the cache held: {list_diff(sorted(returned), held)}"
            )
        self.free.extend(sorted(self.model_starts()))
        pc.reset(self.model)
        self.epoch += 1
        if self.lru_model is not None:
            self.lru_model.reset()

    # ------------------------------------------------------------ bad input

    @precondition(lambda self: self.target is not None and self.profile.errors != "none")
    @rule(seq=seqs, namespace=namespaces, slots=st.sampled_from(BAD_SLOTS), which=st.integers(0, 15))
    def insert_bad_slots(self, seq: tuple[int, ...], namespace: Namespace, slots: str, which: int) -> None:
        """Bad slots for the new pages: rejected with the spec's error, nothing changed."""
        assert self.target is not None
        STATS.record_rule(f"target.insert_bad_slots[{slots}]")
        p, ns, tokens = self.page_size, self.ns(namespace), list(seq)
        keys = pc.get_page_keys(self.model, ns, tokens)
        cached = self.cached_pages_of(keys)
        if cached == len(keys) or self.profile.slots == "target":
            return
        starts = [self.model.entries[key].slot_start for key in keys[:cached]]
        fresh = list(self.free)[: len(keys) - cached]
        if len(fresh) < len(keys) - cached:
            return
        pick = cached + which % (len(keys) - cached)
        pages = [[s + k for k in range(p)] for s in starts + fresh]
        if slots == "misaligned":
            pages[pick] = [s + 1 for s in pages[pick]] if p > 1 else [SLOT_LIMIT]
        elif slots == "cached" and self.model.entries:
            taken = sorted(self.model_starts())
            pages[pick] = [taken[which % len(taken)] + k for k in range(p)]
        elif slots == "twice" and len(keys) - cached >= 2:
            pages[cached + (pick - cached + 1) % (len(keys) - cached)] = pages[pick]
        elif slots == "past_limit":
            pages[pick] = [(SLOT_LIMIT + p - 1) // p * p + k for k in range(p)]
        indices = [s for page in pages for s in page] + [0] * (len(tokens) % p)
        if slots == "short":
            indices.pop()
        try:
            pc.insert_prefix(pc.PrefixCacheState(p, dict(self.model.entries), self.model.clock), tokens, indices, ns)
        except CacheError as exc:
            self.rejected(
                f"insert with {slots} slots", lambda: self.target.insert_prefix(tokens, indices, ns), type(exc)
            )

    @precondition(lambda self: self.target is not None and self.profile.errors != "none" and self.profile.namespaces)
    @rule(seq=seqs, namespace=bad_namespaces, insert=st.booleans())
    def bad_namespace(self, seq: tuple[int, ...], namespace: Any, insert: bool) -> None:
        assert self.target is not None
        STATS.record_rule("target.bad_namespace")
        tokens = list(seq)
        if insert:
            indices = list(range(len(tokens)))
            self.rejected(
                "insert, bad namespace", lambda: self.target.insert_prefix(tokens, indices, namespace), InvalidTypeError
            )
        else:
            self.rejected("match, bad namespace", lambda: self.target.match_prefix(tokens, namespace), InvalidTypeError)

    @precondition(lambda self: self.target is not None and self.profile.errors != "none")
    @rule(seq=seqs, extra=st.integers(1, 3))
    def insert_length_mismatch(self, seq: tuple[int, ...], extra: int) -> None:
        assert self.target is not None
        STATS.record_rule("target.insert_length_mismatch")
        tokens, indices = list(seq), list(range(len(seq) + extra))
        self.rejected(
            "insert, lengths differ", lambda: self.target.insert_prefix(tokens, indices, None), LengthMismatchError
        )

    # ------------------------------------------------------------ checks

    @invariant()
    def target_agrees_with_the_model(self) -> None:
        if self.target is None:
            return
        p = self.page_size
        check_invariants(self.model, locks=self.locks)
        STATS.record_tree(len(self.model.entries))
        expected = pc.size_info(self.model)
        actual = self.target.size_info()
        assert tuple(actual) == tuple(expected), (
            f"size_info: target {tuple(actual)}, the cached pages give {tuple(expected)} (P={p})"
        )
        if hasattr(self.target, "cached_pages"):
            content = self.target.cached_pages()
            model = {key: entry.slot_start for key, entry in self.model.entries.items()}
            if content != model:
                extra = sorted(set(content.items()) - set(model.items()), key=repr)[:4]
                missing = sorted(set(model.items()) - set(content.items()), key=repr)[:4]
                raise AssertionError(f"cached pages differ from the model: target has {extra}, lacks {missing}")
        if self.profile.clock == "logical" and hasattr(self.target, "page_stamps"):
            stamps = {key: entry.last_access for key, entry in self.model.entries.items()}
            assert self.target.page_stamps() == stamps, "page stamps differ from the spec's logical clock"
        if hasattr(self.target, "check_integrity"):
            self.target.check_integrity()
        if self.replayer is not None:
            # the replay invariant: the target's events so far describe exactly its cached pages
            before = self.replayer.applied
            events = self.target.take_events()
            if not self.event_namespaces:
                # a router that cannot tell namespaces apart sees token prefixes only
                events = [replace(e, namespace=None) if isinstance(e, ev.PageStored) else e for e in events]
            self.replayer.apply(events)
            STATS.events_replayed += self.replayer.applied - before
            cached = {key: entry.slot_start for key, entry in self.model.entries.items()}
            if not self.event_namespaces:
                cached = {(None, prefix): slot for (_, prefix), slot in cached.items()}
            ev.events_match_cache(self.replayer.cached(), cached)
        if self.profile.slots == "caller":
            owned = set(self.free)
            held = set(self.model_starts())
            assert not owned & held and len(owned) + len(held) == self.num_pages, (
                f"slot ledger: {len(owned)} free + {len(held)} cached != {self.num_pages} pages"
                f" (shared: {sorted(owned & held)[:8]})"
            )

    # ------------------------------------------------------------ eviction

    def checked_evict(self, amount: int) -> None:
        """target.evict(amount), with every page it gives back checked; the model follows."""
        assert self.target is not None
        stamps_before = self.stamps_if_sync()
        strict = self.strict_plan(div_ceil(amount, self.page_size))
        self.target.evict(amount)
        groups = self.target.take_evicted()
        self.apply_evictions(f"evict({amount})", groups, div_ceil(amount, self.page_size), stamps_before, strict)

    def make_room(self, pages: int) -> None:
        """Evict so that an insert finds free pages (as an engine's allocator would), if enough is evictable."""
        if (
            self.profile.eviction_trigger == "evict"
            and pages * self.page_size <= pc.size_info(self.model).evictable_size
        ):
            STATS.rules["target.evict[for an insert]"] += 1
            self.checked_evict(pages * self.page_size)

    def strict_plan(self, needed: int) -> pc.PrefixCacheState | None:
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
        """Check the pages a call gave back, unit by unit, and remove them from the model."""
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
                if self.profile.slots == "caller":
                    self.free.append(start)
            if needed is not None and self.profile.eviction_unit == "node" and number == len(groups) - 1:
                assert total < needed, f"{label}: evicted {total} pages before its last unit; {needed} were asked"
            total += len(keys)
            STATS.evicted_pages += len(keys)
        if total:
            # the pages one call gave back (an evict(), or an allocation that reused cached pages)
            STATS.record_reach(largest_evict_pages=total)
        if needed is not None:
            if self.profile.eviction_unit == "page":
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

    def expect_no_frees(self, label: str) -> None:
        """Calls other than evict (and, for allocating targets, insert) give nothing back."""
        assert self.target is not None
        groups = self.target.take_evicted()
        assert not groups, f"{label}: gave back slots {brief([brief(g) for g in groups], 2)} (only an eviction may)"

    def stamps_if_sync(self) -> dict[PageKey, Any] | None:
        """The target's clock before an eviction, when sync mode checks the oldest-first rule."""
        if self.LRU != "sync" or self.profile.clock == "none" or not hasattr(self.target, "page_stamps"):
            return None
        return dict(self.target.page_stamps())  # type: ignore[union-attr]

    # ------------------------------------------------------------ helpers

    def rejected(self, label: str, call: Any, error: type[CacheError]) -> None:
        """An invalid call: not sent to targets without validation; else the profile's error, nothing changed."""
        assert self.target is not None
        if self.profile.errors == "none":
            STATS.skipped[label] += 1
            return
        before = self.observe()
        try:
            call()
        except Exception as exc:
            if self.profile.errors == "ours":
                assert isinstance(exc, error), f"{label}: expected {error.__name__}, got {type(exc).__name__}: {exc}"
            assert self.observe() == before, f"{label}: raised {type(exc).__name__} but changed the cache"
            STATS.record_rejection(type(exc))
            return
        raise AssertionError(f"{label}: accepted; the spec rejects it with {error.__name__}")

    def observe(self) -> tuple[Any, ...]:
        """What a rejected call must leave unchanged: size info, content and stamps where exposed."""
        assert self.target is not None
        content = self.target.cached_pages() if hasattr(self.target, "cached_pages") else None
        return (tuple(self.target.size_info()), content, self.target.take_evicted())

    def check_handle(self, label: str, handle: Any, expected: pc.Handle) -> None:
        """The target's handle matches the spec's: same length, exactly the cached slots of that prefix."""
        assert self.target is not None
        got = self.target.cached_len(handle)
        assert got == expected.cached_len, f"{label}: cached_len {got}, the spec {expected.cached_len}"
        slots = self.target.matched_slots(handle)
        want = pc.get_matched_indices(self.model, expected)
        assert slots == want, (
            f"{label}: other slots than the cache holds for that prefix (got, held): {list_diff(slots, want)}"
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

    def outlived_reset(self, handle: TargetHandle) -> bool:
        """True for a handle made before a reset, on a target whose handles do not survive one."""
        return handle.epoch != self.epoch and not self.profile.handles_survive_reset

    def model_namespaces(self) -> set[Namespace]:
        return {namespace for namespace, _ in self.model.entries}

    def model_starts(self) -> list[int]:
        return [entry.slot_start for entry in self.model.entries.values()]

    def teardown(self) -> None:
        """The example's reach (the largest tree the model held) into the campaign's stats."""
        if self.target is None:
            return
        STATS.record_tree(len(self.model.entries))
