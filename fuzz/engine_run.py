"""``python -m fuzz.engine_run``: run an Engine on a synthetic serving workload and print its stats line.

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

import optimized
import reference
from spec.types import RequestSpec, SchedulerConfig


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.engine_run", description=__doc__)
    parser.add_argument("--impl", choices=["reference", "optimized"], default="reference")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=512)
    parser.add_argument("--max-running-reqs", type=int, default=32)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--cache", choices=["radix", "naive"], default="radix")
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
    engine = reference.Engine(config) if args.impl == "reference" else optimized.Engine(config)
    start = time.perf_counter()
    result = engine.generate(shared_prompt_workload(args.requests, args.seed))
    s = result.stats
    print(
        f"{args.impl} {args.cache} P={args.page_size} pages={args.num_pages} overlap={args.overlap}:"
        f" requests {s.admitted}, steps {s.steps} (prefill {s.prefill_batches}, decode {s.decode_batches}),"
        f" prompt tokens {s.prompt_tokens}, prefix hits {s.prefix_hit_tokens} (hit rate {100 * s.hit_rate:.1f}%),"
        f" generated {s.generated_tokens}, evicted pages {result.evicted_pages},"
        f" peak pages in use {s.peak_pages_in_use}/{args.num_pages}, {time.perf_counter() - start:.1f} s"
    )
    c = result.cache.total
    print(
        f"cache: matches {c.match_requests} (hit {100 * c.request_hit_rate:.1f}%), tokens hit"
        f" {100 * c.token_hit_rate:.1f}%, pages stored {c.pages_stored}, evicted {c.pages_evicted},"
        f" mean eviction age {result.cache.mean_eviction_age:.1f} operations"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
