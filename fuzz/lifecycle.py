"""The laws of the request-lifecycle layer, each written once, for every manager the hybrid machine drives.

A request-lifecycle target (ours, or an engine's adapter) drives its engine's calls and shows its state through
the hybrid manager's surface: per request its rows (per group, per page, the page's first slot, or None) and its
computed tokens. From that, and from what the machine saw it do, :class:`LifecycleLaws` keeps a shadow of every
KV write (which prefix's KV each slot holds, in which group) and checks after every step:

* ``attended_pages_are_held`` (the safety law, ``spec.hybrid``): every page a live request can still attend is in
  its row, in every group;
* ``attended_pages_stay_put``: an attended page keeps its slot until the request caches it;
* ``attended_kv_is_the_requests``: every slot a live request attends holds the KV of its own tokens up to there,
  in its group (written by it, or by another request for the same prefix, or copied from such a slot);
* ``pages_are_partitioned``: each pool's free, cached and privately held pages add up to its size;
* ``cached_blocks_hold_their_prefix``: every page the engine caches under a prefix holds that prefix's KV;

the hit law (``hit_law``, called by each adapter as it matches, with what its engine caches at that moment): the
hit is the hit rule's longest valid match (``spec/hit_rules.py``), or, where an engine is known to stop short of
it (SGLang under a window), a valid match never longer;

and ``StateShadow`` holds the recurrent-state law (a state slot holds the state of the prefix it is read as).

What a target may show beyond the rows, each optional (:class:`LifecycleView`): per position slots where a page's
slots are not one run from its first (``kv_slots``), which groups share one pool (``kv_pools``), the copies its
worker made (``take_kv_copies``, a tier's between pools), the slots a copy still in flight will write
(``incoming_kv``: a request attending one waits for it), its pools' accounting (``pools``), the pages it caches
(``cached_kv``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol, cast

from radixspec.reference.hybrid_manager import HybridReq
from radixspec.spec import hit_rules as hr
from radixspec.spec import hybrid as hy
from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import IntegrityError
from radixspec.spec.helpers import align_down, div_ceil

# a slot of a pool, as one int: pool * SLOTS_PER_POOL + slot
SLOTS_PER_POOL = 1 << 40


class Pool(NamedTuple):
    """One pool's accounting, in pages: what ``pages_are_partitioned`` adds up."""

    name: str
    free: int
    cached: int
    private: int
    size: int


class CachedKV(NamedTuple):
    """A page the engine caches: its group, the prefix it is cached under (through the page's last token: its
    tokens, or the spec's interned ``Prefix`` of them, hashed in O(1)), and the slots of the page's positions that
    the prefix covers (the first of them is at ``(len(tokens) - 1) // P * P``)."""

    group: int
    namespace: Namespace
    tokens: tuple[int, ...] | pc.Prefix
    slots: Sequence[int]


class KVCopy(NamedTuple):
    """``size`` slots copied by the worker, from ``source`` on into ``target`` on, in pool ``pool`` (from pool
    ``source_pool`` where it differs: a tier's copy, host to device or back)."""

    pool: int
    source: int
    target: int
    size: int
    source_pool: int | None = None


class LifecycleView(Protocol):
    """What every request-lifecycle target shows (the hybrid manager's surface); the rest is optional."""

    windows: tuple[hy.Window, ...]
    page_size: int


class Prefixes:
    """Prefixes interned as ints: a prefix is its parent's id and its last token (a namespace is a root)."""

    __slots__ = ("children", "memo", "parents")

    def __init__(self) -> None:
        self.children: dict[tuple[int, object], int] = {}
        self.parents: list[int] = []
        self.memo: dict[tuple[Namespace, tuple[int, ...] | pc.Prefix], int] = {}

    def child(self, parent: int, token: object) -> int:
        key = (parent, token)
        found = self.children.get(key)
        if found is None:
            found = self.children[key] = len(self.parents)
            self.parents.append(parent)
        return found

    def root(self, namespace: Namespace) -> int:
        return self.child(-1, ("namespace", namespace))

    def extend(self, ids: list[int], namespace: Namespace, tokens: Sequence[int], upto: int) -> list[int]:
        """``ids[i]`` is the id of ``tokens[: i + 1]``; grown in place to ``upto`` positions."""
        parent = ids[-1] if ids else self.root(namespace)
        children, parents = self.children, self.parents
        for position in range(len(ids), upto):
            # child() inlined: a call per token was most of a campaign's time in the laws
            key = (parent, tokens[position])
            found = children.get(key)
            if found is None:
                found = children[key] = len(parents)
                parents.append(parent)
            ids.append(found)
            parent = found
        return ids

    def of(self, namespace: Namespace, tokens: tuple[int, ...] | pc.Prefix) -> int:
        """The id of ``tokens`` under ``namespace`` (remembered: an engine's cached prefixes repeat every step)."""
        key = (namespace, tokens)
        found = self.memo.get(key)
        if found is None:
            if isinstance(tokens, pc.Prefix):
                return self.of_prefix(namespace, tokens)
            found = self.extend([], namespace, tokens, len(tokens))[-1] if tokens else self.root(namespace)
            self.memo[key] = found
        return found

    def of_prefix(self, namespace: Namespace, prefix: pc.Prefix) -> int:
        """``of`` for the spec's interned prefix: from its longest parent known, a page at a time (a new cached page
        costs its own tokens, not its whole prefix's)."""
        unknown: list[pc.Prefix] = []
        node: pc.Prefix | None = prefix
        found = None
        while node is not None and (found := self.memo.get((namespace, node))) is None:
            unknown.append(node)
            node = node.parent
        found = self.root(namespace) if found is None else found
        for page in reversed(unknown):
            for token in page.page:
                found = self.child(found, token)
            self.memo[(namespace, page)] = found
        return found


class StateShadow:
    """Which prefix's recurrent state each state slot holds, as the target saw its worker write and copy them."""

    __slots__ = ("states",)

    def __init__(self) -> None:
        self.states: dict[int, tuple[Namespace, tuple[int, ...]]] = {}

    def write(self, slot: int, namespace: Namespace, tokens: tuple[int, ...]) -> None:
        self.states[slot] = (namespace, tokens)

    def clear(self, slot: int) -> None:
        self.states.pop(slot, None)

    def copy(self, source: int, target: int) -> None:
        if source in self.states:
            self.states[target] = self.states[source]
        else:
            self.states.pop(target, None)

    def get(self, slot: int) -> tuple[Namespace, tuple[int, ...]] | None:
        return self.states.get(slot)

    def expect(self, law: str, who: str, slot: int, namespace: Namespace, tokens: tuple[int, ...]) -> None:
        """``slot`` holds the state of ``tokens`` under ``namespace``, else ``law`` is broken (``who`` reads it)."""
        held = self.states.get(slot)
        if held != (namespace, tokens):
            other = held is not None and len(held[1]) == len(tokens) and held[0] == namespace
            what = "no state" if held is None else f"the state of {'another prefix of ' * other}{len(held[1])} tokens"
            what += "" if held is None or held[0] == namespace else f" in {held[0]!r}"
            raise IntegrityError(
                f"{law}: {who} reads state slot {slot}, which holds {what}, not the state of its first {len(tokens)}"
                " tokens"
            )


class LifecycleLaws:
    """The laws above for one manager (one tree core of it), with the KV shadow the machine keeps for it."""

    def __init__(self, view: LifecycleView, label: str = "") -> None:
        self.view, self.label = view, label
        self.windows, self.page_size = view.windows, view.page_size
        groups = range(len(self.windows))
        self.kv_groups = [g for g in groups if self.windows[g] != hy.STATE]
        self.pool_of: Sequence[int] = getattr(view, "kv_pools", None) or tuple(groups)
        # (pool, slot) -> (group, prefix id): whose KV the slot holds
        self.shadow: dict[int, tuple[int, int]] = {}
        self.prefixes = Prefixes()
        self.ids: dict[int, list[int]] = {}
        # per live request, the slots of the pages it attends, as last seen: they change only in cache_req
        self.attended: dict[int, dict[tuple[int, int], int]] = {}
        # per live request, its computed tokens and per group the slot of each position, when its KV was last
        # found its own; and the shadow's slots written since the last check: a position checked then, whose slot
        # is the same and was not written since, holds what it held (the check reads only the others)
        self.verified: dict[int, tuple[int, list[list[int | None]]]] = {}
        self.written: set[int] = set()
        # the cached whole pages found holding their prefix at the last check, as (group, prefix id, pool, first
        # slot): one cached still, none of whose slots was written since, holds it still (the check skips it)
        self.verified_pages: set[tuple[int, int, int, int]] = set()

    def fail(self, law: str, problem: str) -> IntegrityError:
        return IntegrityError(f"{self.label}{law}: {problem}")

    # ------------------------------------------------------------ what the machine saw

    def slots(self, req: HybridReq) -> list[Sequence[int | None]]:
        """Per group, per position of the request's rows, its slot (None where the page is not held)."""
        shown = getattr(self.view, "kv_slots", None)
        if shown is not None:
            slots: list[Sequence[int | None]] = shown(req)
            return slots
        p = self.page_size
        return [[None if start is None else start + offset for start in row for offset in range(p)] for row in req.rows]

    def stored(self, req: HybridReq, begin: int, slots: list[Sequence[int | None]]) -> None:
        """The request's KV of positions ``[begin, req.computed)`` was written to ``slots`` (read before the call)."""
        ids = self.prefixes.extend(self.ids.setdefault(req.uid, []), req.namespace, req.input_ids, req.computed)
        for group in self.kv_groups:
            base, row = self.pool_of[group] * SLOTS_PER_POOL, slots[group]
            for position in range(begin, min(req.computed, len(row))):
                slot = row[position]
                if slot is not None:
                    self.shadow[base + slot] = (group, ids[position])
                    self.written.add(base + slot)

    def copied(self) -> None:
        """The copies the target's worker made since last asked (vLLM's copy-on-write of a partial hit)."""
        take = getattr(self.view, "take_kv_copies", None)
        if take is None:
            return
        copies: list[KVCopy] = take()
        for pool, source, target, size, source_pool in copies:
            base = pool * SLOTS_PER_POOL
            source_base = base if source_pool is None else source_pool * SLOTS_PER_POOL
            for offset in range(size):
                self.written.add(base + target + offset)
                held = self.shadow.get(source_base + source + offset)
                if held is None:
                    self.shadow.pop(base + target + offset, None)
                else:
                    self.shadow[base + target + offset] = held

    def finished(self, uid: int, cached: bool) -> None:
        """``cache_req``: the request's attended slots may move; a finished request is forgotten."""
        self.attended.pop(uid, None)
        self.verified.pop(uid, None)
        if cached:
            self.ids.pop(uid, None)

    # ------------------------------------------------------------ the laws

    def check(self, live_reqs: Sequence[HybridReq]) -> None:
        """Every law, in order: the safety law first (a freed page is named as such, not by what it holds)."""
        problem = hy.attended_pages_are_held(
            self.windows, self.page_size, {req.uid: (req.computed, req.rows) for req in live_reqs}
        )
        if problem is not None:
            raise self.fail("attended_pages_are_held", problem)
        for req in live_reqs:
            self.attended_pages_stay_put(req)
            self.attended_kv_is_the_requests(req)
        pools = getattr(self.view, "pools", None)
        if pools is not None:
            self.pages_are_partitioned(pools(list(live_reqs)))
        cached = getattr(self.view, "cached_kv", None)
        if cached is not None:
            self.cached_blocks_hold_their_prefix(cached())
        self.written.clear()

    def attended_pages_stay_put(self, req: HybridReq) -> None:
        now = {
            (group, page): start
            for group, (window, row) in enumerate(zip(self.windows, req.rows, strict=True))
            for page in hy.compute_used_pages(req.computed, window, self.page_size)
            if (start := row[page]) is not None
        }
        seen = self.attended.get(req.uid, {})
        moved = [key for key in now.keys() & seen.keys() if now[key] != seen[key]]
        if moved:
            raise self.fail(
                "attended_pages_stay_put",
                f"request {req.uid}: attended page {moved[0]} moved from slot {seen[moved[0]]} to {now[moved[0]]}",
            )
        self.attended[req.uid] = now

    def attended_kv_is_the_requests(self, req: HybridReq) -> None:
        ids = self.prefixes.extend(self.ids.setdefault(req.uid, []), req.namespace, req.input_ids, req.computed)
        slots, p = self.slots(req), self.page_size
        # slots a copy still in flight will write (a tier's load): the request's forward waits for it
        incoming: set[int] = getattr(self.view, "incoming_kv", set)()
        seen = None if incoming else self.verified.get(req.uid)
        for group in self.kv_groups:
            base, row = self.pool_of[group] * SLOTS_PER_POOL, slots[group]
            used = hy.compute_used_pages(req.computed, self.windows[group], p)
            begin, end = used.start * p, min(req.computed, used.stop * p)
            positions: Iterable[int] = range(begin, end)
            if seen is not None:
                # checked before up to ``upto``, each position's slot the same: only those written since, and the new
                upto = min(seen[0], end)
                if begin < upto and list(row[begin:upto]) == seen[1][group][begin:upto]:
                    written = {key - base for key in self.written if base <= key < base + SLOTS_PER_POOL}
                    again = written.intersection(row[begin:upto])
                    positions = [*(i for i in range(begin, upto) if row[i] in again), *range(upto, end)]
            for position in positions:
                slot = row[position] if position < len(row) else None
                if incoming and slot is not None and base + slot in incoming:
                    continue
                held = None if slot is None else self.shadow.get(base + slot)
                if held != (group, ids[position]):
                    raise self.fail(
                        "attended_kv_is_the_requests",
                        f"request {req.uid} attends group {group} slot {slot} for position {position}, which"
                        f" holds {self.describe(held, group)}",
                    )
        if incoming:
            self.verified.pop(req.uid, None)
        else:
            self.verified[req.uid] = (req.computed, [list(row) for row in slots])

    def pages_are_partitioned(self, pools: Iterable[Pool]) -> None:
        for name, free, cached, private, size in pools:
            if free + cached + private != size:
                raise self.fail(
                    f"{name} pages_are_partitioned", f"free {free} + cached {cached} + private {private} != {size}"
                )

    def cached_blocks_hold_their_prefix(self, pages: Iterable[CachedKV]) -> None:
        """Every cached page holds its prefix's KV, in its group (a stale hash on a block written since). A whole
        page (one aligned run of P slots) found so at the last check, none of its slots written since, is not read
        again."""
        p = self.page_size
        # the pages (pool, first slot // P) the shadow wrote since the last check
        touched = {(key // SLOTS_PER_POOL, key % SLOTS_PER_POOL // p) for key in self.written}
        verified: set[tuple[int, int, int, int]] = set()
        for group, namespace, tokens, slots in pages:
            pool = self.pool_of[group]
            base = pool * SLOTS_PER_POOL
            prefix = self.prefixes.of(namespace, tokens)
            whole = isinstance(slots, range) and slots.step == 1 and len(slots) == p and slots.start % p == 0
            if whole:
                page = (group, prefix, pool, slots[0])
                verified.add(page)
                if page in self.verified_pages and (pool, slots[0] // p) not in touched:
                    continue
            first = (len(tokens) - 1) // p * p
            for position in range(len(tokens) - 1, first - 1, -1):
                slot = slots[position - first]
                held = self.shadow.get(base + slot)
                if held != (group, prefix):
                    raise self.fail(
                        "cached_blocks_hold_their_prefix",
                        f"slot {slot} (position {position}) is cached in group {group} for a prefix of"
                        f" {len(tokens)} tokens and holds {self.describe(held, group)}, not that prefix's",
                    )
                prefix = self.prefixes.parents[prefix]
        self.verified_pages = verified

    def describe(self, held: tuple[int, int] | None, group: int) -> str:
        if held is None:
            return "nothing"
        length, prefix = 0, held[1]
        while self.prefixes.parents[prefix] != -1:
            length, prefix = length + 1, self.prefixes.parents[prefix]
        return f"group {held[0]}'s KV of {length} tokens" if held[0] != group else f"KV of {length} tokens"


def hit_law(
    uid: int,
    hit: int,
    rule: hr.HitRule,
    is_cached: hr.IsCached,
    known: int,
    limit: int,
    why: str,
    *,
    exact: bool = True,
    margin: int = 0,
) -> int:
    """A match's hit against the hit rule over what the engine caches (``is_cached``, per group and entry end),
    its keys reading ``known`` tokens, at most ``limit`` reused (``margin``: the drop's look past it):
    ``hit_is_the_longest_valid_match``, or with ``exact`` off ``hit_is_a_valid_match`` (never longer than the
    longest; a shorter hit is the caller's to count). ``why`` says what the engine was read as caching. Returns
    the longest valid match."""
    longest = longest_hit(rule, is_cached, known, limit, margin)
    if exact and hit != longest:
        raise IntegrityError(
            f"hit_is_the_longest_valid_match: request {uid} hit {hit} of {limit} tokens; by {why} the longest valid"
            f" match is {longest}"
        )
    if hit > longest or (hit and not hr.is_valid_length(rule, hit, is_cached)):
        raise IntegrityError(
            f"hit_is_a_valid_match: request {uid} hit {hit} of {limit} tokens; by {why} the longest valid match is"
            f" {longest}"
        )
    return longest


def longest_hit(rule: hr.HitRule, is_cached: hr.IsCached, known: int, limit: int, margin: int = 0) -> int:
    """``hr.compute_hit``, in time linear in the prompt: each whole page's entry is read once per group, where the
    spec reads every page a length uses again for each length it tries (quadratic in a long prompt's pages: a
    prompt of 30,000 tokens at one token a page). The same answer for every rule and cache
    (``tests/fuzz/test_lifecycle.py`` draws both and compares).

    A length L uses, in each group, the pages of ``hr.compute_used_pages``: the whole entries of those before its
    last page, and the entry ending at L itself (``hr.compute_used_ends``: the last page's end is L); none where
    that range is empty (a window of fewer tokens than L leaves of its last page)."""
    p, unit, dropped = rule.page_size, rule.unit, rule.drop * rule.unit
    longest = align_down(max(0, min(limit, known - rule.lookahead - dropped, limit + margin - dropped)), unit)
    # per group, how many whole pages before page k are not cached (only pages before the last one any length
    # read uses: their ends lie below that length)
    missing = []
    for group, kind in enumerate(rule.kinds):
        counts = [0]
        for page in range(0 if kind == hr.STATE else max(0, div_ceil(longest + dropped, p) - 1)):
            counts.append(counts[-1] + (not is_cached(group, (page + 1) * p)))
        missing.append(counts)

    def valid(length: int, groups: Iterable[int]) -> bool:
        last = div_ceil(length, p) - 1
        for group in groups:
            kind = rule.kinds[group]
            first = last if kind == hr.STATE else 0 if kind is None else max(0, length - (kind - 1)) // p
            if first > last:
                continue  # a window shorter than what the length leaves of its last page: it uses nothing
            if (first < last and missing[group][last] != missing[group][first]) or not is_cached(group, length):
                return False
        return True

    every = range(len(rule.kinds))
    positional = [g for g in every if rule.kinds[g] != hr.STATE]
    for length in range(longest, 0, -unit):
        if valid(length, every) and (not dropped or valid(length + dropped, positional)):
            return length
    return 0


def laws_for(manager: object) -> list[LifecycleLaws]:
    """One set of laws per tree core the manager runs (``cores``: (label, manager) pairs), else one."""
    cores: Sequence[tuple[str, LifecycleView]] | None = getattr(manager, "cores", None)
    if cores is not None:
        return [LifecycleLaws(view, f"{label} core: ") for label, view in cores]
    return [LifecycleLaws(cast(LifecycleView, manager))]
