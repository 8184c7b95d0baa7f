"""``radixspec engine-run``: run an Engine on a synthetic serving workload and print its stats line.

Requests share a few system prompts and few-shot blocks, then differ in a
random suffix; some share a namespace (tenant). The run checks every KV
read (HashModel) and the page accounting at the end.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence

from radixspec import optimized, reference
from radixspec.spec.errors import CacheError
from radixspec.spec.requests import RequestSpec, SchedulerConfig, StepReport

from .cli import DefaultsShown


def shared_prompt_workload(requests: int, seed: int = 0) -> list[RequestSpec]:
    """``requests`` prompts: one of 4 system prompts + one of 8 few-shot blocks + a 4..48-token suffix."""
    rnd = random.Random(seed)
    systems = [[rnd.randrange(1, 32_000) for _ in range(rnd.choice([128, 256, 384]))] for _ in range(4)]
    shots = [[rnd.randrange(1, 32_000) for _ in range(64)] for _ in range(8)]
    workload = []
    for uid in range(requests):
        prompt = (
            rnd.choice(systems) + rnd.choice(shots) + [rnd.randrange(1, 32_000) for _ in range(rnd.randrange(4, 48))]
        )
        namespace = rnd.choice([None, None, ("tenant", "a"), ("lora", 7)])
        workload.append(RequestSpec(uid, prompt, max_tokens=rnd.randrange(1, 64), namespace=namespace))
    return workload


class RequestClock:
    """Wall-clock times of every request, from the run's start: first token (TTFT) and last token (latency)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def on_step(self, report: StepReport) -> None:
        now = time.perf_counter() - self.start
        for uid, _token, _finished in report.processed:
            self.first.setdefault(uid, now)
            self.last[uid] = now


def percentiles(values: list[float], points: Sequence[int] = (50, 90, 99)) -> str:
    """'p50 X ms  p90 Y ms  p99 Z ms' of ``values`` in seconds (nearest rank)."""
    ordered = sorted(values)
    parts = []
    for point in points:
        rank = max(0, min(len(ordered) - 1, -(-point * len(ordered) // 100) - 1))
        parts.append(f"p{point} {1000 * ordered[rank]:.1f} ms")
    return "  ".join(parts)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixspec engine-run", description=__doc__, formatter_class=DefaultsShown)
    parser.add_argument("--impl", choices=["reference", "optimized"], default="reference", help="which Engine runs")
    parser.add_argument("--requests", type=positive_int, default=1000, help="requests in the workload (all at t=0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (P)")
    parser.add_argument("--num-pages", type=positive_int, default=512, help="pages in the KV pool")
    parser.add_argument(
        "--max-running-reqs", type=positive_int, default=32, help="requests decoding at once (page-table rows)"
    )
    parser.add_argument("--overlap", action="store_true", help="the overlap loop (batch k+1 scheduled before k ends)")
    parser.add_argument("--cache", choices=["radix", "naive"], default="radix", help="prefix cache (naive: no sharing)")
    args = parser.parse_args(argv)
    config = SchedulerConfig(
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_running_reqs=args.max_running_reqs,
        max_seq_len=1024,
        max_extend_tokens=2048,
        cache_type=args.cache,
        overlap=args.overlap,
    )
    try:
        engine = reference.Engine(config) if args.impl == "reference" else optimized.Engine(config)
    except CacheError as exc:  # sizes outside the domains (a page past 2**31 slots, ...): the options' fault
        parser.error(str(exc))
    workload = shared_prompt_workload(args.requests, args.seed)
    clock = RequestClock()
    result = engine.generate(workload, on_step=clock.on_step)
    elapsed = time.perf_counter() - clock.start
    s = result.stats
    print(
        f"{args.impl} {args.cache} P={args.page_size} pages={args.num_pages} overlap={args.overlap}:"
        f" requests {s.admitted}, steps {s.steps} (prefill {s.prefill_batches}, decode {s.decode_batches}),"
        f" prompt tokens {s.prompt_tokens}, prefix hits {s.prefix_hit_tokens} (hit rate {100 * s.hit_rate:.1f}%),"
        f" generated {s.generated_tokens}, evicted pages {result.evicted_pages},"
        f" peak pages in use {s.peak_pages_in_use}/{args.num_pages}, {elapsed:.1f} s"
    )
    print(
        f"throughput: {s.prompt_tokens / elapsed:.0f} prompt tokens/s, {s.generated_tokens / elapsed:.0f} generated"
        f" tokens/s, {len(clock.last) / elapsed:.1f} requests/s (wall clock of this process, CPU HashModel)"
    )
    print(f"time to first token: {percentiles(list(clock.first.values()))}  (all requests arrive at t=0)")
    print(f"request latency:     {percentiles(list(clock.last.values()))}")
    c = result.cache.total
    print(
        f"cache: matches {c.match_requests} (hit {100 * c.request_hit_rate:.1f}%), tokens hit"
        f" {100 * c.token_hit_rate:.1f}%, pages stored {c.pages_stored}, evicted {c.pages_evicted},"
        f" mean eviction age {result.cache.mean_eviction_age:.1f} operations"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
