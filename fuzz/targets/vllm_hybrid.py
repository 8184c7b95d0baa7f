"""Target ``vllm-hybrid``: vLLM 0.33.0's ``HybridKVCacheCoordinator`` over one ``BlockPool``, a full-attention
group and a sliding-window group, driven request by request as ``KVCacheManager`` drives it.

The calls and their order are ``KVCacheManager``'s (``vllm/v1/core/kv_cache_manager.py``, read, not
imported: its module needs vLLM's metrics): ``find_longest_cache_hit`` on the request's block hashes
with the last token left out; then, for every chunk, ``remove_skipped_blocks`` of the tokens already
computed, ``get_num_blocks_to_allocate``, ``allocate_new_computed_blocks`` (first chunk, on a hit),
``allocate_new_blocks`` and, once the chunk's KV is stored, ``cache_blocks``; ``free`` when the request
ends. Scheduling is synchronous (no tokens in flight); eagle is off; the block size is the page size.

The machine checks what holds whatever vLLM chooses (docs/hybrid.md):

* the hit is the longest valid match length (``spec/hybrid.py``) of what the pool caches per group at
  that moment, at most the prompt less its last token;
* the safety law: every page a live request still attends is a real block in its list;
* each attended block holds the KV of the request's own tokens, in its group: a shadow of what was
  written where, by group, namespace and token prefix (a block reused while still attended fails);
* the pool's accounting: a block's ``ref_cnt`` is the number of live requests' lists that hold it; a
  block is in the free queue exactly when no one holds it; a block two requests share is a cached one.
"""

from __future__ import annotations

import inspect
import types
from collections import Counter
from collections.abc import Callable, Sequence

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError, OutOfPagesError

from ..stats import STATS
from .api import Profile, TargetInfo
from .shims import install
from .vllm import VERSION, BlockView, RequestStandIn, import_vllm

PROFILE = Profile(
    name=f"vllm {VERSION} HybridKVCacheCoordinator (full attention + sliding window)",
    eviction_unit="node",
    eviction_trigger="allocate",
    clock="order",
    errors="none",
    slots="target",
    notes=(
        "one BlockPool for every group (one free queue): conservation holds for the pool, not per group",
        "window_pages: cdiv(W - 1, P) contiguous cached blocks end a hit, as the spec's window rule",
        "eagle: off, drop (use_eagle: one block more found, then dropped) or lookahead hashes (0.33.0), drawn",
        "alignment: one block size, so the hit aligns to P",
        "early_release: remove_skipped_blocks at each allocation frees private and cached window blocks alike",
        "duplicates: a prefix recomputed while its cached block sits free is cached twice (no dedup)",
    ),
)


def import_hybrid() -> types.ModuleType:
    """vLLM's coordinator, its two managers and the group specs (on top of the BlockPool's imports)."""
    modules = import_vllm()
    if hasattr(modules, "coordinator"):
        return modules
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


class HybridRequest(RequestStandIn):
    """What the coordinator, its managers, the pool and the hasher read of a ``vllm.v1.request.Request``."""

    def __init__(
        self,
        tokens: list[int],
        cache_salt: str | None,
        request_id: int,
        hasher: Callable[[RequestStandIn], list[bytes]],
    ) -> None:
        super().__init__(list(tokens), cache_salt, request_id)
        self.hasher = hasher
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.shared_prefix_boundary = 0
        self.rehash()

    def rehash(self) -> None:
        """Request.__init__ and append_output_token_ids: hash every new whole block."""
        self.num_tokens = len(self.all_token_ids)
        self.block_hashes.extend(self.hasher(self))


class Match:
    """The request's hit, in the place of a handle (``cached_len``)."""

    def __init__(self, cached_len: int) -> None:
        self.cached_len = cached_len


class VllmHybridManager:
    """vLLM's hybrid coordinator behind the hybrid manager's methods (``reference/hybrid_manager.py``)."""

    profile = PROFILE

    def __init__(self, page_size: int, windows: tuple[hy.Window, ...], num_pages: int, eagle: str = "off") -> None:
        v = import_hybrid()
        # EAGLE as the scheduler configures it: off; "drop" (no lookahead hashes: a KV connector, or
        # disable_lookahead_block_hashes; the coordinator finds one block more and drops it); "lookahead"
        # (0.33.0's default: each block hash also covers the next token, nothing dropped)
        if eagle == "lookahead" and not lookahead_hashes(v):
            eagle = "drop"
        self.eagle = eagle
        lookahead = int(eagle == "lookahead")
        # one full group and one window group; a drawn window below 2 tokens attends to nothing before itself,
        # which vLLM's SlidingWindowSpec does not take
        window = next((w for w in windows if w is not None), 2 * page_size + 1)
        self.windows: tuple[hy.Window, ...] = (None, max(2, window))
        self.page_size, self.num_pages = page_size, num_pages
        torch = v.torch
        specs = [
            v.full_spec(block_size=page_size, num_kv_heads=1, head_size=1, dtype=torch.float32),
            v.window_spec(
                block_size=page_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=self.windows[1]
            ),
        ]
        page_bytes = page_size * 2 * 4
        config = v.config(
            num_blocks=num_pages + 1,  # block 0 is the null block
            kv_cache_tensors=[
                v.tensor(
                    size=page_bytes * (num_pages + 1),
                    layers=["full", "window"],
                    layer_stride=0,
                    block_stride=page_bytes,
                )
            ],
            kv_cache_groups=[
                v.group_spec(layer_names=["full"], kv_cache_spec=specs[0]),
                v.group_spec(layer_names=["window"], kv_cache_spec=specs[1]),
            ],
        )
        self.max_len = 1 << 16
        self.coordinator = v.coordinator.get_kv_cache_coordinator(
            kv_cache_config=config,
            max_model_len=self.max_len,
            max_in_flight_tokens=self.max_len,
            use_eagle=eagle == "drop",
            enable_caching=True,
            enable_kv_cache_events=False,
            dcp_world_size=1,
            pcp_world_size=1,
            scheduler_block_size=page_size,
            hash_block_size=page_size,
            **({"num_hash_lookahead_tokens": lookahead} if lookahead else {}),
        )
        self.pool = self.coordinator.block_pool
        self.utils = v.utils
        self.hasher = v.utils.get_request_block_hasher(page_size, v.hash_fn, *([lookahead] if lookahead else []))
        # the hit rule: one unit is the block; with the drop, the coordinator looks one block past the limit
        self.rule = hr.HitRule(page_size, self.windows, page_size, lookahead=lookahead, drop=int(eagle == "drop"))
        self.empty = tuple(() for _ in specs)
        self.requests: dict[int, HybridRequest] = {}
        self.namespaces: dict[int, Namespace] = {}
        # block id -> (group, namespace, the tokens up to the end of what was written into it)
        self.shadow: dict[int, tuple[int, Namespace, tuple[int, ...]]] = {}

    # ------------------------------------------------------------ what the pool caches

    def is_cached(self, request: HybridRequest, page: int, group: int) -> bool:
        """True when the pool caches, for ``group``, the block of ``request``'s page ``page``."""
        return bool(self.pool.get_cached_block(request.block_hashes[page], [group]))

    def expected_hit(self, request: HybridRequest) -> int:
        """The hit rule's longest valid match of what the pool caches now, at most the prompt less its last token
        (``spec/hit_rules.py``: with EAGLE's drop, one block more found, then dropped)."""
        p = self.page_size
        return hr.compute_hit(
            self.rule,
            lambda group, end: end // p <= len(request.block_hashes) and self.is_cached(request, end // p - 1, group),
            known=request.num_tokens,
            limit=request.num_tokens - 1,
            margin=p if self.rule.drop else 0,
        )

    def hasher_for(self, tokens: list[int], namespace: Namespace = None) -> list[bytes]:
        """vLLM's block hashes of ``tokens`` (in ``namespace``), as a request of them would carry."""
        salt = None if namespace is None else repr(namespace)
        return list(HybridRequest(tokens, salt, -1, self.hasher).block_hashes)

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
        salt = None if req.namespace is None else repr(req.namespace)
        request = HybridRequest(req.input_ids, salt, req.uid, self.hasher)
        expected = self.expected_hit(request)
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        if hit != expected:
            raise IntegrityError(
                f"hit_is_the_longest_valid_match: request {req.uid} of {request.num_tokens} tokens hit {hit},"
                f" the pool's cached blocks give {expected}"
            )
        request.shared_prefix_boundary = hit + uncached if uncached else 0
        self.requests[req.uid] = request
        self.namespaces[req.uid] = req.namespace
        self.allocate(request, hit, blocks if any(blocks) else self.empty, hit)
        request.num_computed_tokens = hit
        req.handle, req.computed, req.rows = Match(hit), hit, self.rows(req.uid)

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

    def sync(self, req: HybridReq) -> HybridRequest:
        """The request, with the tokens it decoded since (hashed as Request.append_output_token_ids does)."""
        request = self.requests[req.uid]
        if len(request.all_token_ids) < len(req.input_ids):
            request.all_token_ids[:] = req.input_ids
            request.rehash()
        return request

    def allocate_paged(self, req: HybridReq, length: int) -> None:
        """The blocks for the request's tokens up to ``length``."""
        self.allocate(self.sync(req), length)
        req.rows = self.rows(req.uid)

    def store(self, req: HybridReq, tokens: int) -> None:
        """The chunk's KV is written (the shadow records where), then cache_blocks."""
        request = self.sync(req)
        begin, end, p = request.num_computed_tokens, request.num_computed_tokens + tokens, self.page_size
        for group, blocks in enumerate(self.coordinator.get_blocks(request.request_id)):
            for page in range(begin // p, -(-end // p)):
                block = blocks[page]
                assert not block.is_null, "a block written this chunk is a real one"
                written = tuple(request.all_token_ids[: min(end, (page + 1) * p)])
                self.shadow[block.block_id] = (group, req.namespace, written)
        request.num_computed_tokens = end
        self.coordinator.cache_blocks(request, min(end, request.num_tokens))
        req.computed, req.rows = end, self.rows(req.uid)

    def cache_req(self, req: HybridReq, finished: bool) -> None:
        """A running request's full blocks are cached as they are stored; a finished one frees its blocks."""
        if finished:
            self.coordinator.free(str(req.uid))
            del self.requests[req.uid], self.namespaces[req.uid]
            req.rows, req.handle = [], None

    # ------------------------------------------------------------ universal checks

    def check_integrity(self, live_reqs: list[HybridReq]) -> None:
        """The safety law, the shadow of every attended block, and the pool's accounting."""
        attended = {req.uid: (req.computed, self.rows(req.uid)) for req in live_reqs}
        problem = hy.attended_pages_are_held(self.windows, self.page_size, attended)
        if problem is not None:
            raise IntegrityError(f"attended_pages_are_held: {problem}")
        for req in live_reqs:
            self.check_attended_kv(req)
        self.check_pool(live_reqs)

    def check_attended_kv(self, req: HybridReq) -> None:
        """Every block the request attends holds what it wrote there, or what another wrote for the same prefix."""
        p, tokens = self.page_size, tuple(self.requests[req.uid].all_token_ids)
        for group, (window, blocks) in enumerate(
            zip(self.windows, self.coordinator.get_blocks(str(req.uid)), strict=True)
        ):
            for page in hy.compute_used_pages(req.computed, window, p):
                block = blocks[page].block_id
                seen = self.shadow.get(block)
                needed = min(req.computed, (page + 1) * p)
                if (
                    seen is None
                    or seen[:2] != (group, req.namespace)
                    or len(seen[2]) < needed
                    or seen[2][:needed] != tokens[:needed]
                ):
                    held = "nothing" if seen is None else f"group {seen[0]}'s KV of {len(seen[2])} tokens"
                    raise IntegrityError(
                        f"attended_kv_is_the_requests: request {req.uid} attends block {block} (group {group},"
                        f" page {page}), which holds {held}, not the KV of its own first {needed} tokens"
                    )

    def check_pool(self, live_reqs: list[HybridReq]) -> None:
        """ref_cnt == holders; free exactly when unheld; a block two requests hold is cached."""
        holders: Counter[int] = Counter()
        for req in live_reqs:
            for blocks in self.coordinator.get_blocks(str(req.uid)):
                holders.update(block.block_id for block in blocks if not block.is_null)
        free = {block.block_id for block in self.pool.free_block_queue.get_all_free_blocks()}
        for block in self.pool.blocks[1:]:
            held = holders[block.block_id]
            if block.ref_cnt != held or (held == 0) != (block.block_id in free):
                raise IntegrityError(
                    f"pool_counts_its_holders: block {block.block_id} has ref_cnt {block.ref_cnt}, {held} request"
                    f" lists hold it, {'in' if block.block_id in free else 'not in'} the free queue"
                )
            if held > 1 and block.block_hash is None:
                raise IntegrityError(f"shared_blocks_are_cached: block {block.block_id} is held {held} times, uncached")


def lookahead_hashes(v: types.ModuleType) -> bool:
    """True when this vLLM hashes blocks with lookahead tokens (0.33.0; 0.32.0 only drops)."""
    return "num_hash_lookahead_tokens" in inspect.signature(v.utils.get_request_block_hasher).parameters


EAGLE_MODES = ("off", "drop", "lookahead")


def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> VllmHybridManager:
    """The coordinator with an EAGLE mode drawn from the pool size (the summary counts each)."""
    manager = VllmHybridManager(page_size, windows, num_pages, EAGLE_MODES[num_pages % len(EAGLE_MODES)])
    STATS.record_rule(f"vllm-hybrid.config[eagle={manager.eagle}]")
    return manager


TARGET = TargetInfo(
    name="vllm-hybrid",
    description=f"vLLM {VERSION} HybridKVCacheCoordinator: a full-attention and a sliding-window group, one BlockPool",
    requires=(("vllm", f"radixspec targets install vllm  (pip install --no-deps vllm=={VERSION} cbor2)"),),
    hybrid_factory=factory,
    profile=PROFILE,
    how="the hybrid machine: requests as KVCacheManager drives them; the hit, the window law and the pool checked",
    probe=import_hybrid,
)
