"""A user's prefix cache in a few lines, for the target API tests: the spec's own functions behind the protocol.

``ToyCache`` is correct; ``ForgetfulToyCache`` evicts locked pages too (the
bug a target campaign must catch). ``radixspec fuzz --target
tests.targets.toy:ForgetfulToyCache`` shows the report a user would get.
``TOY_LIFECYCLE`` is a request-lifecycle target (our reference hybrid manager);
``LEAKY_LIFECYCLE`` loses pages (the trace replay's tests).
"""

from __future__ import annotations

from typing import Any

from radixspec.fuzz.targets.api import EXACT, PageKey, Profile, TargetInfo
from radixspec.reference.hybrid_cache import HybridRadixCache
from radixspec.reference.hybrid_manager import HybridCacheManager, HybridReq
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace


class ToyCache:
    """A page dict with the spec's semantics; everything through the spec's functions."""

    profile: Profile = EXACT

    def __init__(self, page_size: int, num_pages: int) -> None:
        self.page_size = page_size
        self.state = pc.new_state(page_size)
        self.evicted: list[list[int]] = []

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> Any:
        return pc.match_prefix(self.state, tokens, namespace)

    def insert_prefix(self, tokens: list[int], indices: list[int] | None, namespace: Namespace) -> tuple[int, Any]:
        cached_len, handle = pc.insert_prefix(self.state, tokens, indices or [], namespace)
        return cached_len, handle

    def cached_len(self, handle: Any) -> int:
        return int(handle.cached_len)

    def get_matched_indices(self, handle: Any) -> list[int]:
        return pc.get_matched_indices(self.state, handle)

    def lock(self, handle: Any) -> None:
        pc.lock(self.state, handle)

    def unlock(self, handle: Any) -> None:
        pc.unlock(self.state, handle)

    def evict(self, size: int) -> None:
        slots = pc.evict(self.state, size)
        if slots:
            self.evicted.append(slots)

    def reset(self) -> list[int]:
        return pc.reset(self.state)

    def size_info(self) -> tuple[int, int]:
        info = pc.size_info(self.state)
        return info.evictable_size, info.protected_size

    def take_evicted(self) -> list[list[int]]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def cached_pages(self) -> dict[PageKey, int]:
        return {key: entry.slot_start for key, entry in self.state.entries.items()}


class ForgetfulToyCache(ToyCache):
    """The toy with a bug: lock() forgets the deepest page of the path, so evict() may take a locked page."""

    def lock(self, handle: Any) -> None:
        keys = pc.get_handle_keys(self.state, handle)
        super().lock(handle)
        if keys:
            entry = self.state.entries[keys[-1]]
            self.state.entries[keys[-1]] = pc.Entry(
                entry.slot_start, entry.last_access, entry.ref_count - 1, entry.generation
            )


class PlainManager:
    """Our reference CacheManager behind the manager protocol only, without the differential capability: the
    manager machine checks it by page accounting alone, as it checks an engine's."""

    HIDDEN = frozenset(
        {"name", "check_integrity", "abstract_state", "view", "spec_handle", "cached_pages", "take_events"}
    )

    def __init__(self, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        from radixspec.fuzz.targets.ours import ReferenceManager

        self.inner = ReferenceManager(num_pages, page_size, rows, max_seq_len)
        self.profile, self.page_size, self.num_pages = EXACT, page_size, num_pages

    def __getattr__(self, name: str) -> Any:
        if name in PlainManager.HIDDEN:
            raise AttributeError(name)
        return getattr(self.inner, name)


PLAIN_MANAGER = TargetInfo(
    name="plain-reference-manager",
    description="the reference CacheManager without the differential capability (page accounting only)",
    manager_factory=PlainManager,
)


def toy_lifecycle(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> HybridCacheManager:
    """Our reference hybrid manager over the reference hybrid cache: a request-lifecycle target of a few lines."""
    return HybridCacheManager(HybridRadixCache(page_size, windows), num_pages)


class LeakyManager(HybridCacheManager):
    """Loses a finished request's uncached last page (a page neither free, cached nor held: the leak
    ``pages_are_partitioned`` names)."""

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        partial = finished and len(req.input_ids) % self.page_size and req.rows and req.rows[0]
        tail = req.rows[0][-1] if partial else None
        super().cache_req(req, finished)
        if tail is not None and tail in self.free_slots[0]:
            self.free_slots[0].remove(tail)


TOY_LIFECYCLE = TargetInfo(
    name="toy-lifecycle", description="the reference hybrid manager as a user's target", hybrid_factory=toy_lifecycle
)
LEAKY_LIFECYCLE = TargetInfo(
    name="leaky-lifecycle",
    description="the reference hybrid manager losing a finished request's partial page",
    hybrid_factory=lambda page_size, windows, num_pages: LeakyManager(HybridRadixCache(page_size, windows), num_pages),
)
