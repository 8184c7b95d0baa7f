"""Each bad store is refused with its own error and exact words, naming the argument at fault; nothing is written."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixspec.optimized import store as store_module
from radixspec.optimized import store_cache, store_cache_fast
from radixspec.optimized.store import StoreStatus, raise_for_status
from radixspec.spec.errors import (
    DuplicateSlotError,
    InvalidSizeError,
    InvalidTypeError,
    KernelError,
    LengthMismatchError,
    OverlappingBuffersError,
    SlotOutOfRangeError,
)

Args = list[Any]


def good() -> Args:
    """40 rows of 16 float16 values into a pool of 64 slots (distinct slots, no shared memory)."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(64, 16, generator=gen).half()
    v_cache = torch.randn(64, 16, generator=gen).half()
    indices = torch.randperm(64, generator=gen)[:40]
    k = torch.randn(40, 16, generator=gen).half()
    v = torch.randn(40, 16, generator=gen).half()
    return [k_cache, v_cache, indices, k, v]


NAMES = ("k_cache", "v_cache", "indices", "k", "v")


def with_arg(name: str, make: Callable[[Args], object]) -> Callable[[], Args]:
    """Good arguments with the one named replaced by ``make(good arguments)``."""

    def build() -> Args:
        args = good()
        args[NAMES.index(name)] = make(args)
        return args

    return build


def strided(width: int) -> torch.Tensor:
    return torch.zeros(40, 2 * width, dtype=torch.float16)[:, ::2]


def as_int64(cache: object) -> torch.Tensor:
    assert isinstance(cache, torch.Tensor)
    return cache.view(torch.int64).reshape(-1)[:40]


def int_caches() -> Args:
    args = good()
    return [torch.zeros(64, 16, dtype=torch.int32), torch.zeros(64, 16, dtype=torch.int32), args[2], *args[3:]]


def empty_rows() -> Args:
    k_cache, v_cache, indices, k, v = good()
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    return [k_cache[:, :0], v_cache[:, :0], indices, k[:, :0], v[:, :0]]


CASES: dict[str, tuple[Callable[[], Args], type[Exception], str]] = {
    **{
        f"{name} not a tensor": (
            with_arg(name, lambda a: [0]),
            InvalidTypeError,
            f"{name} must be a torch.Tensor, got list",
        )
        for name in NAMES
    },
    "caches of two shapes": (
        with_arg("v_cache", lambda a: torch.zeros(64, 8, dtype=torch.float16)),
        InvalidTypeError,
        "caches must both be [num_slots, D], got (64, 16) and (64, 8)",
    ),
    "a 1-D cache": (
        with_arg("k_cache", lambda a: torch.zeros(64, dtype=torch.float16)),
        InvalidTypeError,
        "caches must both be [num_slots, D], got (64,) and (64, 16)",
    ),
    "a cache not contiguous": (
        with_arg("v_cache", lambda a: torch.zeros(16, 64, dtype=torch.float16).t()),
        InvalidTypeError,
        "caches must be contiguous",
    ),
    "rows of no values": (empty_rows, InvalidSizeError, "cache rows hold no values (D == 0)"),
    "int caches": (int_caches, InvalidTypeError, "caches must hold a float dtype, got torch.int32"),
    "v_cache of another dtype": (
        with_arg("v_cache", lambda a: torch.zeros(64, 16)),
        InvalidTypeError,
        "v_cache is torch.float32, the caches hold torch.float16",
    ),
    "k of another dtype": (
        with_arg("k", lambda a: torch.zeros(40, 16)),
        InvalidTypeError,
        "k is torch.float32, the caches hold torch.float16",
    ),
    "v of another dtype": (
        with_arg("v", lambda a: torch.zeros(40, 16, dtype=torch.bfloat16)),
        InvalidTypeError,
        "v is torch.bfloat16, the caches hold torch.float16",
    ),
    **{
        f"{name} on another device": (
            with_arg(name, lambda a, name=name: a[NAMES.index(name)].to("meta")),
            InvalidTypeError,
            f"{name} is on meta, the caches on cpu",
        )
        for name in ("v_cache", "indices", "k", "v")
    },
    "float indices": (
        with_arg("indices", lambda a: torch.zeros(40)),
        InvalidTypeError,
        "indices must be 1-D int32/int64, got 1-D torch.float32",
    ),
    "2-D indices": (
        with_arg("indices", lambda a: torch.zeros(40, 1, dtype=torch.int32)),
        InvalidTypeError,
        "indices must be 1-D int32/int64, got 2-D torch.int32",
    ),
    **{
        f"a 1-D {name}": (
            with_arg(name, lambda a: torch.zeros(40, dtype=torch.float16)),
            InvalidTypeError,
            f"{name} must be [n, D], got (40,)",
        )
        for name in ("k", "v")
    },
    **{
        f"{name} rows too narrow": (
            with_arg(name, lambda a: torch.zeros(40, 8, dtype=torch.float16)),
            LengthMismatchError,
            f"{name} rows hold 8 values, cache rows 16",
        )
        for name in ("k", "v")
    },
    **{
        f"{name} strided": (
            with_arg(name, lambda a: strided(16)),
            InvalidTypeError,
            f"{name} must have unit inner stride, got strides (32, 2)",
        )
        for name in ("k", "v")
    },
    "fewer indices": (
        with_arg("indices", lambda a: a[2][:39]),
        LengthMismatchError,
        "k has 40 rows, v 40, indices 39",
    ),
    "fewer v rows": (
        with_arg("v", lambda a: a[4][:38]),
        LengthMismatchError,
        "k has 40 rows, v 38, indices 40",
    ),
    "one cache for both": (
        with_arg("v_cache", lambda a: a[0]),
        OverlappingBuffersError,
        "k_cache and v_cache share memory: a store would write one through the other",
    ),
    **{
        f"{name} inside {cache}": (
            with_arg(
                name,
                lambda a, name=name, cache=cache: (
                    as_int64(a[NAMES.index(cache)]) if name == "indices" else a[NAMES.index(cache)][:40]
                ),
            ),
            OverlappingBuffersError,
            f"{name} overlaps {cache}: a store would overwrite what it reads",
        )
        for name in ("indices", "k", "v")
        for cache in ("k_cache", "v_cache")
    },
}


@pytest.mark.parametrize("fast", [False, True], ids=["store_cache", "store_cache_fast"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_store_is_refused_with_its_words_and_nothing_written(case: str, fast: bool) -> None:
    build, error, message = CASES[case]
    args = build()
    before = [a.clone() if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a for a in args]
    with pytest.raises(error) as raised:
        if fast:
            store_cache_fast(*args, torch.zeros(1, dtype=torch.int32))
        else:
            store_cache(*args)
    assert str(raised.value) == message
    for was, now in zip(before, args, strict=True):
        if isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor) and now.device.type == "cpu":
            assert torch.equal(was, now)


@pytest.mark.parametrize(
    ("status", "row", "error", "message"),
    [
        (
            StoreStatus.OUT_OF_RANGE,
            1,
            SlotOutOfRangeError,
            "row 1 (slot 7): slot index outside the pool of 4 slots; nothing was written",
        ),
        (
            StoreStatus.OUT_OF_RANGE,
            -1,
            SlotOutOfRangeError,
            "some row: slot index outside the pool of 4 slots; nothing was written",
        ),
        (
            StoreStatus.DUPLICATE,
            0,
            DuplicateSlotError,
            "row 0 (slot 5): slot index given to an earlier row too; nothing was written",
        ),
        (
            StoreStatus.NO_MEMORY,
            0,
            KernelError,
            "no host memory for the duplicate check of 2 rows; nothing was written",
        ),
        (
            StoreStatus.BAD_ARGS,
            0,
            InvalidTypeError,
            "the store rejected its arguments (a pointer, count or stride the checks let through)",
        ),
        (700, 0, KernelError, "the store failed with status 700"),
    ],
)
def test_each_store_status_says_what_went_wrong(status: int, row: int, error: type, message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        raise_for_status(status, row, torch.tensor([5, 7]), 4)


def test_an_empty_strided_k_and_one_value_rows_with_any_stride_are_stored() -> None:
    """The unit-stride rule is for rows of two or more values read from at least one row."""
    k_cache, v_cache = torch.zeros(8, 2, dtype=torch.float16), torch.zeros(8, 2, dtype=torch.float16)
    empty = torch.zeros(0, 4, dtype=torch.float16)[:, ::2]
    store_cache(k_cache, v_cache, torch.zeros(0, dtype=torch.int64), empty, empty)
    assert not k_cache.any()
    narrow_k, narrow_v = torch.zeros(8, 1), torch.zeros(8, 1)
    wide = torch.arange(6.0).view(3, 2)
    store_cache(narrow_k, narrow_v, torch.tensor([4, 0, 2]), wide[:, ::2], wide[:, 1::2])
    assert narrow_k[[4, 0, 2], 0].tolist() == [0.0, 2.0, 4.0] and narrow_v[[4, 0, 2], 0].tolist() == [1.0, 3.0, 5.0]
    two_k, two_v = torch.zeros(8, 2, dtype=torch.float16), torch.zeros(8, 2, dtype=torch.float16)
    with pytest.raises(InvalidTypeError, match=r"^k must have unit inner stride, got strides \(4, 2\)$"):
        store_cache(two_k, two_v, torch.tensor([1, 2, 3]), torch.zeros(3, 4, dtype=torch.float16)[:, ::2], two_v[:3])


def test_cpu_stores_take_the_c_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the C stores run, not the torch ones kept for devices without the kernel."""

    def not_here(*args: object) -> None:
        raise AssertionError("a torch store ran for CPU tensors")

    monkeypatch.setattr(store_module, "store_torch", not_here)
    monkeypatch.setattr(store_module, "store_torch_fast", not_here)
    k_cache, v_cache, indices, k, v = good()
    store_cache(k_cache, v_cache, indices, k, v)
    assert torch.equal(k_cache[indices], k)
    errors = torch.zeros(1, dtype=torch.int32)
    store_cache_fast(*good(), errors)
    assert int(errors) == 0


class FailingStores:
    """The C stores' library with both stores answering ``status`` (and the checked one naming row 2)."""

    def __init__(self, status: int) -> None:
        self.status = status

    def radix_store_rows(self, *args: object) -> int:
        args[-1][0] = 2
        return self.status

    def radix_store_rows_fast(self, *args: object) -> int:
        return self.status


@pytest.mark.parametrize(
    ("status", "error", "checked", "fast"),
    [
        (
            StoreStatus.OUT_OF_RANGE,
            SlotOutOfRangeError,
            "row 2 (slot {slot}): slot index outside the pool of 64 slots; nothing was written",
            "some row: slot index outside the pool of 64 slots; nothing was written",
        ),
        (
            StoreStatus.NO_MEMORY,
            KernelError,
            "no host memory for the duplicate check of 40 rows; nothing was written",
            "no host memory for the duplicate check of 40 rows; nothing was written",
        ),
    ],
)
def test_a_status_from_the_c_stores_is_raised_with_its_row(
    monkeypatch: pytest.MonkeyPatch, status: int, error: type, checked: str, fast: str
) -> None:
    ffi, _ = store_module.load_c()
    monkeypatch.setattr(store_module, "load_c", lambda: (ffi, FailingStores(status)))
    args = good()
    with pytest.raises(error) as raised:
        store_cache(*args)
    assert str(raised.value) == checked.format(slot=int(args[2][2]))
    with pytest.raises(error) as raised:
        store_cache_fast(*good(), torch.zeros(1, dtype=torch.int32))
    assert str(raised.value) == fast
