"""Target ``vllm-hybrid``: vLLM 0.33.0's ``HybridKVCacheCoordinator`` over one ``BlockPool``, full-attention and
sliding-window groups (two to four: a model's layers split into groups of one kind each, several of the same
window too), driven request by request as ``KVCacheManager`` drives it.

The calls and their order are ``KVCacheManager``'s (``vllm/v1/core/kv_cache_manager.py``, read, not
imported: its module needs vLLM's metrics): ``find_longest_cache_hit`` on the request's block hashes
with the last token left out; then, for every chunk, ``remove_skipped_blocks`` of the tokens already
computed, ``get_num_blocks_to_allocate``, ``allocate_new_computed_blocks`` (first chunk, on a hit),
``allocate_new_blocks`` and, once the chunk's KV is stored, ``cache_blocks``; ``free`` when the request
ends. Scheduling is synchronous (no tokens in flight); the block size is the page size.

Each example draws a configuration, counted in the summary: EAGLE (off, the drop, lookahead hashes); the
window groups' retention of prefix-cache checkpoints (``prefix_cache_retention_interval``: 0, vLLM's default,
keeps only a prompt's replay boundary and the shared-prefix junctions; None keeps every block; k * P one tail
per k blocks); the scheduler's deferred frees (``defer_block_free``: a finished request's blocks are popped
and go back to the pool only when the step in flight completes, here the next chunk stored).

The machine checks what holds whatever vLLM chooses (docs/hybrid.md):

* the hit is the longest valid match length (``spec/hybrid.py``) of what the pool caches per group at
  that moment, at most the prompt less its last token;
* the lifecycle laws (``fuzz/lifecycle.py``), to which this shows its rows (a block's slots), its one pool
  for every group, the worker's copy-on-write copies and the cached blocks: the safety law (every page a live
  request still attends is a real block in its list); each attended block holds the KV of the request's own
  tokens, in its group (a block reused while still attended fails); each cached block holds its prefix's;
* the pool's accounting: a block's ``ref_cnt`` is the number of live requests' lists (and deferred frees)
  that hold it; a block is in the free queue exactly when no one holds it; a block two requests share is a
  cached one;
* the KV events (vLLM's own event classes, when msgspec and pyzmq import): replayed from empty, per group,
  they give exactly the pool's cached entries, with a block as many times as the pool caches it; a
  full-attention group's stream also names each block's tokens and parent (``spec/events.py``'s replay).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections import Counter
from collections.abc import Callable, Sequence
from copy import copy as shallow_copy
from dataclasses import dataclass, replace
from typing import Any, Protocol

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import events as ev
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError, OutOfPagesError

from ..lifecycle import CachedKV, KVCopy, hit_law
from ..stats import STATS
from ..workloads import IMAGE_TOKEN, image_runs
from .api import LifecycleProfile, PageKey, Profile, TargetInfo
from .shims import install
from .vllm import COORDINATOR_MODULES, VERSION, BlockView, RequestStandIn, import_vllm
from .vllm import TARGET as BLOCK_POOL_TARGET

PROFILE = LifecycleProfile(
    name=f"vllm {VERSION} HybridKVCacheCoordinator (full attention + sliding windows)",
    hit="the spec's window rule: cdiv(W - 1, P) contiguous cached blocks end a hit; one block size, so the hit"
    " aligns to P",
    pages="one BlockPool for every group (one free queue): conservation holds for the pool, not per group; a"
    " finished request's blocks go back after the step in flight (deferred frees, drawn)",
    window="remove_skipped_blocks at each allocation frees private and cached window blocks alike; window"
    " groups cache only the tails a later hit can use (prefix_cache_retention_interval: 0, vLLM's default,"
    " the replay boundary and shared-prefix junctions; k * P; dense), drawn",
    duplicates="a prefix recomputed while its cached block sits free is cached twice (no dedup)",
    eagle="off, drop (use_eagle: one block more found, then dropped) or lookahead hashes (0.33.0), drawn",
    events="a window group's BlockStored under sparse retention names fewer hashes than the blocks its tokens"
    " span, and no offsets (vllm#44451, fix open in #44488): replayed by count only",
    drawn="two to four groups, full attention and windows (several of one window too); EAGLE, retention,"
    " deferred frees",
)


@functools.cache
def import_hybrid() -> types.ModuleType:
    """vLLM's coordinator, its two managers and the group specs (on top of the BlockPool's imports; once a
    process)."""
    modules = import_vllm()
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # the registry fills itself from vLLM's config and platforms (not importable here): the two specs by hand
    KVCacheSpecRegistry.register(FullAttentionSpec, FullAttentionManager, uniform_type_base_spec=FullAttentionSpec)
    KVCacheSpecRegistry.register(SlidingWindowSpec, SlidingWindowManager, uniform_type_base_spec=SlidingWindowSpec)
    install(modules, coordinator=kv_cache_coordinator)
    install(modules, full_spec=FullAttentionSpec, window_spec=SlidingWindowSpec)
    install(modules, config=KVCacheConfig, group_spec=KVCacheGroupSpec, tensor=KVCacheTensor)
    return modules


@dataclass(frozen=True)
class Placeholder:
    """vLLM's ``PlaceholderRange``, as the hasher reads it: where an image's placeholder tokens are."""

    offset: int
    length: int


@dataclass(frozen=True)
class ImageFeature:
    """vLLM's ``MultiModalFeatureSpec``, as the hasher reads it: the image's identity (its hash) and place."""

    identifier: str
    mm_position: Placeholder


@dataclass(frozen=True)
class LoRAAdapter:
    """vLLM's ``LoRARequest``, as the prefix hasher and the KV events read it."""

    lora_name: str
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return 1 + sum(map(ord, self.lora_name))


# the one token id vLLM's prompt holds at every image position (the image is told by its multimodal feature)
PLACEHOLDER = IMAGE_TOKEN - 1


class HybridRequest(RequestStandIn):
    """What the coordinator, its managers, the pool and the hasher read of a ``vllm.v1.request.Request``: the
    machine's ``tokens`` with each image (``fuzz/workloads.py``) as vLLM's prompt holds it, its positions one
    placeholder token id and the image a multimodal feature (``tokens`` stays the spec's view)."""

    def __init__(
        self,
        tokens: list[int],
        namespace: Namespace,
        request_id: int,
        hasher: Callable[[RequestStandIn], list[bytes]],
    ) -> None:
        # a namespace ("lora", x) is a LoRA adapter's (the prefix hasher keys by its name and path), any other a
        # cache salt (a tenant's)
        lora = namespace is not None and len(namespace) == 2 and namespace[0] == "lora"
        super().__init__([], None if namespace is None or lora else repr(namespace), request_id)
        if lora and namespace is not None:
            self.lora_request = LoRAAdapter(f"adapter-{namespace[1]!r}", f"/adapters/{namespace[1]!r}")
        self.tokens: list[int] = []
        self.see(tokens)
        self.hasher = hasher
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.shared_prefix_boundary = 0
        # the hashes whose prefixes the manager learnt, with the prefix of the last, and those the replay learnt
        # (its hashes only grow: each is learnt once, not every step)
        self.learnt: tuple[int, pc.Prefix | None] = (0, None)
        self.replay_learnt = 0
        self.rehash()

    def see(self, tokens: list[int]) -> None:
        """The request's tokens are ``tokens`` (its own, extended): vLLM's prompt and features follow."""
        self.tokens[:] = tokens
        runs = image_runs(self.tokens)
        self.all_token_ids[:] = self.tokens
        for _, offset, length in runs:
            self.all_token_ids[offset : offset + length] = [PLACEHOLDER] * length
        self.mm_features = [
            ImageFeature(f"image-{image}", Placeholder(offset, length)) for image, offset, length in runs
        ]

    def rehash(self) -> None:
        """Request.__init__ and append_output_token_ids: hash every new whole block."""
        self.num_tokens = len(self.all_token_ids)
        self.block_hashes.extend(self.hasher(self))


def spec_tokens(event: StoredEvent) -> list[int]:
    """A ``BlockStored``'s tokens as the machine knows them: each image's placeholders told by the block's
    multimodal extra keys (published untagged: ``(identifier, offset in the block)``; a salt is a bare string), as
    a router that keys images reads them. A placeholder no key names stays one (its page none of the machine's)."""
    tokens = list(event.token_ids)
    if PLACEHOLDER not in tokens or not event.extra_keys:
        return tokens
    size = event.block_size
    for index, keys in enumerate(event.extra_keys):
        for key in keys or ():
            if isinstance(key, tuple | list) and len(key) == 2:
                image = IMAGE_TOKEN + int(str(key[0]).removeprefix("image-"))
                position = index * size + max(0, int(key[1]))
                while position < min(len(tokens), (index + 1) * size) and tokens[position] == PLACEHOLDER:
                    tokens[position] = image
                    position += 1
    return tokens


def with_spec_tokens(event: StoredEvent) -> StoredEvent:
    """A ``BlockStored`` with ``spec_tokens`` (the same event where it names no image)."""
    if PLACEHOLDER not in event.token_ids:
        return event
    stored = shallow_copy(event)
    stored.token_ids = spec_tokens(event)
    return stored


def cached_keys(pool: Any) -> list[tuple[BlockView, bytes]]:
    """Every (block, hash key with group) the pool caches: a block's primary key and its partial entries."""
    found = []
    partial = pool.cached_block_hashes_by_block
    for block in pool.blocks[1:]:
        if (key := block.block_hash) is not None:
            found.append((block, key))
        if partial and (keys := partial.get(block.block_id)):
            found += [(block, key) for key in keys]
    return found


class StoredEvent(Protocol):
    """What the replay reads of vLLM's ``BlockStored`` (a hit's re-announcement)."""

    block_hashes: list[object]
    token_ids: list[int]
    block_size: int
    parent_block_hash: object
    group_idx: int | None
    extra_keys: list[tuple[object, ...] | None] | None


class GroupReplay:
    """The pool's KV events replayed from empty, group by group, as a router reads them.

    Every group: how many blocks the stream says hold each hash. A full-attention group's stream is also
    replayed by ``spec/events.py`` (each block's tokens and parent; a block removed after the blocks that
    extend it). A window group's is not: under sparse retention its ``BlockStored`` names one hash for a
    range of many blocks' tokens (vllm#44451, known upstream), and early frees leave no prefix order.
    """

    def __init__(self, kinds: tuple[hy.Window, ...], page_size: int, unit: int, utils: types.ModuleType) -> None:
        self.utils, self.unit = utils, unit
        # a stream with entries inside a block (a hash unit below the block) is counted only
        self.full = {
            group: ev.Replayer(page_size, check_hashes=False, count_repeats=True)
            for group, kind in enumerate(kinds)
            if kind is None and unit == page_size
        }
        self.counts: list[Counter[object]] = [Counter() for _ in kinds]
        # a block hash (as the events name it) -> the page it keys, learnt from each request's hashes
        self.keys: dict[object, PageKey] = {}
        # a block hash -> as the events name it (vLLM's maybe_convert_block_hash reads the environment per call)
        self.converted: dict[bytes, object] = {}
        # a hit re-announced names its null blocks and a partial hit's block too (finding 33): counted, the checks
        # go on
        self.known_reannounced = True

    def external(self, block_hash: bytes) -> object:
        """``block_hash`` as the events name it."""
        found = self.converted.get(block_hash)
        if found is None:
            found = self.converted[block_hash] = self.utils.maybe_convert_block_hash(block_hash)
        return found

    def learn(self, request: HybridRequest, prefix_of: dict[bytes, PageKey]) -> None:
        """The pages ``request``'s block hashes key (``prefix_of``: the manager's, learnt), those not learnt yet."""
        hashes = request.block_hashes
        for index in range(request.replay_learnt, len(hashes)):
            self.keys.setdefault(self.external(hashes[index]), prefix_of[hashes[index]])
        request.replay_learnt = len(hashes)

    def apply(self, events: list[Any], namespace: Namespace) -> None:
        """One operation's events (a stored block is in ``namespace``, the operation's)."""
        STATS.events_replayed += len(events)
        for event in events:
            kind, group = type(event).__name__, getattr(event, "group_idx", None) or 0
            if kind == "AllBlocksCleared":
                for counts in self.counts:
                    counts.clear()
            elif kind == "BlockStored":
                blocks = len(event.token_ids) // max(1, event.block_size)
                if blocks != len(event.block_hashes):
                    if group in self.full:
                        raise IntegrityError(
                            f"events_replay_to_the_pool: a full-attention BlockStored of {blocks} blocks' tokens"
                            f" names {len(event.block_hashes)} hashes"
                        )
                    STATS.record_rule("vllm-hybrid.events[a window BlockStored sparser than its tokens]")
                self.counts[group].update(event.block_hashes)
            elif kind == "BlockRemoved":
                for block_hash in event.block_hashes:
                    if self.counts[group][block_hash] <= 0:
                        raise IntegrityError(
                            f"events_replay_to_the_pool: group {group} removes {ev.describe_hash(block_hash)},"
                            " which its stream does not hold"
                        )
                    self.counts[group][block_hash] -= 1
            if kind == "AllBlocksCleared" or group in self.full:
                for g in self.full if kind == "AllBlocksCleared" else (group,):
                    stored = with_spec_tokens(event) if kind == "BlockStored" else event
                    self.full[g].apply(ev.from_block_events([stored], lambda extra: namespace))

    def reannounced(
        self,
        events: list[StoredEvent],
        request: HybridRequest,
        namespace: Namespace,
        hit: Sequence[Sequence[BlockView]],
        length: int,
    ) -> None:
        """The events of a hit re-announced (``kv_cache_report_mode`` "full"): each names an entry its group's
        stream holds (so a router learns no block the pool does not cache), keyed by the prefix of the tokens it
        carries; the counts do not change (the pool cached nothing new). ``hit``: the hit's blocks per group,
        ``length`` its tokens. Finding 33, counted where ``known_reannounced``: a null block of the hit (a window's
        skipped block, a state group's block before its state) named all the same, and the block a hit inside a
        block ends in named by its whole block's hash, which the pool need not cache."""
        STATS.events_replayed += len(events)
        for event in events:
            group = getattr(event, "group_idx", None) or 0
            if type(event).__name__ != "BlockStored" or event.parent_block_hash is not None:
                raise IntegrityError(
                    f"reannounced_blocks_are_cached: a hit re-announced for request {request.request_id} emits"
                    f" {type(event).__name__} (parent {event.parent_block_hash!r}), not a BlockStored from the start"
                )
            tokens = spec_tokens(event)
            pages = [tuple(tokens[start : start + self.unit]) for start in range(0, len(tokens), self.unit)]
            per_block = max(1, event.block_size // self.unit)
            prefix: pc.Prefix | None = None
            for index, block_hash in enumerate(event.block_hashes):
                for page in pages[index * per_block : (index + 1) * per_block]:
                    prefix = pc.Prefix.extend(prefix, page)
                if self.counts[group][block_hash] > 0 and self.keys.get(block_hash) == (namespace, prefix):
                    continue
                null = index < len(hit[group]) and hit[group][index].is_null
                if self.known_reannounced and (null or (index + 1) * event.block_size > length):
                    STATS.record_rule(f"vllm-hybrid.known: {FINDING_33}")
                else:
                    held = "held" if self.counts[group][block_hash] > 0 else "not held"
                    raise IntegrityError(
                        f"reannounced_blocks_are_cached: request {request.request_id}'s hit re-announces block"
                        f" {index} of group {group} ({ev.describe_hash(block_hash)}, {held} by the stream) for"
                        f" {len(event.token_ids)} tokens; the pool caches no such entry of that prefix"
                    )

    def check(self, pool: Any) -> None:
        """The replay holds exactly the pool's cached entries, per group, as many times as the pool holds each."""
        held: list[Counter[object]] = [Counter() for _ in self.counts]
        for _, key in cached_keys(pool):
            held[self.utils.get_group_id(key)][self.external(self.utils.get_block_hash(key))] += 1
        for group, (counts, cached) in enumerate(zip(self.counts, held, strict=True)):
            if +counts != cached:
                stale, unseen = counts - cached, cached - counts
                raise IntegrityError(
                    f"events_replay_to_the_pool: group {group}: {sum(stale.values())} blocks stored and never"
                    f" removed, {sum(unseen.values())} cached blocks never announced"
                )
            if group in self.full:
                ev.events_match_cache(self.full[group].cached(), {self.keys[h]: ev.UNKNOWN_SLOT for h in cached})


class Match:
    """The request's hit, in the place of a handle (``cached_len``)."""

    def __init__(self, cached_len: int) -> None:
        self.cached_len = cached_len


class StateGroup(Protocol):
    """A group of recurrent states beside the attention groups (vLLM's Mamba group in ``align`` mode:
    ``vllm_mamba.MambaGroup``), as the manager calls it where such a group changes what it does."""

    # its index among the groups, once the manager has built them
    group: int

    def kinds(self, windows: Sequence[hy.Window]) -> tuple[hy.Window, ...]: ...

    def spec(self, m: VllmHybridManager, v: types.ModuleType) -> object: ...

    def chunk(self, m: VllmHybridManager, uid: int, request: HybridRequest, length: int) -> int: ...

    def stored(self, uid: int, computed: int, tokens: int) -> int: ...

    def write(
        self, m: VllmHybridManager, request: HybridRequest, namespace: Namespace, begin: int, end: int
    ) -> None: ...

    def copy(self, source: BlockView, copy: BlockView) -> None: ...

    def matched(self, m: VllmHybridManager, req: HybridReq) -> None: ...

    def took_finding_15(self, m: VllmHybridManager, request: HybridRequest, hit: int) -> bool: ...

    def finished(self, uid: int) -> None: ...

    def check(self, m: VllmHybridManager, live_reqs: list[HybridReq]) -> None: ...


class VllmHybridManager:
    """vLLM's hybrid coordinator behind the hybrid manager's methods (``reference/hybrid_manager.py``), with a
    Mamba group where one is given (``mamba``), under the target's ``profile``."""

    # the driver checks every allocation against the free blocks first (OutOfPagesError): anything else that
    # escapes vLLM's calls is a crash, not a refusal
    raises_only_cache_errors = True

    def __init__(
        self,
        page_size: int,
        windows: tuple[hy.Window, ...],
        num_pages: int,
        eagle: str = "off",
        retention: int | None = None,
        defer_free: bool = False,
        unit: int | None = None,
        mamba: StateGroup | None = None,
        profile: Profile = PROFILE,
    ) -> None:
        # the Mamba group, where the model has linear-attention layers (vllm_mamba.py)
        self.mamba, self.profile = mamba, profile
        v = import_hybrid()
        # EAGLE as the scheduler configures it: off; "drop" (no lookahead hashes: a KV connector, or
        # disable_lookahead_block_hashes; the coordinator finds one block more and drops it); "lookahead"
        # (0.33.0's default: each block hash also covers the next token, nothing dropped)
        if eagle == "lookahead" and not lookahead_hashes(v):
            eagle = "drop"
        self.eagle, self.retention, self.defer_free = eagle, retention, defer_free
        lookahead = int(eagle == "lookahead")
        self.page_size, self.num_pages = page_size, num_pages
        # the hash unit (prefix_match_unit, a divisor of P): block hashes are computed every unit tokens
        self.unit = page_size if unit is None else unit
        self.windows = self.group_kinds(windows)
        if self.mamba is not None:
            self.mamba.group = self.windows.index(hr.STATE)
        specs = [self.group_spec(v, kind) for kind in self.windows]
        layers = [f"layer{group}" for group in range(len(specs))]
        page_bytes = page_size * 2 * 4
        config = v.config(
            num_blocks=num_pages + 1,  # block 0 is the null block
            kv_cache_tensors=[
                v.tensor(size=page_bytes * (num_pages + 1), layers=layers, layer_stride=0, block_stride=page_bytes)
            ],
            kv_cache_groups=[
                v.group_spec(layer_names=[layer], kv_cache_spec=spec) for layer, spec in zip(layers, specs, strict=True)
            ],
            prefix_cache_retention_interval=retention,
        )
        self.max_len = 1 << 16
        # the pool's KV events, replayed as a router would (vLLM's event classes import with msgspec and pyzmq)
        self.events = v.kv_events is not None
        self.coordinator = v.coordinator.get_kv_cache_coordinator(
            kv_cache_config=config,
            max_model_len=self.max_len,
            max_in_flight_tokens=self.max_len,
            use_eagle=eagle == "drop",
            enable_caching=True,
            enable_kv_cache_events=self.events,
            dcp_world_size=1,
            pcp_world_size=1,
            scheduler_block_size=page_size,
            hash_block_size=self.unit,
            **({"num_hash_lookahead_tokens": lookahead} if lookahead else {}),
        )
        self.pool = self.coordinator.block_pool
        self.utils = v.utils
        self.hasher = v.utils.get_request_block_hasher(self.unit, v.hash_fn, *([lookahead] if lookahead else []))
        # the hit rule: hits land on the coordinator's alignment (the hash unit where partial hits are on, else
        # the block); with the drop, the coordinator looks one unit past the limit
        alignment = getattr(self.coordinator, "_cache_hit_alignment_tokens", page_size)
        self.rule = hr.HitRule(page_size, self.windows, alignment, lookahead=lookahead, drop=int(eagle == "drop"))
        self.empty = tuple(() for _ in specs)
        self.requests: dict[int, HybridRequest] = {}
        self.namespaces: dict[int, Namespace] = {}
        # every group's blocks come from the one pool; the copies the worker made, until the machine reads them
        self.kv_pools = (0,) * len(self.windows)
        self.kv_copies: list[KVCopy] = []
        # a block hash -> (namespace, tokens, length): the prefix it names is tokens[:length]
        self.prefix_of: dict[bytes, PageKey] = {}
        # a cached key (hash with group) -> its group, namespace and prefix (``entries``, read after every step)
        self.entry_of: dict[bytes, tuple[int, Namespace, pc.Prefix]] = {}
        # finished requests' blocks the scheduler has not given back yet: (the chunk count that frees them, blocks)
        self.deferred: list[tuple[int, list[BlockView]]] = []
        self.chunks = 0
        self.replay = GroupReplay(self.windows, page_size, self.unit, self.utils) if self.events else None

    @property
    def partial_hits(self) -> bool:
        """Hits inside a block are on (the coordinator found every group able to look them up)."""
        return bool(getattr(self.coordinator, "enable_partial_hash_hits", False))

    def group_kinds(self, windows: Sequence[hy.Window]) -> tuple[hy.Window, ...]:
        """The groups this coordinator is built with, from the drawn windows."""
        return group_kinds(windows, self.page_size) if self.mamba is None else self.mamba.kinds(windows)

    def group_spec(self, v: types.ModuleType, kind: hy.Window) -> object:
        """vLLM's KV cache spec of a group of ``kind``."""
        if kind == hr.STATE and self.mamba is not None:
            return self.mamba.spec(self, v)
        common = {"block_size": self.page_size, "num_kv_heads": 1, "head_size": 1, "dtype": v.torch.float32}
        return v.full_spec(**common) if kind is None else v.window_spec(**common, sliding_window=kind)

    # ------------------------------------------------------------ what the pool caches

    def is_cached(self, request: HybridRequest, group: int, end: int, bound: int) -> bool:
        """True when the pool caches, for ``group``, the entry of ``request``'s first ``end`` tokens. A
        full-attention group's KV is positional: a length inside a page is served by any entry of that page
        ending at or after it, up to ``bound`` (the coordinator's lookup limit): vLLM copies the page's first
        tokens (named choice ``inner_hits``)."""
        ends = [end]
        if self.windows[group] is None and end % self.page_size:
            page_end = end - end % self.page_size + self.page_size
            ends = list(range(end, min(page_end, bound) + 1, self.unit))
        return any(
            0 < e <= len(request.block_hashes) * self.unit
            and bool(self.pool.get_cached_block(request.block_hashes[e // self.unit - 1], [group]))
            for e in ends
        )

    def drop_margin(self) -> int:
        """Tokens past the limit EAGLE's drop may find before it drops them: the hybrid coordinator looks one
        unit further (its proof margin, vLLM #32802), so the drop lands back at the limit."""
        return self.rule.unit if self.rule.drop else 0

    def judge_hit(self, uid: int, request: HybridRequest, hit: int) -> None:
        """The hit is the hit rule's longest valid match of what the pool caches now, at most the prompt less its
        last token (with EAGLE's drop, one unit more found, then dropped: ``drop_margin``)."""
        limit = request.num_tokens - 1
        margin = self.drop_margin()
        cached = lambda group, end: self.is_cached(request, group, end, limit + margin)  # noqa: E731
        hit_law(uid, hit, self.rule, cached, request.num_tokens, limit, "the pool's cached blocks", margin=margin)

    def hasher_for(self, tokens: list[int], namespace: Namespace = None) -> list[bytes]:
        """vLLM's block hashes of ``tokens`` (in ``namespace``), as a request of them would carry."""
        return list(HybridRequest(tokens, namespace, -1, self.hasher).block_hashes)

    def cached_page_count(self) -> int:
        """Blocks the pool caches, over every group (the reach of a campaign)."""
        return sum(1 for block in self.pool.blocks[1:] if block.block_hash is not None)

    def rows(self, uid: int) -> list[list[int | None]]:
        """Per group, the request's pages as the spec counts slots (block b holds slots (b - 1) * P ...)."""
        return [
            [None if block.is_null else (block.block_id - 1) * self.page_size for block in blocks]
            for blocks in self.coordinator.get_blocks(str(uid))
        ]

    # ------------------------------------------------------------ the manager's operations

    def match_req(self, req: HybridReq) -> None:
        """get_computed_blocks, then the first allocate_slots of no new token: the hit's blocks are the request's."""
        self.coordinator.new_step_starts()  # each operation is a step of its own: the stores before it are done
        request = HybridRequest(req.input_ids, req.namespace, req.uid, self.hasher)
        if request.mm_features:
            STATS.record_rule("vllm-hybrid.request[with an image]")
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        try:
            self.judge_hit(req.uid, request, hit)
        except IntegrityError:
            if self.mamba is None or not self.mamba.took_finding_15(self, request, hit):
                raise
        if hit and self.replay is not None and req.uid % REANNOUNCED == REANNOUNCED - 1:
            self.reannounce(request, blocks, hit, req.namespace)
        request.shared_prefix_boundary = hit + uncached if uncached else 0
        self.requests[req.uid] = request
        self.namespaces[req.uid] = req.namespace
        if hit:
            # the hit's blocks are the request's at once (vLLM allocates its first chunk in the same call; a
            # request with no hit has nothing to adopt, and allocate_slots of no token is refused)
            self.allocate(request, hit, blocks, hit)
        request.num_computed_tokens = hit
        req.handle, req.computed, req.rows = Match(hit), hit, self.rows(req.uid)
        self.learn(request, req.namespace)
        self.take_events(request, req.namespace)
        if self.mamba is not None:
            self.mamba.matched(self, req)

    def reannounce(
        self, request: HybridRequest, blocks: Sequence[Sequence[BlockView]], hit: int, namespace: Namespace
    ) -> None:
        """KVCacheManager.get_computed_blocks for a request of ``kv_cache_report_mode`` "full" (a gateway's): the
        hit's blocks stored again as events, so that a router learns what the request reused."""
        STATS.record_rule("vllm-hybrid.events[a hit re-announced]")
        self.take_events(request, namespace)
        request.kv_cache_report_mode = "full"
        assert self.replay is not None
        try:
            self.coordinator.emit_cached_block_events(request, tuple(blocks))
        except IndexError:
            # a hit inside the block the prompt ends in: the request has no whole hash for that block, and vLLM's
            # get_computed_blocks raises (vllm#57358); the groups announced before it are dropped with it
            if not self.replay.known_reannounced:
                raise
            STATS.record_rule(f"vllm-hybrid.known: {FINDING_33}: IndexError (vllm#57358)")
            self.pool.take_events()
            return
        self.replay.reannounced(self.pool.take_events(), request, namespace, blocks, hit)

    def learn(self, request: HybridRequest, namespace: Namespace) -> None:
        """The page each of ``request``'s new hashes names (one every hash unit): its namespace and prefix, built on
        the last one's (the spec's interned prefixes: hashed in O(1))."""
        done, parent = request.learnt
        hashes, tokens, unit = request.block_hashes, request.tokens, self.unit
        for index in range(done, min(len(hashes), len(tokens) // unit)):
            parent = pc.Prefix.extend(parent, tuple(tokens[index * unit : (index + 1) * unit]))
            self.prefix_of.setdefault(hashes[index], (namespace, parent))
            done = index + 1
        request.learnt = (done, parent)

    def take_events(self, request: HybridRequest | None, namespace: Namespace) -> None:
        """The pool's events of one operation, into the replay (``namespace``: the operation's request's)."""
        if self.replay is not None:
            if request is not None:
                self.learn(request, namespace)
                self.replay.learn(request, self.prefix_of)
            self.replay.apply(self.pool.take_events(), namespace)

    def allocate(
        self,
        request: HybridRequest,
        length: int,
        new_computed: Sequence[Sequence[BlockView]] | None = None,
        hit: int = 0,
    ) -> None:
        """allocate_slots for tokens up to ``length`` (KVCacheManager.allocate_slots, synchronous, no connector)."""
        computed = request.num_computed_tokens + hit
        coordinator = self.coordinator
        coordinator.remove_skipped_blocks(request.request_id, computed, num_prompt_tokens=request.num_prompt_tokens)
        new_computed = self.empty if new_computed is None else new_computed
        needed = coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=length,
            new_computed_blocks=new_computed,
            num_encoder_tokens=0,
            total_computed_tokens=computed,
            num_local_computed_tokens=computed,
            num_tokens_main_model=length,
            prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1),
        )
        if needed > self.pool.get_num_free_blocks():
            raise OutOfPagesError(f"{needed} blocks needed, {self.pool.get_num_free_blocks()} free")
        if new_computed is not self.empty:
            coordinator.allocate_new_computed_blocks(
                request_id=request.request_id,
                new_computed_blocks=new_computed,
                num_local_computed_tokens=computed,
                num_external_computed_tokens=0,
            )
        coordinator.allocate_new_blocks(request.request_id, length, length, 0)
        self.take_copies()

    def take_copies(self) -> None:
        """take_kv_cache_block_copies: the copy-on-write copies of partial hits run before the step's forward
        (the shadows copy), and their retained ends go back to the pool (after the step, if frees wait)."""
        retained: list[BlockView] = []
        for group, manager in enumerate(self.coordinator.single_type_managers):
            for source, copy in manager.take_pending_cow_copies():
                self.copy_block(group, source, copy)
                retained += [source, copy]
        if retained and self.defer_free:
            self.deferred.append((self.chunks + 1, retained))
        elif retained:
            self.pool.free_blocks(retained)

    def copy_block(self, group: int, source: BlockView, copy: BlockView) -> None:
        """What the worker copies from ``source`` into ``copy`` (the KV, told to the machine's shadow; a Mamba
        block's state, to the group's)."""
        if self.mamba is not None and group == self.mamba.group:
            self.mamba.copy(source, copy)
            return
        p = self.page_size
        self.kv_copies.append(KVCopy(0, (source.block_id - 1) * p, (copy.block_id - 1) * p, p))

    def take_kv_copies(self) -> list[KVCopy]:
        copies, self.kv_copies = self.kv_copies, []
        return copies

    def sync(self, req: HybridReq) -> HybridRequest:
        """The request, with the tokens it decoded since (hashed as Request.append_output_token_ids does)."""
        request = self.requests[req.uid]
        if len(request.tokens) < len(req.input_ids):
            request.see(req.input_ids)
            request.rehash()
            self.learn(request, req.namespace)
        return request

    def allocate_paged(self, req: HybridReq, length: int) -> None:
        """The blocks for the request's tokens up to ``length`` (with a Mamba group, for the chunk the scheduler's
        split leaves of them; none when it leaves none)."""
        request = self.sync(req)
        if self.mamba is not None:
            length = self.mamba.chunk(self, req.uid, request, length)
            if length <= request.num_computed_tokens:
                return
        self.coordinator.new_step_starts()
        try:
            self.allocate(request, length)
        finally:
            self.take_events(request, req.namespace)
        req.rows = self.rows(req.uid)

    def store(self, req: HybridReq, tokens: int) -> None:
        """The chunk's KV is written (the machine's shadow records where), then cache_blocks (allocate_slots
        caches the chunk's blocks before the request's computed tokens advance; with a Mamba group, the chunk as
        the split left it)."""
        if self.mamba is not None:
            tokens = self.mamba.stored(req.uid, req.computed, tokens)
            if tokens <= 0:
                return
        request = self.sync(req)
        begin, end = request.num_computed_tokens, request.num_computed_tokens + tokens
        self.write_states(request, req.namespace, begin, end)
        self.coordinator.cache_blocks(request, min(end, request.num_tokens))
        request.num_computed_tokens = end
        req.computed, req.rows = end, self.rows(req.uid)
        # the step completes: the blocks whose free waited for it go back to the pool, tail first
        self.chunks += 1
        while self.deferred and self.deferred[0][0] <= self.chunks:
            self.pool.free_blocks(reversed(self.deferred.pop(0)[1]))
        self.take_events(request, req.namespace)

    def write_states(self, request: HybridRequest, namespace: Namespace, begin: int, end: int) -> None:
        """A state group's forward over [begin, end)."""
        if self.mamba is not None:
            self.mamba.write(self, request, namespace, begin, end)

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        """A running request's full blocks are cached as they are stored; a finished one frees its blocks."""
        if finished:
            if self.defer_free:
                # Scheduler._free_request_blocks: a step in flight may still write them (async scheduling)
                self.deferred.append((self.chunks + 1, self.coordinator.pop_blocks_for_free(str(req.uid))))
            else:
                self.coordinator.free(str(req.uid))
            del self.requests[req.uid], self.namespaces[req.uid]
            req.rows, req.handle = [], None
            self.take_events(None, req.namespace)
            if self.mamba is not None:
                self.mamba.finished(req.uid)

    # ------------------------------------------------------------ universal checks

    def check_integrity(self, live_reqs: list[HybridReq]) -> None:
        """vLLM's own: the pool's accounting, the events, the Mamba group's states (the lifecycle laws are the
        machine's)."""
        self.check_pool(live_reqs)
        if self.replay is not None:
            self.replay.check(self.pool)
        if self.mamba is not None:
            self.mamba.check(self, live_reqs)

    def entries(self) -> list[tuple[BlockView, int, Namespace, pc.Prefix]]:
        """Every entry the pool caches: (its block, its group, the namespace and prefix it names)."""
        found = []
        entry_of = self.entry_of
        for block, key in cached_keys(self.pool):
            if (entry := entry_of.get(key)) is None:
                # a key names one group's entry of one prefix for good (hashes do not collide)
                namespace, prefix = self.prefix_of[self.utils.get_block_hash(key)]
                entry = entry_of[key] = (self.utils.get_group_id(key), namespace, prefix)
            found.append((block, *entry))
        return found

    def cached_kv(self) -> list[CachedKV]:
        """Every block a full or window group caches, with the prefix its hash names (fuzz/lifecycle.py checks it
        holds that prefix's KV: a stale hash on a block written since is vLLM #44237, #49125)."""
        p = self.page_size
        return [
            CachedKV(group, namespace, tokens, range((block.block_id - 1) * p, block.block_id * p))
            for block, group, namespace, tokens in self.entries()
            if self.windows[group] != hr.STATE
        ]

    def check_pool(self, live_reqs: list[HybridReq]) -> None:
        """ref_cnt == holders (request lists, and blocks whose free waits: a finished request's, a copy's ends);
        free exactly when unheld; a block two requests' lists hold is cached."""
        holders: Counter[int] = Counter()
        for req in live_reqs:
            for blocks in self.coordinator.get_blocks(str(req.uid)):
                holders.update(block.block_id for block in blocks if not block.is_null)
        waiting: Counter[int] = Counter()
        for _, blocks in self.deferred:
            waiting.update(block.block_id for block in blocks if not block.is_null)
        free = {block.block_id for block in self.pool.free_block_queue.get_all_free_blocks()}
        for block in self.pool.blocks[1:]:
            held = holders[block.block_id] + waiting[block.block_id]
            if block.ref_cnt != held or (held == 0) != (block.block_id in free):
                raise IntegrityError(
                    f"pool_counts_its_holders: block {block.block_id} has ref_cnt {block.ref_cnt}, {held} request"
                    f" lists and deferred frees hold it, {'in' if block.block_id in free else 'not in'} the free"
                    " queue"
                )
            if holders[block.block_id] > 1 and block.block_hash is None:
                raise IntegrityError(
                    f"shared_blocks_are_cached: block {block.block_id} is held by {holders[block.block_id]}"
                    " request lists, uncached"
                )


def lookahead_hashes(v: types.ModuleType) -> bool:
    """True when this vLLM hashes blocks with lookahead tokens (0.33.0; 0.32.0 only drops)."""
    return "num_hash_lookahead_tokens" in inspect.signature(v.utils.get_request_block_hasher).parameters


EAGLE_MODES = ("off", "drop", "lookahead")
# one request in REANNOUNCED has its hit's blocks announced again (kv_cache_report_mode "full": a gateway's)
REANNOUNCED = 4
# finding 33 (docs/findings.md)
FINDING_33 = "a hit re-announced names blocks the group does not cache under those hashes (finding 33)"


# prefix_cache_retention_interval, in blocks: 0 (vLLM's default: the replay boundary and the shared-prefix
# junctions only), None (every block), a tail every k blocks
RETENTIONS: tuple[int | None, ...] = (0, 0, None, 2, 3)


def group_kinds(windows: Sequence[hy.Window], page_size: int) -> tuple[hy.Window, ...]:
    """The groups of a model with the drawn layers: one per drawn window (several may share one), full attention
    among them, a window among them (else a full group and a window of 2P + 1). A window below 2 tokens attends
    to nothing before itself, which vLLM's SlidingWindowSpec does not take."""
    kinds = [None if window is None else max(2, int(window)) for window in windows if window != hr.STATE]
    if None not in kinds:
        kinds.insert(0, None)
    if all(kind is None for kind in kinds):
        kinds.append(2 * page_size + 1)
    return tuple(kinds)


def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> VllmHybridManager:
    """The coordinator with a configuration drawn from the pool size (the summary counts each)."""
    retention = RETENTIONS[num_pages // len(EAGLE_MODES) % len(RETENTIONS)]
    manager = VllmHybridManager(
        page_size,
        windows,
        num_pages,
        eagle=EAGLE_MODES[num_pages % len(EAGLE_MODES)],
        retention=retention if not retention else retention * page_size,
        defer_free=num_pages // (len(EAGLE_MODES) * len(RETENTIONS)) % 2 == 1,
    )
    sized = [kind for kind in manager.windows if kind is not None]
    groups = f"{len(manager.windows) - len(sized)} full, {len(sized)} window ({len(set(sized))} sizes)"
    retained = "dense" if retention is None else f"{retention}P"
    STATS.record_rule(
        f"vllm-hybrid.config[eagle={manager.eagle}, retention={retained}, defer_free={manager.defer_free}]"
    )
    STATS.record_rule(f"vllm-hybrid.groups[{groups}]")
    return manager


class VllmDenseManager(VllmHybridManager):
    """A dense model's cache: one full-attention group (vLLM's unitary coordinator), as most deployments run it;
    with EAGLE no window group's drop masks the full group's."""

    def group_kinds(self, windows: Sequence[hy.Window]) -> tuple[hy.Window, ...]:
        return (None,)

    def drop_margin(self) -> int:
        """The unitary coordinator finds at most the limit, then drops: no margin (so a prompt cached whole hits
        one block less than under the hybrid coordinator)."""
        return 0


def dense_factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> VllmDenseManager:
    """The dense model's manager, EAGLE (off, drop, lookahead) and deferred frees drawn from the pool size."""
    manager = VllmDenseManager(
        page_size,
        windows,
        num_pages,
        eagle=EAGLE_MODES[num_pages % len(EAGLE_MODES)],
        defer_free=num_pages // len(EAGLE_MODES) % 2 == 1,
    )
    STATS.record_rule(f"vllm.dense[eagle={manager.eagle}, defer_free={manager.defer_free}]")
    return manager


# the `vllm` target: the block pool under the cache machine, and a dense model's KVCacheManager path under the
# hybrid machine's request lifecycle
DENSE_TARGET = replace(
    BLOCK_POOL_TARGET,
    description=f"{BLOCK_POOL_TARGET.description}; a dense model through the request lifecycle (EAGLE drawn)",
    hybrid_factory=dense_factory,
    how=f"{BLOCK_POOL_TARGET.how}; the hybrid machine: a dense model's requests, the hit with EAGLE's drop checked",
    engine_modules=COORDINATOR_MODULES,
)


TARGET = TargetInfo(
    name="vllm-hybrid",
    description=f"vLLM {VERSION} HybridKVCacheCoordinator: full-attention and sliding-window groups, one BlockPool",
    requires=(("vllm", f"radixspec targets install vllm  (pip install --no-deps vllm=={VERSION} cbor2)"),),
    hybrid_factory=factory,
    profile=PROFILE,
    how="the hybrid machine: requests as KVCacheManager drives them; the hit, the window law and the pool checked",
    probe=import_hybrid,
    engine_modules=COORDINATOR_MODULES,
)
