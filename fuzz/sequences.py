"""Token sequences for the state machines: small alphabets, shared prefixes, mismatches inside pages.

A sequence is drawn as a list of page patterns plus a short tail, so that
the same drawn values mean the same thing at every page size and printed
programs replay as they are. The patterns share prefixes of different
lengths, so matches also stop in the middle of a page.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

from hypothesis import strategies as st

from radixspec.spec.domains import NAMESPACE_DEPTH_LIMIT

# page sizes: the common ones often, then any size an engine may pick (not only powers of two)
page_sizes = st.one_of(st.sampled_from([1, 2, 4, 16]), st.integers(1, 128))
NUM_PATTERNS = 8

# draws: which pattern each page follows, and tail tokens (at most P-1 of them are kept)
page_choices = st.lists(st.integers(0, NUM_PATTERNS - 1), max_size=6)
tail_choices = st.lists(st.integers(0, 3), max_size=4)


class Flavor(IntEnum):
    """An int subclass: ``Flavor.ONE == 1``, yet not in the namespace domain."""

    ONE = 1

    def __repr__(self) -> str:
        return f"Flavor.{self.name}"  # pastes back as itself into a regression test


class Tag(str):
    """A str subclass: equal to its text, yet not in the namespace domain."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Tag({str(self)!r})"


# Valid namespaces that lines share often, among them values Python calls equal to invalid ones
# (("lora", 1) == ("lora", True) == ("lora", 1.0)) and near-aliases that must stay apart ("1", b"1").
NAMESPACE_PALETTE = (None, ("lora", 1), ("tenant", "b"), ("lora", "1"), ("lora", b"1"), ((("lora", 1),),), (), (0,))
# the whole domain: str, bytes and int items (any size) and tuples of them, nested
namespace_items = st.recursive(
    st.one_of(st.text(max_size=4), st.binary(max_size=4), st.integers()),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=6,
)
namespaces = st.one_of(
    st.sampled_from(NAMESPACE_PALETTE),
    st.sampled_from(NAMESPACE_PALETTE),
    st.sampled_from(NAMESPACE_PALETTE),
    st.lists(namespace_items, max_size=3).map(tuple),
)


def nested(depth: int) -> tuple[object, ...]:
    """A namespace of ``depth`` nested tuples around one str."""
    namespace: tuple[object, ...] = ("lora",)
    for _ in range(depth - 1):
        namespace = (namespace,)
    return namespace


# outside the domain: every implementation raises InvalidTypeError (a wrong type) or NamespaceDepthError (one
# tuple deeper than the domain's bound) and changes nothing
BAD_NAMESPACES: tuple[object, ...] = (
    nested(NAMESPACE_DEPTH_LIMIT + 1),
    ("lora", True),
    ("lora", 1.0),
    (False,),
    (Flavor.ONE,),
    ("lora", Tag("1")),
    ("lora", None),
    ("lora", ("x", 1.5)),
    "lora",
    ["lora", 1],
    0,
)
bad_namespaces = st.sampled_from(BAD_NAMESPACES)


def page_pattern(choice: int, page_size: int) -> list[int]:
    """Tokens of pattern ``choice`` for one page; patterns differ at the first, middle or last token."""
    p, half = page_size, page_size // 2
    patterns = (
        [0] * p,
        [1] * p,
        [0] * (p - 1) + [1],
        [0] * half + [2] * (p - half),
        [2] + [0] * (p - 1),
        [3] * p,
        [0] * (p - 1) + [2],
        [1] * (p - 1) + [0],
    )
    return patterns[choice]


def distinct_page(index: int, page_size: int) -> list[int]:
    """A page of tokens no pattern uses, different for every ``index`` (branches that never share)."""
    return [10 + index] * page_size


def build_sequence(page_size: int, pages: Sequence[int], tail: Sequence[int], base: Sequence[int] = ()) -> list[int]:
    """``base`` cut to whole pages, then the drawn pages, then a partial page of tail tokens."""
    cut = len(base) - len(base) % page_size
    tokens = list(base[:cut])
    for choice in pages:
        tokens.extend(page_pattern(choice, page_size))
    tokens.extend(list(tail)[: page_size - 1])
    return tokens
