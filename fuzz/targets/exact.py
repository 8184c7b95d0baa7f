"""The exact capability shared by our targets: forwarding to a cache or manager that offers its abstract state,
fingerprint, KV events and integrity check (``ExactTarget``, ``TreeTarget``, ``OurManager``). The spec and the
reference targets (``ours.py``) and the optimized ones (``ours_optimized.py``) build on it; it imports neither."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeAlias, TypeVar, cast

from radixspec.reference.radix_cache import RadixCacheHandle
from radixspec.spec import cache_manager as sm
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace, copied_fields
from radixspec.spec.events import Event
from radixspec.spec.metrics import CacheStats
from radixspec.spec.requests import Req
from radixspec.spec.types import SizeInfo

from .api import EXACT, PageKey, Profile

if TYPE_CHECKING:
    from radixspec.optimized.radix_cache import RadixCacheHandle as OptimizedHandle


# the handle type of a cache: the spec's, the reference tree's or the optimized tree's
H = TypeVar("H", pc.Handle, RadixCacheHandle, "OptimizedHandle")
# a tree handle: the reference's or the optimized one
Handle: TypeAlias = "RadixCacheHandle | OptimizedHandle"
# the handle type a tree takes
H_contra = TypeVar("H_contra", contravariant=True)


class HasToList(Protocol):
    """A tensor or an array: what ``as_list`` reads through ``tolist``."""

    def tolist(self) -> list[int]: ...


class Tree(Protocol[H_contra]):
    """What ``TreeTarget`` calls on either tree (the reference's, the optimized one)."""

    @property
    def clock(self) -> int: ...
    @property
    def size_info(self) -> SizeInfo: ...
    def lock(self, handle: H_contra) -> None: ...
    def unlock(self, handle: H_contra) -> None: ...
    def check_integrity(self) -> None: ...
    def abstract_state(self) -> pc.PrefixCacheState: ...
    def take_events(self) -> list[Event]: ...
    def stats(self) -> CacheStats: ...


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


class TreeTarget(ExactTarget[H]):
    """Calls that read the same on both trees (``self.cache``)."""

    cache: Tree[H]

    def lock(self, handle: H) -> None:
        self.cache.lock(handle)

    def unlock(self, handle: H) -> None:
        self.cache.unlock(handle)

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


def as_list(values: Sequence[int] | HasToList) -> list[int]:
    """A sequence as a list: a tensor or an array through its ``tolist`` (no torch import for lists)."""
    # (hasattr, not an isinstance of the protocol: this runs on every step of the manager machine)
    return cast(HasToList, values).tolist() if hasattr(values, "tolist") else list(values)


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
        # the abstract state read since the last call that may change it, or None: the manager machine reads it
        # around every call and after every step (five times a step), and only the calls made through
        # ``changing`` change it
        self.state: sm.ManagerState | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> OurManager:
        """The same target on a deep copy of its manager; the state read last is shared (every reader of it shares
        it already: nobody changes it, a changing call drops it)."""
        return copied_fields(self, memo, shared=("state",))

    def changing(self) -> Any:
        """The manager, for a call that may change its state (a failed one too): the state read last is dropped."""
        self.state = None
        return self.manager

    # ------------------------------------------------------------ requests

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> Req:
        return Req(input_ids=list(prompt), table_idx=table_idx, cache_handle=None, namespace=namespace, uid=uid)

    def set_lengths(self, req: Req, cached_len: int, device_len: int) -> None:
        req.cached_len, req.device_len = cached_len, device_len

    def append_token(self, req: Req, token: int) -> None:
        req.input_ids.append(token)

    def admit(self, req: Req, handle: Handle) -> None:
        matched = handle.get_matched_indices()
        self.changing().page_table[req.table_idx][: len(matched)] = matched
        req.cache_handle = handle
        req.cached_len = req.device_len = req.alloc_len = handle.cached_len

    def handle_of(self, req: Req) -> Handle:
        handle: Handle = req.cache_handle
        return handle

    def row(self, req: Req) -> list[int]:
        return [int(slot) for slot in self.manager.page_table[req.table_idx][: req.alloc_len]]

    # ------------------------------------------------------------ the manager's operations

    def match_req(self, req: Req) -> Handle:
        handle: Handle = self.changing().match_req(req)
        return handle

    def lock(self, handle: Handle) -> None:
        self.changing().lock(handle)

    def unlock(self, handle: Handle) -> None:
        self.changing().unlock(handle)

    def cached_len(self, handle: Handle) -> int:
        return int(handle.cached_len)

    def get_matched_indices(self, handle: Handle) -> list[int]:
        matched = handle.get_matched_indices()
        return [int(slot) for slot in as_list(matched)]

    def available_size(self) -> int:
        return int(self.manager.available_size)

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        self.changing().allocate_paged(reqs)

    def cache_req(self, req: Req, finished: bool) -> None:
        self.changing().cache_req(req, finished=finished)

    @contextmanager
    def lazy_free_region(self) -> Iterator[None]:
        """The manager's lazy_free_region; its close (which frees) changes the state too."""
        try:
            with self.changing().lazy_free_region():
                yield
        finally:
            self.state = None

    def evict(self, size: int) -> list[int]:
        slots = self.changing().prefix_cache.evict(size)
        return [int(slot) for slot in as_list(slots)]

    # ------------------------------------------------------------ observation

    def free_pages(self) -> list[int]:
        state = self.abstract_state()
        return [*state.free_slots, *(state.lazy_frees or [])]

    def cached_slots(self) -> list[int]:
        return [entry.slot_start for entry in self.abstract_state().cache.entries.values()]

    def size_info(self) -> tuple[int, int]:
        info = self.manager.prefix_cache.size_info
        return int(info.evictable_size), int(info.protected_size)

    # ------------------------------------------------------------ the differential capability

    def check_integrity(self, live_reqs: Sequence[Req]) -> None:
        self.manager.check_integrity(live_reqs)

    def abstract_state(self) -> sm.ManagerState:
        """The manager's abstract state, read once after each call that may change it (readers must not change
        it: the spec's relations copy what they change)."""
        if self.state is None:
            self.state = self.manager.abstract_state()
        return self.state

    def take_events(self) -> list[Event]:
        return list(self.manager.prefix_cache.take_events())

    def cached_page_count(self) -> int:
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
