"""Findings 15 and 32 found again by a ten-minute ``vllm-mamba`` campaign (2026-12-07, seed 21, at e190b1e), each
replayed from the unshrunk program the campaign wrote. Triaged 2026-12-07: each program keeps every law once the
finding's cause alone is taken out of the code (vLLM's lookup, the scheduler's split), and fails without it.

* seed 586989115, ``F+W+M, unit below P, partial_hits=False, checkpoints=True, eagle=drop, retention=3P`` (pages of
  16, a window of 8): vLLM hit 496 of 818 tokens where the pool's cached blocks give no valid match. The pool caches
  the full group's entries past 512, the window's at 496 but not at 512, the Mamba state at 496 only: the window's
  drop is proved at a longer length, Mamba cuts the length to 496 and is marked verified though it dropped nothing,
  so the window is asked at 496 without the drop. **Finding 15** (the campaign had stopped on it after 505 s once
  before); the target now counts it (``MambaGroup.took_finding_15``) and the campaign goes on.
* seed 248531560, ``F+M, unit below P, partial_hits=True, checkpoints=True, eagle=lookahead, retention=2P`` (pages
  of 16): request 65 hits 624 tokens from block 58, a copy on write of a hit at 622 that the pool caches under the
  624-token hash. **Finding 32**, seen from a request: a burst served the request that cached the block and the one
  that hit it in one step, so the target's mark, applied to cached entries at each check, never saw the block; the
  mark now applies where a request resumes from a cached block too (``MambaGroup.took_finding_32``).
"""

from __future__ import annotations

import importlib.util
import inspect
import textwrap
from collections.abc import Callable

import pytest

from radixspec.fuzz.regression import build_machine
from radixspec.fuzz.stats import STATS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

FIRST_LAW = "hit_is_the_longest_valid_match: request 32 hit 496 of 818 tokens; by"
SECOND_LAW = (
    "state_resumes_from_its_prefix: request 65 .* holds the state of 622 tokens, not the state of its first 624"
)


def uncounted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target stops on findings 15 and 32 instead of counting them."""
    from radixspec.fuzz.targets.vllm_mamba import MambaGroup

    built = MambaGroup.__init__

    def without_marks(self: MambaGroup, checkpoints: bool) -> None:
        built(self, checkpoints)
        self.known_partial_checkpoint = self.known_eagle_verified = False

    monkeypatch.setattr(MambaGroup, "__init__", without_marks)


def counted(finding: str) -> Callable[[], int]:
    from radixspec.fuzz.targets import vllm_mamba

    key = f"vllm-mamba.known: {getattr(vllm_mamba, finding)}"
    return lambda: STATS.rules[key]


def test_finding_15_found_again_is_counted_and_the_program_keeps_every_other_law() -> None:
    seen = counted("FINDING_15")
    before = seen()
    replay_seed_586989115()
    assert seen() > before


def test_finding_15_found_again_breaks_the_hit_law_uncounted(monkeypatch: pytest.MonkeyPatch) -> None:
    uncounted(monkeypatch)
    with pytest.raises(AssertionError, match=FIRST_LAW):
        replay_seed_586989115()


def test_finding_15_found_again_is_finding_15s_cause_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncounted, with vLLM's lookup compiled without finding 15's cause, every law holds."""
    from radixspec.fuzz.targets.vllm_mamba import import_mamba, lookup_without_finding_15

    import_mamba()
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    fixed = lookup_without_finding_15(HybridKVCacheCoordinator.find_longest_cache_hit)
    assert fixed is not None, "vLLM's lookup no longer reads as 0.33.0's"
    uncounted(monkeypatch)
    monkeypatch.setattr(HybridKVCacheCoordinator, "find_longest_cache_hit", fixed)
    replay_seed_586989115()


def test_finding_15_counted_does_not_hide_a_window_group_that_forgets_the_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted, a bug of another cause still breaks the hit law: the window group's finder planted to ignore EAGLE's
    drop lengthens the hit in vLLM's lookup and in the lookup without finding 15's cause alike."""
    from radixspec.fuzz.targets.vllm_mamba import import_mamba

    import_mamba()
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    finder = SlidingWindowManager.find_longest_cache_hit.__func__

    def forgets_the_drop(cls: type, *args: object, **kwargs: object) -> object:
        return finder(cls, *args, **{**kwargs, "drop_eagle_block": False})

    monkeypatch.setattr(SlidingWindowManager, "find_longest_cache_hit", classmethod(forgets_the_drop))
    with pytest.raises(AssertionError, match="hit_is_the_longest_valid_match: request 30 hit 512 of 946 tokens"):
        replay_seed_586989115()


def test_finding_32_seen_from_a_request_is_counted() -> None:
    seen = counted("FINDING_32")
    before = seen()
    replay_seed_248531560()
    assert seen() > before


def test_finding_32_seen_from_a_request_breaks_the_state_law_uncounted(monkeypatch: pytest.MonkeyPatch) -> None:
    uncounted(monkeypatch)
    with pytest.raises(AssertionError, match=SECOND_LAW):
        replay_seed_248531560()


def test_finding_32_seen_from_a_request_is_finding_32s_cause_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncounted, with the scheduler's split keeping the stop at the next block boundary when a chunk starts inside
    a block, internal checkpoint or not (the fix the report proposes), every law holds."""
    from radixspec.fuzz.targets import vllm_mamba

    source = textwrap.dedent(inspect.getsource(vllm_mamba.MambaGroup.aligned_split))
    cause = "(start // p + 1) * p if start % p and not internal else 0,"
    assert source.count(cause) == 1
    namespace = dict(vars(vllm_mamba))
    exec(
        compile(source.replace(cause, "(start // p + 1) * p if start % p else 0,"), vllm_mamba.__file__, "exec"),
        namespace,
    )
    uncounted(monkeypatch)
    monkeypatch.setattr(vllm_mamba.MambaGroup, "aligned_split", namespace["aligned_split"])
    replay_seed_248531560()


def replay_seed_586989115() -> None:
    """The unshrunk program of batch seed 586989115."""
    state = build_machine("hybrid", targets=("vllm-mamba",), lru=None, device="cpu")()
    hybrid_seqs_0, hybrid_seqs_1 = state.setup(
        page_size=16, first=[([], []), ([6, 5, 7, 1, 1, 4], [2, 1, 1, 0])], windows=[(1, 8), (2, 33)], num_pages=253
    )
    state.caches_agree()
    state.managers_keep_the_laws()
    hybrid_seqs_2 = state.new_seq(base=hybrid_seqs_0, keep=True, pages=[5, 0, 5, 2, 0, 1], tail=[3])
    state.caches_agree()
    state.managers_keep_the_laws()
    hybrid_seqs_3 = state.long_seq(base=hybrid_seqs_1, salt=2, tokens=256)
    state.caches_agree()
    state.managers_keep_the_laws()
    hybrid_seqs_4 = state.long_seq(base=hybrid_seqs_0, salt=7, tokens=512)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.long_seq(base=hybrid_seqs_1, salt=4, tokens=512)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="multi-turn", pages=4, pick=57)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_request(extra=[0, 1, 1], namespace=None, tokens=hybrid_seqs_3)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.decode(token=0, which=29)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_request(extra=[3], namespace=None, tokens=hybrid_seqs_2)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_running(answer=2, which=27)
    state.caches_agree()
    state.managers_keep_the_laws()
    hybrid_seqs_6 = state.long_seq(base=hybrid_seqs_0, salt=2, tokens=64)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=10, which=22)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="document", pages=1, pick=26)
    state.caches_agree()
    state.managers_keep_the_laws()
    hybrid_seqs_7 = state.new_seq(base=hybrid_seqs_0, keep=False, pages=[0, 5, 5, 4, 4, 4], tail=[1, 2, 0, 3])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=39, which=57)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_running(answer=3, which=53)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="multi-turn", pages=1, pick=46)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_seq(base=hybrid_seqs_3, keep=False, pages=[7, 2, 4, 5, 1, 2], tail=[0, 3, 0, 0])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_seq(base=hybrid_seqs_1, keep=False, pages=[1, 4, 2, 6, 2, 2], tail=[0])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="system prompt", pages=2, pick=46)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=8, which=19)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_running(answer=2, which=34)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.prefix_of(base=hybrid_seqs_7, cut=179)
    state.caches_agree()
    state.managers_keep_the_laws()
    hybrid_seqs_11 = state.long_seq(base=hybrid_seqs_0, salt=3, tokens=256)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.prefix_of(base=hybrid_seqs_2, cut=208)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_request(extra=[], namespace=("lora", 1), tokens=hybrid_seqs_11)
    state.caches_agree()
    state.managers_keep_the_laws()
    hybrid_seqs_13 = state.prefix_of(base=hybrid_seqs_7, cut=186)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_request(extra=[], namespace=None, tokens=hybrid_seqs_11)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.decode(token=1, which=11)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=2048, which=60)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_running(answer=0, which=2)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="agent tree", pages=3, pick=10)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="document", pages=4, pick=55)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=True, which=41)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_seq(base=hybrid_seqs_2, keep=False, pages=[2, 5, 6, 6, 6, 2], tail=[0, 3, 0])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=14, which=20)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=False, which=46)
    state.caches_agree()
    state.managers_keep_the_laws()
    hybrid_seqs_15 = state.long_seq(base=hybrid_seqs_11, salt=7, tokens=64)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_seq(base=hybrid_seqs_13, keep=False, pages=[5, 5, 4], tail=[])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=True, which=27)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_seq(base=hybrid_seqs_0, keep=False, pages=[7, 7], tail=[])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.decode(token=2, which=48)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=True, which=62)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_running(answer=2, which=34)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_seq(base=hybrid_seqs_3, keep=False, pages=[7, 0], tail=[1, 3, 1, 3])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="document", pages=2, pick=62)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_running(answer=2, which=24)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=64, kind="multi-turn", pages=64, pick=16)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_request(extra=[], namespace=None, tokens=hybrid_seqs_0)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="few-shot", pages=16, pick=48)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="multi-turn", pages=1, pick=19)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.long_seq(base=hybrid_seqs_0, salt=2, tokens=512)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_running(answer=3, which=54)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_seq(base=hybrid_seqs_11, keep=False, pages=[6], tail=[3])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.prefix_of(base=hybrid_seqs_6, cut=24)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_request(extra=[3, 0, 0], namespace=("lora", 1), tokens=hybrid_seqs_3)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.long_seq(base=hybrid_seqs_15, salt=7, tokens=512)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_running(answer=3, which=14)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_request(extra=[2, 1, 1], namespace=None, tokens=hybrid_seqs_4)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=True, which=2)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.prefix_of(base=hybrid_seqs_3, cut=65)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="system prompt", pages=4, pick=32)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=11, which=43)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.new_seq(base=hybrid_seqs_0, keep=True, pages=[7, 4, 7, 3, 6], tail=[1, 2, 0, 3])
    state.caches_agree()
    state.managers_keep_the_laws()
    state.long_seq(base=hybrid_seqs_2, salt=0, tokens=256)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="few-shot", pages=16, pick=13)
    state.teardown()


def replay_seed_248531560() -> None:
    """The unshrunk program of batch seed 248531560."""
    state = build_machine("hybrid", targets=("vllm-mamba",), lru=None, device="cpu")()
    _hybrid_seqs_0, _hybrid_seqs_1, _hybrid_seqs_2 = state.setup(
        first=[([0], [1, 1]), ([2, 5, 6, 1], [2]), ([1, 7, 2, 6], [])],
        num_pages=280,
        page_size=16,
        windows=[None, None, None],
    )
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="few-shot", pages=4, pick=43)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="agent tree", pages=3, pick=12)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="multi-turn", pages=3, pick=50)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=16, kind="tenants", pages=64, pick=21)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=10, which=51)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="multi-turn", pages=4, pick=15)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=64, kind="few-shot", pages=1, pick=35)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=2048, which=55)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=64, kind="few-shot", pages=16, pick=47)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="few-shot", pages=4, pick=15)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="system prompt", pages=4, pick=17)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=False, which=45)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=True, which=30)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=False, which=0)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="agent tree", pages=1, pick=10)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=30, which=58)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=True, which=30)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="agent tree", pages=4, pick=15)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="tenants", pages=1, pick=38)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=False, which=50)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=8, which=14)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="system prompt", pages=4, pick=41)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=32, which=50)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="few-shot", pages=2, pick=15)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="few-shot", pages=64, pick=62)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=True, which=57)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="few-shot", pages=4, pick=51)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="document", pages=2, pick=6)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="agent tree", pages=2, pick=59)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="system prompt", pages=2, pick=7)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="system prompt", pages=3, pick=21)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=64, kind="agent tree", pages=1, pick=13)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="agent tree", pages=1, pick=61)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="document", pages=4, pick=53)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="document", pages=4, pick=12)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="few-shot", pages=3, pick=32)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=4, kind="document", pages=4, pick=11)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=64, kind="system prompt", pages=16, pick=58)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="document", pages=1, pick=8)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.cache_req(finished=True, which=63)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=256, which=62)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="tenants", pages=1, pick=52)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=15, which=6)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=16, kind="multi-turn", pages=1, pick=31)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=256, which=26)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=8, which=21)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.workload_request(kind="tenants", pages=2, pick=36)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.allocate_and_store(tokens=23, which=25)
    state.caches_agree()
    state.managers_keep_the_laws()
    state.serve_burst(count=16, kind="multi-turn", pages=4, pick=38)
    state.teardown()
