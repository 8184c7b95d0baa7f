/* KV store on the CPU: checked (validate every index, then memcpy per row) or fast (memcpy per
 * row, skipping and flagging out-of-range rows).
 *
 * The checked store rejects duplicates (a serving engine never gives two tokens one slot; when it
 * does, that is the bug to find). Small batches check them pairwise; larger ones with an
 * open-addressing hash set sized to the batch, so a store never touches memory in proportion to
 * the pool. Range and duplicates are checked in one pass, so the error names the first bad row. */
#include "store.h"

#include <stdlib.h>
#include <string.h>

static int64_t index_at(const void *indices, int index_bytes, int64_t i) {
    return index_bytes == 4 ? (int64_t)((const int32_t *)indices)[i] : ((const int64_t *)indices)[i];
}

static int args_are_valid(const char *k_cache, const char *v_cache, int64_t num_slots, int64_t row_bytes,
                          const void *indices, int index_bytes, int64_t n, const char *k, int64_t k_stride,
                          const char *v, int64_t v_stride) {
    if (n < 0 || num_slots < 0 || row_bytes <= 0 || (index_bytes != 4 && index_bytes != 8) || k_stride < 0 ||
        v_stride < 0) {
        return 0;
    }
    /* an empty pool may have no memory at all: every row is then out of range */
    int caches_ok = num_slots == 0 || (k_cache != NULL && v_cache != NULL);
    return n == 0 || (caches_ok && indices != NULL && k != NULL && v != NULL);
}

/* Slots seen so far: an open-addressing hash set of capacity a power of two >= 2n. Slots are
 * checked to be in range first, so slot + 1 > 0 marks a used cell. */
typedef struct {
    int64_t *cells;
    uint64_t mask;
} slot_set;

static int slot_set_init(slot_set *set, int64_t n) {
    uint64_t capacity = 64;
    while (capacity < 2 * (uint64_t)n) {
        capacity *= 2;
    }
    set->cells = calloc((size_t)capacity, sizeof *set->cells);
    set->mask = capacity - 1;
    return set->cells != NULL;
}

/* Add slot; returns 1 if it was there already. */
static int slot_set_add(slot_set *set, int64_t slot) {
    int64_t key = slot + 1;
    /* Fibonacci hashing: multiply by 2^64 / phi */
    uint64_t cell = ((uint64_t)key * UINT64_C(0x9E3779B97F4A7C15)) & set->mask;
    while (set->cells[cell] != 0) {
        if (set->cells[cell] == key) {
            return 1;
        }
        cell = (cell + 1) & set->mask;
    }
    set->cells[cell] = key;
    return 0;
}

/* One pass in row order: the first row whose slot is out of range or repeats an earlier row's. */
static int check_indices(const void *indices, int index_bytes, int64_t n, int64_t num_slots, int64_t *bad) {
    int pairwise = n <= RADIX_STORE_PAIRWISE_MAX;
    slot_set seen = {NULL, 0};
    if (!pairwise && !slot_set_init(&seen, n)) {
        return RADIX_STORE_NO_MEMORY;
    }
    int status = RADIX_STORE_OK;
    for (int64_t i = 0; i < n && status == RADIX_STORE_OK; ++i) {
        int64_t slot = index_at(indices, index_bytes, i);
        if (slot < 0 || slot >= num_slots) {
            status = RADIX_STORE_OUT_OF_RANGE;
        } else if (pairwise) {
            for (int64_t j = 0; j < i && status == RADIX_STORE_OK; ++j) {
                if (slot == index_at(indices, index_bytes, j)) {
                    status = RADIX_STORE_DUPLICATE;
                }
            }
        } else if (slot_set_add(&seen, slot)) {
            status = RADIX_STORE_DUPLICATE;
        }
        if (status != RADIX_STORE_OK) {
            *bad = i;
        }
    }
    free(seen.cells);
    return status;
}

int radix_store_rows(char *k_cache, char *v_cache, int64_t num_slots, int64_t row_bytes, const void *indices,
                     int index_bytes, int64_t n, const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                     int64_t *bad) {
    if (bad == NULL) {
        return RADIX_STORE_BAD_ARGS;
    }
    *bad = -1;
    if (!args_are_valid(k_cache, v_cache, num_slots, row_bytes, indices, index_bytes, n, k, k_stride, v,
                        v_stride)) {
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

int radix_store_rows_fast(char *k_cache, char *v_cache, int64_t num_slots, int64_t row_bytes, const void *indices,
                          int index_bytes, int64_t n, const char *k, int64_t k_stride, const char *v,
                          int64_t v_stride, int32_t *errors) {
    if (errors == NULL || !args_are_valid(k_cache, v_cache, num_slots, row_bytes, indices, index_bytes, n, k,
                                          k_stride, v, v_stride)) {
        return RADIX_STORE_BAD_ARGS;
    }
    for (int64_t i = 0; i < n; ++i) {
        int64_t slot = index_at(indices, index_bytes, i);
        if (slot < 0 || slot >= num_slots) {
            *errors |= RADIX_STORE_FLAG_OUT_OF_RANGE;
            continue;
        }
        memcpy(k_cache + slot * row_bytes, k + i * k_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, v + i * v_stride, (size_t)row_bytes);
    }
    return RADIX_STORE_OK;
}
