"""A prefix cache that shares nothing, on tensors. Twin of ``reference.naive_cache``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spec import prefix_cache as pc
from spec.errors import (
    DuplicateSlotError,
    EvictionError,
    IntegrityError,
    InvalidSizeError,
    InvalidTypeError,
    MisalignedPageError,
)
from spec.helpers import align_down
from spec.types import InsertResult, Namespace, SizeInfo, check_namespace, check_page_size

from .inputs import as_insert_args, as_tokens, device_of
from .radix_kernel import first_bad_page


class NaiveCacheHandle:
    """An empty match. Twin of ``reference.NaiveCacheHandle``."""

    __slots__ = ("cached_len", "empty", "namespace")

    def __init__(self, namespace: Namespace, empty: torch.Tensor) -> None:
        self.cached_len = 0
        self.namespace = namespace
        self.empty = empty

    def get_matched_indices(self) -> torch.Tensor:
        return self.empty


class NaivePrefixCache:
    """No sharing: caches nothing, evicts nothing. Twin of ``reference.NaivePrefixCache``."""

    def __init__(self, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.page_size = check_page_size(page_size)
        self.device = device_of(device)
        self.clock = 0
        self._empty = torch.empty(0, dtype=torch.int32, device=self.device)

    def match_prefix(self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None) -> NaiveCacheHandle:
        # CHECK
        as_tokens(input_ids)
        namespace = check_namespace(namespace)
        # UPDATE
        self.clock += 1
        return NaiveCacheHandle(namespace, self._empty)

    def insert_prefix(
        self,
        input_ids: torch.Tensor | Sequence[int],
        indices: torch.Tensor | Sequence[int],
        namespace: Namespace = None,
    ) -> InsertResult:
        # CHECK
        _, slots, namespace = as_insert_args(input_ids, indices, namespace, self.device)
        p = self.page_size
        whole = slots[: align_down(slots.numel(), p)]
        if whole.numel():
            bad = first_bad_page(whole, p)
            if bad < whole.numel() // p:
                raise MisalignedPageError(f"page {bad} is not an aligned run of {p}")
            if torch.unique(whole[::p]).numel() != whole.numel() // p:
                raise DuplicateSlotError("a slot is given to two pages")
        # UPDATE
        self.clock += 1
        return InsertResult(0, NaiveCacheHandle(namespace, self._empty))

    def lock(self, handle: NaiveCacheHandle) -> None:
        self._check_handle(handle)

    def unlock(self, handle: NaiveCacheHandle) -> None:
        self._check_handle(handle)

    def is_handle_locked(self, handle: NaiveCacheHandle) -> bool:
        self._check_handle(handle)
        return True

    def evict(self, size: int) -> torch.Tensor:
        if not isinstance(size, int) or isinstance(size, bool):
            raise InvalidTypeError(f"size must be an int, got {type(size).__name__}")
        if size < 0:
            raise InvalidSizeError(f"cannot evict a negative size ({size})")
        if size > 0:
            raise EvictionError(f"cannot evict {size} tokens, only 0 are evictable")
        return self._empty

    def reset(self) -> torch.Tensor:
        return self._empty

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=0, protected_size=0)

    def check_integrity(self) -> None:
        """The only state is the logical clock: it must be a count of operations."""
        if not isinstance(self.clock, int) or self.clock < 0:
            raise IntegrityError(f"clock_is_a_count: clock is {self.clock!r}")

    def abstract_state(self) -> pc.PrefixCacheState:
        return pc.PrefixCacheState(page_size=self.page_size, clock=self.clock)

    def abstract_handle(self, handle: NaiveCacheHandle) -> pc.Handle:
        return pc.Handle(self._check_handle(handle).namespace, (), ())

    def _check_handle(self, handle: object) -> NaiveCacheHandle:
        if not isinstance(handle, NaiveCacheHandle):
            raise InvalidTypeError(f"expected a NaiveCacheHandle, got {type(handle).__name__}")
        return handle
