"""``radixspec targets``: install the peers' released caches, list the targets.

    radixspec targets install sglang vllm    # released wheels, without their dependency trees
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

# what each installable target needs: (pip arguments without --no-deps, pip arguments with dependencies)
PACKAGES: dict[str, tuple[list[str], list[str]]] = {
    "sglang": (["sglang==0.5.23"], []),
    "vllm": (["vllm==0.33.0"], ["cbor2"]),
}


def install(names: Sequence[str]) -> int:
    """pip-install each named target's packages, then probe its import; the exit status of the whole."""
    status = 0
    for name in names:
        no_deps, light = PACKAGES[name]
        for args in ([*no_deps], [*light]):
            if not args:
                continue
            flags = ["--no-deps"] if args is not light else []
            command = [sys.executable, "-m", "pip", "install", "--quiet", *flags, *args]
            print("$", " ".join(command[2:]), flush=True)
            if subprocess.run(command, check=False).returncode != 0:
                print(f"{name}: pip failed", file=sys.stderr)
                status = 1
                break
        else:
            try:
                resolve(name)
                print(f"{name}: ready (radixspec fuzz --target {name} --minutes 1)")
            except TargetError as exc:
                print(f"{name}: installed but not usable: {exc}", file=sys.stderr)
                status = 1
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixspec targets", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    install_parser = commands.add_parser("install", help="install released peer caches without their dependencies")
    install_parser.add_argument("names", nargs="+", choices=sorted(PACKAGES), metavar="NAME", help=", ".join(PACKAGES))
    commands.add_parser("list", help="list the targets and whether each is ready")
    args = parser.parse_args(argv)
    if args.command == "install":
        return install(args.names)
    print("\n".join(list_targets()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
