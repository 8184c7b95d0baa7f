"""Load the Hypothesis profile named by HYPOTHESIS_PROFILE (``ci`` under CI) before any test class is built."""

from fuzz.profiles import load_from_env

load_from_env()
