/* KV store on the CPU (cdef: csrc/build_ffi.py). The CUDA twin is csrc/store.cu. */
#include <stdint.h>

#define RADIX_STORE_OK 0
#define RADIX_STORE_BAD_ARGS (-1)
#define RADIX_STORE_OUT_OF_RANGE (-2)
#define RADIX_STORE_DUPLICATE (-3)

/* Write row i of k and v (rows k_stride / v_stride bytes apart) into row indices[i] of the
 * dense caches k_cache and v_cache (num_slots rows of row_bytes). index_bytes is 4 or 8.
 * Every index is checked first (0 <= index < num_slots, no index twice): on error nothing
 * is written, *bad is the offending row, and the result is one of the codes above. */
int radix_store_rows(char *k_cache, char *v_cache, int64_t num_slots, int64_t row_bytes, const void *indices,
                     int index_bytes, int64_t n, const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                     int64_t *bad);
