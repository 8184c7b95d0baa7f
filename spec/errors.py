"""The error tree every implementation raises (spec, reference, optimized).

A rejected call changes nothing: the fuzzer compares the abstract state
before and after every call that raised one of these.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error raised by radixspec."""


class StaleHandleError(CacheError):
    """The handle's path lost a page to eviction or reset; it can no longer be used."""


class UnlockError(CacheError):
    """An unlock with no lock of that very path outstanding (a page at ref count 0, or only a longer or a
    shorter path locked), or a manager's call on a request whose handle is stale or not locked."""


class EvictionError(CacheError):
    """Asked to evict more tokens than are evictable."""


class CacheBusyError(CacheError):
    """The operation needs an unlocked cache (reset) but some page is locked."""


class OutOfPagesError(CacheError):
    """Not enough free plus evictable pages for an allocation."""


class IntegrityError(CacheError):
    """A named invariant does not hold; the message names it and gives the numbers."""


class EventStreamError(IntegrityError):
    """A KV event stream cannot be replayed, or does not describe the cache (spec/events.py)."""


class ManagerLawError(IntegrityError):
    """A manager's state after an operation is not one the operation's relation allows (spec/cache_manager.py)."""


class SchedulingLawError(IntegrityError):
    """A scheduler broke one of its laws, named in the message (spec/scheduler.py)."""


class KVCorruptionError(CacheError):
    """A KV slot holds values other than those stored for its token."""


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


class MisalignedPageError(InvalidInputError):
    """A page's slots are not ``start .. start+P-1`` with ``start % P == 0`` and ``start >= 0``."""


class DuplicateSlotError(InvalidInputError):
    """A slot offered for a new page is already cached, or offered twice."""


class MissingPageError(InvalidInputError):
    """A hybrid insert gives no slot for a page that a full-attention group needs and does not cache."""


class SlotOutOfRangeError(InvalidInputError):
    """A slot index lies outside the KV pool, or outside the slot domain ``0 <= slot < 2**31``."""


class OverlappingBuffersError(InvalidInputError):
    """A buffer a call writes overlaps another it writes or reads (``k_cache is v_cache``, ``k`` inside a cache)."""


class InvalidSizeError(InvalidInputError):
    """A size or count is negative or otherwise out of its range."""


class InvalidRequestError(InvalidInputError):
    """A request's lengths or page-table row do not fit the operation."""


class InvalidTypeError(CacheError, TypeError):
    """Bad argument type (not a sequence of ints, wrong dtype, wrong device, foreign handle)."""


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
    "SchedulingLawError",
    "SlotOutOfRangeError",
    "StaleHandleError",
    "UnavailableError",
    "UnlockError",
]
