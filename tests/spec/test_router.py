"""The router's view (spec/router.py): the abstract router index and its three laws, each seen failing."""

from __future__ import annotations

import pytest

from radixspec.spec import events as ev
from radixspec.spec.errors import EventStreamError, IntegrityError, InvalidSizeError, RouterLawError
from radixspec.spec.router import (
    RouterIndex,
    longest_cached_pages,
    router_holds_live_blocks,
    router_namespaces_apart,
    router_scores_match_workers,
)
from tests.spec.test_events import key


def stream(namespace: object, tokens: list[int], slots: list[int], parent: int | None = None) -> list[ev.Event]:
    return list(ev.stored_pages(namespace, parent, tokens, 2, slots))  # type: ignore[arg-type]


def test_the_index_scores_each_worker_by_the_leading_pages_its_stream_holds() -> None:
    index = RouterIndex(2)
    index.apply(0, stream(None, [1, 2, 3, 4], [0, 2]))
    index.apply(1, stream(None, [1, 2], [0]))
    index.apply(2, stream(("lora", 1), [1, 2, 3, 4], [0, 2]))
    assert index.scores([1, 2, 3, 4, 5], None) == {0: 2, 1: 1}
    # another namespace, a first page that differs: no score (and no zero entries)
    assert index.scores([1, 2, 3, 4], ("lora", 1)) == {2: 2}
    assert index.scores([9, 2, 3, 4], None) == {}
    assert index.live() == {
        0: {key(None, 1, 2), key(None, 1, 2, 3, 4)},
        1: {key(None, 1, 2)},
        2: {key(("lora", 1), 1, 2), key(("lora", 1), 1, 2, 3, 4)},
    }
    # a removal, a clear, a worker that leaves
    _, second = stream(None, [1, 2, 3, 4], [0, 2])
    assert isinstance(second, ev.PageStored)
    index.apply(0, [ev.PageRemoved(None, second.page_hash)])
    index.apply(1, [ev.AllCleared()])
    index.remove_worker(2)
    assert index.scores([1, 2, 3, 4], None) == {0: 1}
    assert index.live() == {0: {key(None, 1, 2)}}


def test_a_stream_that_cannot_follow_is_refused() -> None:
    index = RouterIndex(2)
    with pytest.raises(EventStreamError, match="not cached"):
        index.apply(0, [ev.PagesRemoved((123,))])
    with pytest.raises(InvalidSizeError):
        RouterIndex(0)


def test_longest_cached_pages_stops_at_the_first_missing_page_and_ignores_a_partial_one() -> None:
    pages = {key(None, 1, 2): 0, key(None, 1, 2, 3, 4): 2, key(None, 1, 2, 3, 4, 5, 6, 7, 8): 6}
    assert longest_cached_pages(pages, [1, 2, 3, 4, 5, 6, 7, 8], None, 2) == 2
    assert longest_cached_pages(pages, [1, 2, 3], None, 2) == 1
    assert longest_cached_pages(pages, [1, 2, 3, 4], ("lora", 1), 2) == 0


def test_each_law_fails_naming_itself_the_worker_and_the_numbers() -> None:
    assert issubclass(RouterLawError, IntegrityError)
    router_scores_match_workers({0: 2}, {0: 2, 1: 0}, [1, 2, 3, 4], None)
    with pytest.raises(RouterLawError, match=r"router_scores_match_workers: .* worker 1: router 1, worker 0"):
        router_scores_match_workers({0: 2, 1: 1}, {0: 2, 1: 0}, [1, 2, 3, 4], None)
    with pytest.raises(RouterLawError, match=r"worker 0: router 1, worker 2"):
        router_scores_match_workers({0: 1}, {0: 2}, [1, 2, 3, 4], None)
    a, b = key(None, 1, 2), key(None, 1, 2, 3, 4)
    router_holds_live_blocks({0: {a, b}}, {0: {a, b}})
    with pytest.raises(RouterLawError, match=r"router_holds_live_blocks: worker 0: 1 removed pages still indexed"):
        router_holds_live_blocks({0: {a, b}}, {0: {a}})
    with pytest.raises(RouterLawError, match=r"worker 3: 0 removed pages still indexed, 1 live missing"):
        router_holds_live_blocks({}, {3: {a}})
    c = key(("lora", 1), 1, 2)
    router_namespaces_apart({0: {a}, 1: {c}}, lambda page: page)
    with pytest.raises(RouterLawError, match=r"router_namespaces_apart: 2 tokens in \('lora', 1\) and in None"):
        router_namespaces_apart({0: {a}, 1: {c}}, lambda page: page[1])
