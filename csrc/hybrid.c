/* The hybrid prefix cache's tree (declarations and the big picture: csrc/hybrid.h).
 *
 * Twin of reference/hybrid_cache.py, same rules (spec/hybrid.py): a match of length L uses, in a
 * full-attention group, every page before L, in a window group of W the pages holding a token in
 * [L - (W - 1), L); the match is the longest L whose used pages every group caches. Eviction is
 * per group: the evictable page with the oldest stamp, the deeper on a tie; a full group evicts
 * leaves of that group only, a window group any unlocked page. */
#include "hybrid.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages.h"

#define NONE PAGES_NONE
#define TOMB PAGES_TOMB

typedef struct {
    int64_t slot; /* page start, NONE where the group does not cache the page */
    int64_t stamp;
    int64_t refs;
    int64_t gen;
} value_t;

typedef struct {
    int64_t stamp;
    int64_t depth;
    int64_t node;
    int64_t version;
    int64_t gen;
} entry_t;

typedef struct {
    entry_t *items;
    int64_t length;
    int64_t capacity;
} heap_t;

/* an open-addressing set of int64 keys >= 0 (NONE: empty, TOMB: deleted) */
typedef struct {
    int64_t *cells;
    int64_t capacity; /* a power of two */
    int64_t count;
    int64_t used; /* count + tombstones */
} set_t;

struct hybrid_tree {
    int64_t page_size;
    int64_t groups;
    int64_t *windows;
    /* per node */
    int64_t capacity;
    int64_t high; /* nodes ever used: ids below it */
    int64_t *parent;
    int64_t *version;
    int64_t *depth; /* pages from the root */
    int64_t *children; /* child nodes, of any group */
    int64_t *group_children; /* [node * groups + g]: child nodes with a value in group g */
    uint8_t *alive;
    value_t *values; /* [node * groups + g] */
    int64_t *tokens; /* [node * page_size ...]: the page's tokens */
    int64_t *free_ids;
    int64_t free_count;
    int64_t nodes;
    /* children table: cells hold node ids; (parent, page tokens) is read from the node */
    page_table table;
    /* per group: the starts it caches, its evictable pages' heap, counts */
    set_t *starts;
    heap_t *heaps;
    int64_t *cached;
    int64_t *locked;
};

/* ---------------------------------------------------------------- small helpers */

static int set_init(set_t *set, int64_t capacity) {
    set->cells = malloc((size_t)capacity * sizeof *set->cells);
    if (set->cells == NULL) return HYBRID_NO_MEMORY;
    for (int64_t i = 0; i < capacity; i++) set->cells[i] = NONE;
    set->capacity = capacity;
    set->count = set->used = 0;
    return HYBRID_OK;
}

static uint64_t key_hash(int64_t key) { return pages_mix(0x51ed270b27ULL, (uint64_t)key); }

static int64_t set_find(const set_t *set, int64_t key) {
    uint64_t mask = (uint64_t)set->capacity - 1;
    for (uint64_t i = key_hash(key) & mask;; i = (i + 1) & mask) {
        if (set->cells[i] == NONE) return NONE;
        if (set->cells[i] == key) return (int64_t)i;
    }
}

static void set_add(set_t *set, int64_t key) {
    uint64_t mask = (uint64_t)set->capacity - 1;
    uint64_t i = key_hash(key) & mask;
    while (set->cells[i] >= 0) i = (i + 1) & mask;
    if (set->cells[i] == NONE) set->used++;
    set->cells[i] = key;
    set->count++;
}

static void set_remove(set_t *set, int64_t key) {
    int64_t i = set_find(set, key);
    if (i != NONE) {
        set->cells[i] = TOMB;
        set->count--;
    }
}

/* room for more keys (rehashing when tombstones pile up); nothing changes on failure */
static int set_reserve(set_t *set, int64_t more) {
    if ((set->used + more) * 2 <= set->capacity) return HYBRID_OK;
    int64_t capacity = set->capacity;
    while ((set->count + more) * 2 > capacity) capacity *= 2;
    set_t grown;
    if (set_init(&grown, capacity) != HYBRID_OK) return HYBRID_NO_MEMORY;
    for (int64_t i = 0; i < set->capacity; i++)
        if (set->cells[i] >= 0) set_add(&grown, set->cells[i]);
    free(set->cells);
    *set = grown;
    return HYBRID_OK;
}

static value_t *value(const hybrid_tree *tree, int64_t node, int64_t group) {
    return &tree->values[node * tree->groups + group];
}

/* ---------------------------------------------------------------- the children table (csrc/pages.h) */

static int64_t table_find(const hybrid_tree *tree, int64_t parent, const int64_t *page) {
    return page_table_find(&tree->table, tree->parent, tree->tokens, tree->page_size, parent, page);
}

static void table_add(hybrid_tree *tree, int64_t node) {
    page_table_add(&tree->table, tree->parent, tree->tokens, tree->page_size, node);
}

static void table_remove(hybrid_tree *tree, int64_t node) {
    page_table_remove(&tree->table, tree->parent, tree->tokens, tree->page_size, node);
}

static int table_reserve(hybrid_tree *tree, int64_t more) {
    int failed = page_table_reserve(&tree->table, tree->parent, tree->tokens, tree->page_size, more);
    return failed ? HYBRID_NO_MEMORY : HYBRID_OK;
}

/* ---------------------------------------------------------------- the eviction heaps */

static int before(const entry_t *a, const entry_t *b) {
    return a->stamp < b->stamp || (a->stamp == b->stamp && a->depth > b->depth);
}

static int heap_reserve(heap_t *heap, int64_t more) {
    if (heap->length + more <= heap->capacity) return HYBRID_OK;
    int64_t capacity = heap->capacity ? heap->capacity : 16;
    while (heap->length + more > capacity) capacity *= 2;
    entry_t *grown = realloc(heap->items, (size_t)capacity * sizeof *grown);
    if (grown == NULL) return HYBRID_NO_MEMORY;
    heap->items = grown;
    heap->capacity = capacity;
    return HYBRID_OK;
}

static void heap_push(heap_t *heap, entry_t entry) {
    int64_t i = heap->length++;
    while (i > 0 && before(&entry, &heap->items[(i - 1) / 2])) {
        heap->items[i] = heap->items[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap->items[i] = entry;
}

static entry_t heap_pop(heap_t *heap) {
    entry_t top = heap->items[0];
    entry_t last = heap->items[--heap->length];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= heap->length) break;
        if (child + 1 < heap->length && before(&heap->items[child + 1], &heap->items[child])) child++;
        if (!before(&heap->items[child], &last)) break;
        heap->items[i] = heap->items[child];
        i = child;
    }
    if (heap->length) heap->items[i] = last;
    return top;
}

static int is_evictable(const hybrid_tree *tree, int64_t node, int64_t group) {
    const value_t *v = value(tree, node, group);
    return v->slot != NONE
           /* nobody holds a lock on it */
           && v->refs == 0
           /* and it is a leaf of its group, or its group is a sliding window (which may leave a hole) */
           && (tree->windows[group] != 0 || tree->group_children[node * tree->groups + group] == 0);
}

/* an entry still names the page it was pushed for, unchanged, and the page is evictable */
static int entry_is_live(const hybrid_tree *tree, const entry_t *e, int64_t group) {
    if (!tree->alive[e->node] || tree->version[e->node] != e->version) return 0;
    const value_t *v = value(tree, e->node, group);
    return v->gen == e->gen && v->stamp == e->stamp && is_evictable(tree, e->node, group);
}

/* queue the page if it is evictable now (room reserved by the caller) */
static void offer(hybrid_tree *tree, int64_t node, int64_t group) {
    if (!is_evictable(tree, node, group)) return;
    const value_t *v = value(tree, node, group);
    entry_t e = {v->stamp, tree->depth[node], node, tree->version[node], v->gen};
    heap_push(&tree->heaps[group], e);
}

/* ---------------------------------------------------------------- nodes */

static int reserve_nodes(hybrid_tree *tree, int64_t more) {
    if (tree->free_count >= more || tree->high + more - tree->free_count <= tree->capacity) return HYBRID_OK;
    int64_t capacity = tree->capacity > 16 ? tree->capacity : 16;
    while (tree->high + more > capacity) capacity *= 2;
    int64_t g = tree->groups, p = tree->page_size;
#define GROW(field, count)                                                          \
    do {                                                                            \
        void *grown = realloc(tree->field, (size_t)(count) * sizeof *tree->field); \
        if (grown == NULL) return HYBRID_NO_MEMORY;                                 \
        tree->field = grown;                                                        \
    } while (0)
    GROW(parent, capacity);
    GROW(version, capacity);
    GROW(depth, capacity);
    GROW(children, capacity);
    GROW(group_children, capacity * g);
    GROW(alive, capacity);
    GROW(values, capacity * g);
    GROW(tokens, capacity * p);
    GROW(free_ids, capacity);
#undef GROW
    for (int64_t i = tree->capacity; i < capacity; i++) {
        tree->alive[i] = 0;
        tree->version[i] = 0;
    }
    tree->capacity = capacity;
    return HYBRID_OK;
}

/* a new node (room reserved): a root when parent is NONE */
static int64_t new_node(hybrid_tree *tree, int64_t parent, const int64_t *page) {
    int64_t node = tree->free_count ? tree->free_ids[--tree->free_count] : tree->high++;
    tree->parent[node] = parent;
    tree->depth[node] = parent == NONE ? 0 : tree->depth[parent] + 1;
    tree->children[node] = 0;
    tree->alive[node] = 1;
    tree->nodes++;
    for (int64_t g = 0; g < tree->groups; g++) {
        tree->group_children[node * tree->groups + g] = 0;
        *value(tree, node, g) = (value_t){NONE, 0, 0, 0};
    }
    if (parent != NONE) {
        memcpy(&tree->tokens[node * tree->page_size], page, (size_t)tree->page_size * sizeof *page);
        table_add(tree, node);
        tree->children[parent]++;
    }
    return node;
}

static void free_node(hybrid_tree *tree, int64_t node) {
    if (tree->parent[node] != NONE) {
        table_remove(tree, node);
        tree->children[tree->parent[node]]--;
    }
    tree->alive[node] = 0;
    tree->version[node]++;
    tree->free_ids[tree->free_count++] = node;
    tree->nodes--;
}

/* drop node and its ancestors (not a root) while they cache nothing and hold no way down */
static void prune(hybrid_tree *tree, int64_t node) {
    while (tree->parent[node] != NONE && tree->children[node] == 0) {
        for (int64_t g = 0; g < tree->groups; g++)
            if (value(tree, node, g)->slot != NONE) return;
        int64_t parent = tree->parent[node];
        free_node(tree, node);
        node = parent;
    }
}

/* ---------------------------------------------------------------- life */

hybrid_tree *hybrid_new(int64_t page_size, int64_t groups, const int64_t *windows) {
    if (page_size < 1 || groups < 1) return NULL;
    hybrid_tree *tree = calloc(1, sizeof *tree);
    if (tree == NULL) return NULL;
    tree->page_size = page_size;
    tree->groups = groups;
    tree->windows = malloc((size_t)groups * sizeof *tree->windows);
    tree->starts = calloc((size_t)groups, sizeof *tree->starts);
    tree->heaps = calloc((size_t)groups, sizeof *tree->heaps);
    tree->cached = calloc((size_t)groups, sizeof *tree->cached);
    tree->locked = calloc((size_t)groups, sizeof *tree->locked);
    int ok = tree->windows && tree->starts && tree->heaps && tree->cached && tree->locked;
    if (ok) memcpy(tree->windows, windows, (size_t)groups * sizeof *windows);
    for (int64_t g = 0; ok && g < groups; g++) ok = set_init(&tree->starts[g], 64) == HYBRID_OK;
    ok = ok && page_table_init(&tree->table, 64) == 0;
    tree->capacity = 0;
    ok = ok && reserve_nodes(tree, 16) == HYBRID_OK;
    if (!ok) {
        hybrid_free(tree);
        return NULL;
    }
    return tree;
}

void hybrid_free(hybrid_tree *tree) {
    if (tree == NULL) return;
    for (int64_t g = 0; tree->starts && g < tree->groups; g++) free(tree->starts[g].cells);
    for (int64_t g = 0; tree->heaps && g < tree->groups; g++) free(tree->heaps[g].items);
    free(tree->starts);
    free(tree->heaps);
    free(tree->cached);
    free(tree->locked);
    free(tree->windows);
    free(tree->table.cells);
    free(tree->parent);
    free(tree->version);
    free(tree->depth);
    free(tree->children);
    free(tree->group_children);
    free(tree->alive);
    free(tree->values);
    free(tree->tokens);
    free(tree->free_ids);
    free(tree);
}

int64_t hybrid_new_root(hybrid_tree *tree) {
    if (reserve_nodes(tree, 1) != HYBRID_OK) return NONE;
    return new_node(tree, NONE, NULL);
}

void hybrid_reset(hybrid_tree *tree) {
    for (int64_t node = 0; node < tree->high; node++)
        if (tree->alive[node]) {
            tree->alive[node] = 0;
            tree->version[node]++;
        }
    tree->free_count = 0;
    for (int64_t node = tree->high - 1; node >= 0; node--) tree->free_ids[tree->free_count++] = node;
    tree->nodes = 0;
    for (int64_t i = 0; i < tree->table.capacity; i++) tree->table.cells[i] = NONE;
    tree->table.count = tree->table.used = 0;
    for (int64_t g = 0; g < tree->groups; g++) {
        set_t *s = &tree->starts[g];
        for (int64_t i = 0; i < s->capacity; i++) s->cells[i] = NONE;
        s->count = s->used = 0;
        tree->heaps[g].length = 0;
        tree->cached[g] = tree->locked[g] = 0;
    }
}

/* ---------------------------------------------------------------- matching */

/* first page a match of length tokens uses in group g */
static int64_t first_used(const hybrid_tree *tree, int64_t length, int64_t group) {
    int64_t w = tree->windows[group];
    if (w == 0) return 0;
    int64_t start = length - (w - 1);
    return (start > 0 ? start : 0) / tree->page_size;
}

static int cached_at(const hybrid_tree *tree, const int64_t *path, int64_t found, int64_t page, int64_t group) {
    return page < found && value(tree, path[page], group)->slot != NONE;
}

/* the nodes of tokens' pages under root, as far as the tree holds them (path[k] for k < returned) */
static int64_t walk(const hybrid_tree *tree, int64_t root, const int64_t *tokens, int64_t pages, int64_t *path) {
    int64_t node = root, k = 0;
    for (; k < pages; k++) {
        node = table_find(tree, node, &tokens[k * tree->page_size]);
        if (node == NONE) break;
        path[k] = node;
    }
    return k;
}

/* the longest valid match in pages along path (found nodes of pages) */
static int64_t match_pages(const hybrid_tree *tree, const int64_t *path, int64_t found, int64_t pages) {
    int64_t longest = pages, p = tree->page_size;
    for (int64_t g = 0; g < tree->groups; g++)
        if (tree->windows[g] == 0)
            for (int64_t k = 0; k < longest; k++)
                if (!cached_at(tree, path, found, k, g)) {
                    longest = k;
                    break;
                }
    for (int64_t n = longest; n > 0; n--) {
        int valid = 1;
        for (int64_t g = 0; valid && g < tree->groups; g++)
            if (tree->windows[g] != 0)
                for (int64_t k = first_used(tree, n * p, g); valid && k < n; k++) valid = cached_at(tree, path, found, k, g);
        if (valid) return n;
    }
    return 0;
}

/* the handle's arrays for a match of n pages along path; stamps the used pages when stamp >= 0 */
static void describe(hybrid_tree *tree, const int64_t *path, int64_t found, int64_t n, int64_t stamp,
                     int64_t *nodes, int64_t *versions, int64_t *gens) {
    for (int64_t k = 0; k < n; k++) {
        nodes[k] = k < found ? path[k] : NONE;
        versions[k] = k < found ? tree->version[path[k]] : 0;
    }
    for (int64_t g = 0; g < tree->groups; g++) {
        int64_t first = first_used(tree, n * tree->page_size, g);
        for (int64_t k = 0; k < n; k++) {
            if (k < first) {
                gens[g * n + k] = NONE;
                continue;
            }
            value_t *v = value(tree, path[k], g);
            gens[g * n + k] = v->gen;
            if (stamp >= 0 && v->stamp != stamp) {
                v->stamp = stamp;
                offer(tree, path[k], g);
            }
        }
    }
}

/* drop the heap's dead entries (pages evicted, restamped, locked or no longer leaves) once they outnumber
 * the live ones, so that the heap stays as big as the cache, not as long as the history */
static void compact(hybrid_tree *tree, int64_t group) {
    heap_t *heap = &tree->heaps[group];
    if (heap->length <= 4 * tree->cached[group] + 64) return;
    int64_t kept = 0;
    for (int64_t i = 0; i < heap->length; i++)
        if (entry_is_live(tree, &heap->items[i], group)) heap->items[kept++] = heap->items[i];
    heap->length = 0;
    for (int64_t i = 0; i < kept; i++) heap_push(heap, heap->items[i]);
}

static int reserve_heaps(hybrid_tree *tree, int64_t more) {
    for (int64_t g = 0; g < tree->groups; g++) {
        compact(tree, g);
        if (heap_reserve(&tree->heaps[g], more) != HYBRID_OK) return HYBRID_NO_MEMORY;
    }
    return HYBRID_OK;
}

int hybrid_match(hybrid_tree *tree, int64_t root, const int64_t *tokens, int64_t pages, int64_t stamp,
                 int64_t *nodes, int64_t *versions, int64_t *gens, hybrid_walk *out) {
    if (root < 0 || root >= tree->high || !tree->alive[root] || tree->parent[root] != NONE || pages < 0)
        return HYBRID_BAD_ARGS;
    if (reserve_heaps(tree, pages) != HYBRID_OK) return HYBRID_NO_MEMORY;
    /* nodes doubles as the walk's path: describe reads path[k] before it writes nodes[k] */
    int64_t found = walk(tree, root, tokens, pages, nodes);
    int64_t n = match_pages(tree, nodes, found, pages);
    describe(tree, nodes, found, n, stamp, nodes, versions, gens);
    out->length = n * tree->page_size;
    return HYBRID_OK;
}

/* ---------------------------------------------------------------- inserting */

int hybrid_insert(hybrid_tree *tree, int64_t root, const int64_t *tokens, int64_t pages, const int64_t *starts,
                  int64_t stamp, int64_t *unused, int64_t *nodes, int64_t *versions, int64_t *gens,
                  hybrid_walk *out) {
    int64_t g_count = tree->groups, p = tree->page_size;
    if (root < 0 || root >= tree->high || !tree->alive[root] || tree->parent[root] != NONE || pages < 0)
        return HYBRID_BAD_ARGS;
    /* CHECK: memory first, then the pages, group by group */
    if (reserve_nodes(tree, pages) != HYBRID_OK || table_reserve(tree, pages) != HYBRID_OK ||
        reserve_heaps(tree, 2 * pages + 1) != HYBRID_OK)
        return HYBRID_NO_MEMORY;
    for (int64_t g = 0; g < g_count; g++)
        if (set_reserve(&tree->starts[g], pages) != HYBRID_OK) return HYBRID_NO_MEMORY;
    int64_t found = walk(tree, root, tokens, pages, nodes);
    for (int64_t g = 0; g < g_count; g++) {
        for (int64_t k = 0; k < pages; k++) {
            int64_t start = starts[g * pages + k];
            if (cached_at(tree, nodes, found, k, g)) continue;
            out->bad = k;
            out->bad_group = g;
            if (start == NONE) {
                if (tree->windows[g] == 0) return HYBRID_MISSING;
                continue;
            }
            if (start < 0) return HYBRID_BAD_ARGS;
            if (start % p) return HYBRID_MISALIGNED;
            if (set_find(&tree->starts[g], start) != NONE) return HYBRID_DUPLICATE;
            /* given twice in this call: an earlier new page of the group took it */
            for (int64_t j = 0; j < k; j++)
                if (starts[g * pages + j] == start && !cached_at(tree, nodes, found, j, g)) return HYBRID_DUPLICATE;
        }
    }
    out->bad = out->bad_group = NONE;
    /* UPDATE: the missing nodes, then every group's values */
    int64_t node = found ? nodes[found - 1] : root;
    for (int64_t k = found; k < pages; k++) nodes[k] = node = new_node(tree, node, &tokens[k * p]);
    for (int64_t g = 0; g < g_count; g++) {
        for (int64_t k = 0; k < pages; k++) {
            int64_t start = starts[g * pages + k];
            value_t *v = value(tree, nodes[k], g);
            unused[g * pages + k] = NONE;
            if (v->slot != NONE) {
                if (start != NONE && start != v->slot) unused[g * pages + k] = start;
            } else if (start != NONE) {
                *v = (value_t){start, stamp, 0, stamp};
                set_add(&tree->starts[g], start);
                tree->cached[g]++;
                int64_t parent = tree->parent[nodes[k]];
                tree->group_children[parent * g_count + g]++;
            }
        }
    }
    /* stamp every page the groups cache along the path (after the counts, so leaves are known) */
    for (int64_t g = 0; g < g_count; g++)
        for (int64_t k = 0; k < pages; k++) {
            value_t *v = value(tree, nodes[k], g);
            if (v->slot != NONE) {
                v->stamp = stamp;
                offer(tree, nodes[k], g);
            }
        }
    if (pages) prune(tree, nodes[pages - 1]);
    found = walk(tree, root, tokens, pages, nodes);
    int64_t n = match_pages(tree, nodes, found, pages);
    describe(tree, nodes, found, n, -1, nodes, versions, gens);
    out->length = n * p;
    return HYBRID_OK;
}

/* ---------------------------------------------------------------- handles */

int hybrid_handle(hybrid_tree *tree, int op, const int64_t *nodes, const int64_t *versions, const int64_t *gens,
                  int64_t room, int64_t length, int64_t *slots) {
    /* CHECK: the arrays hold the handle's pages, then every page the match uses is the one it used */
    if (length < 0 || length % tree->page_size || length / tree->page_size > room) return HYBRID_BAD_ARGS;
    int64_t n = length / tree->page_size;
    for (int64_t g = 0; g < tree->groups; g++)
        for (int64_t k = first_used(tree, length, g); k < n; k++) {
            int64_t node = nodes[k];
            if (node < 0 || node >= tree->high || !tree->alive[node] || tree->version[node] != versions[k])
                return HYBRID_STALE;
            const value_t *v = value(tree, node, g);
            if (v->slot == NONE || v->gen != gens[g * n + k]) return HYBRID_STALE;
        }
    if (op == HYBRID_UNLOCK) {
        for (int64_t g = 0; g < tree->groups; g++)
            for (int64_t k = first_used(tree, length, g); k < n; k++)
                if (value(tree, nodes[k], g)->refs < 1) return HYBRID_NOT_LOCKED;
        if (reserve_heaps(tree, n) != HYBRID_OK) return HYBRID_NO_MEMORY;
    }
    /* UPDATE */
    for (int64_t g = 0; g < tree->groups; g++) {
        int64_t first = first_used(tree, length, g);
        for (int64_t k = 0; k < n; k++) {
            if (op == HYBRID_MATCHED) slots[g * n + k] = k < first ? NONE : value(tree, nodes[k], g)->slot;
            if (k < first) continue;
            value_t *v = value(tree, nodes[k], g);
            if (op == HYBRID_LOCK && v->refs++ == 0) tree->locked[g]++;
            if (op == HYBRID_UNLOCK && --v->refs == 0) {
                tree->locked[g]--;
                offer(tree, nodes[k], g);
            }
        }
    }
    return HYBRID_OK;
}

/* ---------------------------------------------------------------- evicting */

int hybrid_evict(hybrid_tree *tree, int64_t group, int64_t pages, int64_t *out) {
    if (group < 0 || group >= tree->groups || pages < 0) return HYBRID_BAD_ARGS;
    if (pages > tree->cached[group] - tree->locked[group]) return HYBRID_NOT_EVICTABLE;
    /* a page evicted may make its parent a leaf of a full group: one push per page */
    compact(tree, group);
    if (heap_reserve(&tree->heaps[group], pages) != HYBRID_OK) return HYBRID_NO_MEMORY;
    heap_t *heap = &tree->heaps[group];
    for (int64_t i = 0; i < pages; i++) {
        entry_t e;
        do {
            if (heap->length == 0) return HYBRID_CORRUPT; /* an evictable page was never queued */
            e = heap_pop(heap);
        } while (!entry_is_live(tree, &e, group));
        value_t *v = value(tree, e.node, group);
        out[i] = v->slot;
        set_remove(&tree->starts[group], v->slot);
        *v = (value_t){NONE, 0, 0, 0};
        tree->cached[group]--;
        int64_t parent = tree->parent[e.node];
        tree->group_children[parent * tree->groups + group]--;
        if (tree->parent[parent] != NONE) offer(tree, parent, group);
        prune(tree, e.node);
    }
    return HYBRID_OK;
}

/* ---------------------------------------------------------------- reading */

void hybrid_counts(const hybrid_tree *tree, int64_t group, int64_t *out) {
    if (group < 0 || group >= tree->groups) { /* no such group: -1 pages, never a read past the counters */
        out[0] = out[1] = -1;
        out[2] = tree->nodes;
        return;
    }
    out[0] = tree->cached[group] - tree->locked[group];
    out[1] = tree->locked[group];
    out[2] = tree->nodes;
}

int64_t hybrid_export(const hybrid_tree *tree, int64_t *parent, int64_t *tokens, int64_t *values, int64_t capacity) {
    int64_t count = 0;
    for (int64_t node = 0; node < tree->high; node++) count += tree->alive[node] && tree->parent[node] != NONE;
    if (count > capacity) return -count;
    /* parents first: nodes in order of depth; index[node] is its place in the export */
    int64_t *index = malloc((size_t)(tree->high ? tree->high : 1) * sizeof *index);
    if (index == NULL) return -count;
    int64_t i = 0, g_count = tree->groups, p = tree->page_size;
    for (int64_t depth = 1; i < count; depth++)
        for (int64_t node = 0; node < tree->high; node++) {
            if (!tree->alive[node] || tree->depth[node] != depth) continue;
            int64_t up = tree->parent[node];
            parent[i] = tree->parent[up] == NONE ? -1 - up : index[up];
            memcpy(&tokens[i * p], &tree->tokens[node * p], (size_t)p * sizeof *tokens);
            for (int64_t g = 0; g < g_count; g++) {
                const value_t *v = value(tree, node, g);
                int64_t *row = &values[(i * g_count + g) * 4];
                row[0] = v->slot;
                row[1] = v->stamp;
                row[2] = v->refs;
                row[3] = v->gen;
            }
            index[node] = i++;
        }
    free(index);
    return count;
}

#define FAIL(...)                                    \
    do {                                             \
        snprintf(message, (size_t)capacity, __VA_ARGS__); \
        free(kids);                                  \
        return HYBRID_CORRUPT;                       \
    } while (0)

int hybrid_check(const hybrid_tree *tree, char *message, int64_t capacity) {
    int64_t g_count = tree->groups;
    /* per node: its children, and per group those with a value; then a flag per node for the heap check */
    int64_t *kids = calloc((size_t)(tree->high + 1) * (size_t)(g_count + 2), sizeof *kids);
    if (kids == NULL) {
        snprintf(message, (size_t)capacity, "out of memory");
        return HYBRID_NO_MEMORY;
    }
    int64_t nodes = 0;
    for (int64_t node = 0; node < tree->high; node++) {
        if (!tree->alive[node]) continue;
        nodes++;
        int64_t up = tree->parent[node];
        if (up == NONE) continue;
        if (up < 0 || up >= tree->high || !tree->alive[up]) FAIL("parent_is_alive: node %lld", (long long)node);
        if (tree->depth[node] != tree->depth[up] + 1) FAIL("depths_count_pages: node %lld", (long long)node);
        if (table_find(tree, up, &tree->tokens[node * tree->page_size]) != node)
            FAIL("children_table_finds_every_node: node %lld", (long long)node);
        kids[up * (g_count + 1)]++;
        int holds = 0;
        for (int64_t g = 0; g < g_count; g++)
            if (value(tree, node, g)->slot != NONE) {
                kids[up * (g_count + 1) + 1 + g]++;
                holds = 1;
            }
        if (!holds && tree->children[node] == 0) FAIL("tree_has_no_empty_leaves: node %lld", (long long)node);
    }
    if (nodes != tree->nodes) FAIL("node_count: %lld alive, %lld counted", (long long)nodes, (long long)tree->nodes);
    for (int64_t g = 0; g < g_count; g++) {
        int64_t cached = 0, locked = 0;
        for (int64_t node = 0; node < tree->high; node++) {
            if (!tree->alive[node]) continue;
            if (kids[node * (g_count + 1)] != tree->children[node])
                FAIL("child_counts_match: node %lld", (long long)node);
            if (kids[node * (g_count + 1) + 1 + g] != tree->group_children[node * g_count + g])
                FAIL("group_child_counts_match: node %lld group %lld", (long long)node, (long long)g);
            const value_t *v = value(tree, node, g);
            if (v->slot == NONE) continue;
            cached++;
            locked += v->refs > 0;
            if (v->refs < 0) FAIL("refs_are_not_negative: node %lld group %lld", (long long)node, (long long)g);
            if (set_find(&tree->starts[g], v->slot) == NONE)
                FAIL("start_sets_match_the_tree: group %lld lacks %lld", (long long)g, (long long)v->slot);
        }
        if (cached != tree->cached[g] || locked != tree->locked[g] || cached != tree->starts[g].count)
            FAIL("group_counts_match: group %lld caches %lld (counted %lld, set %lld), locks %lld (counted %lld)",
                 (long long)g, (long long)cached, (long long)tree->cached[g], (long long)tree->starts[g].count,
                 (long long)locked, (long long)tree->locked[g]);
        /* every evictable page waits in the heap with its current stamp */
        int64_t *queued = &kids[(tree->high + 1) * (g_count + 1)];
        memset(queued, 0, (size_t)(tree->high + 1) * sizeof *queued);
        const heap_t *heap = &tree->heaps[g];
        for (int64_t i = 0; i < heap->length; i++)
            if (entry_is_live(tree, &heap->items[i], g)) queued[heap->items[i].node] = 1;
        for (int64_t node = 0; node < tree->high; node++) {
            if (!tree->alive[node] || tree->parent[node] == NONE || !is_evictable(tree, node, g)) continue;
            if (!queued[node]) FAIL("evictable_pages_are_queued: node %lld group %lld", (long long)node, (long long)g);
        }
    }
    free(kids);
    return HYBRID_OK;
}
