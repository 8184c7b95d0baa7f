"""Differential fuzzing: Hypothesis state machines drive the spec and the implementations together.

``radixspec fuzz`` runs a campaign; ``radixspec.fuzz.profiles`` registers Hypothesis settings profiles on import
(``radixspec-ci``, ``radixspec-dev``, ``radixspec-campaign``, ``radixspec-mutation``), never loading one: a user's
settings stay theirs.
"""

from . import profiles

__all__ = ["profiles"]
