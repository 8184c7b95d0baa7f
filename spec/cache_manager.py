"""The CacheManager's page accounting, declaratively: for each operation, what must be true after it.

The state, seen as sets of pages (page starts):

* **free**: on the free list; **held**: freed inside a lazy free region, joining the free list when it closes;
* **cached**: held by the prefix cache (its abstract state; ``radixspec.spec.prefix_cache`` says how the cache behaves);
* **private**: per live request, the pages of its row past its locked path.

Every page is in exactly one of them (``pages_are_partitioned``, the conservation law).

Each operation is a relation between the state before and the state after, both observed on an
implementation (``ManagerState`` and ``RequestView``): its *guards* say when the call must be rejected, and
with which error (a rejected call changes nothing); its *postconditions* say what must be true after an
accepted one. The spec does not say which free page an allocation takes, nor the order the free list keeps:
any choice the relation allows is correct (the reference and the optimized manager must still make the same
one, which the differential checks). A relation that does not hold raises ``ManagerLawError`` naming the
operation and the law.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import prefix_cache as pc
from .domains import Namespace
from .errors import (
    CacheError,
    InvalidRequestError,
    InvalidTypeError,
    ManagerLawError,
    OutOfPagesError,
    UnlockError,
)
from .helpers import compute_page_starts, div_ceil
from .invariants import (
    check_invariants,
    count_locks,
    free_slots_are_aligned_and_unique,
    pages_are_partitioned,
    private_rows_are_page_runs,
    raise_first,
    rows_match_handles,
)
from .requests import Req


@dataclass
class ManagerState:
    """What a CacheManager holds, as an implementation reports it (``abstract_state()``)."""

    # the prefix cache it allocates around
    cache: pc.PrefixCacheState
    # pages in the pool
    num_pages: int
    # page table: row per request slot, one pool slot per token position
    page_table: list[list[int]]
    # the free list (page starts; its order is the implementation's)
    free_slots: list[int] = field(default_factory=list)
    # page starts freed inside lazy_free_region, joining the free list when it closes; None outside
    lazy_frees: list[int] | None = None

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.cache.page_size


@dataclass(frozen=True)
class RequestView:
    """A request as the relations read it: its fields, its locked path as a spec handle, its row."""

    uid: int
    table_idx: int
    namespace: Namespace
    input_ids: tuple[int, ...]
    # the locked path (None once released by cache_req(finished=True))
    handle: pc.Handle | None
    cached_len: int
    device_len: int
    alloc_len: int
    # the row's slots over [0, alloc_len)
    row: tuple[int, ...]


# ---------------------------------------------------------------- the sets


def free_pages(state: ManagerState) -> set[int]:
    """Pages on the free list."""
    return set(state.free_slots)


def held_pages(state: ManagerState) -> set[int]:
    """Pages freed inside the open lazy free region."""
    return set(state.lazy_frees or ())


def cached_pages(state: ManagerState) -> set[int]:
    """Pages the prefix cache holds."""
    return {entry.slot_start for entry in state.cache.entries.values()}


def get_cached_pages(state: ManagerState) -> list[int]:
    """Page starts held by the cache (a list, for the partition check)."""
    return [entry.slot_start for entry in state.cache.entries.values()]


def private_pages(state: ManagerState, req: RequestView) -> set[int]:
    """Pages of the request's row past its locked path."""
    locked = req.handle.cached_len if req.handle is not None else 0
    return set(compute_page_starts(list(req.row[locked:]), state.page_size))


def _law(operation: str, holds: bool, message: str) -> None:
    if not holds:
        raise ManagerLawError(f"{operation}: {message}")


def _outcome(operation: str, expected: type[CacheError] | None, actual: type[CacheError] | None) -> bool:
    """The guard law: the call is rejected exactly when a guard says so, with its error. True when accepted."""

    def said(error: type[CacheError] | None) -> str:
        return f"rejected with {error.__name__}" if error else "accepted"

    _law(operation, expected is actual, f"the guards say {said(expected)}, the implementation {said(actual)}")
    return expected is None


def _unchanged(operation: str, before: ManagerState, after: ManagerState, what: str = "") -> None:
    _law(
        operation,
        (before.cache, sorted(before.free_slots), before.lazy_frees)
        == (after.cache, sorted(after.free_slots), after.lazy_frees),
        f"changed the cache or the free pages{what}",
    )


def _others_unchanged(operation: str, before: Mapping[int, RequestView], after: Mapping[int, RequestView]) -> None:
    for uid, view in before.items():
        _law(operation, after.get(uid) == view, f"changed request {uid}, which it was not called on")


# ---------------------------------------------------------------- the operations

# The manager's operations, in the seed's names (the list the managers and the manager machine are checked
# against, as spec/prefix_cache.py's OPERATIONS for the cache): each has its relation here.
OPERATIONS = ("match_req", "lock", "unlock", "available_size", "allocate_paged", "cache_req", "lazy_free_region")


def available_size(state: ManagerState) -> int:
    """Tokens an allocation may use now: the free pages and the evictable cache (held pages not yet)."""
    return len(state.free_slots) * state.page_size + pc.size_info(state.cache).evictable_size


def match_req(
    before: ManagerState, after: ManagerState, req: RequestView, cached_len: int, error: type[CacheError] | None
) -> None:
    """The prompt but its last token matched in the cache (the last is always recomputed for its logits).

    Guard: an empty prompt is InvalidRequestError. After: ``cached_len`` is the cache's match of
    ``input_ids[:-1]``, the cache stamped as that match stamps it, the pages otherwise unchanged.
    """
    op = f"match_req({req.uid})"
    if not _outcome(op, None if req.input_ids else InvalidRequestError, error):
        _unchanged(op, before, after)
        return
    cache = before.cache.copy()
    handle = pc.match_prefix(cache, req.input_ids[:-1], req.namespace)
    _law(op, cached_len == handle.cached_len, f"matched {cached_len} tokens, the cache holds {handle.cached_len}")
    _law(op, after.cache == cache, "the cache after it is not the cache after that match")
    _law(op, sorted(after.free_slots) == sorted(before.free_slots), "changed the free pages")


def lock(before: ManagerState, after: ManagerState, handle: pc.Handle) -> None:
    """The handle's path protected from eviction: the cache after is the cache's lock; no page moves."""
    cache = before.cache.copy()
    pc.lock(cache, handle)
    _law("lock", after.cache == cache, "the cache after it is not the cache after that lock")
    _law("lock", sorted(after.free_slots) == sorted(before.free_slots), "changed the free pages")


def unlock(before: ManagerState, after: ManagerState, handle: pc.Handle) -> None:
    """One lock of the handle's path released: the cache after is the cache's unlock; no page moves."""
    cache = before.cache.copy()
    pc.unlock(cache, handle)
    _law("unlock", after.cache == cache, "the cache after it is not the cache after that unlock")
    _law("unlock", sorted(after.free_slots) == sorted(before.free_slots), "changed the free pages")


# ---------------------------------------------------------------- the request checks, shared by every manager
#
# Pure functions of a request's numbers: each raises the error a manager must raise, with its message, in the
# order the checks run. The reference and the optimized managers call them; the relations below take their
# guards from them, so the three can never disagree on which call is rejected or why.


class RequestFields(NamedTuple):
    """A request's numbers as a manager reads them: once, as plain ints."""

    uid: int
    table_idx: int
    cached_len: int
    device_len: int
    alloc_len: int


def read_request(req: object) -> RequestFields:
    """``req``'s numbers, each an int (not a bool; an int subclass as the int it holds, whatever its dunders say),
    or raise InvalidTypeError. A manager reads a request's fields only through this, so that the value it checks
    is the value it uses (a field whose ``__index__`` lies would otherwise pick another row than the one checked:
    found by the hostile machine)."""
    values = []
    for name in RequestFields._fields:
        value = getattr(req, name, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidTypeError(
                f"{type(req).__name__} is not a request: its {name} must be an int, got {type(value).__name__}"
            )
        values.append(int.__int__(value))
    return RequestFields(*values)


def read_batch(reqs: object) -> list[RequestFields]:
    """The fields of every request of a batch (a list or tuple of requests), or raise InvalidTypeError."""
    if not isinstance(reqs, (list, tuple)):
        raise InvalidTypeError(f"a batch must be a list or tuple of requests, got {type(reqs).__name__}")
    return [read_request(req) for req in reqs]


def as_spec_requests(live_reqs: Sequence[Req], abstract_handle: Callable[[Any], pc.Handle]) -> list[Req]:
    """Copies of a manager's live requests as the invariants read them: numbers as plain ints (``read_request``),
    handles as the spec's."""
    return [
        dataclasses.replace(
            req,
            cache_handle=None if req.cache_handle is None else abstract_handle(req.cache_handle),
            **read_request(req)._asdict(),
        )
        for req in live_reqs
    ]


def prompt_length(input_ids: object) -> int:
    """How many tokens ``input_ids`` holds (the tokens themselves are checked by the cache), or raise."""
    if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__getitem__"):
        raise InvalidTypeError(f"input_ids must be a sequence of ints, got {type(input_ids).__name__}")
    try:
        return len(input_ids)  # type: ignore[arg-type]
    except TypeError as error:
        raise InvalidTypeError(f"input_ids must be a sequence of ints: {error}") from None


def check_request(
    uid: int, table_idx: int, rows: int, row_len: int, released: bool, locked: bool, alloc_len: int, page_size: int
) -> None:
    """A request a manager may act on: its row in the table (``rows`` rows of ``row_len`` positions), still
    live (not ``released``), its path ``locked``, and its row's pages ending on a page boundary."""
    if not 0 <= table_idx < rows:
        raise InvalidRequestError(f"request {uid}: table_idx {table_idx} outside the page table")
    if released:
        raise InvalidRequestError(f"request {uid} was already released by cache_req(finished=True)")
    if not locked:
        raise UnlockError(f"request {uid}: its handle is stale or not locked")
    if alloc_len % page_size or alloc_len > row_len:
        raise InvalidRequestError(f"request {uid}: alloc_len {alloc_len} is not a page boundary of the row")


def check_allocation(
    uid: int, cached_len: int, device_len: int, alloc_len: int, row_len: int, page_size: int
) -> tuple[int, int]:
    """The pages ``[first, last)`` of the row an allocation gives a request for ``[cached_len, device_len)``."""
    if not cached_len <= device_len <= row_len:
        raise InvalidRequestError(
            f"request {uid}: need cached_len {cached_len} <= device_len {device_len} <= max_seq_len {row_len}"
        )
    first_page, last_page = div_ceil(cached_len, page_size), div_ceil(device_len, page_size)
    if alloc_len != first_page * page_size:
        raise InvalidRequestError(
            f"request {uid}: row holds pages up to position {alloc_len}, cached_len {cached_len} needs"
            f" {first_page * page_size}"
        )
    return first_page, last_page


def check_pages_available(needed_pages: int, free_pages: int, evictable_tokens: int, page_size: int) -> None:
    """An allocation of ``needed_pages`` fits in the free pages and the evictable cache."""
    if needed_pages * page_size > evictable_tokens + free_pages * page_size:
        raise OutOfPagesError(
            f"need {needed_pages} pages, have {free_pages} free + {evictable_tokens // page_size} evictable"
        )


def check_cache_req(uid: int, locked_len: int, cached_len: int, alloc_len: int, tokens: int) -> None:
    """``cache_req`` may insert ``[0, cached_len)``: past the locked path, within the row's pages and the tokens."""
    if not locked_len <= cached_len <= min(alloc_len, tokens):
        raise InvalidRequestError(
            f"request {uid}: need handle {locked_len} <= cached_len {cached_len}"
            f" <= min(alloc_len {alloc_len}, tokens {tokens})"
        )


def _error_of(check: Callable[[], object]) -> type[CacheError] | None:
    """The class of the CacheError ``check`` raises, or None."""
    try:
        check()
    except CacheError as exc:
        return type(exc)
    return None


def _row_len(state: ManagerState) -> int:
    """Positions of a row (page tables are rectangular)."""
    return len(state.page_table[0]) if state.page_table else 0


def allocate_paged_guard(before: ManagerState, batch: Sequence[RequestView]) -> type[CacheError] | None:
    """The error allocate_paged must raise for this batch, in the order the checks run; None to accept it."""
    p = before.page_size
    if len({req.table_idx for req in batch}) != len(batch):
        return InvalidRequestError  # two requests of one batch share a row
    needed = 0
    for req in batch:
        guard = request_guard(before, req)
        if guard is not None:
            return guard
        try:
            first, last = check_allocation(req.uid, req.cached_len, req.device_len, req.alloc_len, _row_len(before), p)
        except CacheError as exc:
            return type(exc)
        needed += max(0, last - first)
    free = len(before.free_slots)
    return _error_of(lambda: check_pages_available(needed, free, pc.size_info(before.cache).evictable_size, p))


def request_guard(state: ManagerState, req: RequestView) -> type[CacheError] | None:
    """A request the manager may act on: its row in the table, still live, its path locked, its row whole pages."""
    locked = req.handle is not None and pc.is_handle_locked(state.cache, req.handle)
    return _error_of(
        lambda: check_request(
            req.uid,
            req.table_idx,
            len(state.page_table),
            _row_len(state),
            req.handle is None,
            locked,
            req.alloc_len,
            state.page_size,
        )
    )


def allocate_paged(
    before: ManagerState,
    after: ManagerState,
    batch_before: Sequence[RequestView],
    batch_after: Sequence[RequestView],
    error: type[CacheError] | None,
    others_before: Mapping[int, RequestView] | None = None,
    others_after: Mapping[int, RequestView] | None = None,
) -> None:
    """Pages for positions ``[cached_len, device_len)`` of each request of the batch.

    Guards: ``allocate_paged_guard``. After: each request's row covers ``device_len`` with whole new pages
    (``alloc_len = ceil(device_len / P) * P``, the part before unchanged); the new pages are distinct and
    were free or just evicted; the cache evicted exactly the pages the free list lacked, as its own
    ``evict`` would (LRU), and nothing else changed in it; free after = free before + evicted - new.
    """
    op = "allocate_paged"
    if not _outcome(op, allocate_paged_guard(before, batch_before), error):
        _unchanged(op, before, after)
        return
    p = before.page_size
    new: list[int] = []
    for req, done in zip(batch_before, batch_after, strict=True):
        end = div_ceil(req.device_len, p) * p  # >= alloc_len: the guard puts alloc_len at ceil(cached_len / P) * P
        _law(op, done.alloc_len == end, f"request {req.uid}: alloc_len {done.alloc_len}, not {end}")
        _law(op, done.row[: req.alloc_len] == req.row, f"request {req.uid}: changed the pages it already had")
        segment = list(done.row[req.alloc_len :])
        starts = compute_page_starts(segment, p)
        _law(
            op,
            [start + k for start in starts for k in range(p)] == segment and all(s % p == 0 for s in starts),
            f"request {req.uid}: its new positions are not whole aligned pages",
        )
        new += starts
    needed = len(new)
    evicted = cached_pages(before) - cached_pages(after)
    _law(op, cached_pages(after) <= cached_pages(before), "the cache gained pages")
    _law(
        op,
        len(evicted) == max(0, needed - len(before.free_slots)),
        f"evicted {len(evicted)} pages, the free list lacked {max(0, needed - len(before.free_slots))}",
    )
    cache = before.cache.copy()
    pc.evict(cache, len(evicted) * p)
    _law(op, after.cache == cache, "the cache after it is not the cache after evicting the LRU pages")
    _law(op, len(set(new)) == needed, "gave a page to two positions")
    _law(
        op,
        set(new) <= free_pages(before) | evicted,
        f"gave pages {sorted(set(new) - free_pages(before) - evicted)[:8]} that were neither free nor evicted",
    )
    _law(
        op,
        sorted(after.free_slots) == sorted((free_pages(before) | evicted) - set(new)),
        "the free pages after it are not the free and evicted pages less the new ones",
    )
    _law(op, after.lazy_frees == before.lazy_frees, "changed the pages held in the lazy free region")
    _others_unchanged(op, others_before or {}, others_after or {})


def cache_req_guard(before: ManagerState, req: RequestView) -> type[CacheError] | None:
    """The error cache_req must raise for this request; None to accept it."""
    guard = request_guard(before, req)
    if guard is not None:
        return guard
    assert req.handle is not None
    locked_len = req.handle.cached_len
    return _error_of(lambda: check_cache_req(req.uid, locked_len, req.cached_len, req.alloc_len, len(req.input_ids)))


def cache_req(
    before: ManagerState,
    after: ManagerState,
    req_before: RequestView,
    req_after: RequestView,
    finished: bool,
    error: type[CacheError] | None,
    others_before: Mapping[int, RequestView] | None = None,
    others_after: Mapping[int, RequestView] | None = None,
) -> None:
    """The request's computed prefix enters the cache; the copies the cache already had are freed.

    Guards: ``cache_req_guard``. After: the cache is the cache after inserting ``input_ids[:cached_len]``
    at the row's slots, unlocking the old path and (unfinished) locking the new one. Freed: the row's
    pages over ``[old path, what the cache already had)`` (duplicates), and when finished its tail past
    the new path too; they join the free list (or the lazy region's held pages), none twice. Unfinished:
    the row's cached part now holds the cache's slots (it never points at a page it freed), the rest is
    unchanged. Finished: the request is released (no handle, nothing allocated).
    """
    op = f"cache_req(finished={finished})"
    if not _outcome(op, cache_req_guard(before, req_before), error):
        _unchanged(op, before, after)
        return
    assert req_before.handle is not None
    p = before.page_size
    cache = before.cache.copy()
    prefix_len, new_handle = pc.insert_prefix(
        cache,
        list(req_before.input_ids[: req_before.cached_len]),
        list(req_before.row[: req_before.cached_len]),
        req_before.namespace,
    )
    pc.unlock(cache, req_before.handle)
    if not finished:
        pc.lock(cache, new_handle)
    _law(op, after.cache == cache, "the cache after it is not the cache after that insert, unlock and lock")
    freed = compute_page_starts(list(req_before.row[req_before.handle.cached_len : prefix_len]), p)
    if finished:
        freed += compute_page_starts(list(req_before.row[new_handle.cached_len : req_before.alloc_len]), p)
    _law(op, len(set(freed)) == len(freed), "freed a page twice")
    already = set(freed) & (free_pages(before) | held_pages(before))
    _law(op, not already, f"freed pages {sorted(already)[:8]} that were free already (a double free)")
    if before.lazy_frees is None:
        _law(
            op,
            sorted(after.free_slots) == sorted([*before.free_slots, *freed]),
            "the free pages after it are not the free and freed ones",
        )
        _law(op, after.lazy_frees is None, "opened a lazy free region")
    else:
        _law(op, sorted(after.free_slots) == sorted(before.free_slots), "freed pages inside a lazy region at once")
        _law(
            op,
            sorted(after.lazy_frees or ()) == sorted([*before.lazy_frees, *freed]),
            "the held pages after it are not the held and freed ones",
        )
    if finished:
        _law(op, req_after.handle is None and req_after.alloc_len == 0, "did not release the request")
    else:
        matched = tuple(pc.get_matched_indices(cache, new_handle))
        _law(op, req_after.handle == new_handle, "the request's path is not the one inserted")
        _law(
            op,
            req_after.row[: len(matched)] == matched,
            "rows_match_handles: the row's cached part is not the cache's slots",
        )
        _law(
            op, req_after.row[len(matched) :] == req_before.row[len(matched) :], "changed the row past the cached part"
        )
        _law(op, req_after.alloc_len == req_before.alloc_len, "changed alloc_len")
    _others_unchanged(op, others_before or {}, others_after or {})


def lazy_free_region(before_exit: ManagerState, after_exit: ManagerState) -> None:
    """Inside, frees are held back; when the region closes, the held pages join the free list (the guard:
    a region inside a region is CacheBusyError, checked by the machine)."""
    op = "lazy_free_region (exit)"
    _law(op, after_exit.lazy_frees is None, "left the region open")
    _law(
        op,
        sorted(after_exit.free_slots) == sorted([*before_exit.free_slots, *(before_exit.lazy_frees or ())]),
        "the free pages after it are not the free and the held ones",
    )
    _law(op, after_exit.cache == before_exit.cache, "changed the cache")


# ---------------------------------------------------------------- invariants


def check_distinct_rows(reqs: Sequence[Req] | Sequence[RequestFields]) -> None:
    """Raise when two requests of one batch share a page-table row."""
    rows = [req.table_idx for req in reqs]
    if len(set(rows)) != len(rows):
        raise InvalidRequestError(f"two requests of one batch share a page-table row: {sorted(rows)}")


def get_private_rows(state: ManagerState, live_reqs: Sequence[Req]) -> dict[int, list[int]]:
    """For each live request, the slots of its row that it holds privately."""
    return {
        req.table_idx: state.page_table[req.table_idx][req.cache_handle.cached_len : req.alloc_len] for req in live_reqs
    }


def check_manager_invariants(state: ManagerState, live_reqs: Sequence[Req]) -> None:
    """Raise IntegrityError naming the first broken accounting invariant (live requests hold spec handles):
    the live requests first (the others read their handles), then the prefix cache's invariants with the
    requests' locks, then the rest of ``MANAGER_INVARIANTS`` in order."""
    (name, first), *rest = MANAGER_INVARIANTS
    raise_first([(name, first(state, live_reqs))])
    check_invariants(state.cache, locks=count_locks(state.cache, [req.cache_handle for req in live_reqs]))
    raise_first((name, holds(state, live_reqs)) for name, holds in rest)


def get_free_pages(state: ManagerState) -> list[int]:
    """Page starts on the free list or held by the open lazy free region (a list: duplicates are a finding)."""
    return state.free_slots + (state.lazy_frees or [])


def get_matched_rows(state: ManagerState, live_reqs: Sequence[Req]) -> dict[int, tuple[list[int], list[int]]]:
    """For each live request, its row's cached part and the slots its handle's path holds in the cache."""
    return {
        req.table_idx: (
            state.page_table[req.table_idx][: req.cache_handle.cached_len],
            pc.get_matched_indices(state.cache, req.cache_handle),
        )
        for req in live_reqs
    }


def live_requests_hold_distinct_rows(live_reqs: Sequence[Req]) -> str | None:
    """Each live request holds a handle and a page-table row of its own."""
    rows = [req.table_idx for req in live_reqs]
    if len(set(rows)) != len(rows):
        return f"live requests share rows: {sorted(rows)}"
    released = [req.uid for req in live_reqs if req.cache_handle is None]
    return f"requests {released} are live but were released" if released else None


# the manager's accounting invariants, by name, each a predicate of (state, live requests): None when it holds,
# else what is wrong; check_manager_invariants runs them in this order (tests/spec/test_invariants.py breaks each)
MANAGER_INVARIANTS: tuple[tuple[str, Callable[[ManagerState, Sequence[Req]], str | None]], ...] = (
    ("live_requests_hold_distinct_rows", lambda state, live: live_requests_hold_distinct_rows(live)),
    (
        "free_slots_are_aligned_and_unique",
        lambda state, live: free_slots_are_aligned_and_unique(get_free_pages(state), state.page_size, state.num_pages),
    ),
    (
        "private_rows_are_page_runs",
        lambda state, live: private_rows_are_page_runs(get_private_rows(state, live), state.page_size),
    ),
    (
        "pages_are_partitioned",
        lambda state, live: pages_are_partitioned(
            state.num_pages,
            state.page_size,
            get_free_pages(state),
            get_cached_pages(state),
            get_private_rows(state, live),
        ),
    ),
    ("rows_match_handles", lambda state, live: rows_match_handles(get_matched_rows(state, live))),
)
