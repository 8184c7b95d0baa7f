"""Target ``sglang``: SGLang 0.5.23's ``UnifiedRadixCache`` as it builds it for a dense model (the FULL component
only), over its real ``PagedTokenToKVPoolAllocator``, driven through the scheduler's request lifecycle.

``sglang`` runs the compiled Rust tree core (SGLang's default, ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust``),
``sglang:python`` the Python core, ``sglang:both`` the two side by side on the same program (they must give the
same hits, rows, evictions and KV events, or the campaign says where they part); ``sglang:legacy`` is the
legacy ``RadixCache`` (``fuzz/targets/sglang.py``).

The lifecycle is the scheduler's, written here from SGLang's code (``mem_cache/common.py``,
``mem_cache/allocation.py``, ``unified_radix_cache.py``): match the prompt less its last token under the
request's ``cache_salt`` (with EAGLE's bigram keys in half the configurations) and lock the match
(``match_prefix_for_req``); allocate with
``alloc_paged_token_slots_extend`` (evict what the allocator's demand exceeds, then ``alloc_extend`` with the
request's ``last_loc``); store KV; between chunks ``checkpoint_kv_cache`` (``checkpoint`` up to the stored
tokens: SGLang inserts the page-aligned prefix, frees the request's copies of pages another request cached,
rewrites its row and moves its lock); when it finishes ``release_kv_cache`` (checkpoint, free the row past
the protected prefix, unlock, free what was allocated past the stored tokens). Requests carry a drawn
priority; the eviction policy is drawn (LRU, or SGLang's priority policy).

What stands in: the KV pool (no tensors), the request (a record of the fields the cache reads) and the
request-to-token table (a tensor and its ``write``); modules the cache never calls (``sglang_modules.py``).

Checks, whatever SGLang chooses: the hit is the spec's longest valid match (``spec/hit_rules.py``) of the
pages the cache's own KV events say it holds; the events replayed from empty hold as many pages as the tree;
every page of a row is a run of P slots; SGLang's ``sanity_check``; and the lifecycle laws (``fuzz/lifecycle.py``:
the safety law, a shadow of every KV write, conservation per pool), to which this shows its rows and pools.
"""

from __future__ import annotations

import importlib
import itertools
import os
import types
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import events as ev
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError, OutOfPagesError

from ..lifecycle import KVCopy, Pool, hit_law
from ..stats import STATS
from .api import LifecycleProfile, Profile, TargetError, TargetInfo
from .sglang import VERSION
from .sglang_modules import PAGE_SIZES, engine_modules, import_unified_cache, mapping_pool

if TYPE_CHECKING:
    import torch


def unified_profile(components: str, hit: str = "", window: str = "", state: str = "") -> LifecycleProfile:
    """The profile of SGLang's unified cache with ``components``: the choices every tree of it makes, and those
    its components add."""
    return LifecycleProfile(
        name=f"sglang {VERSION} UnifiedRadixCache {components}",
        hit=hit,
        pages="the allocator hands out pages; a request's row is rewritten to the tree's pages at each checkpoint;"
        " a finished request's prompt becomes its own node, one priority above the output",
        window=window,
        state=state,
        duplicates="a checkpoint frees the request's copies of pages another request cached meanwhile (dedup)",
        eagle="under EAGLE the tree keys by bigrams (raw keys with a MAMBA component), drawn",
        events="namespaces are cache_salt values (their repr); the KV events carry them",
        drawn="the tree core (Rust, Python, or both on one program), the eviction policy (LRU, priority), EAGLE",
    )


PROFILE = unified_profile("FULL")

# SGLang's tree cores, by our argument
CORES = {None: ("rust",), "rust": ("rust",), "python": ("python",), "both": ("rust", "python")}
POLICIES = ("lru", "priority")
# what a KV slot (or a state) was written with: the request's namespace and its tokens up to there
Written = tuple[Namespace, tuple[int, ...]]
# rows of the request-to-token table, and tokens per row
ROWS, ROW_TOKENS = 256, 4096


@dataclass
class KVRecord:
    """The part of SGLang's request kv record (``ReqKvInfo``) the cache and its components read and write."""

    req_pool_idx: int
    # tokens of the row that are the tree's (locked): the match, then each checkpoint's insert
    cache_protected_len: int = 0
    cache_inserted_len: int = 0
    # tokens allocated in the row
    kv_allocated_len: int = 0
    # per component (SWA): the row's positions below this had their window slots freed
    component_evicted_seqlens: dict[object, int] = field(default_factory=dict)
    swa_evict_floor: int = 0
    # the request's recurrent-state slot (Mamba), and the tree's state a match copies into it
    mamba_pool_idx: torch.Tensor | None = None
    mamba_cow_src_index: torch.Tensor | None = None
    mamba_needs_clear: bool = False
    # the extra buffer's tracking slots (ping-pong): which one the next track writes, which holds the latest
    mamba_ping_pong_track_buffer: torch.Tensor | None = None
    mamba_ping_pong_empty: list[bool] | None = None
    mamba_next_track_idx: int | None = None
    mamba_last_track_idx: int | None = None
    # the lengths whose states the latest and the one before are of
    mamba_last_track_seqlen: int | None = None
    mamba_prev_track_seqlen: int | None = None

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None

    def state_slot(self) -> int:
        """The request's state slot (Mamba): held from its match to its release."""
        assert self.mamba_pool_idx is not None, f"row {self.req_pool_idx}: a live request holds a state slot"
        return int(self.mamba_pool_idx)

    def tracking_slots(self) -> torch.Tensor:
        """The extra buffer's tracking slots: held from the match to the release."""
        slots = self.mamba_ping_pong_track_buffer
        assert slots is not None, f"row {self.req_pool_idx}: a live request of the extra buffer holds tracking slots"
        return slots

    @property
    def holds_kv(self) -> bool:
        return True

    def get_evicted_seqlen(self, component: object) -> int:
        return self.component_evicted_seqlens.get(component, 0)

    def set_evicted_seqlen(self, component: object, length: int) -> None:
        self.component_evicted_seqlens[component] = length

    def swa_dead_lo(self, page_size: int) -> int:
        """The lowest position whose window slot the request frees itself: above the tree's prefix."""
        low = max(self.cache_protected_len, self.swa_evict_floor)
        return -(-low // page_size) * page_size if low > self.cache_protected_len else low


@dataclass
class Record:
    """SGLang's ``Req``, as much of it as the unified cache reads (``checkpoint_into_tree``)."""

    rid: str
    origin_input_ids: array[int]
    full_untruncated_fill_ids: array[int]
    cache_salt: str | None
    priority: int
    kv: KVRecord
    extra_key: str | None = None
    session: None = None
    session_id: None = None
    kv_rotation_base: None = None
    finished_reason: None = None
    lock: object = None
    last_node: object = None
    done: bool = False
    # the match's SWA branch point (SGLang's SWA component inserts a branch there)
    swa_branching_seqlen: int | None = None
    # the match's Mamba branch point: the extra buffer tracks the state there in the next prefill chunk
    mamba_branching_seqlen: int | None = None
    # where the last extend ended: the tokens whose KV is computed
    extend_end: int = 0
    # the match's host hits of the components beside FULL (init_load_back reads them; HiCache: FULL and SWA)
    swa_host_hit_length: int = 0
    mamba_host_hit_length: int = 0

    def finished(self) -> bool:
        return self.done

    def get_fill_ids(self) -> array[int]:
        """The tokens up to the end of the last extend (a chunked prefill's chunk), as SGLang's Req gives them."""
        return self.full_untruncated_fill_ids[: self.extend_end]


@dataclass
class RequestTable:
    """SGLang's ``ReqToTokenPool``: one row of slots per running request."""

    req_to_token: torch.Tensor
    free_rows: list[int] = field(default_factory=list)

    def write(self, index: tuple[int, slice], values: torch.Tensor) -> None:
        self.req_to_token[index] = values


# SGLang reads this switch at each checkpoint (the SWA component frees a running request's out-of-window slots)
OUT_OF_WINDOW = "SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS"


@dataclass(frozen=True)
class SlidingWindow:
    """SGLang's SWA component as a manager combines it with the others: the window, its pool (smaller than the
    full one, as SGLang sizes it: window slots run short first) tied to the full pool by the full-to-SWA index
    mapping, and whether a checkpoint frees a running request's out-of-window slots. Its methods take the
    manager whose allocator and tree they read."""

    window: int
    pages: int
    out_of_window: bool

    @staticmethod
    def sized(window: int, num_pages: int, out_of_window: bool) -> SlidingWindow:
        return SlidingWindow(window, max(2, (3 * num_pages) // 4), out_of_window)

    def allocator(self, m: SGLangUnifiedManager, kvcache: object) -> Any:
        p = m.page_size
        return m.v.swa.SWATokenToKVPoolAllocator(
            size=m.num_pages * p,
            size_swa=self.pages * p,
            page_size=p,
            dtype=m.torch.float16,
            device="cpu",
            kvcache=kvcache,
            need_sort=False,
            req_to_token_pool=m.table,
        )

    def column(self, m: SGLangUnifiedManager, full: Sequence[int]) -> list[int | None]:
        """The SWA slot paired with each full slot (None: freed or tombstoned), read in one gather (read one by one,
        they took a third of a campaign's time)."""
        if not full:
            return []
        paired = m.alloc.full_to_swa_index_mapping[m.torch.tensor(full, dtype=m.torch.int64)].tolist()
        return [None if swa <= 0 else swa for swa in paired]

    def holes(self, m: SGLangUnifiedManager, key: object, tokens: int) -> list[range]:
        """The tree core's SWA tombstones along the whole pages of the key (key units: bigrams under EAGLE)."""
        units = (tokens - int(m.eagle)) // m.page_size * m.page_size
        ranges = m.cache.tree_core.swa_tombstone_ranges(key, 0, units) if units > 0 else []
        return [range(a, b) for a, b in ranges]

    def holds(self, page_size: int, holes: list[range], end: int) -> bool:
        """The page ending at ``end`` has live SWA (no tombstone in it)."""
        page = range(max(0, end - page_size), end)
        return not any(h and page.start < h.stop and h.start < page.stop for h in holes)

    def slide(self, m: SGLangUnifiedManager, req: HybridReq, record: Record, start: int) -> None:
        """A decoding request first frees the window slots it passed (``maybe_evict_swa``)."""
        if start >= len(record.origin_input_ids):
            STATS.record_rule("sglang-swa.evict_sliding_windows")
            m.cache.evict_sliding_windows(record, len(req.input_ids) - 1)
            req.rows = m.page_rows(record, start)

    def alloc_tokens(self, m: SGLangUnifiedManager, need: int) -> torch.Tensor | None:
        """Page size 1 (``alloc_token_slots``): evict both shortfalls, then allocate."""
        full_short = need - m.alloc.full_available_size()
        swa_short = need - m.alloc.swa_available_size()
        if full_short > 0 or swa_short > 0:
            STATS.record_rule("sglang.evict_for_alloc")
            m.cache.evict_for_alloc(
                m.v.base.EvictParams(num_tokens=max(0, full_short), swa_num_tokens=max(0, swa_short))
            )
        out: torch.Tensor | None = m.alloc.alloc(need)
        return out

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        """SGLang reads the out-of-window switch at each checkpoint: set for this manager's calls only."""
        before = os.environ.get(OUT_OF_WINDOW)
        os.environ[OUT_OF_WINDOW] = "true" if self.out_of_window else "false"
        try:
            yield
        finally:
            if before is None:
                del os.environ[OUT_OF_WINDOW]
            else:
                os.environ[OUT_OF_WINDOW] = before

    def pool(self, m: SGLangUnifiedManager, live_reqs: list[HybridReq]) -> Pool:
        """The SWA pool, in pages: a live request holds privately the pages past its protected prefix with live
        SWA."""
        p, private = m.page_size, 0
        for req in live_reqs:
            kv = m.records[req.uid].kv
            row = m.row(m.records[req.uid], kv.kv_allocated_len)
            private += sum(swa is not None for swa in self.column(m, row[kv.cache_protected_len :: p]))
        cached = int(m.cache.swa_evictable_size() + m.cache.swa_protected_size()) // p
        return Pool("SWA", m.alloc.swa_available_size() // p, cached, private, self.pages)


class StateComponent(Protocol):
    """What the manager calls of SGLang's MAMBA component as it combines it (``RecurrentState`` in
    ``sglang_unified_mamba.py``), at each step of the lifecycle where a recurrent state changes what it does. Its
    methods take the manager whose table, allocator and tree they read."""

    def configure(self, core: str, page_size: int) -> None:
        """The settings SGLang's server publishes, which the component reads, set before the cache is built."""

    def table(self, m: SGLangUnifiedManager) -> RequestTable:
        """The request-to-token table with the requests' state slots."""

    def components(self, m: SGLangUnifiedManager) -> dict[str, object]:
        """What the cache's parameters add for it (the MAMBA component, the extra buffer)."""

    def column(self, m: SGLangUnifiedManager, record: Record, pages: int) -> list[int | None]:
        """The state group's row: the request's state slot at the page of its last computed token."""

    def admit(self, m: SGLangUnifiedManager, req: HybridReq) -> None:
        """Before a match: the state slots a request needs, made (OutOfPagesError, nothing changed: not admitted)."""

    def match_params(self, m: SGLangUnifiedManager, key: object, record: Record) -> object:
        """The match's parameters (copy on match)."""

    def has_state(self, req: HybridReq, end: int) -> bool:
        """The tree held, before the match, a state of exactly the prompt's first ``end`` tokens."""

    def adopt(self, m: SGLangUnifiedManager, req: HybridReq, record: Record, hit: int) -> None:
        """The request's state after the judged match."""

    def chunk_end(self, m: SGLangUnifiedManager, req: HybridReq, length: int) -> int:
        """Where the scheduler's chunk asked to end at ``length`` ends."""

    def stored(self, m: SGLangUnifiedManager, req: HybridReq, record: Record, begin: int) -> None:
        """After a forward that computed ``[begin, req.computed)``: the request's state, its snapshots."""

    def make_room(self, m: SGLangUnifiedManager, needed: int = 1) -> bool:
        """``needed`` free state slots, evicting cached states if there are fewer (the scheduler's check)."""

    def check(self, m: SGLangUnifiedManager, req: HybridReq, record: Record) -> None:
        """The recurrent states' laws for a live request."""

    def pool(self, m: SGLangUnifiedManager, live_reqs: list[HybridReq]) -> Pool:
        """The state slots: free, cached, held by the live requests, size."""

    def clear(self, m: SGLangUnifiedManager) -> None:
        """Every state slot free (the request table cleared at a flush, no request running)."""


class MatchView(Protocol):
    """What the lifecycle reads of SGLang's ``MatchResult``."""

    device_prefix_len: int
    host_hit_length: int
    swa_host_hit_length: int
    mamba_host_hit_length: int
    last_device_node: object
    best_match_node: object


class TierComponent(Protocol):
    """HiCache's host tier beside the device pool (``sglang_hicache.py``): the device pool it copies from, the
    cache's ``init_hicache``, the scheduler's per-step poll, the host hit loaded back at a match, the forward's
    wait for the loads, the host tier's events, checks and pool; the copies it made and has in flight."""

    def device_pool(self, m: SGLangUnifiedManager) -> object: ...

    def kv_pools(self, windows: tuple[hy.Window, ...]) -> tuple[int, ...]:
        """The KV shadow's pool of each group (fuzz/lifecycle.py; without a tier, each group's own)."""

    def attach(self, m: SGLangUnifiedManager, params: object) -> None: ...

    def step(self, m: SGLangUnifiedManager, req: HybridReq | None = None, release: bool = False) -> None:
        """The scheduler's poll; before a request's match (``req``), or before a request's release (``release``)."""

    def device_events(self, m: SGLangUnifiedManager, events: list[object]) -> list[object]: ...

    def load_back(
        self, m: SGLangUnifiedManager, req: HybridReq, record: Record, result: MatchView
    ) -> tuple[int, object]: ...

    def forward(self, m: SGLangUnifiedManager) -> None: ...

    def check(self, m: SGLangUnifiedManager, live_reqs: list[HybridReq]) -> None: ...

    def pool(self, m: SGLangUnifiedManager) -> Pool: ...

    def take_kv_copies(self) -> list[KVCopy]: ...

    def incoming_kv(self) -> set[int]: ...

    def execute(self, lane: int, count: int) -> None: ...

    def before_reset(self, m: SGLangUnifiedManager) -> None: ...

    def drain(self, m: SGLangUnifiedManager) -> None: ...

    def evict_tiers(self, m: SGLangUnifiedManager, tiers: int) -> None: ...

    def checkable(self, m: SGLangUnifiedManager) -> bool: ...


def page_keys(req: HybridReq, page_size: int, eagle: bool) -> list[pc.PageKey]:
    """The keys the events name the pages of the request's prompt by, the page ending at ``(i + 1) * page_size``
    at ``i`` (EAGLE: keyed by bigrams, so a prompt's last token ends no page of its own)."""
    tokens = req.input_ids[:-1]
    units: list[Any] = list(itertools.pairwise(tokens)) if eagle else list(tokens)
    # once: keying each end anew is quadratic
    return [(req.namespace, prefix) for prefix in pc.compute_page_prefixes(units, page_size)]


def event_pages(req: HybridReq, cached: dict[pc.PageKey, int], page_size: int, eagle: bool) -> hr.IsCached:
    """Is the page of the request's prompt ending at ``end`` one the events hold (EAGLE: keyed by bigrams)."""
    keys = page_keys(req, page_size, eagle)
    return lambda group, end: keys[end // page_size - 1] in cached


def replayed(m: SGLangUnifiedManager) -> ev.Replayer:
    """The manager's mirror, every event its cache has taken so far replayed into it (with HiCache, the device's)."""
    taken = m.cache.take_events()
    if m.tiers is not None:
        taken = m.tiers.device_events(m, taken)
    events = ev.from_block_events(taken, lambda salt: m.salts.get(salt) if salt else None)
    STATS.events_replayed += len(events)
    # pages leave SGLang's tree only when it evicts them
    STATS.evicted_pages += sum(
        len(e.page_hashes) if isinstance(e, ev.PagesRemoved) else isinstance(e, ev.PageRemoved) for e in events
    )
    return m.mirror.apply(events)


class SGLangUnifiedManager:
    """SGLang's unified cache and its allocator behind the hybrid manager's methods, on one tree core: FULL, with
    the components the model has, combined as SGLang combines them: the SWA one (``swa``), the MAMBA one
    (``mamba``: ``sglang_unified_mamba.py``); with HiCache's host tier (``tiers``: ``sglang_hicache.py``).
    ``profile``: the target's."""

    # a refusal is an OutOfPagesError of ours (the scheduler's checks); anything else escaping SGLang is a crash
    raises_only_cache_errors = True

    def __init__(
        self,
        page_size: int,
        num_pages: int,
        core: str,
        policy: str,
        eagle: bool = False,
        *,
        swa: SlidingWindow | None = None,
        mamba: StateComponent | None = None,
        tiers: TierComponent | None = None,
        profile: Profile = PROFILE,
    ) -> None:
        import torch

        self.torch = torch
        self.swa, self.mamba, self.tiers, self.profile = swa, mamba, tiers, profile
        if mamba is not None:
            mamba.configure(core, page_size)
        v = self.v = import_unified_cache()
        # the groups: full attention, the window where SWA is combined, the state group after the KV groups
        kinds: tuple[hy.Window, ...] = (None,) if swa is None else (None, swa.window)
        self.windows: tuple[hy.Window, ...] = kinds if mamba is None else (*kinds, hr.STATE)
        self.page_size, self.num_pages, self.core = page_size, num_pages, core
        self.kv_pools = None if tiers is None else tiers.kv_pools(self.windows)
        # the tree's keys are bigrams: EAGLE's (``is_eagle``), but raw with a MAMBA component (unified_tree_core.py,
        # the Rust adapter)
        self.eagle = eagle and mamba is None
        self.table = self.make_table()
        self.alloc = self.make_allocator()
        params = v.params.CacheInitParams(
            disable=False,
            req_to_token_pool=self.table,
            token_to_kv_pool_allocator=self.alloc,
            page_size=page_size,
            tree_core_backend=core,
            eviction_policy=policy,
            enable_kv_cache_events=True,
            is_eagle=eagle,
            **self.components(),
        )
        self.cache = v.urc.UnifiedRadixCache(params)
        if tiers is not None:
            tiers.attach(self, params)
        self.records: dict[int, Record] = {}
        # cache_salt -> namespace: the events name a namespace by its salt
        self.salts: dict[str, Namespace] = {}
        self.mirror = ev.Replayer(page_size, check_hashes=False)

    def make_table(self) -> RequestTable:
        if self.mamba is not None:
            return self.mamba.table(self)
        return RequestTable(self.torch.zeros((ROWS, ROW_TOKENS), dtype=self.torch.int64), list(range(ROWS)))

    def make_allocator(self) -> Any:
        """SGLang's paged allocator over a mapping-only KV pool (HiCache: the tier's); with SWA, its SWA one."""
        kvcache = mapping_pool(self.v) if self.tiers is None else self.tiers.device_pool(self)
        if self.swa is not None:
            return self.swa.allocator(self, kvcache)
        paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
        return paged.PagedTokenToKVPoolAllocator(
            size=self.num_pages * self.page_size,
            page_size=self.page_size,
            dtype=self.torch.float16,
            device="cpu",
            kvcache=kvcache,
            need_sort=False,
        )

    def components_of_kv(self) -> tuple[object, ...]:
        """The KV components: FULL, and SWA where the model has sliding-window layers."""
        c = self.v.components
        return (c.FULL,) if self.swa is None else (c.FULL, c.SWA)

    def components(self) -> dict[str, object]:
        """The tree's components, as SGLang builds them for the model (a dense one: FULL only), MAMBA's last."""
        found: dict[str, object] = {"tree_components": self.components_of_kv()}
        if self.swa is not None:
            found["sliding_window_size"] = self.swa.window
        return found if self.mamba is None else found | self.mamba.components(self)

    # ------------------------------------------------------------ reading SGLang's state

    def salt(self, namespace: Namespace) -> str | None:
        if namespace is None:
            return None
        text = repr(namespace)
        self.salts[text] = namespace
        return text

    def cached_pages(self) -> dict[pc.PageKey, int]:
        """The pages the cache's KV events say it holds (with HiCache, on the device), every event so far replayed
        from empty."""
        return replayed(self).cached()

    def row(self, record: Record, length: int) -> list[int]:
        return cast(list[int], self.table.req_to_token[record.kv.req_pool_idx, :length].tolist())

    def page_rows(self, record: Record, length: int) -> list[list[int | None]]:
        """The request's rows as the spec counts them: the first slot of each page (SWA: its paired slot)."""
        full = self.row(record, length)[:: self.page_size]
        rows: list[list[int | None]] = [list(full)]
        if self.swa is not None:
            rows.append(self.swa.column(self, full))
        if self.mamba is not None:
            rows.append(self.mamba.column(self, record, len(full)))
        return rows

    def kv_slots(self, req: HybridReq) -> list[list[int | None]]:
        """Per group, the slot of each allocated position (fuzz/lifecycle.py): the row as SGLang keeps it, and
        with SWA the slot paired with each."""
        record = self.records[req.uid]
        full = self.row(record, record.kv.kv_allocated_len)
        return [list(full)] if self.swa is None else [list(full), self.swa.column(self, full)]

    # ------------------------------------------------------------ the scheduler's lifecycle

    def match_req(self, req: HybridReq) -> None:
        """match_prefix_for_req: the prompt less its last token under its cache_salt; checked, then locked (with
        MAMBA, admitted only with the state slots it needs)."""
        if self.tiers is not None:
            self.tiers.step(self, req)
        if self.mamba is not None:
            self.mamba.admit(self, req)
        if not self.table.free_rows:
            raise OutOfPagesError("no free row in the request-to-token table")
        v, tokens = self.v, req.input_ids[:-1]
        record = Record(
            rid=str(req.uid),
            origin_input_ids=array("q", req.input_ids),
            full_untruncated_fill_ids=array("q", req.input_ids),
            cache_salt=self.salt(req.namespace),
            priority=req.uid % 3,
            kv=KVRecord(self.table.free_rows.pop()),
        )
        # the scheduler's key is raw (_req_radix_key); the tree takes its bigram view when it keys by bigrams
        key = v.radix.RadixKey(array("q", tokens), None, cache_salt=record.cache_salt)
        cached = self.cached_pages()
        result = self.cache.match_prefix(self.match_params(key, record))
        hit = int(result.device_prefix_len)
        self.judge_hit(req, record, key, hit, cached)
        if hit:
            STATS.record_rule("sglang.match[hit]")
        record.swa_branching_seqlen = result.swa_branching_seqlen
        record.mamba_branching_seqlen = result.mamba_branching_seqlen
        last = record.last_node = result.last_device_node
        if self.tiers is not None:
            hit, last = self.tiers.load_back(self, req, record, result)
        if self.mamba is not None:
            self.mamba.adopt(self, req, record, hit)
        record.lock, record.last_node = self.cache.lock(last), last
        record.kv.cache_protected_len = record.kv.kv_allocated_len = hit
        if hit:
            matched = self.cache.path_device_indices(last)[:hit]
            self.table.write((record.kv.req_pool_idx, slice(0, hit)), matched)
        self.records[req.uid] = record
        record.extend_end = hit
        req.rows = self.page_rows(record, hit)
        req.handle, req.computed = types.SimpleNamespace(cached_len=hit), hit

    def match_params(self, key: object, record: Record) -> object:
        """match_kv_cache's parameters: the key and the request (MAMBA's: copy on match)."""
        if self.mamba is not None:
            return self.mamba.match_params(self, key, record)
        return self.v.base.MatchPrefixParams(key=key, req=record)

    def judge_hit(self, req: HybridReq, record: Record, key: object, hit: int, cached: dict[pc.PageKey, int]) -> None:
        """The hit by the hit rule over what the cache holds, per group: the full pages the events say it holds,
        live SWA in the window (the tree core's tombstones), a state of exactly the prefix (Mamba). Without a
        window it is the longest valid match; with one, a valid match never longer (SGLang asks W live tokens
        after a tombstone, one more than needed: shorter hits are counted)."""
        tokens = len(req.input_ids) - 1
        full = event_pages(req, cached, self.page_size, self.eagle)
        holes = [] if self.swa is None else self.swa.holes(self, key, tokens)

        def is_cached(group: int, end: int) -> bool:
            kind = self.windows[group]
            if kind is None:
                return full(0, end)
            if kind == hr.STATE:
                return full(0, end) and self.mamba is not None and self.mamba.has_state(req, end)
            return full(0, end) and self.swa is not None and self.swa.holds(self.page_size, holes, end)

        # EAGLE: the tree is keyed by bigrams, the KV of token i under (t_i, t_i+1): lookahead 1
        rule = hr.HitRule(self.page_size, self.windows, self.page_size, lookahead=int(self.eagle))
        why = "the events' pages" + ("" if self.swa is None else f", the SWA tombstones {holes}")
        why += ", the tree's states" if hr.STATE in self.windows else ""
        # the scheduler's key is the prompt less its last token: the tree reads those, and may reuse them all
        longest = hit_law(req.uid, hit, rule, is_cached, tokens, tokens, why, exact=self.swa is None)
        if hit < longest:
            STATS.record_rule("sglang-swa.hit_below_the_spec")

    def allocate_paged(self, req: HybridReq, length: int) -> None:
        """alloc_paged_token_slots_extend for tokens up to ``length``: evict the shortfall, then alloc_extend."""
        if self.tiers is not None:
            self.tiers.step(self)
        record = self.records[req.uid]
        start, length = record.kv.kv_allocated_len, self.chunk_end(req, length)
        if length <= start:
            return
        if length > ROW_TOKENS:
            raise OutOfPagesError(f"request {req.uid}: {length} tokens, a row holds {ROW_TOKENS}")
        out = self.allocate_slots(req, record, start, length)
        if out is None:
            STATS.record_rule("sglang.allocate[out of pages]")
            raise OutOfPagesError(f"request {req.uid}: {length - start} tokens, {self.alloc.available_size()} free")
        self.table.write((record.kv.req_pool_idx, slice(start, length)), out)
        record.kv.kv_allocated_len = length
        req.rows = self.page_rows(record, length)

    def chunk_end(self, req: HybridReq, length: int) -> int:
        """Where the scheduler's chunk that asks for tokens up to ``length`` ends (there, but with MAMBA)."""
        return length if self.mamba is None else self.mamba.chunk_end(self, req, length)

    def allocate_slots(self, req: HybridReq, record: Record, start: int, length: int) -> torch.Tensor | None:
        """Evict what the scheduler's conservative demand (a new page beside the tokens) exceeds, then extend;
        with SWA a decoding request first frees the window slots it passed, and page size 1 allocates tokens."""
        if self.swa is not None:
            self.swa.slide(self, req, record, start)
            if self.page_size == 1:
                return self.swa.alloc_tokens(self, length - start)
        tensor = self.torch.tensor
        shortfall = length - start + self.page_size - self.alloc.available_size()
        if shortfall > 0:
            STATS.record_rule("sglang.evict_for_alloc")
            self.cache.evict_for_alloc(self.v.base.EvictParams(num_tokens=shortfall))
        prefix, seq = tensor([start]), tensor([length])
        last = tensor([self.row(record, start)[-1] if start else -1])
        out: torch.Tensor | None = self.alloc.alloc_extend(prefix, prefix, seq, seq, last, length - start)
        return out

    def store(self, req: HybridReq, tokens: int) -> None:
        """KV written for ``tokens`` more tokens (the machine's shadow records where, fuzz/lifecycle.py)."""
        if self.tiers is not None:
            self.tiers.forward(self)
        record, begin = self.records[req.uid], req.computed
        end = self.chunk_end(req, req.computed + tokens)
        req.computed = record.extend_end = end
        record.full_untruncated_fill_ids = array("q", req.input_ids)
        if self.mamba is not None:
            self.mamba.stored(self, req, record, begin)

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        """checkpoint_kv_cache after a chunk; release_kv_cache when the request finishes or is aborted (with
        SWA under this manager's out-of-window switch; with MAMBA, a checkpoint only with a state slot free)."""
        if self.tiers is not None:
            self.tiers.step(self, release=finished)
        if not finished and self.mamba is not None and not self.mamba.make_room(self):
            STATS.record_rule("sglang-mamba.checkpoint[no state slot: not called]")
            return
        if self.swa is None:
            self.checkpoint_or_release(req, finished)
            return
        with self.swa.checkpointing():
            self.checkpoint_or_release(req, finished)

    def checkpoint_or_release(self, req: HybridReq, finished: bool) -> None:
        """The scheduler's call after a chunk, or at the end.

        The scheduler checkpoints only after a chunk was computed, so a running request with nothing computed
        since its match or last checkpoint is left alone (a checkpoint then is no state SGLang reaches: under
        EAGLE the bigram key of the protected tokens is one short, and SGLang asserts). A request that ends
        before its prompt is computed was aborted: released without a checkpoint when it computed nothing
        new (the abort of a queued or chunked request), else, for even uids, as the running batch's abort
        (it finishes at the next result and checkpoints what it computed)."""
        torch, record = self.torch, self.records[req.uid]
        record.full_untruncated_fill_ids = array("q", req.input_ids)
        progress = req.computed > record.kv.cache_protected_len
        if not finished:
            if not progress:
                STATS.record_rule("sglang.checkpoint[no chunk: not called]")
                return
            before = record.kv.cache_protected_len
            self.cache.checkpoint(record, up_to=req.computed)
            protected = record.kv.cache_protected_len
            STATS.record_rule(f"sglang.checkpoint[{'inserted' if protected > before else 'nothing'}]")
            req.rows = self.page_rows(record, record.kv.kv_allocated_len)
            req.handle = types.SimpleNamespace(cached_len=protected)
            return
        record.done = True
        owned, allocated = req.computed, record.kv.kv_allocated_len
        aborted = owned < len(record.origin_input_ids)
        checkpoint = progress and not (aborted and req.uid % 2)
        how = ("abort" if aborted else "finished") + ("" if checkpoint else ", no checkpoint")
        STATS.record_rule(f"sglang.release[{how}]")
        if checkpoint:
            self.cache.checkpoint(record, up_to=owned)
        protected = record.kv.cache_protected_len
        # free_kv_row: the row past the protected prefix (the allocator frees whole pages; SWA slots the
        # request freed already are given back on the full side only)
        if protected < owned:
            self.cache.free_kv_row(record.kv, [(protected, owned)])
        self.cache.unlock(record.lock)
        record.lock = None
        # _release_overallocated_kv_indices: from the page after the stored tokens
        tail = -(-owned // self.page_size) * self.page_size
        if tail < allocated:
            self.alloc.free(torch.tensor(self.row(record, allocated)[tail:], dtype=torch.int64))
        # the components' cleanup of a request released without a checkpoint (Mamba: its state slot)
        self.cache.on_release(record, checkpointed=checkpoint)
        self.table.free_rows.append(record.kv.req_pool_idx)
        del self.records[req.uid]
        req.rows, req.handle = [], None

    # ------------------------------------------------------------ universal checks

    def check_integrity(self, live_reqs: list[HybridReq]) -> None:
        """SGLang's own: pages as runs, the events against the tree, its sanity_check (the lifecycle laws, the KV
        shadow and the pools' conservation among them, are the machine's: fuzz/lifecycle.py)."""
        p = self.page_size
        for req in live_reqs:
            record = self.records[req.uid]
            slots = self.row(record, record.kv.kv_allocated_len)
            if self.mamba is not None:
                self.mamba.check(self, req, record)
            for first in range(0, len(slots), p):
                page = slots[first : first + p]
                if page != list(range(page[0], page[0] + len(page))) or page[0] % p:
                    raise IntegrityError(f"pages_are_runs: request {req.uid}'s page at {first} is slots {page}")
        tree = int(self.cache.full_evictable_size() + self.cache.full_protected_size())
        announced = replayed(self).reach()
        if announced * p != tree:
            raise IntegrityError(
                f"events_replay_to_the_cache: the events hold {announced} pages, the tree {tree} tokens"
            )
        if self.tiers is not None:
            self.tiers.check(self, live_reqs)
        if self.tiers is None or self.tiers.checkable(self):
            self.cache.sanity_check()
        STATS.record_reach(largest_tree_pages=tree // p)

    def pools(self, live_reqs: list[HybridReq]) -> list[Pool]:
        """Per pool, in pages: free, cached, held privately by the live requests, size (fuzz/lifecycle.py)."""
        p = self.page_size
        private = sum(
            -(-self.records[r.uid].kv.kv_allocated_len // p) - self.records[r.uid].kv.cache_protected_len // p
            for r in live_reqs
        )
        tree = int(self.cache.full_evictable_size() + self.cache.full_protected_size())
        free = self.alloc.available_size() if self.swa is None else self.alloc.full_available_size()
        found = [Pool("full", free // p, tree // p, private, self.num_pages)]
        found += [component.pool(self, live_reqs) for component in (self.swa, self.mamba) if component is not None]
        if self.tiers is not None:
            found.append(self.tiers.pool(self))
        return found

    @property
    def executes(self) -> bool:
        """Whether the machine runs this manager's transfers (``execute``): with HiCache's host tier."""
        return self.tiers is not None

    def execute(self, lane: int, count: int) -> None:
        """The executor: up to ``count`` more operations of one of the cache's transfer streams (a tiered one's)."""
        cast(TierComponent, self.tiers).execute(lane, count)

    def flush(self) -> None:
        """The scheduler's ``flush_cache`` once no request runs: the cache reset, the allocator cleared."""
        assert not self.records, f"flush_cache with {len(self.records)} requests running"
        if self.tiers is not None:
            self.tiers.before_reset(self)
        self.cache.reset()
        self.alloc.clear()
        if self.mamba is not None:  # req_to_token_pool.clear(): HybridReqToTokenPool's frees every state slot
            self.mamba.clear(self)

    def drain(self) -> None:
        """At idle: every transfer finished, both tiers evicted whole; nothing may stay (``HostTier.drain``)."""
        cast(TierComponent, self.tiers).drain(self)

    def evict_tiers(self, tiers: int) -> None:
        """Pressure: the first ``tiers`` tiers evicted whole, the device first (``HostTier.evict_tiers``)."""
        cast(TierComponent, self.tiers).evict_tiers(self, tiers)

    def take_kv_copies(self) -> list[KVCopy]:
        return [] if self.tiers is None else self.tiers.take_kv_copies()

    def incoming_kv(self) -> set[int]:
        return set() if self.tiers is None else self.tiers.incoming_kv()

    def cached_page_count(self) -> int:
        """Pages the tree holds (the reach of a campaign)."""
        return int(self.cache.full_evictable_size() + self.cache.full_protected_size()) // self.page_size


class BothCores:
    """The same program on SGLang's Rust and Python tree cores: every result, row and page count must agree."""

    raises_only_cache_errors = True

    def __init__(self, managers: Sequence[SGLangUnifiedManager]) -> None:
        self.managers = list(managers)
        self.windows, self.page_size, self.profile = managers[0].windows, managers[0].page_size, managers[0].profile
        # each core under the lifecycle laws (fuzz/lifecycle.py), with a shadow of its own
        self.cores = [(manager.core, manager) for manager in self.managers]

    def both(self, what: str, req: HybridReq, call: Callable[[SGLangUnifiedManager, HybridReq], None]) -> None:
        copies = [
            HybridReq(
                req.uid, list(req.input_ids), req.namespace, req.computed, [list(r) for r in req.rows], req.handle
            )
            for _ in self.managers
        ]
        outcomes: list[str | None] = []
        for manager, copy in zip(self.managers, copies, strict=True):
            try:
                call(manager, copy)
                outcomes.append(None)
            except OutOfPagesError as error:
                outcomes.append(str(error))
        seen = [
            (o, c.rows, c.cached_len, c.computed, m.cached_page_count())
            for o, c, m in zip(outcomes, copies, self.managers, strict=True)
        ]
        if seen[0] != seen[1]:
            raise IntegrityError(f"cores_agree: {what} of request {req.uid}: rust {seen[0]}, python {seen[1]}")
        req.rows, req.handle, req.computed = copies[0].rows, copies[0].handle, copies[0].computed
        if outcomes[0] is not None:
            raise OutOfPagesError(outcomes[0])

    def match_req(self, req: HybridReq) -> None:
        self.both("match_req", req, lambda m, r: m.match_req(r))

    def allocate_paged(self, req: HybridReq, length: int) -> None:
        self.both("allocate_paged", req, lambda m, r: m.allocate_paged(r, length))

    def store(self, req: HybridReq, tokens: int) -> None:
        self.both("store", req, lambda m, r: m.store(r, tokens))

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        self.both("cache_req", req, lambda m, r: m.cache_req(r, finished))

    @property
    def executes(self) -> bool:
        return self.managers[0].executes

    def execute(self, lane: int, count: int) -> None:
        for manager in self.managers:
            manager.execute(lane, count)

    def flush(self) -> None:
        for manager in self.managers:
            manager.flush()

    def drain(self) -> None:
        for manager in self.managers:
            manager.drain()

    def evict_tiers(self, tiers: int) -> None:
        for manager in self.managers:
            manager.evict_tiers(tiers)

    def check_integrity(self, live_reqs: list[HybridReq]) -> None:
        """Each core's checks; a broken law names the core it broke on."""
        for manager in self.managers:
            try:
                manager.check_integrity(live_reqs)
            except IntegrityError as error:
                raise IntegrityError(f"{manager.core} core: {error}") from error

    def cached_page_count(self) -> int:
        return self.managers[0].cached_page_count()


def target(argument: str | None) -> TargetInfo:
    """``sglang`` (Rust core), ``sglang:python``, ``sglang:both``; ``sglang:legacy`` is the legacy RadixCache."""
    if argument == "legacy":
        from .sglang import TARGET

        return TARGET
    if argument not in CORES:
        raise TargetError(f"sglang takes rust, python, both or legacy, got {argument!r}")
    cores = CORES[argument]

    def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> SGLangUnifiedManager | BothCores:
        policy = POLICIES[num_pages % len(POLICIES)]
        eagle = (num_pages // len(POLICIES)) % 2 == 1
        STATS.record_rule(f"sglang.config[P={page_size},{policy}{',eagle' if eagle else ''}]")
        # SGLang's requests take whole pages each: twice the drawn pages lets requests share and cache, and
        # still makes the allocator evict (at the drawn size most requests find no pages at all)
        managers = [SGLangUnifiedManager(page_size, 2 * num_pages, core, policy, eagle) for core in cores]
        return managers[0] if len(managers) == 1 else BothCores(managers)

    return TargetInfo(
        name="sglang" if argument is None else f"sglang:{argument}",
        description=f"SGLang {VERSION} UnifiedRadixCache (FULL), {' and '.join(cores)} tree core, paged allocator",
        requires=(("sglang", f"radixspec targets install sglang  (pip install --no-deps sglang=={VERSION})"),),
        hybrid_factory=factory,
        profile=PROFILE,
        page_sizes=PAGE_SIZES,
        how="the hybrid machine: requests as SGLang's scheduler drives them; the hit, the pools, the events",
        probe=import_unified_cache,
        engine_modules=engine_modules(cores),
    )
