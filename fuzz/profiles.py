"""Hypothesis settings profiles of our own: ``radixspec-ci`` (deterministic, no database), ``radixspec-dev``,
``radixspec-campaign``, ``radixspec-mutation`` (and ``radixspec-crosshair`` where that backend is installed).

Registering a profile under a name of our own changes nothing for a user: no import of ours loads a profile.
Only our own commands and tests do: ``load_from_env`` (``tests/conftest.py`` calls it) loads the profile named
by ``HYPOTHESIS_PROFILE``, short (``ci``) or full (``radixspec-ci``); under ``CI`` the default is ``ci``.
"""

from __future__ import annotations

import importlib.util
import os

from hypothesis import HealthCheck, Phase, settings

# the prefix of every profile we register: a user's own "ci" or "dev" is never replaced
PREFIX = "radixspec-"
SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]

settings.register_profile(
    PREFIX + "ci",
    derandomize=True,
    database=None,
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=SLOW_OK,
)
settings.register_profile(
    PREFIX + "dev",
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=SLOW_OK,
)
# per batch of a campaign (radixspec fuzz runs batch after batch with new seeds)
CAMPAIGN_EXAMPLES, CAMPAIGN_STEPS = 40, 80
# steps per example of a shallow batch (every other batch of a machine, its first included): short examples
# with no big trees find shallow bugs in seconds, while the deep batches between them grow the big states
SHALLOW_STEPS = 20
settings.register_profile(
    PREFIX + "campaign",
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
    PREFIX + "mutation",
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
        PREFIX + "crosshair", backend="crosshair", deadline=None, database=None, suppress_health_check=SLOW_OK
    )


def profile_name(name: str) -> str:
    """The full name of one of our profiles (``ci`` -> ``radixspec-ci``); any other name as given."""
    ours = PREFIX + name
    try:
        settings.get_profile(ours)
    except Exception:  # InvalidArgument: not one of ours (a user's own profile, taken as named)
        return name
    return ours


def load_from_env() -> str:
    """Load the profile named by HYPOTHESIS_PROFILE (default: ``ci`` under CI, else ``dev``); our commands and
    tests call this, no import does."""
    name = profile_name(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
    settings.load_profile(name)
    return name
