"""The seed chapter's five review questions (section 6.2), each answered by an executable test."""

from radixspec.reference import RadixPrefixCache
from radixspec.spec.requests import Req
from tests.lifecycle import admit, new_manager, prefill


def test_match_req_drops_the_last_token_so_that_prefill_always_computes_one_token_for_logits() -> None:
    """Q1: why does match_req match only input_ids[: input_len - 1]?"""
    manager = new_manager(8, 1)
    first = admit(manager, [1, 2, 3, 4], 0)
    prefill(manager, first)
    manager.cache_req(first, finished=True)  # all four tokens are now cached
    again = Req(input_ids=[1, 2, 3, 4], table_idx=1, cache_handle=None)
    handle = manager.match_req(again)
    # the whole prompt is cached, yet one token is left to compute: its forward yields the logits
    assert manager.prefix_cache.match_prefix([1, 2, 3, 4]).cached_len == 4
    assert handle.cached_len == 3
    assert len(again.input_ids) - handle.cached_len == 1


def test_available_size_is_checked_again_after_lock_because_locking_makes_the_match_unevictable() -> None:
    """Q2: why does PrefillAdder check available_size before and after lock?"""
    manager = new_manager(4, 1)
    old = admit(manager, [1, 2, 3], 0)
    prefill(manager, old)
    manager.cache_req(old, finished=True)  # 3 pages cached and evictable, 1 free
    req = Req(input_ids=[1, 2, 3, 9, 9], table_idx=1, cache_handle=None)
    handle = manager.match_req(req)
    needed = len(req.input_ids) - handle.cached_len  # 2 tokens to compute
    assert needed <= manager.available_size == 4  # first check passes: the match counts as evictable
    manager.lock(handle)
    # the 3 matched pages are now protected: they no longer count as available
    assert manager.available_size == 1 and needed > manager.available_size
    manager.unlock(handle)  # so the request must not be admitted
    manager.check_integrity([])


def test_get_matched_indices_walks_to_the_root_and_reverses_because_each_node_holds_only_its_own_run() -> None:
    """Q3: why does get_matched_indices walk parent links to the root and then reverse?"""
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert_prefix([1, 2, 5], [10, 11, 20])  # splits [1 2 | 3 4]
    handle = cache.match_prefix([1, 2, 3, 4])
    runs, node = [], handle.node
    while node.parent is not None:
        runs.append(node.value)
        node = node.parent
    # walking up meets the deepest run first; the attention kernel needs sequence order
    assert runs == [[12, 13], [10, 11]]
    assert handle.get_matched_indices() == [10, 11, 12, 13]


def test_cache_req_frees_the_pages_another_request_cached_meanwhile_else_they_leak() -> None:
    """Q4: which case does [old_handle.cached_len : cached_len) free in cache_req?"""
    manager = new_manager(8, 1)
    first, second = admit(manager, [1, 2, 3, 4], 0), admit(manager, [1, 2, 3, 4], 1)
    prefill(manager, first)
    prefill(manager, second)  # both computed the same prompt on their own pages
    manager.cache_req(first, finished=True)
    free_before = len(manager.free_slots)
    manager.cache_req(second, finished=True)
    # second's old handle matched 0 tokens, the insert found 4 cached: its 4 copies go back
    assert len(manager.free_slots) == free_before + 4
    manager.check_integrity([])  # free + cached == num_pages: nothing leaked


def test_eviction_starts_from_unreferenced_leaves_and_the_manager_puts_the_pages_on_the_free_list() -> None:
    """Q5: why does evict start from unreferenced leaves, and who returns the pages to the free list?"""
    manager = new_manager(6, 1)
    held = admit(manager, [1, 2, 3], 0)
    prefill(manager, held)
    manager.cache_req(held, finished=False)  # [1 2 3] cached and locked by a live request
    other = admit(manager, [5], 1)
    prefill(manager, other)
    manager.cache_req(other, finished=True)  # [5] cached, unreferenced
    cache = manager.prefix_cache
    # only an unreferenced leaf can go: an inner page would orphan its children,
    # a referenced one is being read by a live request
    evicted = cache.evict(1)
    assert evicted == [manager.page_table[1][0]]
    # evict only removes the mapping; the slots are not on the free list until the manager puts them there
    assert evicted[0] not in manager.free_slots
    manager.free_slots.extend(evicted)
    manager.check_integrity([held])
