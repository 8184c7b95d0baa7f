"""The optimized scheduler: same batches and tokens as the reference, tensors on its device."""

import pytest
import torch

import optimized
import reference
from spec.types import RequestSpec, SchedulerConfig


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

    from optimized.model import as_signed, kv_words_tensor, mix64_tensor
    from spec.hashing import compute_kv_words, mix64

    rnd = random.Random(5)
    values = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1] + [rnd.getrandbits(64) for _ in range(2000)]
    signed = torch.tensor([as_signed(v) for v in values], dtype=torch.int64)
    assert [v & ((1 << 64) - 1) for v in mix64_tensor(signed).tolist()] == [mix64(v) for v in values]
    for layer in (0, 1, 7):
        words = kv_words_tensor(signed, layer).view(-1, 4).to(torch.int64).tolist()
        assert [tuple(w) for w in words] == [compute_kv_words(v, layer) for v in values]
