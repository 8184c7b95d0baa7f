"""``python -m tools.typecheck``: mypy (strict, pyproject.toml) over the installed layout of the checkout.

mypy maps a module name to a folder of the same name, and the checkout keeps ``radixspec.spec`` in ``spec/``;
so the layout an install has (``radixspec/spec``, ...) is built as symbolic links under ``build/typecheck/``
and mypy reads the package from there, with the maintainer tools beside it. Arguments go to mypy.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tools.checkout import ROOT

LAYERS = ("spec", "reference", "optimized", "fuzz")


def build_view() -> str:
    """``build/typecheck/radixspec``: the package face's files and the layers, linked; returns its parent."""
    view = ROOT / "build" / "typecheck"
    package = view / "radixspec"
    package.mkdir(parents=True, exist_ok=True)
    for link in package.iterdir():
        if link.is_symlink():
            link.unlink()
    for source in (ROOT / "radixspec").iterdir():
        if source.suffix in (".py", ".typed"):
            (package / source.name).symlink_to(source)
    for layer in LAYERS:
        (package / layer).symlink_to(ROOT / layer, target_is_directory=True)
    return str(view)


def main(argv: list[str] | None = None) -> int:
    env = {**os.environ, "MYPYPATH": build_view()}
    cmd = [sys.executable, "-m", "mypy", "-p", "radixspec", "-p", "tools", *(sys.argv[1:] if argv is None else argv)]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
