"""The mutation score and its survivors, read from a finished ``mutmut run`` (``tox -e mutation``).

``python -m tools.mutation_report [--root .] [--out docs/mutation_survivors.md]`` reads ``mutmut results``
and the mutants' sources under ``mutants/``, prints the score per module and overall, and writes every
survivor with its diff, grouped by class. A class is either an argument that the mutant is equivalent
(it cannot change what any caller observes on this machine) or ``other``: a test gap.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# the statuses of ``mutmut results --all true`` that count as killed ("aborted": see mark_aborts)
KILLED = ("killed", "timeout", "segfault", "aborted")
# a test process that glibc aborted (SIGABRT: it caught the heap corruption a mutant made); mutmut says "suspicious"
ABORT_EXIT_CODES = (-6, 134)


def survived(mutant: Mutant) -> bool:
    """Checked and not killed: a survivor (mutmut's "suspicious" too, unless mark_aborts found it aborted)."""
    return mutant.status not in (*KILLED, "not checked")


@dataclass
class Mutant:
    """One mutant: its name (module.function__mutmut_N), its status, and the lines it changed."""

    name: str
    status: str
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)

    @property
    def module(self) -> str:
        return _split(self.name)[0]


def _split(name: str) -> tuple[str, str]:
    """(module, mangled function) of a mutant name."""
    found = re.match(r"(.*?)\.(x[_ǁ].*)", name)
    if found is None:
        raise ValueError(f"not a mutmut mutant name: {name!r}")
    return found.group(1), found.group(2)


def parse_results(text: str) -> list[Mutant]:
    """The mutants of ``mutmut results --all true`` output."""
    out = []
    for line in text.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            out.append(Mutant(name, status))
    return out


def exit_codes_by_name(root: Path) -> dict[str, int | None]:
    """Every mutant mutmut made under ``root/mutants`` with its exit code (None: not checked yet), from the
    ``*.meta`` files it writes (each verdict the moment it has it)."""
    codes: dict[str, int | None] = {}
    for meta in sorted((root / "mutants").rglob("*.meta")):
        codes.update(json.loads(meta.read_text()).get("exit_code_by_key", {}))
    return codes


def exit_codes(root: Path) -> dict[str, int]:
    """Each checked mutant's exit code."""
    return {name: code for name, code in exit_codes_by_name(root).items() if code is not None}


def mark_aborts(mutants: Iterable[Mutant], codes: dict[str, int]) -> None:
    """A "suspicious" mutant whose tests glibc aborted is killed by a crash, as a segfault is: say "aborted"."""
    for mutant in mutants:
        if mutant.status == "suspicious" and codes.get(mutant.name) in ABORT_EXIT_CODES:
            mutant.status = "aborted"


def add_diffs(mutants: Iterable[Mutant], root: Path) -> None:
    """Fill each mutant's removed and added lines from ``root/mutants/<module>.py`` (orig vs mutant)."""
    sources: dict[Path, dict[str, list[str]]] = {}
    for mutant in mutants:
        module, function = _split(mutant.name)
        path = root / "mutants" / (module.replace(".", "/") + ".py")
        if path not in sources:
            sources[path] = _functions(path.read_text()) if path.exists() else {}
        base = re.sub(r"__mutmut_\d+$", "__mutmut_orig", function)
        original, changed = sources[path].get(base), sources[path].get(function)
        if original is None or changed is None:
            continue
        # the def line too (a mutated default argument), each function under one name
        original = [line.replace(base, "f") for line in original]
        changed = [line.replace(function, "f") for line in changed]
        for line in difflib.unified_diff(original, changed, lineterm="", n=0):
            if line.startswith(("---", "+++", "@@")):
                continue
            (mutant.removed if line.startswith("-") else mutant.added).append(line[1:].rstrip())


def _functions(source: str) -> dict[str, list[str]]:
    """Each mangled function of a mutated module: its lines (the def line first)."""
    lines = source.splitlines()
    return {
        node.name: lines[node.lineno - 1 : node.end_lineno]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "__mutmut_" in node.name
    }


# ---------------------------------------------------------------- classes of survivors

OFF_CPU = (
    "_launch_cuda",
    "store_torch(",
    "store_torch_fast(",
    "has_cuda_kernel",
    '"cuda"',
    "_scratch_errors",
    "first_bad_page_torch",
    "first_outside_torch",
    # store_cache's CUDA branch (its checks on the device, then the kernel)
    "find_first_bad_row(indices, num_slots)",
    "raise_for_status(status, row, indices, num_slots)",
    # device_of's count of GPUs: asked only when CUDA is available
    "torch.cuda.device_count()",
)


def _message(removed: str, added: str) -> bool:
    """Only the words of a message, label or help text changed."""
    if "XX" in added and "XX" not in removed:
        return True
    if added.lower() == removed.lower() and added != removed:
        return True
    if re.search(r"(Error|Exception)\(None\)", added):
        return True
    if added.strip() == "None" and re.match(r'\s*f?"', removed):
        return True  # a message on lines of its own, given as None
    if "_law(" in removed and (re.search(r"_law\(None", added) or added.rstrip().endswith(", None)")):
        return True  # a relation's law: the operation's name or the law's words
    if re.search(r"^\s*(op|where) = None", added) or re.match(r"\s*op = f", removed):
        return True
    if re.search(r"\b(op|operation)\b", removed) and re.sub(r"\b(op|operation)\b", "None", removed) == added:
        return True  # the operation's name handed to a law
    if any(word in removed for word in ("help=", "description=", "prog=")):
        return True
    return "raise" in removed and re.sub(r"\{[^}]*\}", "", added) == re.sub(r"\{[^}]*\}", "", removed)


def _argued(name: str, removed: str = "", added: str = "") -> Callable[[str, str, str], bool]:
    """A test on (mutant name, removed, added): each regex given must be found in its part."""
    return lambda n, r, a: all(re.search(rx, text) for rx, text in ((name, n), (removed, r), (added, a)) if rx)


# (class, its argument, its test on (name, removed, added)): the first class whose test holds names the survivor;
# a class named "equivalent..." or "off-CPU..." argues that no test on this machine can tell the mutant apart
CLASSES: list[tuple[str, str, Callable[[str, str, str], bool]]] = [
    (
        "off-CPU branch (GPU only)",
        "the CUDA kernel's and the torch fallback's branches run only on a GPU device",
        lambda n, r, a: any(s in r for s in OFF_CPU),
    ),
    (
        "message or label text",
        "only the words changed; the twins' messages are compared by the differential and pinned by tests, so a "
        "survivor here is text no test reaches",
        lambda n, r, a: _message(r, a),
    ),
    (
        "equivalent: zip(strict=) on equal lengths",
        "the two sequences have equal lengths by construction; strict only guards that",
        lambda n, r, a: "strict=True" in r and ("strict=False" in a or "strict=None" in a or "strict=" not in a),
    ),
    (
        "equivalent: int64 is torch's default for ints",
        "torch.tensor / arange / as_tensor of Python ints is int64 without the dtype argument, and int64 meets int32 "
        "in a comparison or an assignment as the same values",
        lambda n, r, a: (
            bool(re.search(r"dtype=(torch\.int64|slots\.dtype|row\.dtype)", r))
            and ("dtype=None" in a or "dtype=" not in a)
        ),
    ),
    (
        "equivalent here: the device default is the CPU",
        "on a machine without a GPU, device=None and the CPU are one device; a GPU run kills these",
        lambda n, r, a: (
            ("device" in r or "_on_host" in r)
            and ("device=None" in a or "to(None)" in a or a.count("device") < r.count("device") or "_on_host" in r)
        ),
    ),
    (
        "equivalent: an internal assertion weakened",
        "the assertion states what every caller establishes; a weaker one never fails on a correct run",
        _argued("", r"^\s*assert "),
    ),
    (
        "equivalent: a tie-breaker never compared",
        "evictable leaves never share a stamp (leaf_stamps_are_distinct), so the heap never reads the id() after it",
        _argued("", r"\bid\(", r"id\(None\)"),
    ),
    (
        "equivalent: a fast path not taken",
        "the mutant sends more inputs to the general, checked path, which gives the same answer and the same error",
        lambda n, r, a: (
            bool(re.search(r"x__int_array|x_compute_match_len|x__check_ints", n))
            or bool(re.search(r"ǁ_tokens__|ǁ_slots__", n) and re.search(r"_int_array\(|\.dim\(\) == 1", r))
            or bool(re.search(r"ǁ_tokens__|ǁ_slots__", n) and re.search(r"read = self\._read_in_place\(", r))
            or bool(re.search(r"x_byte_span", n) and re.search(r"t\.dim\(\) == [12]", r))
            or ("type(None)" in a and "type(" in r)
        ),
    ),
    (
        "equivalent: outputs the check does not read",
        "radix_tree_counts writes seven counters; the check reads only the number of roots",
        _argued(r"RadixPrefixCacheǁcheck_integrity", r"radix_tree_(sizes|counts)\("),
    ),
    (
        "equivalent: the root handle's version is never read",
        "a handle that matched nothing names the namespace's root, which never goes stale: its version is not checked",
        _argued(
            r"RadixPrefixCacheǁ(match_prefix|insert_prefix)", r"RadixCacheHandle\(0, _ROOT, 0,", r"_ROOT, (None|1),"
        ),
    ),
    (
        "equivalent on a sound C tree: its corruption path",
        "only a corrupted C tree reports CORRUPT or an unknown status here; python -m tools.planted plants such C bugs "
        "and times their catch, outside the mutation run",
        _argued(r"RadixPrefixCacheǁ(check_integrity|_after_evict)", r"ffi\.string\(message\)|_raise_for\(status\)"),
    ),
    (
        "equivalent: a precomputed argument recomputed",
        "is_evictable computes the same set of pages with children when it is not handed one",
        _argued(r"x_is_evictable|x_get_evictable_leaves", "with_children"),
    ),
    (
        "equivalent: a default argument every caller passes",
        "the mutated default is never used: every call site passes the argument",
        _argued("", r"def f\(", r"def f\("),
    ),
    (
        "equivalent: zero-length work at the boundary",
        "at the boundary the branch does nothing (an empty allocation, eviction, row rewrite, hash extension or "
        "count of zero pages)",
        _argued(
            r"ǁallocate_paged|ǁ_allocate|ǁcache_req|ǁ_row_hashes|RadixPrefixCacheǁinsert_prefix|x_allocate_paged__",
            r" > | < ",
            r" >= | <= |or True",
        ),
    ),
    (
        "equivalent: a scratch buffer's size",
        "a C scratch buffer one or two elements larger, or sized by a larger count; C writes within the count given",
        lambda n, r, a: (
            _argued("", r"ffi\.new\(|3 \* len|_emptied_room")(n, r, a)
            or _argued(r"HybridRadixCacheǁabstract_state", r"torch\.empty\(max\(capacity")(n, r, a)
        ),
    ),
    (
        "equivalent: an exact division",
        "the operands are whole multiples of P, so / and // give equal numbers where they are compared",
        _argued(r"x_insert_prefix_contract|NaivePrefixCacheǁinsert_prefix", "//", r"[^/]/ "),
    ),
    (
        "equivalent: the contract harness builds the same refusal",
        "in the contract's domain the first cached slot is 0 and every misaligned or short variant is refused with "
        "the same error; each bad-slot case is also checked to be planted",
        _argued(r"x_insert_prefix_contract|x_fresh_slots"),
    ),
    (
        "equivalent: a root's stamp or generation",
        "a root is not a page: its stamp and generation are never read",
        _argued(r"ǁ_find_root", r"RadixTreeNode\(self\.page_size, -1, -1\)"),
    ),
    (
        "equivalent: an initial value set again before it is read",
        "a node gets its key, value and namespace when it is linked into the tree, before any read; a None flag "
        "reads as False",
        _argued(r"RadixTreeNodeǁ__init__", r"self\.(detached|key|value|namespace)\b"),
    ),
]


ONE_BY_ONE_CLASS = "equivalent: argued one by one"

# (its test on (name, removed, added), the argument): survivors equivalent for a reason of their own line
ONE_BY_ONE: list[tuple[Callable[[str, str, str], bool], str]] = [
    (
        _argued(r"TieredRadixCacheǁ_walk", r"len\(tokens\) // p \* p", r"len\(tokens\) / p \* p"),
        "the walk's end as a float past the last whole page: a slice of the partial page is shorter than a page "
        "and an empty one names no child, so no child is found or compared there and the walk stops where it "
        "stops with // (the indices stay ints); spec and reference agreed over 60,000 random steps with it",
    ),
    (
        _argued(r"TieredNodeǁ__init__", r"self\.detached = False", r"self\.detached = None"),
        "a tiered node's detached flag is read only as a truth value (a handle through a detached node is "
        "stale), and None reads as False",
    ),
    (
        _argued(r"xǁPrefixǁ__eq__", r"a is None or b is None"),
        "two prefixes of equal length with equal pages at each level reach the end of their chains together, so "
        "one is None only when both are, and then the loop has ended (a is b)",
    ),
    (
        _argued(r"xǁReplayerǁ_store", r"self\.children\.get\(parent_hash, 0\)"),
        "a page stored again is still cached, and its first store counted it under this parent: the parent's "
        "count exists, so the default is never read",
    ),
    (
        _argued(r"xǁHashModelǁforward", r"\.flatten\(1\)\.any\(dim=1\)"),
        "k and v are [n, heads, dim]: flatten(2) leaves them 3-D and any(dim=1) gives [n, dim]; a row is bad in "
        "both forms alike, and nonzero's first entry names the same first bad row",
    ),
    (
        _argued(r"x__row_len", r"else 0"),
        "with no rows every request's row is out of range, and check_request refuses that before it reads the "
        "row length; allocate_paged_guard asks for the row length only after request_guard passed",
    ),
    (
        _argued(r"HybridRadixCacheǁevict", r'self\._check\(self\._lib\.hybrid_evict\(.*"evict"\)'),
        "the label names the call only in the out-of-memory and unknown-status messages; hybrid_evict returns "
        "those only when malloc fails or the tree is corrupt (its own check, hybrid_check, runs every step)",
    ),
    (
        _argued(r"x_read_cdef", r"text\.index\((BEGIN|END)\)"),
        "each header holds one BEGIN and one END marker, so index and rindex find the same one "
        "(test_kv_store compares the declared functions with the built ones)",
    ),
    (
        _argued(r"x_device_of", r"if torch\.version\.cuda else"),
        "this torch is a CPU-only build (torch.version.cuda is None): both branches say 'a CPU-only build'; "
        "a CUDA build of torch on a machine without a GPU kills it",
    ),
    (
        _argued(r"ZmqEventPublisherǁpublish", r"to_bytes\(8, \"big\"\)", r"to_bytes\(8, \)"),
        "int.to_bytes is big-endian by default since Python 3.11, the oldest Python this project supports",
    ),
    (
        _argued(r"ZmqEventPublisherǁclose", r"linger=0"),
        "linger bounds how long unsent messages are kept at close; a PUB socket drops what no subscriber takes "
        "and the tests' subscribers have read every message before it closes: nothing is pending",
    ),
    (
        _argued(r"MHAKVCacheǁ__init__", r"torch\.empty\(0, dtype=dtype\)\.element_size\(\)"),
        "element_size is the dtype's, whatever the number of elements",
    ),
    (
        _argued(r"MHAKVCacheǁ_as_rows|x__row_stride_bytes", r"t\.shape\[0\] > 1"),
        "a tensor of one row (or none) has no second row: its row stride never addresses memory, so any value "
        "reads the same bytes",
    ),
    (
        _argued(r"x_build_store_library", r"sources\[0\]\.parent"),
        "store.cu and the headers it includes lie in one directory (cuda_sources): the include path is the same",
    ),
    (
        _argued(r"x_check_store_args", r"k_cache\.dim\(\) != 2 or v_cache\.dim\(\) != 2"),
        "when only one of k_cache and v_cache is 2-D their shapes differ, so the shape clause raises the same error",
    ),
    (
        _argued(r"x_find_first_bad_row", r"row_outside <= row_repeat"),
        "a repeated row's slot appeared on an earlier row, outside the pool too if it is outside: the first "
        "outside row and the first repeat are never the same row, so < and <= agree",
    ),
    (
        _argued(r"x_store_cache_fast", r"raise_for_status\(status, -1,"),
        "any negative row reads 'some row' (raise_for_status tests row >= 0)",
    ),
    (
        _argued(r"x_store_torch_fast", r"\.to\(torch\.int32\) \* FLAG_OUT_OF_RANGE"),
        "a bool times the flag is 0 or the flag, ORed into the same int32 word",
    ),
    (
        _argued(r"RadixPrefixCacheǁmatch_prefix", r"self\.counter\.matched\(namespace, n, 0\)"),
        "matched() counts a hit only when cached_len is truthy: None and 0 both count none",
    ),
    (
        _argued(r"RadixPrefixCacheǁinsert_prefix", r"as_insert_args\(input_ids, indices, namespace,"),
        "the namespace was checked above; as_insert_args' check passes it and None alike, and only its checks "
        "of the tokens' and slots' ranges can raise here",
    ),
    (
        _argued(r"RadixPrefixCacheǁinsert_prefix", r"if out\[2\] < end:", r"out\[3\]"),
        "on success C sets bad (out[3]) to -1, so the mutant's test always holds; when nothing new was cached "
        "the count of new pages is 0 and no page is announced, as when the original's test fails",
    ),
    (
        _argued(r"RadixPrefixCacheǁ_announce_stored", r"RadixCacheHandle\(end, self\._out\[0\]"),
        "_path_slots reads the handle's node, version and length; its namespace is not read",
    ),
    (
        _argued(r"RadixPrefixCacheǁ_announce_stored", r"start=cached // p \+ 1"),
        "every announced page's depth moves by the same constant, so their order, the only use of a depth "
        "(removals deepest first), is unchanged",
    ),
    (
        _argued(r"RadixPrefixCacheǁ_(tokens|slots)", r'_int_array\("[qi]", ', r'array\("[QI]"'),
        "the typecode only decides which lists take the fast path: an unsigned code refuses a negative value "
        "(OverflowError) and the list goes to the checked path, which raises the same error; a slot in "
        "[2**31, 2**32) reaches C as a negative int32, which C refuses in the same words",
    ),
    (
        _argued(r"RadixPrefixCacheǁ__init__", r'self\._on_host = self\.device\.type == "cpu"'),
        "on the CPU, .to(self.device) returns the tensor itself: _on_host only skips a call that does nothing",
    ),
    (
        _argued(r"x_build_store_library", r"digest = hashlib\.sha256\("),
        "the digest only names the cached build: any deterministic function of the sources and the flags "
        "names it as well",
    ),
]


def one_by_one_argument(mutant: Mutant) -> str | None:
    """The argument of the one-by-one entry that names this survivor, if any."""
    removed, added = " ".join(mutant.removed), " ".join(mutant.added)
    return next((argument for holds, argument in ONE_BY_ONE if holds(mutant.name, removed, added)), None)


def classify(mutant: Mutant) -> str:
    """The class of a survivor (ONE_BY_ONE first: its arguments are the most specific, then CLASSES), else
    ``other``."""
    removed, added = " ".join(mutant.removed), " ".join(mutant.added)
    if removed or added:
        if one_by_one_argument(mutant) is not None:
            return ONE_BY_ONE_CLASS
        for name, _, holds in CLASSES:
            if holds(mutant.name, removed, added):
                return name
    return "other"


# ---------------------------------------------------------------- the report


def score(mutants: list[Mutant]) -> tuple[int, int]:
    """(killed, checked): not-checked mutants count in neither."""
    checked = [m for m in mutants if m.status != "not checked"]
    return sum(m.status in KILLED for m in checked), len(checked)


def equivalent_survivors(mutants: list[Mutant]) -> int:
    """Survivors in a class argued equivalent (or GPU-only)."""
    return sum(classify(m).startswith(("equivalent", "off-CPU")) for m in mutants if survived(m))


def score_without_equivalents(mutants: list[Mutant]) -> float:
    """Percent killed of the checked mutants that are not argued equivalent survivors."""
    killed, checked = score(mutants)
    return 100 * killed / max(checked - equivalent_survivors(mutants), 1)


def report(mutants: list[Mutant]) -> str:
    """The summary: score per module, overall, and without the equivalent classes; survivors per class."""
    by_module: dict[str, list[Mutant]] = defaultdict(list)
    for mutant in mutants:
        by_module[mutant.module].append(mutant)
    lines = ["| module | killed | checked | score |", "|---|---:|---:|---:|"]
    for module, group in sorted(by_module.items()):
        killed, checked = score(group)
        lines.append(f"| {module} | {killed} | {checked} | {100 * killed / max(checked, 1):.1f} % |")
    killed, checked = score(mutants)
    classes = Counter(classify(m) for m in mutants if survived(m))
    lines += [
        "",
        f"mutants {len(mutants)}, checked {checked}, killed {killed} (timeouts and crashes included): "
        f"{100 * killed / max(checked, 1):.1f} %",
        f"without the {equivalent_survivors(mutants)} equivalent or GPU-only survivors: "
        f"{score_without_equivalents(mutants):.1f} %",
        "",
        "| survivors | class |",
        "|---:|---|",
        *(f"| {n} | {name} |" for name, n in classes.most_common()),
    ]
    return "\n".join(lines)


def survivors_markdown(mutants: list[Mutant]) -> str:
    """Every survivor with its diff, grouped by class, each class with its argument."""
    arguments = {name: argument for name, argument, _ in CLASSES}
    arguments[ONE_BY_ONE_CLASS] = "each survivor's own argument follows its diff"
    arguments["other"] = "a test gap: no argument covers it"
    groups: dict[str, list[Mutant]] = defaultdict(list)
    for mutant in mutants:
        if survived(mutant):
            groups[classify(mutant)].append(mutant)
    out = ["# Surviving mutants of tox -e mutation, by class", "", "Written by `python -m tools.mutation_report`.", ""]
    for name, group in sorted(groups.items(), key=lambda item: -len(item[1])):
        out += [f"## {name} ({len(group)})", "", arguments[name], ""]
        for mutant in group:
            out.append(mutant.name if mutant.status == "survived" else f"{mutant.name} ({mutant.status})")
            out += [f"    - {line}" for line in mutant.removed] + [f"    + {line}" for line in mutant.added]
            if name == ONE_BY_ONE_CLASS:
                out.append(f"    why: {one_by_one_argument(mutant)}")
        out.append("")
    return "\n".join(out)


def load(root: Path) -> list[Mutant]:
    """The mutants of the mutmut run in ``root`` with their statuses (aborts marked), survivors with their diffs;
    empty when there is none."""
    run = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=root, capture_output=True, text=True
    )
    mutants = parse_results(run.stdout) if run.returncode == 0 else []
    mark_aborts(mutants, exit_codes(root))
    add_diffs([m for m in mutants if survived(m)], root)
    return mutants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mutation_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="where mutmut ran (holds mutants/)")
    parser.add_argument("--out", type=Path, help="write every survivor with its diff here (markdown)")
    args = parser.parse_args(argv)
    mutants = load(args.root)
    if not mutants:
        print(f"no mutmut results under {args.root}: run tox -e mutation first", file=sys.stderr)
        return 1
    print(report(mutants))
    if args.out is not None:
        args.out.write_text(survivors_markdown(mutants) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
