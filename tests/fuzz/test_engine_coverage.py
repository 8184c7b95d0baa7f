"""``radixspec fuzz --coverage``: the lines and branches of the engine's cache modules a campaign reached."""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixspec.fuzz import campaign, cli, engine_coverage
from radixspec.fuzz.engine_coverage import analyse, line_ranges, measured, module_file

pytestmark = pytest.mark.skipif(not engine_coverage.is_available(), reason="coverage.py is not installed")

DEMO = "radixspec_coverage_demo"


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Path]:
    """A package of three modules on sys.path: ``branchy`` (a function with two branches), ``idle``, and ``device``
    (functions and a class a CPU-only list may name)."""
    package = tmp_path / DEMO
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "branchy.py").write_text(
        textwrap.dedent(
            """\
            def pick(flag):
                if flag:
                    return 1
                return 2
            """
        )
    )
    (package / "idle.py").write_text("VALUE = 1\n")
    (package / "device.py").write_text(
        textwrap.dedent(
            """\
            def on_cpu():
                return 1


            def on_gpu():
                \"\"\"Needs a stream.\"\"\"
                x = 1
                return x + 1


            class Streams:
                def a(self):
                    return 1

                if True:
                    def b(self):
                        return 2
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield package
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name.startswith(DEMO)]:
            del sys.modules[name]


def test_line_ranges_join_consecutive_lines() -> None:
    assert line_ranges([9, 3, 4, 5, 11, 12]) == ["3-5", "9", "11-12"]
    assert line_ranges([]) == []


def test_a_modules_file_is_found_where_its_package_is_installed(demo: Path) -> None:
    assert module_file(f"{DEMO}.branchy") == demo / "branchy.py"
    assert f"{DEMO}.branchy" not in sys.modules  # found, not imported
    assert module_file(f"{DEMO}.absent") is None
    assert module_file("radixspec_no_such_package.cache") is None


@pytest.mark.parametrize("inside", [False, True])
def test_a_measured_run_reports_the_lines_and_branches_it_reached_and_lists_the_rest(
    demo: Path, inside: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if inside:
        # run from a folder that holds the engine (CI's installed stage runs in the folder of its virtualenv):
        # coverage.py names the files relative to it
        monkeypatch.chdir(demo.parent)
    with measured((f"{DEMO}.branchy", f"{DEMO}.idle")) as arcs:
        importlib.import_module(f"{DEMO}.branchy").pick(True)
    # only what ran is measured: the idle module was never imported
    assert set(arcs) == {f"{DEMO}.branchy"}
    branchy, idle, absent = analyse((f"{DEMO}.branchy", f"{DEMO}.idle", f"{DEMO}.absent"), arcs)
    # the def, the if and the first return ran; `return 2` (line 4) never did, nor the if's other branch
    assert (branchy.statements, branchy.covered, branchy.missing) == (4, 3, (4,))
    assert (branchy.branches, branchy.covered_branches) == (2, 1)
    assert branchy.describe() == f"{DEMO}.branchy: lines 75.0 % (3/4), branches 50.0 % (1/2); never reached: 4"
    assert branchy.describe(ranges=0).endswith("1 ranges never reached (listed without --quiet, and in --json)")
    # a module that never ran is reported, all its lines missing; one not installed says so
    assert (idle.statements, idle.covered, idle.missing) == (1, 0, (1,))
    assert absent.path is None and absent.describe() == f"{DEMO}.absent: not installed here"
    assert branchy.as_dict()["missing_lines"] == [4] and branchy.as_dict()["line_percent"] == 75.0


CPU_ONLY_DEMO = {f"{DEMO}.device": {"on_gpu": "cuda: a stream", "Streams": "kernel: no CPU path", "gone": "cuda: x"}}


def test_the_lines_of_functions_that_cannot_run_on_a_cpu_are_set_apart_and_a_wrong_list_is_named(demo: Path) -> None:
    """Listed functions' bodies that never ran are CPU-only: out of the lines reachable on a CPU, not listed as never
    reached. A listed name the file lacks is stale; a listed function that ran is named, its lines counted."""
    with measured((f"{DEMO}.device",)) as arcs:
        importlib.import_module(f"{DEMO}.device").on_cpu()
    (device,) = analyse((f"{DEMO}.device",), arcs, CPU_ONLY_DEMO)
    # ran: the defs, the class and its if (at import), on_cpu's return; never: on_gpu's two lines, a's and b's
    assert (device.statements, device.covered, device.missing) == (11, 7, (7, 8, 13, 17))
    assert device.cpu_only == (7, 8, 13, 17) and device.reachable == 7 and device.reachable_percent == 100.0
    assert device.stale_names == ("gone",) and device.ran_though_listed == ()
    assert device.describe() == (
        f"{DEMO}.device: lines 63.6 % (7/11), branches 0.0 % (0/0), of the lines reachable on a CPU 100.0 % (7/7;"
        " 4 CPU-only); CPU-only list wrong: no gone"
    )
    assert device.as_dict()["cpu_only_lines"] == [7, 8, 13, 17] and device.as_dict()["reachable_line_percent"] == 100.0
    del sys.modules[f"{DEMO}.device"]  # imported again, under measure
    with measured((f"{DEMO}.device",)) as arcs:
        importlib.import_module(f"{DEMO}.device").on_gpu()
    (device,) = analyse((f"{DEMO}.device",), arcs, CPU_ONLY_DEMO)
    assert device.ran_though_listed == ("on_gpu",) and device.cpu_only == (13, 17) and device.reachable == 9
    assert "CPU-only list wrong: on_gpu ran, no gone; never reached: 2" in device.describe()


def test_every_cpu_only_function_listed_is_in_the_installed_engine() -> None:
    """The shipped list against the engines installed here: every name defined (a new release renames or drops)."""
    from radixspec.fuzz.engine_coverage import listed_bodies
    from radixspec.fuzz.targets.cpu_unreachable import CPU_UNREACHABLE

    checked = 0
    for module, listed in CPU_UNREACHABLE.items():
        assert listed and all(
            why.split(":")[0] in ("cuda", "kernel", "distributed", "external") for why in listed.values()
        )
        path = module_file(module)
        if path is None:
            continue
        assert listed_bodies(path.read_text(), listed)[1] == (), module
        checked += 1
    if importlib.util.find_spec("sglang") is not None:
        assert checked > 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--target", "reference", "--workers", "1"], "names no engine module to measure"),
        (["--target", "tokenspeed", "--workers", "1"], "names no engine module to measure"),
        (["--target", "vllm-hybrid", "--workers", "0"], "measures in worker processes"),
    ],
)
def test_coverage_where_nothing_can_be_measured_is_a_usage_error(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    needs = {"tokenspeed": "tokenspeed_scheduler", "vllm-hybrid": "vllm"}.get(argv[1])
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args([*argv, "--coverage"])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


# every built-in engine target that --coverage measures, each variant that changes its modules
MEASURED = [
    "sglang",
    "sglang:python",
    "sglang:both",
    "sglang:legacy",
    "sglang-swa",
    "sglang-mamba",
    "sglang-hicache",
    "sglang-hicache:swa,mamba",
    "vllm",
    "vllm-hybrid",
    "vllm-mamba",
    "vllm-offload",
    "vllm-offload-connector",
    "vllm-simple-offload",
]


@pytest.mark.parametrize("name", MEASURED)
def test_each_engine_target_names_modules_its_engine_installs(name: str) -> None:
    from radixspec.fuzz.targets import resolve

    info = resolve(name, check=False)
    package = info.requires[0][0]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    assert info.engine_modules and all(module.startswith(f"{package}.") for module in info.engine_modules)
    assert [module for module in info.engine_modules if module_file(module) is None] == []


def test_the_tree_core_and_components_drawn_choose_the_modules() -> None:
    from radixspec.fuzz.targets import resolve

    def modules(name: str) -> set[str]:
        return {
            module.rsplit(".", 2)[-2] + "." + module.rsplit(".", 1)[-1]
            for module in resolve(name, False).engine_modules
        }

    assert {"rust_tree_core.adapter"} <= modules("sglang") and "unified_cache.unified_tree_core" not in modules(
        "sglang"
    )
    assert {"rust_tree_core.adapter", "unified_cache.unified_tree_core"} <= modules("sglang:both")
    assert {"components.swa", "allocator.swa"} <= modules("sglang-swa")
    assert {"components.mamba", "managers.cache_controller"} <= modules("sglang-hicache:swa,mamba")
    assert "managers.cache_controller" not in modules("sglang-mamba")


def test_coverage_without_coverage_py_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(engine_coverage, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        cli.parse_args(["--coverage", "--target", "reference"])
    assert "pip install 'radixspec[coverage]'" in capsys.readouterr().err


def test_a_campaign_reports_the_coverage_of_the_engines_modules(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    out = io.StringIO()
    argv = ["--target", "vllm-hybrid", "--examples", "40", "--seed", "1", "--workers", "1", "--no-shrink"]
    args = campaign.parse_args([*argv, "--coverage", "--out", str(tmp_path), "--json", str(tmp_path / "c.json")])
    assert campaign.run(args, out) == 0, out.getvalue()[-3000:]
    modules = json.loads((tmp_path / "c.json").read_text())["coverage"]
    assert [module["module"] for module in modules] == list(args.engine_modules)
    assert "vllm.v1.core.kv_cache_coordinator" in args.engine_modules
    for module in modules:
        # each ran (its import included: measured in the worker) and left lines unreached, listed
        assert 0 < module["covered_lines"] < module["statements"], module["module"]
        assert module["covered_branches"] > 0 and module["missing_lines"], module["module"]
    text = out.getvalue()
    assert "engine coverage: lines " in text and "vllm.v1.core.block_pool: lines " in text
    assert "never reached: " in text
