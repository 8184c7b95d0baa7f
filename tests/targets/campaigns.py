"""A campaign on one engine target in a process of its own, with a bug planted by monkeypatch first: the
helper the target tests share (each engine's stubs differ, so each campaign gets a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

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
