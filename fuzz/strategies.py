"""Hypothesis strategies a user's own tests can reuse (``radixspec.strategies``): the inputs the machines draw.

    from hypothesis import given
    from radixspec.strategies import page_sizes, prompts

    @given(page_size=page_sizes(), batch=prompts(count=4))
    def test_my_cache_matches_what_it_cached(page_size, batch): ...

Prompts come in batches that share prefixes of every length, also ending inside a page, over a small alphabet,
so that matches, splits and partial pages happen often; namespaces cover the spec's domain (``None``, tuples of
str, bytes and int, nested), including values Python calls equal that must stay apart. Nothing here imports
torch; none of these strategies changes a Hypothesis setting.
"""

from __future__ import annotations

from hypothesis import strategies as st

from radixspec.spec.domains import Namespace
from radixspec.spec.requests import RequestSpec

from .sequences import BAD_NAMESPACES, build_sequence, page_choices, tail_choices
from .sequences import namespaces as _namespaces
from .sequences import page_sizes as _page_sizes

__all__ = ["bad_namespaces", "namespaces", "page_sizes", "prompts", "request_programs", "token_sequences"]


def page_sizes(max_size: int = 128) -> st.SearchStrategy[int]:
    """Page sizes: 1, 2, 4 and 16 often, then any size an engine may pick up to ``max_size`` (not only powers
    of two)."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    return _page_sizes.filter(lambda size: size <= max_size) if max_size < 128 else _page_sizes


def namespaces() -> st.SearchStrategy[Namespace]:
    """Namespaces of the spec's domain: ``None`` and tuples of str, bytes, int (nested), with near-aliases."""
    return _namespaces


def bad_namespaces() -> st.SearchStrategy[object]:
    """Values outside the namespace domain (bools, floats, str and int subclasses, lists): a cache must reject
    each with an input error and change nothing."""
    return st.sampled_from(BAD_NAMESPACES)


def token_sequences(page_size: int, base: list[int] | tuple[int, ...] = ()) -> st.SearchStrategy[list[int]]:
    """One token sequence: ``base`` cut to whole pages, up to six drawn pages, a partial page of tail tokens.
    Sequences drawn at the same page size share prefixes often (a small alphabet of page patterns)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return st.builds(lambda pages, tail: build_sequence(page_size, pages, tail, base), page_choices, tail_choices)


@st.composite
def prompts(draw: st.DrawFn, page_size: int | None = None, count: int = 4) -> tuple[int, list[list[int]]]:
    """``(page_size, [prompt, ...])``: ``count`` prompts of one page size (drawn when None), each extending an
    earlier one or starting afresh, so that they share prefixes of every length."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    size = page_size if page_size is not None else draw(_page_sizes, label="page_size")
    batch: list[list[int]] = []
    for _ in range(count):
        base = draw(st.sampled_from([[], *batch]), label="extends") if batch else []
        batch.append(draw(token_sequences(size, base), label="prompt"))
    return size, batch


@st.composite
def request_programs(
    draw: st.DrawFn, page_size: int | None = None, max_requests: int = 8, with_namespaces: bool = True
) -> tuple[int, list[RequestSpec]]:
    """``(page_size, [RequestSpec, ...])``: a serving workload (what ``Engine.generate`` takes): prompts that
    share prefixes, output lengths, namespaces; uids 0, 1, 2, ..."""
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    size, batch = draw(prompts(page_size, count=draw(st.integers(1, max_requests), label="requests")))
    requests = []
    for uid, tokens in enumerate(batch):
        namespace = draw(_namespaces, label="namespace") if with_namespaces else None
        max_tokens = draw(st.integers(1, 24), label="max_tokens")
        # a prompt has at least one token (the last one is always recomputed for its logits)
        requests.append(RequestSpec(uid, tokens or [7], max_tokens=max_tokens, namespace=namespace))
    return size, requests
