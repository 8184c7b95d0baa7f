"""``HashModel`` on the paged KV pool. Twin of ``reference.model.HashModel``.

K/V words come from ``spec.hashing`` (so both models agree token for token)
and go through ``MHAKVCache.store_kv`` (one heads x 2 float32 row per K and
per V: 24-bit words are exact in float32); attention reads every attended
slot back with ``MHAKVCache.gather_kv`` and compares.
"""

from __future__ import annotations

import torch

from spec.errors import IntegrityError, KVCorruptionError
from spec.hashing import compute_kv_words, compute_next_token, compute_prefix_hashes
from spec.types import Batch

from .kv_pool import MHAKVCache


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

    def forward(self, batch: Batch, page_table: torch.Tensor, token_pool: torch.Tensor) -> list[int]:
        device = self.pool.device
        reqs = batch.reqs
        rows = [token_pool[req.table_idx, : req.device_len].tolist() for req in reqs]
        hashes = [compute_prefix_hashes(req.namespace, row) for req, row in zip(reqs, rows, strict=True)]
        if batch.input_ids.tolist() != [
            row[p] for req, row in zip(reqs, rows, strict=True) for p in range(req.cached_len, req.device_len)
        ]:
            raise IntegrityError("batch input ids do not match the token pool")
        attended = torch.cat([page_table[req.table_idx, : req.device_len] for req in reqs])
        for layer in range(self.num_layers):
            # STORE the new positions
            new = [
                compute_kv_words(h[p], layer)
                for req, h in zip(reqs, hashes, strict=True)
                for p in range(req.cached_len, req.device_len)
            ]
            words = torch.tensor(new, dtype=torch.float32, device=device).view(-1, 2, 1, 2)
            self.pool.store_kv(words[:, 0], words[:, 1], batch.out_loc, layer)
            # READ every attended position through the page table
            expected = torch.tensor(
                [
                    compute_kv_words(h[p], layer)
                    for req, h in zip(reqs, hashes, strict=True)
                    for p in range(req.device_len)
                ],
                dtype=torch.float32,
                device=device,
            ).view(-1, 2, 1, 2)
            k, v = self.pool.gather_kv(attended, layer)
            bad = ((k != expected[:, 0]) | (v != expected[:, 1])).flatten(1).any(dim=1)
            if bool(bad.any()):
                self._raise_corruption(int(torch.nonzero(bad)[0, 0]), batch, attended, layer)
        self.positions_checked += attended.numel()
        return [
            compute_next_token(h[req.device_len - 1], self.vocab_size, self.eos_token_id, self.eos_per_mille)
            for req, h in zip(reqs, hashes, strict=True)
        ]

    def _raise_corruption(self, index: int, batch: Batch, attended: torch.Tensor, layer: int) -> None:
        for req in batch.reqs:
            if index < req.device_len:
                raise KVCorruptionError(
                    f"request {req.uid}: position {index} reads slot {int(attended[index])} (layer {layer}),"
                    " which holds another sequence's K/V"
                )
            index -= req.device_len
