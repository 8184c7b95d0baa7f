"""Workload models (fuzz/workloads.py): prompts shaped as an engine's traffic, and the hybrid machine drawing them."""

from __future__ import annotations

from typing import Any

import pytest

from radixspec.fuzz.regression import build_machine
from radixspec.fuzz.sequences import NAMESPACE_PALETTE
from radixspec.fuzz.stats import STATS
from radixspec.fuzz.workloads import FIRST_TOKEN, IMAGE_TOKEN, TOKEN_SPAN, Kind, Workload, image_runs, tokens_of


def test_a_shared_part_is_the_same_for_its_seed_and_unlike_any_other() -> None:
    assert tokens_of(3, 1, 50) == tokens_of(3, 1, 50)
    assert tokens_of(3, 1, 50) != tokens_of(3, 2, 50) != tokens_of(4, 1, 50)
    assert all(FIRST_TOKEN <= token < FIRST_TOKEN + TOKEN_SPAN for token in tokens_of(9, 9, 500))


def test_each_kind_shares_its_prefix_and_ends_in_a_fresh_turn() -> None:
    workload = Workload.for_pool(seed=5, page_size=4, pool_tokens=1024)
    system = workload.system
    assert len(system) == 1024 // 8 + 2
    first, second = (workload.prompt(Kind.SYSTEM, 0, 2) for _ in range(2))
    assert first[: len(system)] == second[: len(system)] == system and first != second
    shot = workload.prompt(Kind.FEW_SHOT, 4, 1)
    assert (
        shot[: len(workload.templates[1])] == workload.templates[1] and workload.templates[1][: len(system)] == system
    )
    document = workload.prompt(Kind.DOCUMENT, 2, 1)
    assert document[: len(workload.documents[2])] == workload.documents[2]
    # no conversation yet: a multi-turn prompt starts one after the system prompt
    assert workload.prompt(Kind.MULTI_TURN, 0, 1)[: len(system)] == system
    answered = (*first, 1, 2, 3)
    workload.answered(answered)
    follow = workload.prompt(Kind.MULTI_TURN, 0, 1)
    assert follow[: len(answered)] == answered and len(follow) > len(answered)
    branch = workload.prompt(Kind.AGENT_TREE, 3, 1)
    # the branch cuts after the system prompt, at a point the pick chooses, then a fresh tool call
    cut = len(system) + 3 * 7 % (len(answered) - len(system) + 1)
    assert branch[:cut] == answered[:cut] and len(branch) > cut and set(branch[cut:]).isdisjoint(answered)
    for kind in Kind:
        assert all(len(workload.prompt(kind, pick, 4)) <= workload.budget for pick in range(10))


def test_a_vision_prompt_is_the_system_prompt_an_image_and_a_fresh_question() -> None:
    """Image k's placeholders are IMAGE_TOKEN + k; the images differ in length, start inside a page (after the system
    prompt's partial page) and here end inside one; ``image_runs`` finds each (the same image twice in a row is one
    run)."""
    workload = Workload.for_pool(seed=5, page_size=4, pool_tokens=1024)
    system = workload.system
    first, second = workload.prompt(Kind.VISION, 0, 1), workload.prompt(Kind.VISION, 1, 1)
    image = workload.images[0]
    assert first[: len(system)] == system and first[len(system) : len(system) + len(image)] == image
    assert image_runs(list(first)) == [(0, len(system), len(image))]
    assert image_runs(list(second)) == [(1, len(system), len(workload.images[1]))]
    assert len({len(image) for image in workload.images}) == len(workload.images)
    assert all((len(system) + len(image)) % 4 for image in workload.images) and len(system) % 4
    twice = [7, IMAGE_TOKEN + 2, IMAGE_TOKEN + 2, IMAGE_TOKEN + 3, 8]
    assert image_runs(twice) == [(2, 1, 2), (3, 3, 1)] and image_runs([1, 2, 3]) == []


def test_a_conversation_past_the_budget_keeps_the_system_prompt_and_its_newest_tokens() -> None:
    workload = Workload.for_pool(seed=1, page_size=16, pool_tokens=64)
    assert workload.budget == 16 and len(workload.system) == 16
    workload.answered(tuple(range(1, 40)))
    prompt = workload.prompt(Kind.MULTI_TURN, 0, 2)
    assert prompt[:16] == workload.system and len(prompt) == 17
    workload = Workload.for_pool(seed=1, page_size=4, pool_tokens=256)
    history = tuple(range(100, 180))
    workload.answered(history)
    prompt = workload.prompt(Kind.MULTI_TURN, 0, 1)
    assert len(prompt) == workload.budget and prompt[: len(workload.system)] == workload.system


def test_a_regenerated_prompt_is_an_earlier_prompt_whole_and_never_a_tenants() -> None:
    workload = Workload.for_pool(seed=2, page_size=4, pool_tokens=1024)
    first = workload.prompt(Kind.REGENERATE, 0, 1)  # nothing sent yet: a fresh prompt, then re-sent
    assert first[: len(workload.system)] == workload.system and len(first) > len(workload.system)
    assert workload.prompt(Kind.REGENERATE, 5, 1) == first
    tenant = workload.prompt(Kind.TENANTS, 0, 1)
    second = workload.prompt(Kind.DOCUMENT, 1, 2)
    assert workload.prompt(Kind.REGENERATE, 0, 1) == second and workload.prompt(Kind.REGENERATE, 1, 1) == first
    assert tenant not in workload.sent and workload.sent == [first, second]
    for i in range(20):
        workload.prompt(Kind.SYSTEM, i, 1)
    assert len(workload.sent) == 16 and first not in workload.sent


def test_conversations_keep_the_newest_sixteen() -> None:
    workload = Workload.for_pool(seed=1, page_size=1, pool_tokens=400)
    for i in range(20):
        workload.answered((i,))
    assert workload.conversations == [(i,) for i in range(4, 20)]


def served_first(kind: str, pages: int = 1) -> Any:
    """The hybrid machine over our reference (pages of 4, 256 of them) after one request of ``kind`` was served
    to its end (``serve_running``: prefilled whole, one token decoded, cached as finished)."""
    state = build_machine("hybrid", targets=("reference",), lru=None, device="cpu")()
    state.setup(page_size=4, num_pages=256, windows=[None], first=[([0], [])])
    state.workload_request(kind=kind, pick=0, pages=pages)
    state.serve_running(which=0, answer=2)
    assert not state.reqs and state.workload.conversations
    state.managers_keep_the_laws()
    return state


@pytest.mark.parametrize("kind", [kind.value for kind in Kind if kind != Kind.TENANTS])
def test_in_the_hybrid_machine_a_second_request_of_a_kind_hits_what_the_first_cached(kind: str) -> None:
    """The first request of ``kind`` runs to its end and is cached; the next one of that kind matches at least
    the system prompt's (or the template's, the document's, the conversation's) whole pages."""
    state = served_first(kind)
    before = STATS.hit_tokens, STATS.prompt_tokens
    state.workload_request(kind=kind, pick=0, pages=1)
    hit = STATS.hit_tokens - before[0]
    assert hit >= len(state.workload.system) // 4 * 4 > 0 and STATS.prompt_tokens > before[1]
    state.managers_keep_the_laws()
    state.teardown()


def test_in_the_hybrid_machine_another_tenants_request_never_hits_the_first_tenants_pages() -> None:
    state = served_first(Kind.SYSTEM.value)
    before = STATS.hit_tokens
    state.workload_request(kind=Kind.TENANTS.value, pick=0, pages=1)
    assert STATS.hit_tokens == before
    assert state.reqs[1][0].namespace == NAMESPACE_PALETTE[1]
    state.teardown()


def test_serve_running_runs_a_request_to_its_end_and_a_later_turn_of_its_conversation_hits_it() -> None:
    state = served_first(Kind.MULTI_TURN.value, pages=2)
    # its prompt (the system prompt and a turn of 7 tokens) and its answer (one token) open a conversation
    assert len(state.workload.conversations[0]) == len(state.workload.system) + 7 + 1
    before = STATS.hit_tokens
    state.workload_request(kind=Kind.MULTI_TURN.value, pick=0, pages=1)
    assert STATS.hit_tokens - before == len(state.workload.conversations[0]) // 4 * 4
    state.teardown()


def burst_machine(production: bool, num_pages: int) -> Any:
    """The hybrid machine over our reference, pages of 4, as a production batch builds it or not."""
    from radixspec.fuzz.machines import machine_for

    state = machine_for("hybrid", ("reference",), production=production)()
    state.setup(page_size=4, num_pages=num_pages, windows=[None], first=[([0], [])])
    return state


def test_a_burst_serves_its_requests_to_their_end_hot_and_leaves_none_running() -> None:
    """A burst in a production pool: 64 requests of one kind, the first served alone, the rest admitted together
    (running at once) and each served, up to BURST_TOKENS prompt tokens; all finished, the shared prefix hit by all
    but the first, a tree of hundreds of pages in one step; the laws hold after it, and the step counts once (its
    requests' rule calls each count as a call: the steps as counted before bursts)."""
    from radixspec.fuzz.hybrid_machine import BURST_TOKENS

    state = burst_machine(True, 4096)
    assert state.num_pages == 4096
    before = STATS.workload_hit_tokens, STATS.workload_tokens, STATS.steps, STATS.calls
    requests = STATS.rules["hybrid.workload[system prompt]"]
    state.serve_burst(kind="system prompt", pick=0, count=64, pages=16)
    state.managers_keep_the_laws()
    hit, asked = STATS.workload_hit_tokens - before[0], STATS.workload_tokens - before[1]
    assert not state.reqs and STATS.steps == before[2] + 1
    # the burst's call, then each request's: its arrival, its serving and its caching, at least
    requests = STATS.rules["hybrid.workload[system prompt]"] - requests
    assert requests >= 8 and STATS.calls - before[3] >= 1 + 3 * requests
    assert asked <= BURST_TOKENS + state.workload.budget and hit >= 0.5 * asked
    assert STATS.most_running_requests is not None and STATS.most_running_requests >= 8
    assert state.ours[0].cache.size_info(0).total_size // 4 >= 500


def test_a_burst_the_pool_has_no_room_for_is_aborted_and_the_request_running_before_it_runs_on() -> None:
    """A request running before the burst holds all but 24 of the pool's 1,024 pages: no request of the burst gets
    room for its prompt, so each is aborted at the end of the step (none left running), the pool's pages return
    and the request from before runs on, untouched."""
    from radixspec.fuzz.hybrid_machine import PRODUCTION_POOL

    state = burst_machine(True, PRODUCTION_POOL)
    state.new_request(tokens=tuple(range(10, 10 + 4000)), extra=[], namespace=None)
    (running,) = state.reqs
    state.allocate_and_store(0, 4000)
    assert state.reqs[running][0].computed == 4000
    uid = state.next_uid
    state.serve_burst(kind="system prompt", pick=0, count=16, pages=16)
    state.managers_keep_the_laws()
    assert state.next_uid - uid == 16  # all admitted, then aborted: none left running
    assert list(state.reqs) == [running] and state.reqs[running][0].computed == 4000
    assert len(state.ours[0].free_slots[0]) == 24 and state.ours[0].cache.size_info(0).total_size == 0


def test_below_production_a_burst_is_four_short_requests_and_no_pool_is_a_production_pool() -> None:
    state = burst_machine(False, 4096)
    assert 41 <= state.num_pages <= 400  # a production pool drawn outside a production batch: a big pool instead
    uid = state.next_uid
    state.serve_burst(kind="few-shot", pick=0, count=64, pages=64)
    assert state.next_uid - uid == 4 and not state.reqs
    assert burst_machine(True, 4096).num_pages == 4096
