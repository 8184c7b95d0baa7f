"""``fast_compare_key``: the common prefix length of two token arrays, in C (csrc/radix.c via cffi).

Twin of ``radixspec.spec.helpers.compute_match_len``. The wrapper validates (1-D,
contiguous, CPU, same integer dtype int32/int64) and raises InvalidTypeError
otherwise; the C side checks its own arguments and returns -1 if invalid.
"""

from __future__ import annotations

import torch

from radixspec.spec.errors import InvalidTypeError

from ._c import load_c

_C_NAMES = {torch.int32: ("int32_t *", "radix_compare_i32"), torch.int64: ("int64_t *", "radix_compare_i64")}


def check_key(t: object, what: str) -> torch.Tensor:
    """``t`` if it is a 1-D contiguous CPU int32/int64 tensor, else raise InvalidTypeError."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.device.type != "cpu" or t.dtype not in _C_NAMES or not t.is_contiguous():
        raise InvalidTypeError(
            f"{what} must be a 1-D contiguous CPU int32/int64 tensor,"
            f" got {t.dim()}-D {t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"
        )
    return t


def fast_compare_key(key: torch.Tensor, input_ids: torch.Tensor) -> int:
    """Length of the common prefix of ``key`` and ``input_ids`` (same dtype, CPU, 1-D, contiguous)."""
    # CHECK
    check_key(key, "key")
    check_key(input_ids, "input_ids")
    if key.dtype != input_ids.dtype:
        raise InvalidTypeError(f"key is {key.dtype} but input_ids is {input_ids.dtype}")
    # WALK
    return compare_raw(key.dtype, key.data_ptr(), input_ids.data_ptr(), min(key.numel(), input_ids.numel()))


def compare_raw(dtype: torch.dtype, a_ptr: int, b_ptr: int, n: int) -> int:
    """The C compare on raw data pointers (for callers that validated once and index by offset)."""
    ffi, lib = load_c()
    c_type, fn = _C_NAMES[dtype]
    result = int(getattr(lib, fn)(ffi.cast(c_type, a_ptr), ffi.cast(c_type, b_ptr), n))
    if result < 0:
        raise InvalidTypeError(f"{fn} rejected its arguments (n={n})")
    return result


def first_outside(t: torch.Tensor, max_value: int) -> int:
    """Index of the first value of a 1-D int32/int64 tensor outside ``[0, max_value]``, or its length if none."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return first_outside_torch(t, max_value)
    ffi, lib = load_c()
    if t.dtype == torch.int32:
        result = int(lib.radix_first_outside_i32(ffi.cast("int32_t *", t.data_ptr()), t.numel(), max_value))
    else:
        result = int(lib.radix_first_outside_i64(ffi.cast("int64_t *", t.data_ptr()), t.numel(), max_value))
    if result < 0:
        raise InvalidTypeError("radix_first_outside rejected its arguments")
    return result


def first_bad_page(slots: torch.Tensor, page_size: int) -> int:
    """Index of the first page of ``slots`` (int32, whole pages) that is not an aligned run; #pages if none."""
    if slots.device.type != "cpu" or not slots.is_contiguous():
        return first_bad_page_torch(slots, page_size)
    ffi, lib = load_c()
    npages = slots.numel() // page_size
    result = int(lib.radix_first_bad_page_i32(ffi.cast("int32_t *", slots.data_ptr()), npages, page_size))
    if result < 0:
        raise InvalidTypeError("radix_first_bad_page rejected its arguments")
    return result


def first_outside_torch(t: torch.Tensor, max_value: int) -> int:
    """first_outside in torch ops (any device, any strides; one sync)."""
    outside = torch.nonzero((t < 0) | (t > max_value))
    return int(outside[0, 0]) if outside.numel() else t.numel()


def first_bad_page_torch(slots: torch.Tensor, page_size: int) -> int:
    """first_bad_page in torch ops (any device, any strides; one sync)."""
    npages = slots.numel() // page_size
    pages = slots.reshape(npages, page_size)
    offsets = torch.arange(page_size, dtype=slots.dtype, device=slots.device)
    bad = (pages[:, 0] < 0) | (pages[:, 0] % page_size != 0) | (pages != pages[:, :1] + offsets).any(dim=1)
    where = torch.nonzero(bad)
    return int(where[0, 0]) if where.numel() else npages
