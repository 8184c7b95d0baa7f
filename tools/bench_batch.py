"""One machine's throughput inside any tree, the batch's shape held fixed (run by ``tools.bench_compare``).

A campaign's steps per second depend on how it shapes its batches as well as on how fast the machine runs: since
the campaign alternates shallow batches (20-step examples) with deep ones, the same command does fewer steps per
example, and the per-example set-up weighs more. To compare the fuzzer's speed across trees, this driver runs
the tree's own ``run_batch`` with one batch spec, the same in both trees: one machine beside the spec on the
reference and optimized implementations, ``--examples`` examples of ``--steps`` steps, ``--seed``, no shrinking,
no shallow batch; a short batch first warms the imports and Hypothesis up (not timed).

It imports only the standard library and the tree's fuzz package (``--package``: ``radixspec.fuzz``, or ``fuzz`` in
a tree from before the move), so ``bench_compare`` runs it as ``python -c SOURCE`` from the tree's root, that
tree's modules first. It prints one JSON line: steps, examples, seconds, steps_per_s.

    python tools/bench_batch.py --package radixspec.fuzz --machine manager --examples 100
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

IMPLEMENTATIONS = ("reference", "optimized")


def batch_spec(batches: Any, machine: str, seed: int, examples: int, steps: int) -> Any:
    """The tree's BatchSpec for a deep batch of ``machine`` on our implementations, by its own fields (a tree
    from before the targets joined the implementations names them ``impls`` and ``target``)."""
    now = time.time()
    values: dict[str, object] = {
        "machine": machine,
        "targets": IMPLEMENTATIONS,
        "impls": IMPLEMENTATIONS,
        "target": None,
        "lru": None,
        "device": "cpu",
        "seed": seed,
        "examples": examples,
        "steps": steps,
        "shrink": False,
        "start": now,
        "deadline": now + 24 * 3600,
        "database": None,
        "shallow": False,
    }
    fields = {field.name for field in dataclasses.fields(batches.BatchSpec)}
    return batches.BatchSpec(**{name: value for name, value in values.items() if name in fields})


class Counted:
    """Hypothesis's own steps: it checks a machine's invariants once after each rule it runs (and once after the
    initialize rules), whatever the machine counts as a step in its statistics (a rule may count several)."""

    steps = 0

    @classmethod
    def install(cls) -> None:
        from hypothesis.stateful import RuleBasedStateMachine

        check = RuleBasedStateMachine.check_invariants

        def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
            cls.steps += 1
            return check(self, *args, **kwargs)

        RuleBasedStateMachine.check_invariants = counting  # type: ignore[method-assign]


def run(batches: Any, machine: str, seed: int, examples: int, steps: int) -> tuple[Any, float, int]:
    """One batch: its result, its wall seconds and Hypothesis's steps; a batch that broke or failed is an error
    (exit 1)."""
    Counted.steps = 0
    start = time.perf_counter()
    result = batches.run_batch(batch_spec(batches, machine, seed, examples, steps))
    seconds = time.perf_counter() - start
    error = getattr(result, "error", None)
    if error is not None or result.failures:
        what = error or result.failures[0].error
        raise SystemExit(f"bench_batch: the {machine} machine's batch did not run clean: {what}")
    return result, seconds, Counted.steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="radixspec.fuzz", help="the tree's fuzz package")
    parser.add_argument("--machine", required=True)
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--steps", type=int, default=80, help="steps per example (the campaigns' deep batches: 80)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.examples < 1 or args.steps < 1:
        parser.error("--examples and --steps must be >= 1")
    batches = importlib.import_module(f"{args.package}.batches")
    Counted.install()
    run(batches, args.machine, args.seed + 1, 2, args.steps)  # warm-up: imports, Hypothesis, the C modules
    result, seconds, steps = run(batches, args.machine, args.seed, args.examples, args.steps)
    figures = {"steps": steps, "rules": int(result.stats.steps), "examples": int(result.stats.examples)}
    print(json.dumps({**figures, "seconds": round(seconds, 3), "steps_per_s": round(steps / max(seconds, 1e-9), 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
