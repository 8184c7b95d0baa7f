"""The cache machine, part: the API's operations, with valid and invalid inputs: match, insert, lock, unlock,
get_matched_indices, evict, reset, bad slots, bad namespaces, and the C tree's own check, checked."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import MultipleResults, multiple, precondition, rule

from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import SLOT_LIMIT, Namespace
from radixspec.spec.errors import (
    IntegrityError,
    InvalidTypeError,
    NamespaceDepthError,
    StaleHandleError,
)
from radixspec.spec.helpers import compute_page_starts, compute_page_to_token

from ..messages import list_diff
from ..sequences import (
    bad_namespaces,
    namespaces,
)
from ..stats import STATS
from ..targets.api import PageKey
from .base import BAD_SLOTS, EVICT_SIZES, FILLER, RESET_AT_PAGES, SLOT_RANGES, Driven, HandleSet, handles, seqs
from .checks import Checks


class Operations(Checks):
    """The API's operations, with valid and invalid inputs: match, insert, lock, unlock, get_matched_indices, evict,
    reset, bad slots, bad namespaces, and the C tree's own check, checked."""

    @rule(target=handles, seq=seqs, namespace=namespaces)
    def match_prefix(self, seq: tuple[int, ...], namespace: Namespace) -> HandleSet:
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

    @rule(target=handles, seq=seqs, namespace=namespaces, where=st.sampled_from(SLOT_RANGES))
    def insert_prefix(
        self, seq: tuple[int, ...], namespace: Namespace, where: str = "low"
    ) -> HandleSet | MultipleResults[HandleSet]:
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
        cached = self.leading_cached_pages(keys)
        self.reach["longest_key_tokens"] = max(self.reach["longest_key_tokens"], len(tokens))
        if self.follow is not None and self.follow.profile.slots == "target":
            return self.insert_target_slots(tokens, keys, cached, ns)
        # a pool target gets fresh pages for every whole page (an engine's way: the duplicates freed after);
        # else fresh pages for the new ones only, and slots the cache must ignore for the rest
        fresh = len(keys) if self.bounded else len(keys) - cached
        if self.bounded and fresh > len(self.free):
            self.make_room(fresh - len(self.free))
            cached = self.leading_cached_pages(keys)
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
        slots = target.get_matched_indices(handle)
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

        def call(run: Driven, h: object) -> None:
            slots = run.target.get_matched_indices(h)
            assert slots == want, f"get_matched_indices of {run.name} (got, held): {list_diff(slots, want)}"

        self.each(handle, "get_matched_indices", error, StaleHandleError, call)

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
            plan = self.model.copy()
            error = self.spec_try(lambda: pc.evict(plan, amount))
            assert error is not None, f"the spec accepted evict({amount}) of {evictable} evictable tokens"
            self.rejected(f"evict({amount})", lambda run: run.evicts.evict(amount), error)
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
            plan = self.model.copy()
            error = self.spec_try(lambda: pc.reset(plan))
            assert error is not None, "the spec reset a cache with locked pages"
            self.rejected("reset", lambda run: run.resets.reset(), error)
            return
        held = sorted(compute_page_to_token(self.model_starts(), self.page_size))
        for run in self.runs:
            returned = run.resets.reset()
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

    @precondition(lambda self: bool(self.model.entries) and any(run.caps.own_checks for run in self.runs))
    @rule(pick=st.integers(0, 255), which=st.integers(0, 63), position=st.integers(0, 3))
    def break_the_tree(self, pick: int, which: int, position: int) -> None:
        """A target's own integrity check is checked (the self-check capability: the C tree's): one field of a
        node (a root's included) or one counter changed (the ``pick``-th the target can break) must fail
        ``check_integrity`` with the name of one of its invariants; put back, the check passes again (the field
        is the only thing changed)."""
        for run in self.runs:
            target = run.caps.own_checks
            if target is None:
                continue
            field, delta = target.breakable_fields[pick % len(target.breakable_fields)]
            STATS.record_rule(f"cache.break_the_tree[{field}]")
            delta *= self.page_size if field == "length" else 1
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
            assert caught.split(":")[0] in target.own_invariants, f"{run.name}: {caught!r} names none of its invariants"
            target.check_integrity()

    @rule(seq=seqs, namespace=namespaces, slots=st.sampled_from(BAD_SLOTS), which=st.integers(0, 15))
    def insert_bad_slots(self, seq: tuple[int, ...], namespace: Namespace, slots: str, which: int) -> None:
        """Bad slots for the new pages: rejected with the spec's error, nothing changed."""
        STATS.record_rule(f"cache.insert_bad_slots[{slots}]")
        p, ns, tokens = self.page_size, self.ns(namespace), list(seq)
        keys = pc.get_page_keys(self.model, ns, tokens)
        cached = self.leading_cached_pages(keys)
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
        plan = self.model.copy()
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
        plan = self.model.copy()

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

    def note_depth(self, handles: HandleSet) -> None:
        """The depth in nodes of a handle's path, from each target that can tell: a path of k pages has between
        1 and k nodes (none when it is empty), since a node holds at least a page and every page is in one."""
        pages = handles.spec.cached_len // self.page_size
        for run, handle in zip(self.runs, handles.handles, strict=True):
            if run.caps.depth is None:
                continue
            depth = run.caps.depth.path_nodes(handle)
            assert min(pages, 1) <= depth <= pages, (
                f"{run.name}: path_nodes is {depth} for a path of {pages} pages (1 to {pages} nodes expected)"
            )
            self.reach["deepest_path_nodes"] = max(self.reach["deepest_path_nodes"], depth)
