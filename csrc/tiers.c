/* The tiered prefix cache's index (declarations and the big picture: csrc/tiers.h).
 *
 * Twin of the index of reference/tiered_cache.py, same rules (spec/tiers.py): device copies stay prefix-closed (a
 * page's device copy leaves only after its children's), a page without a copy leaves the index, eviction takes the
 * least recently used evictable page first. */
#include "tiers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages.h"

#define NONE PAGES_NONE

struct tier_index {
    int64_t page_size;
    /* per node */
    int64_t capacity;
    int64_t high; /* nodes ever used: ids below it */
    int64_t *parent;
    int64_t *version;
    uint8_t *alive;
    int64_t *fields; /* [node * TIER_FIELDS + f] (TIER_PARENT and TIER_VERSION are read from their arrays) */
    int64_t *tokens; /* [node * page_size ...]: the page's tokens */
    int64_t *free_ids;
    int64_t free_count;
    int64_t pages; /* live nodes below a root */
    int64_t roots;
    page_table table;
};

#define F(index, node, field) ((index)->fields[(node) * TIER_FIELDS + (field)])

/* ---------------------------------------------------------------- nodes */

static int reserve_nodes(tier_index *index, int64_t more) {
    if (index->free_count >= more || index->high + more - index->free_count <= index->capacity) return TIER_OK;
    int64_t capacity = index->capacity > 16 ? index->capacity : 16;
    while (index->high + more > capacity) capacity *= 2;
#define GROW(field, count)                                                            \
    do {                                                                              \
        void *grown = realloc(index->field, (size_t)(count) * sizeof *index->field); \
        if (grown == NULL) return TIER_NO_MEMORY;                                     \
        index->field = grown;                                                         \
    } while (0)
    GROW(parent, capacity);
    GROW(version, capacity);
    GROW(alive, capacity);
    GROW(fields, capacity * TIER_FIELDS);
    GROW(tokens, capacity * index->page_size);
    GROW(free_ids, capacity);
#undef GROW
    for (int64_t i = index->capacity; i < capacity; i++) {
        index->alive[i] = 0;
        index->version[i] = 0;
    }
    index->capacity = capacity;
    return TIER_OK;
}

static int reserve(tier_index *index, int64_t more) {
    if (reserve_nodes(index, more) != TIER_OK) return TIER_NO_MEMORY;
    if (page_table_reserve(&index->table, index->parent, index->tokens, index->page_size, more) != 0)
        return TIER_NO_MEMORY;
    return TIER_OK;
}

/* a new node (room reserved): a root when parent is NONE */
static int64_t new_node(tier_index *index, int64_t parent, const int64_t *page, int64_t pins, int64_t stamp) {
    int64_t node = index->free_count ? index->free_ids[--index->free_count] : index->high++;
    index->parent[node] = parent;
    index->alive[node] = 1;
    for (int64_t f = 0; f < TIER_FIELDS; f++) F(index, node, f) = 0;
    F(index, node, TIER_DEVICE) = F(index, node, TIER_HOST) = NONE;
    F(index, node, TIER_PINS) = pins;
    F(index, node, TIER_LAST_ACCESS) = F(index, node, TIER_DEVICE_SINCE) = stamp;
    if (parent == NONE) {
        index->roots++;
        return node;
    }
    F(index, node, TIER_DEPTH) = F(index, parent, TIER_DEPTH) + 1;
    memcpy(&index->tokens[node * index->page_size], page, (size_t)index->page_size * sizeof *page);
    page_table_add(&index->table, index->parent, index->tokens, index->page_size, node);
    F(index, parent, TIER_CHILDREN)++;
    index->pages++;
    return node;
}

static void free_node(tier_index *index, int64_t node) {
    int64_t parent = index->parent[node];
    if (parent != NONE) {
        page_table_remove(&index->table, index->parent, index->tokens, index->page_size, node);
        F(index, parent, TIER_CHILDREN)--;
        index->pages--;
    } else {
        index->roots--;
    }
    index->alive[node] = 0;
    index->version[node]++;
    index->free_ids[index->free_count++] = node;
}

static int is_page(const tier_index *index, int64_t node) {
    return node >= 0 && node < index->high && index->alive[node] && index->parent[node] != NONE;
}

static int is_node(const tier_index *index, int64_t node) {
    return node >= 0 && node < index->high && index->alive[node];
}

/* ---------------------------------------------------------------- life */

tier_index *tier_new(int64_t page_size) {
    if (page_size <= 0) return NULL;
    tier_index *index = calloc(1, sizeof *index);
    if (index == NULL) return NULL;
    index->page_size = page_size;
    if (page_table_init(&index->table, 64) != 0 || reserve_nodes(index, 16) != TIER_OK) {
        tier_free(index);
        return NULL;
    }
    return index;
}

void tier_free(tier_index *index) {
    if (index == NULL) return;
    free(index->parent);
    free(index->version);
    free(index->alive);
    free(index->fields);
    free(index->tokens);
    free(index->free_ids);
    free(index->table.cells);
    free(index);
}

int64_t tier_new_root(tier_index *index) {
    if (reserve_nodes(index, 1) != TIER_OK) return NONE;
    return new_node(index, NONE, NULL, 0, 0);
}

void tier_reset(tier_index *index) {
    for (int64_t node = 0; node < index->high; node++)
        if (index->alive[node]) {
            index->alive[node] = 0;
            index->version[node]++;
        }
    /* the ids go back in order: the next nodes are 0, 1, ... */
    index->free_count = 0;
    index->high = 0;
    index->pages = index->roots = 0;
    for (int64_t i = 0; i < index->table.capacity; i++) index->table.cells[i] = NONE;
    index->table.count = index->table.used = 0;
}

/* ---------------------------------------------------------------- the walk */

int64_t tier_child(const tier_index *index, int64_t parent, const int64_t *page) {
    if (!is_node(index, parent)) return NONE;
    return page_table_find(&index->table, index->parent, index->tokens, index->page_size, parent, page);
}

int64_t tier_walk(const tier_index *index, int64_t root, const int64_t *tokens, int64_t pages, int64_t *nodes,
                  int64_t *runs) {
    runs[0] = runs[1] = 0;
    if (!is_node(index, root) || pages < 0) return 0;
    int64_t length = 0, node = root;
    while (length < pages) {
        node = page_table_find(&index->table, index->parent, index->tokens, index->page_size, node,
                               &tokens[length * index->page_size]);
        if (node == NONE) break;
        nodes[length++] = node;
    }
    int64_t device = 0;
    while (device < length && F(index, nodes[device], TIER_DEVICE) != NONE) device++;
    int64_t host = device;
    while (host < length && F(index, nodes[host], TIER_HOST) != NONE) host++;
    runs[0] = device;
    runs[1] = host;
    return length;
}

/* ---------------------------------------------------------------- changes */

int tier_add_pages(tier_index *index, int64_t parent, const int64_t *tokens, int64_t pages, const int64_t *pins,
                   int64_t stamp, int64_t *nodes) {
    if (!is_node(index, parent) || pages < 0) return TIER_BAD_ARGS;
    if (pages && tier_child(index, parent, tokens) != NONE) return TIER_BAD_ARGS;
    for (int64_t k = 0; k < pages; k++)
        if (pins[k] < 0) return TIER_BAD_ARGS;
    if (reserve(index, pages) != TIER_OK) return TIER_NO_MEMORY;
    for (int64_t k = 0; k < pages; k++) {
        parent = new_node(index, parent, &tokens[k * index->page_size], pins[k], stamp);
        nodes[k] = parent;
    }
    return TIER_OK;
}

int tier_remove(tier_index *index, int64_t node) {
    if (!is_page(index, node)) return TIER_BAD_ARGS;
    /* a page leaves with nothing left: no copy, no child, nobody holding or moving it */
    if (F(index, node, TIER_DEVICE) != NONE || F(index, node, TIER_HOST) != NONE) return TIER_BAD_ARGS;
    for (int f = TIER_REFS; f <= TIER_STORING; f++)
        if (f != TIER_HITS && F(index, node, f) != 0) return TIER_BAD_ARGS;
    if (F(index, node, TIER_CHILDREN) != 0) return TIER_BAD_ARGS;
    free_node(index, node);
    return TIER_OK;
}

int64_t tier_get(const tier_index *index, int64_t node, int field) {
    if (!is_node(index, node) || field < 0 || field >= TIER_FIELDS) return NONE;
    if (field == TIER_PARENT) return index->parent[node];
    if (field == TIER_VERSION) return index->version[node];
    return F(index, node, field);
}

int tier_add(tier_index *index, const int64_t *nodes, int64_t n, int field, int64_t delta) {
    if (field < TIER_REFS || field > TIER_STORING || n < 0) return TIER_BAD_ARGS;
    /* guards first: every node a page whose count stays >= 0 (a node named twice counts twice) */
    for (int64_t i = 0; i < n; i++) {
        if (!is_page(index, nodes[i])) return TIER_BAD_ARGS;
        if (delta >= 0) continue;
        int64_t times = 0;
        for (int64_t j = 0; j < n; j++) times += nodes[j] == nodes[i];
        if (F(index, nodes[i], field) + times * delta < 0) return TIER_BAD_ARGS;
    }
    for (int64_t i = 0; i < n; i++) F(index, nodes[i], field) += delta;
    return TIER_OK;
}

int tier_set(tier_index *index, const int64_t *nodes, int64_t n, int field, int64_t value) {
    if (n < 0) return TIER_BAD_ARGS;
    if (field != TIER_DEVICE && field != TIER_HOST && field != TIER_LAST_ACCESS && field != TIER_DEVICE_SINCE)
        return TIER_BAD_ARGS;
    if ((field == TIER_DEVICE || field == TIER_HOST) && value < NONE) return TIER_BAD_ARGS;
    for (int64_t i = 0; i < n; i++)
        if (!is_page(index, nodes[i])) return TIER_BAD_ARGS;
    for (int64_t i = 0; i < n; i++) {
        int64_t node = nodes[i];
        if (field == TIER_DEVICE)
            F(index, index->parent[node], TIER_ON_DEVICE_BELOW) +=
                (value != NONE) - (F(index, node, TIER_DEVICE) != NONE);
        F(index, node, field) = value;
    }
    return TIER_OK;
}

int tier_handle(tier_index *index, int op, const int64_t *nodes, const int64_t *versions, const int64_t *since,
                int64_t n) {
    if (op < TIER_CHECK || op > TIER_UNLOCK || n < 0) return TIER_BAD_ARGS;
    for (int64_t i = 0; i < n; i++) {
        int64_t node = nodes[i];
        /* the page left the index, or the device, or its device copy is a newer one */
        if (!is_page(index, node) || index->version[node] != versions[i] || F(index, node, TIER_DEVICE) == NONE ||
            F(index, node, TIER_DEVICE_SINCE) != since[i])
            return TIER_STALE;
    }
    if (op == TIER_UNLOCK && n && F(index, nodes[n - 1], TIER_REFS) == 0) return TIER_NOT_LOCKED;
    if (op != TIER_CHECK)
        for (int64_t i = 0; i < n; i++) F(index, nodes[i], TIER_REFS) += op == TIER_LOCK ? 1 : -1;
    return TIER_OK;
}

/* ---------------------------------------------------------------- eviction */

typedef struct {
    int64_t stamp;
    int64_t depth;
    int64_t order;
    int64_t node;
} entry_t;

static int before(const entry_t *a, const entry_t *b) {
    if (a->stamp != b->stamp) return a->stamp < b->stamp;
    if (a->depth != b->depth) return a->depth < b->depth;
    return a->order < b->order;
}

static void heap_push(entry_t *heap, int64_t *length, entry_t entry) {
    int64_t i = (*length)++;
    while (i > 0 && before(&entry, &heap[(i - 1) / 2])) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = entry;
}

static entry_t heap_pop(entry_t *heap, int64_t *length) {
    entry_t top = heap[0];
    entry_t last = heap[--*length];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= *length) break;
        if (child + 1 < *length && before(&heap[child + 1], &heap[child])) child++;
        if (!before(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (*length) heap[i] = last;
    return top;
}

/* what a plan has taken so far, per node: the flags (kept, taken) and, below it, device copies and leaving pages */
typedef struct {
    uint8_t *flags;
    int64_t *off_device;
    int64_t *leaving;
} scratch_t;

#define KEPT 1
#define TAKEN 2

static int evictable(const tier_index *index, const scratch_t *s, int tier, int may_drop, int64_t node) {
    if (!is_page(index, node) || s->flags[node] || F(index, node, TIER_PINS) != 0) return 0;
    int64_t all_leave = F(index, node, TIER_CHILDREN) == s->leaving[node];
    if (tier == TIER_ON_DEVICE)
        return F(index, node, TIER_DEVICE) != NONE && F(index, node, TIER_REFS) == 0 &&
               F(index, node, TIER_ON_DEVICE_BELOW) == s->off_device[node] &&
               (F(index, node, TIER_HOST) != NONE || (may_drop && all_leave));
    return F(index, node, TIER_HOST) != NONE && F(index, node, TIER_HOST_LOCKS) == 0 &&
           F(index, node, TIER_DEVICE) == NONE && all_leave;
}

int64_t tier_plan(const tier_index *index, int tier, int64_t pages, int may_drop, const int64_t *keep, int64_t n_keep,
                  int64_t *plan) {
    if ((tier != TIER_ON_DEVICE && tier != TIER_ON_HOST) || n_keep < 0) return TIER_BAD_ARGS;
    if (pages <= 0) return 0;
    size_t n = (size_t)index->high + 1;
    scratch_t s = {calloc(n, 1), calloc(n, sizeof(int64_t)), calloc(n, sizeof(int64_t))};
    entry_t *heap = malloc(n * sizeof *heap);
    int64_t length = 0, taken = 0;
    if (s.flags == NULL || s.off_device == NULL || s.leaving == NULL || heap == NULL) {
        taken = TIER_NO_MEMORY;
        goto done;
    }
    for (int64_t i = 0; i < n_keep; i++)
        if (is_node(index, keep[i])) s.flags[keep[i]] |= KEPT;
    for (int64_t node = 0; node < index->high; node++)
        if (evictable(index, &s, tier, may_drop, node))
            heap_push(heap, &length,
                      (entry_t){F(index, node, TIER_LAST_ACCESS), F(index, node, TIER_DEPTH), node, node});
    while (length && taken < pages) {
        int64_t node = heap_pop(heap, &length).node;
        plan[taken++] = node;
        s.flags[node] |= TAKEN;
        int64_t parent = index->parent[node];
        s.off_device[parent]++;
        s.leaving[parent] += tier == TIER_ON_HOST || F(index, node, TIER_HOST) == NONE;
        /* its parent may become evictable now (a page taken once is never offered again) */
        if (evictable(index, &s, tier, may_drop, parent))
            heap_push(heap, &length,
                      (entry_t){F(index, parent, TIER_LAST_ACCESS), F(index, parent, TIER_DEPTH), -taken, parent});
    }
done:
    free(s.flags);
    free(s.off_device);
    free(s.leaving);
    free(heap);
    return taken;
}

int64_t tier_unbacked(const tier_index *index, int64_t *out, int64_t room) {
    if (room <= 0) return 0;
    entry_t *heap = malloc(((size_t)index->high + 1) * sizeof *heap);
    if (heap == NULL) return TIER_NO_MEMORY;
    int64_t length = 0;
    for (int64_t node = 0; node < index->high; node++)
        if (is_page(index, node) && F(index, node, TIER_DEVICE) != NONE && F(index, node, TIER_HOST) == NONE &&
            F(index, node, TIER_REFS) == 0 && F(index, node, TIER_PINS) == 0 &&
            F(index, node, TIER_ON_DEVICE_BELOW) == 0)
            heap_push(heap, &length,
                      (entry_t){F(index, node, TIER_LAST_ACCESS), F(index, node, TIER_DEPTH), node, node});
    int64_t written = 0;
    while (length && written < room) out[written++] = heap_pop(heap, &length).node;
    free(heap);
    return written;
}

/* ---------------------------------------------------------------- views */

int64_t tier_export(const tier_index *index, int64_t *nodes, int64_t *values, int64_t capacity) {
    if (index->pages > capacity) return -index->pages;
    int64_t i = 0;
    for (int64_t node = 0; node < index->high; node++) {
        if (!is_page(index, node)) continue;
        nodes[i] = node;
        for (int f = 0; f < TIER_FIELDS; f++) values[i * TIER_FIELDS + f] = tier_get(index, node, f);
        i++;
    }
    return i;
}

void tier_counts(const tier_index *index, int64_t *out) {
    int64_t locked = 0;
    for (int64_t node = 0; node < index->high; node++) locked += is_page(index, node) && F(index, node, TIER_REFS) > 0;
    out[0] = index->pages;
    out[1] = locked;
    out[2] = index->roots;
}

#define FAIL(...)                                              \
    do {                                                       \
        snprintf(message, (size_t)capacity, __VA_ARGS__);      \
        free(below);                                           \
        return TIER_CORRUPT;                                   \
    } while (0)

int tier_check(const tier_index *index, char *message, int64_t capacity) {
    /* per node: its children, and those of them on the device, counted from the children up */
    int64_t *below = calloc(2 * ((size_t)index->high + 1), sizeof *below);
    if (below == NULL) {
        snprintf(message, (size_t)capacity, "out of memory");
        return TIER_NO_MEMORY;
    }
    int64_t pages = 0, roots = 0;
    for (int64_t node = 0; node < index->high; node++) {
        if (!index->alive[node]) continue;
        int64_t up = index->parent[node];
        if (up == NONE) {
            roots++;
            continue;
        }
        pages++;
        if (up < 0 || up >= index->high || !index->alive[up]) FAIL("parent_is_alive: node %lld", (long long)node);
        if (F(index, node, TIER_DEPTH) != F(index, up, TIER_DEPTH) + 1)
            FAIL("depths_count_pages: node %lld", (long long)node);
        if (page_table_find(&index->table, index->parent, index->tokens, index->page_size, up,
                            &index->tokens[node * index->page_size]) != node)
            FAIL("children_table_finds_every_page: node %lld", (long long)node);
        for (int f = TIER_REFS; f <= TIER_STORING; f++)
            if (F(index, node, f) < 0) FAIL("counts_are_not_negative: node %lld field %d", (long long)node, f);
        int on_device = F(index, node, TIER_DEVICE) != NONE;
        if (!on_device && F(index, node, TIER_HOST) == NONE)
            FAIL("every_page_holds_a_copy: node %lld has none", (long long)node);
        if (on_device && index->parent[up] != NONE && F(index, up, TIER_DEVICE) == NONE)
            FAIL("device_copies_are_prefix_closed: node %lld", (long long)node);
        below[2 * up]++;
        below[2 * up + 1] += on_device;
    }
    if (pages != index->pages || roots != index->roots)
        FAIL("node_counts: %lld pages and %lld roots alive, %lld and %lld counted", (long long)pages,
             (long long)roots, (long long)index->pages, (long long)index->roots);
    if (index->table.count != pages)
        FAIL("children_table_holds_the_pages: %lld of %lld", (long long)index->table.count, (long long)pages);
    for (int64_t node = 0; node < index->high; node++) {
        if (!index->alive[node]) continue;
        if (below[2 * node] != F(index, node, TIER_CHILDREN)) FAIL("child_counts_match: node %lld", (long long)node);
        if (below[2 * node + 1] != F(index, node, TIER_ON_DEVICE_BELOW))
            FAIL("device_child_counts_match: node %lld", (long long)node);
    }
    free(below);
    return TIER_OK;
}
