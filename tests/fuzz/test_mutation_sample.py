"""The fast profile of ``tox -e mutation``: its sample, its resumption, its exit status (no mutmut run here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import mutation_report as mr
from tools import mutation_sample as ms

NAMES = [f"spec.mod.x_f{f}__mutmut_{n}" for f in range(50) for n in range(1, 41)]


def test_the_sample_is_reproducible_about_its_share_and_each_name_decided_alone() -> None:
    chosen = [n for n in NAMES if ms.in_sample(n, 20, 0)]
    assert 0.17 < len(chosen) / len(NAMES) < 0.23
    # the same names whatever else exists: a name's membership reads only the seed and the name
    assert [n for n in NAMES[::-1] if ms.in_sample(n, 20, 0)] == chosen[::-1]
    assert chosen != [n for n in NAMES if ms.in_sample(n, 20, 1)]
    # a bigger share holds the smaller one (the first run's checks count towards a larger sample)
    assert set(chosen) <= {n for n in NAMES if ms.in_sample(n, 40, 0)}
    assert all(ms.in_sample(n, 100, 3) for n in NAMES)


def test_only_the_sampled_mutants_without_a_verdict_go_to_mutmut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    codes: dict[str, int | None] = {name: (1 if i % 2 else None) for i, name in enumerate(NAMES)}
    (tmp_path / "mutants" / "spec").mkdir(parents=True)
    (tmp_path / "mutants" / "spec" / "mod.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    assert mr.exit_codes_by_name(tmp_path) == codes
    calls: list[list[str]] = []
    monkeypatch.setattr(ms, "mutmut", lambda root, names, children: calls.append(names) or 0)
    monkeypatch.setattr(ms.mr, "load", lambda root: [])
    assert ms.main(["--root", str(tmp_path), "--percent", "20"]) == 1  # no results to report: not done
    (passed,) = calls
    assert passed == sorted(n for n in NAMES if ms.in_sample(n, 20, 0) and codes[n] is None)


def test_module_keeps_the_sample_to_the_modules_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [*NAMES, *(name.replace("spec.mod.", "spec.other.") for name in NAMES)]
    (tmp_path / "mutants" / "spec").mkdir(parents=True)
    (tmp_path / "mutants" / "spec" / "mod.py.meta").write_text(json.dumps({"exit_code_by_key": dict.fromkeys(names)}))
    calls: list[list[str]] = []
    monkeypatch.setattr(ms, "mutmut", lambda root, names, children: calls.append(names) or 0)
    monkeypatch.setattr(ms.mr, "load", lambda root: [])
    assert ms.main(["--root", str(tmp_path), "--percent", "20", "--module", "spec.other"]) == 1
    (passed,) = calls
    assert passed and all(name.startswith("spec.other.x_") for name in passed)
    assert passed == sorted(n for n in names if n.startswith("spec.other.") and ms.in_sample(n, 20, 0))


def test_a_resumed_run_gets_the_checkouts_compiled_modules(tmp_path: Path) -> None:
    (tmp_path / "optimized").mkdir()
    (tmp_path / "mutants" / "optimized").mkdir(parents=True)
    (tmp_path / "optimized" / "_radix_c.abi3.so").write_bytes(b"new")
    (tmp_path / "mutants" / "optimized" / "_radix_c.abi3.so").write_bytes(b"old")
    assert ms.refresh_compiled(tmp_path) == ["_radix_c.abi3.so"]
    assert (tmp_path / "mutants" / "optimized" / "_radix_c.abi3.so").read_bytes() == b"new"
    assert ms.refresh_compiled(tmp_path) == []


def test_the_first_run_makes_the_mutants_with_a_few_cheap_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(ms, "mutmut", lambda root, names, children: calls.append(names) or 0)
    assert ms.main(["--root", str(tmp_path)]) == 1  # mutmut (stubbed) made nothing
    assert calls == [[ms.BOOTSTRAP]]


def test_unchecked_or_below_goal_fails_and_usage_errors_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    sampled = [n for n in NAMES if ms.in_sample(n, 20, 0)][:10]
    monkeypatch.setattr(ms.mr, "load", lambda root: [mr.Mutant(n, "killed") for n in sampled])
    assert ms.main(["--report-only"]) == 0
    monkeypatch.setattr(ms.mr, "load", lambda root: [mr.Mutant(n, "not checked") for n in sampled])
    assert ms.main(["--report-only"]) == 1
    for argv in (["--percent", "0"], ["--percent", "101"], ["--max-children", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            ms.main(argv)
        assert exit_info.value.code == 2


def test_the_names_plugin_switches_on_mutmuts_file_named_mutant_in_our_runtime_modules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """mutmut names ``spec.helpers.x_f__mutmut_1``; the trampoline compares it with ``radixspec.spec.helpers``."""
    import sys
    import types

    from radixspec.spec import helpers
    from tools import mutmut_names

    hits: list[tuple[str, str | None]] = []
    trampoline = types.ModuleType("mutmut.mutation.trampoline")
    trampoline.get_mutant_under_test = lambda: "spec.helpers.x_align_down__mutmut_1"  # type: ignore[attr-defined]
    trampoline.record_trampoline_hit = lambda name, caller=None: hits.append((name, caller))  # type: ignore[attr-defined]
    for name, module in {
        "mutmut": types.ModuleType("mutmut"),
        "mutmut.mutation": types.ModuleType("mutmut.mutation"),
        "mutmut.mutation.trampoline": trampoline,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys.modules["mutmut.mutation"], "trampoline", trampoline, raising=False)
    # without the plugin the trampoline's module check fails: the mutant is never switched on
    module, _, _ = trampoline.get_mutant_under_test().rpartition(".")
    assert module != helpers.align_down.__module__
    assert mutmut_names.install()
    module, _, mutant = trampoline.get_mutant_under_test().rpartition(".")
    assert (module, mutant) == (helpers.align_down.__module__, "x_align_down__mutmut_1")
    # a hit is recorded under the file's name, the one mutmut's mutants carry; other names pass as they are
    trampoline.record_trampoline_hit("radixspec.spec.helpers.x_align_down", caller="radixspec.fuzz.x")
    assert hits == [("spec.helpers.x_align_down", "radixspec.fuzz.x")]
    assert mutmut_names.to_runtime("stats") == "stats"
