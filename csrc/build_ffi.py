"""cffi build script (API mode): compiles csrc/radix.c into ``optimized._radix_c`` at install time.

``pip install .`` runs it through setup.py's ``cffi_modules``; by hand:
``python csrc/build_ffi.py`` builds the module in place.
"""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
STRICT = ["-O3", "-Wall", "-Wextra", "-Werror", "-std=c11"]

ffibuilder = FFI()
ffibuilder.cdef(
    """
    int64_t radix_compare_i32(const int32_t *a, const int32_t *b, int64_t n);
    int64_t radix_compare_i64(const int64_t *a, const int64_t *b, int64_t n);
    int64_t radix_first_negative_i32(const int32_t *a, int64_t n);
    int64_t radix_first_negative_i64(const int64_t *a, int64_t n);
    int64_t radix_first_bad_page_i32(const int32_t *slots, int64_t npages, int64_t page_size);
    """
)
ffibuilder.set_source(
    "optimized._radix_c",
    '#include "radix.h"',
    sources=[str((HERE / "radix.c").relative_to(HERE.parent))],
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    extra_compile_args=STRICT,
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose=True)
