"""Target ``sglang-swa``: SGLang 0.5.23's ``UnifiedRadixCache`` with its FULL and SWA components over its real
``SWATokenToKVPoolAllocator`` (a full pool and a smaller SWA pool, tied by the full-to-SWA index mapping),
driven through the scheduler's request lifecycle of the ``sglang`` target (``sglang_unified.py``):
``sglang-swa`` runs the Rust tree core, ``sglang-swa:python`` the Python core, ``sglang-swa:both`` the two on
the same program.

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

from radixspec.spec import hybrid as hy

from ..stats import STATS
from .api import TargetError, TargetInfo
from .sglang import VERSION
from .sglang_modules import PAGE_SIZES, engine_modules, import_unified_cache
from .sglang_unified import CORES, POLICIES, BothCores, SGLangUnifiedManager, SlidingWindow, unified_profile

PROFILE = unified_profile(
    "FULL + SWA",
    hit="a valid match, at times shorter than the longest: after an SWA tombstone a match needs W live tokens,"
    " one more than the spec's W - 1",
    window="SWA tombstones; an insert over a tombstone adopts the request's new slots (healing); a running"
    " request frees its out-of-window SWA slots at checkpoints (when on, drawn) and in decode; one full pool"
    " and a smaller SWA pool, tied by a full-to-SWA index mapping",
)


def swa_manager(
    page_size: int, num_pages: int, core: str, policy: str, window: int, eagle: bool, out_of_window: bool
) -> SGLangUnifiedManager:
    """SGLang's unified cache with FULL and SWA over the SWA allocator, on one tree core (the SWA component:
    ``SlidingWindow`` in ``sglang_unified.py``)."""
    swa = SlidingWindow.sized(window, num_pages, out_of_window)
    return SGLangUnifiedManager(page_size, num_pages, core, policy, eagle, swa=swa, profile=PROFILE)


def target(argument: str | None) -> TargetInfo:
    """``sglang-swa`` (Rust core), ``:python``, ``:both``."""
    if argument not in CORES:
        raise TargetError(f"sglang-swa takes rust, python or both, got {argument!r}")
    cores = CORES[argument]

    def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> SGLangUnifiedManager | BothCores:
        window = max(2, next((w for w in windows if isinstance(w, int)), 4))
        policy = POLICIES[num_pages % len(POLICIES)]
        eagle = (num_pages // len(POLICIES)) % 2 == 1
        out_of_window = (num_pages // 4) % 2 == 0
        flags = f"{',eagle' if eagle else ''}{',free out of window' if out_of_window else ''}"
        STATS.record_rule(f"sglang-swa.config[P={page_size},W{'<=' if window <= page_size else '>'}P,{policy}{flags}]")
        managers = [swa_manager(page_size, 2 * num_pages, core, policy, window, eagle, out_of_window) for core in cores]
        return managers[0] if len(managers) == 1 else BothCores(managers)

    return TargetInfo(
        name="sglang-swa" if argument is None else f"sglang-swa:{argument}",
        description=f"SGLang {VERSION} UnifiedRadixCache FULL + SWA, {' and '.join(cores)} tree core, SWA allocator",
        requires=(("sglang", f"radixspec targets install sglang  (pip install --no-deps sglang=={VERSION})"),),
        hybrid_factory=factory,
        profile=PROFILE,
        page_sizes=PAGE_SIZES,
        how="the hybrid machine: requests as SGLang's scheduler drives them; the hit, the window, both pools",
        probe=import_unified_cache,
        engine_modules=engine_modules(cores, "swa"),
    )
