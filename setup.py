"""Build hooks (everything else is in pyproject.toml).

* ``cffi_modules``: csrc/radix.c, store.c, tree.c, hybrid.c and tiers.c become ``radixspec.optimized._radix_c``.
* ``ext_modules``: csrc/hotpath.c becomes ``radixspec.optimized._hotpath`` (the CPython entry points of the prefix
  cache's match and insert, its handle and mutex, and the list reader).
* ``packages``: every package under each folder that pyproject.toml's ``package-dir`` maps (``radixspec.fuzz`` is
  fuzz/, so fuzz/cache/ is ``radixspec.fuzz.cache``): found, never listed, so a new subpackage is in the wheel.
* ``build_py`` also copies the CUDA sources into ``radixspec/optimized/csrc/`` of the
  built package, so an installed wheel can still build its store kernel with
  nvcc (``python -m radixspec.optimized.build_cuda``); a checkout reads them from csrc/.
"""

import os
import tomllib
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py

# as csrc/build_ffi.py: warnings are errors only where our own CI asks (a newer compiler's new warning must not break
# a user's pip install)
HOTPATH_FLAGS = ["-O2", "-Wall", "-Wextra", *(["-Werror"] if os.environ.get("RADIXSPEC_WERROR") == "1" else [])]
# as csrc/build_ffi.py: RADIXSPEC_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer (tools/sanitize)
SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
SANITIZED = os.environ.get("RADIXSPEC_SANITIZE") == "1"
CUDA_SOURCES = ("store.cu", "store_cuda.h", "store_status.h")


def mapped_packages() -> list[str]:
    """Every package of the wheel: each name pyproject.toml maps to a folder, and each package found below it."""
    mapping: dict[str, str] = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {prefix for prefix in mapping}
    found |= {f"{prefix}.{sub}" for prefix, folder in mapping.items() for sub in find_packages(folder)}
    return sorted(found)


class BuildPyWithCudaSources(build_py):
    """build_py, plus csrc/store.cu and the headers it includes into the built package."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "radixspec" / "optimized" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for name in CUDA_SOURCES:
            self.copy_file(str(Path("csrc") / name), str(target / name))


setup(
    packages=mapped_packages(),
    cffi_modules=["csrc/build_ffi.py:ffibuilder"],
    ext_modules=[
        Extension(
            "radixspec.optimized._hotpath",
            ["csrc/hotpath.c"],
            include_dirs=["csrc"],
            extra_compile_args=HOTPATH_FLAGS + (SANITIZE if SANITIZED else []),
            extra_link_args=SANITIZE if SANITIZED else [],
        )
    ],
    cmdclass={"build_py": BuildPyWithCudaSources},
)
