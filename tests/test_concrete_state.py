"""What the abstract state cannot see: roots per namespace, handle ownership, slot tensors handed out.

A rejected call changes nothing, concrete state included; a namespace without
pages keeps no root; the slots a handle returns are the caller's copy.
"""

from typing import Any

import pytest
import torch

from radixspec import optimized, reference
from radixspec.spec.errors import InvalidTypeError, MisalignedPageError

TREES = [reference.RadixPrefixCache, optimized.RadixPrefixCache]


@pytest.mark.parametrize("cls", TREES)
def test_a_rejected_insert_makes_no_root(cls: Any) -> None:
    cache = cls(page_size=2)
    with pytest.raises(MisalignedPageError):
        cache.insert_prefix([1, 2], [1, 2], ("tenant", "new"))
    assert cache.roots == {}


@pytest.mark.parametrize("cls", TREES)
def test_a_match_in_an_unknown_namespace_makes_no_root(cls: Any) -> None:
    cache = cls(page_size=1)
    handle = cache.match_prefix([1, 2], ("tenant", "nobody"))
    assert cache.roots == {} and handle.cached_len == 0
    cache.lock(handle)  # an empty path: nothing to lock, nothing to unlock
    cache.unlock(handle)
    assert list(handle.get_matched_indices()) == []


@pytest.mark.parametrize("cls", TREES)
def test_a_namespace_whose_last_page_is_evicted_or_reset_keeps_no_root(cls: Any) -> None:
    cache = cls(page_size=1)
    for tenant in range(50):
        cache.insert_prefix([tenant, 1], [2 * tenant, 2 * tenant + 1], ("tenant", tenant))
    cache.evict(20)  # the 10 oldest namespaces lose both pages
    assert len(cache.roots) == 40
    cache.check_integrity()
    cache.reset()
    assert cache.roots == {}
    cache.check_integrity()


@pytest.mark.parametrize("cls", TREES)
def test_a_handle_of_another_cache_is_rejected_even_on_the_same_path(cls: Any) -> None:
    a, b = cls(page_size=1), cls(page_size=1)
    a.insert_prefix([1], [0])
    b.insert_prefix([1], [0])
    with pytest.raises(InvalidTypeError):
        b.lock(a.match_prefix([1]))


@pytest.mark.parametrize("nodes", ["root", "one node", "two nodes"])
def test_optimized_matched_indices_are_a_copy_the_caller_may_write(nodes: str) -> None:
    # get_matched_indices once returned the node's own slot tensor for a one-node path
    cache = optimized.RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2], [4, 5])
    cache.insert_prefix([1, 2, 3], [4, 5, 6])
    tokens = {"root": [9], "one node": [1, 2], "two nodes": [1, 2, 3]}[nodes]
    slots = cache.match_prefix(tokens).get_matched_indices()
    slots += 100
    cache.check_integrity()
    assert cache.match_prefix([1, 2, 3]).get_matched_indices().tolist() == [4, 5, 6]


def test_optimized_evicted_and_reset_slots_are_copies_too() -> None:
    cache = optimized.RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2], [4, 5])
    evicted = cache.evict(1)
    evicted += 100
    cache.check_integrity()
    assert cache.match_prefix([1]).get_matched_indices().tolist() == [4]
    assert isinstance(cache.reset(), torch.Tensor)
