"""``radixspec replay``: traces in, hit rates per pool size out, the same from spec, reference, optimized."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest

from radixspec.fuzz import replay


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    replay.generate(path, requests=300, seed=3)
    return path


def test_the_generator_is_deterministic_and_shares_prefixes(trace: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.jsonl"
    replay.generate(again, requests=300, seed=3)
    assert again.read_bytes() == trace.read_bytes()
    requests = list(replay.read_trace(trace))
    assert len(requests) == 300
    assert {namespace for _, namespace in requests} >= {None, ("tenant", "a"), ("lora", 1)}


def test_spec_reference_and_optimized_give_the_same_figures(trace: Path) -> None:
    rows = []
    for pages in (128, 2048):
        for impl in replay.IMPLS:
            rows.append(replay.replay_ours(impl, 16, pages, replay.read_trace(trace)))
    assert replay.differential(rows) == ""
    small, large = rows[0], rows[3]
    # a bigger pool hits more and evicts less; the small one is full at the end
    assert 0 < small.hit_rate < large.hit_rate < 1 and small.evicted_pages > large.evicted_pages
    assert small.pages_in_use <= small.peak_pages_in_use <= 128 and small.too_long < small.requests


def test_the_differential_names_a_disagreement() -> None:
    base = dict(
        pool_pages=8,
        page_size=1,
        requests=1,
        too_long=0,
        asked_tokens=4,
        hit_rate=0.5,
        request_hit_rate=1.0,
        evicted_pages=0,
        pages_in_use=2,
        peak_pages_in_use=2,
        seconds=0.0,
    )
    rows = [replay.Row(impl="spec", hit_tokens=2, **base), replay.Row(impl="optimized", hit_tokens=3, **base)]
    assert "pool of 8 pages" in replay.differential(rows)


def test_jsonl_namespaces_timestamps_and_mooncake_blocks(tmp_path: Path) -> None:
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(
        '{"tokens": [1, 2], "timestamp": 2, "namespace": ["lora", 1]}\n'
        '{"tokens": [3], "timestamp": 1, "namespace": "tenant"}\n\n'
        '{"tokens": [4]}\n'
    )
    assert list(replay.read_trace(jsonl)) == [([4], None), ([3], ("tenant",)), ([1, 2], ("lora", 1))]
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text('{"timestamp": 0, "input_length": 5, "output_length": 9, "hash_ids": [0, 7]}\n')
    assert replay.detect_format(mooncake) == "mooncake"
    assert list(replay.read_trace(mooncake, block_size=3)) == [([0, 1, 2, 21, 22], None)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"tokens": [1, -2]}', "token ids"),
        ('{"tokens": "12"}', "token ids"),
        ('{"tokens": [1], "namespace": [true]}', ""),
    ],
)
def test_a_malformed_request_is_a_clean_error_naming_its_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(SystemExit) as exit_info:
        replay.main([str(path), "--impl", "spec"])
    assert exit_info.value.code == 2


def test_the_command_line_writes_rows_and_a_plot(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "hit.png"
    argv = [str(trace), "--impl", "all", "--pool-pages", "16,64", "--page-size", "8", "--json", str(rows_path)]
    if importlib.util.find_spec("matplotlib"):
        argv += ["--plot", str(png)]
    assert replay.main(argv) == 0
    rows = json.loads(rows_path.read_text())
    assert [(row["impl"], row["pool_pages"]) for row in rows] == [
        (impl, pages) for pages in (16, 64) for impl in replay.IMPLS
    ]
    assert {"impl", "pool_pages", "hit_rate", "evicted_pages"} <= set(rows[0])
    assert "optimized" in capsys.readouterr().out
    if "--plot" in argv:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # an earlier run's rows on the same plot; a file that is not rows is a clean error
        assert replay.main([*argv[:-2], "--plot", str(png), "--plot-with", str(rows_path)]) == 0
        with pytest.raises(SystemExit):
            replay.main([*argv[:-2], "--plot", str(png), "--plot-with", str(trace)])


@pytest.mark.parametrize("argv", [["missing.jsonl"], ["x", "--pool-pages", "0"], ["x", "--pool-pages", "a,b"], []])
def test_bad_command_lines_are_clean_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        replay.main(argv)
    assert exit_info.value.code == 2


def test_a_long_replay_says_how_far_it_got(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay, "PROGRESS_S", 0.0)
    out = io.StringIO()
    replay.replay_ours("reference", 16, 128, replay.read_trace(trace), progress=out)
    lines = out.getvalue().splitlines()
    assert lines and lines[0].startswith("  ... reference at 128 pages: 256 requests in")


GOOD = json.dumps({"tokens": [1, 2, 3, 4]})
MALFORMED = {
    "not JSON": ("{tokens", "not JSON"),
    "not an object": ("[1, 2]", "a request is a JSON object, got list"),
    "a timestamp that is no number": (json.dumps({"timestamp": "soon", "tokens": [1]}), "'timestamp' must be a number"),
    "hash ids that are strings": (
        json.dumps({"hash_ids": ["a"], "input_length": 4}),
        "hash_ids, a list of ints >= 0",
    ),
    "an input length past the bound": (
        json.dumps({"hash_ids": [1], "input_length": 10**12}),
        "input_length must be an int in [0, 4194304]",
    ),
    "a namespace outside the domain": (json.dumps({"tokens": [1], "namespace": [1.5]}), "namespace"),
}


@pytest.mark.parametrize("line, says", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_line_is_one_line_naming_it_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, says: str
) -> None:
    """Each was a traceback (exit 1), a KeyError, or memory without bound."""
    fmt = "mooncake" if "hash_ids" in line else "jsonl"
    trace = tmp_path / "trace.jsonl"
    # the bad line second: it fails during the replay, not only in the first check
    first = json.dumps({"hash_ids": [1], "input_length": 4}) if fmt == "mooncake" else GOOD
    trace.write_text(f"{first}\n{line}\n")
    try:
        status = replay.main([str(trace), "--impl", "spec", "--format", fmt])
    except SystemExit as exit_:  # a malformed line the first check reads: a usage error of argparse
        status = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert any(f"{trace}:2" in entry and says in entry for entry in err), err


def test_a_huge_mooncake_block_size_expands_only_the_tokens_asked_for(tmp_path: Path) -> None:
    """--block-size 10**9 hung: every block was expanded before the cut to input_length."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"hash_ids": [3, 4], "input_length": 10}) + "\n")
    ((tokens, namespace),) = list(replay.read_trace(trace, "mooncake", 10**9))
    assert tokens == [3 * 10**9 + j for j in range(10)] and namespace is None


def test_a_target_taking_the_callers_slots_without_evict_is_refused_before_any_request() -> None:
    from radixspec.fuzz.targets.api import Profile, TargetError

    class NoEvict:
        profile = Profile("no-evict", slots="caller")

    with pytest.raises(TargetError, match="target no-evict takes the caller's slots but has no evict"):
        replay.Driver("no-evict", NoEvict(), 16)  # type: ignore[arg-type]
    NoEvict.profile = Profile("no-evict", slots="target")
    assert replay.Driver("allocates", NoEvict(), 16).evicts is None  # type: ignore[arg-type]


BAILIAN = [
    {"chat_id": 7, "parent_chat_id": -1, "timestamp": 2.5, "input_length": 20, "output_length": 9, "type": "text",
     "turn": 1, "hash_ids": [5, 9]},
    {"chat_id": 3, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 3, "output_length": 1, "type": "file",
     "turn": 1, "hash_ids": [2]},
]  # fmt: skip


def test_a_bailian_trace_is_told_apart_by_its_chat_ids_and_cut_in_blocks_of_16(tmp_path: Path) -> None:
    trace = tmp_path / "qwen_traceA_blksz_16.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in BAILIAN))
    assert replay.detect_format(trace) == "bailian"
    # by timestamp; block h is the tokens 16h .. 16h + 15, cut to input_length
    assert list(replay.read_trace(trace)) == [
        ([32, 33, 34], None),
        ([*range(80, 96), *range(144, 148)], None),
    ]
    assert list(replay.read_trace(trace, block_size=2))[1][0] == [10, 11, 18, 19]
    assert replay.main([str(trace), "--impl", "spec", "--pool-pages", "8"]) == 0


def test_a_request_lifecycle_target_is_served_request_by_request_beside_ours(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The target is our reference hybrid manager and ours is the optimized one: the same figures, pool by pool."""
    rows_json = tmp_path / "rows.json"
    argv = [str(trace), "--target", "tests.targets.toy:TOY_LIFECYCLE", "--pool-pages", "48,1024", "--json"]
    assert replay.main([*argv, str(rows_json)]) == 0
    rows = json.loads(rows_json.read_text())
    assert [row["impl"] for row in rows] == ["toy-lifecycle", "ours@toy-lifecycle"] * 2
    figures = ("pool_pages", "requests", "too_long", "asked_tokens", "hit_tokens", "pages_in_use", "peak_pages_in_use")
    for engine, ours in (rows[:2], rows[2:]):
        assert [engine[key] for key in figures] == [ours[key] for key in figures]
        assert engine["evicted_pages"] is None and ours["config"] == "groups: full"
    small, large = rows[0], rows[2]
    assert 0 < small["hit_rate"] < large["hit_rate"] < 1 and small["peak_pages_in_use"] <= 48
    assert "ours@toy-lifecycle" in capsys.readouterr().out


def test_a_window_reaches_the_lifecycle_targets_groups_and_ours(trace: Path, tmp_path: Path) -> None:
    rows_json = tmp_path / "rows.json"
    argv = [str(trace), "--target", "tests.targets.toy:TOY_LIFECYCLE", "--pool-pages", "256", "--window", "40"]
    assert replay.main([*argv, "--json", str(rows_json)]) == 0
    engine, ours = json.loads(rows_json.read_text())
    assert ours["config"] == "groups: full, window 40" and engine["hit_tokens"] == ours["hit_tokens"]


def test_a_lifecycle_target_that_loses_pages_stops_the_replay_with_the_law_it_broke(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(trace), "--target", "tests.targets.toy:LEAKY_LIFECYCLE", "--pool-pages", "1024"]
    assert replay.main(argv) == 1
    err = capsys.readouterr().err
    assert "LAW BROKEN: leaky-lifecycle, request 64" in err and "pages_are_partitioned" in err, err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--target", "radixspec-router"], "is a router's index: replay the trace over workers behind it"),
        (["--target", "reference", "--lifecycle"], "--lifecycle: target reference has no request lifecycle"),
        (["--target", "reference", "--window", "8"], "--window: target reference is replayed as a prefix cache"),
    ],
    ids=["router", "lifecycle of a prefix cache", "window of a prefix cache"],
)
def test_a_target_the_replay_cannot_drive_so_is_a_usage_error_naming_what_to_run(
    trace: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        replay.main([str(trace), *argv])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
