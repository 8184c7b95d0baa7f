"""The host tier's KV events of ``sglang-hicache`` as a consumer (a router's indexer) replays them: the pages they
hold on the host, each stored under a parent some event stored, stored only where none is held and removed only
where one is (``host_events_are_coherent``). The device tier's events go on to the manager's replay.

Two announcements SGLang makes under FULL + SWA are told from the rest and counted (docs/findings.md, finding 25):
a backup's ack announces on the host every node its SWA transfer covered (``_backup_publish_node_ids``), so a node
whose full KV is already announced there is announced again (the same page: a repeat a set-keeping consumer
ignores), and a node whose full KV is on the device only is announced too (a page the host does not hold). The
second kind is told by the node SGLang's event recorder describes (``follow``), and the pages it announced are
kept apart: the host pool's partition and the host hits are checked against the pages the host does hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Protocol

from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError

from ..stats import STATS
from .sglang_unified import SGLangUnifiedManager

FINDING_25 = "an SWA backup's ack announces a host page whose full KV is on the device only (finding 25)"
REPEAT = "an SWA backup's ack announces a host page again"


class BlockStored(Protocol):
    block_hashes: list[object]


class SGLangNode(Protocol):
    """What the follower reads of a node of SGLang's tree: its components' data."""

    component_data: Mapping[object, ComponentData]


class ComponentData(Protocol):
    host_value: object


class HostEvents:
    """The host tier's events replayed for one manager."""

    def __init__(self) -> None:
        # every page hash the events stored (either tier), its key: a host page's parent may be on the device only
        self.keys: dict[object, pc.PageKey] = {}
        # the host pages the events hold, by hash (the host tier need not be prefix-closed: write-back backs up
        # the leaf it evicts, not its parent)
        self.host_held: dict[object, pc.PageKey] = {}
        # finding 25: the pages (by hash) SGLang announced on the host with their full KV on the device only, not
        # yet replayed (by hash: its recorder merges a page's event into the one before it), and those replayed
        # (a consumer holds them on the host until a removal)
        self.unbacked: Counter[object] = Counter()
        self.phantoms: set[object] = set()

    def follow(self, m: SGLangUnifiedManager) -> None:
        """With SWA: each host announcement SGLang's event recorder makes of a node whose full KV is not on the host
        is noted as it is made (finding 25)."""
        recorder, full = m.cache.tree_core.kv_events, m.v.components.FULL
        record, enqueue = recorder.record_store, recorder.enqueue

        def noted(event: BlockStored) -> None:
            self.unbacked.update(event.block_hashes)
            enqueue(event)

        def record_store(node: SGLangNode, medium: object = None, **options: object) -> None:
            if "CPU" not in str(medium) or node.component_data[full].host_value is not None:
                record(node, medium, **options)
                return
            recorder.enqueue = noted
            try:
                record(node, medium, **options)
            finally:
                recorder.enqueue = enqueue

        recorder.record_store = record_store

    def replay(self, m: SGLangUnifiedManager, events: list[object]) -> list[object]:
        """The device tier's events, for the manager's replay; the host tier's (``medium`` CPU) kept here, as a set
        of pages (``host_events_are_coherent``: a host page stored while held, or removed while not, breaks it)."""
        device = []
        for raw in events:
            host = "CPU" in str(getattr(raw, "medium", ""))
            if not host:
                device.append(raw)
            for event in ev.from_block_events([raw], lambda salt: m.salts.get(salt) if salt else None):
                if isinstance(event, ev.PageStored):
                    parent = self.keys.get(event.parent_hash)
                    if event.parent_hash is not None and parent is None:
                        raise IntegrityError(
                            f"host_events_are_coherent: a page is stored under {ev.describe_hash(event.parent_hash)},"
                            " which no event stored"
                        )
                    key = (event.namespace, pc.Prefix.extend(None if parent is None else parent[1], event.tokens))
                    self.keys[event.page_hash] = key
                    if host and self.unbacked[event.page_hash] > 0:
                        self.unbacked[event.page_hash] -= 1
                        self.phantoms.add(event.page_hash)
                        STATS.rules[f"sglang-hicache.known: {FINDING_25}"] += 1
                    elif host:
                        if event.page_hash in self.host_held:
                            self.repeated(m, key, self.host_held[event.page_hash])
                        self.host_held[event.page_hash] = key
                        self.phantoms.discard(event.page_hash)
                elif isinstance(event, ev.PagesRemoved) and host:
                    for page_hash in event.page_hashes:
                        if self.host_held.pop(page_hash, None) is None and page_hash not in self.phantoms:
                            raise IntegrityError(
                                f"host_events_are_coherent: host page {ev.describe_hash(page_hash)} removed, not held"
                            )
                        self.phantoms.discard(page_hash)
                elif isinstance(event, ev.AllCleared):
                    self.host_held.clear()
                    self.phantoms.clear()
            STATS.events_replayed += host
        return device

    @staticmethod
    def repeated(m: SGLangUnifiedManager, key: pc.PageKey, held: pc.PageKey) -> None:
        """A host page stored again while held: with SWA, the same page announced again by an SWA backup's ack
        (counted); every other repeat breaks ``host_events_are_coherent``."""
        if m.swa is None or key != held:
            raise IntegrityError(f"host_events_are_coherent: host page {key} stored twice")
        STATS.rules[f"sglang-hicache.known: {REPEAT}"] += 1
