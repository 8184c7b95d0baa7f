/* Common-prefix length of two integer arrays, for the radix tree's key match.
 *
 * Long keys (a shared system prompt of thousands of tokens) dominate match
 * cost, so the search narrows in three steps: memcmp over 1 KiB blocks
 * (vectorized by libc), then 32-byte blocks compared as four 64-bit words,
 * then element by element inside the first differing block. */
#include "radix.h"

#include <string.h>

#define BIG_BLOCK_BYTES 1024
#define SMALL_BLOCK_BYTES 32

static int64_t first_differing_byte_block(const unsigned char *a, const unsigned char *b, int64_t nbytes) {
    int64_t off = 0;
    while (off + BIG_BLOCK_BYTES <= nbytes && memcmp(a + off, b + off, BIG_BLOCK_BYTES) == 0) {
        off += BIG_BLOCK_BYTES;
    }
    while (off + SMALL_BLOCK_BYTES <= nbytes) {
        uint64_t x[4], y[4];
        memcpy(x, a + off, sizeof x);
        memcpy(y, b + off, sizeof y);
        if (((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) != 0) {
            break;
        }
        off += SMALL_BLOCK_BYTES;
    }
    return off;
}

/* The same two functions for int32 and int64 token ids. */
#define RADIX_DEFINE_FOR(SUFFIX, TYPE)                                                                         \
    int64_t radix_compare_##SUFFIX(const TYPE *a, const TYPE *b, int64_t n) {                                 \
        if (n < 0 || (n > 0 && (a == NULL || b == NULL))) {                                                    \
            return -1;                                                                                         \
        }                                                                                                      \
        int64_t i = first_differing_byte_block((const unsigned char *)a, (const unsigned char *)b,             \
                                               n * (int64_t)sizeof(TYPE)) /                                    \
                    (int64_t)sizeof(TYPE);                                                                     \
        while (i < n && a[i] == b[i]) {                                                                        \
            ++i;                                                                                               \
        }                                                                                                      \
        return i;                                                                                              \
    }                                                                                                          \
                                                                                                               \
    int64_t radix_first_outside_##SUFFIX(const TYPE *a, int64_t n, int64_t max_value) {                         \
        if (n < 0 || max_value < 0 || (n > 0 && a == NULL)) {                                                  \
            return -1;                                                                                         \
        }                                                                                                      \
        int64_t i = 0;                                                                                         \
        while (i < n && a[i] >= 0 && (int64_t)a[i] <= max_value) {                                             \
            ++i;                                                                                               \
        }                                                                                                      \
        return i;                                                                                              \
    }

RADIX_DEFINE_FOR(i32, int32_t)
RADIX_DEFINE_FOR(i64, int64_t)

int64_t radix_first_bad_page_i32(const int32_t *slots, int64_t npages, int64_t page_size) {
    if (npages < 0 || page_size < 1 || (npages > 0 && slots == NULL)) {
        return -1;
    }
    for (int64_t page = 0; page < npages; ++page) {
        const int32_t *s = slots + page * page_size;
        if (s[0] < 0 || s[0] % page_size != 0) {
            return page;
        }
        for (int64_t k = 1; k < page_size; ++k) {
            if ((int64_t)s[k] != (int64_t)s[0] + k) {
                return page;
            }
        }
    }
    return npages;
}
