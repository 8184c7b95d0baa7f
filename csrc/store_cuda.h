/* KV store on CUDA (csrc/store.cu), loaded through cffi's ABI mode by optimized/store.py, which
 * reads the lines between the cdef markers as its declarations: one source for both. */
#ifndef RADIXSPEC_STORE_CUDA_H
#define RADIXSPEC_STORE_CUDA_H
#include <stdint.h>

#include "store_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */
/* Launch the store on `stream` (a cudaStream_t) of the current device: row i of k and v (rows
 * k_stride / v_stride bytes apart; 0 repeats one row) goes to row indices[i] of the dense caches.
 * A row whose index is outside [0, num_slots) is skipped and RADIX_STORE_FLAG_OUT_OF_RANGE is
 * ORed into *errors (a device int32). No host sync, no allocation: capturable in a CUDA graph.
 * Returns RADIX_STORE_OK, RADIX_STORE_BAD_ARGS, or a positive cudaError_t of the launch. */
int radix_store_launch(void *k_cache, void *v_cache, const void *indices, int index_bytes, int64_t n,
                       int64_t num_slots, int64_t row_bytes, const void *k, int64_t k_stride, const void *v,
                       int64_t v_stride, int32_t *errors, void *stream);

/* cudaGetErrorString of a positive status. */
const char *radix_cuda_error_string(int status);
/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif
