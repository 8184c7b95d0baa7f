"""The hostile-input machine, part: hostile calls on the prefix caches and the hybrid caches, and the readers
(KV event batches, trace lines)."""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import NAMESPACE_DEPTH_LIMIT, SLOT_LIMIT, TOKEN_LIMIT
from radixspec.spec.errors import CacheError, InvalidTypeError

from ..judge import expect_same
from ..sequences import nested
from ..stats import STATS
from .base import (
    FLOAT_ONE,
    LIST_NAMESPACE,
    HostileBase,
    HybridCache,
    Implementation,
    LyingInt,
    ShiftingList,
    call_with,
)


class CacheCalls(HostileBase):
    """Hostile calls on the prefix caches (buffers, handles, domain edges, copies, two threads), the hybrid
    caches, and the readers."""

    @precondition(lambda self: "optimized" in self.IMPLS)
    @rule(
        mutation=st.sampled_from(["zero stride", "every other", "int8 underneath", "resized to 1", "2-D", "int64"]),
        size=st.integers(0, 6),
    )
    def evict_into_a_changed_buffer(self, mutation: str, size: int) -> None:
        import torch

        from radixspec import optimized

        impl = next(i for i in self.impls if i.name == "optimized")
        cache = impl.cache
        assert isinstance(cache, optimized.RadixPrefixCache), f"the optimized implementation holds {cache!r}"
        out = torch.empty(64, dtype=torch.int32)
        self.outcome(lambda: cache.evict(0, out=out), lambda v: None)  # the buffer, kept by the cache
        changes: dict[str, Callable[[], object]] = {
            "zero stride": lambda: out.as_strided_((10**6,), (0,)),
            "every other": lambda: out.as_strided_((16,), (2,)),
            "int8 underneath": lambda: setattr(out, "data", out.view(torch.int8)),
            "resized to 1": lambda: out.resize_(1),
            "2-D": lambda: out.resize_(8, 8),
            "int64": lambda: setattr(out, "data", torch.empty(64, dtype=torch.int64)),
        }
        changes[mutation]()
        before = cache.abstract_state()
        result = self.outcome(lambda: cache.evict(size, out=out), lambda v: None)
        STATS.record_rule(f"hostile.evict_into_a_changed_buffer[{mutation}]")
        # only a buffer resized to 1 slot may still take the eviction (of at most one slot): then the call is an
        # evict like any other, and the spec says what it gives
        pages = -(-size // self.page_size)
        if mutation == "resized to 1" and pages * self.page_size <= 1:
            plan = self.model.copy()
            expected = self.outcome(lambda: pc.evict(plan, size), lambda v: None)
            assert result == expected, f"evict(out= {mutation}): {result}, the spec {expected}"
            if result.ok:
                self.model_evicted(size, impl)
            else:
                assert cache.abstract_state() == before
            return
        assert result.error is InvalidTypeError, f"evict(out= {mutation}): {result}"
        assert cache.abstract_state() == before

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
                "lock[a handle of another cache]",
                None,
                lambda impl: call_with(impl.cache.lock, foreign[self.impls.index(impl)]),
            )
            return
        # a handle of this cache that may be stale: lock, unlock without a lock, read its slots
        ops: dict[str, Callable[[Implementation], object]] = {
            "lock": lambda impl: call_with(impl.cache.lock, handles[self.impls.index(impl)]),
            "unlock": lambda impl: call_with(impl.cache.unlock, handles[self.impls.index(impl)]),
            "stale indices": lambda impl: handles[self.impls.index(impl)].get_matched_indices(),
        }
        outcomes = self.attempt(f"{how}[a handle of this cache]", None, ops[how], lambda v: None)
        if how == "lock" and outcomes and outcomes[0].ok:
            # undo it, so that the trees stay evictable (and mirror it in the spec through a fresh match)
            for impl in self.impls:
                call_with(impl.cache.unlock, handles[self.impls.index(impl)])

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
        calls: dict[str, tuple[Callable[[pc.PrefixCacheState], object], Callable[[Implementation], object]]] = {
            "size -1": (lambda m: pc.evict(m, -1), lambda i: i.cache.evict(-1)),
            "size 2**63": (lambda m: pc.evict(m, 2**63), lambda i: i.cache.evict(2**63)),
            "size a lying int": (lambda m: pc.evict(m, LyingInt(0)), lambda i: i.cache.evict(LyingInt(0))),
            "size a float": (lambda m: call_with(pc.evict, m, FLOAT_ONE), lambda i: call_with(i.cache.evict, 1.0)),
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
                lambda m: call_with(pc.match_prefix, m, tokens, LIST_NAMESPACE),
                lambda i: call_with(i.cache.match_prefix, tokens, ["lora", 1]),
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
                    call_with(impl.cache.lock, handle)
                    call_with(impl.cache.unlock, handle)
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

    def hybrid_attempt(
        self, label: str, spec: Callable[[hy.HybridState], object], call: Callable[[HybridCache], object]
    ) -> None:
        """One call on the spec's hybrid state and each hybrid cache: the same outcome class, nothing changed by
        a refusal (values are compared by the hybrid machine; here, what a hostile call does)."""
        STATS.record_rule(f"hostile.hybrid.{label}")
        expected = self.outcome(lambda: spec(self.hybrid_model), lambda value: None)
        for name, cache in self.hybrids:
            before = cache.abstract_state()
            result = self.outcome(functools.partial(call, cache), lambda value: None)
            expect_same(f"hybrid {label}", expected, result, name)
            if not result.ok:
                assert cache.abstract_state() == before, f"hybrid {label}: {name} refused and changed"

    @rule(pages=st.integers(1, 4))
    def hybrid_insert(self, pages: int) -> None:
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
        tokens = [0] * self.page_size
        if what == "a handle of another cache":
            # each cache gets a handle of another cache of its family: refused, nothing changed in either
            for name, cache in self.hybrids:
                stranger = type(cache)(self.page_size, self.hybrid_model.windows)
                handle = stranger.match_prefix(tokens)
                before = cache.abstract_state()
                result = self.outcome(functools.partial(call_with, cache.lock, handle), lambda value: None)
                STATS.record_rule("hostile.hybrid.lock[a handle of another cache]")
                assert result.error is InvalidTypeError, f"hybrid lock of a foreign handle: {name}: {result}"
                assert cache.abstract_state() == before
            return
        calls: dict[str, tuple[Callable[[hy.HybridState], object], Callable[[HybridCache], object]]] = {
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
    def read_a_hostile_trace_line(self, record: dict[str, object], fmt: str) -> None:
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
