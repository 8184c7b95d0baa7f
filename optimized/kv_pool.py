"""``MHAKVCache``: the paged KV pool, where the K/V values behind each slot live. Twin of the seed's mha_pool.py.

One buffer ``(2, num_layers, num_pages, page_size, num_kv_heads, head_dim)``;
layer ``l``'s K is ``buffer[0, l]`` viewed as ``[num_pages * page_size, heads, head_dim]``.
The radix tree only maps tokens to slots; this stores what the slots hold.
"""

from __future__ import annotations

import torch

from spec.errors import InvalidInputError, InvalidSizeError, InvalidTypeError, LengthMismatchError, SlotOutOfRangeError

from .inputs import device_of
from .kv_store import store_cache


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
    ) -> None:
        # CHECK
        for name, value in (
            ("num_kv_heads", num_kv_heads),
            ("num_layers", num_layers),
            ("head_dim", head_dim),
            ("num_pages", num_pages),
            ("page_size", page_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise InvalidSizeError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidTypeError(f"dtype must be a float torch.dtype, got {dtype!r}")
        # UPDATE
        self.num_kv_heads, self.num_layers, self.head_dim = num_kv_heads, num_layers, head_dim
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        self.device = device_of(device)
        self.num_slots = num_pages * page_size
        self._kv_buffer = torch.zeros(
            (2, num_layers, num_pages, page_size, num_kv_heads, head_dim), dtype=dtype, device=self.device
        )
        self._storage_shape = (self.num_slots, num_kv_heads, head_dim)

    def k_cache(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s K as ``[num_slots, num_kv_heads, head_dim]`` (a view)."""
        return self._kv_buffer[0, self._check_layer(layer_id)].view(self._storage_shape)

    def v_cache(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s V as ``[num_slots, num_kv_heads, head_dim]`` (a view)."""
        return self._kv_buffer[1, self._check_layer(layer_id)].view(self._storage_shape)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """Write token ``i``'s K/V (``[n, heads, head_dim]`` or ``[n, heads * head_dim]``) into slot ``out_loc[i]``."""
        # CHECK
        width = self.num_kv_heads * self.head_dim
        k2, v2 = self._as_rows(k, "k"), self._as_rows(v, "v")
        # UPDATE
        store_cache(
            self.k_cache(layer_id).view(self.num_slots, width),
            self.v_cache(layer_id).view(self.num_slots, width),
            out_loc,
            k2,
            v2,
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
        # WALK
        index = indices.long()
        return self.k_cache(layer_id)[index], self.v_cache(layer_id)[index]

    def _as_rows(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """``t`` as ``[n, heads * head_dim]`` without copying, or raise."""
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        width = self.num_kv_heads * self.head_dim
        if t.dim() == 3:
            if tuple(t.shape[1:]) != (self.num_kv_heads, self.head_dim):
                raise LengthMismatchError(
                    f"{name} is {tuple(t.shape)}, the pool holds [n, {self.num_kv_heads}, {self.head_dim}]"
                )
            if t.shape[0] > 0 and (t.stride(2) != 1 or t.stride(1) != self.head_dim):
                raise InvalidTypeError(f"{name} must be contiguous within a token, got strides {t.stride()}")
            return t.as_strided((t.shape[0], width), (t.stride(0) if t.shape[0] > 1 else width, 1))
        if t.dim() == 2:
            return t
        raise InvalidTypeError(f"{name} must be [n, heads, head_dim] or [n, heads * head_dim], got {tuple(t.shape)}")

    def _check_layer(self, layer_id: int) -> int:
        if not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise InvalidInputError(f"layer_id {layer_id!r} outside 0..{self.num_layers - 1}")
        return layer_id
