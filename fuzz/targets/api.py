"""The public target API: what a prefix cache (or cache manager) offers to be fuzzed against the spec.

A *target* wraps someone else's cache behind a small Protocol and declares a
``Profile``: what it promises exactly as the spec says, and where it
legitimately differs. The machines (``radixspec.fuzz.cache_machine``,
``radixspec.fuzz.manager_machine``) then check the spec's exact semantics where the
profile promises them and universal properties everywhere (docs/targets.md
has the whole contract).

Our own caches and managers are targets too (``radixspec.fuzz.targets.ours``, the exact
profile). What the three-way differential needs beyond a target (the
abstract state, a fingerprint, the KV events, the integrity check) is the
optional capability ``ExactCache`` / ``ExactManager`` of the same protocol:
a machine compares those exactly with the spec, state for state.

Calling convention: token ids and slots are plain lists of ints; a namespace
is ``None`` or a tuple from the spec's domain (targets without namespaces
only ever see ``None``); handles are the target's own type (``H``), requests
too (``R``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, Protocol, TypeVar, runtime_checkable

from radixspec.spec import cache_manager as sm
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.events import Event
from radixspec.spec.hit_rules import Window
from radixspec.spec.metrics import CacheStats
from radixspec.spec.offload import OffloadView
from radixspec.spec.prefix_cache import PageKey, Prefix, page_key
from radixspec.spec.tiers import TieredState, WritePolicy

if TYPE_CHECKING:
    from radixspec.reference.hybrid_manager import HybridCache, HybridReq

# a target's handle type, and its request type (a manager's)
H = TypeVar("H")
R = TypeVar("R")
# a handle type of a protocol that only takes handles
H_contra = TypeVar("H_contra", contravariant=True)

# a page is named by the spec's key: (namespace, Prefix); build one from tokens with page_key(namespace, tokens, P)
__all__ = ["PageKey", "Prefix", "page_key"]


class LruModel(Protocol):
    """A target's eviction rule, modelled for the strict LRU check; pages are named by their first slots, in
    path order."""

    def match(self, pages: list[int]) -> None:
        """A lookup of ``pages``."""

    def insert(self, hits: list[int], new_count: int) -> tuple[list[int], list[int]]:
        """An insert that hit ``hits`` and needs ``new_count`` new pages: (the new pages, the pages evicted)."""

    def lock(self, pages: list[int]) -> None: ...
    def unlock(self, pages: list[int]) -> None: ...
    def reset(self) -> None: ...


@dataclass(frozen=True)
class Profile:
    """A target's semantic profile: where it follows the spec exactly and where it legitimately differs."""

    # a name for the summary
    name: str
    # "page": evict(size) takes exactly ceil(size / P) pages; "node": whole eviction units (radix nodes,
    # blocks) until at least ``size`` tokens, stopping as soon as that many are evicted
    eviction_unit: Literal["page", "node"] = "page"
    # "evict": pages leave only through evict(); "allocate": a cached free page is evicted when the
    # target allocates its page for new data (vLLM's free queue); the target then has no evict()
    eviction_trigger: Literal["evict", "allocate"] = "evict"
    # "logical": page_stamps() must equal the spec's logical stamps; "order": page_stamps() is the
    # target's own clock, only its order is meaningful; "none": no clock is observable
    clock: Literal["logical", "order", "none"] = "logical"
    # "ours": rejects bad input with the spec's error classes, changing nothing; "any": raises some
    # exception and changes nothing; "none": no validation, so the spec serves as the precondition
    # oracle and invalid calls are not sent (the summary counts them as skipped)
    errors: Literal["ours", "any", "none"] = "ours"
    # whether match/insert take a namespace (else every call uses None)
    namespaces: bool = True
    # "returns": reset() returns every slot the cache held; "drops": it empties the cache and the
    # caller takes every slot back; "none": no reset
    reset: Literal["returns", "drops", "none"] = "returns"
    # whether a handle made before reset() may still be locked and unlocked when it covers no page (the
    # spec: an empty path is always valid); when False, such calls are invalid and follow ``errors``
    handles_survive_reset: bool = True
    # "caller": insert_prefix takes the caller's slots for new pages; "target": it allocates its own
    # (the caller passes None and reads them from the handle)
    slots: Literal["caller", "target"] = "caller"
    # the LRU check run by default: "strict" (the target evicts what the spec would) or "sync" (the
    # spec follows the target's choice after checking it was allowed)
    default_lru: Literal["strict", "sync"] = "strict"
    # why this profile differs from the spec, in a sentence per difference (printed by the target listing)
    notes: tuple[str, ...] = ()
    # strict LRU for targets whose rule is not the spec's page LRU: factory(num_pages, page_size) of an LruModel
    lru_model: Callable[[int, int], LruModel] | None = None
    # whether the target's KV events tell namespaces apart (different hashes for equal tokens in two
    # namespaces); when False, --lru sync replays them as a router that counts repeats would, on token
    # prefixes alone, and --lru strict still asks for distinct hashes
    event_namespaces: bool = True
    # "domain": insert_prefix takes any slot the spec accepts (up to 2**31 - 1); "pool": only slots below
    # num_pages * page_size (the target indexes a pool of that size)
    slot_domain: Literal["domain", "pool"] = "domain"

    @property
    def follows_spec(self) -> bool:
        """True when the spec decides every outcome (exact pages, the caller's slots, the spec's LRU): then the
        machine's model needs no choice of the target, and several such targets run side by side."""
        return (
            self.eviction_unit == "page"
            and self.eviction_trigger == "evict"
            and self.slots == "caller"
            and self.lru_model is None
        )


EXACT = Profile(name="exact (the spec's semantics)")


@dataclass(frozen=True)
class LifecycleProfile(Profile):
    """The profile of a request-lifecycle target (an engine's cache as its scheduler drives it): whole nodes or
    blocks evicted when the allocator needs pages, the engine's own clock and pages, no validation of ours (the
    scheduler's checks refuse what it cannot serve); and the engine's named choices where the spec leaves one
    open or the engine differs, one field each ("" where it does as the spec says), printed by the listing."""

    eviction_unit: Literal["page", "node"] = "node"
    eviction_trigger: Literal["evict", "allocate"] = "allocate"
    clock: Literal["logical", "order", "none"] = "order"
    errors: Literal["ours", "any", "none"] = "none"
    slots: Literal["caller", "target"] = "target"
    # which match a request is given (the spec's hit rule: the longest valid match)
    hit: str = ""
    # how pages (blocks) are allocated, shared, freed and evicted, and in how many pools
    pages: str = ""
    # what a sliding-window group caches and frees while a request runs
    window: str = ""
    # where recurrent states are matched, copied and checkpointed
    state: str = ""
    # what happens to a prefix cached twice (a request's copy of pages another cached meanwhile)
    duplicates: str = ""
    # EAGLE's speculative keys and blocks
    eagle: str = ""
    # what the KV events carry (namespaces, offsets)
    events: str = ""
    # the configuration choices the target draws per example (the summary counts each)
    drawn: str = ""

    def choices(self) -> list[tuple[str, str]]:
        """The named choices this profile states, as (name, what the engine does)."""
        names = ("hit", "pages", "window", "state", "duplicates", "eagle", "events", "drawn")
        return [(name, value) for name in names if (value := getattr(self, name))]


@runtime_checkable
class PrefixCacheTarget(Protocol[H]):
    """A prefix cache seen through lists and ints. What it may offer beyond this is a capability, a protocol of
    its own (``Evicts``, ``Resets``, ``ChecksIntegrity``, ``ShowsPages``, ``ShowsStamps``, ``TakesEvents``,
    ``CountsMetrics``, ``MeasuresDepth``, ``ChecksItsChecks``, and the differential ``ExactCache``), resolved
    once into ``CacheCapabilities`` when a machine sets the target up."""

    profile: Profile
    page_size: int

    def match_prefix(self, tokens: list[int], namespace: Namespace) -> H:
        """The longest cached page-aligned prefix: a handle."""

    def insert_prefix(self, tokens: list[int], indices: list[int] | None, namespace: Namespace) -> tuple[int, H]:
        """Cache the whole pages of ``tokens``: (tokens already cached before the call, handle of the whole path)."""

    def cached_len(self, handle: H) -> int:
        """Matched tokens of a handle."""

    def get_matched_indices(self, handle: H) -> list[int]:
        """Slots of a handle's path in sequence order."""

    def lock(self, handle: H) -> None:
        """Protect the handle's path from eviction."""

    def unlock(self, handle: H) -> None:
        """Release one lock of the handle's path."""

    def size_info(self) -> tuple[int, int]:
        """(evictable tokens, protected tokens)."""

    def take_evicted(self) -> list[list[int]]:
        """Slots the cache gave back since the last call, one list per eviction unit, in eviction order."""


# ---------------------------------------------------------------- the optional capabilities of a cache target


@runtime_checkable
class Evicts(Protocol):
    """Eviction on request (``eviction_trigger == "evict"``); the slots come back through ``take_evicted``."""

    def evict(self, size: int) -> None: ...


@runtime_checkable
class Resets(Protocol):
    """``reset()`` (``reset != "none"``): empty the cache, the slots it held returned when the profile says so."""

    def reset(self) -> Sequence[int]: ...


@runtime_checkable
class ChecksIntegrity(Protocol):
    """Its own invariants: ``check_integrity()`` raises on a broken one."""

    def check_integrity(self) -> None: ...


@runtime_checkable
class ShowsPages(Protocol):
    """Introspection: the whole content, ``{PageKey: first slot}``, compared with the spec's after every step."""

    def cached_pages(self) -> dict[PageKey, int]: ...


@runtime_checkable
class ShowsStamps(Protocol):
    """Its clock: ``{PageKey: number}``, its last access of each page (when ``clock != "none"``)."""

    def page_stamps(self) -> Mapping[PageKey, float]: ...


@runtime_checkable
class TakesEvents(Protocol):
    """KV events emitted since the last call, as spec.events' (spec.events.from_block_events converts vLLM-style
    ones): replayed after every step, the replay must give exactly the cached pages."""

    def take_events(self) -> list[Event]: ...


@runtime_checkable
class RouterTarget(Protocol):
    """A cache-aware router's index of its workers' caches (NVIDIA Dynamo's ``RadixTree``, ours), fed with each
    worker's KV event batches as the worker publishes them (``radixspec.optimized.kv_events``: msgpack, vLLM's
    format). The router machine (``radixspec.fuzz.router_machine``) checks it against the workers' own pages
    (``radixspec.spec.router``'s laws)."""

    name: str
    page_size: int

    def apply(self, worker: int, payload: bytes) -> None:
        """One event batch a worker published, through the router's own relay; raises when it cannot apply it."""

    def scores(self, tokens: list[int], namespace: Namespace) -> dict[int, int]:
        """Per worker, how many leading pages of the prompt the router believes it holds (zero scores absent)."""

    def live(self) -> dict[int, set[Hashable]]:
        """Per worker holding any, the pages the index holds, as PageKeys (an entry the router cannot name so,
        e.g. a block it was never sent, as some other hashable: always a stale entry to the laws)."""

    def entry_of(self, key: PageKey) -> Hashable:
        """What the index keys a page by (for ``router_namespaces_apart``)."""

    def remove_worker(self, worker: int) -> None:
        """Forget every page of a worker (it left, or restarts empty)."""


@runtime_checkable
class CountsMetrics(Protocol):
    """spec/metrics.py's counters: compared between targets that count, conserved per namespace."""

    def stats(self) -> CacheStats: ...


@runtime_checkable
class MeasuresDepth(Protocol[H_contra]):
    """The depth in radix nodes of a handle's path (for the reach)."""

    def path_nodes(self, handle: H_contra) -> int: ...


@runtime_checkable
class CountsPages(Protocol):
    """A manager that tells how many pages its cache holds (for the reach: the largest tree)."""

    def cached_page_count(self) -> int: ...


@runtime_checkable
class ChecksItsChecks(Protocol):
    """A tree whose own integrity check is checked: a field of one node changed by ``delta`` (``True``; None
    when no such node; ``False`` when refused), its check then names one of ``own_invariants``."""

    # (field, change) pairs each of which breaks an invariant whatever the node
    breakable_fields: tuple[tuple[str, int], ...]
    own_invariants: tuple[str, ...]

    def break_invariant(self, field: str, which: int, position: int, delta: int) -> bool | None: ...

    def check_integrity(self) -> None: ...


@dataclass(frozen=True)
class CacheCapabilities(Generic[H]):
    """What a cache target offers beyond the protocol, resolved once when a machine sets it up: each field is the
    target itself, typed by that capability, or None. Rules read these; none probes a target's attributes."""

    exact: ExactCache[H] | None
    evicts: Evicts | None
    resets: Resets | None
    integrity: ChecksIntegrity | None
    pages: ShowsPages | None
    stamps: ShowsStamps | None
    events: TakesEvents | None
    metrics: CountsMetrics | None
    depth: MeasuresDepth[H] | None
    own_checks: ChecksItsChecks | None

    @classmethod
    def of(cls, target: PrefixCacheTarget[H]) -> CacheCapabilities[H]:
        return cls(
            exact=target if isinstance(target, ExactCache) else None,
            evicts=target if isinstance(target, Evicts) else None,
            resets=target if isinstance(target, Resets) else None,
            integrity=target if isinstance(target, ChecksIntegrity) else None,
            pages=target if isinstance(target, ShowsPages) else None,
            stamps=target if isinstance(target, ShowsStamps) else None,
            events=target if isinstance(target, TakesEvents) else None,
            metrics=target if isinstance(target, CountsMetrics) else None,
            depth=target if isinstance(target, MeasuresDepth) else None,
            own_checks=target if isinstance(target, ChecksItsChecks) else None,
        )


# a cache target's optional methods (the machines look each up on the target; none is listed here): evict(size)
# and reset() a profile promises (eviction_trigger == "evict",
# reset != "none"; checked when a target is resolved: promised_methods in fuzz/targets/__init__.py); the others
# a target offers at will: check_integrity() (raise on a broken invariant); cached_pages() -> {PageKey: first
# slot} (the whole content, compared with the spec's after every step); page_stamps() -> {PageKey: number}
# (the target's clock, when clock != "none"); take_events() -> the KV events emitted since the last call, as
# spec.events' (spec.events.from_block_events converts vLLM-style ones), replayed after every step: the replay
# must give exactly the cached pages


@runtime_checkable
class ExactCache(PrefixCacheTarget[H], Protocol[H]):
    """The differential capability: a target that exposes the spec's abstract state is compared with the spec
    state for state, its rejections message for message, its events hash for hash (ours: the spec's hashes).
    It may also offer ``stats()`` (spec/metrics.py: compared between such targets) and ``path_nodes(handle)``
    (the depth in radix nodes, for the reach)."""

    name: str

    def evict(self, size: int) -> None:
        """Evict exactly ceil(size / P) pages; their slots, ascending, are the next take_evicted() unit."""

    def reset(self) -> list[int]:
        """Empty the cache: every slot it held, ascending."""

    def check_integrity(self) -> None:
        """Raise IntegrityError naming a broken invariant."""

    def abstract_state(self) -> pc.PrefixCacheState:
        """The spec's state this cache's state means (the abstraction function)."""

    def fingerprint(self) -> Hashable:
        """Cheap parts of the state (sizes, clock): what big trees compare around a rejected call."""

    def take_events(self) -> list[Event]:
        """The KV events emitted since the last call."""


@runtime_checkable
class CacheManagerTarget(Protocol[R, H]):
    """A CacheManager seen through lists and ints; requests (``R``) are whatever ``new_req`` returns."""

    profile: Profile
    page_size: int
    num_pages: int

    def new_req(self, prompt: list[int], table_idx: int, namespace: Namespace, uid: int) -> R:
        """A request of ``prompt`` using page-table row ``table_idx`` (not admitted yet)."""

    def match_req(self, req: R) -> H:
        """Match the request's prompt but its last token: a handle."""

    def lock(self, handle: H) -> None: ...
    def unlock(self, handle: H) -> None: ...
    def cached_len(self, handle: H) -> int: ...

    def get_matched_indices(self, handle: H) -> list[int]:
        """Slots of a handle's path."""

    def available_size(self) -> int:
        """Tokens an allocation may use now (free pages plus evictable cache)."""

    def admit(self, req: R, handle: H) -> None:
        """Give the request its locked handle and write the matched slots into its row."""

    def set_lengths(self, req: R, cached_len: int, device_len: int) -> None: ...
    def append_token(self, req: R, token: int) -> None: ...
    def allocate_paged(self, reqs: Sequence[R]) -> None: ...
    def cache_req(self, req: R, finished: bool) -> None: ...
    def lazy_free_region(self) -> AbstractContextManager[None]: ...

    def row(self, req: R) -> list[int]:
        """The request's page-table row up to its allocated length."""

    def handle_of(self, req: R) -> H:
        """The request's current cache handle."""

    def free_pages(self) -> list[int]:
        """Page starts on the free list (lazily freed ones included)."""

    def cached_slots(self) -> list[int]:
        """First slot of every cached page."""

    def size_info(self) -> tuple[int, int]:
        """(evictable tokens, protected tokens) of its prefix cache."""


@runtime_checkable
class ExactManager(CacheManagerTarget[R, H], Protocol[R, H]):
    """The differential capability of a manager: its abstract state is related to the spec's by each
    operation's relation (spec/cache_manager.py), its integrity check and events are checked, and such managers
    must agree with each other state for state and row for row."""

    name: str

    def check_integrity(self, live_reqs: Sequence[R]) -> None: ...

    def abstract_state(self) -> sm.ManagerState:
        """The spec's manager state this manager's state means."""

    def view(self, state: sm.ManagerState, req: R) -> sm.RequestView:
        """The request as the spec's relations read it (``state``: this manager's abstract state)."""

    def spec_handle(self, handle: H) -> pc.Handle:
        """The spec handle of the same path."""

    def cached_page_count(self) -> int:
        """Pages the prefix cache holds (from its size counters)."""

    def take_events(self) -> list[Event]:
        """The KV events its prefix cache emitted since the last call."""


class TieredHandle(Protocol):
    """A tiered cache's handle on a device path: the machine reads its length only."""

    @property
    def cached_len(self) -> int: ...


class TieredMatchView(Protocol):
    """What a tiered cache's match_prefix returns (spec/tiers.py: TieredMatch)."""

    @property
    def handle(self) -> TieredHandle: ...
    @property
    def device_len(self) -> int: ...
    @property
    def host_len(self) -> int: ...
    @property
    def storage_len(self) -> int: ...


class TieredInserted(Protocol):
    """What a tiered cache's insert_prefix returns (spec/tiers.py: TieredInsertResult)."""

    @property
    def cached_len(self) -> int: ...
    @property
    def handle(self) -> TieredHandle: ...


class StoreOutput(NamedTuple):
    """What an offloading manager answers a store offer: the keys it stores (in the offer's order), the slot of
    each, and the chunks it evicted for them."""

    new: tuple[PageKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[PageKey, ...]


class OffloadTarget(Protocol):
    """A KV-offloading manager's host tier, the offload layer's target (``spec/offload.py``), driven as a scheduler
    drives it: per request ``begin`` (its keys, in prefix order), lookups, at most one load of its hit, store
    offers, ``finish``; the machine, as the executor, ends each job later. A job's completion names its keys."""

    # the configuration it took of the drawn one (e.g. its eviction policy), for the summary
    config: str
    # it stores a key once offered this many times, counting the offers of at most tracker_size keys
    # (spec/offload.py's record_offer)
    threshold: int
    tracker_size: int

    def begin(self, request: int, keys: Sequence[PageKey]) -> None: ...
    def lookup(self, request: int, key: PageKey) -> Literal["miss", "pending", "hit"]: ...
    def prepare_store(self, request: int, keys: Sequence[PageKey]) -> StoreOutput | None: ...
    def complete_store(self, request: int, keys: Sequence[PageKey], success: bool) -> None: ...
    def prepare_load(self, request: int, keys: Sequence[PageKey]) -> Sequence[int]: ...
    def complete_load(self, request: int, keys: Sequence[PageKey]) -> None: ...
    def finish(self, request: int) -> None: ...
    def reset(self) -> None: ...
    def take_events(self) -> list[tuple[PageKey, bool]]:
        """The events published since the last call, as (key, removed); cleanups of failed stores left out."""

    def view(self) -> OffloadView:
        """Its chunks (key -> slot and pins, ``spec.offload.PENDING`` while stored) and its free slots."""

    def check_integrity(self) -> None:
        """The manager's own accounting (IntegrityError naming what broke)."""


# where a page of KV lives, in the planner layer's transfers: a device page, a host block, a storage object's key, a
# page of the pool that keeps a preempted request's pages (its snapshot)
Tier = Literal["device", "host", "storage", "snapshot"]


@dataclass(frozen=True)
class Transfer:
    """One transfer a planner asks its executor for: copy each (source, destination) pair, then report ``op``
    done. ``kind``: "backup" (device -> host), "load" (host -> device: its data must land before the forward of
    the plan that asked for it), "put" (host -> storage), "get" (storage -> host), "query" (which storage keys
    exist; ``pairs`` holds (key, key)), "snapshot" (device -> snapshot: a preempted request's pages), "restore"
    (snapshot or host -> device, per pair: ``sources``; lands before the forward as a load does). ``pinned``: the
    planner keeps the sources from being reused until the report, so the copy may run at any moment before it."""

    op: Hashable
    kind: Literal["backup", "load", "put", "get", "query", "snapshot", "restore"]
    pairs: tuple[tuple[Hashable, Hashable], ...]
    pinned: bool = True
    # per pair, the tier its source lies in, where the kind does not say (a restore's)
    sources: tuple[Tier, ...] | None = None
    # a load or restore the forward of its plan reads; False: the planner runs no pass on its destinations until
    # its report, so it may land as late as that (vLLM's asynchronous loads)
    awaited: bool = True

    def tiers(self, pair: int) -> tuple[Tier, Tier]:
        """The tier pair ``pair``'s source lies in and the tier its destination lies in."""
        source, destination = TRANSFER_TIERS[self.kind]
        return (self.sources[pair] if self.sources else source), destination


TRANSFER_TIERS: dict[str, tuple[Tier, Tier]] = {
    "backup": ("device", "host"),
    "load": ("host", "device"),
    "put": ("host", "storage"),
    "get": ("storage", "host"),
    "query": ("storage", "storage"),
    "snapshot": ("device", "snapshot"),
    "restore": ("snapshot", "device"),
}
# the kinds whose data must land before the forward of the plan that asks for them, and those storage runs (copied
# when reported)
LANDS_BEFORE_FORWARD = ("load", "restore")
STORAGE_KINDS = ("put", "get", "query")


@dataclass(frozen=True)
class Pass:
    """One request's part of a forward: it computes positions ``[start, start + count)`` of its tokens (``inputs``,
    as the planner sent them) and attends every position before; ``pages`` is its page table row (position j lies
    in ``pages[j // page_size]``). ``extend``: a prefill chunk (else a decode step). ``windows``: the rows of its
    sliding-window groups, each with its window ``W`` (layers whose query at position q attends ``(q - W, q]``):
    every position it computes is written to each row too, and the positions before it read from a row are only
    the last ``W - 1`` (the rest of such a row may be the null page). ``state``: the slots of its recurrent state
    group (source, destination): the pass reads the state after its first ``start`` positions from the source (0:
    from the destination, in place) and writes the state after ``start + count`` to the destination."""

    request: str
    start: int
    count: int
    inputs: tuple[int, ...] | None
    pages: tuple[int, ...]
    extend: bool
    windows: tuple[tuple[tuple[int, ...], int], ...] = ()
    state: tuple[int, int] | None = None

    def rows(self) -> tuple[tuple[tuple[int, ...], int | None], ...]:
        """Each row with its window (None: full attention, every position before attended)."""
        return ((self.pages, None), *self.windows)


@dataclass(frozen=True)
class Plan:
    """What a planner asks for in one step: transfers; device page copies (source, destination), pages to zero and
    state slots to reset to the initial state (``fresh``), all before the forward; the forward's passes; the
    requests it aborted. ``flush``: transfers in flight (this
    plan's or earlier ones, by ``op``) whose copies must run before anything of this plan (the planner reuses their
    sources now: vLLM's ``jobs_to_flush``); ``restarted``: requests whose KV the planner dropped (preempted), which
    start again at a hit."""

    transfers: tuple[Transfer, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    zeros: tuple[int, ...] = ()
    passes: tuple[Pass, ...] = ()
    aborted: tuple[str, ...] = ()
    flush: tuple[Hashable, ...] = ()
    restarted: tuple[str, ...] = ()
    fresh: tuple[int, ...] = ()


@dataclass(frozen=True)
class BlockEvent:
    """A KV event a planner published: a block stored on the device (its hash, its parent's, its tokens) or
    removed (its hash), or every block cleared (``hash`` None)."""

    kind: Literal["stored", "removed", "cleared"]
    hash: Hashable | None = None
    parent: Hashable | None = None
    tokens: tuple[int, ...] = ()


class KnownFinding(Exception):
    """A planner crashed in a way its profile names (a known finding of docs/findings.md, pinned by its reproducer):
    the planner machine counts it and goes on with a new planner, so a campaign keeps finding what else there is.
    The message says which finding."""


class PlannerTarget(Protocol):
    """An engine's scheduler that plans its own batches and transfers (TokenSpeed's), the planner layer's target:
    the machine submits requests, asks for plans and plays the executor and the model (it runs the transfers and
    the forward, reports each transfer done or failed, and each pass's sampled tokens)."""

    # the configuration it took of the drawn one, for the summary
    config: str
    page_size: int
    # the most tokens (prompt and sampled) one request may reach: longer ones are refused at submission
    max_request_tokens: int
    # overlap scheduling: it plans the next forward before the last one's sampled tokens are reported, which the
    # machine then reports a forward late
    overlap: bool
    # its KV events may store a block under a parent they never stored or removed before: the known finding that
    # stands for ("finding 19"), counted in the summary; None: such a block fails events_replay_to_the_cache
    orphans: str | None
    # its device caches what it computes and loads, so every full page of a hit is a block its events published;
    # False: it caches nothing on the device (vLLM with prefix caching off), its hits come from another tier
    publishes_hits: bool
    # its device may cache one prefix in several blocks and publish each (vLLM's pool, when two requests compute it
    # at once): a hash stored again is one more copy, removed before the hash is; False: a hash stored twice fails
    duplicates: bool
    # it takes a reset while requests run and transfers are in flight, clearing its host tier whatever its device
    # says (vLLM's reset_prefix_cache(reset_connector=True)); False: a reset only when idle
    resets_busy: bool
    # whether its last reset cleared its host tier: a planner may keep it while its transfers run (vLLM's
    # SimpleCPUOffloadConnector refuses then, and its reset returns False), and it serves it on
    host_cleared: bool

    def submit(self, request: str, tokens: Sequence[int], max_new: int) -> None: ...
    def plan(self) -> Plan: ...
    def done(self, transfer: Transfer, ok: Sequence[bool]) -> None:
        """``transfer`` ended: per pair, whether it was copied (a query: whether the key exists)."""

    def result(self, request: str, tokens: Sequence[int]) -> None:
        """The tokens a request's pass sampled ([] for a prefill chunk that is not its last)."""

    def finish(self, request: str) -> None: ...
    def abort(self, request: str) -> None: ...
    def reset(self) -> bool:
        """Drop the device and host tiers when nothing is in use; whether it did."""

    def take_events(self) -> list[BlockEvent]: ...
    def check_integrity(self, quiescent: bool) -> None:
        """The planner's own accounting (IntegrityError naming what broke); ``quiescent``: no request is live and
        no transfer in flight, so nothing may be pinned or in use."""

    def reach(self) -> Mapping[str, int]:
        """Sizes for the summary's reach (pages cached per tier, ...)."""


class TieredCacheTarget(Protocol):
    """A tiered cache, the tiered layer's target: spec/tiers.py's operations by their names (the transfers it
    starts are ended by the caller: complete_transfer, fail_transfer) and its abstract state."""

    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> TieredMatchView: ...
    def insert_prefix(
        self, input_ids: Sequence[int], indices: Sequence[int], namespace: Namespace = None
    ) -> TieredInserted: ...
    def lock(self, handle: TieredHandle) -> None: ...
    def unlock(self, handle: TieredHandle) -> None: ...
    def allocate(self, num_pages: int) -> list[int]: ...
    def free(self, pages: Sequence[int]) -> None: ...
    def evict_device(self, num_pages: int) -> list[int]: ...
    def evict_host(self, num_pages: int) -> list[int]: ...
    def write_back(self, num_pages: int) -> list[int]: ...
    def load_back(self, input_ids: Sequence[int], namespace: Namespace = None) -> int | None: ...
    def prefetch(self, input_ids: Sequence[int], namespace: Namespace = None) -> int | None: ...
    def complete_transfer(self, transfer_id: int) -> None: ...
    def fail_transfer(self, transfer_id: int) -> None: ...
    def set_storage_online(self, online: bool) -> None: ...
    def reset(self) -> None: ...
    def abstract_state(self) -> TieredState: ...


class LifecycleTarget(Protocol):
    """A request-lifecycle manager, the hybrid layer's target: an engine's cache as its scheduler drives it, or our
    hybrid manager (``reference/hybrid_manager.py``) over one of our hybrid caches. The hybrid machine makes these
    calls; what the lifecycle laws read of it is ``fuzz/lifecycle.py``'s ``LifecycleView`` and its optional views.
    A call refuses what the engine cannot serve with a spec error and nothing changed (``OutOfPagesError``: not
    admitted, not allocated)."""

    page_size: int

    @property
    def windows(self) -> tuple[Window, ...]:
        """Each group's window (None: full attention), of the drawn ones those the target took."""

    def match_req(self, req: HybridReq) -> None:
        """Match the prompt less its last token, lock the hit, give the request its rows up to it."""

    def allocate_paged(self, req: HybridReq, length: int) -> None:
        """Pages (per group) for the request's tokens up to ``length``."""

    def store(self, req: HybridReq, tokens: int) -> None:
        """The KV of ``tokens`` more tokens computed and stored."""

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        """Cache what the request computed; when ``finished``, release it."""

    def check_integrity(self, live_reqs: list[HybridReq]) -> None:
        """The engine's own checks (IntegrityError naming what broke)."""


@dataclass(frozen=True)
class TargetInfo:
    """How to make a target, and what it needs: one entry of ``radixspec fuzz --list-targets``."""

    # the name --target takes
    name: str
    # one line for the listing
    description: str
    # packages that must be installed (found, not imported: their __init__ may not import here), with how to get them
    requires: tuple[tuple[str, str], ...] = ()
    # makes the prefix cache: factory(page_size, num_pages) -> PrefixCacheTarget (the caller's slots, or the
    # target's own pages, lie below num_pages * page_size); None when the target has no prefix cache
    cache_factory: Callable[[int, int], PrefixCacheTarget[Any]] | None = None
    # makes the manager: factory(num_pages, page_size, rows, max_seq_len) -> CacheManagerTarget
    manager_factory: Callable[[int, int, int, int], CacheManagerTarget[Any, Any]] | None = None
    # makes a hybrid cache manager (several attention groups): factory(page_size, windows, num_pages) -> an object
    # with reference/hybrid_manager.py's methods (match_req, allocate_paged, store, cache_req, check_integrity)
    # and its ``windows`` (those it took of the drawn ones); None when the target has no hybrid layer
    hybrid_factory: Callable[[int, tuple[Window, ...], int], LifecycleTarget] | None = None
    # its hybrid managers are tiered and the machine runs their transfers (``execute``, ``flush``: HiCache's), so
    # the hybrid machine with the executor's rules drives it (fuzz/hybrid_executor.py)
    executes: bool = False
    # ours only: makes the hybrid cache (reference/hybrid_manager.py's HybridCache) that our hybrid manager runs
    # over: factory(page_size, windows); the hybrid machine drives each beside the spec's, caches and managers
    hybrid_cache: Callable[[int, tuple[Window, ...]], HybridCache] | None = None
    # makes a router's index of many workers' caches: factory(page_size) -> RouterTarget; None when not a router
    router_factory: Callable[[int], RouterTarget] | None = None
    # makes a tiered cache (device, host, storage): factory(page_size, device_pages, host_pages, storage_pages,
    # policy, threshold) -> TieredCacheTarget; None when the target has no tiered layer
    tiered_factory: Callable[[int, int, int, int, WritePolicy, int], TieredCacheTarget] | None = None
    # makes a KV-offloading manager's host tier: factory(capacity, draw) -> OffloadTarget, ``draw`` a number the
    # target maps to one of its configurations (its eviction policies); None when the target has none
    offload_factory: Callable[[int, int], OffloadTarget] | None = None
    # makes a planner (a scheduler that plans its own batches and transfers): factory(draw) -> PlannerTarget,
    # ``draw`` a number the target maps to one of its configurations; None when the target has none
    planner_factory: Callable[[int], PlannerTarget] | None = None
    # the profile both factories' targets declare (for the listing before anything is built)
    profile: Profile = EXACT
    # extra words for the listing (e.g. how to install it)
    how: str = ""
    # page sizes this target accepts (None: any)
    page_sizes: tuple[int, ...] | None = None
    # imports the target's modules (with their shims) to prove it works here; raises ImportError otherwise
    probe: Callable[[], object] | None = field(default=None, compare=False)
    # the engine's cache modules whose lines and branches ``--coverage`` measures (dotted names of Python files);
    # empty when the engine's cache is compiled or ours
    engine_modules: tuple[str, ...] = ()


def mix(n: int) -> int:
    """A pool size's bits spread over a hybrid target's configuration choices (Knuth's multiplicative hash)."""
    return (n * 2654435761) % 2**32


def choose_from(choices: Sequence[Sequence[object]], draw: int) -> list[object]:
    """The configuration a draw picks, one value of each of ``choices``: the digits of its bits spread (``mix``:
    small draws, which Hypothesis favours, would otherwise leave the last choices at their first values) in the
    mixed radix of ``choices``."""
    picked = []
    value = mix(draw)
    for options in choices:
        value, digit = divmod(value, len(options))
        picked.append(options[digit])
    return picked


def draw_choosing(choices: Sequence[Sequence[object]], picked: Sequence[object]) -> int:
    """A draw that picks ``picked`` (``mix`` undone): tests name a configuration so."""
    value = 0
    for options, one in reversed(list(zip(choices, picked, strict=True))):
        value = value * len(options) + list(options).index(one)
    return value * pow(2654435761, -1, 2**32) % 2**32


class TargetError(Exception):
    """A target cannot be used: unknown name, missing package, bad factory. The message says what to do."""
