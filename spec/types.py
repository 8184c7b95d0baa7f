"""What the prefix cache's operations return, shared by every implementation (the input domains are in
``spec/domains.py``, the requests and the scheduler's types in ``spec/requests.py``)."""

from __future__ import annotations

from typing import Any, NamedTuple


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
