"""The cache machine, part: the oracle: the spec decides what each call must give, or (a target with choices of its
own) the model follows the target once its choice is shown to be allowed; how calls, rejections and evictions are
judged."""

from __future__ import annotations

from collections.abc import Callable

from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import (
    CacheError,
    UnlockError,
)
from radixspec.spec.helpers import compute_page_starts, div_ceil

from ..differential import describe_difference
from ..judge import Outcome, expect_same
from ..messages import brief, list_diff
from ..stats import STATS
from ..targets.api import PageKey
from .base import FULL_CHECK_PAGES, Driven, HandleSet, describe
from .ledger import SlotLedger


class Oracle(SlotLedger):
    """The oracle: the spec decides what each call must give, or (a target with choices of its own) the model follows
    the target once its choice is shown to be allowed; how calls, rejections and evictions are judged."""

    def make_room(self, pages: int) -> None:
        """Evict so that an insert finds free pages (as an engine's allocator would), if enough is evictable."""
        if self.every(lambda p: p.eviction_trigger == "evict") and (
            pages * self.page_size <= pc.size_info(self.model).evictable_size
        ):
            STATS.rules["cache.evict[for an insert]"] += 1
            self.checked_evict(pages * self.page_size)

    def checked_evict(self, amount: int) -> None:
        """evict(amount) on every target, every page it gives back checked; the model follows."""
        pages = div_ceil(amount, self.page_size)
        if self.follow is None:
            want = pc.evict(self.model, amount)
            for run in self.runs:
                run.evicts.evict(amount)
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
        followed = self.follow
        stamps_before = self.stamps_if_sync()
        strict = self.strict_plan()
        followed.evicts.evict(amount)
        self.apply_evictions(f"evict({amount})", followed.target.take_evicted(), pages, stamps_before, strict)

    def strict_plan(self) -> pc.PrefixCacheState | None:
        """A copy of the model the spec's LRU will pop from (strict mode, spec LRU), or None."""
        if self.LRU != "strict" or self.lru_model is not None:
            return None
        return self.model.copy()

    def apply_evictions(
        self,
        label: str,
        groups: list[list[int]],
        needed: int | None,
        stamps: dict[PageKey, float] | None,
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

    def check_oldest(self, label: str, keys: list[PageKey], stamps: dict[PageKey, float], pinned: set[PageKey]) -> None:
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

    def stamps_if_sync(self) -> dict[PageKey, float] | None:
        """The followed target's clock before an eviction, when sync mode checks the oldest-first rule."""
        if self.LRU != "sync" or self.follow is None or self.follow.profile.clock == "none":
            return None
        stamps = self.follow.caps.stamps
        return None if stamps is None else dict(stamps.page_stamps())

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
                expect_same(label, Outcome.raised(error), Outcome.raised(exc), run.name, run.exact, errors)
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
        exact = run.caps.exact
        if exact is not None:
            return exact.abstract_state() if len(self.model.entries) <= FULL_CHECK_PAGES else exact.fingerprint()
        content = run.caps.pages.cached_pages() if run.caps.pages is not None else None
        return (tuple(run.target.size_info()), content, run.target.take_evicted())

    def expect_no_frees(self, run: Driven, label: str) -> None:
        """Calls other than evict (and, for allocating targets, insert) give nothing back."""
        groups = run.target.take_evicted()
        assert not groups, (
            f"{label}: {run.name} gave back slots {brief([brief(g) for g in groups], 2)} (only an eviction may)"
        )

    def check_handle(self, run: Driven, label: str, handle: object, expected: pc.Handle) -> None:
        """The target's handle matches the spec's: same length, exactly the cached slots of that prefix."""
        got = run.target.cached_len(handle)
        assert got == expected.cached_len, f"{label}: {run.name} cached_len {got}, the spec {expected.cached_len}"
        returned = run.target.get_matched_indices(handle)
        want = pc.get_matched_indices(self.model, expected)
        assert returned == want, (
            f"{label}: {run.name} returns other slots than the cache holds for that prefix (got, held):"
            f" {list_diff(returned, want)}"
        )

    def each(
        self,
        handle: HandleSet,
        label: str,
        error: CacheError | None,
        after_reset: type[CacheError] | None,
        call: Callable[[Driven, object], None],
    ) -> bool:
        """``call`` with each target's handle: rejected where the spec rejected (``error``), and for a handle
        from before a reset on targets whose handles do not survive one (``after_reset``, or UnlockError)."""
        for index, run in enumerate(self.runs):
            h = handle.handles[index]

            def bound(r: Driven, h: object = h) -> None:
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
