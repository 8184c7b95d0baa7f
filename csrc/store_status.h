/* Status codes of the KV store (CPU and CUDA), shared with Python: the lines between the cdef
 * markers are cffi declarations too, so optimized/store.py reads the same names and values. */
#ifndef RADIXSPEC_STORE_STATUS_H
#define RADIXSPEC_STORE_STATUS_H

/* cdef-begin */
enum radix_store_status {
    RADIX_STORE_OK = 0,
    /* an argument the wrapper should never pass (null pointer, negative count, bad index width) */
    RADIX_STORE_BAD_ARGS = -1,
    /* a slot outside [0, num_slots) */
    RADIX_STORE_OUT_OF_RANGE = -2,
    /* a slot given to two rows */
    RADIX_STORE_DUPLICATE = -3,
    /* host memory for the duplicate check could not be allocated */
    RADIX_STORE_NO_MEMORY = -4
    /* positive values are CUDA errors (cudaError_t) */
};

/* Bits a fast store ORs into its error word (it never reads or clears it). */
#define RADIX_STORE_FLAG_OUT_OF_RANGE 1

/* The checked CPU store finds duplicates pairwise up to this many rows, with a hash set above. */
#define RADIX_STORE_PAIRWISE_MAX 32
/* cdef-end */

#endif
