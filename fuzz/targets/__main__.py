"""``radixspec targets``: install the peers' released caches, list the targets.

    radixspec targets install sglang vllm    # released wheels, without their dependency trees
    radixspec targets install sglang==0.5.22 # another supported release (fuzz/targets/releases.py)
    radixspec targets install dynamo         # NVIDIA Dynamo's router index (ai-dynamo-runtime)
    radixspec targets list                   # what radixspec fuzz --list-targets prints

``install`` runs pip in the current environment: ``pip install --no-deps`` of
the pinned release, plus the few light packages the cache itself imports,
then imports the cache through its shims to show it works.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from . import TargetError, list_targets, resolve
from .releases import RELEASES, distribution, parse_requirement

# what each engine needs beside its wheel (installed with their dependencies)
LIGHT: dict[str, list[str]] = {"sglang": [], "vllm": ["cbor2"], "dynamo": ["pydantic", "uvloop"]}


def install(names: Sequence[str]) -> int:
    """pip-install each named engine release (``NAME`` or ``NAME==RELEASE``), then probe its import; the exit
    status of the whole (2 for a release no target supports, before anything is installed)."""
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
            command = [sys.executable, "-m", "pip", "install", "--quiet", *flags, *args]
            print("$", " ".join(command[2:]), flush=True)
            if subprocess.run(command, check=False).returncode != 0:
                print(f"{name}: pip failed", file=sys.stderr)
                status = 1
                break
        else:
            try:
                resolve(name)
                machine = " --machine router" if name == "dynamo" else ""
                print(f"{name}: ready (radixspec fuzz{machine} --target {name} --minutes 1)")
            except TargetError as exc:
                print(f"{name}: installed but not usable: {exc}", file=sys.stderr)
                status = 1
    return status


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
