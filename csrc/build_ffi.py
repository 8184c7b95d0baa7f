"""cffi build script (API mode): csrc/radix.c, store.c, tree.c, hybrid.c and tiers.c become
``radixspec.optimized._radix_c``.

``pip install .`` runs it through setup.py's ``cffi_modules``; by hand,
``python csrc/build_ffi.py`` builds the module in place. The declarations are
read from the headers (``optimized/cdefs.py``), never written twice. (The CUDA
store kernel, csrc/store.cu, is built by nvcc instead: ``python -m radixspec.optimized.build_cuda``.)

``RADIXSPEC_SANITIZE=1`` builds with AddressSanitizer and UndefinedBehaviorSanitizer
(run Python with ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``).
"""

import importlib.util
import os
import shutil
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# warnings are errors only where our own CI asks (RADIXSPEC_WERROR=1): a newer compiler's new warning must not
# break a user's pip install
WERROR = ["-Werror"] if os.environ.get("RADIXSPEC_WERROR") == "1" else []
STRICT = ["-O3", "-Wall", "-Wextra", *WERROR, "-std=c11"]
SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def _read_cdef(*names: str) -> str:
    spec = importlib.util.spec_from_file_location("radixspec_cdefs", ROOT / "optimized" / "cdefs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.read_cdef(*(HERE / name for name in names)))


sanitize = os.environ.get("RADIXSPEC_SANITIZE") == "1"
ffibuilder = FFI()
ffibuilder.cdef(_read_cdef("radix.h", "store_status.h", "store.h", "tree.h", "hybrid.h", "tiers.h"))
ffibuilder.set_source(
    "radixspec.optimized._radix_c",
    '#include "radix.h"\n#include "store.h"\n#include "tree.h"\n#include "hybrid.h"\n#include "tiers.h"',
    sources=[str((HERE / name).relative_to(ROOT)) for name in ("radix.c", "store.c", "tree.c", "hybrid.c", "tiers.c")],
    include_dirs=[str(HERE.relative_to(ROOT))],
    extra_compile_args=STRICT + (SANITIZE if sanitize else []),
    extra_link_args=SANITIZE if sanitize else [],
)

if __name__ == "__main__":
    # cffi builds from the checkout's top (the sources are named relative to it) and writes the module under the
    # folders of its dotted name (radixspec/optimized/); a checkout keeps radixspec.optimized in optimized/, so
    # the built module moves there
    built = Path(ffibuilder.compile(tmpdir=str(ROOT), verbose=True))
    shutil.move(built, ROOT / "optimized" / built.name)
    shutil.rmtree(ROOT / "radixspec" / "optimized", ignore_errors=True)
