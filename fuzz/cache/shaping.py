"""The cache machine, part: the rules that shape trees: sequences, bulk inserts, deep chains, many namespaces, hits on
cached pages, parents and leaves touched out of order."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import MultipleResults, precondition, rule

from radixspec.spec import prefix_cache as pc
from radixspec.spec.domains import Namespace

from ..sequences import (
    NUM_PATTERNS,
    build_sequence,
    distinct_page,
    namespaces,
    page_choices,
    page_pattern,
    tail_choices,
)
from ..stats import STATS
from .base import (
    BIG_TREE_PAGES,
    BRANCHES,
    DRAIN_PAGES,
    LONG_KEY_PAGES,
    OUTGROW,
    OUTGROW_MATCHES,
    REMATCH_TOKENS,
    SHALLOW_KEY_PAGES,
    SMALL_BULK_PAGES,
    TOUCHED_LEAVES,
    HandleSet,
    handles,
    seqs,
)
from .operations import Operations


class TreeShaping(Operations):
    """The rules that shape trees: sequences, bulk inserts, deep chains, many namespaces, hits on cached pages, parents
    and leaves touched out of order."""

    @rule(target=seqs, base=seqs, keep=st.booleans(), pages=page_choices, tail=tail_choices)
    def new_seq(self, base: tuple[int, ...], keep: bool, pages: list[int], tail: list[int]) -> tuple[int, ...]:
        """A sequence of drawn pages, after the whole pages of ``base`` when ``keep``."""
        STATS.record_rule("cache.new_seq")
        return tuple(build_sequence(self.page_size, pages, tail, base if keep else ()))

    @rule(target=seqs, base=seqs, cut=st.integers(0, 255))
    def prefix_of(self, base: tuple[int, ...], cut: int) -> tuple[int, ...]:
        """A prefix of ``base``, often ending inside a page."""
        STATS.record_rule("cache.prefix_of")
        return base[: cut % (len(base) + 1)]

    @rule(target=seqs, base=seqs, tokens=st.sampled_from([256, 1024, 4096, 8192]), salt=st.integers(0, 7))
    def long_seq(self, base: tuple[int, ...], tokens: int, salt: int) -> tuple[int, ...]:
        """A key thousands of tokens long (past the C compare's 1 KiB blocks), after ``base``'s whole pages.

        Small examples keep it to LONG_KEY_PAGES pages (long keys need big pages there), shallow ones to
        SHALLOW_KEY_PAGES; big ones do not.
        """
        STATS.record_rule("cache.long_seq")
        p = self.page_size
        cap = None if self.big else SHALLOW_KEY_PAGES if self.SHALLOW else LONG_KEY_PAGES
        count = max(1, tokens // p if cap is None else min(tokens // p, cap))
        pages = [page_pattern((salt + i * (i % 3)) % NUM_PATTERNS, p) for i in range(count)]
        return tuple(build_sequence(p, [], [], base) + [token for page in pages for token in page])

    def room(self) -> int:
        """Pages the bulk rules may still add to this example's tree."""
        return max(0, BIG_TREE_PAGES - len(self.model.entries))

    def grows(self) -> bool:
        """True in a big example (drawn at setup) whose tree is not too big yet: the deep rules may run."""
        return bool(self.runs) and self.big and len(self.model.entries) < BIG_TREE_PAGES

    def bulks(self) -> bool:
        """Bulk inserts: in a big example (its tree may still grow), for a target the model follows (wide nodes
        make its eviction units), or in a small example of a deep batch while its tree is below SMALL_BULK_PAGES
        (dozens of leaves: the C tree's children table grows, its eviction queues churn); shallow batches
        spend their steps on the single operations."""
        return (
            self.grows()
            or (self.follow is not None and len(self.model.entries) < BIG_TREE_PAGES)
            or (bool(self.runs) and not self.SHALLOW and len(self.model.entries) < SMALL_BULK_PAGES)
        )

    @precondition(bulks)
    @rule(base=seqs, width=st.integers(0, 3), depth=st.integers(1, 3), namespace=namespaces)
    def bulk_insert(self, base: tuple[int, ...], width: int, depth: int, namespace: Namespace) -> None:
        """Many branches off ``base``'s whole pages at once (a shared system prompt): wide nodes, many leaves;
        in a big example, thousands of pages in one step."""
        STATS.record_rule("cache.bulk_insert")
        p, ns = self.page_size, self.ns(namespace)
        stem = build_sequence(p, [], [], base)
        for branch in range(BRANCHES[self.big][width]):
            if not self.room():
                break
            pages = [token for level in range(depth) for token in distinct_page(branch * 3 + level, p)]
            self.insert_valid(tuple(stem + pages), ns, bulk=True)

    @precondition(grows)
    @rule(base=seqs, depth=st.sampled_from([16, 16, 16, 128, 128, 600, 1414]), namespace=namespaces)
    def deep_chain(self, base: tuple[int, ...], depth: int, namespace: Namespace) -> None:
        """``base`` extended one page per insert: a path ``depth`` nodes deep (its cost grows as depth**2 * P, kept
        to 2M page tokens: 1,414 levels at P=1, a thousand at P=2)."""
        STATS.record_rule("cache.deep_chain")
        p, ns = self.page_size, self.ns(namespace)
        depth = min(depth, int((2_000_000 / p) ** 0.5))
        tokens = build_sequence(p, [], [], base)
        handles = None
        for level in range(depth):
            if not self.room():
                break
            tokens += distinct_page(level % 5 + 1000, p)
            handles = self.insert_valid(tuple(tokens), ns, bulk=True) or handles
        if handles is not None:
            self.note_depth(handles)

    @precondition(lambda self: self.grows() and self.every(lambda p: p.namespaces))
    @rule(seq=seqs, count=st.sampled_from([4, 32, 200]), salt=st.integers(0, 1 << 16))
    def many_namespaces(self, seq: tuple[int, ...], count: int, salt: int) -> None:
        """The same sequence in many namespaces: lines that share tokens but never pages."""
        STATS.record_rule("cache.many_namespaces")
        for index in range(count):
            if self.room() < len(seq) // self.page_size:
                break
            self.insert_valid(seq, ("tenant", salt, index), bulk=True)

    @precondition(lambda self: bool(self.model.entries))
    @rule(target=handles, which=st.integers(0, 1 << 16), extra=tail_choices)
    def match_cached(self, which: int, extra: list[int]) -> HandleSet | MultipleResults[HandleSet]:
        """A hit: the path of a page the cache holds (the ``which``-th, in caching order), maybe with tokens
        after it: what an engine mostly matches.

        Drawn from the model's pages, so that hits, and the recency order they make (an old page used again
        while newer ones are not), are as common in small examples as in an engine."""
        STATS.record_rule("cache.match_cached")
        pages = list(self.model.entries)
        namespace, prefix = pages[which % len(pages)]
        return self.match_prefix(prefix.tokens + tuple(extra), namespace)

    @precondition(lambda self: len(self.model.entries) >= 2)
    @rule(order=st.permutations(range(TOUCHED_LEAVES)), evict_pages=st.sampled_from([0, 1, 4, DRAIN_PAGES]))
    def touch_parents_out_of_order(self, order: list[int], evict_pages: int = 0) -> None:
        """Match the parent page's path of each evictable leaf (up to TOUCHED_LEAVES, in caching order) in the
        drawn order, then evict up to ``evict_pages`` pages one at a time.

        The leaves keep their older stamps and go first; each exposes its parent, an evictable leaf now whose
        stamp is out of order with the ones queued: the C tree's eviction heap (not its in-order ring) then
        orders the parents. Each one-page eviction shows which leaf went (a larger one's slots come back
        sorted, so only its set is seen)."""
        STATS.record_rule("cache.touch_parents_out_of_order")
        leaves = pc.get_evictable_leaves(self.model)[:TOUCHED_LEAVES]
        for index in order:
            if index < len(leaves):
                namespace, prefix = leaves[index]
                self.match_prefix(prefix.tokens[: len(prefix.tokens) - self.page_size], namespace)
        self.evict_one_by_one(evict_pages)

    def evict_one_by_one(self, pages: int) -> None:
        """Evict up to ``pages`` pages, one per call (where the profile evicts on request)."""
        for _ in range(pages):
            if not self.every(lambda p: p.eviction_trigger == "evict") or not pc.size_info(self.model).evictable_size:
                return
            self.checked_evict(1)

    @precondition(lambda self: bool(self.model.entries) and not self.SHALLOW)
    @rule(
        rounds=st.sampled_from([2, 12, OUTGROW]),
        order=st.permutations(range(TOUCHED_LEAVES)),
        evict_pages=st.sampled_from([0, 1, 4]),
    )
    def rematch_leaves(self, rounds: int, order: list[int], evict_pages: int = 0) -> None:
        """Match every evictable leaf (up to TOUCHED_LEAVES, in the drawn order) ``rounds`` times over, then
        evict a few pages one at a time: each match queues the leaf again at its new stamp, so the C tree's
        queues fill with stale entries until it compacts them (its queue rebuild), as an engine's hot prompts do.

        ``OUTGROW``: as many rounds as it takes for the touches alone to outnumber twice the tree's nodes plus
        64 (a node holds at least a page), so that a queue holding every touch must be compacted; the order then
        is the leaves' new stamp order, unlike their creation order."""
        STATS.record_rule("cache.rematch_leaves")
        leaves = pc.get_evictable_leaves(self.model)[:TOUCHED_LEAVES]
        leaves = [leaves[index] for index in order if index < len(leaves)]
        if not leaves:
            return
        if rounds == OUTGROW:
            # past OUTGROW_MATCHES the touches could not outgrow the tree: two rounds then, as the others
            nodes = len(self.model.entries) + len({namespace for namespace, _ in self.model.entries}) + 1
            touches = 2 * nodes + 65
            rounds = touches // len(leaves) + 1 if touches <= OUTGROW_MATCHES else 2
        # no more than REMATCH_TOKENS tokens matched (two rounds whatever the keys)
        rounds = max(2, min(rounds, REMATCH_TOKENS // sum(len(prefix) for _, prefix in leaves)))
        for _ in range(rounds):
            for namespace, prefix in leaves:
                self.match_prefix(prefix.tokens, namespace)
        self.evict_one_by_one(evict_pages)
