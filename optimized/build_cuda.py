"""``python -m radixspec.optimized.build_cuda``: build the CUDA store kernel now; say what the stores here will use.

Prints where the C (CPU) store and the CUDA sources are, whether nvcc and a GPU
are present, and builds ``store.cu`` when nvcc is there (cached; the first CUDA
store would build it too). ``--force`` rebuilds. Exit status: 0 when everything
this machine can run works (no GPU is not an error: CUDA stores then have no
device to run on); 1 when nvcc is present but the build fails, or a GPU is
present and its stores cannot use the kernel.

The stores themselves live in ``radixspec.optimized.store``; this module is a command,
not imported by the package (so ``python -m`` runs it without a warning).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from radixspec.spec.errors import UnavailableError

from ._c import load_c
from .store import build_store_library, cuda_sources, find_nvcc, has_cuda_kernel


def report(force: bool) -> tuple[list[str], int]:
    """The lines to print and the exit status."""
    lines = []
    try:
        load_c()
        lines.append("CPU store:    C (radixspec.optimized._radix_c) loaded")
    except UnavailableError as exc:
        lines.append(f"CPU store:    UNAVAILABLE: {exc}")
        return lines, 1
    store_cu = cuda_sources()[0]
    lines.append(f"CUDA source:  {store_cu}{'' if store_cu.exists() else ' (MISSING)'}")
    gpu = torch.cuda.is_available()
    if gpu:
        lines.append(
            f"GPU:          {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
        )
    else:
        built_with = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        lines.append(f"GPU:          none visible to torch {torch.__version__} ({built_with})")
    try:
        nvcc = find_nvcc()
    except UnavailableError as exc:
        lines.append(f"nvcc:         not found ({exc})")
        lines.append(
            "CUDA stores:  " + ("torch fallback (no kernel without nvcc)" if gpu else "none (no GPU, no nvcc)")
        )
        return lines, 1 if gpu else 0
    lines.append(f"nvcc:         {nvcc}")
    try:
        library = build_store_library(force=force)
    except UnavailableError as exc:
        lines.append(f"CUDA library: BUILD FAILED: {exc}")
        return lines, 1
    lines.append(f"CUDA library: {library}")
    if not gpu:
        lines.append("CUDA stores:  none (no GPU here; the library is built and cached for this machine)")
        return lines, 0
    if has_cuda_kernel():
        lines.append("CUDA stores:  the kernel (csrc/store.cu)")
        return lines, 0
    lines.append("CUDA stores:  torch fallback: the library was built but does not load")
    return lines, 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixspec.optimized.build_cuda", description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild the CUDA library even if cached")
    args = parser.parse_args(argv)
    lines, status = report(args.force)
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
