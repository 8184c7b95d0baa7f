"""``radixspec replay --target T`` through the engines' request lifecycles (fuzz/lifecycle_replay.py): each engine
serves a trace beside our hybrid manager with the engine's pool and groups. Each replay runs in a process of its own
(SGLang's unified targets do not import where its legacy target's stubs were loaded)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixspec.fuzz import replay

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
# what two rows of one pool size must share to compare at equal pool size
SAME_POOL = ("pool_pages", "page_size", "requests")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    replay.generate(path, requests=300, seed=3)
    return path


def rows_of(trace: Path, tmp_path: Path, *argv: str) -> list[dict[str, object]]:
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "radixspec", "replay", str(trace), "--page-size", "16", *argv, "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return list(json.loads(out.read_text()))


@needs_vllm
def test_vllms_dense_lifecycle_hits_what_ours_hits_at_its_pool(trace: Path, tmp_path: Path) -> None:
    """300 pages draw EAGLE off: vLLM's KVCacheManager and our manager, both LRU over whole pages, hit the same."""
    engine, ours = rows_of(trace, tmp_path, "--target", "vllm", "--lifecycle", "--pool-pages", "300")
    assert engine["config"] == "vllm.dense[eagle=off, defer_free=False]"
    figures = (*SAME_POOL, "too_long", "asked_tokens", "hit_tokens", "pages_in_use", "peak_pages_in_use")
    assert [engine[key] for key in figures] == [ours[key] for key in figures]
    assert 0 < float(str(engine["hit_rate"])) < 1


@needs_sglang
@pytest.mark.parametrize("target", ["sglang:both", "sglang-swa", "sglang-hicache"])
def test_sglangs_lifecycles_replay_beside_ours_at_the_pool_sglang_takes(
    trace: Path, tmp_path: Path, target: str
) -> None:
    """SGLang's adapters take twice the pages asked; ours runs with that pool and SGLang's groups; the tiered cache
    runs its transfers after each request; both tree cores agree on every request (``sglang:both``)."""
    engine, ours = rows_of(trace, tmp_path, "--target", target, "--pool-pages", "64")
    assert engine["pool_pages"] == 128 and [engine[key] for key in SAME_POOL] == [ours[key] for key in SAME_POOL]
    assert str(engine["config"]).startswith(f"{target.split(':')[0]}.config[P=16,")
    assert ours["config"] == ("groups: full, window 4" if target == "sglang-swa" else "groups: full")
    for row in (engine, ours):
        assert 0 < float(str(row["hit_rate"])) < 1 and 0 < int(str(row["peak_pages_in_use"])) <= 128


TRANSFERS = """
from radixspec.fuzz import replay
from radixspec.fuzz.lifecycle_replay import engine_placer
from radixspec.fuzz.targets import resolve

placer = engine_placer(resolve("sglang-hicache"), 16, 64)
row = replay.replay_trace(placer, replay.read_trace(replay.Path({trace!r})))
print("hit", row.hit_tokens, "in flight", sum(lane.pending for lane in placer.manager.tiers.lanes))
"""


@needs_sglang
def test_hicaches_transfers_all_run_after_each_request(trace: Path) -> None:
    """The replay is the executor of a tiered target's streams: once it ends, no transfer is left in flight."""
    done = subprocess.run(
        [sys.executable, "-c", TRANSFERS.format(trace=str(trace))], capture_output=True, text=True, timeout=600
    )
    hit, in_flight = done.stdout.split()[1::3]
    assert int(hit) > 0 and in_flight == "0", done.stdout + done.stderr[-2000:]
