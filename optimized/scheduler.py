"""The scheduler on tensors. Twin of ``reference.scheduler`` (same loop, same decisions).

Optimized for speed rather than clarity where tensors are built: a batch's
positions, token ids and slots come from a few tensor ops over the page
table and token pool, and the sampled tokens go back into the token pool
with one scatter. The queue and abort logic is the reference's.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from spec.errors import IntegrityError, InvalidRequestError
from spec.types import (
    Batch,
    ChunkedReq,
    Namespace,
    PendingReq,
    Req,
    SamplingParams,
    SchedulerConfig,
    SchedulerStats,
    StepReport,
    check_request,
    is_finished,
)

from .cache_manager import CacheManager, make_page_table
from .queues import DecodeManager, PrefillManager
from .table import TableManager


class Model(Protocol):
    """What the scheduler calls once per batch."""

    def forward(self, batch: Batch, page_table: torch.Tensor, token_pool: torch.Tensor) -> list[int]: ...


ForwardData = tuple[Batch, list[int]]


class Scheduler:
    """Requests in, batches through the model, tokens out; tables on ``device``. Twin of ``reference.Scheduler``."""

    def __init__(self, config: SchedulerConfig, model: Model, device: torch.device | str = "cpu") -> None:
        config.check()
        self.config = config
        self.model = model
        self.page_table = make_page_table(config.max_running_reqs, config.max_seq_len, device)
        self.device = self.page_table.device
        self.table_manager = TableManager(config.max_running_reqs, self.page_table)
        self.cache_manager = CacheManager(config.num_pages, config.page_size, self.page_table, config.cache_type)
        self.decode_manager = DecodeManager(config.page_size)
        self.prefill_manager = PrefillManager(self.cache_manager, self.table_manager, self.decode_manager)
        self.finished_reqs: set[int] = set()
        self.pending_aborts: dict[int, Req] = {}
        self.last_data: ForwardData | None = None
        self.live: dict[int, Req] = {}
        self.status: dict[int, str] = {}
        self.outputs: dict[int, list[int]] = {}
        self.sampled: dict[int, int] = {}
        self.stats = SchedulerStats()

    def add_request(
        self,
        uid: int,
        input_ids: list[int],
        max_tokens: int = 16,
        ignore_eos: bool = False,
        namespace: Namespace = None,
    ) -> int:
        # CHECK
        tokens, clipped = check_request(self.config, self.status, uid, input_ids, max_tokens, namespace)
        # UPDATE
        self.prefill_manager.add_one_req(PendingReq(uid, tokens, SamplingParams(clipped, ignore_eos), namespace))
        self.status[uid] = "waiting"
        self.outputs[uid] = []
        self.sampled[uid] = 0
        return clipped

    def abort(self, uid: int) -> bool:
        if self.status.get(uid) not in ("waiting", "running"):
            return False
        req = self.prefill_manager.abort_req(uid) or self.decode_manager.abort_req(uid)
        if req is not None:
            self.pending_aborts[uid] = req
        self.status[uid] = "aborted"
        self.stats.aborted += 1
        return True

    def step(self) -> StepReport:
        report = StepReport(phase=None)
        batch = self._schedule_next_batch(report)
        ongoing = (batch, self._forward(batch)) if batch is not None else None
        if self.config.overlap:
            self._process_last_data(self.last_data, report)
            self.last_data = ongoing
        else:
            self._process_last_data(ongoing, report)
        self._free_pending_aborts(ongoing, report)
        self.stats.steps += 1
        in_use = self.config.num_pages - self.cache_manager.free_slots.numel()
        self.stats.peak_pages_in_use = max(self.stats.peak_pages_in_use, in_use)
        return report

    @property
    def idle(self) -> bool:
        return not (
            self.prefill_manager.runnable or self.decode_manager.runnable or self.last_data or self.pending_aborts
        )

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise InvalidRequestError(f"still busy after {max_steps} steps")

    def check_integrity(self) -> None:
        live = list(self.live.values())
        self.cache_manager.check_integrity(live)
        rows = sorted([req.table_idx for req in live] + self.table_manager.free_slots)
        if rows != list(range(self.config.max_running_reqs)):
            raise IntegrityError(f"rows_are_partitioned: live rows + free rows = {rows}")

    def _schedule_next_batch(self, report: StepReport) -> Batch | None:
        batch = (
            self.prefill_manager.schedule_next_batch(self.config.max_extend_tokens)
            or self.decode_manager.schedule_next_batch()
        )
        if batch is None:
            return None
        self._prepare_batch(batch)
        report.phase = batch.phase
        report.scheduled = [(req.uid, req.extend_len) for req in batch.reqs]
        if batch.is_prefill:
            self.stats.prefill_batches += 1
        else:
            self.stats.decode_batches += 1
        for req in batch.reqs:
            if req.uid not in self.live:
                self.stats.admitted += 1
                self.stats.prompt_tokens += req.max_device_len - req.sampling_params.max_tokens
                self.stats.prefix_hit_tokens += req.cached_len
                self.status[req.uid] = "running"
            self.live[req.uid] = req
        return batch

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

    def _forward(self, batch: Batch) -> list[int]:
        next_tokens = self.model.forward(batch, self.page_table, self.table_manager.token_pool)
        writes = [
            (req.table_idx, req.device_len, t) for req, t in zip(batch.reqs, next_tokens, strict=True) if req.can_decode
        ]
        if writes:
            index: Any = torch.tensor(writes, dtype=torch.int64, device=self.device)
            self.table_manager.token_pool[index[:, 0], index[:, 1]] = index[:, 2].to(torch.int32)
        for req in batch.reqs:
            req.complete_one()
        self.decode_manager.filter_reqs(batch.reqs)
        return next_tokens

    def _process_last_data(self, data: ForwardData | None, report: StepReport) -> None:
        if data is None:
            return
        batch, next_tokens = data
        new_finished: set[int] = set()
        eos = self.config.eos_token_id
        with self.cache_manager.lazy_free_region():
            for req, token in zip(batch.reqs, next_tokens, strict=True):
                if isinstance(req, ChunkedReq):
                    continue
                req.append_host(token)
                self.sampled[req.uid] += 1
                finished = is_finished(self.sampled[req.uid], req.sampling_params, token, eos)
                if self.status[req.uid] == "running":
                    self.outputs[req.uid].append(token)
                    self.stats.generated_tokens += 1
                    report.processed.append((req.uid, token, finished))
                if finished and req.uid not in self.finished_reqs:
                    self.decode_manager.remove_req(req)
                    self._free_req_resources(req, report)
                    new_finished.add(req.uid)
                    if self.status[req.uid] == "running":
                        self.status[req.uid] = "finished"
                elif batch.is_prefill and not finished:
                    self.cache_manager.cache_req(req, finished=False)
        self.finished_reqs = new_finished

    def _free_pending_aborts(self, ongoing: ForwardData | None, report: StepReport) -> None:
        in_flight = {req.uid for req in ongoing[0].reqs} if ongoing is not None and self.config.overlap else set()
        for uid, req in list(self.pending_aborts.items()):
            if uid in in_flight:
                continue
            del self.pending_aborts[uid]
            if uid in self.finished_reqs or uid not in self.live:
                continue
            self._free_req_resources(req, report)

    def _free_req_resources(self, req: Req, report: StepReport) -> None:
        self.table_manager.free(req.table_idx)
        self.cache_manager.cache_req(req, finished=True)
        del self.live[req.uid]
        report.released.append(req.uid)
