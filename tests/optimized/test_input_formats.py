"""Every input format of the optimized cache (issue 23): the same results, the same errors, as lists in the reference.

Token ids and slots as lists, tuples, int32 / int64 CPU tensors, numpy arrays (int32, int64, other integer
dtypes, strided) and ``array('q' / 'i')``; ``evict(size, out=)``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from radixspec import optimized, reference
from radixspec.spec.errors import CacheError, InvalidTypeError

FORMATS: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "tuple": tuple,
    "int64 tensor": lambda v: torch.tensor(v, dtype=torch.int64),
    "int32 tensor": lambda v: torch.tensor(v, dtype=torch.int32),
    "numpy int64": lambda v: np.array(v, dtype=np.int64),
    "numpy int32": lambda v: np.array(v, dtype=np.int32),
    "numpy strided (converted)": lambda v: np.repeat(np.array(v, dtype=np.int64), 2)[::2],
    "array q": lambda v: array("q", v),
    "array i": lambda v: array("i", v),
}


def run(cache: Any, fmt: Callable[[list[int]], Any]) -> list[object]:
    """A fixed program of inserts, matches and evictions; what each call returned (or raised)."""
    out: list[object] = []

    def call(f: Callable[[], Any]) -> None:
        try:
            result = f()
        except CacheError as exc:
            out.append(type(exc).__name__)
            return
        if hasattr(result, "cached_len") and hasattr(result, "handle"):
            out.append(("insert", int(result.cached_len)))
        elif hasattr(result, "get_matched_indices"):
            out.append(("match", result.cached_len, [int(s) for s in result.get_matched_indices()]))
        else:
            out.append(("evict", [int(s) for s in result]))

    call(lambda: cache.insert_prefix(fmt([1, 2, 3, 4, 5, 6, 7]), fmt([0, 1, 2, 3, 4, 5, 0])))
    call(lambda: cache.insert_prefix(fmt([1, 2, 3, 4, 9, 9]), fmt([0, 1, 2, 3, 8, 9])))
    call(lambda: cache.match_prefix(fmt([1, 2, 3, 4, 5, 6, 8])))
    call(lambda: cache.match_prefix(fmt([1, 2, 3])))
    # bad input: a negative token, a slot past 2**31 - 1 (in an int64 format), a misaligned page, a cached slot
    call(lambda: cache.match_prefix(fmt([1, -2])))
    call(lambda: cache.insert_prefix(fmt([7, 7, 7, 7]), [10, 11, 2**31, 13]))
    call(lambda: cache.insert_prefix(fmt([7, 7, 7, 7]), fmt([11, 12, 13, 14])))
    call(lambda: cache.insert_prefix(fmt([7, 7, 7, 7]), fmt([10, 11, 2, 3])))
    call(lambda: cache.evict(3))
    call(lambda: cache.match_prefix(fmt([1, 2, 3, 4, 9, 9])))
    return out


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_gives_the_reference_results(name: str) -> None:
    expected = run(reference.RadixPrefixCache(2), list)
    cache = optimized.RadixPrefixCache(2)
    assert run(cache, FORMATS[name]) == expected
    cache.check_integrity()


def test_a_numpy_array_of_another_integer_dtype_is_converted() -> None:
    cache = optimized.RadixPrefixCache(1)
    cache.insert_prefix(np.array([5, 6, 7], dtype=np.uint16), np.array([0, 1, 2], dtype=np.uint8))
    assert cache.match_prefix([5, 6, 7]).get_matched_indices().tolist() == [0, 1, 2]


@pytest.mark.parametrize("bad", [np.array([1.0, 2.0]), np.array([[1, 2]]), np.array([True, False]), b"\x01\x02"])
def test_arrays_of_other_values_are_rejected_as_the_spec_rejects_them(bad: object) -> None:
    cache = optimized.RadixPrefixCache(1)
    with pytest.raises(InvalidTypeError):
        cache.insert_prefix(bad, [0, 1])
    with pytest.raises(InvalidTypeError):
        cache.insert_prefix([1, 2], bad)
    assert cache.size_info.evictable_size == 0


def test_evict_into_a_buffer_returns_the_buffer_with_the_slots_in_front() -> None:
    cache = optimized.RadixPrefixCache(2)
    cache.insert_prefix([1, 2, 3, 4], [4, 5, 6, 7])
    cache.insert_prefix([1, 2, 8, 8], [4, 5, 0, 1])
    buffer = torch.full((6,), -1, dtype=torch.int32)
    result = cache.evict(1, out=buffer)
    assert result is buffer
    assert buffer.tolist() == [6, 7, -1, -1, -1, -1]
    assert cache.evict(4, out=buffer)[:4].tolist() == [0, 1, 4, 5]
    cache.check_integrity()


@pytest.mark.parametrize(
    "out",
    [
        torch.empty(1, dtype=torch.int32),
        torch.empty(4, dtype=torch.int64),
        torch.empty(8, dtype=torch.int32)[::2],
        torch.empty(2, 2, dtype=torch.int32),
        [0, 0, 0, 0],
    ],
    ids=["short", "int64", "strided", "2-D", "list"],
)
def test_evict_refuses_a_buffer_it_cannot_fill_and_changes_nothing(out: object) -> None:
    cache = optimized.RadixPrefixCache(2)
    cache.insert_prefix([1, 2, 3, 4], [4, 5, 6, 7])
    before = cache.abstract_state()
    with pytest.raises(InvalidTypeError, match="out must be"):
        cache.evict(3, out=out)  # type: ignore[arg-type]
    assert cache.abstract_state() == before


class Color(int):
    """An int subclass: in the token domain (only bool is not), read through the spec's checks."""


@pytest.mark.parametrize(
    "tokens",
    [[1, True, 3, 4], [1, np.int64(2), 3, 4], [1, 2**63, 3, 4], [1, 2, 3.0, 4], [1, Color(2), 3, 4], (1, -2, 3, 4)],
    ids=["bool", "numpy scalar", "past int64", "float", "int subclass", "negative in a tuple"],
)
def test_a_list_the_c_reader_does_not_take_gets_the_references_answer(tokens: list[Any]) -> None:
    """The list reader takes exact ints only; anything else goes through the spec's checks, as in the reference."""

    def outcome(cache: Any) -> object:
        try:
            return cache.insert_prefix(tokens, [0, 1, 2, 3]).cached_len, cache.match_prefix(tokens).cached_len
        except CacheError as exc:
            return type(exc).__name__

    assert outcome(optimized.RadixPrefixCache(2)) == outcome(reference.RadixPrefixCache(2))


def test_evict_checks_a_kept_buffer_again_when_it_changed() -> None:
    """The last call's buffer is trusted only while it is the same tensor, at the same address, as large."""
    cache = optimized.RadixPrefixCache(1)
    cache.insert_prefix(list(range(1, 9)), list(range(8)))
    buffer = torch.zeros(4, dtype=torch.int32)
    assert cache.evict(2, out=buffer)[:2].tolist() == [6, 7]
    buffer.resize_(1)  # smaller: now too small for two slots
    with pytest.raises(InvalidTypeError, match="out must be"):
        cache.evict(2, out=buffer)
    buffer.resize_(1 << 16)  # larger: moved
    assert cache.evict(2, out=buffer)[:2].tolist() == [4, 5]
    other = torch.zeros(2, dtype=torch.int32)
    assert cache.evict(2, out=other).tolist() == [2, 3]
    assert cache.evict(1, out=buffer)[:1].tolist() == [1]
    cache.check_integrity()
