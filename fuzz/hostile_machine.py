"""The hostile-input machine: what a buggy caller passes, against the spec, the reference and the optimized cache.

Every call either does what the spec says or raises a named error of ``spec/errors.py`` with nothing changed;
the process stays alive. The machine draws valid operations (so that the trees grow, split, lock and evict) and,
between them, hostile ones:

* ``evict(out=)`` with a buffer changed after its first use (restrided, resized, dtype-swapped, made 2-D);
* handles of another cache, of a reset cache, or stale ones;
* int subclasses with lying dunders (``__index__``, ``__eq__``, ``__hash__``) as sizes, tokens and slots;
* a list that changes while the cache reads it;
* namespaces one tuple too deep, or very wide;
* sizes, tokens and slots at and past every edge of their domains;
* copies of a cache; two threads on one cache;
* on the hybrid caches: groups outside the cache, handles of another cache, namespaces too deep;
* on the cache managers: requests of another manager, released ones, malformed ones (no prompt, a float
  length, a bool or lying row, a batch that is no list), a lazy free region opened twice;
* on the KV pool: K/V and slot tensors of every wrong dtype, shape, stride, device and range, lying layers;
* ``kv_events.decode`` of random bytes (``EventStreamError``), trace lines of any shape (a request, or a
  ValueError naming the line).

The laws, checked on every call (``attempt``): the outcome is a value or a ``CacheError`` (any other exception
is a failure: a foreign error, a crash the process survived); every implementation agrees with the spec on
which; a refused call leaves every abstract state as it was; after every step each cache passes its own
integrity check and equals the spec state, each manager passes its own (with its live requests) and both
managers hold the same state, and the KV pool holds exactly what the accepted stores wrote.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import NAMESPACE_DEPTH_LIMIT, SLOT_LIMIT, TOKEN_LIMIT
from radixspec.spec.errors import CacheError

from .sequences import nested
from .stats import STATS

Outcome = tuple[str, Any]
# the managers' sizes: rows of the page table, positions of a row, pages of the pool
MANAGER_ROWS, MANAGER_ROW_LEN, MANAGER_PAGES = 3, 16, 6
# the KV pool's sizes (pages of the page size drawn)
POOL_HEADS, POOL_LAYERS, POOL_HEAD_DIM, POOL_PAGES = 2, 2, 2, 4
# values outside the domains, typed as the spec's functions take them (they must refuse them)
FLOAT_ONE: Any = 1.0
LIST_NAMESPACE: Any = ["lora", 1]


class LyingInt(int):
    """An int subclass whose dunders lie: it says it is another number, equals everything, hashes to 0."""

    def __index__(self) -> int:
        return int(self) + 1

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


class ShiftingList(list[int]):
    """A list that changes while it is read: every read of its length appends a value."""

    def __len__(self) -> int:
        n = super().__len__()
        if n < 64:
            self.append(0)
        return n


class Implementation:
    """One cache under hostile calls: how to make it, call it, and read its state as lists."""

    def __init__(self, name: str, page_size: int) -> None:
        self.name = name
        if name == "optimized":
            import torch

            from radixspec import optimized

            self.torch: Any = torch
            self.cache: Any = optimized.RadixPrefixCache(page_size, device="cpu")
        else:
            from radixspec import reference

            self.torch = None
            self.cache = reference.RadixPrefixCache(page_size)

    def as_list(self, values: Any) -> list[int]:
        return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


class HostileMachine(RuleBasedStateMachine):
    """The spec beside our caches, under valid and hostile calls alike."""

    # our implementations driven beside the spec (radixspec.fuzz.machines.machine_for sets them from --impl)
    IMPLS: ClassVar[tuple[str, ...]] = ("reference", "optimized")
    SHALLOW: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        STATS.examples += 1
        self.page_size = 1
        self.model = pc.new_state(1)
        self.impls: list[Implementation] = []
        self.next_slot = 0
        self.handles: list[list[Any]] = []
        # the hybrid caches (one full-attention group, one window of 2 pages) beside the spec's hybrid state
        self.hybrid_model: Any = None
        self.hybrids: list[tuple[str, Any]] = []
        self.hybrid_next = 0
        # the cache managers (one per implementation) and their live requests (one Req per manager each), and
        # requests cache_req released
        self.managers: list[tuple[str, Any]] = []
        self.live: list[list[Any]] = []
        self.released: list[list[Any]] = []
        self.next_uid = 0
        # the KV pool (optimized only) and what its K and V caches must hold: [layer] -> [num_slots, width]
        self.pool: Any = None
        self.pool_shadow: list[list[Any]] = []

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.page_size = page_size
        self.model = pc.new_state(page_size)
        self.impls = [Implementation(name, page_size) for name in ("reference", "optimized") if name in self.IMPLS]
        from radixspec.spec import hybrid as hy

        windows = (None, 2 * page_size)
        self.hybrid_model = hy.new_state(page_size, windows)
        self.hybrids = []
        for name in ("reference", "optimized"):
            if name in self.IMPLS:
                module = (
                    "radixspec.optimized.hybrid_cache" if name == "optimized" else "radixspec.reference.hybrid_cache"
                )
                self.hybrids.append((name, importlib.import_module(module).HybridRadixCache(page_size, windows)))
        self.managers = []
        for impl in self.impls:
            family: Any = importlib.import_module(f"radixspec.{impl.name}.cache_manager")
            table = family.make_page_table(MANAGER_ROWS, MANAGER_ROW_LEN)
            self.managers.append((impl.name, family.CacheManager(MANAGER_PAGES, page_size, table)))
        if "optimized" in self.IMPLS:
            self.setup_pool(page_size)

    # ------------------------------------------------------------ the law

    def outcome(self, call: Callable[[], Any], normalize: Callable[[Any], Any]) -> Outcome:
        """("ok", normalized value) or ("error", class name); any exception not of spec/errors.py fails."""
        try:
            return ("ok", normalize(call()))
        except CacheError as error:
            return ("error", type(error).__name__)
        except Exception as error:
            raise AssertionError(f"raised {type(error).__module__}.{type(error).__name__}: {error}") from error

    def attempt(
        self,
        label: str,
        spec: Callable[[pc.PrefixCacheState], Any] | None,
        call: Callable[[Implementation], Any],
        normalize: Callable[[Any], Any] = lambda value: None,
    ) -> list[Outcome]:
        """Apply one call to the spec (when it has a twin of it) and every implementation; check the law."""
        STATS.record_rule(f"hostile.{label}")
        before = [impl.cache.abstract_state() for impl in self.impls]
        model_before = pc.PrefixCacheState(self.model.page_size, dict(self.model.entries), self.model.clock)
        outcomes = []
        for impl, state in zip(self.impls, before, strict=True):
            result = self.outcome(functools.partial(call, impl), normalize)
            if result[0] == "error":
                assert impl.cache.abstract_state() == state, f"{label}: {impl.name} refused ({result[1]}) and changed"
            outcomes.append(result)
        if spec is not None:
            expected = self.outcome(lambda: spec(self.model), normalize)
            if expected[0] == "error":
                assert self.model.entries == model_before.entries, f"{label}: the spec refused and changed"
            for impl, result in zip(self.impls, outcomes, strict=True):
                assert result == expected, f"{label}: {impl.name} gave {result}, the spec {expected}"
        else:
            assert len({str(o) for o in outcomes}) <= 1, f"{label}: the implementations disagree: {outcomes}"
        return outcomes

    # ------------------------------------------------------------ valid calls (they grow the trees)

    def fresh_slots(self, n: int) -> list[int]:
        start = self.next_slot
        self.next_slot += -(-n // self.page_size) * self.page_size + self.page_size
        return list(range(start, start + n))

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=24))
    def insert(self, tokens: list[int]) -> None:
        slots = self.fresh_slots(len(tokens))
        self.attempt(
            "insert_prefix",
            lambda m: pc.insert_prefix(m, tokens, slots, None),
            lambda impl: impl.cache.insert_prefix(tokens, slots),
            lambda r: int(r[0]),
        )
        self.handles.append([impl.cache.match_prefix(tokens) for impl in self.impls])
        pc.match_prefix(self.model, tokens, None)

    @rule(size=st.integers(0, 8))
    def evict(self, size: int) -> None:
        self.attempt(
            "evict",
            lambda m: pc.evict(m, size),
            lambda impl: impl.cache.evict(size),
            lambda slots: sorted(int(s) for s in (slots.tolist() if hasattr(slots, "tolist") else slots)),
        )

    # ------------------------------------------------------------ hostile calls

    @precondition(lambda self: "optimized" in self.IMPLS)
    @rule(
        mutation=st.sampled_from(["zero stride", "every other", "int8 underneath", "resized to 1", "2-D", "int64"]),
        size=st.integers(0, 6),
    )
    def evict_into_a_changed_buffer(self, mutation: str, size: int) -> None:
        impl = next(i for i in self.impls if i.name == "optimized")
        torch = impl.torch
        out = torch.empty(64, dtype=torch.int32)
        self.outcome(lambda: impl.cache.evict(0, out=out), lambda v: None)  # the buffer, kept by the cache
        changes: dict[str, Callable[[], Any]] = {
            "zero stride": lambda: out.as_strided_((10**6,), (0,)),
            "every other": lambda: out.as_strided_((16,), (2,)),
            "int8 underneath": lambda: setattr(out, "data", out.view(torch.int8)),
            "resized to 1": lambda: out.resize_(1),
            "2-D": lambda: out.resize_(8, 8),
            "int64": lambda: setattr(out, "data", torch.empty(64, dtype=torch.int64)),
        }
        changes[mutation]()
        before = impl.cache.abstract_state()
        result = self.outcome(lambda: impl.cache.evict(size, out=out), lambda v: None)
        STATS.record_rule(f"hostile.evict_into_a_changed_buffer[{mutation}]")
        # only a buffer resized to 1 slot may still take the eviction (of at most one slot): then the call is an
        # evict like any other, and the spec says what it gives
        pages = -(-size // self.page_size)
        if mutation == "resized to 1" and pages * self.page_size <= 1:
            plan = pc.PrefixCacheState(self.model.page_size, dict(self.model.entries), self.model.clock)
            expected = self.outcome(lambda: pc.evict(plan, size), lambda v: None)
            assert result == expected, f"evict(out= {mutation}): {result}, the spec {expected}"
            if result[0] == "ok":
                self.model_evicted(size, impl)
            else:
                assert impl.cache.abstract_state() == before
            return
        assert result == ("error", "InvalidTypeError"), f"evict(out= {mutation}): {result}"
        assert impl.cache.abstract_state() == before

    def model_evicted(self, size: int, done: Implementation) -> None:
        """The optimized cache evicted ``size`` through a buffer: the spec and the other caches do too."""
        pc.evict(self.model, size)
        for impl in self.impls:
            if impl is not done:
                impl.cache.evict(size)

    @precondition(lambda self: bool(self.handles))
    @rule(which=st.integers(0, 1 << 16), how=st.sampled_from(["another cache", "lock", "unlock", "stale indices"]))
    def use_a_handle_badly(self, which: int, how: str) -> None:
        handles = self.handles[which % len(self.handles)]
        if how == "another cache":
            # each implementation gets a handle of a cache of the same family that is not it
            strangers = [Implementation(impl.name, self.page_size) for impl in self.impls]
            foreign = [s.cache.match_prefix([0]) for s in strangers]
            self.attempt(
                "lock[a handle of another cache]", None, lambda impl: impl.cache.lock(foreign[self.impls.index(impl)])
            )
            return
        # a handle of this cache that may be stale: lock, unlock without a lock, read its slots
        ops: dict[str, Callable[[Implementation], Any]] = {
            "lock": lambda impl: impl.cache.lock(handles[self.impls.index(impl)]),
            "unlock": lambda impl: impl.cache.unlock(handles[self.impls.index(impl)]),
            "stale indices": lambda impl: handles[self.impls.index(impl)].get_matched_indices(),
        }
        outcomes = self.attempt(f"{how}[a handle of this cache]", None, ops[how], lambda v: None)
        if how == "lock" and outcomes and outcomes[0][0] == "ok":
            # undo it, so that the trees stay evictable (and mirror it in the spec through a fresh match)
            for impl in self.impls:
                impl.cache.unlock(handles[self.impls.index(impl)])

    @rule(
        what=st.sampled_from(
            [
                "size -1",
                "size 2**63",
                "size a lying int",
                "size a float",
                "size a bool",
                "token 2**63",
                "token -1",
                "token a lying int",
                "slot 2**31",
                "slot a lying int",
                "a list that grows while read",
                "namespace too deep",
                "namespace wide",
                "namespace a list",
            ]
        )
    )
    def call_at_a_domain_edge(self, what: str) -> None:
        p = self.page_size
        slots = self.fresh_slots(p)
        tokens = [7] * p
        calls: dict[str, tuple[Callable[[pc.PrefixCacheState], Any], Callable[[Implementation], Any]]] = {
            "size -1": (lambda m: pc.evict(m, -1), lambda i: i.cache.evict(-1)),
            "size 2**63": (lambda m: pc.evict(m, 2**63), lambda i: i.cache.evict(2**63)),
            "size a lying int": (lambda m: pc.evict(m, LyingInt(0)), lambda i: i.cache.evict(LyingInt(0))),
            "size a float": (lambda m: pc.evict(m, FLOAT_ONE), lambda i: i.cache.evict(1.0)),
            "size a bool": (lambda m: pc.evict(m, True), lambda i: i.cache.evict(True)),
            "token 2**63": (
                lambda m: pc.insert_prefix(m, [TOKEN_LIMIT] * p, slots, None),
                lambda i: i.cache.insert_prefix([TOKEN_LIMIT] * p, slots),
            ),
            "token -1": (
                lambda m: pc.insert_prefix(m, [-1] * p, slots, None),
                lambda i: i.cache.insert_prefix([-1] * p, slots),
            ),
            "token a lying int": (
                lambda m: pc.match_prefix(m, [LyingInt(7)] * p, None),
                lambda i: i.cache.match_prefix([LyingInt(7)] * p),
            ),
            "slot 2**31": (
                lambda m: pc.insert_prefix(m, tokens, [SLOT_LIMIT + k for k in range(p)], None),
                lambda i: i.cache.insert_prefix(tokens, [SLOT_LIMIT + k for k in range(p)]),
            ),
            "slot a lying int": (
                lambda m: pc.insert_prefix(m, tokens, [LyingInt(s) for s in slots], None),
                lambda i: i.cache.insert_prefix(tokens, [LyingInt(s) for s in slots]),
            ),
            "a list that grows while read": (
                lambda m: pc.match_prefix(m, ShiftingList(tokens), None),
                lambda i: i.cache.match_prefix(ShiftingList(tokens)),
            ),
            "namespace too deep": (
                lambda m: pc.match_prefix(m, tokens, nested(NAMESPACE_DEPTH_LIMIT + 1)),
                lambda i: i.cache.match_prefix(tokens, nested(NAMESPACE_DEPTH_LIMIT + 1)),
            ),
            "namespace wide": (
                lambda m: pc.match_prefix(m, tokens, tuple(range(10_000))),
                lambda i: i.cache.match_prefix(tokens, tuple(range(10_000))),
            ),
            "namespace a list": (
                lambda m: pc.match_prefix(m, tokens, LIST_NAMESPACE),
                lambda i: i.cache.match_prefix(tokens, ["lora", 1]),
            ),
        }
        spec, call = calls[what]
        # the spec stamps on a match: only the outcome is compared (the stamps follow in compare_states)
        self.attempt(f"call_at_a_domain_edge[{what}]", spec, call, lambda value: None)

    @rule()
    def copy_a_cache(self) -> None:
        self.attempt("copy", None, lambda impl: copy.copy(impl.cache))
        self.attempt("deepcopy", None, lambda impl: copy.deepcopy(impl.cache))

    @rule(rounds=st.integers(1, 40))
    def two_threads(self, rounds: int) -> None:
        """Two threads match and lock / unlock on every cache at once; nothing they do changes the pages (their
        tokens are never cached: a match stamps no page, so the spec's LRU order still holds)."""
        STATS.record_rule("hostile.two_threads")
        failures: list[str] = []
        tokens = [[9] * self.page_size, [9, 8] * self.page_size]

        def hammer(impl: Implementation, which: int) -> None:
            try:
                for _ in range(rounds):
                    handle = impl.cache.match_prefix(tokens[which])
                    impl.cache.lock(handle)
                    impl.cache.unlock(handle)
                    impl.cache.size_info  # noqa: B018  (a read between the other thread's calls)
            except CacheError as error:
                failures.append(f"{impl.name}: {error!r}")
            except Exception as error:  # not a named error: the law is broken
                failures.append(f"{impl.name}: not a named error: {error!r}")

        for impl in self.impls:
            threads = [threading.Thread(target=hammer, args=(impl, which)) for which in (0, 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert not failures, failures

    # ------------------------------------------------------------ the hybrid caches

    def hybrid_attempt(self, label: str, spec: Callable[[Any], Any], call: Callable[[Any], Any]) -> None:
        """One call on the spec's hybrid state and each hybrid cache: the same outcome class, nothing changed by
        a refusal (values are compared by the hybrid machine; here, what a hostile call does)."""
        STATS.record_rule(f"hostile.hybrid.{label}")
        expected = self.outcome(lambda: spec(self.hybrid_model), lambda value: None)
        for name, cache in self.hybrids:
            before = cache.abstract_state()
            result = self.outcome(functools.partial(call, cache), lambda value: None)
            assert result == expected, f"hybrid {label}: {name} gave {result}, the spec {expected}"
            if result[0] == "error":
                assert cache.abstract_state() == before, f"hybrid {label}: {name} refused and changed"

    @rule(pages=st.integers(1, 4))
    def hybrid_insert(self, pages: int) -> None:
        from radixspec.spec import hybrid as hy

        p = self.page_size
        tokens = [self.hybrid_next % 3] * (pages * p)
        starts = [self.hybrid_next * p + k * p for k in range(pages)]
        self.hybrid_next += pages
        rows = [list(starts), list(starts)]
        self.hybrid_attempt(
            "insert_prefix", lambda m: hy.insert_prefix(m, tokens, rows, None), lambda c: c.insert_prefix(tokens, rows)
        )

    @rule(
        what=st.sampled_from(
            ["group -1", "group past the last", "group a bool", "a handle of another cache", "namespace too deep"]
        )
    )
    def hybrid_call_at_an_edge(self, what: str) -> None:
        from radixspec.spec import hybrid as hy

        tokens = [0] * self.page_size
        if what == "a handle of another cache":
            # each cache gets a handle of another cache of its family: refused, nothing changed in either
            for name, cache in self.hybrids:
                stranger = type(cache)(self.page_size, self.hybrid_model.windows)
                handle = stranger.match_prefix(tokens)
                before = cache.abstract_state()
                result = self.outcome(functools.partial(cache.lock, handle), lambda value: None)
                STATS.record_rule("hostile.hybrid.lock[a handle of another cache]")
                assert result == ("error", "InvalidTypeError"), f"hybrid lock of a foreign handle: {name}: {result}"
                assert cache.abstract_state() == before
            return
        calls: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
            "group -1": (lambda m: hy.size_info(m, -1), lambda c: c.size_info(-1)),
            "group past the last": (lambda m: hy.size_info(m, 2), lambda c: c.size_info(2)),
            "group a bool": (lambda m: hy.evict(m, True, 0), lambda c: c.evict(True, 0)),
            "namespace too deep": (
                lambda m: hy.match_prefix(m, tokens, nested(NAMESPACE_DEPTH_LIMIT + 1)),
                lambda c: c.match_prefix(tokens, nested(NAMESPACE_DEPTH_LIMIT + 1)),
            ),
        }
        spec, call = calls[what]
        self.hybrid_attempt(f"call_at_an_edge[{what}]", spec, call)

    # ------------------------------------------------------------ the cache managers

    def manager_attempt(self, label: str, call: Callable[[int], Any]) -> list[Outcome]:
        """``call(k)`` on the k-th manager: the outcome of each a value or a named error, the same for both, and a
        refusal changes nothing."""
        STATS.record_rule(f"hostile.manager.{label}")
        outcomes = []
        for k, (name, manager) in enumerate(self.managers):
            before = manager.abstract_state()
            result = self.outcome(functools.partial(call, k), lambda value: None)
            if result[0] == "error":
                assert manager.abstract_state() == before, f"manager {label}: {name} refused ({result[1]}) and changed"
            outcomes.append(result)
        assert len(set(outcomes)) <= 1, f"manager {label}: the managers disagree: {outcomes}"
        return outcomes

    @precondition(lambda self: bool(self.managers))
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def manager_admit(self, tokens: list[int]) -> None:
        """A request as a scheduler admits one: match, lock, allocate its pages (unlocked again when short)."""
        from radixspec.spec.requests import Req

        rows = sorted(set(range(MANAGER_ROWS)) - {reqs[0].table_idx for reqs in self.live})
        if not rows:
            return
        reqs = [Req(list(tokens), rows[0], None, uid=self.next_uid) for _ in self.managers]
        self.next_uid += 1
        for (_, manager), req in zip(self.managers, reqs, strict=True):
            req.cache_handle = manager.match_req(req)
            manager.lock(req.cache_handle)
            # the scheduler writes the cached prefix's slots into the row (the seed's table manager)
            matched = req.cache_handle.get_matched_indices()
            manager.page_table[req.table_idx][: len(matched)] = matched
            req.cached_len = req.alloc_len = req.cache_handle.cached_len
            req.device_len = len(tokens)
        outcomes = self.manager_attempt("allocate_paged", lambda k: self.managers[k][1].allocate_paged([reqs[k]]))
        for (_, manager), req in zip(self.managers, reqs, strict=True):
            if outcomes[0][0] == "ok":
                req.cached_len = req.device_len
            else:
                manager.unlock(req.cache_handle)
        if outcomes[0][0] == "ok":
            self.live.append(reqs)

    @precondition(lambda self: bool(self.live))
    @rule(which=st.integers(0, 1 << 16), finished=st.booleans())
    def manager_cache_req(self, which: int, finished: bool) -> None:
        reqs = self.live[which % len(self.live)]
        outcomes = self.manager_attempt(
            "cache_req", lambda k: self.managers[k][1].cache_req(reqs[k], finished=finished)
        )
        if finished and outcomes[0][0] == "ok":
            self.live.remove(reqs)
            self.released.append(reqs)

    @precondition(lambda self: bool(self.managers))
    @rule(
        what=st.sampled_from(
            [
                "a released request",
                "a request of the other manager",
                "a batch that is a request",
                "a batch of None",
                "a batch sharing a row",
                "no prompt",
                "an empty prompt",
                "a namespace too deep",
                "a float length",
                "a bool row",
                "a row past the table",
                "a lying row",
                "a lazy region opened twice",
            ]
        ),
        which=st.integers(0, 1 << 16),
    )
    def manager_call_at_an_edge(self, what: str, which: int) -> None:
        import dataclasses

        from radixspec.spec.requests import Req

        managers = [manager for _, manager in self.managers]
        reqs = self.live[which % len(self.live)] if self.live else None
        if what == "a lazy region opened twice":

            def twice(k: int) -> None:
                with managers[k].lazy_free_region(), managers[k].lazy_free_region():
                    pass

            self.manager_attempt(what, twice)
            return
        prompts: dict[str, Any] = {"no prompt": None, "an empty prompt": [], "a namespace too deep": [1, 2]}
        if what in prompts:
            namespace = nested(NAMESPACE_DEPTH_LIMIT + 1) if what == "a namespace too deep" else None
            self.manager_attempt(what, lambda k: managers[k].match_req(Req(prompts[what], 0, None, namespace)))
            return
        if what == "a batch of None":
            self.manager_attempt(what, lambda k: managers[k].allocate_paged([None]))
            return
        if what == "a released request":
            if self.released:
                gone = self.released[which % len(self.released)]
                self.manager_attempt(what, lambda k: managers[k].cache_req(gone[k], finished=True))
            return
        if reqs is None:
            return
        if what == "a request of the other manager":
            if len(managers) > 1:
                self.manager_attempt(what, lambda k: managers[k].cache_req(reqs[1 - k], finished=False))
            return
        if what == "a batch that is a request":
            self.manager_attempt(what, lambda k: managers[k].allocate_paged(reqs[k]))
            return
        if what == "a batch sharing a row":
            self.manager_attempt(what, lambda k: managers[k].allocate_paged([reqs[k], dataclasses.replace(reqs[k])]))
            return
        # a copy of a live request with one field edited, cached with finished=False (the copy replaces the
        # request when a manager takes it: the cache handle moved to it)
        row = reqs[0].table_idx
        edits: dict[str, dict[str, Any]] = {
            "a float length": {"cached_len": float(reqs[0].cached_len)},
            "a bool row": {"table_idx": bool(row)},
            "a row past the table": {"table_idx": MANAGER_ROWS},
            "a lying row": {"table_idx": LyingInt(row)},
        }
        copies = [dataclasses.replace(req, **edits[what]) for req in reqs]
        outcomes = self.manager_attempt(what, lambda k: managers[k].cache_req(copies[k], finished=False))
        if outcomes[0][0] == "ok":
            for copied in copies:
                copied.table_idx = row
            self.live[self.live.index(reqs)] = copies

    # ------------------------------------------------------------ the KV pool

    def setup_pool(self, page_size: int) -> None:
        import torch

        from radixspec.optimized import MHAKVCache

        self.pool = MHAKVCache(
            POOL_HEADS, POOL_LAYERS, POOL_HEAD_DIM, POOL_PAGES, page_size, torch.float32, "cpu", store_mode="checked"
        )
        width = POOL_HEADS * POOL_HEAD_DIM
        self.pool_shadow = [
            [torch.zeros(POOL_PAGES * page_size, width) for _ in range(POOL_LAYERS)] for _ in ("k", "v")
        ]

    @precondition(lambda self: self.pool is not None)
    @rule(
        what=st.sampled_from(
            [
                "valid",
                "k float64",
                "k 1-D",
                "k transposed",
                "k one row short",
                "k aliases the pool",
                "slots int16",
                "slots 2-D",
                "slots a list",
                "a slot past the pool",
                "a slot negative",
                "a slot twice",
                "slots on meta",
                "layer past the last",
                "layer a bool",
                "layer a lying int",
            ]
        ),
        slots=st.lists(st.integers(0, 63), min_size=1, max_size=4),
        layer=st.integers(0, POOL_LAYERS - 1),
        fast=st.booleans(),
    )
    def pool_store(self, what: str, slots: list[int], layer: int, fast: bool) -> None:
        """One ``store_kv`` with one argument made hostile: a named error and the pool unchanged, or exactly the
        rows asked written (in fast mode, a row whose slot lies outside the pool skipped and flagged)."""
        import torch

        pool = self.pool
        num_slots = pool.num_slots
        rows = sorted({s % num_slots for s in slots})
        n = len(rows)
        values = torch.arange(n * POOL_HEADS * POOL_HEAD_DIM, dtype=torch.float32) + 1 + 100 * self.next_uid
        self.next_uid += 1
        k = values.view(n, POOL_HEADS, POOL_HEAD_DIM)
        v = -k
        loc = torch.tensor(rows, dtype=torch.int64)
        args: list[Any] = [k, v, loc, layer]
        edits: dict[str, Callable[[], None]] = {
            "valid": lambda: None,
            "k float64": lambda: args.__setitem__(0, k.double()),
            "k 1-D": lambda: args.__setitem__(0, k.reshape(-1)),
            "k transposed": lambda: args.__setitem__(0, k.reshape(n, -1).t().contiguous().t()),
            "k one row short": lambda: args.__setitem__(0, k[:-1]),
            "k aliases the pool": lambda: args.__setitem__(0, pool.k_cache(layer)[:n]),
            "slots int16": lambda: args.__setitem__(2, loc.short()),
            "slots 2-D": lambda: args.__setitem__(2, loc.view(n, 1)),
            "slots a list": lambda: args.__setitem__(2, rows),
            "a slot past the pool": lambda: args.__setitem__(2, torch.cat([loc[:-1], torch.tensor([num_slots])])),
            "a slot negative": lambda: args.__setitem__(2, torch.cat([torch.tensor([-1]), loc[1:]])),
            "a slot twice": lambda: args.__setitem__(2, torch.cat([loc[:-1], loc[:1]])),
            "slots on meta": lambda: args.__setitem__(2, loc.to("meta")),
            "layer past the last": lambda: args.__setitem__(3, POOL_LAYERS),
            "layer a bool": lambda: args.__setitem__(3, bool(layer)),
            "layer a lying int": lambda: args.__setitem__(3, LyingInt(layer)),
        }
        edits[what]()
        if fast and what == "a slot twice":
            return  # a fast store does not detect duplicates: which row lands is the device's choice
        pool.store_mode = "fast" if fast else "checked"
        STATS.record_rule(f"hostile.pool.store_kv[{what}]")
        result = self.outcome(lambda: pool.store_kv(*args), lambda value: None)
        # a refused store writes nothing (the shadow stays): compare_pool checks it
        if result[0] == "ok":
            # what the pool must hold now: each in-range row of the given slots, with the given K/V rows
            keys = args[0].reshape(args[0].shape[0], -1) if isinstance(args[0], torch.Tensor) else None
            assert keys is not None and isinstance(args[2], torch.Tensor)
            written_layer = int.__int__(args[3])
            skipped = False
            for i, slot in enumerate(args[2].tolist()):
                if not 0 <= slot < num_slots:
                    skipped = True
                    continue
                self.pool_shadow[0][written_layer][slot] = keys[i]
                self.pool_shadow[1][written_layer][slot] = v.reshape(n, -1)[i]
            flagged = self.outcome(pool.check_store_errors, lambda value: None)
            assert flagged == (("error", "SlotOutOfRangeError") if skipped else ("ok", None)), (
                f"store_kv[{what}]: rows outside the pool skipped: {skipped}, the pool's flags: {flagged}"
            )
        self.compare_pool(what)

    def compare_pool(self, what: str) -> None:
        """The pool holds exactly what the accepted stores wrote."""
        for side, read in enumerate((self.pool.k_cache, self.pool.v_cache)):
            for layer in range(POOL_LAYERS):
                held = read(layer).reshape(self.pool.num_slots, -1)
                assert held.equal(self.pool_shadow[side][layer]), (
                    f"store_kv[{what}]: layer {layer}'s {'KV'[side]} cache holds other values than the stores wrote"
                )

    # ------------------------------------------------------------ the readers: KV event batches, trace lines

    @precondition(lambda self: importlib.util.find_spec("msgspec") is not None)
    @rule(payload=st.binary(max_size=64))
    def decode_noise(self, payload: bytes) -> None:
        """Bytes off the wire that are no event batch: EventStreamError, never msgspec's own errors."""
        from radixspec.optimized.kv_events import decode

        STATS.record_rule("hostile.kv_events.decode")
        self.outcome(lambda: decode(payload), lambda value: None)

    @rule(
        record=st.dictionaries(
            st.sampled_from(["tokens", "hash_ids", "input_length", "namespace", "timestamp"]),
            st.one_of(
                st.none(),
                st.integers(-(2**64), 2**64),
                st.floats(),
                st.text(max_size=3),
                st.lists(st.one_of(st.integers(-2, 2**63), st.text(max_size=2)), max_size=5),
            ),
        ),
        fmt=st.sampled_from(["jsonl", "mooncake"]),
    )
    def read_a_hostile_trace_line(self, record: dict[str, Any], fmt: str) -> None:
        """A trace line of any shape: a request, or a ValueError naming the line (the CLI's exit 2)."""
        from pathlib import Path

        from radixspec.fuzz.replay import parse_request

        STATS.record_rule(f"hostile.trace_line[{fmt}]")
        try:
            tokens, _ = parse_request(record, fmt, 4, 1, Path("trace.jsonl"))
        except ValueError as error:
            assert "trace.jsonl:1" in str(error), f"the error does not name the line: {error}"
            return
        assert len(tokens) <= 1 << 22

    # ------------------------------------------------------------ checks

    @invariant()
    def caches_are_intact_and_agree(self) -> None:
        for impl in self.impls:
            impl.cache.check_integrity()
        self.compare_states()
        for name, cache in self.hybrids:
            cache.check_integrity()
            assert cache.abstract_state().groups == self.hybrid_model.groups, f"hybrid {name} differs from the spec"
        states = []
        for k, (_, manager) in enumerate(self.managers):
            manager.check_integrity([reqs[k] for reqs in self.live])
            states.append(manager.abstract_state())
        assert all(state == states[0] for state in states), "the managers hold different states"

    def compare_states(self) -> None:
        """Every cache holds the spec's pages with the spec's slots and locks (the clocks differ: the threads'
        matches ticked the caches' clocks, not the spec's, and stamped no page)."""
        expected = {key: (e.slot_start, e.ref_count) for key, e in self.model.entries.items()}
        for impl in self.impls:
            state = impl.cache.abstract_state()
            actual = {key: (e.slot_start, e.ref_count) for key, e in state.entries.items()}
            assert actual == expected, f"{impl.name} holds other pages than the spec"

    def teardown(self) -> None:
        if self.impls:
            STATS.record_reach(largest_tree_pages=len(self.model.entries))
