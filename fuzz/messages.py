"""Failure messages a person reads: bounded, whatever the size of the state (the regression file keeps it all).

A message names what differs and shows at most a few items: a long list is
cut to its first items and a count of the rest, and two lists are shown by
where they first differ.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

# items of a list shown in a message before "... (N more)"
SHOWN = 8
# lines and characters of one failure message in the campaign's output
MESSAGE_LINES, LINE_CHARS = 12, 300


def brief(items: Sequence[object], limit: int = SHOWN) -> str:
    """``items`` as a list, cut after ``limit`` items with a count of the rest."""
    shown = ", ".join(str(item) for item in items[:limit])
    more = len(items) - limit
    return f"[{shown}, ... ({more} more)]" if more > 0 else f"[{shown}]"


def list_diff(got: Sequence[object], want: Sequence[object], limit: int = 4) -> str:
    """Where two lists first differ, in a few items: 'lengths 3 and 5; from index 1: [..] against [..]'."""
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    lengths = f"lengths {len(got)} and {len(want)}; " if len(got) != len(want) else ""
    return f"{lengths}from index {first}: {brief(got[first:], limit)} against {brief(want[first:], limit)}"


def cut(line: str, chars: int = LINE_CHARS) -> str:
    """One line cut to ``chars`` characters, saying how many more there were."""
    return line if len(line) <= chars else f"{line[:chars]} ... ({len(line) - chars} more characters)"


def bounded(text: str, lines: int = MESSAGE_LINES, chars: int = LINE_CHARS) -> list[str]:
    """The lines of a message cut to ``lines`` lines of at most ``chars`` characters, saying what was cut."""
    all_lines = text.splitlines()
    out = [cut(line, chars) for line in all_lines[:lines]]
    hidden = len(all_lines) - lines
    return [*out, f"... ({hidden} more lines: the regression file has the whole message)"] if hidden > 0 else out


def one_line(statement: str) -> str:
    """A statement of a failing program on one line (Hypothesis spreads a long list over a line per item)."""
    try:
        return "\n".join(ast.unparse(node) for node in ast.parse(statement.strip()).body)
    except SyntaxError:
        return statement
