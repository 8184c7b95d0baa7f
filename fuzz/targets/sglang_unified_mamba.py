"""Target ``sglang-mamba``: SGLang 0.5.23's ``UnifiedRadixCache`` with its FULL and MAMBA components (a hybrid
linear-attention model: per-token KV for the attention layers, one recurrent state per cached prefix), driven
through the ``sglang`` target's lifecycle (``sglang_unified.py``). ``sglang-mamba`` runs the Rust tree core,
``sglang-mamba:python`` the Python core, ``sglang-mamba:both`` the two on the same program.

What is real: the cache, both components, the paged KV allocator and SGLang's ``MambaSlotAllocator``. What
stands in: the state tensors (a state slot records which prefix its state is of: the shadow) and the
request-to-token table with its state slots (``HybridReqToTokenPool``'s part the cache calls, written from
SGLang's code). Drawn per configuration: the page size (1 to 8), the mode (SGLang's extra buffer, which ``auto``
picks with the overlap scheduler or pages above 1, with one or two tracking slots, or at page size 1 no buffer:
a state exists for exactly the tokens computed so far), the eviction policy, ``mamba_max_states_per_path``
(unlimited, or 2: the shallowest states on a path are dropped), the state pool's size, and in half the
configurations an SWA component beside (FULL + SWA + MAMBA: the ``sglang-swa`` target's window lifecycle and
checks too). The MAMBA component is ``RecurrentState``, which the lifecycle of ``sglang_unified.py`` calls
where a state changes what it does.

The lifecycle's state part, from SGLang's code: the match copies the matched node's state into a slot of the
request's own (``cow_mamba``: the scheduler copies it on the forward stream); a request with no state hit gets
a cleared slot (``HybridReqToTokenPool.alloc``); each chunk advances the request's state; a checkpoint copies
it into a new slot the tree keeps; a finished request donates its slot to the tree, or frees it
(``on_release``). The scheduler admits a request only with a state slot free, evicting a cached state if it
must, and the same before a checkpoint. With the extra buffer (``ExtraBuffer``) a request also holds tracking
slots: a prefill chunk at least a grid long snapshots its state at the chunk's start plus whole grids (or at
the match's branch point), a decode step when the sequence reaches the track grid; a checkpoint donates the
latest snapshot's slot to the tree and takes a fresh one; a finished request gives the tree its latest
snapshot and frees the rest. A chunk that does not finish the prompt ends on a page.

Checks beside the ``sglang`` target's: the hit is the hit rule's longest valid match with a state group (full
KV for every token before it, a cached state for exactly that prefix); the state a match copies is that of the
hit prefix; every request's state is that of the tokens it computed; the state slots' conservation (free +
cached + held by requests = pool); with the buffer, the latest snapshot is the state of the length the
request records for it.
"""

from __future__ import annotations

import functools
import importlib
import math
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hybrid as hy
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import OutOfPagesError

from ..lifecycle import Pool, StateShadow
from ..stats import STATS
from .api import TargetError, TargetInfo, mix
from .sglang import VERSION
from .sglang_modules import PAGE_SIZES, engine_modules, import_unified_cache
from .sglang_unified import (
    CORES,
    POLICIES,
    ROW_TOKENS,
    ROWS,
    BothCores,
    Record,
    RequestTable,
    SGLangUnifiedManager,
    SlidingWindow,
    unified_profile,
)
from .shims import install

if TYPE_CHECKING:
    import torch

PROFILE = unified_profile(
    "FULL + MAMBA",
    hit="the deepest node on the path that holds a state; with a window beside (drawn), as sglang-swa",
    state="the matched state is copied into the request's own slot (copy on match); states are cached at each"
    " checkpoint and at the finish; mamba_max_states_per_path drops shallow ones; the extra buffer snapshots"
    " on a grid from each chunk's start and every track interval of decode, donated at checkpoints (pages 1"
    " to 8); no buffer at page size 1",
)

# a prefix a state is of: (namespace, its tokens)
StateOf = tuple[Namespace, tuple[int, ...]]


class StatePool:
    """The Mamba state tensors, as what each slot's state is of (``MambaPool.copy_from`` copies it)."""

    replayssm_write_pos = None
    replayssm_spec_write_pos = None

    def __init__(self) -> None:
        self.shadow = StateShadow()

    def copy_from(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for source, target in zip(src.view(-1).tolist(), dst.view(-1).tolist(), strict=True):
            self.shadow.copy(int(source), int(target))


class SlotAllocator(Protocol):
    """What this adapter calls of SGLang's ``MambaSlotAllocator``."""

    free_slots: torch.Tensor

    def alloc(self, need_size: int) -> torch.Tensor | None: ...
    def available_size(self) -> int: ...
    def clear(self) -> None: ...


class StateRows(Protocol):
    """What this adapter calls of the request-to-token table with state slots (``state_table``)."""

    mamba_allocator: SlotAllocator
    mamba_pool: StatePool

    def alloc_tracking_slots(self, req: Record) -> None: ...
    def get_mamba_ping_pong_other_idx(self, index: int) -> int: ...


def state_table(base: type) -> type:
    """The request-to-token table with state slots, a subclass of SGLang's ``HybridReqToTokenPool`` name (the
    MAMBA component checks it). Its module holds the state tensors and does not load on a CPU, so the methods
    the component calls are written here from SGLang's: the extra buffer's tracking slots taken, donated to the
    tree (replaced by a fresh slot) and freed with the request (but the one the tree took)."""

    @dataclass
    class StateTable(RequestTable, base):  # type: ignore[misc,valid-type]
        mamba_allocator: Any = None
        mamba_pool: StatePool = field(default_factory=StatePool)
        enable_mamba_extra_buffer: bool = False
        enable_mamba_extra_buffer_lazy: bool = False
        # the extra buffer: tracking slots per request (2 with the overlap scheduler), all taken at admission
        mamba_ping_pong_track_buffer_size: int = 0
        mamba_initial_tracking_slots: int = 0
        req_index_to_mamba_ping_pong_track_buffer_mapping: Any = None
        # HiCache's layer counter (the state copies on match wait on it in SGLang; here the forward's wait)
        layer_transfer_counter: object = None

        def register_layer_transfer_counter(self, counter: object) -> None:
            self.layer_transfer_counter = counter

        def translate_mamba_indices(self, indices: torch.Tensor) -> torch.Tensor:
            return indices

        def get_mamba_ping_pong_other_idx(self, index: int) -> int:
            return 1 - index if self.mamba_ping_pong_track_buffer_size == 2 else index

        def get_mamba_ping_pong_keep_idx(self, req: Record) -> int:
            """The tracking slot holding the latest snapshot."""
            return cast(int, req.kv.mamba_last_track_idx)

        def alloc_tracking_slots(self, req: Record) -> None:
            """``_alloc_ping_pong_buffer``: all the tracking slots at once (not the lazy mode)."""
            n = self.mamba_initial_tracking_slots
            slots = self.mamba_allocator.alloc(n)
            assert slots is not None, "Not enough space for mamba ping pong idx"
            req.kv.mamba_ping_pong_track_buffer = slots.clone()
            req.kv.mamba_ping_pong_empty = [False] * n
            req.kv.mamba_prev_track_seqlen = None
            req.kv.mamba_next_track_idx = 0
            req.kv.mamba_last_track_idx = self.get_mamba_ping_pong_other_idx(0)
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[req.kv.req_pool_idx] = slots

        def donate_mamba_ping_pong_slot(self, req: Record, new_slot: torch.Tensor) -> torch.Tensor:
            """The latest snapshot's slot goes to the tree; a fresh one takes its place."""
            keep = self.get_mamba_ping_pong_keep_idx(req)
            donated = req.kv.tracking_slots()[keep].unsqueeze(-1).clone()
            req.kv.tracking_slots()[keep] = new_slot[0]
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[req.kv.req_pool_idx] = (
                req.kv.mamba_ping_pong_track_buffer
            )
            return donated

        def free_mamba_cache(self, req: Record, mamba_ping_pong_track_buffer_to_keep: int | None = None) -> None:
            """The request's state slot, and its tracking slots but the one kept (the tree took it)."""
            assert req.kv.mamba_pool_idx is not None, "double free? mamba_index is None"
            self.mamba_allocator.free(req.kv.mamba_pool_idx.view(1))
            req.kv.mamba_pool_idx = None
            if self.enable_mamba_extra_buffer:
                keep, empty = mamba_ping_pong_track_buffer_to_keep, req.kv.mamba_ping_pong_empty or []
                row = req.kv.tracking_slots()
                for position in range(self.mamba_ping_pong_track_buffer_size):
                    if position != keep and not empty[position]:
                        self.mamba_allocator.free(row[position : position + 1])
                req.kv.mamba_ping_pong_track_buffer = req.kv.mamba_ping_pong_empty = None
                req.kv.mamba_next_track_idx = req.kv.mamba_last_track_idx = None
                req.kv.mamba_last_track_seqlen = req.kv.mamba_prev_track_seqlen = None
                req.kv.mamba_cow_src_index = None

    return StateTable


@functools.cache
def import_mamba_cache() -> types.ModuleType:
    """The unified cache's modules, with the run-time settings the MAMBA component reads set for a CPU run (once
    a process)."""
    v = import_unified_cache()
    pools = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    install(
        v,
        mamba=importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba"),
        slots=importlib.import_module("sglang.srt.mem_cache.allocator.mamba"),
        table=state_table(pools.HybridReqToTokenPool),
    )
    return v


@dataclass(frozen=True)
class ExtraBuffer:
    """SGLang's extra buffer (``--mamba-radix-cache-strategy extra_buffer``, what ``auto`` picks with the overlap
    scheduler or pages above 1): the kernel snapshots a request's state on a grid into its tracking slots, and
    a checkpoint donates the latest snapshot to the tree."""

    # tracking slots per request: 2 with the overlap scheduler (ping-pong), else 1
    tracking_slots: int
    # the model's chunk (the kernel's grid; SGLang's FLA default is 64: small here, so that grids are reached)
    model_chunk: int
    # mamba_track_interval: a decoding request is snapshot every this many tokens (a multiple of the page)
    interval: int

    def cache_chunk(self, page: int) -> int:
        """``mamba_cache_chunk_size``: the model's chunk, at least a page."""
        return max(self.model_chunk, page)

    def grid(self, page: int) -> int:
        """``mamba_checkpoint_grid``: where a prefill snapshot lands, from the chunk's start."""
        return math.lcm(self.cache_chunk(page), page)

    def track_grid(self, page: int) -> int:
        """``mamba_track_grid``: where a decode snapshot lands."""
        return math.lcm(self.grid(page), self.interval)


class RecurrentState:
    """SGLang's MAMBA component as a manager combines it (``StateComponent``): the state slots (``states``, and
    ``mamba_max_states_per_path``), the extra buffer or none, and the prefixes of the states the tree held at the
    last match. One per manager (per tree core)."""

    # state slots a request is admitted with beyond its own and its tracking slots
    spare = 0

    def __init__(self, states: int, max_states_per_path: int, buffer: ExtraBuffer | None = None) -> None:
        self.states, self.max_states_per_path, self.buffer = states, max_states_per_path, buffer
        self.tree_states: set[StateOf] = set()

    def configure(self, core: str, page_size: int) -> None:
        """The settings SGLang's server publishes, read by the component and the Rust core's adapter; without the
        extra buffer (page size 1) the chunk is the FLA chunk size SGLang falls back to."""
        settings = types.SimpleNamespace(
            mamba=types.SimpleNamespace(
                mamba_max_states_per_path=self.max_states_per_path, enable_mamba_extra_buffer_lazy=False
            )
        )
        chunk = 64 if self.buffer is None else self.buffer.cache_chunk(page_size)
        mamba: Any = import_mamba_cache().mamba
        mamba.get_exec = lambda: settings
        mamba.mamba_cache_chunk_size = lambda: chunk
        mamba.mamba_checkpoint_grid = lambda page: math.lcm(chunk, page)
        if core == "rust":
            adapter: Any = importlib.import_module("sglang.srt.mem_cache.rust_tree_core.adapter")
            adapter.get_exec, adapter.mamba_cache_chunk_size = (lambda: settings), mamba.mamba_cache_chunk_size

    def table(self, m: SGLangUnifiedManager) -> RequestTable:
        torch = m.torch
        table: Any = m.v.table(torch.zeros((ROWS, ROW_TOKENS), dtype=torch.int64), list(range(ROWS)))
        table.mamba_allocator = m.v.slots.MambaSlotAllocator(self.states, "cpu")
        table.mamba_pool.shadow = StateShadow()
        if self.buffer is not None:
            table.enable_mamba_extra_buffer = True
            n = self.buffer.tracking_slots
            table.mamba_ping_pong_track_buffer_size = table.mamba_initial_tracking_slots = n
            table.req_index_to_mamba_ping_pong_track_buffer_mapping = torch.zeros((ROWS, n), dtype=torch.int64)
        return cast(RequestTable, table)

    def components(self, m: SGLangUnifiedManager) -> dict[str, object]:
        """MAMBA after the KV components, with or without its extra buffer."""
        kv = m.components_of_kv()
        return {"tree_components": (*kv, m.v.components.MAMBA), "enable_mamba_extra_buffer": self.buffer is not None}

    # ------------------------------------------------------------ reading SGLang's state

    @staticmethod
    def rows(m: SGLangUnifiedManager) -> StateRows:
        """The manager's request-to-token table, which ``table`` made with state slots."""
        return cast(StateRows, m.table)

    def state_pool(self, m: SGLangUnifiedManager) -> StatePool:
        return self.rows(m).mamba_pool

    def slots(self, m: SGLangUnifiedManager) -> SlotAllocator:
        return self.rows(m).mamba_allocator

    def request_slots(self, m: SGLangUnifiedManager) -> set[int]:
        """The state slots the live requests hold: each its own state, and with the extra buffer its tracking
        slots."""
        held: set[int] = set()
        for r in m.records.values():
            if r.kv.mamba_pool_idx is not None:
                held.add(int(r.kv.mamba_pool_idx))
            if r.kv.mamba_ping_pong_track_buffer is not None:
                empty = r.kv.mamba_ping_pong_empty or []
                buffer = r.kv.mamba_ping_pong_track_buffer.tolist()
                held.update(int(s) for s, e in zip(buffer, empty, strict=True) if not e)
        return held

    def tree_slots(self, m: SGLangUnifiedManager) -> set[int]:
        """The state slots the tree holds: neither free nor a request's."""
        free = {int(s) for s in self.slots(m).free_slots.tolist()}
        return set(range(1, self.states + 1)) - free - self.request_slots(m)

    def make_room(self, m: SGLangUnifiedManager, needed: int = 1) -> bool:
        """``needed`` free state slots, evicting cached states if there are fewer (the scheduler's check)."""
        short = needed - self.slots(m).available_size()
        if short > 0:
            STATS.record_rule("sglang-mamba.evict_state")
            m.cache.evict_for_alloc(m.v.base.EvictParams(num_tokens=0, mamba_num=short))
        return bool(self.slots(m).available_size() >= needed)

    def column(self, m: SGLangUnifiedManager, record: Record, pages: int) -> list[int | None]:
        """The state group's row: the request's state slot at the page of its last computed token."""
        state: list[int | None] = [None] * pages
        if record.extend_end and record.kv.mamba_pool_idx is not None:
            state[(record.extend_end - 1) // m.page_size] = record.kv.state_slot()
        return state

    # ------------------------------------------------------------ the state's lifecycle

    def admit(self, m: SGLangUnifiedManager, req: HybridReq) -> None:
        """Admitted only with a state slot free, and the extra buffer's tracking slots (nothing changes when
        they cannot be made); ``spare`` more for a state loaded back (HiCache)."""
        if not self.make_room(m, 1 + self.spare + (0 if self.buffer is None else self.buffer.tracking_slots)):
            STATS.record_rule("sglang-mamba.match[no state slot: not admitted]")
            raise OutOfPagesError(f"request {req.uid}: no free state slot")

    def match_params(self, m: SGLangUnifiedManager, key: object, record: Record) -> object:
        shadow = self.state_pool(m).shadow
        self.tree_states = {s for slot in self.tree_slots(m) if (s := shadow.get(slot)) is not None}
        return m.v.base.MatchPrefixParams(key=key, req=record, cow_mamba=True)

    def has_state(self, req: HybridReq, end: int) -> bool:
        """The tree held, before the match, a state of exactly the prompt's first ``end`` tokens."""
        return (req.namespace, tuple(req.input_ids[:end])) in self.tree_states

    def adopt(self, m: SGLangUnifiedManager, req: HybridReq, record: Record, hit: int) -> None:
        """The request's state after the match: the hit's, copied (checked); a cleared one (the state of no tokens)
        when nothing was copied and it holds no slot; else (a load back took its slot) what the load writes."""
        tokens, shadow = req.input_ids[:-1], self.state_pool(m).shadow
        source = record.kv.mamba_cow_src_index
        if source is not None:
            # the scheduler's copy on the forward stream (copy on match)
            who = f"request {req.uid}'s copy of its hit of {hit} tokens"
            shadow.expect("the_copied_state_is_the_hits", who, int(source), req.namespace, tuple(tokens[:hit]))
            STATS.record_rule("sglang-mamba.copy_on_match")
            record.kv.mamba_cow_src_index = None
            shadow.write(record.kv.state_slot(), req.namespace, tuple(tokens[:hit]))
        elif not record.kv.holds_mamba:
            # HybridReqToTokenPool.alloc: a cleared state for a request with no state hit
            slot = self.slots(m).alloc(1)
            assert slot is not None, "make_room left a slot"
            record.kv.mamba_pool_idx = slot[0]
            shadow.write(record.kv.state_slot(), req.namespace, ())
        if self.buffer is not None:
            # HybridReqToTokenPool.alloc: the tracking slots, nothing written in them yet
            self.rows(m).alloc_tracking_slots(record)
            for slot in record.kv.tracking_slots().tolist():
                shadow.clear(int(slot))

    def chunk_end(self, m: SGLangUnifiedManager, req: HybridReq, length: int) -> int:
        """With pages above 1, a chunk that does not finish the prompt ends on a page (SGLang's PrefillAdder
        leaves exact chunk fill off for a Mamba cache: its checkpoints land on page-aligned chunk ends)."""
        if m.page_size == 1 or length >= len(m.records[req.uid].origin_input_ids):
            return length
        end = length // m.page_size * m.page_size
        if end <= req.computed:
            STATS.record_rule("sglang-mamba.chunk[inside a page: not cut]")
            raise OutOfPagesError(f"request {req.uid}: a chunk to {length} ends inside a page; SGLang cuts on pages")
        return end

    def stored(self, m: SGLangUnifiedManager, req: HybridReq, record: Record, begin: int) -> None:
        """The request's state is that of what it computed; the extra buffer's snapshot of the forward. The
        forward read the state it advanced: that of what the request had computed (with HiCache, what a load back
        wrote, landed before the forward)."""
        shadow = self.state_pool(m).shadow
        who, before = f"request {req.uid}'s forward from {begin}", tuple(req.input_ids[:begin])
        shadow.expect("the_requests_state_is_its_own", who, record.kv.state_slot(), req.namespace, before)
        shadow.write(record.kv.state_slot(), req.namespace, tuple(req.input_ids[: req.computed]))
        if self.buffer is not None:
            self.track(m, req, record, begin, req.computed)
        req.rows = m.page_rows(record, record.kv.kv_allocated_len)

    def track(self, m: SGLangUnifiedManager, req: HybridReq, record: Record, begin: int, end: int) -> None:
        """The extra buffer's snapshot of the forward that computed ``[begin, end)``, and the scheduler's
        bookkeeping of it, written from SGLang's code: a prefill chunk at least a grid long snapshots the state
        at the chunk's start plus whole grids, or at the match's branch point when it lies in the chunk on the
        chunk grid (``ScheduleBatch``'s track entry); a decode step snapshots when the sequence reaches the
        track grid (``BatchResultProcessor``). The snapshot goes to the next tracking slot, which becomes the
        latest, and the next one is the other."""
        kv, buffer, page = record.kv, cast(ExtraBuffer, self.buffer), m.page_size
        if begin >= len(record.origin_input_ids):
            if end % buffer.track_grid(page):
                return
            STATS.record_rule("sglang-mamba.track[decode]")
            kv.mamba_prev_track_seqlen, length = kv.mamba_last_track_seqlen, end
        else:
            grid, extend = buffer.grid(page), end - begin
            if extend < grid:
                return
            length = begin + extend // grid * grid
            # the position the kernel is asked for: the chunk's end, or one past a snapshot inside it
            asked = end if begin + extend // buffer.model_chunk * buffer.model_chunk == length else length + 1
            branch = record.mamba_branching_seqlen
            if branch is not None and begin < branch < asked and (branch - begin) % buffer.cache_chunk(page) == 0:
                STATS.record_rule("sglang-mamba.track[prefill, branch point]")
                length = branch
            else:
                STATS.record_rule("sglang-mamba.track[prefill]")
        position = kv.mamba_next_track_idx
        assert position is not None, f"request {req.uid}: tracking slots taken at the match name the next one"
        kv.mamba_last_track_idx, kv.mamba_last_track_seqlen = position, length
        kv.mamba_next_track_idx = self.rows(m).get_mamba_ping_pong_other_idx(position)
        snapshot = int(kv.tracking_slots()[position])
        self.state_pool(m).shadow.write(snapshot, req.namespace, tuple(req.input_ids[:length]))

    # ------------------------------------------------------------ universal checks

    def check(self, m: SGLangUnifiedManager, req: HybridReq, record: Record) -> None:
        """The request's state slot holds the state of its computed tokens; its latest snapshot, of its length."""
        shadow, who = self.state_pool(m).shadow, f"request {req.uid}"
        slot, computed = record.kv.state_slot(), tuple(req.input_ids[: req.computed])
        shadow.expect("the_requests_state_is_its_own", who, slot, req.namespace, computed)
        length = record.kv.mamba_last_track_seqlen
        if self.buffer is not None and length is not None:
            slot = int(record.kv.tracking_slots()[record.kv.mamba_last_track_idx])
            who = f"request {req.uid}'s latest snapshot (tracked length {length})"
            shadow.expect("the_latest_snapshot_is_of_its_length", who, slot, req.namespace, computed[:length])

    def clear(self, m: SGLangUnifiedManager) -> None:
        self.slots(m).clear()

    def pool(self, m: SGLangUnifiedManager, live_reqs: list[HybridReq]) -> Pool:
        cached = int(m.cache.mamba_evictable_size() + m.cache.mamba_protected_size())
        held = len(self.request_slots(m))
        return Pool("state", self.slots(m).available_size(), cached, held, self.states)


def mamba_manager(
    num_pages: int,
    core: str,
    policy: str,
    states: int,
    max_states_per_path: int,
    page_size: int = 1,
    buffer: ExtraBuffer | None = None,
    eagle: bool = False,
    window: int | None = None,
) -> SGLangUnifiedManager:
    """SGLang's unified cache with FULL and MAMBA on one tree core; with ``window``, FULL + SWA + MAMBA (a model
    with sliding-window and linear-attention layers; SWA slots freed out of the window at checkpoints: SGLang's
    default)."""
    swa = None if window is None else SlidingWindow.sized(window, num_pages, True)
    mamba = RecurrentState(states, max_states_per_path, buffer)
    return SGLangUnifiedManager(page_size, num_pages, core, policy, eagle, swa=swa, mamba=mamba, profile=PROFILE)


def drawn_state(page_size: int, num_pages: int) -> tuple[tuple[int, int, ExtraBuffer | None], str]:
    """The MAMBA component a configuration draws: its state slots, ``mamba_max_states_per_path`` and its extra
    buffer (``RecurrentState``'s arguments), and how the summary names them."""
    per_path = 2 if (num_pages // len(POLICIES)) % 2 else -1
    # the extra buffer: always with pages above 1; at page size 1 in two thirds (the overlap scheduler's
    # default), else no buffer (SGLang's choice with the overlap scheduler off)
    bits, buffer = mix(num_pages), None
    if page_size > 1 or bits % 3:
        buffer = ExtraBuffer(1 + (bits >> 4) % 2, 1 << (bits >> 6) % 3, page_size * (1 + (bits >> 9) % 2))
    # state slots: a request holds its own and, with the buffer, its tracking slots
    states = (4 + num_pages // 4) * (1 + (0 if buffer is None else buffer.tracking_slots))
    mode = "no buffer" if buffer is None else f"extra buffer x{buffer.tracking_slots}"
    return (states, per_path, buffer), f"{mode},states per path {per_path}"


def target(argument: str | None) -> TargetInfo:
    """``sglang-mamba`` (Rust core), ``sglang-mamba:python``, ``sglang-mamba:both``."""
    if argument not in CORES:
        raise TargetError(f"sglang-mamba takes rust, python or both, got {argument!r}")
    cores = CORES[argument]

    def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> SGLangUnifiedManager | BothCores:
        policy = POLICIES[num_pages % len(POLICIES)]
        # FULL + SWA + MAMBA in half the configurations, with the drawn window
        window = max(2, next((w for w in windows if isinstance(w, int)), 4)) if (num_pages // 4) % 2 else None
        (states, per_path, buffer), drawn = drawn_state(page_size, num_pages)
        swa = "" if window is None else f",SWA W={'<=8' if window <= 8 else '>8'}"
        # the server runs EAGLE (MTP) in half: SGLang keeps raw keys with a MAMBA component, so the cache is
        # the same (what EAGLE changes is the scheduler's speculative tracking, not driven)
        eagle = bool((mix(num_pages) >> 11) % 2)
        STATS.record_rule(f"sglang-mamba.config[P={page_size},{drawn},{policy}{swa}{',eagle' * eagle}]")
        managers = [
            mamba_manager(2 * num_pages, core, policy, states, per_path, page_size, buffer, eagle, window)
            for core in cores
        ]
        return managers[0] if len(managers) == 1 else BothCores(managers)

    return TargetInfo(
        name="sglang-mamba" if argument is None else f"sglang-mamba:{argument}",
        description=f"SGLang {VERSION} UnifiedRadixCache FULL + MAMBA, {' and '.join(cores)} tree core, extra buffer",
        requires=(("sglang", f"radixspec targets install sglang  (pip install --no-deps sglang=={VERSION})"),),
        hybrid_factory=factory,
        profile=PROFILE,
        page_sizes=PAGE_SIZES,
        how="the hybrid machine: requests as SGLang's scheduler drives them; the hit, the states, the pools",
        probe=import_mamba_cache,
        engine_modules=engine_modules(cores, "swa", "mamba"),
    )
