"""A refused call says why in the same words on the reference and the optimized twin (and the spec, where it has the
call): the words are part of the API a serving engine logs, so each message is pinned here, once for all twins."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

import radixspec.optimized.cache_manager as opt_manager
import radixspec.reference.cache_manager as ref_manager
from radixspec.optimized.radix_cache import RadixPrefixCache as OptimizedCache
from radixspec.reference.radix_cache import RadixPrefixCache as ReferenceCache
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import (
    CacheBusyError,
    EvictionError,
    IntegrityError,
    InvalidInputError,
    InvalidRequestError,
    InvalidSizeError,
    InvalidTypeError,
    LengthMismatchError,
    OutOfPagesError,
    SlotOutOfRangeError,
    StaleHandleError,
    UnavailableError,
    UnlockError,
)
from radixspec.spec.requests import Req
from radixspec.spec.types import SizeInfo

MANAGERS = {"reference": ref_manager, "optimized": opt_manager}
CACHES = {"reference": ReferenceCache, "optimized": OptimizedCache}


def says(error: type[Exception], call: Callable[[], object]) -> str:
    with pytest.raises(error) as raised:
        call()
    return str(raised.value)


@pytest.fixture(params=list(MANAGERS))
def module(request: pytest.FixtureRequest) -> Any:
    return MANAGERS[request.param]


def manager_of(module: Any, num_pages: int = 4) -> Any:
    return module.CacheManager(num_pages, 2, module.make_page_table(2, 8))


def admitted(manager: Any, prompt: list[int], row: int, uid: int) -> Req:
    handle = manager.match_req(Req(prompt, row, None, uid=uid))
    manager.prefix_cache.lock(handle)
    return Req(prompt, row, handle, uid=uid, cached_len=handle.cached_len, device_len=handle.cached_len)


def test_the_managers_constructors_say_what_is_wrong(module: Any) -> None:
    assert says(InvalidSizeError, lambda: module.make_page_table(0, 8)) == (
        "page table needs >= 1 rows and columns, got 0 x 8"
    )
    assert says(InvalidSizeError, lambda: module.make_page_table(2, 0)) == (
        "page table needs >= 1 rows and columns, got 2 x 0"
    )
    table = module.make_page_table(2, 8)
    assert says(InvalidSizeError, lambda: module.CacheManager(0, 2, table)) == "num_pages must be >= 1, got 0"
    assert says(InvalidRequestError, lambda: module.CacheManager(4, 2, table, type="lru")) == (
        "prefix cache type must be 'radix' or 'naive', got 'lru'"
    )


def test_the_managers_checks_of_a_request_say_what_is_wrong(module: Any) -> None:
    manager = manager_of(module)
    assert says(InvalidRequestError, lambda: manager.match_req(Req([], 0, None, uid=3))) == (
        "a request needs at least one input token"
    )
    req = admitted(manager, [1, 2, 3], 0, 3)
    req.device_len = 3
    outside = dataclasses.replace(req, table_idx=2)
    assert says(InvalidRequestError, lambda: manager.allocate_paged([outside])) == (
        "request 3: table_idx 2 outside the page table"
    )
    released = dataclasses.replace(req, cache_handle=None)
    assert says(InvalidRequestError, lambda: manager.allocate_paged([released])) == (
        "request 3 was already released by cache_req(finished=True)"
    )
    manager.prefix_cache.insert_prefix([5, 6], [6, 7])  # page 3, never allocated: only its handle matters here
    unlocked = admitted(manager, [5, 6, 7], 1, 4)
    assert unlocked.cache_handle.cached_len == 2
    manager.prefix_cache.unlock(unlocked.cache_handle)
    assert says(UnlockError, lambda: manager.cache_req(unlocked, finished=True)) == (
        "request 4: its handle is stale or not locked"
    )
    odd = dataclasses.replace(req, alloc_len=1)
    assert says(InvalidRequestError, lambda: manager.allocate_paged([odd])) == (
        "request 3: alloc_len 1 is not a page boundary of the row"
    )


def test_a_second_lazy_free_region_is_refused(module: Any) -> None:
    manager = manager_of(module)
    with manager.lazy_free_region():
        assert says(CacheBusyError, lambda: manager.lazy_free_region().__enter__()) == (
            "lazy_free_region is already open"
        )


@pytest.fixture(params=list(CACHES))
def cache(request: pytest.FixtureRequest) -> Any:
    return CACHES[request.param](2)


def test_the_caches_say_what_is_wrong(cache: Any) -> None:
    assert says(LengthMismatchError, lambda: cache.insert_prefix([1, 2, 3], [0, 1])) == (
        "input_ids has 3 tokens but indices has 2 slots"
    )
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    handle = cache.match_prefix([1, 2, 3, 4])
    cache.lock(handle)
    assert says(CacheBusyError, cache.reset) == "cannot reset: 4 tokens are locked"
    assert says(EvictionError, lambda: cache.evict(2)) == "cannot evict 2 tokens, only 0 are evictable"
    cache.unlock(handle)
    assert says(UnlockError, lambda: cache.unlock(handle)) == (
        "no lock ends at the last page of this handle (cached_len 4)"
    )
    cache.evict(4)
    assert says(StaleHandleError, handle.get_matched_indices) == (
        "handle of cached_len 4 lost a page to eviction or reset"
    )
    cache.insert_prefix([1, 2], [4, 5])
    kept = cache.match_prefix([1, 2])
    cache.reset()
    assert says(StaleHandleError, kept.get_matched_indices) == "handle of cached_len 2 lost a page to eviction or reset"


def test_the_spec_says_it_in_the_same_words() -> None:
    state = pc.PrefixCacheState(2)
    pc.insert_prefix(state, [1, 2, 3, 4], [0, 1, 2, 3], None)
    handle = pc.match_prefix(state, [1, 2, 3, 4], None)
    pc.lock(state, handle)
    assert says(CacheBusyError, lambda: pc.reset(state)) == "cannot reset: 4 tokens are locked"
    assert says(EvictionError, lambda: pc.evict(state, 2)) == "cannot evict 2 tokens, only 0 are evictable"


def test_the_managers_allocation_and_caching_say_what_is_wrong(module: Any) -> None:
    assert module.make_page_table(1, 1) is not None  # the smallest table
    assert [[int(x) for x in row] for row in module.make_page_table(2, 3)] == [[0, 0, 0], [0, 0, 0]]
    manager = manager_of(module)
    req = admitted(manager, [1, 2, 3], 0, 3)
    assert says(InvalidRequestError, lambda: manager.allocate_paged([dataclasses.replace(req, device_len=9)])) == (
        "request 3: need cached_len 0 <= device_len 9 <= max_seq_len 8"
    )
    misplaced = dataclasses.replace(req, cached_len=3, device_len=3, alloc_len=2)
    assert says(InvalidRequestError, lambda: manager.allocate_paged([misplaced])) == (
        "request 3: row holds pages up to position 2, cached_len 3 needs 4"
    )
    assert says(InvalidRequestError, lambda: manager.allocate_paged([dataclasses.replace(req, alloc_len=10)])) == (
        "request 3: alloc_len 10 is not a page boundary of the row"
    )
    full = dataclasses.replace(req, cached_len=8, device_len=8, alloc_len=8)
    manager.allocate_paged([full])  # a row allocated to its end needs nothing more
    assert says(
        InvalidRequestError, lambda: manager.cache_req(dataclasses.replace(req, cached_len=1), finished=False)
    ) == ("request 3: need handle 0 <= cached_len 1 <= min(alloc_len 0, tokens 3)")


def test_running_out_of_pages_says_how_many_are_free_and_evictable(module: Any) -> None:
    manager = manager_of(module, num_pages=3)
    first = admitted(manager, [1, 1, 2], 0, 0)
    first.device_len = 3
    manager.allocate_paged([first])
    first.cached_len = 3
    manager.cache_req(first, finished=True)  # (1 1) cached and evictable, its tail page freed: 2 free
    req = admitted(manager, [5, 5, 6, 6, 7, 7, 8], 1, 1)
    req.device_len = 8
    assert says(OutOfPagesError, lambda: manager.allocate_paged([req])) == "need 4 pages, have 2 free + 1 evictable"


def test_a_released_request_is_not_live(module: Any) -> None:
    manager = manager_of(module)
    req = admitted(manager, [1, 2, 3], 0, 3)
    manager.check_integrity([req])
    with pytest.raises(IntegrityError) as raised:
        manager.check_integrity([dataclasses.replace(req, cache_handle=None)])
    assert str(raised.value) == "live_requests_hold_distinct_rows: requests [3] are live but were released"


def test_the_spec_names_a_stale_handle_in_the_same_words() -> None:
    state = pc.PrefixCacheState(2)
    pc.insert_prefix(state, [1, 2, 3, 4], [0, 1, 2, 3], None)
    handle = pc.match_prefix(state, [1, 2, 3, 4], None)
    pc.evict(state, 4)
    message = "handle of cached_len 4 lost a page to eviction or reset"
    assert says(StaleHandleError, lambda: pc.get_matched_indices(state, handle)) == message
    assert says(StaleHandleError, lambda: pc.lock(state, handle)) == message


def test_the_kv_pool_names_the_argument_at_fault() -> None:
    import torch

    from radixspec.optimized import MHAKVCache

    pool = MHAKVCache(2, 1, 4, num_pages=4, page_size=2, dtype=torch.float32, device="cpu")
    k = torch.zeros(3, 2, 4)
    slots = torch.tensor([0, 1, 2])
    assert says(InvalidTypeError, lambda: pool.store_kv(k, [0], slots, 0)) == "v must be a torch.Tensor, got list"
    assert says(LengthMismatchError, lambda: pool.store_kv(k, torch.zeros(3, 2, 5), slots, 0)) == (
        "v is (3, 2, 5), the pool holds [n, 2, 4]"
    )
    assert says(InvalidTypeError, lambda: pool.gather_kv(slots.to("meta"), 0)) == "indices are on meta, the pool on cpu"


def test_the_optimized_cache_says_it_of_tensors_too() -> None:
    import torch

    cache = OptimizedCache(2)
    assert says(LengthMismatchError, lambda: cache.insert_prefix(torch.tensor([1, 2, 3]), torch.tensor([0, 1]))) == (
        "input_ids has 3 tokens but indices has 2 slots"
    )


class Pages(int):
    """An int subclass (as numpy or an IntEnum hands over): a size like any other."""


@pytest.mark.parametrize("twin", ["spec", *CACHES])
def test_an_eviction_size_must_be_an_int_and_not_negative(twin: str) -> None:
    if twin == "spec":
        state = pc.PrefixCacheState(2)
        pc.insert_prefix(state, [1, 2, 3, 4], [0, 1, 2, 3], None)

        def evict(size: Any) -> list[int]:
            return list(pc.evict(state, size))

    else:
        cache = CACHES[twin](2)
        cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])

        def evict(size: Any) -> list[int]:
            return [int(slot) for slot in cache.evict(size)]

    for size, name in ((True, "bool"), (2.0, "float"), ("2", "str"), (None, "NoneType")):
        assert says(InvalidTypeError, lambda size=size: evict(size)) == f"size must be an int, got {name}"
    assert says(InvalidSizeError, lambda: evict(-1)) == "cannot evict a negative size (-1)"
    assert says(InvalidSizeError, lambda: evict(Pages(-3))) == "cannot evict a negative size (-3)"
    assert evict(Pages(1)) == [2, 3]  # one token: its page, the LRU leaf's
    assert evict(Pages(0)) == []
    assert says(EvictionError, lambda: evict(Pages(3))) == "cannot evict 3 tokens, only 2 are evictable"


@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_negative_token_is_named_by_its_position_even_past_the_cached_pages(as_tensor: bool) -> None:
    import torch

    for cls in CACHES.values():
        if as_tensor and cls is ReferenceCache:
            continue  # the reference takes sequences of ints only
        cache = cls(1)
        cache.insert_prefix([1, 2], [0, 1])  # a root: the walk reads the tokens
        for tokens, bad, value in (([1, -5, 3], 1, -5), ([1, 2, 3, -9], 3, -9), ([-1], 0, -1)):
            ids: Any = torch.tensor(tokens) if as_tensor else tokens
            assert says(InvalidInputError, lambda ids=ids, cache=cache: cache.match_prefix(ids)) == (
                f"input_ids[{bad}] = {value} is outside [0, 2**63)"
            )
        empty = cache.match_prefix([7], ("a",))  # no root for ("a",)
        assert cache.abstract_handle(empty) == pc.Handle(("a",), (), ())
        cache.insert_prefix([1], [5], ("a",))
        missed = cache.match_prefix([7, 8], ("a",))  # a root, and nothing under it matches
        assert cache.abstract_handle(missed) == pc.Handle(("a",), (), ())


def test_a_handle_of_another_kind_or_cache_is_refused() -> None:
    for cls, kind in ((ReferenceCache, "a RadixCacheHandle"), (OptimizedCache, "an optimized RadixCacheHandle")):
        cache, other = cls(2), cls(2)
        handle = other.match_prefix([1, 2])
        assert says(InvalidTypeError, lambda cache=cache: cache.lock(object())) == f"expected {kind}, got object"
        assert says(InvalidTypeError, lambda cache=cache, handle=handle: cache.unlock(handle)) == (
            "the handle belongs to another cache"
        )


def test_each_status_of_the_c_tree_has_its_error_and_words() -> None:
    from radixspec.optimized import radix_cache as oc

    cache = OptimizedCache(2)
    cases = [
        (oc._NO_MEMORY, MemoryError, "the C radix tree is out of memory"),
        (oc._CORRUPT, IntegrityError, "the C radix tree found no evictable leaf for its evictable tokens"),
        (oc._STALE, StaleHandleError, "handle of cached_len 0 lost a page to eviction or reset"),
        (oc._NOT_LOCKED, UnlockError, "no lock ends at the last page of this handle (cached_len 0)"),
        (oc._BAD_ARGS, UnavailableError, "csrc/tree.c rejected its arguments (status -1)"),
        (oc._BUSY, UnavailableError, "csrc/tree.c rejected its arguments (status -8)"),
    ]
    for status, error, message in cases:
        assert says(error, lambda status=status: cache._raise_for(status)) == message
    cache._raise_for(oc._OK)


def test_the_largest_token_id_is_accepted_on_every_path() -> None:
    import torch

    top = 2**63 - 1
    for cls in CACHES.values():
        cache = cls(1)
        assert cache.match_prefix([top]).cached_len == 0  # no root yet: checked without the walk
        if cls is OptimizedCache:
            assert cache.match_prefix(torch.tensor([top])).cached_len == 0
        cache.insert_prefix([top, 1], [0, 1])
        assert cache.match_prefix([top, 1, 2]).cached_len == 2


def test_ints_of_any_int_type_in_a_list_or_tuple_are_tokens_and_slots() -> None:
    """An IntEnum or another int subclass leaves the plain-int fast path; the checked path takes it alike."""
    from enum import IntEnum

    class Token(IntEnum):
        SEVEN = 7

    for cls in CACHES.values():
        cache = cls(1)
        cache.insert_prefix((Token.SEVEN, Pages(8)), [Pages(0), 1])
        cache.insert_prefix([7, 8, 9], (0, 1, Token.SEVEN))
        assert cache.match_prefix([7, 8, 9]).cached_len == 3
        assert cache.match_prefix((Token.SEVEN, 8)).cached_len == 2
        assert [int(s) for s in cache.match_prefix([7, 8, 9]).get_matched_indices()] == [0, 1, 7]
        assert cache.stats().of(None).pages_stored == 3


def test_an_insert_checks_slots_before_the_namespace_and_the_lengths_as_the_reference_does() -> None:
    for cls in CACHES.values():
        cache = cls(1)
        cache.insert_prefix([5], [9])  # a root: the optimized cache reaches its C checks
        message = "indices[1] = 1099511627776 is outside [0, 2**31)"
        assert says(SlotOutOfRangeError, lambda cache=cache: cache.insert_prefix([1, 2], [0, 2**40], "x")) == message
        assert says(SlotOutOfRangeError, lambda cache=cache: cache.insert_prefix([1, 2, 3], [0, 2**40])) == message
        assert says(InvalidTypeError, lambda cache=cache: cache.insert_prefix([1, 2], [0, 1], "x")) == (
            "namespace must be None or a tuple (e.g. ('lora', 7)), got str"
        )


def test_page_sizes_namespaces_and_devices_are_checked_in_the_same_words_everywhere() -> None:
    import torch

    from radixspec.optimized.inputs import device_of
    from radixspec.spec.domains import check_namespace

    makers = [pc.new_state, *CACHES.values()]
    for make in makers:
        assert says(InvalidTypeError, lambda make=make: make(2.0)) == "page_size must be an int, got float"
        assert says(InvalidTypeError, lambda make=make: make(True)) == "page_size must be an int, got bool"
        assert says(InvalidInputError, lambda make=make: make(0)) == "page_size must be >= 1, got 0"
        # was: accepted by the reference, an OverflowError of the C tree
        assert says(InvalidInputError, lambda make=make: make(2**63)) == (
            "page_size must be <= 2**31 (a page's slots lie in the slot domain), got 9223372036854775808"
        )
    assert says(InvalidTypeError, lambda: check_namespace("lora")) == (
        "namespace must be None or a tuple (e.g. ('lora', 7)), got str"
    )
    assert says(InvalidTypeError, lambda: check_namespace(("lora", (1, 2.5)))) == (
        "namespace[1][1] is a float: namespace items must be str, bytes, int (not bool, float or a subclass)"
        " or tuples of those"
    )
    assert says(InvalidTypeError, lambda: check_namespace((True,))) == (
        "namespace[0] is a bool: namespace items must be str, bytes, int (not bool, float or a subclass)"
        " or tuples of those"
    )
    state = pc.new_state(2)
    assert says(InvalidTypeError, lambda: pc.lock(state, object())) == "expected a spec Handle, got object"
    assert says(InvalidTypeError, lambda: device_of("gpu")).startswith("not a torch device: 'gpu' (")
    assert device_of("cpu") == device_of(torch.device("cpu")) == torch.device("cpu")


def test_asking_for_a_gpu_that_is_not_there_says_what_this_torch_sees() -> None:
    import torch

    from radixspec.optimized.inputs import device_of

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")  # pragma: no cover
    built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    for name in ("cuda", "cuda:1"):
        assert says(UnavailableError, lambda name=name: device_of(name)) == (
            f"device {name!r} asked for, but torch {torch.__version__} ({built}) sees no CUDA device; use device='cpu'"
        )


def test_a_cache_made_without_arguments_has_pages_of_one_token() -> None:
    from radixspec import optimized, reference

    for cls in (ReferenceCache, OptimizedCache, reference.NaivePrefixCache, optimized.NaivePrefixCache):
        cache = cls()
        assert cache.page_size == 1 and cache.insert_prefix([1, 2, 3], [0, 1, 2])[0] == 0


def test_a_slot_refused_in_c_still_comes_before_the_namespace_and_the_lengths() -> None:
    """A negative slot passes the optimized cache's fast path and is refused later, in C: still first."""
    for cls in CACHES.values():
        cache = cls(1)
        cache.insert_prefix([5], [9])
        message = "indices[1] = -1 is outside [0, 2**31)"
        assert says(SlotOutOfRangeError, lambda cache=cache: cache.insert_prefix([1, 2], [0, -1], "x")) == message
        assert says(SlotOutOfRangeError, lambda cache=cache: cache.insert_prefix([1, 2, 3], [0, -1])) == message


def test_a_stale_handle_is_named_by_its_length_on_every_call() -> None:
    cache = OptimizedCache(2)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    handle = cache.match_prefix([1, 2, 3, 4])
    cache.evict(4)
    message = "handle of cached_len 4 lost a page to eviction or reset"
    calls = [lambda: cache.lock(handle), lambda: cache.abstract_handle(handle), lambda: cache.path_nodes(handle)]
    for call in (*calls, handle.get_matched_indices):
        assert says(StaleHandleError, call) == message


def test_a_root_without_pages_is_an_integrity_error() -> None:
    cache = OptimizedCache(1)
    cache.insert_prefix([1], [0])
    cache._new_root(("x",))  # a namespace whose root holds nothing: what a lost drop would leave
    assert says(IntegrityError, cache.check_integrity) == (
        "roots_hold_pages: namespaces [('x',)] keep a root without pages"
    )


def test_a_size_info_that_disagrees_with_the_pages_is_an_integrity_error(
    cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    cache.check_integrity()
    monkeypatch.setattr(type(cache), "size_info", property(lambda self: SizeInfo(2, 2)))
    assert says(IntegrityError, cache.check_integrity) == (
        "sizes_equal_page_counts: size_info reports (2, 2), pages give (4, 0)"
    )


def test_root_tables_out_of_step_with_the_tree_are_an_integrity_error() -> None:
    cache = OptimizedCache(1)
    cache.insert_prefix([1], [0])
    for ghost in range(12345, 12350):  # root ids no namespace holds: what lost drops would leave
        cache._namespace_of[ghost] = ("x", ghost)
    assert says(IntegrityError, cache.check_integrity) == (
        "roots_hold_pages: roots [12345, 12346, 12347, 12348] are named by one root table only"
    )
    for ghost in range(12345, 12350):
        del cache._namespace_of[ghost]
    cache.check_integrity()
    root = cache.roots.pop(None)  # a root the tree holds that no namespace names
    assert says(IntegrityError, cache.check_integrity) == "roots_hold_pages: the tree holds 1 roots, 0 namespaces"
    cache.roots[None] = root
    cache.check_integrity()


def test_five_roots_without_pages_are_named_four_at_most() -> None:
    cache = OptimizedCache(1)
    cache.insert_prefix([1], [0])
    for k in range(5):
        cache._new_root((f"x{k}",))
    assert says(IntegrityError, cache.check_integrity) == (
        "roots_hold_pages: namespaces [('x0',), ('x1',), ('x2',), ('x3',)] keep a root without pages"
    )


def test_a_stale_handle_is_named_by_its_length_when_locked_on_every_twin(cache: Any) -> None:
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    handle = cache.match_prefix([1, 2, 3, 4])
    cache.evict(4)
    assert says(StaleHandleError, lambda: cache.lock(handle)) == (
        "handle of cached_len 4 lost a page to eviction or reset"
    )


def test_the_optimized_checks_outside_the_c_walk_say_it_in_the_same_words() -> None:
    import torch

    from radixspec.optimized.inputs import as_insert_args, as_slots, as_tokens

    cpu = torch.device("cpu")
    assert says(InvalidTypeError, lambda: as_tokens(torch.zeros((2, 2), dtype=torch.int64))) == (
        "input_ids must be a 1-D int32/int64 CPU tensor, got 2-D torch.int64 on cpu"
    )
    # no root yet: match checks the tensor's range itself, with no walk in C
    assert says(InvalidInputError, lambda: OptimizedCache(2).match_prefix(torch.tensor([3, -1]))) == (
        "input_ids[1] = -1 is outside [0, 2**63)"
    )
    assert says(InvalidTypeError, lambda: as_slots(torch.zeros(2, dtype=torch.int64, device="meta"), cpu)) == (
        "indices are on meta, the cache's slots live on cpu"
    )
    assert says(LengthMismatchError, lambda: as_insert_args([1, 2, 3], [0, 1], None, cpu)) == (
        "input_ids has 3 tokens but indices has 2 slots"
    )
    cache = OptimizedCache(1)  # a negative slot from a list passes the fast path; C refuses it in these words
    assert says(SlotOutOfRangeError, lambda: cache.insert_prefix([1, 2], [0, -1])) == (
        "indices[1] = -1 is outside [0, 2**31)"
    )


class _LibWith:
    """The C module's functions, some replaced: what the C tree says when it is out of memory or corrupted."""

    def __init__(self, lib: Any, **replaced: Any) -> None:
        self._lib, self._replaced = lib, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced.get(name) or getattr(self._lib, name)


def test_a_c_tree_out_of_memory_or_corrupted_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixspec.optimized.radix_cache as module
    from radixspec.optimized._c import load_c

    ffi, lib = load_c()
    monkeypatch.setattr(module, "load_c", lambda: (ffi, _LibWith(lib, radix_tree_new=lambda p: ffi.NULL)))
    assert says(MemoryError, lambda: OptimizedCache(2)) == "radix_tree_new: out of memory"

    def corrupt(tree: Any, message: Any, capacity: int) -> int:
        text = b"tree_is_well_formed: planted"
        ffi.memmove(message, text + b"\0", len(text) + 1)
        return int(module._CORRUPT)

    monkeypatch.setattr(module, "load_c", lambda: (ffi, _LibWith(lib, radix_tree_check=corrupt)))
    cache = OptimizedCache(2)
    cache.insert_prefix([1, 2], [0, 1])
    assert says(IntegrityError, cache.check_integrity) == "tree_is_well_formed: planted"
