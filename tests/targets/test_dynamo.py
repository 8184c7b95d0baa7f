"""Our translation of a worker's KV events into Dynamo's (fuzz/targets/dynamo.py), on its own, and Dynamo's
RadixTree behind it."""

from __future__ import annotations

import json

import pytest

from radixspec.spec import events as ev
from radixspec.spec.errors import EventStreamError
from tests.spec.test_events import key

pytest.importorskip("dynamo._core", reason="Dynamo is not installed (radixspec targets install dynamo)")
kv_events = pytest.importorskip("radixspec.optimized.kv_events")

from dynamo._core import compute_block_hash_for_seq  # noqa: E402

from radixspec.fuzz.targets import dynamo  # noqa: E402


def wire(events: list[ev.Event], page_size: int = 2) -> bytes:
    return kv_events.encode(events, page_size, ts=0.0)


def test_external_hashes_are_64_bit_unsigned_ints_and_bytes_are_refused_as_dynamo_drops_them() -> None:
    assert dynamo.external_hash(5) == 5
    assert dynamo.external_hash(-1) == 2**64 - 1
    assert dynamo.external_hash(2**64 + 3) == 3
    with pytest.raises(EventStreamError, match="Dynamo 1.6.1's relay drops this batch whole"):
        dynamo.external_hash(bytes(range(32)))
    for bad in (True, 1.5, "7", None):
        with pytest.raises(EventStreamError, match="a block hash must be an int"):
            dynamo.external_hash(bad)


def test_relay_turns_stored_removed_and_cleared_into_dynamos_events() -> None:
    hasher = dynamo.Hasher(2)
    stored = ev.stored_pages(("lora", 1), None, [1, 2, 3, 4], 2, [0, 2])
    batch = kv_events.decode(wire([*stored, ev.PagesRemoved((stored[1].page_hash,)), ev.AllCleared()]))
    out = [one.event for one in dynamo.relay(batch.events, hasher, first_id=7)]
    local = compute_block_hash_for_seq([1, 2, 3, 4], 2, cache_namespace="('lora', 1)")
    assert out == [
        {
            "event_id": 7,
            "data": {
                "stored": {
                    "parent_hash": None,
                    "blocks": [
                        {"block_hash": stored[0].page_hash, "tokens_hash": local[0]},
                        {"block_hash": stored[1].page_hash, "tokens_hash": local[1]},
                    ],
                }
            },
        },
        {"event_id": 8, "data": {"removed": {"block_hashes": [stored[1].page_hash]}}},
        {"event_id": 9, "data": "cleared"},
    ]
    # a block hashes its own tokens only (not its parent's): a namespace changes it
    assert local[1] == compute_block_hash_for_seq([3, 4], 2, cache_namespace="('lora', 1)")[0]
    assert local[0] != compute_block_hash_for_seq([1, 2], 2)[0]


def test_relay_refuses_another_block_size_and_leaves_out_a_partial_block() -> None:
    hasher = dynamo.Hasher(2)
    batch = kv_events.decode(wire(ev.stored_pages(None, None, [1, 2, 3, 4], 2, [0, 2]), page_size=4))
    with pytest.raises(EventStreamError, match="a block of 4 tokens, the router's are 2"):
        dynamo.relay(batch.events, hasher, 0)
    partial = kv_events.ReadStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3], block_size=2)
    (one,) = dynamo.relay([partial], hasher, 0)
    assert one.blocks == ((1, compute_block_hash_for_seq([1, 2], 2)[0]),)


def test_dynamo_scores_dumps_and_forgets_what_the_relay_fed_it() -> None:
    router = dynamo.DynamoRouter(2)
    router.apply(0, wire(ev.stored_pages(None, None, [1, 2, 3, 4], 2, [0, 2])))
    router.apply(1, wire(ev.stored_pages(None, None, [1, 2], 2, [0])))
    salted = ev.stored_pages(("tenant", "b"), None, [1, 2, 3, 4], 2, [0, 2])
    router.apply(1, wire(salted))
    assert router.scores([1, 2, 3, 4, 5], None) == {0: 2, 1: 1}
    assert router.scores([1, 2, 3, 4], ("tenant", "b")) == {1: 2}
    assert router.live() == {
        0: {key(None, 1, 2), key(None, 1, 2, 3, 4)},
        1: {key(None, 1, 2), key(("tenant", "b"), 1, 2), key(("tenant", "b"), 1, 2, 3, 4)},
    }
    # removals by the worker's own hashes; the event ids go on per worker
    router.apply(1, wire([ev.PagesRemoved((salted[1].page_hash,))]))
    assert router.scores([1, 2, 3, 4], ("tenant", "b")) == {1: 1}
    assert router.event_ids == {0: 1, 1: 3}
    router.remove_worker(0)
    assert router.scores([1, 2, 3, 4], None) == {1: 1}
    assert router.entry_of(key(None, 1, 2)) != router.entry_of(key(("tenant", "b"), 1, 2))


def test_a_block_dynamo_holds_that_was_never_relayed_is_named_as_unknown() -> None:
    router = dynamo.DynamoRouter(2)
    event = {"event_id": 0, "data": {"stored": {"parent_hash": None, "blocks": [{"block_hash": 9, "tokens_hash": 1}]}}}
    router.tree.apply_event(0, json.dumps(event).encode())
    assert router.live() == {0: {("unknown block", 9)}}


def test_the_relay_reads_a_namespace_as_dynamo_does_cache_salt_or_a_prefixed_extra_key_inherited_by_children() -> None:
    hasher = dynamo.Hasher(2)

    def stored(hashes: list[int], parent: int | None, tokens: list[int], **fields: object) -> object:
        return kv_events.ReadStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=2, **fields
        )

    salts: dict[int, str | None] = {}
    out = dynamo.relay(
        [
            stored([1], None, [1, 2], cache_salt="t1"),  # SGLang's (and our) field
            stored([2], 1, [3, 4]),  # no salt of its own: its parent's
            stored([3], None, [1, 2], extra_keys=[("dynamo-cache-salt:t2",)], lora_name="ad"),
            stored([4], None, [1, 2], extra_keys=[("ad", "s1")], lora_name="ad"),  # vLLM's plain salt: not read
        ],
        hasher,
        0,
        salts,
    )

    def local(tokens: list[int], **options: object) -> int:
        return int(compute_block_hash_for_seq(tokens, 2, **options)[0])

    assert [one.blocks for one in out] == [
        ((1, local([1, 2], cache_namespace="t1")),),
        ((2, local([3, 4], cache_namespace="t1")),),
        ((3, local([1, 2], cache_namespace="t2", lora_name="ad")),),
        ((4, local([1, 2], lora_name="ad")),),
    ]
    assert salts == {1: "t1", 2: "t1", 3: "t2", 4: None}


def test_dynamo_scores_an_engines_salted_prompt_as_the_engine_published_it() -> None:
    router = dynamo.DynamoRouter(2)
    salted = kv_events.ReadStored(
        block_hashes=[-5, 6], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, cache_salt="t1"
    )
    payload = kv_events.msgspec.msgpack.encode(kv_events.ReadBatch(ts=0.0, events=[salted]))
    router.apply(0, payload)
    namespace = kv_events.our_namespace((None, "t1"))
    assert namespace == ("cache_salt", "t1")
    assert router.scores([1, 2, 3, 4], namespace) == {0: 2} and router.scores([1, 2, 3, 4], None) == {}
    assert router.live() == {0: {key(namespace, 1, 2), key(namespace, 1, 2, 3, 4)}}
