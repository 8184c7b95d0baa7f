"""Routers as targets: our own router index, and the translation of a worker's page names into a router's.

``SpecRouter`` (target ``radixspec-router``) is the reference router: it decodes
each batch a worker published (``radixspec.optimized.kv_events``) and replays it
into ``radixspec.spec.router.RouterIndex``. It is what the other routers are
checked beside, and the ``radixspec`` policy of ``radixspec replay --router``.

A namespace travels on the wire as the event's ``cache_salt`` (and the block's
extra key): ``repr(namespace)`` (``kv_events``); ``kv_events.WireReader`` reads
it back (a namespace is a literal of tuples, str, bytes and ints: ``repr``
and ``literal_eval`` are inverse on the spec's domain), and an engine's salts
and LoRA names as namespaces of their own.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from radixspec.spec.domains import Namespace
from radixspec.spec.prefix_cache import PageKey
from radixspec.spec.router import RouterIndex

from .api import TargetInfo

if TYPE_CHECKING:
    from radixspec.optimized.kv_events import WireReader


class SpecRouter:
    """The spec's router index behind the wire: every batch decoded, its events replayed per worker."""

    name = "radixspec-router"

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.index = RouterIndex(page_size, check_hashes=False)
        # per worker, its stream's reader (a block's namespace may come from its parent)
        self.readers: dict[int, WireReader] = {}

    def apply(self, worker: int, payload: bytes) -> None:
        from radixspec.optimized import kv_events

        batch = kv_events.decode(payload)
        reader = self.readers.setdefault(worker, kv_events.WireReader())
        self.index.apply(worker, reader.read(batch.events, kv_events.our_namespace))

    def scores(self, tokens: list[int], namespace: Namespace) -> dict[int, int]:
        return self.index.scores(tokens, namespace)

    def live(self) -> dict[int, set[Hashable]]:
        return {worker: set(pages) for worker, pages in self.index.live().items()}

    def entry_of(self, key: PageKey) -> Hashable:
        return key

    def remove_worker(self, worker: int) -> None:
        self.index.remove_worker(worker)
        self.readers.pop(worker, None)


SPEC_ROUTER = TargetInfo(
    name="radixspec-router",
    description="radixspec's own router index (the spec's, fed through the wire): the routers' reference",
    router_factory=SpecRouter,
    requires=(("msgspec", "pip install 'radixspec[events]'"),),
)
