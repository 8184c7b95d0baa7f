"""The CacheManager's contract, checked by CrossHair (``tox -e crosshair``): page conservation, and every
call within the spec's relation for it (``spec/cache_manager.py``).

``manager_contract`` runs a short program of manager operations on the reference CacheManager (pure
Python, so CrossHair can follow it symbolically) and returns whether every law held: after each call
its relation (the guards chose the outcome, a rejected call changed nothing, an accepted one did exactly
what the relation says) and the accounting invariants, the conservation law ``pages_are_partitioned``
first among them (every page free, held, cached or private to one live request, exactly once).
``post: __return__`` asks CrossHair for a program where they do not hold. ``run_manager_program`` takes
any manager with the differential capability (``radixspec.fuzz.targets.ours``): the tests run the same programs on the
optimized manager.

Op codes: 0-2 admit a request for token sequence k (match_req, lock, its row takes the matched pages; or
unlock again when the pool cannot hold the rest of its prompt);
3 match_req of an empty prompt (rejected); 4 prefill the oldest live request (allocate_paged for its whole
prompt); 5 decode: every fully computed live request takes a token and one batch allocates for all;
6 cache_req(finished=False) of the oldest request with computed tokens; 7 cache_req(finished=True) of the
oldest live request (released); 8 the next call runs inside lazy_free_region; 9 a batch holding one request
twice (rejected).

Bounds (the small scope): P in {1, 2}; 3 pages of pool (so that 5 calls reach an eviction); 2 rows of 8
pages; programs of at most 6 calls over the cache contracts' three token sequences
(``radixspec.spec.contracts.SEQUENCES``: shared prefixes, partial pages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from radixspec.spec import cache_manager as sm
from radixspec.spec.contracts import sequence
from radixspec.spec.errors import CacheError
from radixspec.spec.requests import Req

from .targets.api import ExactManager
from .targets.ours import ReferenceManager

# a manager's handles (each family its own)
H = TypeVar("H")
NUM_PAGES, ROWS, PAGES_PER_ROW = 3, 2, 8
# the token a decode step appends
DECODED = 9
# op codes 0..LAST_OP (see the module's docstring)
LAST_OP = 9


def plain(value: int, most: int) -> int:
    """``value`` (in ``[0, most]``) as a literal int, found by comparisons."""
    return next(k for k in range(most + 1) if k == value)


class ManagerProgram(Generic[H]):
    """One manager and its live requests; each call observed before and after and checked against the spec."""

    def __init__(self, manager: ExactManager[Req, H], page_size: int) -> None:
        self.manager = manager
        self.page_size = page_size
        self.live: list[Req] = []
        self.uids = 0
        self.lazy = False

    # ------------------------------------------------------------ observing

    def state(self) -> sm.ManagerState:
        """The manager's abstract state."""
        return self.manager.abstract_state()

    def views(self, state: sm.ManagerState, reqs: list[Req]) -> dict[int, sm.RequestView]:
        """uid -> the request as the relations read it."""
        return {req.uid: self.manager.view(state, req) for req in reqs}

    def call(self, operation: Callable[[], object]) -> type[CacheError] | None:
        """Run ``operation`` (inside a lazy free region when the previous op asked); the error it raised, if any."""
        with self.region():
            try:
                operation()
            except CacheError as error:
                return type(error)
        return None

    @contextmanager
    def region(self) -> Iterator[None]:
        """The lazy free region the previous op asked for (its exit law checked), or none."""
        if not self.lazy:
            yield
            return
        self.lazy = False
        with self.manager.lazy_free_region():
            yield
            inside = self.state()
        sm.lazy_free_region(inside, self.state())

    def check_invariants(self) -> None:
        """The accounting invariants (conservation first) over the live requests, through the spec."""
        state = self.state()
        live = [dataclasses.replace(req, cache_handle=self.manager.spec_handle(req.cache_handle)) for req in self.live]
        sm.check_manager_invariants(state, live)

    # ------------------------------------------------------------ the calls

    def admit(self, index: int) -> None:
        """match_req then lock for a new request of token sequence ``index`` (or of no tokens, when -1)."""
        free_rows = sorted(set(range(ROWS)) - {req.table_idx for req in self.live})
        if not free_rows:
            return
        tokens = [] if index < 0 else sequence(self.page_size, index)
        self.uids += 1
        req = self.manager.new_req(tokens, free_rows[0], None, self.uids)
        before = self.state()
        found: list[H] = []
        error = self.call(lambda: found.append(self.manager.match_req(req)))
        after = self.state()
        cached_len = self.manager.cached_len(found[0]) if found else 0
        sm.match_req(before, after, self.manager.view(after, req), cached_len, error)
        if error is not None:
            return
        handle = found[0]
        self.call(lambda: self.manager.lock(handle))
        locked = self.state()
        sm.lock(after, locked, self.manager.spec_handle(handle))
        if len(tokens) - cached_len > self.manager.available_size():
            # no room for the rest of the prompt once its prefix is locked: the scheduler unlocks it again
            self.call(lambda: self.manager.unlock(handle))
            sm.unlock(locked, self.state(), self.manager.spec_handle(handle))
            return
        self.manager.admit(req, handle)
        self.live.append(req)

    def allocate(self, batch: list[Req], device_lens: list[int]) -> type[CacheError] | None:
        """allocate_paged for the batch after setting each request's device_len; restored when rejected."""
        for req, device_len in zip(batch, device_lens, strict=True):
            self.manager.set_lengths(req, req.cached_len, device_len)
        others = [req for req in self.live if req not in batch]
        before = self.state()
        views_before, others_before = self.views(before, batch), self.views(before, others)
        error = self.call(lambda: self.manager.allocate_paged(batch))
        after = self.state()
        views_after, others_after = self.views(after, batch), self.views(after, others)
        sm.allocate_paged(
            before,
            after,
            [views_before[req.uid] for req in batch],
            [views_after[req.uid] for req in batch],
            error,
            others_before,
            others_after,
        )
        if error is not None:
            for req in batch:
                self.manager.set_lengths(req, req.cached_len, req.cached_len)
        return error

    def cache(self, req: Req, finished: bool) -> None:
        """cache_req after the forward computed ``[cached_len, device_len)``."""
        self.manager.set_lengths(req, req.device_len, req.device_len)
        others = [other for other in self.live if other is not req]
        before = self.state()
        view_before, others_before = self.manager.view(before, req), self.views(before, others)
        error = self.call(lambda: self.manager.cache_req(req, finished))
        after = self.state()
        sm.cache_req(
            before,
            after,
            view_before,
            self.manager.view(after, req),
            finished,
            error,
            others_before,
            self.views(after, others),
        )
        if finished and error is None:
            self.live.remove(req)

    def step(self, code: int) -> None:
        """One op code (see the module's docstring)."""
        if code < 3:
            self.admit(code)
        elif code == 3:
            self.admit(-1)
        elif code == 4:
            waiting = [req for req in self.live if req.device_len < len(req.input_ids)]
            if waiting:
                self.allocate(waiting[:1], [len(waiting[0].input_ids)])
        elif code == 5:
            done = [req for req in self.live if req.cached_len == len(req.input_ids)]
            for req in done:
                self.manager.append_token(req, DECODED)
            if done:
                self.allocate(done, [len(req.input_ids) for req in done])
        elif code == 6:
            computed = [req for req in self.live if req.device_len > req.cached_len]
            if computed:
                self.cache(computed[0], finished=False)
        elif code == 7:
            if self.live:
                self.cache(self.live[0], finished=True)
        elif code == 8:
            self.lazy = True
        elif self.live:
            before = self.state()
            error = self.call(lambda: self.manager.allocate_paged([self.live[0], self.live[0]]))
            view = self.manager.view(before, self.live[0])
            sm.allocate_paged(before, self.state(), [view, view], [view, view], error)


def run_manager_program(manager: ExactManager[Req, H], page_size: int, program: list[int]) -> bool:
    """Run the program on ``manager``; True when every call kept its relation and the invariants held after."""
    run = ManagerProgram(manager, page_size)
    for code in program:
        run.step(code)
        run.check_invariants()
    return True


def manager_contract(page_size: int, program: list[int]) -> bool:
    """Every call of the program keeps its spec relation, and pages are conserved after each.

    pre: 1 <= page_size <= 2
    pre: len(program) <= 6
    pre: all(0 <= code <= 9 for code in program)
    post: __return__
    """
    # the page size and the op codes as plain ints, chosen by comparisons (CrossHair branches on each, so
    # it still explores every choice). Symbolic ints reaching the manager's slices gave false
    # counterexamples: CrossHair's slice of a list by a symbolic bound is a view, which a later
    # ``del lst[:n]`` changes under it
    page_size = plain(page_size, 2)
    program = [plain(code, LAST_OP) for code in program]
    manager = ReferenceManager(NUM_PAGES, page_size, ROWS, PAGES_PER_ROW * page_size)
    return run_manager_program(manager, page_size, program)
