"""A prefix cache that shares nothing, on tensors. Twin of ``radixspec.reference.naive_cache``: the reference's class
with tensors in and out (its handles, locks, sizes, integrity and abstract state are the reference's own)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixspec.reference.naive_cache import NaiveCacheHandle as _ReferenceHandle
from radixspec.reference.naive_cache import NaivePrefixCache as _ReferencePrefixCache
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace, check_namespace
from radixspec.spec.errors import DuplicateSlotError, MisalignedPageError
from radixspec.spec.helpers import align_down
from radixspec.spec.types import InsertResult

from .inputs import as_insert_args, as_tokens, device_of
from .radix_kernel import first_bad_page


class NaiveCacheHandle(_ReferenceHandle):
    """An empty match whose matched indices are an empty tensor. Twin of ``reference.NaiveCacheHandle``."""

    __slots__ = ("empty",)

    def __init__(self, namespace: Namespace, empty: torch.Tensor) -> None:
        super().__init__(namespace)
        self.empty = empty

    def get_matched_indices(self) -> torch.Tensor:  # type: ignore[override]
        return self.empty


class NaivePrefixCache(_ReferencePrefixCache):
    """No sharing: caches nothing, evicts nothing. Twin of ``reference.NaivePrefixCache``."""

    HANDLE = NaiveCacheHandle

    def __init__(self, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        super().__init__(page_size)
        self.device = device_of(device)
        self._empty = torch.empty(0, dtype=torch.int32, device=self.device)

    def match_prefix(  # type: ignore[override]
        self, input_ids: torch.Tensor | Sequence[int], namespace: Namespace = None
    ) -> NaiveCacheHandle:
        # CHECK
        as_tokens(input_ids)
        namespace = check_namespace(namespace)
        # UPDATE
        self.clock += 1
        return NaiveCacheHandle(namespace, self._empty)

    def insert_prefix(  # type: ignore[override]
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
            # the first page in order that is misaligned or takes an earlier page's slot (as the spec checks them)
            bad, pages = first_bad_page(whole, p), whole.numel() // p
            starts: list[int] = whole[::p].tolist()
            first: dict[int, int] = {}
            for i, start in enumerate(starts):
                first.setdefault(start, i)
            twice = next((i for i, start in enumerate(starts) if first[start] != i), pages)
            if bad < pages and bad <= twice:
                raise MisalignedPageError(f"page {bad} is not an aligned run of {p}")
            if twice < pages:
                raise DuplicateSlotError("a slot is given to two pages")
        # UPDATE
        self.clock += 1
        return InsertResult(0, NaiveCacheHandle(namespace, self._empty))

    def evict(self, size: int) -> torch.Tensor:  # type: ignore[override]
        """Only evict(0) succeeds: nothing is ever evictable."""
        pc.check_evict_size(size, 0)
        return self._empty

    def reset(self) -> torch.Tensor:  # type: ignore[override]
        """Nothing to empty."""
        return self._empty
