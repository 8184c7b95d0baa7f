/* KV store on the CPU: validate every index, then copy rows with memcpy.
 *
 * Duplicates are rejected (a serving engine never gives two tokens one
 * slot; when it does, that is the bug to find). Small batches check them
 * pairwise; larger ones with a bitmap over the slots. */
#include "store.h"

#include <stdlib.h>
#include <string.h>

#define PAIRWISE_MAX 32

static int64_t index_at(const void *indices, int index_bytes, int64_t i) {
    return index_bytes == 4 ? (int64_t)((const int32_t *)indices)[i] : ((const int64_t *)indices)[i];
}

static int check_indices(const void *indices, int index_bytes, int64_t n, int64_t num_slots, int64_t *bad) {
    for (int64_t i = 0; i < n; ++i) {
        int64_t slot = index_at(indices, index_bytes, i);
        if (slot < 0 || slot >= num_slots) {
            *bad = i;
            return RADIX_STORE_OUT_OF_RANGE;
        }
    }
    if (n <= PAIRWISE_MAX) {
        for (int64_t i = 1; i < n; ++i) {
            for (int64_t j = 0; j < i; ++j) {
                if (index_at(indices, index_bytes, i) == index_at(indices, index_bytes, j)) {
                    *bad = i;
                    return RADIX_STORE_DUPLICATE;
                }
            }
        }
        return RADIX_STORE_OK;
    }
    unsigned char *seen = calloc((size_t)(num_slots / 8 + 1), 1);
    if (seen == NULL) {
        *bad = -1;
        return RADIX_STORE_BAD_ARGS;
    }
    int status = RADIX_STORE_OK;
    for (int64_t i = 0; i < n; ++i) {
        int64_t slot = index_at(indices, index_bytes, i);
        unsigned char bit = (unsigned char)(1u << (slot & 7));
        if (seen[slot >> 3] & bit) {
            *bad = i;
            status = RADIX_STORE_DUPLICATE;
            break;
        }
        seen[slot >> 3] |= bit;
    }
    free(seen);
    return status;
}

int radix_store_rows(char *k_cache, char *v_cache, int64_t num_slots, int64_t row_bytes, const void *indices,
                     int index_bytes, int64_t n, const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                     int64_t *bad) {
    if (bad == NULL) {
        return RADIX_STORE_BAD_ARGS;
    }
    *bad = -1;
    if (n < 0 || num_slots < 0 || row_bytes <= 0 || (index_bytes != 4 && index_bytes != 8) ||
        k_stride < row_bytes || v_stride < row_bytes) {
        return RADIX_STORE_BAD_ARGS;
    }
    if (n == 0) {
        return RADIX_STORE_OK;
    }
    if (k_cache == NULL || v_cache == NULL || indices == NULL || k == NULL || v == NULL) {
        return RADIX_STORE_BAD_ARGS;
    }
    int status = check_indices(indices, index_bytes, n, num_slots, bad);
    if (status != RADIX_STORE_OK) {
        return status;
    }
    for (int64_t i = 0; i < n; ++i) {
        int64_t slot = index_at(indices, index_bytes, i);
        memcpy(k_cache + slot * row_bytes, k + i * k_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, v + i * v_stride, (size_t)row_bytes);
    }
    return RADIX_STORE_OK;
}
