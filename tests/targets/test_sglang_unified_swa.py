"""The ``sglang-swa`` target: SGLang 0.5.23's UnifiedRadixCache with FULL and SWA over its SWA allocator, on
both tree cores, through the scheduler's lifecycle at page sizes above and below the window. Each check is
seen catching a bug planted by monkeypatch in the path it guards; each case runs in a process of its own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .test_sglang_unified import assert_caught, assert_clean, run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")

LIFECYCLE = """
from radixspec.fuzz.targets.sglang_unified_swa import swa_manager
from radixspec.reference.hybrid_manager import HybridReq
manager = swa_manager(2, 64, {core!r}, "lru", 4, False, {out_of_window})
prompt = list(range(100, 140))
a = HybridReq(0, prompt + [1], None)
manager.match_req(a)
manager.allocate_paged(a, 16)
manager.store(a, 16)
manager.cache_req(a, False)            # a chunk of 16 tokens: checkpointed
manager.check_integrity([a])
print("chunk", sum(s is not None for s in a.rows[1]))
manager.allocate_paged(a, 41)
manager.store(a, 25)
a.input_ids.append(5)                  # decoding: the window's passed slots are freed before the next token
manager.allocate_paged(a, 42)
manager.store(a, 1)
manager.check_integrity([a])
print("decode", sum(s is not None for s in a.rows[1]))
manager.cache_req(a, True)
b = HybridReq(1, prompt + [2], None)
manager.match_req(b)
manager.check_integrity([b])
print("hit", b.cached_len)
manager.cache_req(b, True)
manager.check_integrity([])
print("pools", *[x for pool in manager.pools([]) for x in pool[1:4]])
"""


@pytest.mark.parametrize("core", ["rust", "python"])
@pytest.mark.parametrize("out_of_window", [True, False])
def test_a_running_request_frees_its_window_and_a_finished_one_is_matched_within_it(
    core: str, out_of_window: bool
) -> None:
    """P = 2, W = 4: a checkpoint at 16 tokens keeps the SWA of the last 3 pages (the window rounded up to pages,
    behind the key's last token), or all 8 with the switch off; decoding at 41 tokens frees what the window
    passed since; the next request hits 40 tokens over the window the first left live."""
    out = run(LIFECYCLE.format(core=core, out_of_window=out_of_window))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # SWA pages live: after the chunk; in decode (the tree's prefix and the request's own); free and cached after
    chunk, decode, swa = ("3", "6", ["42", "6"]) if out_of_window else ("8", "11", ["37", "11"])
    assert out.stdout.split() == ["chunk", chunk, "decode", decode, "hit", "40", "pools", "43", "21", "0", *swa, "0"]


# bugs planted in SGLang's code, each in the path one check guards
PLANTS = {
    # the out-of-window free runs one window ahead: slots the next query attends are freed
    "attended_pages_are_held": """
common = importlib.import_module("sglang.srt.mem_cache.common")
swa = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.swa")
free = common.free_swa_out_of_window_slots
def early(req, pre_len, **kwargs):
    return free(req, pre_len + kwargs["sliding_window_size"], **kwargs)
common.free_swa_out_of_window_slots = swa.free_swa_out_of_window_slots = early
""",
    # the match reports one page more than the tree holds
    "hit_is_a_valid_match": """
urc = sys.modules["sglang.__radixspec_swa__"].urc
match = urc.UnifiedRadixCache.match_prefix
def long(self, params):
    result = match(self, params)
    if result.device_prefix_len + self.page_size <= len(params.key):
        return result._replace(device_prefix_len=result.device_prefix_len + self.page_size)
    return result
urc.UnifiedRadixCache.match_prefix = long
""",
    # the SWA pool's own allocator keeps every third set of window slots it is given back
    "SWA pages_are_partitioned": """
swa = sys.modules["sglang.__radixspec_swa__"].swa
init = swa.SWATokenToKVPoolAllocator.__init__
def planted(self, *args, **kwargs):
    init(self, *args, **kwargs)
    inner, calls = self.swa_attn_allocator, [0]
    for name in ("free", "free_page_ids"):
        if hasattr(inner, name):
            def leaky(indices, original=getattr(inner, name)):
                calls[0] += 1
                if calls[0] % 3:
                    original(indices)
            setattr(inner, name, leaky)
swa.SWATokenToKVPoolAllocator.__init__ = planted
""",
}


@pytest.mark.parametrize("law", sorted(PLANTS))
def test_each_check_catches_its_planted_bug(law: str, tmp_path: Path) -> None:
    assert_caught(law, PLANTS[law], "sglang-swa:python", tmp_path)


@pytest.mark.parametrize("target", ["sglang-swa", "sglang-swa:python"])
def test_a_clean_campaign_on_each_core(target: str, tmp_path: Path) -> None:
    assert_clean(target, tmp_path)


# shrunk from a sglang-swa:python campaign (seed 1): P = 4, out-of-window freeing on; a running request's
# checkpoint after a chunk of 31 tokens
FILL_IDS = """
from radixspec.fuzz.regression import build_machine
state = build_machine('hybrid', targets=({target!r},), lru=None, device='cpu')()
hybrid_seqs_0, hybrid_seqs_1 = state.setup(
    page_size=4, windows=[None, None], num_pages=25, first=[([0], [0, 0, 0, 0]), ([0, 4, 0], [0])]
)
state.new_request(extra=[0, 0], namespace=('lora', 1), tokens=hybrid_seqs_1)
hybrid_seqs_2 = state.long_seq(base=hybrid_seqs_1, salt=0, tokens=64)
hybrid_seqs_3 = state.long_seq(base=hybrid_seqs_2, salt=0, tokens=64)
hybrid_seqs_4 = state.prefix_of(base=hybrid_seqs_3, cut=99)
hybrid_seqs_5 = state.long_seq(base=hybrid_seqs_4, salt=0, tokens=64)
state.allocate_and_store(tokens=1, which=0)
state.allocate_and_store(tokens=4, which=0)
state.cache_req(finished=True, which=46)
hybrid_seqs_7 = state.prefix_of(base=hybrid_seqs_3, cut=141)
state.new_request(extra=[2], namespace=None, tokens=hybrid_seqs_5)
state.allocate_and_store(tokens=38, which=51)
hybrid_seqs_9 = state.long_seq(base=hybrid_seqs_7, salt=6, tokens=256)
state.new_request(extra=[], namespace=('lora', 1), tokens=hybrid_seqs_9)
state.allocate_and_store(tokens=31, which=5)
state.cache_req(finished=False, which=43)
state.teardown()
print("replayed")
"""


@pytest.mark.parametrize("target", ["sglang-swa", "sglang-swa:python"])
def test_the_out_of_window_free_reads_the_tokens_up_to_the_last_extend(target: str) -> None:
    """Regression: the request record's get_fill_ids gave the whole prompt, where SGLang's Req gives the tokens
    up to the last extend; SGLang's SWA component then freed out-of-window slots past the request's row, and its
    allocator asserted (more SWA slots free than it has). Now the record gives what SGLang's does."""
    out = run(FILL_IDS.format(target=target))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.split() == ["replayed"]


EMPTY_UNDER_EAGLE = """
from radixspec.fuzz.targets.sglang_unified_swa import swa_manager
from radixspec.reference.hybrid_manager import HybridReq
manager = swa_manager(2, 32, "rust", "lru", 4, True, True)
a = HybridReq(0, [5], None)      # the match reads no token: no bigram at all
manager.match_req(a)
manager.check_integrity([a])
print("hit", a.cached_len)
"""


def test_a_one_token_prompt_under_eagle_has_no_key_to_look_tombstones_up_in() -> None:
    """Regression (sglang-swa, seed 1): the hit check asked the Rust core for the SWA tombstones of the key's
    first -1 units (no token, under EAGLE one bigram less), and PyO3 raised OverflowError."""
    out = run(EMPTY_UNDER_EAGLE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.split() == ["hit", "0"]
