"""The spec of tiers (spec/tiers.py): each operation's effects, each refusal changing nothing, every law seen
failing on a state that breaks it, and the laws holding along random programs that play the executor too."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from radixspec.fuzz.tiered_machine import Prompt, TieredMachine
from radixspec.spec import tiers as t
from radixspec.spec.errors import (
    CacheBusyError,
    CacheError,
    EvictionError,
    IntegrityError,
    InvalidTypeError,
    StaleHandleError,
    StorageOfflineError,
)
from radixspec.spec.prefix_cache import PageKey, Prefix

A, B, C = [1, 2, 3, 4], [1, 2, 5, 6], [7, 8]


def key(*tokens: int) -> PageKey:
    """The key of ``tokens`` in pages of 2."""
    prefix = None
    for start in range(0, len(tokens), 2):
        prefix = Prefix.extend(prefix, tuple(tokens[start : start + 2]))
    assert prefix is not None
    return (None, prefix)


def slots(pages: list[int], page_size: int = 2) -> list[int]:
    return [page + offset for page in pages for offset in range(page_size)]


def cache(state: t.TieredState, tokens: list[int]) -> t.TieredInsertResult:
    """A request's prefill: device pages for the tokens past the device hit (locked meanwhile), then the insert;
    the pages it could not cache (past a page being loaded back) go back."""
    p = state.page_size
    match = t.match_prefix(state, tokens)
    t.lock(state, match.handle)
    pages = t.allocate(state, (len(tokens) - match.device_len) // p)
    result = t.insert_prefix(state, tokens, [0] * match.device_len + slots(pages, p))
    t.free(state, pages[(result.handle.cached_len - match.device_len) // p :])
    t.unlock(state, match.handle)
    return result


def only(state: t.TieredState, kind: t.TransferKind) -> int:
    (found,) = [number for number, transfer in state.transfers.items() if transfer.kind == kind]
    return found


def healthy() -> t.TieredState:
    """A, then C, each backed up and stored; C evicted to the host tier; B (sharing A's first page) backing up;
    A locked; C loading back."""
    state = t.new_state(2, device_pages=6, host_pages=6, storage_pages=8, policy="write_through")
    cache(state, A)
    t.complete_transfer(state, only(state, "backup"))
    t.complete_transfer(state, only(state, "store"))
    cache(state, C)
    t.complete_transfer(state, only(state, "backup"))
    t.complete_transfer(state, only(state, "store"))
    t.lock(state, t.match_prefix(state, A).handle)
    assert t.evict_device(state, 1) == [4]
    cache(state, B)
    assert t.load_back(state, C) is not None
    return state


def with_transfer_source(state: t.TieredState, source: tuple[int, ...]) -> t.TieredState:
    number = only(state, "load_back")
    state.transfers[number] = dataclasses.replace(state.transfers[number], source=source)
    return state


def edited(change: Callable[[t.TieredState], object]) -> Callable[[t.TieredState], t.TieredState]:
    def apply(state: t.TieredState) -> t.TieredState:
        change(state)
        return state

    return apply


BROKEN: dict[str, Callable[[t.TieredState], t.TieredState]] = {
    "entries_are_prefix_closed": edited(lambda s: s.entries.pop(key(1, 2))),
    "entries_have_a_copy": edited(lambda s: setattr(s.entries[key(7, 8)], "host", None)),
    "device_copies_are_prefix_closed": edited(lambda s: setattr(s.entries[key(1, 2)], "device", None)),
    "locked_pages_are_on_the_device": edited(lambda s: setattr(s.entries[key(7, 8)], "ref_count", 1)),
    "copies_hold_their_prefix": edited(
        lambda s: s.host_kv.update({s.entries[key(1, 2)].host: t.Written(key(1, 2, 3, 4), s.epoch)})
    ),
    "reset_left_no_copy": edited(lambda s: setattr(s, "epoch", s.epoch + 1)),
    "free_lists_hold_no_page_twice": edited(lambda s: s.host_free.append(s.host_free[0])),
    "tiers_are_conserved": edited(lambda s: s.device_free.pop()),
    "transfers_hold_both_ends": lambda s: with_transfer_source(s, (10,)),
    "host_locks_are_balanced": edited(lambda s: setattr(s.entries[key(7, 8)], "host_locks", 0)),
    "write_back_drops_nothing": edited(
        lambda s: (setattr(s, "policy", "write_back"), setattr(s, "dropped_unbacked", 1))
    ),
}


def test_every_tier_law_has_a_breaking_example() -> None:
    assert set(BROKEN) == {law.__name__ for law in t.TIERED_INVARIANTS}


def test_the_healthy_state_keeps_every_law_and_reaches_every_kind_of_copy() -> None:
    state = healthy()
    t.check_tiered_invariants(state)
    assert {transfer.kind for transfer in state.transfers.values()} == {"backup", "load_back"}
    assert state.entries[key(7, 8)].device is None and key(7, 8) in state.storage


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_tiered_invariants_names_the_broken_law(name: str) -> None:
    with pytest.raises(IntegrityError, match=f"^{name}: "):
        t.check_tiered_invariants(BROKEN[name](healthy()))


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_page_twice_in_a_free_list_is_named_with_its_tier(tier: str) -> None:
    state = healthy()
    free = getattr(state, f"{tier}_free")
    free.append(free[0])
    assert (
        t.free_lists_hold_no_page_twice(state)
        == f"the {tier} free list holds [{free[0]}] twice, [] not page starts of it"
    )


# ---------------------------------------------------------------- operations


def test_tier_usage_counts_storage_against_its_capacity() -> None:
    state = t.new_state(2, 4, 4, storage_pages=6)
    cache(state, A)
    t.complete_transfer(state, only(state, "backup"))
    assert t.get_tier_usage(state)["storage"] == t.TierUsage(free=4, cached=0, in_flight=2, private=0, capacity=6)
    t.complete_transfer(state, only(state, "store"))
    assert t.get_tier_usage(state)["storage"] == t.TierUsage(free=4, cached=2, in_flight=0, private=0, capacity=6)


def test_write_through_backs_up_each_new_page_and_a_completed_backup_is_stored() -> None:
    state = t.new_state(2, 4, 4, storage_pages=4)
    cache(state, A)
    backup = state.transfers[only(state, "backup")]
    assert backup.keys == (key(1, 2), key(1, 2, 3, 4)) and backup.source == (0, 2)
    # in flight: the device pages are pinned, the host pages reserved
    assert t.get_tier_usage(state)["host"] == t.TierUsage(free=2, cached=0, in_flight=2, private=0, capacity=4)
    with pytest.raises(EvictionError):
        t.evict_device(state, 1)
    t.complete_transfer(state, only(state, "backup"))
    assert state.entries[key(1, 2, 3, 4)].host == backup.destination[1]
    assert state.entries[key(1, 2)].host_locks == 1  # the store reads it
    t.complete_transfer(state, only(state, "store"))
    assert set(state.storage) == {key(1, 2), key(1, 2, 3, 4)}
    assert t.match_prefix(state, [*A, 9, 9]) == (t.match_prefix(state, A)[0], 4, 4, 4)


def test_a_page_evicted_from_the_device_keeps_its_host_copy_and_is_loaded_back() -> None:
    state = t.new_state(2, 2, 4, policy="write_through")
    cache(state, A)
    t.complete_transfer(state, only(state, "backup"))
    assert t.evict_device(state, 2) == [0, 2]
    match = t.match_prefix(state, A)
    assert (match.device_len, match.host_len, match.storage_len) == (0, 4, 4)
    number = t.load_back(state, A)
    assert number is not None and t.load_back(state, A) is None  # one load of a page at a time
    assert t.match_prefix(state, A).device_len == 0  # not served before it completes
    t.complete_transfer(state, number)
    assert t.match_prefix(state, A).device_len == 4
    t.check_tiered_invariants(state)


def test_write_through_drops_an_unbacked_leaf_and_write_back_never_does() -> None:
    through = t.new_state(2, 2, 1, policy="write_through")
    cache(through, A)
    t.fail_transfer(through, only(through, "backup"))
    assert t.evict_device(through, 2) == [0, 2] and not through.entries and through.dropped_unbacked == 2
    back = t.new_state(2, 2, 2, policy="write_back")
    cache(back, A)
    assert not back.transfers
    with pytest.raises(EvictionError):
        t.evict_device(back, 1)
    (first,) = t.write_back(back, 1)
    t.complete_transfer(back, first)
    assert t.evict_device(back, 1) == [2] and back.dropped_unbacked == 0


def test_write_through_selective_backs_up_a_page_at_its_threshold() -> None:
    state = t.new_state(2, 4, 4, policy="write_through_selective", threshold=2)
    cache(state, A)  # the prefill's match reached nothing
    assert not state.transfers
    t.match_prefix(state, A)
    assert not state.transfers
    t.match_prefix(state, A)
    assert state.transfers[only(state, "backup")].keys == (key(1, 2), key(1, 2, 3, 4))


def test_prefetch_brings_a_storage_hit_into_the_host_tier() -> None:
    state = t.new_state(2, 2, 2, storage_pages=4)
    cache(state, A)
    t.complete_transfer(state, only(state, "backup"))
    t.complete_transfer(state, only(state, "store"))
    t.evict_device(state, 2)
    t.evict_host(state, 2)
    assert not state.entries and t.match_prefix(state, A)[1:] == (0, 0, 4)
    number = t.prefetch(state, A)
    assert number is not None and t.prefetch(state, A) is None
    t.complete_transfer(state, number)
    assert t.match_prefix(state, A)[1:] == (0, 4, 4)
    t.check_tiered_invariants(state)


def test_a_failed_transfer_gives_its_destination_back_and_makes_no_copy() -> None:
    state = t.new_state(2, 4, 4)
    cache(state, A)
    t.fail_transfer(state, only(state, "backup"))
    assert all(entry.host is None for entry in state.entries.values())
    assert t.get_tier_usage(state)["host"].free == 4
    t.check_tiered_invariants(state)


def test_storage_offline_serves_nothing_and_completes_no_transfer_until_it_is_back() -> None:
    state = t.new_state(2, 2, 2, storage_pages=4)
    cache(state, A)
    t.complete_transfer(state, only(state, "backup"))
    t.set_storage_online(state, False)
    number = only(state, "store")
    before = copy.deepcopy(state)
    with pytest.raises(StorageOfflineError):
        t.complete_transfer(state, number)
    assert state == before
    t.set_storage_online(state, True)
    t.complete_transfer(state, number)
    t.evict_device(state, 2)
    t.evict_host(state, 2)
    assert t.match_prefix(state, A)[1:] == (0, 0, 4)
    t.set_storage_online(state, False)
    # offline: no storage hit, nothing to prefetch, the copies kept
    assert t.match_prefix(state, A)[1:] == (0, 0, 0) and t.prefetch(state, A) is None
    assert len(state.storage) == 2
    t.set_storage_online(state, True)
    fetch = t.prefetch(state, A)
    assert fetch is not None
    t.set_storage_online(state, False)
    with pytest.raises(StorageOfflineError):
        t.complete_transfer(state, fetch)
    t.fail_transfer(state, fetch)
    # a backup completed offline starts no store
    cache(state, C)
    t.complete_transfer(state, only(state, "backup"))
    assert not state.transfers
    t.check_tiered_invariants(state)
    with pytest.raises(InvalidTypeError):
        t.set_storage_online(state, 1)  # type: ignore[arg-type]


def test_reset_waits_for_the_transfers_and_leaves_no_tier_serving() -> None:
    state = t.new_state(2, 4, 4, storage_pages=4)
    cache(state, A)
    with pytest.raises(CacheBusyError):
        t.reset(state)
    t.complete_transfer(state, only(state, "backup"))
    t.complete_transfer(state, only(state, "store"))
    t.reset(state)
    assert t.match_prefix(state, A)[1:] == (0, 0, 0)
    assert t.get_tier_usage(state)["device"].free == 4 and t.get_tier_usage(state)["host"].free == 4
    t.check_tiered_invariants(state)


def test_a_locked_page_stays_on_the_device_and_a_handle_goes_stale_when_its_page_leaves() -> None:
    state = t.new_state(2, 2, 2)
    handle = cache(state, A).handle
    t.complete_transfer(state, only(state, "backup"))
    t.lock(state, handle)
    with pytest.raises(EvictionError):
        t.evict_device(state, 1)
    t.unlock(state, handle)
    t.evict_device(state, 1)
    with pytest.raises(StaleHandleError):
        t.lock(state, handle)


def test_tier_usage_counts_each_host_copy_once() -> None:
    """Two pages backed up: the host tier serves two copies, and its places add up to its capacity."""
    state = t.new_state(2, 4, 4)
    cache(state, A)
    t.complete_transfer(state, only(state, "backup"))
    host = t.get_tier_usage(state)["host"]
    assert host == t.TierUsage(free=2, cached=2, in_flight=0, private=0, capacity=4)
    assert host.free + host.cached + host.in_flight == host.capacity


def test_a_handle_goes_stale_when_its_page_comes_back_as_a_newer_device_copy() -> None:
    """A's pages evicted to the host tier and loaded back: the pages have device copies again, but newer ones
    than the handle saw (their slots may hold other KV meanwhile), so locking the old handle is refused."""
    state = t.new_state(2, 2, 2)
    handle = cache(state, A).handle
    t.complete_transfer(state, only(state, "backup"))
    assert t.evict_device(state, 2) == [0, 2]
    number = t.load_back(state, A)
    assert number is not None
    t.complete_transfer(state, number)
    assert all(state.entries[k].device is not None for k in handle.keys)
    before = copy.deepcopy(state)
    with pytest.raises(StaleHandleError):
        t.lock(state, handle)
    assert state == before
    t.lock(state, t.match_prefix(state, A).handle)  # a fresh handle locks


def test_lock_refuses_what_is_not_a_handle_naming_its_type() -> None:
    state = t.new_state(2, 4, 4)
    with pytest.raises(InvalidTypeError, match=r"^expected a TieredHandle, got object$"):
        t.lock(state, object())  # type: ignore[arg-type]


# each call with a count that is not an int (a str, a float, a bool), and the type the refusal names
NOT_COUNTS: dict[str, tuple[Callable[[t.TieredState], object], str]] = {
    "allocate a str": (lambda s: t.allocate(s, "3"), "str"),  # type: ignore[arg-type]
    "evict_device a float": (lambda s: t.evict_device(s, 2.0), "float"),  # type: ignore[arg-type]
    "evict_host a bool": (lambda s: t.evict_host(s, True), "bool"),
    "write_back a float": (lambda s: t.write_back(s, 1.0), "float"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("name", sorted(NOT_COUNTS))
def test_a_count_that_is_not_an_int_is_refused_naming_the_count_and_changes_nothing(name: str) -> None:
    """Two device pages and a host copy evictable: a float or a bool count taken for a number would evict them,
    a str one would fail inside with a TypeError."""
    state = t.new_state(2, 4, 4)
    for tokens in (A, C):
        cache(state, tokens)
        t.complete_transfer(state, only(state, "backup"))
    assert t.evict_device(state, 1) == [2]  # A's second page now lives on the host only
    before = copy.deepcopy(state)
    call, type_name = NOT_COUNTS[name]
    with pytest.raises(InvalidTypeError, match=rf"^num_pages must be an int, got {type_name}$"):
        call(state)
    assert state == before


REFUSALS: dict[str, Callable[[t.TieredState], object]] = {
    "allocate past the device": lambda s: t.allocate(s, 5),
    "insert pages not held": lambda s: t.insert_prefix(s, [9, 9], [6, 7]),
    "free a page not held": lambda s: t.free(s, [6]),
    "evict past the evictable": lambda s: t.evict_device(s, 3),
    "evict a negative count": lambda s: t.evict_host(s, -1),
    "complete an unknown transfer": lambda s: t.complete_transfer(s, 99),
    "reset under a transfer": t.reset,
    "unlock what no lock holds": lambda s: t.unlock(s, t.match_prefix(s, A).handle),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_refused_call_changes_nothing(name: str) -> None:
    state = t.new_state(2, 4, 4, storage_pages=4)
    cache(state, A)
    t.allocate(state, 1)
    before = copy.deepcopy(state)
    with pytest.raises(CacheError):
        REFUSALS[name](state)
    # the match inside "unlock" stamps; the rest must be untouched
    if name != "unlock what no lock holds":
        assert state == before


# ---------------------------------------------------------------- random programs, the spec as its own executor


class SpecAlone(TieredMachine):
    """The spec as its own executor, no implementation beside it."""

    IMPLS = ()


def test_random_programs_keep_every_tier_law() -> None:
    SpecAlone.reached.clear()
    run_state_machine_as_test(
        SpecAlone, settings=settings(max_examples=300, stateful_step_count=50, deadline=None, database=None)
    )
    # the common paths, whatever Hypothesis draws; the rare ones are toured below
    assert {("backup", True), ("store", True)} <= set(SpecAlone.reached), SpecAlone.reached


def tour(machine_class: type[TieredMachine]) -> None:
    """A fixed tour of the machine's own rules: each kind of transfer started by them and ended both ways by the
    executor, then a reset of a full cache, the laws (and agreement) after every step; so that reach does not hang
    on what a Hypothesis release draws."""
    machine_class.reached.clear()
    machine = machine_class()
    machine.configure(policy="write_through", device=4, host=4, storage=4)

    def step(action: Callable[[], object]) -> None:
        action()
        machine.caches_agree_and_keep_the_laws()

    def end(kind: t.TransferKind, ok: bool) -> None:
        step(lambda: machine.end(only(machine.spec, kind), ok))

    seven, one = Prompt([7, 8], None), Prompt([1, 2], None)
    step(lambda: machine.request(seven))
    end("backup", True)
    end("store", False)
    step(lambda: machine.request(one))
    end("backup", False)
    step(lambda: machine.write_back(1))
    end("backup", True)
    end("store", True)
    step(lambda: machine.press(False))
    for ok in (False, True):
        step(lambda: machine.match_and_fetch(seven, hold=1))
        end("load_back", ok)
    step(lambda: machine.press(True))
    for ok in (False, True):
        step(lambda: machine.match_and_fetch(one, hold=1))
        end("prefetch", ok)
    # storage offline under a store: the completion refused, the store failed; storage back
    step(lambda: machine.request(Prompt([9, 9], None)))
    end("backup", True)
    step(lambda: machine.outage(False))
    end("store", True)
    end("store", False)
    step(lambda: machine.outage(True))
    step(lambda: machine.reset(now=0))
    kinds = {(kind, ok) for kind in t.ROUTES for ok in (True, False)}
    outage = {("storage offline", True), ("store while storage is offline", True), ("storage back", False)}
    assert set(machine_class.reached) == kinds | outage | {("reset", True)}, machine_class.reached


def test_the_machine_reaches_every_transfer_completed_and_failed_and_a_full_reset() -> None:
    tour(SpecAlone)


def forgetful_fail(state: t.TieredState, number: int) -> None:
    """A failure that leaves the host pages it reserved reserved forever."""
    transfer = state.transfers.pop(number)
    for key in transfer.keys:
        if t.ROUTES[transfer.kind][0] == "host":
            state.entries[key].host_locks -= 1
    if t.ROUTES[transfer.kind][1] == "device":
        state.device_free.extend(transfer.destination)


def unlocking_load(state: t.TieredState, number: int) -> None:
    """A completed load that keeps its host lock (the split that leaves host locks behind)."""
    loading = state.transfers[number].kind == "load_back"
    keys = state.transfers[number].keys
    COMPLETE(state, number)
    if loading:
        state.entries[keys[0]].host_locks += 1


def reset_keeping_storage(state: t.TieredState) -> None:
    """A reset that leaves the storage tier serving (vLLM #57727's class)."""
    kept = dict(state.storage)
    RESET(state)
    state.storage.update(kept)


def evicting_pinned(state: t.TieredState, num_pages: int, keep: object = ()) -> list[PageKey]:
    """Device eviction that forgets the transfers' pins."""
    pinned = t.get_pinned_keys
    t.get_pinned_keys = lambda s: set()  # type: ignore[assignment]
    try:
        return PLAN(state, num_pages, keep)  # type: ignore[arg-type]
    finally:
        t.get_pinned_keys = pinned  # type: ignore[assignment]


COMPLETE, RESET, PLAN = t.complete_transfer, t.reset, t.plan_device_eviction
# each fault path, planted: (what is patched, the bug, the law that must name it)
PLANTED = {
    "a failed transfer's host pages never come back": ("fail_transfer", forgetful_fail, "tiers_are_conserved"),
    "a load keeps its host lock": ("complete_transfer", unlocking_load, "host_locks_are_balanced"),
    "a reset leaves storage serving": ("reset", reset_keeping_storage, "reset_left_no_copy"),
    "eviction under a transfer": ("plan_device_eviction", evicting_pinned, "transfers_hold_both_ends"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_random_programs_catch_a_planted_bug(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    function, bug, law = PLANTED[name]
    monkeypatch.setattr(t, function, bug)
    with pytest.raises(IntegrityError, match=law):
        run_state_machine_as_test(
            SpecAlone,
            # found, not shrunk: the law's name is what the test asks
            settings=settings(
                max_examples=1500,
                stateful_step_count=50,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                derandomize=True,
            ),
        )
