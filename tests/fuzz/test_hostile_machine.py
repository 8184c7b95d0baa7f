"""Each law of the hostile-input machine, seen failing on a planted bug (and holding without it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("torch")

from radixspec import optimized, reference
from radixspec.fuzz.hostile_machine import HostileMachine
from radixspec.spec.errors import InvalidInputError, OutOfPagesError


def machine(page_size: int = 1) -> HostileMachine:
    state = HostileMachine()
    state.setup(page_size=page_size)
    return state


def grown(page_size: int = 1) -> HostileMachine:
    """A machine whose caches hold pages and whose managers hold a live request."""
    state = machine(page_size)
    state.insert(tokens=[0, 1, 2, 3])
    state.manager_admit(tokens=[1, 1, 1])
    state.caches_are_intact_and_agree()
    return state


def test_the_laws_hold_on_our_caches() -> None:
    state = grown()
    state.call_at_a_domain_edge(what="size -1")
    state.manager_call_at_an_edge(what="a lying row", which=0)
    state.manager_call_at_an_edge(what="a request of the other manager", which=0)
    state.pool_store(what="valid", slots=[1, 2], layer=1, fast=False)
    state.pool_store(what="a slot past the pool", slots=[1, 2], layer=0, fast=True)
    state.manager_cache_req(which=0, finished=True)
    state.manager_call_at_an_edge(what="a released request", which=0)
    state.caches_are_intact_and_agree()


# ---------------------------------------------------------------- the prefix caches


def test_an_error_not_of_the_spec_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def evict(self: Any, size: int, out: Any = None) -> Any:
        raise RuntimeError("torch says no")

    monkeypatch.setattr(optimized.RadixPrefixCache, "evict", evict)
    with pytest.raises(AssertionError, match="raised builtins.RuntimeError: torch says no"):
        grown().call_at_a_domain_edge(what="size -1")


def test_an_outcome_other_than_the_specs_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    original = reference.RadixPrefixCache.evict
    monkeypatch.setattr(
        reference.RadixPrefixCache, "evict", lambda self, size: [] if size < 0 else original(self, size)
    )
    with pytest.raises(
        AssertionError,
        match=r"size -1\]: the spec raised InvalidSizeError\('cannot evict a negative .*'\), reference accepted it",
    ):
        grown().call_at_a_domain_edge(what="size -1")


def test_a_refusal_that_changes_the_cache_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    original = reference.RadixPrefixCache.evict

    def evict(self: Any, size: int) -> Any:
        original(self, 1)  # takes a page, then refuses
        raise InvalidInputError("no")

    monkeypatch.setattr(reference.RadixPrefixCache, "evict", evict)
    with pytest.raises(AssertionError, match=r"reference refused \(raised InvalidInputError\('no'\)\) and changed"):
        grown().call_at_a_domain_edge(what="size -1")


def test_a_cache_that_breaks_its_own_invariants_or_leaves_the_spec_fails() -> None:
    state = grown()
    state.impls[0].cache.evictable_size += 1
    with pytest.raises(Exception, match="size_counters_match_tree: counters say"):
        state.caches_are_intact_and_agree()
    state = grown()
    state.impls[1].cache.insert_prefix([9], [100])
    with pytest.raises(AssertionError, match="optimized holds other pages than the spec"):
        state.caches_are_intact_and_agree()


def test_a_hybrid_cache_that_answers_a_group_it_lacks_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixspec.reference.hybrid_cache import HybridRadixCache

    original = HybridRadixCache.size_info
    monkeypatch.setattr(
        HybridRadixCache, "size_info", lambda self, group: None if group == -1 else original(self, group)
    )
    with pytest.raises(
        AssertionError,
        match=r"hybrid call_at_an_edge\[group -1\]: the spec raised InvalidInputError.*, reference accepted it",
    ):
        grown().hybrid_call_at_an_edge(what="group -1")


def test_two_threads_that_break_a_cache_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    def lock(self: Any, handle: Any) -> None:
        raise RuntimeError("two callers at once")

    state = grown()
    monkeypatch.setattr(optimized.RadixPrefixCache, "lock", lock)
    with pytest.raises(AssertionError, match="optimized: not a named error: RuntimeError"):
        state.two_threads(rounds=2)


# ---------------------------------------------------------------- the managers


def test_a_manager_refusal_that_changes_the_manager_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def allocate_paged(self: Any, reqs: Any) -> None:
        self.free_slots.pop()  # loses a page, then refuses
        raise OutOfPagesError("no")

    monkeypatch.setattr(reference.CacheManager, "allocate_paged", allocate_paged)
    with pytest.raises(
        AssertionError,
        match=r"manager allocate_paged: reference refused \(raised OutOfPagesError\('no'\)\) and changed",
    ):
        machine().manager_admit(tokens=[1, 2])


def test_managers_that_disagree_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    original = reference.CacheManager.match_req
    monkeypatch.setattr(
        reference.CacheManager, "match_req", lambda self, req: None if req.input_ids == [] else original(self, req)
    )
    with pytest.raises(
        AssertionError, match="manager an empty prompt: reference accepted it, optimized raised InvalidRequestError"
    ):
        machine().manager_call_at_an_edge(what="an empty prompt", which=0)


def test_a_manager_that_loses_a_page_or_leaves_its_twin_fails() -> None:
    state = grown()
    state.managers[0][1].free_slots.pop()
    with pytest.raises(Exception, match="pages_are_partitioned"):
        state.caches_are_intact_and_agree()
    state = grown()
    manager = state.managers[0][1]
    manager.free_slots = manager.free_slots[::-1]  # still conserved, but not the order the other keeps
    with pytest.raises(AssertionError, match="the managers hold different states"):
        state.caches_are_intact_and_agree()


# ---------------------------------------------------------------- the KV pool


def test_a_store_that_writes_the_wrong_slot_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    original = optimized.MHAKVCache.store_kv
    monkeypatch.setattr(
        optimized.MHAKVCache, "store_kv", lambda self, k, v, loc, layer: original(self, k, v, loc + 1, layer)
    )
    with pytest.raises(AssertionError, match="layer 0's K cache holds other values than the stores wrote"):
        machine().pool_store(what="valid", slots=[0], layer=0, fast=False)


def test_a_refused_store_that_wrote_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    original = optimized.MHAKVCache.store_kv

    def store_kv(self: Any, k: Any, v: Any, loc: Any, layer: Any) -> None:
        original(self, k[:1], v[:1], loc[:1].long().clamp(0, 3), 0)
        raise InvalidInputError("half a store")

    monkeypatch.setattr(optimized.MHAKVCache, "store_kv", store_kv)
    with pytest.raises(AssertionError, match="holds other values than the stores wrote"):
        machine().pool_store(what="slots int16", slots=[1], layer=0, fast=False)


def test_a_fast_store_that_skips_a_row_without_flagging_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimized.MHAKVCache, "check_store_errors", lambda self: None)
    with pytest.raises(AssertionError, match="rows outside the pool skipped: True, the pool's flags: accepted it"):
        machine().pool_store(what="a slot past the pool", slots=[1, 2], layer=0, fast=True)


# ---------------------------------------------------------------- the readers


def test_a_reader_that_answers_noise_with_a_foreign_error_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("msgspec")
    from radixspec.optimized import kv_events

    def decode(payload: bytes) -> Any:
        raise KeyError("topic")

    monkeypatch.setattr(kv_events, "decode", decode)
    with pytest.raises(AssertionError, match="raised builtins.KeyError"):
        machine().decode_noise(payload=b"\x00")


def test_a_trace_error_that_does_not_name_the_line_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixspec.fuzz import replay

    def parse_request(*args: Callable[..., Any]) -> Any:
        raise ValueError("bad")

    monkeypatch.setattr(replay, "parse_request", parse_request)
    with pytest.raises(AssertionError, match="the error does not name the line: bad"):
        machine().read_a_hostile_trace_line(record={}, fmt="jsonl")
