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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .domains import Immutable, Namespace
from .errors import CacheBusyError, EventStreamError
from .hashing import compute_namespace_seed
from .prefix_cache import PageKey, Prefix


@dataclass(frozen=True)
class PageStored(Immutable):
    """A page entered the cache."""

    namespace: Namespace
    # compute_page_hash of this page, and of the page before it (None for a first page); an engine's
    # events carry its own hashes (any hashable: vLLM's may be bytes)
    page_hash: Any
    parent_hash: Any
    # the page's own P tokens
    tokens: tuple[int, ...]
    # its first slot (UNKNOWN_SLOT when the stream does not carry slots, as on the wire)
    slot: int


@dataclass(frozen=True)
class PageRemoved(Immutable):
    """A page left the cache (evicted). The hash names it; the namespace is for reading (the wire omits it)."""

    namespace: Namespace
    page_hash: Any


@dataclass(frozen=True)
class PagesRemoved(Immutable):
    """Pages that left the cache together (one ``BlockRemoved`` on the wire): their order inside the batch
    carries no meaning (SGLang lists a node's pages first to last), only the state after the whole batch."""

    page_hashes: tuple[Any, ...]


@dataclass(frozen=True)
class AllCleared(Immutable):
    """Every page of every namespace left the cache (reset)."""


Event = PageStored | PageRemoved | PagesRemoved | AllCleared

# the slot of a page announced without one (vLLM's and SGLang's events name blocks by hash only)
UNKNOWN_SLOT = -1


@functools.lru_cache(maxsize=4096)
def _seed_of_repr(text: str, namespace: Namespace) -> int:
    return compute_namespace_seed(namespace)


def _namespace_seed(namespace: Namespace) -> int:
    # cached by repr: namespaces Python calls equal (1 and True) must never share a cached seed
    return _seed_of_repr(repr(namespace), namespace)


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

    def __init__(self, page_size: int, check_hashes: bool = True, count_repeats: bool = False) -> None:
        self.page_size = page_size
        # our hashes are checked against parent and tokens; an engine's own hashes (another function) are not
        self.check_hashes = check_hashes
        # a router that counts: a page stored again (same hash, same tokens) needs as many removals;
        # for engines whose hashes do not tell namespaces apart, replayed on token prefixes alone
        self.count_repeats = count_repeats
        # page hash -> how many times it is stored beyond the first (count_repeats only)
        self.repeats: dict[Any, int] = {}
        # page hash -> (its key, its slot, its parent's hash)
        self.pages: dict[Any, tuple[PageKey, int, Any]] = {}
        # page hash -> how many cached pages extend it
        self.children: dict[Any, int] = {}
        self.applied = 0

    def apply(self, events: Iterable[Event]) -> Replayer:
        """Apply every event in order; EventStreamError at the first one that cannot follow the ones before."""
        for event in events:
            self.applied += 1
            if isinstance(event, PageStored):
                self._store(event)
            elif isinstance(event, PageRemoved):
                self._remove(event.page_hash, "PageRemoved")
            elif isinstance(event, PagesRemoved):
                self._remove_together(event.page_hashes)
            elif isinstance(event, AllCleared):
                self.pages.clear()
                self.children.clear()
                self.repeats.clear()
            else:
                raise EventStreamError(f"event {self.applied}: not an event: {event!r}")
        return self

    def cached(self) -> dict[PageKey, int]:
        """``{(namespace, token prefix): slot_start}`` of the pages the stream says are cached."""
        return {key: slot for key, slot, _ in self.pages.values()}

    def reach(self) -> int:
        """How many pages the stream says are cached now."""
        return len(self.pages)

    def _store(self, event: PageStored) -> None:
        where = f"event {self.applied} (PageStored)"
        if len(event.tokens) != self.page_size:
            raise EventStreamError(f"{where}: a page of {len(event.tokens)} tokens, P={self.page_size}")
        if event.page_hash in self.pages and self.count_repeats:
            key, _, parent_hash = self.pages[event.page_hash]
            if parent_hash != event.parent_hash or key[1].page != tuple(event.tokens):
                raise EventStreamError(
                    f"{where}: page {describe_hash(event.page_hash)} is stored again with other tokens"
                )
            self.repeats[event.page_hash] = self.repeats.get(event.page_hash, 0) + 1
            if parent_hash is not None:
                self.children[parent_hash] = self.children.get(parent_hash, 0) + 1
            return
        if event.page_hash in self.pages:
            (namespace, prefix), _, _ = self.pages[event.page_hash]
            raise EventStreamError(
                f"{where}: page {describe_hash(event.page_hash)} is stored already"
                f" (as {prefix.length} tokens in {namespace!r}; now {parent_length(self, event) + self.page_size}"
                f" tokens in {event.namespace!r})"
            )
        if event.parent_hash is None:
            parent_prefix = None
        elif event.parent_hash in self.pages:
            (parent_namespace, parent_prefix), _, _ = self.pages[event.parent_hash]
            if parent_namespace != event.namespace:
                raise EventStreamError(f"{where}: its parent lies in namespace {parent_namespace!r}")
        else:
            raise EventStreamError(f"{where}: its parent {describe_hash(event.parent_hash)} is not cached")
        if self.check_hashes and compute_page_hash(event.parent_hash, event.namespace, event.tokens) != event.page_hash:
            raise EventStreamError(f"{where}: its hash is not the hash of its parent and tokens")
        key = (event.namespace, Prefix.extend(parent_prefix, tuple(event.tokens)))
        self.pages[event.page_hash] = (key, event.slot, event.parent_hash)
        if event.parent_hash is not None:
            self.children[event.parent_hash] = self.children.get(event.parent_hash, 0) + 1

    def _remove(self, page_hash: Any, kind: str) -> None:
        where = f"event {self.applied} ({kind})"
        found = self.pages.get(page_hash)
        if found is None:
            raise EventStreamError(f"{where}: page {describe_hash(page_hash)} is not cached")
        _, _, parent_hash = found
        if self.repeats.get(page_hash):
            self.repeats[page_hash] -= 1
            if parent_hash is not None:
                self.children[parent_hash] -= 1
            return
        if self.children.get(page_hash):
            raise EventStreamError(f"{where}: page {describe_hash(page_hash)} is removed before the pages extending it")
        del self.pages[page_hash]
        self.children.pop(page_hash, None)
        if parent_hash is not None:
            self.children[parent_hash] -= 1

    def _remove_together(self, page_hashes: tuple[Any, ...]) -> None:
        """Remove a batch: every page cached, none left behind with a parent in the batch."""
        where = f"event {self.applied} (PagesRemoved)"
        if not self.count_repeats and len(set(page_hashes)) != len(page_hashes):
            raise EventStreamError(f"{where}: a page is listed twice")
        for page_hash in page_hashes:
            if page_hash not in self.pages:
                raise EventStreamError(f"{where}: page {describe_hash(page_hash)} is not cached")
        # deepest first: a page's children in the batch go before it
        depth = {h: self.pages[h][0][1].length for h in page_hashes}
        for page_hash in sorted(page_hashes, key=depth.__getitem__, reverse=True):
            self._remove(page_hash, "PagesRemoved")


def describe_hash(page_hash: Any) -> str:
    """A page hash for a message: hex for ints (ours, SGLang's), hex of the first bytes for vLLM's bytes."""
    if isinstance(page_hash, int):
        return f"{page_hash & (2**64 - 1):#x}"
    if isinstance(page_hash, bytes):
        return f"0x{page_hash[:8].hex()}..."
    return repr(page_hash)


def parent_length(replayer: Replayer, event: PageStored) -> int:
    """Tokens before a stored page, as the stream so far names its parent (0 if none)."""
    if event.parent_hash is None:
        return 0
    found = replayer.pages.get(event.parent_hash)
    return 0 if found is None else found[0][1].length


def from_block_events(events: Iterable[Any], namespace_of: Callable[[Any], Namespace]) -> list[Event]:
    """Block events in vLLM's vocabulary (vLLM's own classes, SGLang's, or ``radixspec.optimized.kv_events``') as the
    spec's, page by page: a ``BlockStored`` of n blocks is n PageStored, each chained to the one before.

    ``namespace_of(extra_key)`` names the namespace of a stored block from its extra key, or else its
    ``cache_salt`` (None when the event has neither): the wire names namespaces by hash only, so the caller
    knows its own mapping. Slots are not on the wire: UNKNOWN_SLOT.
    """
    out: list[Event] = []
    for event in events:
        kind = type(event).__name__
        if kind == "BlockStored":
            size = event.block_size
            parent = event.parent_block_hash
            extra_keys = getattr(event, "extra_keys", None)
            for index, block_hash in enumerate(event.block_hashes):
                # SGLang names a namespace by the block's cache_salt, vLLM by its extra keys
                extra = extra_keys[index] if extra_keys else getattr(event, "cache_salt", None)
                tokens = tuple(event.token_ids[index * size : (index + 1) * size])
                out.append(PageStored(namespace_of(extra), block_hash, parent, tokens, UNKNOWN_SLOT))
                parent = block_hash
        elif kind == "BlockRemoved":
            out.append(PagesRemoved(tuple(event.block_hashes)))
        elif kind == "AllBlocksCleared":
            out.append(AllCleared())
        else:
            raise EventStreamError(f"not a KV cache event: {event!r}")
    return out


class EmitsEvents:
    """``enable_events`` / ``take_events`` of a cache that emits events: the reference and the optimized cache.

    The cache keeps ``events`` (the events not yet taken; None while it emits none) and ``roots`` (one per
    namespace holding pages).
    """

    events: list[Event] | None
    roots: dict[Any, Any]

    def enable_events(self) -> None:
        """Emit KV events from now on (the cache must be empty: a router starts from an empty mirror)."""
        if self.roots:
            raise CacheBusyError("enable events on an empty cache: the pages cached before were never announced")
        if self.events is None:
            self.events = []

    def take_events(self) -> list[Event]:
        """The events emitted since the last call, in order (drained; empty while none are emitted)."""
        taken, self.events = (self.events or []), ([] if self.events is not None else None)
        return taken


def replay(events: Iterable[Event], page_size: int) -> dict[PageKey, int]:
    """The cached pages an event stream describes: ``{(namespace, token prefix): slot_start}``."""
    return Replayer(page_size).apply(events).cached()


def events_match_cache(replayed: dict[PageKey, int], cached: dict[PageKey, int]) -> None:
    """The replay invariant: the pages the events describe are exactly the cache's (with their slots, where
    the events carry them)."""
    if replayed == cached:
        return
    missing = [key for key in cached if key not in replayed]
    extra = [key for key in replayed if key not in cached]
    moved = [key for key in cached if key in replayed and replayed[key] not in (cached[key], UNKNOWN_SLOT)]
    if not (missing or extra or moved):
        return

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
