"""Target ``vllm-mamba``: vLLM 0.33.0's ``HybridKVCacheCoordinator`` with a Mamba group in ``align`` mode beside
full attention (and, in some examples, a sliding window), as a hybrid linear-attention model runs it, driven as
``vllm-hybrid`` drives its groups (``fuzz/targets/vllm_hybrid.py``), plus what the Mamba group needs.

Written from vLLM's code (read, not imported where it needs a GPU):

* the hash unit (``prefix_match_unit``) is drawn below the block: with a Mamba group in ``align`` mode and no
  window group, a hit may end inside a block (the full-attention group's tail block and the Mamba state are
  copied on write into blocks of the request's own, ``take_kv_cache_block_copies``), and a prompt registers a
  *partial* entry at its last hash boundary, promoted to a full one when the block fills;
* the scheduler splits prefill chunks where Mamba states must be cached (``_mamba_block_aligned_split``);
* the worker's side of ``align`` mode: before a step the running state is copied from the block of the step
  before to the step's last block (``preprocess_mamba``), the forward advances it there, and with prefill
  checkpoints on, the state at the checkpoint position is exported into the block before
  (``compute_mamba_prefill_checkpoints``).

Checks, beside ``vllm-hybrid``'s (the hit is the hit rule's longest valid match, with a state group; the
safety law; the KV shadow; the pool's accounting; the event replay, by count where entries sit inside
blocks): a shadow of which state every Mamba block holds (the namespace and tokens it is the state of), and

* ``cached_states_are_their_prefix``: every entry the Mamba group caches is a block holding the state of
  exactly the prefix its hash names;
* ``state_resumes_from_its_prefix``: a step starts from the state of the tokens the request computed (after
  a hit: the hit's), never from another prefix's or a freed block's.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import types
from collections.abc import Callable, Sequence

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError

from ..lifecycle import StateShadow
from ..stats import STATS
from .api import LifecycleProfile, TargetInfo, mix
from .shims import install
from .vllm import COORDINATOR_MODULES, VERSION, BlockView
from .vllm_hybrid import EAGLE_MODES, RETENTIONS, HybridRequest, VllmHybridManager, import_hybrid

PROFILE = LifecycleProfile(
    name=f"vllm {VERSION} HybridKVCacheCoordinator (full attention + Mamba, align mode)",
    hit="a hit needs the state of exactly its prefix (spec STATE); hash units (prefix_match_unit) below the block"
    " give hits inside a page, only without a window group: a full-attention page's entry serves every length"
    " inside the page up to where it ends, and keeps its partial entry until its full hash is known",
    pages="one BlockPool for every group; the scheduler's block-aligned split (prefill ends at block boundaries"
    " and at the prompt's last hash boundary)",
    state="a Mamba block holds one state, of the prefix its entry names; states are sparse; a hit inside a"
    " block copies the tail block and the state into the request's own (copy on write)",
    drawn="the hash unit, EAGLE, retention, deferred frees, prefill checkpoints",
)


# finding 32 (docs/findings.md): a hit inside a block, then a chunk the internal checkpoint runs past the block's end,
# caches the copy-on-write block under its full hash while it holds the state of the hit
FINDING_32 = "a partial hit's block cached under its full hash holds the state of the hit (finding 32)"
# finding 15: under EAGLE's drop the Mamba group, whose finder never drops, is marked verified all the same, so a
# window group's drop proved at a longer length survives Mamba's cut
FINDING_15 = "a window group's EAGLE drop proved at a longer length survives Mamba's cut (finding 15)"
# finding 15's cause in HybridKVCacheCoordinator.find_longest_cache_hit, and that code without it
MARKS_MAMBA_VERIFIED = "            if drop_eagle_block:\n"
MARKS_WHAT_DROPPED = "            if drop_eagle_block and not isinstance(spec, MambaSpec):\n"


@functools.cache
def import_mamba() -> types.ModuleType:
    """vLLM's coordinator with its Mamba manager registered, and the checkpoint rules the worker follows (once a
    process)."""
    v = import_hybrid()
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import (
        MambaSpec,
        get_mamba_prefill_checkpoint_position,
        is_mamba_prefill_checkpoint_valid,
    )
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry.register(MambaSpec, MambaManager, uniform_type_base_spec=MambaSpec)
    # vLLM's warning_once asks the distributed state for its rank (psutil, torch.distributed); its one warning
    # here (a window group turns hits inside blocks off) is the summary's partial_hits=False
    v.utils.logger.warning_once = lambda *args, **kwargs: None
    install(v, mamba_spec=MambaSpec, checkpoint_at=get_mamba_prefill_checkpoint_position)
    install(v, checkpoint_valid=is_mamba_prefill_checkpoint_valid)
    return v


@functools.cache
def lookup_without_finding_15(method: object) -> Callable[..., tuple[object, int, int]] | None:
    """``method`` (``HybridKVCacheCoordinator.find_longest_cache_hit`` as the coordinator's class has it: vLLM's,
    or a plant's) compiled from its own source with finding 15's cause removed (a group whose finder does not drop
    is not marked verified): the hit it gives had vLLM not had that bug. None where its source is not at hand or
    does not read as 0.33.0's (nothing is then counted)."""
    if not isinstance(method, types.FunctionType):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(method))
    except OSError:
        return None
    if source.count(MARKS_MAMBA_VERIFIED) != 1:
        return None
    namespace = dict(method.__globals__)
    exec(
        compile(source.replace(MARKS_MAMBA_VERIFIED, MARKS_WHAT_DROPPED), method.__code__.co_filename, "exec"),
        namespace,
    )
    lookup: Callable[..., tuple[object, int, int]] = namespace["find_longest_cache_hit"]
    return lookup


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MambaGroup:
    """vLLM's Mamba group in ``align`` mode as the coordinator combines it with the attention groups (one manager
    class per spec, as vLLM keeps them): the spec it is built with, the scheduler's block-aligned split, the
    worker's states (a shadow of which state each block holds) and their laws. Its methods take the manager
    whose coordinator, pool and requests they read."""

    def __init__(self, checkpoints: bool) -> None:
        self.v = import_mamba()
        # the backend exports a state inside a chunk (num_prefill_checkpoint_blocks, at the hash unit's grid)
        self.checkpoints = checkpoints
        # the Mamba group's index, once the manager has built its groups
        self.group = -1
        # block id -> (namespace, tokens): the state it holds is of these tokens
        self.state = StateShadow()
        # block id -> the entry's prefix and the state the block held when the check found it holding that
        # prefix's state (a state written since is another object: the block is read again)
        self.verified: dict[int, tuple[pc.Prefix, object]] = {}
        # request -> the block index of its running state (the worker's mamba_state_idx)
        self.state_at: dict[int, int] = {}
        # request -> where the scheduler's split ends the chunk allocated last
        self.chunk_end: dict[int, int] = {}
        # finding 32 counted (the shadow then takes the block as holding its entry's state, so the checks go on);
        # off, cached_states_are_their_prefix names it
        self.known_partial_checkpoint = True
        # finding 15 counted (the hit stands); off, hit_is_the_longest_valid_match names it
        self.known_eagle_verified = True

    def kinds(self, windows: Sequence[hy.Window]) -> tuple[hy.Window, ...]:
        """Full attention, a window where one was drawn, the Mamba group."""
        window = next((max(2, int(w)) for w in windows if w is not None and w != hr.STATE), None)
        return (None, hr.STATE) if window is None else (None, window, hr.STATE)

    def spec(self, m: VllmHybridManager, v: types.ModuleType) -> object:
        return self.v.mamba_spec(
            block_size=m.page_size,
            shapes=((1,),),
            dtypes=(v.torch.float32,),
            mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=int(self.checkpoints),
            prefill_checkpoint_alignment=m.unit if self.checkpoints else None,
        )

    # ------------------------------------------------------------ the scheduler's chunks

    def aligned_split(self, m: VllmHybridManager, request: HybridRequest, start: int, end: int) -> int:
        """Scheduler._mamba_block_aligned_split: where the chunk [start, end) ends (the budget is never short)."""
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return end
        p, u, v, partial = m.page_size, m.unit, self.v, m.partial_hits
        last_cache_position = self.checkpoint_at(m, request.num_tokens, p)
        checkpoint_position = self.checkpoint_at(m, prefill_end, u if partial else p)
        internal = (
            self.checkpoints
            and end >= prefill_end
            and v.checkpoint_valid(
                query_start=start,
                query_end=end,
                checkpoint_position=checkpoint_position,
                hash_block_size=u,
                mamba_block_size=p,
                checkpoint_alignment=u,
            )
        )
        if internal:
            last_cache_position = 0
        if end < prefill_end:
            end = end // p * p
        tail = 0
        if partial and not internal:
            tail = self.checkpoint_at(m, request.num_prompt_tokens, u)
        junction = request.shared_prefix_boundary
        stops = (
            (start // p + 1) * p if start % p and not internal else 0,
            last_cache_position,
            tail if last_cache_position < tail < request.num_prompt_tokens else 0,
            start + (junction - start) // p * p if start < junction < end else 0,
        )
        return min((s for s in stops if start < s < end), default=end)

    def checkpoint_at(self, m: VllmHybridManager, tokens: int, unit: int) -> int:
        """get_mamba_prefill_checkpoint_position with this coordinator's EAGLE (0.32.0 has no lookahead hashes)."""
        lookahead = {"num_hash_lookahead_tokens": 1} if m.eagle == "lookahead" else {}
        return int(self.v.checkpoint_at(tokens, unit, m.eagle == "drop", **lookahead))

    def chunk(self, m: VllmHybridManager, uid: int, request: HybridRequest, length: int) -> int:
        """The end of the chunk the scheduler's split leaves of [computed, length) (remembered for the store)."""
        start = request.num_computed_tokens
        end = self.aligned_split(m, request, start, length) if length > start else length
        self.chunk_end[uid] = end
        if end > start:
            STATS.record_rule(f"vllm-mamba.chunk[{'split' if end < length else 'whole'}]")
        return end

    def stored(self, uid: int, computed: int, tokens: int) -> int:
        """The tokens a store writes: the chunk as the split left it."""
        return min(tokens, self.chunk_end.get(uid, 0) - computed)

    # ------------------------------------------------------------ the worker's states

    def copy(self, source: BlockView, copy: BlockView) -> None:
        STATS.record_rule("vllm-mamba.copy_on_write[state]")
        self.state.copy(source.block_id, copy.block_id)

    def write(self, m: VllmHybridManager, request: HybridRequest, namespace: Namespace, begin: int, end: int) -> None:
        """preprocess_mamba, the forward and the prefill checkpoint of [begin, end)."""
        uid, p = int(request.request_id), m.page_size
        blocks = m.coordinator.get_blocks(request.request_id)[self.group]
        tokens = tuple(request.tokens)
        previous = self.state_at.get(uid, (begin - 1) // p)
        current = cdiv(end, p) - 1
        if begin and uid not in self.state_at and previous != -1 and not blocks[previous].is_null:
            # the first step after the match resumes from the hit's block
            self.took_finding_32(m, blocks[previous], namespace, tokens[:begin])
        if previous != -1 and previous != current:
            if blocks[previous].is_null:
                raise IntegrityError(
                    f"state_resumes_from_its_prefix: request {uid} at {begin} tokens copies its running state"
                    f" from block index {previous}, a null block"
                )
            self.state.copy(blocks[previous].block_id, blocks[current].block_id)
        if begin:
            self.check_state(uid, blocks[current], namespace, tokens[:begin], "state_resumes_from_its_prefix")
        if self.checkpoints:
            self.export_checkpoint(m, blocks, namespace, tokens, begin, end)
        self.state.write(blocks[current].block_id, namespace, tokens[:end])
        self.state_at[uid] = current
        for manager in m.coordinator.single_type_managers:
            manager.take_pending_boundary_state_offloads()  # a KV connector's; none here

    def export_checkpoint(
        self,
        m: VllmHybridManager,
        blocks: Sequence[BlockView],
        namespace: Namespace,
        tokens: tuple[int, ...],
        begin: int,
        end: int,
    ) -> None:
        """compute_mamba_prefill_checkpoints: the state at the checkpoint position, into the block before."""
        position = self.checkpoint_at(m, end, m.rule.unit)
        valid = self.v.checkpoint_valid(
            query_start=begin,
            query_end=end,
            checkpoint_position=position,
            hash_block_size=m.unit,
            mamba_block_size=m.page_size,
            checkpoint_alignment=m.unit,
        )
        column = cdiv(end, m.page_size) - 2
        if valid and 0 <= column < len(blocks) and not blocks[column].is_null:
            STATS.record_rule("vllm-mamba.prefill_checkpoint")
            self.state.write(blocks[column].block_id, namespace, tokens[:position])

    def check_state(self, uid: int, block: BlockView, namespace: Namespace, tokens: tuple[int, ...], law: str) -> None:
        who = "the cache" if uid < 0 else f"request {uid}"
        self.state.expect(law, f"{who} (block {block.block_id})", block.block_id, namespace, tokens)

    # ------------------------------------------------------------ the request's lifecycle and the laws

    def matched(self, m: VllmHybridManager, req: HybridReq) -> None:
        self.state_at.pop(req.uid, None)
        if req.computed % m.page_size:
            STATS.record_rule("vllm-mamba.hit[inside a block]")

    def finished(self, uid: int) -> None:
        self.state_at.pop(uid, None)
        self.chunk_end.pop(uid, None)

    def is_finding_32(self, m: VllmHybridManager, block: int, namespace: Namespace, tokens: tuple[int, ...]) -> bool:
        """Finding 32's mark: with partial hits and prefill checkpoints, a block cached under the entry of
        ``tokens`` (a whole block's end) holds the state of a shorter prefix of them ending inside that block."""
        held = self.state.get(block)
        return (
            m.partial_hits
            and self.checkpoints
            and held is not None
            and held[0] == namespace
            and len(tokens) - m.page_size < len(held[1]) < len(tokens)
            and tokens[: len(held[1])] == held[1]
        )

    def is_cached_under(
        self, m: VllmHybridManager, block: BlockView, namespace: Namespace, tokens: tuple[int, ...]
    ) -> bool:
        """True when the pool caches ``block`` under the entry of ``tokens`` (its primary hash or a partial one)."""
        keys = [] if block.block_hash is None else [block.block_hash]
        keys += m.pool.cached_block_hashes_by_block.get(block.block_id, ())
        for key in keys:
            entry_namespace, prefix = m.prefix_of[m.utils.get_block_hash(key)]
            if entry_namespace == namespace and prefix.tokens == tokens:
                return True
        return False

    def took_finding_32(
        self, m: VllmHybridManager, block: BlockView, namespace: Namespace, tokens: tuple[int, ...]
    ) -> bool:
        """Where counted, a block cached under the entry of ``tokens`` that finding 32 left holding a shorter
        prefix's state is counted and taken as holding the entry's state, so the checks go on: seen from the cache
        (``check``) or from a request whose hit resumes from it before the next check (``write``: a burst serves the
        request that caches it and the one that hits it in one step)."""
        if not (
            self.known_partial_checkpoint
            and self.is_finding_32(m, block.block_id, namespace, tokens)
            and self.is_cached_under(m, block, namespace, tokens)
        ):
            return False
        STATS.rules[f"vllm-mamba.known: {FINDING_32}"] += 1
        self.state.write(block.block_id, namespace, tokens)
        return True

    def took_finding_15(self, m: VllmHybridManager, request: HybridRequest, hit: int) -> bool:
        """Where counted, a hit the hit rule refuses that vLLM's lookup without finding 15's cause does not give,
        while the lookup so fixed keeps the rule: counted, and the hit stands."""
        lookup = lookup_without_finding_15(type(m.coordinator).find_longest_cache_hit)
        if not (self.known_eagle_verified and m.rule.drop and lookup is not None):
            return False
        _, fixed, _ = lookup(m.coordinator, request.block_hashes, request.num_tokens - 1)
        if fixed >= hit:
            return False  # the bug only ever lengthens the hit
        try:
            m.judge_hit(-1, request, fixed)
        except IntegrityError:
            return False
        STATS.rules[f"vllm-mamba.known: {FINDING_15}"] += 1
        return True

    def check(self, m: VllmHybridManager, live_reqs: list[HybridReq]) -> None:
        """Every cached Mamba entry holds the state of its prefix; every live request's step resumes from its own."""
        for block, group, namespace, prefix in m.entries():
            if group != self.group or self.verified.get(block.block_id) == (prefix, self.state.get(block.block_id)):
                continue  # verified at an earlier check, the block's state not written since
            if not self.took_finding_32(m, block, namespace, prefix.tokens):
                self.check_state(-1, block, namespace, prefix.tokens, "cached_states_are_their_prefix")
            self.verified[block.block_id] = (prefix, self.state.get(block.block_id))
        for req in live_reqs:
            if req.computed:
                blocks = m.coordinator.get_blocks(str(req.uid))[self.group]
                tokens = tuple(m.requests[req.uid].tokens[: req.computed])
                block = blocks[(req.computed - 1) // m.page_size]
                self.check_state(req.uid, block, req.namespace, tokens, "state_resumes_from_its_prefix")


def factory(page_size: int, windows: tuple[hy.Window, ...], num_pages: int) -> VllmHybridManager:
    """vLLM's coordinator with full attention and a Mamba group in align mode: the hybrid manager given a
    ``MambaGroup`` (see the module docstring), under this target's profile, with a configuration drawn from the
    pool size (the summary counts each)."""
    bits = mix(num_pages)
    units = [u for u in range(1, page_size + 1) if (page_size % u == 0 and u > 1) or page_size == 1]
    unit = units[bits % len(units)]
    if unit == page_size and len(units) > 1 and bits // 5 % 2:
        # half the draws of the block where the page has a unit below it take one (hits inside blocks, the paths
        # only this target reaches: one example in six drew them before); a draw below the block is kept, so that
        # the programs recorded before replay as they ran
        unit = units[bits // 10 % (len(units) - 1)]
    retention = RETENTIONS[bits // 7 % len(RETENTIONS)]
    checkpoints = bits // 83 % 2 == 1
    manager = VllmHybridManager(
        page_size,
        windows,
        num_pages,
        eagle=EAGLE_MODES[bits // 3 % len(EAGLE_MODES)],
        retention=retention if not retention else retention * page_size,
        defer_free=bits // 41 % 2 == 1,
        unit=unit,
        mamba=MambaGroup(checkpoints),
        profile=PROFILE,
    )
    groups = "+".join("F" if kind is None else "M" if kind == hr.STATE else "W" for kind in manager.windows)
    retained = "dense" if retention is None else f"{retention}P"
    STATS.record_rule(
        f"vllm-mamba.config[{groups}, unit={'P' if unit == page_size else 'below P'},"
        f" partial_hits={manager.partial_hits}, checkpoints={checkpoints}]"
    )
    STATS.record_rule(
        f"vllm-mamba.config[eagle={manager.eagle}, retention={retained}, defer_free={manager.defer_free}]"
    )
    return manager


TARGET = TargetInfo(
    name="vllm-mamba",
    description=f"vLLM {VERSION} HybridKVCacheCoordinator: full attention and a Mamba group in align mode",
    requires=(("vllm", f"radixspec targets install vllm  (pip install --no-deps vllm=={VERSION} cbor2)"),),
    hybrid_factory=factory,
    profile=PROFILE,
    how="the hybrid machine: requests as KVCacheManager and the scheduler's Mamba split drive them",
    probe=import_mamba,
    page_sizes=(2, 4, 8, 16),
    engine_modules=COORDINATOR_MODULES,
)
