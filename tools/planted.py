"""``python -m tools.planted``: plant known bugs one at a time in a copy of the tree; time the campaign's catch.

Each bug is a textual edit of one file (the real bugs that keep hitting
serving engines). The copy is fuzzed with ``radixspec fuzz``; the table
says how long the campaign took to find a failing example and to report
it shrunk. A bug that survives the budget is reported as MISSED; a bug whose
target cannot start here (an engine not installed) is "skipped", with what it
needs, and counted apart; a campaign that broke is an ERROR. The run exits 0
only when every bug run was caught and none was skipped (``--allow-skips``
admits skips).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from radixspec.fuzz.registry import IMPLEMENTATIONS
from radixspec.fuzz.targets import TargetError, resolve
from tools import sanitize
from tools.checkout import ROOT


@dataclass(frozen=True)
class PlantedBug:
    """A known bug as an edit: replace ``old`` by ``new`` in ``path``."""

    name: str
    path: str
    old: str
    new: str
    machine: str
    impl: str = "reference"
    # a bug planted in a peer's released cache (path relative to the installed package), not in our tree
    peer: str | None = None
    # run the copy's C module built with ASan + UBSan (a memory error a plain build may never show)
    sanitize: bool = False

    @property
    def in_c(self) -> bool:
        """Planted in our C sources: the copy's module is rebuilt."""
        return self.path.endswith((".c", ".h"))


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
        'match_prefix(input_ids[: n - 1], getattr(req, "namespace", None))',
        'match_prefix(input_ids, getattr(req, "namespace", None))',
        "manager",
    ),
    # the same bugs in the optimized implementation: its tree is C (csrc/tree.c)
    PlantedBug(
        "split_at does not carry the ref count over (C)",
        "csrc/tree.c",
        "    N(prefix).ref_count = N(id).ref_count;\n",
        "",
        "cache",
        "optimized",
    ),
    PlantedBug(
        "lock skips the handle's own node (mini-sglang #52) (C)",
        "csrc/tree.c",
        "    for (int64_t id = node; !N(id).is_root; id = N(id).parent) {\n        if (N(id).ref_count == 0) {",
        "    for (int64_t id = N(node).parent; !N(id).is_root; id = N(id).parent) {\n"
        "        if (N(id).ref_count == 0) {",
        "cache",
        "optimized",
    ),
    PlantedBug(
        "evict takes a locked leaf (C)",
        "csrc/tree.c",
        "        if (is_evictable_leaf(tree, entry.node) && N(entry.node).timestamp == entry.stamp) {",
        "        if (N(entry.node).child_count == 0 && N(entry.node).timestamp == entry.stamp) {",
        "cache",
        "optimized",
    ),
    PlantedBug(
        "children table resize drops its last cell (off by one) (C)",
        "csrc/tree.c",
        "    for (int64_t i = 0; i < tree->children_capacity; ++i) {\n        if (tree->children[i].child != NONE) {",
        "    for (int64_t i = 0; i < tree->children_capacity - 1; ++i) {\n"
        "        if (tree->children[i].child != NONE) {",
        "cache",
        "optimized",
    ),
    PlantedBug(
        "evict reads a leaf's slots after freeing it (use after free) (C, ASan)",
        "csrc/tree.c",
        "        for (int64_t k = 0; k < length; k += p) {\n"
        "            starts[taken++] = slots[k];\n"
        "        }\n"
        "        int64_t parent = detach(tree, leaf);",
        "        int64_t parent = detach(tree, leaf);\n"
        "        for (int64_t k = 0; k < length; k += p) {\n"
        "            starts[taken++] = slots[k];\n"
        "        }",
        "cache",
        "optimized",
        sanitize=True,
    ),
    PlantedBug(
        "unlock forgets the queue entry of a leaf it frees (C)",
        "csrc/tree.c",
        "            if (N(id).child_count == 0 && status == RADIX_TREE_OK) {\n"
        "                status = queue_push(tree, id);\n"
        "            }\n",
        "",
        "cache",
        "optimized",
    ),
    PlantedBug(
        # the pages stay partitioned (the extra page goes to the free list): only the relation sees it
        "allocation evicts one page more than the free list lacks",
        "reference/cache_manager.py",
        "            evicted = self.prefix_cache.evict((needed_pages - free_pages) * self.page_size)\n",
        "            extra = self.page_size if self.prefix_cache.size_info.evictable_size > (needed_pages - free_pages)"
        " * self.page_size else 0\n"
        "            evicted = self.prefix_cache.evict((needed_pages - free_pages) * self.page_size + extra)\n",
        "manager",
        "reference",
    ),
    PlantedBug(
        "lazy free region loses its frees when its body raises",
        "reference/cache_manager.py",
        "        try:\n            yield\n        finally:\n            held, self.lazy_frees = self.lazy_frees, None\n"
        "            self.free_slots.extend(held)\n",
        "        yield\n        held, self.lazy_frees = self.lazy_frees, None\n        self.free_slots.extend(held)\n",
        "manager",
        "reference",
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
        "match_req matches the whole prompt",
        "optimized/cache_manager.py",
        'match_prefix(input_ids[: n - 1], getattr(req, "namespace", None))',
        'match_prefix(input_ids, getattr(req, "namespace", None))',
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
        "            self._free(row[new_handle.cached_len : fields.alloc_len])\n",
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
    # in the core both schedulers share: only the scheduler laws (spec/scheduler.py) can tell
    PlantedBug(
        "admission reserves one token too many per request (shared core)",
        "reference/prefill.py",
        "        estimated_len = p * compute_pages_to_finish(req.input_len + req.output_len, cached_len, p)\n",
        "        estimated_len = p * compute_pages_to_finish(req.input_len + req.output_len + 1, cached_len, p)\n",
        "scheduler",
    ),
    PlantedBug(
        # over-conservative, never unsafe: only the law's exact batch (liveness) can tell
        "running requests reserve one token too many each (shared core)",
        "reference/decode.py",
        "            p * compute_pages_to_finish(req.max_device_len, req.alloc_len, p)"
        " for req in self.running_reqs.values()\n",
        "            p * compute_pages_to_finish(req.max_device_len + 1, req.alloc_len, p)"
        " for req in self.running_reqs.values()\n",
        "scheduler",
    ),
    PlantedBug(
        "EOS ignored by the stop rule (shared by every scheduler and baseline)",
        "spec/requests.py",
        "    return sampled >= params.max_tokens or (not params.ignore_eos and token == eos_token_id)\n",
        "    return sampled >= params.max_tokens\n",
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


# a router's index (the router machine; impl: the router target): our relay into Dynamo, and our own index
BUGS += (
    PlantedBug(
        "the relay drops removals (the router keeps evicted blocks)",
        "fuzz/targets/dynamo.py",
        "            hashes = [external_hash(h) for h in event.block_hashes]\n",
        "            hashes = []\n",
        "router",
        "dynamo",
    ),
    PlantedBug(
        "the relay roots every stored run (parent hash dropped)",
        "fuzz/targets/dynamo.py",
        '            stored = {"parent_hash": None if parent is None else external_hash(parent), "blocks": blocks}\n',
        '            stored = {"parent_hash": None, "blocks": blocks}\n',
        "router",
        "dynamo",
    ),
    PlantedBug(
        "namespaces folded into one (no cache_namespace, relay and prompt)",
        "fuzz/targets/dynamo.py",
        "lora_name=lora_name, cache_namespace=namespace)[0]",
        "lora_name=lora_name, cache_namespace=None)[0]",
        "router",
        "dynamo",
    ),
    PlantedBug(
        "a prompt hashed one token late (eagle's shift on the query only)",
        "fuzz/targets/dynamo.py",
        "        local = self.hasher.of_blocks(tokens, cache_namespace(namespace), lora_name(namespace))\n",
        "        local = self.hasher.of_blocks(tokens[1:], cache_namespace(namespace), lora_name(namespace))\n",
        "router",
        "dynamo",
    ),
    PlantedBug(
        "our index forgets every other worker when one joins",
        "spec/router.py",
        "            replayer = self.workers[worker] = Replayer(self.page_size, check_hashes=self.check_hashes)\n",
        "            self.workers.clear()\n"
        "            replayer = self.workers[worker] = Replayer(self.page_size, check_hashes=self.check_hashes)\n",
        "router",
        "radixspec-router",
    ),
)


# the tiered cache (the tiered machine, the reference beside the spec): the classes of the engines' 2026 tier bugs
TIERED = "reference/tiered_cache.py"
BUGS += (
    PlantedBug(
        "a load back copies one host page into every device page (SGLang #39830, #30321: a host hit's wrong KV)",
        TIERED,
        "                self.device_pool[destination // p] = self.host_pool[source // p]\n",
        "                self.device_pool[destination // p] = self.host_pool[transfer.source[0] // p]\n",
        "tiered",
    ),
    PlantedBug(
        "write-back lets an unbacked page leave on eviction (SGLang #39444: a prefix lost before its backup)",
        TIERED,
        '        return self.policy != "write_back"\n',
        "        return True\n",
        "tiered",
    ),
    PlantedBug(
        "a split leaves the upper half without host locks (SGLang PR #38480)",
        TIERED,
        '        for name in ("device_since", "lock_ref", "host_ref", "pins", "hits"):\n',
        '        for name in ("device_since", "lock_ref", "pins", "hits"):\n',
        "tiered",
    ),
    PlantedBug(
        "reset gives the host pages back twice (SGLang #26009: duplicate host free slots)",
        TIERED,
        "        self.host_free += sorted(start for node in nodes for start in node.host_value or [])\n",
        "        self.host_free += 2 * sorted(start for node in nodes for start in node.host_value or [])\n",
        "tiered",
    ),
    PlantedBug(
        "reset leaves storage serving (vLLM #57727: a reset that leaves the CPU tier serving)",
        TIERED,
        "        self.storage.clear()\n        self.epoch += 1\n",
        "        self.epoch += 1\n",
        "tiered",
    ),
    PlantedBug(
        "a store files its page under its parent's key (vLLM #53498: stored blocks never reachable)",
        TIERED,
        "                self.storage[namespace, tuple(tokens[: (page + 1) * p])] = content\n",
        "                self.storage[namespace, tuple(tokens[: max(1, page) * p])] = content\n",
        "tiered",
    ),
    PlantedBug(
        "a load back may evict the device hit it extends (SGLang PR #42289: a hit lost before allocation)",
        TIERED,
        "        keep = set(self._nodes_between(path, 0, device)) | self._fetching()\n",
        "        keep = self._fetching()\n",
        "tiered",
    ),
    PlantedBug(
        "a match serves storage hits while storage is offline (an outage the cache does not see)",
        TIERED,
        "        if not self.storage_online:\n            return page\n",
        "",
        "tiered",
    ),
    PlantedBug(
        "a store completes while storage is offline (an acknowledged write the backend never took)",
        TIERED,
        '        if "storage" in st.ROUTES[transfer.kind] and not self.storage_online:\n',
        "        if False:\n",
        "tiered",
    ),
)

# historical bug classes of SGLang, re-planted in a copy of its released radix cache (RADIXSPEC_SGLANG_RADIX_CACHE)
PEER_BUGS: tuple[PlantedBug, ...] = (
    PlantedBug(
        "evictable size counted twice for shared pages (SGLang #35270)",
        "srt/mem_cache/radix_cache.py",
        "            if node.lock_ref == 1:\n",
        "            if node.lock_ref >= 1:\n",
        "cache",
        "sglang",
        peer="sglang",
    ),
    PlantedBug(
        "a page freed twice when an eviction exposes its parent (SGLang #38981 class)",
        "srt/mem_cache/radix_cache.py",
        "                heapq.heappush(eviction_heap, (new_priority, x.parent))\n",
        "                heapq.heappush(eviction_heap, (new_priority, x.parent))\n"
        "                self.token_to_kv_pool_allocator.free_segment(x.value[-self.page_size :], start_pos=0)\n",
        "cache",
        "sglang",
        peer="sglang",
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


def target_of(bug: PlantedBug) -> str:
    """The target the campaign on ``bug`` drives (``all``: every implementation of ours)."""
    return f"{bug.peer}:legacy" if bug.peer is not None else bug.impl


def cannot_start(bug: PlantedBug) -> str | None:
    """Why the campaign on ``bug`` cannot start here (its target is not ready: an engine not installed), or None."""
    name = target_of(bug)
    if name == "all" or name in IMPLEMENTATIONS:
        return None
    try:
        resolve(name)
    except TargetError as exc:
        return str(exc)
    return None


def run_one(bug: PlantedBug, minutes: float, seed: int, shrink: bool) -> tuple[str, float | None, float | None]:
    """Fuzz a copy of the tree with ``bug`` planted; return (verdict, found after s, reported after s)."""
    if bug.peer is not None:
        return run_one_peer(bug, minutes, seed, shrink)
    with tempfile.TemporaryDirectory(prefix="radixspec-planted-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*sanitize.COPY_IGNORE))
        plant(bug, tree)
        if bug.in_c or bug.sanitize:
            try:
                sanitize.build(tree, sanitize=bug.sanitize)
            except RuntimeError as exc:
                return f"ERROR: {str(exc).splitlines()[0]}", None, None
        extra = ["--quiet"] + ([] if shrink else ["--no-shrink"])
        if bug.sanitize:
            (run,) = sanitize.run_campaigns(tree, [bug.machine], minutes, seed, extra)
            if run.report is not None:
                return "caught", run.seconds, run.seconds
            return verdict(subprocess.CompletedProcess([], run.returncode, run.stdout, run.stderr))
        impl = "all" if bug.machine == "scheduler" else bug.impl
        # a router is a target (the router machine's workers are ours)
        select = ["--target", bug.impl] if bug.machine == "router" else ["--impl", impl]
        cmd = [sys.executable, "-m", "radixspec.fuzz", "--machine", bug.machine, *select]
        cmd += ["--minutes", str(minutes), "--seed", str(seed), *extra]
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
    return verdict(proc)


def run_one_peer(bug: PlantedBug, minutes: float, seed: int, shrink: bool) -> tuple[str, float | None, float | None]:
    """Fuzz the target ``bug.peer`` with ``bug`` planted in a copy of its module."""
    from radixspec.fuzz.targets.shims import package_root

    assert bug.peer == "sglang", "only SGLang's radix cache can be loaded from a patched copy"
    with tempfile.TemporaryDirectory(prefix="radixspec-planted-") as tmp:
        copy = Path(tmp) / "radix_cache.py"
        shutil.copy(package_root(bug.peer) / bug.path, copy)
        plant(replace(bug, path=copy.name), Path(tmp))
        cmd = [sys.executable, "-m", "radixspec.fuzz", "--target", f"{bug.peer}:legacy", "--machine", bug.machine]
        cmd += ["--minutes", str(minutes), "--seed", str(seed), "--quiet"]
        if not shrink:
            cmd.append("--no-shrink")
        env = {**os.environ, "RADIXSPEC_SGLANG_RADIX_CACHE": str(copy)}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    return verdict(proc)


def verdict(proc: subprocess.CompletedProcess[str]) -> tuple[str, float | None, float | None]:
    """What a campaign on a planted bug did: caught (with its times), missed, or failed to run (exit 2: a usage
    error, 3: the campaign broke)."""
    found = re.search(
        r"first failing example after ([\d.]+) s, (?:not )?shrunk and reported after ([\d.]+) s", proc.stdout
    )
    if proc.returncode == 1 and found:
        return "caught", float(found.group(1)), float(found.group(2))
    if proc.returncode == 0:
        return "MISSED", None, None
    # a broken campaign names why in its summary's last lines (stdout); a usage error on stderr
    detail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
    return f"ERROR (exit {proc.returncode}): {detail}", None, None


def seconds(value: float | None) -> str:
    """A duration for the table, or a dash."""
    return "-" if value is None else f"{value:.1f} s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.planted", description=__doc__)
    parser.add_argument("--minutes", type=positive_float, default=1.0, help="campaign budget per bug")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shrink", action="store_true", help="also shrink each failure (slow: minutes per bug)")
    parser.add_argument(
        "--impl",
        default=None,
        choices=sorted({bug.impl for bug in BUGS}),
        help="only bugs planted in this implementation",
    )
    parser.add_argument("--only", default=None, help="only bugs whose name contains this text")
    parser.add_argument(
        "--machine", default=None, choices=sorted({bug.machine for bug in BUGS}), help="only bugs this machine catches"
    )
    parser.add_argument(
        "--peer",
        default=None,
        choices=sorted({bug.peer for bug in PEER_BUGS if bug.peer}),
        help="plant historical bugs in a copy of this peer's released cache instead of ours",
    )
    parser.add_argument(
        "--allow-skips",
        action="store_true",
        help="exit 0 when every bug that could run was caught, though some were skipped (their target not ready)",
    )
    args = parser.parse_args(argv)
    pool = [bug for bug in PEER_BUGS if bug.peer == args.peer] if args.peer else list(BUGS)
    chosen = [
        bug
        for bug in pool
        if (args.impl is None or bug.impl == args.impl)
        and (args.only is None or args.only in bug.name)
        and (args.machine is None or bug.machine == args.machine)
    ]
    if not chosen:
        parser.error("no planted bug matches these options")
    counts = {"caught": 0, "MISSED": 0, "skipped": 0, "ERROR": 0}
    needs: dict[str, str] = {}
    began = time.monotonic()
    print(
        f"{len(chosen)} planted bugs, a campaign of at most {args.minutes:g} min each. Clocks: found / reported ="
        " seconds from the campaign's start to the first failing example / to its report (the campaign's own"
        " clock); wall = the whole run (copy, build, start-up, imports)",
        flush=True,
    )
    print(f"{'planted bug':<76} {'impl':<10} {'verdict':<8} {'found':>8} {'reported':>9} {'wall':>8}", flush=True)
    for number, bug in enumerate(chosen, 1):
        # progress on stderr: the table on stdout stays a table
        print(f"[{number}/{len(chosen)}] running {bug.name} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        reason = cannot_start(bug)
        if reason is not None:
            outcome, found_s, reported_s = "skipped", None, None
            needs[target_of(bug)] = reason
        else:
            outcome, found_s, reported_s = run_one(bug, args.minutes, args.seed, args.shrink)
        wall = time.monotonic() - start
        counts[outcome.split(" ")[0].rstrip(":")] += 1
        note = f" (needs {target_of(bug)}: see below)" if reason is not None else ""
        print(
            f"{bug.name:<76} {bug.impl:<10} {outcome:<8} {seconds(found_s):>8} {seconds(reported_s):>9}"
            f" {seconds(wall):>8}{note}",
            flush=True,
        )
    ran = len(chosen) - counts["skipped"]
    print(
        f"{counts['caught']} of {ran} run caught ({counts['MISSED']} missed, {counts['ERROR']} errors);"
        f" {counts['skipped']} skipped, their target not ready; in {time.monotonic() - began:.0f} s",
        flush=True,
    )
    for target, reason in needs.items():
        print(f"skipped: {target}: {reason}", flush=True)
    failed = counts["MISSED"] + counts["ERROR"] + (0 if args.allow_skips else counts["skipped"])
    return 1 if failed else 0


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
