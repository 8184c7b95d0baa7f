"""The ``radixspec`` console script: one command, a subcommand per tool.

    radixspec fuzz ...          a differential campaign (radixspec.fuzz.campaign; also python -m radixspec.fuzz)
    radixspec replay ...        a request trace replayed at several pool sizes (radixspec.fuzz.replay)
    radixspec exhaustive ...    every operation sequence up to a depth (radixspec.fuzz.exhaustive)
    radixspec targets ...       install the peers' released caches, list the targets (radixspec.fuzz.targets)
    radixspec engine-run ...    an Engine on a synthetic serving workload (radixspec.fuzz.engine_run)
    radixspec --version         the versions of radixspec, Python, Hypothesis and torch

Each subcommand's module is imported only when it runs, so ``radixspec --help`` and a usage error answer at once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# subcommand -> (module of its main(argv), one line of help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fuzz": ("radixspec.fuzz.campaign", "a differential fuzz campaign (spec beside the selected targets)"),
    "replay": ("radixspec.fuzz.replay", "replay a request trace at several pool sizes; hit rates per cache"),
    "exhaustive": ("radixspec.fuzz.exhaustive", "every sequence of cache and manager operations up to a depth"),
    "targets": ("radixspec.fuzz.targets.__main__", "install the peers' released caches; list the targets"),
    "engine-run": ("radixspec.fuzz.engine_run", "run an Engine on a synthetic serving workload"),
}


def versions() -> dict[str, str | None]:
    """The versions of radixspec and what it runs on (None: not installed); read without importing torch."""
    from importlib import metadata

    import radixspec

    found: dict[str, str | None] = {"radixspec": radixspec.__version__, "python": sys.version.split()[0]}
    for name in ("hypothesis", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: radixspec {" + ",".join(SUBCOMMANDS) + "} ... | --version | --help", ""]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "radixspec SUBCOMMAND --help says more."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand's ``main``; exit status 2 (usage) for an unknown one."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(" ".join(f"{name} {version or '(not installed)'}" for name, version in versions().items()))
        return 0
    if args[0] not in SUBCOMMANDS:
        print(f"radixspec: unknown subcommand {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    entry: Callable[[Sequence[str]], int] = importlib.import_module(SUBCOMMANDS[args[0]][0]).main
    return entry(args[1:])
