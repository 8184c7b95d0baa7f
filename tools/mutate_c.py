"""``python -m tools.mutate_c``: mutation testing of the C tree (``csrc/tree.c``).

mutmut sees Python only; this applies standard mutation operators to the C
source, one mutant at a time, and asks whether the campaigns notice:

* ``ror``: a relational operator replaced by its neighbour (``<`` and
  ``<=``, ``>`` and ``>=``, ``==`` and ``!=``);
* ``const``: an integer literal (0 to 64) plus or minus one;
* ``delete``: an expression statement deleted (a call, an assignment, an
  increment; never a declaration, a return, a break or a brace);
* ``swap``: the two arguments of a two-argument call swapped.

Only code is mutated: comments, preprocessor lines, string literals and the
cffi declarations' header are left alone. Each mutant is built in a copy of
the checkout (``csrc/build_ffi.py``) and faced with stages in turn, until
one kills it (``--stages`` picks them; the default is the first two):

1. **machines**: the cache and the manager machines on the optimized
   implementation, side by side, for ``--seconds`` each;
2. **tests**: the C tree's own tests (``C_TESTS``), on a build with ASan +
   UBSan (``tools.sanitize``): its entry points called as any C caller would,
   including what the Python wrapper never asks (an empty match), the blocks
   of memory every call and every tree give back, and any overrun or use
   after free on the way;
3. **sanitized**: the machines again, for half the seconds, on that build.

Verdicts: **killed** (a stage failed, crashed or hung past its budget; the
stage is named), **survived** (every stage clean), **build failed** (the
mutant is not C; it counts in neither). A survivor of the machines argued
equivalent (below) faces no later stage. ``--sample K --seed S`` draws a
reproducible subset of the mutants; ``--json`` writes every verdict.
``--sanitize`` builds each mutant with ASan + UBSan from the start.

A survivor listed in ``EQUIVALENT`` (by its line before and after) carries the
argument why no caller can tell it from the tree; the score counts the
mutants that are not equivalent: killed / (built - equivalent). Exit status 0
when the score reaches ``--goal`` (default 90 %), 1 below it, 2 on a usage
error.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tools import sanitize
from tools.checkout import ROOT

SOURCE = "csrc/tree.c"
OPERATORS = ("ror", "const", "delete", "swap")
MACHINES = ("cache", "manager")
# what can face a mutant, in turn, until one kills it: the machines; the C tree's own tests (its entry points
# called as any C caller would, the blocks of memory every call gives back) on an ASan + UBSan build; the machines
# on that build. The default: the first two (the third costs a survivor 20 s more)
STAGES = ("machines", "tests", "sanitized")
DEFAULT_STAGES = ("machines", "tests")
C_TESTS = ("tests/optimized/test_tree_c.py",)
TESTS_TIMEOUT = 90
# a machine still running this long past its budget hangs (a campaign ends within its budget and 10 s, start-up
# included 13 s): killed
HANG_SLACK = 15
ROR = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "=="}
# a relational operator between operands (not part of <<, >>, ->, <<=, >>=)
ROR_PATTERN = re.compile(r"(?<![<>=!\-])(<=|>=|==|!=|<|>)(?![<>=])")
CONST_PATTERN = re.compile(r"(?<![\w.])(\d+)(?![\w.])")
# f(a, b); with plain arguments (no nested call or comma inside)
SWAP_PATTERN = re.compile(r"\b(\w+)\(([^(),]+),\s*([^(),]+)\)")
STATEMENT_PATTERN = re.compile(r"^\s+[\w\->.\[\]()*&+ ]+(\+\+|--|[-+*/|&]?=[^=].*|\(.*\));\s*$")
SKIPPED_STATEMENTS = ("return", "break", "continue", "goto", "case", "default")
DECLARATION_PATTERN = re.compile(
    r"^\s*(const\s+)?(static\s+)?(u?int\d+_t|int|char|size_t|double|void|\w+_t|struct\s+\w+|"
    r"segment|node_t|child_cell|leaf_entry|radix_tree)\s*\**\s*\w+\s*(=|;|\[)"
)


# survivors no caller can tell from the tree, by (function, line before, line after stripped): the argument
EQUIVALENT: dict[tuple[str, str, str], str] = {
    (
        "compare_entries",
        "return entry_before(*x, *y) ? -1 : entry_before(*y, *x) ? 1 : 0;",
        "return entry_before(*x, *y) ? -1 : entry_before(*y, *x) ? 2 : 0;",
    ): "a qsort comparator's result: any positive value means the same",
    (
        "radix_tree_insert",
        "} else if ((status = reserve(tree, 1, 0)) != RADIX_TREE_OK) {",
        "} else if ((status = reserve(tree, 1, 1)) != RADIX_TREE_OK) {",
    ): "the insert reserves room for one page more than it uses: capacity only, never read",
    (
        "radix_tree_check",
        "int64_t *marks = block_calloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 1) * 2, sizeof *marks);",
        "int64_t *marks = block_calloc((size_t)(tree->nodes_high >= 0 ? tree->nodes_high : 1) * 2, sizeof *marks);",
    ): "the check's mark buffer: nodes_high is never 0 (the first root is made with the tree)",
    (
        "mix64",
        "x = (x ^ (x >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);",
        "x = (x ^ (x >> 29)) * UINT64_C(0xBF58476D1CE4E5B9);",
    ): "the hash of the children and slot tables mixes differently: any hash finds the same cells, in other places",
    (
        "children_reserve",
        "while ((tree->children_count + extra) * 2 > tree->children_capacity) {",
        "while ((tree->children_count + extra) * 3 > tree->children_capacity) {",
    ): "the children table grows at a third full, not at half: capacity only, the cells found are the same",
    (
        "heap_pop",
        "if (child >= tree->heap_length) {",
        "if (child > tree->heap_length) {",
    ): "at child == heap_length the cell read is the one just taken off the end (never written in the loop): "
    "it is `last` itself, not before itself, and the loop stops there all the same",
    (
        "starts_reserve",
        "while ((tree->starts_count + extra) * 2 > capacity) {",
        "while ((tree->starts_count + extra) * 3 > capacity) {",
    ): "the slot table grows at a third full, not at half: capacity only, the cells found are the same",
    (
        "fifo_grow",
        "int64_t capacity = tree->fifo_capacity * 2;",
        "int64_t capacity = tree->fifo_capacity * 3;",
    ): "the ring grows threefold, not twofold: capacity only, the entries keep their order",
    (
        "queue_push",
        "if (status == RADIX_TREE_OK && tree->fifo_length + tree->heap_length > 2 * tree->node_count + 64) {",
        "if (status == RADIX_TREE_OK && tree->fifo_length + tree->heap_length > 2 * tree->node_count + 63) {",
    ): "the queues are compacted one stale entry sooner: when, not what (the rebuild keeps every live leaf)",
    (
        "reserve",
        "if (status == RADIX_TREE_OK && tree->heap_length == tree->heap_capacity) {",
        "if (status != RADIX_TREE_OK && tree->heap_length == tree->heap_capacity) {",
    ): "the heap is not grown ahead; heap_push grows it when full: different only when malloc fails",
    (
        "scratch_reserve",
        "while (grown < count) {",
        "while (grown <= count) {",
    ): "the scratch buffer grows once more than needed: capacity only",
    (
        "radix_tree_free",
        "for (int64_t id = 0; id < tree->nodes_high; ++id) {",
        "for (int64_t id = 1; id < tree->nodes_high; ++id) {",
    ): "the tree's release skips node 0, the first root, which never holds a segment",
    (
        "radix_tree_export",
        "int64_t *stack = block_malloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 1) * 2 * sizeof *stack);",
        "int64_t *stack = block_malloc((size_t)(tree->nodes_high > 1 ? tree->nodes_high : 1) * 2 * sizeof *stack);",
    ): "the stack's size at nodes_high == 1: both give 1",
    (
        "radix_tree_export",
        "int64_t *stack = block_malloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 1) * 2 * sizeof *stack);",
        "int64_t *stack = block_malloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 0) * 2 * sizeof *stack);",
    ): "the export's stack when nodes_high is 0: never (the first root is made with the tree)",
    (
        "radix_tree_check",
        "for (int64_t j = 1; j < p; ++j) {",
        "for (int64_t j = 0; j < p; ++j) {",
    ): "the check compares a page's slot 0 with its own start (start + 0): always equal",
    (
        "radix_tree_check",
        "int64_t *marks = block_calloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 1) * 2, sizeof *marks);",
        "int64_t *marks = block_calloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 0) * 2, sizeof *marks);",
    ): "the check's mark buffer when nodes_high is 0: never (the first root is made with the tree)",
    (
        "radix_tree_check",
        "if (listed > tree->nodes_high || N(child).parent != id) {",
        "if (listed >= tree->nodes_high || N(child).parent != id) {",
    ): "the bound only stops a child list that loops: a list without a cycle holds at most nodes_high - 1 "
    "children (never the node itself), so both stop the same lists, with the same message",
    (
        "check_new_pages",
        "for (int64_t k = 1; k < p && status == RADIX_TREE_OK; ++k) {",
        "for (int64_t k = 0; k < p && status == RADIX_TREE_OK; ++k) {",
    ): "a page's slot 0 is compared with its own start (start + 0): always equal",
    (
        "radix_tree_evict",
        "if (taken > 1) {",
        "if (taken > 0) {",
    ): "the evicted starts are sorted when there is one: a sort of one item changes nothing",
    (
        "radix_tree_evict",
        "if (reserve(tree, 1, 0) != RADIX_TREE_OK) {",
        "if (reserve(tree, 0, 0) != RADIX_TREE_OK) {",
    ): "no node is reserved ahead of an eviction's split: the split's node_alloc grows the table itself, so the "
    "two differ only when malloc fails (the split then reports no memory after some pages went)",
    (
        "children_reserve",
        "if (status != RADIX_TREE_OK) {",
        "if (status == RADIX_TREE_OK) {",
    ): "the reserve returns after one doubling: every caller asks for at most 2 more children, the table starts "
    "at 64 cells and is at most half full, so one doubling always makes room (count + 2 <= capacity); the loop "
    "differs only when malloc fails (it tries again instead of reporting)",
    (
        "radix_tree_export",
        "while (top > 0) {",
        "while (top > 1) {",
    ): "the export's stack holds (node, parent) pairs, so its height is always even: top > 1 is top > 0",
    (
        "queue_push",
        "if (status == RADIX_TREE_OK && tree->fifo_length + tree->heap_length > 2 * tree->node_count + 64) {",
        "if (status == RADIX_TREE_OK && tree->fifo_length + tree->heap_length >= 2 * tree->node_count + 64) {",
    ): "the queues are compacted at the bound, not one entry past it: when, not what (the rebuild keeps every "
    "live leaf)",
    (
        "queue_rebuild",
        "leaf_entry *entries = block_malloc((size_t)(count > 0 ? count : 1) * sizeof *entries);",
        "leaf_entry *entries = block_malloc((size_t)(count > 0 ? count : 0) * sizeof *entries);",
    ): "a rebuild starts from queue_push of an evictable leaf, so count is at least 1: the branch for 0 is never taken",
    (
        "reserve",
        "if (status == RADIX_TREE_OK && tree->fifo_length == tree->fifo_capacity) {",
        "if (status != RADIX_TREE_OK && tree->fifo_length == tree->fifo_capacity) {",
    ): "the ring is not grown ahead; fifo_push grows it when full: different only when malloc fails",
    (
        "split_at",
        "if (reserve(tree, 1, 0) != RADIX_TREE_OK) {",
        "if (reserve(tree, 1, 1) != RADIX_TREE_OK) {",
    ): "the split reserves room for one page more than it uses: capacity only, never read",
    (
        "radix_tree_new",
        "radix_tree *tree = block_calloc(1, sizeof *tree);",
        "radix_tree *tree = block_calloc(2, sizeof *tree);",
    ): "the tree's own block is twice as big: nothing reads past the first (memory_bytes counts sizeof *tree)",
    (
        "valid_root",
        "for (int64_t base = 0; base < n; base += 256) {                  \\",
        "for (int64_t base = 0; base <= n; base += 256) {                  \\",
    ): "FIRST_NEGATIVE (the macro after valid_root): at base == n the block is empty (end = n), nothing is read",
    (
        "check_new_pages",
        "while (capacity < 2 * count) {",
        "while (capacity <= 2 * count) {",
    ): "the new pages' seen set doubles once more at exactly half full: capacity only, the cells found are the same",
    (
        "compare_segments",
        "return (x > y) - (x < y);",
        "return (x >= y) - (x < y);",
    ): "equal pointers compare greater both ways; every other pair is ordered, so qsort still puts each segment's "
    "holders between the smaller and the larger pointers, together, and the check counts the same runs",
    (
        "check_segments",
        "segment **held = block_malloc((size_t)(tree->node_count > 0 ? tree->node_count : 1) * sizeof *held);",
        "segment **held = block_malloc((size_t)(tree->node_count >= 0 ? tree->node_count : 1) * sizeof *held);",
    ): "with no node the buffer is malloc(0): a unique pointer on glibc, and no cell is written (count stays 0)",
    (
        "check_segments",
        "segment **held = block_malloc((size_t)(tree->node_count > 0 ? tree->node_count : 1) * sizeof *held);",
        "segment **held = block_malloc((size_t)(tree->node_count > 0 ? tree->node_count : 0) * sizeof *held);",
    ): "with no node the buffer is malloc(0): a unique pointer on glibc, and no cell is written (count stays 0)",
    (
        "radix_tree_check",
        "int64_t *marks = block_calloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 1) * 2, sizeof *marks);",
        "int64_t *marks = block_calloc((size_t)(tree->nodes_high > 1 ? tree->nodes_high : 1) * 2, sizeof *marks);",
    ): "the check's mark buffer at nodes_high == 1: both give 1",
    (
        "radix_tree_check",
        "int64_t *marks = block_calloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 1) * 2, sizeof *marks);",
        "int64_t *marks = block_calloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 2) * 2, sizeof *marks);",
    ): "the check's mark buffer when nodes_high is 0: never (the first root is made with the tree)",
}

# a top-level line that opens a function: its name
FUNCTION_PATTERN = re.compile(r"^[a-z][\w\s*]*?\b(\w+)\(")


@dataclass(frozen=True)
class Mutant:
    """One edit of one line of the source."""

    number: int
    operator: str
    line: int
    before: str
    after: str
    # the function the line is in
    function: str = ""

    def describe(self) -> str:
        after = self.after.strip() or "(deleted)"
        return f"#{self.number} {self.operator} line {self.line} ({self.function}): {self.before.strip()} -> {after}"

    @property
    def equivalent(self) -> str | None:
        """The argument why no caller can tell this mutant from the tree (EQUIVALENT), or None."""
        return EQUIVALENT.get((self.function, self.before.strip(), self.after.strip()))


@dataclass
class Verdict:
    mutant: Mutant
    verdict: str
    seconds: float
    detail: str = ""
    # the stage that killed it (STAGES)
    stage: str = ""


def code_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines that are code: not in a comment, not preprocessor."""
    in_comment = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if in_comment:
            if "*/" in stripped:
                in_comment = False
            continue
        if stripped.startswith("/*"):
            in_comment = "*/" not in stripped
            continue
        if not stripped or stripped.startswith(("#", "//", "*")):
            continue
        yield number, line


def strip_strings(line: str) -> str:
    """The line with string and char literals and trailing comments blanked (same length), so that the
    patterns never match inside them."""
    out = re.sub(r'"(\\.|[^"\\])*"', lambda m: " " * len(m.group(0)), line)
    out = re.sub(r"'(\\.|[^'\\])*'", lambda m: " " * len(m.group(0)), out)
    cut = out.find("/*")
    return out if cut < 0 else out[:cut] + " " * (len(out) - cut)


def mutants_of(text: str) -> list[Mutant]:
    """Every mutant of the source, in a fixed order (line, operator, position)."""
    found: list[Mutant] = []
    functions = function_by_line(text)

    def add(operator: str, number: int, before: str, after: str) -> None:
        if after != before:
            found.append(Mutant(len(found), operator, number, before, after, functions[number]))

    for number, line in code_lines(text):
        scan = strip_strings(line)
        for match in ROR_PATTERN.finditer(scan):
            if "#include" in scan:
                continue
            start, end = match.span(1)
            add("ror", number, line, line[:start] + ROR[match.group(1)] + line[end:])
        for match in CONST_PATTERN.finditer(scan):
            value = int(match.group(1))
            if value > 64 or (re.search(r"\w\[\s*$", scan[: match.start(1)]) and DECLARATION_PATTERN.match(scan)):
                continue
            start, end = match.span(1)
            for changed in (value + 1, value - 1):
                if changed >= 0:
                    add("const", number, line, line[:start] + str(changed) + line[end:])
        stripped = scan.strip()
        if (
            STATEMENT_PATTERN.match(scan)
            and not stripped.startswith(SKIPPED_STATEMENTS)
            and not DECLARATION_PATTERN.match(scan)
            and not stripped.startswith(("if", "for", "while", "}", "{", "else"))
        ):
            add("delete", number, line, "")
        for match in SWAP_PATTERN.finditer(scan):
            if match.group(1) in ("if", "while", "for", "sizeof", "return"):
                continue
            a, b = match.group(2).strip(), match.group(3).strip()
            if a == b:
                continue
            start, end = match.span(0)
            add("swap", number, line, line[:start] + f"{match.group(1)}({b}, {a})" + line[end:])
    return found


def function_by_line(text: str) -> dict[int, str]:
    """The function each line (numbered from 1) is in: the last top-level line before it that opens one."""
    out, current = {}, ""
    for number, line in enumerate(text.splitlines(), 1):
        found = FUNCTION_PATTERN.match(line)
        if found is not None:
            current = found.group(1)
        out[number] = current
    return out


def apply(text: str, mutant: Mutant) -> str:
    lines = text.splitlines(keepends=True)
    assert lines[mutant.line - 1].rstrip("\n") == mutant.before, f"{mutant.describe()}: the source changed"
    lines[mutant.line - 1] = mutant.after + "\n" if mutant.after else ""
    return "".join(lines)


def face_machines(tree: Path, seconds: float, seed: int, env: dict[str, str] | None) -> str | None:
    """Run the cache and manager machines on the optimized implementation in ``tree``, side by side, for
    ``seconds`` each: why the mutant is killed (a machine failed, crashed or hung past its budget), or None."""
    procs = {
        machine: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fuzz",
                "--machine",
                machine,
                "--impl",
                "optimized",
                "--workers",
                "0",
                "--minutes",
                f"{seconds / 60:.4f}",
                "--seed",
                str(seed),
                "--no-shrink",
                "--quiet",
            ],
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for machine in MACHINES
    }
    deadline = time.monotonic() + seconds + HANG_SLACK
    killed: str | None = None
    while procs and killed is None:
        for machine, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[machine]
            if code != 0:
                _, err = proc.communicate()
                report = sanitize.SANITIZER_REPORT.search(err)
                last = report.group(0) if report else (err.strip().splitlines() or [""])[-1]
                killed = f"{machine}: exit {code}" + (f": {last[:160]}" if last else "")
                break
        if killed is None and procs and time.monotonic() > deadline:
            killed = f"{', '.join(procs)}: hung past the budget"
        if killed is None:
            time.sleep(0.1)
    for proc in procs.values():
        proc.kill()
        proc.communicate()
    return killed


def face_tests(tree: Path, env: dict[str, str] | None) -> str | None:
    """Run the C tree's own tests (C_TESTS) in ``tree``: the first failing test, or None when all pass."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *C_TESTS],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=TESTS_TIMEOUT,
        check=False,
    )
    if proc.returncode == 0:
        return None
    report = sanitize.SANITIZER_REPORT.search(proc.stdout + proc.stderr)
    failed = re.search(r"^(FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    found = report.group(0)[:160] if report else failed.group(2) if failed else f"pytest exit {proc.returncode}"
    return f"tests: {found}"


def run_mutant(
    mutant: Mutant,
    text: str,
    seconds: float,
    seed: int,
    sanitized: bool = False,
    stages: Sequence[str] = DEFAULT_STAGES,
) -> Verdict:
    """Build the mutant in a copy (with ASan + UBSan when ``sanitized``) and face it with ``stages`` in turn,
    until one kills it: the machines for ``seconds`` each; the C tree's tests, on a build with ASan + UBSan; the
    machines on that build for ``seconds / 2``. A survivor argued equivalent (EQUIVALENT) stops after the first
    stage: its argument says why no caller can tell it apart, and was checked when it was written."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="radixspec-mutant-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*sanitize.COPY_IGNORE))
        (tree / SOURCE).write_text(apply(text, mutant))
        try:
            sanitize.build(tree, sanitize=sanitized)
        except RuntimeError as exc:
            return Verdict(mutant, "build failed", time.monotonic() - began, str(exc).splitlines()[-1][:200])
        env = sanitize.sanitized_env() if sanitized else None
        for index, stage in enumerate(stages):
            if index > 0 and mutant.equivalent is not None:
                break
            try:
                if stage != "machines" and env is None:
                    sanitize.build(tree, sanitize=True)
                    env = sanitize.sanitized_env()
                if stage == "machines":
                    killed = face_machines(tree, seconds, seed, env)
                elif stage == "tests":
                    killed = face_tests(tree, env)
                else:
                    killed = face_machines(tree, seconds / 2, seed, env)
            except subprocess.TimeoutExpired:
                killed = f"{stage}: hung past {TESTS_TIMEOUT} s"
            except RuntimeError as exc:
                return Verdict(mutant, "build failed", time.monotonic() - began, f"{stage}: {exc}"[:200])
            if killed is not None:
                return Verdict(mutant, "killed", time.monotonic() - began, killed, stage)
    return Verdict(mutant, "survived", time.monotonic() - began)


def summarize(verdicts: Sequence[Verdict], operators: Sequence[str], stages: Sequence[str], seconds: float) -> float:
    """Print the score, the kills by operator and by stage, and the survivors with their arguments; the score."""
    killed = sum(v.verdict == "killed" for v in verdicts)
    equivalent = sum(v.verdict == "survived" and v.mutant.equivalent is not None for v in verdicts)
    built = sum(v.verdict != "build failed" for v in verdicts)
    counted = built - equivalent
    score = 100.0 * killed / counted if counted else 0.0
    print(
        f"\nkilled {killed}, survived {built - killed} ({equivalent} of them equivalent, argued in EQUIVALENT),"
        f" build failed {len(verdicts) - built}; score {score:.1f} % of the {counted} built mutants that are not"
        f" equivalent ({100.0 * killed / built if built else 0.0:.1f} % of all {built} built) in {seconds:.0f} s"
    )
    for operator in operators:
        mine = [v for v in verdicts if v.mutant.operator == operator and v.verdict != "build failed"]
        if mine:
            k = sum(v.verdict == "killed" for v in mine)
            print(f"  {operator:<7} {k}/{len(mine)} killed")
    print("killed by: " + ", ".join(f"the {stage} {sum(v.stage == stage for v in verdicts)}" for stage in stages))
    survivors = [v for v in verdicts if v.verdict == "survived"]
    if survivors:
        print("survivors:")
        for v in survivors:
            argument = v.mutant.equivalent
            print(f"  {v.mutant.describe()}" + (f"\n      equivalent: {argument}" if argument else ""))
    return score


def rescore(path: Path, goal: float) -> int:
    """The summary of a run's ``--json`` file again, with today's EQUIVALENT (arguments written after the run)."""
    run = json.loads(path.read_text())
    fields = {name for name in Mutant.__dataclass_fields__}
    verdicts = [
        Verdict(
            Mutant(**{k: v for k, v in row.items() if k in fields}),
            row["verdict"],
            row["seconds"],
            row["detail"],
            row.get("stage", ""),
        )
        for row in run["verdicts"]
    ]
    print(f"{path}: {len(verdicts)} mutants of {run['source']}, seed {run['seed']}, {run['seconds']:g} s per machine")
    score = summarize(verdicts, OPERATORS, run.get("stages", ["machines"]), sum(v.seconds for v in verdicts))
    return 0 if score >= goal else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.mutate_c", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sample", type=int, default=None, help="draw this many mutants (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample and of the campaigns")
    parser.add_argument("--seconds", type=float, default=15.0, help="budget of each machine per mutant (default 15)")
    parser.add_argument("--operator", choices=OPERATORS, nargs="+", default=list(OPERATORS))
    parser.add_argument("--list", action="store_true", help="list the mutants (numbered) and stop")
    parser.add_argument("--only", type=int, nargs="+", default=None, help="only these mutant numbers")
    parser.add_argument(
        "--goal", type=float, default=90.0, help="the score to reach: percent killed of the built, not equivalent"
    )
    parser.add_argument(
        "--sanitize", action="store_true", help="build each mutant with ASan + UBSan (memory errors kill it)"
    )
    parser.add_argument(
        "--stages",
        choices=STAGES,
        nargs="+",
        default=list(DEFAULT_STAGES),
        help="what faces each mutant, in this order, until one kills it: the machines, the C tree's tests on an"
        " ASan + UBSan build, the machines on that build for half the seconds (default: machines tests)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every verdict here")
    parser.add_argument(
        "--rescore", type=Path, default=None, help="print the summary of a --json file again (today's EQUIVALENT)"
    )
    args = parser.parse_args(argv)
    if args.rescore is not None:
        return rescore(args.rescore, args.goal)
    if args.sample is not None and args.sample < 1:
        parser.error(f"--sample must be >= 1, got {args.sample}")
    if not args.seconds > 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    text = (ROOT / SOURCE).read_text()
    every = [m for m in mutants_of(text) if m.operator in args.operator]
    chosen = every
    if args.only is not None:
        chosen = [m for m in every if m.number in set(args.only)]
    elif args.sample is not None and args.sample < len(every):
        chosen = sorted(random.Random(args.seed).sample(every, args.sample), key=lambda m: m.number)
    if args.list:
        for mutant in chosen:
            print(mutant.describe())
        print(f"{len(chosen)} of {len(every)} mutants of {SOURCE}")
        return 0
    print(
        f"{len(chosen)} of {len(every)} mutants of {SOURCE} ({', '.join(args.operator)}); cache and manager"
        f" machines, {args.seconds:g} s each per mutant, seed {args.seed}"
        + (", built with ASan + UBSan" if args.sanitize else "")
        + f"; stages: {', '.join(args.stages)}",
        flush=True,
    )
    verdicts: list[Verdict] = []
    began = time.monotonic()
    for index, mutant in enumerate(chosen, 1):
        result = run_mutant(mutant, text, args.seconds, args.seed, args.sanitize, args.stages)
        verdicts.append(result)
        print(
            f"[{index}/{len(chosen)} {time.monotonic() - began:6.0f} s] {result.verdict:<12} {result.seconds:5.1f} s"
            f"  {mutant.describe()}"
            + (f"  (by the {result.stage})" if result.stage else "")
            + (f"  ({result.detail})" if result.detail and result.verdict != "killed" else ""),
            flush=True,
        )
    score = summarize(verdicts, args.operator, args.stages, time.monotonic() - began)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "source": SOURCE,
                    "seed": args.seed,
                    "seconds": args.seconds,
                    "score": score,
                    "sanitized": args.sanitize,
                    "stages": args.stages,
                    "verdicts": [
                        {
                            **asdict(v.mutant),
                            "verdict": v.verdict,
                            "seconds": v.seconds,
                            "detail": v.detail,
                            "stage": v.stage,
                            "equivalent": v.mutant.equivalent,
                        }
                        for v in verdicts
                    ],
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if score >= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
