"""Routers as targets: our own router index, and the translation of a worker's page names into a router's.

``SpecRouter`` (target ``radixspec-router``) is the reference router: it decodes
each batch a worker published (``radixspec.optimized.kv_events``) and replays it
into ``radixspec.spec.router.RouterIndex``. It is what the other routers are
checked beside, and the ``radixspec`` policy of ``radixspec replay --router``.

A namespace travels on the wire as the block's extra key ``(repr(namespace),)``
(``kv_events``); ``namespace_of_extra`` reads it back (a namespace is a
literal of tuples, str, bytes and ints: ``repr`` and ``literal_eval`` are
inverse on the spec's domain).
"""

from __future__ import annotations

import ast
from collections.abc import Hashable

from radixspec.spec.domains import Namespace
from radixspec.spec.errors import EventStreamError
from radixspec.spec.events import from_block_events
from radixspec.spec.prefix_cache import PageKey
from radixspec.spec.router import RouterIndex

from .api import TargetInfo


def namespace_of_extra(extra: object) -> Namespace:
    """The namespace an extra key (``kv_events``: ``(repr(namespace),)``, or None) names."""
    if extra is None:
        return None
    text = extra[0] if isinstance(extra, (tuple, list)) and len(extra) == 1 else None
    try:
        if not isinstance(text, str):
            raise ValueError(text)
        namespace: Namespace = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise EventStreamError(f"extra key {extra!r} names no namespace") from None
    return namespace


class SpecRouter:
    """The spec's router index behind the wire: every batch decoded, its events replayed per worker."""

    name = "radixspec-router"

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.index = RouterIndex(page_size, check_hashes=False)

    def apply(self, worker: int, payload: bytes) -> None:
        from radixspec.optimized import kv_events

        batch = kv_events.decode(payload)
        self.index.apply(worker, from_block_events(batch.events, namespace_of_extra))

    def scores(self, tokens: list[int], namespace: Namespace) -> dict[int, int]:
        return self.index.scores(tokens, namespace)

    def live(self) -> dict[int, set[Hashable]]:
        return {worker: set(pages) for worker, pages in self.index.live().items()}

    def entry_of(self, key: PageKey) -> Hashable:
        return key

    def remove_worker(self, worker: int) -> None:
        self.index.remove_worker(worker)


SPEC_ROUTER = TargetInfo(
    name="radixspec-router",
    description="radixspec's own router index (the spec's, fed through the wire): the routers' reference",
    router_factory=SpecRouter,
    requires=(("msgspec", "pip install 'radixspec[events]'"),),
)
