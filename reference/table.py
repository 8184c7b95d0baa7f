"""Request slots (the seed's ``scheduler/table.py``): page-table rows and the token pool."""

from __future__ import annotations

from collections.abc import Sequence

from radixspec.spec.errors import InvalidRequestError


class TableManager:
    """A free list of page-table rows, the page table, and the token pool (token ids per row position)."""

    def __init__(self, max_running_reqs: int, page_table: list[list[int]]) -> None:
        self.page_table = page_table
        self.token_pool = [[0] * len(row) for row in page_table]
        self.free_slots = list(range(max_running_reqs))

    @property
    def available_size(self) -> int:
        """Rows free for new requests."""
        return len(self.free_slots)

    def allocate(self) -> int:
        """Take the lowest free row."""
        # CHECK
        if not self.free_slots:
            raise InvalidRequestError.no_free_row()
        # UPDATE
        return self.free_slots.pop(0)

    def free(self, table_idx: int) -> None:
        """Return a row; freeing a free row is refused."""
        # CHECK
        if not 0 <= table_idx < len(self.page_table) or table_idx in self.free_slots:
            raise InvalidRequestError.row_not_held(table_idx)
        # UPDATE
        self.free_slots.append(table_idx)

    def write_tokens(self, table_idx: int, start: int, tokens: Sequence[int]) -> None:
        """Token ids into the token pool row from position ``start``."""
        self.token_pool[table_idx][start : start + len(tokens)] = tokens

    def write_slots(self, table_idx: int, start: int, slots: Sequence[int]) -> None:
        """Slots into the page-table row from position ``start``."""
        self.page_table[table_idx][start : start + len(slots)] = slots

    def write_next_tokens(self, writes: list[tuple[int, int, int]]) -> None:
        """Sampled tokens into the token pool: (row, position, token) each."""
        for table_idx, position, token in writes:
            self.token_pool[table_idx][position] = token
