"""Failures the fuzzer found, replayed as the shrunk programs it printed."""

import pytest

from radixspec.fuzz.cache_machine import OUTGROW, TOUCHED_LEAVES, CacheMachine
from radixspec.spec.errors import UnlockError
from radixspec.spec.invariants import check_invariants


def test_unlocking_a_prefix_of_a_locked_path_is_rejected_by_every_implementation() -> None:
    # Shrunk program of the first campaign: unlock(handles_1) used to succeed because every
    # page of the short path had ref >= 1, leaving page (0,) at ref 0 under page (0, 0) at ref 1.
    state = CacheMachine()
    (seqs_0,) = state.setup(page_size=1, first=[([0, 0], [])])
    state.targets_agree()
    seqs_1 = state.prefix_of(base=seqs_0, cut=1)
    handles_0 = state.insert_prefix(namespace=None, seq=seqs_0)
    state.lock(handle=handles_0)
    handles_1 = state.insert_prefix(namespace=None, seq=seqs_1)
    state.unlock(handle=handles_1)
    state.targets_agree()
    state.teardown()
    check_invariants(state.model, locks=state.locks)
    reference = state.runs[0].target.cache
    with pytest.raises(UnlockError):
        reference.unlock(handles_1.handles[0])


def test_an_insert_that_extends_a_leaf_leaves_the_heap_able_to_evict_both() -> None:
    # Shrunk programs from the campaign after the eviction heap became integer keyed: the insert
    # pushed the leaf it extended and then its new child under the same stamp; the child's entry
    # replaced the parent's, the parent later looked pushed but had no entry (IntegrityError),
    # evict popped an empty heap (IndexError) or took the wrong page.
    for final in (("some", 50), ("all", 0)):
        state = CacheMachine()
        seqs_0, seqs_1 = state.setup(page_size=1, first=[([0, 0], []), ([0], [])])
        state.evict(fraction=0, size="some")
        state.insert_prefix(namespace=None, seq=seqs_1)
        state.insert_prefix(namespace=None, seq=seqs_0)
        state.insert_prefix(namespace=("lora", 1), seq=seqs_0)
        state.evict(fraction=final[1], size=final[0])
        state.targets_agree()
        state.teardown()


def test_teardown_replays_the_events_of_the_last_step() -> None:
    # A regression file written by a campaign failed on a correct tree: its printed program ends at a
    # step with no invariant run after it, so teardown compared the caches with a router mirror that
    # had not seen that step's events ("69 announced pages not cached"). Teardown now replays them.
    state = CacheMachine()
    (seqs_0,) = state.setup(page_size=1, first=[([0, 0, 0], [0, 0])], big=False)
    state.targets_agree()
    state.insert_prefix(namespace=("lora", 1), seq=seqs_0, where="low")
    state.targets_agree()
    state.evict(fraction=100, size="some")
    state.teardown()
    replayer = state.runs[0].replayer
    assert replayer is not None
    assert replayer.cached() == {key: entry.slot_start for key, entry in state.model.entries.items()}


def test_a_short_slot_list_for_an_empty_sequence_is_not_drawn() -> None:
    # Found by the first campaign on the merged cache machine: "short" slots for a sequence with no slot at all
    # popped from an empty list (IndexError in the machine, not in a cache).
    state = CacheMachine()
    (seqs_0,) = state.setup(page_size=2, first=[([], [])])
    state.insert_bad_slots(seq=seqs_0, namespace=None, slots="short", which=0)
    state.insert_bad_slots(seq=seqs_0, namespace=None, slots="long", which=1)
    state.teardown()


def test_rematching_when_every_leaf_is_locked_does_nothing() -> None:
    # Found by the cache machine's test the day rematch_leaves learned its OUTGROW rounds: with every leaf
    # locked there is no evictable leaf, and the rounds were divided by none (ZeroDivisionError in the machine).
    state = CacheMachine()
    (seqs_0,) = state.setup(page_size=1, first=[([0, 0, 0], [])], big=False)
    handles_0 = state.insert_prefix(namespace=None, seq=seqs_0, where="low")
    state.lock(handle=handles_0)
    state.rematch_leaves(rounds=OUTGROW, order=list(range(TOUCHED_LEAVES)), evict_pages=4)
    state.targets_agree()
    state.teardown()
