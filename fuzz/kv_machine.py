"""State machine for the KV pool: ``MHAKVCache.store_kv``, ``store_cache(_fast)``, ``gather_kv`` vs torch indexing.

The oracle is a shadow copy of the pool's buffer written with plain torch
indexing, through bytes, so every float dtype (float8 and float4 included,
NaN payloads too) compares bit for bit. Rules draw batches from 0 and 1 rows
up past the checked store's pairwise threshold, odd head counts and sizes,
every float dtype, int32 and int64 indices, every layout a caller may pass
(contiguous, fused-qkv slices, transposed, non-unit inner stride with one row
and with many, broadcast rows, heads out of order, overlapping rows, a
source inside the cache) and bad slots (duplicate, negative, past the pool,
past 2**31). The machine predicts each outcome: a store it expects accepted
must equal the oracle; one it expects rejected must raise that class from
``spec/errors.py`` (naming the first bad row for a bad index) and leave the
whole buffer unchanged, bit for bit. A fast store must skip exactly the
out-of-range rows, flag them, and write the others (the last of duplicate
rows wins on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixspec.optimized import MHAKVCache, store_cache, store_cache_fast
from radixspec.optimized.store import PAIRWISE_MAX
from radixspec.spec.errors import (
    CacheError,
    DuplicateSlotError,
    InvalidTypeError,
    LengthMismatchError,
    OverlappingBuffersError,
    SlotOutOfRangeError,
)

from .judge import Outcome, expect_error
from .stats import STATS

FLOAT_DTYPES = tuple(
    sorted(
        {value for value in vars(torch).values() if isinstance(value, torch.dtype) and value.is_floating_point},
        key=str,
    )
)
# layouts a caller may pass for k or v, and the error each must raise (None: accepted); see rows_for()
GOOD_LAYOUTS = (
    "contiguous_3d",
    "contiguous_2d",
    "fused_qkv_2d",
    "fused_qkv_3d",
    "transposed_2d",
    "broadcast_2d",
    "overlapping_rows_2d",
    "heads_swapped_3d",
    "inner_stride_2",
    "other_layer",
)
BAD_LAYOUTS = ("inside_cache", "wrong_dtype", "wrong_heads_3d", "wrong_width_2d", "four_dims", "extra_row")
# when a layout's error is raised: the pool's reshaping (store_kv), the dtype checks, the per-tensor
# checks (k before v), the row counts, the overlaps; the store raises the earliest
ERROR_STAGE = {
    "heads_swapped_3d": 0,
    "wrong_heads_3d": 0,
    "four_dims": 0,
    "wrong_dtype": 1,
    "transposed_2d": 2,
    "inner_stride_2": 2,
    "wrong_width_2d": 2,
    "extra_row": 3,
    "inside_cache": 4,
}
INDEX_KINDS = ("distinct", "distinct", "duplicate", "negative", "past_pool", "past_int32", "edges")
SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# rows per store: the small cases, then up past the pairwise threshold into the hash-set path
ROWS = st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(0, 3 * PAIRWISE_MAX))


@dataclass
class Rows:
    """A k or v argument and what the store must do with it."""

    tensor: torch.Tensor
    # the error class the store must raise for this argument, or None
    error: type[CacheError] | None
    # when the store meets that error (ERROR_STAGE)
    stage: int
    # the bytes of each row as the store should read them, [n, width * element_size]
    expected: torch.Tensor


class KVStoreMachine(RuleBasedStateMachine):
    """One MHAKVCache and a shadow buffer; every store and gather checked against plain torch indexing."""

    # the pool lives in optimized/ only; the machine ignores --impl
    IMPLS: ClassVar[tuple[str, ...]] = ("optimized",)
    # where the pool lives (radixspec fuzz --device)
    DEVICE: ClassVar[str] = "cpu"

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.pool: MHAKVCache | None = None
        self.shadow = torch.empty(0)
        # a fast store skipped a row since the last check_store_errors
        self.flag_pending = False

    @initialize(
        heads=st.integers(1, 4),
        head_dim=st.sampled_from([1, 2, 3, 5, 8, 16, 33]),
        page_size=st.integers(1, 8),
        num_pages=st.integers(1, 32),
        layers=st.integers(1, 2),
        dtype=st.sampled_from(FLOAT_DTYPES),
        mode=st.sampled_from(["checked", "fast"]),
    )
    def setup(
        self, heads: int, head_dim: int, page_size: int, num_pages: int, layers: int, dtype: torch.dtype, mode: str
    ) -> None:
        self.pool = MHAKVCache(heads, layers, head_dim, num_pages, page_size, dtype, self.DEVICE, store_mode=mode)
        # the pool starts as zeros; give it recognisable bytes so that a lost write shows
        noise = torch.randint(0, 256, self.bytes_view(self.pool._kv_buffer).shape, dtype=torch.uint8)
        self.bytes_view(self.pool._kv_buffer).copy_(noise.to(self.pool.device))
        self.shadow = self.bytes_view(self.pool._kv_buffer).cpu().clone()

    # ------------------------------------------------------------ helpers

    @property
    def width(self) -> int:
        assert self.pool is not None
        return self.pool.num_kv_heads * self.pool.head_dim

    @staticmethod
    def bytes_view(t: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor's bytes (a view)."""
        return t.view(torch.uint8)

    def shadow_rows(self, which: int, layer: int) -> torch.Tensor:
        """The oracle's ``[num_slots, width * element_size]`` bytes of K (0) or V (1) of ``layer``."""
        assert self.pool is not None
        return self.shadow[which, layer].reshape(self.pool.num_slots, -1)

    @property
    def int_dtype(self) -> torch.dtype:
        """An integer dtype of the pool's element size: layouts are built in it (torch copies no float4)."""
        assert self.pool is not None
        return SAME_SIZE_INT[self.pool._kv_buffer.element_size()]

    def random_bytes(self, seed: int, rows: int, width: int) -> torch.Tensor:
        """``[rows, width]`` random values of ``int_dtype`` (viewed as the pool's dtype at the end), on the device."""
        assert self.pool is not None
        gen = torch.Generator().manual_seed(seed)
        size = self.pool._kv_buffer.element_size()
        raw = torch.randint(0, 256, (rows, width * size), generator=gen, dtype=torch.uint8)
        return raw.view(self.int_dtype).to(self.pool.device)

    def rows_for(self, layout: str, n: int, seed: int, layer: int, which: int) -> Rows:
        """A k (which 0) or v (which 1) argument of ``n`` rows laid out as ``layout``."""
        assert self.pool is not None
        pool = self.pool
        heads, head_dim, width = pool.num_kv_heads, pool.head_dim, self.width
        values = self.random_bytes(seed, n, width)
        error: type[CacheError] | None = None
        if layout == "contiguous_3d":
            t = values.view(n, heads, head_dim)
        elif layout == "contiguous_2d":
            t = values
        elif layout == "fused_qkv_2d":
            t = self.random_bytes(seed + 1, n, 3 * width)[:, width : 2 * width]
            t[:] = values
        elif layout == "fused_qkv_3d":
            t = self.random_bytes(seed + 1, n, 3 * width).view(n, 3 * heads, head_dim)[:, heads : 2 * heads]
            t[:] = values.view(n, heads, head_dim)
        elif layout == "transposed_2d":
            t = values.t().contiguous().t()
            # one row, or one value per row: still D consecutive values
            error = None if n <= 1 or width == 1 else InvalidTypeError
        elif layout == "broadcast_2d":
            t = values[:1].expand(n, width) if n else values
        elif layout == "overlapping_rows_2d":
            flat = self.random_bytes(seed + 2, 1, n + width).flatten()
            t = flat.as_strided((n, width), (1, 1))
        elif layout == "heads_swapped_3d":
            t = values.view(n, heads, head_dim).transpose(1, 2).contiguous().transpose(1, 2)
            error = InvalidTypeError if n and heads > 1 and head_dim > 1 else None
        elif layout == "inner_stride_2":
            wide = self.random_bytes(seed + 3, n, 2 * width)
            t = wide[:, ::2]
            t[:] = values
            error = InvalidTypeError if n and width > 1 else None
        elif layout == "other_layer":
            # rows read from another layer's region of the same buffer: legal, it is not written
            source = (layer + 1) % pool.num_layers
            if source == layer or n > pool.num_slots:
                t = values
            else:
                cache = pool.k_cache(source) if which == 0 else pool.v_cache(source)
                t = cache[:n].view(self.int_dtype)
        elif layout == "inside_cache":
            cache = pool.k_cache(layer) if which == 0 else pool.v_cache(layer)
            if 0 < n <= pool.num_slots:
                t = cache[pool.num_slots - n :].view(self.int_dtype)
                error = OverlappingBuffersError
            else:
                t = values
        elif layout == "wrong_dtype":
            other = torch.float32 if pool.dtype != torch.float32 else torch.float16
            return Rows(torch.zeros(n, width, dtype=other, device=pool.device), InvalidTypeError, 1, values)
        elif layout == "wrong_heads_3d":
            t = self.random_bytes(seed, n, (heads + 1) * head_dim).view(n, heads + 1, head_dim)
            error = LengthMismatchError
        elif layout == "wrong_width_2d":
            t = self.random_bytes(seed, n, width + 1)
            error = LengthMismatchError
        elif layout == "four_dims":
            t = values.view(n, 1, heads, head_dim)
            error = InvalidTypeError
        elif layout == "extra_row":
            t = self.random_bytes(seed, n + 1, width)
            error = LengthMismatchError
        else:
            raise AssertionError(layout)
        expected = t
        if error is None:  # the bytes each row holds, copied into a fresh dense tensor
            dense = torch.empty(t.shape[0], width, dtype=self.int_dtype)
            expected = dense.copy_(t.reshape(t.shape[0], width).cpu()).view(torch.uint8)
        return Rows(t.view(pool.dtype), error, ERROR_STAGE.get(layout, 0), expected)

    def indices_for(self, kind: str, n: int, where: int, seed: int, dtype: torch.dtype, strided: bool) -> list[int]:
        """``n`` slot indices of ``kind``; the bad one (if any) at row ``where % n``."""
        assert self.pool is not None
        slots = self.pool.num_slots
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(slots, generator=gen).tolist()
        values = [order[i % slots] for i in range(n)]
        if not n:
            return values
        at = where % n
        if kind == "duplicate" and n >= 2:
            at = max(at, 1)
            values[at] = values[where % at]
        elif kind == "negative":
            values[at] = -1 - where % 3
        elif kind == "past_pool":
            values[at] = slots + where % 3
        elif kind == "past_int32":
            values[at] = 2**31 + where % 3 if dtype == torch.int64 else 2**31 - 1
        elif kind == "edges":
            edge = slots - 1 if where % 2 else 0
            if edge in values:  # move it to row ``at``, keeping the slots distinct
                other = values.index(edge)
                values[other], values[at] = values[at], edge
            else:
                values[at] = edge
        return values

    def index_tensor(self, values: list[int], dtype: torch.dtype, strided: bool) -> torch.Tensor:
        """``values`` as a 1-D tensor, contiguous or a strided view."""
        assert self.pool is not None
        if strided:
            doubled = torch.zeros(2 * len(values), dtype=dtype)
            doubled[::2] = torch.tensor(values, dtype=dtype)
            return doubled.to(self.pool.device)[::2]
        return torch.tensor(values, dtype=dtype, device=self.pool.device)

    def first_bad_row(self, values: list[int]) -> tuple[type[CacheError] | None, int]:
        """The checked store's verdict on ``values``: the first row out of range or repeating an earlier slot."""
        assert self.pool is not None
        seen: set[int] = set()
        for row, slot in enumerate(values):
            if not 0 <= slot < self.pool.num_slots:
                return SlotOutOfRangeError, row
            if slot in seen:
                return DuplicateSlotError, row
            seen.add(slot)
        return None, -1

    def apply_to_shadow(self, layer: int, values: list[int], k: Rows, v: Rows, fast: bool) -> bool:
        """Write accepted rows into the oracle; returns True when a fast store skipped a row."""
        skipped = False
        shadow_k, shadow_v = self.shadow_rows(0, layer), self.shadow_rows(1, layer)
        for row, slot in enumerate(values):  # in row order: on the CPU the last of duplicate rows wins
            if not 0 <= slot < shadow_k.shape[0]:
                assert fast, "a checked store with a bad index was expected to be rejected"
                skipped = True
                continue
            shadow_k[slot] = k.expected[row]
            shadow_v[slot] = v.expected[row]
        return skipped

    def expect(self, label: str, call: Callable[[], object], error: type[CacheError] | None, bad_row: int = -1) -> bool:
        """Run ``call``; the judge demands ``error`` (the buffer unchanged; naming ``bad_row`` when one is given)
        or, when None, acceptance. True if it was accepted."""
        assert self.pool is not None
        before = self.bytes_view(self.pool._kv_buffer).clone()
        outcome = Outcome.of(call)
        if not outcome.ok:
            after = self.bytes_view(self.pool._kv_buffer)
            assert torch.equal(before, after), f"{label}: {outcome} but wrote to the pool"
        expect_error(label, outcome, error, f"row {bad_row} " if bad_row >= 0 else "")
        if not outcome.ok:
            STATS.record_rejection(outcome.error_class)
        return outcome.ok

    # ------------------------------------------------------------ rules

    @rule(
        n=ROWS,
        k_layout=st.sampled_from(GOOD_LAYOUTS),
        bad_layout=st.one_of(st.none(), st.sampled_from(BAD_LAYOUTS)),
        bad_side=st.sampled_from(["k", "v"]),
        kind=st.sampled_from(INDEX_KINDS),
        where=st.integers(0, 1 << 16),
        index_dtype=st.sampled_from([torch.int32, torch.int64]),
        strided=st.booleans(),
        layer=st.integers(0, 1),
        seed=st.integers(0, 1 << 30),
    )
    def store_kv(
        self,
        n: int,
        k_layout: str,
        bad_layout: str | None,
        bad_side: str,
        kind: str,
        where: int,
        index_dtype: torch.dtype,
        strided: bool,
        layer: int,
        seed: int,
    ) -> None:
        """MHAKVCache.store_kv in the pool's mode; a bad layout on one side when drawn."""
        assert self.pool is not None
        pool = self.pool
        layer %= pool.num_layers
        STATS.record_rule(f"kv.store_kv[{pool.store_mode}, {kind}]")
        STATS.record_store(n)
        v_layout = GOOD_LAYOUTS[(GOOD_LAYOUTS.index(k_layout) + seed) % len(GOOD_LAYOUTS)]
        layouts = {"k": k_layout, "v": v_layout}
        if bad_layout is not None:
            layouts[bad_side] = bad_layout
        STATS.rules[f"kv.layout[{bad_layout or k_layout}]"] += 1
        k = self.rows_for(layouts["k"], n, seed, layer, 0)
        v = self.rows_for(layouts["v"], n, seed + 7, layer, 1)
        values = self.indices_for(kind, n, where, seed, index_dtype, strided)
        indices = self.index_tensor(values, index_dtype, strided)
        fast = pool.store_mode == "fast"
        errors = sorted((rows.stage, side, rows.error) for side, rows in enumerate((k, v)) if rows.error)
        layout_error = errors[0][2] if errors else None
        index_error, bad_row = (None, -1) if fast else self.first_bad_row(values)
        accepted = self.expect(
            f"store_kv({pool.store_mode}, {n} rows, k {layouts['k']}, v {layouts['v']}, {kind} indices {values[:8]})",
            lambda: pool.store_kv(k.tensor, v.tensor, indices, layer),
            layout_error or index_error,
            -1 if layout_error else bad_row,
        )
        if accepted:
            self.flag_pending |= self.apply_to_shadow(layer, values, k, v, fast)

    @rule(
        n=ROWS,
        caches=st.sampled_from(["layer", "swapped", "k_is_v", "across_layers"]),
        fast=st.booleans(),
        kind=st.sampled_from(INDEX_KINDS),
        where=st.integers(0, 1 << 16),
        index_dtype=st.sampled_from([torch.int32, torch.int64]),
        seed=st.integers(0, 1 << 30),
    )
    def store_cache_direct(
        self, n: int, caches: str, fast: bool, kind: str, where: int, index_dtype: torch.dtype, seed: int
    ) -> None:
        """store_cache / store_cache_fast called on the pool's [num_slots, D] views, aliasing ones included."""
        assert self.pool is not None
        pool = self.pool
        STATS.record_rule(f"kv.store_cache[{'fast' if fast else 'checked'}, {caches}]")
        STATS.record_store(n)
        layer, other = 0, pool.num_layers - 1
        # (cache written with k, cache written with v) as (which, layer) of the shadow
        targets = {
            "layer": ((0, layer), (1, layer)),
            "swapped": ((1, layer), (0, layer)),
            "k_is_v": ((0, layer), (0, layer)),
            "across_layers": ((0, layer), (1, other)),
        }[caches]
        views = [
            (pool.k_cache(lay) if which == 0 else pool.v_cache(lay)).view(pool.num_slots, self.width)
            for which, lay in targets
        ]
        k = self.rows_for("contiguous_2d", n, seed, layer, 0)
        v = self.rows_for("fused_qkv_2d", n, seed + 7, layer, 1)
        values = self.indices_for(kind, n, where, seed, index_dtype, False)
        indices = self.index_tensor(values, index_dtype, False)
        errors = torch.zeros(1, dtype=torch.int32, device=pool.device)
        alias_error = OverlappingBuffersError if caches == "k_is_v" and pool.num_slots else None
        index_error, bad_row = (None, -1) if fast else self.first_bad_row(values)

        def call() -> None:
            if fast:
                store_cache_fast(views[0], views[1], indices, k.tensor, v.tensor, errors)
            else:
                store_cache(views[0], views[1], indices, k.tensor, v.tensor)

        label = f"store_cache({caches}, fast={fast}, {n} rows, {kind} indices {values[:8]})"
        if not self.expect(label, call, alias_error or index_error, -1 if alias_error else bad_row):
            return
        skipped = False
        for row, slot in enumerate(values):
            if not 0 <= slot < pool.num_slots:
                skipped = True
                continue
            self.shadow_rows(*targets[0])[slot] = k.expected[row]
            self.shadow_rows(*targets[1])[slot] = v.expected[row]
        assert bool(errors.item()) == skipped, f"fast store error word {int(errors.item())}, rows skipped: {skipped}"

    @rule(
        n=ROWS,
        kind=st.sampled_from(INDEX_KINDS),
        where=st.integers(0, 1 << 16),
        index_dtype=st.sampled_from([torch.int32, torch.int64]),
        layer=st.integers(0, 1),
        seed=st.integers(0, 1 << 30),
    )
    def gather_kv(self, n: int, kind: str, where: int, index_dtype: torch.dtype, layer: int, seed: int) -> None:
        """What attention reads: the rows of the given slots, equal to the oracle's."""
        assert self.pool is not None
        pool = self.pool
        layer %= pool.num_layers
        STATS.record_rule(f"kv.gather_kv[{kind}]")
        values = self.indices_for(kind, n, where, seed, index_dtype, False)
        indices = self.index_tensor(values, index_dtype, False)
        outside = any(not 0 <= slot < pool.num_slots for slot in values)
        got: list[tuple[torch.Tensor, torch.Tensor]] = []
        error = SlotOutOfRangeError if outside else None
        if self.expect("gather_kv", lambda: got.append(pool.gather_kv(indices, layer)), error):
            k, v = got[0]
            assert k.shape == v.shape == (n, pool.num_kv_heads, pool.head_dim), f"gather shapes {k.shape}, {v.shape}"
            for which, t in ((0, k), (1, v)):
                want = self.shadow_rows(which, layer)[torch.tensor(values, dtype=torch.long)]
                assert torch.equal(t.reshape(n, self.width).view(torch.uint8).cpu(), want), (
                    f"gather of {values[:8]} differs"
                )

    @precondition(lambda self: self.pool is not None and self.pool.store_mode == "fast")
    @rule()
    def check_store_errors(self) -> None:
        """The fast mode's error word: raised once for every skipped row since the last check, then clear."""
        assert self.pool is not None
        STATS.record_rule("kv.check_store_errors")
        pool = self.pool
        self.expect("check_store_errors", pool.check_store_errors, SlotOutOfRangeError if self.flag_pending else None)
        self.flag_pending = False

    # ------------------------------------------------------------ checks

    @invariant()
    def pool_equals_oracle(self) -> None:
        if self.pool is None:
            return
        actual = self.bytes_view(self.pool._kv_buffer).cpu()
        if not torch.equal(actual, self.shadow.cpu()):
            differ = (actual != self.shadow.cpu()).nonzero()
            raise AssertionError(
                f"pool differs from the torch-indexing oracle at {differ.shape[0]} bytes, first at {differ[0].tolist()}"
            )
