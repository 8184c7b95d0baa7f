"""The hostile-input machine's state, setup, law and checks (``fuzz/hostile_machine.py`` assembles the
machine): what every hostile call is judged by."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeAlias, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc

from ..judge import Outcome, expect_same
from ..stats import STATS
from ..targets.exact import as_list

if TYPE_CHECKING:
    import torch

    from radixspec import optimized, reference
    from radixspec.optimized import hybrid_cache as optimized_hybrid
    from radixspec.optimized.kv_pool import MHAKVCache
    from radixspec.reference import hybrid_cache as reference_hybrid
    from radixspec.spec.requests import Req

    from ..targets.exact import Handle

# our prefix caches, cache managers and hybrid caches: the reference's and the optimized one's
Cache: TypeAlias = "reference.RadixPrefixCache | optimized.RadixPrefixCache"
Manager: TypeAlias = "reference.CacheManager | optimized.CacheManager"
HybridCache: TypeAlias = "reference_hybrid.HybridRadixCache | optimized_hybrid.HybridRadixCache"
T = TypeVar("T")

# the managers' sizes: rows of the page table, positions of a row, pages of the pool
MANAGER_ROWS, MANAGER_ROW_LEN, MANAGER_PAGES = 3, 16, 6
# the KV pool's sizes (pages of the page size drawn)
POOL_HEADS, POOL_LAYERS, POOL_HEAD_DIM, POOL_PAGES = 2, 2, 2, 4
# values outside the domains (the spec's functions must refuse them): passed through ``call_with``
FLOAT_ONE: object = 1.0
LIST_NAMESPACE: object = ["lora", 1]


def call_with(function: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``function(*args, **kwargs)`` whatever the arguments' types: a hostile call passes on purpose what the
    signature refuses (the callee must refuse it when it runs), and a handle of either family goes back to a
    cache of either family."""
    return function(*args, **kwargs)


def first_int(result: tuple[int, object]) -> int:
    """An insert's cached length: the first field of the spec's InsertResult and of a cache's tuple alike."""
    return int(result[0])


def sorted_slots(slots: Sequence[int] | torch.Tensor) -> list[int]:
    """Evicted slots in order, from a list or a tensor alike."""
    return sorted(int(s) for s in as_list(slots))


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
    """One cache under hostile calls: its name and the cache."""

    def __init__(self, name: str, page_size: int) -> None:
        self.name = name
        self.cache: Cache
        if name == "optimized":
            from radixspec import optimized

            self.cache = optimized.RadixPrefixCache(page_size, device="cpu")
        else:
            from radixspec import reference

            self.cache = reference.RadixPrefixCache(page_size)


def make_manager(name: str, page_size: int) -> Manager:
    """Our cache manager ``name`` over a small page table and pool (MANAGER_ROWS, MANAGER_ROW_LEN, MANAGER_PAGES)."""
    if name == "optimized":
        from radixspec import optimized

        table = optimized.make_page_table(MANAGER_ROWS, MANAGER_ROW_LEN)
        return optimized.CacheManager(MANAGER_PAGES, page_size, table)
    from radixspec import reference

    return reference.CacheManager(MANAGER_PAGES, page_size, reference.make_page_table(MANAGER_ROWS, MANAGER_ROW_LEN))


def make_hybrid(name: str, page_size: int, windows: tuple[hy.Window, ...]) -> HybridCache:
    """Our hybrid cache ``name`` with the groups ``windows``."""
    if name == "optimized":
        from radixspec.optimized.hybrid_cache import HybridRadixCache as OptimizedHybrid

        return OptimizedHybrid(page_size, windows)
    from radixspec.reference.hybrid_cache import HybridRadixCache as ReferenceHybrid

    return ReferenceHybrid(page_size, windows)


class HostileBase(RuleBasedStateMachine):
    """The spec beside our caches, managers and KV pool: the state, the law every call is judged by, the valid
    calls that grow the trees, and the checks after every step."""

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
        self.handles: list[list[Handle]] = []
        # the hybrid caches (one full-attention group, one window of 2 pages) beside the spec's hybrid state
        self.hybrid_model = hy.new_state(1, (None, 2))
        self.hybrids: list[tuple[str, HybridCache]] = []
        self.hybrid_next = 0
        # the cache managers (one per implementation) and their live requests (one Req per manager each), and
        # requests cache_req released
        self.managers: list[tuple[str, Manager]] = []
        self.live: list[list[Req]] = []
        self.released: list[list[Req]] = []
        self.next_uid = 0
        # the KV pool (optimized only) and what its K and V caches must hold: [layer] -> [num_slots, width]
        self.pool: MHAKVCache | None = None
        self.pool_shadow: list[list[torch.Tensor]] = []

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.page_size = page_size
        self.model = pc.new_state(page_size)
        self.impls = [Implementation(name, page_size) for name in ("reference", "optimized") if name in self.IMPLS]
        windows = (None, 2 * page_size)
        self.hybrid_model = hy.new_state(page_size, windows)
        self.hybrids = [
            (name, make_hybrid(name, page_size, windows)) for name in ("reference", "optimized") if name in self.IMPLS
        ]
        self.managers = [(impl.name, make_manager(impl.name, page_size)) for impl in self.impls]
        if "optimized" in self.IMPLS:
            self.setup_pool(page_size)

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

    def outcome(self, call: Callable[[], T], normalize: Callable[[T], object]) -> Outcome:
        """The judge's outcome (``fuzz/judge.py``): a value or a named error; any other exception fails."""
        return Outcome.of(call, normalize)

    def attempt(
        self,
        label: str,
        spec: Callable[[pc.PrefixCacheState], T] | None,
        call: Callable[[Implementation], T],
        normalize: Callable[[T], object] = lambda value: None,
    ) -> list[Outcome]:
        """Apply one call to the spec (when it has a twin of it) and every implementation; check the law."""
        STATS.record_rule(f"hostile.{label}")
        before = [impl.cache.abstract_state() for impl in self.impls]
        model_before = self.model.copy()
        outcomes = []
        for impl, state in zip(self.impls, before, strict=True):
            result = self.outcome(functools.partial(call, impl), normalize)
            if not result.ok:
                assert impl.cache.abstract_state() == state, f"{label}: {impl.name} refused ({result}) and changed"
            outcomes.append(result)
        if spec is not None:
            expected = self.outcome(lambda: spec(self.model), normalize)
            if not expected.ok:
                assert self.model.entries == model_before.entries, f"{label}: the spec refused and changed"
            for impl, result in zip(self.impls, outcomes, strict=True):
                expect_same(label, expected, result, impl.name)
        else:
            for impl, result in zip(self.impls[1:], outcomes[1:], strict=True):
                expect_same(label, outcomes[0], result, impl.name, expected_from=self.impls[0].name)
        return outcomes

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
            first_int,
        )
        self.handles.append([impl.cache.match_prefix(tokens) for impl in self.impls])
        pc.match_prefix(self.model, tokens, None)

    @rule(size=st.integers(0, 8))
    def evict(self, size: int) -> None:
        self.attempt(
            "evict",
            lambda m: pc.evict(m, size),
            lambda impl: impl.cache.evict(size),
            sorted_slots,
        )

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

    def compare_pool(self, what: str) -> None:
        """The pool holds exactly what the accepted stores wrote."""
        pool = self.pool
        assert pool is not None, "compare_pool runs after a store into the pool"
        for side, read in enumerate((pool.k_cache, pool.v_cache)):
            for layer in range(POOL_LAYERS):
                held = read(layer).reshape(pool.num_slots, -1)
                assert held.equal(self.pool_shadow[side][layer]), (
                    f"store_kv[{what}]: layer {layer}'s {'KV'[side]} cache holds other values than the stores wrote"
                )

    def teardown(self) -> None:
        if self.impls:
            STATS.record_reach(largest_tree_pages=len(self.model.entries))
