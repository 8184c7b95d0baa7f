"""The tiered radix cache in plain Python: a radix tree whose nodes hold device and host copies, a host pool
beside the device pool, storage beside the tree, and a cache controller whose queue holds the transfers in
flight until the executor ends them. ``spec/tiers.py`` says what it must do; the names are the spec's.

Compressed nodes, as in ``radix_cache.py``: a node holds a run of whole pages with the same copies (``value``:
device page starts, ``host_value``: host page starts, either None when the run has no copy there) and the same
accounting. A transfer aligns the nodes to its pages first (splits), so each node is wholly in it or not; a later
split gives both halves the node's counts (locks, host locks, pins): each half is wholly inside whatever the
whole was inside. The controller names a transfer's pages by path and index, never by node, so a split never
leaves it pointing at half of what it moves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from radixspec.spec import tiers as st
from radixspec.spec.domains import (
    Namespace,
    check_insert_inputs,
    check_namespace,
    check_page_size,
    check_token_ids,
)
from radixspec.spec.errors import (
    CacheBusyError,
    DuplicateSlotError,
    EvictionError,
    InvalidInputError,
    InvalidTypeError,
    MisalignedPageError,
    OutOfPagesError,
    StaleHandleError,
    StorageOfflineError,
    UnlockError,
)
from radixspec.spec.helpers import is_page_run
from radixspec.spec.prefix_cache import PageKey, compute_page_prefixes

# what a page holds: (namespace, the tokens of its prefix, the reset epoch it was written in)
Content = tuple[Namespace, tuple[int, ...], int]


class TieredNode:
    """A run of whole pages (``key``) with the same copies and counts."""

    def __init__(
        self, page_size: int, key: list[int], value: list[int] | None, host_value: list[int] | None, stamp: int
    ) -> None:
        self.page_size = page_size
        self.parent: TieredNode | None = None
        # a root's namespace
        self.namespace: Namespace = None
        self.children: dict[tuple[int, ...], TieredNode] = {}
        self.key = key
        self.value = value
        self.host_value = host_value
        self.last_access = stamp
        self.device_since = stamp
        # requests' locks on device paths through it
        self.lock_ref = 0
        # in-flight transfers reading its host pages
        self.host_ref = 0
        # in-flight transfers moving its pages, or whose pages hang under it
        self.pins = 0
        self.hits = 0
        # set when it leaves the tree: handles on it are stale
        self.detached = False

    def split(self, tokens: int) -> TieredNode:
        """Cut the node after its first ``tokens`` tokens: a new node holds them, this one keeps the rest (so a
        handle on it stays valid). Both keep the node's stamps and counts. Returns the new upper node."""
        pages = tokens // self.page_size
        upper = TieredNode(
            self.page_size,
            self.key[:tokens],
            None if self.value is None else self.value[:pages],
            None if self.host_value is None else self.host_value[:pages],
            self.last_access,
        )
        for name in ("device_since", "lock_ref", "host_ref", "pins", "hits"):
            setattr(upper, name, getattr(self, name))
        parent = self.parent
        assert parent is not None, "the root is never split"
        parent.children[self.first_page()] = upper
        upper.parent = parent
        self.key = self.key[tokens:]
        self.value = None if self.value is None else self.value[pages:]
        self.host_value = None if self.host_value is None else self.host_value[pages:]
        upper.children[self.first_page()] = self
        self.parent = upper
        return upper

    def first_page(self) -> tuple[int, ...]:
        """Its key among its parent's children."""
        return tuple(self.key[: self.page_size])

    @property
    def pages(self) -> int:
        return len(self.key) // self.page_size


class TieredHandle:
    """A device path: the node it ends at, its tokens, and the tick it was made at (a page whose device copy is
    newer, or gone, makes it stale)."""

    def __init__(self, node: TieredNode, namespace: Namespace, cached_len: int, made_at: int) -> None:
        self.node, self.namespace, self.cached_len, self.made_at = node, namespace, cached_len, made_at


@dataclass(frozen=True)
class QueuedTransfer:
    """An entry of the controller's queue: pages ``pages`` (indices) of the path ``tokens`` in ``namespace``."""

    kind: st.TransferKind
    namespace: Namespace
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    source: tuple[int, ...]
    destination: tuple[int, ...]


class TieredRadixCache:
    """The tiered cache of ``spec/tiers.py`` as a radix tree with a host pool and a controller's queue."""

    def __init__(
        self,
        page_size: int,
        device_pages: int,
        host_pages: int,
        storage_pages: int = 0,
        policy: st.WritePolicy = "write_through",
        threshold: int = 2,
    ) -> None:
        # the spec's guards on the configuration, in its words
        st.new_state(page_size, device_pages, host_pages, storage_pages, policy, threshold)
        p = self.page_size = check_page_size(page_size)
        self.device_pages, self.host_pages, self.storage_pages = device_pages, host_pages, storage_pages
        self.policy, self.threshold = policy, threshold
        self.roots: dict[Namespace, TieredNode] = {}
        self.device_free = [page * p for page in range(device_pages)]
        self.host_free = [page * p for page in range(host_pages)]
        self.private: set[int] = set()
        # the pools: what each page holds (None: never written)
        self.device_pool: list[Content | None] = [None] * device_pages
        self.host_pool: list[Content | None] = [None] * host_pages
        self.storage: dict[tuple[Namespace, tuple[int, ...]], Content] = {}
        # the controller's queue: transfers in flight by id
        self.queue: dict[int, QueuedTransfer] = {}
        self.next_transfer = 0
        self.clock = 0
        self.epoch = 0
        self.dropped_unbacked = 0
        self.storage_online = True

    # ------------------------------------------------------------ operations

    def match_prefix(self, input_ids: Sequence[int], namespace: Namespace = None) -> st.TieredMatch[TieredHandle]:
        """The device, host and storage hits; stamps the tree's pages up to the host hit and counts their hits;
        under write_through_selective, backs up the device pages that reached the threshold."""
        # CHECK
        tokens = check_token_ids(input_ids)
        namespace = check_namespace(namespace)
        # WALK
        path = self._walk(namespace, tokens)
        device, host = self._runs(path)
        stored = self._stored_run(namespace, tokens, host)
        # UPDATE
        t = self._tick()
        for node in self._nodes_between(path, 0, host):
            node.last_access, node.hits = t, node.hits + 1
        if self.policy == "write_through_selective":
            hot = [page for page in range(device) if self._node_at(path, page).hits >= self.threshold]
            self._start_backups(namespace, tokens, hot)
        p = self.page_size
        return st.TieredMatch(self._handle(namespace, path, device, t), device * p, host * p, stored * p)

    def insert_prefix(
        self, input_ids: Sequence[int], indices: Sequence[int], namespace: Namespace = None
    ) -> st.TieredInsertResult[TieredHandle]:
        """Cache the whole pages on the device with the caller's pages (spec: insert_prefix)."""
        # CHECK
        tokens, slots, namespace = check_insert_inputs(input_ids, indices, namespace)
        p = self.page_size
        whole = len(tokens) // p
        path = self._walk(namespace, tokens)
        cached, _ = self._runs(path)
        loading = self._moving(namespace, tokens, "load_back")
        end = next((page for page in range(cached, whole) if page in loading), whole)
        starts: list[int] = []
        for page in range(cached, end):
            run = slots[page * p : (page + 1) * p]
            if not is_page_run(run, p):
                raise MisalignedPageError.not_a_run(page, list(run), p)
            if run[0] not in self.private or run[0] in starts:
                raise DuplicateSlotError(f"page {page} takes slot {run[0]}, which the caller does not hold")
            starts.append(run[0])
        # UPDATE
        t = self._tick()
        for node in self._nodes_between(path, 0, cached):
            node.last_access = t
        in_tree = min(end, self._pages(path))
        for node in self._align(namespace, tokens, range(cached, in_tree)):
            first = self._first_page_of(node)
            node.value = starts[first - cached : first - cached + node.pages]
            node.device_since = node.last_access = t
        if end > in_tree:
            parent = path[-1] if path else self._root(namespace)
            node = TieredNode(p, list(tokens[in_tree * p : end * p]), starts[in_tree - cached :], None, t)
            self._attach(parent, node)
        for page, start in zip(range(cached, end), starts, strict=True):
            self.private.discard(start)
            self.device_pool[start // p] = (namespace, tuple(tokens[: (page + 1) * p]), self.epoch)
        if self.policy == "write_through":
            self._start_backups(namespace, tokens, list(range(cached, end)))
        return st.TieredInsertResult(
            cached * p, self._handle(namespace, self._walk(namespace, tokens[: end * p]), end, t)
        )

    def lock(self, handle: object) -> None:
        """One lock more on every node of the handle's device path."""
        # CHECK
        checked = self._check_handle(handle)
        # UPDATE
        for node in self._path_up(checked.node):
            node.lock_ref += 1

    def unlock(self, handle: object) -> None:
        """One lock less on every node of the handle's path; refused unless each holds one."""
        # CHECK
        checked = self._check_handle(handle)
        if checked.cached_len and checked.node.lock_ref == 0:
            raise UnlockError.no_lock_ends_here(checked.cached_len)
        # UPDATE
        for node in self._path_up(checked.node):
            node.lock_ref -= 1

    def allocate(self, num_pages: int) -> list[int]:
        """Device pages for the caller, evicting for what the free list lacks (spec: allocate)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        keep = self._fetching()
        evictable = self._device_evictable(keep)
        if len(self.device_free) + evictable < num_pages:
            raise OutOfPagesError(
                f"{num_pages} device pages asked, {len(self.device_free)} free and {evictable} evictable"
            )
        # UPDATE
        self._evict_device(num_pages - len(self.device_free), keep)
        taken, self.device_free = self.device_free[:num_pages], self.device_free[num_pages:]
        self.private.update(taken)
        return taken

    def free(self, pages: Sequence[int]) -> None:
        """The caller gives back device pages it holds."""
        # CHECK
        starts = st.check_pages_held(pages, self.private)
        # UPDATE
        self.private.difference_update(starts)
        self.device_free.extend(starts)

    def evict_device(self, num_pages: int) -> list[int]:
        """Evict exactly ``num_pages`` device copies, least recently used first (spec: evict_device)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        keep = self._fetching()
        evictable = self._device_evictable(keep)
        if evictable < num_pages:
            raise EvictionError(f"cannot evict {num_pages} device pages: {evictable} evictable")
        # UPDATE
        return sorted(self._evict_device(num_pages, keep))

    def evict_host(self, num_pages: int) -> list[int]:
        """Evict exactly ``num_pages`` host copies of pages off the device (spec: evict_host)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        evictable = self._host_evictable(set())
        if evictable < num_pages:
            raise EvictionError(f"cannot evict {num_pages} host pages: {evictable} evictable")
        # UPDATE
        return sorted(self._evict_host(num_pages, set()))

    def write_back(self, num_pages: int) -> list[int]:
        """Back up the unlocked device leaves without a host copy, least recently used first (spec: write_back)."""
        # CHECK
        st.check_count("num_pages", num_pages)
        # WALK
        fetching = self._fetching()
        leaves = [
            node
            for node in self._nodes()
            if node not in fetching
            and node.value is not None
            and node.host_value is None
            and node.lock_ref == 0
            and node.pins == 0
            and not any(child.value is not None for child in node.children.values())
        ]
        leaves.sort(key=lambda node: (node.last_access, self._depth(node)))
        # UPDATE: one transfer a page, each the last page of its leaf
        started = []
        for node in leaves[:num_pages]:
            namespace, tokens = self._path_tokens(node)
            number = self._start_backup_run(namespace, tokens, [len(tokens) // self.page_size - 1])
            if number is not None:
                started.append(number)
        return started

    def load_back(self, input_ids: Sequence[int], namespace: Namespace = None) -> int | None:
        """Start loading the host hit past the device hit back to the device (spec: load_back)."""
        # CHECK
        tokens = check_token_ids(input_ids)
        namespace = check_namespace(namespace)
        path = self._walk(namespace, tokens)
        device, host = self._runs(path)
        loading = self._moving(namespace, tokens, "load_back")
        end = next((page for page in range(device, host) if page in loading), host)
        if end == device:
            return None
        keep = set(self._nodes_between(path, 0, device)) | self._fetching()
        evictable = self._device_evictable(keep)
        need = end - device
        if len(self.device_free) + evictable < need:
            raise OutOfPagesError(f"loading {need} pages back: {len(self.device_free)} free, {evictable} evictable")
        # UPDATE
        self._evict_device(need - len(self.device_free), keep)
        destination, self.device_free = self.device_free[:need], self.device_free[need:]
        pages = list(range(device, end))
        source = self._read_host(self._align(namespace, tokens, pages))
        return self._enqueue("load_back", namespace, tokens, pages, source, tuple(destination))

    def prefetch(self, input_ids: Sequence[int], namespace: Namespace = None) -> int | None:
        """Start bringing the storage hit past the host hit into the host tier (spec: prefetch)."""
        # CHECK
        tokens = check_token_ids(input_ids)
        namespace = check_namespace(namespace)
        path = self._walk(namespace, tokens)
        _, host = self._runs(path)
        stored = self._stored_run(namespace, tokens, host)
        fetching = self._moving(namespace, tokens, "prefetch")
        end = next((page for page in range(host, stored) if page in fetching), stored)
        # UPDATE
        keep = set(self._nodes_between(path, 0, host))
        return self._start_host_run("prefetch", namespace, tokens, list(range(host, end)), (), keep)

    def complete_transfer(self, transfer_id: int) -> None:
        """The executor finished the transfer (spec: complete_transfer)."""
        # CHECK
        transfer = self._check_transfer(transfer_id)
        if "storage" in st.ROUTES[transfer.kind] and not self.storage_online:
            raise StorageOfflineError(f"transfer {transfer_id} ({transfer.kind}) cannot complete: storage is offline")
        # UPDATE
        del self.queue[transfer_id]
        p, namespace, tokens = self.page_size, transfer.namespace, transfer.tokens
        nodes = self._release(transfer)
        if transfer.kind == "prefetch":
            self._attach_fetched(transfer)
        if transfer.kind == "backup":
            for node in nodes:
                node.host_value = self._slice(transfer, node, transfer.destination)
            for source, destination in zip(transfer.source, transfer.destination, strict=True):
                self.host_pool[destination // p] = self.device_pool[source // p]
            self._start_store(namespace, tokens, list(transfer.pages))
        elif transfer.kind == "load_back":
            t = self._tick()
            for node in nodes:
                node.value = self._slice(transfer, node, transfer.destination)
                node.device_since = t
            for source, destination in zip(transfer.source, transfer.destination, strict=True):
                self.device_pool[destination // p] = self.host_pool[source // p]
        elif transfer.kind == "store":
            for page, source in zip(transfer.pages, transfer.source, strict=True):
                content = self.host_pool[source // p]
                assert content is not None
                self.storage[namespace, tuple(tokens[: (page + 1) * p])] = content

    def fail_transfer(self, transfer_id: int) -> None:
        """The executor gave the transfer up: its destination pages go back, no copy is made."""
        # CHECK
        transfer = self._check_transfer(transfer_id)
        # UPDATE
        del self.queue[transfer_id]
        self._release(transfer)
        destination = st.ROUTES[transfer.kind][1]
        if destination == "device":
            self.device_free.extend(transfer.destination)
        elif destination == "host":
            self.host_free.extend(transfer.destination)

    def set_storage_online(self, online: bool) -> None:
        """Storage goes offline or comes back, its copies kept (spec: set_storage_online)."""
        # CHECK
        if not isinstance(online, bool):
            raise InvalidTypeError(f"online must be a bool, got {type(online).__name__}")
        # UPDATE
        self.storage_online = online

    def reset(self) -> None:
        """Empty every tier (spec: reset); refused under locks and transfers."""
        # CHECK
        locked = sum(node.pages for node in self._nodes() if node.lock_ref)
        if locked or self.queue:
            raise CacheBusyError(f"reset refused: {locked} pages locked, {len(self.queue)} transfers in flight")
        # UPDATE
        nodes = list(self._nodes())
        self.device_free += sorted(start for node in nodes for start in node.value or [])
        self.host_free += sorted(start for node in nodes for start in node.host_value or [])
        for node in nodes:
            node.detached = True
        self.roots.clear()
        self.storage.clear()
        self.epoch += 1

    # ------------------------------------------------------------ the spec's view

    def abstract_state(self) -> st.TieredState:
        """The state as spec/tiers.py keeps it: a page per key."""
        p = self.page_size
        state = st.TieredState(
            page_size=p,
            device_pages=self.device_pages,
            host_pages=self.host_pages,
            storage_pages=self.storage_pages,
            policy=self.policy,
            threshold=self.threshold,
            device_free=list(self.device_free),
            host_free=list(self.host_free),
            private=set(self.private),
            next_transfer=self.next_transfer,
            clock=self.clock,
            epoch=self.epoch,
            dropped_unbacked=self.dropped_unbacked,
            storage_online=self.storage_online,
        )
        for node in self._nodes():
            namespace, tokens = self._path_tokens(node)
            first = len(tokens) // p - node.pages
            for index, prefix in enumerate(compute_page_prefixes(tokens, p)[first:]):
                state.entries[namespace, prefix] = st.TieredEntry(
                    device=None if node.value is None else node.value[index],
                    host=None if node.host_value is None else node.host_value[index],
                    last_access=node.last_access,
                    device_since=node.device_since,
                    ref_count=node.lock_ref,
                    host_locks=node.host_ref,
                    hits=node.hits,
                )
        for (namespace, tokens), content in self.storage.items():
            state.storage[namespace, compute_page_prefixes(tokens, p)[-1]] = written(content, p)
        state.device_kv = {page * p: written(c, p) for page, c in enumerate(self.device_pool) if c is not None}
        state.host_kv = {page * p: written(c, p) for page, c in enumerate(self.host_pool) if c is not None}
        for number, transfer in self.queue.items():
            prefixes = compute_page_prefixes(transfer.tokens, p)
            keys = tuple((transfer.namespace, prefixes[page]) for page in transfer.pages)
            state.transfers[number] = st.Transfer(transfer.kind, keys, transfer.source, transfer.destination)
        return state

    def check_integrity(self) -> None:
        """Every law of spec/tiers.py on the abstract state (IntegrityError naming the broken one)."""
        st.check_tiered_invariants(self.abstract_state())

    # ------------------------------------------------------------ the tree

    def _tick(self) -> int:
        t = self.clock
        self.clock += 1
        return t

    def _root(self, namespace: Namespace) -> TieredNode:
        if namespace not in self.roots:
            self.roots[namespace] = TieredNode(self.page_size, [], [], [], 0)
            self.roots[namespace].namespace = namespace
        return self.roots[namespace]

    def _attach(self, parent: TieredNode, node: TieredNode) -> None:
        node.parent = parent
        parent.children[node.first_page()] = node

    def _walk(self, namespace: Namespace, tokens: Sequence[int]) -> list[TieredNode]:
        """The nodes along the whole pages of ``tokens`` present in the tree, the last one split where the
        tokens' pages end inside it (a split changes nothing the spec sees)."""
        p = self.page_size
        root = self.roots.get(namespace)
        path: list[TieredNode] = []
        if root is None:
            return path
        node, at, whole = root, 0, len(tokens) // p * p
        while at < whole:
            child = node.children.get(tuple(tokens[at : at + p]))
            if child is None:
                break
            same = 0
            while (
                same < len(child.key)
                and at + same < whole
                and child.key[same : same + p] == list(tokens[at + same : at + same + p])
            ):
                same += p
            if same < len(child.key):
                child = child.split(same)
            path.append(child)
            node, at = child, at + same
            if same < len(node.key):
                break
        return path

    def _pages(self, path: list[TieredNode]) -> int:
        return sum(len(node.key) for node in path) // self.page_size

    def _runs(self, path: list[TieredNode]) -> tuple[int, int]:
        """Pages from the first with a device copy, then with a device or a host copy (the device copies are
        prefix-closed: the host run goes on where the device run ends)."""
        device = host = 0
        for node in path:
            on_device = node.value is not None and device == host
            if not on_device and node.host_value is None:
                break
            device += node.pages if on_device else 0
            host += node.pages
        return device, host

    def _stored_run(self, namespace: Namespace, tokens: Sequence[int], start: int) -> int:
        """The end of the run of pages from ``start`` that storage holds (none while it is offline)."""
        p, page = self.page_size, start
        if not self.storage_online:
            return page
        while (page + 1) * p <= len(tokens) and (namespace, tuple(tokens[: (page + 1) * p])) in self.storage:
            page += 1
        return page

    def _nodes_between(self, path: list[TieredNode], first: int, end: int) -> list[TieredNode]:
        """The nodes of ``path`` holding pages [first, end) (their bounds on node bounds)."""
        found, at = [], 0
        for node in path:
            pages = node.pages
            if first <= at and at + pages <= end and pages:
                found.append(node)
            at += pages
        return found

    def _node_at(self, path: list[TieredNode], page: int) -> TieredNode:
        at = 0
        for node in path:
            at += node.pages
            if page < at:
                return node
        raise AssertionError(f"page {page} is past the path")

    def _first_page_of(self, node: TieredNode) -> int:
        return sum(len(up.key) for up in self._path_up(node.parent)) // self.page_size if node.parent else 0

    def _align(self, namespace: Namespace, tokens: Sequence[int], pages: Sequence[int]) -> list[TieredNode]:
        """The nodes holding ``pages`` of the path, each wholly inside them: nodes split at every bound of a run
        of consecutive pages."""
        p = self.page_size
        nodes: list[TieredNode] = []
        for first, end in runs_of(pages):
            self._walk(namespace, tokens[: first * p])
            path = self._walk(namespace, tokens[: end * p])
            nodes += self._nodes_between(path, first, end)
        return nodes

    def _path_up(self, node: TieredNode | None) -> Iterator[TieredNode]:
        """``node`` and its ancestors below the root."""
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    def _depth(self, node: TieredNode) -> int:
        return sum(len(up.key) for up in self._path_up(node))

    def _path_tokens(self, node: TieredNode) -> tuple[Namespace, tuple[int, ...]]:
        ups = list(self._path_up(node))
        root = ups[-1].parent if ups else node
        assert root is not None
        tokens: list[int] = []
        for up in reversed(ups):
            tokens += up.key
        return root.namespace, tuple(tokens)

    def _nodes(self) -> Iterator[TieredNode]:
        """Every node below the roots, parents before children."""
        for root in list(self.roots.values()):
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack += node.children.values()

    def _detach(self, node: TieredNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.first_page()]
        node.detached = True

    def _handle(self, namespace: Namespace, path: list[TieredNode], pages: int, t: int) -> TieredHandle:
        nodes = self._nodes_between(path, 0, pages)
        node = nodes[-1] if nodes else self._root(namespace)
        return TieredHandle(node, namespace, pages * self.page_size, t)

    def _check_handle(self, handle: object) -> TieredHandle:
        if not isinstance(handle, TieredHandle):
            raise InvalidTypeError(f"expected a reference TieredHandle, got {type(handle).__name__}")
        for node in self._path_up(handle.node):
            if node.detached or node.value is None or node.device_since > handle.made_at:
                raise StaleHandleError(f"a page of the handle's {handle.cached_len} tokens left the device")
        if handle.node.detached:
            raise StaleHandleError(f"a page of the handle's {handle.cached_len} tokens left the device")
        return handle

    # ------------------------------------------------------------ eviction

    def _device_evictable(self, keep: set[TieredNode]) -> int:
        """Device pages eviction could take, one after another (a node's pages once its device children went)."""
        cleared: dict[TieredNode, bool] = {}
        gone: dict[TieredNode, bool] = {}
        count = 0
        for node in reversed(list(self._nodes())):
            children = list(node.children.values())
            evictable = (
                node.value is not None
                and node.lock_ref == 0
                and node.pins == 0
                and node not in keep
                and all(cleared[child] for child in children)
                and (node.host_value is not None or (self._may_drop() and all(gone[c] for c in children)))
            )
            count += node.pages if evictable else 0
            cleared[node] = (node.value is None or evictable) and all(cleared[child] for child in children)
            gone[node] = evictable and node.host_value is None and all(gone[child] for child in children)
        return count

    def _evict_device(self, num_pages: int, keep: set[TieredNode]) -> list[int]:
        """Evict ``num_pages`` device pages (known to be evictable), one at a time, the least recently used."""
        freed = []
        for _ in range(max(0, num_pages)):
            node = min(
                (n for n in self._nodes() if self._is_device_leaf(n, keep)),
                key=lambda n: (n.last_access, self._depth(n)),
            )
            if len(node.key) > self.page_size:
                node.split(len(node.key) - self.page_size)
            assert node.value is not None
            freed.append(node.value[0])
            if node.host_value is not None:
                node.value = None
            else:
                namespace, tokens = self._path_tokens(node)
                self.dropped_unbacked += (namespace, tokens) not in self.storage
                self._detach(node)
        self.device_free.extend(freed)
        return freed

    def _may_drop(self) -> bool:
        """Whether a device page with no copy elsewhere may leave the tree (write-back never lets one)."""
        return self.policy != "write_back"

    def _is_device_leaf(self, node: TieredNode, keep: set[TieredNode]) -> bool:
        return (
            node.value is not None
            and node.lock_ref == 0
            and node.pins == 0
            and node not in keep
            and not any(child.value is not None for child in node.children.values())
            and (node.host_value is not None or (self._may_drop() and not node.children))
        )

    def _host_evictable(self, keep: set[TieredNode]) -> int:
        removable: dict[TieredNode, bool] = {}
        count = 0
        for node in reversed(list(self._nodes())):
            removable[node] = (
                node.host_value is not None
                and node.value is None
                and node.host_ref == 0
                and node.pins == 0
                and node not in keep
                and all(removable[child] for child in node.children.values())
            )
            count += node.pages if removable[node] else 0
        return count

    def _evict_host(self, num_pages: int, keep: set[TieredNode]) -> list[int]:
        freed = []
        for _ in range(max(0, num_pages)):
            node = min(
                (
                    n
                    for n in self._nodes()
                    if n.host_value is not None
                    and n.value is None
                    and n.host_ref == 0
                    and n.pins == 0
                    and n not in keep
                    and not n.children
                ),
                key=lambda n: (n.last_access, self._depth(n)),
            )
            if len(node.key) > self.page_size:
                node.split(len(node.key) - self.page_size)
            assert node.host_value is not None
            freed.append(node.host_value[0])
            self._detach(node)
        self.host_free.extend(freed)
        return freed

    # ------------------------------------------------------------ the controller

    def _moving(self, namespace: Namespace, tokens: Sequence[int], kind: st.TransferKind) -> set[int]:
        """Pages of this path that an in-flight transfer of ``kind`` moves."""
        p = self.page_size
        found = set()
        for transfer in self.queue.values():
            if transfer.kind == kind and transfer.namespace == namespace:
                for page in transfer.pages:
                    end = (page + 1) * p
                    if end <= len(tokens) and tuple(tokens[:end]) == transfer.tokens[:end]:
                        found.add(page)
        return found

    def _moving_anywhere(self, kinds: Sequence[st.TransferKind]) -> set[tuple[Namespace, tuple[int, ...]]]:
        p = self.page_size
        return {
            (transfer.namespace, transfer.tokens[: (page + 1) * p])
            for transfer in self.queue.values()
            if transfer.kind in kinds
            for page in transfer.pages
        }

    def _enqueue(
        self,
        kind: st.TransferKind,
        namespace: Namespace,
        tokens: Sequence[int],
        pages: Sequence[int],
        source: tuple[int, ...],
        destination: tuple[int, ...],
    ) -> int:
        """Queue a transfer and pin what it moves and what it hangs under."""
        p = self.page_size
        path_tokens = tuple(tokens[: (pages[-1] + 1) * p])
        nodes = self._align(namespace, path_tokens, pages) if kind != "prefetch" else []
        for node in [*nodes, *self._parent_of(namespace, path_tokens, pages[0])]:
            node.pins += 1
        number = self.next_transfer
        self.next_transfer += 1
        self.queue[number] = QueuedTransfer(kind, namespace, path_tokens, tuple(pages), source, destination)
        return number

    def _fetching(self) -> set[TieredNode]:
        """Nodes whose pages a request cached while a prefetch brings them in: they stay until it ends (the
        prefetch pinned no node: its pages were not in the tree when it started)."""
        nodes: set[TieredNode] = set()
        for transfer in self.queue.values():
            if transfer.kind == "prefetch":
                in_tree = self._pages(self._walk(transfer.namespace, transfer.tokens))
                nodes.update(self._align(transfer.namespace, transfer.tokens, range(transfer.pages[0], in_tree)))
        return nodes

    def _parent_of(self, namespace: Namespace, tokens: Sequence[int], page: int) -> list[TieredNode]:
        """The one-page node holding the page before ``page`` (split out, so that no later split halves a pin on
        it), or none for a first page."""
        return [] if page == 0 else self._align(namespace, tokens, [page - 1])

    def _release(self, transfer: QueuedTransfer) -> list[TieredNode]:
        """Unpin what the transfer pinned (and its host reads); the nodes holding its pages (none for a prefetch:
        its pages are not in the tree)."""
        fetched = transfer.kind == "prefetch"
        nodes = [] if fetched else self._align(transfer.namespace, transfer.tokens, transfer.pages)
        for node in [*nodes, *self._parent_of(transfer.namespace, transfer.tokens, transfer.pages[0])]:
            node.pins -= 1
        if st.ROUTES[transfer.kind][0] == "host":
            for node in nodes:
                node.host_ref -= 1
        return nodes

    def _slice(self, transfer: QueuedTransfer, node: TieredNode, pages: tuple[int, ...]) -> list[int]:
        first = self._first_page_of(node)
        index = transfer.pages.index(first)
        return list(pages[index : index + node.pages])

    def _attach_fetched(self, transfer: QueuedTransfer) -> None:
        """A completed prefetch: pages a request cached meanwhile get the fetched copy as their backup; the rest
        become host-only nodes under them (pinned in place by the transfer)."""
        p, t = self.page_size, self._tick()
        namespace, tokens = transfer.namespace, transfer.tokens
        path = self._walk(namespace, tokens)
        in_tree = self._pages(path)
        first = transfer.pages[0]
        for page, destination in zip(transfer.pages, transfer.destination, strict=True):
            content = self.storage[namespace, tokens[: (page + 1) * p]]
            self.host_pool[destination // p] = content
        for node in self._align(namespace, tokens, range(first, in_tree)):
            node.host_value = self._slice(transfer, node, transfer.destination)
        if in_tree < len(transfer.pages) + first:
            parent = path[-1] if path else self._root(namespace)
            fresh = TieredNode(p, list(tokens[in_tree * p :]), None, list(transfer.destination[in_tree - first :]), t)
            self._attach(parent, fresh)

    def _start_host_run(
        self,
        kind: st.TransferKind,
        namespace: Namespace,
        tokens: Sequence[int],
        pages: Sequence[int],
        source: tuple[int, ...],
        keep: set[TieredNode],
    ) -> int | None:
        """A transfer of ``pages`` into the host tier, as many (from the first) as it has room for, evicting host
        copies (none of ``keep``)."""
        if not pages:
            return None
        fits = min(len(pages), len(self.host_free) + self._host_evictable(keep))
        if not fits:
            return None
        self._evict_host(fits - len(self.host_free), keep)
        destination, self.host_free = self.host_free[:fits], self.host_free[fits:]
        return self._enqueue(kind, namespace, tokens, pages[:fits], source[:fits], tuple(destination))

    def _start_backup_run(self, namespace: Namespace, tokens: Sequence[int], pages: Sequence[int]) -> int | None:
        """The backup of ``pages`` (device pages without a host copy), as far as the host tier has room."""
        source = tuple(start for node in self._align(namespace, tokens, pages) for start in node.value or [])
        return self._start_host_run("backup", namespace, tokens, pages, source, set())

    def _start_backups(self, namespace: Namespace, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """The write policy's backups of ``pages`` (device pages of the path) with no host copy and none coming."""
        if not pages:
            return
        coming = self._moving_anywhere(("backup", "prefetch"))
        p = self.page_size
        path = self._walk(namespace, tokens[: (max(pages) + 1) * p])
        run = [
            page
            for page in pages
            if self._node_at(path, page).host_value is None
            and (namespace, tuple(tokens[: (page + 1) * p])) not in coming
        ]
        if run:
            self._start_backup_run(namespace, tokens, run)

    def _start_store(self, namespace: Namespace, tokens: Sequence[int], pages: Sequence[int]) -> None:
        if not self.storage_online:
            return
        p = self.page_size
        storing = self._moving_anywhere(("store",))
        in_flight = sum(len(t.pages) for t in self.queue.values() if t.kind == "store")
        room = self.storage_pages - len(self.storage) - in_flight
        run = [
            page
            for page in pages
            if (key := (namespace, tuple(tokens[: (page + 1) * p]))) not in self.storage and key not in storing
        ][: max(0, room)]
        if run:
            self._enqueue("store", namespace, tokens, run, self._read_host(self._align(namespace, tokens, run)), ())

    def _read_host(self, nodes: Sequence[TieredNode]) -> tuple[int, ...]:
        """The host pages of ``nodes``, each node locked for a transfer that reads it."""
        source: list[int] = []
        for node in nodes:
            assert node.host_value is not None, "a transfer reads host copies"
            node.host_ref += 1
            source += node.host_value
        return tuple(source)

    def _check_transfer(self, transfer_id: object) -> QueuedTransfer:
        if not isinstance(transfer_id, int) or isinstance(transfer_id, bool):
            raise InvalidTypeError(f"a transfer id is an int, got {type(transfer_id).__name__}")
        if transfer_id not in self.queue:
            raise InvalidInputError(f"no transfer {transfer_id} is in flight")
        return self.queue[transfer_id]


def runs_of(pages: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs of page indices (ascending) as half-open ranges."""
    found: list[tuple[int, int]] = []
    for page in pages:
        if found and found[-1][1] == page:
            found[-1] = (found[-1][0], page + 1)
        else:
            found.append((page, page + 1))
    return found


def written(content: Content, page_size: int) -> st.Written:
    namespace, tokens, epoch = content
    key: PageKey = (namespace, compute_page_prefixes(tokens, page_size)[-1])
    return st.Written(key, epoch)
