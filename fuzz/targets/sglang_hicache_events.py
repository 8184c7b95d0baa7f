"""The host tier's KV events of ``sglang-hicache`` as a consumer (a router's indexer) replays them: the pages they
hold on the host, each stored under a parent some event stored, stored only where none is held and removed only
where one is (``host_events_are_coherent``). The device tier's events go on to the manager's replay.

Announcements SGLang makes under FULL + SWA are told from the rest and counted (docs/findings.md, finding 25):
a backup's ack announces on the host every node its SWA transfer covered (``_backup_publish_node_ids``), so a node
whose full KV is already announced there is announced again (the same page: a repeat a set-keeping consumer
ignores), and a node whose full KV is on the device only is announced too (a page the host does not hold). The
second kind is told apart at the ack (``follow``: the node's full KV has no host copy), and the pages it announced
are kept apart: the host pool's partition and the host hits are checked against the pages the host does hold.
Under FULL + MAMBA a state backed up after its node's full KV is announced again likewise (a repeat, counted).
"""

from __future__ import annotations

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import events as ev
from radixspec.spec import prefix_cache as pc
from radixspec.spec.errors import IntegrityError

from ..stats import STATS
from .sglang_unified import SGLangUnifiedManager, page_keys

FINDING_25 = "an SWA backup's ack announces a host page whose full KV is on the device only (finding 25)"
# a backup of a node whose full KV is on the host already, for a component's value (SWA's or a MAMBA state): its ack
# announces the node again (the same page)
REPEAT = "an {} backup's ack announces a host page again"


class HostEvents:
    """The host tier's events replayed for one manager."""

    def __init__(self) -> None:
        # every page hash the events stored (either tier), its key: a host page's parent may be on the device only
        self.keys: dict[object, pc.PageKey] = {}
        # the host pages the events hold, by hash (the host tier need not be prefix-closed: write-back backs up
        # the leaf it evicts, not its parent)
        self.host_held: dict[object, pc.PageKey] = {}
        # events taken from the tree core's queue at an ack (in order), not yet replayed; of them, those of
        # finding 25 (by id, the events held here), and the pages they announced (a consumer holds them on the host
        # until a removal)
        self.taken: list[object] = []
        self.unbacked: dict[int, object] = {}
        self.phantoms: set[object] = set()

    def follow(self, m: SGLangUnifiedManager) -> None:
        """With SWA: each node a backup's ack announces on the host while its full KV is not there (finding 25;
        ``is_backuped``: the full KV has a host copy) is acknowledged on its own, and the events of its announcement
        taken from the tree core's queue then (with those queued before them, in order): they reach ``replay`` first,
        told apart. Each node of an ack is acknowledged alone, as SGLang's loop over them does (Python and Rust
        cores alike)."""
        core = m.cache.tree_core
        finish, take = core.finish_write_through, core.take_events

        def finish_write_through(node_ids: list[int], ack_id: int) -> None:
            for node_id in node_ids:
                if core.is_backuped(node_id):
                    finish([node_id], ack_id)
                    continue
                self.taken.extend(take())
                finish([node_id], ack_id)
                announced = take()
                self.unbacked.update((id(event), event) for event in announced)
                self.taken.extend(announced)

        core.finish_write_through = finish_write_through

    def replay(self, m: SGLangUnifiedManager, events: list[object]) -> list[object]:
        """The device tier's events, for the manager's replay; the host tier's (``medium`` CPU) kept here, as a set
        of pages (``host_events_are_coherent``: a host page stored while held, or removed while not, breaks it)."""
        device = []
        taken, self.taken = self.taken, []
        for raw in taken + events:
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
                    if host and id(raw) in self.unbacked:
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
            self.unbacked.pop(id(raw), None)
            STATS.events_replayed += host
        return device

    def check_host_hit(self, m: SGLangUnifiedManager, req: HybridReq, hit: int, host_hit: int) -> int:
        """``host_hit_is_held``: the pages of a match's host hit (``host_hit`` tokens past its ``hit`` tokens on
        the device) are pages the events hold on the host, in a run right after the device hit. Under a component,
        the run may pass over pages the events hold on the device (SGLang's scheduler: "a load can expose resident
        FULL behind host-only aux state"): with MAMBA such a page is counted in the host hit (a state on the host
        only covers its node's full KV wherever it lies); with SWA alone it is not (FULL sums the host copies of the
        nodes past the device match, and a node whose window is on the host only but whose full KV is on the device
        only stops the device match while adding nothing: ``finalize_match_result_in_tree_core``). Returns the
        tokens passed over, which the load brings back beside the host hit."""
        cached = m.cached_pages()  # the device's events replayed first: the host's taken from them
        device = set(cached) if m.swa is not None or m.mamba is not None else set()
        host = set(self.host_held.values())
        keys = page_keys(req, m.page_size, m.eagle)
        end, counted, passed = hit, 0, 0
        while counted < host_hit:
            end += m.page_size
            key = keys[end // m.page_size - 1] if end // m.page_size <= len(keys) else None
            if key in host or (key in device and m.mamba is not None):
                counted += m.page_size
            elif key in device:
                passed += m.page_size
            else:
                where = "host copy" if not device else "copy on either tier"
                history = self.history(key) if key is not None else "past the request's key"
                raise IntegrityError(
                    f"host_hit_is_held: request {req.uid} hit {hit} tokens on the device and {host_hit} more on the"
                    f" host, but the events hold no {where} of the page ending at {end} ({history})"
                )
        if passed:
            STATS.record_rule("sglang-hicache.match[host hit past pages whose full KV is on the device only]")
        return passed

    def history(self, key: pc.PageKey) -> str:
        """What the events did with page ``key``, for a failure's message: held on the host, announced there only
        as finding 25's page, removed, or never stored."""
        hashes = [page_hash for page_hash, stored in self.keys.items() if stored == key]
        if not hashes:
            return "no event ever stored it"
        if any(page_hash in self.phantoms for page_hash in hashes):
            return "its only host announcement was taken for finding 25's (its full KV on the device only then)"
        if any(page_hash in self.host_held for page_hash in hashes):
            return "held"
        return f"stored ({len(hashes)} hash(es)), not held on the host now"

    @staticmethod
    def repeated(m: SGLangUnifiedManager, key: pc.PageKey, held: pc.PageKey) -> None:
        """A host page stored again while held: with SWA or MAMBA, the same page announced again by the ack of a
        backup of that component's value alone (counted); every other repeat breaks ``host_events_are_coherent``."""
        component = "SWA" if m.swa is not None else "MAMBA" if m.mamba is not None else None
        if component is None or key != held:
            raise IntegrityError(f"host_events_are_coherent: host page {key} stored twice")
        STATS.rules[f"sglang-hicache.known: {REPEAT.format(component)}"] += 1
