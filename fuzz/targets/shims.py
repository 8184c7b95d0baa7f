"""Importing a peer's cache without its dependency tree: bare packages, stubs of modules the cache never calls.

A peer installed with ``pip install --no-deps`` has package ``__init__`` files
that import half the world (transformers, triton, the allocators). We
register *bare* package objects whose ``__path__`` points at the installed
folders, so the real cache modules import, and *stubs* for the few modules
their import chain pulls in but the cache never calls with events and
metrics off. A stub's functions raise ``StubCalledError`` if called after all:
that is a harness artefact to fix, never a finding.

Each peer's list lives beside its adapter (``fuzz/targets/sglang.py`` ...),
with the reason for each stub; docs/targets.md says what each target needs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any


class StubCalledError(RuntimeError):
    """A stubbed module of a peer was called: the harness stubbed too much."""


def never(*args: Any, **kwargs: Any) -> Any:
    """Stands for a function a peer imports but must never call here."""
    raise StubCalledError("a stubbed peer function was called (harness artefact: stub less)")


def package_root(package: str) -> Path:
    """The folder a package is installed in, without importing it (its __init__ may not import here)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def bare(name: str, path: Path) -> types.ModuleType:
    """Register package ``name`` as an empty module whose submodules load from ``path`` (its __init__ is skipped)."""
    module = sys.modules.get(name)
    if module is None or not getattr(module, "__radixspec_bare__", False):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        # a spec like a real package's, so that importlib.util.find_spec still answers
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__spec__.submodule_search_locations = [str(path)]
        module.__radixspec_bare__ = True  # type: ignore[attr-defined]
        sys.modules[name] = module
    return module


def stub(name: str, **attributes: Any) -> types.ModuleType:
    """Register module ``name`` with exactly ``attributes``."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__radixspec_stub__ = True  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def stub_any(name: str, **attributes: Any) -> types.ModuleType:
    """Register module ``name`` whose every other attribute is ``never`` (for names only imported)."""
    module = stub(name, **attributes)

    def module_getattr(attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return never

    module.__getattr__ = module_getattr  # type: ignore[method-assign]
    return module


def import_with_stand_ins(name: str, **stand_ins: types.ModuleType) -> types.ModuleType:
    """Import module ``name`` with ``stand_ins`` in sys.modules only while it loads (for third-party
    packages it imports for code the cache never runs: the stand-ins do not outlive the import)."""
    saved = {key: sys.modules.get(key) for key in stand_ins}
    sys.modules.update(stand_ins)
    try:
        return importlib.import_module(name)
    finally:
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module


class Recorded:
    """Stands for an event class of a peer: keeps its keyword arguments as attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


def load_file_as(name: str, path: Path) -> types.ModuleType:
    """Load ``path`` as module ``name`` (a patched copy of a peer's module, for planted bugs)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class LogicalClock:
    """A peer's wall clock replaced by a logical one: the adapter ticks it once per call (deterministic LRU)."""

    def __init__(self) -> None:
        self.now = 1

    def tick(self) -> None:
        self.now += 1

    def read(self) -> int:
        return self.now
