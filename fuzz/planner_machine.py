"""The planner machine: an engine's scheduler that plans its own batches and transfers (``PlannerTarget``:
TokenSpeed's), the machine playing its executor and its model.

The machine submits requests (new prompts, prompts sharing a past request's prefix, follow-ups extending a past
request's whole sequence, as a conversation's next turn does), asks for plans, and runs each: its transfers (a
backup's copy at once, or, when the planner pins its sources, as late as its report; a load's before the forward
that asked for it; storage operations when reported, some failed), its page copies and zeroing, then the forward.
Reports of transfers come late and out of order (``report``); requests finish after a drawn number of tokens, or
are aborted at any point; ``reset`` clears the cache when the planner allows.

The machine keeps the KV of every page of every tier: per slot, the identity of the prefix whose last token's KV
it holds (a chained hash of the request's tokens up to that position). Laws, each named in its error:

* ``attended_kv_is_the_requests``: every position a pass attends holds that request's KV, whichever tiers it came
  through (so a load of a reused block, a backup read after its source was reused, a storage object fetched under
  another key, a copy-on-write missed, all fail here);
* ``pass_inputs_are_the_requests``: a prefill chunk's inputs are the request's tokens at its positions, and it
  starts where the request's KV ends or at a hit;
* ``passes_write_distinct_slots``: no two passes of one forward write one slot; no pass writes the null page;
* ``device_hits_are_published``: every full page of a hit is a block the planner's KV events published;
* ``events_replay_to_the_cache``: no block stored twice or removed unstored, every stored block's parent
  published, and after a reset nothing published;
* ``reset_leaves_no_tier_serving``: after a reset, no device or host copy made before it is served;
* the planner's own accounting (``check_integrity``), with nothing held once every request ended and every
  transfer was reported (teardown drains the run).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from radixspec.spec.errors import IntegrityError

from .stats import STATS
from .targets import resolve
from .targets.api import (
    LANDS_BEFORE_FORWARD,
    STORAGE_KINDS,
    BlockEvent,
    KnownFinding,
    Pass,
    Plan,
    PlannerTarget,
    TargetInfo,
    Transfer,
)

# what a slot holds: the identity of the prefix whose last token's KV it is; None: never written; (CLEARED, what it
# held): dropped by a reset
CLEARED = "cleared by a reset"
NEVER = None
Slot = int | tuple[str, object] | None
# a recurrent state slot holds, in its first place, the identity of the last position the state took in (the
# identities chain the whole prefix); the initial state, before any position, is the chain's seed
INITIAL_STATE = 0
# live requests at most, and past sequences kept for prompts that share them
MAX_LIVE = 12
MAX_PAST = 16
# plans run to drain a run at teardown before it must be quiet
DRAIN_PLANS = 64
# plans run between two resets at least: a machine is idle often, and Hypothesis draws a reset's zero far more often
# than one in sixteen, so without a floor resets outnumber prefills and every tier stays cold
RESET_AFTER = 4


def identity(previous: int, token: int) -> int:
    """The KV identity of a position: a chained hash of the tokens up to it (ints and tuples hash the same in every
    process)."""
    return hash((previous, token))


def sample(previous: int) -> int:
    """The model's token after the position whose identity is ``previous`` (deterministic: a draft can guess it)."""
    return 100 + previous % 7


def speculate(request: Request, start: int, count: int) -> tuple[list[int], list[int]]:
    """A decode pass of ``count`` positions from ``start`` (its last token, then ``count - 1`` drafts, as EAGLE or
    MTP propose them): the drafter guesses the first ``accepted`` drafts right and the next wrong. The identities the
    pass writes at each position, and the tokens it samples: the accepted drafts, then the model's next."""
    accepted = request.ids[start] % count
    written, tokens = [request.ids[start]], []
    for i in range(1, count):
        right = sample(written[-1])
        draft = right if i <= accepted else right + 1
        written.append(identity(written[-1], draft))
        if i <= accepted:
            tokens.append(draft)
    return written, [*tokens, sample(written[accepted])]


@dataclass
class Request:
    """A request the machine submitted: its tokens (prompt, then what it sampled) and their KV identities."""

    name: str
    tokens: list[int]
    prompt: int
    # tokens to sample before it finishes
    wanted: int
    ids: list[int] = field(default_factory=list)
    # positions whose KV its passes computed or were served
    computed: int = 0
    sampled: int = 0
    # sampled tokens reported to the planner
    reported: int = 0
    started: bool = False

    def __post_init__(self) -> None:
        previous = INITIAL_STATE
        for token in self.tokens:
            previous = identity(previous, token)
            self.ids.append(previous)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.ids.append(identity(self.ids[-1], token))


class Published(dict[Hashable, "tuple[int, ...] | None"]):
    """The blocks a planner's KV events published, replayed: hash -> the tokens of the prefix the block ends (None:
    tokens the events do not say, below an orphan the profile names); ``copies``: the blocks stored again under a
    hash already published (where the profile allows duplicates), each removed before the hash is."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: Counter[Hashable] = Counter()

    def replay(self, events: list[BlockEvent], orphans: str | None, duplicates: bool) -> None:
        """Apply ``events``; ``events_replay_to_the_cache`` fails on a block stored twice (unless ``duplicates``),
        removed unpublished, or stored under a parent not published (unless ``orphans`` names the finding: counted)."""
        for event in events:
            STATS.events_replayed += 1
            if event.kind == "cleared":
                self.clear()
                self.copies.clear()
            elif event.kind == "removed":
                if event.hash not in self:
                    raise IntegrityError(f"events_replay_to_the_cache: block {event.hash} removed, never published")
                if self.copies[event.hash]:
                    self.copies[event.hash] -= 1
                else:
                    del self[event.hash]
            else:
                parent = self.parent_of(event.hash, event.parent, orphans)
                tokens = None if parent is None else parent + event.tokens
                if event.hash in self:
                    if not duplicates or self[event.hash] != tokens:
                        raise IntegrityError(f"events_replay_to_the_cache: block {event.hash} stored twice")
                    STATS.rules["planner.events[a prefix stored again in another block]"] += 1
                    self.copies[event.hash] += 1
                    continue
                self[event.hash] = tokens

    def parent_of(self, block: Hashable, parent: Hashable | None, orphans: str | None) -> tuple[int, ...] | None:
        """The tokens of a stored block's parent (None: unknown). Its parent must be published, unless the
        planner's profile says its events may store a block under a parent they never stored or removed (``orphans``,
        the finding that is): such a block, and every block below it, stands for tokens the events do not say."""
        if parent is None:
            return ()
        if parent in self:
            return self[parent]
        if orphans:
            STATS.rules[f"planner.known: a block stored under a parent not published ({orphans})"] += 1
            return None
        raise IntegrityError(f"events_replay_to_the_cache: block {block} stored under {parent}, not published")


def check_pass(request: Request, one: Pass, start: int, page_size: int) -> None:
    """``pass_inputs_are_the_requests``: a pass's row covers what it computes, a decode step follows the request's
    KV, a chunk's inputs are its tokens and it starts where its KV ends."""
    pages_needed = -(-(start + one.count) // page_size)
    for pages, window in one.rows():
        if len(pages) < pages_needed:
            raise IntegrityError(
                f"pass_inputs_are_the_requests: {one.request} computes up to position {start + one.count - 1} with"
                f" a {'' if window is None else f'window {window} '}row of {len(pages)} pages"
            )
    if not one.extend:
        if request.computed != start or start + 1 != len(request.tokens):
            raise IntegrityError(
                f"pass_inputs_are_the_requests: {one.request} decodes position {start} with {request.computed}"
                " positions computed"
            )
        return
    expected = tuple(request.tokens[one.start : one.start + one.count])
    if one.inputs != expected or one.start + one.count > len(request.tokens):
        raise IntegrityError(
            f"pass_inputs_are_the_requests: {one.request}'s chunk at {one.start} sends {one.inputs}, its tokens"
            f" there are {expected} (of {len(request.tokens)})"
        )
    if request.started and one.start != request.computed:
        raise IntegrityError(
            f"pass_inputs_are_the_requests: {one.request}'s chunk starts at {one.start}, its KV ends at"
            f" {request.computed}"
        )


def held_instead(
    requests: dict[str, Request], request: Request, held: Slot, expected: Slot, noun: str
) -> tuple[str, str]:
    """What a pass of ``request`` read (``held``) where it needed ``expected``, its ``noun`` (KV or state): the law
    it breaks, and what it read in words."""
    law = "attended_kv_is_the_requests"
    if held is NEVER:
        return law, f"no {noun} ever written there"
    if isinstance(held, tuple):
        # the request's own, but copied before a reset: the tier it came through was not cleared
        if held[1] == expected:
            return "reset_leaves_no_tier_serving", f"its {noun} from before a reset"
        return law, f"another prefix's {noun} from before a reset"
    if noun == "state" and held == INITIAL_STATE:
        return law, "the initial state"
    if held in request.ids:
        at = request.ids.index(held)
        return law, f"its own state after {at + 1} positions" if noun == "state" else f"its own KV of position {at}"
    owners = [r.name for r in requests.values() if held in r.ids]
    return law, f"another prefix's {noun}{f' (of {owners[0]})' if owners else ''}"


def misread(
    requests: dict[str, Request],
    page_size: int,
    request: Request,
    one: Pass,
    row: tuple[tuple[int, ...], int | None],
    j: int,
    held: Slot,
) -> str:
    """The failure of a pass that reads, at position ``j`` of ``row`` (its pages, its window), what its request did
    not compute: its law, what it read."""
    page = row[0][j // page_size]
    law, what = held_instead(requests, request, held, request.ids[j], "KV")
    return (
        f"{law}: {one.request} ({'prefill chunk' if one.extend else 'decode'} at"
        f" {one.start if one.extend else len(request.tokens) - 1}) reads position {j} from device page {page}"
        f"{'' if row[1] is None else f' of its window {row[1]} row'}, which holds {what}"
    )


def prefill_started(request: Request, start: int, page_size: int) -> tuple[int, ...]:
    """A request's first chunk ran (its hit: ``start`` tokens), counted; the tokens of its hit's full pages."""
    request.started = True
    STATS.rules["planner.prefill"] += 1
    STATS.record_prompt(request.prompt, start)
    if start:
        STATS.rules["planner.prefill[hit]"] += 1
    return tuple(request.tokens[: start // page_size * page_size])


def claim(
    writes: dict[tuple[int, int], tuple[str, int]], slot: tuple[int, int], name: str, held: int, what: str
) -> None:
    """``passes_write_distinct_slots``: a forward writes each slot once, and never the null page's; ``held``: the
    identity the slot takes."""
    if slot in writes or slot[0] == 0:
        other = writes.get(slot, ("the null page", 0))[0]
        raise IntegrityError(
            f"passes_write_distinct_slots: {name} writes {what}, which {other} writes in the same forward"
        )
    writes[slot] = (name, held)


def check_state(requests: dict[str, Request], request: Request, one: Pass, start: int, slot: int, held: Slot) -> None:
    """A pass's recurrent state, read from ``slot``, is the one after its first ``start`` positions."""
    if one.extend and start and not request.started:
        STATS.rules["planner.state[a hit's cached state read]"] += 1
    if held != (request.ids[start - 1] if start else INITIAL_STATE):
        raise IntegrityError(misread_state(requests, request, one, start, slot, held))


def misread_state(requests: dict[str, Request], request: Request, one: Pass, start: int, slot: int, held: Slot) -> str:
    """The failure of a pass whose recurrent state, read from ``slot``, is not the one after its first ``start``
    positions: its law, what it read."""
    law, what = held_instead(requests, request, held, request.ids[start - 1] if start else INITIAL_STATE, "state")
    return (
        f"{law}: {one.request} ({'prefill chunk' if one.extend else 'decode'} at {start}) reads the state after"
        f" {start} positions from state slot {slot}, which holds {what}"
    )


prompts = st.tuples(
    st.integers(0, MAX_PAST),  # a past sequence to share (MAX_PAST: none)
    st.sampled_from([0.25, 0.5, 1.0, 1.0]),  # how much of it
    st.lists(st.integers(1, 6), min_size=0, max_size=24),  # new tokens after it
    st.integers(1, 4),  # tokens to sample
)


class PlannerMachine(RuleBasedStateMachine):
    """Each of ``IMPLS`` (targets with a planner layer) in one drawn configuration, executed and checked."""

    IMPLS: ClassVar[tuple[str | TargetInfo, ...]] = ()

    @initialize(draw=st.integers(0, 2**16 - 1))
    def configure(self, draw: int) -> None:
        STATS.examples += 1
        (chosen,) = self.IMPLS
        info = chosen if isinstance(chosen, TargetInfo) else resolve(chosen)
        assert info.planner_factory is not None, f"target {info.name} has no planner layer"
        self.factory, self.draw = info.planner_factory, draw
        self.target: PlannerTarget = self.factory(draw)
        self.name = info.name
        STATS.rules[f"planner.config[{self.target.config}]"] += 1
        self.start()

    def start(self) -> None:
        """The machine's model of a fresh planner: every tier empty, no request, nothing in flight."""
        self.page_size = self.target.page_size
        # every tier's slots: a device page or host block -> its slots; a storage key -> the slots it was put with
        self.tiers: dict[str, dict[Hashable, list[Slot]]] = {"device": {}, "host": {}, "storage": {}, "snapshot": {}}
        self.requests: dict[str, Request] = {}
        self.past: list[list[int]] = []
        self.serial = 0
        self.plans_since_reset = 0
        # transfers asked for and not yet reported, in the order asked; those whose data already moved
        self.in_flight: list[Transfer] = []
        self.moved: set[Hashable] = set()
        # the blocks the KV events published: hash -> the tokens of the prefix it ends
        self.published = Published()
        self.hits_to_publish: list[tuple[str, tuple[int, ...]]] = []
        # the last forward's sampled tokens, not yet reported (overlap scheduling reports them a forward late)
        self.results: list[tuple[str, list[int]]] = []
        # a decode with drafts: the tokens it samples, from its forward to its result
        self.speculated: dict[str, list[int]] = {}
        # finished requests with a row still in flight (overlap)
        self.finishing: set[str] = set()
        STATS.rules[f"planner.results[{'a forward late' if self.target.overlap else 'at once'}]"] += 1

    def plan(self) -> Plan | None:
        """The planner's next plan; None when it crashed in a way its profile names (a known finding): the
        crash is counted, and the example goes on with a new planner of the same configuration, as an engine
        restarts."""
        try:
            return self.target.plan()
        except KnownFinding as known:
            STATS.rules[f"planner.known: {known}"] += 1
            self.target = self.factory(self.draw)
            self.start()
            return None

    # ------------------------------------------------------------ requests

    @precondition(lambda self: len(self.requests) < MAX_LIVE)
    @rule(prompt=prompts)
    def submit(self, prompt: tuple[int, float, list[int], int]) -> None:
        """A request: new tokens after a share of a past sequence (all of it: the next turn of a conversation)."""
        STATS.record_rule("planner.submit")
        which, share, new, wanted = prompt
        base = self.past[which][: int(len(self.past[which]) * share)] if which < len(self.past) else []
        tokens = base + new
        if len(tokens) < 2:
            tokens += [7, 7][len(tokens) :]
        if len(tokens) + wanted > self.target.max_request_tokens:
            STATS.skipped["planner.submit: longer than one request may be"] += 1
            return
        self.serial += 1
        request = Request(f"r{self.serial}", list(tokens), len(tokens), wanted)
        self.requests[request.name] = request
        STATS.rules[f"planner.submit[{'shares a past prefix' if base else 'new'}]"] += 1
        self.target.submit(request.name, tokens, wanted)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, MAX_LIVE), now=st.integers(0, 3))
    def abort(self, index: int, now: int) -> None:
        """Abort a live request, whatever it is doing (one draw in four: aborts are rarer than requests)."""
        if now:
            return
        STATS.record_rule("planner.abort")
        name = sorted(self.requests, key=lambda n: int(n[1:]))[index % len(self.requests)]
        STATS.rules[f"planner.abort[{'started' if self.requests[name].started else 'waiting'}]"] += 1
        del self.requests[name]
        self.target.abort(name)

    # ------------------------------------------------------------ plans, executed

    @rule(
        plans=st.integers(1, 4),
        late=st.booleans(),
        report=st.sampled_from(["all", "all, reversed", "none", "none"]),
    )
    def step(self, plans: int, late: bool, report: str) -> None:
        """``plans`` plans run, each: its transfers started (``late``: a pinned backup's copy waits for its report),
        the forward, the sampled tokens reported; then the transfers in flight reported (``report``)."""
        for _ in range(plans):
            STATS.record_rule("planner.step")
            self.plans_since_reset += 1
            plan = self.plan()
            if plan is None:
                return
            self.run(plan, late)
            if report != "none":
                for transfer in list(reversed(self.in_flight) if report == "all, reversed" else self.in_flight):
                    self.report_transfer(transfer, fail=False)
            self.after_step()

    @precondition(lambda self: self.in_flight)
    @rule(index=st.integers(0, 63), fail=st.booleans())
    def report(self, index: int, fail: bool) -> None:
        """One transfer in flight reported done, in any order (``fail``: a storage operation fails a key)."""
        STATS.record_rule("planner.report")
        self.report_transfer(self.in_flight[index % len(self.in_flight)], fail)
        self.after_step()

    @precondition(
        lambda self: (
            not self.requests and not self.in_flight and not self.results and self.plans_since_reset >= RESET_AFTER
        )
    )
    @rule(now=st.integers(0, 15))
    def reset(self, now: int) -> None:
        """Clear the cache when idle (one draw in sixteen, RESET_AFTER plans since the last at least: a machine is
        idle often, and a reset empties every tier): no request, no transfer and no forward in flight (under
        overlap a finished request's last row may still be: finding 21); the planner may refuse."""
        if now:
            return
        STATS.record_rule("planner.reset")
        self.plans_since_reset = 0
        if self.target.reset():
            STATS.rules["planner.reset[cleared]"] += 1
            self.reset_took(device=True)
        self.after_step()

    @precondition(
        lambda self: (
            self.target.resets_busy and (self.requests or self.in_flight) and self.plans_since_reset >= RESET_AFTER
        )
    )
    @rule(now=st.integers(0, 15))
    def reset_busy(self, now: int) -> None:
        """A reset while requests run and transfers are in flight, where the planner takes one (vLLM's
        ``reset_prefix_cache(reset_connector=True)``): its host tier is cleared whatever the device says (the
        device refuses while a request holds a block), unless the planner says it kept it (``host_cleared``). The
        loads in flight land first: their requests took their hits before the reset, and the planner completes them
        before its next step."""
        if now:
            return
        STATS.record_rule("planner.reset[busy]")
        self.plans_since_reset = 0
        for transfer in self.in_flight:
            if transfer.kind in LANDS_BEFORE_FORWARD and transfer.op not in self.moved:
                self.move(transfer, None)
        device = self.target.reset()
        STATS.rules[f"planner.reset[busy, device {'cleared' if device else 'refused'}]"] += 1
        self.reset_took(device)
        self.after_step()

    def reset_took(self, device: bool) -> None:
        """A reset the planner took: the device (and its snapshots) cleared when it says so, the host tier unless
        the planner kept it (``host_cleared``)."""
        if not self.target.host_cleared:
            STATS.rules["planner.reset[host refused]"] += 1
        self.cleared((("device", "snapshot") if device else ()) + (("host",) if self.target.host_cleared else ()))

    def cleared(self, tiers: tuple[str, ...] = ("device", "host", "snapshot")) -> None:
        """The planner cleared ``tiers``: no copy made before in them may be served, and (the device cleared) its
        events must have removed every block."""
        for tier in tiers:
            for slots in self.tiers[tier].values():
                slots[:] = [held if isinstance(held, tuple) else (CLEARED, held) for held in slots]
        self.take_events()
        if "device" in tiers and self.published:
            raise IntegrityError(
                f"events_replay_to_the_cache: after a reset {len(self.published)} blocks are still published"
            )

    def run(self, plan: Plan, late: bool) -> None:
        for name in plan.aborted:
            STATS.rules["planner.aborted by the planner"] += 1
            self.requests.pop(name, None)
        for name in plan.restarted:  # preempted: its KV dropped, it starts again at a hit
            if name in self.requests:
                STATS.rules["planner.restarted"] += 1
                self.requests[name].started, self.requests[name].computed = False, 0
        landing = []
        for transfer in plan.transfers:
            STATS.rules[f"planner.transfer[{transfer.kind}]"] += 1
            self.in_flight.append(transfer)
            # storage runs its operations when they are reported; a copy whose sources stay pinned may wait for its
            # report (``late``); a load or restore lands after the device copies and zeroing, before the forward,
            # unless no pass reads it before its report (``late``: it lands then)
            if transfer.kind in LANDS_BEFORE_FORWARD:
                if transfer.awaited or not late:
                    landing.append(transfer)
            elif not (transfer.kind in STORAGE_KINDS or (late and transfer.pinned)):
                self.move(transfer, None)
        # the copies the planner flushes run first: it reuses their sources in this plan
        for transfer in [t for t in self.in_flight if t.op in plan.flush and t.op not in self.moved]:
            STATS.rules[f"planner.transfer[{transfer.kind} flushed]"] += 1
            self.move(transfer, None)
        # the device copies read their sources before anything of this plan writes them: TokenSpeed's plan says its
        # copies run before its zeroing ("a source re-granted in the same round is read before it is zeroed"), and
        # a page it re-grants to a load in the same round is read first likewise (a harness choice, docs/targets.md)
        device = self.tiers["device"]
        copied = [(destination, list(self.page(device, source))) for source, destination in plan.copies]
        for destination, slots in copied:
            device[destination] = slots
        for page in plan.zeros:
            device[page] = [NEVER] * self.page_size
        for slot in plan.fresh:
            device[slot] = [INITIAL_STATE] + [NEVER] * (self.page_size - 1)
        for transfer in landing:
            self.move(transfer, None)
        earlier, self.results = self.results, []
        if plan.passes:
            self.forward(plan.passes)
        if self.target.overlap:  # the previous forward's results, reported once this one is launched
            self.deliver(earlier)
        else:
            self.deliver(earlier + self.results)
            self.results = []
        STATS.record_reach(most_transfers_in_flight=len(self.in_flight))

    def page(self, tier: dict[Hashable, list[Slot]], key: Hashable) -> list[Slot]:
        return tier.setdefault(key, [NEVER] * self.page_size)

    def move(self, transfer: Transfer, ok: list[bool] | None) -> None:
        """Copy a transfer's data (``ok``: the pairs copied; None: all)."""
        for i, (source, destination) in enumerate(transfer.pairs):
            if ok is None or ok[i]:
                source_tier, destination_tier = transfer.tiers(i)
                self.tiers[destination_tier][destination] = list(self.page(self.tiers[source_tier], source))
        self.moved.add(transfer.op)

    def report_transfer(self, transfer: Transfer, fail: bool) -> None:
        self.in_flight.remove(transfer)
        storage = self.tiers["storage"]
        if transfer.kind == "query":
            ok = [key in storage for key, _ in transfer.pairs]
        elif transfer.kind in ("put", "get"):
            # a failed operation fails its last key; a get of a key storage does not hold fails
            ok = [not (fail and i == len(transfer.pairs) - 1) for i in range(len(transfer.pairs))]
            if transfer.kind == "get":
                ok = [flag and key in storage for flag, (key, _) in zip(ok, transfer.pairs, strict=True)]
            if not all(ok):
                STATS.rules[f"planner.transfer[{transfer.kind} failed]"] += 1
            self.move(transfer, ok)
        else:
            ok = [True] * len(transfer.pairs)
            if transfer.op not in self.moved:
                STATS.rules[f"planner.transfer[{transfer.kind} copied at its report]"] += 1
                self.move(transfer, None)
        self.moved.discard(transfer.op)
        self.target.done(transfer, ok)

    # ------------------------------------------------------------ the forward

    def forward(self, passes: tuple[Pass, ...]) -> None:
        """Each layer writes the batch's KV into the cache before its attention reads it: every pass's positions
        are written first, then what each pass attends is checked (a request may attend a page another pass of the
        same forward computes: vLLM hits blocks allocated in the same step)."""
        device, p = self.tiers["device"], self.page_size
        writes: dict[tuple[int, int], tuple[str, int]] = {}
        spans = []
        for one in passes:
            request = self.requests.get(one.request)
            if request is None:
                raise IntegrityError(f"pass_inputs_are_the_requests: a pass of {one.request}, which is not live")
            start = one.start if one.extend else len(request.tokens) - 1
            check_pass(request, one, start, self.page_size)
            # what it writes: its positions' identities; a decode of several positions writes its drafts'
            written = request.ids[start : start + one.count] if one.extend or one.count == 1 else None
            if written is None:
                written, self.speculated[one.request] = speculate(request, start, one.count)
            for pages, _ in one.rows():
                for j in range(start, start + one.count):
                    slot = (pages[j // p], j % p)
                    what = f"position {j} to page {slot[0]} slot {slot[1]}"
                    claim(writes, slot, one.request, written[j - start], what)
            if one.state is not None:  # the state after the pass: the identity of its last position, in place 0
                claim(writes, (one.state[1], 0), one.request, written[-1], f"its state to slot {one.state[1]}")
            spans.append((one, request, start))
        for one, request, start in spans:  # a state is read before the forward writes any (in place: its slot)
            if one.state is not None:
                read = one.state[0] or one.state[1]
                check_state(self.requests, request, one, start, read, self.page(device, read)[0])
        for (page, offset), (_, identity_written) in writes.items():
            self.page(device, page)[offset] = identity_written
        for one, request, start in spans:
            for row in one.rows():
                pages, window = row
                for j in range(0 if window is None else max(0, start - window + 1), start):
                    held = self.page(device, pages[j // p])[j % p]
                    if held != request.ids[j]:
                        raise IntegrityError(misread(self.requests, self.page_size, request, one, row, j, held))
        for one, request, start in spans:
            self.after_pass(one, request, start)

    def after_pass(self, one: Pass, request: Request, start: int) -> None:
        if one.extend and not request.started:
            hit = prefill_started(request, start, self.page_size)
            if hit and self.target.publishes_hits:
                self.hits_to_publish.append((request.name, hit))
        request.computed, left = start + one.count, request.wanted - request.sampled
        drafted = self.speculated.pop(request.name, None)
        # no token: a pass planned before its finish reached the planner (overlap: every planned row's result lands,
        # as in TokenSpeed's event loop, which holds a finishing request's pages until they do; the device stopped
        # the request), or a prefill chunk that is not the last
        if left <= 0 or (drafted is None and request.computed < len(request.tokens)):
            self.results.append((request.name, []))
            return
        if drafted is not None:  # a decode with drafts: its accepted drafts and the next token, as many as wanted
            STATS.rules[f"planner.decode[{len(drafted) - 1} of {one.count - 1} drafts accepted]"] += 1
            request.computed = start + min(len(drafted), left)  # the last token's KV and the accepted drafts'
        taken = (drafted or [sample(request.ids[-1])])[:left]
        for token in taken:
            request.append(token)
        request.sampled += len(taken)
        self.results.append((request.name, taken))

    def deliver(self, results: list[tuple[str, list[int]]]) -> None:
        """Report sampled tokens (none for a prefill chunk that is not the last), each request's own in order; a
        request that sampled all it wanted finishes after its last is reported; an aborted one's are dropped."""
        for name, tokens in results:
            if name in self.finishing:  # a row planned before its finish: its result still lands
                STATS.rules["planner.results[a row after its finish]"] += 1
                self.target.result(name, tokens)
                self.finishing.discard(name)
                continue
            request = self.requests.get(name)
            if request is None:  # aborted: the planner dropped it, and takes no result
                continue
            self.target.result(name, tokens)
            request.reported += len(tokens)
            if request.reported >= request.wanted:
                del self.requests[name]
                self.past = ([*self.past, list(request.tokens)])[-MAX_PAST:]
                STATS.rules["planner.finished"] += 1
                self.target.finish(name)
                if any(late == name for late, _ in self.results):
                    self.finishing.add(name)

    # ------------------------------------------------------------ events and checks

    def take_events(self) -> None:
        self.published.replay(self.target.take_events(), self.target.orphans, self.target.duplicates)

    def after_step(self) -> None:
        self.take_events()
        if self.hits_to_publish:
            prefixes = {tokens for tokens in self.published.values() if tokens is not None}
            for name, tokens in self.hits_to_publish:
                for end in range(self.page_size, len(tokens) + 1, self.page_size):
                    if tokens[:end] not in prefixes:
                        raise IntegrityError(
                            f"device_hits_are_published: {name} hit {len(tokens)} tokens; its page ending at {end}"
                            " is not a published block"
                        )
            self.hits_to_publish.clear()
        self.target.check_integrity(quiescent=False)
        reach = self.target.reach()
        STATS.record_reach(
            largest_tree_pages=reach.get("device pages in use", 0),
            largest_host_pages=reach.get("host blocks cached", 0),
            largest_storage_pages=reach.get("storage blocks held", 0),
        )

    def teardown(self) -> None:
        """Drain the run: every live request ended, every transfer reported; then nothing may be held, and a reset
        must leave nothing published. Not after a failure: the example failed already, and the drain of a broken run
        would only report something else in its place."""
        if not hasattr(self, "target") or sys.exc_info()[1] is not None:
            return
        for name in list(self.requests):
            del self.requests[name]
            self.target.abort(name)
        for _ in range(DRAIN_PLANS):
            # results still out (a row after its finish, under overlap) and transfers in flight are reported in
            # this run: the planner may only then plan what they free (a job another worker reports a step later),
            # so the drain ends at an empty plan with nothing reported
            reported = bool(self.results or self.in_flight)
            plan = self.plan()
            if plan is None:
                return
            self.run(plan, late=False)
            for transfer in list(self.in_flight):
                self.report_transfer(transfer, fail=False)
            self.after_step()
            if not plan.transfers and not plan.passes and not reported:
                break
        else:
            raise IntegrityError(f"{self.name} still plans work {DRAIN_PLANS} plans after every request ended")
        self.target.check_integrity(quiescent=True)
        if not self.target.reset():
            raise IntegrityError(f"{self.name} refused a reset with no request live and no transfer in flight")
        self.cleared()
