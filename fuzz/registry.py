"""Every state machine, by name: the one list that the CLI (``--machine``), the campaign, the backends, the
sanitizer (``tools/sanitize.py``) and the docs read. Adding a machine is one entry here plus its module.

Light: it names the machines' modules without importing them (the kv and scheduler machines import torch; a
campaign over a pure-Python target imports neither), and our implementations come from
``fuzz/targets/ours.py``, which imports no torch either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .targets.api import TargetInfo
from .targets.ours import HYBRID_IMPLEMENTATIONS, IMPLEMENTATIONS

# what a machine drives beside the spec, and so how machine_for configures it (the router machine: routers with a
# ``router_factory`` as ROUTERS, beside ours, over workers that are the selected caches or ours, as WORKERS):
# "layer": any target that has its ``layer`` (a TargetInfo factory), as TARGETS (TargetInfo objects) with an LRU
#          mode; "ours": our implementations only, by name, as IMPLS; "device": the optimized layer on a device,
#          as DEVICE; "hybrid": our hybrid twins and targets with a hybrid factory, as IMPLS
DRIVES = ("layer", "ours", "device", "hybrid", "router")


@dataclass(frozen=True)
class MachineEntry:
    """One machine: where its class lives, what it drives, and one line on what it checks."""

    name: str
    module: str
    attribute: str
    drives: str
    # for drives == "layer": the TargetInfo attribute a target needs (cache_factory, manager_factory)
    layer: str | None
    what: str

    def can_drive(self, names: Sequence[str], foreign: Mapping[str, TargetInfo]) -> bool:
        """Whether it drives every selected target (``names``; ``foreign``: those not ours, resolved)."""
        if self.drives == "layer":
            return all(getattr(info, str(self.layer)) is not None for info in foreign.values())
        if self.drives == "hybrid":
            return all(
                name in HYBRID_IMPLEMENTATIONS or (name in foreign and foreign[name].hybrid_factory is not None)
                for name in names
            )
        if self.drives == "router":
            # routers selected, over workers: the selected caches that take the caller's pages and evict and reset on
            # request (ours, SGLang's legacy RadixCache, a user's), else both of ours
            return any(info.router_factory is not None for info in foreign.values()) and all(
                info.router_factory is not None or serves_as_worker(info) for info in foreign.values()
            )
        return not foreign  # "ours" and "device": our implementations only


def _entry(name: str, attribute: str, drives: str, what: str, layer: str | None = None) -> MachineEntry:
    assert drives in DRIVES and (layer is not None) == (drives == "layer"), name
    return MachineEntry(name, f"radixspec.fuzz.{name}_machine", attribute, drives, layer, what)


# in the order a campaign cycles through them
MACHINES: dict[str, MachineEntry] = {
    entry.name: entry
    for entry in (
        _entry("cache", "CacheMachine", "layer", "prefix caches against the spec", layer="cache_factory"),
        _entry("manager", "ManagerMachine", "layer", "cache managers against the spec's relations", "manager_factory"),
        _entry("scheduler", "SchedulerMachine", "ours", "schedulers (overlap, aborts) against a no-sharing run"),
        _entry("kv", "KVStoreMachine", "device", "the KV pool's store against a model of it"),
        _entry("hybrid", "HybridMachine", "hybrid", "hybrid (sliding window) caches against the spec"),
        _entry("hostile", "HostileMachine", "ours", "what a buggy caller passes: a value or a named error"),
        _entry("router", "RouterMachine", "router", "a router's index of many workers against their caches"),
    )
}


def serves_as_worker(info: TargetInfo) -> bool:
    """Whether a cache target can be a worker of the router machine: it takes the caller's pages, and a small one
    shows its pages, evicts and resets on request and emits KV events (built here, as ``check_methods`` does)."""
    from .targets.api import CacheCapabilities

    profile = info.profile
    if info.cache_factory is None or profile.slots != "caller" or profile.eviction_trigger != "evict":
        return False
    try:
        caps = CacheCapabilities.of(info.cache_factory(info.page_sizes[0] if info.page_sizes else 1, 16))
    except Exception:  # a factory that cannot build here: not a worker (resolve reports why)
        return False
    return all((caps.pages, caps.evicts, caps.resets, caps.events))


def machines_for(names: Sequence[str], foreign: Mapping[str, TargetInfo]) -> list[str]:
    """The machines that drive every selected target, in the registry's order."""
    return [name for name, entry in MACHINES.items() if entry.can_drive(names, foreign)]


__all__ = ["HYBRID_IMPLEMENTATIONS", "IMPLEMENTATIONS", "MACHINES", "MachineEntry", "machines_for"]
