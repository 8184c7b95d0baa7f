"""Hypothesis settings profiles: ``ci`` (deterministic, no database), ``dev``, ``campaign``.

Hypothesis does not read ``HYPOTHESIS_PROFILE`` itself; ``load_from_env``
does (``tests/conftest.py`` calls it). Under ``CI`` the default is ``ci``.
"""

from __future__ import annotations

import importlib.util
import os

from hypothesis import HealthCheck, Phase, settings

SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=SLOW_OK,
)
settings.register_profile(
    "dev",
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=SLOW_OK,
)
# per batch of a campaign (python -m fuzz runs batch after batch with new seeds)
CAMPAIGN_EXAMPLES, CAMPAIGN_STEPS = 40, 80
# steps per example of a shallow batch (every other batch of a machine, its first included): short examples
# with no big trees find shallow bugs in seconds, while the deep batches between them grow the big states
SHALLOW_STEPS = 20
settings.register_profile(
    "campaign",
    max_examples=CAMPAIGN_EXAMPLES,
    stateful_step_count=CAMPAIGN_STEPS,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=SLOW_OK,
)

# tox -e mutation: every mutant runs the tests that reach it; few, deterministic examples keep one mutant's
# run to seconds (the exhaustive checker's tests cover the small states completely), and no shrinking: a
# mutant only needs a failure, and shrinking one took minutes (mutmut then counted a timeout)
settings.register_profile(
    "mutation",
    derandomize=True,
    database=None,
    max_examples=20,
    stateful_step_count=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=SLOW_OK,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


if importlib.util.find_spec("hypothesis_crosshair_provider") is not None:
    # the hypothesis-crosshair backend (the crosshair extra): symbolic inputs for the contracts' tests
    # (tests/spec/test_contracts.py). Not for the state machines: see docs/campaigns.md
    settings.register_profile(
        "crosshair", backend="crosshair", deadline=None, database=None, suppress_health_check=SLOW_OK
    )


def load_from_env() -> str:
    """Load the profile named by HYPOTHESIS_PROFILE (default: ``ci`` under CI, else ``dev``)."""
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    settings.load_profile(name)
    return name
