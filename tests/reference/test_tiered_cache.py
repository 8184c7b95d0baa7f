"""The reference tiered cache (reference/tiered_cache.py) against the spec of tiers: the same results, errors
and abstract state after every call of random programs in which the machine is the executor of the transfers;
and the tree's own mechanics (splits under pins and host locks)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from radixspec.fuzz.targets.api import TieredCacheTarget
from radixspec.fuzz.targets.ours import SpecTieredCache, make_optimized_tiered
from radixspec.fuzz.tiered_machine import TieredMachine
from radixspec.reference.tiered_cache import TieredNode, TieredRadixCache
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import (
    CacheBusyError,
    DuplicateSlotError,
    EvictionError,
    IntegrityError,
    InvalidSizeError,
    InvalidTypeError,
    MisalignedPageError,
)
from radixspec.spec.tiers import check_tiered_invariants

from ..spec.test_tiers import tour


class ReferenceTiered(TieredMachine):
    IMPLS = ("reference",)


def run(examples: int, phases: tuple[Phase, ...] = tuple(Phase)) -> None:
    ReferenceTiered.reached.clear()
    run_state_machine_as_test(
        ReferenceTiered,
        settings=settings(
            max_examples=examples,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,
            database=None,
            phases=phases,
        ),
    )


def test_the_reference_agrees_with_the_spec_on_random_programs() -> None:
    run(600)
    # the common paths, whatever Hypothesis draws; the rare ones are toured below
    assert {("backup", True), ("store", True)} <= set(ReferenceTiered.reached), ReferenceTiered.reached


def test_the_reference_agrees_with_the_spec_on_the_tour_of_every_transfer() -> None:
    tour(ReferenceTiered)


def test_a_split_keeps_the_host_locks_of_both_halves() -> None:
    cache = TieredRadixCache(2, 4, 4, storage_pages=4)
    pages = cache.allocate(2)
    cache.insert_prefix([1, 2, 3, 4], [pages[0], pages[0] + 1, pages[1], pages[1] + 1])
    cache.complete_transfer(0)  # the backup; its store (transfer 1) now reads both host pages
    cache.match_prefix([1, 2])  # splits the node under the store
    assert [e.host_locks for e in cache.abstract_state().entries.values()] == [1, 1]
    cache.complete_transfer(1)
    assert [e.host_locks for e in cache.abstract_state().entries.values()] == [0, 0]
    cache.check_integrity()


def test_a_split_that_leaves_a_host_lock_behind_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang PR #38480's class: a split that does not give the upper half the node's host locks (the machine
    catches it too, timed by ``python -m tools.planted --machine tiered``)."""
    split = TieredNode.split

    def forgetful(self: TieredNode, tokens: int) -> TieredNode:
        upper = split(self, tokens)
        upper.host_ref = 0
        return upper

    monkeypatch.setattr(TieredNode, "split", forgetful)
    cache = TieredRadixCache(2, 4, 4, storage_pages=4)
    pages = cache.allocate(2)
    cache.insert_prefix([1, 2, 3, 4], [pages[0], pages[0] + 1, pages[1], pages[1] + 1])
    cache.complete_transfer(0)  # its store reads both host pages
    cache.match_prefix([1, 2])  # splits the node under the store
    with pytest.raises(IntegrityError, match="^host_locks_are_balanced: "):
        cache.check_integrity()


# ---------------------------------------------------------------- alike in all three, with their numbers

# our tiered caches: the optimized one made through its target's factory (torch is imported for it only)
OURS: dict[str, Callable[..., TieredCacheTarget]] = {
    "spec": SpecTieredCache,
    "reference": TieredRadixCache,
    "optimized": make_optimized_tiered,
}


@pytest.mark.parametrize("impl", sorted(OURS))
def test_refusals_name_what_was_wrong_with_its_numbers(impl: str) -> None:
    make = OURS[impl]
    with pytest.raises(InvalidSizeError, match=r"^host_pages must be an int >= 1, got 0$"):
        make(2, 4, 0)
    cache: TieredCacheTarget = make(2, 4, 4)
    with pytest.raises(InvalidSizeError, match=r"^num_pages must be >= 0, got -1$"):
        cache.allocate(-1)
    pages = cache.allocate(2)
    with pytest.raises(MisalignedPageError, match=r"not a run start\.\.start\+1 with start % 2 == 0$"):
        cache.insert_prefix([1, 2], [pages[0] + 1, pages[0] + 2])
    # one page named for two new pages of one insert
    with pytest.raises(DuplicateSlotError):
        cache.insert_prefix([1, 2, 3, 4], [pages[1], pages[1] + 1, pages[1], pages[1] + 1])
    with pytest.raises(EvictionError, match=r"^cannot evict 1 host pages: 0 evictable$"):
        cache.evict_host(1)
    assert cache.evict_host(0) == []
    with pytest.raises(EvictionError, match=r"^cannot evict 1 device pages: 0 evictable$"):
        cache.evict_device(1)
    # a transfer id that is not an int, and one that is a bool
    for transfer in ("0", 0.0, False):
        with pytest.raises(InvalidTypeError, match=rf"^a transfer id is an int, got {type(transfer).__name__}$"):
            cache.complete_transfer(transfer)  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError, match=rf"^a transfer id is an int, got {type(transfer).__name__}$"):
            cache.fail_transfer(transfer)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", sorted(OURS))
def test_a_load_back_evicts_for_the_room_the_free_list_lacks(impl: str) -> None:
    cache = OURS[impl](2, 2, 4)
    (a,) = cache.allocate(1)
    cache.insert_prefix([1, 2], [a, a + 1])
    cache.complete_transfer(0)  # the backup (write-through)
    cache.evict_device(1)  # [1, 2] now lives on the host only
    (b,) = cache.allocate(1)
    cache.insert_prefix([5, 6], [b, b + 1])
    cache.complete_transfer(1)  # [5, 6] on the device, backed up: evictable
    cache.allocate(1)  # the last free device page, held
    assert cache.abstract_state().device_free == []
    # one page to load, none free, one evictable: the load evicts it
    transfer = cache.load_back([1, 2])
    assert transfer == 2
    assert cache.abstract_state().transfers[2].destination == (b,)


@pytest.mark.parametrize("impl", sorted(OURS))
def test_a_handle_names_its_namespace(impl: str) -> None:
    cache = OURS[impl](2, 4, 4)
    (a,) = cache.allocate(1)
    assert cache.insert_prefix([1, 2], [a, a + 1], ("t", 1)).handle.namespace == ("t", 1)
    for tokens in ([1, 2], [3, 4]):  # a hit, and none
        assert cache.match_prefix(tokens, ("t", 1)).handle.namespace == ("t", 1)


@pytest.mark.parametrize("impl", sorted(OURS))
def test_a_write_back_of_a_negative_count_is_refused_naming_num_pages(impl: str) -> None:
    """The refusal names the argument, as allocate's does (the spec's check_count words)."""
    cache = OURS[impl](2, 4, 4)
    with pytest.raises(InvalidSizeError, match=r"^num_pages must be >= 0, got -1$"):
        cache.write_back(-1)


@pytest.mark.parametrize("impl", sorted(OURS))
def test_a_refused_reset_names_its_locked_pages_and_its_transfers(impl: str) -> None:
    """The spec's message, with its numbers: locked pages (not nodes) and transfers in flight."""
    cache = OURS[impl](2, 4, 4)
    pages = cache.allocate(2)
    handle = cache.insert_prefix([1, 2, 3, 4], [pages[0], pages[0] + 1, pages[1], pages[1] + 1]).handle
    cache.lock(handle)  # and the insert's backup is in flight (write-through)
    with pytest.raises(CacheBusyError, match=r"^reset refused: 2 pages locked, 1 transfers in flight$"):
        cache.reset()


def stored_and_gone(
    make: Callable[..., TieredCacheTarget], tokens: list[int], namespace: Namespace
) -> TieredCacheTarget:
    """A cache (pages of 2) in which ``tokens`` (whole pages) were cached in ``namespace``, backed up and stored,
    then evicted from the device and the host tiers: storage alone holds them. Transfers 0 and 1 are spent."""
    cache = make(2, 4, 4, 4)
    pages = cache.allocate(len(tokens) // 2)
    cache.insert_prefix(tokens, [page + offset for page in pages for offset in (0, 1)], namespace)
    cache.complete_transfer(0)  # the backup
    cache.complete_transfer(1)  # its store
    cache.evict_device(len(pages))
    cache.evict_host(len(pages))
    assert cache.match_prefix(tokens, namespace)[1:] == (0, 0, len(tokens))
    return cache


@pytest.mark.parametrize("impl", sorted(OURS))
def test_a_prefetch_of_a_run_short_of_the_tokens_brings_in_only_its_pages(impl: str) -> None:
    """The request's tokens run a page past what storage holds: the completed prefetch serves the two stored
    pages from the host tier, not the third page it never fetched."""
    cache = stored_and_gone(OURS[impl], [1, 2, 3, 4], None)
    assert cache.prefetch([1, 2, 3, 4, 5, 6]) == 2
    cache.complete_transfer(2)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[1:] == (0, 4, 4)
    check_tiered_invariants(cache.abstract_state())


@pytest.mark.parametrize("impl", sorted(OURS))
def test_a_prefetch_completed_in_a_namespace_serves_that_namespace_only(impl: str) -> None:
    """The namespace's tree is empty when the prefetch completes: its pages hang under that namespace's root,
    so the host hit is that namespace's, and the default namespace sees none."""
    cache = stored_and_gone(OURS[impl], [1, 2, 3, 4], ("t", 1))
    assert cache.prefetch([1, 2, 3, 4], ("t", 1)) == 2
    cache.complete_transfer(2)
    assert cache.match_prefix([1, 2, 3, 4], ("t", 1))[1:] == (0, 4, 4)
    assert cache.match_prefix([1, 2, 3, 4])[1:] == (0, 0, 0)
