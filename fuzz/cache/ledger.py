"""The cache machine, part: the slot ledger: the pages the machine owns and hands out, and the pages the model holds."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import SLOT_LIMIT

from ..targets.api import PageKey
from .base import CacheMachineBase


class SlotLedger(CacheMachineBase):
    """The slot ledger: the pages the machine owns and hands out, and the pages the model holds."""

    def take_pages(self, count: int, high: bool = False) -> list[int]:
        """``count`` page starts the machine owns, handed out (from the top of the slot domain when ``high``)."""
        p = self.page_size
        if high:
            top = (SLOT_LIMIT - p) // p * p
            pages = [top - (self.high_taken + k) * p for k in range(count)]
            self.high_taken += count
            self.num_pages += count
            return pages
        while not self.bounded and len(self.free) < count:
            self.free.append(self.next_low)
            self.next_low += p
            self.num_pages += 1
        return [self.free.popleft() for _ in range(count)]

    def peek_pages(self) -> Iterator[int]:
        """The page starts the next take_pages() would hand out (for calls that must be rejected)."""
        if self.bounded:
            return iter(list(self.free))
        return itertools.chain(list(self.free), itertools.count(self.next_low, self.page_size))

    def leading_cached_pages(self, keys: list[PageKey]) -> int:
        """How many leading pages of ``keys`` the model holds."""
        cached = 0
        while cached < len(keys) and keys[cached] in self.model.entries:
            cached += 1
        return cached

    def page_starts(self, handle: pc.Handle) -> list[int]:
        """First slots of a live handle's pages, in path order."""
        return [self.model.entries[key].slot_start for key in pc.get_handle_keys(self.model, handle)]

    def model_starts(self) -> list[int]:
        return [entry.slot_start for entry in self.model.entries.values()]
