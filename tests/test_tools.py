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
