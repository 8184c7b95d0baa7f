"""The layers a target can offer, one record each: the one list that the machines' registry, ``machine_for``, the
target listing, ``check_methods``, ``radixspec.testing``, the pytest plugin and the docs read.

A layer is what a ``TargetInfo`` factory makes (a prefix cache, a cache manager, a request-lifecycle manager, a
router's index) and the machine that drives it. Adding one is a record here, the ``TargetInfo`` field that holds
its factory, and its machine (docs/extending.md, "A layer"). Light: no torch, no machine module imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixspec.spec.hybrid import Window

from .api import CacheManagerTarget, PrefixCacheTarget, TargetInfo

if TYPE_CHECKING:
    from radixspec.reference.hybrid_manager import HybridCache

# what a machine's class attributes are set to for the targets selected (machine_for): name -> value
Attributes = dict[str, object]


@dataclass(frozen=True)
class Layer:
    """One layer: the factory that makes its targets, what they keep, and the machine that drives them."""

    name: str
    # the TargetInfo field that holds the factory
    factory: str
    # the factory's arguments, as the docs and errors name them
    signature: str
    # the protocol its targets keep (check_methods builds one and reads its methods); None: checked by its machine
    protocol: type | None
    # the arguments check_methods builds one small target with, at page size p
    example: Callable[[int], tuple[int, ...]] | None
    # the machine that drives it (a key of fuzz/registry.py's MACHINES)
    machine: str
    # radixspec.testing offers NAME_machine(factory) for it, and the pytest plugin collects it per target
    user: bool
    # our own implementations it takes beside the targets, by name (fuzz/targets/ours.py's IMPLEMENTATIONS)
    ours: Callable[[], Mapping[str, object]]
    # the machine's class attributes for the selected targets (names as --impl / --target take them, or
    # TargetInfo objects), in LRU mode ``lru`` (None: the profiles')
    configure: Callable[[tuple[str | TargetInfo, ...], str | None], Attributes]
    # whether the layer's machine drives these targets: None is the rule of every layer (each selected name is ours
    # or a target with the factory); the router's differs (routers over workers)
    drives: Callable[[Sequence[str], Mapping[str, TargetInfo]], bool] | None = None

    def factory_of(self, info: TargetInfo) -> Callable[..., object] | None:
        found: Callable[..., object] | None = getattr(info, self.factory)
        return found

    def can_drive(self, names: Sequence[str], foreign: Mapping[str, TargetInfo]) -> bool:
        """Whether the layer's machine drives every selected target (``foreign``: those not ours, resolved)."""
        if self.drives is not None:
            return self.drives(names, foreign)
        ours = self.ours()
        return all(
            name in ours or (name in foreign and self.factory_of(foreign[name]) is not None) for name in names
        ) and all(self.factory_of(info) is not None for info in foreign.values())


def infos(targets: tuple[str | TargetInfo, ...]) -> tuple[TargetInfo, ...]:
    from . import resolve

    return tuple(target if isinstance(target, TargetInfo) else resolve(target, check=False) for target in targets)


def exact_layer(targets: tuple[str | TargetInfo, ...], lru: str | None) -> Attributes:
    """The cache and manager machines: every target as TARGETS, in the one profile's LRU mode or strict."""
    found = infos(targets)
    return {"TARGETS": found, "LRU": lru or (found[0].profile.default_lru if len(found) == 1 else "strict")}


def router_layer(targets: tuple[str | TargetInfo, ...], lru: str | None) -> Attributes:
    """The router machine: the routers selected as ROUTERS, over the other targets as WORKERS (else ours)."""
    found = infos(targets)
    workers = tuple(info for info in found if info.router_factory is None)
    attributes: Attributes = {"ROUTERS": tuple(info for info in found if info.router_factory is not None)}
    if workers:
        attributes["WORKERS"] = workers
    return attributes


def drives_routers(names: Sequence[str], foreign: Mapping[str, TargetInfo]) -> bool:
    """Routers selected, over workers: the selected caches that take the caller's pages and evict and reset on
    request (ours, SGLang's legacy RadixCache, a user's)."""
    return any(info.router_factory is not None for info in foreign.values()) and all(
        info.router_factory is not None or serves_as_worker(info) for info in foreign.values()
    )


def serves_as_worker(info: TargetInfo) -> bool:
    """Whether a cache target can be a worker of the router machine: it takes the caller's pages, and a small one
    shows its pages, evicts and resets on request and emits KV events (built here, as ``check_methods`` does)."""
    from .api import CacheCapabilities

    profile = info.profile
    if info.cache_factory is None or profile.slots != "caller" or profile.eviction_trigger != "evict":
        return False
    try:
        caps = CacheCapabilities.of(info.cache_factory(info.page_sizes[0] if info.page_sizes else 1, 16))
    except Exception:  # a factory that cannot build here: not a worker (resolve reports why)
        return False
    return all((caps.pages, caps.evicts, caps.resets, caps.events))


def our_targets() -> Mapping[str, object]:
    from .ours import IMPLEMENTATIONS

    return IMPLEMENTATIONS


def our_hybrid_caches() -> dict[str, Callable[[int, tuple[Window, ...]], HybridCache]]:
    """The hybrid cache factory of each of our implementations that has one, by name (the hybrid machine runs our
    hybrid manager over each)."""
    from .ours import IMPLEMENTATIONS

    return {name: info.hybrid_cache for name, info in IMPLEMENTATIONS.items() if info.hybrid_cache}


def our_tiered_caches() -> dict[str, object]:
    """The tiered cache factory of each of our implementations that has one, by name."""
    from .ours import IMPLEMENTATIONS

    return {name: info.tiered_factory for name, info in IMPLEMENTATIONS.items() if info.tiered_factory}


LAYERS: dict[str, Layer] = {
    layer.name: layer
    for layer in (
        Layer(
            "cache",
            "cache_factory",
            "factory(page_size, num_pages)",
            PrefixCacheTarget,
            lambda p: (p, 16),
            "cache",
            True,
            our_targets,
            exact_layer,
        ),
        Layer(
            "manager",
            "manager_factory",
            "factory(num_pages, page_size, rows, max_seq_len)",
            CacheManagerTarget,
            lambda p: (16, p, 4, 64),
            "manager",
            True,
            our_targets,
            exact_layer,
        ),
        Layer(
            "hybrid",
            "hybrid_factory",
            "factory(page_size, windows, num_pages)",
            None,
            None,
            "hybrid",
            True,
            our_hybrid_caches,
            lambda targets, lru: {"IMPLS": targets},
        ),
        Layer(
            "router",
            "router_factory",
            "factory(page_size)",
            None,
            None,
            "router",
            False,
            dict,
            router_layer,
            drives_routers,
        ),
        Layer(
            "tiered",
            "tiered_factory",
            "factory(page_size, device_pages, host_pages, storage_pages, policy, threshold)",
            None,
            None,
            "tiered",
            False,
            our_tiered_caches,
            lambda targets, lru: {"IMPLS": targets},
        ),
        Layer(
            "offload",
            "offload_factory",
            "factory(capacity, draw)",
            None,
            None,
            "offload",
            False,
            dict,
            lambda targets, lru: {"IMPLS": targets},
        ),
        Layer(
            "planner",
            "planner_factory",
            "factory(draw)",
            None,
            None,
            "planner",
            False,
            dict,
            lambda targets, lru: {"IMPLS": targets},
        ),
    )
}


def layers_of(info: TargetInfo) -> list[Layer]:
    """The layers ``info`` has a factory for, in the registry's order."""
    return [layer for layer in LAYERS.values() if layer.factory_of(info) is not None]


__all__ = ["LAYERS", "Layer", "layers_of", "serves_as_worker"]
