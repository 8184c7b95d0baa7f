"""Targets: the prefix caches (and cache managers) a campaign can check against the spec.

``--target NAME`` names one of three kinds:

* a built-in: ``reference``, ``optimized`` (ours), ``sglang``, ``vllm``
  (released wheels, ``radixspec targets install sglang vllm``),
  ``minisgl:PATH`` (a mini-sglang source checkout);
* ``module:attribute``: an importable ``TargetInfo``, or a callable
  ``factory(page_size, num_pages) -> PrefixCacheTarget``;
* a name registered under the entry-point group ``radixspec.targets``
  (its object as for ``module:attribute``).

``resolve`` turns the name into a ``TargetInfo`` and checks that what it
needs imports; every failure is a ``TargetError`` with a message for the
command line, never a fuzz failure.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .api import (
    EXACT,
    CacheManagerTarget,
    LifecycleProfile,
    PageKey,
    PrefixCacheTarget,
    Profile,
    TargetError,
    TargetInfo,
)
from .layers import layers_of
from .releases import VARIANTS, check_release

ENTRY_POINT_GROUP = "radixspec.targets"


def builtin_targets() -> dict[str, Callable[[str | None], TargetInfo]]:
    """Built-in targets by name; each takes the argument after ``NAME:`` (None when absent)."""
    from . import (
        dynamo,
        minisgl,
        ours,
        routers,
        sglang_hicache_target,
        sglang_unified,
        sglang_unified_mamba,
        sglang_unified_swa,
        tokenspeed,
        vllm_hybrid,
        vllm_mamba,
        vllm_offload,
        vllm_offload_connector,
        vllm_simple_offload,
    )

    def no_argument(info: TargetInfo) -> Callable[[str | None], TargetInfo]:
        def make(argument: str | None) -> TargetInfo:
            if argument is not None:
                raise TargetError(f"target {info.name!r} takes no argument (got {info.name}:{argument})")
            return info

        return make

    return {
        "reference": no_argument(ours.REFERENCE),
        "optimized": no_argument(ours.OPTIMIZED),
        "sglang": sglang_unified.target,
        "vllm": no_argument(vllm_hybrid.DENSE_TARGET),
        "vllm-hybrid": no_argument(vllm_hybrid.TARGET),
        "vllm-mamba": no_argument(vllm_mamba.TARGET),
        "vllm-offload": vllm_offload.target,
        "vllm-offload-connector": vllm_offload_connector.target,
        "vllm-simple-offload": no_argument(vllm_simple_offload.TARGET),
        "minisgl": minisgl.target,
        "sglang-swa": sglang_unified_swa.target,
        "sglang-mamba": sglang_unified_mamba.target,
        "sglang-hicache": sglang_hicache_target.target,
        "tokenspeed": no_argument(tokenspeed.TARGET),
        "dynamo": no_argument(dynamo.TARGET),
        "radixspec-router": no_argument(routers.SPEC_ROUTER),
    }


def entry_point_targets() -> dict[str, importlib.metadata.EntryPoint]:
    """Targets other packages registered under the ``radixspec.targets`` entry-point group."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def resolve(name: str, check: bool = True) -> TargetInfo:
    """The target ``name`` names; with ``check``, also import what it needs. Raises TargetError."""
    head, _, argument = name.partition(":")
    builtins = builtin_targets()
    if head in builtins:
        info = builtins[head](argument or None)
    elif head in entry_point_targets():
        info = as_target_info(head, _load(entry_point_targets()[head].value, name))
    elif argument:
        info = as_target_info(name, _load(name, name))
    else:
        known = sorted({*builtins, *entry_point_targets()})
        raise TargetError(f"unknown target {name!r}; choose from {', '.join(known)}, or give module:attribute")
    if check:
        check_requirements(info)
        check_methods(info)
    return info


def _load(path: str, name: str) -> object:
    """The object ``module:attribute`` names, or TargetError."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise TargetError(f"target {name!r}: expected module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"target {name!r}: cannot import {module_name!r} ({exc})") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise TargetError(f"target {name!r}: module {module_name!r} has no {attribute!r}") from None


def as_target_info(name: str, obj: object) -> TargetInfo:
    """A TargetInfo from what a user named: a TargetInfo, or a factory(page_size, num_pages) of a cache target."""
    if isinstance(obj, TargetInfo):
        return obj
    if callable(obj):
        profile = getattr(obj, "profile", None)
        return TargetInfo(
            name=name,
            description=(getattr(obj, "__doc__", None) or "a user's prefix cache").strip().splitlines()[0],
            cache_factory=obj,
            profile=profile if isinstance(profile, Profile) else EXACT,
        )
    raise TargetError(
        f"target {name!r} is a {type(obj).__name__}: expected a TargetInfo or a factory(page_size, num_pages)"
    )


def check_requirements(info: TargetInfo) -> None:
    """Find every package the target needs at a supported release (``releases.py``), then probe its import;
    TargetError saying what to do otherwise."""
    missing = [f"{package} ({how})" for package, how in info.requires if importlib.util.find_spec(package) is None]
    if missing:
        raise TargetError(f"target {info.name!r} needs {', '.join(missing)}")
    for package, _ in info.requires:
        check_release(package)
    if info.probe is not None:
        try:
            info.probe()
        except Exception as exc:  # any failure to import a peer is a setup problem, reported as such
            raise TargetError(f"target {info.name!r} is installed but does not import here: {exc!r}") from None


def promised_methods(protocol: type, profile: Profile) -> list[str]:
    """The methods a target of ``protocol`` must have under ``profile``: the protocol's, and the optional ones
    the profile promises (``evict`` when pages leave through evict(), ``reset`` unless reset is "none")."""
    methods = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    if protocol is PrefixCacheTarget:
        methods += ["evict"] if profile.eviction_trigger == "evict" else []
        methods += ["reset"] if profile.reset != "none" else []
    return methods


def check_methods(info: TargetInfo) -> None:
    """Build one small instance of each of the target's factories and check that it has every method its
    profile promises; TargetError naming what is missing (a command-line error, never a fuzz failure)."""
    p = info.page_sizes[0] if info.page_sizes else 1
    for layer in layers_of(info):
        factory = layer.factory_of(info)
        if layer.protocol is None or layer.example is None or factory is None:
            continue  # a layer whose machine checks its targets as it builds them
        protocol, args = layer.protocol, layer.example(p)
        call = f"{layer.factory}({', '.join(map(str, args))})"
        try:
            target = factory(*args)
        except Exception as exc:  # a user's factory that cannot build: a setup problem, reported as such
            raise TargetError(f"target {info.name!r}: {call} raised {exc!r}") from None
        profile = getattr(target, "profile", info.profile)
        missing = [name for name in promised_methods(protocol, profile) if not callable(getattr(target, name, None))]
        missing += [name for name in ("profile", "page_size") if not hasattr(target, name)]
        if missing:
            raise TargetError(
                f"target {info.name!r} ({type(target).__name__}) has no {', '.join(missing)}, which its profile"
                f" {profile.name!r} promises (eviction_trigger={profile.eviction_trigger!r},"
                f" reset={profile.reset!r}); add them, or declare a Profile without them (docs/targets.md)"
            )


# resolve one target in a fresh interpreter: exit 0 when ready, else 1 with the TargetError's message on stdout
_RESOLVE_ALONE = """
import sys
from radixspec.fuzz.targets import TargetError, resolve
try:
    resolve(sys.argv[1])
except TargetError as exc:
    print(exc)
    sys.exit(1)
"""


def readiness(names: Sequence[str]) -> dict[str, str | None]:
    """Whether each target would start a campaign here: None when ready, else why not. Each is resolved (its
    imports, one small instance) in a fresh interpreter, as a campaign starts it: an engine's targets stand in
    for modules of the engine differently (SGLang's legacy cache and its unified one cannot share a process),
    so probing them one after the other in one process would say what no campaign sees. Several at a time."""

    def alone(name: str) -> str | None:
        command = [sys.executable, "-c", _RESOLVE_ALONE, name]
        run = subprocess.run(command, capture_output=True, text=True, check=False)
        if run.returncode == 0:
            return None
        said = run.stdout.strip() or (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
        return said

    # os.cpu_count, not sched_getaffinity: the listing runs on macOS too
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(alone, names), strict=True))


def list_targets() -> list[str]:
    """Lines of ``radixspec fuzz --list-targets``: every target, each variant of an engine's (``sglang:python``,
    ...) included, what it checks, what it needs, whether it is ready."""
    lines = []
    entries: list[tuple[str, TargetInfo | None, str]] = []
    variants = [variant for engine in VARIANTS.values() for variant in engine if ":" in variant]
    for name, make in builtin_targets().items():
        try:
            entries.append((name, make(None), ""))
        except TargetError as exc:  # minisgl without a path
            entries.append((name, None, str(exc)))
        for variant in (v for v in variants if v.partition(":")[0] == name):
            entries.append((variant, make(variant.partition(":")[2]), ""))
    for name, ep in entry_point_targets().items():
        try:
            entries.append((name, as_target_info(name, ep.load()), ""))
        except Exception as exc:  # a broken third-party entry point is listed, not fatal
            entries.append((name, None, f"entry point {ep.value} does not load: {exc}"))
    width = max(len(name) for name, _, _ in entries)
    # an engine's targets each in a fresh interpreter (readiness); ours and a user's here
    alone = readiness([name for name, info, _ in entries if info is not None and info.probe is not None])
    for name, info, problem in entries:
        if info is None:
            lines.append(f"{name:<{width}} {problem}")
            continue
        if name in alone:
            said = alone[name]
            ready = "ready" if said is None else f"NOT READY: {said}"
        else:
            try:
                check_requirements(info)
                ready = "ready"
            except TargetError as exc:
                ready = f"NOT READY: {exc}"
        kinds, indent = "+".join(layer.name for layer in layers_of(info)), " " * (width + 1)
        lines.append(f"{name:<{width}} {info.description}")
        lines.append(
            f"{'':<{width}} machines: {kinds}; profile: {info.profile.name}; default LRU: {info.profile.default_lru}"
        )
        if info.how:
            lines.append(f"{'':<{width}} {info.how}")
        stated = info.profile.choices() if isinstance(info.profile, LifecycleProfile) else []
        stated += [("differs", note) for note in info.profile.notes]
        for choice, what in stated:
            lines += textwrap.wrap(f"{choice}: {what}", 120, initial_indent=indent, subsequent_indent=indent + "  ")
        lines.append(f"{'':<{width}} {ready}")
    return lines


__all__ = [
    "ENTRY_POINT_GROUP",
    "EXACT",
    "CacheManagerTarget",
    "PageKey",
    "PrefixCacheTarget",
    "Profile",
    "TargetError",
    "TargetInfo",
    "as_target_info",
    "check_methods",
    "check_requirements",
    "list_targets",
    "promised_methods",
    "readiness",
    "resolve",
]
