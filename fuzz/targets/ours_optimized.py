"""The optimized cache and manager as targets (torch and the C tree): imported only when one is made.

``radixspec.fuzz.targets.ours`` names them (``OPTIMIZED``, ``--impl optimized``) through factories that import
this module, so that a campaign over the spec, the reference or a user's pure-Python cache loads neither torch
nor the C extension.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy
import torch

from radixspec import optimized
from radixspec.optimized._c import load_c
from radixspec.optimized.inputs import copied_with_tensors
from radixspec.optimized.radix_cache import RadixCacheHandle as OptimizedHandle
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.requests import Req

from .exact import OurManager, TreeTarget

# the cache machine's break_the_tree (the self-check capability): each field of the C tree it changes, with a
# change that breaks an invariant whatever the node
# (a length by that many pages; a slot modulo 2**32, so 2**31 makes it negative; a queue stamp past any clock)
BROKEN_FIELDS = (
    ("ref_count", 1),
    ("length", 1),
    ("length", -1),
    ("parent", 1),
    ("child_count", 1),
    ("child_refs", -1),
    ("queue_stamp", 2**40),
    ("slot", 2**31),
    ("evictable", 1),
    ("protected", 1),
    ("nodes", -1),
    ("pages", 1),
    ("roots", 1),
    ("children", 1),
    ("starts", -1),
    ("segment_bytes", 1),
    ("segment_refs", 1),
)
# the invariants csrc/tree.c's radix_tree_check names
TREE_INVARIANTS = (
    "tree_is_well_formed",
    "children_find_every_node",
    "page_slots_are_aligned",
    "cached_starts_match_tree",
    "evictable_leaves_are_queued",
    "ref_counts_cover_children",
    "size_counters_match_tree",
    "tables_match_tree",
    "segments_are_counted",
)
# the input formats the optimized cache takes, drawn in turn for tokens and slots (each input path gets its share),
# with the bits of the integers each holds: values a format cannot hold (past int32, say) go as a list; numpy
# arrays are among them, which its signature (a tensor or a sequence of ints) does not name: hence Any
INPUT_FORMATS: tuple[tuple[Callable[[list[int]], Any], int | None], ...] = (
    (list, None),
    (lambda values: torch.tensor(values, dtype=torch.int32), 32),
    (lambda values: torch.tensor(values, dtype=torch.int64), 64),
    (lambda values: numpy.array(values, dtype=numpy.int64), 64),
    (lambda values: numpy.array(values, dtype=numpy.int32), 32),
    (lambda values: array("q", values), 64),
    (tuple, None),
)


def fits(values: list[int], bits: int | None) -> bool:
    """True when every value is an int that a signed integer of ``bits`` bits holds (any, for None)."""
    if bits is None or not values:
        return True
    limit = 1 << (bits - 1)
    return all(type(value) is int for value in values) and -limit <= min(values) and max(values) < limit


@contextmanager
def gives_back_its_blocks(call: str) -> Iterator[None]:
    """A read of the C tree gives back every block of memory it took (``radix_tree_live_blocks``, all trees of
    the process). Fewer blocks after it is no leak: another tree, dropped earlier, may be collected meanwhile."""
    live_blocks = load_c()[1].radix_tree_live_blocks
    before = live_blocks()
    yield
    kept = live_blocks() - before
    assert kept <= 0, f"optimized: {call} kept {kept} blocks of the C tree's memory (a leak)"


class OptimizedCache(TreeTarget[OptimizedHandle]):
    """The optimized cache: lists in, converted to each input format it takes in turn, lists out."""

    name = "optimized"
    cache: optimized.RadixPrefixCache
    # the self-check capability (fuzz/targets/api.py: ChecksItsChecks)
    breakable_fields = BROKEN_FIELDS
    own_invariants = TREE_INVARIANTS

    def __init__(self, page_size: int, num_pages: int = 0) -> None:
        self.page_size = page_size
        self.cache = optimized.RadixPrefixCache(page_size, device="cpu", enable_events=True)
        self.calls = 0
        self.evicted = []
        self.out = torch.empty(0, dtype=torch.int32)

    def __deepcopy__(self, memo: dict[int, object]) -> OptimizedCache:
        return copied_with_tensors(self, memo)

    def check_integrity(self) -> None:
        with gives_back_its_blocks("check_integrity"):
            self.cache.check_integrity()

    def abstract_state(self) -> pc.PrefixCacheState:
        with gives_back_its_blocks("abstract_state (the tree's export)"):
            return self.cache.abstract_state()

    def convert(self, values: list[int], shift: int = 0) -> Any:
        """``values`` in the next input format (``shift`` picks another one for the slots of the same call)."""
        fmt, bits = INPUT_FORMATS[(self.calls + shift) % len(INPUT_FORMATS)]
        return fmt(values) if fits(values, bits) else list(values)

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> OptimizedHandle:
        self.calls += 1
        return self.cache.match_prefix(self.convert(tokens), namespace)

    def insert_prefix(
        self, tokens: list[int], indices: list[int] | None, namespace: Namespace
    ) -> tuple[int, OptimizedHandle]:
        self.calls += 1
        ids, slots = self.convert(tokens), self.convert(indices or [], shift=self.calls // len(INPUT_FORMATS))
        cached_len, handle = self.cache.insert_prefix(ids, slots, namespace)
        return int(cached_len), handle

    def get_matched_indices(self, handle: OptimizedHandle) -> list[int]:
        return [int(slot) for slot in handle.get_matched_indices().tolist()]

    def path_nodes(self, handle: OptimizedHandle) -> int:
        """Radix nodes from the handle's node up to the root (counted in C)."""
        return int(self.cache.path_nodes(handle))

    def evict(self, size: int) -> None:
        """Every other call into the target's own buffer (``evict(size, out=)``), else into a new tensor."""
        self.calls += 1
        pages = -(-size // self.page_size) if size > 0 else 0
        if self.calls % 2 and pages * self.page_size <= 4096:
            if self.out.numel() < pages * self.page_size:
                self.out = torch.empty(max(64, 2 * pages * self.page_size), dtype=torch.int32)
            slots = self.cache.evict(size, out=self.out)[: pages * self.page_size]
        else:
            slots = self.cache.evict(size)
        self.note_evicted([int(slot) for slot in slots.tolist()])

    def reset(self) -> list[int]:
        return [int(slot) for slot in self.cache.reset().tolist()]

    def break_invariant(self, field: str, which: int, position: int, delta: int) -> bool | None:
        """Test support (the cache machine's break_the_tree): ``delta`` added to one field of the C tree, of its
        ``which``-th live node modulo their number (nodes with pages only, for a slot or a segment's refs);
        ``-delta`` puts it back. None when there is no such node; else whether the C tree did it."""
        stats = self.cache.tree_stats()
        live = stats["nodes"] + (0 if field in ("slot", "segment_refs") else stats["roots"])
        return self.cache.break_invariant(field, which % live, position, delta) if live else None


class OptimizedManager(OurManager):
    """optimized.CacheManager as a manager target; its requests keep token ids as CPU tensors."""

    name = "optimized"

    def __init__(self, num_pages: int, page_size: int, rows: int, max_seq_len: int) -> None:
        table = optimized.make_page_table(rows, max_seq_len)
        super().__init__(optimized.CacheManager(num_pages, page_size, table), num_pages, page_size)

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> Req:
        tokens = torch.tensor(prompt, dtype=torch.int64)
        return Req(input_ids=tokens, table_idx=table_idx, cache_handle=None, namespace=namespace, uid=uid)  # type: ignore[arg-type]

    def append_token(self, req: Req, token: int) -> None:
        req.input_ids = torch.cat([req.input_ids, torch.tensor([token])])  # type: ignore[list-item, assignment]
