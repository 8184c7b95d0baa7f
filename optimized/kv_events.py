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
published as the block's extra key and the event's ``cache_salt`` (SGLang's
field, which Dynamo's relay reads): ``repr(namespace)``. Consecutive stores
of one path become one ``BlockStored``, consecutive removals one
``BlockRemoved``, as vLLM and SGLang batch them.

Reading (``decode``, ``WireReader``) takes what the engines really send, a
superset of both: SGLang 0.5.23 omits ``lora_name`` and ``medium`` when unset
and names a namespace by ``cache_salt`` (and ``lora_name``); vLLM 0.33.0 may
send hashes as bytes, names a LoRA by ``lora_name`` and puts a request's
``cache_salt`` among the first block's ``extra_keys`` only (the blocks after
it inherit it through their parent), and adds fields of its own (group,
locality, lookahead tokens) that a reader may ignore.

The publisher sends ``(topic, sequence number as 8 bytes big-endian, payload)``
on a PUB socket, like vLLM's ``ZmqEventPublisher``, so a vLLM-compatible
router subscribes to it unchanged. With a replay endpoint it also keeps its
last batches and answers replay requests on a ROUTER socket in vLLM's
convention: a DEALER sends ``(b"", start sequence as 8 bytes big-endian)``
and gets ``(b"", topic, seq, payload)`` for every kept batch from there on,
then ``(b"", b"", END_SEQ, b"")``. ``SequencedSubscriber`` is what a
subscriber does with the sequence numbers (each batch once, in order; a gap
filled by a replay before anything after it is applied);
``ZmqEventSubscriber`` is one on sockets.

Needs the ``events`` extra (``pip install radixspec[events]``: msgspec, pyzmq).
"""

from __future__ import annotations

import ast
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from radixspec.spec import events as ev
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import EventStreamError, InvalidSizeError, InvalidTypeError

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
    # SGLang's field (Dynamo's relay reads a namespace from it); vLLM's decoder ignores it
    cache_salt: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---------------------------------------------------------------- what a reader takes: the engines' fields, all of them


class ReadStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):  # type: ignore[call-arg]
    """A ``BlockStored`` as vLLM, SGLang or we send it (every optional field optional)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class ReadRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class ReadCleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    medium: str | None = None


ReadEvent = ReadStored | ReadRemoved | ReadCleared


class ReadBatch(EventBatch):
    events: list[ReadEvent]


# the events a reader takes, by class name: ours as read or written, an engine's own
KINDS = {
    "ReadStored": "stored",
    "BlockStored": "stored",
    "ReadRemoved": "removed",
    "BlockRemoved": "removed",
    "ReadCleared": "cleared",
    "AllBlocksCleared": "cleared",
}

# a block's namespace as the wire names it: (lora_name, cache_salt), None for neither
WireNamespace = tuple[str | None, str | None] | None


class WireReader:
    """Reads one publisher's stream: the namespace of each stored block, and the stream as the spec's events.

    A block's salt is the event's ``cache_salt`` (SGLang, ours), else a string among its own extra keys other than
    the LoRA name (vLLM), else its parent's (the block before it in the event, or the event's parent): vLLM
    names a request's salt on its first block only. The LoRA is the event's ``lora_name``.
    """

    def __init__(self) -> None:
        # block hash -> its namespace, for every block stored and not removed
        self.namespaces: dict[int | bytes, WireNamespace] = {}

    def block_namespaces(self, event: Any) -> list[WireNamespace]:
        """The namespace of each block of a stored event (``ReadStored``, or an engine's own ``BlockStored``),
        remembered for the blocks that extend them."""
        above = self.namespaces.get(event.parent_block_hash) if event.parent_block_hash is not None else None
        inherited = above[1] if above is not None else None
        lora_name = getattr(event, "lora_name", None)
        extra_keys = getattr(event, "extra_keys", None)
        out: list[WireNamespace] = []
        for index, block_hash in enumerate(event.block_hashes):
            extra = extra_keys[index] if extra_keys and index < len(extra_keys) else None
            salt = getattr(event, "cache_salt", None) or salt_of(extra, lora_name) or inherited
            key = None if salt is None and lora_name is None else (lora_name, salt)
            self.namespaces[block_hash] = key
            out.append(key)
            inherited = salt
        return out

    def read(self, events: Sequence[Any], namespace_of: Callable[[WireNamespace], Namespace]) -> list[ev.Event]:
        """The events (``decode``'s, or an engine's own classes) as the spec's, page by page (``namespace_of``
        names a wire namespace as ours); slots are not on the wire: UNKNOWN_SLOT."""
        out: list[ev.Event] = []
        for event in events:
            kind = KINDS.get(type(event).__name__)
            if kind == "stored":
                size, parent = event.block_size, event.parent_block_hash
                keys = self.block_namespaces(event)
                for index, (block_hash, key) in enumerate(zip(event.block_hashes, keys, strict=True)):
                    tokens = tuple(event.token_ids[index * size : (index + 1) * size])
                    out.append(ev.PageStored(namespace_of(key), block_hash, parent, tokens, ev.UNKNOWN_SLOT))
                    parent = block_hash
            elif kind == "removed":
                for block_hash in event.block_hashes:
                    self.namespaces.pop(block_hash, None)
                out.append(ev.PagesRemoved(tuple(event.block_hashes)))
            elif kind == "cleared":
                self.namespaces.clear()
                out.append(ev.AllCleared())
            else:
                raise EventStreamError(f"not a KV cache event: {event!r}")
        return out


def salt_of(extra: tuple[Any, ...] | None, lora_name: str | None) -> str | None:
    """The cache salt among a block's extra keys (vLLM: the LoRA name first when set, multimodal pairs as
    tuples, the salt as a string, prompt-embedding digests as bytes), or None."""
    for item in extra or ():
        if isinstance(item, str) and item != lora_name:
            return item
    return None


def our_namespace(key: WireNamespace) -> Namespace:
    """A wire namespace as the spec's: ours back from their ``repr``; an engine's salt and LoRA as
    ``("cache_salt", salt)`` / ``("lora_name", name)`` tuples (namespaces apart exactly when the wire's are)."""
    if key is None:
        return None
    lora, salt = key
    if lora is None and salt is not None:
        try:
            namespace = ast.literal_eval(salt)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            namespace = None
        if isinstance(namespace, tuple) and repr(namespace) == salt:
            return namespace
    parts: tuple[str, ...] = ()
    if lora is not None:
        parts += ("lora_name", lora)
    if salt is not None:
        parts += ("cache_salt", salt)
    return parts


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
                    cache_salt=None if extra is None else extra[0],
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


_DECODER = msgspec.msgpack.Decoder(ReadBatch)


def decode(payload: bytes) -> ReadBatch:
    """A payload back into the batch (what a router does); EventStreamError naming the problem when the
    payload is not a batch (a wrong type, truncated or foreign bytes), never msgspec's own errors."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        return _DECODER.decode(payload)
    except msgspec.MsgspecError as exc:
        raise EventStreamError(f"not a KV event batch ({len(payload)} bytes): {exc}") from None


def wire_namespace(namespace: Namespace) -> WireNamespace:
    """How a namespace goes on the wire, the inverse of ``our_namespace``: ours as the salt ``repr(namespace)``,
    an engine's (``("lora_name", name, "cache_salt", salt)`` or either half) as its LoRA name and salt."""
    if namespace is None:
        return None
    lora = salt = None
    if len(namespace) in (2, 4) and all(isinstance(item, str) for item in namespace):
        fields = {str(name): str(value) for name, value in zip(namespace[::2], namespace[1::2], strict=True)}
        lora, salt = fields.get("lora_name"), fields.get("cache_salt")
    if (lora is not None or salt is not None) and our_namespace((lora, salt)) == namespace:
        return (lora, salt)
    return (None, repr(namespace))


def from_wire(
    events: Sequence[Any], namespace_of: Callable[[WireNamespace], Namespace] = our_namespace
) -> list[ev.Event]:
    """Decoded events (one whole stream from its start) back into the spec's, page by page (``WireReader``)."""
    return WireReader().read(events, namespace_of)


# the end of a replay (vLLM's ZmqEventPublisher.END_SEQ)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ReplayBuffer:
    """The last ``steps`` batches a publisher sent, by sequence number (what a replay request is answered from)."""

    def __init__(self, steps: int = 10_000) -> None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise InvalidSizeError.not_positive("buffer_steps", steps)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=steps)
        self._lock = threading.Lock()

    def append(self, sequence: int, payload: bytes) -> None:
        with self._lock:
            self._kept.append((sequence, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """Every kept batch numbered ``start`` or later, in order."""
        with self._lock:
            return [(sequence, payload) for sequence, payload in self._kept if sequence >= start]


class SequencedSubscriber:
    """A subscriber's use of sequence numbers: each batch applied once and in order.

    ``receive(seq, payload)`` gives the payloads to apply now: none for a batch seen already (a duplicate, or one
    a replay brought first); for a batch past the next expected one, the missing ones first, asked of the
    publisher (``replay(start)``: its kept batches from ``start`` on); EventStreamError, with nothing applied,
    when the publisher no longer holds them (the subscriber must then start over from a snapshot or empty).
    ``restart()``: the publisher started again (a worker restart), numbering from 0.
    """

    def __init__(self, replay: Callable[[int], Sequence[tuple[int, bytes]]]) -> None:
        self.replay = replay
        self.expected = 0
        self.duplicates = 0
        self.gaps = 0
        self.replayed = 0

    def receive(self, sequence: int, payload: bytes) -> list[bytes]:
        if sequence < self.expected:
            self.duplicates += 1
            return []
        out: list[bytes] = []
        if sequence > self.expected:
            self.gaps += 1
            missing = {seq: data for seq, data in self.replay(self.expected) if self.expected <= seq < sequence}
            if len(missing) != sequence - self.expected:
                lost = [seq for seq in range(self.expected, sequence) if seq not in missing]
                raise EventStreamError(
                    f"batches {lost[0]}..{lost[-1]} were lost and the publisher no longer holds them"
                    f" ({len(lost)} of {sequence - self.expected} missing)"
                )
            out = [missing[seq] for seq in range(self.expected, sequence)]
            self.replayed += len(out)
        out.append(payload)
        self.expected = sequence + 1
        return out

    def restart(self) -> None:
        self.expected = 0


class ZmqEventPublisher:
    """PUB socket sending ``(topic, seq, payload)`` per batch, as vLLM's publisher does; with ``replay_endpoint``,
    a ROUTER socket answering replay requests from the last ``buffer_steps`` batches (a thread serves it)."""

    def __init__(
        self,
        endpoint: str,
        page_size: int,
        topic: str = "",
        rank: int | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
    ) -> None:
        import zmq

        self.buffer = ReplayBuffer(buffer_steps)
        context: Any = zmq.Context.instance()
        self._socket: Any = context.socket(zmq.PUB)
        self._socket.bind(endpoint)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.page_size = page_size
        self.topic = topic.encode()
        self.rank = rank
        self.sequence = 0
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        if replay_endpoint is not None:
            replay: Any = context.socket(zmq.ROUTER)
            replay.bind(replay_endpoint)
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._server = threading.Thread(target=self._serve_replay, args=(replay,), daemon=True)
            self._server.start()

    def publish(self, events: Sequence[ev.Event]) -> int:
        """Send one batch (nothing for no events); its sequence number, or -1 when nothing was sent."""
        if not events:
            return -1
        sequence = self.sequence
        payload = encode(events, self.page_size, rank=self.rank)
        self.buffer.append(sequence, payload)
        self._socket.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))
        self.sequence += 1
        return sequence

    def _serve_replay(self, socket: Any) -> None:
        """Answer replay requests until closed (the replay socket is used by this thread only)."""
        try:
            while not self._stop.is_set():
                if not socket.poll(50):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: ignored, as vLLM's publisher does
                client, _, start = frames
                for sequence, payload in self.buffer.since(int.from_bytes(start, "big")):
                    socket.send_multipart((client, b"", self.topic, sequence.to_bytes(8, "big"), payload))
                socket.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join()
        self._socket.close(linger=0)


class ZmqEventSubscriber:
    """A SUB socket on a publisher, and a DEALER on its replay endpoint: ``receive`` gives the payloads to apply, each
    once and in order, a gap filled by a replay first (``SequencedSubscriber``)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", timeout_ms: int = 5000):
        import zmq

        context: Any = zmq.Context.instance()
        self._zmq = zmq
        self._socket: Any = context.socket(zmq.SUB)
        self._socket.connect(endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._replay: Any = None
        if replay_endpoint is not None:
            self._replay = context.socket(zmq.DEALER)
            self._replay.connect(replay_endpoint)
        self.timeout_ms = timeout_ms
        self.sequenced = SequencedSubscriber(self._ask_replay)

    def _ask_replay(self, start: int) -> list[tuple[int, bytes]]:
        if self._replay is None:
            return []
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        while self._replay.poll(self.timeout_ms):
            _, _, sequence, payload = self._replay.recv_multipart()
            if sequence == END_SEQ:
                return out
            out.append((int.from_bytes(sequence, "big"), payload))
        raise EventStreamError(f"no end of replay within {self.timeout_ms} ms")

    def receive(self, timeout_ms: int = 0) -> list[bytes]:
        """The payloads to apply of every batch that arrived (waiting up to ``timeout_ms`` for the first)."""
        out: list[bytes] = []
        while self._socket.poll(timeout_ms):
            _, sequence, payload = self._socket.recv_multipart()
            out.extend(self.sequenced.receive(int.from_bytes(sequence, "big"), payload))
            timeout_ms = 0
        return out

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
