"""KV events: the stream a router replays (spec/events.py), and the caches that emit it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from radixspec import optimized, reference
from radixspec.spec import events as ev
from radixspec.spec.errors import CacheBusyError
from radixspec.spec.prefix_cache import PageKey, Prefix


def key(namespace: Any, *tokens: int, page_size: int = 2) -> PageKey:
    prefix = None
    for start in range(0, len(tokens), page_size):
        prefix = Prefix.extend(prefix, tuple(tokens[start : start + page_size]))
    return (namespace, prefix)


# ---------------------------------------------------------------- the stream and its replay


def test_replay_gives_each_stored_page_its_prefix_and_slot() -> None:
    stream = ev.stored_pages(None, None, [1, 2, 3, 4], 2, [10, 20])
    assert ev.replay(stream, 2) == {key(None, 1, 2): 10, key(None, 1, 2, 3, 4): 20}
    # the second page chains to the first
    assert stream[1].parent_hash == stream[0].page_hash


def test_a_page_hash_names_its_whole_prefix_and_namespace_only() -> None:
    whole = ev.stored_pages(None, None, [1, 2, 3, 4], 2, [0, 2])
    # the same pages stored in two steps (as after a node split) get the same hashes
    first = ev.stored_pages(None, None, [1, 2], 2, [0])
    second = ev.stored_pages(None, first[0].page_hash, [3, 4], 2, [2])
    assert [e.page_hash for e in whole] == [first[0].page_hash, second[0].page_hash]
    # another namespace, or another token before, is another page
    assert ev.stored_pages(("lora", 1), None, [1, 2], 2, [0])[0].page_hash != first[0].page_hash
    assert ev.stored_pages(None, None, [9, 2, 3, 4], 2, [0, 2])[1].page_hash != whole[1].page_hash


def test_namespaces_hash_apart_even_where_python_calls_them_equal() -> None:
    domain = (None, ("lora", 1), ("lora", "1"), ("lora", b"1"), (1,), ((1,),), ())
    assert len({ev.compute_page_hash(None, ns, (1,)) for ns in domain}) == len(domain)
    assert ev.compute_page_hash(None, ("lora", True), (1,)) != ev.compute_page_hash(None, ("lora", 1), (1,))


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (lambda a, b: [b[0]], "its parent .* is not cached"),
        (lambda a, b: [a[0], a[0]], "is stored already"),
        (lambda a, b: [a[0], a[1], ev.PageRemoved(None, a[0].page_hash)], "before the pages extending it"),
        (lambda a, b: [ev.PageRemoved(None, 7)], "is not cached"),
        (lambda a, b: [ev.PageStored(None, 5, None, (1, 2), 0)], "not the hash of its parent and tokens"),
        (lambda a, b: [ev.PageStored(None, a[0].page_hash, None, (1, 2, 3), 0)], "a page of 3 tokens"),
        (lambda a, b: [a[0], ev.PagesRemoved((a[0].page_hash, a[0].page_hash))], "listed twice"),
        (lambda a, b: ["BlockStored"], "not an event"),
    ],
)
def test_a_stream_that_cannot_follow_is_rejected_at_the_first_bad_event(stream: Any, message: str) -> None:
    a = ev.stored_pages(None, None, [1, 2, 3, 4], 2, [0, 2])
    b = [ev.PageStored(None, a[1].page_hash, a[0].page_hash, (3, 4), 2)]
    with pytest.raises(ev.EventStreamError, match=message):
        ev.Replayer(2).apply(stream(a, b))


def test_the_rejections_name_the_event_and_the_page_exactly() -> None:
    a = ev.stored_pages(None, None, [1, 2, 3, 4], 2, [0, 2])
    h0, h1 = a[0].page_hash, a[1].page_hash

    def name(page_hash: int) -> str:
        return f"{page_hash % 2**64:#x}"

    cases = [
        ([a[1]], f"event 1 (PageStored): its parent {name(h0)} is not cached"),
        (
            [a[0], a[0]],
            f"event 2 (PageStored): page {name(h0)} is stored already (as 2 tokens in None; now 2 tokens in None)",
        ),
        (
            [a[0], a[1], a[1]],
            f"event 3 (PageStored): page {name(h1)} is stored already (as 4 tokens in None; now 4 tokens in None)",
        ),
        (  # stored again under a parent the stream never named: counted from no tokens before it
            [a[0], ev.PageStored(None, h0, 12345, (1, 2), 0)],
            f"event 2 (PageStored): page {name(h0)} is stored already (as 2 tokens in None; now 2 tokens in None)",
        ),
        ([a[0], ev.PagesRemoved((h0, 7))], "event 2 (PagesRemoved): page 0x7 is not cached"),
        (
            [a[0], a[1], ev.PagesRemoved((h0,))],
            f"event 3 (PagesRemoved): page {name(h0)} is removed before the pages extending it",
        ),
        ([ev.PageRemoved(None, -1)], "event 1 (PageRemoved): page 0xffffffffffffffff is not cached"),
        (
            [ev.PageRemoved(None, bytes(range(1, 33)))],
            "event 1 (PageRemoved): page 0x0102030405060708... is not cached",
        ),
        ([ev.PageRemoved(None, "h")], "event 1 (PageRemoved): page 'h' is not cached"),
    ]
    for stream, message in cases:
        with pytest.raises(ev.EventStreamError) as error:
            ev.Replayer(2).apply(stream)
        assert str(error.value) == message
    counting = ev.Replayer(2, count_repeats=True).apply([a[0], a[0]])
    with pytest.raises(ev.EventStreamError) as error:
        counting.apply([ev.PageStored(None, h0, None, (9, 9), 0)])
    assert str(error.value) == f"event 3 (PageStored): page {name(h0)} is stored again with other tokens"
    # a batch removal is one event, its pages removed deepest first whatever their order
    assert ev.Replayer(2).apply([*a, ev.PagesRemoved((h0, h1))]).cached() == {}


def test_pages_removed_together_may_come_in_any_order() -> None:
    a = ev.stored_pages(None, None, [1, 2, 3, 4], 2, [0, 2])
    replayer = ev.Replayer(2).apply(a)
    replayer.apply([ev.PagesRemoved((a[0].page_hash, a[1].page_hash))])  # parent listed first, as SGLang does
    assert replayer.cached() == {}


def test_a_counting_replay_needs_as_many_removals_as_stores() -> None:
    a = ev.stored_pages(None, None, [1, 2], 2, [0])
    replayer = ev.Replayer(2, count_repeats=True).apply(a + a)
    replayer.apply([ev.PageRemoved(None, a[0].page_hash)])
    assert replayer.cached() == {key(None, 1, 2): 0}
    replayer.apply([ev.PagesRemoved((a[0].page_hash,))])
    assert replayer.cached() == {}
    with pytest.raises(ev.EventStreamError, match="with other tokens"):
        ev.Replayer(2, count_repeats=True).apply([*a, ev.PageStored(None, a[0].page_hash, None, (7, 7), 4)])


def test_a_counting_replay_counts_the_children_of_each_copy() -> None:
    """A stored three times with its child B, B stored twice, C once: A goes last, after every copy of B and C."""
    a = ev.stored_pages(None, None, [1, 2], 2, [0])
    b = ev.stored_pages(None, a[0].page_hash, [3, 4], 2, [2])
    c = ev.stored_pages(None, a[0].page_hash, [5, 6], 2, [4])
    replayer = ev.Replayer(2, count_repeats=True).apply([*a, *b, *b, *c, *a, *a])
    h_a, h_b, h_c = a[0].page_hash, b[0].page_hash, c[0].page_hash
    assert replayer.children == {h_a: 3} and replayer.repeats == {h_b: 1, h_a: 2}
    for removed in (h_b, h_a, h_a, h_b):  # the copies go first; B's last copy goes with it
        replayer.apply([ev.PageRemoved(None, removed)])
    assert replayer.children == {h_a: 1}
    with pytest.raises(ev.EventStreamError, match="removed before the pages extending it"):
        replayer.apply([ev.PageRemoved(None, h_a)])
    replayer.apply([ev.PageRemoved(None, h_c), ev.PageRemoved(None, h_a)])
    assert replayer.pages == {} and replayer.children == {} and not any(replayer.repeats.values())
    with pytest.raises(ev.EventStreamError, match="is not cached"):
        replayer.apply([ev.PageRemoved(None, h_a)])


def test_a_page_whose_parent_lies_in_another_namespace_is_rejected() -> None:
    a = ev.stored_pages("x", None, [1, 2], 2, [0])
    other = ev.PageStored("y", 99, a[0].page_hash, (3, 4), 2)
    with pytest.raises(ev.EventStreamError) as error:
        ev.Replayer(2, check_hashes=False).apply([*a, other])
    assert str(error.value) == "event 2 (PageStored): its parent lies in namespace 'x'"


def test_all_cleared_forgets_every_page() -> None:
    stream = [*ev.stored_pages(None, None, [1, 2], 2, [0]), ev.AllCleared(), *ev.stored_pages(1, None, [3, 4], 2, [2])]
    assert ev.replay(stream, 2) == {key(1, 3, 4): 2}


def test_events_match_cache_names_missing_extra_and_moved_pages() -> None:
    ev.events_match_cache({key(None, 1, 2): ev.UNKNOWN_SLOT}, {key(None, 1, 2): 6})  # the wire carries no slots
    with pytest.raises(ev.EventStreamError, match="1 cached pages never announced .*1 announced pages not cached"):
        ev.events_match_cache({key(None, 1, 2): 0}, {key(None, 3, 4): 0})
    with pytest.raises(ev.EventStreamError, match="1 pages at another slot"):
        ev.events_match_cache({key(None, 1, 2): 0}, {key(None, 1, 2): 4})


@pytest.mark.parametrize(
    ("replayed", "cached", "message"),
    [
        (
            {},
            {key(None, *range(2 * n)): n for n in (1, 2, 3, 4)},
            "4 cached pages never announced (2 tokens in None, 4 tokens in None, 6 tokens in None)",
        ),
        ({key(7, 1, 2): 0}, {}, "1 announced pages not cached (2 tokens in 7)"),
        ({key(None, 1, 2): 0}, {key(None, 1, 2): 4}, "1 pages at another slot (2 tokens in None)"),
        (
            {key(None, 1, 2): 0, key("a", 5, 6): 2},
            {key(None, 1, 2): 4, key("b", 5, 6): 2},
            "1 cached pages never announced (2 tokens in 'b'); 1 announced pages not cached (2 tokens in 'a');"
            " 1 pages at another slot (2 tokens in None)",
        ),
    ],
)
def test_events_match_cache_says_exactly_what_differs(
    replayed: dict[PageKey, int], cached: dict[PageKey, int], message: str
) -> None:
    with pytest.raises(ev.EventStreamError) as error:
        ev.events_match_cache(replayed, cached)
    assert str(error.value) == "events_replay_to_the_cache: " + message


def test_block_events_in_vllms_vocabulary_become_pages() -> None:
    BlockStored = type("BlockStored", (SimpleNamespace,), {})
    BlockRemoved = type("BlockRemoved", (SimpleNamespace,), {})
    AllBlocksCleared = type("AllBlocksCleared", (SimpleNamespace,), {})
    stored = BlockStored(block_hashes=[b"x", b"y"], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2)
    events = ev.from_block_events([stored, BlockRemoved(block_hashes=[b"y"]), AllBlocksCleared()], lambda _: "ns")
    assert events == [
        ev.PageStored("ns", b"x", None, (1, 2), ev.UNKNOWN_SLOT),
        ev.PageStored("ns", b"y", b"x", (3, 4), ev.UNKNOWN_SLOT),
        ev.PagesRemoved((b"y",)),
        ev.AllCleared(),
    ]
    assert ev.Replayer(2, check_hashes=False).apply(events[:3]).cached() == {key("ns", 1, 2): ev.UNKNOWN_SLOT}
    with pytest.raises(ev.EventStreamError, match="not a KV cache event"):
        ev.from_block_events([object()], lambda _: None)


# ---------------------------------------------------------------- the caches that emit it


CACHES = {
    "reference": lambda **kw: reference.RadixPrefixCache(**kw),
    "optimized": lambda **kw: optimized.RadixPrefixCache(**kw),
}


def cached(cache: Any) -> dict[PageKey, int]:
    return {k: e.slot_start for k, e in cache.abstract_state().entries.items()}


@pytest.mark.parametrize("impl", CACHES)
def test_no_events_unless_asked(impl: str) -> None:
    cache = CACHES[impl](page_size=2)
    cache.insert_prefix([1, 2], [0, 1])
    assert cache.take_events() == []
    cache.insert_prefix([3, 4], [2, 3])  # taking from a cache without events does not turn them on
    assert cache.take_events() == [] and cache.events is None


@pytest.mark.parametrize("impl", CACHES)
def test_splits_partial_evictions_namespaces_and_reset_replay_to_the_cache(impl: str) -> None:
    cache = CACHES[impl](page_size=2, enable_events=True)
    replayer = ev.Replayer(2)
    cache.insert_prefix([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
    first = cache.take_events()
    replayer.apply(first)
    cache.insert_prefix([1, 2, 3, 4, 9, 9], [0, 1, 2, 3, 6, 7])  # splits the node after two pages
    cache.insert_prefix([1, 2], [8, 9], namespace=("lora", 1))  # same tokens, another namespace
    replayer.apply(cache.take_events())
    assert replayer.cached() == cached(cache)
    # the split moved no hash: the first pages' names are the ones announced before
    assert {e.page_hash for e in first} <= set(replayer.pages)
    cache.evict(2)  # one page of a leaf
    replayer.apply(cache.take_events())
    assert replayer.cached() == cached(cache)
    cache.reset()
    assert cache.take_events()[-1] == ev.AllCleared()
    assert cache.take_events() == []  # drained


@pytest.mark.parametrize("impl", CACHES)
def test_events_are_enabled_on_an_empty_cache_only(impl: str) -> None:
    cache = CACHES[impl](page_size=1)
    cache.insert_prefix([1], [0])
    with pytest.raises(CacheBusyError) as error:
        cache.enable_events()
    assert str(error.value) == "enable events on an empty cache: the pages cached before were never announced"
    cache.reset()
    cache.enable_events()
    cache.insert_prefix([1], [0])
    assert ev.replay(cache.take_events(), 1) == cached(cache)


@pytest.mark.parametrize("impl", CACHES)
def test_an_eviction_names_the_namespace_of_each_page_it_removes(impl: str) -> None:
    cache = CACHES[impl](page_size=2, enable_events=True)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3], ("a",))
    cache.insert_prefix([5, 6], [4, 5], ("b",))
    stored = cache.take_events()
    cache.evict(6)
    removed = cache.take_events()
    hashes = {(e.namespace, e.page_hash) for e in stored}
    assert sorted((e.namespace, e.page_hash) for e in removed) == sorted(hashes)
    assert all(type(e) is ev.PageRemoved for e in removed)


@pytest.mark.parametrize("impl", CACHES)
def test_a_reset_counts_the_pages_it_drops_per_namespace(impl: str) -> None:
    cache = CACHES[impl](page_size=2)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3], ("a",))
    cache.insert_prefix([1, 2, 5, 6], [0, 1, 4, 5], ("a",))
    cache.insert_prefix([7, 8], [6, 7], ("b",))
    cache.reset()
    cache.insert_prefix([9, 9], [0, 1], ("b",))
    cache.reset()
    stats = cache.stats()
    dropped = {ns: stats.of(ns).pages_dropped for ns in (("a",), ("b",))}
    assert dropped == {("a",): 3, ("b",): 2} and all(type(n) is int for n in dropped.values())
    assert stats.of(None).pages_dropped == 0


@pytest.mark.parametrize("impl", CACHES)
def test_pages_stored_by_an_insert_that_extends_a_cached_path_are_removed_leaf_first(impl: str) -> None:
    """The second insert's pages sit below the first's: an eviction of all announces the deepest first."""
    cache = CACHES[impl](page_size=2, enable_events=True)
    namespace = ("a",)
    cache.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3], namespace)
    cache.insert_prefix([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7], namespace)
    cache.insert_prefix([1, 2, 9, 9], [0, 1, 8, 9], namespace)
    replayer = ev.Replayer(2).apply(cache.take_events())
    ev.events_match_cache(replayer.cached(), cached(cache))
    cache.evict(10)
    replayer.apply(cache.take_events())  # a page removed before its children is rejected here
    assert replayer.cached() == {} and cached(cache) == {}


def test_a_page_hash_is_blake2b_of_its_parents_hash_and_tokens_as_documented() -> None:
    """64 bits of BLAKE2b over the parent's hash and the tokens, all little-endian 8-byte words."""
    import hashlib
    import struct

    data = struct.pack("<Q3q", 7, 3, 4, -5)
    expected = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert ev.compute_page_hash(7, ("lora", 1), (3, 4, -5)) == expected
    assert ev.compute_page_hash(2**64 - 1, None, (1,)) == int.from_bytes(
        hashlib.blake2b(struct.pack("<Qq", 2**64 - 1, 1), digest_size=8).digest(), "little"
    )


@pytest.mark.parametrize("impl", CACHES)
def test_the_counters_are_whole_numbers(impl: str) -> None:
    """Pages and ages are counted in ints on every twin (a float count would print and export differently)."""
    cache = CACHES[impl](page_size=2)
    cache.insert_prefix([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], ("a",))
    cache.match_prefix([1, 2, 3, 4], ("a",))
    cache.insert_prefix([7, 8], [6, 7])
    cache.evict(4)
    cache.reset()
    stats = cache.stats()
    counts = [getattr(s, name) for s in stats.namespaces.values() for name in vars(s)]
    assert counts and all(type(n) is int for n in counts) and type(stats.eviction_age_sum) is int
    assert stats.of(("a",)).pages_evicted + stats.of(None).pages_evicted == 2
    assert stats.eviction_age_sum > 0
