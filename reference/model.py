"""Models the scheduler can run. ``HashModel``: K/V and next tokens from a hash of the sequence.

For every computed position it stores K/V derived from
``hash(namespace, tokens up to that position, layer)`` at the slot the
scheduler gave it, then reads back every position the request attends to
through the page table and raises ``KVCorruptionError`` on any mismatch: a
wrong page table, a page reused while still read, or a prefix shared across
namespaces shows up at once. Reference: the pool is a dict ``(layer, slot) -> words``.
"""

from __future__ import annotations

from typing import Protocol

from radixspec.spec.errors import IntegrityError, KVCorruptionError
from radixspec.spec.hashing import compute_kv_words, compute_next_token, compute_prefix_hashes
from radixspec.spec.requests import Batch


class Model(Protocol):
    """What the scheduler calls once per batch."""

    def forward(self, batch: Batch, page_table: list[list[int]], token_pool: list[list[int]]) -> list[int]:
        """Store the K/V of the batch's positions at ``batch.out_loc``; return one next token per request."""
        ...


class HashModel:
    """Deterministic stand-in for an LLM that checks every KV read (reference: a dict as the KV pool)."""

    def __init__(
        self, num_layers: int = 2, vocab_size: int = 1000, eos_token_id: int = 0, eos_per_mille: int = 50
    ) -> None:
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_per_mille = eos_per_mille
        self.kv: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self.positions_checked = 0

    def forward(self, batch: Batch, page_table: list[list[int]], token_pool: list[list[int]]) -> list[int]:
        next_tokens = []
        offset = 0
        for req in batch.reqs:
            row = req.table_idx
            hashes = compute_prefix_hashes(req.namespace, token_pool[row][: req.device_len])
            # STORE the new positions
            for position in range(req.cached_len, req.device_len):
                if batch.positions[offset] != position or batch.input_ids[offset] != token_pool[row][position]:
                    raise IntegrityError(f"batch input {offset} does not match request {req.uid} at {position}")
                for layer in range(self.num_layers):
                    self.kv[(layer, batch.out_loc[offset])] = compute_kv_words(hashes[position], layer)
                offset += 1
            # READ every position the request attends to, through its page-table row
            for position in range(req.device_len):
                slot = page_table[row][position]
                for layer in range(self.num_layers):
                    if self.kv.get((layer, slot)) != compute_kv_words(hashes[position], layer):
                        raise KVCorruptionError(
                            f"request {req.uid}: position {position} reads slot {slot} (layer {layer}),"
                            " which holds another sequence's K/V"
                        )
            self.positions_checked += req.device_len
            next_tokens.append(
                compute_next_token(hashes[req.device_len - 1], self.vocab_size, self.eos_token_id, self.eos_per_mille)
            )
        return next_tokens
