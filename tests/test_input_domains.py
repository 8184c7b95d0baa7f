"""The spec's input domains (namespaces, slots, token ids), the same in every implementation.

Namespaces: ``None`` or tuples of str / bytes / int (exactly those types) or
tuples of them; Python calls ``("lora", 1)``, ``("lora", True)`` and
``("lora", 1.0)`` equal, and before the domain was defined they shared cache
lines (the class of SGLang #24638). Slots: ``0 <= slot < 2**31`` (int32 page
tables). Token ids: ``0 <= token < 2**63``.
"""

import subprocess
import sys
import textwrap
from enum import IntEnum
from typing import Any

import pytest
import torch

from radixspec import optimized, reference
from radixspec.fuzz.sequences import nested
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import NAMESPACE_DEPTH_LIMIT, check_namespace
from radixspec.spec.errors import InvalidInputError, InvalidTypeError, NamespaceDepthError, SlotOutOfRangeError
from radixspec.spec.requests import RequestSpec, SchedulerConfig


class Flavor(IntEnum):
    ONE = 1


class Tag(str):
    pass


def caches(page_size: int = 1) -> list[Any]:
    """The spec (through a small wrapper) and every cache implementation, empty."""

    class Spec:
        def __init__(self) -> None:
            self.state = pc.new_state(page_size)

        def match_prefix(self, tokens: Any, namespace: Any = None) -> Any:
            return pc.match_prefix(self.state, tokens, namespace)

        def insert_prefix(self, tokens: Any, slots: Any, namespace: Any = None) -> Any:
            return pc.insert_prefix(self.state, tokens, slots, namespace)

        def abstract_state(self) -> pc.PrefixCacheState:
            return pc.PrefixCacheState(page_size, dict(self.state.entries), self.state.clock)

    return [
        Spec(),
        reference.RadixPrefixCache(page_size),
        reference.NaivePrefixCache(page_size),
        optimized.RadixPrefixCache(page_size),
        optimized.NaivePrefixCache(page_size),
    ]


VALID = [None, (), ("lora", 1), ("lora", "1"), ("lora", b"1"), (("lora", (1, b"x")),), ("tenant", 2**80, -3)]
ALIASES = [("lora", True), ("lora", 1.0), (False,), (Flavor.ONE,), ("lora", Tag("1")), ("lora", None)]
NOT_TUPLES = ["lora", ["lora", 1], 0, frozenset({1})]


@pytest.mark.parametrize("namespace", VALID, ids=repr)
def test_every_namespace_of_the_domain_is_accepted_by_every_implementation(namespace: Any) -> None:
    for cache in caches():
        cache.insert_prefix([1, 2], [0, 1], namespace)
        assert cache.match_prefix([1, 2], namespace).cached_len in (0, 2)


@pytest.mark.parametrize("namespace", ALIASES + NOT_TUPLES, ids=repr)
def test_a_namespace_outside_the_domain_is_rejected_with_nothing_changed(namespace: Any) -> None:
    for cache in caches():
        cache.insert_prefix([1, 2], [0, 1], ("lora", 1))
        before = cache.abstract_state()
        with pytest.raises(InvalidTypeError):
            cache.match_prefix([1, 2], namespace)
        with pytest.raises(InvalidTypeError):
            cache.insert_prefix([1, 2, 3], [4, 5, 6], namespace)
        assert cache.abstract_state() == before, type(cache)


def test_lines_that_python_calls_equal_no_longer_alias() -> None:
    # ("lora", 1) and ("lora", True) hashed and compared equal: a request of one read the other's pages
    engine = reference.Engine(SchedulerConfig(page_size=1, num_pages=64, max_seq_len=64))
    with pytest.raises(InvalidTypeError):
        engine.generate(
            [
                RequestSpec(uid=0, input_ids=[5, 6, 7, 8], max_tokens=2, namespace=("lora", 1)),
                RequestSpec(uid=1, input_ids=[5, 6, 7, 8], max_tokens=2, namespace=("lora", True)),
            ]
        )
    assert engine.scheduler.status == {0: "waiting"}, "the request before the bad one was queued, nothing else"


def test_namespaces_nest_up_to_the_domains_bound_and_one_deeper_is_a_named_error() -> None:
    assert check_namespace(nested(NAMESPACE_DEPTH_LIMIT)) == nested(NAMESPACE_DEPTH_LIMIT)
    too_deep = nested(NAMESPACE_DEPTH_LIMIT + 1)
    for cache in caches(page_size=1):
        before = cache.abstract_state()
        with pytest.raises(NamespaceDepthError, match=f"nests tuples {NAMESPACE_DEPTH_LIMIT + 1} deep"):
            cache.match_prefix([1, 2], too_deep)
        with pytest.raises(NamespaceDepthError, match=f"nests tuples {NAMESPACE_DEPTH_LIMIT + 1} deep"):
            cache.insert_prefix([1, 2], [0, 1], too_deep)
        assert cache.abstract_state() == before, type(cache)


def test_a_namespace_far_deeper_than_the_interpreter_hashes_is_refused_quickly_and_the_process_lives() -> None:
    """CPython's tuple hash recurses: 200,000 levels crashed both caches in match_prefix; the check, linear,
    refuses them first (in a child process: a crash would take the test run with it)."""
    probe = textwrap.dedent(
        """
        import time
        from radixspec import optimized, reference
        from radixspec.spec.domains import check_namespace
        from radixspec.spec.errors import NamespaceDepthError
        deep = ("x",)
        for _ in range(320_000):
            deep = (deep,)
        start = time.perf_counter()
        try:
            check_namespace(deep)
        except NamespaceDepthError:
            pass
        assert time.perf_counter() - start < 1.0, "the check is not linear"
        for cache in (reference.RadixPrefixCache(page_size=1), optimized.RadixPrefixCache(page_size=1, device="cpu")):
            for call in (lambda: cache.match_prefix([1, 2], deep), lambda: cache.insert_prefix([1, 2], [0, 1], deep)):
                try:
                    call()
                except NamespaceDepthError:
                    continue
                raise AssertionError("a 320,000-deep namespace was accepted")
        print("alive")
        """
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "alive" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("slot", [2**31, 2**31 + 7, 2**40])
def test_a_slot_at_or_past_2_31_is_rejected_everywhere(slot: int) -> None:
    top = 2**31 - 4  # the last page of size 4 that fits: slots 2**31 - 4 .. 2**31 - 1
    for cache in caches(page_size=4):
        cache.insert_prefix([1] * 4, [top, top + 1, top + 2, top + 3])  # just below the limit: fine
        before = cache.abstract_state()
        with pytest.raises(SlotOutOfRangeError):
            cache.insert_prefix([2] * 4, [slot, slot + 1, slot + 2, slot + 3])
        assert cache.abstract_state() == before, type(cache)


@pytest.mark.parametrize("position", [0, 1, 3])
def test_an_int64_slot_tensor_is_checked_at_every_position_not_only_the_last(position: int) -> None:
    for cls in (optimized.RadixPrefixCache, optimized.NaivePrefixCache):
        cache = cls(page_size=1)
        slots = torch.tensor([0, 1, 2, 3], dtype=torch.int64)
        slots[position] = 2**31 + position
        with pytest.raises(SlotOutOfRangeError, match=rf"indices\[{position}\]"):
            cache.insert_prefix(torch.tensor([1, 2, 3, 4]), slots)
        assert cache.clock == 0


def test_a_negative_slot_is_out_of_range_too() -> None:
    for cache in caches():
        with pytest.raises(SlotOutOfRangeError):
            cache.insert_prefix([1, 2], [0, -1])


@pytest.mark.parametrize("token", [2**63, 2**64 + 1])
def test_a_token_id_past_int64_is_rejected_everywhere(token: int) -> None:
    for cache in caches():
        with pytest.raises(InvalidInputError):
            cache.match_prefix([1, token])
        with pytest.raises(InvalidInputError):
            cache.insert_prefix([1, token], [0, 1])


def test_tensors_of_every_accepted_kind_insert_alike_and_an_empty_one_of_any_dtype_is_empty() -> None:
    """int32 or int64, contiguous or strided: the same pages; ``torch.tensor([])`` (float32) inserts nothing."""
    for cls in (optimized.RadixPrefixCache, optimized.NaivePrefixCache):
        states = []
        for tokens, slots in (
            (torch.tensor([1, 2, 3, 4]), torch.tensor([4, 5, 6, 7], dtype=torch.int32)),
            (torch.tensor([1, 2, 3, 4], dtype=torch.int32), torch.tensor([4, 5, 6, 7])),
            (torch.tensor([1, 9, 2, 9, 3, 9, 4, 9])[::2], torch.tensor([4, 0, 5, 0, 6, 0, 7, 0])[::2]),
        ):
            cache = cls(page_size=2)
            assert cache.insert_prefix(tokens, slots)[0] == 0
            assert cache.match_prefix(tokens).cached_len == (4 if cls is optimized.RadixPrefixCache else 0)
            states.append(cache.abstract_state())
            assert cache.insert_prefix(torch.tensor([]), torch.tensor([]))[0] == 0
            assert cache.abstract_state().entries == states[-1].entries
            with pytest.raises(InvalidTypeError, match=r"^indices must be a 1-D int32/int64 tensor, got 1-D torch"):
                cache.insert_prefix(torch.tensor([5, 6]), torch.tensor([0.0, 1.0]))
        assert states[0] == states[1] == states[2]
