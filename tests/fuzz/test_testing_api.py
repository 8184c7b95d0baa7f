"""radixspec.testing, radixspec.strategies and the pytest plugin: a user's cache in a user's pytest."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from radixspec import strategies
from radixspec.fuzz.machines import Stop
from radixspec.fuzz.options import Options
from radixspec.reference.hybrid_cache import HybridRadixCache
from radixspec.reference.hybrid_manager import HybridCacheManager
from radixspec.spec import prefix_cache as pc
from radixspec.testing import NothingChecked, cache_machine, hybrid_machine, manager_machine, options
from tests.targets.toy import ForgetfulToyCache, PlainManager, ToyCache

# what an installed wheel must do: CI runs this module against the wheel too (.ci/installed)
pytestmark = pytest.mark.installed

FEW = settings(max_examples=15, stateful_step_count=20, database=None, deadline=None)


@pytest.fixture
def plugin_options(tmp_path: Path) -> object:
    """The plugin's options as a run sets them, put back after the test."""
    saved = Options(**vars(options))
    options.out, options.shrink_seconds, options.seed = tmp_path / "failures", 5.0, 1
    yield options
    for name, value in vars(saved).items():
        setattr(options, name, value)


def test_a_correct_cache_passes_its_machine_made_from_a_class(plugin_options: object) -> None:
    cache_machine(ToyCache, settings=FEW).TestCase().runTest()


def test_a_cache_built_by_a_fixture_runs_through_a_lambda(plugin_options: object) -> None:
    built: list[ToyCache] = []
    machine = cache_machine(
        lambda page_size, num_pages: built.append(ToyCache(page_size, num_pages)) or built[-1], settings=FEW
    )
    machine.TestCase().runTest()
    assert built, "the factory was never called"


def test_a_buggy_cache_fails_and_leaves_a_regression_file_that_replays_the_failure(
    plugin_options: Options, tmp_path: Path
) -> None:
    machine = cache_machine(ForgetfulToyCache, settings=settings(FEW, max_examples=200))
    with pytest.raises(Exception) as failure:
        machine.TestCase().runTest()
    notes = "\n".join(getattr(failure.value, "__notes__", []))
    files = sorted(plugin_options.out.glob("test_cache_*.py"))
    assert files and f"regression test written to {files[0]}" in notes
    source = files[0].read_text()
    assert "targets=('tests.targets.toy:ForgetfulToyCache',)" in source and "batch seed 1" in source
    # the file replays on its own, from anywhere its factory imports (pytest run in a directory of its own)
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(files[0])],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-2000:]


def test_a_manager_and_a_hybrid_manager_run_through_the_api(plugin_options: object) -> None:
    manager_machine(PlainManager, settings=FEW).TestCase().runTest()

    def hybrid(page_size: int, windows: tuple[int | None, ...], num_pages: int) -> HybridCacheManager:
        return HybridCacheManager(HybridRadixCache(page_size, windows), num_pages)

    hybrid_machine(hybrid, settings=FEW).TestCase().runTest()


def test_a_machine_that_ran_no_example_fails_rather_than_passing_having_checked_nothing(
    plugin_options: object,
) -> None:
    # a user's replay-only profile (explicit examples, no generation): Hypothesis would pass the test having run none
    replay_only = settings(FEW, phases=[Phase.explicit])
    with pytest.raises(NothingChecked, match="cache machine against tests.targets.toy:ToyCache ran no example"):
        cache_machine(ToyCache, settings=replay_only).TestCase().runTest()


def test_a_deadline_left_by_an_earlier_campaign_in_the_process_does_not_reject_a_users_examples(
    plugin_options: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # run_batch sets the deadline of its batch; a campaign run in-process before the user's test left it past
    monkeypatch.setattr(Stop, "deadline", 0.0)
    cache_machine(ToyCache, settings=FEW).TestCase().runTest()


def test_a_factory_without_a_promised_method_is_refused_when_the_machine_is_made() -> None:
    class NoReset(ToyCache):
        reset = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="reset"):
        cache_machine(NoReset)
    with pytest.raises(TypeError, match="takes a factory"):
        cache_machine(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Profile"):
        cache_machine(ToyCache, profile="exact")  # type: ignore[arg-type]


def test_the_plugin_options_reach_the_machines(plugin_options: Options) -> None:
    from radixspec.fuzz.testing import effective_settings

    plugin_options.examples, plugin_options.steps = 7, 9
    chosen = effective_settings(FEW)
    assert (chosen.max_examples, chosen.stateful_step_count, chosen.database) == (7, 9, None)
    plugin_options.examples = plugin_options.steps = None
    assert effective_settings(FEW) is FEW


def run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_the_plugin_runs_each_machine_of_a_named_target_as_a_test_item(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    run = run_pytest(tmp_path, "--radixspec-target", "reference", "--radixspec-examples", "3", "--radixspec-seed", "5")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "radixspec[cache:reference]" in run.stdout and "radixspec[manager:reference]" in run.stdout
    assert "3 passed" in run.stdout and "seed 5, examples 3" in run.stdout
    bad = run_pytest(tmp_path, "--radixspec-target", "no.such.module:Cache")
    assert bad.returncode == 4 and "--radixspec-target no.such.module:Cache" in bad.stderr
    bad_seed = run_pytest(tmp_path, "--radixspec-seed", "often")
    assert bad_seed.returncode == 4 and "takes an integer or 'random'" in bad_seed.stderr


def test_no_import_of_ours_changes_a_users_hypothesis_profile() -> None:
    probe = textwrap.dedent(
        """
        from hypothesis import settings
        settings.register_profile("ci", max_examples=1000)
        settings.register_profile("dev", max_examples=3)
        settings.load_profile("ci")
        import radixspec, radixspec.testing, radixspec.strategies, radixspec.fuzz.pytest_plugin
        import radixspec.fuzz.campaign, radixspec.fuzz.machines, radixspec.fuzz.profiles
        from radixspec.fuzz.machines import machine_for
        machine_for("cache", ("reference",))
        assert settings.default.max_examples == 1000, settings.default
        assert settings.get_profile("ci").max_examples == 1000
        assert settings.get_profile("dev").max_examples == 3
        assert settings.get_profile("radixspec-ci").max_examples != 1000
        print("untouched")
        """
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "untouched" in run.stdout, run.stderr[-2000:]


@settings(max_examples=40, database=None)
@given(batch=strategies.prompts(count=4), size=strategies.page_sizes(max_size=8), data=st.data())
def test_the_strategies_draw_prompts_that_share_prefixes_and_bounded_page_sizes(
    batch: tuple[int, list[list[int]]], size: int, data: st.DataObject
) -> None:
    page_size, prompts = batch
    assert 1 <= size <= 8 and len(prompts) == 4 and page_size >= 1
    # each prompt is its own sequence of pages and a partial page (fewer than page_size tail tokens)
    state = pc.new_state(page_size)
    for number, tokens in enumerate(prompts):
        whole = len(tokens) - len(tokens) % page_size
        start = (number + 1) * 1000 * page_size  # page-aligned, apart from every other prompt's slots
        pc.insert_prefix(state, tokens, list(range(start, start + len(tokens))), None)
        assert pc.match_prefix(state, tokens, None).cached_len == whole
    size, workload = data.draw(strategies.request_programs(max_requests=3))
    assert [request.uid for request in workload] == list(range(len(workload)))
    assert all(request.input_ids and request.max_tokens >= 1 for request in workload)


def test_the_strategies_refuse_sizes_that_cannot_be() -> None:
    for make in (lambda: strategies.page_sizes(0), lambda: strategies.token_sequences(0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            make()
