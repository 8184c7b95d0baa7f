"""The seed's CacheManager over plain lists: free list, page table, prefix cache.

Every page of the pool is free, cached, or private to one live request;
``check_integrity(live_reqs)`` checks that set by set through the spec.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from radixspec.spec import cache_manager as spec_manager
from radixspec.spec.domains import check_page_size, check_pool_size, copied_fields
from radixspec.spec.errors import CacheBusyError, InvalidRequestError, InvalidSizeError
from radixspec.spec.helpers import compute_page_starts, compute_page_to_token
from radixspec.spec.requests import Prompted, Req

from .base import BaseCacheHandle, BasePrefixCache
from .naive_cache import NaivePrefixCache
from .radix_cache import RadixPrefixCache


def make_page_table(max_running_reqs: int, max_seq_len: int) -> list[list[int]]:
    """An all-zero page table: one row per request slot, one entry per token position."""
    if max_running_reqs < 1 or max_seq_len < 1:
        raise InvalidSizeError(f"page table needs >= 1 rows and columns, got {max_running_reqs} x {max_seq_len}")
    return [[0] * max_seq_len for _ in range(max_running_reqs)]


class CacheManager:
    """Connects the prefix cache, the free list of pages and the page table."""

    def __init__(self, num_pages: int, page_size: int, page_table: list[list[int]], type: str = "radix") -> None:
        # CHECK
        page_size = check_page_size(page_size)
        num_pages = check_pool_size(num_pages, page_size)
        if type not in ("radix", "naive"):
            raise InvalidRequestError(f"prefix cache type must be 'radix' or 'naive', got {type!r}")
        if not page_table or len({len(row) for row in page_table}) != 1:
            raise InvalidSizeError("page_table must be rows of one length (see make_page_table)")
        # UPDATE
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.prefix_cache: BasePrefixCache = (
            RadixPrefixCache(page_size) if type == "radix" else NaivePrefixCache(page_size)
        )
        # FIFO of free page starts: 0, P, 2P, ...
        self.free_slots: list[int] = [page * page_size for page in range(num_pages)]
        # page starts freed inside lazy_free_region; None outside it
        self.lazy_frees: list[int] | None = None
        # pages taken back from the cache by allocations, over the manager's life
        self.evicted_pages = 0

    def __deepcopy__(self, memo: dict[int, object]) -> CacheManager:
        """An independent manager in the same state: its page table and free lists copied as the lists of ints
        they are (a deep copy would copy each int by a call), its cache copied deep."""
        return copied_fields(
            self,
            memo,
            made={
                "page_table": lambda table: [row[:] for row in table],
                "free_slots": list,
                "lazy_frees": lambda frees: None if frees is None else frees[:],
            },
        )

    def match_req(self, req: Prompted) -> BaseCacheHandle:
        """Match all of the prompt but its last token, which is always recomputed to produce logits."""
        # CHECK
        input_ids: Any = getattr(req, "input_ids", None)
        n = spec_manager.prompt_length(input_ids)
        if n == 0:
            raise InvalidRequestError.empty_request()
        # WALK
        return self.prefix_cache.match_prefix(input_ids[: n - 1], getattr(req, "namespace", None))

    @property
    def max_seq_len(self) -> int:
        """Positions of a page-table row."""
        return len(self.page_table[0])

    @property
    def available_size(self) -> int:
        """Tokens an allocation may use now: evictable cache plus free pages."""
        return self.prefix_cache.size_info.evictable_size + len(self.free_slots) * self.page_size

    def lock(self, handle: BaseCacheHandle) -> None:
        """Protect the handle's path from eviction."""
        self.prefix_cache.lock(handle)

    def unlock(self, handle: BaseCacheHandle) -> None:
        """Release one lock on the handle's path."""
        self.prefix_cache.unlock(handle)

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        """Give each request pages for ``[cached_len, device_len)``; write them into its row.

        Raises OutOfPagesError with nothing changed when free plus evictable pages do not suffice.
        """
        # CHECK
        p = self.page_size
        batch = spec_manager.read_batch(reqs)
        spec_manager.check_distinct_rows(batch)
        needed_pages = 0
        allocation_info: list[tuple[Req, int, int, int]] = []
        for req, fields in zip(reqs, batch, strict=True):
            self._check_req(req, fields)
            first_page, last_page = spec_manager.check_allocation(
                fields.uid, fields.cached_len, fields.device_len, fields.alloc_len, self.max_seq_len, p
            )
            if last_page > first_page:
                needed_pages += last_page - first_page
                allocation_info.append((req, fields.table_idx, first_page, last_page))
        spec_manager.check_pages_available(
            needed_pages, len(self.free_slots), self.prefix_cache.size_info.evictable_size, p
        )
        # UPDATE
        allocated = self._page_to_token(self._allocate(needed_pages))
        offset = 0
        for req, table_idx, first_page, last_page in allocation_info:
            length = (last_page - first_page) * p
            self.page_table[table_idx][first_page * p : last_page * p] = allocated[offset : offset + length]
            req.alloc_len = last_page * p
            offset += length

    def cache_req(self, req: Req, *, finished: bool) -> None:
        """Insert the request's computed prefix into the cache; free what the cache already had.

        Regions of the request's row (all half-open)::

            [0, old_handle.cached_len)          cached before this prefill (locked by old_handle)
            [old_handle.cached_len, cached_len) cached by another request meanwhile: free ours
            [cached_len, new_handle.cached_len) newly inserted into the cache
            [new_handle.cached_len, alloc_len)  tail that cannot enter the tree: free if finished

        When not finished, the row's ``[old_handle.cached_len, cached_len)`` is
        rewritten to the cache's slots, so the request never reads a page it
        just freed. When finished, the request is released.
        """
        # CHECK
        fields = spec_manager.read_request(req)
        old_handle = self._check_req(req, fields)
        tokens = spec_manager.prompt_length(req.input_ids)
        spec_manager.check_cache_req(fields.uid, old_handle.cached_len, fields.cached_len, fields.alloc_len, tokens)
        row = self.page_table[fields.table_idx]
        # UPDATE (insert_prefix checks its own input first and raises before any change)
        cached_len, new_handle = self.prefix_cache.insert_prefix(
            req.input_ids[: fields.cached_len], row[: fields.cached_len], req.namespace
        )
        self.unlock(old_handle)
        # ACCOUNT
        self._free(row[old_handle.cached_len : cached_len])
        if finished:
            self._free(row[new_handle.cached_len : fields.alloc_len])
            req.cache_handle = None
            req.alloc_len = 0
        else:
            row[old_handle.cached_len : cached_len] = new_handle.get_matched_indices()[
                old_handle.cached_len : cached_len
            ]
            req.cache_handle = new_handle
            self.lock(new_handle)

    @contextmanager
    def lazy_free_region(self) -> Iterator[None]:
        """Inside, frees are held back; on exit (even by an exception) they join the free list in order."""
        # CHECK
        if self.lazy_frees is not None:
            raise CacheBusyError.lazy_region_open()
        # UPDATE
        self.lazy_frees = []
        try:
            yield
        finally:
            held, self.lazy_frees = self.lazy_frees, None
            self.free_slots.extend(held)

    def check_integrity(self, live_reqs: Sequence[Req] = ()) -> None:
        """Check the prefix cache, then the conservation law set by set (free + cached + private == num_pages)."""
        self.prefix_cache.check_integrity()
        spec_manager.check_manager_invariants(
            self.abstract_state(),
            spec_manager.as_spec_requests(live_reqs, self.prefix_cache.abstract_handle),
        )

    def abstract_state(self) -> spec_manager.ManagerState:
        """This manager as the spec's manager state."""
        return spec_manager.ManagerState(
            cache=self.prefix_cache.abstract_state(),
            num_pages=self.num_pages,
            page_table=[row[:] for row in self.page_table],
            free_slots=self.free_slots[:],
            lazy_frees=None if self.lazy_frees is None else self.lazy_frees[:],
        )

    # ------------------------------------------------------------ internals

    def _allocate(self, needed_pages: int) -> list[int]:
        """Take ``needed_pages`` page starts from the front of the free list, evicting first if short."""
        free_pages = len(self.free_slots)
        if needed_pages > free_pages:
            evicted = self.prefix_cache.evict((needed_pages - free_pages) * self.page_size)
            self.free_slots.extend(compute_page_starts(evicted, self.page_size))
            self.evicted_pages += needed_pages - free_pages
        allocated = self.free_slots[:needed_pages]
        del self.free_slots[:needed_pages]
        return allocated

    def _free(self, indices: Sequence[int]) -> None:
        """Return the pages starting at ``indices[::P]`` (held back inside a lazy region)."""
        starts = compute_page_starts(indices, self.page_size)
        if self.lazy_frees is not None:
            self.lazy_frees.extend(starts)
        else:
            self.free_slots.extend(starts)

    def _page_to_token(self, pages: Sequence[int]) -> list[int]:
        """Expand page starts to the slots of each page."""
        return compute_page_to_token(pages, self.page_size)

    def _check_req(self, req: Req, fields: spec_manager.RequestFields) -> BaseCacheHandle:
        """The request's locked handle, after checking its row (``fields``: its numbers, read once); raise
        otherwise."""
        handle: BaseCacheHandle | None = req.cache_handle
        locked = handle is not None and self.prefix_cache.is_handle_locked(handle)
        spec_manager.check_request(
            fields.uid,
            fields.table_idx,
            len(self.page_table),
            self.max_seq_len,
            handle is None,
            locked,
            fields.alloc_len,
            self.page_size,
        )
        assert handle is not None
        return handle
