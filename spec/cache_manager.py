"""Page accounting of the CacheManager as an abstract model.

Every page of the pool is in exactly one place: the free list, the cache,
or privately held by one live request (the tail of its page-table row).
``check_manager_invariants`` checks that conservation law set by set.

The free list is a FIFO of page starts: allocation takes from the front,
frees append at the back, eviction appends the evicted pages (ascending)
before taking.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import prefix_cache as pc
from .errors import (
    CacheBusyError,
    InvalidRequestError,
    InvalidSizeError,
    OutOfPagesError,
    UnlockError,
)
from .helpers import compute_page_starts, compute_page_to_token, div_ceil
from .invariants import (
    check_invariants,
    count_locks,
    free_slots_are_aligned_and_unique,
    pages_are_partitioned,
    private_rows_are_page_runs,
    raise_first,
    rows_match_handles,
)
from .types import Prompted, Req, check_page_size


@dataclass
class ManagerState:
    """The whole abstract state of a CacheManager."""

    # the prefix cache it allocates around
    cache: pc.PrefixCacheState
    # pages in the pool
    num_pages: int
    # page table: row per request slot, one pool slot per token position
    page_table: list[list[int]]
    # FIFO of free page starts
    free_slots: list[int] = field(default_factory=list)
    # page starts freed inside lazy_free_region, appended to free_slots on exit; None outside
    lazy_frees: list[int] | None = None

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.cache.page_size


def new_manager(num_pages: int, page_size: int, max_running_reqs: int, max_seq_len: int) -> ManagerState:
    """A manager with every page free: free list ``0, P, 2P, ...``."""
    # CHECK
    page_size = check_page_size(page_size)
    for name, value in (("num_pages", num_pages), ("max_running_reqs", max_running_reqs), ("max_seq_len", max_seq_len)):
        if value < 1:
            raise InvalidSizeError(f"{name} must be >= 1, got {value}")
    # UPDATE
    return ManagerState(
        cache=pc.new_state(page_size),
        num_pages=num_pages,
        page_table=[[0] * max_seq_len for _ in range(max_running_reqs)],
        free_slots=[page * page_size for page in range(num_pages)],
    )


def available_size(state: ManagerState) -> int:
    """Tokens an allocation may use now: evictable cache plus free pages."""
    return pc.size_info(state.cache).evictable_size + len(state.free_slots) * state.page_size


def match_req(state: ManagerState, req: Prompted) -> pc.Handle:
    """Match all of the prompt but its last token, which is always recomputed to produce logits."""
    # CHECK
    if len(req.input_ids) == 0:
        raise InvalidRequestError("a request needs at least one input token")
    # WALK
    return pc.match_prefix(state.cache, req.input_ids[: len(req.input_ids) - 1], req.namespace)


def lock(state: ManagerState, handle: pc.Handle) -> None:
    """Protect the handle's path from eviction."""
    pc.lock(state.cache, handle)


def unlock(state: ManagerState, handle: pc.Handle) -> None:
    """Release one lock on the handle's path."""
    pc.unlock(state.cache, handle)


def allocate_paged(state: ManagerState, reqs: Sequence[Req]) -> None:
    """Give each request pages for positions ``[cached_len, device_len)`` and write them into its row.

    Raises OutOfPagesError with nothing changed when free plus evictable pages do not suffice.
    """
    # CHECK
    p = state.page_size
    check_distinct_rows(reqs)
    needed_pages = 0
    allocation_info: list[tuple[Req, int, int]] = []
    for req in reqs:
        check_req_row(state, req)
        if not req.cached_len <= req.device_len <= len(state.page_table[req.table_idx]):
            raise InvalidRequestError(
                f"request {req.uid}: need cached_len {req.cached_len} <= device_len {req.device_len}"
                f" <= max_seq_len {len(state.page_table[req.table_idx])}"
            )
        first_page = div_ceil(req.cached_len, p)
        last_page = div_ceil(req.device_len, p)
        if req.alloc_len != first_page * p:
            raise InvalidRequestError(
                f"request {req.uid}: row holds pages up to position {req.alloc_len},"
                f" cached_len {req.cached_len} needs {first_page * p}"
            )
        if last_page > first_page:
            needed_pages += last_page - first_page
            allocation_info.append((req, first_page, last_page))
    if needed_pages * p > available_size(state):
        raise OutOfPagesError(
            f"need {needed_pages} pages, have {len(state.free_slots)} free"
            f" + {pc.size_info(state.cache).evictable_size // p} evictable"
        )
    # UPDATE
    allocated = _page_to_token(state, _allocate(state, needed_pages))
    offset = 0
    for req, first_page, last_page in allocation_info:
        length = (last_page - first_page) * p
        state.page_table[req.table_idx][first_page * p : last_page * p] = allocated[offset : offset + length]
        req.alloc_len = last_page * p
        offset += length


def cache_req(state: ManagerState, req: Req, *, finished: bool) -> None:
    """Insert the request's computed prefix into the cache; free what the cache already had.

    Regions of the request's row (all half-open)::

        [0, old_handle.cached_len)          cached before this prefill (locked by old_handle)
        [old_handle.cached_len, cached_len) cached by another request meanwhile: free ours
        [cached_len, new_handle.cached_len) newly inserted into the cache
        [new_handle.cached_len, alloc_len)  tail that cannot enter the tree: free if finished

    When not finished, the row's ``[old_handle.cached_len, cached_len)`` is
    rewritten to the cache's slots (same tokens, same KV), so the request never
    reads a page it just freed. When finished, the request is released: its
    handle becomes None and a second cache_req is rejected.
    """
    # CHECK
    old_handle = check_req_row(state, req)
    if not old_handle.cached_len <= req.cached_len <= min(req.alloc_len, len(req.input_ids)):
        raise InvalidRequestError(
            f"request {req.uid}: need handle {old_handle.cached_len} <= cached_len {req.cached_len}"
            f" <= min(alloc_len {req.alloc_len}, tokens {len(req.input_ids)})"
        )
    row = state.page_table[req.table_idx]
    # UPDATE (insert_prefix checks its own input first and raises before any change)
    cached_len, new_handle = pc.insert_prefix(
        state.cache, req.input_ids[: req.cached_len], row[: req.cached_len], req.namespace
    )
    pc.unlock(state.cache, old_handle)
    # ACCOUNT
    _free(state, row[old_handle.cached_len : cached_len])
    if finished:
        _free(state, row[new_handle.cached_len : req.alloc_len])
        req.cache_handle = None
        req.alloc_len = 0
    else:
        row[old_handle.cached_len : cached_len] = pc.get_matched_indices(state.cache, new_handle)[
            old_handle.cached_len : cached_len
        ]
        req.cache_handle = new_handle
        pc.lock(state.cache, new_handle)


@contextmanager
def lazy_free_region(state: ManagerState) -> Iterator[None]:
    """Inside, frees are held back; on exit (even by an exception) they join the free list in order."""
    # CHECK
    if state.lazy_frees is not None:
        raise CacheBusyError("lazy_free_region is already open")
    # UPDATE
    state.lazy_frees = []
    try:
        yield
    finally:
        held, state.lazy_frees = state.lazy_frees, None
        state.free_slots.extend(held)


def _allocate(state: ManagerState, needed_pages: int) -> list[int]:
    """Take ``needed_pages`` page starts from the front of the free list, evicting first if short."""
    free_pages = len(state.free_slots)
    if needed_pages > free_pages:
        evicted = pc.evict(state.cache, (needed_pages - free_pages) * state.page_size)
        state.free_slots.extend(compute_page_starts(evicted, state.page_size))
    allocated = state.free_slots[:needed_pages]
    del state.free_slots[:needed_pages]
    return allocated


def _free(state: ManagerState, indices: Sequence[int]) -> None:
    """Return the pages starting at ``indices[::P]`` to the free list (held back inside a lazy region)."""
    starts = compute_page_starts(indices, state.page_size)
    if state.lazy_frees is not None:
        state.lazy_frees.extend(starts)
    else:
        state.free_slots.extend(starts)


def _page_to_token(state: ManagerState, pages: Sequence[int]) -> list[int]:
    """Expand page starts to the slots of each page."""
    return compute_page_to_token(pages, state.page_size)


def check_distinct_rows(reqs: Sequence[Req]) -> None:
    """Raise when two requests of one batch share a page-table row."""
    rows = [req.table_idx for req in reqs]
    if len(set(rows)) != len(rows):
        raise InvalidRequestError(f"two requests of one batch share a page-table row: {sorted(rows)}")


def check_req_row(state: ManagerState, req: Req) -> pc.Handle:
    """The request's locked handle, after checking its row and lengths; raise otherwise."""
    if not 0 <= req.table_idx < len(state.page_table):
        raise InvalidRequestError(f"request {req.uid}: table_idx {req.table_idx} outside the page table")
    handle = req.cache_handle
    if handle is None:
        raise InvalidRequestError(f"request {req.uid} was already released by cache_req(finished=True)")
    handle = pc.check_type(handle)
    if not pc.is_handle_locked(state.cache, handle):
        raise UnlockError(f"request {req.uid}: its handle is stale or not locked")
    if req.alloc_len % state.page_size or req.alloc_len > len(state.page_table[req.table_idx]):
        raise InvalidRequestError(f"request {req.uid}: alloc_len {req.alloc_len} is not a page boundary of the row")
    return handle


def get_private_rows(state: ManagerState, live_reqs: Sequence[Req]) -> dict[int, list[int]]:
    """For each live request, the slots of its row that it holds privately."""
    return {
        req.table_idx: state.page_table[req.table_idx][req.cache_handle.cached_len : req.alloc_len] for req in live_reqs
    }


def get_cached_pages(state: ManagerState) -> list[int]:
    """Page starts held by the cache."""
    return [entry.slot_start for entry in state.cache.entries.values()]


def check_manager_invariants(state: ManagerState, live_reqs: Sequence[Req]) -> None:
    """Raise IntegrityError naming the first broken accounting invariant."""
    raise_first([("live_requests_hold_distinct_rows", live_requests_hold_distinct_rows(live_reqs))])
    check_invariants(state.cache, locks=count_locks(state.cache, [req.cache_handle for req in live_reqs]))
    p = state.page_size
    free = state.free_slots + (state.lazy_frees or [])
    raise_first([("free_slots_are_aligned_and_unique", free_slots_are_aligned_and_unique(free, p, state.num_pages))])
    private = get_private_rows(state, live_reqs)
    matched = {
        req.table_idx: (
            state.page_table[req.table_idx][: req.cache_handle.cached_len],
            pc.get_matched_indices(state.cache, req.cache_handle),
        )
        for req in live_reqs
    }
    raise_first(
        [
            ("private_rows_are_page_runs", private_rows_are_page_runs(private, p)),
            (
                "pages_are_partitioned",
                pages_are_partitioned(state.num_pages, p, free, get_cached_pages(state), private),
            ),
            ("rows_match_handles", rows_match_handles(matched)),
        ]
    )


def live_requests_hold_distinct_rows(live_reqs: Sequence[Req]) -> str | None:
    """Each live request holds a handle and a page-table row of its own."""
    rows = [req.table_idx for req in live_reqs]
    if len(set(rows)) != len(rows):
        return f"live requests share rows: {sorted(rows)}"
    released = [req.uid for req in live_reqs if req.cache_handle is None]
    return f"requests {released} are live but were released" if released else None
