"""The layers' registry (fuzz/targets/layers.py): one record per TargetInfo factory, each driven by its machine."""

from __future__ import annotations

import dataclasses

from radixspec.fuzz.registry import MACHINES, machines_for
from radixspec.fuzz.targets import resolve
from radixspec.fuzz.targets.api import TargetInfo
from radixspec.fuzz.targets.layers import LAYERS, layers_of
from radixspec.fuzz.targets.ours import IMPLEMENTATIONS


def test_every_factory_of_a_target_is_a_layer_and_every_layer_has_its_machine() -> None:
    factories = {field.name for field in dataclasses.fields(TargetInfo) if field.name.endswith("_factory")}
    assert factories == {layer.factory for layer in LAYERS.values()}
    for layer in LAYERS.values():
        assert MACHINES[layer.machine].drives == layer.name
        assert MACHINES[layer.machine].layer is layer


def test_a_target_has_the_layers_of_its_factories() -> None:
    assert [layer.name for layer in layers_of(IMPLEMENTATIONS["reference"])] == ["cache", "manager", "tiered"]
    assert [layer.name for layer in layers_of(IMPLEMENTATIONS["optimized"])] == ["cache", "manager", "tiered"]
    router = resolve("radixspec-router", check=False)
    assert [layer.name for layer in layers_of(router)] == ["router"]
    only_hybrid = TargetInfo("h", "a user's lifecycle manager", hybrid_factory=lambda p, w, n: None)
    assert [layer.name for layer in layers_of(only_hybrid)] == ["hybrid"]
    # its machine drives it, ours are no hybrid target of that name
    assert machines_for(["h"], {"h": only_hybrid}) == ["hybrid"]
    assert "hybrid" in machines_for(["reference"], {})
    assert "tiered" in machines_for(["reference"], {}) and "tiered" in machines_for(["optimized"], {})
    # a target without a tiered factory is no tiered target
    assert "tiered" not in machines_for(["h"], {"h": only_hybrid})


def test_a_layers_record_configures_its_machine() -> None:
    reference = IMPLEMENTATIONS["reference"]
    attributes = LAYERS["cache"].configure((reference,), None)
    assert attributes == {"TARGETS": (reference,), "LRU": reference.profile.default_lru}
    assert LAYERS["hybrid"].configure(("reference",), None) == {"IMPLS": ("reference",)}
    assert LAYERS["tiered"].configure(("reference",), None) == {"IMPLS": ("reference",)}
    assert LAYERS["router"].configure(("radixspec-router",), None)["ROUTERS"][0].name == "radixspec-router"
