"""The checkout the maintainer tools work on, found once; a clear exit when they run without one."""

from __future__ import annotations

from pathlib import Path

# the folder above tools/: the checkout, when this file is in one
ABOVE = Path(__file__).resolve().parent.parent


def find_root(root: Path = ABOVE) -> Path:
    """The checkout holding this ``tools/`` folder; SystemExit saying so when the folder above is not one."""
    missing = [name for name in ("pyproject.toml", "csrc", "spec", "fuzz") if not (root / name).exists()]
    if missing:
        raise SystemExit(
            f"radixspec's maintainer tools work on a checkout of its repository; {root} lacks {', '.join(missing)}"
            " (an installed radixspec does not ship them: clone the repository and run python -m tools.NAME there)"
        )
    return root


ROOT = find_root()
