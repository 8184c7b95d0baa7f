"""store_cache and MHAKVCache: store then read back equals ``cache[indices] = k``; bad input writes nothing."""

import shutil
from pathlib import Path

import pytest
import torch

from optimized import MHAKVCache, store_cache
from optimized.kv_store import build_store_library, has_cuda_kernel
from spec.errors import DuplicateSlotError, InvalidTypeError, LengthMismatchError, SlotOutOfRangeError, UnavailableError

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def expected_after(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    ek, ev = k_cache.clone(), v_cache.clone()
    ek[indices.long()] = k
    ev[indices.long()] = v
    return ek, ev


def case(
    n: int,
    width: int,
    num_slots: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype,
    fused: bool,
    device: str = "cpu",
    seed: int = 0,
):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_slots, width, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_slots, width, generator=gen).to(dtype).to(device)
    indices = torch.randperm(num_slots, generator=gen)[:n].to(index_dtype).to(device)
    if fused:  # k and v sliced out of one qkv row: row stride 3 * width
        qkv = torch.randn(n, 3 * width, generator=gen).to(dtype).to(device)
        k, v = qkv[:, width : 2 * width], qkv[:, 2 * width :]
    else:
        k = torch.randn(n, width, generator=gen).to(dtype).to(device)
        v = torch.randn(n, width, generator=gen).to(dtype).to(device)
    return k_cache, v_cache, indices, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("n", "width"), [(1, 8), (3, 1), (17, 24), (33, 128), (257, 1024), (4096, 64)])
def test_store_then_read_back_equals_advanced_indexing(
    dtype: torch.dtype, index_dtype: torch.dtype, fused: bool, n: int, width: int
) -> None:
    k_cache, v_cache, indices, k, v = case(n, width, max(2 * n, 8), dtype, index_dtype, fused)
    ek, ev = expected_after(k_cache, v_cache, indices, k, v)
    store_cache(k_cache, v_cache, indices, k, v)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)


@pytest.mark.parametrize("n", [1, 1024, 65536])
def test_store_of_up_to_65536_rows(n: int) -> None:
    k_cache, v_cache, indices, k, v = case(n, 16, n + 7, torch.bfloat16, torch.int32, fused=True, seed=n)
    ek, ev = expected_after(k_cache, v_cache, indices, k, v)
    store_cache(k_cache, v_cache, indices, k, v)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)


def test_an_empty_store_writes_nothing() -> None:
    k_cache, v_cache, indices, k, v = case(0, 8, 8, torch.float32, torch.int64, fused=False)
    before = k_cache.clone()
    store_cache(k_cache, v_cache, indices, k, v)
    assert torch.equal(k_cache, before)


def bad(how: str) -> tuple[tuple[torch.Tensor, ...], type]:
    k_cache, v_cache, indices, k, v = case(40, 16, 64, torch.float16, torch.int64, fused=False)
    if how == "duplicate":
        indices[39] = indices[3]
        return (k_cache, v_cache, indices, k, v), DuplicateSlotError
    if how == "duplicate small":
        indices = indices[:4].clone()
        indices[3] = indices[0]
        return (k_cache, v_cache, indices, k[:4], v[:4]), DuplicateSlotError
    if how == "out of range":
        indices[20] = 64
        return (k_cache, v_cache, indices, k, v), SlotOutOfRangeError
    if how == "negative":
        indices[0] = -1
        return (k_cache, v_cache, indices, k, v), SlotOutOfRangeError
    if how == "dtype":
        return (k_cache, v_cache, indices, k.float(), v), InvalidTypeError
    if how == "float indices":
        return (k_cache, v_cache, indices.float(), k, v), InvalidTypeError
    if how == "rows":
        return (k_cache, v_cache, indices[:39], k, v), LengthMismatchError
    if how == "width":
        return (k_cache, v_cache, indices, k[:, :8], v[:, :8]), LengthMismatchError
    if how == "inner stride":
        wide = torch.zeros(40, 32, dtype=torch.float16)
        return (k_cache, v_cache, indices, wide[:, ::2], v), InvalidTypeError
    if how == "overlapping rows":
        flat = torch.zeros(40 + 16, dtype=torch.float16)
        return (k_cache, v_cache, indices, flat.as_strided((40, 16), (1, 1)), v), InvalidTypeError
    if how == "cache not contiguous":
        return (k_cache.t().contiguous().t(), v_cache, indices, k, v), InvalidTypeError
    if how == "device":
        return (k_cache, v_cache, indices.to("meta"), k, v), InvalidTypeError
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "duplicate",
        "duplicate small",
        "out of range",
        "negative",
        "dtype",
        "float indices",
        "rows",
        "width",
        "inner stride",
        "overlapping rows",
        "cache not contiguous",
        "device",
    ],
)
def test_bad_input_is_rejected_and_nothing_is_written(how: str) -> None:
    args, error = bad(how)
    before = (args[0].clone(), args[1].clone())
    with pytest.raises(error):
        store_cache(*args)
    assert torch.equal(args[0], before[0]) and torch.equal(args[1], before[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_kv_cache_stores_per_layer_and_gathers_back(dtype: torch.dtype) -> None:
    pool = MHAKVCache(num_kv_heads=2, num_layers=3, head_dim=8, num_pages=16, page_size=4, dtype=dtype, device="cpu")
    out_loc = torch.tensor([5, 0, 63, 17], dtype=torch.int32)
    k = torch.randn(4, 2, 8).to(dtype)
    v = torch.randn(4, 16).to(dtype)  # [n, heads * head_dim] works too
    pool.store_kv(k, v, out_loc, layer_id=1)
    got_k, got_v = pool.gather_kv(out_loc, layer_id=1)
    assert torch.equal(got_k, k) and torch.equal(got_v, v.view(4, 2, 8))
    assert not pool.k_cache(0).any() and not pool.k_cache(2).any()
    assert pool.k_cache(1).shape == (64, 2, 8)


def test_mha_kv_cache_rejects_bad_layers_and_shapes() -> None:
    pool = MHAKVCache(2, 1, 8, 4, 4, torch.float32, "cpu")
    with pytest.raises(Exception, match="layer_id"):
        pool.k_cache(1)
    with pytest.raises(LengthMismatchError):
        pool.store_kv(torch.zeros(1, 3, 8), torch.zeros(1, 3, 8), torch.tensor([0]), 0)
    with pytest.raises(SlotOutOfRangeError):
        pool.gather_kv(torch.tensor([16]), 0)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_store_cu_compiles_with_nvcc(tmp_path: Path) -> None:
    library = build_store_library(out_dir=tmp_path, force=True)
    assert library.exists() and library.stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_the_cuda_kernel_is_unavailable() -> None:
    from optimized.kv_store import load_store_kernel

    assert not has_cuda_kernel()
    with pytest.raises(UnavailableError):
        load_store_kernel()


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("n", "width"), [(1, 8), (3, 1), (33, 1024), (4096, 1024), (65536, 1024), (100, 3)])
def test_cuda_store_equals_advanced_indexing(
    dtype: torch.dtype, index_dtype: torch.dtype, fused: bool, n: int, width: int
) -> None:
    assert has_cuda_kernel()
    k_cache, v_cache, indices, k, v = case(n, width, n + 5, dtype, index_dtype, fused, device="cuda")
    ek, ev = expected_after(k_cache, v_cache, indices, k, v)
    store_cache(k_cache, v_cache, indices, k, v)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)


@needs_cuda
@pytest.mark.parametrize("how", ["duplicate", "out of range", "negative"])
def test_cuda_store_rejects_bad_indices_with_nothing_written(how: str) -> None:
    args, error = bad(how)
    args = tuple(t.to("cuda") for t in args)
    before = (args[0].clone(), args[1].clone())
    with pytest.raises(error):
        store_cache(*args)
    assert torch.equal(args[0], before[0]) and torch.equal(args[1], before[1])
