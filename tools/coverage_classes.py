"""``python -m tools.coverage_classes A.json B.json ...``: the lines of vLLM's core cache modules that campaigns run
with ``radixspec fuzz --coverage --json`` never reached (over the files together: a line counts as reached when any
campaign reached it), each put in a class by the function it is in, with each module's line share of what is left
once the classes set apart are taken out (issue 53: the unreached lines explained).

The classes (``CLASSES``) are read from vLLM 0.33.0 (2026-12-07): engine start-up code that sizes the pool and is
never called by the cache after; request features no target draws (prompt embeddings: images and LoRA adapters are
drawn since 41efc1f and c265942); attention kinds no target draws; a KV connector's paths (the connector targets run
some); metrics. What is in no class is in what the targets draw and was not reached by these campaigns: a reach
gap. Each line in a class is still reachable on a CPU: the classes explain the gap, they do not close it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from radixspec.fuzz.engine_coverage import all_bodies

# class -> a pattern of the qualified names of the functions in it
CLASSES: dict[str, str] = {
    "start-up sizing (run once as the engine sizes its pool, never by the cache after)": (
        r"^(resolve_kv_cache_block_sizes|get_max_concurrency_for_kv_cache_config|update_kv_cache_capacity"
        r"|generate_scheduler_kv_cache_config|get_kv_cache_capacity|_kv_cache_device_name|resolve_dcp_kv_cache_spec"
        r"|resolve_cache_hit_alignment_tokens|get_none_hash_seed|resolve_none_hash_seed|init_none_hash"
        r"|register_all_kvcache_specs|_validate_prefix_cache_retention_interval|get_kv_cache_coordinator"
        r"|KVCacheCoordinatorNoPrefixCache\..*|HybridKVCacheCoordinator\.(__init__|verify_and_split_kv_cache_groups)"
        r"|KVCacheCoordinator\.__init__)$"
    ),
    "request features no target draws (prompt embeddings)": r"^_gen_prompt_embeds_extra_hash_keys$",
    "attention kinds no target draws (chunked local, reversed window, circular buffer, sink, cross, HiSparse)": (
        r"^(ChunkedLocalAttentionManager|RSWAManager|CircularBufferManager|SinkFullAttentionManager"
        r"|CrossAttentionManager|_?HiSparse\w*)\."
    ),
    "a KV connector's paths (external hits, the per-group lookup, failed loads' evictions, pins)": (
        r"(allocate_external_computed_blocks|find_longest_cache_hit_per_group|evict_blocks|unpin_blocks"
        r"|_notify_reuse|finalize_partial_tail_offload|move_block_hashes"
        r"|KVCacheCoordinator\.allocate_new_computed_blocks)$"
    ),
    "metrics (a metrics collector, the pool's usage, a block's repr)": (
        r"(get_usage|take_events|KVCacheBlock\.__repr__)$"
    ),
}
# the modules the classes were read from
MODULES = (
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager",
)
UNCLASSED = "in what the targets draw: a reach gap"


@dataclass
class Module:
    """One module over the campaigns: its statements and the lines no campaign reached."""

    name: str
    path: str
    statements: int
    missing: set[int]
    # class -> function -> lines
    classes: dict[str, dict[str, int]] = field(default_factory=dict)

    def classify(self) -> None:
        bodies = all_bodies(Path(self.path).read_text())
        spans = [(len(lines), -len(name), name, lines) for name, ranges in bodies.items() for lines in ranges]
        for line in sorted(self.missing):
            owner = min((span for span in spans if line in span[3]), default=(0, 0, "<module>", range(0)))[2]
            kind = next((kind for kind, pattern in CLASSES.items() if re.search(pattern, owner)), UNCLASSED)
            functions = self.classes.setdefault(kind, {})
            functions[owner] = functions.get(owner, 0) + 1

    def report(self) -> list[str]:
        reached = self.statements - len(self.missing)
        apart = sum(sum(functions.values()) for kind, functions in self.classes.items() if kind != UNCLASSED)
        rest = self.statements - apart
        lines = [
            f"{self.name}: {self.statements} statements, {reached} reached ({100 * reached / self.statements:.1f} %);"
            f" of the {rest} outside the classes set apart, {100 * reached / max(1, rest):.1f} %"
        ]
        for kind, functions in sorted(self.classes.items(), key=lambda item: -sum(item[1].values())):
            named = ", ".join(f"{name} {count}" for name, count in sorted(functions.items(), key=lambda f: -f[1]))
            lines.append(f"  {sum(functions.values())} {kind}: {named}")
        return lines


def union(files: list[Path]) -> dict[str, Module]:
    """The modules of ``MODULES`` over the campaigns' JSON summaries: a line is missing where every file misses it."""
    modules: dict[str, Module] = {}
    for path in files:
        for entry in json.loads(path.read_text()).get("coverage") or []:
            if entry["module"] not in MODULES:
                continue
            missing = set(entry["missing_lines"])
            if (known := modules.get(entry["module"])) is None:
                modules[entry["module"]] = Module(entry["module"], entry["path"], entry["statements"], missing)
            else:
                known.missing &= missing
    return modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.coverage_classes", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="JSON summaries of campaigns run with --coverage")
    args = parser.parse_args(argv)
    modules = union(args.files)
    if not modules:
        print(f"no coverage of {', '.join(MODULES)} in {len(args.files)} file(s): run with --coverage", file=sys.stderr)
        return 2
    for module in modules.values():
        module.classify()
        print("\n".join(module.report()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
