"""A deep copy of a prefix cache or a CacheManager, in both families: an independent object in the same state.

The exhaustive checker (``fuzz/exhaustive.py``) runs a state's transitions on deep copies of the state instead of
replays of its path; these tests hold a copy to what the original, or a replay, does next."""

from __future__ import annotations

import copy
import gc
import random
from typing import Any

import pytest
import torch

from radixspec import optimized, reference
from radixspec.fuzz import exhaustive
from radixspec.optimized._c import load_c
from radixspec.spec.domains import Immutable

FAMILIES = {"reference": reference, "optimized": optimized}
OTHER = ("tenant", 1)


def new_cache(family: str) -> Any:
    return FAMILIES[family].RadixPrefixCache(2, enable_events=True)


def first_half(cache: Any) -> Any:
    """A tree with a split, two namespaces and an eviction behind it; the handle of a locked path."""
    cache.insert_prefix(list(range(1, 9)), list(range(8)))
    cache.insert_prefix([1, 2, 3, 4, 9, 9], [0, 1, 2, 3, 8, 9])
    cache.insert_prefix([1, 2, 5, 5], [10, 11, 12, 13], OTHER)
    handle = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])  # splits [5..8] at 6
    cache.lock(handle)
    cache.evict(2)
    return handle


def second_half(cache: Any, handle: Any) -> list[Any]:
    """What the cache does next, each result as plain values."""
    seen = [cache.insert_prefix([1, 2, 3, 4, 5, 6, 7, 7], [0, 1, 2, 3, 4, 5, 14, 15])[0]]
    cache.unlock(handle)
    seen.append(list(cache.evict(4)))
    seen.append(cache.match_prefix([1, 2, 3, 4, 9, 9]).cached_len)
    seen.append(cache.match_prefix([1, 2], OTHER).cached_len)
    return [int(x) if not isinstance(x, list) else [int(v) for v in x] for x in seen]


def observed(cache: Any) -> tuple[Any, ...]:
    cache.check_integrity()
    return (cache.abstract_state(), cache.stats(), tuple(cache.size_info), cache.take_events())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_deep_copy_goes_on_as_the_original_would_and_leaves_it_alone(family: str) -> None:
    original = new_cache(family)
    handle = first_half(original)
    before = (original.abstract_state(), original.stats())
    clone, clone_handle = copy.deepcopy((original, handle))
    assert clone_handle.cache is clone and clone is not original
    # a cache that ran everything itself
    replayed = new_cache(family)
    replayed_handle = first_half(replayed)
    assert second_half(clone, clone_handle) == second_half(replayed, replayed_handle)
    assert observed(clone) == observed(replayed)
    # the original saw none of it, and goes on as a fresh replay does
    assert (original.abstract_state(), original.stats()) == before
    fresh = new_cache(family)
    assert second_half(original, handle) == second_half(fresh, first_half(fresh))
    assert observed(original) == observed(fresh)


def shared_mutables(a: Any, b: Any, path: str = "", seen: set[int] | None = None) -> list[str]:
    """Where ``a`` and its deep copy ``b`` hold one mutable object (a list, dict, set, tensor or object of ours)."""
    seen = set() if seen is None else seen
    if isinstance(a, (int, float, str, bytes, tuple, frozenset, type(None), Immutable, torch.device, type)):
        return []
    if type(a).__module__.startswith(("_cffi_backend", "builtins")) and not isinstance(a, (list, dict, set)):
        return []  # a C function, an FFI or a cffi buffer: the machinery, each cache's own or shared read-only
    if a is b:
        return [path or "<top>"]
    if id(a) in seen:
        return []
    seen.add(id(a))
    if isinstance(a, torch.Tensor):
        return [path] if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() else []
    if isinstance(a, dict):
        return [p for key in a for p in shared_mutables(a[key], b[key], f"{path}[{key!r}]", seen)]
    if isinstance(a, list):
        return [
            p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in shared_mutables(x, y, f"{path}[{i}]", seen)
        ]
    if isinstance(a, set) or (callable(a) and not hasattr(a, "__dict__")):
        return []
    fields = vars(a) if hasattr(a, "__dict__") else {}
    return [p for name in fields for p in shared_mutables(fields[name], vars(b)[name], f"{path}.{name}", seen)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_deep_copy_of_a_cache_or_manager_shares_nothing_it_could_change(family: str) -> None:
    cache = new_cache(family)
    first_half(cache)
    assert shared_mutables(cache, copy.deepcopy(cache)) == []
    # a manager with live requests, a lazy free region open and pages cached (the exhaustive manager's rules)
    ops = [("admit", "0", "2"), ("forward_all", "1", "eager"), ("admit", "1", "2"), ("forward_all", "8", "lazy")]
    world = exhaustive.run_ops(1, ops, machine="manager")
    assert isinstance(world, exhaustive.ManagerWorld)
    target = world.machine.impls[list(FAMILIES).index(family)]
    assert shared_mutables(target.manager, copy.deepcopy(target.manager)) == []
    # shared on purpose: Hypothesis's own fields of the machine (the exhaustive checker never runs its runner),
    # and each target's abstract state read last (nobody changes it; a changing call drops it)
    allowed = (
        *(f".machine.{name}" for name in world.machine.RUNNER_FIELDS),
        ".machine.impls[0].state",
        ".machine.impls[1].state",
    )
    assert [path for path in shared_mutables(world, copy.deepcopy(world)) if not path.startswith(allowed)] == []


def test_copies_of_the_c_tree_give_back_every_block() -> None:
    _, lib = load_c()
    cache = new_cache("optimized")
    handle = first_half(cache)
    gc.collect()
    live = lib.radix_tree_live_blocks()
    for _ in range(3):
        clone, clone_handle = copy.deepcopy((cache, handle))
        second_half(clone, clone_handle)
        clone.check_integrity()
        del clone, clone_handle
    gc.collect()
    assert lib.radix_tree_live_blocks() == live


@pytest.mark.parametrize("machine", ["cache", "manager"])
@pytest.mark.parametrize("page_size", [1, 2])
def test_a_copied_state_goes_on_as_its_replay(machine: str, page_size: int) -> None:
    # every transition out of states drawn along random paths: on a deep copy of the state, and on a replay of its
    # path, the same key after (and no failure on either); the state copied from is left as it was
    rng = random.Random(f"{machine}{page_size}")
    alphabet = exhaustive.alphabet_of(machine, page_size)
    for _ in range(6):
        path: list[exhaustive.Op] = []
        world = exhaustive.run_ops(page_size, path, check=False, machine=machine)
        for _ in range(4):
            key = world.key()
            for op in (op for op in alphabet if world.enabled(op)):
                on_copy = copy.deepcopy(world)
                on_copy.apply(op)
                replay = exhaustive.run_ops(page_size, path, machine=machine)
                replay.apply(op)
                assert on_copy.key() == replay.key(), (path, op)
                assert world.key() == key
            op = rng.choice([op for op in alphabet if world.enabled(op)])
            world.apply(op)
            path.append(op)
