/* The children table of the trees with one node per page (csrc/hybrid.c, csrc/tiers.c): an open-addressing table
 * of node ids, found by (parent, page tokens), both read from the tree's arrays. Each tree keeps its parents in
 * one int64 array and its pages' tokens in another (P per node), and hands both to these functions.
 *
 * Cells hold a node id, PAGES_NONE (empty) or PAGES_TOMB (deleted). page_table_reserve makes room before a
 * change, so a call that fails for memory changes nothing. */
#ifndef RADIXSPEC_PAGES_H
#define RADIXSPEC_PAGES_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PAGES_NONE (-1)
#define PAGES_TOMB (-2)

typedef struct {
    int64_t *cells;
    int64_t capacity; /* a power of two */
    int64_t count;
    int64_t used; /* count + tombstones */
} page_table;

static inline uint64_t pages_mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdULL;
}

static inline uint64_t pages_hash(int64_t parent, const int64_t *tokens, int64_t p) {
    uint64_t h = pages_mix(0x1234567ULL, (uint64_t)parent);
    for (int64_t i = 0; i < p; i++) h = pages_mix(h, (uint64_t)tokens[i]);
    return h ^ (h >> 29);
}

/* an empty table of capacity cells (a power of two); -1 when out of memory */
static inline int page_table_init(page_table *t, int64_t capacity) {
    t->cells = malloc((size_t)capacity * sizeof *t->cells);
    if (t->cells == NULL) return -1;
    for (int64_t i = 0; i < capacity; i++) t->cells[i] = PAGES_NONE;
    t->capacity = capacity;
    t->count = t->used = 0;
    return 0;
}

/* the child of parent whose page is page (P tokens), or PAGES_NONE */
static inline int64_t page_table_find(const page_table *t, const int64_t *parents, const int64_t *tokens, int64_t p,
                                      int64_t parent, const int64_t *page) {
    uint64_t mask = (uint64_t)t->capacity - 1;
    for (uint64_t i = pages_hash(parent, page, p) & mask;; i = (i + 1) & mask) {
        int64_t node = t->cells[i];
        if (node == PAGES_NONE) return PAGES_NONE;
        if (node >= 0 && parents[node] == parent && memcmp(&tokens[node * p], page, (size_t)p * sizeof *page) == 0)
            return node;
    }
}

/* add node, its parent and page already written (room reserved) */
static inline void page_table_add(page_table *t, const int64_t *parents, const int64_t *tokens, int64_t p,
                                  int64_t node) {
    uint64_t mask = (uint64_t)t->capacity - 1;
    uint64_t i = pages_hash(parents[node], &tokens[node * p], p) & mask;
    while (t->cells[i] >= 0) i = (i + 1) & mask;
    if (t->cells[i] == PAGES_NONE) t->used++;
    t->cells[i] = node;
    t->count++;
}

/* remove node (in the table), its parent and page still written */
static inline void page_table_remove(page_table *t, const int64_t *parents, const int64_t *tokens, int64_t p,
                                     int64_t node) {
    uint64_t mask = (uint64_t)t->capacity - 1;
    uint64_t i = pages_hash(parents[node], &tokens[node * p], p) & mask;
    while (t->cells[i] != node) i = (i + 1) & mask;
    t->cells[i] = PAGES_TOMB;
    t->count--;
}

/* room for more nodes (rehashing when tombstones pile up); -1 when out of memory, the table unchanged */
static inline int page_table_reserve(page_table *t, const int64_t *parents, const int64_t *tokens, int64_t p,
                                     int64_t more) {
    if ((t->used + more) * 2 <= t->capacity) return 0;
    int64_t capacity = t->capacity;
    while ((t->count + more) * 2 > capacity) capacity *= 2;
    page_table grown;
    if (page_table_init(&grown, capacity) != 0) return -1;
    for (int64_t i = 0; i < t->capacity; i++)
        if (t->cells[i] >= 0) page_table_add(&grown, parents, tokens, p, t->cells[i]);
    free(t->cells);
    *t = grown;
    return 0;
}

#endif
