"""``python -m tools.typecheck``: mypy (strict, pyproject.toml) over the installed layout of the checkout.

mypy maps a module name to a folder of the same name, and the checkout keeps ``radixspec.spec`` in ``spec/``;
so the layout an install has (``radixspec/spec``, ...) is built as symbolic links under ``build/typecheck/``
and mypy reads the package from there, with the maintainer tools beside it. Arguments go to mypy.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from tools.checkout import ROOT

LAYERS = ("spec", "reference", "optimized", "fuzz")


def build_view() -> str:
    """``build/typecheck/radixspec``: the package face's files and the layers, linked; returns its parent.

    A link already pointing where it should is left alone, so runs side by side (one cache folder each) do not
    race on the view.
    """
    view = ROOT / "build" / "typecheck"
    package = view / "radixspec"
    package.mkdir(parents=True, exist_ok=True)
    wanted = {source.name: source for source in (ROOT / "radixspec").iterdir() if source.suffix in (".py", ".typed")}
    wanted.update({layer: ROOT / layer for layer in LAYERS})
    for link in package.iterdir():
        if link.is_symlink() and wanted.get(link.name) != link.readlink():
            link.unlink(missing_ok=True)
    for name, source in wanted.items():
        link = package / name
        if not link.is_symlink():
            with contextlib.suppress(FileExistsError):
                link.symlink_to(source, target_is_directory=source.is_dir())
    return str(view)


def main(argv: list[str] | None = None) -> int:
    env = {**os.environ, "MYPYPATH": build_view()}
    cmd = [sys.executable, "-m", "mypy", "-p", "radixspec", "-p", "tools", *(sys.argv[1:] if argv is None else argv)]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
