"""``python -m fuzz.planted``: plant known bugs one at a time in a copy of the tree; time the campaign's catch.

Each bug is a textual edit of one file (the real bugs that keep hitting
serving engines). The copy is fuzzed with ``python -m fuzz``; the table
says how long the campaign took to find a failing example and to report
it shrunk. A bug that survives the budget is reported as MISSED.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PlantedBug:
    """A known bug as an edit: replace ``old`` by ``new`` in ``path``."""

    name: str
    path: str
    old: str
    new: str
    machine: str
    impl: str = "reference"


BUGS: tuple[PlantedBug, ...] = (
    PlantedBug(
        "split_at does not copy ref_count",
        "reference/radix_cache.py",
        "        new_node.ref_count = self.ref_count\n",
        "",
        "cache",
    ),
    PlantedBug(
        "lock skips the handle's own node (mini-sglang #52)",
        "reference/radix_cache.py",
        "        node = self._check_handle(handle).node\n        # UPDATE\n",
        "        node = self._check_handle(handle).node\n        node = node.parent or node\n        # UPDATE\n",
        "cache",
    ),
    PlantedBug(
        "evict takes a locked leaf",
        "reference/radix_cache.py",
        "            # nobody holds a lock on it\n            and node.ref_count == 0\n",
        "",
        "cache",
    ),
    PlantedBug(
        "cache_req forgets to free [old_handle.cached_len : cached_len)",
        "reference/cache_manager.py",
        "        self._free(row[old_handle.cached_len : cached_len])\n",
        "",
        "manager",
    ),
    PlantedBug(
        "LRU by insertion time instead of last access",
        "reference/radix_cache.py",
        "leaves = [(node.timestamp, id(node), node)",
        "leaves = [(node.generation, id(node), node)",
        "cache",
    ),
    PlantedBug(
        "match_req matches the whole prompt",
        "reference/cache_manager.py",
        "match_prefix(req.input_ids[: len(req.input_ids) - 1], req.namespace)",
        "match_prefix(req.input_ids, req.namespace)",
        "manager",
    ),
    # the same bugs in the optimized implementation
    PlantedBug(
        "split_at does not copy ref_count",
        "optimized/radix_cache.py",
        "        new_node.ref_count = node.ref_count\n",
        "",
        "cache",
        "optimized",
    ),
    PlantedBug(
        "lock skips the handle's own node (mini-sglang #52)",
        "optimized/radix_cache.py",
        "        node = self._check_handle(handle).node\n        # UPDATE\n",
        "        node = self._check_handle(handle).node\n        node = node.parent or node\n        # UPDATE\n",
        "cache",
        "optimized",
    ),
    PlantedBug(
        "evict takes a locked leaf",
        "optimized/radix_cache.py",
        "            if node.ref_count == 0 and not node.children and self._lru_key(node) == ts:",
        "            if not node.children and self._lru_key(node) == ts:",
        "cache",
        "optimized",
    ),
    PlantedBug(
        "cache_req forgets to free [old_handle.cached_len : cached_len)",
        "optimized/cache_manager.py",
        "        self._free(row[old_handle.cached_len : cached_len])\n",
        "",
        "manager",
        "optimized",
    ),
    PlantedBug(
        "LRU by insertion time instead of last access",
        "optimized/radix_cache.py",
        "        return node.timestamp\n",
        "        return node.generation\n",
        "cache",
        "optimized",
    ),
    PlantedBug(
        "match_req matches the whole prompt",
        "optimized/cache_manager.py",
        "match_prefix(req.input_ids[: len(req.input_ids) - 1], req.namespace)",
        "match_prefix(req.input_ids, req.namespace)",
        "manager",
        "optimized",
    ),
    # the scheduler's request lifecycle
    PlantedBug(
        "abort of an in-flight request frees twice (mini-sglang #111)",
        "reference/scheduler.py",
        "            if uid in self.finished_reqs or uid not in self.live:\n"
        "                continue  # its last batch finished it and freed it already\n",
        "",
        "scheduler",
    ),
    PlantedBug(
        "cache_req(finished=True) skips freeing the tail",
        "reference/cache_manager.py",
        "            self._free(row[new_handle.cached_len : req.alloc_len])\n",
        "",
        "scheduler",
    ),
    PlantedBug(
        "PrefillAdder skips the second available_size check",
        "reference/prefill.py",
        "        if estimated_len + self.reserved_size > self.cache_manager.available_size:\n"
        "            self.cache_manager.unlock(handle)\n"
        "            return None\n",
        "",
        "scheduler",
    ),
    PlantedBug(
        "decode batch built from a set",
        "reference/decode.py",
        'return Batch(reqs=list(self.running_reqs.values()), phase="decode")',
        'return Batch(reqs=list(set(self.running_reqs.values())), phase="decode")',
        "scheduler",
    ),
    PlantedBug(
        "chunked request not put back at the head",
        "reference/prefill.py",
        "self.pending_list = chunked_list + self.pending_list[len(reqs) :]",
        "self.pending_list = self.pending_list[len(reqs) :] + chunked_list",
        "scheduler",
    ),
    PlantedBug(
        "_page_to_token off by one",
        "reference/cache_manager.py",
        "        return compute_page_to_token(pages, self.page_size)\n",
        "        return [slot + 1 for slot in compute_page_to_token(pages, self.page_size)]\n",
        "scheduler",
    ),
    PlantedBug(
        "unlock forgets the heap entry of a leaf it frees",
        "optimized/radix_cache.py",
        "                if not node.children:\n                    self._push(node)\n",
        "",
        "cache",
        "optimized",
    ),
)


# the KV store (optimized/store.py)
BUGS += (
    PlantedBug(
        "one-row store ignores a non-unit inner stride",
        "optimized/store.py",
        "        if t.shape[0] > 0 and width > 1 and t.stride(1) != 1:",
        "        if t.shape[0] > 1 and width > 1 and t.stride(1) != 1:",
        "kv",
        "optimized",
    ),
)


def plant(bug: PlantedBug, tree: Path) -> None:
    """Apply ``bug`` to the copy at ``tree``; the edit must match exactly once."""
    target = tree / bug.path
    text = target.read_text()
    if text.count(bug.old) != 1:
        raise SystemExit(
            f"planted bug {bug.name!r}: the text to replace occurs {text.count(bug.old)} times in {bug.path}"
        )
    target.write_text(text.replace(bug.old, bug.new))


def run_one(bug: PlantedBug, minutes: float, seed: int, shrink: bool) -> tuple[str, float | None, float | None]:
    """Fuzz a copy of the tree with ``bug`` planted; return (verdict, found after s, reported after s)."""
    with tempfile.TemporaryDirectory(prefix="radixspec-planted-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(
            ROOT,
            tree,
            ignore=shutil.ignore_patterns(
                ".git", ".tox", ".venv", "__pycache__", ".hypothesis", ".benchmarks", "build"
            ),
        )
        plant(bug, tree)
        impl = "all" if bug.machine == "scheduler" else bug.impl
        cmd = [sys.executable, "-m", "fuzz", "--machine", bug.machine, "--impl", impl]
        cmd += ["--minutes", str(minutes), "--seed", str(seed), "--quiet"]
        if not shrink:
            cmd.append("--no-shrink")
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
    found = re.search(
        r"first failing example after ([\d.]+) s, (?:not )?shrunk and reported after ([\d.]+) s", proc.stdout
    )
    if proc.returncode == 1 and found:
        return "caught", float(found.group(1)), float(found.group(2))
    if proc.returncode == 0:
        return "MISSED", None, None
    return f"ERROR (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", None, None


def seconds(value: float | None) -> str:
    """A duration for the table, or a dash."""
    return "-" if value is None else f"{value:.1f} s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.planted", description=__doc__)
    parser.add_argument("--minutes", type=float, default=1.0, help="campaign budget per bug")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shrink", action="store_true", help="also shrink each failure (slow: minutes per bug)")
    parser.add_argument("--impl", default=None, help="only bugs planted in this implementation")
    parser.add_argument("--only", default=None, help="only bugs whose name contains this text")
    parser.add_argument("--machine", default=None, help="only bugs caught by this machine (cache, manager, scheduler)")
    args = parser.parse_args(argv)
    chosen = [
        bug
        for bug in BUGS
        if (args.impl is None or bug.impl == args.impl)
        and (args.only is None or args.only in bug.name)
        and (args.machine is None or bug.machine == args.machine)
    ]
    missed = 0
    print(f"{'planted bug':<66} {'impl':<10} {'verdict':<8} {'found':>8} {'reported':>9}")
    for bug in chosen:
        verdict, found_s, reported_s = run_one(bug, args.minutes, args.seed, args.shrink)
        missed += verdict != "caught"
        print(f"{bug.name:<66} {bug.impl:<10} {verdict:<8} {seconds(found_s):>8} {seconds(reported_s):>9}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
