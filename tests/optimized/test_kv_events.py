"""KV events on the wire: vLLM's msgpack format (decoded by vLLM's own classes when installed) and ZMQ."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import pytest

pytest.importorskip("msgspec", reason="the events extra: pip install radixspec[events]")

from radixspec import optimized
from radixspec.optimized import kv_events as wire
from radixspec.spec import events as ev
from radixspec.spec.errors import EventStreamError, InvalidSizeError
from radixspec.spec.prefix_cache import PageKey


def cache_with_history() -> tuple[Any, list[ev.Event]]:
    """An optimized cache after stores in two namespaces, a split, a partial eviction; and its events."""
    cache = optimized.RadixPrefixCache(page_size=2, enable_events=True)
    cache.insert_prefix([1, 2, 3, 4, 5, 6], list(range(6)))
    cache.insert_prefix([1, 2, 3, 4, 9, 9], [0, 1, 2, 3, 6, 7])
    cache.insert_prefix([1, 2], [8, 9], namespace=("lora", 1))
    cache.evict(2)
    return cache, cache.take_events()


def pages_of(cache: Any) -> set[PageKey]:
    return set(cache.abstract_state().entries)


NAMESPACES = {None: None, (repr(("lora", 1)),): ("lora", 1)}


def test_encoded_batches_decode_to_the_cached_pages() -> None:
    cache, events = cache_with_history()
    batch = wire.decode(wire.encode(events, page_size=2, ts=1.5, rank=3))
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 3)
    # consecutive stores of one path and consecutive removals are one wire event each
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockStored", "BlockStored", "BlockRemoved"]
    replayed = ev.Replayer(2).apply(wire.from_wire(batch.events, NAMESPACES)).cached()
    assert set(replayed) == pages_of(cache)
    assert set(replayed.values()) == {ev.UNKNOWN_SLOT}  # the wire names blocks, not slots


def test_to_wire_rejects_what_is_not_an_event() -> None:
    with pytest.raises(wire.InvalidTypeError) as raised:
        wire.to_wire(["BlockStored"], 2)  # type: ignore[list-item]
    assert str(raised.value) == "not a KV event: 'BlockStored'"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllms_own_classes_decode_our_payload() -> None:
    from radixspec.fuzz.targets.vllm import import_vllm

    vllm_events = import_vllm().kv_events
    assert vllm_events is not None, "vLLM's kv_events did not load for real"
    cache, events = cache_with_history()
    payload = wire.encode(events, page_size=2, ts=2.0)
    batch = __import__("msgspec").msgpack.decode(payload, type=vllm_events.KVEventBatch)
    assert isinstance(batch, vllm_events.KVEventBatch)
    assert all(type(e).__module__ == vllm_events.__name__ for e in batch.events)
    stored = [e for e in batch.events if isinstance(e, vllm_events.BlockStored)]
    assert stored[0].block_size == 2 and stored[0].parent_block_hash is None
    assert stored[-1].extra_keys == [(repr(("lora", 1)),)]
    # what vLLM decoded replays to our cache
    replayed = ev.Replayer(2).apply(wire.from_wire(batch.events, NAMESPACES)).cached()
    assert set(replayed) == pages_of(cache)


def test_a_subscriber_on_loopback_receives_topic_sequence_and_batch() -> None:
    zmq = pytest.importorskip("zmq")
    cache, events = cache_with_history()
    publisher = wire.ZmqEventPublisher("tcp://127.0.0.1:*", page_size=2, topic="kv")
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    try:
        subscriber.connect(publisher.endpoint)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
        assert publisher.publish([]) == -1  # nothing to send
        # PUB drops what it sends before the subscription arrives: send until the subscriber hears
        deadline = time.monotonic() + 10
        received = None
        while received is None and time.monotonic() < deadline:
            publisher.publish(events)
            if subscriber.poll(100):
                received = subscriber.recv_multipart()
        assert received is not None, "no batch arrived on loopback within 10 s"
        topic, sequence, payload = received
        assert topic == b"kv" and int.from_bytes(sequence, "big") < publisher.sequence
        replayed = ev.Replayer(2).apply(wire.from_wire(wire.decode(payload).events, NAMESPACES)).cached()
        assert set(replayed) == pages_of(cache)
    finally:
        subscriber.close(linger=0)
        publisher.close()


def test_to_wire_coalesces_one_path_and_keeps_every_field() -> None:
    a = ev.stored_pages(None, None, [1, 2, 3, 4], 2, [0, 2])
    b = ev.stored_pages(("t",), None, [1, 2, 5, 6], 2, [4, 6])
    c = ev.stored_pages(None, a[0].page_hash, [7, 7], 2, [8])  # another child of a[0]: a new wire event
    events = [*a, *b, *c, ev.PageRemoved(None, a[1].page_hash), ev.PagesRemoved((b[1].page_hash, b[0].page_hash))]
    out = wire.to_wire([*events, ev.AllCleared()], page_size=2)
    assert [type(e).__name__ for e in out] == [
        "BlockStored",
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    first, second, third, removed, _ = out
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (
        [a[0].page_hash, a[1].page_hash],
        None,
        [1, 2, 3, 4],
    )
    assert (first.block_size, first.medium, first.lora_id, first.lora_name, first.extra_keys) == (
        2,
        "GPU",
        None,
        None,
        None,
    )
    assert (second.block_hashes, second.token_ids) == ([b[0].page_hash, b[1].page_hash], [1, 2, 5, 6])
    assert second.extra_keys == [(repr(("t",)),), (repr(("t",)),)]
    assert (third.block_hashes, third.parent_block_hash, third.token_ids) == ([c[0].page_hash], a[0].page_hash, [7, 7])
    assert removed.block_hashes == [a[1].page_hash, b[1].page_hash, b[0].page_hash] and removed.medium == "GPU"
    # a path that changes namespace mid-way is two events
    d = ev.stored_pages(("u",), b[1].page_hash, [8, 8], 2, [10])
    assert len(wire.to_wire([*b, *d], page_size=2)) == 2


def test_the_publisher_numbers_its_batches_and_names_its_rank() -> None:
    pytest.importorskip("zmq")
    _, events = cache_with_history()
    sent: list[tuple[bytes, ...]] = []
    publisher = wire.ZmqEventPublisher("tcp://127.0.0.1:*", page_size=2, rank=5)
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:") and publisher.topic == b""
        socket = publisher._socket
        publisher._socket = type("Recorder", (), {"send_multipart": lambda self, parts: sent.append(tuple(parts))})()
        assert [publisher.publish(events), publisher.publish([]), publisher.publish(events)] == [0, -1, 1]
        assert publisher.sequence == 2
        assert [(topic, int.from_bytes(seq, "big")) for topic, seq, _ in sent] == [(b"", 0), (b"", 1)]
        assert all(len(seq) == 8 for _, seq, _ in sent)
        batch = wire.decode(sent[0][2])
        assert batch.data_parallel_rank == 5 and abs(batch.ts - time.time()) < 60
        assert [type(e) for e in batch.events] == [type(e) for e in wire.to_wire(events, 2)]
    finally:
        publisher._socket = socket
        publisher.close()
    assert socket.closed


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xff\xff\xff", b"\x93\x01\x02\x03", bytes(range(64))],
    ids=["empty", "junk", "wrong shape", "noise"],
)
def test_a_payload_that_is_no_batch_is_the_specs_event_stream_error(payload: bytes) -> None:
    """Was: msgspec's own DecodeError / ValidationError, unnamed by spec/errors.py."""
    from radixspec.optimized.kv_events import decode
    from radixspec.spec.errors import EventStreamError, InvalidTypeError

    with pytest.raises(EventStreamError, match="not a KV event batch"):
        decode(payload)
    with pytest.raises(InvalidTypeError, match="payload must be bytes"):
        decode("text")  # type: ignore[arg-type]


# ---------------------------------------------------------------- sequence numbers and the replay socket


def test_a_sequenced_subscriber_applies_each_batch_once_in_order_filling_gaps_by_replay() -> None:
    kept = wire.ReplayBuffer(steps=3)
    for seq in range(5):
        kept.append(seq, b"batch%d" % seq)
    assert kept.since(3) == [(3, b"batch3"), (4, b"batch4")]
    subscriber = wire.SequencedSubscriber(kept.since)
    assert subscriber.receive(0, b"batch0") == [b"batch0"]
    # batch 1 lost: the publisher keeps only 2..4, so the gap cannot be filled; nothing is applied
    with pytest.raises(EventStreamError, match=r"batches 1..1 were lost and the publisher no longer holds them"):
        subscriber.receive(3, b"batch3")
    assert subscriber.expected == 1
    subscriber.expected = 2  # (started over from a snapshot that holds batch 1)
    # batch 2 lost, 3 arrives: 2 is replayed first; 3 again (a duplicate) and 2 late are dropped
    assert subscriber.receive(3, b"batch3") == [b"batch2", b"batch3"]
    assert subscriber.receive(3, b"batch3") == [] and subscriber.receive(2, b"batch2") == []
    assert (subscriber.gaps, subscriber.replayed, subscriber.duplicates) == (2, 1, 2)
    subscriber.restart()
    assert subscriber.receive(0, b"new0") == [b"new0"]
    with pytest.raises(InvalidSizeError):
        wire.ReplayBuffer(steps=0)


def test_a_subscriber_that_joined_late_gets_the_batches_it_missed_from_the_replay_socket() -> None:
    pytest.importorskip("zmq")
    _, events = cache_with_history()
    publisher = wire.ZmqEventPublisher(
        "tcp://127.0.0.1:*", page_size=2, topic="kv", replay_endpoint="tcp://127.0.0.1:*"
    )
    assert publisher.replay_endpoint is not None
    # three batches before anyone listens: a PUB socket drops them
    for _ in range(3):
        publisher.publish(events)
    subscriber = wire.ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, topic="kv")
    try:
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            publisher.publish(events)
            got = subscriber.receive(timeout_ms=100)
        assert got, "no batch arrived on loopback within 10 s"
        # everything from batch 0 on, each once and in order, though only the later ones came over PUB
        assert subscriber.sequenced.gaps == 1 and subscriber.sequenced.replayed >= 3
        assert len(got) == subscriber.sequenced.expected
        assert got == [payload for _, payload in publisher.buffer.since(0)][: len(got)]
    finally:
        subscriber.close()
        publisher.close()
