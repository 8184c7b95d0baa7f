"""Hypothesis strategies for a user's own tests: the inputs radixspec's machines draw (see
``radixspec.fuzz.strategies``, where they are defined)."""

from radixspec.fuzz.strategies import (
    bad_namespaces,
    namespaces,
    page_sizes,
    prompts,
    request_programs,
    token_sequences,
)

__all__ = ["bad_namespaces", "namespaces", "page_sizes", "prompts", "request_programs", "token_sequences"]
