"""The CacheManager on device tensors. Twin of ``radixspec.reference.cache_manager``.

Optimized for speed rather than clarity: the free list is a device tensor
of page starts, the page table a device tensor ``[max_running_reqs,
max_seq_len]``, and ``allocate_paged`` writes a whole batch with one
scatter (a Python loop over requests, never over tokens).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from radixspec.spec import cache_manager as spec_manager
from radixspec.spec.domains import check_page_size, check_pool_size
from radixspec.spec.errors import (
    CacheBusyError,
    InvalidRequestError,
    InvalidSizeError,
    InvalidTypeError,
)
from radixspec.spec.helpers import div_ceil
from radixspec.spec.requests import Prompted, Req

from .inputs import copied_with_tensors
from .naive_cache import NaivePrefixCache
from .radix_cache import RadixPrefixCache


def make_page_table(max_running_reqs: int, max_seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An all-zero int32 page table on ``device``."""
    if max_running_reqs < 1 or max_seq_len < 1:
        raise InvalidSizeError(f"page table needs >= 1 rows and columns, got {max_running_reqs} x {max_seq_len}")
    return torch.zeros((max_running_reqs, max_seq_len), dtype=torch.int32, device=device)


class CacheManager:
    """Prefix cache + free list + page table, on tensors. Twin of ``reference.CacheManager``."""

    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor, type: str = "radix") -> None:
        # CHECK
        page_size = check_page_size(page_size)
        num_pages = check_pool_size(num_pages, page_size)
        if type not in ("radix", "naive"):
            raise InvalidRequestError(f"prefix cache type must be 'radix' or 'naive', got {type!r}")
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.dtype != torch.int32:
            raise InvalidTypeError("page_table must be a 2-D int32 tensor (see make_page_table)")
        # UPDATE
        self.device = page_table.device
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.prefix_cache: RadixPrefixCache | NaivePrefixCache = (
            RadixPrefixCache(page_size, self.device) if type == "radix" else NaivePrefixCache(page_size, self.device)
        )
        self.free_slots = torch.arange(num_pages, dtype=torch.int32, device=self.device) * page_size
        self.lazy_frees: list[torch.Tensor] | None = None
        # pages taken back from the cache by allocations, over the manager's life
        self.evicted_pages = 0
        self._offsets = torch.arange(page_size, dtype=torch.int32, device=self.device)

    def __deepcopy__(self, memo: dict[int, object]) -> CacheManager:
        """An independent manager in the same state: its tensors cloned (torch's own deep copy costs ten times
        more), the rest, its cache included, copied deep."""
        return copied_with_tensors(self, memo)

    def match_req(self, req: Prompted) -> Any:
        """Match all of the prompt but its last token, which is always recomputed to produce logits."""
        # CHECK
        input_ids: Any = getattr(req, "input_ids", None)
        n = spec_manager.prompt_length(input_ids)
        if n == 0:
            raise InvalidRequestError.empty_request()
        # WALK
        return self.prefix_cache.match_prefix(input_ids[: n - 1], getattr(req, "namespace", None))

    @property
    def available_size(self) -> int:
        """Tokens an allocation may use now: evictable cache plus free pages."""
        return self.prefix_cache.size_info.evictable_size + self.free_slots.numel() * self.page_size

    def lock(self, handle: Any) -> None:
        self.prefix_cache.lock(handle)

    def unlock(self, handle: Any) -> None:
        self.prefix_cache.unlock(handle)

    def allocate_paged(self, reqs: Sequence[Req]) -> None:
        """Pages for ``[cached_len, device_len)`` of each request, written with one scatter."""
        # CHECK
        p = self.page_size
        batch = spec_manager.read_batch(reqs)
        spec_manager.check_distinct_rows(batch)
        rows: list[int] = []
        firsts: list[int] = []
        lengths: list[int] = []
        for req, fields in zip(reqs, batch, strict=True):
            self._check_req(req, fields)
            first_page, last_page = spec_manager.check_allocation(
                fields.uid, fields.cached_len, fields.device_len, fields.alloc_len, self.page_table.shape[1], p
            )
            if last_page > first_page:
                rows.append(fields.table_idx)
                firsts.append(first_page * p)
                lengths.append((last_page - first_page) * p)
        needed_pages = sum(lengths) // p
        spec_manager.check_pages_available(
            needed_pages, self.free_slots.numel(), self.prefix_cache.size_info.evictable_size, p
        )
        if needed_pages == 0:
            return
        # UPDATE
        allocated = self._page_to_token(self._allocate(needed_pages))
        device = self.device
        length_t = torch.tensor(lengths, dtype=torch.int64, device=device)
        row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64, device=device), length_t)
        starts = torch.tensor(firsts, dtype=torch.int64, device=device) - (torch.cumsum(length_t, 0) - length_t)
        positions = torch.arange(allocated.numel(), device=device) + torch.repeat_interleave(starts, length_t)
        self.page_table[row_idx, positions] = allocated
        for req, fields in zip(reqs, batch, strict=True):
            if div_ceil(fields.device_len, p) * p > fields.alloc_len:
                req.alloc_len = div_ceil(fields.device_len, p) * p

    def cache_req(self, req: Req, *, finished: bool) -> None:
        """Insert the request's computed prefix; free what the cache already had (see the reference's map)."""
        # CHECK
        fields = spec_manager.read_request(req)
        old_handle = self._check_req(req, fields)
        tokens = spec_manager.prompt_length(req.input_ids)
        spec_manager.check_cache_req(fields.uid, old_handle.cached_len, fields.cached_len, fields.alloc_len, tokens)
        row = self.page_table[fields.table_idx]
        # UPDATE
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
            if cached_len > old_handle.cached_len:
                row[old_handle.cached_len : cached_len] = new_handle.get_matched_indices()[
                    old_handle.cached_len : cached_len
                ]
            req.cache_handle = new_handle
            self.lock(new_handle)

    @contextmanager
    def lazy_free_region(self) -> Iterator[None]:
        """Inside, frees are held back; on exit (even by an exception) they join the free list at once."""
        # CHECK
        if self.lazy_frees is not None:
            raise CacheBusyError.lazy_region_open()
        # UPDATE
        self.lazy_frees = []
        try:
            yield
        finally:
            held, self.lazy_frees = self.lazy_frees, None
            if held:
                self.free_slots = torch.cat([self.free_slots, *held])

    def check_integrity(self, live_reqs: Sequence[Req] = ()) -> None:
        """The prefix cache's checks, then the conservation law set by set through the spec."""
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
            page_table=self.page_table.tolist(),
            free_slots=self.free_slots.tolist(),
            lazy_frees=None if self.lazy_frees is None else [s for t in self.lazy_frees for s in t.tolist()],
        )

    # ------------------------------------------------------------ internals

    def _allocate(self, needed_pages: int) -> torch.Tensor:
        """Take ``needed_pages`` page starts from the front of the free list, evicting first if short."""
        free_pages = self.free_slots.numel()
        if needed_pages > free_pages:
            evicted = self.prefix_cache.evict((needed_pages - free_pages) * self.page_size)
            self.free_slots = torch.cat([self.free_slots, evicted[:: self.page_size]])
            self.evicted_pages += needed_pages - free_pages
        allocated = self.free_slots[:needed_pages]
        self.free_slots = self.free_slots[needed_pages:]
        return allocated

    def _free(self, indices: torch.Tensor) -> None:
        """Return the pages starting at ``indices[::P]`` (held back, copied, inside a lazy region)."""
        if indices.numel() == 0:
            return
        starts = indices[:: self.page_size]
        if self.lazy_frees is not None:
            self.lazy_frees.append(starts.clone())
        else:
            self.free_slots = torch.cat([self.free_slots, starts])

    def _page_to_token(self, pages: torch.Tensor) -> torch.Tensor:
        """[X] -> [X, X+1, ..., X+P-1] for every page start."""
        if self.page_size == 1:
            return pages
        return (pages.unsqueeze(1) + self._offsets).flatten()

    def _check_req(self, req: Req, fields: spec_manager.RequestFields) -> Any:
        """The request's locked handle, after checking its row (``fields``: its numbers, read once); raise
        otherwise."""
        handle = req.cache_handle
        locked = handle is not None and self.prefix_cache.is_handle_locked(handle)
        rows, row_len = self.page_table.shape
        spec_manager.check_request(
            fields.uid, fields.table_idx, rows, row_len, handle is None, locked, fields.alloc_len, self.page_size
        )
        return handle
