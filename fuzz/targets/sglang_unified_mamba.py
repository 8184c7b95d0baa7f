"""Target ``sglang-mamba``: SGLang 0.5.23's ``UnifiedRadixCache`` with its FULL and MAMBA components (a hybrid
linear-attention model: per-token KV for the attention layers, one recurrent state per cached prefix), driven
through the ``sglang`` target's lifecycle (``sglang_unified.py``). ``sglang-mamba`` runs the Rust tree core,
``sglang-mamba:python`` the Python core, ``sglang-mamba:both`` the two on the same program.

What is real: the cache, both components, the paged KV allocator and SGLang's ``MambaSlotAllocator``. What
stands in: the state tensors (a state slot records which prefix its state is of: the shadow) and the
request-to-token table with its state slots (``HybridReqToTokenPool``'s part the cache calls). The mode is
SGLang's without the extra buffer (page size 1: a state exists for exactly the tokens computed so far).
Drawn per configuration: the eviction policy, ``mamba_max_states_per_path`` (unlimited, or 2: the shallowest
states on a path are dropped), the state pool's size, and in half the configurations an SWA component beside
(FULL + SWA + MAMBA, ``SGLangSWAMambaManager``: the ``sglang-swa`` target's window lifecycle and checks too).

The lifecycle's state part, from SGLang's code: the match copies the matched node's state into a slot of the
request's own (``cow_mamba``: the scheduler copies it on the forward stream); a request with no state hit gets
a cleared slot (``HybridReqToTokenPool.alloc``); each chunk advances the request's state; a checkpoint copies
it into a new slot the tree keeps; a finished request donates its slot to the tree, or frees it
(``on_release``). The scheduler admits a request only with a state slot free, evicting a cached state if it
must, and the same before a checkpoint.

Checks beside the ``sglang`` target's: the hit is the hit rule's longest valid match with a state group (full
KV for every token before it, a cached state for exactly that prefix); the state a match copies is that of the
hit prefix; every request's state is that of the tokens it computed; the state slots' conservation (free +
cached + held by requests = pool).
"""

from __future__ import annotations

import importlib
import math
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError, OutOfPagesError

from ..stats import STATS
from .api import TargetError, TargetInfo
from .sglang import VERSION
from .sglang_swa import import_swa_cache
from .sglang_unified import (
    CORES,
    POLICIES,
    ROW_TOKENS,
    ROWS,
    BothCores,
    Record,
    RequestTable,
    SGLangUnifiedManager,
    Written,
    unified_profile,
)
from .sglang_unified_swa import SGLangSWAUnifiedManager
from .shims import install

if TYPE_CHECKING:
    import torch

PROFILE = unified_profile(
    "FULL + MAMBA",
    "state_match: the deepest node on the path that holds a state",
    "state_copy: the matched state is copied into the request's own slot (copy on match)",
    "state_checkpoints: at each checkpoint and at the finish; mamba_max_states_per_path drops shallow ones",
    "page size 1 (no extra buffer)",
)

# a prefix a state is of: (namespace, its tokens)
StateOf = Written


class StatePool:
    """The Mamba state tensors, as what each slot's state is of (``MambaPool.copy_from`` copies it)."""

    replayssm_write_pos = None
    replayssm_spec_write_pos = None

    def __init__(self) -> None:
        self.states: dict[int, StateOf | None] = {}

    def copy_from(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for source, target in zip(src.view(-1).tolist(), dst.view(-1).tolist(), strict=True):
            self.states[int(target)] = self.states.get(int(source))


def state_table(base: type) -> type:
    """The request-to-token table with state slots, a subclass of SGLang's ``HybridReqToTokenPool`` name
    (the MAMBA component checks it)."""

    @dataclass
    class StateTable(RequestTable, base):  # type: ignore[misc,valid-type]
        mamba_allocator: Any = None
        mamba_pool: StatePool = field(default_factory=StatePool)
        enable_mamba_extra_buffer: bool = False

        def translate_mamba_indices(self, indices: torch.Tensor) -> torch.Tensor:
            return indices

        def free_mamba_cache(self, req: Record, mamba_ping_pong_track_buffer_to_keep: int | None = None) -> None:
            assert req.kv.mamba_pool_idx is not None, "double free? mamba_index is None"
            self.mamba_allocator.free(req.kv.mamba_pool_idx.view(1))
            req.kv.mamba_pool_idx = None

    return StateTable


def import_mamba_cache() -> types.ModuleType:
    """The unified cache's modules, with the run-time settings the MAMBA component reads set for a CPU run."""
    v = import_swa_cache()
    if not hasattr(v, "mamba"):
        mamba: Any = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")
        # no extra buffer, page size 1: the state grid is the FLA chunk size SGLang falls back to
        chunk = 64
        mamba.mamba_cache_chunk_size = lambda: chunk
        mamba.mamba_checkpoint_grid = lambda page: math.lcm(chunk, page)
        pools: Any = importlib.import_module("sglang.srt.mem_cache.memory_pool")
        install(
            v,
            mamba=mamba,
            slots=importlib.import_module("sglang.srt.mem_cache.allocator.mamba"),
            table=state_table(pools.HybridReqToTokenPool),
        )
    return v


class SGLangMambaUnifiedManager(SGLangUnifiedManager):
    """SGLang's unified cache with FULL and MAMBA, on one tree core."""

    profile = PROFILE

    def __init__(self, num_pages: int, core: str, policy: str, states: int, max_states_per_path: int) -> None:
        self.states, self.max_states_per_path = states, max_states_per_path
        settings = types.SimpleNamespace(
            mamba=types.SimpleNamespace(
                mamba_max_states_per_path=max_states_per_path, enable_mamba_extra_buffer_lazy=False
            )
        )
        # the settings SGLang's server publishes, read by the component and the Rust core's adapter
        mamba: Any = import_mamba_cache().mamba
        mamba.get_exec = lambda: settings
        if core == "rust":
            adapter: Any = importlib.import_module("sglang.srt.mem_cache.rust_tree_core.adapter")
            adapter.get_exec, adapter.mamba_cache_chunk_size = (lambda: settings), mamba.mamba_cache_chunk_size
        # the unified manager's own set-up (with SWA beside, the combined class sets the window's part)
        SGLangUnifiedManager.__init__(self, 1, num_pages, core, policy)
        self.windows = (None, hr.STATE)
        # the prefixes of the states the tree holds, as last read before a match
        self.tree_states: set[StateOf] = set()

    def make_table(self) -> RequestTable:
        table: Any = self.v.table(self.torch.zeros((ROWS, ROW_TOKENS), dtype=self.torch.int64), list(range(ROWS)))
        table.mamba_allocator = self.v.slots.MambaSlotAllocator(self.states, "cpu")
        table.mamba_pool.states = {}
        return cast(RequestTable, table)

    def components(self) -> dict[str, object]:
        c = self.v.components
        return {"tree_components": (c.FULL, c.MAMBA), "enable_mamba_extra_buffer": False}

    # ------------------------------------------------------------ reading SGLang's state

    @property
    def pool(self) -> StatePool:
        table: Any = self.table
        return cast(StatePool, table.mamba_pool)

    @property
    def slots(self) -> Any:
        table: Any = self.table
        return table.mamba_allocator

    def request_slots(self) -> dict[int, int]:
        """The state slot of each live request."""
        return {uid: int(r.kv.mamba_pool_idx) for uid, r in self.records.items() if r.kv.mamba_pool_idx is not None}

    def tree_slots(self) -> set[int]:
        """The state slots the tree holds: neither free nor a request's."""
        free = {int(s) for s in self.slots.free_slots.tolist()}
        return set(range(1, self.states + 1)) - free - set(self.request_slots().values())

    def make_room(self) -> bool:
        """A free state slot, evicting a cached state if none is (the scheduler's admission check)."""
        if self.slots.available_size() == 0:
            STATS.record_rule("sglang-mamba.evict_state")
            self.cache.evict_for_alloc(self.v.base.EvictParams(num_tokens=0, mamba_num=1))
        return bool(self.slots.available_size())

    def page_rows(self, record: Record, length: int) -> list[list[int | None]]:
        """The full row, and the state group's: the request's state slot at its last computed token."""
        full = self.row(record, length)
        state: list[int | None] = [None] * len(full)
        if record.extend_end and record.kv.mamba_pool_idx is not None:
            state[record.extend_end - 1] = int(record.kv.mamba_pool_idx)
        return [list(full), state]

    # ------------------------------------------------------------ the state's lifecycle

    def match_req(self, req: HybridReq) -> None:
        """Admitted only with a state slot free (nothing changes when none can be made)."""
        if not self.make_room():
            STATS.record_rule("sglang-mamba.match[no state slot: not admitted]")
            raise OutOfPagesError(f"request {req.uid}: no free state slot")
        super().match_req(req)

    def match_params(self, key: object, record: Record) -> object:
        self.tree_states = {s for slot in self.tree_slots() if (s := self.pool.states.get(slot)) is not None}
        return self.v.base.MatchPrefixParams(key=key, req=record, cow_mamba=True)

    def judge_hit(self, req: HybridReq, record: Record, key: object, hit: int, cached: dict[pc.PageKey, int]) -> None:
        """The longest length with full KV before it and a state of exactly that prefix; then the copy."""
        tokens = req.input_ids[:-1]
        full = self.event_pages(req, cached)

        def is_cached(group: int, end: int) -> bool:
            return full(0, end) if group == 0 else self.has_state(req, end)

        rule = hr.HitRule(1, self.windows, 1)
        expected = hr.compute_hit(rule, is_cached, len(tokens), len(tokens))
        if hit != expected:
            raise IntegrityError(
                f"hit_is_the_longest_valid_match: request {req.uid} hit {hit} of {len(tokens)} tokens; with full KV"
                f" and a cached state for exactly that prefix the longest is {expected}"
            )
        self.adopt_state(req, record, hit)

    def has_state(self, req: HybridReq, end: int) -> bool:
        """The tree held, before the match, a state of exactly the prompt's first ``end`` tokens."""
        return (req.namespace, tuple(req.input_ids[:end])) in self.tree_states

    def adopt_state(self, req: HybridReq, record: Record, hit: int) -> None:
        """The request's state after the match: the hit's, copied (checked), or a cleared one."""
        tokens = req.input_ids[:-1]
        source = record.kv.mamba_cow_src_index
        if source is not None:
            # the scheduler's copy on the forward stream (copy on match)
            copied = self.pool.states.get(int(source))
            if copied != (req.namespace, tuple(tokens[:hit])):
                raise IntegrityError(
                    f"the_copied_state_is_the_hits: request {req.uid} hit {hit} tokens and copies the state of"
                    f" {'nothing' if copied is None else f'{len(copied[1])} tokens'}"
                )
            STATS.record_rule("sglang-mamba.copy_on_match")
            record.kv.mamba_cow_src_index = None
        elif not record.kv.holds_mamba:
            # HybridReqToTokenPool.alloc: a cleared state for a request with no state hit
            slot = self.slots.alloc(1)
            assert slot is not None, "make_room left a slot"
            record.kv.mamba_pool_idx = slot[0]
        self.pool.states[int(record.kv.mamba_pool_idx)] = (req.namespace, tuple(tokens[:hit]))

    def store(self, req: HybridReq, tokens: int) -> None:
        super().store(req, tokens)
        record = self.records[req.uid]
        self.pool.states[int(record.kv.mamba_pool_idx)] = (req.namespace, tuple(req.input_ids[: req.computed]))
        req.rows = self.page_rows(record, record.kv.kv_allocated_len)

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        if not finished and not self.make_room():
            STATS.record_rule("sglang-mamba.checkpoint[no state slot: not called]")
            return
        super().cache_req(req, finished)

    # ------------------------------------------------------------ universal checks

    def check_attended(self, req: HybridReq, record: Record, slots: list[int]) -> None:
        super().check_attended(req, record, slots)
        state = self.pool.states.get(int(record.kv.mamba_pool_idx))
        if state != (req.namespace, tuple(req.input_ids[: req.computed])):
            raise IntegrityError(
                f"the_requests_state_is_its_own: request {req.uid} computed {req.computed} tokens; its state slot"
                f" {int(record.kv.mamba_pool_idx)} holds that of"
                f" {'nothing' if state is None else f'{len(state[1])} tokens'}"
            )

    def pools(self, live_reqs: list[HybridReq]) -> list[tuple[str, int, int, int, int]]:
        cached = int(self.cache.mamba_evictable_size() + self.cache.mamba_protected_size())
        held = len(self.request_slots())
        return [*super().pools(live_reqs), ("state ", self.slots.available_size(), cached, held, self.states)]


class SGLangSWAMambaManager(SGLangMambaUnifiedManager, SGLangSWAUnifiedManager):
    """FULL + SWA + MAMBA (a hybrid model with sliding-window and linear-attention layers), at page size 1."""

    profile = PROFILE

    def __init__(
        self, num_pages: int, core: str, policy: str, states: int, max_states_per_path: int, window: int
    ) -> None:
        self.window, self.out_of_window, self.swa_pages = window, True, max(2, (3 * num_pages) // 4)
        self.swa_shadow: dict[int, Written] = {}
        super().__init__(num_pages, core, policy, states, max_states_per_path)
        self.windows = (None, window, hr.STATE)

    def components(self) -> dict[str, object]:
        c = self.v.components
        return {
            "tree_components": (c.FULL, c.SWA, c.MAMBA),
            "sliding_window_size": self.window,
            "enable_mamba_extra_buffer": False,
        }

    def page_rows(self, record: Record, length: int) -> list[list[int | None]]:
        full, state = SGLangMambaUnifiedManager.page_rows(self, record, length)
        return [full, SGLangSWAUnifiedManager.page_rows(self, record, length)[1], state]

    def judge_hit(self, req: HybridReq, record: Record, key: object, hit: int, cached: dict[pc.PageKey, int]) -> None:
        """Valid by the three groups (full KV, live SWA in the window, a state of exactly the prefix), never
        longer than the longest valid match; then the state's copy."""
        full, holes = self.event_pages(req, cached), self.swa_holes(key, len(req.input_ids) - 1)

        def is_cached(group: int, end: int) -> bool:
            kind = self.windows[group]
            holds = self.has_state(req, end) if kind == hr.STATE else kind is None or self.window_holds(holes, end)
            return full(0, end) and holds

        why = f"the events' pages, the SWA tombstones {holes} and the tree's states"
        self.judge_valid(req, hit, hr.HitRule(1, self.windows, 1), is_cached, why)
        self.adopt_state(req, record, hit)


def target(argument: str | None) -> TargetInfo:
    """``sglang-mamba`` (Rust core), ``sglang-mamba:python``, ``sglang-mamba:both``."""
    if argument not in CORES:
        raise TargetError(f"sglang-mamba takes rust, python or both, got {argument!r}")
    cores = CORES[argument]

    def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> Any:
        policy = POLICIES[num_pages % len(POLICIES)]
        per_path = 2 if (num_pages // len(POLICIES)) % 2 else -1
        states = 4 + num_pages // 4
        # FULL + SWA + MAMBA in half the configurations, with the drawn window
        window = max(2, next((w for w in windows if isinstance(w, int)), 4)) if (num_pages // 4) % 2 else None
        swa = "" if window is None else f",SWA W={'<=8' if window <= 8 else '>8'}"
        STATS.record_rule(f"sglang-mamba.config[{policy},states per path {per_path}{swa}]")
        managers = [
            SGLangMambaUnifiedManager(2 * num_pages, core, policy, states, per_path)
            if window is None
            else SGLangSWAMambaManager(2 * num_pages, core, policy, states, per_path, window)
            for core in cores
        ]
        return managers[0] if len(managers) == 1 else BothCores(managers)

    return TargetInfo(
        name="sglang-mamba" if argument is None else f"sglang-mamba:{argument}",
        description=f"SGLang {VERSION} UnifiedRadixCache FULL + MAMBA, {' and '.join(cores)} tree core, page size 1",
        requires=(("sglang", f"radixspec targets install sglang  (pip install --no-deps sglang=={VERSION})"),),
        hybrid_factory=factory,
        profile=PROFILE,
        page_sizes=(1,),
        how="the hybrid machine: requests as SGLang's scheduler drives them; the hit, the states, the pools",
        probe=import_mamba_cache,
    )
