"""``radixspec replay --tiers``: a trace through tiered caches, the hit rate by tier, the same from spec,
reference and optimized."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from radixspec.fuzz import replay
from radixspec.fuzz import tier_replay as tr
from radixspec.fuzz.targets import ours
from radixspec.reference.tiered_cache import TieredRadixCache


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    replay.generate(path, requests=120, seed=3)
    return path


def rows_of(trace: Path, policy: tr.WritePolicy, sizes: list[tuple[int, int, int]]) -> list[tr.TierRow]:
    return [
        tr.replay_tiers(impl, tr.our_tiered_cache(impl), 8, size, policy, replay.read_trace(trace))
        for size in sizes
        for impl in tr.TIER_IMPLS
    ]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_spec_reference_and_optimized_give_the_same_hits_by_tier(trace: Path, policy: tr.WritePolicy) -> None:
    rows = rows_of(trace, policy, [(128, 128, 0), (128, 1024, 0), (128, 256, 2048)])
    assert tr.differential(rows) == ""
    # the first implementation's row at each size
    small, large, stored = rows[:: len(tr.TIER_IMPLS)]
    for row in rows:
        assert row.too_long == 0 and row.asked_tokens > 0
        hits = row.device_hit_tokens + row.host_hit_tokens + row.storage_hit_tokens
        assert row.hit_rate == hits / row.asked_tokens
    # no storage tier, no storage hits; a larger host tier serves more from the host; storage serves
    assert small.storage_hit_tokens == large.storage_hit_tokens == 0
    assert large.host_hit_tokens > small.host_hit_tokens
    assert stored.storage_hit_tokens > 0 and stored.hit_rate > small.hit_rate


def test_the_differential_names_a_disagreement(trace: Path) -> None:
    (row,) = [r for r in rows_of(trace, "write_through", [(128, 256, 0)]) if r.impl == "spec"]
    other = tr.TierRow(**{**row.__dict__, "impl": "reference", "host_hit_tokens": row.host_hit_tokens + 8})
    assert "device/host/storage pages (128, 256, 0)" in tr.differential([row, other])


def test_the_command_line_writes_rows_and_a_plot(trace: Path, tmp_path: Path) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "tiers.png"
    argv = [str(trace), "--tiers", "--pool-pages", "128", "--host-pages", "128,512", "--storage-pages", "0,1024"]
    argv += ["--page-size", "8", "--json", str(rows_path)]
    if importlib.util.find_spec("matplotlib"):
        argv += ["--plot", str(png)]
    assert replay.main(argv) == 0
    rows = json.loads(rows_path.read_text())
    assert [(row["impl"], row["host_pages"], row["storage_pages"]) for row in rows] == [
        (impl, host, storage) for host in (128, 512) for storage in (0, 1024) for impl in tr.TIER_IMPLS
    ]
    if "--plot" in argv:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_reference_that_never_prefetches_fails_the_differential(
    trace: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(TieredRadixCache, "prefetch", lambda self, input_ids, namespace=None: None)
    argv = [str(trace), "--tiers", "--pool-pages", "128", "--host-pages", "256", "--storage-pages", "2048"]
    assert replay.main([*argv, "--page-size", "8"]) == 1
    assert "DIFFERENTIAL FAILED: device/host/storage pages (128, 256, 2048)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra",
    [
        ["--workers", "2"],
        ["--policy", "write_sometimes"],
        ["--storage-pages", "-1"],
        ["--host-pages", "0"],
        ["--target", "no-such-target"],
    ],
)
def test_bad_tier_command_lines_are_clean_errors(trace: Path, extra: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        replay.main([str(trace), "--tiers", *extra])
    assert exit_info.value.code == 2


def test_a_target_without_a_tiered_layer_is_a_clean_error(
    trace: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ours, "OPTIMIZED", dataclasses.replace(ours.OPTIMIZED, tiered_factory=None))
    with pytest.raises(SystemExit) as exit_info:
        replay.main([str(trace), "--tiers", "--target", "optimized"])
    assert exit_info.value.code == 2
    assert "has no tiered layer" in capsys.readouterr().err
