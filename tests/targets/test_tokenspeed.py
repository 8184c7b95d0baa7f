"""The ``tokenspeed`` target: TokenSpeed's scheduler wheel under the planner machine (fuzz/planner_machine.py).

Its code is compiled, so its bugs cannot be planted in it: each plant below is a bug of the scheduler's output
(the plan, the KV events, the completions it waits for) planted in the adapter that hands them to the machine, one
per law, and each must fail a campaign naming that law within two minutes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tokenspeed_scheduler") is None, reason="tokenspeed-scheduler is not installed"
)

from radixspec.fuzz.stats import STATS  # noqa: E402
from radixspec.fuzz.targets.api import Pass, Plan  # noqa: E402
from radixspec.fuzz.targets.tokenspeed import TARGET, Config, TokenSpeedPlanner, draw_for  # noqa: E402
from radixspec.spec.errors import IntegrityError  # noqa: E402

from .campaigns import DrivenPlanner  # noqa: E402


def planner(page_size: int = 4, device: int = 8, host: float = 2, storage: bool = False) -> TokenSpeedPlanner:
    """A planner in the configuration named (a budget of 128 tokens a step, 4 requests a batch)."""
    made = TokenSpeedPlanner(draw_for(Config(page_size, device, host, storage, 128, 4)))
    assert made.page_size == page_size and made.storage == storage
    return made


def retracting() -> TokenSpeedPlanner:
    """Finding 19's configuration: P = 1, 8 device pages, 8 tokens a step, one request a batch, retraction forced
    every third plan."""
    return TokenSpeedPlanner(draw_for(Config(1, 8, 0.5, False, 8, 1, "forced", False)))


def Driven(target: TokenSpeedPlanner) -> DrivenPlanner:
    """The planner machine over ``target``, its rules called by hand."""
    return DrivenPlanner(TARGET, target)


def test_a_prefix_evicted_from_the_device_is_served_from_the_host() -> None:
    machine = Driven(planner(page_size=4, device=8, host=4))
    shared = list(range(1, 13))
    assert machine.serve([*shared, 50]) == 0
    assert machine.serve([*shared, 60]) == 12  # a device hit
    machine.serve(list(range(200, 226)))  # evicts the shared prefix from the device
    loads = STATS.rules["planner.transfer[load]"]
    assert machine.serve([*shared, 70]) == 12  # loaded back from the host, its KV checked at the forward
    assert STATS.rules["planner.transfer[load]"] > loads
    machine.teardown()


def test_a_retracted_request_is_restored_with_its_kv() -> None:
    machine = Driven(retracting())
    machine.target.orphans = "finding 19"
    machine.serve([4, 6, 4, 4, 3], wanted=3)
    assert STATS.rules["planner.transfer[snapshot]"] and STATS.rules["planner.transfer[restore]"]
    machine.teardown()


def test_with_overlap_a_row_planned_before_its_finish_still_lands() -> None:
    # TokenSpeed holds a finishing request's pages until every row planned for it reported a result (0.1.34 on);
    # the machine reports the late row (no token: the device stopped the request), and the drain finds nothing held
    machine = Driven(TokenSpeedPlanner(draw_for(Config(1, 8, 0.5, False, 8, 1, "off", False, True))))
    assert machine.target.overlap
    machine.submit(prompt=(16, 1.0, [7, 7], 1))
    for _ in range(3):
        machine.run(machine.target.plan(), late=False)
        machine.after_step()
    assert STATS.rules["planner.results[a row after its finish]"]
    machine.teardown()
    # skipping the late row leaks the request's pages: the drain names it
    machine = Driven(TokenSpeedPlanner(draw_for(Config(1, 8, 0.5, False, 8, 1, "off", False, True))))
    machine.submit(prompt=(16, 1.0, [7, 7], 1))
    for _ in range(2):
        machine.run(machine.target.plan(), late=False)
    machine.finishing.clear()
    machine.results.clear()
    with pytest.raises(IntegrityError, match="tokenspeed_quiescent_holds_nothing: .*'active device pages'"):
        machine.teardown()


def test_finding_21_a_reset_with_a_forward_in_flight_serves_kv_from_before_it() -> None:
    # the machine resets only with no forward in flight (its precondition); forced here, TokenSpeed clears, caches
    # the finished request's pages when its last row lands, and serves them: the law names it
    machine = Driven(TokenSpeedPlanner(draw_for(Config(16, 16, 4, False, 8, 4, "off", False, True))))
    machine.submit(prompt=(16, 1.0, [7, 7], 2))
    machine.step(plans=3, late=False, report="all")
    assert machine.results and not machine.requests  # the finished request's last row is still in flight
    assert machine.target.reset()
    machine.cleared()
    machine.step(plans=1, late=False, report="all")
    machine.submit(prompt=(16, 1.0, [7, 7, 101, 102], 1))
    with pytest.raises(IntegrityError, match="reset_leaves_no_tier_serving: r2 .* its KV from before a reset"):
        machine.step(plans=1, late=False, report="all")


def test_a_copys_source_re_granted_to_a_load_in_the_same_plan_is_read_first() -> None:
    # a campaign's program (P = 16, 12 device pages, overlap, mixed batches): the last plan copies page 9 (a shared
    # block a prompt page was deduplicated onto) to a decode's private page, and loads another block into page 9;
    # the copy reads it first, as TokenSpeed's copies read a source re-granted in the round before it is zeroed.
    # The machine once landed the load first and reported a harness artefact as attended_kv_is_the_requests
    machine = Driven(TokenSpeedPlanner(draw_for(Config(16, 12, 2, False, 32, 8, "forced", True, True))))
    for share, new, wanted in ((0.25, [], 1), (0.25, [], 1), (0.25, [], 3), (0.25, [1, 1], 3)):
        machine.submit(prompt=(0, share, new, wanted))
    machine.step(late=False, plans=1, report="all")
    machine.submit(prompt=(0, 0.25, [1], 2))
    machine.step(late=False, plans=1, report="all")
    machine.submit(prompt=(0, 0.25, [], 1))
    machine.step(late=False, plans=1, report="all")
    machine.submit(prompt=(0, 0.25, [], 1))
    machine.step(late=False, plans=1, report="none")
    for share, new in ((0.25, []), (0.25, [1]), (0.25, [1, 1, 1]), (0.5, [1]), (1.0, []), (0.25, []), (0.25, [])):
        machine.submit(prompt=(0, share, new, 1))
    machine.submit(prompt=(0, 0.25, [], 1))
    machine.step(late=False, plans=2, report="all")
    assert STATS.rules["planner.transfer[load]"]
    machine.teardown()


def test_with_a_window_group_each_pass_carries_its_window_row() -> None:
    """A window group of 6 tokens beside the full one (pages of 4): a 13-token prompt, then the same prompt again
    (a device hit of 12: its window's KV checked in the window group's row)."""
    machine = Driven(TokenSpeedPlanner(draw_for(Config(4, 24, 1, False, 16, 8, window=6))))
    shared = list(range(1, 13))
    assert machine.serve([*shared, 50]) == 0
    assert machine.serve([*shared, 60]) == 12
    machine.teardown()


def orphans_counted_or_named(config: Config, finding: int, program: Callable[[Any], None]) -> None:
    """Run ``program`` (submits and aborts) then two plans, twice: with ``finding`` named in the profile its
    orphan blocks are counted; not named, the event law fails."""
    from radixspec.fuzz.regression import build_machine

    key = f"planner.known: a block stored under a parent not published (finding {finding})"
    for known in (True, False):
        machine = build_machine("planner", targets=("tokenspeed",), lru=None, device="cpu")()
        machine.configure(draw=draw_for(config))
        if not known:
            machine.target.orphans = None
        counted = STATS.rules[key]
        program(machine)
        if known:
            machine.step(late=False, plans=2, report="all")
            assert STATS.rules[key] > counted
            machine.teardown()
        else:
            with pytest.raises(IntegrityError, match="events_replay_to_the_cache: block .* not published"):
                machine.step(late=False, plans=2, report="all")


def test_finding_28_fails_the_event_law_where_the_profile_does_not_name_it() -> None:
    """A campaign's program (seed 5, shrunk; a window of 6, pages of 4, storage on): a 12-token prompt of ones
    prefilled in one pass leaves its first page out of the window, and the events never publish it but store the
    next page under it (finding 28, docs/findings.md). Named in the profile, it is counted; not named, the event
    law fails."""

    def program(machine: Any) -> None:
        for count in (4, 3):
            for _ in range(count):
                machine.submit(prompt=(0, 0.25, [], 1))
            machine.abort(index=0, now=0)
        machine.submit(prompt=(0, 0.25, [], 2))
        machine.submit(prompt=(0, 0.25, [1] * 12, 1))

    orphans_counted_or_named(Config(4, 24, 1, True, 16, 8, "off", False, False, 6), 28, program)


def test_finding_30_fails_the_event_law_where_the_profile_does_not_name_it() -> None:
    """A campaign's program (seed 3, shrunk; a state group, pages of 2, storage on): a 3-token prompt's only
    published block is the tail where its state is cached, under the page before it, never published (finding 30,
    docs/findings.md). Named in the profile, it is counted; not named, the event law fails."""

    def program(machine: Any) -> None:
        assert machine.target.state and machine.target.window is None
        machine.submit(prompt=(0, 0.25, [1, 1, 1], 1))

    orphans_counted_or_named(Config(2, 16, 2, True, 32, 1, "off", True, False, None, True), 30, program)


def test_finding_19_fails_the_event_law_where_the_profile_does_not_name_it() -> None:
    # TokenSpeed's events store a restored request's next block under a parent they removed at the restore: with
    # the profile's choice off, the law names it; on, the machine counts it (the test above)
    machine = Driven(retracting())
    machine.target.orphans = None
    with pytest.raises(IntegrityError, match="events_replay_to_the_cache: block .* stored under .*, not published"):
        machine.serve([4, 6, 4, 4, 3], wanted=3)


def finding_20(known: bool) -> Driven:
    """The program a campaign shrank for finding 20 (P = 4, 8 device pages, storage and retraction on, mixed
    batches, 16 tokens a step, 2 requests a batch), the crash named in the profile or not."""
    machine = Driven(TokenSpeedPlanner(draw_for(Config(4, 8, 2, True, 16, 2, "on", True, False))))
    assert machine.target.known_crashes
    machine.target.known_crashes = known
    for prompt in ([1, 1, 1, 2, *[1] * 13], [], [], [], [1] * 11):
        machine.submit(prompt=(0, 0.25, prompt, 3 if len(prompt) == 11 else 1))
    return machine


def test_finding_20_is_reported_where_the_profile_does_not_name_it() -> None:
    with pytest.raises(RuntimeError, match="the tail's parent page has its KV event hash"):
        finding_20(known=False).step(late=False, plans=3, report="all")


def test_finding_20_where_the_profile_names_it_is_counted_and_the_scheduler_restarted() -> None:
    machine = finding_20(known=True)
    before, first = (
        STATS.rules["planner.known: a scheduler assertion on a tail page's KV event hash (finding 20)"],
        id(machine.target),
    )
    machine.step(late=False, plans=3, report="all")
    after = STATS.rules["planner.known: a scheduler assertion on a tail page's KV event hash (finding 20)"]
    assert after == before + 1 and id(machine.target) != first and not machine.requests
    machine.teardown()  # the new scheduler drains clean


def test_a_load_into_another_page_than_the_row_reads_is_named() -> None:
    machine = Driven(planner(page_size=4, device=8, host=4))
    shared = list(range(1, 13))
    machine.serve([*shared, 50])
    machine.serve(list(range(200, 226)))
    real = machine.target._transfers

    def shifted(op: object) -> list:
        found = real(op)
        return [
            type(t)(t.op, t.kind, tuple((s, d % 8 + 1) for s, d in t.pairs), t.pinned) if t.kind == "load" else t
            for t in found
        ]

    machine.target._transfers = shifted  # type: ignore[method-assign]
    with pytest.raises(IntegrityError, match="attended_kv_is_the_requests"):
        machine.serve([*shared, 70])


def test_a_chunk_whose_inputs_are_not_the_requests_is_named() -> None:
    machine = Driven(planner())
    machine.submit(prompt=(16, 1.0, [1, 2, 3, 4, 5], 1))
    plan = machine.target.plan()
    (one,) = plan.passes
    bad = Pass(one.request, one.start, one.count, tuple(t + 1 for t in one.inputs or ()), one.pages, True)
    with pytest.raises(IntegrityError, match="pass_inputs_are_the_requests"):
        machine.run(Plan(passes=(bad,)), late=False)


def test_two_passes_writing_one_slot_are_named() -> None:
    machine = Driven(planner())
    machine.submit(prompt=(16, 1.0, [1, 2, 3], 1))
    machine.submit(prompt=(16, 1.0, [4, 5, 6], 1))
    plan = machine.target.plan()
    first, second = plan.passes
    clash = Pass(second.request, second.start, second.count, second.inputs, first.pages, True)
    with pytest.raises(IntegrityError, match="passes_write_distinct_slots"):
        machine.run(Plan(passes=(first, clash)), late=False)


PLANTS = {
    # a hit served from a page of another prefix: the row of a request with a hit has its first two pages swapped
    "attended_kv_is_the_requests (a hit's pages out of order)": """
real = T.plan
def plan(self):
    p = real(self)
    swap = lambda o: (o.pages[1], o.pages[0], *o.pages[2:]) if o.extend and o.start >= 2 * self.page_size else o.pages
    return replace(p, passes=tuple(replace(o, pages=swap(o)) for o in p.passes))
T.plan = plan
""",
    # a load back lands on the device page after the one it named
    "attended_kv_is_the_requests (a load onto another page)": """
real = T._transfers
def transfers(self, op):
    shift = lambda t: replace(t, pairs=tuple((s, d % (self.device_pages - 1) + 1) for s, d in t.pairs))
    return [shift(t) if t.kind == "load" else t for t in real(self, op)]
T._transfers = transfers
""",
    # a storage get fills the host blocks in reverse order of its keys
    "attended_kv_is_the_requests (a storage get under the wrong keys)": """
real = T._transfers
def transfers(self, op):
    flip = lambda t: replace(t, pairs=tuple(zip([s for s, _ in t.pairs], [d for _, d in t.pairs][::-1])))
    return [flip(t) if t.kind == "get" and len(t.pairs) > 1 else t for t in real(self, op)]
T._transfers = transfers
""",
    # a reset that reports the cache cleared, publishes it so (and no removal of what it held), and keeps serving it
    "reset_leaves_no_tier_serving (a reset that clears nothing)": """
from radixspec.fuzz.targets.api import BlockEvent
real_events = T.take_events
def reset(self):
    self.fake_clear = True
    return True
def take_events(self):
    self.stored = getattr(self, "stored", set())
    self.hidden = getattr(self, "hidden", set())
    events = []
    for event in real_events(self):
        if event.kind == "removed" and event.hash in self.hidden:
            self.hidden.discard(event.hash)
            continue
        self.stored.add(event.hash) if event.kind == "stored" else self.stored.discard(event.hash)
        events.append(event)
    if getattr(self, "fake_clear", False):
        self.fake_clear = False
        self.hidden |= self.stored
        self.stored = set()
        events.append(BlockEvent("cleared"))
    return events
T.reset, T.take_events = reset, take_events
""",
    # every fifth removal not published
    "events_replay_to_the_cache (removals lost)": """
real = T.take_events
def take_events(self):
    self.n = getattr(self, "n", 0)
    kept = []
    for e in real(self):
        self.n += e.kind == "removed"
        if not (e.kind == "removed" and self.n % 5 == 0):
            kept.append(e)
    return kept
T.take_events = take_events
""",
    # no KV event published at all
    "device_hits_are_published (events never published)": """
T.take_events = lambda self: (self.scheduler.drain_kv_events(), [])[1]
""",
    # a backup reported done as it is asked for, before its data moved: the scheduler may then reuse its source
    # (write-back evicting a page whose backup has not landed); the machine copies it when it reports it
    "attended_kv_is_the_requests (a backup reported done before its copy)": """
real_plan, real_done = T.plan, T.done
def plan(self):
    p = real_plan(self)
    for t in p.transfers:
        if t.kind == "backup":
            real_done(self, t, [True] * len(t.pairs))
            self.ops[t.op] = None
    return p
def done(self, transfer, ok):
    if transfer.kind == "backup":
        self.ops.pop(transfer.op)
        return
    real_done(self, transfer, ok)
T.plan, T.done = plan, done
""",
    # two backups of one plan written to one host block (a host slot handed out twice)
    "attended_kv_is_the_requests (two backups into one host block)": """
real = T._transfers
def transfers(self, op):
    found = real(self, op)
    for i, t in enumerate(found):
        if t.kind == "backup" and len(t.pairs) > 1:
            first = t.pairs[0][1]
            found[i] = replace(t, pairs=(t.pairs[0], *((s, first) for s, _ in t.pairs[1:])))
    return found
T._transfers = transfers
""",
    # a state row read in place where it names another source (a state group's hit or next chunk reads the slot it
    # is about to write)
    "attended_kv_is_the_requests (a state read from its destination)": """
real = T.plan
def plan(self):
    p = real(self)
    moved = lambda o: replace(o, state=(0, o.state[1])) if o.state and o.state[0] else o
    return replace(p, passes=tuple(moved(o) for o in p.passes))
T.plan = plan
""",
    # the completion of a load never reaches the scheduler, which keeps its host blocks pinned
    "tokenspeed_quiescent_holds_nothing (a load's completion lost)": """
real = T.done
def done(self, transfer, ok):
    if transfer.kind == "load":
        self.ops.pop(transfer.op)
        return
    real(self, transfer, ok)
T.done = done
""",
}

CAMPAIGN = """
import time
from collections.abc import Callable
from dataclasses import replace
from radixspec.fuzz.targets.tokenspeed import TokenSpeedPlanner as T
{plant}
from radixspec.fuzz.campaign import main
began = time.monotonic()
code = main(["--target", "tokenspeed", "--seed", "0", "--examples", "{examples}", "--workers", "0", "--quiet",
             "--no-shrink", "--out", {out!r}])
print("exit", code, "after", round(time.monotonic() - began, 1))
"""


def run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("law", sorted(PLANTS))
def test_each_law_catches_its_planted_bug(law: str, tmp_path: Path) -> None:
    began = time.monotonic()
    done = run(CAMPAIGN.format(plant=PLANTS[law], out=str(tmp_path), examples=1500))
    assert "exit 1" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert law.split()[0] + ":" in done.stdout + done.stderr, done.stdout[-3000:]
    assert time.monotonic() - began < 120


def test_a_failure_is_reported_as_itself_not_as_the_drains(tmp_path: Path) -> None:
    # a failing example's teardown does not drain it: a broken run's drain would report its own failure instead
    plant = """
from radixspec.spec.errors import IntegrityError
real, real_check = T.plan, T.check_integrity
def plan(self):
    self.plans = getattr(self, "plans", 0) + 1
    if self.plans == 5:
        raise RuntimeError("planted in the fifth plan")
    return real(self)
def check_integrity(self, quiescent):
    if quiescent and getattr(self, "plans", 0) >= 5:
        raise IntegrityError("the drain of the broken run")
    real_check(self, quiescent)
T.plan, T.check_integrity = plan, check_integrity
"""
    done = run(CAMPAIGN.format(plant=plant, out=str(tmp_path), examples=200))
    assert "exit 1" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RuntimeError: planted in the fifth plan" in done.stdout, done.stdout[-3000:]
    assert "the drain of the broken run" not in done.stdout, done.stdout[-3000:]


def test_a_clean_campaign(tmp_path: Path) -> None:
    done = run(CAMPAIGN.format(plant="", out=str(tmp_path), examples=400))
    assert "exit 0" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_under_a_window_group_retraction_is_never_drawn() -> None:
    """Finding 29: with a window group and retraction, TokenSpeed aborts the process at a restored request's finish,
    which ends a campaign's worker (no profile can count it). A draw of both gets a scheduler without retraction;
    without the window the same draw retracts."""
    for retraction in ("on", "forced"):
        drawn = TokenSpeedPlanner(draw_for(Config(1, 24, 0.5, True, 32, 4, retraction, False, True, 6)))
        assert (drawn.window, drawn.retraction) == (6, "off") and "retraction off" in drawn.config
        plain = TokenSpeedPlanner(draw_for(Config(1, 24, 0.5, True, 32, 4, retraction, False, True, None)))
        assert (plain.window, plain.retraction) == (None, retraction) and f"retraction {retraction}" in plain.config


def with_state(overlap: bool = False) -> TokenSpeedPlanner:
    """A state group beside the full one: pages of 1, 48 device pages, 32 tokens a step, 2 requests a batch."""

    class Planner(TokenSpeedPlanner):
        overlap_beside_state = overlap

    made = Planner(draw_for(Config(1, 48, 0.5, False, 32, 2, "off", False, overlap, None, True)))
    assert made.state and made.overlap == overlap and "state" in made.config
    return made


def test_with_a_state_group_a_hit_reads_the_state_cached_at_its_end() -> None:
    """Each pass reads its state (the one after its first ``start`` positions) and writes the one after its last:
    a 13-token prompt, then the same prompt and one more token hit its 13 tokens and read the state cached there."""
    machine = Driven(with_state())
    shared = list(range(1, 14))
    read = STATS.rules["planner.state[a hit's cached state read]"]
    assert machine.serve(shared) == 0
    assert machine.serve([*shared, 50]) == 13
    assert STATS.rules["planner.state[a hit's cached state read]"] == read + 1
    machine.teardown()


def test_a_state_read_from_its_destination_is_named() -> None:
    """A plan whose state row is read in place where it names another source: the destination holds nothing yet
    (a fresh slot, the initial state), and the hit's pass reads it as the state after 13 positions."""
    machine = Driven(with_state())
    shared = list(range(1, 14))
    machine.serve(shared)
    real = machine.target.plan

    def in_place() -> Plan:
        plan = real()
        passes = tuple(
            Pass(o.request, o.start, o.count, o.inputs, o.pages, o.extend, o.windows, (0, o.state[1])) if o.state else o
            for o in plan.passes
        )
        return Plan(plan.transfers, plan.copies, plan.zeros, passes, plan.aborted, fresh=plan.fresh)

    machine.target.plan = in_place  # type: ignore[method-assign]
    with pytest.raises(IntegrityError, match="r2 .prefill chunk at 13. reads the state after 13 positions .*initial"):
        machine.serve([*shared, 50])


def test_finding_31_with_overlap_a_hit_reads_a_state_one_token_ahead() -> None:
    """Finding 31 (docs/findings.md): with overlap, a request's finish caches its state slot while the decode planned
    before the finish still updates it in place. The target keeps overlap off beside a state group; on, the law
    names it: a request that continues the first's prompt and first sampled token reads the state one token on.
    Without overlap the same program is clean."""
    for overlap in (False, True):
        machine = Driven(with_state(overlap))
        machine.submit(prompt=(16, 1.0, [1, 2], 2))
        machine.step(plans=4, late=False, report="all")
        assert not machine.requests
        machine.submit(prompt=(0, 0.75, [], 1))  # [1, 2] and its first sampled token
        if not overlap:
            machine.step(plans=3, late=False, report="all")
            machine.teardown()
            continue
        assert STATS.rules["planner.results[a row after its finish]"]
        with pytest.raises(IntegrityError, match="attended_kv_is_the_requests: r2 .decode at 3. .* own state after 4"):
            machine.step(plans=3, late=False, report="all")


def test_with_drafts_a_decode_samples_its_accepted_drafts_and_a_later_hit_reads_their_kv() -> None:
    """Speculative decoding (2 drafts a decode step, pages of 1): each step writes its last token's KV and its
    drafts'; the tokens it samples are the accepted drafts and the model's next. A later request with the whole
    sequence hits the accepted drafts' KV; a plan that served the last position (a rejected draft's KV, or none) is
    named."""
    machine = Driven(TokenSpeedPlanner(draw_for(Config(1, 24, 1, False, 32, 2, "off", False, False, None, False, 2))))
    assert machine.target.drafts == 2 and "2 drafts" in machine.target.config
    rows: dict[str, tuple[int, ...]] = {}
    real = machine.target.plan

    def noted() -> Plan:
        plan = real()
        rows.update((one.request, one.pages) for one in plan.passes)
        return plan

    machine.target.plan = noted  # type: ignore[method-assign]
    before = sum(n for rule, n in STATS.rules.items() if rule.startswith("planner.decode["))
    machine.serve([1, 2, 3], wanted=8)
    decodes = sum(n for rule, n in STATS.rules.items() if rule.startswith("planner.decode[")) - before
    sequence = list(machine.past[-1])
    assert len(sequence) == 11 and 0 < decodes < 7  # fewer decode steps than tokens: some drafts accepted
    assert machine.serve([*sequence[:10], 77]) == 10  # the prompt and nine sampled tokens, drafts among them
    # the last position's KV was never computed (its token was sampled last): a plan that serves it is named
    machine.submit(prompt=(16, 1.0, [*sequence, 78], 1))
    name = f"r{machine.serial}"
    forged = Pass(name, 11, 1, (78,), (*rows["r1"][:11], 23), True)
    with pytest.raises(IntegrityError, match=f"attended_kv_is_the_requests: {name} .* reads position 10"):
        machine.run(Plan(passes=(forged,)), late=False)
