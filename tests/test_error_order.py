"""The order of the input checks (docs/semantics.md, "The order of the checks"): a call with several faults
raises the error of the first check in that order, the same class from the spec, the reference and the
optimized cache, and changes nothing. The differential compares error classes, so this order is part of the
contract."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from radixspec import optimized, reference
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import (
    DuplicateSlotError,
    EvictionError,
    InvalidInputError,
    InvalidSizeError,
    InvalidTypeError,
    LengthMismatchError,
    MisalignedPageError,
    SlotOutOfRangeError,
    StaleHandleError,
)

P = 2
BAD_TOKEN, BAD_SLOT, BAD_NAMESPACE = -1, -1, (1.5,)


class Spec:
    """The spec's free functions as methods, like the two caches."""

    def __init__(self) -> None:
        self.state = pc.new_state(P)

    def insert_prefix(self, tokens: list[int], slots: list[int], namespace: Any = None) -> Any:
        return pc.insert_prefix(self.state, tokens, slots, namespace)

    def match_prefix(self, tokens: list[int], namespace: Any = None) -> Any:
        return pc.match_prefix(self.state, tokens, namespace)

    def evict(self, size: Any) -> Any:
        return pc.evict(self.state, size)

    def unlock(self, handle: Any) -> None:
        pc.unlock(self.state, handle)

    def abstract_state(self) -> pc.PrefixCacheState:
        return self.state


CACHES: dict[str, Callable[[], Any]] = {
    "spec": Spec,
    "reference": lambda: reference.RadixPrefixCache(page_size=P),
    "optimized": lambda: optimized.RadixPrefixCache(page_size=P, device="cpu"),
}

# (what is wrong, call on a cache holding page [1, 1] at slots [0, 1], the error of the first failing check)
CASES: list[tuple[str, Callable[[Any], Any], type[Exception]]] = [
    (
        "token, slot, namespace, lengths",
        lambda c: c.insert_prefix([BAD_TOKEN, 1, 1], [BAD_SLOT, 1], BAD_NAMESPACE),
        InvalidInputError,
    ),
    (
        "slot, namespace, lengths",
        lambda c: c.insert_prefix([1, 1, 1], [BAD_SLOT, 1], BAD_NAMESPACE),
        SlotOutOfRangeError,
    ),
    ("namespace, lengths", lambda c: c.insert_prefix([1, 1, 1], [0, 1], BAD_NAMESPACE), InvalidTypeError),
    ("lengths, misaligned page", lambda c: c.insert_prefix([1, 1, 2, 2, 3], [0, 1, 5, 6], None), LengthMismatchError),
    (
        "misaligned page 1, duplicate page 2",
        lambda c: c.insert_prefix([1, 1, 2, 2, 3, 3], [0, 1, 5, 6, 0, 1], None),
        MisalignedPageError,
    ),
    (
        "duplicate page 1, misaligned page 2",
        lambda c: c.insert_prefix([1, 1, 2, 2, 3, 3], [0, 1, 0, 1, 5, 6], None),
        DuplicateSlotError,
    ),
    ("match: token, namespace", lambda c: c.match_prefix([BAD_TOKEN], BAD_NAMESPACE), InvalidInputError),
    ("evict: negative", lambda c: c.evict(-1), InvalidSizeError),
    ("evict: past the evictable size", lambda c: c.evict(3), EvictionError),
]


@pytest.mark.parametrize("name", list(CACHES))
@pytest.mark.parametrize(("what", "call", "error"), CASES, ids=[case[0] for case in CASES])
def test_the_first_failing_check_names_the_error(
    name: str, what: str, call: Callable[[Any], Any], error: type[Exception]
) -> None:
    cache = CACHES[name]()
    cache.insert_prefix([1, 1], [0, 1], None)
    before = cache.abstract_state()
    before = pc.PrefixCacheState(before.page_size, dict(before.entries), before.clock)
    with pytest.raises(Exception) as raised:  # the exact class is asserted below
        call(cache)
    assert type(raised.value) is error, f"{name}: {what}: {type(raised.value).__name__}: {raised.value}"
    assert cache.abstract_state() == before, f"{name}: {what}: the rejected call changed the cache"


@pytest.mark.parametrize("name", list(CACHES))
def test_a_stale_handle_is_reported_before_a_missing_lock(name: str) -> None:
    cache = CACHES[name]()
    cache.insert_prefix([1, 1], [0, 1], None)
    handle = cache.match_prefix([1, 1], None)
    cache.evict(2)
    with pytest.raises(StaleHandleError):  # stale, and never locked: stale first
        cache.unlock(handle)
    with pytest.raises(InvalidTypeError):  # not a handle of this cache at all: the type first
        cache.unlock(object())
