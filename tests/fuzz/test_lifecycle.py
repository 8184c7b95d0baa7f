"""The lifecycle laws (fuzz/lifecycle.py), each seen holding on a small state and failing on a broken one."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixspec.fuzz.lifecycle import (
    CachedKV,
    KVCopy,
    LifecycleLaws,
    Pool,
    Prefixes,
    StateShadow,
    hit_law,
    laws_for,
    longest_hit,
)
from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError


@dataclass
class View:
    """A target's view: two groups (full attention, a window of 3), pages of 2, optional parts set per test."""

    windows: tuple[hy.Window, ...] = (None, 3)
    page_size: int = 2
    copies: list[KVCopy] = field(default_factory=list)

    def take_kv_copies(self) -> list[KVCopy]:
        copies, self.copies = self.copies, []
        return copies


def stored(laws: LifecycleLaws, req: HybridReq, tokens: int) -> None:
    """The machine's store: slots read before, the request's computed tokens advanced, the writes recorded."""
    slots, begin = laws.slots(req), req.computed
    req.computed += tokens
    laws.stored(req, begin, slots)


def written() -> tuple[LifecycleLaws, HybridReq, View]:
    """A request of 6 tokens stored in pages at slots 0, 2, 4 of both groups."""
    view = View()
    laws = LifecycleLaws(view)
    req = HybridReq(1, [5, 6, 7, 8, 9, 10], "a", rows=[[0, 2, 4], [0, 2, 4]])
    stored(laws, req, 6)
    return laws, req, view


def test_prefixes_intern_each_prefix_once_per_namespace() -> None:
    prefixes = Prefixes()
    ids = prefixes.extend([], "a", [1, 2, 3], 3)
    assert prefixes.extend([], "a", [1, 2, 9], 3)[:2] == ids[:2]
    assert prefixes.extend([], "b", [1, 2, 3], 3)[2] != ids[2]
    assert prefixes.of("a", (1, 2, 3)) == ids[2]
    assert prefixes.parents[ids[2]] == ids[1]
    # the spec's interned prefix names the same id, page by page from the longest known (here the first page's)
    first = pc.Prefix.extend(None, (1,))
    assert prefixes.of("a", first) == ids[0]
    assert prefixes.of("a", pc.Prefix.extend(first, (2, 3))) == ids[2]
    assert prefixes.of("b", pc.Prefix.extend(first, (2, 3))) == prefixes.of("b", (1, 2, 3)) != ids[2]


def test_a_request_that_reads_what_it_wrote_keeps_every_law() -> None:
    laws, req, _ = written()
    laws.check([req])
    # another request of the same prefix, sharing the first two pages, reads what the first wrote
    other = HybridReq(2, [5, 6, 7, 8, 1], "a", computed=4, rows=[[0, 2], [0, 2]])
    laws.check([req, other])


def test_attended_kv_is_the_requests_fails_on_a_slot_another_prefix_overwrote() -> None:
    laws, req, _ = written()
    intruder = HybridReq(2, [1, 2, 3, 4], "a", rows=[[10, 2], [10, 2]])
    stored(laws, intruder, 4)  # writes slots 2 and 3: the first request's second page
    with pytest.raises(IntegrityError, match="attended_kv_is_the_requests: request 1 attends group 0 slot 2"):
        laws.check([req])


def test_attended_kv_is_the_requests_tells_namespaces_and_groups_apart() -> None:
    laws, req, _ = written()
    salted = HybridReq(3, list(req.input_ids), "b", computed=6, rows=req.rows)
    with pytest.raises(IntegrityError, match="attended_kv_is_the_requests: request 3 .* holds KV of 1 tokens"):
        laws.check([salted])
    shared = LifecycleLaws(View())
    shared.pool_of = (0, 0)  # both groups in one pool (vLLM's): a block written for group 0, read by group 1
    req = HybridReq(1, [5, 6], "a", rows=[[0], [None]])
    stored(shared, req, 2)
    window = HybridReq(2, [5, 6], "a", computed=2, rows=[[0], [0]])
    with pytest.raises(IntegrityError, match="group 1 slot 0 .* holds group 0's KV of 1 tokens"):
        shared.check([window])


def test_the_safety_law_comes_first_and_attended_pages_stay_put() -> None:
    laws, req, _ = written()
    req.rows[1][2] = None
    with pytest.raises(IntegrityError, match="^attended_pages_are_held: request 1, group 1"):
        laws.check([req])
    laws, req, _ = written()
    laws.check([req])
    req.rows[0][0] = 40
    with pytest.raises(IntegrityError, match="attended_pages_stay_put: request 1: attended page \\(0, 0\\) moved"):
        laws.check([req])
    laws.finished(req.uid, cached=False)  # cache_req may move them
    stored(laws, req, 0)


def test_copies_carry_the_kv_and_a_copy_of_nothing_clears() -> None:
    laws, req, view = written()
    view.copies = [KVCopy(0, 2, 20, 2), KVCopy(0, 90, 4, 2)]
    laws.copied()
    copy = HybridReq(2, [5, 6, 7, 8], "a", computed=4, rows=[[0, 20], [0, 2]])
    laws.check([copy])
    with pytest.raises(IntegrityError, match="request 1 attends group 0 slot 4 for position 4, which holds nothing"):
        laws.check([req])


def test_pages_are_partitioned_names_the_pool() -> None:
    laws = LifecycleLaws(View())
    laws.pages_are_partitioned([Pool("full", 2, 3, 1, 6)])
    with pytest.raises(IntegrityError, match="^SWA pages_are_partitioned: free 2 \\+ cached 3 \\+ private 0 != 6"):
        laws.pages_are_partitioned([Pool("full", 2, 3, 1, 6), Pool("SWA", 2, 3, 0, 6)])


def test_cached_blocks_hold_their_prefix_reads_every_position_of_the_page() -> None:
    laws = written()[0]
    laws.cached_blocks_hold_their_prefix([CachedKV(0, "a", (5, 6, 7, 8), range(2, 4))])
    laws.cached_blocks_hold_their_prefix([CachedKV(0, "a", (5, 6, 7), range(2, 4))])
    stale = "cached_blocks_hold_their_prefix: slot 5 \\(position 5\\) .* holds KV of 6 tokens"
    with pytest.raises(IntegrityError, match=stale):
        laws.cached_blocks_hold_their_prefix([CachedKV(0, "a", (5, 6, 7, 8, 1, 1), range(4, 6))])
    with pytest.raises(IntegrityError, match="cached_blocks_hold_their_prefix: slot 3 .* group 1"):
        laws.cached_blocks_hold_their_prefix([CachedKV(1, "a", (5, 6, 7, 9), range(2, 4))])


def test_a_state_slot_holds_the_state_it_is_read_as() -> None:
    shadow = StateShadow()
    shadow.write(3, "a", (1, 2))
    shadow.copy(3, 4)
    shadow.expect("state_law", "request 1", 4, "a", (1, 2))
    shadow.copy(9, 4)
    with pytest.raises(IntegrityError, match="^state_law: request 1 reads state slot 4, which holds no state"):
        shadow.expect("state_law", "request 1", 4, "a", (1, 2))
    shadow.clear(3)
    with pytest.raises(IntegrityError, match="holds no state"):
        shadow.expect("state_law", "request 1", 3, "a", (1, 2))


def test_each_tree_core_gets_laws_of_its_own() -> None:
    class Both:
        def __init__(self) -> None:
            self.cores = [("rust", View()), ("python", View())]

    laws = laws_for(Both())
    assert [law.label for law in laws] == ["rust core: ", "python core: "]
    assert len(laws_for(View())) == 1


def test_the_hit_law_is_the_longest_valid_match_or_with_a_window_a_valid_one_never_longer() -> None:
    # one full-attention group and a window of 3 tokens, pages of 2: the window group lacks the page ending at 4
    rule = hr.HitRule(2, (None, 3), 2)

    def cached(group: int, end: int) -> bool:
        return end <= 8 and (group == 0 or end != 4)

    assert hit_law(1, 8, rule, cached, 9, 9, "pages") == 8
    with pytest.raises(IntegrityError, match="^hit_is_the_longest_valid_match: request 1 hit 6 of 9 tokens; by pages"):
        hit_law(1, 6, rule, cached, 9, 9, "pages")
    assert hit_law(1, 6, rule, cached, 9, 9, "pages", exact=False) == 8  # shorter and valid: the caller counts it
    with pytest.raises(IntegrityError, match="^hit_is_a_valid_match: request 1 hit 4 of 9"):
        hit_law(1, 4, rule, cached, 9, 9, "pages", exact=False)  # the window's page ending at 4 is not cached
    with pytest.raises(IntegrityError, match="^hit_is_a_valid_match: request 1 hit 10 of 9"):
        hit_law(1, 10, rule, cached, 9, 9, "pages", exact=False)


@st.composite
def hit_problems(draw: st.DrawFn) -> tuple[hr.HitRule, frozenset[tuple[int, int]], int, int, int]:
    """A hit rule (any kinds, unit, lookahead, drop), what a cache holds (entries by group and end), and the
    prompt's known tokens, limit and margin."""
    p = draw(st.integers(1, 8))
    kinds = draw(st.lists(st.one_of(st.none(), st.integers(1, 3 * p + 2), st.just(hr.STATE)), min_size=1, max_size=3))
    unit = draw(st.sampled_from([d for d in range(1, p + 1) if p % d == 0]))
    rule = hr.new_hit_rule(p, kinds, unit, draw(st.integers(0, 1)), draw(st.integers(0, 2)))
    known = draw(st.integers(0, 12 * p))
    # mostly a cached run from the start (as caches hold prefixes), with holes
    run = draw(st.integers(0, known + p))
    holes = draw(st.sets(st.tuples(st.integers(0, len(kinds) - 1), st.integers(1, known + 2 * p)), max_size=6))
    cached = {(g, end) for g in range(len(kinds)) for end in range(1, run + 1)} ^ holes
    limit, margin = draw(st.integers(0, known)), draw(st.integers(0, p))
    return rule, frozenset(cached), known, limit, margin


@settings(max_examples=600, deadline=None)
@given(hit_problems())
def test_longest_hit_is_the_spec_hit(problem: tuple[hr.HitRule, frozenset[tuple[int, int]], int, int, int]) -> None:
    """The adapters' hit law reads ``longest_hit`` (linear in the prompt); it is the spec's ``compute_hit``."""
    rule, cached, known, limit, margin = problem

    def is_cached(group: int, end: int) -> bool:
        return (group, end) in cached

    assert longest_hit(rule, is_cached, known, limit, margin) == hr.compute_hit(rule, is_cached, known, limit, margin)


def test_a_slot_overwritten_after_it_was_checked_is_read_again() -> None:
    """The check reads again only what changed since it last passed (new positions, slots written since): a page
    the first check found its own, overwritten by another request's store or by a copy, still fails."""
    laws, req, view = written()
    laws.check([req])
    intruder = HybridReq(2, [1, 2, 3, 4], "a", rows=[[10, 2], [10, 2]])
    stored(laws, intruder, 4)  # writes slots 2 and 3: the first request's second page, checked already
    with pytest.raises(IntegrityError, match="attended_kv_is_the_requests: request 1 attends group 0 slot 2"):
        laws.check([req])
    laws, req, view = written()
    laws.check([req])
    view.copies.append(KVCopy(0, 10, 4, 2, None))  # the worker copies two empty slots over the third page
    laws.copied()
    with pytest.raises(IntegrityError, match="attended_kv_is_the_requests: request 1 attends group 0 slot 4"):
        laws.check([req])


def test_a_check_that_passed_reads_only_the_new_positions_after() -> None:
    """Past a passing check, an unchanged request costs nothing per position: the shadow is not read for it."""
    laws, req, _ = written()
    laws.check([req])
    assert shadow_reads(laws, [req]) == 0


def shadow_reads(laws: LifecycleLaws, live: list[HybridReq]) -> int:
    """How many times a check of ``live`` reads the shadow (the check must pass)."""
    reads = 0
    shadow = laws.shadow

    class Counting(dict[int, tuple[int, int]]):
        def get(self, key: int, default: object = None) -> object:  # type: ignore[override]
            nonlocal reads
            reads += 1
            return shadow.get(key, default)

    laws.shadow = Counting(shadow)
    try:
        laws.check(live)
    finally:
        laws.shadow = shadow
    return reads


def test_a_cached_page_written_after_it_was_checked_is_read_again_and_an_untouched_one_is_not() -> None:
    """The cached pages' law reads again only the whole pages whose slots the shadow wrote since it last passed;
    a page named by the spec's interned prefix is the page named by its tokens."""
    laws, _, view = written()
    page = CachedKV(0, "a", pc.Prefix.extend(pc.Prefix.extend(None, (5, 6)), (7, 8)), range(2, 4))
    view.cached_kv = lambda: [page]  # type: ignore[attr-defined]
    laws.check([])
    assert shadow_reads(laws, []) == 0
    intruder = HybridReq(2, [1, 2, 3, 4], "a", rows=[[10, 2], [10, 2]])
    stored(laws, intruder, 4)  # writes slots 2 and 3: the cached page, checked already
    with pytest.raises(IntegrityError, match="cached_blocks_hold_their_prefix: slot 3 \\(position 3\\)"):
        laws.check([])
