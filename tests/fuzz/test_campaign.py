"""``python -m fuzz``: a short clean campaign, and a planted bug that it must catch."""

import io
import re

import pytest

from fuzz import campaign
from fuzz.planted import BUGS, ROOT
from reference.radix_cache import RadixPrefixCache


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = campaign.run(campaign.parse_args(list(argv)), out)
    return status, out.getvalue()


def test_a_clean_campaign_passes_and_prints_a_summary() -> None:
    status, text = run("--machine", "all", "--examples", "8", "--batch", "4", "--steps", "20", "--quiet")
    assert status == 0
    assert "== summary ==" in text and "failures: none" in text
    examples = int(re.search(r"examples (\d+)", text.split("== summary ==")[1]).group(1))  # type: ignore[union-attr]
    assert examples >= 16
    assert "cache.match_prefix" in text and "manager.admit" in text


def test_the_campaign_catches_a_lock_that_skips_the_handles_own_node(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RadixPrefixCache.lock

    def lock_from_parent(self: RadixPrefixCache, handle: object) -> None:  # mini-sglang issue #52
        checked = self._check_handle(handle)
        if checked.node.parent is not None and checked.node.parent.parent is not None:
            original(self, type(checked)(checked.cached_len, checked.node.parent, checked.namespace, self))

    monkeypatch.setattr(RadixPrefixCache, "lock", lock_from_parent)
    status, text = run("--machine", "cache", "--examples", "200", "--no-shrink", "--quiet")
    assert status == 1
    assert "failures: 1" in text
    assert "state = PrefixCacheMachine()" in text and "state.lock(" in text


def test_every_planted_bug_still_applies_to_the_tree() -> None:
    for bug in BUGS:
        assert (ROOT / bug.path).read_text().count(bug.old) == 1, bug.name
