"""store_cache and MHAKVCache: store then read back equals ``cache[indices] = k``; bad input writes nothing."""

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import cffi
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from radixspec.fuzz.kv_machine import FLOAT_DTYPES
from radixspec.optimized import MHAKVCache, store_cache, store_cache_fast
from radixspec.optimized import store as store_module
from radixspec.optimized.cdefs import csrc_dir, read_cdef
from radixspec.optimized.store import (
    FLAG_OUT_OF_RANGE,
    PAIRWISE_MAX,
    StoreStatus,
    build_store_library,
    find_first_bad_row,
    has_cuda_kernel,
    raise_for_status,
    store_torch,
    store_torch_fast,
)
from radixspec.spec.errors import (
    DuplicateSlotError,
    InvalidInputError,
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
    from radixspec.optimized.store import load_store_kernel

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
    from radixspec.optimized import Engine
    from radixspec.spec.requests import RequestSpec, SchedulerConfig

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


@given(
    st.integers(1, 12),
    st.lists(st.integers(-2, 14), max_size=10),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
    st.sampled_from([torch.int32, torch.int64]),
)
def test_the_torch_stores_write_what_the_c_stores_write(
    num_slots: int, values: list[int], dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    # the stores of a device without the kernel, run on the CPU beside the C stores they stand in for
    def pools() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(num_slots, 3).to(dtype), torch.zeros(num_slots, 3).to(dtype)

    k = (torch.arange(len(values) * 3, dtype=torch.float32).reshape(-1, 3) + 1).to(dtype)
    v = (k.float() * 2).to(dtype)
    indices = torch.tensor(values, dtype=index_dtype)
    outcomes = []
    for store in (store_cache, store_torch):
        k_cache, v_cache = pools()
        try:
            store(k_cache, v_cache, indices, k, v)
            outcomes.append((k_cache.view(torch.uint8).tolist(), v_cache.view(torch.uint8).tolist()))
        except (SlotOutOfRangeError, DuplicateSlotError) as error:
            outcomes.append((type(error), str(error), k_cache.view(torch.uint8).abs().sum().item()))
    assert outcomes[0] == outcomes[1]
    # the fast stores: duplicates are not detected (which row wins is the device's), so distinct slots here
    seen: set[int] = set()
    keep = []
    for i, value in enumerate(values):
        if 0 <= value < num_slots:
            if value in seen:
                continue
            seen.add(value)
        keep.append(i)
    indices, k, v = indices[keep], k[keep], v[keep]
    outcomes = []
    for store in (store_cache_fast, store_torch_fast):
        k_cache, v_cache = pools()
        errors = torch.zeros(1, dtype=torch.int32)
        store(k_cache, v_cache, indices, k, v, errors)
        outcomes.append((k_cache.view(torch.uint8).tolist(), v_cache.view(torch.uint8).tolist(), int(errors)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][2] == (FLAG_OUT_OF_RANGE if any(not 0 <= x < num_slots for x in indices.tolist()) else 0)


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
    from radixspec.optimized import _radix_c

    # the checkout's headers (an installed wheel ships only the CUDA sources, in optimized/csrc/)
    checkout = Path(__file__).resolve().parents[2] / "csrc"
    api = read_cdef(*(checkout / n for n in ("radix.h", "store_status.h", "store.h", "tree.h")))
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


class TestKvStoreReport:
    """``python -m radixspec.optimized.build_cuda``: each machine it can meet, each line it prints, its exit status."""

    @staticmethod
    def fake(
        monkeypatch: pytest.MonkeyPatch, *, gpu: bool, nvcc: bool, builds: bool = True, kernel: bool = True
    ) -> None:
        from radixspec.optimized import build_cuda

        def no(*args: object, **kwargs: object) -> None:
            raise UnavailableError("not here")

        monkeypatch.setattr(build_cuda.torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setattr(build_cuda.torch.cuda, "get_device_name", lambda: "Fake H200")
        monkeypatch.setattr(build_cuda, "find_nvcc", (lambda: "/fake/nvcc") if nvcc else no)
        monkeypatch.setattr(
            build_cuda, "build_store_library", (lambda force: Path("/fake/libstore.so")) if builds else no
        )
        monkeypatch.setattr(build_cuda, "has_cuda_kernel", lambda: kernel)

    def run(self, force: bool = False) -> tuple[dict[str, str], int]:
        from radixspec.optimized import build_cuda

        lines, status = build_cuda.report(force)
        return {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in lines}, status

    def test_this_machine_without_a_gpu_nor_nvcc(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake(monkeypatch, gpu=False, nvcc=False)
        lines, status = self.run()
        assert status == 0
        assert lines["CPU store"] == "C (radixspec.optimized._radix_c) loaded"
        assert lines["CUDA source"] == str(store_module.cuda_sources()[0])  # it exists: no "(MISSING)"
        assert lines["GPU"].startswith(f"none visible to torch {torch.__version__} (")
        assert lines["nvcc"] == "not found (not here)"
        assert lines["CUDA stores"] == "none (no GPU, no nvcc)"

    def test_a_gpu_without_nvcc_falls_back_to_torch_and_fails(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake(monkeypatch, gpu=True, nvcc=False)
        lines, status = self.run()
        assert status == 1
        assert lines["GPU"].startswith("Fake H200 (torch ")
        assert lines["CUDA stores"] == "torch fallback (no kernel without nvcc)"

    def test_nvcc_without_a_gpu_builds_the_library(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake(monkeypatch, gpu=False, nvcc=True)
        lines, status = self.run()
        assert status == 0
        assert (lines["nvcc"], lines["CUDA library"]) == ("/fake/nvcc", "/fake/libstore.so")
        assert lines["CUDA stores"] == "none (no GPU here; the library is built and cached for this machine)"

    def test_a_failed_build_fails(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake(monkeypatch, gpu=False, nvcc=True, builds=False)
        lines, status = self.run()
        assert (status, lines["CUDA library"]) == (1, "BUILD FAILED: not here")

    def test_a_gpu_with_the_kernel_passes_and_without_it_fails(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake(monkeypatch, gpu=True, nvcc=True)
        lines, status = self.run()
        assert (status, lines["CUDA stores"]) == (0, "the kernel (csrc/store.cu)")
        self.fake(monkeypatch, gpu=True, nvcc=True, kernel=False)
        lines, status = self.run()
        assert (status, lines["CUDA stores"]) == (1, "torch fallback: the library was built but does not load")

    def test_no_c_module_fails_at_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from radixspec.optimized import build_cuda

        def missing() -> None:
            raise UnavailableError("no _radix_c")

        monkeypatch.setattr(build_cuda, "load_c", missing)
        assert build_cuda.report(False) == (["CPU store:    UNAVAILABLE: no _radix_c"], 1)

    def test_main_prints_the_report_and_passes_force(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from radixspec.optimized import build_cuda

        seen: list[bool] = []
        monkeypatch.setattr(build_cuda, "report", lambda force: (seen.append(force) or ["a", "b"], 3))
        assert build_cuda.main(["--force"]) == 3
        assert build_cuda.main([]) == 3
        assert seen == [True, False]
        assert capsys.readouterr().out == "a\nb\na\nb\n"


class TestBuildingTheCudaLibrary:
    """find_nvcc, cuda_archs and build_store_library, with nvcc and the GPU stood in for."""

    def test_nvcc_is_found_on_path_then_under_cuda_home(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        found = {"nvcc": "/on/path/nvcc", str(tmp_path / "bin" / "nvcc"): "/cuda/home/nvcc"}
        monkeypatch.setenv("CUDA_HOME", str(tmp_path))
        monkeypatch.setattr(store_module.shutil, "which", found.get)
        assert store_module.find_nvcc() == "/on/path/nvcc"
        del found["nvcc"]
        assert store_module.find_nvcc() == "/cuda/home/nvcc"
        monkeypatch.delenv("CUDA_HOME")
        asked: list[str] = []
        monkeypatch.setattr(store_module.shutil, "which", lambda name: asked.append(name))
        with pytest.raises(UnavailableError, match=r"^nvcc not found \(PATH or \$CUDA_HOME/bin\)"):
            store_module.find_nvcc()
        assert asked == ["nvcc", "/usr/local/cuda/bin/nvcc"]

    def test_the_archs_are_hopper_with_ptx_plus_the_local_gpu(self, monkeypatch: pytest.MonkeyPatch) -> None:
        hopper = ["arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"]
        monkeypatch.setattr(store_module.torch.cuda, "is_available", lambda: False)
        assert store_module.cuda_archs() == hopper
        monkeypatch.setattr(store_module.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(store_module.torch.cuda, "get_device_capability", lambda: (8, 0))
        assert store_module.cuda_archs() == [*hopper, "arch=compute_80,code=sm_80"]
        monkeypatch.setattr(store_module.torch.cuda, "get_device_capability", lambda: (9, 0))
        assert store_module.cuda_archs() == hopper

    def fake_nvcc(self, monkeypatch: pytest.MonkeyPatch, fails: bool = False, writes: bool = True) -> list[list[str]]:
        runs: list[list[str]] = []

        def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
            runs.append(command)
            assert kwargs == {"capture_output": True, "text": True, "check": False}
            if writes:
                Path(command[-1]).write_text("partial output")
            return subprocess.CompletedProcess(command, 1 if fails else 0, "", "error: it broke\n" if fails else "")

        monkeypatch.setattr(store_module, "find_nvcc", lambda: "/fake/nvcc")
        monkeypatch.setattr(store_module.torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(store_module.subprocess, "run", run)
        return runs

    def test_a_build_is_cached_by_sources_and_flags_and_forced_again(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        runs = self.fake_nvcc(monkeypatch)
        library = build_store_library(out_dir=tmp_path / "cache")
        source = store_module.cuda_sources()[0]
        flags = [*store_module.NVCC_FLAGS, *(f"-gencode={arch}" for arch in store_module.cuda_archs())]
        assert re.fullmatch(r"libradix_store-[0-9a-f]{16}\.so", library.name) and library.parent == tmp_path / "cache"
        assert library.read_text() == "partial output" and not list(tmp_path.glob("cache/*.tmp"))
        assert runs == [["/fake/nvcc", *flags, f"-I{source.parent}", str(source), "-o", runs[0][-1]]]
        assert runs[0][-1].endswith(".tmp")
        assert build_store_library(out_dir=tmp_path / "cache") == library and len(runs) == 1
        assert build_store_library(out_dir=tmp_path / "cache", force=True) == library and len(runs) == 2
        monkeypatch.setenv("RADIXSPEC_CACHE", str(tmp_path / "env"))
        assert build_store_library().parent == tmp_path / "env"

    def test_a_failed_build_leaves_nothing_and_says_why(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.fake_nvcc(monkeypatch, fails=True)
        with pytest.raises(UnavailableError, match=r"^nvcc failed to build store\.cu:\nerror: it broke$"):
            build_store_library(out_dir=tmp_path)
        assert list(tmp_path.iterdir()) == []

    def test_a_build_that_failed_before_writing_anything_says_why_too(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        self.fake_nvcc(monkeypatch, fails=True, writes=False)
        with pytest.raises(UnavailableError, match="^nvcc failed to build store.cu"):
            build_store_library(out_dir=tmp_path)

    def test_missing_sources_are_named(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setattr(store_module, "cuda_sources", lambda: (tmp_path / "store.cu", tmp_path / "x.h"))
        with pytest.raises(UnavailableError) as error:
            build_store_library(out_dir=tmp_path)
        assert str(error.value) == (
            f"the CUDA sources are missing from this installation: {tmp_path / 'store.cu'}, {tmp_path / 'x.h'}"
        )


def test_read_cdef_takes_the_one_marked_block_of_each_header(tmp_path: Path) -> None:
    first, second, bad = tmp_path / "a.h", tmp_path / "b.h", tmp_path / "c.h"
    first.write_text("int x;\n/* cdef-begin */\nint f(void);\n/* cdef-end */\nint y;")
    second.write_text("/* cdef-begin */int g(int);/* cdef-end */")
    assert read_cdef(first, second) == "\nint f(void);\n\nint g(int);"
    bad.write_text("/* cdef-begin */ int h(void); /* cdef-begin */ /* cdef-end */")
    with pytest.raises(
        ValueError, match=r"c\.h must hold exactly one /\* cdef-begin \*/ \.\.\. /\* cdef-end \*/ block"
    ):
        read_cdef(bad)
    bad.write_text("int h(void);")
    with pytest.raises(ValueError):
        read_cdef(bad)
    assert (csrc_dir() / "store.cu").exists()


def test_the_sources_are_the_packages_own_in_a_wheel_else_the_checkouts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from radixspec.optimized import cdefs

    package = tmp_path / "site" / "optimized"
    (package / "csrc").mkdir(parents=True)
    monkeypatch.setattr(cdefs, "__file__", str(package / "cdefs.py"))
    assert cdefs.csrc_dir() == tmp_path / "site" / "csrc"  # a checkout: csrc/ beside the package
    (package / "csrc" / "store.cu").write_text("")
    assert cdefs.csrc_dir() == package / "csrc"  # a wheel: the sources shipped inside it


def test_the_report_names_a_missing_source_the_cuda_build_and_passes_force(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixspec.optimized import build_cuda

    forced: list[bool] = []
    monkeypatch.setattr(build_cuda, "cuda_sources", lambda: (Path("/nowhere/store.cu"),))
    monkeypatch.setattr(build_cuda.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(build_cuda.torch.version, "cuda", "12.4")
    monkeypatch.setattr(build_cuda, "find_nvcc", lambda: "/fake/nvcc")
    monkeypatch.setattr(build_cuda, "build_store_library", lambda force: forced.append(force) or Path("/lib.so"))
    lines, status = build_cuda.report(True)
    assert lines[1:3] == [
        "CUDA source:  /nowhere/store.cu (MISSING)",
        f"GPU:          none visible to torch {torch.__version__} (CUDA 12.4)",
    ]
    monkeypatch.setattr(build_cuda.torch.version, "cuda", None)
    expected = f"GPU:          none visible to torch {torch.__version__} (a CPU-only build)"
    assert build_cuda.report(False)[0][2] == expected
    assert forced == [True, False] and status == 0


def test_the_command_names_itself_and_its_option(capsys: pytest.CaptureFixture[str]) -> None:
    from radixspec.optimized import build_cuda

    with pytest.raises(SystemExit):
        build_cuda.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m radixspec.optimized.build_cuda [-h] [--force]")
    assert "build the CUDA store kernel now" in out and "rebuild the CUDA library even if cached" in out


def test_the_library_cache_defaults_to_the_home_cache_and_makes_its_parents(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    TestBuildingTheCudaLibrary().fake_nvcc(monkeypatch)
    monkeypatch.delenv("RADIXSPEC_CACHE", raising=False)
    monkeypatch.setattr(store_module.Path, "home", lambda: tmp_path / "home")
    assert build_store_library().parent == tmp_path / "home" / ".cache" / "radixspec"
    assert build_store_library(out_dir=tmp_path / "a" / "b").parent == tmp_path / "a" / "b"
    # the name hashes the sources and the flags: other flags, another library
    first = build_store_library(out_dir=tmp_path / "c")
    monkeypatch.setattr(store_module, "NVCC_FLAGS", [*store_module.NVCC_FLAGS, "-lineinfo"])
    assert build_store_library(out_dir=tmp_path / "c") != first


class TestThePoolSaysWhy:
    """MHAKVCache's checks: each bad argument refused with its own message, nothing written."""

    @staticmethod
    def pool(heads: int = 2, head_dim: int = 4, mode: str = "checked") -> MHAKVCache:
        return MHAKVCache(
            heads, 2, head_dim, num_pages=4, page_size=4, dtype=torch.float32, device="cpu", store_mode=mode
        )

    @staticmethod
    def refused(call: Any, error: type, message: str) -> None:
        with pytest.raises(error) as raised:
            call()
        assert str(raised.value) == message

    def test_the_sizes_dtype_and_mode(self) -> None:
        sizes = {"num_kv_heads": 1, "num_layers": 1, "head_dim": 1, "num_pages": 1, "page_size": 1}
        for name in ("num_kv_heads", "num_layers", "head_dim"):
            for value in (0, True):
                self.refused(
                    lambda name=name, value=value: MHAKVCache(
                        **{**sizes, name: value}, dtype=torch.float32, device="cpu"
                    ),
                    InvalidSizeError,
                    f"{name} must be an int >= 1, got {value!r}",
                )
        # the page and pool sizes are the spec's domains, as a CacheManager checks them
        for name, value, error, message in (
            ("page_size", 0, InvalidInputError, "page_size must be >= 1, got 0"),
            ("page_size", True, InvalidTypeError, "page_size must be an int, got bool"),
            ("num_pages", 0, InvalidSizeError, "num_pages must be >= 1, got 0"),
            ("num_pages", True, InvalidTypeError, "num_pages must be an int, got bool"),
        ):
            self.refused(
                lambda name=name, value=value: MHAKVCache(**{**sizes, name: value}, dtype=torch.float32, device="cpu"),
                error,
                message,
            )
        self.refused(
            lambda: MHAKVCache(**sizes, dtype=torch.int32, device="cpu"),
            InvalidTypeError,
            "dtype must be a float torch.dtype, got torch.int32",
        )
        self.refused(
            lambda: MHAKVCache(**sizes, dtype=torch.float32, device="cpu", store_mode="quick"),
            InvalidInputError,
            "store_mode must be one of ('checked', 'fast'), got 'quick'",
        )

    def test_the_rows_a_store_takes(self) -> None:
        pool, out = self.pool(), torch.tensor([0, 1, 2])
        rows = torch.zeros(3, 8)
        cases = [
            ([0.0], "k must be a torch.Tensor, got list", InvalidTypeError),
            (torch.zeros(3, 3, 4), "k is (3, 3, 4), the pool holds [n, 2, 4]", LengthMismatchError),
            (
                torch.zeros(3, 4, 2).transpose(1, 2),
                "k must be contiguous within a token, got strides (8, 1, 2)",
                InvalidTypeError,
            ),
            (
                torch.zeros(3, 2, 8)[:, :, :4],
                "k must be contiguous within a token, got strides (16, 8, 1)",
                InvalidTypeError,
            ),
            (
                torch.zeros(3, 1, 2, 4),
                "k must be [n, heads, head_dim] or [n, heads * head_dim], got (3, 1, 2, 4)",
                InvalidTypeError,
            ),
        ]
        for k, message, error in cases:
            self.refused(lambda k=k: pool.store_kv(k, rows, out, 0), error, message)
        self.refused(lambda: pool.store_kv(rows, rows, out, 2), InvalidInputError, "layer_id 2 outside 0..1")
        self.refused(lambda: pool.store_kv(rows, rows, out, True), InvalidInputError, "layer_id True outside 0..1")
        assert not pool.k_cache(0).any() and not pool.v_cache(1).any()

    def test_one_head_or_one_value_per_head_keeps_no_stride_there(self) -> None:
        # [n, 1, 4] cut from [n, 2, 4]: its head stride is 8, which one head never uses
        one_head = self.pool(heads=1)
        k = torch.arange(24.0).reshape(3, 2, 4)[:, :1, :]
        one_head.store_kv(k, k, torch.tensor([5, 0, 9]), 1)
        k_back, _ = one_head.gather_kv(torch.tensor([5, 0, 9]), 1)
        assert torch.equal(k_back, k)
        # [n, 2, 1] cut from [n, 2, 2]: its value stride is 2, which one value per head never uses
        one_value = self.pool(head_dim=1)
        with pytest.raises(InvalidTypeError, match=r"strides \(4, 2, 1\)"):
            one_value.store_kv(torch.zeros(3, 2, 2)[:, :, :1], torch.zeros(3, 2, 1), torch.tensor([0, 1, 2]), 0)
        v = torch.arange(6.0).reshape(3, 2, 1)
        one_value.store_kv(v, v, torch.tensor([0, 1, 2]), 0)
        assert torch.equal(one_value.gather_kv(torch.tensor([0, 1, 2]), 0)[1], v)
        # one row: any row stride; no rows: any strides at all
        row = torch.arange(16.0).reshape(2, 2, 4)[1:]
        one_value_pool = self.pool()
        one_value_pool.store_kv(row, row, torch.tensor([7]), 0)
        assert torch.equal(one_value_pool.gather_kv(torch.tensor([7]), 0)[0], row)
        one_value_pool.store_kv(
            torch.zeros(0, 4, 2).transpose(1, 2), torch.zeros(0, 8), torch.tensor([], dtype=torch.int64), 0
        )

    def test_the_within_token_strides_of_each_shape(self) -> None:
        out = torch.tensor([3, 5, 6])
        # one value per head: the value stride is never read, the head stride must be 1
        one_value = self.pool(head_dim=1)
        base = torch.arange(8.0)
        k = base.as_strided((3, 2, 1), (2, 1, 5))
        one_value.store_kv(k, k, out, 0)
        assert torch.equal(one_value.gather_kv(out, 0)[0], k)
        # two values per head: they must be consecutive, whatever the head stride
        two_values = self.pool(head_dim=2)
        spread = torch.arange(32.0).as_strided((3, 2, 2), (4, 2, 3))
        self.refused(
            lambda: two_values.store_kv(spread, spread, out, 0),
            InvalidTypeError,
            "k must be contiguous within a token, got strides (4, 2, 3)",
        )
        # one token: its row stride is free, its within-token strides are not
        token = torch.zeros(1, 2, 8)[:, :, :4]
        self.refused(
            lambda: self.pool().store_kv(token, token, out[:1], 0),
            InvalidTypeError,
            "k must be contiguous within a token, got strides (16, 8, 1)",
        )
        assert not two_values.k_cache(0).any()

    def test_the_slots_a_gather_takes(self) -> None:
        pool = self.pool()
        self.refused(lambda: pool.gather_kv([0], 0), InvalidTypeError, "indices must be a 1-D int32/int64 tensor")
        self.refused(
            lambda: pool.gather_kv(torch.zeros(1, 1, dtype=torch.int64), 0),
            InvalidTypeError,
            "indices must be a 1-D int32/int64 tensor",
        )
        self.refused(
            lambda: pool.gather_kv(torch.zeros(1), 0), InvalidTypeError, "indices must be a 1-D int32/int64 tensor"
        )
        self.refused(
            lambda: pool.gather_kv(torch.tensor([-1, 3]), 0), SlotOutOfRangeError, "slots -1..3 outside the pool of 16"
        )
        self.refused(
            lambda: pool.gather_kv(torch.tensor([16]), 0), SlotOutOfRangeError, "slots 16..16 outside the pool of 16"
        )
        assert pool.gather_kv(torch.tensor([15], dtype=torch.int32), 0)[0].shape == (1, 2, 4)
        assert pool.gather_kv(torch.tensor([], dtype=torch.int64), 1)[1].shape == (0, 2, 4)

    def test_a_fast_store_flags_a_skipped_row_once(self) -> None:
        pool = self.pool(mode="fast")
        rows = torch.ones(2, 8)
        pool.store_kv(rows, rows, torch.tensor([3, 99]), 0)
        self.refused(
            pool.check_store_errors,
            SlotOutOfRangeError,
            "a fast store skipped rows whose slot lies outside the pool of 16 slots",
        )
        pool.check_store_errors()  # the flags were cleared
        assert pool.store_errors.dtype == torch.int32 and int(pool.store_errors) == 0
        assert pool.k_cache(0)[3].sum() == 8 and pool.k_cache(1).sum() == 0


@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=3),
    st.lists(st.integers(0, 7), min_size=3, max_size=3),
    st.integers(0, 5),
    st.sampled_from([torch.int8, torch.float32, torch.bfloat16]),
)
@example([4], [3, 0, 0], 1, torch.float32)  # 1-D
@example([3, 4], [5, 2, 0], 2, torch.bfloat16)  # 2-D, inner stride 2
@example([2, 3, 4], [7, 3, 1], 0, torch.int8)  # 3-D
def test_byte_span_is_the_first_and_past_the_last_byte_an_element_touches(
    shape: list[int], strides: list[int], offset: int, dtype: torch.dtype
) -> None:
    base = torch.zeros(256, dtype=dtype)
    t = base.as_strided(shape, strides[: len(shape)], offset)
    size = base.element_size()
    offsets = [offset]
    for n, stride in zip(shape, strides, strict=False):
        offsets = [o + i * stride for o in offsets for i in range(n)]
    expected = (
        (0, 0) if t.numel() == 0 else (base.data_ptr() + offset * size, base.data_ptr() + (max(offsets) + 1) * size)
    )
    span = store_module.byte_span(t)
    assert span == expected and all(type(end) is int for end in span)


@given(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6), st.integers(0, 6))
@example(3, 3, 0, 6)  # an empty span overlaps nothing
@example(0, 6, 3, 3)
@example(2, 4, 0, 2)  # spans that only touch do not overlap
@example(0, 2, 2, 4)
def test_spans_overlap_when_they_share_a_byte(a0: int, a1: int, b0: int, b1: int) -> None:
    assert store_module.spans_overlap((a0, a1), (b0, b1)) == bool(set(range(a0, a1)) & set(range(b0, b1)))


def test_the_error_word_must_be_one_int32_on_the_caches_device() -> None:
    from radixspec.optimized.store import check_errors_word

    word = torch.zeros(1, dtype=torch.int32)
    assert check_errors_word(word, torch.device("cpu")) is word
    for bad in (torch.zeros(1), torch.zeros(2, dtype=torch.int32), [0]):
        with pytest.raises(InvalidTypeError) as raised:
            check_errors_word(bad, torch.device("cpu"))
        assert str(raised.value) == "errors must be a one-element int32 tensor (see MHAKVCache.store_errors)"
    with pytest.raises(InvalidTypeError) as raised:
        check_errors_word(word, torch.device("meta"))
    assert str(raised.value) == "errors is on cpu, the caches on meta"


def test_the_torch_index_check_says_ok_as_the_c_store_does() -> None:
    assert find_first_bad_row(torch.tensor([], dtype=torch.int64), 4) == (StoreStatus.OK, -1)
    assert find_first_bad_row(torch.tensor([3, 0, 1]), 4) == (StoreStatus.OK, -1)
    assert find_first_bad_row(torch.tensor([3, 0, 3, 9]), 4) == (StoreStatus.DUPLICATE, 2)
    assert find_first_bad_row(torch.tensor([3, 9, 3]), 4) == (StoreStatus.OUT_OF_RANGE, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_pool_holds_k_and_v_of_every_layer_and_nothing_more(dtype: torch.dtype) -> None:
    pool = MHAKVCache(num_kv_heads=2, num_layers=3, head_dim=8, num_pages=4, page_size=2, dtype=dtype, device="cpu")
    planes, item = 2, torch.empty(0, dtype=dtype).element_size()  # K and V
    assert pool.k_cache(0).untyped_storage().nbytes() == planes * 3 * (4 * 2) * 2 * 8 * item
    assert pool.k_cache(2).untyped_storage().data_ptr() == pool.v_cache(0).untyped_storage().data_ptr()


def test_the_build_cuda_command_says_what_force_does(capsys: pytest.CaptureFixture[str]) -> None:
    from radixspec.optimized.build_cuda import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--force rebuild the CUDA library even if cached" in " ".join(capsys.readouterr().out.split())
