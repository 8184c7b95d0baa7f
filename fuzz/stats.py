"""Counters a campaign reports: volume (examples, steps, rules, rejections) and reach (how big the states got).

A campaign is only as good as the states it reaches, so beside the volume
every run reports its reach: the largest tree, the longest key, the deepest
path, the busiest eviction, the largest KV store batch. Batches run in many
processes; each returns its counters and the campaign merges them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

# reach counters: the campaign keeps the maximum over batches; None until a machine records one (a figure a
# machine or target cannot observe is "n/a" in the summary, never a 0 that reads as "reached nothing")
REACH = (
    "largest_tree_pages",
    "longest_key_tokens",
    "deepest_path_nodes",
    "most_evictable_leaves",
    "largest_evict_pages",
    "largest_store_rows",
    "most_namespaces",
    "most_workers",
    "most_router_blocks",
    "most_router_over_pages",
    "most_router_under_pages",
    "longest_router_outage_steps",
    "largest_host_pages",
    "largest_storage_pages",
    "most_transfers_in_flight",
    "most_running_requests",
)


@dataclass
class CampaignStats:
    """What the state machines did, summed over every example they ran (shrinking included)."""

    examples: int = 0
    steps: int = 0
    # rule calls, a rule's calls inside another's included (a burst's requests, each served whole): the steps as they
    # were counted before a burst counted one (82bd808), the unit the fuzzer's earlier speed figures are in
    calls: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    # rejected calls by error class: a rejection on which every implementation agreed
    rejected: Counter[str] = field(default_factory=Counter)
    # invalid calls not sent to a target that does not validate (its profile's errors == "none"), by kind
    skipped: Counter[str] = field(default_factory=Counter)
    evicted_pages: int = 0
    # KV events replayed against the cache they describe (ours and the targets' that emit them)
    events_replayed: int = 0
    # the router machine: removal events relayed to the routers, prompt scores checked against the workers
    router_removals: int = 0
    router_scores_checked: int = 0
    # faults injected on the workers' links, by kind, and those after which the routers were in sync again
    router_faults: Counter[str] = field(default_factory=Counter)
    router_recovered: Counter[str] = field(default_factory=Counter)
    # reach
    largest_tree_pages: int | None = None
    # tokens of the longest sequence matched or inserted
    longest_key_tokens: int | None = None
    # radix nodes on the longest root path of a tree (when an implementation can tell)
    deepest_path_nodes: int | None = None
    # evictable leaf pages at once, when an eviction ran (the eviction heap's load)
    most_evictable_leaves: int | None = None
    # pages one evict() call (or one allocation that evicted, for targets that evict on reuse) took
    largest_evict_pages: int | None = None
    # rows of the largest KV store batch driven
    largest_store_rows: int | None = None
    # namespaces holding pages at once
    most_namespaces: int | None = None
    # workers behind one router, and the pages their router indexed at once
    most_workers: int | None = None
    most_router_blocks: int | None = None
    # while a fault lasted: the largest over- and under-estimate of a worker's score (pages), the longest outage
    most_router_over_pages: int | None = None
    most_router_under_pages: int | None = None
    longest_router_outage_steps: int | None = None
    # the tiered machine: host and storage pages serving copies at once, transfers in flight at once
    largest_host_pages: int | None = None
    largest_storage_pages: int | None = None
    most_transfers_in_flight: int | None = None
    # requests admitted and not yet finished, at once (the machines that drive requests)
    most_running_requests: int | None = None
    # the machines that drive requests: prompt tokens matched, and those the cache already held (the token hit rate)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    # of those, the prompts the workload models shaped (fuzz/workloads.py): the token hit rate of the workload mix
    workload_tokens: int = 0
    workload_hit_tokens: int = 0

    def record_rule(self, name: str) -> None:
        """Count one step of rule ``name`` (and one call: a rule that calls others sets the steps back after)."""
        self.steps += 1
        self.calls += 1
        self.rules[name] += 1

    def record_rejection(self, error: type[BaseException]) -> None:
        """Count one call that every implementation rejected with ``error``."""
        self.rejected[error.__name__] += 1

    def record_tree(self, pages: int) -> None:
        """Note the size of a tree seen after a step."""
        self.record_reach(largest_tree_pages=pages)

    def record_store(self, rows: int) -> None:
        """Note the size of a KV store batch."""
        self.record_reach(largest_store_rows=rows)

    def record_prompt(self, tokens: int, hit: int, workload: bool = False) -> None:
        """A request matched its prompt of ``tokens`` tokens, ``hit`` of them cached already; ``workload``: a prompt
        the workload models shaped."""
        self.prompt_tokens += tokens
        self.hit_tokens += hit
        if workload:
            self.workload_tokens += tokens
            self.workload_hit_tokens += hit

    def record_reach(self, **values: int) -> None:
        """Raise any reach counter to ``values`` (names from REACH); the first value recorded sets it."""
        for name, value in values.items():
            assert name in REACH, name
            setattr(self, name, larger(getattr(self, name), value))

    def merge(self, other: CampaignStats) -> None:
        """Add ``other``'s counts; keep the larger reach."""
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if item.name in REACH:
                setattr(self, item.name, larger(mine, theirs))
            elif isinstance(mine, Counter):
                mine.update(theirs)
            else:
                setattr(self, item.name, mine + theirs)

    def reset(self) -> None:
        """Zero every counter."""
        zero = CampaignStats()
        for item in fields(self):
            setattr(self, item.name, getattr(zero, item.name))


def larger(mine: int | None, theirs: int | None) -> int | None:
    """The larger of two reach figures, either of which may be unrecorded (None)."""
    if mine is None or theirs is None:
        return theirs if mine is None else mine
    return max(mine, theirs)


def shown(value: int | None, unit: str = "") -> str:
    """A reach figure for a human: "n/a" when no machine recorded it."""
    return "n/a" if value is None else f"{value}{unit}"


# One collector per process; a batch resets it and hands a copy back.
STATS = CampaignStats()
