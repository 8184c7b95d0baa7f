"""Hypothesis settings profiles: ``ci`` (deterministic, no database), ``dev``, ``campaign``.

Hypothesis does not read ``HYPOTHESIS_PROFILE`` itself; ``load_from_env``
does (``tests/conftest.py`` calls it). Under ``CI`` the default is ``ci``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
settings.register_profile(
    "campaign",
    max_examples=CAMPAIGN_EXAMPLES,
    stateful_step_count=CAMPAIGN_STEPS,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=SLOW_OK,
)


def load_from_env() -> str:
    """Load the profile named by HYPOTHESIS_PROFILE (default: ``ci`` under CI, else ``dev``)."""
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    settings.load_profile(name)
    return name
