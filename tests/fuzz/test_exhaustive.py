"""``radixspec exhaustive``: every operation sequence up to a depth, shortest counterexamples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from radixspec import reference
from radixspec.fuzz import exhaustive
from radixspec.spec.prefix_cache import OPERATIONS


def test_every_state_up_to_depth_three_holds_every_invariant() -> None:
    for page_size in (1, 2):
        result = exhaustive.explore(page_size, depth=3, workers=1, progress=False)
        assert result.failure is None, result.failure
        assert result.depth == 3 and result.states > 200 and result.transitions > result.states


def test_a_planted_bug_gives_a_shortest_counterexample_as_a_runnable_test(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # LRU by insertion time: evict picks the oldest generation instead of the oldest access
    original = reference.RadixPrefixCache.evict

    def evict_by_generation(self: reference.RadixPrefixCache, size: int) -> list[int]:
        for node in self._iter_nodes():
            node.timestamp = node.generation
        return original(self, size)

    monkeypatch.setattr(reference.RadixPrefixCache, "evict", evict_by_generation)
    result = exhaustive.explore(1, depth=5, workers=1, progress=False)
    assert result.failure is not None and "evict" in result.failure
    # breadth first, so nothing shorter fails: an insert, a match (a newer access), an evict
    assert [op[0] for op in result.counterexample] == ["insert", "match", "evict"]
    test_file = exhaustive.write_test(result, tmp_path)
    assert "run_ops(" in test_file.read_text()
    with pytest.raises(AssertionError, match="evict"):
        exhaustive.run_ops(1, result.counterexample)
    monkeypatch.undo()
    # without the bug the same sequence passes, and the written file runs under pytest
    exhaustive.run_ops(1, result.counterexample)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", str(test_file)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_manager_state_up_to_depth_three_satisfies_the_relations() -> None:
    result = exhaustive.explore(2, depth=3, workers=1, progress=False, machine="manager")
    assert result.failure is None, result.failure
    assert result.states > 200 and result.transitions > result.states


def test_a_manager_bug_only_a_relation_sees_is_found_shortest(monkeypatch: pytest.MonkeyPatch) -> None:
    # an allocation that evicts one page more than the free list lacks: the pages stay partitioned
    original = reference.CacheManager._allocate

    def allocate_one_more(self: reference.CacheManager, needed_pages: int) -> list[int]:
        short = needed_pages > len(self.free_slots)
        allocated: list[int] = original(self, needed_pages)
        if short and self.prefix_cache.size_info.evictable_size >= self.page_size:
            self.free_slots.extend(self.prefix_cache.evict(self.page_size)[:: self.page_size])
        return allocated

    monkeypatch.setattr(reference.CacheManager, "_allocate", allocate_one_more)
    result = exhaustive.explore(1, depth=6, workers=1, progress=False, machine="manager")
    assert result.failure is not None and "evicted" in result.failure, result.failure


@pytest.mark.parametrize(
    "argv",
    [["--depth", "0"], ["--workers", "0"], ["--page-sizes", "x"], ["--page-sizes", "0"], ["--machine", "scheduler"]],
)
def test_bad_command_lines_are_clean_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        exhaustive.main(argv)
    assert exit_info.value.code == 2


def test_a_failure_after_key_preserving_operations_keeps_them_in_its_sequence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a world reused after operations that left its key unchanged: the failure is reported with them, unless
    # the operation also fails on a fresh replay of the path (then that shorter sequence)
    class Fresh:
        def apply(self, op: exhaustive.Op, check: bool = True) -> None:
            if op == ("fails", "alone"):
                raise AssertionError("alone")

    monkeypatch.setattr(exhaustive, "run_ops", lambda *args, **kwargs: Fresh())
    path = (("insert", "0"),)
    since = [("evict", "negative")]
    error = AssertionError("after the rejection")
    assert exhaustive.shortest_failure("cache", 1, path, since, ("fails", "alone"), error) == (
        "AssertionError: alone",
        (("insert", "0"), ("fails", "alone")),
    )
    assert exhaustive.shortest_failure("cache", 1, path, since, ("fails", "after"), error) == (
        "AssertionError: after the rejection",
        (("insert", "0"), ("evict", "negative"), ("fails", "after")),
    )
    # a failure of a copy that its replay does not show is the deep copy's
    assert exhaustive.shortest_failure("cache", 1, path, [], ("fails", "after"), error) == (
        "a deep copy of the state differs from its replay: on the copy, AssertionError: after the rejection",
        (("insert", "0"), ("fails", "after")),
    )


@pytest.mark.parametrize("page_size", [1, 2])
def test_the_alphabet_drives_every_operation_of_the_spec(page_size: int) -> None:
    driven = {exhaustive.DRIVES[op[0]] for op in exhaustive.alphabet(page_size)}
    # size_info is compared after every operation (World.check)
    assert driven | {"size_info"} == set(OPERATIONS)
