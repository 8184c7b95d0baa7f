"""The target API: naming targets, errors for the command line, and campaigns against a user's cache."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

from radixspec.fuzz import campaign, targets
from radixspec.fuzz.targets import TargetError, list_targets, releases, resolve
from radixspec.fuzz.targets.api import LifecycleProfile

from .toy import ToyCache

# what an installed wheel must do: CI runs this module against the wheel too (.ci/installed)
pytestmark = pytest.mark.installed


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    # seed 0 unless a test names one: a test's verdict must not depend on a fresh seed's draw
    seed = [] if "--seed" in argv else ["--seed", "0"]
    status = campaign.run(campaign.parse_args([*seed, *argv]), out)
    return status, out.getvalue()


def test_a_users_factory_is_named_as_module_and_attribute() -> None:
    info = resolve("tests.targets.toy:ToyCache")
    assert info.cache_factory is ToyCache and info.profile.name.startswith("exact")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-such-target", "unknown target"),
        ("tests.targets.toy:Nothing", "has no 'Nothing'"),
        ("no.such.module:thing", "cannot import"),
        ("os:sep", "expected a TargetInfo or a factory"),
        ("minisgl", "needs the path of a mini-sglang checkout"),
        ("minisgl:/nowhere", "no mini-sglang checkout"),
        ("reference:extra", "takes no argument"),
    ],
)
def test_a_bad_target_name_is_a_clear_error(name: str, message: str) -> None:
    with pytest.raises(TargetError, match=message):
        resolve(name)


def test_a_bad_target_on_the_command_line_exits_2_without_fuzzing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        campaign.parse_args(["--target", "no-such-target"])
    assert exit_info.value.code == 2
    assert "unknown target" in capsys.readouterr().err


def test_a_target_is_found_through_the_entry_point_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "toy_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[radixspec.targets]\ntoy = tests.targets.toy:ToyCache\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve("toy").cache_factory is ToyCache
    # the engines' targets are probed in fresh interpreters (seconds): not what this test is about
    monkeypatch.setattr(targets, "readiness", lambda names: dict.fromkeys(names, "not probed in this test"))
    assert any(line.startswith("toy ") for line in list_targets())


def test_the_listing_names_every_target_of_every_engine_what_it_needs_and_whether_it_is_ready() -> None:
    lines = list_targets()
    text = "\n".join(lines)
    for name in ("reference", "optimized", "sglang", "vllm", "minisgl"):
        assert f"\n{name}" in f"\n{text}"
    assert "git clone https://github.com/sgl-project/mini-sglang" in text
    for variant in (variant for variants in releases.VARIANTS.values() for variant in variants):
        (at,) = [i for i, line in enumerate(lines) if line.split(" ")[0] == variant]
        end = next((i for i in range(at + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
        following = [line.strip() for line in lines[at + 1 : end]]
        assert following[-1] == "ready" or following[-1].startswith("NOT READY"), (variant, following)
    # a request-lifecycle target states its named choices, a cache target where it differs from the spec
    (swa,) = [i for i, line in enumerate(lines) if line.split(" ")[0] == "sglang-swa"]
    assert any(line.strip().startswith("hit: a valid match") for line in lines[swa : swa + 12])
    (vllm,) = [i for i, line in enumerate(lines) if line.split(" ")[0] == "vllm"]
    assert any(line.strip().startswith("differs: ") for line in lines[vllm : vllm + 12])


def test_a_lifecycle_profile_states_its_choices_by_name() -> None:
    profile = LifecycleProfile(name="an engine", hit="the longest valid match but one page", state="none")
    assert profile.choices() == [("hit", "the longest valid match but one page"), ("state", "none")]
    # what every request-lifecycle target shares: the engine's pages, clock and eviction, no validation of ours
    assert (profile.slots, profile.clock, profile.eviction_trigger, profile.errors) == (
        "target",
        "order",
        "allocate",
        "none",
    )


def test_a_correct_users_cache_passes_a_campaign() -> None:
    status, text = run("--target", "tests.targets.toy:ToyCache", "--examples", "30", "--steps", "30", "--quiet")
    assert status == 0, text
    assert "target tests.targets.toy:ToyCache" in text and "failures: none" in text


def test_a_users_cache_that_evicts_a_locked_page_is_caught() -> None:
    status, text = run(
        "--target",
        "tests.targets.toy:ForgetfulToyCache",
        "--examples",
        "300",
        "--steps",
        "40",
        "--no-shrink",
        "--quiet",
    )
    assert status == 1, text
    # the forgotten lock shows as a locked page evicted, sizes that disagree, or an unlock the toy refuses
    assert any(symptom in text for symptom in ("evicted locked page", "size_info", "no lock ends at the last page"))


@pytest.mark.parametrize("target", ["reference", "optimized"])
@pytest.mark.parametrize("lru", ["strict", "sync"])
def test_our_own_caches_pass_as_targets_in_both_lru_modes(target: str, lru: str) -> None:
    status, text = run("--target", target, "--lru", lru, "--examples", "20", "--steps", "30", "--quiet")
    assert status == 0, text


def test_sync_lru_follows_one_target_only() -> None:
    with pytest.raises(SystemExit):
        campaign.parse_args(["--lru", "sync"])  # the default selection: reference and optimized
    assert campaign.parse_args(["--lru", "sync", "--impl", "reference"]).targets == ("reference",)
    assert sys.modules["radixspec.fuzz.campaign"] is campaign


def test_a_users_cache_runs_beside_ours_and_its_bug_is_caught() -> None:
    status, text = run(
        "--impl", "optimized", "--target", "tests.targets.toy:ForgetfulToyCache", "--machine", "cache",
        "--examples", "300", "--steps", "40", "--no-shrink", "--quiet",
    )  # fmt: skip
    assert status == 1, text
    assert "targets optimized, tests.targets.toy:ForgetfulToyCache" in text
    assert "tests.targets.toy:ForgetfulToyCache" in text.split("failing example found", 1)[1], text[-2000:]


@pytest.mark.parametrize(
    ("bug", "invariant"),
    [("double free", "free_slots_are_aligned_and_unique"), ("lost free", "pages_are_partitioned")],
)
def test_a_managers_accounting_bug_is_named_by_the_specs_invariant(
    monkeypatch: pytest.MonkeyPatch, bug: str, invariant: str
) -> None:
    from radixspec import reference

    original = reference.CacheManager._free

    def buggy_free(self: reference.CacheManager, indices: list[int]) -> None:
        if bug == "double free":
            original(self, indices)
            original(self, indices)
        # "lost free": the pages given back are forgotten (a leak)

    monkeypatch.setattr(reference.CacheManager, "_free", buggy_free)
    status, text = run(
        "--target",
        "tests.targets.toy:PLAIN_MANAGER",
        "--machine",
        "manager",
        "--workers",
        "0",
        "--examples",
        "200",
        "--no-shrink",
        "--quiet",
    )
    assert status == 1, text
    assert f"IntegrityError: {invariant}: " in text, text[-3000:]


def test_the_insertion_ordered_set_is_a_set_that_iterates_in_insertion_order() -> None:
    from radixspec.fuzz.targets.shims import InsertionOrderedSet

    items = InsertionOrderedSet([3, 1])
    items.add(2)
    items.add(1)
    assert list(items) == [3, 1, 2] and len(items) == 3 and 2 in items and 5 not in items
    items.remove(1)
    items.discard(7)
    with pytest.raises(KeyError):
        items.remove(7)
    assert list(items) == [3, 2]
    items.clear()
    assert not items


def test_a_failing_sglang_strict_lru_program_replays_the_same_path() -> None:
    """SGLang's evictable leaves of equal last access are taken in its set's order (memory addresses): the
    adapter installs an insertion-ordered set, so a run and its replay take one path (without it, the strict
    campaign's first failure did not replay: FlakyStrategyDefinition, no regression file)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    from radixspec.fuzz.targets.shims import InsertionOrderedSet

    def eviction_order() -> list[list[int]]:
        cache = resolve("sglang:legacy").cache_factory(2, 128)  # type: ignore[misc]
        assert isinstance(cache.cache.evictable_leaves, InsertionOrderedSet)
        # each second insert splits the first's node: its suffix and the new leaf share one last access
        for i in range(20):
            cache.insert_prefix([i, i, 2, 2], [8 * i, 8 * i + 1, 8 * i + 2, 8 * i + 3], None)
            cache.insert_prefix([i, i, 3, 3], [8 * i, 8 * i + 1, 8 * i + 4, 8 * i + 5], None)
        order = []
        for _ in range(40):
            cache.evict(2)
            order += cache.take_evicted()
        return order

    first = eviction_order()
    assert len(first) == 40 and all(eviction_order() == first for _ in range(5))


@pytest.mark.parametrize("target", ["reference", "optimized"])
def test_a_managers_abstract_state_is_read_again_after_every_call_that_may_change_it(target: str) -> None:
    """Our managers' targets keep the abstract state they read until a call may change it (the manager machine
    reads it five times a step): after each call, a failed one and a lazy region's close too, what the target
    reports is what the manager holds."""
    if target == "optimized":
        pytest.importorskip("torch")
    manager = resolve(target).manager_factory(4, 2, 2, 8)  # type: ignore[misc]

    def reads_the_manager() -> None:
        assert manager.abstract_state() == manager.manager.abstract_state()
        assert manager.abstract_state() is manager.abstract_state()  # read once between changes

    reads_the_manager()
    req = manager.new_req([1, 2, 3, 4, 5], 0, None, 0)
    handle = manager.match_req(req)  # stamps (the clock moves)
    reads_the_manager()
    manager.lock(handle)
    manager.admit(req, handle)
    manager.set_lengths(req, 0, 5)
    manager.allocate_paged([req])
    reads_the_manager()
    other = manager.new_req([7, 7, 7, 7, 7, 7, 7, 7, 7], 1, None, 1)
    manager.set_lengths(other, 0, 9)
    with pytest.raises(ValueError):
        manager.allocate_paged([other])  # past the row: refused, nothing changed
    reads_the_manager()
    manager.set_lengths(req, 5, 5)
    with manager.lazy_free_region():
        manager.cache_req(req, finished=True)
        reads_the_manager()
    reads_the_manager()  # the region's close freed its pages
    assert len(manager.evict(2)) == 2  # one of the two cached pages
    reads_the_manager()
    assert len(manager.abstract_state().cache.entries) == 1


def test_a_package_another_adapter_stood_in_for_is_importable_and_asking_does_not_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sglang-hicache's stand-in for psutil (no __spec__) made vLLM's adapter raise when it asked find_spec whether
    psutil is installed: a vLLM target run after a HiCache one in one process failed to import."""
    import types

    from radixspec.fuzz.targets.shims import importable

    monkeypatch.setitem(sys.modules, "radixspec_stood_in", types.ModuleType("radixspec_stood_in"))
    with pytest.raises(ValueError, match="__spec__ is None"):
        importlib.util.find_spec("radixspec_stood_in")
    assert importable("radixspec_stood_in") and importable("json") and not importable("radixspec_absent_package")
