"""Store bandwidth on one device: store_cache (checked), store_cache_fast, torch indexing, copy bandwidth; JSON out.

    python tests/gpu/bench_store_gpu.py --device cuda --out $OUT/store_bench.json
    python tests/gpu/bench_store_gpu.py --device cpu --rows 1 256 --out /tmp/store.json   # dry run

8 KV heads, head_dim 128, bf16; k and v are slices of a fused qkv tensor (row stride 3 * D).
GB/s counts the bytes of K+V written. The copy ceiling is ``dst.copy_(src)`` of 1 GiB
(bytes copied per second), measured the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from radixspec.optimized.store import has_cuda_kernel, store_cache, store_cache_fast

HEADS, HEAD_DIM, DTYPE = 8, 128, torch.bfloat16


def timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds per call (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / timed(lambda: dst.copy_(src), device, 20)


def measure(rows: int, device: torch.device, ceiling: float) -> dict[str, object]:
    """One batch size: our store, torch indexing, their GB/s, and a correctness check."""
    width = HEADS * HEAD_DIM
    num_slots = 2 * rows + 1024
    k_cache = torch.zeros(num_slots, width, dtype=DTYPE, device=device)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(rows, 3 * width, device=device).to(DTYPE)
    k, v = qkv[:, width : 2 * width], qkv[:, 2 * width :]
    indices = torch.randperm(num_slots, device=device)[:rows].to(torch.int32)
    index64 = indices.long()
    nbytes = 2 * rows * width * k_cache.element_size()

    def torch_indexing() -> None:
        k_cache[index64] = k
        v_cache[index64] = v

    errors = torch.zeros(1, dtype=torch.int32, device=device)
    ours = timed(lambda: store_cache(k_cache, v_cache, indices, k, v), device, 50)
    fast = timed(lambda: store_cache_fast(k_cache, v_cache, indices, k, v, errors), device, 50)
    theirs = timed(torch_indexing, device, 50)
    k_cache.zero_()
    store_cache(k_cache, v_cache, indices, k, v)
    expected = torch.zeros_like(k_cache)
    expected[index64] = k
    result = {
        "rows": rows,
        "bytes": nbytes,
        "store_cache_s": ours,
        "store_cache_GBps": nbytes / ours / 1e9,
        "store_cache_fast_s": fast,
        "store_cache_fast_GBps": nbytes / fast / 1e9,
        "fast_speedup_vs_torch": theirs / fast,
        "fast_fraction_of_copy_bw": nbytes / fast / ceiling,
        "torch_indexing_s": theirs,
        "torch_indexing_GBps": nbytes / theirs / 1e9,
        "speedup_vs_torch": theirs / ours,
        "fraction_of_copy_bw": nbytes / ours / ceiling,
        "correct": bool(torch.equal(k_cache, expected)) and int(errors.item()) == 0,
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 16, 256, 1024, 4096, 16384, 32768, 65536])
    parser.add_argument("--copy-bytes", type=int, default=1 << 30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    ceiling = copy_bandwidth(device, args.copy_bytes)
    results = [measure(rows, device, ceiling) for rows in args.rows]
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda_kernel": has_cuda_kernel() if device.type == "cuda" else False,
        "copy_bandwidth_GBps": ceiling / 1e9,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "dtype": str(DTYPE),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0 if all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
