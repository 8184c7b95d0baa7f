"""The hot path of the optimized prefix cache (csrc/hotpath.c): match_prefix, insert_prefix and evict in C.

It takes the common case whole (a torch tensor, a list or tuple of ints, a buffer of native int32/int64, in a
namespace that holds pages, no events) and hands every other call, with its very arguments, to the Python
method of the same operation. These tests pin which calls it takes, that what it takes gives what the Python
method gives (results, clock, counters, tree), that it never runs while a Python method of the cache holds the
lock, and that its classes refuse what would break them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from radixspec.optimized import _hotpath
from radixspec.optimized.radix_cache import RadixCacheHandle, RadixPrefixCache
from radixspec.spec.errors import InvalidInputError, InvalidTypeError, NamespaceDepthError, SlotOutOfRangeError
from tests.optimized.test_input_formats import FORMATS

P = 4
TOKENS = list(range(1, 17))

# every input format the hot path reads in place: the input-format tests' (but the strided array, which is
# converted) and a memoryview
HOT_FORMATS: dict[str, Callable[[list[int]], Any]] = {
    **{name: convert for name, convert in FORMATS.items() if "converted" not in name},
    "memoryview": lambda values: memoryview(array("q", values)),
}


class Spy:
    """Counts the calls a cache hands to its Python methods (looked up on the instance first)."""

    def __init__(self, cache: RadixPrefixCache) -> None:
        self.calls: list[str] = []
        for name in ("_match_prefix", "_insert_prefix", "_evict"):
            method = getattr(cache, name)
            setattr(cache, name, self._counting(name, method))

    def _counting(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


def seeded(namespace: Any = None) -> RadixPrefixCache:
    """A cache holding TOKENS' pages in ``namespace``, its counters' entry there made by a match."""
    cache = RadixPrefixCache(P)
    cache.insert_prefix(TOKENS, list(range(100, 116)), namespace)
    cache.match_prefix(TOKENS, namespace)
    return cache


def observed(cache: RadixPrefixCache) -> tuple[Any, ...]:
    """Everything a call may change: the tree, the clock, the counters, the sizes."""
    return (cache.abstract_state(), cache.clock, cache.stats().as_dict(), cache.size_info)


@pytest.mark.parametrize("fmt", sorted(HOT_FORMATS))
def test_the_hot_path_takes_every_format_and_agrees_with_the_python_method(fmt: str) -> None:
    convert = HOT_FORMATS[fmt]
    hot, slow = seeded(), seeded()
    spy = Spy(hot)
    prompt = [*TOKENS[:8], 50, 51, 52, 53, 54, 55]
    slots = list(range(200, 214))
    results = []
    for cache, match, insert, evict in (
        (hot, hot.match_prefix, hot.insert_prefix, hot.evict),
        (slow, slow._match_prefix, slow._insert_prefix, slow._evict),
    ):
        handle = match(convert(prompt))
        inserted = insert(convert(prompt), convert(slots))
        again = match(convert(prompt))
        cache.lock(again)
        out = torch.full((12,), -7, dtype=torch.int32)
        evicted = (evict(P).tolist(), evict(P - 1, out=out) is out, out.tolist(), evict(0).tolist())
        results.append(
            (
                handle.cached_len,
                handle.get_matched_indices().tolist(),
                inserted.cached_len,
                inserted.handle.cached_len,
                again.cached_len,
                again.get_matched_indices().tolist(),
                type(handle),
                type(inserted).__name__,
                evicted,
                observed(cache),
            )
        )
        cache.unlock(again)
        cache.check_integrity()
    assert spy.calls == [], f"{fmt}: handed to Python: {spy.calls}"
    assert results[0] == results[1]
    assert results[0][:6] == (
        8,
        [100, 101, 102, 103, 104, 105, 106, 107],
        8,
        12,
        12,
        [*range(100, 108), *range(208, 212)],
    )
    # the locked path keeps its pages: the other branch goes, page by page, the oldest first
    assert results[0][8] == ([112, 113, 114, 115], True, [108, 109, 110, 111, *[-7] * 8], [])


def test_keywords_and_namespaces_take_the_hot_path_too() -> None:
    namespace = ("lora", 7, (b"tenant", "a"))
    cache = seeded(namespace)
    spy = Spy(cache)
    assert cache.match_prefix(input_ids=TOKENS, namespace=namespace).cached_len == 16
    assert cache.match_prefix(TOKENS, namespace=("lora", 7, (b"tenant", "a"))).cached_len == 16
    result = cache.insert_prefix(indices=list(range(300, 320)), input_ids=[*TOKENS, 9, 9, 9, 9], namespace=namespace)
    assert (result.cached_len, result.handle.cached_len) == (16, 20)
    assert cache.match_prefix(TOKENS).cached_len == 0  # another namespace: no root, handed over
    assert spy.calls == ["_match_prefix"]


HANDED_OVER: dict[str, Callable[[RadixPrefixCache], object]] = {
    "a namespace without pages": lambda cache: cache.match_prefix(TOKENS, ("other",)),
    "fewer tokens than a page": lambda cache: cache.match_prefix(TOKENS[:3]),
    "an empty tensor": lambda cache: cache.match_prefix(torch.empty(0, dtype=torch.int64)),
    "a 2-D tensor": lambda cache: cache.match_prefix(torch.tensor([TOKENS])),
    "a strided tensor": lambda cache: cache.match_prefix(torch.tensor(TOKENS * 2)[::2]),
    "a float tensor": lambda cache: cache.match_prefix(torch.tensor(TOKENS, dtype=torch.float32)),
    "a tensor subclass": lambda cache: cache.match_prefix(torch.nn.Parameter(torch.tensor(TOKENS), False)),
    "a list subclass": lambda cache: cache.match_prefix(type("L", (list,), {})(TOKENS)),
    "a list holding a bool": lambda cache: cache.match_prefix([True, *TOKENS[1:]]),
    "a list holding an int past int64": lambda cache: cache.match_prefix([2**64, *TOKENS[1:]]),
    "a negative token": lambda cache: cache.match_prefix([-1, *TOKENS[1:]]),
    "a big-endian numpy array": lambda cache: cache.match_prefix(np.array(TOKENS, dtype=">i8")),
    "a float numpy array": lambda cache: cache.match_prefix(np.array(TOKENS, dtype=np.float64)),
    "bytes": lambda cache: cache.match_prefix(bytes(TOKENS)),
    "a namespace list": lambda cache: cache.match_prefix(TOKENS, ["lora"]),
    "a namespace with a bool": lambda cache: cache.match_prefix(TOKENS, ("lora", True)),
    "a namespace 33 deep": lambda cache: cache.match_prefix(TOKENS, _nested(33)),
    "an unknown keyword": lambda cache: cache.match_prefix(TOKENS, tokens=TOKENS),
    "a keyword given twice": lambda cache: cache.match_prefix(TOKENS, input_ids=TOKENS),
    "too many arguments": lambda cache: cache.match_prefix(TOKENS, None, None),
    "no argument": lambda cache: cache.match_prefix(),
    "insert: fewer slots than tokens": lambda cache: cache.insert_prefix(TOKENS, list(range(15))),
    "insert: a negative slot": lambda cache: cache.insert_prefix([9] * 16, [-1, *range(1, 16)]),
    "insert: a slot past 2**31": lambda cache: cache.insert_prefix([9] * 4, [2**31, 1, 2, 3]),
    "insert: a misaligned page": lambda cache: cache.insert_prefix([9] * 4, [1, 2, 3, 4]),
    "insert: a cached slot": lambda cache: cache.insert_prefix([9] * 4, [100, 101, 102, 103]),
    "insert: less than a page": lambda cache: cache.insert_prefix([9] * 3, [0, 1, 2]),
    "insert: a new namespace": lambda cache: cache.insert_prefix([9] * 4, [0, 1, 2, 3], ("new",)),
    "insert: a slot tensor of floats": lambda cache: cache.insert_prefix([9] * 4, torch.zeros(4)),
    "evict: a negative size": lambda cache: cache.evict(-1),
    "evict: a bool": lambda cache: cache.evict(True),
    "evict: a float": lambda cache: cache.evict(4.0),  # type: ignore[arg-type]
    "evict: an int subclass": lambda cache: cache.evict(type("I", (int,), {})(4)),
    "evict: more than is evictable": lambda cache: cache.evict(17),
    "evict: past the large size": lambda cache: cache.evict(2**40),
    "evict: out of int64": lambda cache: cache.evict(4, out=torch.empty(4, dtype=torch.int64)),
    "evict: out too small": lambda cache: cache.evict(5, out=torch.empty(4, dtype=torch.int32)),
    "evict: out strided": lambda cache: cache.evict(4, out=torch.empty(8, dtype=torch.int32)[::2]),
    "evict: out a list": lambda cache: cache.evict(4, out=[0, 0, 0, 0]),  # type: ignore[arg-type]
    "evict: out given twice": lambda cache: cache.evict(4, torch.empty(4, dtype=torch.int32), out=None),
}


def _nested(depth: int) -> tuple[Any, ...]:
    value: tuple[Any, ...] = ("x",)
    for _ in range(depth - 1):
        value = (value,)
    return value


@pytest.mark.parametrize("case", sorted(HANDED_OVER))
def test_what_the_hot_path_does_not_take_goes_to_the_python_method_unchanged(case: str) -> None:
    """Each case goes to the Python method once, with its arguments, and ends as the Python method alone ends it:
    the same result or the same error, and the same cache after."""
    outcomes = []
    for hot in (True, False):
        cache = seeded()
        spy = Spy(cache)
        if not hot:
            # the Python methods alone: the C methods replaced by the ones they hand over to
            cache.match_prefix = cache._match_prefix  # type: ignore[method-assign]
            cache.insert_prefix = cache._insert_prefix  # type: ignore[method-assign]
        try:
            result: object = HANDED_OVER[case](cache)
            outcome: object = _described(result)
        except Exception as error:  # the error itself is the outcome compared
            outcome = (type(error), str(error))
        outcomes.append((outcome, observed(cache)))
        if hot:
            assert len(spy.calls) == 1, spy.calls
    assert outcomes[0] == outcomes[1]


def _described(result: object) -> object:
    if isinstance(result, RadixCacheHandle):
        return ("handle", result.cached_len, result.namespace)
    cached_len, handle = result  # type: ignore[misc]
    return ("insert", cached_len, handle.cached_len)


def test_events_send_inserts_and_evictions_to_the_python_method() -> None:
    cache = RadixPrefixCache(P, enable_events=True)
    spy = Spy(cache)
    cache.insert_prefix(TOKENS, list(range(100, 116)))
    cache.insert_prefix([*TOKENS, 5, 5, 5, 5], list(range(200, 220)))
    cache.evict(P)
    assert spy.calls == ["_insert_prefix", "_insert_prefix", "_evict"]
    assert len(cache.take_events()) == 6


def test_an_evict_that_empties_namespaces_drops_their_roots_in_c() -> None:
    cache = RadixPrefixCache(P)
    for k in range(20):  # more namespaces than the first room for emptied roots (16)
        cache.insert_prefix([k + 1] * P, list(range(P * k, P * k + P)), ("tenant", k))
        cache.match_prefix([k + 1] * P, ("tenant", k))
    cache.insert_prefix(TOKENS, list(range(1000, 1016)))
    spy = Spy(cache)
    slots = cache.evict(21 * P - 1)
    assert spy.calls == []
    assert sorted(slots.tolist()) == [*range(20 * P), *range(1012, 1016)]
    assert list(cache.roots) == [None] and list(cache._namespace_of.values()) == [None]
    cache.check_integrity()
    assert cache.stats().of(("tenant", 3)).pages_evicted == 1
    assert cache.stats().eviction_age_sum > 0
    cache.insert_prefix([1] * P, list(range(P)), ("tenant", 0))  # a dropped namespace starts again
    assert cache.match_prefix([1] * P, ("tenant", 0)).cached_len == P


def test_errors_on_the_hot_path_are_the_specs() -> None:
    cache = seeded()
    with pytest.raises(InvalidInputError, match=r"input_ids\[2\] = -5 is outside"):
        cache.match_prefix(torch.tensor([1, 2, -5, 4]))
    with pytest.raises(SlotOutOfRangeError, match=r"indices\[1\] = -1"):
        cache.insert_prefix(np.array([7, 7, 7, 7]), np.array([0, -1, 2, 3]))
    with pytest.raises(NamespaceDepthError):
        cache.match_prefix(TOKENS, _nested(40))
    with pytest.raises(InvalidTypeError):
        cache.match_prefix(torch.tensor([[1, 2, 3, 4]]))


def test_no_call_runs_in_c_while_a_python_method_holds_the_lock() -> None:
    """A thread that holds the cache's lock (as a Python method does, between its C calls) keeps every other
    thread's match_prefix and insert_prefix waiting, though each would take the hot path."""
    cache = seeded()
    done: list[str] = []

    def other() -> None:
        cache.match_prefix(TOKENS)
        done.append("match")
        cache.insert_prefix([3] * 4, [400, 401, 402, 403])
        done.append("insert")

    with cache._mutex:
        assert cache._mutex.held == 1
        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.3)
        assert done == [], "a call ran in C while another thread held the cache's lock"
    thread.join(10)
    assert done == ["match", "insert"]
    assert cache._mutex.held == 0
    cache.check_integrity()


def test_a_call_under_the_lock_in_the_same_thread_is_reentrant() -> None:
    cache = seeded()
    with cache._mutex, cache._mutex:
        assert cache._mutex.held == 2
        assert cache.match_prefix(TOKENS).cached_len == 16
    assert cache._mutex.held == 0


def test_the_mutex_refuses_a_release_it_does_not_hold() -> None:
    mutex = _hotpath.Mutex(threading.RLock())
    with pytest.raises(RuntimeError, match="released without being held"):
        mutex.__exit__(None, None, None)
    with mutex, pytest.raises(RuntimeError, match="while it is held"):
        mutex.__init__(threading.RLock())  # type: ignore[misc]
    assert mutex.held == 0


def test_the_classes_refuse_what_would_break_them() -> None:
    cache = seeded()
    with pytest.raises(RuntimeError, match="bound already"):
        cache._bind_tree(cache._tree, 1, P, True)
    with pytest.raises(RuntimeError, match="once per process"):
        _hotpath.setup(1, 1, 1, 1, torch.Tensor, torch.int32, torch.int64, torch.empty, RadixCacheHandle, tuple)
    # a cache never initialized, or a bare Core, has no tree: each call goes to Python, which says what is missing
    bare = RadixPrefixCache.__new__(RadixPrefixCache)
    with pytest.raises(AttributeError):
        bare.match_prefix(TOKENS)
    with pytest.raises(AttributeError):
        _hotpath.Core().insert_prefix(TOKENS, TOKENS)  # type: ignore[attr-defined]
    # the cache's fields replaced: every call goes to Python, nothing in C reads them
    cache.roots = None  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        cache.match_prefix(TOKENS)


def test_a_handle_is_a_plain_record() -> None:
    cache = seeded()
    handle = cache.match_prefix(TOKENS)
    assert (handle.cached_len, handle.namespace, handle.cache) == (16, None, cache)
    assert repr(handle) == "RadixCacheHandle(cached_len=16)"
    made = RadixCacheHandle(16, handle.node, handle.version, None, cache)
    cache.lock(made)
    assert cache.is_handle_locked(handle)
    cache.unlock(handle)
    with pytest.raises(AttributeError):
        handle.other = 1  # type: ignore[attr-defined]
    handle.node = "forged"  # type: ignore[assignment]
    with pytest.raises((InvalidTypeError, TypeError)):
        cache.lock(handle)


def test_a_torch_without_the_attributes_read_still_loads() -> None:
    """A torch whose Tensor lacks an attribute the hot path reads (a future release, say): setup binds the rest, and
    every tensor then goes to the Python methods. In a fresh process, the extension alone (setup runs once)."""
    code = textwrap.dedent(
        f"""
        import collections, importlib.util
        spec = importlib.util.spec_from_file_location("_hotpath", {_hotpath.__file__!r})
        hotpath = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hotpath)
        class Handle(hotpath.Handle):
            __slots__ = ()
        class Tensor:  # no dtype, is_cpu, ndim, ...
            pass
        Result = collections.namedtuple("Result", "cached_len handle")
        hotpath.setup(1, 1, 1, 1, Tensor, object(), object(), lambda n: None, Handle, Result)
        print("bound")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "bound", run.stderr[-2000:]
