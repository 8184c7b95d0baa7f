"""Differential fuzzing: Hypothesis state machines drive the spec and the implementations together.

``python -m fuzz`` runs a campaign; ``fuzz.profiles`` registers the
``ci``, ``dev`` and ``campaign`` settings profiles on import.
"""

from . import profiles

__all__ = ["profiles"]
