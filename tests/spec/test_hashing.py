"""Known answers of the hash model (spec/hashing.py): its tokens, K/V words and prefix hashes are part of every
recorded run and regression file, so they must not change from one version to the next."""

from __future__ import annotations

from radixspec.spec import hashing as h


def test_prefix_hashes_are_the_known_ones_and_extend_one_token_at_a_time() -> None:
    plain = h.compute_prefix_hashes(None, [1, 2, 3])
    assert plain == [962173023646476431, 13955721363269909801, 13153190681595354295]
    assert h.compute_prefix_hashes(("t", 1), [1, 2, 3]) == [
        10580869899951743779,
        13310129883835085902,
        17433719906023320920,
    ]
    assert h.extend_prefix_hashes(plain[0], [2, 3]) == plain[1:]
    assert (h.compute_namespace_seed(None), h.compute_namespace_seed(("t", 1))) == (
        5412783121878825845,
        13054114165446926827,
    )
    assert (h.mix64(0), h.mix64(1)) == (0, 6238072747940578789)


def test_kv_words_and_next_tokens_are_the_known_ones() -> None:
    first = h.compute_prefix_hashes(None, [1, 2, 3])[0]
    assert h.compute_kv_words(first, 0) == (13927779, 322026, 3437347, 537322)
    assert h.compute_kv_words(first, 1) == (6251311, 13622087, 15197889, 14841486)
    hashes = h.compute_prefix_hashes(None, list(range(40)))
    tokens = [h.compute_next_token(x, 1000, 0, 50) for x in hashes]
    assert tokens[:12] == [766, 601, 681, 740, 0, 889, 305, 316, 591, 475, 61, 81]
    assert tokens.count(0) == 4  # EOS on about 50 per mille of sequences
    # no EOS asked for: the hash's token, moved off EOS when it lands on it
    assert h.compute_next_token(first, 1000, 0, 0) == 612
    assert h.compute_next_token(first, 1000, 612, 0) == 613
    assert h.compute_next_token(first, 1000, 0, 1000) == 0  # EOS on every sequence
    assert all(h.compute_next_token(x, 7, 3, 0) != 3 for x in hashes)
