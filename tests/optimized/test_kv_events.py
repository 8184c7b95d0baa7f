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
from tests.spec.test_events import key


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


def test_encoded_batches_decode_to_the_cached_pages() -> None:
    cache, events = cache_with_history()
    batch = wire.decode(wire.encode(events, page_size=2, ts=1.5, rank=3))
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 3)
    # consecutive stores of one path and consecutive removals are one wire event each
    assert [type(e).__struct_config__.tag for e in batch.events] == [
        "BlockStored",
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
    ]
    replayed = ev.Replayer(2).apply(wire.from_wire(batch.events)).cached()
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
    replayed = ev.Replayer(2).apply(wire.from_wire(batch.events)).cached()
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
        replayed = ev.Replayer(2).apply(wire.from_wire(wire.decode(payload).events)).cached()
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
        tags = [type(e).__struct_config__.tag for e in batch.events]
        assert tags == [type(e).__name__ for e in wire.to_wire(events, 2)]
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


# ---------------------------------------------------------------- what the engines really send


def sglang_events() -> Any:
    """SGLang 0.5.23's own event module (loaded for real by its target's import)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    import sys

    from radixspec.fuzz.targets.sglang import events_available, import_radix_cache

    if not events_available():
        pytest.skip("SGLang's event module needs msgspec and pyzmq")
    import_radix_cache()
    return sys.modules["sglang.srt.disaggregation.kv_events"]


def test_sglangs_payload_with_its_omitted_fields_and_cache_salt_reads_as_its_pages() -> None:
    sg = sglang_events()
    msgspec = pytest.importorskip("msgspec")
    # SGLang leaves medium, lora_name, session_id out when unset; names a namespace by cache_salt; ints may be < 0
    batch = sg.KVEventBatch(
        ts=1.0,
        events=[
            sg.BlockStored(
                block_hashes=[11, -12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, lora_id=None
            ),
            sg.BlockStored(
                block_hashes=[21], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None, cache_salt="t1"
            ),
            sg.BlockStored(block_hashes=[22], parent_block_hash=21, token_ids=[5, 6], block_size=2, lora_id=None),
            sg.BlockRemoved(block_hashes=[-12]),
        ],
        attn_dp_rank=2,
    )
    payload = msgspec.msgpack.encode(batch)
    assert b"lora_name" not in payload and b"medium" not in payload
    decoded = wire.decode(payload)
    assert decoded.data_parallel_rank == 2
    reader = wire.WireReader()
    replayed = ev.Replayer(2, check_hashes=False).apply(reader.read(decoded.events, wire.our_namespace)).cached()
    salted = ("cache_salt", "t1")
    # the block stored below a salted one, with no salt of its own, is in its parent's namespace
    assert set(replayed) == {key(None, 1, 2), key(salted, 1, 2), key(salted, 1, 2, 5, 6)}
    assert reader.namespaces == {11: None, 21: (None, "t1"), 22: (None, "t1")}


def test_vllms_payload_with_bytes_hashes_lora_and_a_salt_on_the_first_block_reads_as_its_pages() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    from radixspec.fuzz.targets.vllm import import_vllm

    vllm_events = import_vllm().kv_events
    msgspec = pytest.importorskip("msgspec")
    h = [bytes([n]) * 32 for n in range(4)]
    # vLLM: hashes as bytes (sha256), the salt among the first block's extra keys (after the LoRA name), its own
    # fields (group, locality, lookahead tokens) that a reader may ignore
    stored = vllm_events.BlockStored(
        block_hashes=[h[0], h[1]],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name="ad",
        extra_keys=[("ad", "s1"), ("ad",)],
        group_idx=0,
        locality="LOCAL",
        lookahead_token_ids=[[3], [5]],
    )
    child = vllm_events.BlockStored(
        block_hashes=[h[2]],
        parent_block_hash=h[1],
        token_ids=[7, 7],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name="ad",
        extra_keys=[("ad",)],
    )
    plain = vllm_events.BlockStored(
        block_hashes=[h[3]],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    removed = vllm_events.BlockRemoved(block_hashes=[h[2]], medium="GPU", group_idx=0)
    payload = msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=1.0, events=[stored, child, plain, removed]))
    decoded = wire.decode(payload)
    assert decoded.events[0].block_hashes == [h[0], h[1]] and decoded.events[0].lookahead_token_ids == [[3], [5]]
    reader = wire.WireReader()
    replayed = ev.Replayer(2, check_hashes=False).apply(reader.read(decoded.events, wire.our_namespace)).cached()
    ns = ("lora_name", "ad", "cache_salt", "s1")
    assert set(replayed) == {key(ns, 1, 2), key(ns, 1, 2, 3, 4), key(None, 1, 2)}
    # the second block inherits the first's salt; a removed block is forgotten
    assert reader.namespaces == {h[0]: ("ad", "s1"), h[1]: ("ad", "s1"), h[3]: None}


def test_our_payload_names_its_namespace_as_cache_salt_and_extra_key_and_reads_back() -> None:
    _, events = cache_with_history()
    out = wire.to_wire(events, 2)
    namespaced = [e for e in out if isinstance(e, wire.BlockStored) and e.extra_keys]
    assert namespaced and all(e.cache_salt == repr(("lora", 1)) for e in namespaced)
    assert wire.our_namespace((None, repr(("lora", 1)))) == ("lora", 1)
    # a salt that is not ours (not the repr of a namespace) is a namespace of its own
    assert wire.our_namespace((None, "1")) == ("cache_salt", "1")
    assert wire.our_namespace(("a", None)) == ("lora_name", "a")
