"""spec/offload.py: the host tier as an offloading manager serves it. A tour pins the rules (all-or-nothing
offers, pending chunks skipped, loads pinning, failed stores giving back, reset abandoning), the guards refuse
with nothing changed, and each law is seen failing on a state planted to break it."""

from __future__ import annotations

import copy

import pytest

from radixspec.spec import offload as of
from radixspec.spec.errors import IntegrityError, InvalidInputError, InvalidSizeError, OutOfPagesError
from radixspec.spec.prefix_cache import PageKey, compute_page_prefixes
from radixspec.spec.tiers import Written


def keys(*pages: int) -> list[PageKey]:
    """The page keys of a prompt of one-token pages."""
    return [(None, prefix) for prefix in compute_page_prefixes(list(pages), 1)]


def test_a_tour_of_offers_loads_failures_and_a_reset() -> None:
    state = of.new_state(3)
    a = keys(1, 2, 3)
    store = of.prepare_store(state, a, evicted=(), slots=(2, 0, 1))
    assert store == 0 and [of.lookup(state, key) for key in a] == ["pending"] * 3
    assert of.get_hit_run(state, a) is None  # a pending chunk first: ask again later
    # an offer sharing a pending chunk skips it; its new key finds no room (3 held, none idle): refused
    b = keys(1, 5)
    assert of.plan_store(state, b) is None
    before = copy.deepcopy(state)
    with pytest.raises(OutOfPagesError):
        of.prepare_store(state, b, evicted=(), slots=())
    assert state == before
    of.complete_store(state, store)
    assert of.get_hit_run(state, b) == (a[0],)
    assert state.written[2] == Written(a[0], 0)
    load = of.prepare_load(state, a[:2])
    assert of.get_load_slots(state, load) == (2, 0)
    # b's new key must evict the one idle chunk outside the offer (a[2]; a[0] is in it, a[1] is read)
    assert of.plan_store(state, b) == of.StorePlan((b[1],), 1)
    failed = of.prepare_store(state, b, evicted=(a[2],), slots=(1,))
    assert failed is not None and a[2] not in state.chunks
    of.complete_store(state, failed, success=False)
    assert b[1] not in state.chunks and 1 in state.free and 1 not in state.written
    of.complete_load(state, load)
    assert {key: chunk.pins for key, chunk in state.chunks.items()} == {a[0]: 0, a[1]: 0}
    of.check_offload_invariants(state)
    # a reset abandons what is in flight: its store's copy lands in the old epoch, serving nothing
    again = of.prepare_store(state, keys(7), evicted=(), slots=(1,))
    assert again is not None
    of.reset(state)
    assert not state.chunks and not state.stores and sorted(state.free) == [0, 1, 2] and state.epoch == 1
    assert state.written[1] == Written(keys(7)[0], 0)
    of.check_offload_invariants(state)


def test_an_offer_of_nothing_new_starts_no_job() -> None:
    state = of.new_state(2)
    job = of.prepare_store(state, keys(1), evicted=(), slots=(0,))
    assert job is not None
    assert of.prepare_store(state, keys(1), evicted=(), slots=()) is None
    assert state.stores.keys() == {job}


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda s: of.prepare_store(s, [*keys(1), *keys(1)], (), ()), InvalidInputError, "repeat"),
        (lambda s: of.prepare_store(s, keys(4), (), (0,)), IntegrityError, "store_takes_free_slots"),
        (lambda s: of.prepare_store(s, keys(4), (), (1, 1)), IntegrityError, "store_takes_free_slots"),
        (lambda s: of.prepare_store(s, keys(4), keys(1), (1,)), IntegrityError, "store_evicts_only_what_it_lacks"),
        (lambda s: of.prepare_load(s, keys(1, 2)), InvalidInputError, "pending"),
        (lambda s: of.prepare_load(s, []), InvalidInputError, "no keys"),
        (lambda s: of.complete_store(s, 7), InvalidInputError, "no store job 7"),
        (lambda s: of.complete_load(s, 0), InvalidInputError, "no load job 0"),
        (lambda s: of.complete_store(s, True), InvalidInputError, "no store job True"),
    ],
)
def test_a_refused_call_names_what_was_wrong_and_changes_nothing(call, error, words) -> None:  # type: ignore[no-untyped-def]
    state = of.new_state(3)
    of.complete_store(state, of.prepare_store(state, keys(1), (), (0,)))  # type: ignore[arg-type]
    of.prepare_store(state, [*keys(1, 2)], (), (2,))
    before = copy.deepcopy(state)
    with pytest.raises(error, match=words):
        call(state)
    assert state == before


def test_a_capacity_a_threshold_and_a_tracker_must_be_positive_ints() -> None:
    for bad in (0, -1, True, 2.0):
        for name in ("capacity", "threshold", "tracker_size"):
            arguments = {"capacity": 2, "threshold": 2, "tracker_size": 2, name: bad}
            with pytest.raises(InvalidSizeError, match=name):
                of.new_state(**arguments)  # type: ignore[arg-type]


def busy() -> of.OffloadState:
    """Two ready chunks (one read by a load) and one pending."""
    state = of.new_state(4)
    of.complete_store(state, of.prepare_store(state, keys(1, 2), (), (0, 1)))  # type: ignore[arg-type]
    of.prepare_load(state, keys(1))
    of.prepare_store(state, keys(1, 2, 3), (), (3,))
    of.check_offload_invariants(state)
    return state


def plant_shared_slot(state: of.OffloadState) -> None:
    key = keys(1, 2)[1]
    state.chunks[key] = state.chunks[key]._replace(slot=0)


def plant_free_twice(state: of.OffloadState) -> None:
    state.free.append(state.free[0])


def plant_lost_slot(state: of.OffloadState) -> None:
    state.free.pop()


def plant_store_done_silently(state: of.OffloadState) -> None:
    key = keys(1, 2, 3)[2]
    state.chunks[key] = state.chunks[key]._replace(pins=0)


def plant_pin_left(state: of.OffloadState) -> None:
    state.loads.clear()


def plant_ready_unwritten(state: of.OffloadState) -> None:
    state.epoch += 1


@pytest.mark.parametrize(
    ("plant", "law"),
    [
        (plant_shared_slot, "slots_hold_one_chunk"),
        (plant_free_twice, "slots_are_conserved"),
        (plant_lost_slot, "slots_are_conserved"),
        (plant_store_done_silently, "pending_chunks_have_their_store"),
        (plant_pin_left, "pins_count_the_loads"),
        (plant_ready_unwritten, "ready_chunks_hold_their_key"),
    ],
)
def test_each_law_fails_on_its_planted_state(plant, law: str) -> None:  # type: ignore[no-untyped-def]
    state = busy()
    plant(state)
    with pytest.raises(IntegrityError, match=law):
        of.check_offload_invariants(state)


def test_the_published_keys_must_be_the_ready_chunks() -> None:
    state = busy()
    ready = keys(1, 2)
    assert of.published_are_the_ready_chunks(state, ready) is None
    assert "ready but not published" in str(of.published_are_the_ready_chunks(state, ready[:1]))
    assert "published but not ready" in str(of.published_are_the_ready_chunks(state, keys(1, 2, 3)))


def test_a_key_is_stored_once_offered_threshold_times_and_the_tracker_forgets_the_oldest() -> None:
    state = of.new_state(4, threshold=2, tracker_size=2)
    a, b, c = keys(1), keys(2), keys(3)
    of.record_offer(state, a)
    assert of.plan_store(state, a) == of.StorePlan((), 0)  # offered once: not admitted
    of.record_offer(state, a)
    assert of.plan_store(state, a) == of.StorePlan(tuple(a), 0)
    of.record_offer(state, b)
    assert list(state.offers.values()) == [2, 1]
    # full: c makes room by forgetting the key offered longest ago (a), never one of its own offer
    of.record_offer(state, c)
    assert list(state.offers) == [*b, *c]
    of.record_offer(state, [*b, *c, *a])  # both counted keys protected: a finds no room, is not counted
    assert dict(state.offers) == {b[0]: 2, c[0]: 2}
    of.check_offload_invariants(state)
    # the counts survive a reset
    of.reset(state)
    assert dict(state.offers) == {b[0]: 2, c[0]: 2}


def test_the_tracker_law_fails_when_it_counts_too_many() -> None:
    state = of.new_state(4, threshold=2, tracker_size=1)
    of.record_offer(state, keys(1))
    state.offers[keys(2)[0]] = 1
    with pytest.raises(IntegrityError, match="offer_counts_fit_the_tracker"):
        of.check_offload_invariants(state)
    state = of.new_state(4)  # threshold 1: nothing counted
    state.offers[keys(2)[0]] = 1
    with pytest.raises(IntegrityError, match="offer_counts_fit_the_tracker"):
        of.check_offload_invariants(state)


# the survivors of the fresh mutation sample of spec/offload.py (seed 15), each seen failing under its mutant


def test_a_choice_that_evicts_an_idle_chunk_of_the_offer_itself_is_refused() -> None:
    state = of.new_state(2)
    for prompt in (keys(1), keys(2)):
        of.complete_store(state, of.prepare_store(state, prompt, (), (state.free[0],)))  # type: ignore[arg-type]
    offer = [*keys(1), *keys(3)]  # one new key, no free slot: one idle chunk outside the offer (keys(2)) must go
    assert of.plan_store(state, offer) == of.StorePlan(tuple(keys(3)), 1)
    before = copy.deepcopy(state)
    with pytest.raises(IntegrityError, match="store_evicts_only_what_it_lacks"):
        of.prepare_store(state, offer, evicted=keys(1), slots=(state.chunks[keys(1)[0]].slot,))
    assert state == before
    assert of.prepare_store(state, offer, evicted=keys(2), slots=(1,)) is not None


def test_a_failed_store_into_a_slot_never_written_leaves_it_unwritten() -> None:
    state = of.new_state(2)
    job = of.prepare_store(state, keys(1), (), (1,))
    assert job is not None
    of.complete_store(state, job, success=False)
    assert state.written == {} and sorted(state.free) == [0, 1]


def test_repeated_keys_are_refused_by_name_in_offers_loads_and_counts() -> None:
    state = of.new_state(2, threshold=2)
    twice = [*keys(1), *keys(1)]
    with pytest.raises(InvalidInputError, match="^an offer's keys repeat"):
        of.prepare_store(state, twice, (), ())
    with pytest.raises(InvalidInputError, match="^an offer's keys repeat"):
        of.record_offer(state, twice)
    with pytest.raises(InvalidInputError, match="^a load's keys repeat"):
        of.prepare_load(state, twice)
    with pytest.raises(InvalidInputError, match="^a load of no keys$"):
        of.prepare_load(state, [])
    with pytest.raises(InvalidInputError, match="^no load job 9 in flight"):
        of.get_load_slots(state, 9)
    assert state == of.new_state(2, threshold=2)


def test_a_full_tracker_forgets_only_keys_counted_before_the_offer() -> None:
    state = of.new_state(4, threshold=2, tracker_size=2)
    of.record_offer(state, keys(1))
    of.record_offer(state, keys(2))
    # c and d take the places of 1 and 2; e finds only keys of its own offer: not counted
    c, d, e = keys(3)[0], keys(4)[0], keys(5)[0]
    of.record_offer(state, [c, d, e])
    assert state.offers == {c: 1, d: 1}
    assert of.view(state).offers == [(c, 1), (d, 1)]


def test_the_laws_name_what_they_found() -> None:
    state = busy()
    state.free.append(0)  # slot 0 held and free: the count over the capacity says it too
    assert "free and held [0]" in str(of.slots_are_conserved(of.view(state)))
    state = busy()
    key = keys(1, 2)[1]
    state.chunks[key] = state.chunks[key]._replace(slot=7)
    assert "outside 0..3 [7]" in str(of.slots_hold_one_chunk(of.view(state)))
    # a pin counted where no load reads (pins 0 are not pins)
    state = busy()
    assert of.pins_count_the_loads(state) is None
    state.chunks[key] = state.chunks[key]._replace(pins=1)
    assert "pins_count_the_loads" in str(of.pins_count_the_loads(state))
    # namespaces of both kinds in one message
    tenant = ((("tenant", 1), keys(9)[0][1]),)
    state = busy()
    message = str(of.published_are_the_ready_chunks(state, [*tenant, *keys(1)]))
    assert "published but not ready [(('tenant', 1)" in message and "ready but not published [(None" in message


# the survivors of the fresh sample (seed 16), each seen failing under its mutant


def test_jobs_in_flight_have_numbers_of_their_own() -> None:
    state = of.new_state(4)
    first = of.prepare_store(state, keys(1), (), (0,))
    second = of.prepare_store(state, keys(2), (), (1,))
    assert first is not None and second is not None
    load = of.complete_store(state, first) or of.prepare_load(state, keys(1))
    assert len({first, second, load}) == 3 and set(state.stores) == {second} and set(state.loads) == {load}


def test_a_choice_of_one_slot_twice_is_refused() -> None:
    state = of.new_state(4)
    with pytest.raises(IntegrityError, match="store_takes_free_slots"):
        of.prepare_store(state, keys(1, 2), (), (3, 3))
    assert state == of.new_state(4)


def test_an_offer_counts_its_new_keys_after_a_counted_one() -> None:
    state = of.new_state(4, threshold=2, tracker_size=4)
    a, b = keys(1)[0], keys(2)[0]
    of.record_offer(state, [a])
    of.record_offer(state, [a, b])
    assert state.offers == {a: 2, b: 1}


def test_a_slot_at_the_capacity_is_outside() -> None:
    state = busy()
    key = keys(1, 2)[1]
    state.chunks[key] = state.chunks[key]._replace(slot=state.capacity)
    assert "outside 0..3 [4]" in str(of.slots_hold_one_chunk(of.view(state)))
