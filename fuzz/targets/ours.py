"""Our own caches and managers as targets, with the exact profile and the differential capability.

The spec, the reference and the optimized implementations are reached by the
machines through the same protocol as SGLang's or vLLM's caches
(``radixspec.fuzz.targets.api``). Each also offers ``ExactCache`` / ``ExactManager``:
its abstract state, a fingerprint, its KV events and its integrity check, so
the machines compare it with the spec state for state.

They also show how small a target is: each method forwards to the cache and
turns tensors into lists.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

from radixspec import reference
from radixspec.reference.hybrid_cache import HybridRadixCache
from radixspec.reference.radix_cache import RadixCacheHandle
from radixspec.spec import cache_manager as sm
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.events import Event
from radixspec.spec.invariants import check_invariants
from radixspec.spec.metrics import CacheStats
from radixspec.spec.requests import Req
from radixspec.spec.types import SizeInfo

from .api import EXACT, PageKey, Profile, TargetInfo

if TYPE_CHECKING:
    from radixspec import optimized
    from radixspec.optimized.radix_cache import RadixCacheHandle as OptimizedHandle

    from .ours_optimized import OptimizedCache, OptimizedManager

# the handle type of a cache: the spec's, the reference tree's or the optimized tree's
H = TypeVar("H", pc.Handle, RadixCacheHandle, "OptimizedHandle")
Tree = TypeVar("Tree", reference.RadixPrefixCache, "optimized.RadixPrefixCache")


class ExactTarget(Generic[H]):
    """What every exact cache target shares: the profile, the eviction units, the page views."""

    profile: Profile = EXACT
    name: str
    page_size: int
    evicted: list[list[int]]

    def abstract_state(self) -> pc.PrefixCacheState:
        raise NotImplementedError

    def take_evicted(self) -> list[list[int]]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def note_evicted(self, slots: list[int]) -> None:
        if slots:
            self.evicted.append(slots)  # exact page eviction: one unit, ascending

    def cached_pages(self) -> dict[PageKey, int]:
        return {key: entry.slot_start for key, entry in self.abstract_state().entries.items()}

    def page_stamps(self) -> dict[PageKey, int]:
        return {key: entry.last_access for key, entry in self.abstract_state().entries.items()}


class SpecCache(ExactTarget[pc.Handle]):
    """The spec's free functions over one state (the oracle of the exhaustive checker)."""

    name = "spec"

    def __init__(self, page_size: int, num_pages: int = 0) -> None:
        self.page_size = page_size
        self.state = pc.new_state(page_size)
        self.evicted = []

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> pc.Handle:
        return pc.match_prefix(self.state, tokens, namespace)

    def insert_prefix(
        self, tokens: list[int], indices: list[int] | None, namespace: Namespace
    ) -> tuple[int, pc.Handle]:
        result = pc.insert_prefix(self.state, tokens, indices or [], namespace)
        return result.cached_len, result.handle

    def cached_len(self, handle: pc.Handle) -> int:
        return handle.cached_len

    def matched_slots(self, handle: pc.Handle) -> list[int]:
        return pc.get_matched_indices(self.state, handle)

    def lock(self, handle: pc.Handle) -> None:
        pc.lock(self.state, handle)

    def unlock(self, handle: pc.Handle) -> None:
        pc.unlock(self.state, handle)

    def evict(self, size: int) -> None:
        self.note_evicted(pc.evict(self.state, size))

    def reset(self) -> list[int]:
        return pc.reset(self.state)

    def size_info(self) -> tuple[int, int]:
        info = pc.size_info(self.state)
        return info.evictable_size, info.protected_size

    def check_integrity(self) -> None:
        check_invariants(self.state)

    def abstract_state(self) -> pc.PrefixCacheState:
        return pc.PrefixCacheState(self.state.page_size, dict(self.state.entries), self.state.clock)

    def fingerprint(self) -> Hashable:
        return (self.size_info(), self.state.clock)

    def take_events(self) -> list[Event]:
        """The spec is the oracle of the events, not a source: its pages are what they must replay to."""
        return []


class TreeTarget(ExactTarget[H], Generic[H, Tree]):
    """Calls that read the same on both trees (``self.cache``)."""

    cache: Tree

    def lock(self, handle: H) -> None:
        self.cache.lock(handle)  # type: ignore[arg-type]

    def unlock(self, handle: H) -> None:
        self.cache.unlock(handle)  # type: ignore[arg-type]

    def cached_len(self, handle: H) -> int:
        return int(handle.cached_len)

    def size_info(self) -> tuple[int, int]:
        info = self.cache.size_info
        return int(info.evictable_size), int(info.protected_size)

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def abstract_state(self) -> pc.PrefixCacheState:
        return self.cache.abstract_state()

    def fingerprint(self) -> Hashable:
        return (self.size_info(), self.cache.clock)

    def take_events(self) -> list[Event]:
        return list(self.cache.take_events())

    def stats(self) -> CacheStats:
        """The cache's metrics (spec/metrics.py)."""
        return self.cache.stats()


class ReferenceCache(TreeTarget[RadixCacheHandle, reference.RadixPrefixCache]):
    """The reference RadixPrefixCache (already lists and ints)."""

    name = "reference"

    def __init__(self, page_size: int, num_pages: int = 0) -> None:
        self.page_size = page_size
        self.cache = reference.RadixPrefixCache(page_size)
        self.cache.enable_events()
        self.evicted = []

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> RadixCacheHandle:
        return self.cache.match_prefix(tokens, namespace)

    def insert_prefix(
        self, tokens: list[int], indices: list[int] | None, namespace: Namespace
    ) -> tuple[int, RadixCacheHandle]:
        cached_len, handle = self.cache.insert_prefix(tokens, indices or [], namespace)
        return cached_len, handle

    def matched_slots(self, handle: RadixCacheHandle) -> list[int]:
        return list(handle.get_matched_indices())

    def path_nodes(self, handle: RadixCacheHandle) -> int:
        """Radix nodes from the handle's node up to the root."""
        depth, node = 0, handle.node
        while node.parent is not None:
            depth, node = depth + 1, node.parent
        return depth

    def evict(self, size: int) -> None:
        self.note_evicted(list(self.cache.evict(size)))

    def reset(self) -> list[int]:
        return list(self.cache.reset())


# ---------------------------------------------------------------- managers

Handle: TypeAlias = "RadixCacheHandle | OptimizedHandle"


def as_list(values: Any) -> list[Any]:
    """A sequence as a list: a tensor or an array through its ``tolist`` (no torch import for lists)."""
    return list(values.tolist() if hasattr(values, "tolist") else values)


class OurManager:
    """One of our CacheManagers as a target with the exact profile and the differential capability.

    Requests are ``radixspec.spec.requests.Req``; the optimized manager's keep token ids as a CPU tensor.
    """

    profile: Profile = EXACT
    name: str

    def __init__(self, manager: Any, num_pages: int, page_size: int) -> None:
        # the two managers share their API but not their types (lists against tensors): read through Any
        self.manager: Any = manager
        self.manager.prefix_cache.enable_events()
        self.page_size, self.num_pages = page_size, num_pages

    # ------------------------------------------------------------ requests

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> Req:
        return Req(input_ids=list(prompt), table_idx=table_idx, cache_handle=None, namespace=namespace, uid=uid)

    def set_lengths(self, req: Req, cached_len: int, device_len: int) -> None:
        req.cached_len, req.device_len = cached_len, device_len

    def append_token(self, req: Req, token: int) -> None:
        req.input_ids.append(token)

    def admit(self, req: Req, handle: Handle) -> None:
        matched = handle.get_matched_indices()
        self.manager.page_table[req.table_idx][: len(matched)] = matched
        req.cache_handle = handle
        req.cached_len = req.device_len = req.alloc_len = handle.cached_len

    def handle_of(self, req: Req) -> Handle:
        handle: Handle = req.cache_handle  # type: ignore[assignment]
        return handle

    def row(self, req: Req) -> list[int]:
        return [int(slot) for slot in self.manager.page_table[req.table_idx][: req.alloc_len]]

    # ------------------------------------------------------------ the manager's operations

    def match_req(self, req: Req) -> Handle:
        handle: Handle = self.manager.match_req(req)
        return handle

    def lock(self, handle: Handle) -> None:
        self.manager.lock(handle)

    def unlock(self, handle: Handle) -> None:
        self.manager.unlock(handle)

    def cached_len(self, handle: Handle) -> int:
        return int(handle.cached_len)

    def get_matched_indices(self, handle: Handle) -> list[int]:
        matched = handle.get_matched_indices()
        return [int(slot) for slot in as_list(matched)]

    def available_size(self) -> int:
        return int(self.manager.available_size)

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        self.manager.allocate_paged(reqs)

    def cache_req(self, req: Req, finished: bool) -> None:
        self.manager.cache_req(req, finished=finished)

    def lazy_free_region(self) -> AbstractContextManager[None]:
        region: AbstractContextManager[None] = self.manager.lazy_free_region()
        return region

    def evict(self, size: int) -> list[int]:
        slots = self.manager.prefix_cache.evict(size)
        return [int(slot) for slot in as_list(slots)]

    # ------------------------------------------------------------ observation

    def free_pages(self) -> list[int]:
        state = self.manager.abstract_state()
        return [*state.free_slots, *(state.lazy_frees or [])]

    def cached_slots(self) -> list[int]:
        return [entry.slot_start for entry in self.manager.prefix_cache.abstract_state().entries.values()]

    def size_info(self) -> tuple[int, int]:
        info = self.manager.prefix_cache.size_info
        return int(info.evictable_size), int(info.protected_size)

    # ------------------------------------------------------------ the differential capability

    def check_integrity(self, live_reqs: Sequence[Req]) -> None:
        self.manager.check_integrity(live_reqs)

    def abstract_state(self) -> sm.ManagerState:
        state: sm.ManagerState = self.manager.abstract_state()
        return state

    def take_events(self) -> list[Event]:
        return list(self.manager.prefix_cache.take_events())

    def cached_pages(self) -> int:
        info = self.manager.prefix_cache.size_info
        return int(info.evictable_size + info.protected_size) // self.page_size

    def spec_handle(self, handle: Handle) -> pc.Handle:
        spec: pc.Handle = self.manager.prefix_cache.abstract_handle(handle)
        return spec

    def view(self, state: sm.ManagerState, req: Req) -> sm.RequestView:
        ids = as_list(req.input_ids)
        handle = None if req.cache_handle is None else self.spec_handle(req.cache_handle)
        row = state.page_table[req.table_idx][: req.alloc_len]
        return sm.RequestView(
            req.uid,
            req.table_idx,
            req.namespace,
            tuple(ids),
            handle,
            req.cached_len,
            req.device_len,
            req.alloc_len,
            tuple(row),
        )


class ReferenceManager(OurManager):
    """reference.CacheManager as a manager target."""

    name = "reference"

    def __init__(self, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        table = reference.make_page_table(rows, max_seq_len)
        super().__init__(reference.CacheManager(num_pages, page_size, table), num_pages, page_size)


REFERENCE = TargetInfo(
    name="reference",
    description="radixspec's reference RadixPrefixCache and CacheManager (pure Python)",
    cache_factory=ReferenceCache,
    manager_factory=ReferenceManager,
    profile=EXACT,
)


def make_optimized_cache(page_size: int, num_pages: int = 0) -> OptimizedCache:
    """The optimized cache as a target; torch and the C tree are imported here, when one is made."""
    from .ours_optimized import OptimizedCache

    return OptimizedCache(page_size, num_pages)


def make_optimized_manager(num_pages: int, page_size: int, rows: int, max_seq_len: int) -> OptimizedManager:
    """The optimized manager as a target; torch and the C tree are imported here, when one is made."""
    from .ours_optimized import OptimizedManager

    return OptimizedManager(num_pages, page_size, rows, max_seq_len)


def make_optimized_hybrid(page_size: int, windows: tuple[hy.Window, ...]) -> Any:
    """The optimized hybrid cache (the C tree); imported when one is made."""
    from radixspec.optimized.hybrid_cache import HybridRadixCache as OptimizedHybridCache

    return OptimizedHybridCache(page_size, windows)


# the optimized targets are made by these functions: naming them imports neither torch nor the C tree (a campaign
# over the spec, the reference or a user's pure-Python cache never loads either)
OPTIMIZED = TargetInfo(
    name="optimized",
    description="radixspec's optimized RadixPrefixCache and CacheManager (torch, C)",
    cache_factory=make_optimized_cache,
    manager_factory=make_optimized_manager,
    profile=EXACT,
)
# what --impl names: our implementations, in the order --impl all drives them
IMPLEMENTATIONS: dict[str, TargetInfo] = {"reference": REFERENCE, "optimized": OPTIMIZED}


class SpecHybridCache:
    """The spec's hybrid free functions over one state, with the hybrid trees' methods (what the
    hybrid manager calls, so that the manager runs over the spec beside each tree)."""

    name = "spec"

    def __init__(self, page_size: int, windows: tuple[hy.Window, ...]) -> None:
        self.state = hy.new_state(page_size, windows)
        self.page_size, self.windows = self.state.page_size, self.state.windows

    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> hy.HybridHandle:
        return hy.match_prefix(self.state, input_ids, namespace)

    def insert_prefix(
        self, input_ids: Sequence[int], pages: Sequence[Sequence[int | None]], namespace: Namespace = None
    ) -> hy.HybridInsertResult:
        return hy.insert_prefix(self.state, input_ids, pages, namespace)

    def lock(self, handle: hy.HybridHandle) -> None:
        hy.lock(self.state, handle)

    def unlock(self, handle: hy.HybridHandle) -> None:
        hy.unlock(self.state, handle)

    def get_matched_pages(self, handle: hy.HybridHandle) -> list[list[int | None]]:
        return hy.get_matched_pages(self.state, handle)

    def evict(self, group: int, size: int) -> list[int]:
        return hy.evict(self.state, group, size)

    def reset(self) -> list[list[int]]:
        return hy.reset(self.state)

    def size_info(self, group: int) -> SizeInfo:
        return hy.size_info(self.state, group)

    def abstract_state(self) -> hy.HybridState:
        return self.state

    def abstract_handle(self, handle: hy.HybridHandle) -> hy.HybridHandle:
        return handle

    def check_integrity(self) -> None:
        hy.check_hybrid_invariants(self.state, [self.size_info(g) for g in range(len(self.windows))])


# the hybrid caches by implementation name (the hybrid machine drives these beside the spec)
HYBRID_IMPLEMENTATIONS: dict[str, Callable[[int, tuple[hy.Window, ...]], Any]] = {
    "reference": HybridRadixCache,
    "optimized": make_optimized_hybrid,
}
