"""Request slots on device tensors. Twin of ``reference.table``."""

from __future__ import annotations

import torch

from spec.errors import InvalidRequestError


class TableManager:
    """Free rows; the page table and the token pool as ``[max_running_reqs, max_seq_len]`` int32 tensors."""

    def __init__(self, max_running_reqs: int, page_table: torch.Tensor) -> None:
        self.page_table = page_table
        self.token_pool = torch.zeros_like(page_table)
        self.free_slots = list(range(max_running_reqs))

    @property
    def available_size(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        if not self.free_slots:
            raise InvalidRequestError("no free request slot (max_running_reqs reached)")
        return self.free_slots.pop(0)

    def free(self, table_idx: int) -> None:
        if not 0 <= table_idx < self.page_table.shape[0] or table_idx in self.free_slots:
            raise InvalidRequestError(f"row {table_idx} is not held by a request")
        self.free_slots.append(table_idx)
