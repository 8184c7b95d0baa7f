"""The maintainer tools live in tools/ of a checkout, not in the installed package; outside one they say so."""

from pathlib import Path

import pytest

from tools.checkout import ROOT, find_root


def test_the_tools_find_the_checkout_they_live_in() -> None:
    assert find_root() == ROOT == Path(__file__).resolve().parent.parent
    assert (ROOT / "csrc" / "tree.c").exists()


def test_outside_a_checkout_a_tool_exits_with_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "spec").mkdir()
    with pytest.raises(SystemExit, match=r"lacks pyproject.toml, csrc, fuzz .*clone the repository"):
        find_root(tmp_path)


def test_the_router_fault_table_has_a_row_per_fault_and_way_of_applying_batches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("msgspec")
    from tools import router_faults

    assert router_faults.main(["--router", "radixspec-router", "--examples", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| router | batches applied | fault | injected | router right again")
    cells = [line.split(" | ") for line in lines[2:]]
    assert {(cell[1], cell[2]) for cell in cells} <= {
        (mode, kind) for mode in router_faults.MODES for kind in router_faults.FAULTS
    }
    sequenced = {cell[2]: cell for cell in cells if cell[1] == "sequenced + replay"}
    # with the replay, a lost batch ends in sync; a silent restart never does
    assert int(sequenced["drop"][5]) > 0 and sequenced["silent_restart"][5] == "0"
