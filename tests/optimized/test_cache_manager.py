"""The optimized CacheManager: device tensors, batched allocation, and agreement with the reference."""

import pytest
import torch

from radixspec import optimized, reference
from radixspec.spec.errors import InvalidTypeError
from radixspec.spec.requests import Req


def admit(manager: object, prompt: list[int], row: int) -> Req:
    req = Req(input_ids=list(prompt), table_idx=row, cache_handle=None, uid=row)
    handle = manager.match_req(req)  # type: ignore[attr-defined]
    manager.lock(handle)  # type: ignore[attr-defined]
    matched = handle.get_matched_indices()
    table = manager.page_table  # type: ignore[attr-defined]
    if isinstance(table, torch.Tensor):
        table[row, : handle.cached_len] = matched
    else:
        table[row][: handle.cached_len] = matched
    req.cache_handle = handle
    req.cached_len = req.device_len = req.alloc_len = handle.cached_len
    return req


def test_allocate_paged_fills_a_batch_of_rows_with_one_scatter_like_the_reference() -> None:
    fast = optimized.CacheManager(16, 4, optimized.make_page_table(4, 32))
    slow = reference.CacheManager(16, 4, reference.make_page_table(4, 32))
    prompts = [[1] * 9, [2] * 3, [3] * 17]
    fast_reqs = [admit(fast, p, i) for i, p in enumerate(prompts)]
    slow_reqs = [admit(slow, p, i) for i, p in enumerate(prompts)]
    for reqs in (fast_reqs, slow_reqs):
        for req in reqs:
            req.device_len = len(req.input_ids)
    fast.allocate_paged(fast_reqs)
    slow.allocate_paged(slow_reqs)
    for fr, sr in zip(fast_reqs, slow_reqs, strict=True):
        assert fr.alloc_len == sr.alloc_len
        assert fast.page_table[fr.table_idx, : fr.alloc_len].tolist() == slow.page_table[sr.table_idx][: sr.alloc_len]
    assert fast.free_slots.tolist() == slow.free_slots
    fast.check_integrity(fast_reqs)


def test_cache_req_and_lazy_frees_match_the_reference() -> None:
    fast = optimized.CacheManager(8, 2, optimized.make_page_table(2, 16))
    slow = reference.CacheManager(8, 2, reference.make_page_table(2, 16))
    for manager in (fast, slow):
        first, second = admit(manager, [5, 5, 6, 6, 7], 0), admit(manager, [5, 5, 6, 6, 7], 1)
        for req in (first, second):
            req.device_len = 5
            manager.allocate_paged([req])
            req.cached_len = 5
        with manager.lazy_free_region():
            manager.cache_req(first, finished=True)
            manager.cache_req(second, finished=False)
        manager.check_integrity([second])
    assert fast.abstract_state().free_slots == slow.abstract_state().free_slots
    assert fast.abstract_state().cache == slow.abstract_state().cache


@pytest.mark.parametrize("module", [reference, optimized], ids=["reference", "optimized"])
def test_lazy_free_region_hands_back_its_frees_when_its_body_raises(module: object) -> None:
    # a forward that fails after its frees: the held pages still join the free list, and the region closes
    manager = module.CacheManager(4, 2, module.make_page_table(1, 8))  # type: ignore[attr-defined]
    req = admit(manager, [5, 5, 6, 6, 7], 0)
    req.device_len = 5
    manager.allocate_paged([req])
    req.cached_len = 5
    with pytest.raises(RuntimeError, match="forward failed"), manager.lazy_free_region():
        manager.cache_req(req, finished=True)
        raise RuntimeError("forward failed")
    state = manager.abstract_state()
    # 4 pages: two cached (the prompt's whole pages), two free again (the tail past the prompt was freed)
    assert len(state.free_slots) == 2 and state.lazy_frees is None
    manager.check_integrity([])
    with manager.lazy_free_region():
        pass  # the region closed: a new one opens


def test_bools_and_floats_in_plain_lists_are_refused_as_the_reference_refuses_them() -> None:
    # the optimized cache's fast path (a list of plain ints as an array) must not let a bool through
    for cache in (reference.RadixPrefixCache(1), optimized.RadixPrefixCache(1)):
        for call, message in (
            (lambda c=cache: c.match_prefix([1, True]), "input_ids[1] must be an int, got bool"),
            (lambda c=cache: c.insert_prefix([1, 2], [0, True]), "indices[1] must be an int, got bool"),
            (lambda c=cache: c.insert_prefix((1, 2), [0, 1.0]), "indices[1] must be an int, got float"),
        ):
            with pytest.raises(InvalidTypeError) as raised:
                call()
            assert str(raised.value) == message
        assert cache.size_info == (0, 0)


def test_the_edges_of_a_manager_one_page_a_full_row_an_empty_allocation() -> None:
    for module in (reference, optimized):
        manager = module.CacheManager(1, 1, module.make_page_table(1, 4))  # one page of one token
        assert manager.available_size == 1
        naive = module.CacheManager(2, 2, module.make_page_table(1, 4), type="naive")
        assert type(naive.prefix_cache).__name__ == "NaivePrefixCache" and naive.prefix_cache.page_size == 2
        roomy = module.CacheManager(8, 1, module.make_page_table(1, 4))
        req = Req(input_ids=[1, 2, 3, 4], table_idx=0, cache_handle=roomy.match_req(Req([9], 0, None)))
        roomy.lock(req.cache_handle)
        roomy.allocate_paged([req])  # device_len == cached_len == 0: nothing to allocate
        assert req.alloc_len == 0 and roomy.available_size == 8
        req.device_len = 4  # the whole row
        roomy.allocate_paged([req])
        assert req.alloc_len == 4 and roomy.available_size == 4
    for bad in (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), [[0] * 4]):
        with pytest.raises(InvalidTypeError, match=r"^page_table must be a 2-D int32 tensor \(see make_page_table\)$"):
            optimized.CacheManager(2, 1, bad)  # type: ignore[arg-type]
