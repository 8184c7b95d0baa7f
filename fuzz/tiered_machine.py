"""The tiered machine: the tiered cache of ``spec/tiers.py`` beside implementations of it, with the machine as
the executor of their transfers.

Each step makes the same call on the spec and on every implementation (``TieredCacheTarget`` of
``fuzz/targets/api.py``: the spec's operation names as methods): requests that match, lock, allocate and
insert; loads back and prefetches of their hits; pressure on the device and host tiers; write-back; and the
executor's answers, each transfer in flight completed or failed, in any order; storage going offline for a
while (its transfers in flight can then only fail or wait); resets, refused under locks and transfers. Results
and error classes must agree, a refused call must change nothing, the abstract states must be equal, and every
law of the spec must hold after every step (``check_tiered_invariants``, on the spec's state and on each
implementation's).

``reached`` counts what the examples reached: each kind of transfer completed and failed, resets of a full
cache, storage going offline and back, completions refused while it is offline. A campaign's summary reports
the same as rules (``tiered.backup[completed]``, ...) and the reach: pages per tier and transfers in flight at once.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from typing import ClassVar, NamedTuple, cast

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixspec.spec import tiers as tiers
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import CacheError, IntegrityError
from radixspec.spec.prefix_cache import PageKey

from .stats import STATS
from .targets import resolve
from .targets.api import TargetInfo, TieredCacheTarget, TieredHandle, TieredInserted, TieredMatchView
from .targets.layers import our_tiered_caches
from .targets.ours import IMPLEMENTATIONS, SpecTieredCache

FETCHES = ("load_back", "prefetch")
PAGE_SIZE = 2
# the pages prompts are made of (few, so that prompts share prefixes); a prompt starts with one of two
FIRST_PAGES = ((1, 2), (7, 8))
PAGES = ((1, 2), (3, 4), (5, 6), (7, 8), (9, 9))


class Prompt(NamedTuple):
    """A request's tokens, and the namespace it caches under."""

    tokens: list[int]
    namespace: Namespace


prompts = st.builds(
    lambda first, rest, namespace: Prompt([token for page in (first, *rest) for token in page], namespace),
    st.sampled_from(FIRST_PAGES),
    # short prompts most often (small pools fill and evict), long ones for deep trees
    st.one_of(st.lists(st.sampled_from(PAGES), max_size=2), st.lists(st.sampled_from(PAGES), max_size=11)),
    st.sampled_from((None, None, ("tenant", 1))),
)


def summary(result: object) -> object:
    """What must agree between implementations: hit lengths rather than handles, cached lengths of inserts."""
    if isinstance(result, tuple) and hasattr(result, "device_len"):
        match = cast(TieredMatchView, result)
        return ("match", match.device_len, match.host_len, match.storage_len)
    if isinstance(result, tuple) and hasattr(result, "cached_len") and hasattr(result, "handle"):
        inserted = cast(TieredInserted, result)
        return ("insert", inserted.cached_len, inserted.handle.cached_len)
    return result


class TieredMachine(RuleBasedStateMachine):
    """The spec's tiered cache beside ``IMPLS`` (our implementations by name, or targets with a tiered layer)."""

    # ours by name, or targets: each with a tiered layer (machine_for sets it for the selected ones)
    IMPLS: ClassVar[tuple[str | TargetInfo, ...]] = tuple(our_tiered_caches())
    # (a transfer kind, completed or failed); ("reset", of a full cache); storage going offline or back (with
    # transfers in flight); a completion refused while storage is offline
    reached: ClassVar[Counter[tuple[str, bool]]] = Counter()

    @initialize(
        policy=st.sampled_from(tiers.WRITE_POLICIES),
        # small pools most often: a device that runs out makes loads back and allocations evict
        device=st.one_of(st.integers(2, 8), st.integers(2, 8), st.integers(9, 40)),
        host=st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(9, 40)),
        storage=st.one_of(st.just(0), st.integers(1, 8), st.integers(9, 60)),
    )
    def configure(self, policy: tiers.WritePolicy, device: int, host: int, storage: int) -> None:
        STATS.examples += 1
        STATS.rules[f"tiered.config[{policy}, storage {'on' if storage else 'off'}]"] += 1
        config = (PAGE_SIZE, device, host, storage, policy, 2)
        # the spec's adapter answers every operation by name (__getattr__): a TieredCache by construction
        self.caches: list[tuple[str, TieredCacheTarget]] = [("spec", cast(TieredCacheTarget, SpecTieredCache(*config)))]
        for chosen in self.IMPLS:
            info = chosen if isinstance(chosen, TargetInfo) else IMPLEMENTATIONS.get(chosen) or resolve(chosen)
            assert info.tiered_factory is not None, f"target {info.name} has no tiered layer"
            self.caches.append((info.name, info.tiered_factory(*config)))
        # handles locked by the machine, one per cache
        self.handles: list[list[TieredHandle]] = []

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

    @rule(prompt=prompts)
    def request(self, prompt: Prompt) -> None:
        """A prefill: its device hit locked while it allocates device pages for the rest and inserts them; the
        pages past a page being loaded back go back."""
        STATS.record_rule("tiered.request")
        matches = self.matches(prompt)
        handles = [match.handle for match in matches]
        self.call("lock", each=handles)
        hit = matches[0].device_len
        allocated = self.call("allocate", (len(prompt.tokens) - hit) // PAGE_SIZE)
        if allocated is not None:
            pages = cast(list[int], allocated[0])
            row = [0] * hit + [page + i for page in pages for i in range(PAGE_SIZE)]
            inserted = cast(list[TieredInserted], self.call("insert_prefix", prompt.tokens, row, prompt.namespace))
            self.call("free", pages[(inserted[0].handle.cached_len - hit) // PAGE_SIZE :])
        self.call("unlock", each=handles)

    def matches(self, prompt: Prompt) -> list[TieredMatchView]:
        """match_prefix on every cache (a match is never refused)."""
        return cast(list[TieredMatchView], self.call("match_prefix", *prompt))

    @rule(prompt=prompts, hold=st.integers(0, 3))
    def match_and_load(self, prompt: Prompt, hold: int) -> None:
        """A match, its device hit locked (one in four, until ``unlock``), its host hit loaded back and its
        storage hit prefetched."""
        STATS.record_rule("tiered.match_and_load")
        self.match_and_fetch(prompt, hold)

    def match_and_fetch(self, prompt: Prompt, hold: int) -> None:
        matches = self.matches(prompt)
        first = matches[0]
        assert first.device_len <= first.host_len <= first.storage_len
        if not hold:
            handles = [match.handle for match in matches]
            self.call("lock", each=handles)
            self.handles.append(handles)
        self.call("load_back", *prompt)
        self.call("prefetch", *prompt)

    @rule(prompt=prompts, spilled=st.integers(0, 8), tail=st.booleans(), busy=st.integers(0, 2))
    def come_back(self, prompt: Prompt, spilled: int, tail: bool, busy: int) -> None:
        """A prompt comes back after ``spilled`` device pages went to the host tier (``tail``: every other evictable
        page, then 1 to all but one of its own, its backups done first): its host hit loaded back, its storage hit
        fetched. ``busy`` 1: while running requests hold every free device page (the load back must evict, or is
        refused); 2: every device page but the prompt's own (the load back must keep its device hit: refused)."""
        STATS.record_rule("tiered.come_back")
        if tail:
            # long after it was served: its backups done; stamped last, its pages go after the others'
            self.complete_writes()
            self.matches(prompt)
            others = tiers.plan_device_eviction(self.spec, self.spec.device_pages, keep=self.keys(prompt))
            # 1 to all but one of its own pages: a device hit with a host tail
            own = len(prompt.tokens) // PAGE_SIZE
            spilled = len(others) + (1 + spilled % (own - 1) if own > 1 else 0)
        self.call("evict_device", len(tiers.plan_device_eviction(self.spec, spilled)))
        held = self.call("allocate", self.busy_pages(prompt, busy)) if busy else None
        self.match_and_fetch(prompt, hold=1)
        if held is not None:
            self.call("free", held[0])

    def busy_pages(self, prompt: Prompt, busy: int) -> int:
        """The device pages running requests hold: every free one, and (``busy`` 2) every evictable one but the
        prompt's device hit (matched first, so that eviction takes the others' pages first)."""
        if busy == 1:
            return len(self.spec.device_free)
        self.matches(prompt)
        others = tiers.plan_device_eviction(self.spec, self.spec.device_pages, keep=self.keys(prompt))
        return len(self.spec.device_free) + len(others)

    def keys(self, prompt: Prompt) -> set[PageKey]:
        """The spec's keys of the prompt's pages."""
        return set(tiers.get_page_keys(self.spec, prompt.namespace, prompt.tokens))

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        STATS.record_rule("tiered.unlock")
        handles = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.call("unlock", each=handles)

    # ------------------------------------------------------------ tiers

    @rule(data=st.data(), host=st.booleans())
    def evict(self, data: st.DataObject, host: bool) -> None:
        """Up to one page more than is evictable (refused) from the device or the host tier."""
        STATS.record_rule("tiered.evict")
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
        STATS.record_rule("tiered.pressure")
        self.press(host)

    def press(self, host: bool) -> None:
        self.call("evict_device", len(tiers.plan_device_eviction(self.spec, self.spec.device_pages)))
        if host:
            self.call("evict_host", len(tiers.plan_host_eviction(self.spec, self.spec.host_pages, set())))

    @rule(pages=st.integers(1, 3))
    def write_back(self, pages: int) -> None:
        STATS.record_rule("tiered.write_back")
        self.call("write_back", pages)

    # ------------------------------------------------------------ the executor

    def end(self, number: int, ok: bool) -> None:
        """The executor completes (``ok``) or fails transfer ``number``; a completion that storage being offline
        refuses counts apart (the transfer stays in flight)."""
        kind = self.spec.transfers[number].kind
        if self.call("complete_transfer" if ok else "fail_transfer", number) is None:
            self.reached[f"{kind} while storage is offline", ok] += 1
            STATS.rules[f"tiered.{kind}[refused offline]"] += 1
            return
        self.reached[kind, ok] += 1
        STATS.rules[f"tiered.{kind}[{'completed' if ok else 'failed'}]"] += 1

    @precondition(lambda self: bool(self.spec.transfers))
    @rule(data=st.data(), ok=st.booleans())
    def executor(self, data: st.DataObject, ok: bool) -> None:
        """The executor ends any transfer in flight."""
        STATS.record_rule("tiered.executor")
        self.end(data.draw(st.sampled_from(sorted(self.spec.transfers))), ok)

    @precondition(lambda self: any(transfer.kind in FETCHES for transfer in self.spec.transfers.values()))
    @rule(data=st.data(), ok=st.booleans())
    def fetch_ends(self, data: st.DataObject, ok: bool) -> None:
        """The executor ends a load back or a prefetch (rarer than backups: they follow a spill)."""
        STATS.record_rule("tiered.fetch_ends")
        fetches = sorted(number for number, transfer in self.spec.transfers.items() if transfer.kind in FETCHES)
        self.end(data.draw(st.sampled_from(fetches)), ok)

    @rule()
    def drain(self) -> None:
        """The executor completes every write in flight (backups, and the stores their completions start; no
        store while storage is offline)."""
        STATS.record_rule("tiered.drain")
        self.complete_writes()

    def complete_writes(self) -> None:
        while writes := self.writes():
            self.end(min(writes), True)

    def writes(self) -> list[int]:
        """The writes in flight that can complete now."""
        online = self.spec.storage_online
        return [
            number
            for number, transfer in self.spec.transfers.items()
            if transfer.kind not in FETCHES and (online or transfer.kind != "store")
        ]

    @rule(online=st.booleans(), now=st.integers(0, 7))
    def outage(self, online: bool, now: int = 0) -> None:
        """Storage comes back (``online``), or goes offline (one draw in eight of the rest: for a while, not half
        the time): its transfers in flight can then only fail or wait, a match sees no storage hit."""
        STATS.record_rule("tiered.outage")
        if not online and now:
            return
        if self.spec.storage_online != online:
            self.reached["storage " + ("back" if online else "offline"), bool(self.spec.transfers)] += 1
            STATS.rules[f"tiered.storage[{'back' if online else 'offline'}]"] += 1
        self.call("set_storage_online", online)

    @rule(now=st.integers(0, 7))
    def reset(self, now: int) -> None:
        """Now and then (one draw in eight), a reset: refused under locks and transfers."""
        STATS.record_rule("tiered.reset")
        if now:
            return
        full = bool(self.spec.entries)
        if self.call("reset") is None:
            STATS.rules["tiered.reset[refused under load]"] += 1
            return
        self.handles.clear()
        self.reached["reset", full] += 1
        STATS.rules[f"tiered.reset[{'full' if full else 'empty'}]"] += 1

    # ------------------------------------------------------------ after every step

    @invariant()
    def caches_agree_and_keep_the_laws(self) -> None:
        expected = self.spec
        tiers.check_tiered_invariants(expected)
        usage = tiers.get_tier_usage(expected)
        STATS.record_reach(
            largest_tree_pages=usage["device"].cached,
            largest_host_pages=usage["host"].cached,
            largest_storage_pages=usage["storage"].cached,
            most_transfers_in_flight=len(expected.transfers),
        )
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
