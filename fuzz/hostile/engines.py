"""The hostile-input machine, part: hostile calls on the cache managers and the KV pool."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from radixspec.spec.domains import NAMESPACE_DEPTH_LIMIT
from radixspec.spec.errors import SlotOutOfRangeError

from ..judge import Outcome, expect_same
from ..sequences import nested
from ..stats import STATS
from .base import MANAGER_ROWS, POOL_HEAD_DIM, POOL_HEADS, POOL_LAYERS, LyingInt, call_with
from .caches import CacheCalls


class EngineCalls(CacheCalls):
    """Hostile calls on the cache managers (requests of another manager, released or malformed ones) and the KV
    pool (tensors of every wrong dtype, shape, stride, device and range)."""

    def manager_attempt(self, label: str, call: Callable[[int], object], same_words: bool = True) -> list[Outcome]:
        """``call(k)`` on the k-th manager: the outcome of each a value or a named error, the same for both (the
        same words too, unless each was given something else: ``same_words``), and a refusal changes nothing."""
        STATS.record_rule(f"hostile.manager.{label}")
        outcomes = []
        for k, (name, manager) in enumerate(self.managers):
            before = manager.abstract_state()
            result = self.outcome(functools.partial(call, k), lambda value: None)
            if not result.ok:
                assert manager.abstract_state() == before, f"manager {label}: {name} refused ({result}) and changed"
            outcomes.append(result)
        first = self.managers[0][0] if self.managers else ""
        for (name, _), result in zip(self.managers[1:], outcomes[1:], strict=True):
            expect_same(f"manager {label}", outcomes[0], result, name, exact=same_words, expected_from=first)
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
            if outcomes[0].ok:
                req.cached_len = req.device_len
            else:
                manager.unlock(req.cache_handle)
        if outcomes[0].ok:
            self.live.append(reqs)

    @precondition(lambda self: bool(self.live))
    @rule(which=st.integers(0, 1 << 16), finished=st.booleans())
    def manager_cache_req(self, which: int, finished: bool) -> None:
        reqs = self.live[which % len(self.live)]
        outcomes = self.manager_attempt(
            "cache_req", lambda k: self.managers[k][1].cache_req(reqs[k], finished=finished)
        )
        if finished and outcomes[0].ok:
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
        prompts: dict[str, list[int] | None] = {
            "no prompt": None,
            "an empty prompt": [],
            "a namespace too deep": [1, 2],
        }
        if what in prompts:
            namespace = nested(NAMESPACE_DEPTH_LIMIT + 1) if what == "a namespace too deep" else None
            self.manager_attempt(
                what, lambda k: managers[k].match_req(call_with(Req, prompts[what], 0, None, namespace))
            )
            return
        if what == "a batch of None":
            self.manager_attempt(what, lambda k: call_with(managers[k].allocate_paged, [None]))
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
                # each manager gets the other's request: refused alike, each in its own words
                self.manager_attempt(
                    what, lambda k: managers[k].cache_req(reqs[1 - k], finished=False), same_words=False
                )
            return
        if what == "a batch that is a request":
            self.manager_attempt(what, lambda k: call_with(managers[k].allocate_paged, reqs[k]))
            return
        if what == "a batch sharing a row":
            self.manager_attempt(what, lambda k: managers[k].allocate_paged([reqs[k], dataclasses.replace(reqs[k])]))
            return
        # a copy of a live request with one field edited, cached with finished=False (the copy replaces the
        # request when a manager takes it: the cache handle moved to it)
        row = reqs[0].table_idx
        # a float where a length goes: the wrong type is the point
        float_length = cast(int, float(reqs[0].cached_len))
        edits: dict[str, Callable[[Req], Req]] = {
            "a float length": lambda req: dataclasses.replace(req, cached_len=float_length),
            "a bool row": lambda req: dataclasses.replace(req, table_idx=bool(row)),
            "a row past the table": lambda req: dataclasses.replace(req, table_idx=MANAGER_ROWS),
            "a lying row": lambda req: dataclasses.replace(req, table_idx=LyingInt(row)),
        }
        copies = [edits[what](req) for req in reqs]
        outcomes = self.manager_attempt(what, lambda k: managers[k].cache_req(copies[k], finished=False))
        if outcomes[0].ok:
            for copied in copies:
                copied.table_idx = row
            self.live[self.live.index(reqs)] = copies

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
        assert pool is not None, "the precondition: a pool"
        num_slots = pool.num_slots
        rows = sorted({s % num_slots for s in slots})
        n = len(rows)
        values = torch.arange(n * POOL_HEADS * POOL_HEAD_DIM, dtype=torch.float32) + 1 + 100 * self.next_uid
        self.next_uid += 1
        k = values.view(n, POOL_HEADS, POOL_HEAD_DIM)
        v = -k
        loc = torch.tensor(rows, dtype=torch.int64)
        args: list[object] = [k, v, loc, layer]
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
        result = self.outcome(lambda: call_with(pool.store_kv, *args), lambda value: None)
        # a refused store writes nothing (the shadow stays): compare_pool checks it
        if result.ok:
            # what the pool must hold now: each in-range row of the given slots, with the given K/V rows
            given_keys, given_slots, given_layer = args[0], args[2], args[3]
            keys = given_keys.reshape(given_keys.shape[0], -1) if isinstance(given_keys, torch.Tensor) else None
            assert keys is not None and isinstance(given_slots, torch.Tensor) and isinstance(given_layer, int)
            written_layer = int.__int__(given_layer)
            skipped = False
            for i, slot in enumerate(given_slots.tolist()):
                if not 0 <= slot < num_slots:
                    skipped = True
                    continue
                self.pool_shadow[0][written_layer][slot] = keys[i]
                self.pool_shadow[1][written_layer][slot] = v.reshape(n, -1)[i]
            flagged = self.outcome(pool.check_store_errors, lambda value: None)
            assert (flagged.error is SlotOutOfRangeError) if skipped else flagged.ok, (
                f"store_kv[{what}]: rows outside the pool skipped: {skipped}, the pool's flags: {flagged}"
            )
        self.compare_pool(what)
