"""A prefix cache that shares nothing (the seed's "naive" strategy), with the same API.

Every match finds nothing and every insert keeps nothing, so a CacheManager
over it frees each request's pages when the request finishes. Bad input is
rejected exactly as an empty RadixPrefixCache would reject it.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import (
    Namespace,
    check_insert_inputs,
    check_namespace,
    check_page_size,
    check_token_ids,
)
from radixspec.spec.errors import (
    DuplicateSlotError,
    IntegrityError,
    InvalidTypeError,
    MisalignedPageError,
)
from radixspec.spec.helpers import align_down, is_page_run
from radixspec.spec.types import InsertResult, SizeInfo

from .base import BaseCacheHandle, BasePrefixCache


class NaiveCacheHandle(BaseCacheHandle):
    """An empty match."""

    def __init__(self, namespace: Namespace) -> None:
        self.cached_len = 0
        self.namespace = namespace

    def get_matched_indices(self) -> list[int]:
        """Nothing is ever matched."""
        return []


class NaivePrefixCache(BasePrefixCache):
    """No sharing: caches nothing, evicts nothing; keeps the logical clock like every cache."""

    # the handles this cache makes and accepts
    HANDLE: type[NaiveCacheHandle] = NaiveCacheHandle

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = check_page_size(page_size)
        self.clock = 0

    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> NaiveCacheHandle:
        """Always an empty match."""
        # CHECK
        check_token_ids(input_ids)
        namespace = check_namespace(namespace)
        # UPDATE
        self.clock += 1
        return NaiveCacheHandle(namespace)

    def insert_prefix(
        self, input_ids: Sequence[int], indices: Sequence[int], namespace: Namespace = None
    ) -> InsertResult:
        """Keeps nothing: reports 0 cached tokens and an empty handle."""
        # CHECK
        _, slots, namespace = check_insert_inputs(input_ids, indices, namespace)
        p = self.page_size
        seen: set[int] = set()
        for start in range(0, align_down(len(slots), p), p):
            page = slots[start : start + p]
            if not is_page_run(page, p):
                raise MisalignedPageError(f"page {start // p} has slots {list(page)}: not an aligned run of {p}")
            if page[0] in seen:
                raise DuplicateSlotError(f"page {start // p} takes slot {page[0]} twice")
            seen.add(page[0])
        # UPDATE
        self.clock += 1
        return InsertResult(0, NaiveCacheHandle(namespace))

    def lock(self, handle: BaseCacheHandle) -> None:
        """Nothing to protect."""
        self._check_handle(handle)

    def unlock(self, handle: BaseCacheHandle) -> None:
        """Nothing to release."""
        self._check_handle(handle)

    def is_handle_locked(self, handle: BaseCacheHandle) -> bool:
        """An empty path is always covered."""
        self._check_handle(handle)
        return True

    def evict(self, size: int) -> list[int]:
        """Only evict(0) succeeds: nothing is ever evictable."""
        # CHECK
        pc.check_evict_size(size, 0)
        return []

    def reset(self) -> list[int]:
        """Nothing to empty."""
        return []

    @property
    def size_info(self) -> SizeInfo:
        """Always empty."""
        return SizeInfo(evictable_size=0, protected_size=0)

    def check_integrity(self) -> None:
        """The only state is the logical clock: it must be a count of operations."""
        if not isinstance(self.clock, int) or self.clock < 0:
            raise IntegrityError(f"clock_is_a_count: clock is {self.clock!r}")

    def abstract_state(self) -> pc.PrefixCacheState:
        """An empty spec state at this clock."""
        return pc.PrefixCacheState(page_size=self.page_size, clock=self.clock)

    def abstract_handle(self, handle: BaseCacheHandle) -> pc.Handle:
        """The empty spec handle."""
        return pc.Handle(self._check_handle(handle).namespace, (), ())

    def _check_handle(self, handle: object) -> NaiveCacheHandle:
        """``handle`` if it is a naive handle, else raise InvalidTypeError."""
        if type(handle) is not self.HANDLE:  # exactly: the twin's handles are not this cache's
            raise InvalidTypeError(f"expected a NaiveCacheHandle, got {type(handle).__name__}")
        return handle
