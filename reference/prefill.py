"""Admission and chunked prefill (the seed's ``scheduler/prefill.py``): FCFS under a token budget.

Shared by both schedulers: rows are written through the table manager
(lists here, one tensor copy each in ``radixspec.optimized.table``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from radixspec.spec.helpers import compute_pages_to_finish
from radixspec.spec.requests import Batch, ChunkedReq, PendingReq, Req

from .base import BaseCacheHandle
from .decode import DecodeManager


class CacheManager(Protocol):
    """What admission needs of a cache manager (``reference.CacheManager`` or ``optimized.CacheManager``)."""

    page_size: int

    @property
    def available_size(self) -> int: ...
    def match_req(self, req: PendingReq) -> Any: ...
    def lock(self, handle: Any) -> None: ...
    def unlock(self, handle: Any) -> None: ...


class TableManager(Protocol):
    """What admission needs of a table manager (``radixspec.reference.table`` or ``radixspec.optimized.table``)."""

    @property
    def available_size(self) -> int: ...
    def allocate(self) -> int: ...
    def write_tokens(self, table_idx: int, start: int, tokens: Any) -> None: ...
    def write_slots(self, table_idx: int, start: int, slots: Any) -> None: ...


@dataclass
class PrefillAdder:
    """Fills one prefill batch: each request must fit the token budget and the pages left after reservations."""

    # prompt tokens this batch may still compute
    token_budget: int
    # tokens of pages promised to requests already running or added: not available to new ones
    reserved_size: int
    cache_manager: CacheManager
    table_manager: TableManager

    def _try_allocate_one(self, req: PendingReq) -> tuple[BaseCacheHandle, int] | None:
        """Match, check room, lock, check room again, take a row, copy the matched prefix into it."""
        if self.table_manager.available_size == 0:
            return None
        handle = self.cache_manager.match_req(req)
        cached_len = handle.cached_len
        p = self.cache_manager.page_size
        # every page the request will allocate from here to its last token (page exact: see README)
        estimated_len = p * compute_pages_to_finish(req.input_len + req.output_len, cached_len, p)
        if estimated_len + self.reserved_size > self.cache_manager.available_size:
            return None
        self.cache_manager.lock(handle)
        # the matched pages are locked now, so they stopped counting as available: check again
        if estimated_len + self.reserved_size > self.cache_manager.available_size:
            self.cache_manager.unlock(handle)
            return None
        table_idx = self.table_manager.allocate()
        if cached_len > 0:
            self.table_manager.write_tokens(table_idx, 0, req.input_ids[:cached_len])
            self.table_manager.write_slots(table_idx, 0, handle.get_matched_indices())
        return handle, table_idx

    def _add_one_req(
        self, pending_req: PendingReq, cache_handle: BaseCacheHandle, table_idx: int, cached_len: int, alloc_len: int
    ) -> Req:
        """The next chunk of ``pending_req``: as much of its prompt as the budget allows."""
        remain_len = pending_req.input_len - cached_len
        chunk_size = min(self.token_budget, remain_len)
        cls = ChunkedReq if chunk_size < remain_len else Req
        p = self.cache_manager.page_size
        self.token_budget -= chunk_size
        self.reserved_size += p * compute_pages_to_finish(pending_req.input_len + pending_req.output_len, alloc_len, p)
        # only token ids here: pages are allocated when the batch is prepared
        end = cached_len + chunk_size
        self.table_manager.write_tokens(table_idx, cached_len, pending_req.input_ids[cached_len:end])
        return cls(
            input_ids=pending_req.input_ids[:end],
            table_idx=table_idx,
            cache_handle=cache_handle,
            namespace=pending_req.namespace,
            cached_len=cached_len,
            device_len=end,
            alloc_len=alloc_len,
            uid=pending_req.uid,
            max_device_len=pending_req.input_len + pending_req.output_len,
            sampling_params=pending_req.sampling_params,
        )

    def try_add_one(self, pending_req: PendingReq) -> Req | None:
        """A request (or its next chunk) for this batch, or None when it does not fit."""
        if self.token_budget <= 0:
            return None
        if chunked := pending_req.chunked_req:
            return self._add_one_req(
                pending_req, chunked.cache_handle, chunked.table_idx, chunked.cached_len, chunked.alloc_len
            )
        if resource := self._try_allocate_one(pending_req):
            handle, table_idx = resource
            return self._add_one_req(pending_req, handle, table_idx, handle.cached_len, handle.cached_len)
        return None


@dataclass
class PrefillManager:
    """The queue of requests waiting for prefill, first come first served."""

    cache_manager: CacheManager
    table_manager: TableManager
    decode_manager: DecodeManager
    pending_list: list[PendingReq] = field(default_factory=list)

    def add_one_req(self, req: PendingReq) -> None:
        self.pending_list.append(req)

    def schedule_next_batch(self, prefill_budget: int) -> Batch | None:
        """Add requests in order until one does not fit; unfinished chunks go back to the head of the queue."""
        if not self.pending_list:
            return None
        adder = PrefillAdder(
            token_budget=prefill_budget,
            reserved_size=self.decode_manager.inflight_tokens,
            cache_manager=self.cache_manager,
            table_manager=self.table_manager,
        )
        reqs: list[Req] = []
        chunked_list: list[PendingReq] = []
        for pending_req in self.pending_list:
            req = adder.try_add_one(pending_req)
            if req is None:
                break  # first come, first served: nobody overtakes a request that does not fit
            pending_req.chunked_req = None
            if isinstance(req, ChunkedReq):
                pending_req.chunked_req = req
                chunked_list.append(pending_req)
            reqs.append(req)
        if not reqs:
            return None
        # a request cut into chunks goes back to the head of the queue, so it is never starved
        self.pending_list = chunked_list + self.pending_list[len(reqs) :]
        return Batch(reqs=reqs, phase="prefill")

    def abort_req(self, uid: int) -> Req | None:
        """Drop request ``uid`` from the queue; returns its chunk if it already holds resources."""
        for i, pending in enumerate(self.pending_list):
            if pending.uid == uid:
                del self.pending_list[i]
                return pending.chunked_req
        return None

    @property
    def runnable(self) -> bool:
        return bool(self.pending_list)
