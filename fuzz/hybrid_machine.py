"""The hybrid machine: the spec's hybrid cache beside our hybrid trees, and the hybrid manager over each.

Two halves share one example (``docs/hybrid.md``):

* the **cache** half drives the spec state and every selected tree with the
  same match / insert / lock / unlock / evict / reset calls and bad inputs,
  and compares results, errors and abstract states after every step;
* the **manager** half runs ``HybridCacheManager`` over the spec's cache and
  over each tree's (its own caches, apart from the cache half's), with
  requests that match, allocate, store, decode and cache; it compares every
  manager's free lists, rows and results, and checks after every step the
  conservation law per group, the rows against the locked matches, and the
  safety law: every page a live request still attends is held, and keeps
  its slot until the request caches it.

The windows are drawn against the page size: smaller than a page, not a
multiple of it, many pages long; one to three groups, full attention among
them or not.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from radixspec.reference.hybrid_manager import HybridCache, HybridCacheManager, HybridReq
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError

from .judge import Outcome, expect_same
from .lifecycle import LifecycleLaws, laws_for
from .messages import brief
from .sequences import NAMESPACE_PALETTE, NUM_PATTERNS, build_sequence, page_choices, page_pattern, tail_choices
from .stats import STATS
from .targets import resolve
from .targets.api import CountsPages, LifecycleTarget, TargetInfo
from .targets.layers import our_hybrid_caches
from .targets.ours import SpecHybridCache
from .workloads import Kind, Workload

# small pages often (splits, partial pages), any size up to 16, and the pages engines run (16 to 64 tokens)
hybrid_page_sizes = st.one_of(st.sampled_from([1, 2, 4]), st.integers(1, 16), st.sampled_from([16, 32, 64]))
# the smallest production pool, in pages: drawn only in production batches (fuzz/campaign.py), filled by bursts
PRODUCTION_POOL = 1024
# a burst's prompt tokens at most: the lifecycle laws follow each token in Python (a burst of 64 prompts of 4,096
# tokens took seconds under vllm-mamba)
BURST_TOKENS = 32_768
# serve_burst as a rule, its draws: the kind of its requests, where its shapes start, how many, about how many pages
BURST_RULE = rule(
    kind=st.sampled_from([kind.value for kind in Kind]),
    pick=st.integers(0, 63),
    count=st.sampled_from([4, 16, 64]),
    pages=st.sampled_from([1, 4, 16, 64]),
)
# the pages engines run, kept as drawn with a production pool even for a target whose own page sizes are smaller
# (the pool, not the batch, decides: a production batch's regression file replays its pool). Programs recorded
# before 2026-12-07 (b017932) with such a pool ran these at the target's own size
PRODUCTION_PAGE_SIZES = (16, 32, 64)
# small pools evict often; big ones let trees and keys grow (half and half: with two small draws in three, a planted
# storage bug of sglang-hicache went uncaught in 400 examples); the biggest (one example in 32 of the production
# batches: each costs as much as hundreds of small ones) hold the pages of a production cache (drawn by name:
# one_of takes each strategy once, however often it is listed)
POOL_SIZES = {
    "small": st.integers(4, 40),
    "big": st.integers(41, 400),
    "production": st.integers(PRODUCTION_POOL, 8192),
}
hybrid_pool_sizes = st.sampled_from(["small"] * 16 + ["big"] * 15 + ["production"]).flatmap(POOL_SIZES.__getitem__)
BAD_INSERTS = ("misaligned", "duplicate", "missing", "short_row", "groups")
# a path's namespace and its handle in each implementation (the spec's, then each cache's: each of its own type)
Handles = tuple[Namespace, tuple[Any, ...]]
# what an insert gives its bundle: the handles, or nothing when the spec refused it
Inserted = Handles | MultipleResults[Handles]


# a window as drawn, independent of the page size (so a regression file replays it): None (full attention) or
# (kind, k); window_for reads it at the drawn page size
WindowChoice = tuple[int, int] | None
window_choices = st.lists(
    st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(1, 35))), min_size=1, max_size=3
)


# the hybrid model's state, copied: per group its pages, the locks, the clock
Snapshot = tuple[tuple[dict[pc.PageKey, pc.Entry], ...], dict[tuple[Namespace, tuple[int, ...]], int], int]


def window_for(choice: WindowChoice, page_size: int) -> hy.Window:
    """One window at ``page_size``: full attention, below a page, not a multiple of it, or many pages."""
    if choice is None:
        return None
    kind, k = choice
    p = page_size
    if kind == 0:
        return 1 + (k - 1) % max(1, p)
    if kind == 1:
        return 1 + (k - 1) % (4 * p + 3)
    return (1 + (k - 1) % 8) * p + 1


def manager_outcome(call: Callable[[], object], foreign: bool, manager: object = None) -> Outcome:
    """What a manager's call gave. An IntegrityError raised inside it (a target's own check, two tree cores that
    disagree) is a law broken, never a refusal: taken for one, it was swallowed and the campaign went on from a
    state the law had just ruled out. A foreign manager that refuses only with spec errors
    (``raises_only_cache_errors``) crashed when anything else escapes it."""
    foreign = foreign and not getattr(manager, "raises_only_cache_errors", False)
    got = Outcome.of(call, foreign=foreign)
    if got.error is not None and issubclass(got.error, IntegrityError):
        raise AssertionError(got.message)
    return got


def same(names: list[str], what: str, outcomes: Sequence[object]) -> Outcome:
    """The one outcome every implementation had (the spec's first, then ``names``': the judge's exact comparison of
    values, error classes and words), or an AssertionError naming the first that differs; plain values are outcomes
    of calls that returned them."""
    judged = [o if isinstance(o, Outcome) else Outcome(True, o) for o in outcomes]
    for name, got in zip(names, judged[1:], strict=True):
        expect_same(what, judged[0], got, name)
    return judged[0]


def same_requests(names: list[str], what: str, reqs: list[HybridReq]) -> None:
    """Every manager's copy of a request (the spec's first, then ``names``') holds the same rows, match and stored
    length."""
    first = reqs[0]
    for name, req in zip(names, reqs[1:], strict=True):
        assert (req.rows, req.cached_len, req.computed) == (first.rows, first.cached_len, first.computed), (
            f"{what} of request {first.uid}: spec rows {brief(first.rows)} matched {first.cached_len},"
            f" {name} rows {brief(req.rows)} matched {req.cached_len}"
        )


def draw_pages(
    free: list[deque[int]], windows: tuple[hy.Window, ...], pages: int, held: list[list[bool]]
) -> list[list[int | None]]:
    """One row per group for ``pages`` whole pages: fresh starts from the ledger ``free``, None where not held."""
    rows: list[list[int | None]] = []
    for group, window in enumerate(windows):
        row: list[int | None] = []
        for page in range(pages):
            keep = window is None or held[group % len(held)][page % len(held[group % len(held)])]
            row.append(free[group].popleft() if keep and free[group] else None)
        rows.append(row)
    return rows


def bad_rows(model: hy.HybridState, num_pages: int, whole: int, kind: str) -> list[list[int | None]]:
    """Rows for ``whole`` pages that break the insert's contract as ``kind`` says (one of BAD_INSERTS): fresh
    slots past the pool, then one misaligned, already cached, missing in a full group, a row short, a group
    too few or too many."""
    p, windows = model.page_size, model.windows
    cached = [[e.slot_start for e in entries.values()] for entries in model.groups]
    rows: list[list[int | None]] = [
        [num_pages * p + (g * whole + k) * p for k in range(whole)] for g in range(len(windows))
    ]
    if kind == "misaligned" and p > 1 and whole:
        rows[-1][-1] = (rows[-1][-1] or 0) + 1
    elif kind == "duplicate" and whole and cached[-1]:
        rows[-1][-1] = cached[-1][0]
    elif kind == "missing" and whole and None in windows:
        rows[windows.index(None)][-1] = None
    elif kind == "short_row":
        rows[0] = rows[0][:-1] if whole else [0]
    elif kind == "groups":
        rows = rows[:-1] if len(rows) > 1 else rows + rows
    return rows


def first_sequences(page_size: int, first: list[tuple[list[int], list[int]]]) -> list[tuple[int, ...]]:
    """The example's first keys, as drawn at set-up."""
    return [tuple(build_sequence(page_size, pages, tail)) for pages, tail in first]


def caches_agree(model: hy.HybridState, names: list[str], caches: list[HybridCache]) -> None:
    """Every tree's abstract state is the spec's state ``model``; every tree passes its own integrity check."""
    if not caches:
        return
    hy.check_hybrid_invariants(model, [hy.size_info(model, g) for g in range(len(model.windows))])
    expected = snapshot(model)
    for name, cache in zip(names, caches, strict=True):
        cache.check_integrity()
        state = cache.abstract_state()
        got = (tuple(state.groups), dict(state.locks), state.clock)
        assert got == expected, f"{name}'s abstract state differs from the spec's ({len(expected[0][0])} pages)"


def snapshot(model: hy.HybridState) -> Snapshot:
    """The model's state, copied (to tell that a rejected call changed nothing)."""
    return (tuple(dict(g) for g in model.groups), dict(model.locks), model.clock)


def record_reach(model: hy.HybridState, tokens: int) -> None:
    """The cache half's reach after a call on a key of ``tokens`` tokens."""
    STATS.record_reach(
        longest_key_tokens=tokens,
        largest_tree_pages=max(len(g) for g in model.groups),
        # one node per page in the trees: a path's nodes are its pages
        deepest_path_nodes=max((len(key[1]) // model.page_size for g in model.groups for key in g), default=0),
        most_namespaces=len({key[0] for g in model.groups for key in g}),
    )


def uncached_pages(model: hy.HybridState, num_pages: int) -> list[deque[int]]:
    """The cache half's ledger, per group: every page start of the pool that ``model`` does not cache, in order."""
    p = model.page_size
    ledger = []
    for entries in model.groups:
        cached = {entry.slot_start for entry in entries.values()}
        ledger.append(deque(s for s in range(0, num_pages * p, p) if s not in cached))
    return ledger


class HybridMachine(RuleBasedStateMachine):
    """The spec's hybrid cache and our hybrid trees, and the hybrid manager over each, driven alike."""

    # the implementations beside the spec (radixspec.fuzz.machines.machine_for sets them from --impl)
    IMPLS: ClassVar[tuple[str | TargetInfo, ...]] = tuple(our_hybrid_caches())
    # a production batch's machine (machine_for sets it; a regression file's too): production pools drawn
    PRODUCTION: ClassVar[bool] = False

    seqs = Bundle("hybrid_seqs")
    handles = Bundle("hybrid_handles")

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.page_size = 1
        self.windows: tuple[hy.Window, ...] = (None,)
        self.num_pages = 8
        self.names: list[str] = []
        self.model = hy.new_state(1, (None,))
        self.caches: list[HybridCache] = []
        # the cache half's slot ledger, per group: page starts the model does not cache
        self.free: list[deque[int]] = []
        # the manager half: one manager per implementation (the spec's first), one request per manager per uid
        self.managers: list[LifecycleTarget] = []
        # ours (not a foreign target): the spec's manager, then each implementation's, as self.managers
        self.ours: list[HybridCacheManager] = []
        self.reqs: dict[int, list[HybridReq]] = {}
        self.next_uid = 0
        # a foreign target (an engine's hybrid manager) runs alone: no cache half, no exact comparison
        self.foreign = False
        # the foreign manager, resolved once, when it tells how many pages it caches (the reach)
        self.page_counter: CountsPages | None = None
        # the lifecycle laws and their KV shadow (fuzz/lifecycle.py): the spec's manager (every manager of ours
        # holds its rows), or each tree core of a foreign one
        self.laws: list[LifecycleLaws] = []
        # the example's traffic shapes (fuzz/workloads.py), sized to the pool at set-up
        self.workload = Workload.for_pool(0, 1, 8)

    @initialize(
        target=seqs,
        page_size=hybrid_page_sizes,
        num_pages=hybrid_pool_sizes,
        windows=window_choices,
        first=st.lists(st.tuples(page_choices, tail_choices), min_size=1, max_size=3),
    )
    def setup(
        self, page_size: int, num_pages: int, windows: list[WindowChoice], first: list[tuple[list[int], list[int]]]
    ) -> MultipleResults[tuple[int, ...]]:
        if not self.PRODUCTION and num_pages >= PRODUCTION_POOL:
            num_pages = 41 + num_pages % 360  # a big pool instead
        self.page_size, self.num_pages = page_size, num_pages
        self.workload = Workload.for_pool(num_pages * 131 + page_size, page_size, num_pages * page_size)
        self.windows = hy.check_windows([window_for(choice, page_size) for choice in windows])
        ours = our_hybrid_caches()
        self.names = [name for name in ours if name in self.IMPLS]
        # an engine's hybrid manager: it picks its own pages, so it runs alone, under the universal checks
        if (chosen := next((name for name in self.IMPLS if name not in ours), None)) is not None:
            info = chosen if isinstance(chosen, TargetInfo) else resolve(chosen, check=False)
            assert info.hybrid_factory is not None, f"target {info.name} has no hybrid layer"
            if info.page_sizes is not None:
                production = num_pages >= PRODUCTION_POOL and page_size in PRODUCTION_PAGE_SIZES
                if page_size not in info.page_sizes and not production:
                    page_size = info.page_sizes[page_size % len(info.page_sizes)]
                self.page_size = page_size
                self.workload = Workload.for_pool(num_pages * 131 + page_size, page_size, num_pages * page_size)
            target = info.hybrid_factory(page_size, self.windows, num_pages)
            self.foreign, self.windows, self.managers = True, target.windows, [target]
            # the page sizes an engine's example ran, those engines run named (the reach of a campaign)
            STATS.record_rule(f"hybrid.page_size[{page_size if page_size >= 16 else 'below 16'}]")
            self.laws = laws_for(target)
            self.page_counter = target if isinstance(target, CountsPages) else None
            return multiple(*first_sequences(self.page_size, first))
        self.model = hy.new_state(page_size, self.windows)
        makers = [SpecHybridCache, *(ours[name] for name in self.names)]
        self.caches = [make(page_size, self.windows) for make in makers[1:]]
        self.free = [deque(range(0, num_pages * page_size, page_size)) for _ in self.windows]
        self.ours = [HybridCacheManager(make(page_size, self.windows), num_pages) for make in makers]
        self.managers = list(self.ours)
        self.laws = laws_for(self.ours[0])
        return multiple(*first_sequences(self.page_size, first))

    # ------------------------------------------------------------ sequences

    @rule(target=seqs, base=seqs, keep=st.booleans(), pages=page_choices, tail=tail_choices)
    def new_seq(self, base: tuple[int, ...], keep: bool, pages: list[int], tail: list[int]) -> tuple[int, ...]:
        STATS.record_rule("hybrid.new_seq")
        return tuple(build_sequence(self.page_size, pages, tail, base if keep else ()))

    @rule(target=seqs, base=seqs, cut=st.integers(0, 255))
    def prefix_of(self, base: tuple[int, ...], cut: int) -> tuple[int, ...]:
        STATS.record_rule("hybrid.prefix_of")
        return base[: cut % (len(base) + 1)]

    @rule(target=seqs, base=seqs, tokens=st.sampled_from([64, 256, 512]), salt=st.integers(0, 7))
    def long_seq(self, base: tuple[int, ...], tokens: int, salt: int) -> tuple[int, ...]:
        """A key of hundreds of tokens after ``base``'s whole pages: deep paths, windows of many pages."""
        STATS.record_rule("hybrid.long_seq")
        p = self.page_size
        pages = [page_pattern((salt + i * (i % 3)) % NUM_PATTERNS, p) for i in range(max(1, tokens // p))]
        return tuple(build_sequence(p, [], [], base) + [token for page in pages for token in page])

    # ------------------------------------------------------------ the cache half

    @precondition(lambda self: not self.foreign)
    @rule(
        target=handles,
        tokens=seqs,
        held=st.lists(st.lists(st.booleans(), min_size=1, max_size=6), min_size=1, max_size=3),
        namespace=st.sampled_from(NAMESPACE_PALETTE[:3]),
    )
    def insert_prefix(self, tokens: tuple[int, ...], held: list[list[bool]], namespace: Namespace) -> Inserted:
        STATS.record_rule("hybrid.insert_prefix")
        rows = draw_pages(self.free, self.windows, len(tokens) // self.page_size, held)
        full_short = any(None in row for row, w in zip(rows, self.windows, strict=True) if w is None)
        got = [Outcome.of(lambda: hy.insert_prefix(self.model, tokens, rows, namespace))]
        got += [Outcome.of(lambda c=c: c.insert_prefix(tokens, rows, namespace)) for c in self.caches]
        results = [replace(o, value=(o.value.unused, o.value.handle.cached_len)) if o.ok else o for o in got]
        same(self.names, f"insert_prefix of {len(tokens)} tokens (pool short: {full_short})", results)
        self.free = uncached_pages(self.model, self.num_pages)
        record_reach(self.model, len(tokens))
        if not got[0].ok:
            STATS.record_rejection(got[0].error_class)
            return multiple()
        return (namespace, tuple(outcome.value.handle for outcome in got))

    @precondition(lambda self: not self.foreign)
    @rule(tokens=seqs, kind=st.sampled_from(BAD_INSERTS), namespace=st.sampled_from(NAMESPACE_PALETTE[:3]))
    def insert_bad_pages(self, tokens: tuple[int, ...], kind: str, namespace: Namespace) -> None:
        """A bad row: every implementation raises the same error and changes nothing."""
        STATS.record_rule(f"hybrid.insert_bad_pages[{kind}]")
        rows = bad_rows(self.model, self.num_pages, len(tokens) // self.page_size, kind)
        before = snapshot(self.model)
        got = [Outcome.of(lambda: hy.insert_prefix(self.model, tokens, rows, namespace))]
        got += [Outcome.of(lambda c=c: c.insert_prefix(tokens, rows, namespace)) for c in self.caches]
        results = [replace(o, value=(o.value.unused, o.value.handle.cached_len)) if o.ok else o for o in got]
        same(self.names, f"insert_prefix with a {kind} row", results)
        if not got[0].ok:
            assert snapshot(self.model) == before, f"a rejected insert ({got[0]}) changed the cache"
            STATS.record_rejection(got[0].error_class)
        self.free = uncached_pages(self.model, self.num_pages)

    @precondition(lambda self: not self.foreign)
    @rule(target=handles, tokens=seqs, namespace=st.sampled_from(NAMESPACE_PALETTE[:3]))
    def match_prefix(self, tokens: tuple[int, ...], namespace: Namespace) -> Handles:
        STATS.record_rule("hybrid.match_prefix")
        handles = [
            hy.match_prefix(self.model, tokens, namespace),
            *(c.match_prefix(tokens, namespace) for c in self.caches),
        ]
        pages = [
            hy.get_matched_pages(self.model, handles[0]),
            *(c.get_matched_pages(h) for c, h in zip(self.caches, handles[1:], strict=True)),
        ]
        same(
            self.names,
            f"match_prefix of {len(tokens)} tokens",
            [(h.cached_len, m) for h, m in zip(handles, pages, strict=True)],
        )
        record_reach(self.model, len(tokens))
        return (namespace, tuple(handles))

    @precondition(lambda self: not self.foreign)
    @rule(handle=handles, unlock=st.booleans())
    def lock_or_unlock(self, handle: Handles, unlock: bool) -> None:
        operation = "unlock" if unlock else "lock"
        STATS.record_rule(f"hybrid.{operation}")
        _, per_impl = handle
        got = [Outcome.of(lambda: getattr(hy, operation)(self.model, per_impl[0]))]
        got += [
            Outcome.of(lambda c=c, h=h: getattr(c, operation)(h))
            for c, h in zip(self.caches, per_impl[1:], strict=True)
        ]
        same(self.names, f"{operation} of a handle of cached_len {per_impl[0].cached_len}", got)

    @precondition(lambda self: not self.foreign)
    @rule(group=st.integers(0, 2), share=st.integers(0, 8), bad=st.sampled_from([None] * 5 + [-1, 3, True]))
    def evict(self, group: int, share: int, bad: Any) -> None:
        """Evict a share of one group's evictable pages; or, with ``bad``, a bad group or size (rejected alike)."""
        STATS.record_rule("hybrid.evict" if bad is None else "hybrid.evict_bad")
        group %= len(self.windows)
        evictable = hy.size_info(self.model, group).evictable_size
        # share 0: one token, so one page, where the order among pages of one stamp decides
        size: Any = min(1, evictable) if share == 0 else evictable * share // 8
        if bad is not None:
            group, size = (bad, size) if share % 2 else (group, [-1, 1 << 40, 1.0][share % 3])
        before = snapshot(self.model)
        got = [Outcome.of(lambda: hy.evict(self.model, group, size))]
        got += [Outcome.of(lambda c=c: c.evict(group, size)) for c in self.caches]
        same(self.names, f"evict({group!r}, {size!r})", got)
        if bad is not None:
            assert not got[0].ok and snapshot(self.model) == before, f"evict({group!r}, {size!r}) was accepted"
            STATS.record_rejection(got[0].error_class)
        else:
            STATS.record_reach(largest_evict_pages=-(-size // self.page_size))
            STATS.evicted_pages += -(-size // self.page_size)
        self.free = uncached_pages(self.model, self.num_pages)

    @precondition(lambda self: not self.foreign and self.model.clock % 8 == 7)
    @rule()
    def reset(self) -> None:
        """Empty every group (refused while a lock is outstanding); now and then, else it undoes every state."""
        STATS.record_rule("hybrid.reset")
        got = [Outcome.of(lambda: hy.reset(self.model))]
        got += [Outcome.of(lambda c=c: c.reset()) for c in self.caches]
        same(self.names, "reset", got)
        self.free = uncached_pages(self.model, self.num_pages)

    @invariant()
    def caches_agree(self) -> None:
        """Every tree's abstract state is the spec's state; every tree passes its own integrity check."""
        caches_agree(self.model, self.names, self.caches)

    # ------------------------------------------------------------ the manager half

    @rule(tokens=seqs, extra=st.lists(st.integers(0, 3), max_size=3), namespace=st.sampled_from(NAMESPACE_PALETTE[:2]))
    def new_request(self, tokens: tuple[int, ...], extra: list[int], namespace: Namespace) -> None:
        """A request matches its prompt and locks the match."""
        STATS.record_rule("hybrid.match_req")
        prompt = [*tokens, *extra]
        if not prompt or not self.managers:
            return
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        self.submit(uid, prompt, namespace)

    @rule(kind=st.sampled_from([kind.value for kind in Kind]), pick=st.integers(0, 63), pages=st.integers(1, 4))
    def workload_request(self, kind: str, pick: int, pages: int) -> None:
        """A request shaped as production traffic (fuzz/workloads.py): a long prefix shared with earlier ones."""
        STATS.record_rule(f"hybrid.workload[{kind}]")
        if not self.managers:
            return
        prompt = self.workload.prompt(Kind(kind), pick, pages)
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        self.submit(uid, list(prompt), NAMESPACE_PALETTE[1] if kind == Kind.TENANTS else None, workload=True)
        if uid in self.reqs:
            STATS.rules[f"hybrid.workload[{kind}] tokens"] += len(prompt)
            STATS.rules[f"hybrid.workload[{kind}] tokens hit"] += self.reqs[uid][0].cached_len

    def submit(self, uid: int, prompt: list[int], namespace: Namespace, workload: bool = False) -> None:
        """Request ``uid`` matched and locked on every manager, or admitted by none (nothing changed)."""
        reqs = [HybridReq(uid, list(prompt), namespace) for _ in self.managers]
        got = [
            manager_outcome(functools.partial(manager.match_req, req), self.foreign, manager)
            for manager, req in zip(self.managers, reqs, strict=True)
        ]
        self.copied()
        if not same(self.names, f"match_req of request {uid}", got).ok:
            # not admitted (an engine's scheduler waits for a free row or state slot): nothing changed
            STATS.record_rule("hybrid.match_req[not admitted]")
            return
        same_requests(self.names, "match_req", reqs)
        self.reqs[uid] = reqs
        if reqs[0].cached_len:
            STATS.record_rule("hybrid.match_req[hit]")
        STATS.record_prompt(len(prompt), reqs[0].cached_len, workload)
        STATS.record_reach(longest_key_tokens=len(prompt), most_running_requests=len(self.reqs))
        # a foreign manager's reach where it can tell (cached_page_count() is optional: a user's may not have it)
        if self.page_counter is not None:
            STATS.record_reach(largest_tree_pages=self.page_counter.cached_page_count())

    def manager_call(self, what: str, uid: int, call: Callable[[LifecycleTarget, HybridReq], object]) -> list[Outcome]:
        """``call(manager, req)`` on every manager; the outcomes must agree, and so must the requests after."""
        got = [
            manager_outcome(functools.partial(call, m, r), self.foreign, m)
            for m, r in zip(self.managers, self.reqs[uid], strict=True)
        ]
        self.copied()
        same(self.names, f"{what} of request {uid}", got)
        same_requests(self.names, what, self.reqs[uid])
        return got

    def copied(self) -> None:
        for laws in self.laws:
            laws.copied()

    @precondition(lambda self: self.reqs)
    # chunks of a few tokens (decode steps, small chunks), or of a chunked prefill's budget: long prompts finish
    @rule(which=st.integers(0, 63), tokens=st.one_of(st.integers(1, 40), st.sampled_from([256, 2048])))
    def allocate_and_store(self, which: int, tokens: int) -> None:
        """A prefill chunk or a decode step: pages for ``tokens`` more tokens, then their KV stored."""
        STATS.record_rule("hybrid.allocate_and_store")
        uid = sorted(self.reqs)[which % len(self.reqs)]
        req = self.reqs[uid][0]
        length = min(len(req.input_ids), req.computed + tokens)
        got = self.manager_call("allocate_paged", uid, lambda m, r: m.allocate_paged(r, length))
        if got[0].ok:
            # the slots the KV goes to, read before the call (a store may free window slots it passed)
            req, begin = self.reqs[uid][0], self.reqs[uid][0].computed
            slots = [laws.slots(req) for laws in self.laws]
            self.manager_call("store", uid, lambda m, r: m.store(r, length - r.computed))
            for laws, written in zip(self.laws, slots, strict=True):
                laws.stored(req, begin, written)

    @precondition(lambda self: self.reqs)
    @rule(which=st.integers(0, 63), token=st.integers(0, 3))
    def decode(self, which: int, token: int) -> None:
        """A request that stored all its KV produces one more token."""
        STATS.record_rule("hybrid.decode")
        uid = sorted(self.reqs)[which % len(self.reqs)]
        if self.reqs[uid][0].computed == len(self.reqs[uid][0].input_ids):
            for req in self.reqs[uid]:
                req.input_ids.append(token)

    @precondition(lambda self: self.reqs)
    @rule(which=st.integers(0, 63), answer=st.integers(0, 3))
    def serve_running(self, which: int, answer: int) -> None:
        """A running request served to its end, as an engine serves it, in one step: prefill in chunks of the budget
        (up to one the pool has no room for), a decode step, then cached as finished (what its next turn hits)."""
        steps = STATS.steps
        STATS.record_rule("hybrid.serve_running")
        uid = sorted(self.reqs)[which % len(self.reqs)]
        while (done := self.reqs[uid][0].computed) < len(self.reqs[uid][0].input_ids):
            self.allocate_and_store(sorted(self.reqs).index(uid), 2048)
            if self.reqs[uid][0].computed == done:
                break  # no room: it waits, running
        else:
            self.decode(sorted(self.reqs).index(uid), answer)
            self.allocate_and_store(sorted(self.reqs).index(uid), 1)
            self.cache_req(sorted(self.reqs).index(uid), finished=True)
        STATS.steps = steps + 1

    @BURST_RULE
    def serve_burst(self, kind: str, pick: int, count: int, pages: int) -> None:
        """A burst, in bulk: ``count`` requests of ``kind`` (turns of about ``pages`` pages; below production pools
        4 of 4 pages; prompts of ``BURST_TOKENS`` in all) arrive, the first served alone, then the rest, admitted
        together, each to its end; those the pool had no room for are aborted. A warm cache and a big tree in one
        step (its checks run after it)."""
        steps = STATS.steps
        STATS.record_rule(f"hybrid.serve_burst[{kind}]")
        first, began, production = self.next_uid, STATS.prompt_tokens, self.num_pages >= PRODUCTION_POOL
        for i in range(count if production else min(count, 4)):
            if STATS.prompt_tokens - began >= BURST_TOKENS:
                break
            self.workload_request(kind, pick + i, pages if production else min(pages, 4))
            if i == 0 and first in self.reqs:
                self.serve_running(sorted(self.reqs).index(first), 0)
        for uid in range(first + 1, self.next_uid):
            if uid in self.reqs:
                self.serve_running(sorted(self.reqs).index(uid), uid % 4)
        for uid in [uid for uid in range(first, self.next_uid) if uid in self.reqs]:
            self.cache_req(sorted(self.reqs).index(uid), finished=True)
        STATS.steps = steps + 1

    @precondition(lambda self: self.reqs)
    @rule(which=st.integers(0, 63), finished=st.booleans())
    def cache_req(self, which: int, finished: bool) -> None:
        STATS.record_rule(f"hybrid.cache_req[{'finished' if finished else 'running'}]")
        uid = sorted(self.reqs)[which % len(self.reqs)]
        self.manager_call("cache_req", uid, lambda m, r: m.cache_req(r, finished))
        for laws in self.laws:
            laws.finished(uid, finished)
        if finished:
            self.workload.answered(tuple(self.reqs[uid][0].input_ids))
            del self.reqs[uid]

    @precondition(
        lambda self: (
            not self.foreign and any(self.ours[0].cache.size_info(g).evictable_size for g in range(len(self.windows)))
        )
    )
    @rule(group=st.integers(0, 2))
    def manager_evict_all(self, group: int) -> None:
        """Churn: evict everything evictable of one group into its free list."""
        STATS.record_rule("hybrid.manager_evict")
        group %= len(self.windows)
        got = []
        for manager in self.ours:
            size = manager.cache.size_info(group).evictable_size
            evicted = manager.cache.evict(group, size)
            manager.free_slots[group].extend(evicted[:: self.page_size])
            got.append(evicted)
        same(self.names, f"evicting group {group} of the managers' caches", got)

    @invariant()
    def managers_keep_the_laws(self) -> None:
        """Every manager's own checks; the lifecycle laws (fuzz/lifecycle.py); our managers agree."""
        if not self.managers:
            return
        live = [[reqs[i] for reqs in self.reqs.values()] for i in range(len(self.managers))]
        for manager, reqs in zip(self.managers, live, strict=True):
            manager.check_integrity(reqs)
        for laws in self.laws:
            laws.check(live[0])
        for name, manager in zip(self.names, self.ours[1:], strict=True):
            free = [list(q) for q in self.ours[0].free_slots]
            assert [list(q) for q in manager.free_slots] == free, f"{name}'s manager free lists differ from the spec's"

    def teardown(self) -> None:
        """Every request finishes; then every page of every group is free or cached, and no lock is left."""
        for uid in sorted(self.reqs):
            self.manager_call("cache_req", uid, lambda m, r: m.cache_req(r, True))
        self.reqs.clear()
        for manager in self.managers:
            manager.check_integrity([])
        # the lifecycle laws with no live request: each pool's pages free or cached (a slot lost on release shows)
        for laws in self.laws:
            laws.check([])
        for manager in self.ours:
            assert not manager.cache.abstract_state().locks, "locks left after every request finished"
