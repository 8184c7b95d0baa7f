"""The cffi declarations of the C and CUDA sources, read from their headers (one source for both).

Each header in ``csrc/`` marks its declarations with ``/* cdef-begin */`` and
``/* cdef-end */``; ``read_cdef`` returns what lies between. ``csrc/build_ffi.py``
(API mode, at install) and ``radixspec.optimized.store`` (ABI mode: the status codes of
the stores, and the CUDA library) both call it, so a signature cannot drift
between C and Python.
Stdlib only: the build script loads this file without importing the package.
"""

from __future__ import annotations

from pathlib import Path

BEGIN, END = "/* cdef-begin */", "/* cdef-end */"


def read_cdef(*headers: Path) -> str:
    """The declarations between the cdef markers of each header, in order."""
    parts = []
    for header in headers:
        text = header.read_text()
        if text.count(BEGIN) != 1 or text.count(END) != 1:
            raise ValueError(f"{header} must hold exactly one {BEGIN} ... {END} block")
        parts.append(text[text.index(BEGIN) + len(BEGIN) : text.index(END)])
    return "\n".join(parts)


def csrc_dir() -> Path:
    """The C and CUDA sources: shipped inside the package (a built wheel), else the checkout's ``csrc/``."""
    shipped = Path(__file__).resolve().parent / "csrc"
    return shipped if (shipped / "store.cu").exists() else Path(__file__).resolve().parent.parent / "csrc"
