"""The three layers use the same names (the seed's vocabulary), so a reader maps each one 1:1."""

import inspect
import re
from pathlib import Path

from radixspec import optimized, reference
from radixspec.optimized import tiered_cache as optimized_tiers
from radixspec.reference import tiered_cache as reference_tiers
from radixspec.spec import cache_manager as spec_manager
from radixspec.spec import prefix_cache as spec_cache
from radixspec.spec import tiers as spec_tiers

ROOT = Path(__file__).resolve().parents[1]


def public_names(module: object) -> set[str]:
    return {name for name in getattr(module, "__all__", []) if not name.startswith("_")}


def test_reference_and_optimized_export_the_same_public_names() -> None:
    # the abstract bases exist once, in reference; the kernels and the KV pool only in optimized
    bases = {"BaseCacheHandle", "BasePrefixCache"}
    physical = {"fast_compare_key", "MHAKVCache", "store_cache", "store_cache_fast"}
    assert public_names(reference) - bases == public_names(optimized) - physical


def test_every_spec_operation_has_a_method_of_the_same_name_in_both_implementations() -> None:
    for name in spec_cache.OPERATIONS:
        assert callable(getattr(spec_cache, name)), name
        for cls in (
            reference.RadixPrefixCache,
            optimized.RadixPrefixCache,
            reference.NaivePrefixCache,
            optimized.NaivePrefixCache,
        ):
            assert hasattr(cls, name), (cls, name)
    for name in spec_manager.OPERATIONS:
        assert callable(getattr(spec_manager, name)), name
        for cls in (reference.CacheManager, optimized.CacheManager):
            assert hasattr(cls, name), (cls, name)
    for name in spec_tiers.OPERATIONS:
        assert callable(getattr(spec_tiers, name)), name
        for cls in (reference_tiers.TieredRadixCache, optimized_tiers.TieredRadixCache):
            assert callable(getattr(cls, name, None)), (cls, name)


def test_each_optimized_class_names_its_reference_twin() -> None:
    for name in public_names(optimized) - {"fast_compare_key", "make_page_table", "store_cache", "store_cache_fast"}:
        doc = inspect.getdoc(getattr(optimized, name)) or ""
        assert "Twin of" in doc, name


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, anywhere in its body (a function's deferred import
    too: a circle through one still ties the two modules together)."""
    import ast

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(root).with_suffix("").parts)
        return ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])

    modules = {name_of(path): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            elif node.module and node.module.startswith(f"radixspec.{package}"):
                target = node.module.removeprefix("radixspec.")
            else:
                continue
            # ``from . import x`` imports the submodule x (the package it lies in is not a dependency of it)
            candidates = [f"{target}.{a.name}" for a in node.names] + ([target] if node.module else [])
            found |= {t for t in candidates if t in modules} - {module}
        graph[module] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_a_layer_imports_one_that_imports_it_back() -> None:
    root = Path(__file__).resolve().parent.parent
    for package in ("spec", "reference", "optimized", "fuzz"):
        assert circles(import_graph(root / package, package)) == [], f"{package}/ has import circles"
    # the check sees a circle, including one through a deferred import
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_class_of_the_fuzz_layer_is_over_400_lines() -> None:
    """The fuzz layer in rooms a reader can hold: a machine too big is split into parts (fuzz/cache/, ...)."""
    import ast

    root = Path(__file__).resolve().parent.parent / "fuzz"
    big = [
        f"{path.relative_to(root.parent)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and (node.end_lineno or 0) - node.lineno + 1 > 400
    ]
    assert not big, big


def test_the_fuzz_layer_types_its_values() -> None:
    """Values have types a reader (and mypy) can follow: Any is for the few values whose type truly varies
    (issue 35: 257 Any and 27 type: ignore before capabilities, protocols of the engines' objects and typed
    machines; issue 50: 113 after the lifecycle laws and the layers' registry, 83 after the lifecycle protocol, the
    SGLang state table's protocols and a generic apply_all, 59 with the stamps as numbers, the routers' readers,
    mini-sglang's Req, the contracts' and the outcome judge's calls typed; the bounds keep it from creeping back)."""
    sources = [path.read_text() for path in sorted((ROOT / "fuzz").rglob("*.py"))]
    anys = sum(len(re.findall(r"\bAny\b", source)) for source in sources)
    ignores = sum(source.count("type: ignore") for source in sources)
    assert anys < 60 and ignores < 10, f"{anys} Any, {ignores} type: ignore in fuzz/"


def catalogue_words() -> dict[str, re.Pattern[str]]:
    """Each catalogue method of spec/errors.py (``Class.method``) -> its words as an f-string would write them
    (each argument a ``{...}`` field), from a call with stand-in arguments."""
    from radixspec.spec import errors

    words: dict[str, re.Pattern[str]] = {}
    for name, cls in vars(errors).items():
        if not (isinstance(cls, type) and issubclass(cls, errors.CacheError)):
            continue
        for method_name, method in vars(cls).items():
            if not isinstance(method, classmethod):
                continue
            bound = getattr(cls, method_name)
            stand_ins = [7919 + i for i in range(len(inspect.signature(bound).parameters))]
            text = str(bound(*stand_ins))
            for stand_in in stand_ins:
                text = text.replace(str(stand_in), "\x01")
            words[f"{name}.{method_name}"] = re.compile(r"\{[^}]+\}".join(map(re.escape, text.split("\x01"))))
    return words


def test_every_refusal_in_the_catalogue_is_written_only_there() -> None:
    """The words of a refusal several implementations say are in spec/errors.py only: no layer writes them
    again as a literal (a refusal in other words would fail the machines' judge; one copy cannot drift)."""
    words = catalogue_words()
    assert len(words) >= 19, words
    repeated = []
    for layer in ("spec", "reference", "optimized"):
        for path in sorted((ROOT / layer).glob("*.py")):
            if path.name == "errors.py":
                continue
            source = path.read_text()
            repeated += [f"{path.relative_to(ROOT)}: {m}" for m, pattern in words.items() if pattern.search(source)]
    assert not repeated, "\n".join(repeated)


def test_the_cache_machine_drives_every_operation_of_the_spec() -> None:
    """Each spec operation is called on the targets by a rule or a check of fuzz/cache/ (the list is the spec's
    own: a new operation without a rule fails here)."""
    machine = "\n".join(path.read_text() for path in sorted((ROOT / "fuzz" / "cache").glob("*.py")))
    assert [name for name in spec_cache.OPERATIONS if f".{name}(" not in machine] == []


def test_the_manager_machine_drives_every_operation_of_the_manager_spec() -> None:
    paths = [ROOT / "fuzz" / "manager_machine.py", *sorted((ROOT / "fuzz" / "manager").glob("*.py"))]
    machine = "\n".join(path.read_text() for path in paths)
    assert [name for name in spec_manager.OPERATIONS if f"impl.{name}(" not in machine] == []
