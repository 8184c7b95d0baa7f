"""A campaign on one engine target in a process of its own, with a bug planted by monkeypatch first: the
helper the target tests share (each engine's stubs differ, so each campaign gets a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from radixspec.fuzz.planner_machine import PlannerMachine
from radixspec.fuzz.stats import STATS
from radixspec.fuzz.targets.api import PlannerTarget, TargetInfo

CAMPAIGN = """
import importlib, sys, time
from radixspec.fuzz.targets import resolve
resolve({target!r}, check=False).probe()
{plant}
from radixspec.fuzz.campaign import main
began = time.monotonic()
code = main(["--target", {target!r}, "--seed", "0", "--examples", "{examples}", "--workers", "0", "--quiet",
             "--no-shrink", "--out", {out!r}])
print("exit", code, "after", round(time.monotonic() - began, 1))
"""


def campaign(target: str, plant: str, out: Path, examples: int) -> subprocess.CompletedProcess[str]:
    """``examples`` examples of ``target`` (seed 0, no shrinking) after ``plant`` ran."""
    script = CAMPAIGN.format(target=target, plant=plant, out=str(out), examples=examples)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)


def assert_caught(target: str, law: str, plant: str, out: Path, examples: int) -> None:
    """With ``plant`` in force the campaign fails, naming ``law``, within five minutes."""
    began = time.monotonic()
    done = campaign(target, plant, out, examples)
    assert "exit 1" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert law in done.stdout + done.stderr, done.stdout[-3000:]
    assert time.monotonic() - began < 300


def assert_clean(target: str, out: Path, examples: int) -> None:
    """Without a plant the campaign passes."""
    done = campaign(target, "", out, examples)
    assert "exit 0" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


# a plant: replaces ``old`` by ``new`` (exactly once) in the source of "module:Class.method", in its module
EDIT = """
import inspect, textwrap
module_name, _, where = {name!r}.partition(":")
class_name, _, method = where.rpartition(".")
module = importlib.import_module(module_name)
owner = getattr(module, class_name)
source = textwrap.dedent(inspect.getsource(getattr(owner, method)))
assert source.count({old!r}) == 1, (method, {old!r})
found = {{}}
exec(compile(source.replace({old!r}, {new!r}), module.__file__, "exec"), module.__dict__, found)
setattr(owner, method, found[method])
"""


def edit(name: str, old: str, new: str) -> str:
    """The plant that replaces ``old`` by ``new`` in method ``name`` ("module:Class.method")."""
    return EDIT.format(name=name, old=old, new=new)


class DrivenPlanner(PlannerMachine):
    """The planner machine over one planner built by the test, its rules called by hand."""

    def __init__(self, info: TargetInfo, target: PlannerTarget) -> None:
        super().__init__()
        self.IMPLS = (info,)
        self.configure(draw=0)
        self.target, self.page_size = target, target.page_size

    def serve(self, tokens: list[int], wanted: int = 1, late: bool = False) -> int:
        """Submit one request and run plans until it finished; its hit (its first chunk's start)."""
        self.submit(prompt=(16, 1.0, tokens, wanted))
        name = f"r{self.serial}"
        hit = None
        for _ in range(32):
            plan = self.target.plan()
            for one in plan.passes:
                if one.request == name and one.extend and hit is None:
                    hit = one.start
            self.run(plan, late=late)
            for transfer in list(self.in_flight):
                self.report_transfer(transfer, fail=False)
            self.after_step()
            if name not in self.requests:
                assert hit is not None
                return hit
        raise AssertionError(f"{name} did not finish")


def driven(name: str, target: object) -> DrivenPlanner:
    """The planner machine over ``target``, a planner of the target named ``name``, its rules called by hand."""
    from radixspec.fuzz.targets import resolve

    return DrivenPlanner(resolve(name, check=False), target)  # type: ignore[arg-type]


def load_after_eviction(machine: DrivenPlanner) -> tuple[int, int, int, int]:
    """A prefix of 12 tokens served twice, evicted from the device by a longer prompt, then served again: the three
    hits, and how many loads the last one took (its KV checked at the forward)."""
    shared = list(range(1, 13))
    first, second = machine.serve([*shared, 50]), machine.serve([*shared, 60])
    machine.serve(list(range(200, 230)))
    loads = STATS.rules["planner.transfer[load]"]
    third = machine.serve([*shared, 70])
    machine.teardown()
    return first, second, third, STATS.rules["planner.transfer[load]"] - loads
