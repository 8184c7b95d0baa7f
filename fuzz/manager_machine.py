"""The manager machine: the seed's request lifecycle on any set of CacheManager targets, checked by the spec.

It plays the lifecycle on every target with the same calls: admit
(match_req, check available_size, lock, check again, copy the matched slots
into the request's row), forward (allocate_paged for a batch of prefill
chunks and decode steps), cache_req after a completed prefill, finish or
abort (cache_req(finished=True)), all under a small pool so that eviction
and OutOfPagesError are constant. The targets must agree on every outcome.

After every step, on every target, what must hold of any manager (the
spec's own invariants, spec/invariants.py):

* **pages are partitioned**: every page is free, cached, or private to
  exactly one live request (free + cached + private == num_pages, set by set);
* **rows match handles**: the cached part of every live request's row holds
  the slots of its locked handle;
* **no freed page is reachable**: no live request's row points at a page on
  the free list (a page freed while a request still reads it is handed to
  the next request: silent KV corruption);
* size info and ``available_size`` agree with the free list and the cache.

Targets with the differential capability (``ExactManager``: ours) are held
to more: around every call the machine observes their abstract states and
checks the operation's declarative relation (spec/cache_manager.py: its
guards, then what must be true after); after every step their own integrity
check, the available_size law and their KV events; and they agree with each
other state for state and row for row (the choices the spec leaves open,
made the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from radixspec.spec import cache_manager as sm
from radixspec.spec.domains import Namespace
from radixspec.spec.errors import CacheBusyError
from radixspec.spec.helpers import div_ceil

from .differential import Outcomes, apply_all
from .manager.base import (
    MAX_PAGES_PER_REQ,
    REGIONS,
    ROWS,
    BodyRaised,
    LiveReq,
    ManagerBase,
    Target,
    prompts,
)
from .sequences import build_sequence, namespaces, page_choices, tail_choices
from .stats import STATS


class ManagerMachine(ManagerBase):
    """The spec and manager targets driven through the same request lifecycles."""

    @precondition(lambda self: len(self.live) < ROWS)
    @rule(
        target=prompts,
        base=prompts,
        keep=st.booleans(),
        pages=page_choices,
        tail=tail_choices,
        namespace=namespaces,
        max_new_tokens=st.integers(1, 6),
    )
    def admit(
        self,
        base: tuple[int, ...],
        keep: bool,
        pages: list[int],
        tail: list[int],
        namespace: Namespace,
        max_new_tokens: int,
    ) -> tuple[int, ...]:
        """The seed's PrefillAdder._try_allocate_one: match, check, lock, check again, fill the row.

        The prompt is ``base`` when ``keep`` and no pages are drawn, else the drawn
        pages after ``base``'s whole pages (when ``keep``); it joins the bundle.
        """
        STATS.record_rule("manager.admit")
        prompt = (
            base if keep and not pages else tuple(build_sequence(self.page_size, pages, tail, base if keep else ()))
        )
        if len(prompt) + max_new_tokens > MAX_PAGES_PER_REQ * self.page_size:
            return prompt
        self.try_admit(prompt, self.ns(namespace), max_new_tokens)
        return prompt

    @precondition(lambda self: len(self.live) < ROWS)
    @rule(target=prompts, base=prompts, max_new_tokens=st.integers(1, 6))
    def admit_cached_prefix(self, base: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
        """Admit the whole pages of an earlier prompt, in its namespace: often every page is cached, so the
        match must stop a token short (match_req leaves the last token to be recomputed)."""
        STATS.record_rule("manager.admit_cached_prefix")
        prompt = base[: len(base) - len(base) % self.page_size]
        if prompt and len(prompt) + max_new_tokens <= MAX_PAGES_PER_REQ * self.page_size:
            self.try_admit(prompt, self.namespace_of.get(base), max_new_tokens)
        return prompt

    def try_admit(self, prompt: tuple[int, ...], namespace: Namespace, max_new_tokens: int) -> None:
        """Admit ``prompt`` on every target if each finds room (they must agree)."""
        if not prompt and not self.validates:
            STATS.skipped["admit of an empty prompt"] += 1
            return
        self.namespace_of[prompt] = namespace
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        used = {live.reqs[0].table_idx for live in self.live}
        table_idx = min(set(range(ROWS)) - used)
        reqs = [impl.new_req(list(prompt), table_idx, namespace, uid) for impl in self.impls]
        before = self.observe({uid: reqs})
        matched = apply_all(
            "match_req",
            self.impls,
            lambda impl, i: impl.match_req(reqs[i]),
            lambda impl, h: (impl.cached_len(h), impl.get_matched_indices(h)),
            snapshot=self.snapshot,
            known=self.known(before),
        )
        after = self.observe({uid: reqs})
        if before is not None and after is not None:
            for index in self.exact:
                cached = self.impls[index].cached_len(matched.results[index]) if matched.ok else 0
                sm.match_req(before[index][0], after[index][0], before[index][1][uid], cached, matched.error)
        if not matched.ok:
            return
        handles = matched.results
        estimated = len(prompt) - self.first.cached_len(handles[0]) + max_new_tokens

        def try_lock(impl: Target, i: int) -> str:
            if estimated > impl.available_size():
                return "no room before lock"
            impl.lock(handles[i])
            # locking made the matched pages unevictable: check again
            if estimated > impl.available_size():
                impl.unlock(handles[i])
                return "no room after lock"
            impl.admit(reqs[i], handles[i])
            return "admitted"

        before = after
        out = apply_all("admit", self.impls, try_lock, snapshot=self.snapshot, known=self.known(before))
        after = self.observe({})
        if before is not None and after is not None:
            for index in self.exact:
                exact = self.exact_target(index)
                if out.results[index] == "admitted":
                    sm.lock(before[index][0], after[index][0], exact.spec_handle(handles[index]))
                else:  # locked and unlocked again, or never locked: the cache as it was
                    assert after[index][0].cache == before[index][0].cache, f"{self.name(index)}: {out.results[index]}"
        STATS.rules[f"manager.admit: {out.results[0]}"] += 1
        if out.results[0] == "admitted":
            cached = self.first.cached_len(handles[0])
            self.live.append(LiveReq(uid, len(prompt), max_new_tokens, reqs, cached, tokens=list(prompt)))

    @precondition(lambda self: bool(self.live))
    @rule(chunk=st.integers(1, 40), region=st.sampled_from(REGIONS))
    def forward_all(self, chunk: int, region: str) -> None:
        """One batch of every live request, in admission order."""
        STATS.record_rule("manager.forward_all")
        self.forward(list(self.live), chunk, region)

    @precondition(lambda self: bool(self.live))
    @rule(
        picks=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS, unique=True),
        chunk=st.integers(1, 40),
        region=st.sampled_from(REGIONS),
    )
    def forward_some(self, picks: list[int], chunk: int, region: str) -> None:
        """One batch of the picked live requests."""
        STATS.record_rule("manager.forward_some")
        self.forward([self.live[i] for i in dict.fromkeys(i % len(self.live) for i in picks)], chunk, region)

    def forward(self, batch: list[LiveReq], chunk: int, region: str) -> None:
        """Allocate pages for prefill chunks and decode steps, then process the results.

        An allocation the pool cannot satisfy is not sent to targets that do not validate.
        """
        targets = [
            min(live.cached_len + chunk, live.prompt_len) if live.in_prefill else live.cached_len + 1 for live in batch
        ]
        if not self.validates:
            p = self.page_size
            needed = sum(
                div_ceil(end, p) - div_ceil(live.cached_len, p) for live, end in zip(batch, targets, strict=True)
            )
            if needed * p > self.first.available_size():
                STATS.skipped["allocate_paged past available_size"] += 1
                return
        for impl_index, impl in enumerate(self.impls):
            for live, device_len in zip(batch, targets, strict=True):
                impl.set_lengths(live.reqs[impl_index], live.cached_len, device_len)
        cached_before = self.cached_page_count()
        out = self.allocate(batch)
        STATS.evicted_pages += max(0, cached_before - self.cached_page_count())
        if not out.ok:
            for impl_index, impl in enumerate(self.impls):
                for live in batch:
                    impl.set_lengths(live.reqs[impl_index], live.cached_len, live.cached_len)
            return
        # after the forward: chunks advance, a completed prefill is cached, a finished request is released
        self.in_region(region, lambda: self.advance(batch, targets))

    def allocate(self, batch: list[LiveReq], copies: int = 1) -> Outcomes:
        """allocate_paged of the batch on every implementation, checked against the spec's relation."""
        mine = {live.uid: live.reqs for live in batch}
        others = self.live_reqs(but=batch)
        before, others_before = self.observe_apart(mine, others)
        out = apply_all(
            "allocate_paged",
            self.impls,
            lambda impl, i: impl.allocate_paged([live.reqs[i] for live in batch] * copies),
            snapshot=self.snapshot,
            known=self.known(before),
        )
        after, others_after = self.observe_apart(mine, others)
        if before is not None and after is not None and others_before is not None and others_after is not None:
            for index in self.exact:
                views_before = [before[index][1][live.uid] for live in batch] * copies
                views_after = [after[index][1][live.uid] for live in batch] * copies
                sm.allocate_paged(
                    before[index][0],
                    after[index][0],
                    views_before,
                    views_after,
                    out.error,
                    others_before[index][1],
                    others_after[index][1],
                )
        return out

    def cache(self, live: LiveReq, finished: bool, label: str) -> Outcomes:
        """cache_req of one request on every implementation, checked against the spec's relation."""
        mine = {live.uid: live.reqs}
        others = self.live_reqs(but=[live])
        before, others_before = self.observe_apart(mine, others)
        out = apply_all(
            label,
            self.impls,
            lambda impl, i: impl.cache_req(live.reqs[i], finished),
            snapshot=self.snapshot,
            known=self.known(before),
        )
        after, others_after = self.observe_apart(mine, others)
        if before is not None and after is not None and others_before is not None and others_after is not None:
            for index in self.exact:
                sm.cache_req(
                    before[index][0],
                    after[index][0],
                    before[index][1][live.uid],
                    after[index][1][live.uid],
                    finished,
                    out.error,
                    others_before[index][1],
                    others_after[index][1],
                )
        return out

    def lazy_exit_law(self, inside: dict[int, tuple[sm.ManagerState, dict[int, sm.RequestView]]] | None) -> None:
        """After a lazy free region closed: the held pages joined the free list, nothing else moved."""
        after = self.observe({})
        if inside is not None and after is not None:
            for index in self.exact:
                sm.lazy_free_region(inside[index][0], after[index][0])

    def in_region(self, region: str, body: Callable[[], None]) -> None:
        """Run ``body`` on every target as ``region`` says (see REGIONS); after a lazy region, its exit law."""
        lazy = region != "none"
        inside = None
        try:
            with ExitStack() as stack:
                if lazy:
                    for impl in self.impls:
                        stack.enter_context(impl.lazy_free_region())
                    if self.relations:  # a refusal that changes nothing (a path replayed was checked once)
                        self.check_nested_lazy_region_is_rejected()
                body()
                inside = self.observe({}) if lazy else None
                if region == "lazy, body raises":
                    raise BodyRaised("the body of the lazy free region raised after its frees")
        except BodyRaised:
            STATS.record_rule("manager.lazy_free_region[body raises]")
        self.lazy_exit_law(inside)

    def advance(self, batch: list[LiveReq], targets: list[int]) -> None:
        """Chunks advance, tokens are sampled; finished requests are released, completed prefills cached."""
        for live, device_len in zip(batch, targets, strict=True):
            was_prefill = live.in_prefill
            live.cached_len = device_len
            for impl_index, impl in enumerate(self.impls):
                impl.set_lengths(live.reqs[impl_index], device_len, device_len)
            if live.in_prefill:
                continue  # a chunk: no token sampled yet
            token = sum(live.tokens) % 4
            live.tokens.append(token)
            live.generated += 1
            for impl_index, impl in enumerate(self.impls):
                impl.append_token(live.reqs[impl_index], token)
            if live.generated >= live.max_new_tokens:
                self.release(live, "finish")
            elif was_prefill:
                self.cache_unfinished(live)

    def cache_unfinished(self, live: LiveReq) -> None:
        """cache_req(finished=False) after a completed prefill: the prompt enters the cache, locked."""
        self.cache(live, False, "cache_req(finished=False)")

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, ROWS - 1), region=st.sampled_from(REGIONS))
    def abort(self, pick: int, region: str) -> None:
        """Abort a live request between batches."""
        STATS.record_rule("manager.abort")
        live = self.live[pick % len(self.live)]
        self.in_region(region, lambda: self.release(live, "abort"))

    def release(self, live: LiveReq, why: str) -> None:
        """cache_req(finished=True) on every implementation; the request leaves the live set."""
        out = self.cache(live, True, f"cache_req(finished=True) on {why}")
        assert out.ok, f"releasing live request {live.uid} was rejected with {out.error}"
        if not self.validates:
            self.live.remove(live)
            STATS.skipped["cache_req(finished=True) again"] += 1
            return
        if not self.relations:  # a refusal that changes nothing (a path replayed was checked once)
            self.live.remove(live)
            return
        again = self.cache(live, True, "cache_req(finished=True) again")
        self.live.remove(live)
        assert not again.ok, f"a second cache_req(finished=True) of request {live.uid} was accepted"

    def check_nested_lazy_region_is_rejected(self) -> None:
        """Opening a lazy free region inside another is rejected, changing nothing."""
        if not self.validates:
            STATS.skipped["nested lazy_free_region"] += 1
            return

        def nest(impl: Target, i: int) -> None:
            with impl.lazy_free_region():
                pass

        out = apply_all("nested lazy_free_region", self.impls, nest, snapshot=self.snapshot)
        assert out.error is CacheBusyError, f"a lazy free region inside another: {out.error or 'accepted'}"

    @precondition(lambda self: bool(self.live) and self.validates)
    @rule(pick=st.integers(0, ROWS - 1), how=st.sampled_from(["same row twice", "past max_seq_len", "backwards"]))
    def allocate_bad_batch(self, pick: int, how: str) -> None:
        """allocate_paged with an impossible batch: rejected, nothing changed."""
        STATS.record_rule(f"manager.allocate_bad_batch[{how}]")
        live = self.live[pick % len(self.live)]
        device_len = {
            "same row twice": live.cached_len + 1,
            "past max_seq_len": MAX_PAGES_PER_REQ * self.page_size + 1,
            "backwards": live.cached_len - 1,
        }[how]
        for impl_index, impl in enumerate(self.impls):
            impl.set_lengths(live.reqs[impl_index], live.cached_len, device_len)
        copies = 2 if how == "same row twice" else 1
        out = self.allocate([live], copies)
        for impl_index, impl in enumerate(self.impls):
            impl.set_lengths(live.reqs[impl_index], live.cached_len, live.cached_len)
        assert not out.ok, f"allocate_paged accepted a batch with {how}"

    def teardown(self) -> None:
        """Release every request: then every page is free or cached (no leak)."""
        if not self.impls:
            return
        for live in list(self.live):
            self.release(live, "teardown")
        self.targets_agree()
