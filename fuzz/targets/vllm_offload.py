"""Target ``vllm-offload``: vLLM 0.33.0's KV offloading, scheduler side: ``CPUOffloadingManager``, the host tier the
``OffloadingConnector``'s scheduler offers computed chunks to and loads hits from, with each eviction policy it
ships (``lru``, ``arc``).

The offload machine plays the connector's scheduler as it calls the manager (``OffloadingConnectorScheduler``,
replayed: that module needs vLLM's whole config package to import): per request ``on_new_request`` with the end
position of each key in its ``ReqContext``; ``lookup`` of its keys; ``prepare_load`` of the hit in one job (its
keys distinct, as a job's key set is); ``prepare_store`` of the chunks past the hit (the chunk-level policy), as
they are computed; ``on_request_finished``; ``complete_store`` / ``complete_load`` with a job's keys when the
workers report it; ``reset_cache`` as ``reset_prefix_cache(reset_connector=True)`` reaches it, after which the
scheduler delivers no completion of an older job (its ``_stale_job_threshold``). A chunk is one page
(``blocks_per_chunk`` 1); its key is a chained hash of the page's prefix (the namespace seeds the chain, as a
``cache_salt`` does) in group 0, as the scheduler makes it.

What is shimmed, and why it cannot hide a bug of the manager: six packages are registered without their
``__init__`` (``vllm``, ``vllm.distributed``, ``.kv_transfer``, ``.kv_connector``, ``.kv_connector.v1``,
``vllm.v1``: they patch torch, start parallel state, import every connector), and two names the import chain
reads are stand-ins that raise if called (``VllmConfig`` / ``KVTransferConfig``: annotations of the connector's
metrics; ``KVConnectorFactory``: used by its Prometheus logging only). The manager, its policies, its events and
``ReqContext`` are vLLM's own code, unchanged.
"""

from __future__ import annotations

import hashlib
import sys
import types
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal, Protocol, TypeVar, cast

from radixspec.spec import offload as of
from radixspec.spec.errors import IntegrityError
from radixspec.spec.prefix_cache import PageKey

from .api import Profile, StoreOutput, TargetError, TargetInfo
from .shims import Never, bare, install, package_root, register, stub
from .vllm import OFFLOAD_MANAGER_MODULES

VERSION = "0.33.0"
# the eviction policies vLLM 0.33.0 registers (CachePolicyFactory)
POLICIES = ("lru", "arc")
# store thresholds drawn (half the examples store every offer), and tracker sizes (64,000: the connector's default)
THRESHOLDS = (1, 1, 2, 3)
TRACKERS = (4, 16, 64_000)


def import_offload() -> types.ModuleType:
    """vLLM's CPU offloading manager and its interface, with bare packages and two stand-ins."""
    cached = sys.modules.get("vllm.__radixspec_offload__")
    if cached is not None:
        return cached
    import importlib

    root = package_root("vllm")
    for name in (
        "vllm",
        "vllm.distributed",
        "vllm.distributed.kv_transfer",
        "vllm.distributed.kv_transfer.kv_connector",
        "vllm.distributed.kv_transfer.kv_connector.v1",
        "vllm.v1",
    ):
        bare(name, root.joinpath(*name.split(".")[1:]))
    config = sys.modules.get("vllm.config")
    if config is None:
        config = stub("vllm.config")
    for attribute in ("VllmConfig", "KVTransferConfig"):
        if not hasattr(config, attribute):
            install(config, **{attribute: Never})
    stub("vllm.distributed.kv_transfer.kv_connector.factory", KVConnectorFactory=Never)
    base = importlib.import_module("vllm.v1.kv_offload.base")
    manager = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
    return register("vllm.__radixspec_offload__", base=base, manager=manager)


class ChunkStatus(Protocol):
    """What the adapter reads of vLLM's ``ChunkStatus``: its slot and its pins (-1 while its store is in flight)."""

    chunk_id: int
    ref_cnt: int


# a chunk's key (the adapter's bytes, the connector's offload keys)
K = TypeVar("K", bound=Hashable)


class CPUManager(Protocol):
    """What the adapters read of a ``CPUOffloadingManager``: its policy (LRU's or ARC's) and its counters."""

    _policy: object
    _num_write_pending_chunks: int
    _num_evictable_cache_chunks: int


def policy_chunks(manager: CPUManager) -> dict[Hashable, ChunkStatus]:
    """Every chunk a ``CPUOffloadingManager``'s policy holds (LRU: one map; ARC: its two resident lists)."""
    policy = manager._policy
    if hasattr(policy, "chunks"):
        return dict(policy.chunks)
    return {**getattr(policy, "t1"), **getattr(policy, "t2")}  # noqa: B009


def check_counts(manager: CPUManager, chunks: Mapping[K, ChunkStatus]) -> set[K]:
    """``manager_counts_its_chunks``: its counters of write-pending and evictable chunks are its chunks'; the idle
    ones."""
    pending = sum(chunk.ref_cnt == of.PENDING for chunk in chunks.values())
    idle = {key for key, chunk in chunks.items() if chunk.ref_cnt == 0}
    counted = (manager._num_write_pending_chunks, manager._num_evictable_cache_chunks)
    if counted != (pending, len(idle)):
        raise IntegrityError(
            f"manager_counts_its_chunks: counts {counted} (write pending, evictable), chunks {(pending, len(idle))}"
        )
    return idle


class VllmOffloadStore:
    """``CPUOffloadingManager`` as an ``OffloadTarget``: page keys as chained offload keys, requests as contexts."""

    def __init__(self, capacity: int, draw: int, policy: str | None = None) -> None:
        vllm = import_offload()
        self.base = vllm.base
        # the policy: the one the target names (vllm-offload:arc), else drawn
        policy = policy or POLICIES[draw % len(POLICIES)]
        # store_threshold (1: every offer stored; the connector's default), and a tracker small enough to forget
        self.threshold = THRESHOLDS[draw // len(POLICIES) % len(THRESHOLDS)]
        self.tracker_size = TRACKERS[draw // len(POLICIES) // len(THRESHOLDS) % len(TRACKERS)]
        self.config = policy if self.threshold < 2 else f"{policy}, threshold {self.threshold}"
        self.manager = vllm.manager.CPUOffloadingManager(
            num_chunks=capacity,
            cache_policy=policy,
            enable_events=True,
            store_threshold=self.threshold,
            max_tracker_size=self.tracker_size,
        )
        self.capacity = capacity
        self.contexts: dict[int, object] = {}
        self.offload_keys: dict[PageKey, bytes] = {}
        self.page_keys: dict[bytes, PageKey] = {}

    # ------------------------------------------------------------ keys and requests

    def key_of(self, key: PageKey) -> bytes:
        """The offload key of ``key``: a hash chained over its pages from a seed of its namespace."""
        found = self.offload_keys.get(key)
        if found is None:
            namespace, prefix = key
            parent = (
                self.key_of((namespace, prefix.parent))[:-4]
                if prefix.parent is not None
                else hashlib.sha256(repr(namespace).encode()).digest()
            )
            found = self.base.make_offload_key(hashlib.sha256(parent + repr(prefix.page).encode()).digest(), 0)
            self.offload_keys[key], self.page_keys[found] = found, key
        return found

    def keys_of(self, keys: Sequence[PageKey]) -> list[bytes]:
        return [self.key_of(key) for key in keys]

    def begin(self, request: int, keys: Sequence[PageKey]) -> None:
        context = self.base.ReqContext(req_id=str(request))
        for key in keys:
            context.set_offload_key_position(self.key_of(key), key[1].length)
        self.contexts[request] = context
        self.manager.on_new_request(context)

    def finish(self, request: int) -> None:
        self.manager.on_request_finished(self.contexts.pop(request))

    def context(self, request: int) -> object:
        # a finished request's jobs still complete under its context
        return self.contexts.get(request) or self.base.ReqContext(req_id=str(request))

    # ------------------------------------------------------------ the manager's calls

    def lookup(self, request: int, key: PageKey) -> Literal["miss", "pending", "hit"]:
        found = self.manager.lookup(self.key_of(key), self.context(request))
        results = self.base.LookupResult
        if found == results.MISS:
            return "miss"
        if found == results.HIT_PENDING:
            return "pending"
        if found == results.HIT:
            return "hit"
        raise IntegrityError(f"lookup_answers: the CPU manager answered {found} for {key!r}")

    def prepare_store(self, request: int, keys: Sequence[PageKey]) -> StoreOutput | None:
        output = self.manager.prepare_store(self.keys_of(keys), self.context(request))
        if output is None:
            return None
        return StoreOutput(
            tuple(self.page_keys[key] for key in output.keys_to_store),
            tuple(int(slot) for slot in output.store_spec.block_ids),
            tuple(self.page_keys[key] for key in output.evicted_keys),
        )

    def complete_store(self, request: int, keys: Sequence[PageKey], success: bool) -> None:
        self.manager.complete_store(self.keys_of(keys), self.context(request), success=success)

    def prepare_load(self, request: int, keys: Sequence[PageKey]) -> Sequence[int]:
        spec = self.manager.prepare_load(self.keys_of(keys), self.context(request))
        return [int(slot) for slot in spec.block_ids]

    def complete_load(self, request: int, keys: Sequence[PageKey]) -> None:
        self.manager.complete_load(self.keys_of(keys), self.context(request))

    def reset(self) -> None:
        self.manager.reset_cache()

    def take_events(self) -> list[tuple[PageKey, bool]]:
        return [
            (self.page_keys[key], bool(event.removed))
            for event in self.manager.take_events()
            # a failed store's cleanup (0.33.0; 0.32.0's events have no such flag and queue none)
            if not getattr(event, "metadata_only", False)
            for key in event.keys
        ]

    # ------------------------------------------------------------ what the laws read

    def chunks(self) -> dict[bytes, ChunkStatus]:
        return cast(dict[bytes, ChunkStatus], policy_chunks(self.manager))

    def view(self) -> of.OffloadView:
        held = {
            self.page_keys[key]: of.Chunk(int(chunk.chunk_id), int(chunk.ref_cnt))
            for key, chunk in self.chunks().items()
        }
        fresh = range(self.manager._num_allocated_chunks, self.capacity)
        counts = self.manager.counts or {}
        offers = [(self.page_keys[key], count) for key, count in counts.items()]
        return of.OffloadView(self.capacity, held, [*self.manager._free_list, *fresh], offers)

    def check_integrity(self) -> None:
        """The manager's counters and its policy's evictable set agree with its chunks."""
        idle = check_counts(self.manager, self.chunks())
        evictable = getattr(self.manager._policy, "_evictable", None)
        if evictable is not None and set(evictable) != idle:
            raise IntegrityError(
                f"policy_knows_the_idle_chunks: LRU's evictable set {len(evictable)}, idle {len(idle)}"
            )


PROFILE = Profile(
    name=f"vllm {VERSION} CPUOffloadingManager (KV offloading, host tier)",
    default_lru="sync",
    notes=(
        "which idle chunks an offer evicts and which free slots it takes are its policy's (lru, arc): the spec takes"
        " them after checking the rules allow them (sync), no order is predicted",
        "a reset abandons the jobs in flight (reset_connector=True); the scheduler delivers none of their completions",
    ),
)


def target(argument: str | None) -> TargetInfo:
    """``vllm-offload`` (each example draws its policy), ``vllm-offload:lru``, ``vllm-offload:arc``."""
    if argument is not None and argument not in POLICIES:
        raise TargetError(f"vllm-offload takes a policy ({', '.join(POLICIES)}), got {argument!r}")

    def factory(capacity: int, draw: int) -> VllmOffloadStore:
        return VllmOffloadStore(capacity, draw, argument)

    return TargetInfo(
        name="vllm-offload" if argument is None else f"vllm-offload:{argument}",
        description=f"vLLM {VERSION} KV offloading: CPUOffloadingManager ({argument or 'lru, arc'}) as its connector's"
        " scheduler drives it",
        requires=(
            ("vllm", f"radixspec targets install vllm  (pip install --no-deps vllm=={VERSION} prometheus_client)"),
            ("prometheus_client", "radixspec targets install vllm  (pip install prometheus_client)"),
        ),
        offload_factory=factory,
        profile=PROFILE,
        how="the offload machine: the scheduler's calls and the workers' completions, late, out of order, failed",
        probe=import_offload,
        engine_modules=OFFLOAD_MANAGER_MODULES,
    )


TARGET = target(None)
