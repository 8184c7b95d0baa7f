"""``store_cache``: write K/V rows into the slots a prefix cache handed out. Twin of the seed's store.cu.

CPU: csrc/store.c through the cffi module (validates every index, then
memcpy per row). CUDA: csrc/store.cu, built by nvcc into a shared library
(``python -m optimized.kv_store`` builds it; the first CUDA store builds it
too, cached under ``$RADIXSPEC_CACHE`` or ``~/.cache/radixspec``) and loaded
with cffi ABI mode; launched on torch's current CUDA stream. Without nvcc or
a GPU, ``load_store_kernel`` raises UnavailableError and CUDA tensors take a
torch fallback; CPU tensors always take the C path.

Rules: caches ``[num_slots, D]`` dense; ``k``/``v`` ``[n, D]`` with unit
inner stride and any row stride (slices of a fused qkv tensor); indices
int32 or int64, in range, **no index twice** (DuplicateSlotError: a serving
engine never gives two tokens one slot, so a duplicate is the bug to report,
not a race to resolve). Every check runs before the first write.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from spec.errors import (
    DuplicateSlotError,
    InvalidTypeError,
    LengthMismatchError,
    SlotOutOfRangeError,
    UnavailableError,
)

from .radix_kernel import _load

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "store.cu"
CUDA_CDEF = """
int radix_store_launch(void *k_cache, void *v_cache, const void *indices, int index_bytes, int64_t n,
                       int64_t num_slots, int64_t row_bytes, const void *k, int64_t k_stride, const void *v,
                       int64_t v_stride, void *error, void *stream);
int radix_check_indices_launch(const void *indices, int index_bytes, int64_t n, int64_t num_slots, void *bitmap,
                               void *error, void *stream);
"""
NVCC_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror"]
_ERRORS = {-2: SlotOutOfRangeError, -3: DuplicateSlotError}


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
    """Compile csrc/store.cu with nvcc into a shared library (cached by source and flags); return its path."""
    nvcc = find_nvcc()
    archs = cuda_archs()
    flags = [*NVCC_FLAGS, *(f"-gencode={arch}" for arch in archs)]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    directory = out_dir or Path(os.environ.get("RADIXSPEC_CACHE", Path.home() / ".cache" / "radixspec"))
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"libradix_store-{digest}.so"
    if target.exists() and not force:
        return target
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([nvcc, *flags, str(SOURCE), "-o", str(partial)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise UnavailableError(f"nvcc failed to build {SOURCE.name}:\n{proc.stderr.strip()}")
    partial.replace(target)
    return target


@functools.cache
def load_store_kernel() -> tuple[Any, Any]:
    """The CUDA store library through cffi ABI mode (built on first use); UnavailableError without a GPU."""
    if not torch.cuda.is_available():
        raise UnavailableError("no CUDA device: store_cache uses the CPU path")
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(CUDA_CDEF)
    return ffi, ffi.dlopen(str(build_store_library()))


def has_cuda_kernel() -> bool:
    """True when CUDA tensors will take the CUDA kernel (a GPU is present and the library built)."""
    try:
        load_store_kernel()
    except UnavailableError:
        return False
    return True


def check_store_args(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Raise a project error unless shapes, dtypes, devices and strides allow a correct store."""
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
        if t.shape[0] > 1 and t.shape[1] > 1 and t.stride(1) != 1:
            raise InvalidTypeError(f"{name} must have unit inner stride, got strides {t.stride()}")
        if t.shape[0] > 1 and t.stride(0) < width:
            raise InvalidTypeError(f"{name} rows overlap: row stride {t.stride(0)} < row length {width}")
    if not k.shape[0] == v.shape[0] == indices.shape[0]:
        raise LengthMismatchError(f"k has {k.shape[0]} rows, v {v.shape[0]}, indices {indices.shape[0]}")


def store_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write row ``i`` of ``k``/``v`` into slot ``indices[i]`` of ``k_cache``/``v_cache``; all-or-nothing."""
    # CHECK
    check_store_args(k_cache, v_cache, indices, k, v)
    n = indices.numel()
    if n == 0:
        return
    indices = indices.contiguous()
    # UPDATE
    if k_cache.device.type == "cpu":
        _store_cpu(k_cache, v_cache, indices, k, v)
    elif k_cache.device.type == "cuda" and has_cuda_kernel():
        _store_cuda(k_cache, v_cache, indices, k, v)
    else:
        _store_torch(k_cache, v_cache, indices, k, v)


def _row_stride_bytes(t: torch.Tensor, width: int) -> int:
    return (t.stride(0) if t.shape[0] > 1 else width) * t.element_size()


def _store_cpu(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    ffi, lib = _load()
    width = k_cache.shape[1]
    bad = ffi.new("int64_t *")
    status = lib.radix_store_rows(
        ffi.cast("char *", k_cache.data_ptr()),
        ffi.cast("char *", v_cache.data_ptr()),
        k_cache.shape[0],
        width * k_cache.element_size(),
        ffi.cast("void *", indices.data_ptr()),
        indices.element_size(),
        indices.numel(),
        ffi.cast("char *", k.data_ptr()),
        _row_stride_bytes(k, width),
        ffi.cast("char *", v.data_ptr()),
        _row_stride_bytes(v, width),
        bad,
    )
    if status != 0:
        _raise_for(status, int(bad[0]), indices, k_cache.shape[0])


def _store_cuda(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    ffi, lib = load_store_kernel()
    device = k_cache.device
    stream = ffi.cast("void *", torch.cuda.current_stream(device).cuda_stream)
    num_slots, width = k_cache.shape
    flags = torch.empty(1, dtype=torch.int32, device=device)
    bitmap = torch.empty((num_slots + 31) // 32, dtype=torch.int32, device=device)
    status = lib.radix_check_indices_launch(
        ffi.cast("void *", indices.data_ptr()),
        indices.element_size(),
        indices.numel(),
        num_slots,
        ffi.cast("void *", bitmap.data_ptr()),
        ffi.cast("void *", flags.data_ptr()),
        stream,
    )
    if status != 0:
        raise UnavailableError(f"radix_check_indices_launch failed with CUDA error {status}")
    problem = int(flags[0])
    if problem:
        _raise_for(-2 if problem & 1 else -3, -1, indices, num_slots)
    status = lib.radix_store_launch(
        ffi.cast("void *", k_cache.data_ptr()),
        ffi.cast("void *", v_cache.data_ptr()),
        ffi.cast("void *", indices.data_ptr()),
        indices.element_size(),
        indices.numel(),
        num_slots,
        width * k_cache.element_size(),
        ffi.cast("void *", k.data_ptr()),
        _row_stride_bytes(k, width),
        ffi.cast("void *", v.data_ptr()),
        _row_stride_bytes(v, width),
        ffi.cast("void *", flags.data_ptr()),
        stream,
    )
    if status != 0:
        raise UnavailableError(f"radix_store_launch failed with CUDA error {status}")


def _store_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Fallback for devices without the kernel: torch checks, then index_copy_."""
    num_slots = k_cache.shape[0]
    low, high = torch.aminmax(indices)
    if int(low) < 0 or int(high) >= num_slots:
        _raise_for(-2, -1, indices, num_slots)
    if torch.unique(indices).numel() != indices.numel():
        _raise_for(-3, -1, indices, num_slots)
    k_cache.index_copy_(0, indices.long(), k)
    v_cache.index_copy_(0, indices.long(), v)


def _raise_for(status: int, row: int, indices: torch.Tensor, num_slots: int) -> None:
    where = f"row {row} (slot {int(indices[row])})" if row >= 0 else "some row"
    if status == -2:
        raise SlotOutOfRangeError(f"{where}: slot index outside the pool of {num_slots} slots; nothing was written")
    if status == -3:
        raise DuplicateSlotError(f"{where}: slot index given twice; nothing was written")
    raise InvalidTypeError(f"radix_store_rows rejected its arguments (status {status})")


def main() -> int:
    """``python -m optimized.kv_store``: build the CUDA store library now and print its path."""
    try:
        print(build_store_library(force="--force" in sys.argv))
    except UnavailableError as exc:
        print(f"not built: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
