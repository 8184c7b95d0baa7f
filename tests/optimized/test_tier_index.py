"""The C index of the tiered cache (csrc/tiers.c) on its own: its guards refuse what the wrapper must never pass,
changing nothing, and ``tier_check`` names each law it keeps when it is broken."""

from __future__ import annotations

import pytest

from radixspec.optimized.tiered_cache import NONE, TieredRadixCache, TierIndex
from radixspec.spec.errors import IntegrityError


def chain(pages: int, page_size: int = 2) -> tuple[TierIndex, int, list[int]]:
    """An index with one root and a chain of ``pages`` pages, each on the device at page * P."""
    index = TierIndex(page_size)
    root = index.new_root()
    nodes = index.add_pages(root, list(range(1, pages * page_size + 1)), [0] * pages, stamp=0)
    for page, node in enumerate(nodes):
        index.set([node], index.lib.TIER_DEVICE, page * page_size)
    index.check()
    return index, root, nodes


def test_a_walk_finds_the_chain_and_its_runs_per_tier() -> None:
    index, root, nodes = chain(3)
    lib = index.lib
    index.set([nodes[2]], lib.TIER_HOST, 0)
    index.set([nodes[2]], lib.TIER_DEVICE, NONE)
    assert index.walk(root, [1, 2, 3, 4, 5, 6, 7]) == (nodes, 2, 3)
    assert index.walk(root, [1, 2, 9, 9]) == (nodes[:1], 1, 1)
    assert index.get(nodes[0], lib.TIER_ON_DEVICE_BELOW) == 1
    assert index.get(nodes[1], lib.TIER_ON_DEVICE_BELOW) == 0
    index.check()


def test_the_guards_refuse_and_change_nothing() -> None:
    index, root, nodes = chain(2)
    lib = index.lib
    before = index.export()
    # a count below zero, a field that is no count, a page with a child or a copy leaving, a root as a page
    assert lib.tier_add(index.tree, index._array([nodes[0]]), 1, lib.TIER_REFS, -1) == lib.TIER_BAD_ARGS
    assert lib.tier_add(index.tree, index._array([nodes[0]]), 1, lib.TIER_DEVICE, 1) == lib.TIER_BAD_ARGS
    assert lib.tier_set(index.tree, index._array([nodes[0]]), 1, lib.TIER_PINS, 3) == lib.TIER_BAD_ARGS
    assert lib.tier_remove(index.tree, nodes[0]) == lib.TIER_BAD_ARGS
    assert lib.tier_remove(index.tree, root) == lib.TIER_BAD_ARGS
    index.set([nodes[1]], lib.TIER_DEVICE, NONE)
    index.set([nodes[1]], lib.TIER_HOST, 4)
    before = index.export()
    assert lib.tier_remove(index.tree, nodes[1]) == lib.TIER_BAD_ARGS
    # a page that is a child already
    pins = index._array([0])
    out = index.ffi.new("int64_t[1]")
    assert lib.tier_add_pages(index.tree, root, index._array([1, 2]), 1, pins, 0, out) == lib.TIER_BAD_ARGS
    assert index.export() == before
    index.check()


def test_a_node_named_twice_counts_twice_against_zero() -> None:
    index, _, nodes = chain(1)
    lib = index.lib
    index.add([nodes[0]], lib.TIER_PINS, 1)
    assert lib.tier_add(index.tree, index._array([nodes[0], nodes[0]]), 2, lib.TIER_PINS, -1) == lib.TIER_BAD_ARGS
    assert index.get(nodes[0], lib.TIER_PINS) == 1


def test_a_removed_page_is_a_stale_handles_page_and_its_id_comes_back_with_a_new_version() -> None:
    index, root, nodes = chain(1)
    lib = index.lib
    version = index.get(nodes[0], lib.TIER_VERSION)
    index.set([nodes[0]], lib.TIER_DEVICE, NONE)
    index.remove(nodes[0])
    assert index.get(nodes[0], lib.TIER_DEVICE) == NONE
    (again,) = index.add_pages(root, [1, 2], [0], stamp=1)
    assert again == nodes[0] and index.get(again, lib.TIER_VERSION) == version + 1
    index.set([again], lib.TIER_DEVICE, 0)
    check = lib.tier_handle(index.tree, lib.TIER_LOCK, index._array([again]), index._array([version]),
                            index._array([1]), 1)  # fmt: skip
    assert check == lib.TIER_STALE
    assert index.get(again, lib.TIER_REFS) == 0


@pytest.mark.parametrize(
    ("break_it", "law"),
    [
        # a child on the device under a page off it
        (lambda index, nodes: index.set([nodes[0]], index.lib.TIER_HOST, 0)
         or index.set([nodes[0]], index.lib.TIER_DEVICE, NONE), "device_copies_are_prefix_closed"),
        # a page with no copy left in the index
        (lambda index, nodes: index.set([nodes[1]], index.lib.TIER_DEVICE, NONE), "every_page_holds_a_copy"),
    ],
)  # fmt: skip
def test_tier_check_names_the_law_a_change_breaks(break_it: object, law: str) -> None:
    index, _, nodes = chain(2)
    break_it(index, nodes)  # type: ignore[operator]
    with pytest.raises(IntegrityError, match=f"^{law}: "):
        index.check()


def test_the_cache_checks_its_index_first() -> None:
    """check_integrity runs the index's laws before the spec's: a page left without a copy by a change of the C
    index alone is named by the index's law."""
    cache = TieredRadixCache(2, 4, 4, policy="write_back")
    cache.insert_prefix([1, 2, 3, 4], [slot + offset for slot in cache.allocate(2) for offset in (0, 1)])
    path, _, _ = cache._walk(None, [1, 2, 3, 4])
    cache.index.set([path[1]], cache.c.TIER_DEVICE, NONE)
    with pytest.raises(IntegrityError, match="^every_page_holds_a_copy: "):
        cache.check_integrity()


def test_a_plan_takes_the_least_recently_used_leaf_first_then_its_parent() -> None:
    index, root, nodes = chain(2)
    lib = index.lib
    (other,) = index.add_pages(root, [7, 8], [0], stamp=5)
    index.set([other], lib.TIER_DEVICE, 8)
    index.set([other], lib.TIER_HOST, 0)
    for node in nodes:
        index.set([node], lib.TIER_HOST, 2 + node)
    # the chain is older (stamp 0): its leaf first, then the page above it, then the newer page
    assert index.plan(lib.TIER_ON_DEVICE, 3, True, []) == [nodes[1], nodes[0], other]
    # kept pages are never taken, nor those above them
    assert index.plan(lib.TIER_ON_DEVICE, 3, True, [nodes[1]]) == [other]
    # a host copy is evictable only off the device
    assert index.plan(lib.TIER_ON_HOST, 3, False, []) == []
