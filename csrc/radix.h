/* Small C helpers of the optimized radix cache. The lines between the cdef markers are the
 * cffi declarations too (csrc/build_ffi.py reads them): one source for both.
 * Every function checks its arguments and returns -1 when they are invalid. */
#ifndef RADIXSPEC_RADIX_H
#define RADIXSPEC_RADIX_H
#include <stdint.h>

/* cdef-begin */
/* Length of the common prefix of a[0..n) and b[0..n) (n = the shorter length). */
int64_t radix_compare_i32(const int32_t *a, const int32_t *b, int64_t n);
int64_t radix_compare_i64(const int64_t *a, const int64_t *b, int64_t n);

/* Index of the first value of a[0..n) outside [0, max_value], or n when there is none. */
int64_t radix_first_outside_i32(const int32_t *a, int64_t n, int64_t max_value);
int64_t radix_first_outside_i64(const int64_t *a, int64_t n, int64_t max_value);

/* Index of the first of npages pages of page_size slots that is not a run
 * start..start+page_size-1 with start >= 0 and start % page_size == 0, or npages when all are. */
int64_t radix_first_bad_page_i32(const int32_t *slots, int64_t npages, int64_t page_size);
/* cdef-end */

#endif
