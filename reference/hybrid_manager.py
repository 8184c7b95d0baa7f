"""Page accounting for a hybrid cache: one pool per group, window pages released while a request runs.

The twin of ``reference/cache_manager.py`` for several attention groups
(``spec/hybrid.py``, ``docs/hybrid.md``). Every group has its own pool of
``num_pages`` pages, and every page of it is free, cached in that group, or
private to one live request (``pages_are_partitioned``, once per group).

A request's row, per group, has one entry per page of its tokens: the page's
slot start, or ``None`` for a page it does not hold. The part below its
match (``handle.cached_len``) is the cache's pages, locked by the handle;
the rest is private::

    # [0, handle.cached_len)          the cache's pages, locked (window groups: only those the match uses)
    # [handle.cached_len, computed)   private pages holding stored KV (window pages behind the window: None)
    # [computed, allocated)           private pages allocated for KV not stored yet

The manager works over any cache with the hybrid cache's methods, so the
fuzzer runs it over the spec and over each tree and compares.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec.domains import Namespace, check_namespace, check_token_ids
from radixspec.spec.errors import InvalidRequestError, OutOfPagesError
from radixspec.spec.helpers import compute_page_to_token, div_ceil
from radixspec.spec.invariants import pages_are_partitioned, raise_first
from radixspec.spec.types import SizeInfo


class HybridCache(Protocol):
    """What the manager calls on a hybrid cache (the spec's, the reference tree, the optimized tree)."""

    page_size: int
    windows: tuple[hy.Window, ...]

    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> Any: ...
    def insert_prefix(
        self, input_ids: Sequence[int], pages: Sequence[Sequence[int | None]], namespace: Namespace = None
    ) -> hy.HybridInsertResult: ...
    def lock(self, handle: Any) -> None: ...
    def unlock(self, handle: Any) -> None: ...
    def get_matched_pages(self, handle: Any) -> list[list[int | None]]: ...
    def evict(self, group: int, size: int) -> list[int]: ...
    def size_info(self, group: int) -> SizeInfo: ...
    def abstract_state(self) -> hy.HybridState: ...
    def check_integrity(self) -> None: ...


@dataclass
class HybridReq:
    """A running request of a hybrid cache."""

    # distinct per live request
    uid: int
    # prompt and generated tokens so far
    input_ids: list[int]
    namespace: Namespace = None
    # tokens whose KV is stored
    computed: int = 0
    # per group, per page: its slot start, or None where the request does not hold the page
    rows: list[list[int | None]] = field(default_factory=list)
    # the locked match (None before match_req)
    handle: Any = None

    @property
    def cached_len(self) -> int:
        """Tokens of the locked match."""
        return 0 if self.handle is None else int(self.handle.cached_len)


class HybridCacheManager:
    """One free list per group over a hybrid cache; requests match, allocate, store, release and cache."""

    def __init__(self, cache: HybridCache, num_pages: int) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise InvalidRequestError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.cache = cache
        self.page_size = cache.page_size
        self.windows = cache.windows
        self.num_pages = num_pages
        # per group: page starts, FIFO (allocation takes from the front, frees append at the back)
        self.free_slots = [deque(range(0, num_pages * self.page_size, self.page_size)) for _ in self.windows]

    def available_size(self, group: int) -> int:
        """Tokens group ``group`` can still allocate: its free pages and what its cache may evict."""
        return len(self.free_slots[group]) * self.page_size + self.cache.size_info(group).evictable_size

    def match_req(self, req: HybridReq) -> None:
        """Match ``req``'s tokens but the last (always recomputed) and lock the match: its rows start there."""
        # CHECK
        tokens = check_token_ids(req.input_ids)
        check_namespace(req.namespace)
        if req.handle is not None or req.rows:
            raise InvalidRequestError(f"request {req.uid} was matched already")
        if not tokens:
            raise InvalidRequestError(f"request {req.uid} has no tokens")
        # UPDATE
        handle = self.cache.match_prefix(tokens[:-1], req.namespace)
        self.cache.lock(handle)
        req.handle = handle
        req.rows = self.cache.get_matched_pages(handle)
        req.computed = handle.cached_len

    def allocate_paged(self, req: HybridReq, length: int) -> None:
        """Give ``req`` pages for its tokens ``[0, length)`` in every group; evicts when the free list is short.

        Raises OutOfPagesError, with nothing changed, when some group cannot find the pages.
        """
        # CHECK
        if req.handle is None:
            raise InvalidRequestError.never_matched(req.uid)
        if not req.computed <= length <= len(req.input_ids):
            raise InvalidRequestError(f"request {req.uid}: cannot allocate {length} tokens of {len(req.input_ids)}")
        needed = [max(0, div_ceil(length, self.page_size) - len(row)) for row in req.rows]
        for group, pages in enumerate(needed):
            if pages * self.page_size > self.available_size(group):
                raise OutOfPagesError(
                    f"group {group}: {pages} pages needed, {self.available_size(group) // self.page_size} available"
                )
        # UPDATE
        for group, pages in enumerate(needed):
            free = self.free_slots[group]
            if len(free) < pages:
                # locked now or private, never the request's own pages: every cached page it holds is locked
                evicted = self.cache.evict(group, (pages - len(free)) * self.page_size)
                free.extend(evicted[:: self.page_size])
            req.rows[group].extend(free.popleft() for _ in range(pages))

    def store(self, req: HybridReq, tokens: int) -> None:
        """Record that ``tokens`` more tokens of ``req`` have their KV stored, then release what the window left."""
        # CHECK
        allocated = min(len(row) for row in req.rows) * self.page_size if req.rows else 0
        if tokens < 0 or req.computed + tokens > min(allocated, len(req.input_ids)):
            raise InvalidRequestError(
                f"request {req.uid}: {req.computed} + {tokens} tokens stored, {allocated} allocated,"
                f" {len(req.input_ids)} known"
            )
        # UPDATE
        req.computed += tokens
        self.release_skipped(req)

    def release_skipped(self, req: HybridReq) -> None:
        """Free every private window page that no token from ``req.computed`` on can attend.

        The pages of the locked match stay held until cache_req (named choice ``early_release``).
        """
        for group, window in enumerate(self.windows):
            row = req.rows[group]
            first_attended = hy.compute_used_pages(req.computed, window, self.page_size).start
            for page in range(req.cached_len // self.page_size, min(first_attended, len(row))):
                start = row[page]
                if start is not None:
                    self.free_slots[group].append(start)
                    row[page] = None

    def cacheable_len(self, req: HybridReq) -> int:
        """The longest page-aligned length, up to the stored KV, whose match every group's row can serve
        (``spec/hit_rules.py``'s ``compute_cacheable_len``)."""
        p = self.page_size
        rule = hr.HitRule(p, self.windows, p)
        return hr.compute_cacheable_len(
            rule, req.computed, len(req.input_ids), lambda group, end: req.rows[group][end // p - 1] is not None
        )

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        """Cache ``req``'s longest valid prefix; when ``finished``, free the rest, else lock the new match.

        Caching less than the whole stored KV is a choice: a match past the longest valid length
        would lock pages a window group released, so its pages past it stay private.
        """
        # CHECK
        if req.handle is None:
            raise InvalidRequestError.never_matched(req.uid)
        p = self.page_size
        length = self.cacheable_len(req)
        # UPDATE
        result = self.cache.insert_prefix(
            req.input_ids[:length], [row[: length // p] for row in req.rows], req.namespace
        )
        for group, starts in enumerate(result.unused):
            # another request cached these pages meanwhile: ours are duplicates
            self.free_slots[group].extend(starts)
        self.cache.unlock(req.handle)
        if finished:
            for group, row in enumerate(req.rows):
                self.free_slots[group].extend(start for start in row[length // p :] if start is not None)
            req.rows, req.handle = [], None
            return
        self.cache.lock(result.handle)
        req.handle = result.handle
        for row, matched in zip(req.rows, self.cache.get_matched_pages(result.handle), strict=True):
            row[: length // p] = matched

    # ------------------------------------------------------------ integrity

    def private_rows(self, live_reqs: Sequence[HybridReq], group: int) -> dict[int, list[int]]:
        """Per live request, the slots of its private pages in ``group``."""
        p = self.page_size
        return {
            req.uid: compute_page_to_token([s for s in req.rows[group][req.cached_len // p :] if s is not None], p)
            for req in live_reqs
        }

    def check_integrity(self, live_reqs: Sequence[HybridReq]) -> None:
        """Check the cache, then per group the conservation law, the rows against the matches and the safety law."""
        self.cache.check_integrity()
        state = self.cache.abstract_state()
        checks: list[tuple[str, str | None]] = []
        for group in range(len(self.windows)):
            cached = [entry.slot_start for entry in state.groups[group].values()]
            problem = pages_are_partitioned(
                self.num_pages,
                self.page_size,
                list(self.free_slots[group]),
                cached,
                self.private_rows(live_reqs, group),
            )
            checks.append((f"group {group} pages_are_partitioned", problem))
        checks.append(("rows_match_handles", self.rows_match_handles(live_reqs)))
        attended = {req.uid: (req.computed, req.rows) for req in live_reqs}
        checks.append(("attended_pages_are_held", hy.attended_pages_are_held(self.windows, self.page_size, attended)))
        raise_first(checks)

    def rows_match_handles(self, live_reqs: Sequence[HybridReq]) -> str | None:
        """The part of every live request's rows below its match is the cache's pages of its locked match."""
        p = self.page_size
        for req in live_reqs:
            matched = self.cache.get_matched_pages(req.handle)
            for group, (row, pages) in enumerate(zip(req.rows, matched, strict=True)):
                if row[: req.cached_len // p] != pages:
                    return f"request {req.uid}, group {group}: row {row[:8]}... but its match holds {pages[:8]}..."
        return None
