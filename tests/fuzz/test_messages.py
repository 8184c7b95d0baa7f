"""Failure messages stay readable whatever the size of the state: bounded lists, diffs, one-line statements."""

from __future__ import annotations

from radixspec.fuzz.messages import bounded, brief, cut, list_diff, one_line
from radixspec.fuzz.regression import docstring_safe


def test_a_long_list_is_cut_with_a_count_of_the_rest() -> None:
    assert brief(list(range(3))) == "[0, 1, 2]"
    assert brief(list(range(100))) == "[0, 1, 2, 3, 4, 5, 6, 7, ... (92 more)]"
    assert brief(list(range(100)), 2) == "[0, 1, ... (98 more)]"


def test_two_lists_are_shown_where_they_first_differ() -> None:
    got, want = list(range(100)), [*range(50), 7, *range(51, 100)]
    assert list_diff(got, want) == (
        "from index 50: [50, 51, 52, 53, ... (46 more)] against [7, 51, 52, 53, ... (46 more)]"
    )
    assert list_diff([1, 2], [1, 2, 3]) == "lengths 2 and 3; from index 2: [] against [3]"


def test_a_message_is_bounded_in_lines_and_characters() -> None:
    text = "\n".join(["x" * 1000, *[f"line {i}" for i in range(40)]])
    lines = bounded(text, lines=5, chars=50)
    assert len(lines) == 6 and all(len(line) <= 90 for line in lines)
    assert lines[0].endswith("(950 more characters)") and lines[-1].startswith("... (36 more lines")
    assert bounded("short") == ["short"]
    assert cut("abc", 2) == "ab ... (1 more characters)"


def test_a_statement_spread_over_lines_is_put_on_one() -> None:
    spread = "state.insert(seq=[\n    1,\n    2,\n    3,\n], ns=None)"
    assert one_line(spread) == "state.insert(seq=[1, 2, 3], ns=None)"
    assert one_line("not python (") == "not python ("


def test_a_message_with_quotes_and_backslashes_fits_in_a_docstring() -> None:
    message = 'a """quoted""" path C:\\tmp\\x'
    namespace: dict[str, object] = {}
    exec(f'def f():\n    """{docstring_safe(message)}"""\n', namespace)
    assert namespace["f"].__doc__ == message  # type: ignore[attr-defined]
