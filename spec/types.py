"""Types shared by every implementation: results, namespaces, requests, input checks."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

from .errors import InvalidInputError, InvalidTypeError

# A namespace isolates cache lines (LoRA id, tenant salt). ``None`` is the
# default namespace; any other namespace is a tuple, never a joined string.
Namespace: TypeAlias = "tuple[Hashable, ...] | None"


class SizeInfo(NamedTuple):
    """Sizes of the cache in tokens (always multiples of the page size)."""

    # tokens on pages nobody has locked: what evict() may take
    evictable_size: int
    # tokens on locked pages
    protected_size: int

    @property
    def total_size(self) -> int:
        """All cached tokens."""
        return self.evictable_size + self.protected_size


class InsertResult(NamedTuple):
    """What insert_prefix returns."""

    # tokens of the input that were already cached before the call (page aligned);
    # the caller frees its own duplicates indices[old_handle.cached_len : cached_len]
    cached_len: int
    # handle on the whole inserted path (cached_len == align_down(len(input_ids), P))
    handle: Any


@dataclass(eq=False)
class Req:
    """A request as the CacheManager sees it (the seed's ``Req``, host side).

    Positions of its page-table row::

        [0, cache_handle.cached_len)          cached pages, locked through cache_handle
        [cache_handle.cached_len, alloc_len)  pages private to this request
        [0, cached_len)                       KV computed and stored
        [cached_len, device_len)              KV computed by the current forward
    """

    # prompt followed by the tokens generated so far
    input_ids: list[int]
    # row of the page table that maps this request's positions to slots
    table_idx: int
    # handle returned by match_req / cache_req, locked while the request lives;
    # None once the request was released by cache_req(finished=True)
    cache_handle: Any
    # cache line namespace
    namespace: Namespace = None
    # tokens whose KV is in the pool
    cached_len: int = 0
    # tokens whose KV is in the pool after the forward being prepared
    device_len: int = 0
    # positions of the row backed by pages (a multiple of the page size)
    alloc_len: int = 0
    # free-form label for reports
    uid: int = field(default=0)


def check_page_size(page_size: object) -> int:
    """``page_size`` as an int >= 1, or raise."""
    if not isinstance(page_size, int) or isinstance(page_size, bool):
        raise InvalidTypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 1:
        raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
    return page_size


def check_namespace(namespace: object) -> Namespace:
    """``namespace`` if it is None or a hashable tuple, else raise."""
    if namespace is None:
        return None
    if not isinstance(namespace, tuple):
        raise InvalidTypeError(
            f"namespace must be None or a tuple (e.g. (lora_id, tenant)), got {type(namespace).__name__}"
        )
    try:
        hash(namespace)
    except TypeError as exc:
        raise InvalidTypeError(f"namespace must be hashable: {exc}") from None
    return namespace


def check_int_sequence(values: object, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of non-negative ints, or raise (names ``what``)."""
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise InvalidTypeError(f"{what} must be a sequence of ints, got {type(values).__name__}")
    out = tuple(values)
    for i, v in enumerate(out):
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidTypeError(f"{what}[{i}] must be an int, got {type(v).__name__}")
        if v < 0:
            raise InvalidInputError(f"{what}[{i}] = {v} is negative")
    return out
