"""The tiered machine: the tiered cache of ``spec/tiers.py`` beside implementations of it, with the machine as
the executor of their transfers.

Each step makes the same call on the spec and on every implementation (``TieredCache``: the spec's operation
names as methods): requests that match, lock, allocate and insert; loads back and prefetches of their hits;
pressure on the device and host tiers; write-back; and the executor's answers, each transfer in flight
completed or failed, in any order; resets, refused under locks and transfers. Results and error classes must
agree, a refused call must change nothing, the abstract states must be equal, and every law of the spec must
hold after every step (``check_tiered_invariants``, on the spec's state and on each implementation's).

``reached`` counts what the examples reached: each kind of transfer completed and failed, resets of a full
cache; a campaign reports it beside its figures.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol, cast

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixspec.spec import tiers as tiers
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import CacheError, IntegrityError

FETCHES = ("load_back", "prefetch")
# prompts of pages of 2 that share prefixes (the machine's page size), in two namespaces
PROMPTS = ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8], [1, 2, 3, 4, 9, 9], [7, 8, 1, 1], [5, 5])
PAGE_SIZE = 2


class Handle(Protocol):
    """An implementation's handle on a device path: the machine reads its length only."""

    @property
    def cached_len(self) -> int: ...


class Match(Protocol):
    """What match_prefix returns (spec/tiers.py: TieredMatch)."""

    @property
    def handle(self) -> Handle: ...
    @property
    def device_len(self) -> int: ...
    @property
    def host_len(self) -> int: ...
    @property
    def storage_len(self) -> int: ...


class Inserted(Protocol):
    """What insert_prefix returns (spec/tiers.py: TieredInsertResult)."""

    @property
    def cached_len(self) -> int: ...
    @property
    def handle(self) -> Handle: ...


class TieredCache(Protocol):
    """A tiered cache under the machine: the spec's operations, by their names, and its abstract state."""

    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> Match: ...
    def insert_prefix(
        self, input_ids: Sequence[int], indices: Sequence[int], namespace: Namespace = None
    ) -> Inserted: ...
    def lock(self, handle: Handle) -> None: ...
    def unlock(self, handle: Handle) -> None: ...
    def allocate(self, num_pages: int) -> list[int]: ...
    def free(self, pages: Sequence[int]) -> None: ...
    def evict_device(self, num_pages: int) -> list[int]: ...
    def evict_host(self, num_pages: int) -> list[int]: ...
    def write_back(self, num_pages: int) -> list[int]: ...
    def load_back(self, input_ids: Sequence[int], namespace: Namespace = None) -> int | None: ...
    def prefetch(self, input_ids: Sequence[int], namespace: Namespace = None) -> int | None: ...
    def complete_transfer(self, transfer_id: int) -> None: ...
    def fail_transfer(self, transfer_id: int) -> None: ...
    def reset(self) -> None: ...
    def abstract_state(self) -> tiers.TieredState: ...


class SpecTieredCache:
    """The spec's free functions as a TieredCache (each looked up at call time: a test may patch one)."""

    def __init__(
        self, page_size: int, device: int, host: int, storage: int, policy: tiers.WritePolicy, threshold: int
    ) -> None:
        self.state = tiers.new_state(page_size, device, host, storage, policy, threshold)

    def __getattr__(self, name: str) -> Callable[..., object]:
        if name not in tiers.OPERATIONS:
            raise AttributeError(name)
        operation = getattr(tiers, name)
        return lambda *args: operation(self.state, *args)

    def abstract_state(self) -> tiers.TieredState:
        return self.state


def summary(result: object) -> object:
    """What must agree between implementations: hit lengths rather than handles, cached lengths of inserts."""
    if isinstance(result, tuple) and hasattr(result, "device_len"):
        match = cast(Match, result)
        return ("match", match.device_len, match.host_len, match.storage_len)
    if isinstance(result, tuple) and hasattr(result, "cached_len") and hasattr(result, "handle"):
        inserted = cast(Inserted, result)
        return ("insert", inserted.cached_len, inserted.handle.cached_len)
    return result


class TieredMachine(RuleBasedStateMachine):
    """The spec's tiered cache beside ``implementations`` (factories taking the spec's configuration)."""

    implementations: ClassVar[tuple[Callable[..., TieredCache], ...]] = ()
    reached: ClassVar[Counter[tuple[str, bool]]] = Counter()

    @initialize(
        policy=st.sampled_from(tiers.WRITE_POLICIES),
        device=st.integers(2, 8),
        host=st.integers(1, 8),
        storage=st.integers(0, 8),
    )
    def configure(self, policy: tiers.WritePolicy, device: int, host: int, storage: int) -> None:
        config = (PAGE_SIZE, device, host, storage, policy, 2)
        # the spec's adapter answers every operation by name (__getattr__): a TieredCache by construction
        self.caches: list[tuple[str, TieredCache]] = [("spec", cast(TieredCache, SpecTieredCache(*config)))]
        self.caches += [(factory.__name__, factory(*config)) for factory in self.implementations]
        # handles locked by the machine, one per cache
        self.handles: list[list[Handle]] = []

    @property
    def spec(self) -> tiers.TieredState:
        return self.caches[0][1].abstract_state()

    def call(self, name: str, *args: object, each: Sequence[object] | None = None) -> list[object] | None:
        """``name`` on every cache (``each``: an argument per cache, put first); the results (their summaries)
        or error classes must agree, and a refusal must change nothing. Returns the results, or None when
        refused."""
        outcomes: list[tuple[str, object]] = []
        results: list[object] = []
        for index, (_, cache) in enumerate(self.caches):
            before = copy.deepcopy(cache.abstract_state())
            first = () if each is None else (each[index],)
            try:
                result = getattr(cache, name)(*first, *args)
            except CacheError as error:
                after = cache.abstract_state()
                assert after == before, f"{self.caches[index][0]}: a refused {name} changed the state"
                outcomes.append(("refused", type(error)))
                results.append(None)
                continue
            outcomes.append(("done", summary(result)))
            results.append(result)
        for (label, _), outcome in zip(self.caches[1:], outcomes[1:], strict=True):
            assert outcome == outcomes[0], f"{name}{args}: spec {outcomes[0]}, {label} {outcome}"
        return None if outcomes[0][0] == "refused" else results

    # ------------------------------------------------------------ requests

    @rule(prompt=st.sampled_from(PROMPTS))
    def request(self, prompt: list[int]) -> None:
        """A prefill: its device hit locked while it allocates device pages for the rest and inserts them; the
        pages past a page being loaded back go back."""
        matches = self.matches(prompt)
        handles = [match.handle for match in matches]
        self.call("lock", each=handles)
        hit = matches[0].device_len
        allocated = self.call("allocate", (len(prompt) - hit) // PAGE_SIZE)
        if allocated is not None:
            pages = cast(list[int], allocated[0])
            row = [0] * hit + [page + i for page in pages for i in range(PAGE_SIZE)]
            inserted = cast(list[Inserted], self.call("insert_prefix", prompt, row))
            self.call("free", pages[(inserted[0].handle.cached_len - hit) // PAGE_SIZE :])
        self.call("unlock", each=handles)

    def matches(self, prompt: list[int]) -> list[Match]:
        """match_prefix on every cache (a match is never refused)."""
        return cast(list[Match], self.call("match_prefix", prompt))

    @rule(prompt=st.sampled_from(PROMPTS), hold=st.integers(0, 3))
    def match_and_load(self, prompt: list[int], hold: int) -> None:
        """A match, its device hit locked (one in four, until ``unlock``), its host hit loaded back and its
        storage hit prefetched."""
        matches = self.matches(prompt)
        first = matches[0]
        assert first.device_len <= first.host_len <= first.storage_len
        if not hold:
            handles = [match.handle for match in matches]
            self.call("lock", each=handles)
            self.handles.append(handles)
        self.call("load_back", prompt)
        self.call("prefetch", prompt)

    @rule(prompt=st.sampled_from(PROMPTS), host=st.booleans())
    def come_back(self, prompt: list[int], host: bool) -> None:
        """A prompt comes back after the tiers were pressed: its host hit loaded back, its storage hit fetched."""
        self.pressure(host)
        self.match_and_load(prompt, hold=1)

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        handles = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.call("unlock", each=handles)

    # ------------------------------------------------------------ tiers

    @rule(data=st.data(), host=st.booleans())
    def evict(self, data: st.DataObject, host: bool) -> None:
        """Up to one page more than is evictable (refused) from the device or the host tier."""
        state = self.spec
        plan = (
            tiers.plan_host_eviction(state, state.host_pages, set())
            if host
            else tiers.plan_device_eviction(state, state.device_pages)
        )
        self.call("evict_host" if host else "evict_device", data.draw(st.integers(0, len(plan) + 1)))

    @rule(host=st.booleans())
    def pressure(self, host: bool) -> None:
        """The device under pressure: every evictable device page evicted (to the host tier where backed up);
        then, or not, the host tier too (what storage holds stays there)."""
        self.call("evict_device", len(tiers.plan_device_eviction(self.spec, self.spec.device_pages)))
        if host:
            self.call("evict_host", len(tiers.plan_host_eviction(self.spec, self.spec.host_pages, set())))

    @rule(pages=st.integers(1, 3))
    def write_back(self, pages: int) -> None:
        self.call("write_back", pages)

    # ------------------------------------------------------------ the executor

    def end(self, number: int, ok: bool) -> None:
        self.reached[self.spec.transfers[number].kind, ok] += 1
        self.call("complete_transfer" if ok else "fail_transfer", number)

    @precondition(lambda self: bool(self.spec.transfers))
    @rule(data=st.data(), ok=st.booleans())
    def executor(self, data: st.DataObject, ok: bool) -> None:
        """The executor ends any transfer in flight."""
        self.end(data.draw(st.sampled_from(sorted(self.spec.transfers))), ok)

    @precondition(lambda self: any(transfer.kind in FETCHES for transfer in self.spec.transfers.values()))
    @rule(data=st.data(), ok=st.booleans())
    def fetch_ends(self, data: st.DataObject, ok: bool) -> None:
        """The executor ends a load back or a prefetch (rarer than backups: they follow a spill)."""
        fetches = sorted(number for number, transfer in self.spec.transfers.items() if transfer.kind in FETCHES)
        self.end(data.draw(st.sampled_from(fetches)), ok)

    @rule()
    def drain(self) -> None:
        """The executor completes every write in flight (backups, and the stores their completions start)."""
        while writes := [number for number, transfer in self.spec.transfers.items() if transfer.kind not in FETCHES]:
            self.end(min(writes), True)

    @rule(now=st.integers(0, 7))
    def reset(self, now: int) -> None:
        """Now and then (one draw in eight), a reset: refused under locks and transfers."""
        if now:
            return
        full = bool(self.spec.entries)
        if self.call("reset") is not None:
            self.handles.clear()
            self.reached["reset", full] += 1

    # ------------------------------------------------------------ after every step

    @invariant()
    def caches_agree_and_keep_the_laws(self) -> None:
        expected = self.spec
        tiers.check_tiered_invariants(expected)
        for label, cache in self.caches[1:]:
            found = cache.abstract_state()
            try:
                tiers.check_tiered_invariants(found)
            except IntegrityError as error:
                raise IntegrityError(f"{label}: {error}") from error
            if found != expected:
                fields = [
                    name for name in expected.__dataclass_fields__ if getattr(found, name) != getattr(expected, name)
                ]
                raise IntegrityError(f"states_agree: {label} differs from the spec in {', '.join(fields)}")
