"""Our own caches as targets (profile: exactly the spec), so the target machines can be checked on known code.

They also show how small a target is: each method forwards to the cache and
turns tensors into lists.
"""

from __future__ import annotations

from typing import Any

import optimized
import reference
from spec import prefix_cache as pc
from spec.domains import Namespace

from ..adapters import OptimizedManager, ReferenceManager
from .api import EXACT, PageKey, Profile, TargetInfo


class OurCache:
    """reference.RadixPrefixCache or optimized.RadixPrefixCache behind the target protocol."""

    profile: Profile = EXACT

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.page_size: int = cache.page_size
        self.evicted: list[list[int]] = []

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> Any:
        return self.cache.match_prefix(tokens, namespace)

    def insert_prefix(self, tokens: list[int], indices: list[int] | None, namespace: Namespace) -> tuple[int, Any]:
        cached_len, handle = self.cache.insert_prefix(tokens, indices, namespace)
        return int(cached_len), handle

    def cached_len(self, handle: Any) -> int:
        return int(handle.cached_len)

    def matched_slots(self, handle: Any) -> list[int]:
        return [int(slot) for slot in handle.get_matched_indices()]

    def lock(self, handle: Any) -> None:
        self.cache.lock(handle)

    def unlock(self, handle: Any) -> None:
        self.cache.unlock(handle)

    def evict(self, size: int) -> None:
        slots = [int(slot) for slot in self.cache.evict(size)]
        if slots:
            self.evicted.append(slots)  # exact page eviction: one unit, ascending

    def reset(self) -> list[int]:
        return [int(slot) for slot in self.cache.reset()]

    def size_info(self) -> tuple[int, int]:
        info = self.cache.size_info
        return int(info.evictable_size), int(info.protected_size)

    def take_evicted(self) -> list[list[int]]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def cached_pages(self) -> dict[PageKey, int]:
        return {key: entry.slot_start for key, entry in self.abstract().entries.items()}

    def page_stamps(self) -> dict[PageKey, int]:
        return {key: entry.last_access for key, entry in self.abstract().entries.items()}

    def abstract(self) -> pc.PrefixCacheState:
        state: pc.PrefixCacheState = self.cache.abstract_state()
        return state


class ObservedManager:
    """Observation methods of a CacheManager target, over one of our managers (``self.manager``)."""

    manager: Any
    profile: Profile = EXACT

    def handle_of(self, req: Any) -> Any:
        return req.cache_handle

    def free_pages(self) -> list[int]:
        state = self.manager.abstract_state()
        return [*state.free_slots, *(state.lazy_frees or [])]

    def cached_slots(self) -> list[int]:
        return [entry.slot_start for entry in self.manager.prefix_cache.abstract_state().entries.values()]

    def size_info(self) -> tuple[int, int]:
        info = self.manager.prefix_cache.size_info
        return int(info.evictable_size), int(info.protected_size)


class ReferenceManagerTarget(ObservedManager, ReferenceManager):
    """reference.CacheManager as a manager target."""

    def __init__(self, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        ReferenceManager.__init__(self, num_pages, page_size, rows, max_seq_len)
        self.page_size, self.num_pages = page_size, num_pages


class OptimizedManagerTarget(ObservedManager, OptimizedManager):
    """optimized.CacheManager as a manager target."""

    def __init__(self, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        OptimizedManager.__init__(self, num_pages, page_size, rows, max_seq_len)
        self.page_size, self.num_pages = page_size, num_pages


REFERENCE = TargetInfo(
    name="reference",
    description="radixspec's reference RadixPrefixCache and CacheManager (pure Python)",
    cache_factory=lambda page_size, num_pages: OurCache(reference.RadixPrefixCache(page_size)),
    manager_factory=ReferenceManagerTarget,
    profile=EXACT,
)
OPTIMIZED = TargetInfo(
    name="optimized",
    description="radixspec's optimized RadixPrefixCache and CacheManager (torch, C)",
    cache_factory=lambda page_size, num_pages: OurCache(optimized.RadixPrefixCache(page_size)),
    manager_factory=OptimizedManagerTarget,
    profile=EXACT,
)
