"""Counters a campaign reports: examples, steps, rules hit, rejected calls, tree sizes, evictions."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class CampaignStats:
    """What the state machines did, summed over every example they ran (shrinking included)."""

    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    # rejected calls by error class: a rejection on which every implementation agreed
    rejected: Counter[str] = field(default_factory=Counter)
    evicted_pages: int = 0
    largest_tree_pages: int = 0
    # rows of the largest KV store batch driven
    largest_store_rows: int = 0
    # invalid calls not sent to a target that does not validate (its profile's errors == "none"), by kind
    skipped: Counter[str] = field(default_factory=Counter)

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

    def reset(self) -> None:
        """Zero every counter."""
        self.__init__()  # type: ignore[misc]


# One collector per process; the campaign runner resets and reads it.
STATS = CampaignStats()
