"""Build hooks (everything else is in pyproject.toml).

* ``cffi_modules``: csrc/radix.c, store.c, tree.c and hybrid.c become ``radixspec.optimized._radix_c``.
* ``ext_modules``: csrc/pyints.c becomes ``radixspec.optimized._pyints`` (lists of ints read into int64 buffers).
* ``build_py`` also copies the CUDA sources into ``radixspec/optimized/csrc/`` of the
  built package, so an installed wheel can still build its store kernel with
  nvcc (``python -m radixspec.optimized.build_cuda``); a checkout reads them from csrc/.
"""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

CUDA_SOURCES = ("store.cu", "store_cuda.h", "store_status.h")


class BuildPyWithCudaSources(build_py):
    """build_py, plus csrc/store.cu and the headers it includes into the built package."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "radixspec" / "optimized" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for name in CUDA_SOURCES:
            self.copy_file(str(Path("csrc") / name), str(target / name))


setup(
    cffi_modules=["csrc/build_ffi.py:ffibuilder"],
    ext_modules=[Extension("radixspec.optimized._pyints", ["csrc/pyints.c"], extra_compile_args=["-O2"])],
    cmdclass={"build_py": BuildPyWithCudaSources},
)
