"""The optimized tiered cache (optimized/tiered_cache.py) against the spec and the reference: the same results,
errors and abstract state after every call of random programs and of the tour; and what only its tensors can
show: a copy that moves the wrong rows is named by ``copies_hold_their_prefix``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from radixspec.fuzz.targets.api import TargetInfo
from radixspec.fuzz.tiered_machine import TieredMachine
from radixspec.optimized.tiered_cache import TieredRadixCache
from radixspec.reference.tiered_cache import TieredRadixCache as ReferenceTieredCache
from radixspec.spec import tiers as t
from radixspec.spec.errors import IntegrityError, InvalidTypeError, StaleHandleError

from ..spec.test_tiers import tour


class AllTiered(TieredMachine):
    IMPLS = ("reference", "optimized")


class OptimizedTiered(TieredMachine):
    IMPLS = ("optimized",)


def run(machine: type[TieredMachine], examples: int, phases: tuple[Phase, ...] = tuple(Phase)) -> None:
    machine.reached.clear()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,
            database=None,
            phases=phases,
            report_multiple_bugs=False,
        ),
    )


def test_spec_reference_and_optimized_agree_on_random_programs() -> None:
    run(AllTiered, 300)
    assert {("backup", True), ("store", True)} <= set(AllTiered.reached), AllTiered.reached


def test_spec_reference_and_optimized_agree_on_the_tour_of_every_transfer() -> None:
    tour(AllTiered)


def backed_up(cache: TieredRadixCache) -> None:
    """Two pages cached on the device, their backup completed (write-through)."""
    pages = cache.allocate(2)
    # tokens and slots as tensors (slots on the cache's device), as the optimized caches take them
    slots = torch.tensor([pages[0], pages[0] + 1, pages[1], pages[1] + 1], dtype=torch.int32, device=cache.device)
    cache.insert_prefix(torch.tensor([1, 2, 3, 4], dtype=torch.int32), slots)
    cache.complete_transfer(0)


def test_a_backup_copies_the_kv_rows_through_the_store_path() -> None:
    cache = TieredRadixCache(2, 4, 4)
    backed_up(cache)
    state = cache.abstract_state()
    for key, entry in state.entries.items():
        assert entry.host is not None
        assert state.host_kv[entry.host] == state.device_kv[entry.device] == t.Written(key, 0)
    # the rows themselves: the device page's, in the host page
    device, host = next(iter(state.entries.values())).device, next(iter(state.entries.values())).host
    assert torch.equal(cache.host_k[host : host + 2], cache.device_k[device : device + 2].cpu())
    cache.check_integrity()


def test_a_copy_that_moves_the_wrong_rows_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The class of SGLang #39830 / #30321 (a host hit serving the wrong KV): a backup that copies each page's rows
    to each other's host page leaves host copies of another prefix, and the law says which."""
    copy = TieredRadixCache._copy

    def swapped(
        self: TieredRadixCache, from_k: torch.Tensor, from_v: torch.Tensor, sources: list[int], *to: object
    ) -> None:
        copy(self, from_k, from_v, sources[::-1], *to)  # type: ignore[arg-type]

    cache = TieredRadixCache(2, 4, 4)
    pages = cache.allocate(2)
    cache.insert_prefix([1, 2, 3, 4], [pages[0], pages[0] + 1, pages[1], pages[1] + 1])
    monkeypatch.setattr(TieredRadixCache, "_copy", swapped)
    cache.complete_transfer(0)
    monkeypatch.undo()
    with pytest.raises(IntegrityError, match="^copies_hold_their_prefix: "):
        cache.check_integrity()


def test_a_pin_left_behind_is_caught_by_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A completed transfer that does not unpin the page its run hangs under: that page can never be evicted, and
    the machine sees the optimized twin refuse an eviction the spec makes."""
    pin = TieredRadixCache._pin

    def forgetful(self: TieredRadixCache, transfer: object, delta: int) -> None:
        parent = transfer.parent  # type: ignore[attr-defined]
        pin(self, transfer, delta)  # type: ignore[arg-type]
        if delta < 0 and parent is not None:
            self.index.add([parent], self.c.TIER_PINS, 1)

    monkeypatch.setattr(TieredRadixCache, "_pin", forgetful)
    with pytest.raises(AssertionError, match="spec .*, optimized "):
        run(OptimizedTiered, 300, phases=(Phase.generate,))


def test_a_handle_is_stale_once_a_page_left_the_device_and_another_caches_handle_is_refused() -> None:
    cache = TieredRadixCache(2, 2, 4)
    backed_up(cache)
    handle = cache.match_prefix([1, 2, 3, 4]).handle
    cache.evict_device(1)
    with pytest.raises(StaleHandleError):
        cache.lock(handle)
    other = ReferenceTieredCache(2, 2, 4)
    with pytest.raises(InvalidTypeError):
        other.lock(cache.match_prefix([1, 2]).handle)
    with pytest.raises(InvalidTypeError):
        cache.lock(other.match_prefix([1, 2]).handle)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/gpu/run_gpu_checks.sh)")
def test_with_its_pools_on_cuda_the_three_agree() -> None:
    """The pools on the GPU, the host pool pinned: every copy through the CUDA store kernel and back."""

    def on_cuda(*config: object) -> TieredRadixCache:
        return TieredRadixCache(*config, device="cuda")  # type: ignore[arg-type]

    class OnCuda(TieredMachine):
        IMPLS = (
            "reference",
            TargetInfo("optimized-cuda", "the optimized tiered cache on CUDA", tiered_factory=on_cuda),
        )

    cache = on_cuda(2, 4, 4)
    assert cache.device_k.is_cuda and cache.host_k.is_pinned() and cache.host_v.is_pinned()
    backed_up(cache)
    cache.check_integrity()
    run(OnCuda, 100)
    tour(OnCuda)
