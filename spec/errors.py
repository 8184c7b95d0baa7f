"""The error tree every implementation raises (spec, reference, optimized), and the catalogue of the words
they refuse in.

A rejected call changes nothing: the fuzzer compares the abstract state
before and after every call that raised one of these. Twins refuse in the
same words (the machines compare them), so a refusal more than one
implementation says is written once, here: a class method of its error
(``raise StaleHandleError.lost_page(cached_len)``) builds the error with its
words.
"""

from __future__ import annotations

from typing import Self


class CacheError(Exception):
    """Base of every error raised by radixspec."""


class StaleHandleError(CacheError):
    """The handle's path lost a page to eviction or reset; it can no longer be used."""

    @classmethod
    def lost_page(cls, cached_len: int) -> Self:
        return cls(f"handle of cached_len {cached_len} lost a page to eviction or reset")


class UnlockError(CacheError):
    """An unlock with no lock of that very path outstanding (a page at ref count 0, or only a longer or a
    shorter path locked), or a manager's call on a request whose handle is stale or not locked."""

    @classmethod
    def no_lock_ends_here(cls, cached_len: int) -> Self:
        """A tree's unlock: no lock ends at the handle's last page."""
        return cls(f"no lock ends at the last page of this handle (cached_len {cached_len})")

    @classmethod
    def no_lock_of_match(cls, cached_len: int) -> Self:
        """A hybrid cache's unlock: no lock of this very match is outstanding."""
        return cls(f"no lock of this match (cached_len {cached_len}) is outstanding")


class EvictionError(CacheError):
    """Asked to evict more tokens than are evictable."""

    @classmethod
    def past_evictable(cls, size: int, evictable: int) -> Self:
        return cls(f"cannot evict {size} tokens, only {evictable} are evictable")


class CacheBusyError(CacheError):
    """The operation needs an unlocked cache (reset) but some page is locked, or a region is already open."""

    @classmethod
    def tokens_locked(cls, tokens: int) -> Self:
        """A tree's reset while ``tokens`` tokens are locked."""
        return cls(f"cannot reset: {tokens} tokens are locked")

    @classmethod
    def locks_outstanding(cls, locks: int) -> Self:
        """A hybrid cache's reset while ``locks`` locks are outstanding."""
        return cls(f"cannot reset: {locks} locks are outstanding")

    @classmethod
    def lazy_region_open(cls) -> Self:
        return cls("lazy_free_region is already open")


class OutOfPagesError(CacheError):
    """Not enough free plus evictable pages for an allocation."""


class IntegrityError(CacheError):
    """A named invariant does not hold; the message names it and gives the numbers."""


class EventStreamError(IntegrityError):
    """A KV event stream cannot be replayed, or does not describe the cache (spec/events.py)."""


class ManagerLawError(IntegrityError):
    """A manager's state after an operation is not one the operation's relation allows (spec/cache_manager.py)."""


class RouterLawError(IntegrityError):
    """A router's index disagrees with its workers' caches; the message names the law (spec/router.py)."""


class SchedulingLawError(IntegrityError):
    """A scheduler broke one of its laws, named in the message (spec/scheduler.py)."""


class KVCorruptionError(CacheError):
    """A KV slot holds values other than those stored for its token."""


class StorageOfflineError(CacheError):
    """The storage tier is offline: a transfer to or from it cannot complete until it is back."""


class UnavailableError(CacheError):
    """An optional part (CUDA kernel, C extension) is not available on this machine."""


class KernelError(CacheError, RuntimeError):
    """A C or CUDA kernel failed for a reason other than its input (out of memory, a CUDA error); names the status."""


class InvalidInputError(CacheError, ValueError):
    """Bad argument value; the call was rejected before any change."""


class NamespaceDepthError(InvalidInputError):
    """A namespace nests tuples deeper than the domain's bound (spec/domains.py: NAMESPACE_DEPTH_LIMIT)."""


class LengthMismatchError(InvalidInputError):
    """Two sequences that must have equal lengths do not."""

    @classmethod
    def tokens_and_slots(cls, tokens: int, slots: int) -> Self:
        """An insert's ``input_ids`` and ``indices`` of different lengths."""
        return cls(f"input_ids has {tokens} tokens but indices has {slots} slots")


class MisalignedPageError(InvalidInputError):
    """A page's slots are not ``start .. start+P-1`` with ``start % P == 0`` and ``start >= 0``."""

    @classmethod
    def not_a_run(cls, page: int, slots: list[int], page_size: int) -> Self:
        """A tree's new page ``page`` given ``slots`` that are not one aligned run of ``page_size``."""
        p = page_size
        return cls(
            f"page {page} (tokens [{page * p}, {(page + 1) * p})) has slots {slots}:"
            f" not a run start..start+{p - 1} with start % {p} == 0"
        )

    @classmethod
    def start_not_aligned(cls, group: int, page: int, start: int, page_size: int) -> Self:
        """A hybrid cache's new page of ``group`` starting at a slot that is not a multiple of P."""
        return cls(f"group {group} page {page} starts at slot {start}, not a multiple of {page_size}")


class DuplicateSlotError(InvalidInputError):
    """A slot offered for a new page is already cached, or offered twice."""

    @classmethod
    def cached_slot(cls, page: int, slot: int, group: int | None = None) -> Self:
        """New page ``page`` (of ``group``, in a hybrid cache) takes ``slot``, which a cached page holds."""
        where = f"page {page}" if group is None else f"group {group} page {page}"
        return cls(f"{where} takes slot {slot}, which is already cached")


class MissingPageError(InvalidInputError):
    """A hybrid insert gives no slot for a page that a full-attention group needs and does not cache."""

    @classmethod
    def needs_page(cls, group: int, page: int) -> Self:
        return cls(f"group {group} (full attention) needs page {page}, which it does not cache")


class SlotOutOfRangeError(InvalidInputError):
    """A slot index lies outside the KV pool, or outside the slot domain ``0 <= slot < 2**31``."""


class OverlappingBuffersError(InvalidInputError):
    """A buffer a call writes overlaps another it writes or reads (``k_cache is v_cache``, ``k`` inside a cache)."""


class InvalidSizeError(InvalidInputError):
    """A size or count is negative or otherwise out of its range."""

    @classmethod
    def negative_evict(cls, size: int) -> Self:
        return cls(f"cannot evict a negative size ({size})")

    @classmethod
    def not_positive(cls, name: str, value: object) -> Self:
        """A size the caller gives (``name``) that is not an int >= 1."""
        return cls(f"{name} must be an int >= 1, got {value!r}")


class InvalidRequestError(InvalidInputError):
    """A request's lengths or page-table row do not fit the operation."""

    @classmethod
    def empty_request(cls) -> Self:
        return cls("a request needs at least one input token")

    @classmethod
    def no_free_row(cls) -> Self:
        return cls("no free request slot (max_running_reqs reached)")

    @classmethod
    def row_not_held(cls, row: int) -> Self:
        return cls(f"row {row} is not held by a request")

    @classmethod
    def never_matched(cls, uid: int) -> Self:
        return cls(f"request {uid} was never matched")


class InvalidTypeError(CacheError, TypeError):
    """Bad argument type (not a sequence of ints, wrong dtype, wrong device, foreign handle)."""

    @classmethod
    def foreign_handle(cls) -> Self:
        return cls("the handle belongs to another cache")


__all__ = [
    "CacheBusyError",
    "CacheError",
    "DuplicateSlotError",
    "EventStreamError",
    "EvictionError",
    "IntegrityError",
    "InvalidInputError",
    "InvalidRequestError",
    "InvalidSizeError",
    "InvalidTypeError",
    "KVCorruptionError",
    "KernelError",
    "LengthMismatchError",
    "ManagerLawError",
    "MisalignedPageError",
    "MissingPageError",
    "OutOfPagesError",
    "OverlappingBuffersError",
    "RouterLawError",
    "SchedulingLawError",
    "SlotOutOfRangeError",
    "StaleHandleError",
    "StorageOfflineError",
    "UnavailableError",
    "UnlockError",
]
