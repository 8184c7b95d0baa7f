"""``MHAKVCache``: the paged KV pool, where the K/V values behind each slot live. Twin of the seed's mha_pool.py.

One buffer ``(2, num_layers, num_pages, page_size, num_kv_heads, head_dim)``;
layer ``l``'s K is ``buffer[0, l]`` viewed as ``[num_pages * page_size, heads, head_dim]``.
The radix tree only maps tokens to slots; this stores what the slots hold.

``store_mode`` picks how ``store_kv`` writes: ``"checked"`` (``store_cache``:
every index checked before any write) or ``"fast"`` (``store_cache_fast``:
no host sync, out-of-range rows skipped and flagged in ``store_errors``,
which ``check_store_errors`` reads).
"""

from __future__ import annotations

import torch

from radixspec.spec.domains import check_page_size, check_pool_size
from radixspec.spec.errors import (
    InvalidInputError,
    InvalidSizeError,
    InvalidTypeError,
    LengthMismatchError,
    SlotOutOfRangeError,
)

from .inputs import device_of
from .store import FLAG_OUT_OF_RANGE, store_cache, store_cache_fast

STORE_MODES = ("checked", "fast")


class MHAKVCache:
    """Multi-head attention KV pool on one device. Twin of mini-sglang's ``MHAKVCache``."""

    def __init__(
        self,
        num_kv_heads: int,
        num_layers: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        store_mode: str = "checked",
    ) -> None:
        # CHECK (sizes read once as plain ints: an int subclass's dunders may lie)
        sizes = []
        for name, value in (("num_kv_heads", num_kv_heads), ("num_layers", num_layers), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidSizeError.not_positive(name, value)
            sizes.append(int.__int__(value))
        num_kv_heads, num_layers, head_dim = sizes
        page_size = check_page_size(page_size)
        num_pages = check_pool_size(num_pages, page_size)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidTypeError(f"dtype must be a float torch.dtype, got {dtype!r}")
        if store_mode not in STORE_MODES:
            raise InvalidInputError(f"store_mode must be one of {STORE_MODES}, got {store_mode!r}")
        # UPDATE
        self.num_kv_heads, self.num_layers, self.head_dim = num_kv_heads, num_layers, head_dim
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        self.device = device_of(device)
        self.num_slots = num_pages * page_size
        # zero bytes, viewed as the dtype: torch fills no float4 dtype
        shape = (2, num_layers, num_pages, page_size, num_kv_heads, head_dim)
        item = torch.empty(0, dtype=dtype).element_size()
        try:
            buffer = torch.zeros((*shape[:-1], head_dim * item), dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
            size = 2 * num_layers * num_pages * page_size * num_kv_heads * head_dim * item
            raise InvalidSizeError(f"a pool of {size} bytes cannot be allocated on {self.device}: {error}") from None
        self._kv_buffer = buffer.view(dtype)
        self._storage_shape = (self.num_slots, num_kv_heads, head_dim)
        self.store_mode = store_mode
        # fast stores OR their error flags in here; check_store_errors reads and clears it
        self.store_errors = torch.zeros(1, dtype=torch.int32, device=self.device)

    def k_cache(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s K as ``[num_slots, num_kv_heads, head_dim]`` (a view)."""
        return self._kv_buffer[0, self._check_layer(layer_id)].view(self._storage_shape)

    def v_cache(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s V as ``[num_slots, num_kv_heads, head_dim]`` (a view)."""
        return self._kv_buffer[1, self._check_layer(layer_id)].view(self._storage_shape)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """Write token ``i``'s K/V (``[n, heads, head_dim]`` or ``[n, heads * head_dim]``) into slot ``out_loc[i]``.

        Checked mode: all-or-nothing, errors name the first bad row. Fast mode: see ``store_cache_fast``.
        """
        # CHECK
        width = self.num_kv_heads * self.head_dim
        k_cache = self.k_cache(layer_id).view(self.num_slots, width)
        v_cache = self.v_cache(layer_id).view(self.num_slots, width)
        k2, v2 = self._as_rows(k, "k"), self._as_rows(v, "v")
        # UPDATE
        if self.store_mode == "fast":
            store_cache_fast(k_cache, v_cache, out_loc, k2, v2, self.store_errors)
        else:
            store_cache(k_cache, v_cache, out_loc, k2, v2)

    def check_store_errors(self) -> None:
        """Raise SlotOutOfRangeError if a fast store skipped a row since the last check, and clear the flags (syncs)."""
        flags = int(self.store_errors.item())
        self.store_errors.zero_()
        if flags & FLAG_OUT_OF_RANGE:
            raise SlotOutOfRangeError(
                f"a fast store skipped rows whose slot lies outside the pool of {self.num_slots} slots"
            )

    def gather_kv(self, indices: torch.Tensor, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots, ``[n, heads, head_dim]`` each: what attention reads through the page table."""
        # CHECK
        if (
            not isinstance(indices, torch.Tensor)
            or indices.dim() != 1
            or indices.dtype not in (torch.int32, torch.int64)
        ):
            raise InvalidTypeError("indices must be a 1-D int32/int64 tensor")
        if indices.device != self.device:
            raise InvalidTypeError(f"indices are on {indices.device}, the pool on {self.device}")
        if indices.numel():
            low, high = torch.aminmax(indices)
            if int(low) < 0 or int(high) >= self.num_slots:
                raise SlotOutOfRangeError(f"slots {int(low)}..{int(high)} outside the pool of {self.num_slots}")
        # WALK (through bytes: torch indexes no float8 or float4 dtype on the CPU)
        index = indices.long()
        return self._gather(self.k_cache(layer_id), index), self._gather(self.v_cache(layer_id), index)

    def _gather(self, cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of one layer's cache, as a new ``[n, heads, head_dim]`` tensor."""
        rows = cache.view(self.num_slots, -1).view(torch.uint8)[index]
        return rows.view(self.dtype).view(index.numel(), self.num_kv_heads, self.head_dim)

    def _as_rows(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """``t`` as ``[n, heads * head_dim]`` without copying, or raise."""
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        heads, head_dim = self.num_kv_heads, self.head_dim
        width = heads * head_dim
        if t.dim() == 3:
            if tuple(t.shape[1:]) != (heads, head_dim):
                raise LengthMismatchError(f"{name} is {tuple(t.shape)}, the pool holds [n, {heads}, {head_dim}]")
            # a token's heads * head_dim values must be consecutive (a dimension of size 1 has no stride to keep)
            within_token = (head_dim == 1 or t.stride(2) == 1) and (heads == 1 or t.stride(1) == head_dim)
            if t.shape[0] > 0 and not within_token:
                raise InvalidTypeError(f"{name} must be contiguous within a token, got strides {t.stride()}")
            return t.as_strided((t.shape[0], width), (t.stride(0) if t.shape[0] > 1 else width, 1))
        if t.dim() == 2:
            return t
        raise InvalidTypeError(f"{name} must be [n, heads, head_dim] or [n, heads * head_dim], got {tuple(t.shape)}")

    def _check_layer(self, layer_id: int) -> int:
        """``layer_id`` if it names a layer of the pool, else raise InvalidInputError."""
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) or not 0 <= layer_id < self.num_layers:
            raise InvalidInputError(f"layer_id {layer_id!r} outside 0..{self.num_layers - 1}")
        return int.__int__(layer_id)
