"""The scheduler's laws (spec/scheduler.py) on views built by hand: the arithmetic each law rests on."""

from __future__ import annotations

import pytest

from radixspec.spec import prefix_cache as pc
from radixspec.spec import scheduler as laws
from radixspec.spec.errors import SchedulingLawError
from radixspec.spec.requests import SchedulerConfig, StepReport

CONFIG = SchedulerConfig(page_size=2, num_pages=16, max_running_reqs=4, max_seq_len=32, max_extend_tokens=100)


def cache(locked: bool) -> pc.PrefixCacheState:
    """P = 2: pages (1 2) and (1 2 3 4); (1 2) locked or not."""
    state = pc.new_state(2)
    pc.insert_prefix(state, [1, 2, 3, 4], [0, 1, 2, 3])
    if locked:
        pc.lock(state, pc.match_prefix(state, [1, 2]))
    return state


def view(
    *waiting: laws.WaitingView,
    available: int,
    locked: bool = False,
    running: tuple[laws.RunningView, ...] = (),
    rows: int = 4,
    cache_type: str = "radix",
) -> laws.SchedulerView:
    return laws.SchedulerView(tuple(waiting), running, available, rows, cache(locked), cache_type)


def waiting(uid: int, *prompt: int, max_tokens: int = 1, **chunk: int) -> laws.WaitingView:
    return laws.WaitingView(uid, prompt, max_tokens, None, chunked=bool(chunk), **chunk)


def test_pages_still_needed_leave_out_the_last_token() -> None:
    # (final length, positions backed, P) -> pages: positions [0, final - 1) need K/V
    cases = {(1, 0, 1): 0, (5, 0, 2): 2, (6, 0, 2): 3, (6, 4, 2): 1, (3, 8, 2): 0, (9, 0, 4): 2, (10, 0, 4): 3}
    assert {case: laws.pages_still_needed(*case) for case in cases} == cases
    assert all(type(laws.pages_still_needed(*case)) is int for case in cases)


def test_a_match_finds_the_whole_cached_pages_of_the_prompt_but_its_last_token() -> None:
    state = view(available=0)
    keys = {key[1].tokens: key for key in state.cache.entries}
    assert laws.matched_pages(state, waiting(1, 1, 2, 3, 4, 5)) == [keys[(1, 2)], keys[(1, 2, 3, 4)]]
    assert laws.matched_pages(state, waiting(1, 1, 2, 3, 4)) == [keys[(1, 2)]]  # (4) is the last token
    assert laws.matched_pages(state, waiting(1, 1, 2, 9, 9, 3, 4, 5)) == [keys[(1, 2)]]  # stops at the gap
    assert laws.matched_pages(view(available=0, cache_type="naive"), waiting(1, 1, 2, 3, 4, 5)) == []


def test_a_locked_match_costs_nothing_an_unlocked_one_its_pages() -> None:
    # (1 2 7 7 5) matches (1 2), needs 2 more pages (4 tokens); 4 tokens are available
    request = waiting(1, 1, 2, 7, 7, 5)
    assert laws.admitted_batch(CONFIG, view(request, available=4, locked=True)) == [(1, 3)]
    # unlocked, locking it takes its page from what is available: 4 > 4 - 2
    assert laws.admitted_batch(CONFIG, view(request, available=4)) == []
    assert laws.admitted_batch(CONFIG, view(request, available=5)) == []  # 4 > 5 - 2: a page is 2 tokens
    assert laws.admitted_batch(CONFIG, view(request, available=6)) == [(1, 3)]


def test_what_is_admitted_is_reserved_and_locked_for_those_behind() -> None:
    # 10 tokens: request 1 locks (1 2) (8 left) and reserves 4; request 2 shares (1 2): reserves 4 more;
    # request 3 needs 4 of its own (no match), and 4 + 8 > 8: it waits, and request 4 behind it too. With 14
    # tokens (12 once (1 2) is locked) request 3 runs, and request 4's one page does not fit: 2 + 12 > 12
    queue = [waiting(1, 1, 2, 7, 7, 5), waiting(2, 1, 2, 8, 8, 5), waiting(3, 9, 9, 9, 9), waiting(4, 9)]
    assert laws.admitted_batch(CONFIG, view(*queue, available=10)) == [(1, 3), (2, 3)]
    assert laws.admitted_batch(CONFIG, view(*queue, available=9)) == [(1, 3)]  # 4 + 4 > 9 - 2
    assert laws.admitted_batch(CONFIG, view(*queue, available=14)) == [(1, 3), (2, 3), (3, 4)]
    assert laws.admitted_batch(CONFIG, view(*queue, available=16)) == [(1, 3), (2, 3), (3, 4), (4, 1)]


def test_running_requests_keep_their_reservation_and_rows_and_budget_bound_the_batch() -> None:
    running = (laws.RunningView(7, max_device_len=5, alloc_len=2),)  # one more page: 2 tokens reserved
    request = waiting(1, 9, 9, 9)  # 3 tokens, 1 new: 2 pages
    assert laws.admitted_batch(CONFIG, view(request, available=6, running=running)) == [(1, 3)]
    assert laws.admitted_batch(CONFIG, view(request, available=5, running=running)) == []
    assert laws.admitted_batch(CONFIG, view(request, available=99, rows=0)) == []
    # a chunk in progress needs no row; the budget cuts the last request of the batch
    chunk = waiting(5, *range(10, 40), cached_len=4, alloc_len=4)
    small = SchedulerConfig(page_size=2, num_pages=16, max_running_reqs=4, max_seq_len=64, max_extend_tokens=20)
    assert laws.admitted_batch(small, view(chunk, request, available=99, rows=0)) == [(5, 20)]
    assert laws.admitted_batch(small, view(request, chunk, available=99, rows=1)) == [(1, 3), (5, 17)]


def test_check_step_names_the_batch_the_law_gives() -> None:
    prefill = view(waiting(1, 9, 9, 9), available=8, running=(laws.RunningView(7, 9, 8),))
    laws.check_step(CONFIG, prefill, StepReport("prefill", [(1, 3)]))
    decode = view(waiting(1, 9, 9, 9), available=0, running=(laws.RunningView(7, 9, 8),))
    laws.check_step(CONFIG, decode, StepReport("decode", [(7, 1)]))
    laws.check_step(CONFIG, view(available=0), StepReport(None))
    cases = [
        (
            prefill,
            StepReport("decode", [(7, 1)]),
            "admission law: the waiting queue [1] (available 8, free rows 4) admits prefill [(1, 3)];"
            " the scheduler ran decode [(7, 1)]",
        ),
        (
            prefill,
            StepReport("prefill", [(1, 2)]),
            "admission law: the waiting queue [1] (available 8, free rows 4) admits prefill [(1, 3)];"
            " the scheduler ran prefill [(1, 2)]",
        ),
        (
            decode,
            StepReport("prefill", [(7, 1)]),
            "admission law: nothing waiting can run, so every running request decodes in admission order"
            " [(7, 1)]; the scheduler ran prefill [(7, 1)]",
        ),
        (
            decode,
            StepReport("decode", []),
            "admission law: nothing waiting can run, so every running request decodes in admission order"
            " [(7, 1)]; the scheduler ran decode []",
        ),
        (view(available=0), StepReport("decode"), "admission law: nothing can run, yet the scheduler ran decode"),
    ]
    for before, report, message in cases:
        with pytest.raises(SchedulingLawError) as error:
            laws.check_step(CONFIG, before, report)
        assert str(error.value) == message


def test_check_output_wants_the_sequence_or_a_prefix_of_it_when_aborted() -> None:
    laws.check_output([4, 5, 6], [4, 5, 6], True, 1)
    laws.check_output([4, 5, 6], [4, 5], False, 1)
    cases = [
        ([4, 5], True, "generation law: request 1 finished with [4, 5], its sequence is [4, 5, 6]"),
        ([4, 6], False, "generation law: request 1 produced [4, 6], not a prefix of [4, 5, 6]"),
    ]
    for output, finished, message in cases:
        with pytest.raises(SchedulingLawError) as error:
            laws.check_output([4, 5, 6], output, finished, 1)
        assert str(error.value) == message
