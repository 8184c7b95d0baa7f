"""KV events on the wire: vLLM's event classes and msgpack format, and a ZMQ publisher a router subscribes to.

The format (vLLM 0.33.0, ``vllm/distributed/kv_events.py``; SGLang publishes
the same): a ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` (a msgpack
array), each event a map tagged by its class name: ``BlockStored``
(``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
``lora_id``, ``medium``, ``lora_name``, ``extra_keys`` ...), ``BlockRemoved``
(``block_hashes``, ``medium``), ``AllBlocksCleared``. The structs below are
written from that format (field names, order, tags); the tests decode what
they encode with vLLM's own classes when the wheel is installed.

A page of ours is one block: its hash is ``radixspec.spec.events``' page hash (a
64-bit int, stable across node splits), a namespace other than None is
published as the block's extra key (``repr(namespace)``). Consecutive stores
of one path become one ``BlockStored``, consecutive removals one
``BlockRemoved``, as vLLM and SGLang batch them.

The publisher sends ``(topic, sequence number as 8 bytes big-endian, payload)``
on a PUB socket, like vLLM's ``ZmqEventPublisher``, so a vLLM-compatible
router subscribes to it unchanged.

Needs the ``events`` extra (``pip install radixspec[events]``: msgspec, pyzmq).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from radixspec.spec import events as ev
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import EventStreamError, InvalidTypeError

MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """The batch: a timestamp, the events, the data-parallel rank (a msgpack array)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Every event: a msgpack map tagged with its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _extra_key(namespace: Namespace) -> tuple[Any, ...] | None:
    return None if namespace is None else (repr(namespace),)


def to_wire(events: Sequence[ev.Event], page_size: int) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """Our events as vLLM's: consecutive stores of one path and consecutive removals coalesced."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in events:
        tail = out[-1] if out else None
        if isinstance(event, ev.PageStored):
            extra = _extra_key(event.namespace)
            if (
                isinstance(tail, BlockStored)
                and tail.block_hashes[-1] == event.parent_hash
                and (tail.extra_keys or [None])[-1] == extra
            ):
                tail.block_hashes.append(event.page_hash)
                tail.token_ids.extend(event.tokens)
                if tail.extra_keys is not None:
                    tail.extra_keys.append(extra)
                continue
            out.append(
                BlockStored(
                    block_hashes=[event.page_hash],
                    parent_block_hash=event.parent_hash,
                    token_ids=list(event.tokens),
                    block_size=page_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    extra_keys=None if extra is None else [extra],
                )
            )
        elif isinstance(event, (ev.PageRemoved, ev.PagesRemoved)):
            hashes = [event.page_hash] if isinstance(event, ev.PageRemoved) else list(event.page_hashes)
            if isinstance(tail, BlockRemoved):
                tail.block_hashes.extend(hashes)
            else:
                out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_GPU))
        elif isinstance(event, ev.AllCleared):
            out.append(AllBlocksCleared())
        else:
            raise InvalidTypeError(f"not a KV event: {event!r}")
    return out


def encode(events: Sequence[ev.Event], page_size: int, ts: float | None = None, rank: int | None = None) -> bytes:
    """One msgpack ``KVEventBatch`` of our events, as vLLM publishes it."""
    batch = KVEventBatch(
        ts=time.time() if ts is None else ts, events=to_wire(events, page_size), data_parallel_rank=rank
    )
    return msgspec.msgpack.encode(batch)


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode(payload: bytes) -> KVEventBatch:
    """A payload back into the batch (what a router does); EventStreamError naming the problem when the
    payload is not a batch (a wrong type, truncated or foreign bytes), never msgspec's own errors."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        return _DECODER.decode(payload)
    except msgspec.MsgspecError as exc:
        raise EventStreamError(f"not a KV event batch ({len(payload)} bytes): {exc}") from None


def from_wire(events: Sequence[Any], namespaces: dict[tuple[Any, ...] | None, Namespace]) -> list[ev.Event]:
    """vLLM-format events (ours or vLLM's own classes) back into the spec's, page by page.

    ``namespaces`` maps an extra key back to its namespace (None for none); slots are not on the
    wire, so a stored page's slot is ``radixspec.spec.events.UNKNOWN_SLOT``.
    """
    return ev.from_block_events(events, lambda extra: namespaces[None if extra is None else tuple(extra)])


class ZmqEventPublisher:
    """PUB socket sending ``(topic, seq, payload)`` per batch, as vLLM's publisher does."""

    def __init__(self, endpoint: str, page_size: int, topic: str = "", rank: int | None = None) -> None:
        import zmq

        self._socket: Any = zmq.Context.instance().socket(zmq.PUB)
        self._socket.bind(endpoint)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.page_size = page_size
        self.topic = topic.encode()
        self.rank = rank
        self.sequence = 0

    def publish(self, events: Sequence[ev.Event]) -> int:
        """Send one batch (nothing for no events); its sequence number, or -1 when nothing was sent."""
        if not events:
            return -1
        sequence = self.sequence
        self._socket.send_multipart(
            (self.topic, sequence.to_bytes(8, "big"), encode(events, self.page_size, rank=self.rank))
        )
        self.sequence += 1
        return sequence

    def close(self) -> None:
        self._socket.close(linger=0)
