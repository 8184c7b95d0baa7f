"""``python -m tools.router_faults``: the fault table of a router behind the router machine's workers.

For each router (``--router``, default ``dynamo`` and ``radixspec-router``) and
each way of receiving batches (``as they arrive``, and ``sequenced + replay``:
the subscriber applies each batch once and in order and fills a gap from the
publisher's kept batches, vLLM's replay convention), the router machine
(``radixspec.fuzz.router_machine``) runs ``--examples`` examples with one fault
each on a worker's link: a batch lost, twice, after the next one, a worker
restarted without the router being told. Per fault kind the table gives how
many were injected; after how many the router's view of that worker was
right again at some step (its pages and every prompt's score, checked); how
each ended: the subscriber in sync again through the replay (the laws are
asserted from then on), a restart the router was told of, or still out when
the example ended (no batch of that worker came after the fault); the
largest over- and under-estimate of that worker's score (pages) while it
lasted, the longest it lasted (steps), and the batches the router refused
meanwhile.
Deterministic (Hypothesis derandomized).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from radixspec.fuzz import router_machine
from radixspec.fuzz.machines import machine_for
from radixspec.fuzz.router_machine import FAULTS, Divergence

MODES = {"as they arrive": False, "sequenced + replay": True}


def measure(router: str, recover: bool, examples: int) -> list[Divergence]:
    """Every fault of ``examples`` examples of the router machine on ``router`` alone."""
    base = machine_for("router", (router,))
    machine = type(base.__name__, (base,), {"RECOVER": recover, "WITH_OURS": False, "FAULT_BUDGET": 1})
    router_machine.DIVERGENCES.clear()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=40,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    return list(router_machine.DIVERGENCES)


def rows(router: str, mode: str, found: list[Divergence]) -> list[str]:
    """The table's lines for one router and mode, a line per fault kind."""
    out = []
    for kind in FAULTS:
        # one fault per example: each is seen alone
        mine = [d for d in found if d.kind == kind]
        if not mine:
            continue
        ended = {how: sum(d.ended == how for d in mine) for how in ("replay", "restart", "open")}
        right = [d.right_after for d in mine if d.right_after is not None]
        out.append(
            f"| {router} | {mode} | {kind} | {len(mine)} | {len(right)} ({100 * len(right) / len(mine):.0f} %)"
            f" | {ended['replay']} | {ended['restart']} | {ended['open']}"
            f" | {max(d.over for d in mine)} | {max(d.under for d in mine)} | {max((d.steps or 0) for d in mine)}"
            f" | {sum(d.refused for d in mine)} |"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.router_faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", action="append", default=None, help="router target (repeatable)")
    parser.add_argument("--examples", type=int, default=200, help="examples per router and mode")
    args = parser.parse_args(argv)
    print(
        "| router | batches applied | fault | injected | router right again | ended: in sync by replay | ended:"
        " restart told | ended: still out at the example's end | most over-estimate (pages) | most under-estimate"
        " (pages) | longest (steps) | batches refused |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for router in args.router or ["dynamo", "radixspec-router"]:
        for mode, recover in MODES.items():
            for line in rows(router, mode, measure(router, recover, args.examples)):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
