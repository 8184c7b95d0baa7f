"""store_cache and MHAKVCache: store then read back equals ``cache[indices] = k``; bad input writes nothing."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import cffi
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz.kv_machine import FLOAT_DTYPES
from optimized import MHAKVCache, store_cache, store_cache_fast
from optimized import store as store_module
from optimized.cdefs import csrc_dir, read_cdef
from optimized.store import (
    FLAG_OUT_OF_RANGE,
    PAIRWISE_MAX,
    StoreStatus,
    build_store_library,
    find_first_bad_row,
    has_cuda_kernel,
    raise_for_status,
)
from spec.errors import (
    DuplicateSlotError,
    InvalidSizeError,
    InvalidTypeError,
    KernelError,
    LengthMismatchError,
    OverlappingBuffersError,
    SlotOutOfRangeError,
    UnavailableError,
)

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
    if how == "one row, inner stride 2":  # the decode case at batch size 1; once silently stored [0, 1, 2, 3]
        wide = torch.arange(32.0, dtype=torch.float16).view(1, 32)
        return (k_cache, v_cache, indices[:1], wide[:, ::2], v[:1]), InvalidTypeError
    if how == "k_cache is v_cache":
        return (k_cache, k_cache, indices, k, v), OverlappingBuffersError
    if how == "k inside the cache":
        return (k_cache, v_cache, indices, k_cache[:40], v), OverlappingBuffersError
    if how == "empty rows":
        return (k_cache[:, :0], v_cache[:, :0], indices, k[:, :0], v[:, :0]), InvalidSizeError
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
        "one row, inner stride 2",
        "k_cache is v_cache",
        "k inside the cache",
        "empty rows",
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
    from optimized.store import load_store_kernel

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


# ---------------------------------------------------------------- the fast mode


def test_a_fast_store_skips_out_of_range_rows_flags_them_and_writes_the_rest() -> None:
    k_cache, v_cache, indices, k, v = case(6, 8, 16, torch.float32, torch.int64, fused=True)
    indices[2], indices[4] = 16, -1
    errors = torch.zeros(1, dtype=torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = torch.tensor([0, 1, 3, 5])
    expected_k[indices[keep]] = k[keep]
    expected_v[indices[keep]] = v[keep]
    store_cache_fast(k_cache, v_cache, indices, k, v, errors)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert int(errors.item()) == FLAG_OUT_OF_RANGE


def test_the_fast_store_reads_no_tensor_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # on a GPU each such read is a host sync (and breaks CUDA-graph capture); the checked mode's int(flags[0]) was one
    k_cache, v_cache, indices, k, v = case(40, 16, 64, torch.float16, torch.int32, fused=True)
    errors = torch.zeros(1, dtype=torch.int32)

    def no_host_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, no_host_read)
    store_cache_fast(k_cache, v_cache, indices, k, v, errors)
    monkeypatch.undo()
    assert int(errors.item()) == 0


def test_the_pool_in_fast_mode_reports_skipped_rows_once_then_clears() -> None:
    pool = MHAKVCache(1, 1, 4, num_pages=2, page_size=2, dtype=torch.float32, device="cpu", store_mode="fast")
    pool.store_kv(torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.tensor([0, 9]), layer_id=0)
    with pytest.raises(SlotOutOfRangeError):
        pool.check_store_errors()
    pool.check_store_errors()  # cleared
    assert pool.k_cache(0)[0].tolist() == [[1.0] * 4] and not pool.k_cache(0)[1:].any()


def test_the_engine_stores_in_fast_mode_with_the_same_outputs() -> None:
    from optimized import Engine
    from spec.types import RequestSpec, SchedulerConfig

    engine = Engine(SchedulerConfig(page_size=2, num_pages=32, max_seq_len=64))
    assert engine.model.pool.store_mode == "fast"
    result = engine.generate([RequestSpec(uid, [1, 2, 3, uid], max_tokens=4) for uid in range(4)])
    reference_result = __import__("reference").Engine(SchedulerConfig(page_size=2, num_pages=32, max_seq_len=64))
    assert (
        result.outputs
        == reference_result.generate([RequestSpec(uid, [1, 2, 3, uid], max_tokens=4) for uid in range(4)]).outputs
    )


# ---------------------------------------------------------------- checks and statuses


@given(
    st.lists(st.integers(-3, 40), max_size=3 * PAIRWISE_MAX),
    st.sampled_from([torch.int32, torch.int64]),
)
def test_the_torch_index_check_finds_the_same_first_bad_row_as_the_c_store(
    values: list[int], dtype: torch.dtype
) -> None:
    # the CUDA checked mode uses find_first_bad_row; the CPU store its C twin: they must agree row for row
    n, num_slots = len(values), 37
    indices = torch.tensor(values, dtype=dtype)
    k_cache, v_cache = torch.zeros(num_slots, 2), torch.zeros(num_slots, 2)
    rows = torch.zeros(n, 2)
    status, row = find_first_bad_row(indices, num_slots)
    if status == StoreStatus.OK:
        store_cache(k_cache, v_cache, indices, rows, rows)
        return
    error = SlotOutOfRangeError if status == StoreStatus.OUT_OF_RANGE else DuplicateSlotError
    with pytest.raises(error, match=rf"^row {row} "):
        store_cache(k_cache, v_cache, indices, rows, rows)


def test_an_empty_pool_rejects_any_row_as_out_of_range() -> None:
    k_cache, v_cache = torch.zeros(0, 4), torch.zeros(0, 4)
    with pytest.raises(SlotOutOfRangeError, match="^row 0 "):
        store_cache(k_cache, v_cache, torch.tensor([0]), torch.zeros(1, 4), torch.zeros(1, 4))


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (StoreStatus.OUT_OF_RANGE, SlotOutOfRangeError),
        (StoreStatus.DUPLICATE, DuplicateSlotError),
        (StoreStatus.NO_MEMORY, KernelError),
        (StoreStatus.BAD_ARGS, InvalidTypeError),
        (700, KernelError),  # a CUDA error (cudaErrorIllegalAddress)
    ],
)
def test_each_store_status_has_its_own_error(status: int, error: type) -> None:
    with pytest.raises(error):
        raise_for_status(status, 0, torch.tensor([5]), 4)
    raise_for_status(StoreStatus.OK, -1, torch.tensor([5]), 4)


def test_status_codes_come_from_the_header_the_c_sources_include() -> None:
    header = (csrc_dir() / "store_status.h").read_text()
    for member in StoreStatus:
        assert re.search(rf"RADIX_STORE_{member.name} = {member.value}\b", header), member


def test_the_cffi_declarations_are_the_headers_and_nothing_else() -> None:
    # csrc/build_ffi.py and the CUDA loader both read the cdef blocks; nothing declares a C function twice
    from optimized import _radix_c

    api = read_cdef(*(csrc_dir().parent / "csrc" / n for n in ("radix.h", "store_status.h", "store.h", "tree.h")))
    declared = set(re.findall(r"\b(radix_\w+)\(", api))
    assert declared == {name for name in dir(_radix_c.lib) if name.startswith("radix_")}
    cuda = read_cdef(csrc_dir() / "store_status.h", csrc_dir() / "store_cuda.h")
    assert set(re.findall(r"\b(radix_\w+)\(", cuda)) == {"radix_store_launch", "radix_cuda_error_string"}
    assert '#include "store_cuda.h"' in (csrc_dir() / "store.cu").read_text()
    for path in Path(__file__).resolve().parents[2].glob("optimized/*.py"):
        assert "int radix_" not in path.read_text(), f"{path.name} declares a C function itself"


# ---------------------------------------------------------------- the CUDA path without a GPU


def test_a_failed_kernel_build_is_not_retried_on_every_store(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def failing_build(*args: object, **kwargs: object) -> Path:
        calls.append(1)
        raise UnavailableError("nvcc failed")

    monkeypatch.setattr(store_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(store_module, "build_store_library", failing_build)
    store_module._load_store_kernel_once.cache_clear()
    try:
        for _ in range(3):
            with pytest.raises(UnavailableError, match="nvcc failed"):
                store_module.load_store_kernel()
            assert not store_module.has_cuda_kernel()
    finally:
        store_module._load_store_kernel_once.cache_clear()
    assert len(calls) == 1


class FakeTensor:
    """Just enough of a CUDA tensor for _launch_cuda: metadata, no memory."""

    def __init__(self, shape: tuple[int, ...], device: str, element_size: int = 2) -> None:
        self.shape, self.device, self._size = torch.Size(shape), torch.device(device), element_size

    def data_ptr(self) -> int:
        return 4096

    def element_size(self) -> int:
        return self._size

    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def stride(self, dim: int) -> int:
        return self.shape[1] if dim == 0 else 1


def test_the_cuda_launch_runs_on_the_caches_device_not_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    current = ["cuda:0"]
    launched_on = []

    class Device:
        def __init__(self, device: torch.device) -> None:
            self.device = str(device)

        def __enter__(self) -> None:
            self.saved, current[0] = current[0], self.device

        def __exit__(self, *exc: object) -> None:
            current[0] = self.saved

    class Lib:
        def radix_store_launch(self, *args: object) -> int:
            launched_on.append(current[0])
            return 700 if len(launched_on) == 2 else 0

        def radix_cuda_error_string(self, status: int) -> bytes:
            return b"an illegal memory access was encountered"

    ffi = cffi.FFI()
    monkeypatch.setattr(store_module, "load_store_kernel", lambda: (ffi, Lib()))
    monkeypatch.setattr(store_module.torch.cuda, "device", Device)
    monkeypatch.setattr(store_module.torch.cuda, "current_stream", lambda device: type("S", (), {"cuda_stream": 0}))
    monkeypatch.setattr(ffi, "string", lambda value: value)
    cache, rows, index = FakeTensor((8, 4), "cuda:1"), FakeTensor((2, 4), "cuda:1"), FakeTensor((2,), "cuda:1", 4)
    store_module._launch_cuda(cache, cache, index, rows, rows, index)  # type: ignore[arg-type]
    assert launched_on == ["cuda:1"] and current[0] == "cuda:0"
    with pytest.raises(KernelError, match="CUDA error 700"):
        store_module._launch_cuda(cache, cache, index, rows, rows, index)  # type: ignore[arg-type]


# ---------------------------------------------------------------- every float dtype, and the wheel


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_every_float_dtype_stores_and_gathers_bit_for_bit(dtype: torch.dtype) -> None:
    pool = MHAKVCache(2, 1, 3, num_pages=4, page_size=2, dtype=dtype, device="cpu")
    size = pool.k_cache(0).element_size()
    raw = torch.randint(0, 256, (3, 2 * 3 * size), dtype=torch.uint8)  # NaN payloads included
    k = raw.view(dtype).view(3, 2, 3)
    slots = torch.tensor([7, 0, 4])
    pool.store_kv(k, k, slots, 0)
    got_k, got_v = pool.gather_kv(slots, 0)
    assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8)) and got_v.dtype == dtype


def test_a_built_wheel_carries_the_cuda_sources(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(root),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("radixspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"optimized/csrc/store.cu", "optimized/csrc/store_cuda.h", "optimized/csrc/store_status.h"} <= names
