/* Small C helpers of the optimized radix cache (cdef: csrc/build_ffi.py).
 * Every function checks its arguments and returns -1 when they are invalid. */
#include <stdint.h>

/* Length of the common prefix of a[0..n) and b[0..n) (n = the shorter length). */
int64_t radix_compare_i32(const int32_t *a, const int32_t *b, int64_t n);
int64_t radix_compare_i64(const int64_t *a, const int64_t *b, int64_t n);
