"""The compiled C helpers: ``radixspec.optimized._radix_c``, built by cffi from ``csrc/`` (csrc/build_ffi.py) at
``pip install``, and the CPython extension ``radixspec.optimized._hotpath`` (csrc/hotpath.c: the prefix cache's match
and insert entry points, its handle and mutex, the list reader). One loader for the whole package (the radix tree, the
compare kernel, the CPU store); the enum constants and structs declared in the headers are read from it by name."""

from __future__ import annotations

import functools
from typing import Any

from radixspec.spec.errors import UnavailableError


@functools.cache
def load_c() -> tuple[Any, Any]:
    """(ffi, lib) of the compiled module; UnavailableError saying how to build it when it is missing."""
    try:
        from . import _radix_c  # type: ignore[attr-defined]
    except ImportError as exc:
        raise UnavailableError(
            f"the C helpers are not built ({exc}); run `pip install -e .` or `python csrc/build_ffi.py`"
        ) from None
    return _radix_c.ffi, _radix_c.lib


@functools.cache
def load_hotpath() -> Any:
    """The module ``radixspec.optimized._hotpath`` (csrc/hotpath.c, a CPython extension built by ``pip install``);
    UnavailableError saying how to build it when it is missing."""
    try:
        from . import _hotpath  # type: ignore[attr-defined]
    except ImportError as exc:
        raise UnavailableError(f"the hot path is not built ({exc}); run `pip install -e .`") from None
    return _hotpath
