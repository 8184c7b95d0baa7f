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

import ast
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable, Iterator, MutableSet
from pathlib import Path
from typing import NoReturn, TypeVar

T = TypeVar("T")


class StubCalledError(RuntimeError):
    """A stubbed module of a peer was called: the harness stubbed too much."""


def never(*args: object, **kwargs: object) -> NoReturn:
    """Stands for a function a peer imports but must never call here."""
    raise StubCalledError("a stubbed peer function was called (harness artefact: stub less)")


def package_root(package: str) -> Path:
    """The folder a package is installed in, without importing it (its __init__ may not import here)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def install(module: types.ModuleType, **attributes: object) -> None:
    """Set ``attributes`` on ``module`` (a peer's, or one registered in its place): names its code reads, the
    stand-ins of the harness, or the harness's own markers."""
    for attribute, value in attributes.items():
        setattr(module, attribute, value)


def bare(name: str, path: Path) -> types.ModuleType:
    """Register package ``name`` as an empty module whose submodules load from ``path`` (its __init__ is skipped)."""
    module = sys.modules.get(name)
    if module is None or not getattr(module, "__radixspec_bare__", False):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        # a spec like a real package's, so that importlib.util.find_spec still answers
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__spec__.submodule_search_locations = [str(path)]
        install(module, __radixspec_bare__=True)
        sys.modules[name] = module
    return module


def importable(name: str) -> bool:
    """True when ``import name`` would succeed: a module in sys.modules already (another adapter's stand-in
    included, whose ``__spec__`` is None: ``find_spec`` raises on it) or one found on the path."""
    return sys.modules.get(name) is not None or importlib.util.find_spec(name) is not None


def compiled_from(path: Path, names: Iterable[str], namespace: dict[str, object]) -> dict[str, object]:
    """The functions ``names`` of the peer's file ``path``, compiled from its own source in ``namespace`` (the
    names they read), where importing the file would need what a CPU-only machine lacks."""
    wanted = set(names)
    body: list[ast.stmt] = [
        node for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef) and node.name in wanted
    ]
    missing = wanted - {node.name for node in body if isinstance(node, ast.FunctionDef)}
    if missing:
        raise ImportError(f"{path} defines no {', '.join(sorted(missing))}")
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in wanted}


def stub(name: str, **attributes: object) -> types.ModuleType:
    """Register module ``name`` with exactly ``attributes``."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    install(module, __radixspec_stub__=True)
    sys.modules[name] = module
    return module


def stub_any(name: str, **attributes: object) -> types.ModuleType:
    """Register module ``name`` whose every other attribute is ``never`` (for names only imported)."""
    module = stub(name, **attributes)

    def module_getattr(attribute: str) -> Callable[..., NoReturn]:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return never

    install(module, __getattr__=module_getattr)  # a module's __getattr__ (PEP 562): for names it does not hold
    return module


def register(name: str, **attributes: object) -> types.ModuleType:
    """Register module ``name`` holding ``attributes``: what an adapter loaded of a peer, kept for the process
    under a name beside the peer's modules."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
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


class Never:
    """Stands for a class a peer's import chain names (in annotations) but must never build here."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        never(*args, **kwargs)


class Recorded:
    """Stands for an event class of a peer: keeps its keyword arguments as attributes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
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


class InsertionOrderedSet(MutableSet[T]):
    """A set that iterates in insertion order: a peer's set of objects hashed by identity iterates in memory
    address order, which differs from run to run; where the peer breaks ties by that order (SGLang's evictable
    leaves of equal last access), the harness installs this one, so that one program always takes one path.
    The order is one of those the peer's own set may give."""

    def __init__(self, items: Iterable[T] = ()) -> None:
        self.items: dict[T, None] = dict.fromkeys(items)

    def __contains__(self, item: object) -> bool:
        return item in self.items

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, value: T) -> None:
        self.items[value] = None

    def discard(self, value: T) -> None:
        self.items.pop(value, None)

    def clear(self) -> None:
        self.items.clear()


class LogicalClock:
    """A peer's wall clock replaced by a logical one: the adapter ticks it once per call (deterministic LRU)."""

    def __init__(self) -> None:
        self.now = 1

    def tick(self) -> None:
        self.now += 1

    def read(self) -> int:
        return self.now
