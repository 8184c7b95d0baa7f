"""HiCache with the MAMBA component (``sglang-hicache:mamba``): SGLang 0.5.23's ``UnifiedRadixCache`` with FULL and
MAMBA (the ``sglang-mamba`` target's cache and lifecycle, ``sglang_unified_mamba.py``) and a host tier behind both
pools, as SGLang's ``_MambaStrategy`` builds it (``build_hybrid_mamba_stack``): the anchor host pool over the full
KV pool, a ``MambaPoolHost`` over the device's state pool, reclaimed by evicting the MAMBA component on the host
(``evict_host(n, MAMBA)``) and on the device (the state shortfall, ``_evict_mamba_for_device_alloc``), its device
slots from SGLang's ``MambaSlotAllocator``.

What stands in, beside ``sglang_hicache.py``'s:

* the device state pool (``StateBuffers``): SGLang's ``MambaPool`` module imports triton, so its buffers are ours:
  one state layer with a temporal and a conv tensor of one int64 per slot (slot 0 the dummy, as SGLang's), in the
  buffer description the host pool reads (``MambaStateBufferInfo``); what each slot's state is of stays the
  ``sglang-mamba`` target's shadow (``StateShadow``), which the copies below move;
* the two ``sgl_kernel`` functions the state host pool calls under the ``direct`` backend with its
  ``page_first_direct`` layout (the only layouts ``MambaPoolHost`` takes): ``transfer_kv_all_layer_direct_lf_pf``
  (a backup: every layer's slots into the host's page-first rows) and ``transfer_kv_per_layer_direct_pf_lf`` (a load,
  layer by layer), torch index copies of the same indices put on the current stream, as ``transfer_kv_direct`` is
  for the KV. The KV host pool's layout is drawn as without MAMBA (``layer_first`` or ``page_first_direct``; SGLang
  gives both pools one layout, and the state pool takes only the page-first ones: the draw of ``layer_first`` beside
  it is ours);
* the host pools are unpinned, and the layer counter is registered on the request table too (SGLang's
  ``register_req_to_token_counter``).

The shadow of the host's state slots is kept here (``HostStates``): a backup's copy gives a host slot the state
the device slot held when the copy ran, a load the reverse. So a state loaded back from the wrong host slot, or
read after its source was reused, is caught where the lifecycle reads it: the copy a match makes
(``the_copied_state_is_the_hits``) and the request's own state (``the_requests_state_is_its_own``). The tier's
laws cover the state pools too: no free list holds a slot twice, no copy in flight or queued reads or writes a
free state slot, and at idle the host's state pool is all free.
"""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from radixspec.reference.hybrid_manager import HybridReq

from ..lifecycle import SLOTS_PER_POOL, StateShadow
from ..stats import STATS
from .sglang_hicache import EXECUTOR, LAYERS, MAMBA_DEVICE_POOL, MAMBA_HOST_POOL, HostTier, import_hicache
from .sglang_unified import Record, RequestTable, SGLangUnifiedManager
from .sglang_unified_mamba import RecurrentState, StatePool
from .shims import install

if TYPE_CHECKING:
    import torch


# the state layer's model layer id: after the attention layers (full, then SWA's where the model has a window)
def state_layer(m: SGLangUnifiedManager) -> int:
    return LAYERS if m.swa is None else 2 * LAYERS


FINDING_26 = "a declined load back leaves a device hit with a cleared state (finding 26)"


class StateBuffers(StatePool):
    """The device's state pool as the host pool reads it: one layer, a temporal and a conv tensor of one int64 per
    slot (slot 0 SGLang's dummy), and the shadow of what each slot's state is of."""

    host_capacity_tokens = None

    def __init__(self, size: int, layer: int) -> None:
        import torch

        super().__init__()
        self.size, self.layer = size, layer
        self.temporal = torch.full((1, size + 1, 1), -1, dtype=torch.int64)
        self.conv = (torch.full((1, size + 1, 1), -1, dtype=torch.int64),)

    def get_device_pool_infos(self) -> list[types.SimpleNamespace]:
        m = import_hicache()
        info = m.info.MambaStateBufferInfo(temporal=self.temporal, conv=self.conv)
        names = m.storage.PoolName
        return [
            m.info.DevicePoolInfo(
                pool_name=names.MAMBA, indices_from_pool=names.MAMBA, layer_ids=(self.layer,), buffer_info=info
            )
        ]


def state_copy(
    sources: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    source_slots: torch.Tensor,
    target_slots: torch.Tensor,
    layer: int | None,
) -> None:
    """One of the state host pool's kernels as torch copies on the current stream: ``layer`` None, a backup of
    every layer (device layers -> the host's page-first rows); else a load of that layer (host rows -> the device
    layer). The temporal tensor's copy moves the shadow (``HostStates.copied``)."""
    tier = HostTier.owner(targets[0])
    states = None if tier is None else cast("HostStates | None", tier.states)
    moves = states is not None and states.moves(sources[0], targets[0])
    epoch = states.submitted(sources[0], source_slots, target_slots) if states is not None and moves else -1
    sources, targets = list(sources), list(targets)
    source_slots, target_slots = source_slots.clone(), target_slots.clone()

    def run() -> None:
        if layer is None:
            for j, source in enumerate(sources):
                targets[0][target_slots, j, 0] = source[source_slots]
        else:
            targets[0][target_slots] = sources[0][source_slots, layer, 0]
        if states is not None and moves:
            states.copied(sources[0], source_slots, target_slots, epoch)

    EXECUTOR.current.enqueue(run)


def state_backup(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``transfer_kv_all_layer_direct_lf_pf`` as the state host pool calls it (one destination: its rows)."""
    assert page_size == 1 and len(dst_ptrs) == 1, "the state pool copies slots into one page-first buffer"
    state_copy(src_ptrs, dst_ptrs, src_indices, dst_indices, None)


def state_load(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """``transfer_kv_per_layer_direct_pf_lf`` as the state host pool calls it (one layer, one buffer each side)."""
    assert page_size == 1 and len(src_ptrs) == len(dst_ptrs) == 1, "the state pool loads one buffer per layer"
    state_copy(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id)


def import_mamba_host() -> types.ModuleType:
    """SGLang's state host pool module, its two direct kernels ours (``state_backup``, ``state_load``)."""
    import_hicache()
    module = importlib.import_module("sglang.srt.mem_cache.pool_host.mamba")
    # a host pool smaller than its device pool is drawn on purpose: its warning on every cache built set to errors
    logging.getLogger(module.__name__).setLevel(logging.ERROR)
    install(module, transfer_kv_all_layer_direct_lf_pf=state_backup, transfer_kv_per_layer_direct_pf_lf=state_load)
    return module


class HostStates:
    """The MAMBA component's host tier for one ``HostTier``: the state host pool, built as ``_MambaStrategy``
    builds it, the shadow of its slots, and its part of the tier's checks."""

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        self.shadow = StateShadow()
        self.device: StateBuffers | None = None
        self.host: object = None
        self.slots = 0

    def entry(self, cache: object, params: object, bound: int) -> object:
        """The MAMBA entry of the host pool group: ``MambaPoolHost`` over the device's state pool, its host slots
        the tier's ratio of the device's, reclaimed by evicting the MAMBA component on either tier."""
        m, host_module = import_hicache(), import_mamba_host()
        table = cast(types.SimpleNamespace, params).req_to_token_pool
        device, allocator = cast(StateBuffers, table.mamba_pool), table.mamba_allocator
        components, urc = m.v.components, cast(types.SimpleNamespace, cache)
        host = host_module.MambaPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            self.tier.ratio,
            0,
            device_capacity=device.size,
            pin_memory=False,
            device="cpu",
            layout="page_first_direct",
        )

        def device_evict(size: int) -> None:
            # _evict_mamba_for_device_alloc: the state shortfall evicted from the device
            shortfall = size - int(allocator.schedulable_available_size())
            if shortfall > 0:
                urc.evict_for_alloc(m.v.base.EvictParams(mamba_num=shortfall))

        self.device, self.host, self.slots = device, host, int(host.size)
        return m.group.PoolEntry(
            name=m.storage.PoolName.MAMBA,
            host_pool=host,
            device_pool=device,
            layer_mapper=lambda layer: 0 if layer == device.layer and 0 <= layer < bound else None,
            host_evict_fn=lambda size: urc.evict_host(size, components.MAMBA),
            device_evict_fn=device_evict,
            device_alloc_fn=allocator.alloc,
            device_free_fn=allocator.free,
        )

    def attach(self, cache: object, params: object, controller: object) -> None:
        """``_apply_stack_result``'s part for MAMBA: its host pool on the cache and the component, the layer counter
        on the request table; the state tensors named to the tier."""
        m = import_hicache()
        urc = cast(types.SimpleNamespace, cache)
        urc.mamba_pool_host = self.host
        urc.components[m.v.components.MAMBA]._mamba_pool_host = self.host
        table = cast(types.SimpleNamespace, params).req_to_token_pool
        table.register_layer_transfer_counter(cast(types.SimpleNamespace, controller).layer_done_counter)
        device, host = cast(StateBuffers, self.device), cast(types.SimpleNamespace, self.host)
        self.tier.register((device.temporal, *device.conv), MAMBA_DEVICE_POOL)
        self.tier.register((host.temporal_buffer, *host.conv_buffer), MAMBA_HOST_POOL)

    # ------------------------------------------------------------ the copies

    def moves(self, read: torch.Tensor, written: torch.Tensor) -> bool:
        """Whether a copy between these tensors is the temporal state's (the one the shadow follows: each state
        copy also copies the conv tensor, with the same slots)."""
        device, host = cast(StateBuffers, self.device), cast(types.SimpleNamespace, self.host)
        ends = {read.untyped_storage().data_ptr(), written.untyped_storage().data_ptr()}
        temporal = {device.temporal.untyped_storage().data_ptr(), host.temporal_buffer.untyped_storage().data_ptr()}
        return ends == temporal

    def submitted(self, read: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> int:
        """A state copy put on a stream: its slots are in flight until it runs (the tier's counters)."""
        self.tier.flight(*self.ends(read), sources, targets, 1)
        return self.tier.epoch

    def copied(self, read: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor, epoch: int) -> None:
        """A state copy ran: the target slots hold what the source slots held; they leave the flight."""
        source_pool, into = self.ends(read)
        device = cast(StateBuffers, self.device).shadow
        source_shadow, target_shadow = (device, self.shadow) if into == MAMBA_HOST_POOL else (self.shadow, device)
        for source, slot in zip(sources.tolist(), targets.tolist(), strict=True):
            held = source_shadow.get(int(source))
            if held is None:
                target_shadow.clear(int(slot))
            else:
                target_shadow.write(int(slot), *held)
        if epoch == self.tier.epoch:
            self.tier.flight(source_pool, into, sources, targets, -1)

    def ends(self, read: torch.Tensor) -> tuple[int, int]:
        """The pools a state copy reading ``read`` reads and writes."""
        if self.tier.pool_of(read) == MAMBA_DEVICE_POOL:
            return MAMBA_DEVICE_POOL, MAMBA_HOST_POOL
        return MAMBA_HOST_POOL, MAMBA_DEVICE_POOL

    def incoming(self) -> set[int]:
        """The device state slots a copy in flight writes."""
        base = MAMBA_DEVICE_POOL * SLOTS_PER_POOL
        return {slot - base for slot in self.tier.writing if base <= slot < base + SLOTS_PER_POOL}

    # ------------------------------------------------------------ checks

    def free_lists(self, m: SGLangUnifiedManager) -> dict[int, list[int]]:
        """The state pools' free slots: the device allocator's, the host pool's (free and queued for release)."""
        allocator = cast(types.SimpleNamespace, m.table).mamba_allocator
        return {
            MAMBA_DEVICE_POOL: [int(s) for s in allocator.free_slots.tolist()],
            MAMBA_HOST_POOL: HostTier.free_host_slots(cast(types.SimpleNamespace, self.host)),
        }

    def host_free(self) -> int:
        return int(cast(types.SimpleNamespace, self.host).available_size())


class TieredState(RecurrentState):
    """The MAMBA component with HiCache behind it: its state pool with tensors (``StateBuffers``); a match, and
    the check of a request's state, wait for the state loads in flight (SGLang's forward waits for them before its
    copy on match reads a slot, ``copy_mamba_state``)."""

    # a match may load a state back into the node's device slot besides the request's own: the scheduler's budget
    # counts a slot for it (``_mamba_gap_budget_for_req``: one per state host hit)
    spare = 1

    # finding 26 (docs/findings.md): a declined load back leaves the request its device hit with no state copied;
    # counted (tests turn it off to see the_requests_state_is_its_own fail)
    known_cleared_state = True

    def table(self, m: SGLangUnifiedManager) -> RequestTable:
        table = super().table(m)
        cast(types.SimpleNamespace, table).mamba_pool = StateBuffers(self.states, state_layer(m))
        return table

    @staticmethod
    def host_states(m: SGLangUnifiedManager) -> HostStates:
        states = cast(HostTier, m.tiers).states
        assert states is not None, "a tier under a MAMBA component keeps its states"
        return cast(HostStates, states)

    def match_params(self, m: SGLangUnifiedManager, key: object, record: Record) -> object:
        """Before a match, the state loads in flight land: a node's device state is set when its load is
        submitted, and the tree's states the hit rule reads are the shadow's."""
        if self.host_states(m).incoming():
            STATS.record_rule("sglang-hicache.match[state loads landed first]")
            cast(HostTier, m.tiers).forward(m)
        return super().match_params(m, key, record)

    def adopt(self, m: SGLangUnifiedManager, req: HybridReq, record: Record, hit: int) -> None:
        """As ``RecurrentState.adopt``. A device hit with no state copied and no slot a load took is what a declined
        load back leaves (finding 26: the copy on match reads only the best match, whose state is on the host only):
        SGLang clears the request's state and runs it from its hit. Counted; the shadow then takes that state as the
        hit's, so the checks go on with what follows."""
        cleared = hit > 0 and record.kv.mamba_cow_src_index is None and not record.kv.holds_mamba
        super().adopt(m, req, record, hit)
        if cleared and self.known_cleared_state:
            STATS.rules[f"sglang-hicache.known: {FINDING_26}"] += 1
            self.state_pool(m).shadow.write(record.kv.state_slot(), req.namespace, tuple(req.input_ids[:hit]))

    def check(self, m: SGLangUnifiedManager, req: HybridReq, record: Record) -> None:
        """As ``RecurrentState.check``, but not while a load writes the request's own state (it lands before the
        request's forward reads it)."""
        if record.kv.holds_mamba and record.kv.state_slot() in self.host_states(m).incoming():
            STATS.record_rule("sglang-hicache.check[request's state loading]")
            return
        super().check(m, req, record)
