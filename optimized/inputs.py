"""Input checks of the optimized implementation: token ids and slot indices as tensors.

Token ids and slots come as 1-D int32/int64 CPU tensors, numpy arrays, ``array('q')`` (any
buffer of native int32/int64), lists or tuples of ints. Twins of ``radixspec.spec.domains.check_token_ids`` /
``check_slot_indices`` and of the spec's devices: the same errors for the same bad input (InvalidTypeError for a
wrong type, InvalidInputError for a token outside ``[0, 2**63)``,
SlotOutOfRangeError for a slot outside ``[0, 2**31)``), checked on the whole
tensor at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from radixspec.spec.domains import (
    SLOT_LIMIT,
    TOKEN_LIMIT,
    Namespace,
    check_namespace,
    check_slot_indices,
    check_token_ids,
    copied_fields,
)
from radixspec.spec.errors import (
    InvalidInputError,
    InvalidTypeError,
    LengthMismatchError,
    SlotOutOfRangeError,
    UnavailableError,
)

from .radix_kernel import first_outside

INT_DTYPES = (torch.int32, torch.int64)


def device_of(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device that this torch can use, or raise (InvalidTypeError, UnavailableError)."""
    try:
        checked = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidTypeError(f"not a torch device: {device!r} ({exc})") from None
    if checked.type not in ("cpu", "cuda"):
        # 'meta' holds no data (the evicted slots would be lost); the stores run on the CPU and on CUDA only
        raise InvalidInputError(f"device {str(checked)!r}: the caches run on 'cpu' and 'cuda' devices only")
    if checked.type == "cuda":
        if not torch.cuda.is_available():
            built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise UnavailableError(
                f"device {str(checked)!r} asked for, but torch {torch.__version__} ({built}) sees no CUDA device;"
                " use device='cpu'"
            )
        if checked.index is not None and checked.index >= torch.cuda.device_count():
            raise UnavailableError(f"device {str(checked)!r} asked for, but only {torch.cuda.device_count()} GPUs")
    return checked


def int_view(values: object) -> memoryview | None:
    """``values`` as a buffer of native int32/int64, 1-D and contiguous (numpy arrays, ``array('q' / 'l' / 'i')``),
    for C to read in place; None for anything else (lists, tensors, other dtypes: checked as sequences)."""
    if isinstance(values, (list, tuple, str, bytes, bytearray, torch.Tensor)):
        return None
    try:
        view = memoryview(values)  # type: ignore[arg-type]
    except TypeError:
        return None
    if view.ndim == 1 and view.c_contiguous and view.format in ("q", "l", "i") and view.itemsize in (4, 8):
        return view
    return None


def as_sequence(values: object) -> object:
    """``values`` for the spec's sequence checks: an array that is not a ``Sequence`` (numpy's) as its list."""
    if isinstance(values, Sequence) or not callable(getattr(values, "tolist", None)):
        return values
    return values.tolist()  # type: ignore[attr-defined]


def as_tokens(input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Token ids as a contiguous 1-D int64 CPU tensor (the caller's own when it is one already)."""
    if not isinstance(input_ids, torch.Tensor):
        return torch.tensor(check_token_ids(as_sequence(input_ids)), dtype=torch.int64)
    if input_ids.numel() == 0 and input_ids.device.type == "cpu":
        return torch.empty(0, dtype=torch.int64)  # torch.tensor([]) is float32: accept it as empty
    if input_ids.dim() != 1 or input_ids.dtype not in INT_DTYPES or input_ids.device.type != "cpu":
        raise InvalidTypeError(
            f"input_ids must be a 1-D int32/int64 CPU tensor, got {input_ids.dim()}-D {input_ids.dtype}"
            f" on {input_ids.device}"
        )
    ids = input_ids.to(torch.int64).contiguous()  # the same tensor when it is one already
    bad = first_outside(ids, TOKEN_LIMIT - 1)
    if bad < ids.numel():
        raise InvalidInputError(f"input_ids[{bad}] = {int(ids[bad])} is outside [0, 2**63)")
    return ids


def as_slots(indices: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """Slot indices as a 1-D int32 tensor on ``device`` (the caller's own when it is one already)."""
    if not isinstance(indices, torch.Tensor):
        return torch.tensor(check_slot_indices(as_sequence(indices)), dtype=torch.int32, device=device)
    if indices.numel() == 0 and indices.device == device:
        return torch.empty(0, dtype=torch.int32, device=device)
    if indices.dim() != 1 or indices.dtype not in INT_DTYPES:
        raise InvalidTypeError(f"indices must be a 1-D int32/int64 tensor, got {indices.dim()}-D {indices.dtype}")
    if indices.device != device:
        raise InvalidTypeError(f"indices are on {indices.device}, the cache's slots live on {device}")
    bad = first_outside(indices, SLOT_LIMIT - 1)
    if bad < indices.numel():
        raise SlotOutOfRangeError(f"indices[{bad}] = {int(indices[bad])} is outside [0, 2**31)")
    return indices.to(torch.int32)  # the same tensor when it is int32 already


def as_insert_args(
    input_ids: torch.Tensor | Sequence[int],
    indices: torch.Tensor | Sequence[int],
    namespace: object,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, Namespace]:
    """insert_prefix's arguments checked in the reference's order: tokens, slots, namespace, lengths."""
    ids = as_tokens(input_ids)
    slots = as_slots(indices, device)
    checked_namespace = check_namespace(namespace)
    if ids.numel() != slots.numel():
        raise LengthMismatchError.tokens_and_slots(ids.numel(), slots.numel())
    return ids, slots, checked_namespace


T = TypeVar("T")


def copied_with_tensors(original: T, memo: dict[int, object]) -> T:
    """A deep copy of ``original``, field by field (``spec.domains.copied_fields``), its tensors cloned (torch's own
    deep copy costs ten times more; none of ours is a view of another)."""
    tensors = {name: torch.Tensor.clone for name, value in vars(original).items() if isinstance(value, torch.Tensor)}
    return copied_fields(original, memo, made=tensors)
