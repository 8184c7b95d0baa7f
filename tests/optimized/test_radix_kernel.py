"""fast_compare_key: the C common-prefix compare and its input checks."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from radixspec.optimized import fast_compare_key
from radixspec.spec.errors import InvalidTypeError
from radixspec.spec.helpers import compute_match_len

CSRC = Path(__file__).resolve().parents[2] / "csrc"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 31, 32, 33, 255, 256, 257, 1000, 4096, 33_000])
def test_fast_compare_key_finds_a_mismatch_at_every_block_boundary(dtype: torch.dtype, n: int) -> None:
    key = torch.arange(n, dtype=dtype)
    assert fast_compare_key(key, key.clone()) == n
    for pos in sorted({0, n // 2, n - 1, max(n - 8, 0), min(64, n - 1), min(256, n - 1)}):
        if 0 <= pos < n:
            other = key.clone()
            other[pos] = -5
            assert fast_compare_key(key, other) == pos


@given(st.lists(st.integers(0, 3), max_size=80), st.lists(st.integers(0, 3), max_size=80))
def test_fast_compare_key_equals_the_spec_helper(a: list[int], b: list[int]) -> None:
    for dtype in (torch.int32, torch.int64):
        assert fast_compare_key(torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)) == compute_match_len(a, b)


def test_fast_compare_key_stops_at_the_shorter_array() -> None:
    assert fast_compare_key(torch.arange(5), torch.arange(100)) == 5


@pytest.mark.parametrize(
    ("key", "other"),
    [
        (torch.arange(4), torch.arange(4, dtype=torch.int32)),  # mixed dtypes
        (torch.arange(4.0), torch.arange(4.0)),  # floats
        (torch.arange(8)[::2], torch.arange(4)),  # not contiguous
        (torch.arange(4).view(2, 2), torch.arange(4)),  # 2-D
        ([0, 1, 2], torch.arange(3)),  # not a tensor
    ],
)
def test_fast_compare_key_rejects_bad_input(key: object, other: torch.Tensor) -> None:
    with pytest.raises(InvalidTypeError):
        fast_compare_key(key, other)  # type: ignore[arg-type]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found")
def test_the_c_sources_build_with_all_warnings_as_errors(tmp_path: Path) -> None:
    cmd = [
        "gcc",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-std=c11",
        "-c",
        str(CSRC / "radix.c"),
        "-o",
        str(tmp_path / "radix.o"),
    ]
    subprocess.run(cmd, check=True)


@given(
    st.integers(1, 4),
    st.lists(st.integers(-2, 20), max_size=24),
    st.booleans(),
    st.sampled_from([torch.int32, torch.int64]),
)
@example(2, [0, 1, 2, 3, -2, -1], False, torch.int32)  # a page at 0 is good, one below it is not
@example(2, [0, 1, 3, 2], True, torch.int32)  # a page not in order
@example(2, [0, 1, 1, 2], False, torch.int32)  # in order, not aligned
@example(3, [3, 4, 5, 16, 17, 18], True, torch.int32)
@example(1, [15, 16], False, torch.int64)  # the largest value inside [0, 15], then the first past it
def test_the_torch_checks_find_what_the_c_checks_find(
    page_size: int, values: list[int], strided: bool, dtype: torch.dtype
) -> None:
    # the checks of a device without the C path, run on the CPU beside the C checks; strided inputs too
    from radixspec.optimized.radix_kernel import (
        first_bad_page,
        first_bad_page_torch,
        first_outside,
        first_outside_torch,
    )

    whole = torch.tensor(values[: len(values) - len(values) % page_size], dtype=dtype)
    t = torch.stack([whole, whole]).t().reshape(-1)[::2] if strided else whole  # the same values, stride 2
    assert first_outside_torch(t, 15) == first_outside(t, 15) == first_outside(whole.contiguous(), 15)
    if dtype == torch.int32:
        expected = first_bad_page(whole, page_size)
        assert first_bad_page_torch(t, page_size) == first_bad_page(t, page_size) == expected
        pages = [values[i : i + page_size] for i in range(0, len(whole), page_size)]
        good = [p[0] >= 0 and p[0] % page_size == 0 and p == list(range(p[0], p[0] + page_size)) for p in pages]
        assert expected == (good.index(False) if False in good else len(pages))


def test_the_c_checks_refuse_arguments_they_cannot_read() -> None:
    from radixspec.optimized.radix_kernel import compare_raw, first_bad_page, first_outside

    cases = [
        (lambda: first_bad_page(torch.zeros(4, dtype=torch.int32), -2), "radix_first_bad_page rejected its arguments"),
        (lambda: compare_raw(torch.int64, 0, 0, -1), "radix_compare_i64 rejected its arguments (n=-1)"),
        (lambda: first_outside(torch.zeros(4, dtype=torch.int32), -1), "radix_first_outside rejected its arguments"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidTypeError) as raised:
            call()
        assert str(raised.value) == message


def test_the_key_checks_say_what_they_got() -> None:
    cases = [
        (lambda: fast_compare_key([1], torch.tensor([1])), "key must be a torch.Tensor, got list"),
        (lambda: fast_compare_key(torch.tensor([1]), (1,)), "input_ids must be a torch.Tensor, got tuple"),
        (
            lambda: fast_compare_key(torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1])),
            "key must be a 1-D contiguous CPU int32/int64 tensor, got 2-D torch.int64 on cpu",
        ),
        (
            lambda: fast_compare_key(torch.tensor([1]), torch.arange(4)[::2]),
            "input_ids must be a 1-D contiguous CPU int32/int64 tensor, got 1-D torch.int64 on cpu (not contiguous)",
        ),
        (
            lambda: fast_compare_key(torch.tensor([1.0]), torch.tensor([1])),
            "key must be a 1-D contiguous CPU int32/int64 tensor, got 1-D torch.float32 on cpu",
        ),
        (
            lambda: fast_compare_key(torch.tensor([1], dtype=torch.int32), torch.tensor([1])),
            "key is torch.int32 but input_ids is torch.int64",
        ),
    ]
    for call, message in cases:
        with pytest.raises(InvalidTypeError) as error:
            call()
        assert str(error.value) == message
