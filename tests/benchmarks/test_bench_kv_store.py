"""KV store bandwidth on the CPU: store_cache (checked) and store_cache_fast (C) against torch indexing (opt-in).

Bandwidth is GB/s of K+V written (2 * rows * heads * head_dim * element size / min time);
8 KV heads, head_dim 128, bf16, k and v sliced out of a fused qkv tensor. The checked
store validates every index (range, duplicates) before writing; the fast one only skips
and flags out-of-range rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixspec.optimized import store_cache, store_cache_fast

pytestmark = pytest.mark.bench
HEADS, HEAD_DIM, DTYPE = 8, 128, torch.bfloat16


def torch_indexing(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    k_cache[indices] = k
    v_cache[indices] = v


@pytest.mark.parametrize("impl", ["store_cache", "store_cache_fast", "torch_indexing"])
@pytest.mark.parametrize("rows", [1, 16, 256, 4096, 16384, 65536])
def test_kv_store_bandwidth(benchmark: Any, impl: str, rows: int) -> None:
    width = HEADS * HEAD_DIM
    benchmark.group = f"kv store rows={rows}"
    num_slots = max(2 * rows, 1024)
    k_cache = torch.zeros(num_slots, width, dtype=DTYPE)
    v_cache = torch.zeros(num_slots, width, dtype=DTYPE)
    qkv = torch.randn(rows, 3 * width).to(DTYPE)
    k, v = qkv[:, width : 2 * width], qkv[:, 2 * width :]
    indices = torch.randperm(num_slots)[:rows].to(torch.int64 if impl == "torch_indexing" else torch.int32)
    errors = torch.zeros(1, dtype=torch.int32)
    fn = {
        "store_cache": store_cache,
        "store_cache_fast": lambda *args: store_cache_fast(*args, errors),
        "torch_indexing": torch_indexing,
    }[impl]
    rounds = 200 if rows <= 4096 else 20
    benchmark.pedantic(fn, args=(k_cache, v_cache, indices, k, v), rounds=rounds, iterations=1, warmup_rounds=2)
    assert int(errors.item()) == 0
    if benchmark.enabled and benchmark.stats is not None:
        benchmark.extra_info["bytes"] = 2 * rows * width * k_cache.element_size()
