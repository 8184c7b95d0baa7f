"""``radixspec engine-run``: a serving workload through the Engine, with throughput and latency."""

from __future__ import annotations

import re

import pytest

from radixspec.fuzz import engine_run


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_a_run_reports_throughput_and_latency_percentiles(impl: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_run.main(["--impl", impl, "--requests", "12", "--num-pages", "256"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"requests 12,", out), out
    assert re.search(r"throughput: \d+ prompt tokens/s, \d+ generated tokens/s, [\d.]+ requests/s", out), out
    ttft = re.search(r"time to first token: p50 ([\d.]+) ms  p90 ([\d.]+) ms  p99 ([\d.]+) ms", out)
    latency = re.search(r"request latency: +p50 ([\d.]+) ms  p90 ([\d.]+) ms  p99 ([\d.]+) ms", out)
    assert ttft and latency, out
    first = [float(x) for x in ttft.groups()]
    last = [float(x) for x in latency.groups()]
    assert first == sorted(first) and last == sorted(last)
    assert all(a <= b for a, b in zip(first, last, strict=True))  # a request's last token never precedes its first
    assert "cache: matches" in out


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--page-size", "0"], ["--num-pages", "-3"]])
def test_bad_sizes_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        engine_run.main(argv)
    assert exit_info.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_every_option_is_described_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engine_run.main(["--help"])
    help_text = capsys.readouterr().out
    for option in ("--impl", "--requests", "--seed", "--page-size", "--num-pages", "--max-running-reqs", "--cache"):
        line = help_text[help_text.index(f"\n  {option}") + 1 :].split("\n  -", 1)[0]
        assert "default:" in line, option


def test_percentiles_take_the_nearest_rank() -> None:
    assert engine_run.percentiles([0.001 * i for i in range(1, 101)]) == "p50 50.0 ms  p90 90.0 ms  p99 99.0 ms"
    assert engine_run.percentiles([0.002]) == "p50 2.0 ms  p90 2.0 ms  p99 2.0 ms"
