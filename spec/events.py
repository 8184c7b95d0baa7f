"""KV cache events: the stream a prefix cache publishes so that a router can mirror what it holds.

A cache that emits events tells, page by page, what it stored and what it
removed (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``;
SGLang emits the same classes). A router replays the stream to know which
worker holds which prefix. The stream must never drift from the cache: the
invariant the machines check on every step is

    replay(everything emitted so far) == the cache's cached pages.

A page is named by a hash of its namespace and its whole token prefix
(``compute_page_hash``): the hash of the page before it chained with the
page's own tokens (BLAKE2b, 64 bits). It depends on the tokens only, so a
node split, which moves pages between nodes, never changes it.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import IntegrityError
from .hashing import compute_namespace_seed
from .prefix_cache import PageKey, Prefix
from .types import Namespace


class EventStreamError(IntegrityError):
    """The event stream cannot be replayed (a page removed twice, a parent never stored ...)."""


@dataclass(frozen=True)
class PageStored:
    """A page entered the cache."""

    namespace: Namespace
    # compute_page_hash of this page, and of the page before it (None for a first page)
    page_hash: int
    parent_hash: int | None
    # the page's own P tokens
    tokens: tuple[int, ...]
    # its first slot
    slot: int


@dataclass(frozen=True)
class PageRemoved:
    """A page left the cache (evicted). The hash names it; the namespace is for reading (the wire omits it)."""

    namespace: Namespace
    page_hash: int


@dataclass(frozen=True)
class AllCleared:
    """Every page of every namespace left the cache (reset)."""


Event = PageStored | PageRemoved | AllCleared


@functools.lru_cache(maxsize=4096)
def _namespace_seed(namespace: Namespace) -> int:
    return compute_namespace_seed(namespace)


def compute_page_hash(parent_hash: int | None, namespace: Namespace, tokens: Sequence[int]) -> int:
    """The hash of a page: 64 bits of BLAKE2b over its parent's hash (the namespace's seed for a first
    page) and its tokens (int64, little-endian). A function of the whole token prefix and the
    namespace only, so a node split never changes it; stable across processes and machines.
    """
    seed = _namespace_seed(namespace) if parent_hash is None else parent_hash
    data = seed.to_bytes(8, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def stored_pages(
    namespace: Namespace, parent_hash: int | None, tokens: Sequence[int], page_size: int, slots: Sequence[int]
) -> list[PageStored]:
    """PageStored events of consecutive new pages: ``tokens`` (whole pages) after the page ``parent_hash``.

    ``slots``: the first slot of each page, in order. Hashing costs O(new tokens): the cached prefix
    is named by its last page's hash alone.
    """
    events = []
    parent = parent_hash
    for page, slot in enumerate(slots):
        own = tuple(tokens[page * page_size : (page + 1) * page_size])
        page_hash = compute_page_hash(parent, namespace, own)
        events.append(PageStored(namespace, page_hash, parent, own, slot))
        parent = page_hash
    return events


class Replayer:
    """Applies events one by one, as a router would, and knows the cached pages they describe."""

    def __init__(self, page_size: int, check_hashes: bool = True) -> None:
        self.page_size = page_size
        # our hashes are checked against parent and tokens; an engine's own hashes (another function) are not
        self.check_hashes = check_hashes
        # page hash -> (its key, its slot, its parent's hash)
        self.pages: dict[int, tuple[PageKey, int, int | None]] = {}
        # page hash -> how many cached pages extend it
        self.children: dict[int, int] = {}
        self.applied = 0

    def apply(self, events: Iterable[Event]) -> Replayer:
        """Apply every event in order; EventStreamError at the first one that cannot follow the ones before."""
        for event in events:
            self.applied += 1
            if isinstance(event, PageStored):
                self._store(event)
            elif isinstance(event, PageRemoved):
                self._remove(event)
            elif isinstance(event, AllCleared):
                self.pages.clear()
                self.children.clear()
            else:
                raise EventStreamError(f"event {self.applied}: not an event: {event!r}")
        return self

    def cached(self) -> dict[PageKey, int]:
        """``{(namespace, token prefix): slot_start}`` of the pages the stream says are cached."""
        return {key: slot for key, slot, _ in self.pages.values()}

    def _store(self, event: PageStored) -> None:
        where = f"event {self.applied} (PageStored)"
        if len(event.tokens) != self.page_size:
            raise EventStreamError(f"{where}: a page of {len(event.tokens)} tokens, P={self.page_size}")
        if event.page_hash in self.pages:
            raise EventStreamError(f"{where}: page {event.page_hash:#x} is stored already")
        if event.parent_hash is None:
            parent_prefix = None
        elif event.parent_hash in self.pages:
            (parent_namespace, parent_prefix), _, _ = self.pages[event.parent_hash]
            if parent_namespace != event.namespace:
                raise EventStreamError(f"{where}: its parent lies in namespace {parent_namespace!r}")
        else:
            raise EventStreamError(f"{where}: its parent {event.parent_hash:#x} is not cached")
        if self.check_hashes and compute_page_hash(event.parent_hash, event.namespace, event.tokens) != event.page_hash:
            raise EventStreamError(f"{where}: its hash is not the hash of its parent and tokens")
        key = (event.namespace, Prefix.extend(parent_prefix, tuple(event.tokens)))
        self.pages[event.page_hash] = (key, event.slot, event.parent_hash)
        if event.parent_hash is not None:
            self.children[event.parent_hash] = self.children.get(event.parent_hash, 0) + 1

    def _remove(self, event: PageRemoved) -> None:
        where = f"event {self.applied} (PageRemoved)"
        found = self.pages.get(event.page_hash)
        if found is None:
            raise EventStreamError(f"{where}: page {event.page_hash:#x} is not cached")
        if self.children.get(event.page_hash):
            raise EventStreamError(f"{where}: page {event.page_hash:#x} is removed before the pages extending it")
        _, _, parent_hash = found
        del self.pages[event.page_hash]
        self.children.pop(event.page_hash, None)
        if parent_hash is not None:
            self.children[parent_hash] -= 1


def replay(events: Iterable[Event], page_size: int) -> dict[PageKey, int]:
    """The cached pages an event stream describes: ``{(namespace, token prefix): slot_start}``."""
    return Replayer(page_size).apply(events).cached()


def events_match_cache(replayed: dict[PageKey, int], cached: dict[PageKey, int]) -> None:
    """The replay invariant: the pages the events describe are exactly the cache's (with their slots)."""
    if replayed == cached:
        return
    missing = [key for key in cached if key not in replayed]
    extra = [key for key in replayed if key not in cached]
    moved = [key for key in cached if key in replayed and replayed[key] != cached[key]]

    def show(keys: list[PageKey]) -> str:
        return ", ".join(f"{len(prefix)} tokens in {namespace!r}" for namespace, prefix in keys[:3])

    raise EventStreamError(
        "events_replay_to_the_cache: "
        + "; ".join(
            part
            for part in (
                f"{len(missing)} cached pages never announced ({show(missing)})" if missing else "",
                f"{len(extra)} announced pages not cached ({show(extra)})" if extra else "",
                f"{len(moved)} pages at another slot ({show(moved)})" if moved else "",
            )
            if part
        )
    )
