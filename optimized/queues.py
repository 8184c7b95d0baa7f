"""Admission (PrefillAdder, PrefillManager) and the decode queue over tensors. Twin of ``reference.prefill``/``decode``.

Optimized for speed rather than clarity only where tensors are touched:
the matched prefix and each chunk's token ids are copied into the device
row with one slice assignment each. The queue logic is the reference's,
line for line (FCFS, page-exact reservations, chunks back at the head).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from spec.helpers import compute_pages_to_finish
from spec.types import Batch, ChunkedReq, PendingReq, Req

from .cache_manager import CacheManager
from .table import TableManager


class DecodeManager:
    """Requests in decode, in admission order (an ordered dict). Twin of ``reference.DecodeManager``."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.running_reqs: dict[int, Req] = {}

    def filter_reqs(self, reqs: Iterable[Req]) -> None:
        merged = {uid: req for uid, req in self.running_reqs.items() if req.can_decode}
        for req in reqs:
            if req.can_decode and req.uid not in merged:
                merged[req.uid] = req
        self.running_reqs = merged

    def remove_req(self, req: Req) -> None:
        self.running_reqs.pop(req.uid, None)

    def abort_req(self, uid: int) -> Req | None:
        return self.running_reqs.pop(uid, None)

    @property
    def inflight_tokens(self) -> int:
        p = self.page_size
        return sum(p * compute_pages_to_finish(r.max_device_len, r.alloc_len, p) for r in self.running_reqs.values())

    def schedule_next_batch(self) -> Batch | None:
        return Batch(reqs=list(self.running_reqs.values()), phase="decode") if self.running_reqs else None

    @property
    def runnable(self) -> bool:
        return bool(self.running_reqs)


@dataclass
class PrefillAdder:
    """One prefill batch under a token budget and page reservations. Twin of ``reference.PrefillAdder``."""

    token_budget: int
    reserved_size: int
    cache_manager: CacheManager
    table_manager: TableManager

    def _try_allocate_one(self, req: PendingReq) -> tuple[Any, int] | None:
        if self.table_manager.available_size == 0:
            return None
        handle = self.cache_manager.match_req(req)
        cached_len = handle.cached_len
        p = self.cache_manager.page_size
        estimated_len = p * compute_pages_to_finish(req.input_len + req.output_len, cached_len, p)
        if estimated_len + self.reserved_size > self.cache_manager.available_size:
            return None
        self.cache_manager.lock(handle)
        if estimated_len + self.reserved_size > self.cache_manager.available_size:
            self.cache_manager.unlock(handle)
            return None
        table_idx = self.table_manager.allocate()
        if cached_len > 0:
            row = self.table_manager.token_pool[table_idx]
            row[:cached_len] = torch.tensor(req.input_ids[:cached_len], dtype=row.dtype, device=row.device)
            self.table_manager.page_table[table_idx, :cached_len] = handle.get_matched_indices()
        return handle, table_idx

    def _add_one_req(self, pending: PendingReq, handle: Any, table_idx: int, cached_len: int, alloc_len: int) -> Req:
        remain_len = pending.input_len - cached_len
        chunk_size = min(self.token_budget, remain_len)
        cls = ChunkedReq if chunk_size < remain_len else Req
        p = self.cache_manager.page_size
        self.token_budget -= chunk_size
        self.reserved_size += p * compute_pages_to_finish(pending.input_len + pending.output_len, alloc_len, p)
        end = cached_len + chunk_size
        row = self.table_manager.token_pool[table_idx]
        row[cached_len:end] = torch.tensor(pending.input_ids[cached_len:end], dtype=row.dtype, device=row.device)
        return cls(
            input_ids=pending.input_ids[:end],
            table_idx=table_idx,
            cache_handle=handle,
            namespace=pending.namespace,
            cached_len=cached_len,
            device_len=end,
            alloc_len=alloc_len,
            uid=pending.uid,
            max_device_len=pending.input_len + pending.output_len,
            sampling_params=pending.sampling_params,
        )

    def try_add_one(self, pending: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            return None
        if chunked := pending.chunked_req:
            return self._add_one_req(
                pending, chunked.cache_handle, chunked.table_idx, chunked.cached_len, chunked.alloc_len
            )
        if resource := self._try_allocate_one(pending):
            handle, table_idx = resource
            return self._add_one_req(pending, handle, table_idx, handle.cached_len, handle.cached_len)
        return None


@dataclass
class PrefillManager:
    """The FCFS prefill queue. Twin of ``reference.PrefillManager``."""

    cache_manager: CacheManager
    table_manager: TableManager
    decode_manager: DecodeManager
    pending_list: list[PendingReq] = field(default_factory=list)

    def add_one_req(self, req: PendingReq) -> None:
        self.pending_list.append(req)

    def schedule_next_batch(self, prefill_budget: int) -> Batch | None:
        if not self.pending_list:
            return None
        adder = PrefillAdder(
            prefill_budget, self.decode_manager.inflight_tokens, self.cache_manager, self.table_manager
        )
        reqs: list[Req] = []
        chunked_list: list[PendingReq] = []
        for pending in self.pending_list:
            req = adder.try_add_one(pending)
            if req is None:
                break
            pending.chunked_req = None
            if isinstance(req, ChunkedReq):
                pending.chunked_req = req
                chunked_list.append(pending)
            reqs.append(req)
        if not reqs:
            return None
        self.pending_list = chunked_list + self.pending_list[len(reqs) :]
        return Batch(reqs=reqs, phase="prefill")

    def abort_req(self, uid: int) -> Req | None:
        for i, pending in enumerate(self.pending_list):
            if pending.uid == uid:
                del self.pending_list[i]
                return pending.chunked_req
        return None

    @property
    def runnable(self) -> bool:
        return bool(self.pending_list)
