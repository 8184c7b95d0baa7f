"""The mutation report: results parsed, diffs read from the mutated sources, survivors classified, score counted."""

from __future__ import annotations

import json
from pathlib import Path

from tools import mutation_report as mr

SOURCE = """
def x_f__mutmut_orig(a):
    if a.device.type == "cpu":
        raise ValueError(f"bad {a}")
    return list(zip(a, a, strict=True))

def x_f__mutmut_1(a):
    if a.device.type == "cpu":
        raise ValueError(None)
    return list(zip(a, a, strict=True))

def x_f__mutmut_2(a):
    if a.device.type == "cpu":
        raise ValueError(f"bad {a}")
    return list(zip(a, a, strict=False))

def x_f__mutmut_3(a):
    if a.device.type != "cpu":
        raise ValueError(f"bad {a}")
    return list(zip(a, a, strict=True))
"""

RESULTS = """
    pkg.mod.x_f__mutmut_1: survived
    pkg.mod.x_f__mutmut_2: survived
    pkg.mod.x_f__mutmut_3: survived
    pkg.mod.x_f__mutmut_4: killed
    pkg.mod.x_f__mutmut_5: timeout
    pkg.other.x_g__mutmut_1: not checked
"""


def test_survivors_are_read_diffed_classified_and_counted(tmp_path: Path) -> None:
    (tmp_path / "mutants" / "pkg").mkdir(parents=True)
    (tmp_path / "mutants" / "pkg" / "mod.py").write_text(SOURCE)
    mutants = mr.parse_results(RESULTS)
    assert [(m.module, m.status) for m in mutants][-2:] == [("pkg.mod", "timeout"), ("pkg.other", "not checked")]
    mr.add_diffs(mutants, tmp_path)
    first = mutants[0]
    assert first.removed == ['        raise ValueError(f"bad {a}")'] and first.added == [
        "        raise ValueError(None)"
    ]
    assert [mr.classify(m) for m in mutants[:3]] == [
        "message or label text",
        "equivalent: zip(strict=) on equal lengths",
        "other",
    ]
    assert mr.score(mutants) == (2, 5)  # the timeout counts as killed, the unchecked mutant not at all
    report = mr.report(mutants)
    assert "mutants 6, checked 5, killed 2 (timeouts and crashes included): 40.0 %" in report
    assert "without the 1 equivalent or GPU-only survivors: 50.0 %" in report
    markdown = mr.survivors_markdown(mutants)
    assert "## other (1)" in markdown and '    +     if a.device.type != "cpu":' in markdown


def test_without_a_run_the_report_says_so(tmp_path: Path, capsys: object) -> None:
    assert mr.main(["--root", str(tmp_path)]) == 1
    assert "run tox -e mutation first" in capsys.readouterr().err  # type: ignore[attr-defined]


def test_a_survivor_argued_on_its_own_line_carries_its_argument() -> None:
    eq = mr.Mutant(
        "radixspec.spec.prefix_cache.xǁPrefixǁ__eq____mutmut_8",
        "survived",
        ["            if a is None or b is None or (a._hash, a.length) != (b._hash, b.length):"],
        ["            if a is None and b is None or (a._hash, a.length) != (b._hash, b.length):"],
    )
    elsewhere = mr.Mutant("spec.other.x_g__mutmut_1", "survived", list(eq.removed), list(eq.added))
    assert (mr.classify(eq), mr.classify(elsewhere)) == (mr.ONE_BY_ONE_CLASS, "other")
    argument = mr.one_by_one_argument(eq)
    assert argument is not None and "reach the end of their chains together" in argument
    markdown = mr.survivors_markdown([eq, elsewhere])
    assert f"## {mr.ONE_BY_ONE_CLASS} (1)" in markdown and f"    why: {argument}" in markdown


def test_a_message_on_lines_of_its_own_given_as_none_is_message_text() -> None:
    text = '                    f"request {req.uid}: need cached_len {req.cached_len} <= device_len {req.device_len}"'
    on_its_own = mr.Mutant("radixspec.reference.cache_manager.xǁCacheManagerǁallocate_paged__mutmut_10", "survived")
    on_its_own.removed, on_its_own.added = [text], ["                    None"]
    assert mr.classify(on_its_own) == "message or label text"  # not the device class its words name


def test_a_suspicious_mutant_that_glibc_aborted_counts_as_killed_by_a_crash(tmp_path: Path) -> None:
    (tmp_path / "mutants" / "pkg").mkdir(parents=True)
    (tmp_path / "mutants" / "pkg" / "mod.py").write_text(SOURCE)
    codes = {"pkg.mod.x_f__mutmut_1": -6, "pkg.mod.x_f__mutmut_2": 7, "pkg.mod.x_f__mutmut_3": 0}
    (tmp_path / "mutants" / "pkg" / "mod.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    mutants = mr.parse_results(
        "pkg.mod.x_f__mutmut_1: suspicious\npkg.mod.x_f__mutmut_2: suspicious\npkg.mod.x_f__mutmut_3: survived\n"
    )
    assert mr.exit_codes(tmp_path) == codes
    mr.mark_aborts(mutants, mr.exit_codes(tmp_path))
    assert [m.status for m in mutants] == ["aborted", "suspicious", "survived"]
    assert mr.score(mutants) == (1, 3)
    assert [mr.survived(m) for m in mutants] == [False, True, True]
    mr.add_diffs(mutants, tmp_path)
    markdown = mr.survivors_markdown(mutants)
    assert "pkg.mod.x_f__mutmut_2 (suspicious)\n" in markdown and "x_f__mutmut_1" not in markdown
