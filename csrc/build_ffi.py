"""cffi build script (API mode): csrc/radix.c and csrc/store.c become ``optimized._radix_c``.

``pip install .`` runs it through setup.py's ``cffi_modules``; by hand,
``python csrc/build_ffi.py`` builds the module in place. (The CUDA store
kernel, csrc/store.cu, is built by nvcc instead: ``python -m optimized.kv_store``.)
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
    int radix_store_rows(char *k_cache, char *v_cache, int64_t num_slots, int64_t row_bytes, const void *indices,
                         int index_bytes, int64_t n, const char *k, int64_t k_stride, const char *v,
                         int64_t v_stride, int64_t *bad);
    """
)
ffibuilder.set_source(
    "optimized._radix_c",
    '#include "radix.h"\n#include "store.h"',
    sources=[str((HERE / name).relative_to(HERE.parent)) for name in ("radix.c", "store.c")],
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    extra_compile_args=STRICT,
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose=True)
