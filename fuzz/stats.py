"""Counters a campaign reports: volume (examples, steps, rules, rejections) and reach (how big the states got).

A campaign is only as good as the states it reaches, so beside the volume
every run reports its reach: the largest tree, the longest key, the deepest
path, the busiest eviction, the largest KV store batch. Batches run in many
processes; each returns its counters and the campaign merges them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

# reach counters: the campaign keeps the maximum over batches
REACH = (
    "largest_tree_pages",
    "longest_key_tokens",
    "deepest_path_nodes",
    "most_evictable_leaves",
    "largest_evict_pages",
    "largest_store_rows",
    "most_namespaces",
)


@dataclass
class CampaignStats:
    """What the state machines did, summed over every example they ran (shrinking included)."""

    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    # rejected calls by error class: a rejection on which every implementation agreed
    rejected: Counter[str] = field(default_factory=Counter)
    # invalid calls not sent to a target that does not validate (its profile's errors == "none"), by kind
    skipped: Counter[str] = field(default_factory=Counter)
    evicted_pages: int = 0
    # KV events replayed against the cache they describe (ours and the targets' that emit them)
    events_replayed: int = 0
    # reach
    largest_tree_pages: int = 0
    # tokens of the longest sequence matched or inserted
    longest_key_tokens: int = 0
    # radix nodes on the longest root path of a tree (when an implementation can tell)
    deepest_path_nodes: int = 0
    # evictable leaf pages at once, when an eviction ran (the eviction heap's load)
    most_evictable_leaves: int = 0
    # pages one evict() call took
    largest_evict_pages: int = 0
    # rows of the largest KV store batch driven
    largest_store_rows: int = 0
    # namespaces holding pages at once
    most_namespaces: int = 0

    def record_rule(self, name: str) -> None:
        """Count one step of rule ``name``."""
        self.steps += 1
        self.rules[name] += 1

    def record_rejection(self, error: type[BaseException]) -> None:
        """Count one call that every implementation rejected with ``error``."""
        self.rejected[error.__name__] += 1

    def record_tree(self, pages: int) -> None:
        """Note the size of a tree seen after a step."""
        self.largest_tree_pages = max(self.largest_tree_pages, pages)

    def record_store(self, rows: int) -> None:
        """Note the size of a KV store batch."""
        self.largest_store_rows = max(self.largest_store_rows, rows)

    def record_reach(self, **values: int) -> None:
        """Raise any reach counter to ``values`` (names from REACH)."""
        for name, value in values.items():
            assert name in REACH, name
            if value > getattr(self, name):
                setattr(self, name, value)

    def merge(self, other: CampaignStats) -> None:
        """Add ``other``'s counts; keep the larger reach."""
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if item.name in REACH:
                setattr(self, item.name, max(mine, theirs))
            elif isinstance(mine, Counter):
                mine.update(theirs)
            else:
                setattr(self, item.name, mine + theirs)

    def reset(self) -> None:
        """Zero every counter."""
        self.__init__()  # type: ignore[misc]


# One collector per process; a batch resets it and hands a copy back.
STATS = CampaignStats()
