"""One calling convention for every implementation, so a state machine can drive them side by side.

Adapters take and return plain Python lists and ints; the spec is always
present as the oracle. ``CACHE_IMPLEMENTATIONS`` and ``MANAGER_IMPLEMENTATIONS`` name what ``--impl``
selects (``fuzz.campaign.IMPLEMENTATIONS`` holds the same names for the command line).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

import optimized
import reference
from spec import cache_manager as sm
from spec import prefix_cache as pc
from spec.domains import Namespace
from spec.invariants import check_invariants
from spec.requests import Req


class CacheAdapter(Protocol):
    """A prefix cache seen through lists and ints."""

    name: str

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> Any: ...
    def insert_prefix(self, tokens: list[int], indices: list[int], namespace: Namespace) -> tuple[int, Any]: ...
    def lock(self, handle: Any) -> None: ...
    def unlock(self, handle: Any) -> None: ...
    def cached_len(self, handle: Any) -> int: ...
    def get_matched_indices(self, handle: Any) -> list[int]: ...
    def evict(self, size: int) -> list[int]: ...
    def reset(self) -> list[int]: ...
    def size_info(self) -> tuple[int, int]: ...
    def check_integrity(self) -> None: ...
    def abstract_state(self) -> pc.PrefixCacheState: ...
    def fingerprint(self) -> tuple[Any, ...]: ...
    def take_events(self) -> list[Any]: ...


class SpecCache:
    """The spec's free functions over one state."""

    name = "spec"

    def __init__(self, page_size: int) -> None:
        self.state = pc.new_state(page_size)

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> pc.Handle:
        return pc.match_prefix(self.state, tokens, namespace)

    def insert_prefix(self, tokens: list[int], indices: list[int], namespace: Namespace) -> tuple[int, pc.Handle]:
        return tuple(pc.insert_prefix(self.state, tokens, indices, namespace))  # type: ignore[return-value]

    def lock(self, handle: pc.Handle) -> None:
        pc.lock(self.state, handle)

    def unlock(self, handle: pc.Handle) -> None:
        pc.unlock(self.state, handle)

    def cached_len(self, handle: pc.Handle) -> int:
        return handle.cached_len

    def get_matched_indices(self, handle: pc.Handle) -> list[int]:
        return pc.get_matched_indices(self.state, handle)

    def evict(self, size: int) -> list[int]:
        return pc.evict(self.state, size)

    def reset(self) -> list[int]:
        return pc.reset(self.state)

    def size_info(self) -> tuple[int, int]:
        return tuple(pc.size_info(self.state))  # type: ignore[return-value]

    def check_integrity(self) -> None:
        check_invariants(self.state)

    def abstract_state(self) -> pc.PrefixCacheState:
        return pc.PrefixCacheState(self.state.page_size, dict(self.state.entries), self.state.clock)

    def fingerprint(self) -> tuple[Any, ...]:
        return (self.size_info(), self.state.clock)

    def take_events(self) -> list[Any]:
        """The spec is the oracle of the events, not a source: its pages are what they must replay to."""
        return []


class DelegatingCache:
    """Calls that read the same on every tree implementation (``self.cache``)."""

    cache: Any

    def take_events(self) -> list[Any]:
        """The KV events the cache emitted since the last call (spec/events.py)."""
        return list(self.cache.take_events())

    def stats(self) -> Any:
        """The cache's metrics (spec/metrics.py)."""
        return self.cache.stats()

    def lock(self, handle: Any) -> None:
        self.cache.lock(handle)

    def unlock(self, handle: Any) -> None:
        self.cache.unlock(handle)

    def cached_len(self, handle: Any) -> int:
        return int(handle.cached_len)

    def size_info(self) -> tuple[int, int]:
        return tuple(self.cache.size_info)  # type: ignore[return-value]

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def abstract_state(self) -> pc.PrefixCacheState:
        return self.cache.abstract_state()  # type: ignore[no-any-return]

    def fingerprint(self) -> tuple[Any, ...]:
        """Cheap parts of the state (sizes, clock): what big trees compare around a rejected call."""
        return (self.size_info(), self.cache.clock)


class ReferenceCache(DelegatingCache):
    """A reference cache (already lists and ints)."""

    def path_nodes(self, handle: Any) -> int:
        """Radix nodes from the handle's node up to the root."""
        depth, node = 0, handle.node
        while node.parent is not None:
            depth, node = depth + 1, node.parent
        return depth

    name = "reference"

    def __init__(self, page_size: int, cls: type[reference.BasePrefixCache] = reference.RadixPrefixCache) -> None:
        self.cache = cls(page_size)  # type: ignore[call-arg]
        if hasattr(self.cache, "enable_events"):
            self.cache.enable_events()

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> Any:
        return self.cache.match_prefix(tokens, namespace)

    def insert_prefix(self, tokens: list[int], indices: list[int], namespace: Namespace) -> tuple[int, Any]:
        return tuple(self.cache.insert_prefix(tokens, indices, namespace))  # type: ignore[return-value]

    def get_matched_indices(self, handle: Any) -> list[int]:
        return list(handle.get_matched_indices())

    def evict(self, size: int) -> list[int]:
        return list(self.cache.evict(size))

    def reset(self) -> list[int]:
        return list(self.cache.reset())


class ManagerAdapter(Protocol):
    """A CacheManager seen through lists and ints; requests are whatever new_req returns."""

    name: str

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> Any: ...
    def match_req(self, req: Any) -> Any: ...
    def lock(self, handle: Any) -> None: ...
    def unlock(self, handle: Any) -> None: ...
    def cached_len(self, handle: Any) -> int: ...
    def get_matched_indices(self, handle: Any) -> list[int]: ...
    def available_size(self) -> int: ...
    def admit(self, req: Any, handle: Any) -> None: ...
    def set_lengths(self, req: Any, cached_len: int, device_len: int) -> None: ...
    def append_token(self, req: Any, token: int) -> None: ...
    def allocate_paged(self, reqs: Sequence[Any]) -> None: ...
    def cache_req(self, req: Any, finished: bool) -> None: ...
    def lazy_free_region(self) -> AbstractContextManager[None]: ...
    def evict(self, size: int) -> list[int]: ...
    def check_integrity(self, live_reqs: Sequence[Any]) -> None: ...
    def abstract_state(self) -> sm.ManagerState: ...
    def view(self, state: sm.ManagerState, req: Any) -> sm.RequestView: ...
    def spec_handle(self, handle: Any) -> pc.Handle: ...
    def cached_pages(self) -> int: ...
    def row(self, req: Any) -> list[int]: ...
    def take_events(self) -> list[Any]: ...


class ListReqMixin:
    """Requests as ``spec.requests.Req`` with list token ids (spec and reference)."""

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> Req:
        return Req(input_ids=list(prompt), table_idx=table_idx, cache_handle=None, namespace=namespace, uid=uid)

    def cached_len(self, handle: Any) -> int:
        return int(handle.cached_len)

    def set_lengths(self, req: Req, cached_len: int, device_len: int) -> None:
        req.cached_len, req.device_len = cached_len, device_len

    def append_token(self, req: Req, token: int) -> None:
        req.input_ids.append(token)


class DelegatingManager:
    """Calls that read the same on every CacheManager implementation (``self.manager``)."""

    manager: Any

    def match_req(self, req: Req) -> Any:
        return self.manager.match_req(req)

    def lock(self, handle: Any) -> None:
        self.manager.lock(handle)

    def unlock(self, handle: Any) -> None:
        self.manager.unlock(handle)

    def available_size(self) -> int:
        return int(self.manager.available_size)

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        self.manager.allocate_paged(reqs)

    def cache_req(self, req: Req, finished: bool) -> None:
        self.manager.cache_req(req, finished=finished)

    def lazy_free_region(self) -> AbstractContextManager[None]:
        return self.manager.lazy_free_region()  # type: ignore[no-any-return]

    def check_integrity(self, live_reqs: Sequence[Req]) -> None:
        self.manager.check_integrity(live_reqs)

    def abstract_state(self) -> sm.ManagerState:
        return self.manager.abstract_state()  # type: ignore[no-any-return]

    def take_events(self) -> list[Any]:
        """The KV events the manager's cache emitted since the last call (spec/events.py)."""
        return list(self.manager.prefix_cache.take_events())

    def cached_pages(self) -> int:
        """Pages the manager's prefix cache holds (from its size counters)."""
        info = self.manager.prefix_cache.size_info
        return int(info.evictable_size + info.protected_size) // int(self.manager.page_size)

    def spec_handle(self, handle: Any) -> pc.Handle:
        """The spec handle of the same path."""
        return self.manager.prefix_cache.abstract_handle(handle)  # type: ignore[no-any-return]

    def view(self, state: sm.ManagerState, req: Req) -> sm.RequestView:
        """The request as the spec's relations read it (``state``: this manager's abstract state)."""
        ids = req.input_ids.tolist() if hasattr(req.input_ids, "tolist") else req.input_ids
        handle = None if req.cache_handle is None else self.manager.prefix_cache.abstract_handle(req.cache_handle)
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

    def admit(self, req: Req, handle: Any) -> None:
        matched = handle.get_matched_indices()
        self.manager.page_table[req.table_idx][: len(matched)] = matched
        req.cache_handle = handle
        req.cached_len = req.device_len = req.alloc_len = handle.cached_len


class ReferenceManager(ListReqMixin, DelegatingManager):
    """The reference CacheManager."""

    name = "reference"

    def __init__(self, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        self.manager = reference.CacheManager(num_pages, page_size, reference.make_page_table(rows, max_seq_len))
        self.manager.prefix_cache.enable_events()

    def get_matched_indices(self, handle: Any) -> list[int]:
        return list(handle.get_matched_indices())

    def evict(self, size: int) -> list[int]:
        return list(self.manager.prefix_cache.evict(size))

    def row(self, req: Req) -> list[int]:
        return list(self.manager.page_table[req.table_idx][: req.alloc_len])


class OptimizedCache(DelegatingCache):
    """The optimized cache: lists in, tensors to it (token dtype alternating int32/int64), lists out."""

    name = "optimized"

    def __init__(self, page_size: int) -> None:
        self.cache = optimized.RadixPrefixCache(page_size, device="cpu", enable_events=True)
        self.calls = 0

    def tokens(self, values: list[int]) -> torch.Tensor | list[int]:
        """Every third call a list, else a tensor, int32 and int64 in turn: each input path gets its share."""
        self.calls += 1
        if self.calls % 3 == 0:
            return values
        return torch.tensor(values, dtype=torch.int32 if self.calls % 3 == 1 else torch.int64)

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> Any:
        return self.cache.match_prefix(self.tokens(tokens), namespace)

    def insert_prefix(self, tokens: list[int], indices: list[int], namespace: Namespace) -> tuple[int, Any]:
        ids = self.tokens(tokens)
        if isinstance(ids, list):
            return tuple(self.cache.insert_prefix(ids, indices, namespace))  # type: ignore[return-value]
        fits_int32 = all(-(2**31) <= slot < 2**31 for slot in indices)
        slots = torch.tensor(indices, dtype=torch.int32 if fits_int32 and self.calls % 3 == 2 else torch.int64)
        return tuple(self.cache.insert_prefix(ids, slots, namespace))  # type: ignore[return-value]

    def path_nodes(self, handle: Any) -> int:
        """Radix nodes from the handle's node up to the root (counted in C)."""
        return int(self.cache.path_nodes(handle))

    def get_matched_indices(self, handle: Any) -> list[int]:
        return list(handle.get_matched_indices().tolist())

    def evict(self, size: int) -> list[int]:
        return list(self.cache.evict(size).tolist())

    def reset(self) -> list[int]:
        return list(self.cache.reset().tolist())


class OptimizedManager(ListReqMixin, DelegatingManager):
    """The optimized CacheManager; its requests keep token ids as CPU tensors."""

    name = "optimized"

    def __init__(self, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        self.manager = optimized.CacheManager(num_pages, page_size, optimized.make_page_table(rows, max_seq_len))
        self.manager.prefix_cache.enable_events()

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> Req:  # tensors
        tokens = torch.tensor(prompt, dtype=torch.int64)
        return Req(input_ids=tokens, table_idx=table_idx, cache_handle=None, namespace=namespace, uid=uid)  # type: ignore[arg-type]

    def get_matched_indices(self, handle: Any) -> list[int]:
        return list(handle.get_matched_indices().tolist())

    def append_token(self, req: Req, token: int) -> None:
        req.input_ids = torch.cat([req.input_ids, torch.tensor([token])])  # type: ignore[list-item, assignment]

    def evict(self, size: int) -> list[int]:
        return list(self.manager.prefix_cache.evict(size).tolist())

    def row(self, req: Req) -> list[int]:
        return list(self.manager.page_table[req.table_idx, : req.alloc_len].tolist())


# --impl name -> the adapters that run beside the spec
CACHE_IMPLEMENTATIONS: dict[str, Callable[[int], CacheAdapter]] = {
    "reference": ReferenceCache,
    "optimized": OptimizedCache,
}
MANAGER_IMPLEMENTATIONS: dict[str, Callable[[int, int, int, int], ManagerAdapter]] = {
    "reference": ReferenceManager,
    "optimized": OptimizedManager,
}
