"""Target ``tokenspeed``: TokenSpeed's scheduler (the ``tokenspeed-scheduler`` 0.1.42 wheel, C++ behind nanobind),
which plans its own batches over a three-tier KV cache: the device block pool, the host pool (``WriteBackOp``,
``LoadBackOp``) and, when drawn, storage (``StorageQueryOp`` / ``StoragePutOp`` / ``StorageGetOp``).

The planner machine (``fuzz/planner_machine.py``) submits requests, asks for each ``next_execution_plan`` and
plays the executor and the model: it runs the transfers (late, out of order, storage ones failed), the page copies
and zeroing the plan asks for, and the forward, reporting ``ExtendResult`` per request, ``Finish``, ``Abort``,
``clear_cache``. Nothing of the wheel is shimmed: it needs no GPU, no torch, only numpy. This adapter translates
its plan into the planner layer's ``Plan`` and the machine's reports into its events, and nothing else.

Configurations drawn: page size 1 to 16 (the prefix granularity), device pool 8 to 48 pages, host pool 0.5x to 4x
the device's, storage on or off, a token budget per step of 8 to 128 (chunked prefill), 1 to 8 requests a batch,
mixed prefill and decode batches or not, retraction off, on (budgets undeclared) or forced every third plan, and
overlap scheduling (results a forward late) or not. One full-attention cache group and, each in half the examples, a
sliding-window group beside it and a recurrent state group (two slots a request: the state read and the one written);
in a third, speculative decoding (two drafts a decode step, some accepted).

The wheel's ``FatalCheck`` calls ``abort()``: a broken internal assertion ends the process. The campaign then
reports a dead worker (exit 3), with Python's fault handler's stack on stderr.
"""

from __future__ import annotations

import types
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal, NamedTuple, Protocol, cast

from radixspec.spec.errors import IntegrityError

from .api import BlockEvent, KnownFinding, Pass, Plan, Profile, TargetInfo, Tier, Transfer, choose_from, draw_choosing

VERSION = "0.1.42"
PAGE_SIZES = (1, 2, 4, 8, 16)
DEVICE_PAGES = (8, 12, 16, 24, 48)
HOST_RATIOS = (0.5, 1, 2, 4)
BUDGETS = (8, 16, 32, 128)
BATCHES = (1, 2, 4, 8)
RETRACTIONS = ("off", "on", "forced")
GROUP = "full"
# a sliding-window group beside the full one (its window in tokens, not a multiple of the page size needed), in half
# the examples
WINDOW_GROUP = "swa"
WINDOWS = (None, None, 6, 24)
# a recurrent state group (``AttnKind.State``: two slots a request, the state read and the state written) beside the
# others, in half the examples
STATE_GROUP = "state"
# speculative decoding (EAGLE or MTP): the drafts each decode step carries, in a third of the examples
DRAFTS = (0, 0, 2)
# the assertion finding 20 fails (docs/findings.md)
KNOWN_CRASH = "the tail's parent page has its KV event hash"


def import_tokenspeed() -> types.ModuleType:
    """The wheel's module (an ImportError when it is not installed). Its log (spdlog) says warnings only, unless the
    user set ``SPDLOG_LEVEL``: at its default level it prints a line on every cache flush, thousands a minute."""
    import importlib
    import os

    os.environ.setdefault("SPDLOG_LEVEL", "warn")
    return importlib.import_module("tokenspeed_scheduler")


class Config(NamedTuple):
    """One configuration of the scheduler: a draw picks one value of each field from CHOICES."""

    page_size: int
    device_pages: int
    host_ratio: float
    storage: bool
    budget: int
    batch: int
    # preemption: "off"; "on" (a decoding request retracted when the pool runs short: its pages to the host and the
    # snapshot pool, restored later; budgets undeclared, so the pool can run short); "forced" (every third plan,
    # the scheduler's debug knob, budgets declared)
    retraction: str = "off"
    # prefill chunks and decode steps in one batch
    mixed: bool = False
    # overlap scheduling (depth 1): the next plan made before the last forward's results are reported
    overlap: bool = False
    # a sliding-window group (``AttnKind.SlidingWindow``, its window in tokens) beside the full one, drawing its pages
    # from the same device pool: its row's pages that left the window are the null page
    window: int | None = None
    # a recurrent state group (``AttnKind.State``, a linear-attention or Mamba layer's state), its slots from the same
    # device pool: a hit needs the state cached at its end
    state: bool = False
    # speculative decoding: each decode step carries the last token and ``drafts`` drafts (``decode_input_tokens``);
    # the executor's drafter guesses some right, and reports the accepted ones and the model's next token
    drafts: int = 0


# the values each field of Config is drawn from, in its order
CHOICES: tuple[tuple[object, ...], ...] = (
    PAGE_SIZES,
    DEVICE_PAGES,
    HOST_RATIOS,
    (False, True),
    BUDGETS,
    BATCHES,
    RETRACTIONS,
    (False, True),
    (False, True),
    WINDOWS,
    (False, True),
    DRAFTS,
)


def choose(draw: int) -> Config:
    return Config._make(choose_from(CHOICES, draw))


def draw_for(config: Config) -> int:
    """A draw that picks ``config``: tests name a configuration so."""
    return draw_choosing(CHOICES, config)


class CopyOp(Protocol):
    """What the adapter reads of a ``WriteBackOp`` or ``LoadBackOp``: per operation, its pages."""

    op_ids: Sequence[int]
    src_pages: Sequence[Sequence[int]]
    dst_pages: Sequence[Sequence[int]]


class RestoreOp(CopyOp, Protocol):
    """A ``RestoreOp`` also says, per page, the pool it restores from."""

    source_tiers: Sequence[Sequence[int]]


class StorageOp(Protocol):
    """What the adapter reads of a storage operation: its keys (group, content hash, page offset)."""

    op_id: int
    keys: Sequence[Sequence[Hashable]]


class TokenSpeedPlanner:
    """One TokenSpeed ``Scheduler`` in the configuration ``draw`` selects, behind the planner layer's protocol."""

    # finding 31 (below): tests turn overlap on beside a state group to see the law fail on it
    overlap_beside_state = False

    def __init__(self, draw: int) -> None:
        ts = self.ts = import_tokenspeed()
        chosen = choose(draw)
        self.page_size, device, ratio, self.storage, budget, batch, retraction, mixed, self.overlap = chosen[:9]
        self.window, self.state = chosen.window, chosen.state
        # drafts beside a state group would need a state per draft (the adapter runs a state per chunk): none there
        self.drafts = 0 if self.state else chosen.drafts
        if self.window is not None or self.state:
            # finding 29: with a window or a state group and retraction, TokenSpeed 0.1.42 aborts the process at a
            # restored request's finish ("cache mutation on a KV event boundary with no token descriptor",
            # scheduler.cpp:323). An abort ends a campaign's worker, which no profile can count: retraction stays off
            # beside such a group
            retraction = "off"
        if self.state and not self.overlap_beside_state:
            # finding 31: with overlap scheduling, a request's finish caches its state slot as a checkpoint while the
            # decode planned before the finish still updates that slot in place; a later hit reads a state one token
            # ahead. Every example with a state group would stop there: overlap stays off beside a state group
            self.overlap = False
        device += 1  # page 0 is the null page
        self.retraction = retraction
        host = max(2, int(device * ratio))
        config = ts.SchedulerConfig()
        config.prefix_granularity = self.page_size
        config.max_scheduled_tokens = budget
        config.max_batch_size = batch
        config.num_device_pages = device
        config.num_host_pages = host
        config.enable_mixed_prefill_decode = mixed
        config.overlap_schedule_depth = int(self.overlap)
        # one snapshot page: only the null one, no retraction
        config.num_snapshot_pages = device if retraction != "off" else 1
        config.max_retracted_requests = 2 if retraction != "off" else 0
        config.debug_force_retraction_interval = 3 if retraction == "forced" else 0
        config.enable_kv_cache_events = True
        config.decode_input_tokens = 1 + self.drafts
        config.cache_groups = [ts.CacheGroupConfig(GROUP, self.page_size, device, ts.AttnKind.Full)]
        if self.window is not None:
            window = ts.CacheGroupConfig(WINDOW_GROUP, self.page_size, device, ts.AttnKind.SlidingWindow, self.window)
            config.cache_groups = [*config.cache_groups, window]
        # a state read only at a chunk's start and written at its end (what the adapter executes: _plain_states)
        config.state_checkpoint_in_forward, config.prefix_replay_tokens = False, 0
        if self.state:  # a state group spans no tokens: its granularity is 0
            config.cache_groups = [*config.cache_groups, ts.CacheGroupConfig(STATE_GROUP, 0, device, ts.AttnKind.State)]
        if self.storage:
            config.enable_l3_storage = True
            high, low = ts.StoragePressure(8, 1 << 30, 10**7), ts.StoragePressure(2, 1 << 20, 10**6)
            # operations, keys per operation, host blocks on loan, metadata entries, prefetch tokens max / min,
            # wait and ready timeouts (us), pressure marks
            config.storage_config = ts.StorageConfig(4, 16, max(1, host // 2), 64, 64, 1, 10**6, 10**6, high, low)
        self.scheduler = ts.Scheduler(config)
        self.device_pages, self.host_pages = device, host
        # a request reserves its prompt and max(its budget, a decode step's tokens): at most its budget and the drafts
        self.max_request_tokens: int = self.scheduler.max_single_request_tokens() - self.drafts
        # finding 19 (docs/findings.md): a retracted and restored request goes on storing blocks under a parent its
        # events removed at the restore, or never stored; only retraction reaches it
        # finding 28: with a window group, a page that leaves the window in the pass that computes it is never
        # published, though the full group caches it and serves hits on it; the next page is stored under it. Its
        # hits then name pages the events never stored: the hit law is off under a window group
        # finding 30: with a state group, only the boundaries where a state is cached are published, each under
        # the previous page's hash, which never is: orphans, and hits on pages the events never stored
        known = (
            ["finding 19"] * (retraction != "off")
            + ["finding 28"] * (self.window is not None)
            + ["finding 30"] * self.state
        )
        self.orphans: str | None = " or ".join(known) or None
        self.publishes_hits, self.duplicates, self.resets_busy, self.host_cleared = (
            self.window is None and not self.state,
            False,
            False,
            True,
        )
        # finding 20: with retraction enabled, planning can fail an internal assertion (KNOWN_CRASH); the machine
        # counts it and goes on with a new scheduler. Tests turn it off to see the crash reported
        # (a state group reaches the same assertion without retraction: its publications end at state checkpoints,
        # inside pages)
        self.known_crashes = retraction != "off" or self.state
        self.config = (
            f"P={self.page_size}, device {device - 1}, host {host - 1}, storage {'on' if self.storage else 'off'},"
            f" budget {budget}, batch {batch}, retraction {retraction}{', mixed' if mixed else ''}"
            f"{', overlap' if self.overlap else ''}{f', window {self.window}' if self.window else ''}"
            f"{', state' if self.state else ''}{f', {self.drafts} drafts' if self.drafts else ''}"
        )
        self.now_us = 0
        # the plan's ops by our transfer, to report each done
        self.ops: dict[Hashable, object] = {}
        self.next_storage_op = 0

    # ------------------------------------------------------------ requests

    def submit(self, request: str, tokens: Sequence[int], max_new: int) -> None:
        spec = self.ts.RequestSpec()
        # with retraction "on" the budget is left undeclared (0), as a request without max_tokens: a declared one
        # is reserved whole at admission, and the pool then never runs short enough to retract
        declared = 0 if self.retraction == "on" else max_new
        spec.request_id, spec.tokens, spec.max_new_tokens = request, list(tokens), declared
        self.scheduler.submit_requests([spec])

    def _advance(self, event: object) -> None:
        self.scheduler.advance(self.ts.ExecutionEvent().add_event(event))

    def result(self, request: str, tokens: Sequence[int]) -> None:
        event = self.ts.ForwardEvent.ExtendResult()
        event.request_id, event.tokens = request, list(tokens)
        self._advance(event)

    def finish(self, request: str) -> None:
        event = self.ts.ForwardEvent.Finish()
        event.request_id = request
        self._advance(event)

    def abort(self, request: str) -> None:
        event = self.ts.ForwardEvent.Abort()
        event.request_id = request
        self._advance(event)

    def reset(self) -> bool:
        if not self.scheduler.can_clear_cache():
            return False
        cleared: bool = self.scheduler.clear_cache()
        return cleared

    # ------------------------------------------------------------ plans

    def plan(self) -> Plan:
        ts, scheduler = self.ts, self.scheduler
        if self.storage:
            self.now_us += 1000
            self._advance(ts.Cache.StorageTick(self.now_us, True, True, ts.StoragePressure(0, 0, 0)))
        try:
            plan = scheduler.next_execution_plan()
        except RuntimeError as crash:
            if self.known_crashes and KNOWN_CRASH in str(crash):
                raise KnownFinding("a scheduler assertion on a tail page's KV event hash (finding 20)") from crash
            raise
        transfers = tuple(transfer for op in plan.cache for transfer in self._transfers(op))
        passes: list[Pass] = []
        for batch in plan.forward:
            ids = list(batch.request_ids)
            if not ids:
                continue
            extends, rows = batch.num_extends(), batch.block_tables[GROUP]
            # the window group's rows: pages that left the window are the null page (not compacted)
            window_rows = batch.block_tables[WINDOW_GROUP] if self.window is not None else None
            state_rows = batch.block_tables[STATE_GROUP] if self.state else None
            self._plain_states(batch)
            inputs, at = list(batch.input_ids), 0
            for i, request in enumerate(ids):
                count = batch.input_lengths[i]
                windows = () if window_rows is None else ((tuple(window_rows[i]), cast(int, self.window)),)
                state = None if state_rows is None else (int(state_rows[i][0]), int(state_rows[i][1]))
                if i < extends:
                    start = batch.extend_prefix_lens[i]
                    chunk = tuple(inputs[at : at + count])
                    passes.append(Pass(request, start, count, chunk, tuple(rows[i]), True, windows, state))
                    at += count
                else:  # a decode step: its position is the request's last token's, which the machine knows
                    passes.append(Pass(request, -1, count, None, tuple(rows[i]), False, windows, state))
        # every group's copies and zeros: the groups share the device's page ids
        copies = tuple((int(src), int(dst)) for group in plan.pages_to_copy.values() for src, dst in group)
        zeroed = plan.pages_to_zero
        zeros = tuple(int(page) for group, pages in zeroed.items() if group != STATE_GROUP for page in pages)
        # a state slot zeroed is the initial state
        fresh = tuple(int(slot) for slot in zeroed.get(STATE_GROUP, ()))
        aborted = tuple(str(abort.request_id) for abort in plan.aborts)
        return Plan(transfers, copies, zeros, tuple(passes), aborted, fresh=fresh)

    def _plain_states(self, batch: object) -> None:
        """The adapter runs a state group's chunks whole: each state read at its chunk's start, written at its end.
        A checkpoint inside a chunk or tokens replayed before it (``state_checkpoint_in_forward``,
        ``prefix_replay_tokens``, both off here) it does not execute."""
        for name in ("extend_state_checkpoint_lens", "extend_replay_lens"):
            if any(getattr(batch, name)):
                raise NotImplementedError(f"a plan with {name} {list(getattr(batch, name))} (the adapter runs none)")

    def _transfers(self, planned: object) -> list[Transfer]:
        name = type(planned).__name__
        if name in ("WriteBackOp", "LoadBackOp"):
            copy = cast(CopyOp, planned)
            kind: Literal["backup", "load"] = "backup" if name == "WriteBackOp" else "load"
            # a backup's sources stay pinned until its report (the wheel says so per operation)
            pins: Sequence[bool] = getattr(planned, "source_pinned", [True] * len(copy.op_ids))
            found = []
            for i, op_id in enumerate(copy.op_ids):
                pinned = bool(pins[i])
                pages = tuple(zip(map(int, copy.src_pages[i]), map(int, copy.dst_pages[i]), strict=True))
                transfer = Transfer(("copy", int(op_id)), kind, pages, pinned)
                self.ops[transfer.op] = op_id
                found.append(transfer)
            return found
        if name in ("SnapshotOp", "RestoreOp"):
            return self._preemption(name, planned)
        if name == "StorageCancelOp":  # best effort: the operation still owes its StorageDone
            return []
        kinds: dict[str, Literal["query", "put", "get"]] = {
            "StorageQueryOp": "query",
            "StoragePutOp": "put",
            "StorageGetOp": "get",
        }
        if name not in kinds:
            raise IntegrityError(f"tokenspeed planned a {name}, which this adapter does not execute")
        op = cast(StorageOp, planned)
        keys: list[Hashable] = [tuple(key) for key in op.keys]
        blocks: list[Hashable] = [int(block) for block in getattr(op, "host_blocks", ())]
        pairs: tuple[tuple[Hashable, Hashable], ...]
        if name == "StorageQueryOp":
            pairs = tuple((key, key) for key in keys)
        elif name == "StoragePutOp":
            pairs = tuple(zip(blocks, keys, strict=True))
        else:
            pairs = tuple(zip(keys, blocks, strict=True))
        transfer = Transfer(("storage", int(op.op_id)), kinds[name], pairs)
        self.ops[transfer.op] = op.op_id
        return [transfer]

    def _preemption(self, name: str, planned: object) -> list[Transfer]:
        """A retraction's snapshot (device pages to the snapshot pool) or a restore (from the host pool or the
        snapshot pool back to the device), one transfer per operation."""
        copy = cast(CopyOp, planned)
        found = []
        for i, op_id in enumerate(copy.op_ids):
            pages = tuple(zip(map(int, copy.src_pages[i]), map(int, copy.dst_pages[i]), strict=True))
            if name == "SnapshotOp":
                transfer = Transfer(("snapshot", int(op_id)), "snapshot", pages, pinned=False)
            else:
                # per page, the pool it comes from: the host pool (L2) or the snapshot pool
                host_tiers = self.ts.Cache.HostTier
                named: dict[int, Tier] = {host_tiers.L2.value: "host", host_tiers.SnapshotPool.value: "snapshot"}
                tiers = [int(tier) for tier in cast(RestoreOp, planned).source_tiers[i]]
                if not set(tiers) <= set(named):
                    raise NotImplementedError(
                        f"a RestoreOp from the tiers {sorted(set(tiers))} (the adapter knows two)"
                    )
                sources = tuple(named[tier] for tier in tiers)
                transfer = Transfer(("restore", int(op_id)), "restore", pages, sources=sources)
            self.ops[transfer.op] = op_id
            found.append(transfer)
        return found

    def done(self, transfer: Transfer, ok: Sequence[bool]) -> None:
        ts, op_id = self.ts, self.ops.pop(transfer.op)
        if transfer.kind == "backup":
            event = ts.Cache.WriteBackDoneEvent()
            event.op_id = op_id
        elif transfer.kind == "load":
            event = ts.Cache.LoadBackDoneEvent(op_id)
        elif transfer.kind in ("snapshot", "restore"):
            event = ts.Cache.SnapshotDoneEvent() if transfer.kind == "snapshot" else ts.Cache.RestoreDoneEvent()
            event.op_id = op_id
        else:  # a storage operation: per key, whether it succeeded; retired (the executor is done with it)
            flags = [int(flag) for flag in ok]
            event = ts.Cache.StorageDone(op_id, flags, True, [0] * len(flags))
        self._advance(event)

    # ------------------------------------------------------------ what it shows

    def take_events(self) -> list[BlockEvent]:
        events = []
        for event in self.scheduler.drain_kv_events():
            if event.kind == "BlockStored":
                parent, tokens = event.parent_block_hash, tuple(event.token_ids)
                events += [BlockEvent("stored", h, parent, tokens) for h in event.block_hashes]
            elif event.kind == "BlockRemoved":
                events += [BlockEvent("removed", h) for h in event.block_hashes]
            else:
                events.append(BlockEvent("cleared"))
        return events

    def check_integrity(self, quiescent: bool) -> None:
        scheduler = self.scheduler
        usable = self.device_pages - 1
        held = scheduler.available_lcm_blocks() + scheduler.active_lcm_blocks()
        if held > usable:
            raise IntegrityError(
                f"tokenspeed_pool_conserved: {scheduler.available_lcm_blocks()} available + "
                f"{scheduler.active_lcm_blocks()} active device pages exceed the pool's {usable}"
            )
        if not quiescent:
            return
        busy = {
            "active device pages": scheduler.active_lcm_blocks(),
            "pinned host blocks": scheduler.host_pool_pinned_blocks(),
            "storage operations pending": int(scheduler.storage_pending()),
            "requests live": scheduler.waiting_size() + scheduler.prefilling_size() + scheduler.decoding_size(),
        }
        left = {what: n for what, n in busy.items() if n}
        if left or not scheduler.can_clear_cache():
            raise IntegrityError(
                f"tokenspeed_quiescent_holds_nothing: with no request live and no transfer in flight it holds {left}"
                f" (can_clear_cache {scheduler.can_clear_cache()})"
            )

    def reach(self) -> Mapping[str, int]:
        scheduler = self.scheduler
        return {
            "device pages in use": self.device_pages - 1 - scheduler.empty_lcm_blocks(),
            "host blocks cached": scheduler.host_pool_cached_blocks(),
            "storage blocks held": scheduler.storage_held_blocks(),
        }


PROFILE = Profile(
    name="tokenspeed (a scheduler that plans its own batches and transfers)",
    notes=(
        "it chooses its hits, evictions, backups and batches itself: the machine checks what it serves (every"
        " attended position holds the request's KV, across tiers), not which choice it made",
        "with retraction on, its KV events may store a block under a parent they removed at a restore or never"
        " stored (finding 19, a bug): the machine counts those and checks every other event",
        "with retraction on, planning may fail its assertion on a tail page's KV event hash (finding 20, a bug):"
        " the machine counts it and goes on with a new scheduler in the same configuration",
        "with a window group, a page that leaves the window in the pass that computes it is never published, and"
        " the next is stored under it (finding 28, a bug): counted; the hit law is off in those examples",
        "with a state group, only the boundaries where a state is cached are published, each under a parent never"
        " stored (finding 30, a bug): counted; the hit law is off in those examples",
        "with a window or a state group, retraction is off (finding 29: TokenSpeed aborts the process); with a state"
        " group, overlap is off (finding 31: a finished request's cached state is updated by its last decode)",
    ),
)

TARGET = TargetInfo(
    name="tokenspeed",
    description=f"TokenSpeed's scheduler {VERSION}: device, host and storage tiers, its own plans",
    requires=(("tokenspeed_scheduler", "radixspec targets install tokenspeed  (pip install tokenspeed-scheduler)"),),
    planner_factory=TokenSpeedPlanner,
    profile=PROFILE,
    how="the planner machine: its plans executed (transfers late, reordered, storage failed), the forward checked",
    probe=import_tokenspeed,
)
