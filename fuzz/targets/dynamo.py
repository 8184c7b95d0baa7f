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
from typing import TYPE_CHECKING, cast

from radixspec.spec.domains import Namespace
from radixspec.spec.errors import EventStreamError
from radixspec.spec.prefix_cache import PageKey, Prefix

from .api import TargetInfo
from .routers import namespace_of_extra

if TYPE_CHECKING:
    from radixspec.optimized.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    WireEvent = BlockStored | BlockRemoved | AllBlocksCleared

VERSION = "1.6.1"
U64 = 2**64


def external_hash(block_hash: object) -> int:
    """An engine's block hash as Dynamo's external hash: an int as its 64 bits (vLLM's and SGLang's may be
    negative; Dynamo casts them), bytes (vLLM's sha256 hashes) as their last 8 bytes, big-endian, as Dynamo's
    newer relay reads them (1.6.1's drops a batch with bytes hashes whole)."""
    if isinstance(block_hash, bool):
        raise EventStreamError(f"a block hash must be an int or bytes, got {block_hash!r}")
    if isinstance(block_hash, int):
        return block_hash % U64
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(bytes(block_hash[-8:]), "big")
    raise EventStreamError(f"a block hash must be an int or bytes, got {type(block_hash).__name__}")


def cache_namespace(namespace: Namespace) -> str | None:
    """The ``cache_namespace`` a namespace is hashed under (None: the default namespace)."""
    return None if namespace is None else repr(namespace)


class Hasher:
    """Local hashes (``compute_block_hash_for_seq``), cached per (namespace, block tokens)."""

    def __init__(self, block_size: int) -> None:
        from dynamo._core import compute_block_hash_for_seq

        self.block_size = block_size
        self._compute = compute_block_hash_for_seq
        self._known: dict[tuple[str | None, tuple[int, ...]], int] = {}

    def of_blocks(self, tokens: Sequence[int], namespace: str | None) -> list[int]:
        """The local hash of each whole block of ``tokens`` (a partial last block has none)."""
        size = self.block_size
        out = []
        for start in range(0, len(tokens) - size + 1, size):
            block = tuple(tokens[start : start + size])
            found = self._known.get((namespace, block))
            if found is None:
                found = self._compute(list(block), size, cache_namespace=namespace)[0]
                self._known[(namespace, block)] = found
            out.append(found)
        return out


def relay(events: Sequence[WireEvent], hasher: Hasher, first_id: int) -> list[dict[str, object]]:
    """Wire events (``kv_events.decode``'s) as Dynamo's event JSON, one per event, numbered from ``first_id``. A
    stored event's blocks past the token ids it carries (a partial block) are left out."""
    from radixspec.optimized import kv_events

    out: list[dict[str, object]] = []
    for number, event in enumerate(events, start=first_id):
        if isinstance(event, kv_events.BlockStored):
            if event.block_size != hasher.block_size:
                raise EventStreamError(f"a block of {event.block_size} tokens, the router's are {hasher.block_size}")
            extra_keys = getattr(event, "extra_keys", None) or [None] * len(event.block_hashes)
            blocks = []
            for index, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[index * hasher.block_size : (index + 1) * hasher.block_size]
                if len(tokens) < hasher.block_size:
                    break
                namespace = cache_namespace(namespace_of_extra(extra_keys[index]))
                (local,) = hasher.of_blocks(tokens, namespace)
                blocks.append({"block_hash": external_hash(block_hash), "tokens_hash": local})
            parent = event.parent_block_hash
            stored = {"parent_hash": None if parent is None else external_hash(parent), "blocks": blocks}
            out.append({"event_id": number, "data": {"stored": stored}})
        elif isinstance(event, kv_events.BlockRemoved):
            hashes = [external_hash(h) for h in event.block_hashes]
            out.append({"event_id": number, "data": {"removed": {"block_hashes": hashes}}})
        elif isinstance(event, kv_events.AllBlocksCleared):
            out.append({"event_id": number, "data": "cleared"})
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
        # per worker, the next event id
        self.event_ids: dict[int, int] = {}
        # per worker, external hash -> (the page it was relayed as, its chain of local hashes from the root)
        self.external: dict[int, dict[int, tuple[PageKey, tuple[int, ...]]]] = {}
        # chain of local hashes from the root -> the page, for every page ever relayed (the dump names pages so)
        self.named: dict[tuple[int, ...], PageKey] = {}

    def apply(self, worker: int, payload: bytes) -> None:
        from radixspec.optimized import kv_events

        batch = kv_events.decode(payload)
        self.learn(worker, batch.events)
        first = self.event_ids.get(worker, 0)
        for event in relay(batch.events, self.hasher, first):
            self.tree.apply_event(worker, json.dumps(event).encode())
        self.event_ids[worker] = first + len(batch.events)

    def learn(self, worker: int, events: Sequence[WireEvent]) -> None:
        """Name every stored block by its page and its local-hash chain (the wire carries only the new blocks:
        a chain continues its parent's, relayed before it)."""
        from radixspec.optimized import kv_events

        known = self.external.setdefault(worker, {})
        size = self.page_size
        for event in events:
            if not isinstance(event, kv_events.BlockStored):
                continue
            extra_keys = getattr(event, "extra_keys", None) or [None] * len(event.block_hashes)
            parent = event.parent_block_hash
            for index, block_hash in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[index * size : (index + 1) * size])
                above = known.get(external_hash(parent)) if parent is not None else None
                if len(tokens) < size or (parent is not None and above is None):
                    break  # a partial block, or an unknown parent: the relay and the tree skip them too
                namespace = namespace_of_extra(extra_keys[index])
                (local,) = self.hasher.of_blocks(tokens, cache_namespace(namespace))
                prefix, chain = (above[0][1], above[1]) if above is not None else (None, ())
                key: PageKey = (namespace, Prefix.extend(prefix, tokens))
                known[external_hash(block_hash)] = (key, (*chain, local))
                self.named[(*chain, local)] = key
                parent = block_hash

    def scores(self, tokens: list[int], namespace: Namespace) -> dict[int, int]:
        local = self.hasher.of_blocks(tokens, cache_namespace(namespace))
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
        return tuple(self.hasher.of_blocks(tokens, cache_namespace(namespace)))

    def remove_worker(self, worker: int) -> None:
        self.tree.remove_worker(worker)
        self.event_ids.pop(worker, None)
        self.external.pop(worker, None)


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
