"""``python -m tools.mutate_c``: the mutants it makes of C source, its sample, its verdicts (no campaign run here)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest

from tools import mutate_c

SNIPPET = """/* a comment: if (a < b) { x = 1; } */
#include "tree.h"
#define LIMIT 16

static int f(int a, int b) {
    if (a < b && b != 0) {
        count(a, b);
        a = b + 1;
    }
    printf("%d < %d", a, b);
    return a >= 2;
}
"""


def test_every_operator_makes_its_mutants_on_code_only() -> None:
    mutants = mutate_c.mutants_of(SNIPPET)
    described = {(m.operator, m.after.strip()) for m in mutants}
    assert ("ror", "if (a <= b && b != 0) {") in described
    assert ("ror", "if (a < b && b == 0) {") in described
    assert ("ror", "return a > 2;") in described
    assert ("const", "a = b + 2;") in described and ("const", "a = b + 0;") in described
    assert ("delete", "") in {(m.operator, m.after) for m in mutants if m.before.strip() == "count(a, b);"}
    assert ("swap", "count(b, a);") in described
    # never in a comment, a preprocessor line or a string literal
    assert not any(m.line in (1, 2, 3) for m in mutants)
    assert all('"%d < %d"' in m.after for m in mutants if '"%d < %d"' in m.before and m.operator != "delete")
    # returns are never deleted
    assert not any(m.operator == "delete" and "return" in m.before for m in mutants)


def test_a_mutant_changes_exactly_its_line() -> None:
    for mutant in mutate_c.mutants_of(SNIPPET):
        changed = mutate_c.apply(SNIPPET, mutant)
        before, after = SNIPPET.splitlines(), changed.splitlines()
        if mutant.operator == "delete":
            assert len(after) == len(before) - 1 and before[mutant.line - 1] not in after[mutant.line - 1 : mutant.line]
        else:
            differ = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
            assert differ == [mutant.line - 1]


def test_the_tree_has_mutants_of_every_operator_and_the_sample_is_reproducible() -> None:
    text = (mutate_c.ROOT / mutate_c.SOURCE).read_text()
    mutants = mutate_c.mutants_of(text)
    assert {m.operator for m in mutants} == set(mutate_c.OPERATORS)
    assert len(mutants) > 500
    first = random.Random(3).sample(mutants, 10)
    assert first == random.Random(3).sample(mutate_c.mutants_of(text), 10)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--sample", "0"], ["--seconds", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            mutate_c.main(argv)
        assert exit_info.value.code == 2


def test_list_names_the_sampled_mutants(capsys: pytest.CaptureFixture[str]) -> None:
    assert mutate_c.main(["--list", "--sample", "5", "--seed", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 6 and out[-1].startswith("5 of ")


def test_each_mutant_names_its_function() -> None:
    mutants = mutate_c.mutants_of(SNIPPET)
    assert mutants and {m.function for m in mutants} == {"f"}


def test_every_argued_equivalent_names_exactly_one_mutant_of_the_tree() -> None:
    # an argument whose line changed is stale: it must be argued again, never match a new mutant by chance
    mutants = mutate_c.mutants_of((mutate_c.ROOT / mutate_c.SOURCE).read_text())
    for key, argument in mutate_c.EQUIVALENT.items():
        matching = [m for m in mutants if (m.function, m.before.strip(), m.after.strip()) == key]
        assert len(matching) == 1, f"{key}: {len(matching)} mutants"
        assert matching[0].equivalent == argument and argument


def test_rescore_counts_a_survivor_argued_after_the_run_as_equivalent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (mutate_c.ROOT / mutate_c.SOURCE).read_text()
    mutants = mutate_c.mutants_of(text)
    argued = next(m for m in mutants if m.equivalent is not None)
    other = next(m for m in mutants if m.equivalent is None)
    rows = [
        {**asdict(argued), "verdict": "survived", "seconds": 20.0, "detail": "", "stage": ""},
        {**asdict(other), "verdict": "killed", "seconds": 8.0, "detail": "cache: exit 1", "stage": "machines"},
        {**asdict(other), "verdict": "survived", "seconds": 30.0, "detail": "", "stage": ""},
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"source": mutate_c.SOURCE, "seed": 0, "seconds": 15, "verdicts": rows}))
    # one killed of the two that are not argued equivalent: 50 %
    assert mutate_c.main(["--rescore", str(path), "--goal", "50"]) == 0
    assert mutate_c.main(["--rescore", str(path), "--goal", "51"]) == 1
    out = capsys.readouterr().out
    assert "score 50.0 % of the 2 built mutants that are not equivalent" in out and "killed by: the machines 1" in out
