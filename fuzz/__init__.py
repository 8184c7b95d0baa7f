"""Differential fuzzing: Hypothesis state machines drive the spec and the implementations together.

``radixspec fuzz`` runs a campaign; ``radixspec.fuzz.profiles`` registers the
``ci``, ``dev`` and ``campaign`` settings profiles on import.
"""

from . import profiles

__all__ = ["profiles"]
