"""The HashModel's arithmetic: K/V and next tokens derived from a hash of the sequence (pure, stdlib).

Position ``p`` of a sequence stores K/V derived from
``hash(namespace, tokens[: p + 1], layer)``, so two requests may share a
slot exactly when they agree on the namespace and every token up to it.
Both models (reference: a dict; optimized: MHAKVCache tensors) use these
functions, so their outputs are comparable token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

from .domains import Namespace

MASK64 = (1 << 64) - 1
WORD_BITS = 24  # a K/V word fits a float32 mantissa exactly
WORD_MASK = (1 << WORD_BITS) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective scramble of 64 bits.

    pre: 0 <= x < 2 ** 64
    post: 0 <= __return__ < 2 ** 64
    """
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def compute_namespace_seed(namespace: Namespace) -> int:
    """A 64-bit seed for the namespace (stable across runs: built from repr, not hash())."""
    seed = 0x9E3779B97F4A7C15
    for ch in repr(namespace).encode():
        seed = mix64(seed ^ ch)
    return seed


def compute_prefix_hashes(namespace: Namespace, tokens: Sequence[int]) -> list[int]:
    """``h[p]`` = hash of (namespace, tokens[: p + 1]) for every position p (a rolling hash)."""
    return extend_prefix_hashes(compute_namespace_seed(namespace), tokens)


def extend_prefix_hashes(last: int, tokens: Sequence[int]) -> list[int]:
    """The rolling hash continued from ``last`` (the namespace seed, or the hash of the sequence so far)."""
    h = last
    out = []
    for token in tokens:
        h = mix64(h ^ mix64(token + 0x632BE59BD9B4E019 & MASK64))
        out.append(h)
    return out


def compute_kv_words(prefix_hash: int, layer: int) -> tuple[int, int, int, int]:
    """Four 24-bit words for a position at ``layer``: two for K, two for V."""
    k = mix64(prefix_hash ^ mix64(2 * layer + 1))
    v = mix64(prefix_hash ^ mix64(2 * layer + 2))
    return (k & WORD_MASK, (k >> WORD_BITS) & WORD_MASK, v & WORD_MASK, (v >> WORD_BITS) & WORD_MASK)


def compute_next_token(prefix_hash: int, vocab_size: int, eos_token_id: int, eos_per_mille: int) -> int:
    """The greedy next token after a sequence: EOS on ``eos_per_mille`` of sequences, else hash mod vocab."""
    h = mix64(prefix_hash ^ 0xD6E8FEB86659FD93)
    if h % 1000 < eos_per_mille:
        return eos_token_id
    token = (h >> 10) % vocab_size
    return token if token != eos_token_id else (token + 1) % vocab_size
