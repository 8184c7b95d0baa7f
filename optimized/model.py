"""``HashModel`` on the paged KV pool, a whole batch at a time. Twin of ``radixspec.reference.model.HashModel``.

The K/V words and next tokens are ``radixspec.spec.hashing``'s (so both models agree
token for token); optimized for speed rather than clarity:

* each request's prefix hashes are kept between forwards and extended by its
  new positions only (the rolling hash is sequential along a sequence);
* the K/V words of every position of the batch, stored and attended, come
  from one vectorized ``mix64`` over an int64 tensor per layer (two's
  complement arithmetic gives the same 64 bits as the spec's unsigned ints);
* they go through ``MHAKVCache.store_kv`` (one heads x 2 float32 row per K and
  per V: 24-bit words are exact in float32) and every attended slot is read
  back with ``MHAKVCache.gather_kv`` and compared at once.
"""

from __future__ import annotations

import torch

from radixspec.spec.errors import IntegrityError, KVCorruptionError
from radixspec.spec.hashing import (
    WORD_BITS,
    WORD_MASK,
    compute_namespace_seed,
    compute_next_token,
    extend_prefix_hashes,
    mix64,
)
from radixspec.spec.requests import Batch, Req

from .kv_pool import MHAKVCache

_SIGN = 1 << 63
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_C2 = 0x94D049BB133111EB - (1 << 64)


def as_signed(value: int) -> int:
    """A 64-bit unsigned int as the int64 with the same bits."""
    return value - (1 << 64) if value & _SIGN else value


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """``radixspec.spec.hashing.mix64`` on every element of an int64 tensor (bits as unsigned, shifts logical)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _C1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _C2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def kv_words_tensor(prefix_hashes: torch.Tensor, layer: int) -> torch.Tensor:
    """``spec.hashing.compute_kv_words`` of every position: an ``[n, 2, 1, 2]`` float32 tensor (K, V words)."""
    k = mix64_tensor(prefix_hashes ^ as_signed(mix64(2 * layer + 1)))
    v = mix64_tensor(prefix_hashes ^ as_signed(mix64(2 * layer + 2)))
    words = torch.stack(
        [k & WORD_MASK, (k >> WORD_BITS) & WORD_MASK, v & WORD_MASK, (v >> WORD_BITS) & WORD_MASK], dim=1
    )
    return words.to(torch.float32).view(-1, 2, 1, 2)


class _RowHashes:
    """The prefix hashes of one request's row, extended as its sequence grows: as ints and as an int64 tensor."""

    __slots__ = ("hashes", "signed", "uid")

    def __init__(self, uid: int, device: torch.device) -> None:
        self.uid = uid
        self.hashes: list[int] = []
        self.signed = torch.empty(0, dtype=torch.int64, device=device)


class HashModel:
    """Stand-in LLM checking every KV read, its KV in an MHAKVCache. Twin of ``reference.HashModel``."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        num_layers: int = 2,
        vocab_size: int = 1000,
        eos_token_id: int = 0,
        eos_per_mille: int = 50,
        store_mode: str = "checked",
    ) -> None:
        self.pool = MHAKVCache(1, num_layers, 2, num_pages, page_size, torch.float32, device, store_mode)
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_per_mille = eos_per_mille
        self.positions_checked = 0
        # row -> the prefix hashes of the request in it (recomputed when another request takes the row)
        self.rows: dict[int, _RowHashes] = {}

    def forward(self, batch: Batch, page_table: torch.Tensor, token_pool: torch.Tensor) -> list[int]:
        device = self.pool.device
        reqs = batch.reqs
        # the prefix hashes of every request, extended by its new positions
        rows = [self._row_hashes(req, token_pool) for req in reqs]
        new_tokens = torch.cat([token_pool[req.table_idx, req.cached_len : req.device_len] for req in reqs])
        if not torch.equal(batch.input_ids.to(new_tokens.device), new_tokens):
            raise IntegrityError("batch input ids do not match the token pool")
        attended_hashes = torch.cat([row.signed[: req.device_len] for row, req in zip(rows, reqs, strict=True)])
        # where each new position sits among the attended ones (request after request)
        lengths = torch.tensor([req.device_len for req in reqs], dtype=torch.int64, device=device)
        extend = torch.tensor([req.extend_len for req in reqs], dtype=torch.int64, device=device)
        starts = torch.tensor([req.cached_len for req in reqs], dtype=torch.int64, device=device)
        shift = (lengths.cumsum(0) - lengths) + starts - (extend.cumsum(0) - extend)
        new_index = torch.repeat_interleave(shift, extend) + torch.arange(int(extend.sum()), device=device)
        attended = torch.cat([page_table[req.table_idx, : req.device_len] for req in reqs])
        for layer in range(self.num_layers):
            expected = kv_words_tensor(attended_hashes, layer)
            # STORE the new positions
            stored = expected[new_index]
            self.pool.store_kv(stored[:, 0], stored[:, 1], batch.out_loc, layer)
            # READ every attended position through the page table
            k, v = self.pool.gather_kv(attended, layer)
            bad = ((k != expected[:, 0]) | (v != expected[:, 1])).flatten(1).any(dim=1)
            if bool(bad.any()):
                self._raise_corruption(int(torch.nonzero(bad)[0, 0]), batch, attended, layer)
        self.positions_checked += attended.numel()
        return [
            compute_next_token(row.hashes[req.device_len - 1], self.vocab_size, self.eos_token_id, self.eos_per_mille)
            for req, row in zip(reqs, rows, strict=True)
        ]

    def _row_hashes(self, req: Req, token_pool: torch.Tensor) -> _RowHashes:
        """Prefix hashes of positions [0, device_len) of ``req``'s row: kept, extended by its new tokens only."""
        kept = self.rows.get(req.table_idx)
        if kept is None or kept.uid != req.uid:
            kept = self.rows[req.table_idx] = _RowHashes(req.uid, self.pool.device)
        have = len(kept.hashes)
        if have < req.device_len:
            tokens = token_pool[req.table_idx, have : req.device_len].tolist()
            seed = kept.hashes[-1] if have else compute_namespace_seed(req.namespace)
            new = extend_prefix_hashes(seed, tokens)
            kept.hashes.extend(new)
            signed = torch.tensor([as_signed(h) for h in new], dtype=torch.int64, device=kept.signed.device)
            kept.signed = torch.cat([kept.signed, signed])
        return kept

    def _raise_corruption(self, index: int, batch: Batch, attended: torch.Tensor, layer: int) -> None:
        """Name the request, position and slot of the first bad read (``index`` into the batch's ``attended``)."""
        position = index
        for req in batch.reqs:
            if position < req.device_len:
                raise KVCorruptionError(
                    f"request {req.uid}: position {position} reads slot {int(attended[index])} (layer {layer}),"
                    " which holds another sequence's K/V"
                )
            position -= req.device_len
