"""Each law of the manager's relations, broken alone, is reported in its own words: operation, then law.

A correct transition is observed on the reference manager; one field of the state or view after it is then
changed so that exactly one law breaks, and the relation must say which (the first law it checks that fails).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from radixspec.fuzz.targets.ours import ReferenceManager
from radixspec.spec import cache_manager as sm
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError, InvalidRequestError, OutOfPagesError
from radixspec.spec.requests import Req

from .managers import PROMPT, admitted, manager_with_a_cached_prefix, observe


def restamped(state: sm.ManagerState) -> sm.ManagerState:
    """The same pages, the cache's clock one tick on: a cache the relation did not predict."""
    cache = pc.PrefixCacheState(state.page_size, dict(state.cache.entries), state.cache.clock + 1)
    return replace(state, cache=cache)


def moved_free_page(state: sm.ManagerState) -> sm.ManagerState:
    return replace(state, free_slots=state.free_slots[1:])


def law(relation: Any, *args: Any, **kwargs: Any) -> str:
    """The message of the law ``relation(*args)`` reports broken."""
    with pytest.raises(sm.ManagerLawError) as raised:
        relation(*args, **kwargs)
    return str(raised.value)


def test_the_match_relations_laws() -> None:
    manager, _ = manager_with_a_cached_prefix()
    req = manager.new_req([1, 1, 2, 2, 9], 2, None, 7)
    before, view = observe(manager, req)
    handle: Any = manager.match_req(req)
    after = manager.abstract_state()
    sm.match_req(before, after, view, handle.cached_len, None)
    assert after.cache != before.cache  # a match stamps the path it matched
    assert (
        law(sm.match_req, before, after, view, handle.cached_len, InvalidRequestError)
        == "match_req(7): the guards say accepted, the implementation rejected with InvalidRequestError"
    )
    empty = replace(view, input_ids=())
    sm.match_req(before, before, empty, 0, InvalidRequestError)
    assert (
        law(sm.match_req, before, moved_free_page(before), empty, 0, InvalidRequestError)
        == "match_req(7): changed the cache or the free pages"
    )
    assert (
        law(sm.match_req, before, after, empty, 0, None)
        == "match_req(7): the guards say rejected with InvalidRequestError, the implementation accepted"
    )
    assert law(sm.match_req, before, after, view, 2, None) == "match_req(7): matched 2 tokens, the cache holds 4"
    assert (
        law(sm.match_req, before, before, view, 4, None)
        == "match_req(7): the cache after it is not the cache after that match"
    )
    assert law(sm.match_req, before, moved_free_page(after), view, 4, None) == "match_req(7): changed the free pages"


def test_the_lock_relations_laws() -> None:
    manager, _ = manager_with_a_cached_prefix()
    req = manager.new_req([1, 1, 2, 2, 9], 2, None, 7)
    handle: Any = manager.match_req(req)
    before = manager.abstract_state()
    manager.lock(handle)
    after = manager.abstract_state()
    spec_handle = manager.spec_handle(handle)
    sm.lock(before, after, spec_handle)
    assert law(sm.lock, before, before, spec_handle) == "lock: the cache after it is not the cache after that lock"
    assert law(sm.lock, before, moved_free_page(after), spec_handle) == "lock: changed the free pages"


def allocation() -> tuple[sm.ManagerState, sm.ManagerState, sm.RequestView, sm.RequestView]:
    """Positions [4, 8) of the request: two of the three free pages, nothing evicted."""
    manager, req = manager_with_a_cached_prefix()
    manager.set_lengths(req, 4, 8)
    before, view_before = observe(manager, req)
    manager.allocate_paged([req])
    after, view_after = observe(manager, req)
    sm.allocate_paged(before, after, [view_before], [view_after], None)
    return before, after, view_before, view_after


def test_the_allocation_relations_guard_laws() -> None:
    before, after, view_before, view_after = allocation()
    op = "allocate_paged: "
    assert law(sm.allocate_paged, before, after, [view_before], [view_after], OutOfPagesError) == (
        op + "the guards say accepted, the implementation rejected with OutOfPagesError"
    )
    too_long = replace(view_before, device_len=9)
    sm.allocate_paged(before, before, [too_long], [too_long], InvalidRequestError)
    assert (
        law(sm.allocate_paged, before, moved_free_page(before), [too_long], [too_long], InvalidRequestError)
        == op + "changed the cache or the free pages"
    )


def test_the_allocation_relations_laws_on_each_request() -> None:
    before, after, view_before, view_after = allocation()
    row = view_after.row
    op = "allocate_paged: request 1: "

    def broken_row(new_row: tuple[int, ...]) -> str:
        return law(sm.allocate_paged, before, after, [view_before], [replace(view_after, row=new_row)], None)

    assert (
        law(sm.allocate_paged, before, after, [view_before], [replace(view_after, alloc_len=6)], None)
        == op + "alloc_len 6, not 8"
    )
    assert broken_row((row[2], row[3], row[0], row[1], *row[4:])) == op + "changed the pages it already had"
    assert broken_row((*row[:4], row[4] + 1, row[4] + 2, row[6], row[7])) == op + (
        "its new positions are not whole aligned pages"
    )
    sm.allocate_paged(before, after, [view_before], [replace(view_after, row=(*row[:4], *row[6:], *row[4:6]))], None)
    assert broken_row((*row[:4], row[5], row[4], *row[6:])) == op + "its new positions are not whole aligned pages"


def test_the_allocation_relations_laws_on_the_pages() -> None:
    before, after, view_before, view_after = allocation()
    row = view_after.row
    op = "allocate_paged: "
    spare = after.free_slots[0]
    gained = pc.PrefixCacheState(after.page_size, dict(after.cache.entries), after.cache.clock)
    pc.insert_prefix(gained, [7, 7], [spare, spare + 1], None)
    assert law(sm.allocate_paged, before, replace(after, cache=gained), [view_before], [view_after], None) == (
        op + "the cache gained pages"
    )
    assert law(sm.allocate_paged, before, restamped(after), [view_before], [view_after], None) == (
        op + "the cache after it is not the cache after evicting the LRU pages"
    )
    leaf = max(after.cache.entries, key=lambda key: len(key[1]))
    lost = pc.PrefixCacheState(after.page_size, dict(after.cache.entries), after.cache.clock)
    del lost.entries[leaf]
    assert law(sm.allocate_paged, before, replace(after, cache=lost), [view_before], [view_after], None) == (
        op + "evicted 1 pages, the free list lacked 0"
    )
    twice = replace(view_after, row=(*row[:4], row[4], row[5], row[4], row[5]))
    assert law(sm.allocate_paged, before, after, [view_before], [twice], None) == (op + "gave a page to two positions")
    cached = replace(view_after, row=(*row[:4], row[4], row[5], row[0], row[1]))
    assert law(sm.allocate_paged, before, after, [view_before], [cached], None) == (
        op + f"gave pages [{row[0]}] that were neither free nor evicted"
    )
    assert law(sm.allocate_paged, before, moved_free_page(after), [view_before], [view_after], None) == (
        op + "the free pages after it are not the free and evicted pages less the new ones"
    )
    assert law(sm.allocate_paged, before, replace(after, lazy_frees=[]), [view_before], [view_after], None) == (
        op + "changed the pages held in the lazy free region"
    )
    others = {9: view_before}
    sm.allocate_paged(before, after, [view_before], [view_after], None, others, dict(others))
    assert law(sm.allocate_paged, before, after, [view_before], [view_after], None, others, {}) == (
        op + "changed request 9, which it was not called on"
    )


def test_the_allocation_relation_counts_the_evicted_pages() -> None:
    """Three pages, two cached and unlocked: positions [0, 6) of a new prompt take the free one and evict two."""
    manager = ReferenceManager(num_pages=3, page_size=2, rows=2, max_seq_len=8)
    first = admitted(manager, [1, 1, 2, 2, 9], 0, 0)
    manager.set_lengths(first, 0, 5)
    manager.allocate_paged([first])
    manager.set_lengths(first, 5, 5)
    manager.cache_req(first, True)
    req = admitted(manager, [5, 5, 6, 6, 7, 7], 1, 1)
    manager.set_lengths(req, 0, 6)
    before, view_before = observe(manager, req)
    manager.allocate_paged([req])
    after, view_after = observe(manager, req)
    sm.allocate_paged(before, after, [view_before], [view_after], None)
    assert not after.cache.entries and not after.free_slots
    kept = replace(after, cache=before.cache)
    assert law(sm.allocate_paged, before, kept, [view_before], [view_after], None) == (
        "allocate_paged: evicted 0 pages, the free list lacked 2"
    )


def cached_twice() -> tuple[ReferenceManager, Req, Req]:
    """Two requests on PROMPT, each with its own copy of page (3 3); the twin's copy cached first."""
    manager, req = manager_with_a_cached_prefix()
    twin = admitted(manager, PROMPT, 2, 2)
    for r in (req, twin):
        manager.set_lengths(r, 4, 6)
    manager.allocate_paged([req, twin])
    for r in (req, twin):
        manager.set_lengths(r, 6, 6)
    manager.cache_req(twin, False)
    return manager, req, twin


def cache(manager: ReferenceManager, req: Req, finished: bool) -> tuple[Any, ...]:
    """(before, after, view before, view after) of a cache_req that satisfies its relation."""
    before, view_before = observe(manager, req)
    manager.cache_req(req, finished)
    after, view_after = observe(manager, req)
    sm.cache_req(before, after, view_before, view_after, finished, None)
    return before, after, view_before, view_after


def test_the_cache_relations_guard_laws() -> None:
    manager, req, _ = cached_twice()
    before, after, view_before, view_after = cache(manager, req, False)
    op = "cache_req(finished=False): "
    assert law(sm.cache_req, before, after, view_before, view_after, False, InvalidRequestError) == (
        op + "the guards say accepted, the implementation rejected with InvalidRequestError"
    )
    outside = replace(view_before, table_idx=3)
    sm.cache_req(before, before, outside, outside, False, InvalidRequestError)
    assert law(sm.cache_req, before, moved_free_page(before), outside, outside, False, InvalidRequestError) == (
        op + "changed the cache or the free pages"
    )


def test_the_cache_relations_laws_unfinished() -> None:
    manager, req, _ = cached_twice()
    before, after, view_before, view_after = cache(manager, req, False)
    op = "cache_req(finished=False): "

    def broken(state: sm.ManagerState = after, view: sm.RequestView = view_after, **kw: Any) -> str:
        return law(sm.cache_req, before, state, view_before, view, False, None, **kw)

    assert broken(restamped(after)) == op + "the cache after it is not the cache after that insert, unlock and lock"
    assert broken(moved_free_page(after)) == op + "the free pages after it are not the free and freed ones"
    assert broken(replace(after, lazy_frees=[])) == op + "opened a lazy free region"
    assert broken(view=replace(view_after, handle=view_before.handle)) == (
        op + "the request's path is not the one inserted"
    )
    stale = replace(view_after, row=view_before.row)  # mini-sglang's #142: the row keeps the page it freed
    assert broken(view=stale) == op + "rows_match_handles: the row's cached part is not the cache's slots"
    assert broken(view=replace(view_after, alloc_len=8)) == op + "changed alloc_len"
    assert broken(others_before={9: view_before}, others_after={}) == (
        op + "changed request 9, which it was not called on"
    )


def test_the_cache_relation_keeps_the_row_past_the_cached_part() -> None:
    manager, req = manager_with_a_cached_prefix()
    manager.set_lengths(req, 4, 8)
    manager.allocate_paged([req])
    manager.set_lengths(req, 6, 8)
    before, after, view_before, view_after = cache(manager, req, False)
    row = view_after.row
    assert len(row) == 8 and view_after.handle is not None and view_after.handle.cached_len == 6
    swapped = replace(view_after, row=(*row[:6], row[7], row[6]))
    assert law(sm.cache_req, before, after, view_before, swapped, False, None) == (
        "cache_req(finished=False): changed the row past the cached part"
    )


def test_the_cache_relations_laws_finished() -> None:
    manager, req, _ = cached_twice()
    before, after, view_before, view_after = cache(manager, req, True)
    op = "cache_req(finished=True): "
    assert law(
        sm.cache_req, before, after, view_before, replace(view_after, handle=view_before.handle), True, None
    ) == (op + "did not release the request")
    assert law(sm.cache_req, before, after, view_before, replace(view_after, alloc_len=2), True, None) == (
        op + "did not release the request"
    )
    duplicate = view_before.row[4]
    already_free = replace(before, free_slots=[*before.free_slots, duplicate])
    assert law(sm.cache_req, already_free, after, view_before, view_after, True, None) == (
        op + f"freed pages [{duplicate}] that were free already (a double free)"
    )
    # the row's tail past the new path (finished: freed) holds the duplicate page again
    row = view_before.row
    doubled = replace(view_before, row=(*row, row[4], row[5]), alloc_len=8)
    assert law(sm.cache_req, before, after, doubled, view_after, True, None) == op + "freed a page twice"


def test_the_cache_relations_laws_inside_a_lazy_region() -> None:
    manager, req, _ = cached_twice()
    region = manager.lazy_free_region()
    region.__enter__()
    before, view_before = observe(manager, req)
    manager.cache_req(req, True)
    inside, view_inside = observe(manager, req)
    sm.cache_req(before, inside, view_before, view_inside, True, None)
    assert inside.lazy_frees == [view_before.row[4]]
    op = "cache_req(finished=True): "
    at_once = replace(inside, free_slots=[*inside.free_slots, *inside.lazy_frees], lazy_frees=[])
    assert law(sm.cache_req, before, at_once, view_before, view_inside, True, None) == (
        op + "freed pages inside a lazy region at once"
    )
    assert law(sm.cache_req, before, replace(inside, lazy_frees=[]), view_before, view_inside, True, None) == (
        op + "the held pages after it are not the held and freed ones"
    )
    region.__exit__(None, None, None)
    after = manager.abstract_state()
    sm.lazy_free_region(inside, after)
    op = "lazy_free_region (exit): "
    assert law(sm.lazy_free_region, inside, replace(after, lazy_frees=[])) == op + "left the region open"
    assert law(sm.lazy_free_region, inside, replace(inside, lazy_frees=None)) == (
        op + "the free pages after it are not the free and the held ones"
    )
    assert law(sm.lazy_free_region, inside, restamped(after)) == op + "changed the cache"


def test_the_manager_invariants_name_themselves() -> None:
    manager, req = manager_with_a_cached_prefix()
    manager.set_lengths(req, 4, 8)
    manager.allocate_paged([req])
    state = manager.abstract_state()
    live = [replace(req, cache_handle=manager.spec_handle(req.cache_handle))]
    sm.check_manager_invariants(state, live)
    cached = sorted(sm.cached_pages(state))
    private = state.page_table[1][4:8]
    free = state.free_slots[0]

    def broken(state: sm.ManagerState, live: list[Req] = live) -> str:
        with pytest.raises(IntegrityError) as raised:
            sm.check_manager_invariants(state, live)
        return str(raised.value)

    assert broken(state, live * 2) == "live_requests_hold_distinct_rows: live requests share rows: [1, 1]"
    assert broken(state, [replace(live[0], cache_handle=None)]) == (
        "live_requests_hold_distinct_rows: requests [1] are live but were released"
    )
    table = [list(row) for row in state.page_table]
    table[1][4:6] = [private[1], private[0]]
    assert broken(replace(state, page_table=table)) == (
        f"private_rows_are_page_runs: row 1: positions 0..1 map to [{private[1]}, {private[0]}]"
    )
    assert broken(replace(state, free_slots=[*state.free_slots, cached[0]])) == (
        f"pages_are_partitioned: 1 pages have two owners, e.g. page {cached[0]}: ['free', 'cached']"
    )
    assert broken(replace(state, free_slots=[*state.free_slots, private[0]])) == (
        f"pages_are_partitioned: 1 pages have two owners, e.g. page {private[0]}: ['free', 'request row 1']"
    )
    assert broken(replace(state, free_slots=[])) == (
        f"pages_are_partitioned: free 0 + cached 2 + private 2 != num_pages 5: leaked pages [{free}], unknown pages []"
    )


def test_a_batch_sharing_a_row_is_named() -> None:
    reqs = [Req([1], 2, 0, uid=0), Req([2], 0, 0, uid=1), Req([3], 2, 0, uid=2)]
    with pytest.raises(InvalidRequestError) as raised:
        sm.check_distinct_rows(reqs)
    assert str(raised.value) == "two requests of one batch share a page-table row: [0, 2, 2]"


def test_the_guards_at_their_edges() -> None:
    manager, req = manager_with_a_cached_prefix()
    manager.set_lengths(req, 4, 4)
    state, view = observe(manager, req)
    assert (view.table_idx, view.alloc_len, len(state.page_table)) == (1, 4, 3)
    assert sm.request_guard(state, view) is None
    assert sm.request_guard(state, replace(view, table_idx=3)) is InvalidRequestError  # one past the last row
    assert sm.request_guard(state, replace(view, table_idx=-1)) is InvalidRequestError
    assert sm.request_guard(state, replace(view, alloc_len=3)) is InvalidRequestError  # not a page boundary
    assert sm.request_guard(state, replace(view, alloc_len=8)) is None  # the row's end
    assert sm.request_guard(state, replace(view, alloc_len=10)) is InvalidRequestError
    assert sm.request_guard(state, replace(view, handle=None)) is InvalidRequestError
    # the batch guard asks each request's guard first, then its lengths
    assert sm.allocate_paged_guard(state, [replace(view, handle=None)]) is InvalidRequestError
    assert sm.allocate_paged_guard(state, [view]) is None  # cached_len == device_len: nothing to allocate
    assert sm.allocate_paged_guard(state, [replace(view, device_len=3)]) is InvalidRequestError
    assert sm.allocate_paged_guard(state, [replace(view, device_len=8)]) is None
    assert sm.allocate_paged_guard(state, [replace(view, device_len=9)]) is InvalidRequestError


def test_a_law_names_at_most_eight_pages() -> None:
    """P=1 and a request of ten tokens: nine pages at fault, the first eight named."""
    manager = ReferenceManager(num_pages=12, page_size=1, rows=2, max_seq_len=12)
    req = admitted(manager, list(range(1, 11)), 0, 0)
    manager.set_lengths(req, 0, 10)
    before, view_before = observe(manager, req)
    manager.allocate_paged([req])
    after, view_after = observe(manager, req)
    sm.allocate_paged(before, after, [view_before], [view_after], None)
    made_up = replace(view_after, row=(100, *range(101, 110)))  # pages the pool never had
    assert law(sm.allocate_paged, before, after, [view_before], [made_up], None) == (
        f"allocate_paged: gave pages {list(range(100, 108))} that were neither free nor evicted"
    )
    manager.set_lengths(req, 1, 10)
    before, after, view_before, view_after = cache(manager, req, True)  # frees the nine pages past the first
    tail = list(view_before.row[1:10])
    already_free = replace(before, free_slots=[*before.free_slots, *tail])
    assert law(sm.cache_req, already_free, after, view_before, view_after, True, None) == (
        f"cache_req(finished=True): freed pages {sorted(tail)[:8]} that were free already (a double free)"
    )
