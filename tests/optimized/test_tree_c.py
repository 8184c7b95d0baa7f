"""The C tree (csrc/tree.c) at its own entry points, called through cffi as any C caller would.

What the Python wrapper never asks of it is pinned here: an empty match or insert (the wrapper answers those
itself), the walk's ``bad`` index on success, ``radix_tree_break_invariant`` past the live nodes, an eviction
on a tree whose counters claim more than its leaves hold, the memory figure's element sizes, and the blocks of
memory that every call and every tree give back (``radix_tree_live_blocks``). ``python -m tools.mutate_c``
runs this file, with tests/optimized/test_radix_cache.py, against every mutant the machines miss.
"""

import ctypes
import gc
import os
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
import torch

from radixspec.optimized import RadixPrefixCache
from radixspec.optimized._c import load_c
from radixspec.spec.errors import DuplicateSlotError, IntegrityError

ffi, lib = load_c()
# the walk's fields before a call: a value no call reports, so that a field left unwritten shows
UNWRITTEN = 7777


def new_tree(page_size: int) -> tuple[Any, int]:
    """A C tree (freed with its Python object) and its first root."""
    tree = ffi.gc(lib.radix_tree_new(page_size), lib.radix_tree_free)
    root = lib.radix_tree_new_root(tree)
    assert root >= 0
    return tree, root


def new_walk() -> Any:
    return ffi.new("radix_tree_walk *", dict.fromkeys(("node", "version", "length", "bad"), UNWRITTEN))


def tokens_of(values: list[int]) -> Any:
    return ffi.new("int64_t[]", values)


def slots_of(values: list[int]) -> Any:
    return ffi.new("int32_t[]", values)


def test_an_empty_match_without_a_buffer_is_a_miss_at_the_root() -> None:
    tree, root = new_tree(2)
    walk = new_walk()
    assert lib.radix_tree_match(tree, root, ffi.NULL, 8, 0, 0, 1, walk) == lib.RADIX_TREE_OK
    assert (walk.node, walk.length, walk.bad) == (root, 0, -1)


def test_an_empty_insert_without_buffers_caches_nothing() -> None:
    tree, root = new_tree(2)
    walk = new_walk()
    assert lib.radix_tree_insert(tree, root, ffi.NULL, 8, ffi.NULL, 4, 0, 0, 1, walk) == lib.RADIX_TREE_OK
    assert (walk.node, walk.length, walk.bad) == (root, 0, -1)
    counters = ffi.new("radix_tree_counters *")
    lib.radix_tree_counts(tree, counters)
    assert (counters.nodes, counters.pages) == (0, 0)


def test_a_walk_that_succeeds_reports_no_bad_index() -> None:
    tree, root = new_tree(2)
    walk = new_walk()
    assert lib.radix_tree_insert(tree, root, tokens_of([1, 2, 3, 4]), 8, slots_of([0, 1, 2, 3]), 4, 4, 4, 1, walk) == 0
    assert (walk.length, walk.bad) == (0, -1)
    walk = new_walk()
    assert lib.radix_tree_match(tree, root, tokens_of([1, 2, 3, 4, 5]), 8, 4, 5, 2, walk) == lib.RADIX_TREE_OK
    assert (walk.length, walk.bad) == (4, -1)
    assert lib.radix_tree_depth(tree, walk.node, walk.version) == 1


def test_the_counters_are_the_trees_own() -> None:
    # two branches under the root: three pages, locked, and one page; every field written, none left as it was
    tree, root = new_tree(2)
    walk = new_walk()
    assert (
        lib.radix_tree_insert(tree, root, tokens_of([1, 1, 2, 2, 3, 3]), 8, slots_of(list(range(6))), 4, 6, 6, 1, walk)
        == 0
    )
    assert lib.radix_tree_lock(tree, walk.node, walk.version) == lib.RADIX_TREE_OK
    assert lib.radix_tree_insert(tree, root, tokens_of([9, 9]), 8, slots_of([6, 7]), 4, 2, 2, 2, walk) == 0
    fields = ("evictable", "protected_", "nodes", "pages", "roots", "fifo", "heap")
    counters = ffi.new("radix_tree_counters *", dict.fromkeys(fields, UNWRITTEN))
    lib.radix_tree_counts(tree, counters)
    # 2 tokens evictable, 6 locked; 2 nodes holding 4 pages under 1 root; both leaves queued in order, none on the heap
    assert [getattr(counters, field) for field in fields] == [2, 6, 2, 4, 1, 2, 0]


def test_a_bad_call_is_refused_with_nothing_changed() -> None:
    tree, root = new_tree(2)
    walk = new_walk()
    # tokens that are not whole pages, fewer checked than walked, a width the tree does not read
    assert lib.radix_tree_match(tree, root, tokens_of([1, 2, 3]), 8, 3, 3, 1, walk) == lib.RADIX_TREE_BAD_ARGS
    assert lib.radix_tree_match(tree, root, tokens_of([1, 2]), 8, 2, 1, 1, walk) == lib.RADIX_TREE_BAD_ARGS
    assert lib.radix_tree_match(tree, root, tokens_of([1, 2]), 2, 2, 2, 1, walk) == lib.RADIX_TREE_BAD_ARGS
    assert lib.radix_tree_match(tree, root, ffi.NULL, 8, 0, 1, 1, walk) == lib.RADIX_TREE_BAD_ARGS
    assert lib.radix_tree_match(tree, root + 1, tokens_of([1, 2]), 8, 2, 2, 1, walk) == lib.RADIX_TREE_BAD_ARGS
    assert walk.node == UNWRITTEN
    message = ffi.new("char[]", 256)
    assert lib.radix_tree_check(tree, message, 256) == lib.RADIX_TREE_OK


def test_break_invariant_names_live_nodes_only() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    cache.match_prefix([1, 2])  # a split: two nodes and the root
    live = cache.tree_stats()["nodes"] + cache.tree_stats()["roots"]
    assert live == 3
    for field in ("ref_count", "length", "parent", "child_count", "child_refs", "queue_stamp"):
        assert cache.break_invariant(field, live - 1, 0, 0)
        assert not cache.break_invariant(field, live, 0, 1)
    # a slot and a segment's refs: of the nodes that hold pages (the root holds none)
    assert cache.break_invariant("slot", live - 2, 0, 0) and not cache.break_invariant("slot", live - 1, 0, 1)
    cache.check_integrity()


def test_evict_on_a_tree_that_counts_more_evictable_tokens_than_its_leaves_hold_reports_corruption() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    # one page more than any leaf holds: the queues run dry before the count is met
    assert cache.break_invariant("evictable", 0, 0, 2)
    with pytest.raises(IntegrityError, match="no evictable leaf for its evictable tokens"):
        cache.evict(6)


def test_memory_bytes_counts_the_widened_tokens_at_8_bytes_and_the_narrowed_slots_at_4() -> None:
    # the same insert from int64 tokens and int32 slots (read in place), and with a buffer the tree keeps for one
    # of them: int32 tokens widened, int64 slots narrowed; both buffers grow by the same rule
    n = 1000
    tokens, slots = torch.arange(n, dtype=torch.int64), torch.arange(n, dtype=torch.int32)
    memory = {}
    for name, ids, indices in (
        ("in place", tokens, slots),
        ("tokens widened", tokens.to(torch.int32), slots),
        ("slots narrowed", tokens, slots.to(torch.int64)),
    ):
        cache = RadixPrefixCache(page_size=1)
        cache.insert_prefix(ids, indices)
        memory[name] = cache.tree_stats()["memory_bytes"]
    widened, narrowed = memory["tokens widened"] - memory["in place"], memory["slots narrowed"] - memory["in place"]
    assert widened % 8 == 0 and narrowed % 4 == 0 and widened // 8 == narrowed // 4 >= n, memory


def test_a_rebuilt_queue_holds_exactly_the_evictable_leaves() -> None:
    # 30 leaves under the root, matched again and again: each match queues its leaf anew, until the queues hold
    # more than twice the nodes and 64 entries and are rebuilt from the leaves (one entry each, nothing else)
    cache = RadixPrefixCache(page_size=2)
    leaves = [[i, i, 1, 1] for i in range(30)]
    for i, leaf in enumerate(leaves):
        cache.insert_prefix(leaf, list(range(4 * i, 4 * i + 4)))
    entries = []
    for _ in range(6):
        for leaf in leaves:
            cache.match_prefix(leaf)
            stats = cache.tree_stats()
            entries.append(stats["fifo_entries"] + stats["heap_entries"])
    rebuilt = [after for before, after in pairwise(entries) if after < before]
    assert rebuilt and set(rebuilt) == {30}, entries
    cache.check_integrity()


def test_leaves_the_queue_passed_while_locked_wait_on_the_heap_and_leave_in_lru_order() -> None:
    # 100 locked leaves, passed over by an eviction (their queue entries dropped), then unlocked: each is
    # evictable again with a stamp older than the newest queued, so the heap takes it (past its first 64 cells)
    cache = RadixPrefixCache(page_size=1)
    handles = []
    for i in range(100):
        handles.append(cache.insert_prefix([i, 1000], [2 * i, 2 * i + 1]).handle)
        cache.lock(handles[-1])
    cache.insert_prefix([5000], [500])
    assert cache.evict(1).tolist() == [500]
    for handle in reversed(handles):
        cache.unlock(handle)
    # the first one unlocked finds the in-order ring empty and goes there; the other 99 to the heap
    assert (cache.tree_stats()["fifo_entries"], cache.tree_stats()["heap_entries"]) == (1, 99)
    cache.check_integrity()
    # least recently used first: the last page of the first insert (its node split), then its first, and so on
    assert [cache.evict(1).tolist() for _ in range(6)] == [[1], [0], [3], [2], [5], [4]]
    cache.check_integrity()


def churn(cache: RadixPrefixCache) -> Iterator[str]:
    """Every kind of call that allocates or frees in the C tree, one after another; yields what it just did."""
    p = cache.page_size
    for i in range(40):
        ids = torch.arange(i * 3 * p, (i * 3 + 60) * p, dtype=torch.int32 if i % 2 else torch.int64)
        # slots as int64 on every third insert (narrowed into the tree's buffer)
        slots = torch.arange(i * 60 * p, (i + 1) * 60 * p, dtype=torch.int64 if i % 3 == 0 else torch.int32)
        cache.insert_prefix(ids, slots, namespace=("tenant", i % 4))
    yield "inserts (children, starts and node tables grown; widened tokens, narrowed slots)"
    cache.insert_prefix(list(range(60 * p)), list(range(3000 * p, 3060 * p)), namespace=("tenant", 0))
    yield "an insert of cached pages only (its segment not kept)"
    for i in range(40):
        cache.match_prefix(list(range(i * 3 * p, (i * 3 + 30) * p)), namespace=("tenant", i % 4))
    yield "matches that split"
    leaves = [list(range(i * 3 * p, (i * 3 + 60) * p)) for i in range(40)]
    for _ in range(8):
        for i, leaf in enumerate(leaves):
            cache.match_prefix(leaf, namespace=("tenant", i % 4))
    stats = cache.tree_stats()
    # 320 re-stamps of leaves, but the queues hold no more than twice the nodes and 64 more: compacted
    assert stats["fifo_entries"] + stats["heap_entries"] <= 2 * stats["nodes"] + 65, stats
    yield "leaves matched again and again (the queues rebuilt)"
    held = cache.match_prefix(list(range(10 * p)), namespace=("tenant", 0))
    cache.lock(held)
    with pytest.raises(DuplicateSlotError):
        # a duplicate slot among more than 64 new pages: the tree's seen set on the heap
        cache.insert_prefix(list(range(10**6, 10**6 + 100 * p)), list(range(0, 100 * p)))
    yield "a rejected insert"
    cache.evict(cache.size_info.evictable_size // 2 + p)
    yield "a partial eviction (a split, freed segments)"
    cache.unlock(held)
    cache.evict(cache.size_info.evictable_size)
    yield "the rest evicted (empty roots dropped)"
    cache.insert_prefix(list(range(5 * p)), list(range(5 * p)))
    cache.reset()
    yield "a reset"


def test_every_call_and_every_tree_give_back_the_blocks_they_took() -> None:
    gc.collect()
    before = lib.radix_tree_live_blocks()
    cache = RadixPrefixCache(page_size=2)
    assert lib.radix_tree_live_blocks() > before
    for done in churn(cache):
        held = lib.radix_tree_live_blocks()
        cache.abstract_state()
        cache.check_integrity()
        cache.tree_stats()
        assert lib.radix_tree_live_blocks() == held, f"after {done}: an export or a check kept a block"
    del cache
    gc.collect()
    assert lib.radix_tree_live_blocks() == before, "a freed tree kept blocks"


def test_a_tree_freed_while_it_holds_pages_gives_back_its_segments() -> None:
    gc.collect()
    before = lib.radix_tree_live_blocks()
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix(list(range(40)), list(range(40)))
    cache.match_prefix(list(range(10)))  # a split: two nodes share one segment
    cache.insert_prefix(list(range(10)) + [99] * 10, list(range(40, 60)), namespace=("lora", 1))
    del cache
    gc.collect()
    assert lib.radix_tree_live_blocks() == before


def test_an_export_into_buffers_too_small_is_refused_and_gives_back_its_blocks() -> None:
    tree, root = new_tree(2)
    walk = new_walk()
    assert lib.radix_tree_insert(tree, root, tokens_of([1, 2, 3, 4]), 8, slots_of([0, 1, 2, 3]), 4, 4, 4, 1, walk) == 0
    sizes = ffi.new("int64_t[3]", [0, 0, 0])
    # buffers big enough for the one node, but told they hold nothing
    records, tokens, pages = ffi.new("radix_tree_record[1]"), ffi.new("int64_t[4]"), ffi.new("int64_t[2]")
    held = lib.radix_tree_live_blocks()
    assert lib.radix_tree_export(tree, records, tokens, pages, sizes, sizes + 1, sizes + 2) == lib.RADIX_TREE_BAD_ARGS
    assert lib.radix_tree_live_blocks() == held
    sizes[0], sizes[1], sizes[2] = 1, 4, 2
    assert lib.radix_tree_export(tree, records, tokens, pages, sizes, sizes + 1, sizes + 2) == lib.RADIX_TREE_OK
    assert (records[0].length, list(tokens[0:4]), list(pages[0:2])) == (4, [1, 2, 3, 4], [0, 2])
    assert list(sizes) == [1, 4, 2]


def test_a_check_that_finds_the_tree_broken_gives_back_its_blocks() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix(list(range(8)), list(range(8)))
    cache.match_prefix(list(range(4)))
    held = lib.radix_tree_live_blocks()
    for field in ("ref_count", "length", "child_count", "segment_refs", "segment_bytes", "evictable"):
        assert cache.break_invariant(field, 1, 0, 2)
        with pytest.raises(IntegrityError):
            cache.check_integrity()
        cache.break_invariant(field, 1, 0, -2)
        assert lib.radix_tree_live_blocks() == held, field
    cache.check_integrity()


def process_memory() -> int:
    """The bytes the process holds now: under ASan, its allocator's live bytes (it keeps freed blocks in
    quarantine, out of the resident size's reach); else the resident size (Linux: /proc/self/statm)."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        allocated = ctypes.CDLL(None).__sanitizer_get_current_allocated_bytes
        allocated.restype = ctypes.c_size_t
        return int(allocated())
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident memory from /proc")
def test_the_memory_of_a_freed_tree_goes_back_to_the_system() -> None:
    # blocks counted as freed must be freed: 40 trees of a 6 MB segment each, one after another, leave the
    # process no bigger (a segment that large is its own mapping, unmapped when freed)
    n = 500_000
    tokens, slots = torch.arange(n), torch.arange(n, dtype=torch.int32)
    gc.collect()
    start = process_memory()
    for _ in range(40):
        cache = RadixPrefixCache(page_size=1)
        cache.insert_prefix(tokens, slots)
        del cache
    gc.collect()
    grown = process_memory() - start
    assert grown < 100 * 2**20, f"{grown / 2**20:.0f} MiB kept after 40 trees of 6 MB each were freed"
