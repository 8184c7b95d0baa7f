"""fast_compare_key: the C common-prefix compare and its input checks."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from optimized import fast_compare_key
from spec.errors import InvalidTypeError
from spec.helpers import compute_match_len

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
