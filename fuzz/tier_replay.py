"""``radixspec replay TRACE --tiers``: the hit rate by tier (device, host, storage) against host and storage sizes.

    radixspec replay TRACE --tiers --pool-pages 256 --host-pages 256,1024,4096 --storage-pages 0,16384
                         [--policy write_through] [--impl spec|reference|optimized|all] [--json rows.json]
                         [--plot tiers.png]

Each request of the trace, in order, goes through a tiered cache (``spec/tiers.py``: our spec, reference and
optimized, or a target's tiered layer) as an engine with a host tier and storage serves a prompt: match it; prefetch its
storage hit into the host tier and load its host hit back to the device (the executor completes each transfer
at once, in the order they started); match again; lock the device hit, take device pages for the rest of the
whole pages (under write_back, backing up the pages eviction takes next when the device is short), insert,
unlock; then the executor completes the backups and stores the policy started. A request whose pages the
device cannot hold is counted ``too_long`` and left out.

A row per (device, host, storage) size: the prompt tokens asked, the tokens the device already held (device
hits), those loaded back from the host tier (host hits) and those fetched from storage (storage hits), as
shares of the asked tokens. Ours must give the same rows (``--impl all``: a differential at trace
scale). The plot: the hit rate of all tiers and of the device alone against the host size, a curve per
storage size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, cast

from radixspec.spec.domains import Namespace
from radixspec.spec.errors import EvictionError, InvalidInputError, OutOfPagesError
from radixspec.spec.tiers import WRITE_POLICIES, WritePolicy

from .pools import Request
from .targets.api import TieredCacheTarget

# our tiered caches by name, as --impl names them under --tiers
TIER_IMPLS = ("spec", "reference", "optimized")
# seconds between two progress lines of a long replay (on stderr)
PROGRESS_S = 10.0


@dataclass(frozen=True)
class TierRow:
    """One replay of a trace through a tiered cache of the sizes given (pages of ``page_size`` tokens)."""

    impl: str
    page_size: int
    device_pages: int
    host_pages: int
    storage_pages: int
    policy: str
    requests: int
    too_long: int
    asked_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int
    hit_rate: float
    device_hit_rate: float
    seconds: float


class Executor:
    """Completes every transfer in flight, in the order they started (transfer ids count up from 0)."""

    def __init__(self, cache: TieredCacheTarget) -> None:
        self.cache = cache
        self.next = 0

    def drain(self) -> None:
        """Complete the transfers started since the last drain, and those their completions start."""
        while True:
            try:
                self.cache.complete_transfer(self.next)
            except InvalidInputError:
                return
            self.next += 1


def serve(
    cache: TieredCacheTarget, executor: Executor, p: int, tokens: list[int], namespace: Namespace
) -> tuple[int, ...]:
    """One prompt through the tiered cache (pages of ``p`` tokens); the tokens it found on the device, loaded back
    from the host tier and fetched from storage. OutOfPagesError (nothing cached of it) when the device cannot
    hold its pages."""
    whole = len(tokens) // p * p
    tokens = tokens[:whole]
    first = cache.match_prefix(tokens, namespace)
    match = first
    if first.storage_len > first.host_len or first.host_len > first.device_len:
        if first.storage_len > first.host_len:
            cache.prefetch(tokens, namespace)
            executor.drain()
        # the device may be short: what is not loaded back is computed again
        with contextlib.suppress(OutOfPagesError):
            cache.load_back(tokens, namespace)
        executor.drain()
        match = cache.match_prefix(tokens, namespace)
    served = match.device_len
    cache.lock(match.handle)
    try:
        pages = allocate(cache, executor, (whole - served) // p)
        row = [0] * served + [page + offset for page in pages for offset in range(p)]
        inserted = cache.insert_prefix(tokens, row, namespace)
        cache.free(pages[(inserted.handle.cached_len - served) // p :])
    finally:
        cache.unlock(match.handle)
    executor.drain()
    device = min(first.device_len, served)
    host = max(0, min(first.host_len, served) - device)
    return (device, host, served - device - host)


def allocate(cache: TieredCacheTarget, executor: Executor, num_pages: int) -> list[int]:
    """``num_pages`` device pages. While the device is short (under write_back eviction never drops an unbacked
    page), the leaves eviction takes next are backed up and evicted, and it is asked again; OutOfPagesError
    when nothing more can be evicted."""
    while True:
        try:
            return cache.allocate(num_pages)
        except OutOfPagesError:
            started = cache.write_back(num_pages)
            executor.drain()
            evict_some(cache, len(started) or num_pages)


def evict_some(cache: TieredCacheTarget, most: int) -> None:
    """Evict ``most`` device pages, or half as many, down to one (their parents become leaves); OutOfPagesError
    when none is evictable."""
    while True:
        try:
            cache.evict_device(most)
            return
        except EvictionError as error:
            if most == 1:
                raise OutOfPagesError(f"no device page is evictable: {error}") from error
            most //= 2


def replay_tiers(
    name: str,
    make: Callable[[int, int, int, int, WritePolicy, int], TieredCacheTarget],
    page_size: int,
    sizes: tuple[int, int, int],
    policy: WritePolicy,
    requests: Iterator[Request],
    progress: TextIO | None = None,
) -> TierRow:
    """Every request of the trace through a fresh tiered cache of ``sizes`` (device, host, storage pages)."""
    device_pages, host_pages, storage_pages = sizes
    cache = make(page_size, device_pages, host_pages, storage_pages, policy, 2)
    executor = Executor(cache)
    count = too_long = asked = 0
    hits = [0, 0, 0]
    start = last = time.perf_counter()
    for tokens, namespace in requests:
        count += 1
        if progress is not None and count % 256 == 0 and time.perf_counter() - last >= PROGRESS_S:
            last = time.perf_counter()
            print(f"  ... {name} at {sizes}: {count} requests in {last - start:.0f} s", file=progress, flush=True)
        try:
            found = serve(cache, executor, page_size, tokens, namespace)
        except OutOfPagesError:
            too_long += 1
            continue
        asked += len(tokens) // page_size * page_size
        hits = [total + tier for total, tier in zip(hits, found, strict=True)]
    return TierRow(
        impl=name,
        page_size=page_size,
        device_pages=device_pages,
        host_pages=host_pages,
        storage_pages=storage_pages,
        policy=policy,
        requests=count,
        too_long=too_long,
        asked_tokens=asked,
        device_hit_tokens=hits[0],
        host_hit_tokens=hits[1],
        storage_hit_tokens=hits[2],
        hit_rate=sum(hits) / asked if asked else 0.0,
        device_hit_rate=hits[0] / asked if asked else 0.0,
        seconds=round(time.perf_counter() - start, 3),
    )


def our_tiered_cache(name: str) -> Callable[[int, int, int, int, WritePolicy, int], TieredCacheTarget]:
    """The factory of our tiered cache ``name`` (``TIER_IMPLS``)."""
    from .targets.ours import IMPLEMENTATIONS, SpecTieredCache

    if name == "spec":
        return cast(Callable[[int, int, int, int, WritePolicy, int], TieredCacheTarget], SpecTieredCache)
    factory = IMPLEMENTATIONS[name].tiered_factory
    assert factory is not None, f"{name} has a tiered cache"
    return factory


def differential(rows: Sequence[TierRow]) -> str:
    """Where two caches disagree on the same sizes (ours must not): a sentence, or ''."""
    by_sizes: dict[tuple[int, int, int], dict[str, tuple[int, ...]]] = {}
    for row in rows:
        figures = (row.too_long, row.asked_tokens, row.device_hit_tokens, row.host_hit_tokens, row.storage_hit_tokens)
        by_sizes.setdefault((row.device_pages, row.host_pages, row.storage_pages), {})[row.impl] = figures
    for sizes, by_impl in by_sizes.items():
        if len(set(by_impl.values())) > 1:
            return f"device/host/storage pages {sizes}: {by_impl}"
    return ""


HEADER = (
    f"{'impl':<10} {'device':>7} {'host':>7} {'storage':>8} {'requests':>9} {'hit rate':>9} {'device':>8}"
    f" {'host':>8} {'storage':>8} {'seconds':>8}"
)


def format_row(row: TierRow) -> str:
    def share(tokens: int) -> str:
        return f"{100 * tokens / row.asked_tokens if row.asked_tokens else 0.0:>7.2f}%"

    return (
        f"{row.impl:<10} {row.device_pages:>7} {row.host_pages:>7} {row.storage_pages:>8} {row.requests:>9}"
        f" {100 * row.hit_rate:>8.2f}% {share(row.device_hit_tokens)} {share(row.host_hit_tokens)}"
        f" {share(row.storage_hit_tokens)} {row.seconds:>8.2f}"
    )


def plot(rows: Sequence[TierRow], path: Path) -> None:
    """The hit rate of all tiers and of the device alone against the host size: a curve per (cache, device size,
    storage size)."""
    from .plots import plot_hit_rates

    curves: dict[str, list[tuple[int, float]]] = {}
    devices = {row.device_pages for row in rows}
    for row in rows:
        where = f"{row.impl}, " + (f"device {row.device_pages}, " if len(devices) > 1 else "")
        where += f"storage {row.storage_pages}"
        curves.setdefault(f"{where}: all tiers", []).append((row.host_pages, row.hit_rate))
        curves.setdefault(f"{where}: device", []).append((row.host_pages, row.device_hit_rate))
    page_size = rows[0].page_size
    plot_hit_rates(curves, f"host tier (pages of {page_size} tokens)", path)


def check_policy(text: str) -> WritePolicy:
    """An argparse type: a write policy of spec/tiers.py."""
    for policy in WRITE_POLICIES:
        if text == policy:
            return policy
    import argparse

    raise argparse.ArgumentTypeError(f"a write policy is one of {', '.join(WRITE_POLICIES)}, got {text!r}")
