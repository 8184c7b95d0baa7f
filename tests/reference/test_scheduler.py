"""The reference scheduler, part by part: rows, queues, admission, chunking, aborts, both loop modes."""

from __future__ import annotations

import pytest

from radixspec.reference import CacheManager, HashModel, Scheduler, make_page_table
from radixspec.reference.decode import DecodeManager
from radixspec.reference.prefill import PrefillAdder, PrefillManager
from radixspec.reference.table import TableManager
from radixspec.spec.errors import InvalidRequestError, InvalidSizeError, KVCorruptionError
from radixspec.spec.requests import ChunkedReq, PendingReq, Req, SamplingParams, SchedulerConfig


def scheduler(**overrides: object) -> Scheduler:
    config = SchedulerConfig(page_size=2, num_pages=32, max_running_reqs=4, max_seq_len=40, max_extend_tokens=16)
    for name, value in overrides.items():
        setattr(config, name, value)
    return Scheduler(config, HashModel(eos_token_id=0, eos_per_mille=0))


def test_table_manager_hands_out_the_lowest_row_and_refuses_a_double_free() -> None:
    table = TableManager(3, make_page_table(3, 8))
    assert [table.allocate(), table.allocate()] == [0, 1]
    table.free(0)
    with pytest.raises(InvalidRequestError):
        table.free(0)
    assert table.available_size == 2


def test_decode_manager_keeps_admission_order() -> None:
    decode = DecodeManager(page_size=1)
    reqs = [Req([1], i, None, uid=uid, device_len=1, max_device_len=5) for i, uid in enumerate([7, 3, 5])]
    decode.filter_reqs(reqs)
    decode.filter_reqs(reversed(reqs))
    batch = decode.schedule_next_batch()
    assert batch is not None and [r.uid for r in batch.reqs] == [7, 3, 5]


def test_prefill_adder_rechecks_available_size_after_lock() -> None:
    manager = CacheManager(4, 1, make_page_table(2, 16))
    table = TableManager(2, manager.page_table)
    # cache [1, 2, 3] (3 evictable pages, 1 free)
    first = Req([1, 2, 3, 9], 0, manager.match_req(Req([1, 2, 3, 9], 0, None)), device_len=4)
    manager.lock(first.cache_handle)
    manager.allocate_paged([first])
    first.cached_len = 4
    manager.cache_req(first, finished=True)
    adder = PrefillAdder(token_budget=16, reserved_size=0, cache_manager=manager, table_manager=table)
    pending = PendingReq(1, [1, 2, 3, 5, 6], SamplingParams(max_tokens=1))
    # before lock: needs 2 pages of 4 available; after locking [1 2 3]: 1 available
    assert adder.try_add_one(pending) is None
    assert manager.prefix_cache.size_info.protected_size == 0  # the lock was undone
    assert table.available_size == 2


def test_a_chunked_request_goes_back_to_the_head_of_the_queue() -> None:
    manager = CacheManager(32, 1, make_page_table(4, 64))
    table = TableManager(4, manager.page_table)
    prefill = PrefillManager(manager, table, DecodeManager(1))
    prefill.add_one_req(PendingReq(1, list(range(1, 21)), SamplingParams(max_tokens=2)))
    prefill.add_one_req(PendingReq(2, [5, 6], SamplingParams(max_tokens=2)))
    batch = prefill.schedule_next_batch(prefill_budget=8)
    assert batch is not None and [(r.uid, r.extend_len) for r in batch.reqs] == [(1, 8)]
    assert [p.uid for p in prefill.pending_list] == [1, 2]


def test_admission_is_first_come_first_served() -> None:
    s = scheduler(num_pages=8, max_seq_len=16)
    s.add_request(1, [1] * 11, max_tokens=2)  # 6 pages
    s.add_request(2, [2] * 9, max_tokens=2)  # 5 pages: does not fit beside request 1
    s.add_request(3, [3], max_tokens=2)  # would fit, but may not overtake request 2
    report = s.step()
    assert [uid for uid, _ in report.scheduled] == [1]


@pytest.mark.parametrize(
    ("uid", "prompt", "max_tokens", "error"),
    [
        (1, [], 4, InvalidRequestError),
        (0, [1, 2], 4, InvalidRequestError),  # uid 0 already exists
        (1, [1] * 40, 4, InvalidRequestError),  # no room in max_seq_len
        (1, [1, 2], 0, InvalidSizeError),
    ],
)
def test_bad_requests_are_rejected_with_nothing_changed(
    uid: int, prompt: list[int], max_tokens: int, error: type
) -> None:
    s = scheduler()
    s.add_request(0, [1, 2, 3])
    with pytest.raises(error):
        s.add_request(uid, prompt, max_tokens)
    assert list(s.status) == [0] and [p.uid for p in s.prefill_manager.pending_list] == [0]


def test_a_request_that_can_never_fit_the_pool_is_rejected() -> None:
    s = scheduler(num_pages=4, max_seq_len=40)
    with pytest.raises(InvalidRequestError, match="could never run"):
        s.add_request(1, [1] * 20, max_tokens=4)


def test_max_tokens_is_clipped_to_the_room_left_in_a_row() -> None:
    s = scheduler(max_seq_len=10)
    assert s.add_request(1, [1] * 7, max_tokens=50) == 3
    s.run_until_idle()
    assert len(s.outputs[1]) == 3


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_at_every_stage_frees_everything_exactly_once(overlap: bool) -> None:
    s = scheduler(overlap=overlap, max_extend_tokens=4)
    for uid in range(4):
        s.add_request(uid, [1, 2, 3, 4, 5, 6, 7, 8, 9, uid + 10], max_tokens=6, ignore_eos=True)
    s.step()  # request 0 chunked (4 of 10 tokens)
    assert s.abort(0)
    s.step()
    s.step()
    assert s.abort(1)  # in flight in overlap mode
    assert s.abort(3)  # still waiting
    assert not s.abort(3)
    s.run_until_idle()
    s.check_integrity()
    assert s.status == {0: "aborted", 1: "aborted", 2: "finished", 3: "aborted"}
    assert s.cache_manager.prefix_cache.size_info.protected_size == 0
    assert len(s.cache_manager.free_slots) + len(s.cache_manager.prefix_cache.abstract_state().entries) == 32


def test_an_abort_of_a_request_finishing_in_the_in_flight_batch_frees_it_once() -> None:
    s = scheduler(overlap=True)
    s.add_request(1, [4, 5, 6], max_tokens=1)
    s.step()  # batch 1 in flight: its only token finishes request 1
    assert s.abort(1)
    s.step()  # processes batch 1: finishes and frees request 1; the abort must not free it again
    s.run_until_idle()
    s.check_integrity()
    assert s.status[1] == "aborted" and not s.live


def test_overlap_mode_keeps_the_last_token_of_a_request_that_runs_out_of_max_tokens() -> None:
    # Found while building the scheduler: judging `finished` by req.can_decode at processing time
    # saw the state one batch ahead in overlap mode, dropped the last token and freed early.
    outputs = {}
    for overlap in (False, True):
        s = scheduler(overlap=overlap)
        s.add_request(1, [4, 5, 6], max_tokens=3, ignore_eos=True)
        s.run_until_idle()
        outputs[overlap] = s.outputs[1]
    assert len(outputs[True]) == 3 and outputs[True] == outputs[False]


def test_a_corrupted_page_table_is_caught_by_the_hash_model() -> None:
    s = scheduler()
    s.add_request(1, [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)
    s.step()
    req = s.live[1]
    s.page_table[req.table_idx][0] = s.page_table[req.table_idx][2]  # position 0 now reads position 2's slot
    with pytest.raises(KVCorruptionError):
        s.step()


def test_shared_prefixes_give_the_same_tokens_as_no_sharing() -> None:
    prompts = {uid: [9, 9, 8, 8, 7, 7] + [uid + 1] * (uid % 3 + 1) for uid in range(8)}
    outputs = {}
    for cache_type in ("radix", "naive"):
        s = scheduler(cache_type=cache_type, num_pages=64)
        for uid, prompt in prompts.items():
            s.add_request(uid, prompt, max_tokens=5)
        s.run_until_idle()
        outputs[cache_type] = s.outputs
        if cache_type == "radix":
            assert s.stats.prefix_hit_tokens > 0
    assert outputs["radix"] == outputs["naive"]


def test_a_chunk_that_is_not_the_last_is_never_decoded_nor_sampled() -> None:
    chunk = ChunkedReq(input_ids=[1, 2, 3], table_idx=0, cache_handle=None)
    assert not chunk.can_decode
    with pytest.raises(AssertionError, match="^a ChunkedReq is never sampled$"):
        chunk.append_host(7)
    assert chunk.input_ids == [1, 2, 3]
