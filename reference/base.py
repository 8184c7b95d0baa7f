"""Interfaces of the reference prefix caches (the seed's ``kvcache/base.py``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace, copied_fields
from radixspec.spec.errors import InvalidTypeError
from radixspec.spec.types import InsertResult, SizeInfo

from .threads import new_mutex


class NotCopyable:
    """A cache is not copied shallowly: a shallow copy would share its tree (its C tree, in the optimized caches)
    with the original, and a change through either would corrupt both. ``copy.deepcopy`` makes an independent
    cache where the cache supports it (the prefix caches of both families, ``BasePrefixCache``); the others
    raise. Make a new cache instead."""

    def __copy__(self) -> NotCopyable:
        raise InvalidTypeError(
            f"a {type(self).__name__} cannot be copied (the copy would share its tree); make a new one"
        )

    def __deepcopy__(self, memo: dict[int, object]) -> NotCopyable:
        return self.__copy__()


class BaseCacheHandle(ABC):
    """A matched path of cached pages. Its slots are valid only while it is locked."""

    # matched tokens (page aligned)
    cached_len: int

    @abstractmethod
    def get_matched_indices(self) -> list[int]:
        """Slots of the matched prefix in sequence order; raises StaleHandleError once a page was evicted."""


class BasePrefixCache(NotCopyable, ABC):
    """A prefix cache: token ids -> slot indices. Stores no KV, only the mapping."""

    def __deepcopy__(self, memo: dict[int, object]) -> BasePrefixCache:
        """An independent cache in the same state: every field copied deep, a lock of its own. Handles copied
        in the same ``deepcopy`` call name the copy's paths (a snapshot of a cache with the handles it gave)."""
        return copied_fields(self, memo, made={"_mutex": lambda _: new_mutex()})

    page_size: int

    @abstractmethod
    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> BaseCacheHandle:
        """Longest cached page-aligned prefix; stamps its pages with a new logical time."""

    @abstractmethod
    def insert_prefix(
        self, input_ids: Sequence[int], indices: Sequence[int], namespace: Namespace = None
    ) -> InsertResult:
        """Cache the whole pages of ``input_ids``; already cached pages keep their slots."""

    @abstractmethod
    def lock(self, handle: BaseCacheHandle) -> None:
        """+1 ref on every page of the handle's path: those pages cannot be evicted."""

    @abstractmethod
    def unlock(self, handle: BaseCacheHandle) -> None:
        """-1 ref on every page of the handle's path; refused unless a lock of this very path is outstanding."""

    @abstractmethod
    def is_handle_locked(self, handle: BaseCacheHandle) -> bool:
        """True when the handle is live and a lock of this very path is outstanding. Changes nothing."""

    @abstractmethod
    def evict(self, size: int) -> list[int]:
        """Evict exactly ceil(size / P) pages, LRU evictable leaf first; returns their slots ascending."""

    @abstractmethod
    def reset(self) -> list[int]:
        """Empty the cache (refused while locked); returns every slot it held, ascending."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo:
        """Evictable and protected tokens."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Check every invariant; raise IntegrityError naming the broken one."""

    @abstractmethod
    def abstract_state(self) -> pc.PrefixCacheState:
        """This cache's state as the spec's abstract state."""

    @abstractmethod
    def abstract_handle(self, handle: BaseCacheHandle) -> pc.Handle:
        """A handle as the spec's handle (same path, same generations)."""
