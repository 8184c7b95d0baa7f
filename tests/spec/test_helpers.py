"""The pure page-arithmetic helpers (also checked symbolically by ``tox -e crosshair``)."""

from hypothesis import given
from hypothesis import strategies as st

from radixspec.spec.helpers import (
    align_down,
    align_up,
    compute_match_len,
    compute_page_starts,
    compute_page_to_token,
    div_ceil,
    is_page_run,
)

sizes = st.integers(0, 10_000)
page_sizes = st.sampled_from([1, 2, 4, 16, 3])


@given(sizes, page_sizes)
def test_align_down_align_up_and_div_ceil_bracket_n(n: int, p: int) -> None:
    assert align_down(n, p) <= n <= align_up(n, p)
    assert align_down(n, p) % p == 0 and align_up(n, p) % p == 0
    assert align_up(n, p) - align_down(n, p) in (0, p)
    assert div_ceil(n, p) * p == align_up(n, p)


def test_div_ceil_examples() -> None:
    assert [div_ceil(n, 4) for n in range(9)] == [0, 1, 1, 1, 1, 2, 2, 2, 2]


@given(st.lists(st.integers(0, 2)), st.lists(st.integers(0, 2)))
def test_compute_match_len_is_the_common_prefix_length(a: list[int], b: list[int]) -> None:
    n = compute_match_len(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


def test_compute_page_to_token_expands_each_page_start() -> None:
    assert compute_page_to_token([8, 0], 4) == [8, 9, 10, 11, 0, 1, 2, 3]
    assert compute_page_to_token([5, 2], 1) == [5, 2]


def test_compute_page_starts_takes_every_pth_slot() -> None:
    assert compute_page_starts([8, 9, 10, 11, 0, 1], 4) == [8, 0]


def test_is_page_run_needs_an_aligned_consecutive_whole_page() -> None:
    assert is_page_run([4, 5, 6, 7], 4)
    assert not is_page_run([5, 6, 7, 8], 4)  # misaligned
    assert not is_page_run([4, 6, 5, 7], 4)  # out of order
    assert not is_page_run([4, 5, 6], 4)  # short
    assert not is_page_run([-1], 1)  # negative


def test_pages_to_finish_leave_out_the_last_token_and_what_is_allocated() -> None:
    from radixspec.spec.helpers import compute_pages_to_finish

    cases = {(1, 0, 1): 0, (5, 0, 2): 2, (6, 0, 2): 3, (6, 4, 2): 1, (6, 6, 2): 0, (5, 8, 2): 0, (10, 4, 4): 2}
    assert {case: compute_pages_to_finish(*case) for case in cases} == cases
