"""``python -m tools.mutation_sample``: the fast profile of ``tox -e mutation``, a sample of the mutants that fits
in half an hour on 2 cores, resumed where it stopped.

The whole scope (``[tool.mutmut]`` in ``pyproject.toml``: 8,171 mutants)
takes hours. This checks a reproducible sample of it: each mutant is in the
sample when a hash of ``(seed, its name)`` falls in the first ``--percent``
of the range, so every module and every function is sampled alike and the
sample of a name never depends on the others. mutmut runs each sampled
mutant with the tests that cover it.

Resumable: mutmut keeps every verdict under ``mutants/`` the moment it has
it; a second run passes mutmut only the sampled mutants that have no verdict
yet. The first run also makes the mutants and learns which tests cover each
(``mutmut run`` on one module's first mutants). Then the score of the sample,
per module, and its survivors by class (``tools.mutation_report``).

Exit status: 0 when every sampled mutant is checked and the score without the
argued equivalent survivors reaches ``--goal``; 1 otherwise; 2 on a usage
error.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools import mutation_report as mr

# the first run makes the mutants (mutmut makes them all on any run): with only these, which are quick
BOOTSTRAP = "spec.helpers.*__mutmut_1"


def in_sample(name: str, percent: float, seed: int) -> bool:
    """Whether mutant ``name`` is in the ``percent`` sample of ``seed`` (a hash of both, never of the others)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < percent / 100 * 2**64


def refresh_compiled(root: Path) -> list[str]:
    """Copy the checkout's compiled modules (``optimized/*.so``) over those of ``root/mutants``: mutmut copies
    them once, so after a C change a resumed run would test the old C (or fail its clean tests). The names
    copied."""
    copied = []
    target = root / "mutants" / "optimized"
    if target.is_dir():
        for module in sorted((root / "optimized").glob("*.so")):
            if not (target / module.name).exists() or (target / module.name).read_bytes() != module.read_bytes():
                shutil.copy2(module, target / module.name)
                copied.append(module.name)
    return copied


def mutmut(root: Path, names: list[str], max_children: int) -> int:
    """``mutmut run`` for ``names`` in ``root`` (with the checkout's compiled modules); its exit status."""
    copied = refresh_compiled(root)
    if copied:
        print(f"mutants/optimized: compiled modules refreshed from the checkout: {', '.join(copied)}", flush=True)
    executable = Path(sys.executable).parent / "mutmut"
    cmd = [str(executable), "run", "--max-children", str(max_children), *names]
    # mutmut's test processes run in mutants/: "." there is the mutated copy, where -p tools.mutmut_names is found
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, cwd=root, check=False, env=env).returncode


def wanted(name: str, args: argparse.Namespace) -> bool:
    """Whether mutant ``name`` is of a module ``--module`` names (any, without one)."""
    return not args.module or any(name.startswith(module + ".") for module in args.module)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.mutation_sample",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--percent", type=float, default=15.0, help="share of the mutants checked (default 15)")
    parser.add_argument("--seed", type=int, default=0, help="which sample (default 0)")
    parser.add_argument("--max-children", type=int, default=2, help="mutmut's worker processes (default 2)")
    parser.add_argument("--goal", type=float, default=90.0, help="the score to reach, in percent (default 90)")
    parser.add_argument("--root", type=Path, default=Path("."), help="where mutmut runs (holds mutants/)")
    parser.add_argument("--out", type=Path, default=None, help="write the sample's survivors with their diffs here")
    parser.add_argument("--report-only", action="store_true", help="check nothing: the report of what is checked")
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        metavar="NAME",
        help="only the mutants of this module (as mutmut names it: spec.tiers, reference.tiered_cache); repeatable",
    )
    args = parser.parse_args(argv)
    if not 0 < args.percent <= 100:
        parser.error(f"--percent must be in (0, 100], got {args.percent}")
    if args.max_children < 1:
        parser.error(f"--max-children must be >= 1, got {args.max_children}")
    began = time.monotonic()
    if not args.report_only:
        if not mr.exit_codes_by_name(args.root):
            print(f"making the mutants and learning which tests cover each (mutmut run {BOOTSTRAP})", flush=True)
            mutmut(args.root, [BOOTSTRAP], args.max_children)
        names = mr.exit_codes_by_name(args.root)
        if not names:
            print(f"mutmut made no mutants under {args.root}/mutants", file=sys.stderr)
            return 1
        sample = [name for name in sorted(names) if in_sample(name, args.percent, args.seed) and wanted(name, args)]
        pending = [name for name in sample if names[name] is None]
        print(
            f"sample {args.percent:g} % (seed {args.seed}): {len(sample)} of {len(names)} mutants;"
            f" {len(sample) - len(pending)} checked before, {len(pending)} to check",
            flush=True,
        )
        if pending:
            mutmut(args.root, pending, args.max_children)
    mutants = [m for m in mr.load(args.root) if in_sample(m.name, args.percent, args.seed) and wanted(m.name, args)]
    if not mutants:
        print(f"no mutmut results under {args.root}: run it without --report-only first", file=sys.stderr)
        return 1
    print(mr.report(mutants))
    if args.out is not None:
        args.out.write_text(mr.survivors_markdown(mutants) + "\n")
    unchecked = sum(m.status == "not checked" for m in mutants)
    elapsed = time.monotonic() - began
    print(f"\n{len(mutants) - unchecked} of {len(mutants)} sampled mutants checked; this run took {elapsed:.0f} s")
    return 0 if unchecked == 0 and mr.score_without_equivalents(mutants) >= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
