"""A pytest plugin for ``tox -e mutation``: one name per mutated function, whichever name mutmut gives it.

mutmut names a mutant after its file (``spec/helpers.py`` -> ``spec.helpers.x_align_down__mutmut_1``),
while its trampoline compares that name with the module the function was defined in at run time, which
for us is ``radixspec.spec.helpers`` (the folders install under one import name). Without this plugin
no mutant is ever switched on (every one survives) and no test is recorded as covering one. Loaded by
``pytest_add_cli_args`` in ``[tool.mutmut]`` (``-p tools.mutmut_names``) in mutmut's test processes:

* the mutant under test is read as ``radixspec.<file name>``;
* a function reached while mutmut learns which tests cover what is recorded under its file name.

Outside a mutmut run it does nothing.
"""

from __future__ import annotations

import importlib

PACKAGE = "radixspec."
LAYERS = ("spec.", "reference.", "optimized.")


def to_runtime(name: str) -> str:
    """mutmut's name of a mutant (or "stats", "fail", "") as our modules' ``__name__`` spells it."""
    return PACKAGE + name if name.startswith(LAYERS) else name


def to_file(name: str) -> str:
    """A function's run-time qualified name as mutmut's file-based names spell it."""
    return name[len(PACKAGE) :] if name.startswith(PACKAGE) and name[len(PACKAGE) :].startswith(LAYERS) else name


def install() -> bool:
    """Wrap the trampoline's two name lookups; False when mutmut is not importable (not a mutation run)."""
    try:
        trampoline = importlib.import_module("mutmut.mutation.trampoline")
    except ImportError:
        return False
    if getattr(trampoline, "_radixspec_names", False):
        return True
    get_mutant_under_test = trampoline.get_mutant_under_test
    record_trampoline_hit = trampoline.record_trampoline_hit

    def get_runtime_mutant() -> str:
        return to_runtime(get_mutant_under_test())

    def record_file_hit(name: str, caller: str | None = None) -> None:
        record_trampoline_hit(to_file(name), caller=None if caller is None else to_file(caller))

    setattr(trampoline, "get_mutant_under_test", get_runtime_mutant)  # noqa: B010 (a module of mutmut's)
    setattr(trampoline, "record_trampoline_hit", record_file_hit)  # noqa: B010
    setattr(trampoline, "_radixspec_names", True)  # noqa: B010
    return True


install()
