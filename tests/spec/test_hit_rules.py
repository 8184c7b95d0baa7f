"""The hit rule of spec/hit_rules.py: group kinds, hash units finer than a page, EAGLE, chunked caching.

Each engine formula below is the one read from its code (docs/hybrid.md, "Named choices"), checked
against the rule on a cache that holds everything, then rules that depend on what is missing.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixspec.spec import hit_rules as hr
from radixspec.spec.errors import InvalidInputError, InvalidTypeError


def everything(group: int, end: int) -> bool:
    return True


def cached(*ends_per_group: set[int]) -> hr.IsCached:
    """A cache whose group g holds the entries ending at ends_per_group[g]."""
    return lambda group, end: end in ends_per_group[group]


# ---------------------------------------------------------------- what a length uses


def test_a_state_group_uses_one_checkpoint_at_exactly_the_length() -> None:
    assert hr.compute_used_ends(12, hr.STATE, 4) == [12]
    assert hr.compute_used_ends(10, hr.STATE, 4) == [10]
    assert hr.compute_used_ends(0, hr.STATE, 4) == []


def test_a_length_inside_a_page_uses_the_partial_entry_ending_there() -> None:
    assert hr.compute_used_ends(10, None, 4) == [4, 8, 10]
    assert hr.compute_used_ends(10, 3, 4) == [10]  # window 3: tokens [8, 10), both on page 2
    assert hr.compute_used_ends(10, 4, 4) == [8, 10]  # window 4: tokens [7, 10)
    assert hr.compute_used_ends(8, 3, 4) == [8]  # tokens [6, 8): page 1 only


def test_a_state_group_makes_a_length_without_a_checkpoint_invalid() -> None:
    rule = hr.new_hit_rule(4, (None, hr.STATE))
    # the full group holds three pages, the state group a checkpoint after 4 tokens only
    holds = cached({4, 8, 12}, {4})
    assert hr.is_valid_length(rule, 4, holds)
    assert not hr.is_valid_length(rule, 8, holds)
    assert hr.compute_hit(rule, holds, known=13, limit=12) == 4
    # sparse: a checkpoint after 12 serves 12 without one at 8
    assert hr.compute_hit(rule, cached({4, 8, 12}, {12}), known=13, limit=12) == 12


def test_a_hit_ends_inside_a_page_only_on_a_partial_entry_and_on_the_unit() -> None:
    rule = hr.new_hit_rule(16, (None,), unit=4)
    # page 0 full, page 1 cached under a partial entry after 24 tokens (its first 8)
    holds = cached({16, 24})
    assert hr.compute_hit(rule, holds, known=40, limit=39) == 24
    # without the unit finer than the page the same cache gives the whole page only
    assert hr.compute_hit(hr.new_hit_rule(16, (None,)), holds, known=40, limit=39) == 16


def test_a_window_group_needs_the_pages_in_its_window_only() -> None:
    rule = hr.new_hit_rule(4, (None, 6))
    # window 6 at L = 12 uses tokens [7, 12): pages 1 and 2; page 0 may be gone
    assert hr.compute_hit(rule, cached({4, 8, 12}, {8, 12}), known=13, limit=12) == 12
    assert hr.compute_hit(rule, cached({4, 8, 12}, {4, 12}), known=13, limit=12) == 4


# ---------------------------------------------------------------- EAGLE, as each engine does it


def test_vllm_lookahead_hashes_cap_the_hit_at_what_the_next_tokens_key() -> None:
    # one group, B = h = 16, n = 100: without speculation 96; EAGLE's lookahead 1: still 96
    assert hr.compute_hit(hr.new_hit_rule(16, (None,)), everything, known=100, limit=99) == 96
    assert hr.compute_hit(hr.new_hit_rule(16, (None,), lookahead=1), everything, known=100, limit=99) == 96
    # multi-module MTP, 3 speculative tokens: floor((n - 3) / 16) * 16
    mtp = hr.new_hit_rule(16, (None,), lookahead=3)
    assert hr.compute_hit(mtp, everything, known=100, limit=99) == 96
    assert hr.compute_hit(mtp, everything, known=98, limit=97) == 80


def test_vllm_legacy_drop_recomputes_the_last_unit() -> None:
    # one group: floor((n - 1) / B) * B - B
    rule = hr.new_hit_rule(16, (None,), drop=1)
    assert hr.compute_hit(rule, everything, known=100, limit=99) == 80
    # hybrid with a unit finer than the block: looks one unit past the limit, floor(n / h) * h - h
    hybrid = hr.new_hit_rule(64, (None, hr.STATE), unit=16, drop=1)
    assert hr.compute_hit(hybrid, everything, known=100, limit=99, margin=16) == 80
    # the coarse hybrid: floor(min(n - 1 + B, n) / B) * B - B; n = 128, B = 64: 64 (one group gives 0)
    coarse = hr.new_hit_rule(64, (None, 32), drop=1)
    assert hr.compute_hit(coarse, everything, known=128, limit=127, margin=64) == 64
    assert hr.compute_hit(hr.new_hit_rule(64, (None,), drop=1), everything, known=128, limit=127) == 0


def test_a_dropped_unit_must_have_been_found_in_full_and_window_groups_not_in_state_groups() -> None:
    rule = hr.new_hit_rule(4, (None, hr.STATE), drop=1)
    # the state group's checkpoint after 8 serves 8 if the full group also holds page 2 (dropped)
    assert hr.compute_hit(rule, cached({4, 8, 12}, {8}), known=13, limit=12, margin=4) == 8
    assert hr.compute_hit(rule, cached({4, 8}, {8}), known=13, limit=12, margin=4) == 0
    # a window group needs its window at both lengths: the run one page longer (vLLM's contiguous blocks + 1)
    window = hr.new_hit_rule(4, (None, 5), drop=1)
    assert hr.compute_hit(window, cached({4, 8, 12}, {8, 12}), known=13, limit=12, margin=4) == 8
    assert hr.compute_hit(window, cached({4, 8, 12}, {12}), known=13, limit=12, margin=4) == 0


def test_sglang_bigram_keys_reuse_at_most_n_minus_2_tokens() -> None:
    # prompt [a, b, c, d, x]: the match reads n - 1 = 4 raw tokens, three bigrams: KV of a, b, c
    assert hr.compute_hit(hr.new_hit_rule(1, (None,), lookahead=1), everything, known=4, limit=4) == 3
    assert hr.compute_hit(hr.new_hit_rule(2, (None,), lookahead=1), everything, known=4, limit=4) == 2


@given(
    n=st.integers(1, 300),
    page=st.sampled_from([1, 2, 4, 16]),
    lookahead=st.integers(0, 3),
)
def test_on_a_cache_that_holds_everything_the_hit_is_the_engines_formula(n: int, page: int, lookahead: int) -> None:
    rule = hr.new_hit_rule(page, (None,), lookahead=lookahead)
    # vLLM: hashes over all n tokens, the hit below n
    assert hr.compute_hit(rule, everything, known=n, limit=n - 1) == max(0, min(n - 1, n - lookahead)) // page * page


# ---------------------------------------------------------------- chunked caching of a running request


def test_a_running_request_caches_up_to_its_last_checkpoint_and_nothing_without_one() -> None:
    rule = hr.new_hit_rule(4, (None, hr.STATE))
    pages = {4, 8, 12, 16}
    # 18 tokens stored; its state snapshot after 12 tokens: SGLang's page_floor(min(chunk end, snapshot))
    assert hr.compute_cacheable_len(rule, 18, 20, cached(pages, {12})) == 12
    assert hr.compute_cacheable_len(rule, 18, 20, cached(pages, set())) == 0
    # no state group: whole pages of what is stored; bigram keys (lookahead 1): one token less
    assert hr.compute_cacheable_len(hr.new_hit_rule(4, (None,)), 18, 20, cached(pages)) == 16
    assert hr.compute_cacheable_len(hr.new_hit_rule(4, (None,), lookahead=1), 18, 17, cached(pages)) == 16
    assert hr.compute_cacheable_len(hr.new_hit_rule(4, (None,), lookahead=1), 16, 16, cached(pages)) == 12


def test_a_running_request_caches_no_length_whose_window_it_released() -> None:
    rule = hr.new_hit_rule(4, (None, 6))
    # window pages 0 and 1 released: 8 needs pages 0-1 of the window ([3, 8)), 12 needs pages 1-2
    assert hr.compute_cacheable_len(rule, 16, 16, cached({4, 8, 12, 16}, {12, 16})) == 16
    assert hr.compute_cacheable_len(rule, 16, 16, cached({4, 8, 12, 16}, {16})) == 0


# ---------------------------------------------------------------- what a page owns


def test_a_promoted_page_keeps_no_partial_entry() -> None:
    # page of tokens [16, 32), full: only the entry ending at 32
    assert hr.page_entries_are_current(16, [(16, 16, [32])]) is None
    # vLLM #49125's shape: the partial entry after 24 tokens left on the promoted page
    assert "ending at [24]" in (hr.page_entries_are_current(16, [(16, 16, [24, 32])]) or "")
    # not full yet: partial entries of what was written, none past it
    assert hr.page_entries_are_current(16, [(16, 8, [20, 24])]) is None
    assert "ending at [28]" in (hr.page_entries_are_current(16, [(16, 8, [28])]) or "")


# ---------------------------------------------------------------- the rule's own domain


def test_a_rule_outside_its_domain_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="does not divide"):
        hr.new_hit_rule(16, (None,), unit=5)
    with pytest.raises(InvalidInputError):
        hr.new_hit_rule(16, (None,), lookahead=-1)
    with pytest.raises(InvalidInputError):
        hr.new_hit_rule(16, (None,), drop=-1)
    with pytest.raises(InvalidTypeError):
        hr.new_hit_rule(16, (None, "mamba"))
    with pytest.raises(InvalidInputError, match="no state groups"):
        hr.check_kinds((None, hr.STATE), state_groups=False)
