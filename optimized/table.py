"""Request slots on device tensors. Twin of ``radixspec.reference.table``: the same rows; writes are tensor copies."""

from __future__ import annotations

from typing import Any

import torch

from radixspec.spec.errors import InvalidRequestError


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
            raise InvalidRequestError.no_free_row()
        return self.free_slots.pop(0)

    def free(self, table_idx: int) -> None:
        if not 0 <= table_idx < self.page_table.shape[0] or table_idx in self.free_slots:
            raise InvalidRequestError.row_not_held(table_idx)
        self.free_slots.append(table_idx)

    def write_tokens(self, table_idx: int, start: int, tokens: Any) -> None:
        """Token ids (a tensor or a list) into the token pool row from position ``start``: one copy."""
        row = self.token_pool[table_idx]
        row[start : start + len(tokens)] = torch.as_tensor(tokens, dtype=row.dtype, device=row.device)

    def write_slots(self, table_idx: int, start: int, slots: torch.Tensor) -> None:
        """Slots (a tensor on the table's device) into the page-table row from position ``start``: one copy."""
        self.page_table[table_idx, start : start + slots.numel()] = slots

    def write_next_tokens(self, writes: list[tuple[int, int, int]]) -> None:
        """Sampled tokens into the token pool with one scatter: (row, position, token) each."""
        if writes:
            index = torch.tensor(writes, dtype=torch.int64, device=self.token_pool.device)
            self.token_pool[index[:, 0], index[:, 1]] = index[:, 2].to(self.token_pool.dtype)
