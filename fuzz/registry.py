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
from .targets.layers import LAYERS, Layer
from .targets.ours import IMPLEMENTATIONS

# what a machine drives beside the spec, and so how machine_for configures it: a layer of fuzz/targets/layers.py
# (the targets with that layer's factory, and ours), or "ours" (our implementations only, by name, as IMPLS), or
# "device" (the optimized layer on a device, as DEVICE)
DRIVES = ("ours", "device", *LAYERS)


@dataclass(frozen=True)
class MachineEntry:
    """One machine: where its class lives, what it drives, and one line on what it checks."""

    name: str
    module: str
    attribute: str
    drives: str
    what: str

    @property
    def layer(self) -> Layer | None:
        """The layer it drives, if it drives one."""
        return LAYERS.get(self.drives)

    def can_drive(self, names: Sequence[str], foreign: Mapping[str, TargetInfo]) -> bool:
        """Whether it drives every selected target (``names``; ``foreign``: those not ours, resolved)."""
        layer = self.layer
        if layer is not None:
            return layer.can_drive(names, foreign)
        return not foreign  # "ours" and "device": our implementations only


def _entry(name: str, attribute: str, drives: str, what: str) -> MachineEntry:
    assert drives in DRIVES, name
    return MachineEntry(name, f"radixspec.fuzz.{name}_machine", attribute, drives, what)


# in the order a campaign cycles through them
MACHINES: dict[str, MachineEntry] = {
    entry.name: entry
    for entry in (
        _entry("cache", "CacheMachine", "cache", "prefix caches against the spec"),
        _entry("manager", "ManagerMachine", "manager", "cache managers against the spec's relations"),
        _entry("scheduler", "SchedulerMachine", "ours", "schedulers (overlap, aborts) against a no-sharing run"),
        _entry("kv", "KVStoreMachine", "device", "the KV pool's store against a model of it"),
        _entry("hybrid", "HybridMachine", "hybrid", "hybrid (sliding window) caches against the spec"),
        _entry("hostile", "HostileMachine", "ours", "what a buggy caller passes: a value or a named error"),
        _entry("router", "RouterMachine", "router", "a router's index of many workers against their caches"),
        _entry("tiered", "TieredMachine", "tiered", "tiered caches (device, host, storage) against the spec"),
        _entry("offload", "OffloadMachine", "offload", "KV-offloading managers' host tiers against the spec"),
        _entry(
            "planner", "PlannerMachine", "planner", "schedulers that plan their own transfers, executed and checked"
        ),
    )
}
# every layer's machine is in the registry, driving that layer
assert all(MACHINES[layer.machine].drives == layer.name for layer in LAYERS.values())


def machines_for(names: Sequence[str], foreign: Mapping[str, TargetInfo]) -> list[str]:
    """The machines that drive every selected target, in the registry's order."""
    return [name for name, entry in MACHINES.items() if entry.can_drive(names, foreign)]


__all__ = [
    "IMPLEMENTATIONS",
    "MACHINES",
    "MachineEntry",
    "machines_for",
]
