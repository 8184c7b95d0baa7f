"""What the pytest plugin's options set for the machines of ``radixspec.testing``: the plugin writes them when
pytest starts, the machines read them when their test runs (a module of its own, so that neither imports the
other)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Options:
    """What the plugin's options set for every machine of ``radixspec.testing`` (None: the user's settings)."""

    # --radixspec-examples: max_examples of each machine's test
    examples: int | None = None
    # --radixspec-steps: stateful_step_count
    steps: int | None = None
    # --radixspec-seed: every machine draws from this seed (a run reproduces)
    seed: int | None = None
    # --radixspec-out: where a failure's regression file goes
    out: Path = Path("fuzz-failures")
    # --radixspec-shrink-seconds: how long a failure's shrinking may take (Hypothesis's own budget is 300 s)
    shrink_seconds: float = 60.0


# set when pytest starts; radixspec.testing reads it when a machine's test runs
options = Options()
