/* KV store on the CPU. The CUDA twin is csrc/store.cu (its API: csrc/store_cuda.h).
 * The lines between the cdef markers are the cffi declarations too (csrc/build_ffi.py). */
#ifndef RADIXSPEC_STORE_H
#define RADIXSPEC_STORE_H
#include <stdint.h>

#include "store_status.h"

/* cdef-begin */
/* Checked store: write row i of k and v (rows k_stride / v_stride bytes apart; 0 repeats one row)
 * into row indices[i] of the dense caches k_cache and v_cache (num_slots rows of row_bytes).
 * index_bytes is 4 or 8. Every index is checked first, in row order (0 <= index < num_slots, no
 * index twice): on error nothing is written, *bad is the first offending row, and the result is
 * an enum radix_store_status. O(n) time and memory, whatever num_slots is. */
int radix_store_rows(char *k_cache, char *v_cache, int64_t num_slots, int64_t row_bytes, const void *indices,
                     int index_bytes, int64_t n, const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                     int64_t *bad);

/* Fast store: the same copy with no duplicate check and no pre-pass. A row whose index is out of
 * range is skipped and RADIX_STORE_FLAG_OUT_OF_RANGE is ORed into *errors; the other rows are
 * written. With duplicate indices the last such row wins. Returns RADIX_STORE_OK or BAD_ARGS. */
int radix_store_rows_fast(char *k_cache, char *v_cache, int64_t num_slots, int64_t row_bytes, const void *indices,
                          int index_bytes, int64_t n, const char *k, int64_t k_stride, const char *v,
                          int64_t v_stride, int32_t *errors);
/* cdef-end */

#endif
