"""The ``sglang-hicache`` target's names: ``sglang-hicache`` (the Python tree core), ``:rust``, ``:both``, a write
policy, a component beside FULL (``:swa``, ``:mamba``), ``:eagle``; the profile of each, and the configurations an
example draws (write policy, host tier size, storage tier, EAGLE, window, state pool). The cache, its tier and their
checks are in ``sglang_hicache.py`` (and ``sglang_hicache_mamba.py`` for the MAMBA component's host tier)."""

from __future__ import annotations

from radixspec.spec import hybrid as hy

from ..stats import STATS
from .api import TargetError, TargetInfo, mix
from .sglang import VERSION
from .sglang_hicache import (
    HOST_RATIOS,
    LAYOUTS,
    PAGE_SIZES,
    STORAGE,
    STORAGE_CAPACITIES,
    WRITE_POLICIES,
    HostTier,
    import_hicache,
)
from .sglang_hicache_mamba import HostStates, TieredState
from .sglang_modules import engine_modules
from .sglang_unified import CORES, BothCores, SGLangUnifiedManager, SlidingWindow, unified_profile
from .sglang_unified_mamba import drawn_state

PROFILE = unified_profile(
    "FULL",
    hit=(
        "the device hit, then the host hit loaded back whole (init_load_back) when the pages fit; the hit"
        " reported is the device hit plus what was loaded"
    ),
)


MAMBA_PROFILE = unified_profile(
    "FULL + MAMBA",
    hit=(
        "the device hit (a state on the host only counts), then the host hit and the state loaded back whole"
        " (init_load_back) when the pages fit; the hit reported is the device hit plus what was loaded"
    ),
    state=(
        "as sglang-mamba; a node's state backed up to the host pool of states and loaded back into the node's"
        " device slot and the request's own"
    ),
)


SWA_PROFILE = unified_profile(
    "FULL + SWA",
    hit=(
        "the device hit (a window whose SWA KV is on the host only counts), then the host hit and the window's"
        " SWA KV loaded back whole (init_load_back) when the pages fit; the hit reported is the device hit plus"
        " what was loaded"
    ),
    window=(
        "SWA tombstones on each tier: a device tombstone with a host copy of its window is a match boundary the"
        " load back heals; one full pool and a smaller SWA pool, each with a host pool"
    ),
)


SWA_MAMBA_PROFILE = unified_profile(
    "FULL + SWA + MAMBA",
    hit=(
        "the device hit (a window's SWA KV or a state on the host only counts), then the host hit, the window's SWA"
        " KV and the state loaded back whole (init_load_back) when the pages fit; the hit reported is the device hit"
        " plus what was loaded"
    ),
    window=SWA_PROFILE.window,
    state=MAMBA_PROFILE.state,
)


def swa_window(windows: tuple[hy.Window, ...], num_pages: int) -> SlidingWindow:
    """The SWA component with the machine's drawn window (as ``sglang-swa`` takes it), its pool sized against
    ``num_pages`` full pages, freeing out-of-window slots at checkpoints (SGLang's default) or not, drawn."""
    window = max(2, next((w for w in windows if isinstance(w, int)), 4))
    return SlidingWindow.sized(window, num_pages, (num_pages // 4) % 2 == 0)


def tier(
    policy: str,
    ratio: float,
    storage: str | None,
    mamba: bool,
    faults: bool = False,
    capacity: float | None = None,
    layout: str = LAYOUTS[0],
) -> HostTier:
    """HiCache's host tier for one manager; with MAMBA, its host pool of states beside; ``faults``: its storage's
    files fail now and then; ``capacity``: the files' space, in host tiers (None: unbounded); ``layout``: the host
    pools'."""
    built = HostTier(policy, ratio, storage)
    built.storage_faults, built.storage_capacity, built.layout = faults, capacity, layout
    if mamba:
        built.states = HostStates(built)
    return built


def target(argument: str | None) -> TargetInfo:
    """``sglang-hicache`` (the Python tree core), ``sglang-hicache:rust``, ``sglang-hicache:both``; a write policy
    after the core or alone pins it (``sglang-hicache:write_back``, ``sglang-hicache:both,write_through``), else each
    example draws one; ``swa`` or ``mamba`` adds that component (``sglang-hicache:both,mamba``), both FULL + SWA +
    MAMBA (``sglang-hicache:swa,mamba``, as ``_MambaSwaStrategy`` builds it); ``eagle`` runs
    EAGLE in every example (``sglang-hicache:swa,eagle``), else half draw it (not with MAMBA: SGLang keeps raw keys
    there, so the cache is the same)."""
    parts = [] if argument is None else argument.split(",")
    core = next((part for part in parts if part in CORES), None)
    pinned = next((part for part in parts if part in WRITE_POLICIES), None)
    swa, mamba, eagle = "swa" in parts, "mamba" in parts, "eagle" in parts
    if len(parts) != (core is not None) + (pinned is not None) + swa + mamba + eagle:
        raise TargetError(
            f"sglang-hicache takes a core (rust, python or both), a write policy ({', '.join(WRITE_POLICIES)}),"
            f" a component or both (swa: FULL + SWA, mamba: FULL + MAMBA), eagle, or several"
            f" (core,swa,eagle,policy), got {argument!r}"
        )
    if eagle and mamba:
        raise TargetError(
            "sglang-hicache: eagle and mamba do not combine: with a MAMBA component SGLang keys the tree by raw"
            " tokens, so EAGLE changes nothing the cache does"
        )
    cores = ("python",) if core is None else CORES[core]
    profile = SWA_MAMBA_PROFILE if swa and mamba else SWA_PROFILE if swa else MAMBA_PROFILE if mamba else PROFILE

    def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> SGLangUnifiedManager | BothCores:
        policy = pinned or WRITE_POLICIES[num_pages % len(WRITE_POLICIES)]
        ratio = HOST_RATIOS[(num_pages // len(WRITE_POLICIES)) % len(HOST_RATIOS)]
        # the storage tier, in two examples of three (SWA's pages and the states go to files of their own)
        storage = STORAGE[(num_pages // len(WRITE_POLICIES)) % len(STORAGE)]
        if storage == "wait_complete" and (mix(num_pages) >> 21) % 2:
            storage = "timeout"
        # in half of those, one file operation in four fails
        faults = storage is not None and bool((mix(num_pages) >> 17) % 2)
        # in half, the files' space is bounded (SGLang's file evictor): as many pages as the host tier, or half that
        capacity = None if storage is None else STORAGE_CAPACITIES[(mix(num_pages) >> 23) % len(STORAGE_CAPACITIES)]
        window = swa_window(windows, 2 * num_pages) if swa else None
        # EAGLE: the tree keyed by bigrams (is_eagle), its host and storage keys too
        bigrams = not mamba and (eagle or bool((mix(num_pages) >> 13) % 2))
        drawn = f"P={page_size},{policy},host x{ratio}" + ("" if storage is None else f",storage {storage}")
        drawn += ",eagle" if bigrams else ""
        drawn += ",failing files" if faults else ""
        drawn += "" if capacity is None else f",storage cap x{capacity}"
        # the host pools' layout: page-first in half the examples
        layout = LAYOUTS[(mix(num_pages) >> 25) % len(LAYOUTS)]
        drawn += "" if layout == LAYOUTS[0] else f",{layout}"
        if window is not None:
            drawn += f",W{'<=' if window.window <= page_size else '>'}P"
            drawn += ",free out of window" if window.out_of_window else ""
        state = None
        if mamba:
            state, drawn_states = drawn_state(page_size, num_pages)
            drawn += f",{drawn_states}"
        STATS.record_rule(f"sglang-hicache.config[{drawn}]")
        managers = [
            SGLangUnifiedManager(
                page_size,
                2 * num_pages,
                core,
                "lru",
                bigrams,
                swa=window,
                mamba=None if state is None else TieredState(*state),
                tiers=tier(policy, ratio, storage, mamba, faults, capacity, layout),
                profile=profile,
            )
            for core in cores
        ]
        return managers[0] if len(managers) == 1 else BothCores(managers)

    return TargetInfo(
        name="sglang-hicache" if argument is None else f"sglang-hicache:{argument}",
        description=f"SGLang {VERSION} UnifiedRadixCache with HiCache (host tier), {' and '.join(cores)} tree core"
        + (", FULL" + " + SWA" * swa + " + MAMBA" * mamba if swa or mamba else "")
        + (", EAGLE" if eagle else "")
        + (f", {pinned}" if pinned else ""),
        requires=(("sglang", f"radixspec targets install sglang  (pip install --no-deps sglang=={VERSION})"),),
        hybrid_factory=factory,
        executes=True,
        profile=profile,
        page_sizes=PAGE_SIZES,
        how="the hybrid machine with the executor: requests as SGLang's scheduler drives HiCache; the tiers' laws",
        probe=import_hicache,
        engine_modules=engine_modules(cores, *("swa",) * swa, *("mamba",) * mamba, "hicache"),
    )
