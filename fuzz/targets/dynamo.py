"""NVIDIA Dynamo's KV-router index (``ai-dynamo-runtime``) as a router target, behind our translation of its relay.

Dynamo's router keeps a ``RadixTree`` of every worker's blocks. Engines publish
KV events in vLLM's format (``radixspec.optimized.kv_events``); Dynamo's relay
turns each ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` into its
own event JSON: a stored block carries the engine's hash (``block_hash``, the
*external* hash, as an unsigned 64-bit integer: parents and removals resolve
by it, per worker) and a *local* hash of the block's own tokens
(``tokens_hash``: ``compute_block_hash_for_seq`` of those tokens), by which the
tree's children are linked and prompts are scored. The router scores a
prompt by the local hashes of its whole blocks.

``relay`` is that translation, ours (written from Dynamo's relay and tested on
its own). A namespace rides on the local hash: a block's extra key (our wire's
namespace) becomes ``cache_namespace``, and the router hashes a prompt of that
namespace the same way (``local_hashes``).

``radixspec targets install dynamo`` installs the wheel (``ai-dynamo-runtime``
with pydantic and uvloop); it runs on a CPU with no etcd, NATS or GPU.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from radixspec.spec.domains import Namespace
from radixspec.spec.errors import EventStreamError
from radixspec.spec.prefix_cache import PageKey, Prefix

from .api import TargetInfo

if TYPE_CHECKING:
    from radixspec.optimized.kv_events import ReadEvent, ReadStored, WireReader

VERSION = "1.6.1"
U64 = 2**64


def external_hash(block_hash: object) -> int:
    """An engine's block hash as Dynamo's external hash: an int as its 64 bits (vLLM's and SGLang's may be
    negative; Dynamo casts them). Bytes (vLLM's sha256 hashes, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) are
    refused: Dynamo 1.6.1's relay fails to decode such a batch and drops it whole (a warning in its log)."""
    if isinstance(block_hash, (bytes, bytearray)):
        raise EventStreamError(
            "a block hash of bytes: Dynamo 1.6.1's relay drops this batch whole (it reads int hashes only)"
        )
    if isinstance(block_hash, bool) or not isinstance(block_hash, int):
        raise EventStreamError(f"a block hash must be an int, got {block_hash!r}")
    return block_hash % U64


def cache_namespace(namespace: Namespace) -> str | None:
    """The ``cache_namespace`` a prompt of ``namespace`` is hashed under: the salt its blocks go on the wire with
    (``kv_events.wire_namespace``: ours ``repr(namespace)``; an engine's its ``cache_salt``)."""
    from radixspec.optimized.kv_events import wire_namespace

    key = wire_namespace(namespace)
    return None if key is None else key[1]


def lora_name(namespace: Namespace) -> str | None:
    """The LoRA name a prompt of ``namespace`` is hashed with (an engine's namespace that names one)."""
    from radixspec.optimized.kv_events import wire_namespace

    key = wire_namespace(namespace)
    return None if key is None else key[0]


class Hasher:
    """Local hashes (``compute_block_hash_for_seq``), cached per (namespace, LoRA, block tokens)."""

    def __init__(self, block_size: int) -> None:
        from dynamo._core import compute_block_hash_for_seq

        self.block_size = block_size
        self._compute = compute_block_hash_for_seq
        self._known: dict[tuple[str | None, str | None, tuple[int, ...]], int] = {}

    def of_blocks(self, tokens: Sequence[int], namespace: str | None, lora_name: str | None = None) -> list[int]:
        """The local hash of each whole block of ``tokens`` (a partial last block has none)."""
        size = self.block_size
        out = []
        for start in range(0, len(tokens) - size + 1, size):
            block = tuple(tokens[start : start + size])
            found = self._known.get((namespace, lora_name, block))
            if found is None:
                found = self._compute(list(block), size, lora_name=lora_name, cache_namespace=namespace)[0]
                self._known[(namespace, lora_name, block)] = found
            out.append(found)
        return out


# an extra key Dynamo's relay reads as the request's cache salt (any other string among extra keys it ignores)
SALT_PREFIX = "dynamo-cache-salt:"


def event_salt(event: ReadStored) -> str | None:
    """The cache namespace a stored event names itself, as Dynamo's relay reads it: its ``cache_salt`` (SGLang's
    field, ours), else a first-block extra key prefixed ``dynamo-cache-salt:``."""
    if event.cache_salt:
        return event.cache_salt
    first = event.extra_keys[0] if event.extra_keys else None
    for item in first or ():
        if isinstance(item, str) and item.startswith(SALT_PREFIX):
            return item[len(SALT_PREFIX) :]
    return None


@dataclass(frozen=True)
class Relayed:
    """One event as Dynamo's relay sends it (its JSON), and a stored event's blocks as (external, local) hashes."""

    kind: str
    event: dict[str, object]
    blocks: tuple[tuple[int, int], ...] = ()


def relay(
    events: Sequence[ReadEvent], hasher: Hasher, first_id: int, salts: dict[int, str | None] | None = None
) -> list[Relayed]:
    """Decoded events (``kv_events.decode``'s) as Dynamo's event JSON, one per event, numbered from ``first_id``.

    A block's local hash mixes in its event's LoRA name and cache namespace (``event_salt``; an event that names
    none takes its parent's: ``salts``, the worker's external hash -> namespace, kept by the caller across
    batches). A stored event's blocks past the token ids it carries (a partial block) are left out; a batch
    with bytes hashes (vLLM's sha256 hashes) is refused (``external_hash``): Dynamo 1.6.1 drops it whole.
    """
    from radixspec.optimized import kv_events

    salts = {} if salts is None else salts
    out: list[Relayed] = []
    for number, event in enumerate(events, start=first_id):
        if isinstance(event, kv_events.ReadStored):
            if event.block_size != hasher.block_size:
                raise EventStreamError(f"a block of {event.block_size} tokens, the router's are {hasher.block_size}")
            parent = event.parent_block_hash
            salt = event_salt(event)
            if salt is None and parent is not None:
                salt = salts.get(external_hash(parent))
            blocks: list[dict[str, int]] = []
            for index, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[index * hasher.block_size : (index + 1) * hasher.block_size]
                if len(tokens) < hasher.block_size:
                    break
                (local,) = hasher.of_blocks(tokens, salt, event.lora_name)
                salts[external_hash(block_hash)] = salt
                blocks.append({"block_hash": external_hash(block_hash), "tokens_hash": local})
            stored = {"parent_hash": None if parent is None else external_hash(parent), "blocks": blocks}
            pairs = tuple((block["block_hash"], block["tokens_hash"]) for block in blocks)
            out.append(Relayed("stored", {"event_id": number, "data": {"stored": stored}}, pairs))
        elif isinstance(event, kv_events.ReadRemoved):
            hashes = [external_hash(h) for h in event.block_hashes]
            out.append(Relayed("removed", {"event_id": number, "data": {"removed": {"block_hashes": hashes}}}))
        elif isinstance(event, kv_events.ReadCleared):
            out.append(Relayed("cleared", {"event_id": number, "data": "cleared"}))
        else:
            raise EventStreamError(f"not a KV cache event: {event!r}")
    return out


class DynamoRouter:
    """Dynamo's ``RadixTree`` fed through ``relay``; its dump's blocks named back as pages by what was relayed."""

    name = "dynamo"

    def __init__(self, page_size: int) -> None:
        from dynamo._core import RadixTree

        self.page_size = page_size
        self.tree = RadixTree()
        self.hasher = Hasher(page_size)
        # per worker: the next event id, the relay's namespaces by external hash, the stream's reader (our view of
        # each block's namespace), and external hash -> (the page it was relayed as, its local-hash chain)
        self.event_ids: dict[int, int] = {}
        self.salts: dict[int, dict[int, str | None]] = {}
        self.readers: dict[int, WireReader] = {}
        self.external: dict[int, dict[int, tuple[PageKey, tuple[int, ...]]]] = {}
        # chain of local hashes from the root -> the page, for every page ever relayed (the dump names pages so)
        self.named: dict[tuple[int, ...], PageKey] = {}

    def apply(self, worker: int, payload: bytes) -> None:
        from radixspec.optimized import kv_events

        batch = kv_events.decode(payload)
        first = self.event_ids.get(worker, 0)
        relayed = relay(batch.events, self.hasher, first, self.salts.setdefault(worker, {}))
        self.learn(worker, batch.events, relayed)
        for one in relayed:
            self.tree.apply_event(worker, json.dumps(one.event).encode())
        self.event_ids[worker] = first + len(batch.events)

    def learn(self, worker: int, events: Sequence[ReadEvent], relayed: list[Relayed]) -> None:
        """Name every relayed block by the page the worker stored (its namespace as the worker meant it) and by
        the chain of local hashes Dynamo got (the wire carries only the new blocks: a chain continues its
        parent's, relayed before it)."""
        from radixspec.optimized import kv_events

        reader = self.readers.setdefault(worker, kv_events.WireReader())
        known = self.external.setdefault(worker, {})
        size = self.page_size
        stored = iter([one for one in relayed if one.kind == "stored"])
        for event in events:
            if not isinstance(event, kv_events.ReadStored):
                continue
            one = next(stored)
            namespaces = reader.block_namespaces(event)
            parent = event.parent_block_hash
            above = known.get(external_hash(parent)) if parent is not None else None
            if parent is not None and above is None:
                continue  # an unknown parent: Dynamo skips the store too
            prefix, chain = (above[0][1], above[1]) if above is not None else (None, ())
            for index, (external, local) in enumerate(one.blocks):
                tokens = tuple(event.token_ids[index * size : (index + 1) * size])
                prefix = Prefix.extend(prefix, tokens)
                chain = (*chain, local)
                key: PageKey = (kv_events.our_namespace(namespaces[index]), prefix)
                known[external] = (key, chain)
                self.named[chain] = key

    def scores(self, tokens: list[int], namespace: Namespace) -> dict[int, int]:
        local = self.hasher.of_blocks(tokens, cache_namespace(namespace), lora_name(namespace))
        if not local:
            return {}
        out: dict[int, int] = {}
        for where, blocks in self.tree.find_matches(local).scores.items():
            # (worker, dp rank) pairs, though 1.6.1's type stub says worker ids
            key: object = where
            worker = cast(int, key[0] if isinstance(key, tuple) else key)
            out[worker] = out.get(worker, 0) + blocks
        return {worker: blocks for worker, blocks in out.items() if blocks}

    def live(self) -> dict[int, set[Hashable]]:
        """The dump, each block named by its chain of local hashes from the root, then as the page relayed so."""
        tables: dict[int, dict[int, tuple[int | None, int]]] = {}
        for line in self.tree.dump_tree_as_events():
            record = json.loads(line)
            stored = record["event"]["data"]["stored"]
            parent = stored["parent_hash"]
            table = tables.setdefault(record["worker_id"], {})
            for block in stored["blocks"]:
                table[block["block_hash"]] = (parent, block["tokens_hash"])
                parent = block["block_hash"]
        out: dict[int, set[Hashable]] = {}
        for worker, table in tables.items():
            names: set[Hashable] = set()
            for external in table:
                chain: list[int] = []
                at: int | None = external
                while at is not None and at in table and len(chain) <= len(table):
                    parent, local = table[at]
                    chain.append(local)
                    at = parent
                whole = tuple(reversed(chain))
                # a block whose chain does not reach the root, or that no relayed page had, is named as itself
                names.add(self.named.get(whole, ("unknown block", external)) if at is None else ("orphan", external))
            out[worker] = names
        return out

    def entry_of(self, key: PageKey) -> Hashable:
        namespace, prefix = key
        pages = []
        at: Prefix | None = prefix
        while at is not None:
            pages.append(at.page)
            at = at.parent
        tokens = [token for page in reversed(pages) for token in page]
        return tuple(self.hasher.of_blocks(tokens, cache_namespace(namespace), lora_name(namespace)))

    def remove_worker(self, worker: int) -> None:
        self.tree.remove_worker(worker)
        for table in (self.event_ids, self.salts, self.readers, self.external):
            table.pop(worker, None)


def probe() -> object:
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    return RadixTree, compute_block_hash_for_seq


TARGET = TargetInfo(
    name="dynamo",
    description=f"NVIDIA Dynamo's KV-router index (ai-dynamo-runtime {VERSION} RadixTree) behind our relay",
    router_factory=DynamoRouter,
    requires=(
        ("dynamo", f"radixspec targets install dynamo  (pip install ai-dynamo-runtime=={VERSION})"),
        ("msgspec", "pip install 'radixspec[events]'"),
    ),
    probe=probe,
)
