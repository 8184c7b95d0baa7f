"""The naive cache shares nothing but speaks the same API and rejects the same bad input."""

import pytest

from radixspec.reference import NaivePrefixCache
from radixspec.spec.errors import EvictionError, LengthMismatchError, MisalignedPageError


def test_naive_cache_never_matches_and_never_keeps_anything() -> None:
    cache = NaivePrefixCache(page_size=2)
    result = cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
    assert result.cached_len == 0 and result.handle.cached_len == 0
    handle = cache.match_prefix([1, 2, 3, 4])
    assert handle.cached_len == 0 and handle.get_matched_indices() == []
    cache.lock(handle)
    assert cache.is_handle_locked(handle)
    cache.unlock(handle)
    assert cache.size_info == (0, 0)
    assert cache.evict(0) == [] and cache.reset() == []
    with pytest.raises(EvictionError):
        cache.evict(1)
    assert cache.abstract_state().clock == 2
    cache.check_integrity()


def test_naive_cache_rejects_what_an_empty_radix_cache_rejects() -> None:
    cache = NaivePrefixCache(page_size=2)
    with pytest.raises(LengthMismatchError):
        cache.insert_prefix([1, 2], [0])
    with pytest.raises(MisalignedPageError):
        cache.insert_prefix([1, 2], [1, 2])
    assert cache.clock == 0
