"""``radixspec targets``: install the peers' released caches, list the targets.

    radixspec targets install sglang vllm    # released wheels, without their dependency trees
    radixspec targets install sglang==0.5.22 # another supported release (fuzz/targets/releases.py)
    radixspec targets install dynamo         # NVIDIA Dynamo's router index (ai-dynamo-runtime)
    radixspec targets install tokenspeed     # TokenSpeed's scheduler (tokenspeed-scheduler)
    radixspec targets list                   # what radixspec fuzz --list-targets prints

``install`` runs pip in the current environment: ``pip install --no-deps`` of
the pinned release, plus the few light packages its targets import (with their
own dependencies), then probes every target of that engine (``releases.VARIANTS``:
``sglang``, ``sglang:python``, ..., ``vllm-mamba``, ``dynamo``): each imports the
engine's cache through its shims and builds one small instance. It exits 0 only
when every target of every engine named is ready, else 1 naming what is missing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from . import TargetError, list_targets, readiness
from .releases import RELEASES, VARIANTS, distribution, parse_requirement

# what each engine's targets need beside its wheel (installed with their dependencies): the engines' KV event
# recorders run for real only with msgspec and pyzmq; vLLM's block hashes use cbor2, its KV offloading manager imports
# its connector's metrics (prometheus_client); Dynamo's relay reads msgspec
LIGHT: dict[str, list[str]] = {
    "sglang": ["msgspec", "pyzmq"],
    "vllm": ["cbor2", "msgspec", "pyzmq", "prometheus_client"],
    "dynamo": ["pydantic", "uvloop", "msgspec"],
    "tokenspeed": [],
}
# pip's warnings that the engine's own dependency tree is missing: that is the point of --no-deps
QUIET_PIP = ["--quiet", "--no-warn-conflicts"]


def install(names: Sequence[str]) -> int:
    """pip-install each named engine release (``NAME`` or ``NAME==RELEASE``), then probe every target of it; the
    exit status of the whole: 0 every target ready, 1 a pip failure or a target not ready (each named), 2 a
    release no target supports (before anything is installed)."""
    try:
        wanted = [parse_requirement(name) for name in names]
    except TargetError as exc:
        print(f"radixspec targets install: {exc}", file=sys.stderr)
        return 2
    status = 0
    for name, release in wanted:
        no_deps, light = [f"{distribution(name)}=={release}"], LIGHT[name]
        # the engine's wheel without its dependency tree, then the light packages with theirs
        for flags, args in ((["--no-deps"], no_deps), ([], light)):
            if not args:
                continue
            command = [sys.executable, "-m", "pip", "install", *QUIET_PIP, *flags, *args]
            print("$", " ".join(command[2:]), flush=True)
            if subprocess.run(command, check=False).returncode != 0:
                print(f"{name}: pip failed", file=sys.stderr)
                status = 1
                break
        else:
            status = max(status, probe(name))
    return status


def probe(engine: str) -> int:
    """Resolve every target of ``engine`` as a campaign would (its imports, one small instance; each in a fresh
    interpreter); print what is ready and, for each target that is not, why; 0 when all are ready, else 1."""
    found = readiness(VARIANTS[engine])
    ready = [variant for variant, problem in found.items() if problem is None]
    broken = [f"{variant}: {problem}" for variant, problem in found.items() if problem is not None]
    if ready:
        machine = " --machine router" if engine == "dynamo" else ""
        print(f"{engine}: ready: {', '.join(ready)} (radixspec fuzz{machine} --target {ready[0]} --minutes 1)")
    for line in broken:
        print(f"{engine}: NOT READY: {line}", file=sys.stderr)
    return 1 if broken else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixspec targets", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    install_parser = commands.add_parser("install", help="install released peer caches without their dependencies")
    install_parser.add_argument(
        "names",
        nargs="+",
        metavar="NAME[==RELEASE]",
        help="; ".join(f"{name}: {', '.join(releases)}" for name, releases in RELEASES.items()),
    )
    commands.add_parser("list", help="list the targets and whether each is ready")
    args = parser.parse_args(argv)
    if args.command == "install":
        return install(args.names)
    print("\n".join(list_targets()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
