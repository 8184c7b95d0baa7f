"""The engine releases the targets drive: the two newest of each, checked before a campaign starts.

An engine's cache code moves between releases (SGLang 0.5.23 builds another cache than 0.5.21 did), and our
adapters call into it by name. So each engine states the releases its targets were written and tested
against; a campaign refuses any other installed release with exit 2 naming them, rather than report a
difference that is the adapter's. ``radixspec targets install sglang==0.5.22`` installs one of them.
"""

from __future__ import annotations

import importlib.metadata

from .api import TargetError

# per engine package, the releases its targets support, oldest first (the last is what `install` takes)
RELEASES: dict[str, tuple[str, ...]] = {
    "sglang": ("0.5.22", "0.5.23"),
    "vllm": ("0.32.0", "0.33.0"),
    "dynamo": ("1.6.1",),
    "tokenspeed": ("0.1.42",),
}
# the distribution pip installs for an engine whose import name differs
DISTRIBUTIONS: dict[str, str] = {"dynamo": "ai-dynamo-runtime", "tokenspeed": "tokenspeed-scheduler"}
# the engine whose targets import a package of another name (a target's ``requires`` names what it imports)
ENGINE_OF_IMPORT: dict[str, str] = {"tokenspeed_scheduler": "tokenspeed"}
# per engine package, every target that drives it (``radixspec targets install`` readies and probes each; the
# listing shows each with its readiness). A new target or core of an engine is added here
VARIANTS: dict[str, tuple[str, ...]] = {
    "sglang": (
        "sglang",
        "sglang:python",
        "sglang:both",
        "sglang:legacy",
        "sglang-swa",
        "sglang-swa:python",
        "sglang-swa:both",
        "sglang-mamba",
        "sglang-mamba:python",
        "sglang-mamba:both",
        "sglang-hicache",
        "sglang-hicache:rust",
        "sglang-hicache:both",
        "sglang-hicache:swa",
        "sglang-hicache:mamba",
        "sglang-hicache:eagle",
        "sglang-hicache:swa,mamba",
    ),
    "vllm": ("vllm", "vllm-hybrid", "vllm-mamba", "vllm-offload", "vllm-offload-connector", "vllm-simple-offload"),
    "dynamo": ("dynamo",),
    "tokenspeed": ("tokenspeed",),
}


def distribution(package: str) -> str:
    """What pip calls ``package`` (``dynamo``: ``ai-dynamo-runtime``)."""
    return DISTRIBUTIONS.get(package, package)


def supported(package: str) -> str:
    """The supported releases of ``package`` in words."""
    return " and ".join(RELEASES[package])


def installed_release(package: str) -> str | None:
    """The installed release of ``package`` (None when it is not installed)."""
    try:
        return importlib.metadata.version(distribution(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def check_release(package: str) -> None:
    """Raise TargetError when an engine ``package`` is installed at a release its targets do not support."""
    package = ENGINE_OF_IMPORT.get(package, package)
    if package not in RELEASES:
        return
    release = installed_release(package)
    if release is not None and release not in RELEASES[package]:
        raise TargetError(
            f"{package} {release} is installed; radixspec's {package} targets support {supported(package)}"
            f" (radixspec targets install {package}=={RELEASES[package][-1]})"
        )


def parse_requirement(text: str) -> tuple[str, str]:
    """``sglang`` or ``sglang==0.5.22`` as (package, release); TargetError for another engine or release."""
    package, _, release = text.partition("==")
    if package not in RELEASES:
        raise TargetError(f"no engine {package!r} to install; choose from {', '.join(sorted(RELEASES))}")
    release = release or RELEASES[package][-1]
    if release not in RELEASES[package]:
        raise TargetError(f"{package} {release} is not supported; radixspec drives {supported(package)}")
    return package, release
