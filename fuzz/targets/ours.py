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
from typing import TYPE_CHECKING

from radixspec import reference
from radixspec.reference.hybrid_cache import HybridRadixCache
from radixspec.reference.radix_cache import RadixCacheHandle
from radixspec.reference.tiered_cache import TieredRadixCache
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec import tiers
from radixspec.spec.domains import Namespace
from radixspec.spec.events import Event
from radixspec.spec.invariants import check_invariants
from radixspec.spec.types import SizeInfo

from .api import EXACT, TargetInfo
from .exact import ExactTarget, OurManager, TreeTarget

if TYPE_CHECKING:
    from radixspec.optimized.hybrid_cache import HybridRadixCache as OptimizedHybridCache
    from radixspec.optimized.tiered_cache import TieredRadixCache as OptimizedTieredCache

    from .ours_optimized import OptimizedCache, OptimizedManager


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

    def get_matched_indices(self, handle: pc.Handle) -> list[int]:
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
        return self.state.copy()

    def fingerprint(self) -> Hashable:
        return (self.size_info(), self.state.clock)

    def take_events(self) -> list[Event]:
        """The spec is the oracle of the events, not a source: its pages are what they must replay to."""
        return []


class ReferenceCache(TreeTarget[RadixCacheHandle]):
    """The reference RadixPrefixCache (already lists and ints)."""

    name = "reference"
    cache: reference.RadixPrefixCache

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

    def get_matched_indices(self, handle: RadixCacheHandle) -> list[int]:
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


class ReferenceManager(OurManager):
    """reference.CacheManager as a manager target."""

    name = "reference"

    def __init__(self, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        table = reference.make_page_table(rows, max_seq_len)
        super().__init__(reference.CacheManager(num_pages, page_size, table), num_pages, page_size)


REFERENCE = TargetInfo(
    name="reference",
    description="radixspec's reference RadixPrefixCache, CacheManager and TieredRadixCache (pure Python)",
    cache_factory=ReferenceCache,
    manager_factory=ReferenceManager,
    hybrid_cache=HybridRadixCache,
    tiered_factory=TieredRadixCache,
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


def make_optimized_hybrid(page_size: int, windows: tuple[hy.Window, ...]) -> OptimizedHybridCache:
    """The optimized hybrid cache (the C tree); imported when one is made."""
    from radixspec.optimized.hybrid_cache import HybridRadixCache as OptimizedHybridCache

    return OptimizedHybridCache(page_size, windows)


def make_optimized_tiered(
    page_size: int,
    device_pages: int,
    host_pages: int,
    storage_pages: int = 0,
    policy: tiers.WritePolicy = "write_through",
    threshold: int = 2,
) -> OptimizedTieredCache:
    """The optimized tiered cache (its pools tensors on the CPU); torch is imported when one is made."""
    from radixspec.optimized.tiered_cache import TieredRadixCache as OptimizedTieredCache

    return OptimizedTieredCache(page_size, device_pages, host_pages, storage_pages, policy, threshold)


# the optimized targets are made by these functions: naming them imports neither torch nor the C tree (a campaign
# over the spec, the reference or a user's pure-Python cache never loads either)
OPTIMIZED = TargetInfo(
    name="optimized",
    description="radixspec's optimized RadixPrefixCache, CacheManager and TieredRadixCache (torch, C)",
    cache_factory=make_optimized_cache,
    manager_factory=make_optimized_manager,
    hybrid_cache=make_optimized_hybrid,
    tiered_factory=make_optimized_tiered,
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


class SpecTieredCache:
    """The spec's free functions as a TieredCacheTarget (each looked up at call time: a test may patch one)."""

    def __init__(
        self,
        page_size: int,
        device: int,
        host: int,
        storage: int = 0,
        policy: tiers.WritePolicy = "write_through",
        threshold: int = 2,
    ) -> None:
        self.state = tiers.new_state(page_size, device, host, storage, policy, threshold)

    def __getattr__(self, name: str) -> Callable[..., object]:
        if name not in tiers.OPERATIONS:
            raise AttributeError(name)
        operation = getattr(tiers, name)
        return lambda *args: operation(self.state, *args)

    def abstract_state(self) -> tiers.TieredState:
        return self.state
