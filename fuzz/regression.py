"""Failures as runnable regression tests: ``radixspec fuzz`` writes one pytest file per failure.

A generated file rebuilds the machine exactly as the campaign ran it
(``build_machine``) and replays the shrunk program Hypothesis printed, step by
step, with no randomness: ``python -m pytest FILE`` fails the same way until
the bug is fixed. Keep it as a regression test, or move its steps into one of
tests/ by hand.
"""

from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

from hypothesis.stateful import RuleBasedStateMachine

from .machines import machine_for
from .messages import one_line

HEADER = '''"""{title}

Written by radixspec fuzz on {date}: machine {machine}, {driven}, batch seed {seed}{campaign}.
{error}

Replays the {kind} failing program; run it with python -m pytest {name}
"""
{torch}
from radixspec.fuzz.regression import build_machine
from radixspec.fuzz.sequences import Flavor, Tag  # noqa: F401  (drawn namespaces outside the domain)


def test_{function}() -> None:
'''


def build_machine(
    machine: str,
    targets: tuple[str, ...] = ("reference", "optimized"),
    lru: str | None = None,
    device: str = "cpu",
    shallow: bool = False,
    production: bool = True,
) -> type[RuleBasedStateMachine]:
    """The machine class a campaign ran (for a regression file: call it, then replay the steps). ``production``:
    the program's batch was a production batch, whose pools it keeps; False for one of another batch, where a
    production pool drawn ran as a big one (files written before 2026-12-07 name neither: replayed as
    production)."""
    return machine_for(machine, targets, device, lru, shallow, production=production)


def regression_source(
    program: list[str],
    machine: str,
    targets: tuple[str, ...],
    lru: str | None,
    device: str,
    seed: int,
    error: str,
    shrunk: bool,
    name: str,
    reproduce: str = "",
    shallow: bool = False,
    campaign_seed: int | None = None,
    production: bool = False,
) -> str:
    """The text of a pytest file replaying ``program`` (Hypothesis's printed steps)."""
    args = f"{machine!r}, targets={targets!r}, lru={lru!r}, device={device!r}" + (", shallow=True" if shallow else "")
    args += ", production=True" if production else ", production=False"
    steps = []
    for statement in program:
        if re.fullmatch(r"state = \w+\(\)", statement.strip()):
            steps.append(f"state = build_machine({args})()")
        else:
            steps.append(one_line(statement))
    first_line = error.splitlines()[0] if error else "a failure"
    driven = f"targets {', '.join(targets)} (LRU {lru or 'default'})"
    header = HEADER.format(
        title=f"Regression test from a fuzz campaign: {first_line[:90]}",
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=machine,
        driven=driven,
        seed=seed,
        campaign="" if campaign_seed is None else f" (campaign: radixspec fuzz --seed {campaign_seed})",
        error=textwrap.indent(docstring_safe(error), "    "),
        kind="shrunk" if shrunk else "unshrunk",
        name=name,
        function=re.sub(r"\W", "_", Path(name).stem.removeprefix("test_")),
        # only where a drawn value names a torch dtype: a pure-Python target's file does not import torch
        torch="\nimport torch\n" if any("torch." in statement for statement in program) else "",
    )
    if reproduce:
        steps.append(f"# Hypothesis replays the same example with: {reproduce}")
    body = textwrap.indent("\n".join(steps), "    ")
    return f"{header}{body}\n"


def docstring_safe(text: str) -> str:
    """``text`` as it may stand inside a triple-quoted docstring: backslashes and quotes escaped."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def write_regression_test(directory: Path, name: str, source: str) -> Path:
    """Write the file (checked to compile) and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    compile(source, name, "exec")
    path = directory / name
    path.write_text(source)
    return path
