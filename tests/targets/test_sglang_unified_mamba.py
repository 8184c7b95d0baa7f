"""The ``sglang-mamba`` target: SGLang 0.5.23's UnifiedRadixCache with FULL and MAMBA (recurrent states) on both
tree cores, through the scheduler's lifecycle. Each check is seen catching a bug planted by monkeypatch in the
path it guards; each case runs in a process of its own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .test_sglang_unified import assert_caught, assert_clean, run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")

LIFECYCLE = """
from radixspec.fuzz.targets.sglang_unified_mamba import mamba_manager
from radixspec.reference.hybrid_manager import HybridReq
m = mamba_manager(64, {core!r}, "lru", 6, -1)
prompt = list(range(100, 120))
a = HybridReq(0, prompt + [1], None)
m.match_req(a)
m.allocate_paged(a, 10)
m.store(a, 10)
m.cache_req(a, False)                  # a chunk of 10: the tree keeps a copy of the state after 10 tokens
m.check_integrity([a])
m.allocate_paged(a, 21)
m.store(a, 21 - 10)
b = HybridReq(1, prompt[:15] + [7, 7], None)
m.match_req(b)                         # shares 15 tokens; the only state on the way is after 10
hits = [b.cached_len]
m.check_integrity([a, b])
m.cache_req(a, True)                   # finished: its state after 21 tokens goes to the tree
c = HybridReq(2, prompt + [1, 9], None)
m.match_req(c)
hits.append(c.cached_len)
m.check_integrity([b, c])
for req in (b, c):
    m.cache_req(req, True)
m.check_integrity([])
print("hits", *hits, "states", *m.pools([])[1][1:])
"""


@pytest.mark.parametrize("core", ["rust", "python"])
def test_a_match_stops_at_the_deepest_state_and_copies_it(core: str) -> None:
    out = run(LIFECYCLE.format(core=core))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # b: full KV for 15 tokens, a state only after 10; c: a's finished state after 21; two states cached
    assert out.stdout.split() == ["hits", "10", "21", "states", "4", "2", "0", "6"]


# the same program with a window of 4 beside the states: SWA's pool printed before the states'
WITH_SWA = LIFECYCLE.replace(
    'mamba_manager(64, {core!r}, "lru", 6, -1)', 'mamba_manager(64, {core!r}, "lru", 6, -1, window=4)'
).replace("*m.pools([])[1][1:]", "*m.pools([])[1][1:], *m.pools([])[2][1:]")


@pytest.mark.parametrize("core", ["rust", "python"])
def test_with_a_window_beside_the_states_the_hits_are_the_same_and_the_window_is_kept(core: str) -> None:
    """FULL + SWA + MAMBA, W = 4: the same hits (each state's window is live), and both the SWA pool and the
    states add up (16 SWA slots cached: the windows behind the two states and the tails)."""
    assert "-1, window=4)" in WITH_SWA and "pools([])[2]" in WITH_SWA
    out = run(WITH_SWA.format(core=core))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.split() == ["hits", "10", "21", "states", "32", "16", "0", "48", "4", "2", "0", "6"]


# the extra buffer at page size 4: grid 4 from each chunk's start, a decode snapshot every 4 tokens, two
# tracking slots; a chunk asked to end inside a page ends on the page before
BUFFERED = """
from radixspec.fuzz.targets.sglang_unified_mamba import ExtraBuffer, mamba_manager
from radixspec.reference.hybrid_manager import HybridReq
m = mamba_manager(64, {core!r}, "lru", 12, -1, 4, ExtraBuffer(2, 4, 4))
prompt = list(range(100, 120))
a = HybridReq(0, prompt + [1], None)
m.match_req(a)
m.allocate_paged(a, 10)
m.store(a, 10)                         # a chunk cut to 8 tokens: the snapshot after 8
computed = [a.computed]
m.cache_req(a, False)                  # the snapshot's slot goes to the tree, with the 8 tokens' KV
m.check_integrity([a])
m.allocate_paged(a, 21)
m.store(a, 21 - 8)                     # the snapshot after 8 + 12 = 20 tokens
for token in (5, 5, 5):                # decode: a snapshot after 24 tokens
    a.input_ids.append(token)
    m.allocate_paged(a, a.computed + 1)
    m.store(a, 1)
    m.check_integrity([a])
b = HybridReq(1, prompt[:15] + [7, 7], None)
m.match_req(b)                         # full KV and a state after 8 (nothing else is the tree's yet)
hits = [b.cached_len]
m.check_integrity([a, b])
m.cache_req(a, True)                   # finished: the latest snapshot (24 tokens) goes to the tree
c = HybridReq(2, prompt + [1, 5, 5, 5, 9], None)
m.match_req(c)
hits.append(c.cached_len)
m.check_integrity([b, c])
for req in (b, c):
    m.cache_req(req, True)
m.check_integrity([])
print("computed", *computed, "hits", *hits, "states", *m.pools([])[1][1:])
"""


@pytest.mark.parametrize("core", ["rust", "python"])
def test_the_extra_buffer_donates_the_snapshots_of_chunks_and_decode(core: str) -> None:
    out = run(BUFFERED.format(core=core))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # two states cached at the end (after 8 and 24 tokens); b and c leave theirs untracked (no grid reached)
    assert out.stdout.split() == ["computed", "8", "hits", "8", "24", "states", "10", "2", "0", "12"]


# bugs planted in SGLang's code, each in the path one check guards
PLANTS = {
    # the match reports one page less than the deepest state
    "hit_is_the_longest_valid_match": """
urc = sys.modules["sglang.__radixspec_swa__"].urc
match = urc.UnifiedRadixCache.match_prefix
def short(self, params):
    result = match(self, params)
    if result.device_prefix_len:
        return result._replace(device_prefix_len=result.device_prefix_len - self.page_size)
    return result
urc.UnifiedRadixCache.match_prefix = short
""",
    # copy on match reads the state slot after the matched node's
    "the_copied_state_is_the_hits": """
mamba = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")
finalize = mamba.MambaComponent.finalize_match_result_in_cache
def other(self, params, result):
    result = finalize(self, params, result)
    if params.req is not None and params.req.kv.mamba_cow_src_index is not None:
        params.req.kv.mamba_cow_src_index = params.req.kv.mamba_cow_src_index + 1
    return result
mamba.MambaComponent.finalize_match_result_in_cache = other
""",
    # a checkpoint copies the state the wrong way round: from the tree's new slot into the request's
    "the_requests_state_is_its_own": """
mamba = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")
prepare = mamba.MambaComponent.prepare_for_caching_req
def swapped(self, req, insert_params, token_ids_len, is_finished):
    if is_finished:
        return prepare(self, req, insert_params, token_ids_len, is_finished)
    donated = self._alloc_mamba_slot(req)
    self.cache.req_to_token_pool.mamba_pool.copy_from(donated, req.kv.mamba_pool_idx.unsqueeze(0))
    insert_params.mamba_value = donated
    return token_ids_len
mamba.MambaComponent.prepare_for_caching_req = swapped
""",
    # the state allocator loses every third slot it is given back
    "state pages_are_partitioned": """
slots = importlib.import_module("sglang.srt.mem_cache.allocator.mamba")
free, calls = slots.MambaSlotAllocator.free, [0]
def leaky(self, index):
    calls[0] += 1
    if calls[0] % 3:
        free(self, index)
slots.MambaSlotAllocator.free = leaky
""",
    # extra buffer: a finished request gives the tree its older snapshot under the latest one's length
    "hit_is_the_longest_valid_match ": """
mamba = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")
select = mamba.MambaComponent._select_finished_checkpoint
def older(self, req, token_ids_len):
    chosen = select(self, req, token_ids_len)
    if chosen is None or self.cache.req_to_token_pool.mamba_ping_pong_track_buffer_size != 2:
        return chosen
    return chosen[0], 1 - chosen[1]
mamba.MambaComponent._select_finished_checkpoint = older
""",
    # extra buffer: a finished request frees every tracking slot, the one the tree took too
    "state pages_are_partitioned ": """
mamba = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")
cleanup = mamba.MambaComponent.cleanup_after_caching_req
def all_freed(self, req, is_finished, insert_result=None, insert_params=None):
    if is_finished and insert_params is not None:
        insert_params.mamba_keep_idx = None
    return cleanup(self, req, is_finished, insert_result, insert_params)
mamba.MambaComponent.cleanup_after_caching_req = all_freed
""",
    # extra buffer: a checkpoint leaves the donated snapshot's length on the request (its slot is fresh now)
    "the_latest_snapshot_is_of_its_length": """
mamba = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")
cleanup = mamba.MambaComponent.cleanup_after_caching_req
def kept(self, req, is_finished, insert_result=None, insert_params=None):
    length = req.kv.mamba_last_track_seqlen
    cleanup(self, req, is_finished, insert_result, insert_params)
    if not is_finished:
        req.kv.mamba_last_track_seqlen = length
mamba.MambaComponent.cleanup_after_caching_req = kept
""",
}


@pytest.mark.parametrize("law", sorted(PLANTS))
def test_each_check_catches_its_planted_bug(law: str, tmp_path: Path) -> None:
    """(A law named with a trailing space is a second plant for it, in the extra buffer's path.) A short hit is
    judged by the hit law, which asks the longest valid match, or in the half of the configurations that combine
    a window beside the states, a valid match: which configuration fails first moves with the code (Hypothesis
    draws from the constants of the code it runs)."""
    hit_law = ("hit_is_the_longest_valid_match", "hit_is_a_valid_match")
    assert_caught(hit_law if law.strip() == hit_law[0] else law.strip(), PLANTS[law], "sglang-mamba:python", tmp_path)


@pytest.mark.parametrize("target", ["sglang-mamba", "sglang-mamba:python"])
def test_a_clean_campaign_on_each_core(target: str, tmp_path: Path) -> None:
    assert_clean(target, tmp_path)
