"""radixspec: RadixAttention prefix caching as an executable spec, a reference and a fast implementation, and
the differential fuzzer that checks any engine's cache against the spec.

One import name, four layers (each its own folder of the checkout)::

    radixspec.spec        the abstract model: operations with guards, named invariants, errors (stdlib only)
    radixspec.reference   the seed's system in clear Python (radix tree, cache manager, scheduler)
    radixspec.optimized   the same, fast: C tree, torch tensors, CUDA store kernel (needs torch, numpy, cffi)
    radixspec.fuzz        state machines, campaigns, targets (``radixspec fuzz``)

and the face a user's own tests need: ``radixspec.testing`` (machines for a user's cache, made by a factory)
and ``radixspec.strategies`` (Hypothesis strategies). Importing this package imports none of the layers.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.2.0"

# A checkout keeps the layers at its top (spec/, reference/, optimized/, fuzz/ beside this folder); an installed
# wheel has them inside this package. In a checkout (or a copy of one: the maintainer tools fuzz copies of the
# tree), the folder above is searched after this one, so ``radixspec.spec`` is ``<checkout>/spec``.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "spec" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))

__all__ = ["__version__"]
