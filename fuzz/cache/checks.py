"""The cache machine, part: the checks after every step: sizes, KV events replayed, and the whole comparison (the
spec's invariants, each target's integrity, content or abstract state, stamps, metrics, the slot ledger)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis.stateful import invariant

from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.invariants import check_invariants

from ..differential import describe_difference
from ..stats import STATS
from ..targets.api import PageKey
from .base import CHECK_EVERY, FULL_CHECK_PAGES, Driven
from .oracle import Oracle


class Checks(Oracle):
    """The checks after every step: sizes, KV events replayed, and the whole comparison (the spec's invariants, each
    target's integrity, content or abstract state, stamps, metrics, the slot ledger)."""

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
            assert run.caps.events is not None  # a replayer is made for a target that emits events only
            events = run.caps.events.take_events()
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
            if run.caps.integrity is not None:
                run.caps.integrity.check_integrity()
            if run.caps.exact is not None:
                actual = run.caps.exact.abstract_state()
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
        if run.caps.pages is not None:
            actual = run.caps.pages.cached_pages()
            if actual != content:
                extra = sorted(set(actual.items()) - set(content.items()), key=repr)[:4]
                missing = sorted(set(content.items()) - set(actual.items()), key=repr)[:4]
                raise AssertionError(
                    f"cached pages of {run.name} differ from the model: it has {extra}, lacks {missing}"
                )
        if run.profile.clock == "logical" and run.caps.stamps is not None:
            stamps = {key: entry.last_access for key, entry in self.model.entries.items()}
            assert run.caps.stamps.page_stamps() == stamps, (
                f"page stamps of {run.name} differ from the spec's logical clock"
            )

    def compare_metrics(self) -> None:
        """Targets that count metrics count the same, and each namespace's pages are conserved:
        stored = cached now + evicted + dropped by reset."""
        counted = [(run.name, run.caps.metrics.stats()) for run in self.runs if run.caps.metrics is not None]
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
