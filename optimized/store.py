"""``store_cache``: write K/V rows into the slots a prefix cache handed out. Twin of the seed's ``kernel/store.py``.

Two modes, two functions:

* ``store_cache`` (checked; the default for tests, the fuzzer and direct
  calls): every check runs before the first write, and a bad index is
  reported with the first bad row. On CUDA the index check costs one host
  sync.
* ``store_cache_fast`` (the Engine's hot path): no host sync, no allocation,
  O(rows) work, capturable in a CUDA graph. It still does every check that
  needs no look at the indices' values (types, dtypes, devices, shapes,
  strides, overlapping buffers: all on the host, from tensor metadata). A
  row whose index is out of range is skipped, never written, and flagged in
  the caller's ``errors`` word (``MHAKVCache.check_store_errors`` reads it).
  Duplicate indices are not detected: one of the rows wins (the last, on the
  CPU). Finding such a bug is what the checked mode is for.

CPU: csrc/store.c through the cffi module. CUDA: csrc/store.cu, built by nvcc
into a shared library (``python -m radixspec.optimized.build_cuda`` builds it; the first
CUDA store builds it too, cached under ``$RADIXSPEC_CACHE`` or
``~/.cache/radixspec``) and loaded with cffi's ABI mode; launched on torch's
current stream of the caches' device. Without nvcc or a GPU, CUDA tensors
take a torch fallback (same checks and errors; it syncs).

Rules: caches ``[num_slots, D]``, dense, not overlapping each other; ``k``/``v``
``[n, D]`` with unit inner stride and any row stride (slices of a fused qkv
tensor, broadcast rows), not overlapping a cache; indices int32 or int64, in
range, no index twice (DuplicateSlotError: a serving engine never gives two
tokens one slot, so a duplicate is the bug to report, not a race to resolve).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from enum import IntEnum
from pathlib import Path
from typing import Any

import torch
from cffi import FFI

from radixspec.spec.errors import (
    DuplicateSlotError,
    InvalidSizeError,
    InvalidTypeError,
    KernelError,
    LengthMismatchError,
    OverlappingBuffersError,
    SlotOutOfRangeError,
    UnavailableError,
)

from ._c import load_c
from .cdefs import csrc_dir, read_cdef

NVCC_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror"]

# the status codes, read from the header the C and CUDA sources include (constants need no library:
# dlopen(None) is the running process)
_STATUS_FFI = FFI()
_STATUS_FFI.cdef(read_cdef(csrc_dir() / "store_status.h"))
_STATUS = _STATUS_FFI.dlopen(None)


class StoreStatus(IntEnum):
    """``enum radix_store_status`` of csrc/store_status.h (positive values are CUDA errors)."""

    OK = _STATUS.RADIX_STORE_OK
    BAD_ARGS = _STATUS.RADIX_STORE_BAD_ARGS
    OUT_OF_RANGE = _STATUS.RADIX_STORE_OUT_OF_RANGE
    DUPLICATE = _STATUS.RADIX_STORE_DUPLICATE
    NO_MEMORY = _STATUS.RADIX_STORE_NO_MEMORY


# bit a fast store ORs into its errors word for a skipped out-of-range row
FLAG_OUT_OF_RANGE = _STATUS.RADIX_STORE_FLAG_OUT_OF_RANGE
# rows the checked CPU store compares pairwise for duplicates (a hash set above)
PAIRWISE_MAX = _STATUS.RADIX_STORE_PAIRWISE_MAX


# ---------------------------------------------------------------- the CUDA library


def cuda_sources() -> tuple[Path, ...]:
    """store.cu and the headers it includes (shipped in the wheel; in csrc/ of a checkout)."""
    directory = csrc_dir()
    return tuple(directory / name for name in ("store.cu", "store_cuda.h", "store_status.h"))


def cuda_archs() -> list[str]:
    """sm_90 with PTX (Hopper and newer via JIT), plus the local GPU's arch when one is present."""
    archs = ["arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        local = f"arch=compute_{major}{minor},code=sm_{major}{minor}"
        if local not in archs:
            archs.append(local)
    return archs


def find_nvcc() -> str:
    """Path of nvcc (PATH, then $CUDA_HOME/bin), or raise UnavailableError."""
    found = shutil.which("nvcc") or shutil.which(
        str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    )
    if found is None:
        raise UnavailableError("nvcc not found (PATH or $CUDA_HOME/bin): the CUDA store kernel cannot be built")
    return found


def build_store_library(out_dir: Path | None = None, force: bool = False) -> Path:
    """Compile store.cu with nvcc into a shared library (cached by sources and flags); return its path."""
    sources = cuda_sources()
    missing = [str(path) for path in sources if not path.exists()]
    if missing:
        raise UnavailableError(f"the CUDA sources are missing from this installation: {', '.join(missing)}")
    nvcc = find_nvcc()
    flags = [*NVCC_FLAGS, *(f"-gencode={arch}" for arch in cuda_archs())]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources) + " ".join(flags).encode())
    directory = out_dir or Path(os.environ.get("RADIXSPEC_CACHE", Path.home() / ".cache" / "radixspec"))
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"libradix_store-{digest.hexdigest()[:16]}.so"
    if target.exists() and not force:
        return target
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [nvcc, *flags, f"-I{sources[0].parent}", str(sources[0]), "-o", str(partial)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise UnavailableError(f"nvcc failed to build {sources[0].name}:\n{proc.stderr.strip()}")
    partial.replace(target)
    return target


@functools.cache
def _load_store_kernel_once() -> tuple[Any, Any] | UnavailableError:
    """The library, or the reason it is unavailable: kept either way, so a failure is not retried per store."""
    if not torch.cuda.is_available():
        return UnavailableError("no CUDA device: CUDA stores are unavailable (CPU tensors take the C path)")
    ffi = FFI()
    ffi.cdef(read_cdef(csrc_dir() / "store_status.h", csrc_dir() / "store_cuda.h"))
    try:
        return ffi, ffi.dlopen(str(build_store_library()))
    except UnavailableError as exc:
        return exc
    except OSError as exc:
        return UnavailableError(f"the CUDA store library does not load: {exc}")


def load_store_kernel() -> tuple[Any, Any]:
    """The CUDA store library through cffi's ABI mode (built on first use); UnavailableError without it."""
    loaded = _load_store_kernel_once()
    if isinstance(loaded, UnavailableError):
        raise UnavailableError(str(loaded))
    return loaded


def has_cuda_kernel() -> bool:
    """True when CUDA tensors will take the CUDA kernel (a GPU is present and the library built)."""
    return not isinstance(_load_store_kernel_once(), UnavailableError)


# ---------------------------------------------------------------- checks


def check_store_args(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Raise a project error unless shapes, dtypes, devices, strides and overlaps allow a correct store.

    Reads tensor metadata only (no device sync).
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("indices", indices), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_cache.dim() != 2 or v_cache.dim() != 2 or k_cache.shape != v_cache.shape:
        raise InvalidTypeError(
            f"caches must both be [num_slots, D], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise InvalidTypeError("caches must be contiguous")
    dtype, device, width = k_cache.dtype, k_cache.device, k_cache.shape[1]
    if width == 0:
        raise InvalidSizeError("cache rows hold no values (D == 0)")
    if not dtype.is_floating_point:
        raise InvalidTypeError(f"caches must hold a float dtype, got {dtype}")
    for name, t in (("v_cache", v_cache), ("k", k), ("v", v)):
        if t.dtype != dtype:
            raise InvalidTypeError(f"{name} is {t.dtype}, the caches hold {dtype}")
    for name, t in (("v_cache", v_cache), ("indices", indices), ("k", k), ("v", v)):
        if t.device != device:
            raise InvalidTypeError(f"{name} is on {t.device}, the caches on {device}")
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise InvalidTypeError(f"indices must be 1-D int32/int64, got {indices.dim()}-D {indices.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 2:
            raise InvalidTypeError(f"{name} must be [n, D], got {tuple(t.shape)}")
        if t.shape[1] != width:
            raise LengthMismatchError(f"{name} rows hold {t.shape[1]} values, cache rows {width}")
        # one row or many: a row is read as D consecutive values
        if t.shape[0] > 0 and width > 1 and t.stride(1) != 1:
            raise InvalidTypeError(f"{name} must have unit inner stride, got strides {t.stride()}")
    if not k.shape[0] == v.shape[0] == indices.shape[0]:
        raise LengthMismatchError(f"k has {k.shape[0]} rows, v {v.shape[0]}, indices {indices.shape[0]}")
    check_no_overlap(k_cache, v_cache, indices, k, v)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory that ``t``'s elements may touch (empty for an empty tensor)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    if t.dim() == 1:  # the common shapes without a Python loop: this runs on every store
        extent = (t.shape[0] - 1) * t.stride(0)
    elif t.dim() == 2:
        extent = (t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1)
    else:
        extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (start, start + (extent + 1) * t.element_size())


def spans_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """True when two non-empty byte spans share a byte."""
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def check_no_overlap(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Raise OverlappingBuffersError when a written cache overlaps the other cache or a buffer read."""
    caches = (("k_cache", byte_span(k_cache)), ("v_cache", byte_span(v_cache)))
    if spans_overlap(caches[0][1], caches[1][1]):
        raise OverlappingBuffersError("k_cache and v_cache share memory: a store would write one through the other")
    for name, t in (("indices", indices), ("k", k), ("v", v)):
        span = byte_span(t)
        for cache_name, cache_span in caches:
            if spans_overlap(span, cache_span):
                raise OverlappingBuffersError(f"{name} overlaps {cache_name}: a store would overwrite what it reads")


def check_errors_word(errors: object, device: torch.device) -> torch.Tensor:
    """``errors`` if it is a one-element int32 tensor on ``device`` (a fast store's error flags), else raise."""
    if not isinstance(errors, torch.Tensor) or errors.dtype != torch.int32 or errors.numel() != 1:
        raise InvalidTypeError("errors must be a one-element int32 tensor (see MHAKVCache.store_errors)")
    if errors.device != device:
        raise InvalidTypeError(f"errors is on {errors.device}, the caches on {device}")
    return errors


def find_first_bad_row(indices: torch.Tensor, num_slots: int) -> tuple[StoreStatus, int]:
    """The first row whose slot is out of range or appeared in an earlier row, with torch ops (one sync).

    The checked store's rule on devices without the C path: (OK, -1) when every index is good.
    """
    n = indices.numel()
    if n == 0:
        return StoreStatus.OK, -1
    index = indices.long()
    rows = torch.arange(n, device=index.device)
    outside = (index < 0) | (index >= num_slots)
    # sorted stably, equal slots sit together in row order: each after the first repeats an earlier row
    ordered, order = torch.sort(index, stable=True)
    repeated = torch.zeros(n, dtype=torch.bool, device=index.device)
    repeated[order[1:][ordered[1:] == ordered[:-1]]] = True
    first_outside = torch.where(outside, rows, n).min()
    first_repeat = torch.where(repeated & ~outside, rows, n).min()
    row_outside, row_repeat = torch.stack([first_outside, first_repeat]).tolist()
    if min(row_outside, row_repeat) == n:
        return StoreStatus.OK, -1
    if row_outside <= row_repeat:
        return StoreStatus.OUT_OF_RANGE, row_outside
    return StoreStatus.DUPLICATE, row_repeat


# ---------------------------------------------------------------- the stores


def store_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write row ``i`` of ``k``/``v`` into slot ``indices[i]`` of ``k_cache``/``v_cache``; all-or-nothing.

    Checked mode: every argument and every index is checked before the first write.
    """
    # CHECK
    check_store_args(k_cache, v_cache, indices, k, v)
    if indices.numel() == 0:
        return
    indices = indices.contiguous()
    num_slots = k_cache.shape[0]
    # UPDATE
    if k_cache.device.type == "cpu":
        ffi, lib = load_c()
        bad = ffi.new("int64_t *")
        status = lib.radix_store_rows(*_c_args(ffi, k_cache, v_cache, indices, k, v), bad)
        raise_for_status(status, int(bad[0]), indices, num_slots)
        return
    if k_cache.device.type == "cuda" and has_cuda_kernel():
        status, row = find_first_bad_row(indices, num_slots)
        raise_for_status(status, row, indices, num_slots)
        _launch_cuda(k_cache, v_cache, indices, k, v, _scratch_errors(k_cache.device))
    else:
        store_torch(k_cache, v_cache, indices, k, v)


def store_cache_fast(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    """The same store for the hot path: no host sync; out-of-range rows skipped and flagged in ``errors``.

    ``errors`` (one int32 on the caches' device) gets ``FLAG_OUT_OF_RANGE`` ORed in;
    nothing reads or clears it here. Duplicate indices are not detected.
    """
    # CHECK (metadata only)
    check_store_args(k_cache, v_cache, indices, k, v)
    check_errors_word(errors, k_cache.device)
    if indices.numel() == 0:
        return
    indices = indices.contiguous()
    # UPDATE
    if k_cache.device.type == "cpu":
        ffi, lib = load_c()
        status = lib.radix_store_rows_fast(
            *_c_args(ffi, k_cache, v_cache, indices, k, v), ffi.cast("int32_t *", errors.data_ptr())
        )
        raise_for_status(status, -1, indices, k_cache.shape[0])
    elif k_cache.device.type == "cuda" and has_cuda_kernel():
        _launch_cuda(k_cache, v_cache, indices, k, v, errors)
    else:
        store_torch_fast(k_cache, v_cache, indices, k, v, errors)


def store_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """The checked store in torch ops, for a device without the kernel (arguments checked by the caller):
    every index checked first (one sync), then the rows copied through bytes (torch copies no float8 or
    float4 dtype by index). Runs on any device; the tests compare it with the C store on the CPU."""
    status, row = find_first_bad_row(indices, k_cache.shape[0])
    raise_for_status(status, row, indices, k_cache.shape[0])
    index = indices.long()
    _as_bytes(k_cache).index_copy_(0, index, _as_bytes(k))
    _as_bytes(v_cache).index_copy_(0, index, _as_bytes(v))


def store_torch_fast(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    """The fast store in torch ops, for a device without the kernel: out-of-range rows skipped and flagged
    in ``errors`` (boolean indexing syncs; only the kernel avoids it). Runs on any device."""
    index = indices.long()
    inside = (index >= 0) & (index < k_cache.shape[0])
    errors.bitwise_or_((~inside).any().to(torch.int32) * FLAG_OUT_OF_RANGE)
    _as_bytes(k_cache)[index[inside]] = _as_bytes(k)[inside]
    _as_bytes(v_cache)[index[inside]] = _as_bytes(v)[inside]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, D]`` rows of any dtype as ``[n, D * element_size]`` bytes (a view)."""
    return t.view(torch.uint8)


def _row_stride_bytes(t: torch.Tensor) -> int:
    """Bytes from one row of ``t`` to the next (0 for broadcast rows; any value for one row)."""
    return t.stride(0) * t.element_size() if t.shape[0] > 1 else 0


def _c_args(
    ffi: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[Any, ...]:
    """The arguments both CPU stores share, in csrc/store.h's order (up to the last one)."""
    return (
        ffi.cast("char *", k_cache.data_ptr()),
        ffi.cast("char *", v_cache.data_ptr()),
        k_cache.shape[0],
        k_cache.shape[1] * k_cache.element_size(),
        ffi.cast("void *", indices.data_ptr()),
        indices.element_size(),
        indices.numel(),
        ffi.cast("char *", k.data_ptr()),
        _row_stride_bytes(k),
        ffi.cast("char *", v.data_ptr()),
        _row_stride_bytes(v),
    )


def _launch_cuda(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    errors: torch.Tensor,
) -> None:  # pragma: no mutate block (a GPU only: tests/gpu/run_gpu_checks.sh runs it)
    """Launch csrc/store.cu on the caches' device and its current stream (never on whatever device is current)."""
    ffi, lib = load_store_kernel()
    device = k_cache.device
    with torch.cuda.device(device):
        status = lib.radix_store_launch(
            ffi.cast("void *", k_cache.data_ptr()),
            ffi.cast("void *", v_cache.data_ptr()),
            ffi.cast("void *", indices.data_ptr()),
            indices.element_size(),
            indices.numel(),
            k_cache.shape[0],
            k_cache.shape[1] * k_cache.element_size(),
            ffi.cast("void *", k.data_ptr()),
            _row_stride_bytes(k),
            ffi.cast("void *", v.data_ptr()),
            _row_stride_bytes(v),
            ffi.cast("int32_t *", errors.data_ptr()),
            ffi.cast("void *", torch.cuda.current_stream(device).cuda_stream),
        )
    if status > 0:
        message = ffi.string(lib.radix_cuda_error_string(status)).decode()
        raise KernelError(f"radix_store_launch: CUDA error {status} ({message})")
    raise_for_status(status, -1, indices, k_cache.shape[0])


@functools.cache
def _scratch_errors(device: torch.device) -> torch.Tensor:
    """An error word for checked CUDA stores (their indices were checked: the kernel never sets it)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def raise_for_status(status: int, row: int, indices: torch.Tensor, num_slots: int) -> None:
    """Raise the project error for a store status (nothing for OK); ``row`` names the first bad row."""
    if status == StoreStatus.OK:
        return
    where = f"row {row} (slot {int(indices[row])})" if row >= 0 else "some row"
    if status == StoreStatus.OUT_OF_RANGE:
        raise SlotOutOfRangeError(f"{where}: slot index outside the pool of {num_slots} slots; nothing was written")
    if status == StoreStatus.DUPLICATE:
        raise DuplicateSlotError(f"{where}: slot index given to an earlier row too; nothing was written")
    if status == StoreStatus.NO_MEMORY:
        raise KernelError(f"no host memory for the duplicate check of {indices.numel()} rows; nothing was written")
    if status == StoreStatus.BAD_ARGS:
        raise InvalidTypeError("the store rejected its arguments (a pointer, count or stride the checks let through)")
    raise KernelError(f"the store failed with status {status}")
