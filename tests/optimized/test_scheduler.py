"""The optimized scheduler: same batches and tokens as the reference, tensors on its device."""

import inspect
from typing import Any

import pytest
import torch

from radixspec import optimized, reference
from radixspec.spec.errors import IntegrityError, InvalidRequestError, KVCorruptionError
from radixspec.spec.requests import RequestSpec, SchedulerConfig


def workload() -> list[RequestSpec]:
    system = [5, 6, 7, 8, 9, 10, 11, 12]
    return [
        RequestSpec(
            uid, system + [uid + 20] * (uid % 5 + 1), max_tokens=uid % 7 + 1, namespace=(None if uid % 3 else ("t", 1))
        )
        for uid in range(24)
    ]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_optimized_engine_matches_the_reference_step_for_step(overlap: bool, page_size: int) -> None:
    config = SchedulerConfig(
        page_size=page_size,
        num_pages=64 // page_size + 8,
        max_running_reqs=4,
        max_seq_len=32,
        max_extend_tokens=24,
        overlap=overlap,
    )
    ref = reference.Engine(config)
    fast = optimized.Engine(config)
    for spec in workload():
        for engine in (ref, fast):
            engine.scheduler.add_request(spec.uid, spec.input_ids, spec.max_tokens, spec.ignore_eos, spec.namespace)
    while not ref.scheduler.idle:
        assert ref.scheduler.step() == fast.scheduler.step()
        fast.scheduler.check_integrity()
    assert fast.scheduler.idle
    assert ref.scheduler.outputs == fast.scheduler.outputs
    assert ref.scheduler.stats == fast.scheduler.stats


def test_batch_tensors_are_built_without_a_loop_over_tokens() -> None:
    config = SchedulerConfig(page_size=2, num_pages=32, max_running_reqs=2, max_seq_len=32, max_extend_tokens=32)
    engine = optimized.Engine(config)
    engine.scheduler.add_request(1, [3, 4, 5, 6, 7], max_tokens=2)
    engine.scheduler.add_request(2, [8, 9], max_tokens=2)
    batch = engine.scheduler.prefill_manager.schedule_next_batch(32)
    assert batch is not None
    engine.scheduler._prepare_batch(batch)
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert batch.input_ids.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert batch.out_loc.dtype == torch.int32 and batch.out_loc.numel() == 7


def test_the_vectorized_hash_arithmetic_is_the_spec_s_bit_for_bit() -> None:
    import random

    from radixspec.optimized.model import as_signed, kv_words_tensor, mix64_tensor
    from radixspec.spec.hashing import compute_kv_words, mix64

    rnd = random.Random(5)
    values = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1] + [rnd.getrandbits(64) for _ in range(2000)]
    signed = torch.tensor([as_signed(v) for v in values], dtype=torch.int64)
    assert [v & ((1 << 64) - 1) for v in mix64_tensor(signed).tolist()] == [mix64(v) for v in values]
    for layer in (0, 1, 7):
        words = kv_words_tensor(signed, layer).view(-1, 4).to(torch.int64).tolist()
        assert [tuple(w) for w in words] == [compute_kv_words(v, layer) for v in values]


def test_engine_generate_is_the_reference_run_and_checks_every_k_steps() -> None:
    # a small pool (evictions), two namespaces, EOS honoured by odd uids only
    config = SchedulerConfig(page_size=2, num_pages=24, max_running_reqs=4, max_seq_len=48, max_extend_tokens=24)
    system = [5, 6, 7, 8, 9, 10, 11, 12]
    requests = [
        RequestSpec(
            uid,
            system + [uid + 20] * (uid % 5 + 1),
            max_tokens=uid % 7 + 4,
            ignore_eos=uid % 2 == 0,
            namespace=None if uid % 3 else ("t", 1),
        )
        for uid in range(24)
    ]
    expected = reference.Engine(config).generate(requests)
    engine = optimized.Engine(config)
    checked = []
    check = engine.scheduler.check_integrity

    def counting_check() -> None:
        checked.append(engine.scheduler.stats.steps)
        check()

    engine.scheduler.check_integrity = counting_check  # type: ignore[method-assign]
    result = engine.generate(requests, check_every=5)
    fields = ("outputs", "stats", "evicted_pages", "cache")
    assert [getattr(result, f) for f in fields] == [getattr(expected, f) for f in fields]
    assert result.evicted_pages > 0 and result.cache.total.pages_evicted > 0
    stopped_at_eos = [r.uid for r in requests if len(result.outputs[r.uid]) < r.max_tokens]
    assert stopped_at_eos and all(uid % 2 for uid in stopped_at_eos)
    steps = result.stats.steps
    assert checked == [*range(5, steps + 1, 5), steps]


@pytest.mark.parametrize("position", [0, 1])
def test_a_corrupted_row_is_named_by_request_position_and_slot(position: int) -> None:
    # found by tox -e mutation: the optimized model named the slot of the batch's first request, not the
    # corrupted one (it indexed the batch's reads by the position within the request)
    config = SchedulerConfig(page_size=1, num_pages=64, max_running_reqs=2, max_seq_len=32, max_extend_tokens=32)
    messages = []
    for engine in (reference.Engine(config), optimized.Engine(config)):
        scheduler = engine.scheduler
        scheduler.add_request(1, [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)
        scheduler.add_request(2, [6, 7, 8, 9], max_tokens=4, ignore_eos=True)
        scheduler.step()
        row = scheduler.page_table[scheduler.live[2].table_idx]
        slot = int(row[3])
        row[position] = slot  # request 2's position now reads its position 3's slot
        with pytest.raises(KVCorruptionError) as error:
            while True:
                scheduler.step()
        messages.append(str(error.value))
    expected = f"request 2: position {position} reads slot {slot} (layer 0), which holds another sequence's K/V"
    assert messages == [expected] * 2


def test_a_slot_whose_k_alone_is_wrong_is_caught() -> None:
    config = SchedulerConfig(page_size=1, num_pages=64, max_running_reqs=2, max_seq_len=32, max_extend_tokens=32)
    engine = optimized.Engine(config)
    scheduler = engine.scheduler
    scheduler.add_request(1, [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)
    scheduler.step()
    slot = int(scheduler.page_table[scheduler.live[1].table_idx][2])
    engine.model.pool.k_cache(1)[slot] += 1  # layer 1's K of position 2; its V untouched
    with pytest.raises(KVCorruptionError, match=f"^request 1: position 2 reads slot {slot} \\(layer 1\\)"):
        scheduler.step()


def test_the_optimized_model_has_the_reference_models_defaults() -> None:
    def defaults(function: object) -> dict[str, object]:
        parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
        return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}

    shared = defaults(reference.HashModel.__init__)
    assert {name: defaults(optimized.HashModel.__init__)[name] for name in shared} == shared


def test_the_tensor_table_hands_out_and_takes_back_rows_as_the_reference_does() -> None:
    from radixspec.optimized.table import TableManager as Fast
    from radixspec.reference.table import TableManager as Slow

    fast = Fast(2, torch.zeros(2, 8, dtype=torch.int32))  # 2 rows of 8 positions: shape[0] != shape[1]
    slow = Slow(2, [[0] * 8 for _ in range(2)])
    for table in (fast, slow):
        assert [table.allocate(), table.allocate(), table.available_size] == [0, 1, 0]
        with pytest.raises(InvalidRequestError, match=r"^no free request slot \(max_running_reqs reached\)$"):
            table.allocate()
        table.free(1)
        for bad in (1, 2, -1, 7):  # already free, past the rows (but inside a row's positions), negative
            with pytest.raises(InvalidRequestError, match=f"^row {bad} is not held by a request$"):
                table.free(bad)
        assert table.free_slots == [1]
    fast.write_tokens(0, 2, [7, 8, 9])
    fast.write_tokens(0, 5, torch.tensor([4], dtype=torch.int64))
    assert fast.token_pool[0].tolist() == [0, 0, 7, 8, 9, 4, 0, 0] and fast.token_pool.dtype == torch.int32


def test_both_models_check_the_same_positions_and_share_their_defaults() -> None:
    config = SchedulerConfig(page_size=2, num_pages=64, max_running_reqs=3, max_seq_len=32, max_extend_tokens=8)
    requests = [RequestSpec(uid, [1, 2, 3, uid + 4], max_tokens=3 + uid, ignore_eos=True) for uid in range(4)]
    engines = [reference.Engine(config), optimized.Engine(config)]
    for engine in engines:
        engine.generate(requests)
    checked = [engine.model.positions_checked for engine in engines]
    # every step reads each running request's whole sequence: prefills in chunks of 8, then decodes
    assert checked[0] == checked[1] > sum(len(r.input_ids) + r.max_tokens for r in requests)
    defaults = {"num_layers": 2, "vocab_size": 1000, "eos_token_id": 0, "eos_per_mille": 50}
    for model in (reference.HashModel, optimized.HashModel):
        parameters = inspect.signature(model).parameters
        assert {name: parameters[name].default for name in defaults} == defaults
        assert model is optimized.HashModel or model().positions_checked == 0
    assert optimized.HashModel(4, 2).positions_checked == 0


def test_the_optimized_model_extends_a_rows_hashes_instead_of_recomputing_them() -> None:
    config = SchedulerConfig(page_size=1, num_pages=64, max_running_reqs=2, max_seq_len=32, max_extend_tokens=32)
    engine = optimized.Engine(config)
    scheduler = engine.scheduler
    scheduler.add_request(1, [1, 2, 3], max_tokens=5, ignore_eos=True)
    scheduler.step()
    row = scheduler.live[1].table_idx
    kept = engine.model.rows[row]
    assert kept.uid == 1 and len(kept.hashes) == 3
    scheduler.step()
    assert engine.model.rows[row] is kept and len(kept.hashes) == 4  # one new position hashed


def test_a_batch_whose_input_ids_are_not_the_token_pool_is_refused() -> None:
    config = SchedulerConfig(page_size=1, num_pages=64, max_running_reqs=2, max_seq_len=32, max_extend_tokens=32)
    engine = optimized.Engine(config)
    forward = engine.model.forward

    def corrupted(batch: Any, page_table: torch.Tensor, token_pool: torch.Tensor) -> list[int]:
        batch.input_ids = batch.input_ids.clone()
        batch.input_ids[-1] += 1
        return forward(batch, page_table, token_pool)

    engine.model.forward = corrupted  # type: ignore[method-assign]
    engine.scheduler.add_request(1, [1, 2, 3], max_tokens=2, ignore_eos=True)
    with pytest.raises(IntegrityError) as error:
        engine.scheduler.step()
    assert str(error.value) == "batch input ids do not match the token pool"


def test_the_engines_take_the_configs_eos_and_cache_type() -> None:
    base = dict(page_size=2, num_pages=64, max_running_reqs=3, max_seq_len=48, max_extend_tokens=16)
    requests = [RequestSpec(uid, [uid + 1, 2, 3, 4, 5], max_tokens=30) for uid in range(3)]
    for eos in (0, 7, 311):
        config = SchedulerConfig(**base, eos_token_id=eos)  # type: ignore[arg-type]
        engine = optimized.Engine(config)
        assert engine.config is config and engine.model.eos_token_id == eos
        assert engine.generate(requests).outputs == reference.Engine(config).generate(requests).outputs
    naive = optimized.Engine(SchedulerConfig(**base, cache_type="naive"))  # type: ignore[arg-type]
    assert type(naive.scheduler.cache_manager.prefix_cache) is optimized.NaivePrefixCache
    model = optimized.HashModel(4, 2)
    assert (model.num_layers, model.vocab_size, model.eos_token_id, model.eos_per_mille) == (2, 1000, 0, 50)
