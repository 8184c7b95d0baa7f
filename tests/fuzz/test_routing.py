"""``radixspec replay --workers N --router POLICY`` (fuzz/routing.py): a trace over N workers behind a router."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from radixspec.fuzz import replay, routing

pytest.importorskip("msgspec")
needs_dynamo = pytest.mark.skipif(importlib.util.find_spec("dynamo") is None, reason="Dynamo is not installed")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    replay.generate(path, requests=400, seed=5)
    return path


def requests(trace: Path) -> replay.Iterator[replay.Request]:
    return replay.read_trace(trace, "jsonl")


def test_one_worker_is_the_single_cache_replay_whatever_the_policy(trace: Path) -> None:
    single = replay.replay_ours("optimized", 16, 64, requests(trace))
    for policy in ("radixspec", "round-robin", "least-loaded"):
        row = routing.route(requests(trace), policy, 1, 64, 16)
        assert (row.requests, row.asked_tokens, row.hit_tokens) == (
            single.requests,
            single.asked_tokens,
            single.hit_tokens,
        )
        assert row.worker_requests == [single.requests]


def test_our_router_predicts_every_hit_and_beats_the_cache_blind_policies(trace: Path) -> None:
    rows = {
        policy: routing.route(requests(trace), policy, 4, 64, 16)
        for policy in ("radixspec", "round-robin", "least-loaded")
    }
    ours = rows["radixspec"]
    # in step with its workers (every batch applied before the next request): predicted exactly
    assert ours.mispredicted_requests == 0 and ours.predicted_tokens == ours.hit_tokens
    assert rows["round-robin"].predicted_tokens is None and rows["round-robin"].request_imbalance == 1.0
    assert ours.hit_rate > 1.5 * max(rows["round-robin"].hit_rate, rows["least-loaded"].hit_rate)
    assert sum(ours.worker_requests) == ours.requests == 400 and len(ours.worker_hit_rates) == 4
    assert ours.request_imbalance == max(ours.worker_requests) / (400 / 4)


def test_a_router_one_batch_behind_mispredicts(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixspec.fuzz.targets import routers

    original = routers.SpecRouter.apply
    held: dict[int, bytes] = {}

    def apply(self: routers.SpecRouter, worker: int, payload: bytes) -> None:
        late = held.pop(worker, None)
        held[worker] = payload
        if late is not None:
            original(self, worker, late)

    monkeypatch.setattr(routers.SpecRouter, "apply", apply)
    row = routing.route(requests(trace), "radixspec", 2, 16, 16)  # small pools: evictions all the time
    assert row.mispredicted_requests and row.predicted_tokens is not None and row.predicted_tokens != row.hit_tokens


@needs_dynamo
def test_dynamo_routes_exactly_as_our_index_does(trace: Path) -> None:
    dynamo = routing.route(requests(trace), "dynamo", 4, 64, 16)
    ours = routing.route(requests(trace), "radixspec", 4, 64, 16)
    assert dynamo.mispredicted_requests == 0
    assert (dynamo.worker_requests, dynamo.hit_tokens, dynamo.worker_pages) == (
        ours.worker_requests,
        ours.hit_tokens,
        ours.worker_pages,
    )


def test_the_command_line_prints_a_row_per_policy_and_n_and_writes_json_and_a_plot(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "hit.png"
    argv = [
        str(trace),
        "--workers",
        "1,2",
        "--router",
        "radixspec,round-robin",
        "--pool-pages",
        "64",
        "--json",
        str(rows_path),
    ]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(png)]
    assert replay.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("radixspec ") == 2 and out.count("round-robin ") == 2
    rows = json.loads(rows_path.read_text())
    assert [(row["policy"], row["workers"]) for row in rows] == [
        ("radixspec", 1),
        ("round-robin", 1),
        ("radixspec", 2),
        ("round-robin", 2),
    ]
    if "--plot" in argv:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "extra",
    [["--router", "random"], ["--impl", "spec"], ["--target", "vllm"], ["--workers", "0"]],
    ids=["unknown policy", "with --impl", "with --target", "no workers"],
)
def test_bad_routing_command_lines_are_clean_errors(trace: Path, extra: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        replay.main([str(trace), "--workers", "2", *extra])
    assert exit_info.value.code == 2
