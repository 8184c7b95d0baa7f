"""The scheduler (the seed's ``scheduler/scheduler.py``): prefill first, else decode; normal or overlap loop.

Normal loop: schedule batch k, run it, process its results. Overlap loop:
schedule and run batch k+1, then process batch k's results (what a GPU
engine does to hide CPU time). An abort may arrive between any two steps,
for a request waiting, chunked, running, in the batch in flight, or
finishing in it: the request leaves the queues at once and its resources
are freed exactly once, after its last batch was processed (mini-sglang
issue #111 was a double free here).
"""

from __future__ import annotations

from typing import Any

from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError, InvalidRequestError
from radixspec.spec.requests import (
    Batch,
    ChunkedReq,
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
from .decode import DecodeManager
from .model import Model
from .prefill import PrefillManager
from .table import TableManager

ForwardData = tuple[Batch, list[int]]


class Scheduler:
    """Requests in, batches through the model, tokens out. Plain Python (lists and ints).

    The host-side core (queues, admission, chunking, aborts, overlap bookkeeping) is this class's,
    and ``optimized.Scheduler`` inherits it: the twins differ only in their tables (lists or
    tensors), in ``_prepare_batch`` and in the model they run.
    """

    def __init__(self, config: SchedulerConfig, model: Model) -> None:
        config.check()
        page_table = make_page_table(config.max_running_reqs, config.max_seq_len)
        self._set_up(
            config,
            model,
            page_table,
            TableManager(config.max_running_reqs, page_table),
            CacheManager(config.num_pages, config.page_size, page_table, config.cache_type),
        )

    def _set_up(
        self, config: SchedulerConfig, model: Any, page_table: Any, table_manager: Any, cache_manager: Any
    ) -> None:
        """The core's state around the given tables and cache manager."""
        self.config = config
        self.model = model
        self.page_table = page_table
        self.table_manager = table_manager
        self.cache_manager = cache_manager
        self.decode_manager = DecodeManager(config.page_size)
        self.prefill_manager = PrefillManager(self.cache_manager, self.table_manager, self.decode_manager)
        # uids finished while processing the last batch (overlap may show them once more)
        self.finished_reqs: set[int] = set()
        # aborted requests whose resources wait for their last batch, in abort order
        self.pending_aborts: dict[int, Req] = {}
        self.last_data: ForwardData | None = None
        # the current Req object of every request holding resources
        self.live: dict[int, Req] = {}
        self.status: dict[int, str] = {}
        self.outputs: dict[int, list[int]] = {}
        # tokens sampled per request, whatever its status (decides when it finished)
        self.sampled: dict[int, int] = {}
        self.stats = SchedulerStats()

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        uid: int,
        input_ids: list[int],
        max_tokens: int = 16,
        ignore_eos: bool = False,
        namespace: Namespace = None,
    ) -> int:
        """Queue a request; returns its max_tokens, clipped to what fits in a row of max_seq_len."""
        # CHECK
        tokens, clipped = check_request(self.config, self.status, uid, input_ids, max_tokens, namespace)
        # UPDATE
        params = SamplingParams(max_tokens=clipped, ignore_eos=ignore_eos)
        self.prefill_manager.add_one_req(PendingReq(uid, tokens, params, namespace))
        self.status[uid] = "waiting"
        self.outputs[uid] = []
        self.sampled[uid] = 0
        return clipped

    def abort(self, uid: int) -> bool:
        """Abort request ``uid`` at once; its resources are freed after its last batch. False if not live."""
        if self.status.get(uid) not in ("waiting", "running"):
            return False
        req = self.prefill_manager.abort_req(uid) or self.decode_manager.abort_req(uid)
        if req is not None:
            self.pending_aborts[uid] = req
        self.status[uid] = "aborted"
        self.stats.aborted += 1
        return True

    # ------------------------------------------------------------ the loop

    def step(self) -> StepReport:
        """One iteration of the normal or overlap loop."""
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
        in_use = self.config.num_pages - len(self.cache_manager.free_slots)
        self.stats.peak_pages_in_use = max(self.stats.peak_pages_in_use, in_use)
        return report

    @property
    def idle(self) -> bool:
        """Nothing waiting, running, in flight, or left to free."""
        return not (
            self.prefill_manager.runnable or self.decode_manager.runnable or self.last_data or self.pending_aborts
        )

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step until idle (raises if max_steps pass first: a request would be starved)."""
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise InvalidRequestError(f"still busy after {max_steps} steps")

    # ------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Pages (free, cached, or private to one live request) and rows (free or held by one live request)."""
        live = list(self.live.values())
        self.cache_manager.check_integrity(live)
        rows = sorted([req.table_idx for req in live] + self.table_manager.free_slots)
        if rows != list(range(self.config.max_running_reqs)):
            raise IntegrityError(f"rows_are_partitioned: live rows + free rows = {rows}")

    # ------------------------------------------------------------ internals

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
        """Pages for the new positions, then the positions, their token ids and their slots."""
        self.cache_manager.allocate_paged(batch.reqs)
        positions, input_ids, out_loc = [], [], []
        for req in batch.reqs:
            row = req.table_idx
            for position in range(req.cached_len, req.device_len):
                positions.append(position)
                input_ids.append(self.table_manager.token_pool[row][position])
                out_loc.append(self.page_table[row][position])
        batch.positions, batch.input_ids, batch.out_loc = positions, input_ids, out_loc

    def _forward(self, batch: Batch) -> list[int]:
        """Run the model; the next token goes into the token pool, lengths advance, decode set updates."""
        next_tokens: list[int] = self.model.forward(batch, self.page_table, self.table_manager.token_pool)
        self.table_manager.write_next_tokens(
            [
                (req.table_idx, req.device_len, token)
                for req, token in zip(batch.reqs, next_tokens, strict=True)
                if req.can_decode
            ]
        )
        for req in batch.reqs:
            req.complete_one()
        self.decode_manager.filter_reqs(batch.reqs)
        return next_tokens

    def _process_last_data(self, data: ForwardData | None, report: StepReport) -> None:
        """Append sampled tokens; release finished requests; cache the prompt of a completed prefill."""
        if data is None:
            return
        batch, next_tokens = data
        new_finished: set[int] = set()
        with self.cache_manager.lazy_free_region():
            for req, token in zip(batch.reqs, next_tokens, strict=True):
                if isinstance(req, ChunkedReq):
                    continue  # a chunk samples nothing
                req.append_host(token)
                self.sampled[req.uid] += 1
                # judged by this batch's token count, not by req.can_decode: in overlap mode the
                # request has already advanced through the next batch
                finished = is_finished(self.sampled[req.uid], req.sampling_params, token, self.config.eos_token_id)
                if self.status[req.uid] == "running":
                    self.outputs[req.uid].append(token)
                    self.stats.generated_tokens += 1
                    report.processed.append((req.uid, token, finished))
                # overlap may show a request once more after it finished: free it once
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
        """Free aborted requests, except one in the batch in flight (its turn comes after processing)."""
        in_flight = {req.uid for req in ongoing[0].reqs} if ongoing is not None and self.config.overlap else set()
        for uid, req in list(self.pending_aborts.items()):
            if uid in in_flight:
                continue
            del self.pending_aborts[uid]
            if uid in self.finished_reqs or uid not in self.live:
                continue  # its last batch finished it and freed it already
            self._free_req_resources(req, report)

    def _free_req_resources(self, req: Req, report: StepReport) -> None:
        """Give back the request's row and pages (its computed prefix enters the cache)."""
        self.table_manager.free(req.table_idx)
        self.cache_manager.cache_req(req, finished=True)
        del self.live[req.uid]
        report.released.append(req.uid)
