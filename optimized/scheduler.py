"""The scheduler on tensors. Twin of ``radixspec.reference.scheduler``: the same core, tensors prepared here.

The host-side logic (queues, admission, chunking, aborts, overlap
bookkeeping) is ``reference.Scheduler``'s and exists once: this class
inherits it. What differs is what touches tensors: the page table and token
pool are device tensors (``radixspec.optimized.table``: a row is written with one
copy, the sampled tokens with one scatter), and a batch's positions, token
ids and slots come from a few tensor ops over them (``_prepare_batch``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from radixspec.reference.scheduler import Scheduler as _Core
from radixspec.spec.requests import Batch, SchedulerConfig

from .cache_manager import CacheManager, make_page_table
from .table import TableManager


class Model(Protocol):
    """What the scheduler calls once per batch."""

    def forward(self, batch: Batch, page_table: torch.Tensor, token_pool: torch.Tensor) -> list[int]: ...


class Scheduler(_Core):
    """Requests in, batches through the model, tokens out; tables on ``device``. Twin of ``reference.Scheduler``."""

    def __init__(self, config: SchedulerConfig, model: Model, device: torch.device | str = "cpu") -> None:
        config.check()
        page_table = make_page_table(config.max_running_reqs, config.max_seq_len, device)
        self.device = page_table.device
        self._set_up(
            config,
            model,
            page_table,
            TableManager(config.max_running_reqs, page_table),
            CacheManager(config.num_pages, config.page_size, page_table, config.cache_type),
        )

    def _prepare_batch(self, batch: Batch) -> None:
        """Pages, then positions / token ids / slots of the whole batch with a few tensor ops."""
        self.cache_manager.allocate_paged(batch.reqs)
        device = self.device
        lengths = torch.tensor([req.extend_len for req in batch.reqs], dtype=torch.int64, device=device)
        rows = torch.repeat_interleave(
            torch.tensor([req.table_idx for req in batch.reqs], dtype=torch.int64, device=device), lengths
        )
        firsts = torch.tensor([req.cached_len for req in batch.reqs], dtype=torch.int64, device=device)
        starts = torch.repeat_interleave(firsts - (torch.cumsum(lengths, 0) - lengths), lengths)
        positions = torch.arange(rows.numel(), dtype=torch.int64, device=device) + starts
        batch.positions = positions
        batch.input_ids = self.table_manager.token_pool[rows, positions]
        batch.out_loc = self.page_table[rows, positions]
