"""Target ``sglang-swa``: SGLang 0.5.23's ``UnifiedRadixCache`` with its FULL and SWA components over its real
``SWATokenToKVPoolAllocator`` (a full pool and a smaller SWA pool, tied by the full-to-SWA index mapping),
driven through the scheduler's request lifecycle of the ``sglang`` target (``sglang_unified.py``):
``sglang-swa`` runs the Rust tree core, ``sglang-swa:python`` the Python core, ``sglang-swa:both`` the two on
the same program; ``sglang-swa:legacy`` (and ``:legacy-rust``) is the older target that caches a request only
when it finishes, at page size 1 (``sglang_swa.py``).

Drawn per configuration: the page size (1, 2, 4, 8) and the window (the hybrid machine's: below a page, not a
multiple of it, many pages), EAGLE's bigram keys, SGLang's default of freeing out-of-window SWA slots at each
checkpoint of a running request (``SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS``) on or off.

What the lifecycle adds for the window, from SGLang's code: a decoding request frees the SWA slots its window
passed (``ScheduleBatch.maybe_evict_swa`` -> ``evict_sliding_windows``); allocation evicts the full and the SWA
shortfall (``SWATokenToKVPoolAllocator.evict_to_free_tokens``); page size 1 allocates token slots
(``alloc_token_slots``); a release frees the row past the protected prefix with ``free_kv_row`` (SWA slots the
request freed already go back on the full side only).

Checks beside the ``sglang`` target's: the hit is a valid match by the hit rule of (full, window W) over what
the tree holds (the events' full pages, the tree core's SWA tombstones), never longer than the spec's longest
valid match (shorter ones are counted: SGLang asks W live tokens after a tombstone, one more than needed); its
SWA slots per position shown to the lifecycle laws (``fuzz/lifecycle.py``: a request's attended window positions
hold live SWA slots with its own KV), both pools to their conservation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError

from ..lifecycle import Pool
from ..stats import STATS
from .api import TargetError, TargetInfo
from .sglang import VERSION
from .sglang_swa import import_swa_cache, mapping_pool
from .sglang_unified import CORES, POLICIES, BothCores, Record, SGLangUnifiedManager, unified_profile

if TYPE_CHECKING:
    import torch

PROFILE = unified_profile(
    "FULL + SWA",
    "window_tokens: after an SWA tombstone a match needs W live tokens, one more than the spec's W - 1",
    "holes: SWA tombstones; an insert over a tombstone adopts the request's new slots (healing)",
    "pools: one full pool and one SWA pool, tied by a full-to-SWA index mapping",
    "a running request frees its out-of-window SWA slots at checkpoints (when on) and in decode",
)

OUT_OF_WINDOW = "SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS"


@contextmanager
def free_out_of_window(on: bool) -> Iterator[None]:
    """SGLang reads the switch at each checkpoint: set it for this manager's calls only."""
    before = os.environ.get(OUT_OF_WINDOW)
    os.environ[OUT_OF_WINDOW] = "true" if on else "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ[OUT_OF_WINDOW]
        else:
            os.environ[OUT_OF_WINDOW] = before


class SGLangSWAUnifiedManager(SGLangUnifiedManager):
    """SGLang's unified cache with FULL and SWA over the SWA allocator, on one tree core."""

    profile = PROFILE

    def __init__(
        self, page_size: int, num_pages: int, core: str, policy: str, window: int, eagle: bool, out_of_window: bool
    ) -> None:
        self.window, self.out_of_window = window, out_of_window
        # the SWA pool is smaller than the full one, as SGLang sizes it: window slots run short first
        self.swa_pages = max(2, (3 * num_pages) // 4)
        super().__init__(page_size, num_pages, core, policy, eagle)
        self.windows = (None, window)

    def make_allocator(self) -> Any:
        p = self.page_size
        return self.v.swa.SWATokenToKVPoolAllocator(
            size=self.num_pages * p,
            size_swa=self.swa_pages * p,
            page_size=p,
            dtype=self.torch.float16,
            device="cpu",
            kvcache=mapping_pool(self.v),
            need_sort=False,
            req_to_token_pool=self.table,
        )

    def components(self) -> dict[str, object]:
        c = self.v.components
        return {"tree_components": (c.FULL, c.SWA), "sliding_window_size": self.window}

    # ------------------------------------------------------------ reading SGLang's state

    def swa_slot(self, full: int) -> int | None:
        """The SWA slot paired with a full slot (None: freed or tombstoned)."""
        swa = int(self.alloc.full_to_swa_index_mapping[full])
        return None if swa <= 0 else swa

    def page_rows(self, record: Record, length: int) -> list[list[int | None]]:
        full = self.row(record, length)[:: self.page_size]
        return [list(full), [self.swa_slot(f) for f in full]]

    def kv_slots(self, req: HybridReq) -> list[list[int | None]]:
        """Per position, its full slot and the SWA slot paired with it (None: freed)."""
        record = self.records[req.uid]
        full = self.row(record, record.kv.kv_allocated_len)
        return [list(full), [self.swa_slot(f) for f in full]]

    def judge_hit(self, req: HybridReq, record: Record, key: object, hit: int, cached: dict[pc.PageKey, int]) -> None:
        """A valid match of (full, window) over the events' full pages and the tree's live SWA, and no longer
        than the longest valid one."""
        tokens, p = req.input_ids[:-1], self.page_size
        full = self.event_pages(req, cached)
        holes = self.swa_holes(key, len(tokens))

        def is_cached(group: int, end: int) -> bool:
            return full(0, end) and (group == 0 or self.window_holds(holes, end))

        rule = hr.HitRule(p, self.windows, p, lookahead=int(self.eagle))
        self.judge_valid(req, hit, rule, is_cached, f"the events' pages and the tree's SWA tombstones {holes}")

    def swa_holes(self, key: object, tokens: int) -> list[range]:
        """The tree core's SWA tombstones along the whole pages of the key (key units: bigrams under EAGLE)."""
        units = (tokens - int(self.eagle)) // self.page_size * self.page_size
        ranges = self.cache.tree_core.swa_tombstone_ranges(key, 0, units) if units > 0 else []
        return [range(a, b) for a, b in ranges]

    def window_holds(self, holes: list[range], end: int) -> bool:
        """The page ending at ``end`` has live SWA (no tombstone in it)."""
        page = range(max(0, end - self.page_size), end)
        return not any(h and page.start < h.stop and h.start < page.stop for h in holes)

    def judge_valid(self, req: HybridReq, hit: int, rule: hr.HitRule, is_cached: hr.IsCached, why: str) -> None:
        """SGLang's hit under a window: valid, never longer than the longest valid match (shorter: counted)."""
        tokens = len(req.input_ids) - 1
        longest = hr.compute_hit(rule, is_cached, tokens, tokens)
        if hit > longest or (hit and not hr.is_valid_length(rule, hit, is_cached)):
            raise IntegrityError(
                f"hit_is_a_valid_match: request {req.uid} hit {hit} of {tokens} tokens; by {why} the longest valid"
                f" match is {longest}"
            )
        if hit < longest:
            STATS.record_rule("sglang-swa.hit_below_the_spec")

    # ------------------------------------------------------------ the window's lifecycle

    def allocate_slots(self, req: HybridReq, record: Record, start: int, length: int) -> torch.Tensor | None:
        """A decoding request first frees the window slots it passed; then evict both shortfalls and allocate."""
        if start >= len(record.origin_input_ids):
            STATS.record_rule("sglang-swa.evict_sliding_windows")
            self.cache.evict_sliding_windows(record, len(req.input_ids) - 1)
            req.rows = self.page_rows(record, start)
        if self.page_size > 1:
            return super().allocate_slots(req, record, start, length)
        need = length - start
        full_short = need - self.alloc.full_available_size()
        swa_short = need - self.alloc.swa_available_size()
        if full_short > 0 or swa_short > 0:
            STATS.record_rule("sglang.evict_for_alloc")
            self.cache.evict_for_alloc(
                self.v.base.EvictParams(num_tokens=max(0, full_short), swa_num_tokens=max(0, swa_short))
            )
        out: torch.Tensor | None = self.alloc.alloc(need)
        return out

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        with free_out_of_window(self.out_of_window):
            super().cache_req(req, finished)

    # ------------------------------------------------------------ the view the lifecycle laws read

    def pools(self, live_reqs: list[HybridReq]) -> list[Pool]:
        p, cache = self.page_size, self.cache
        full = super().pools(live_reqs)[0]
        private = 0
        for req in live_reqs:
            kv = self.records[req.uid].kv
            row = self.row(self.records[req.uid], kv.kv_allocated_len)
            private += sum(
                1 for first in range(kv.cache_protected_len, len(row), p) if self.swa_slot(row[first]) is not None
            )
        cached = int(cache.swa_evictable_size() + cache.swa_protected_size()) // p
        swa = Pool("SWA", self.alloc.swa_available_size() // p, cached, private, self.swa_pages)
        return [full._replace(free=self.alloc.full_available_size() // p), swa]


def target(argument: str | None) -> TargetInfo:
    """``sglang-swa`` (Rust core), ``:python``, ``:both``; ``:legacy`` / ``:legacy-rust`` the older target."""
    if argument in ("legacy", "legacy-rust"):
        from . import sglang_swa

        return sglang_swa.target("python" if argument == "legacy" else "rust", name=f"sglang-swa:{argument}")
    if argument not in CORES:
        raise TargetError(f"sglang-swa takes rust, python, both, legacy or legacy-rust, got {argument!r}")
    cores = CORES[argument]

    def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> Any:
        window = max(2, next((w for w in windows if isinstance(w, int)), 4))
        policy = POLICIES[num_pages % len(POLICIES)]
        eagle = (num_pages // len(POLICIES)) % 2 == 1
        out_of_window = (num_pages // 4) % 2 == 0
        flags = f"{',eagle' if eagle else ''}{',free out of window' if out_of_window else ''}"
        STATS.record_rule(f"sglang-swa.config[P={page_size},W{'<=' if window <= page_size else '>'}P,{policy}{flags}]")
        managers = [
            SGLangSWAUnifiedManager(page_size, 2 * num_pages, core, policy, window, eagle, out_of_window)
            for core in cores
        ]
        return managers[0] if len(managers) == 1 else BothCores(managers)

    return TargetInfo(
        name="sglang-swa" if argument is None else f"sglang-swa:{argument}",
        description=f"SGLang {VERSION} UnifiedRadixCache FULL + SWA, {' and '.join(cores)} tree core, SWA allocator",
        requires=(("sglang", f"radixspec targets install sglang  (pip install --no-deps sglang=={VERSION})"),),
        hybrid_factory=factory,
        profile=PROFILE,
        page_sizes=(1, 2, 4, 8),
        how="the hybrid machine: requests as SGLang's scheduler drives them; the hit, the window, both pools",
        probe=import_swa_cache,
    )
