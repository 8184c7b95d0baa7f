"""A caller's buffer, handle or input that changed, was forged, or came from elsewhere: a named error from
spec/errors.py, nothing changed, the process alive."""

from collections.abc import Callable

import pytest
import torch

from radixspec.optimized import RadixPrefixCache
from radixspec.spec.errors import InvalidTypeError

MUTATIONS: dict[str, Callable[[torch.Tensor], object]] = {
    # a zero stride over a million slots: C would write 999,999 int32 from a 64-byte allocation
    "restrided to a huge zero-stride view": lambda out: out.as_strided_((10**6,), (0,)),
    # the same object, now int8 underneath: C would write four times past the buffer
    "dtype swapped under the same object": lambda out: setattr(out, "data", out.view(torch.int8)),
    # every other slot: the C writes would land between the elements the caller reads
    "restrided to every other slot": lambda out: out.as_strided_((8,), (2,)),
    "shrunk to nothing": lambda out: out.resize_(0),
    "made 2-D": lambda out: out.resize_(4, 4),
}


@pytest.mark.parametrize("mutate", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_an_out_buffer_changed_after_its_first_use_is_checked_again(mutate: Callable[[torch.Tensor], object]) -> None:
    cache = RadixPrefixCache(page_size=1, device="cpu")
    cache.insert_prefix(list(range(12)), torch.arange(12, dtype=torch.int32))
    out = torch.empty(16, dtype=torch.int32)
    assert cache.evict(1, out=out)[:1].tolist() == [11]
    before = cache.abstract_state()
    mutate(out)
    with pytest.raises(InvalidTypeError, match="out must be a 1-D contiguous int32 CPU tensor"):
        cache.evict(1, out=out)
    assert cache.abstract_state() == before
    cache.check_integrity()
    # a buffer that is right again is taken again
    fresh = torch.full((16,), -1, dtype=torch.int32)
    assert cache.evict(2, out=fresh)[:2].tolist() == [9, 10]


# ---------------------------------------------------------------- hybrid caches: groups and handles


def hybrid_pair(family: str) -> tuple[object, object]:
    from radixspec.optimized.hybrid_cache import HybridRadixCache as Optimized
    from radixspec.reference.hybrid_cache import HybridRadixCache as Reference

    make = Optimized if family == "optimized" else Reference
    return make(1, (None, 2)), make(1, (None, 2))


@pytest.mark.parametrize("family", ["reference", "optimized"])
@pytest.mark.parametrize("group", [-1, 2, 10**6])
def test_a_group_outside_the_cache_is_refused_by_size_info(family: str, group: int) -> None:
    from radixspec.spec.errors import InvalidInputError

    cache, _ = hybrid_pair(family)
    with pytest.raises(InvalidInputError, match=f"group {group} is not one of the cache's 2 groups"):
        cache.size_info(group)  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", ["reference", "optimized"])
def test_a_handle_of_another_cache_is_refused_and_neither_cache_changes(family: str) -> None:
    a, b = hybrid_pair(family)
    for cache in (a, b):
        cache.insert_prefix([1, 2, 3, 4], [[0, 1, 2, 3], [0, 1, 2, 3]])  # type: ignore[attr-defined]
    foreign = b.match_prefix([1, 2, 3, 4])  # type: ignore[attr-defined]
    before = (a.abstract_state(), b.abstract_state())  # type: ignore[attr-defined]
    for operation in ("lock", "unlock", "get_matched_pages", "abstract_handle"):
        with pytest.raises(InvalidTypeError, match="another cache|of this cache"):
            getattr(a, operation)(foreign)
    assert (a.abstract_state(), b.abstract_state()) == before  # type: ignore[attr-defined]
    a.check_integrity()  # type: ignore[attr-defined]
    b.check_integrity()  # type: ignore[attr-defined]


def test_a_forged_optimized_hybrid_handle_is_refused_before_c_reads_it() -> None:
    from radixspec.optimized.hybrid_cache import HybridHandle

    cache, _ = hybrid_pair("optimized")
    cache.insert_prefix([1, 2, 3, 4], [[0, 1, 2, 3], [0, 1, 2, 3]])  # type: ignore[attr-defined]
    empty = torch.empty(0, dtype=torch.int64)
    with pytest.raises(InvalidTypeError, match="another cache"):
        cache.lock(HybridHandle(None, (1, 2, 3, 4), empty, empty, empty))  # type: ignore[attr-defined]
    real = cache.match_prefix([1, 2, 3, 4])  # type: ignore[attr-defined]
    # the right owner, arrays too short for its length (C would read past them)
    edited = HybridHandle(None, real.tokens, empty, empty, empty, cache)
    with pytest.raises(InvalidTypeError, match="no longer match its length and groups"):
        cache.lock(edited)  # type: ignore[attr-defined]
    cache.lock(real)  # type: ignore[attr-defined]
    cache.unlock(real)  # type: ignore[attr-defined]
    cache.check_integrity()  # type: ignore[attr-defined]


# ---------------------------------------------------------------- sizes, devices, copies


@pytest.mark.parametrize("size", [2**21, 10**10, 2**63])
def test_an_eviction_past_what_is_evictable_is_the_specs_error_at_every_size(size: int) -> None:
    from radixspec.spec.errors import EvictionError

    cache = RadixPrefixCache(page_size=1, device="cpu")
    cache.insert_prefix([1, 2, 3], [0, 1, 2])
    before = cache.abstract_state()
    # was: torch's RuntimeError / TypeError allocating the result before C checked the size
    with pytest.raises(EvictionError, match=f"cannot evict {size} tokens, only 3 are evictable"):
        cache.evict(size)
    assert cache.abstract_state() == before


def test_a_device_without_data_is_refused() -> None:
    from radixspec.spec.errors import InvalidInputError

    # was: accepted, and the evicted slots were lost on the meta device
    with pytest.raises(InvalidInputError, match="'meta': the caches run on 'cpu' and 'cuda' devices only"):
        RadixPrefixCache(page_size=1, device="meta")


@pytest.mark.parametrize("family", ["reference", "optimized"])
def test_a_pool_whose_slots_leave_the_slot_domain_is_refused(family: str) -> None:
    from radixspec import optimized, reference
    from radixspec.spec.errors import InvalidSizeError

    module = optimized if family == "optimized" else reference
    table = module.make_page_table(2, 8)
    # was: slots past 2**31 (negative in the optimized free list)
    with pytest.raises(InvalidSizeError, match=r"num_pages \* page_size must be <= 2\*\*31"):
        module.CacheManager(2**29 + 1, 4, table)  # type: ignore[arg-type]  # one page past 2**31 slots


def test_a_cache_cannot_be_copied_shallowly_and_the_original_stays_intact() -> None:
    import copy

    from radixspec import reference
    from radixspec.optimized.hybrid_cache import HybridRadixCache as OptimizedHybrid
    from radixspec.reference.hybrid_cache import HybridRadixCache as ReferenceHybrid

    # (a deep copy of a prefix cache is an independent cache: tests/optimized/test_deep_copy.py)
    duplicates = [
        (RadixPrefixCache(page_size=1, device="cpu"), (copy.copy,)),
        (reference.RadixPrefixCache(page_size=1), (copy.copy,)),
        (OptimizedHybrid(1, (None,)), (copy.copy, copy.deepcopy)),
        (ReferenceHybrid(1, (None,)), (copy.copy, copy.deepcopy)),
    ]
    for cache, ways in duplicates:
        for duplicate in ways:
            # was: copy.copy shared the C tree; a change through the copy corrupted the original
            with pytest.raises(InvalidTypeError, match="cannot be copied"):
                duplicate(cache)
        cache.check_integrity()  # type: ignore[attr-defined]


def test_a_campaign_on_a_device_this_machine_lacks_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from radixspec.fuzz import cli

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["--machine", "kv", "--device", "cuda"])
    assert exit_.value.code == 2
    assert "--device cuda: device 'cuda' asked for" in capsys.readouterr().err


def test_a_slot_that_is_an_int_subclass_with_lying_dunders_is_the_int_it_holds_everywhere() -> None:
    """Found by the hostile machine: the spec kept the subclass, whose __hash__ and __eq__ made slot 2 equal to
    the cached slot 0 (DuplicateSlotError), while the optimized cache read 2 and took it."""
    from radixspec import reference
    from radixspec.fuzz.hostile_machine import LyingInt
    from radixspec.spec import prefix_cache as pc

    state = pc.new_state(1)
    caches = [RadixPrefixCache(page_size=1, device="cpu"), reference.RadixPrefixCache(page_size=1)]
    pc.insert_prefix(state, [0], [0], None)
    for cache in caches:
        cache.insert_prefix([0], [0])
    assert pc.insert_prefix(state, [7], [LyingInt(2)], None).cached_len == 0
    for cache in caches:
        assert cache.insert_prefix([7], [LyingInt(2)]).cached_len == 0
    expected = {key: entry.slot_start for key, entry in state.entries.items()}
    for cache in caches:
        assert {key: entry.slot_start for key, entry in cache.abstract_state().entries.items()} == expected
    assert sorted(expected.values()) == [0, 2] and all(type(slot) is int for slot in expected.values())


def test_the_events_of_an_insert_are_built_from_what_c_read_not_from_the_callers_list() -> None:
    """The caller's list may change while C runs (another thread): the values the call keeps for its events
    and messages are the ones C read."""
    from radixspec.spec import events as ev

    cache = RadixPrefixCache(page_size=2, device="cpu", enable_events=True)
    tokens = [1, 2, 3, 4]
    _, n, width, owner = cache._read_in_place(tokens, "_token_room")  # type: ignore[misc]
    tokens[:] = [9, 9, 9, 9]
    assert (n, width, owner.tolist()) == (4, 8, [1, 2, 3, 4])
    # and end to end: the stored events replay to exactly the cached pages
    cache.insert_prefix([5, 6, 7, 8], [0, 1, 2, 3])
    replayed = ev.replay(cache.take_events(), 2)
    assert replayed == {key: entry.slot_start for key, entry in cache.abstract_state().entries.items()}


def test_the_c_hybrid_tree_reads_no_counter_of_a_group_it_does_not_have() -> None:
    """The Python wrapper refuses the group first; C itself answers -1 pages instead of reading past its counters."""
    from radixspec.optimized._c import load_c
    from radixspec.optimized.hybrid_cache import HybridRadixCache

    ffi, lib = load_c()
    cache = HybridRadixCache(1, (None, 2))
    counts = ffi.new("int64_t[3]")
    for group in (-1, 2, 10**6):
        lib.hybrid_counts(cache._tree, group, counts)
        assert (counts[0], counts[1]) == (-1, -1)
    lib.hybrid_counts(cache._tree, 1, counts)
    assert (counts[0], counts[1]) == (0, 0)


def test_the_c_hybrid_tree_reads_no_handle_array_past_the_room_it_is_told() -> None:
    """The wrapper checks the handle's shapes first; C itself refuses a length its arrays do not hold."""
    from radixspec.optimized._c import load_c
    from radixspec.optimized.hybrid_cache import HybridRadixCache

    ffi, lib = load_c()
    cache = HybridRadixCache(2, (None, 4))
    cache.insert_prefix([1, 2, 3, 4], [[0, 2], [0, 2]])
    handle = cache.match_prefix([1, 2, 3, 4, 5])
    arrays = [cache._ptr(a) for a in (handle.nodes, handle.versions, handle.gens)]
    assert lib.hybrid_handle(cache._tree, lib.HYBRID_CHECK, *arrays, 2, 4, ffi.NULL) == lib.HYBRID_OK
    for room, length in ((1, 4), (2, 6), (2, 3), (2, -2)):
        assert lib.hybrid_handle(cache._tree, lib.HYBRID_LOCK, *arrays, room, length, ffi.NULL) == lib.HYBRID_BAD_ARGS
    assert cache.size_info(0).protected_size == 0
    cache.check_integrity()


# ---------------------------------------------------------------- managers and the KV pool


def manager_and_request(family: str) -> tuple[object, object]:
    """A manager of either family (8 pages of 2) with one admitted request: [1..5] in row 0, computed."""
    from radixspec import optimized, reference
    from radixspec.spec.requests import Req

    module = optimized if family == "optimized" else reference
    manager = module.CacheManager(8, 2, module.cache_manager.make_page_table(4, 16))
    req = Req([1, 2, 3, 4, 5], 0, None)
    req.cache_handle = manager.match_req(req)
    manager.lock(req.cache_handle)
    req.device_len = 5
    manager.allocate_paged([req])
    req.cached_len = 5
    return manager, req


@pytest.mark.parametrize("family", ["reference", "optimized"])
def test_request_rows_with_lying_dunders_are_the_ints_they_hold(family: str) -> None:
    from radixspec.fuzz.hostile_machine import LyingInt
    from radixspec.spec.requests import Req

    manager, first = manager_and_request(family)
    batch = []
    for row in (1, 2):
        # rows 1 and 2, whose __eq__ and __hash__ say they are one row: the batch was refused as sharing a row
        req = Req([7, row, 7], LyingInt(row), None)
        req.cache_handle = manager.match_req(req)  # type: ignore[attr-defined]
        manager.lock(req.cache_handle)  # type: ignore[attr-defined]
        req.device_len = 3
        batch.append(req)
    manager.allocate_paged(batch)  # type: ignore[attr-defined]
    assert [req.alloc_len for req in batch] == [4, 4]
    manager.check_integrity([first, *batch])  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", ["reference", "optimized"])
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, r: m.match_req(type(r)(None, 1, None)), "input_ids must be a sequence of ints, got NoneType"),
        (lambda m, r: m.allocate_paged(r), "a batch must be a list or tuple of requests, got Req"),
        (lambda m, r: m.allocate_paged([None]), "NoneType is not a request: its uid must be an int"),
        (lambda m, r: (setattr(r, "cached_len", 4.0), m.cache_req(r, finished=True)), "its cached_len must be an int"),
        (lambda m, r: (setattr(r, "table_idx", True), m.cache_req(r, finished=True)), "its table_idx must be an int"),
    ],
    ids=["match_req of no tokens", "a batch that is a request", "a batch of None", "a float length", "a bool row"],
)
def test_a_malformed_request_is_a_named_type_error_and_changes_nothing(
    family: str, call: Callable[[object, object], object], message: str
) -> None:
    manager, req = manager_and_request(family)
    before = manager.abstract_state()  # type: ignore[attr-defined]
    with pytest.raises(InvalidTypeError, match=message):
        call(manager, req)
    assert manager.abstract_state() == before  # type: ignore[attr-defined]


def test_a_pool_past_the_slot_domain_or_this_machines_memory_is_refused() -> None:
    from radixspec.optimized import MHAKVCache
    from radixspec.spec.errors import InvalidSizeError

    sizes = {"num_kv_heads": 1, "num_layers": 1, "head_dim": 1, "dtype": torch.bfloat16, "device": "cpu"}
    with pytest.raises(InvalidSizeError, match=r"num_pages \* page_size must be <= 2\*\*31"):
        MHAKVCache(num_pages=2**31, page_size=2, **sizes)  # type: ignore[arg-type]
    huge = {**sizes, "num_kv_heads": 2**20, "head_dim": 2**20}
    with pytest.raises(InvalidSizeError, match="bytes cannot be allocated on cpu"):
        MHAKVCache(num_pages=2**20, page_size=1, **huge)  # type: ignore[arg-type]
