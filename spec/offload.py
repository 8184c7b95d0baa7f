"""Offloading: a host tier that a scheduler offers computed pages to and loads hits back from, chunk by chunk.

This is the host tier as a KV-offloading manager serves it (vLLM's ``OffloadingManager``: its scheduler asks,
its workers copy): a flat store of page keys (no tree; a key ``(namespace, prefix)`` names the KV of that
prefix) in ``capacity`` host slots. Each key held is a **chunk** in one slot, and is

* **pending** (``pins == PENDING``): a store job writes its slot; a lookup sees it, nobody may read it;
* **ready** with ``pins`` load jobs reading it (0: idle, the only chunks eviction may take).

Jobs are asynchronous: ``prepare_store`` / ``prepare_load`` start one, the executor ends it later with
``complete_store`` (done, or failed: the chunks it wrote go back) or ``complete_load``. A store offer is **all or
nothing**: keys already held are not stored again (a pending one belongs to another job), and the new keys either
all get a slot (evicting as many idle chunks outside the offer as are short) or none does (``plan_store`` is
None). Which idle chunks go, and which free slots the new chunks take, are the manager's policy (LRU, ARC, ...): the
spec takes the manager's choice and checks that it is one the rules allow.

A manager may admit a key only once it was offered ``threshold`` times (``threshold`` 1: every offer): it counts
the offers of up to ``tracker_size`` keys, forgetting the one offered longest ago for a new one, never one of the
offer being counted (``record_offer``, before each offer is planned; the counts survive a reset).

``reset`` drops every chunk, pinned or pending (an engine's reset abandons its jobs in flight: their completions
are never delivered, and the executor finishes their copies before any job started later). Each slot's content is
modelled as what was written into it (``Written``: the key and the reset epoch), so the laws can say that every
ready chunk holds its own key's KV and that nothing written before a reset serves after it.

Every operation lists its guards (``# CHECK``) before its effects.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeVar

from .errors import IntegrityError, InvalidInputError, InvalidSizeError, OutOfPagesError
from .prefix_cache import PageKey
from .tiers import Written

Lookup = Literal["miss", "pending", "hit"]
# a chunk whose store is in flight
PENDING = -1
# a job in flight: a store's keys and slots, or a load's keys
J = TypeVar("J")


class Chunk(NamedTuple):
    """A key's host slot, and its pins: ``PENDING`` while its store is in flight, else the loads reading it."""

    slot: int
    pins: int


class StorePlan(NamedTuple):
    """What an offer stores: its new keys (in the offer's order) and how many idle chunks must go first."""

    new: tuple[PageKey, ...]
    evict: int


class StoreJob(NamedTuple):
    """A store in flight: each key it writes and the slot it writes."""

    keys: tuple[PageKey, ...]
    slots: tuple[int, ...]


@dataclass
class OffloadState:
    capacity: int
    chunks: dict[PageKey, Chunk] = field(default_factory=dict)
    # the free slots (a manager takes them in its own order)
    free: list[int] = field(default_factory=list)
    # jobs in flight, by number
    stores: dict[int, StoreJob] = field(default_factory=dict)
    loads: dict[int, tuple[PageKey, ...]] = field(default_factory=dict)
    # what each slot holds (what a store wrote, in which reset epoch)
    written: dict[int, Written] = field(default_factory=dict)
    epoch: int = 0
    next_job: int = 0
    # admission: a key is stored once offered this many times (1: at once); the counts of at most tracker_size
    # keys, the one offered longest ago first
    threshold: int = 1
    tracker_size: int = 0
    offers: dict[PageKey, int] = field(default_factory=dict)


class OffloadView(NamedTuple):
    """What the laws of the slots read: a manager's chunks and its free slots (the spec's, or a target's), and its
    offer counts (the one offered longest ago first)."""

    capacity: int
    chunks: dict[PageKey, Chunk]
    free: Sequence[int]
    offers: Sequence[tuple[PageKey, int]] = ()


def new_state(capacity: int, threshold: int = 1, tracker_size: int = 64_000) -> OffloadState:
    # CHECK
    for name, value in (("capacity", capacity), ("threshold", threshold), ("tracker_size", tracker_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidSizeError.not_positive(name, value)
    return OffloadState(capacity, free=list(range(capacity)), threshold=threshold, tracker_size=tracker_size)


# ------------------------------------------------------------------ queries


def lookup(state: OffloadState, key: PageKey) -> Lookup:
    """Whether ``key`` is held, and readable."""
    chunk = state.chunks.get(key)
    if chunk is None:
        return "miss"
    return "pending" if chunk.pins == PENDING else "hit"


def get_hit_run(state: OffloadState, keys: Sequence[PageKey]) -> tuple[PageKey, ...] | None:
    """The keys a scheduler loads: the ready ones from the first, up to the first not held; None (ask again later)
    when a pending one comes first."""
    run: list[PageKey] = []
    for key in keys:
        found = lookup(state, key)
        if found == "pending":
            return None
        if found == "miss":
            break
        run.append(key)
    return tuple(run)


def get_idle_keys(state: OffloadState, keep: Collection[PageKey] = ()) -> list[PageKey]:
    """The chunks eviction may take: ready, read by no load, not in ``keep``."""
    return [key for key, chunk in state.chunks.items() if chunk.pins == 0 and key not in keep]


def is_admitted(state: OffloadState, key: PageKey) -> bool:
    """Whether ``key`` was offered often enough to be stored."""
    return state.threshold < 2 or state.offers.get(key, 0) >= state.threshold


def plan_store(state: OffloadState, keys: Sequence[PageKey]) -> StorePlan | None:
    """What offering ``keys`` (counted by ``record_offer``) would store: the keys not held and admitted; None when
    they cannot all get a slot."""
    new = tuple(key for key in keys if key not in state.chunks and is_admitted(state, key))
    short = max(0, len(new) - len(state.free))
    if short > len(get_idle_keys(state, keep=set(keys))):
        return None
    return StorePlan(new, short)


# ------------------------------------------------------------------ operations


def record_offer(state: OffloadState, keys: Sequence[PageKey]) -> None:
    """Count an offer of ``keys`` (under a threshold of 2 or more): each counted key once more and offered last; a
    key not counted yet at 1, in room the tracker makes by forgetting the key offered longest ago outside the offer
    (none left: not counted)."""
    # CHECK
    check_distinct("an offer's keys", keys)
    if state.threshold < 2:
        return
    # EFFECT
    counted = [key for key in keys if key in state.offers]
    for key in counted:
        state.offers[key] = state.offers.pop(key) + 1
    # the keys counted before this offer now come first; the offer's new keys take the free room, then the places
    # of those keys, oldest first, while any is left
    others = len(state.offers) - len(counted)
    room = max(0, state.tracker_size - len(state.offers))
    taken = [key for key in keys if key not in state.offers][: room + others]
    for old in list(state.offers)[: max(0, len(taken) - room)]:
        del state.offers[old]
    state.offers.update(dict.fromkeys(taken, 1))


def prepare_store(
    state: OffloadState, keys: Sequence[PageKey], evicted: Sequence[PageKey], slots: Sequence[int]
) -> int | None:
    """Offer ``keys``; the manager evicted ``evicted`` and gave the new keys ``slots``. Returns the store job's
    number (None: nothing new to store). Refused (``OutOfPagesError``) when the plan is None."""
    # CHECK
    check_distinct("an offer's keys", keys)
    plan = plan_store(state, keys)
    if plan is None:
        raise OutOfPagesError(f"offer of {len(keys)} keys: no room for its new keys without evicting its own")
    check_store_choice(state, keys, plan, evicted, slots)
    # EFFECT
    for key in evicted:
        state.free.append(state.chunks.pop(key).slot)
    if not plan.new:
        return None
    for key, slot in zip(plan.new, slots, strict=True):
        state.free.remove(slot)
        state.chunks[key] = Chunk(slot, PENDING)
    return begin_job(state, stores=StoreJob(plan.new, tuple(slots)))


def complete_store(state: OffloadState, job: int, success: bool = True) -> None:
    """The executor ends store ``job``: its chunks ready (their slots written), or (failed) given back."""
    # CHECK
    stored = check_job(state.stores, job, "store")
    # EFFECT
    del state.stores[job]
    for key, slot in zip(stored.keys, stored.slots, strict=True):
        if success:
            state.chunks[key] = Chunk(slot, 0)
            state.written[slot] = Written(key, state.epoch)
        else:
            del state.chunks[key]
            state.free.append(slot)
            state.written.pop(slot, None)


def prepare_load(state: OffloadState, keys: Sequence[PageKey]) -> int:
    """Start a load of ``keys`` (each ready): each chunk pinned until the job completes. Returns its number."""
    # CHECK
    check_distinct("a load's keys", keys)
    if not keys:
        raise InvalidInputError("a load of no keys")
    for key in keys:
        if lookup(state, key) != "hit":
            raise InvalidInputError(f"a load of {key!r}, which is {lookup(state, key)}: only a hit is read")
    # EFFECT
    for key in keys:
        state.chunks[key] = state.chunks[key]._replace(pins=state.chunks[key].pins + 1)
    return begin_job(state, loads=tuple(keys))


def get_load_slots(state: OffloadState, job: int) -> tuple[int, ...]:
    """The slots load ``job`` reads, in its keys' order."""
    return tuple(state.chunks[key].slot for key in check_job(state.loads, job, "load"))


def complete_load(state: OffloadState, job: int) -> None:
    """The executor ends load ``job`` (done or not, the chunks are read no more): its pins released."""
    # CHECK
    keys = check_job(state.loads, job, "load")
    # EFFECT
    del state.loads[job]
    for key in keys:
        state.chunks[key] = state.chunks[key]._replace(pins=state.chunks[key].pins - 1)


def reset(state: OffloadState) -> None:
    """Drop every chunk and abandon every job in flight: the executor finishes their copies (stores write their
    slots, in the old epoch) before anything started later, and delivers no completion of them."""
    # EFFECT
    for job in state.stores.values():
        for key, slot in zip(job.keys, job.slots, strict=True):
            state.written[slot] = Written(key, state.epoch)
    state.chunks.clear()
    state.stores.clear()
    state.loads.clear()
    state.free = list(range(state.capacity))
    state.epoch += 1


# ------------------------------------------------------------------ guards and helpers


def check_distinct(what: str, keys: Sequence[PageKey]) -> None:
    # CHECK
    repeated = [key for key, count in Counter(keys).items() if count > 1]
    if repeated:
        raise InvalidInputError(f"{what} repeat {repeated[0]!r}: each key once")


def check_job(jobs: Mapping[int, J], job: object, kind: str) -> J:
    # CHECK
    if isinstance(job, bool) or not isinstance(job, int) or job not in jobs:
        raise InvalidInputError(f"no {kind} job {job!r} in flight (in flight: {sorted(jobs)})")
    return jobs[job]


def check_store_choice(
    state: OffloadState, keys: Sequence[PageKey], plan: StorePlan, evicted: Sequence[PageKey], slots: Sequence[int]
) -> None:
    """The manager's choice for an offer must be one the rules allow (``IntegrityError`` naming the rule)."""
    # CHECK
    idle = set(get_idle_keys(state, keep=set(keys)))
    if len(evicted) != plan.evict or len(set(evicted)) != len(evicted) or not idle.issuperset(evicted):
        raise IntegrityError(
            f"store_evicts_only_what_it_lacks: {len(plan.new)} new keys, {len(state.free)} free slots: must evict "
            f"{plan.evict} distinct idle chunks outside the offer, evicted {list(evicted)!r}"
        )
    free = set(state.free) | {state.chunks[key].slot for key in evicted}
    if len(slots) != len(plan.new) or len(set(slots)) != len(slots) or not free.issuperset(slots):
        raise IntegrityError(
            f"store_takes_free_slots: {len(plan.new)} new keys given slots {list(slots)}; free were {sorted(free)}"
        )


def begin_job(state: OffloadState, stores: StoreJob | None = None, loads: tuple[PageKey, ...] | None = None) -> int:
    job = state.next_job
    state.next_job += 1
    if stores is not None:
        state.stores[job] = stores
    if loads is not None:
        state.loads[job] = loads
    return job


def view(state: OffloadState) -> OffloadView:
    return OffloadView(state.capacity, state.chunks, state.free, list(state.offers.items()))


# ------------------------------------------------------------------ invariants (None when it holds)


def slots_hold_one_chunk(found: OffloadView) -> str | None:
    """Every chunk in a slot of its own, within the capacity."""
    slots = Counter(chunk.slot for chunk in found.chunks.values())
    shared = sorted(slot for slot, count in slots.items() if count > 1)
    outside = sorted(slot for slot in slots if not 0 <= slot < found.capacity)
    if shared or outside:
        return f"slots_hold_one_chunk: slots held twice {shared}, outside 0..{found.capacity - 1} {outside}"
    return None


def slots_are_conserved(found: OffloadView) -> str | None:
    """Free slots and held slots are every slot, each once: nothing leaked, nothing free twice or while held."""
    held = {chunk.slot for chunk in found.chunks.values()}
    free = Counter(found.free)
    twice = sorted(slot for slot, count in free.items() if count > 1)
    both = sorted(held & set(free))
    lost = sorted(set(range(found.capacity)) - held - set(free))
    if twice or both or lost or len(held) + len(free) > found.capacity:
        return f"slots_are_conserved: free twice {twice}, free and held {both}, lost {lost}, free {sorted(free)}"
    return None


def pending_chunks_have_their_store(state: OffloadState) -> str | None:
    """Each pending chunk is written by exactly one store in flight, into its slot; each store's chunks pending."""
    writing = Counter(pair for job in state.stores.values() for pair in zip(job.keys, job.slots, strict=True))
    pending = Counter((key, chunk.slot) for key, chunk in state.chunks.items() if chunk.pins == PENDING)
    if writing != pending:
        return f"pending_chunks_have_their_store: pending {list(pending)}, written by stores {list(writing)}"
    return None


def pins_count_the_loads(state: OffloadState) -> str | None:
    """Each ready chunk is pinned once per load in flight that reads it, and a load reads only ready chunks."""
    reading = Counter(key for keys in state.loads.values() for key in keys)
    pins = {key: chunk.pins for key, chunk in state.chunks.items() if chunk.pins > 0}
    unready = [key for key in reading if lookup(state, key) != "hit"]
    if dict(reading) != pins or unready:
        return f"pins_count_the_loads: pins {dict(pins)}, loads reading {dict(reading)}, not ready {unready}"
    return None


def ready_chunks_hold_their_key(state: OffloadState) -> str | None:
    """Every ready chunk's slot holds its own key's KV, written since the last reset."""
    for key, chunk in state.chunks.items():
        if chunk.pins != PENDING and state.written.get(chunk.slot) != Written(key, state.epoch):
            return (
                f"ready_chunks_hold_their_key: {key!r} is ready in slot {chunk.slot}, which holds "
                f"{state.written.get(chunk.slot)!r} (epoch now {state.epoch})"
            )
    return None


def published_are_the_ready_chunks(state: OffloadState, published: Iterable[PageKey]) -> str | None:
    """The manager's events, replayed (stored: +, removed: -; a reset clears), give exactly the ready chunks."""
    shown = list(published)
    ready = [key for key, chunk in state.chunks.items() if chunk.pins != PENDING]
    ready_keys, shown_keys = set(ready), set(shown)
    extra = [key for key in shown if key not in ready_keys]
    missing = [key for key in ready if key not in shown_keys]
    if extra or missing:
        return f"published_are_the_ready_chunks: published but not ready {extra!r}, ready but not published {missing!r}"
    return None


def offer_counts_fit_the_tracker(state: OffloadState) -> str | None:
    """At most ``tracker_size`` keys counted, each offered at least once (no counts under a threshold of 1)."""
    if len(state.offers) > (state.tracker_size if state.threshold >= 2 else 0) or any(
        count < 1 for count in state.offers.values()
    ):
        return (
            f"offer_counts_fit_the_tracker: {len(state.offers)} keys counted (threshold {state.threshold}, "
            f"tracker of {state.tracker_size}), lowest count {min(state.offers.values())}"
        )
    return None


VIEW_LAWS = (slots_hold_one_chunk, slots_are_conserved)
JOB_LAWS = (
    pending_chunks_have_their_store,
    pins_count_the_loads,
    ready_chunks_hold_their_key,
    offer_counts_fit_the_tracker,
)


def check_view(found: OffloadView) -> None:
    """The slot laws on a manager's view (the spec's, or a target's)."""
    for law in VIEW_LAWS:
        broken = law(found)
        if broken is not None:
            raise IntegrityError(broken)


def check_offload_invariants(state: OffloadState) -> None:
    """Every law of the spec's state; IntegrityError naming the first broken one."""
    check_view(view(state))
    for law in JOB_LAWS:
        broken = law(state)
        if broken is not None:
            raise IntegrityError(broken)
