/* The radix tree of the optimized prefix cache (declarations and the big picture: csrc/tree.h).
 *
 * Twin of reference/radix_cache.py, same operations and the same rules: a walk stamps every
 * node it passes and splits the node a match ends in (the original node keeps the suffix, so
 * handles on it stay valid); eviction takes exactly the asked pages, least recently used leaf
 * page first, splitting a node when only its last pages go. Nodes are indices into one array
 * (re-read after anything that may grow it); no Python object exists per node. */
#include "tree.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "radix.h"

#define NONE (-1)

/* ---------------------------------------------------------------- memory

Every block of this file is allocated and freed through these, so that the blocks still live are counted
(radix_tree_live_blocks): a tree freed, or a call returned, leaves none behind, and a test can see a leak. */

static int64_t live_blocks;

static void *counted(void *block) {
    if (block != NULL) {
        __atomic_add_fetch(&live_blocks, 1, __ATOMIC_RELAXED);
    }
    return block;
}

static void *block_malloc(size_t bytes) {
    return counted(malloc(bytes));
}

static void *block_calloc(size_t count, size_t size) {
    return counted(calloc(count, size));
}

/* a new block when old is NULL; else the same block, moved (or NULL, old untouched) */
static void *block_realloc(void *old, size_t bytes) {
    void *grown = realloc(old, bytes);
    return old == NULL ? counted(grown) : grown;
}

static void block_free(void *block) {
    if (block != NULL) {
        __atomic_sub_fetch(&live_blocks, 1, __ATOMIC_RELAXED);
    }
    free(block);
}

int64_t radix_tree_live_blocks(void) {
    return __atomic_load_n(&live_blocks, __ATOMIC_RELAXED);
}

typedef struct segment {
    /* nodes holding a slice of this segment */
    int64_t refs;
    int64_t length;
    int64_t *tokens;
    int32_t *slots;
} segment;

typedef struct {
    segment *seg;
    /* the node's tokens and slots: seg[offset, offset + length) */
    int64_t offset;
    int64_t length;
    int64_t parent;
    int64_t first_child;
    int64_t next_sibling;
    int64_t prev_sibling;
    int64_t child_count;
    int64_t timestamp;
    int64_t generation;
    /* locks on paths through this node, and the sum of its children's */
    int64_t ref_count;
    int64_t child_refs;
    /* bumped when the node is freed: (id, version) names one node's life */
    int64_t version;
    /* stamp of this node's live entry in the leaf queues, or NONE */
    int64_t queue_stamp;
    int32_t alive;
    int32_t is_root;
} node_t;

/* the children table: (parent, first page of the child) -> child; child == NONE marks an empty cell */
typedef struct {
    uint64_t hash;
    int64_t parent;
    int64_t child;
} child_cell;

/* an evictable leaf waiting in a queue */
typedef struct {
    int64_t stamp;
    int64_t node;
    int64_t version;
} leaf_entry;

struct radix_tree {
    int64_t page_size;
    node_t *nodes;
    int64_t nodes_capacity;
    int64_t nodes_high;
    int64_t free_head;
    child_cell *children;
    int64_t children_capacity;
    int64_t children_count;
    /* first slot of every cached page; NONE marks an empty cell */
    int64_t *starts;
    int64_t starts_capacity;
    int64_t starts_count;
    /* leaves pushed in stamp order (a ring) and the others (a min-heap) */
    leaf_entry *fifo;
    int64_t fifo_capacity;
    int64_t fifo_head;
    int64_t fifo_length;
    int64_t fifo_last;
    leaf_entry *heap;
    int64_t heap_capacity;
    int64_t heap_length;
    /* counters */
    int64_t evictable;
    int64_t protected_;
    int64_t node_count;
    int64_t page_count;
    int64_t root_count;
    int64_t segment_bytes;
    /* metrics: the sum of the last-access stamps of every page evicted so far (eviction ages) */
    int64_t evicted_stamp_sum;
    /* the caller's int32 token ids widened, or its int64 slots narrowed, for one call (grown, never shrunk) */
    int64_t *wide_tokens;
    int64_t wide_tokens_capacity;
    int32_t *narrow_slots;
    int64_t narrow_slots_capacity;
};

#define N(i) (tree->nodes[(i)])

static uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    x = (x ^ (x >> 27)) * UINT64_C(0x94D049BB133111EB);
    return x ^ (x >> 31);
}

static const int64_t *node_tokens(const radix_tree *tree, int64_t id) {
    return N(id).seg->tokens + N(id).offset;
}

static const int32_t *node_slots(const radix_tree *tree, int64_t id) {
    return N(id).seg->slots + N(id).offset;
}

static int node_is_live(const radix_tree *tree, int64_t id, int64_t version) {
    return id >= 0 && id < tree->nodes_high && N(id).alive && N(id).version == version;
}

/* ---------------------------------------------------------------- nodes and segments */

static int64_t node_alloc(radix_tree *tree) {
    if (tree->free_head == NONE) {
        if (tree->nodes_high == tree->nodes_capacity) {
            int64_t capacity = tree->nodes_capacity * 2;
            node_t *grown = block_realloc(tree->nodes, (size_t)capacity * sizeof *grown);
            if (grown == NULL) {
                return NONE;
            }
            tree->nodes = grown;
            tree->nodes_capacity = capacity;
        }
        int64_t id = tree->nodes_high++;
        N(id).version = 0;
        N(id).alive = 0;
        tree->free_head = id;
        N(id).next_sibling = NONE;
    }
    int64_t id = tree->free_head;
    tree->free_head = N(id).next_sibling;
    int64_t version = N(id).version;
    memset(&N(id), 0, sizeof(node_t));
    N(id).version = version;
    N(id).alive = 1;
    N(id).parent = N(id).first_child = N(id).next_sibling = N(id).prev_sibling = NONE;
    N(id).queue_stamp = NONE;
    return id;
}

/* Bytes of a segment of length tokens: its header, then its tokens and slots in the same block. */
static int64_t segment_size(int64_t length) {
    return (int64_t)sizeof(segment) + length * (int64_t)(sizeof(int64_t) + sizeof(int32_t));
}

static void segment_free(radix_tree *tree, segment *seg) {
    tree->segment_bytes -= segment_size(seg->length);
    block_free(seg);
}

static void segment_release(radix_tree *tree, segment *seg) {
    if (seg != NULL && --seg->refs == 0) {
        segment_free(tree, seg);
    }
}

static void node_free(radix_tree *tree, int64_t id) {
    segment_release(tree, N(id).seg);
    N(id).seg = NULL;
    N(id).alive = 0;
    N(id).version++;
    N(id).next_sibling = tree->free_head;
    tree->free_head = id;
}

static segment *segment_new(radix_tree *tree, const int64_t *tokens, const int32_t *slots, int64_t length) {
    segment *seg = block_malloc((size_t)segment_size(length));
    if (seg == NULL) {
        return NULL;
    }
    seg->refs = 0;
    seg->length = length;
    seg->tokens = (int64_t *)(seg + 1);
    seg->slots = (int32_t *)(seg->tokens + length);
    memcpy(seg->tokens, tokens, (size_t)length * sizeof(int64_t));
    memcpy(seg->slots, slots, (size_t)length * sizeof(int32_t));
    tree->segment_bytes += segment_size(length);
    return seg;
}

/* ---------------------------------------------------------------- the children table */

static uint64_t page_hash(int64_t parent, const int64_t *page, int64_t page_size) {
    uint64_t h = mix64((uint64_t)parent ^ UINT64_C(0x9E3779B97F4A7C15));
    for (int64_t k = 0; k < page_size; ++k) {
        h = mix64(h ^ (uint64_t)page[k]);
    }
    return h;
}

/* The cell of parent's child starting with page, or NONE. */
static int64_t child_cell_of(const radix_tree *tree, int64_t parent, const int64_t *page, uint64_t hash) {
    uint64_t mask = (uint64_t)tree->children_capacity - 1;
    for (uint64_t i = hash & mask;; i = (i + 1) & mask) {
        const child_cell *cell = &tree->children[i];
        if (cell->child == NONE) {
            return NONE;
        }
        if (cell->hash == hash && cell->parent == parent &&
            memcmp(node_tokens(tree, cell->child), page, (size_t)tree->page_size * sizeof(int64_t)) == 0) {
            return (int64_t)i;
        }
    }
}

static int64_t child_of(const radix_tree *tree, int64_t parent, const int64_t *page) {
    int64_t cell = child_cell_of(tree, parent, page, page_hash(parent, page, tree->page_size));
    return cell == NONE ? NONE : tree->children[cell].child;
}

static void child_place(child_cell *cells, int64_t capacity, child_cell cell) {
    uint64_t mask = (uint64_t)capacity - 1;
    uint64_t i = cell.hash & mask;
    while (cells[i].child != NONE) {
        i = (i + 1) & mask;
    }
    cells[i] = cell;
}

static int children_grow(radix_tree *tree) {
    int64_t capacity = tree->children_capacity * 2;
    child_cell *cells = block_malloc((size_t)capacity * sizeof *cells);
    if (cells == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    for (int64_t i = 0; i < capacity; ++i) {
        cells[i].child = NONE;
    }
    for (int64_t i = 0; i < tree->children_capacity; ++i) {
        if (tree->children[i].child != NONE) {
            child_place(cells, capacity, tree->children[i]);
        }
    }
    block_free(tree->children);
    tree->children = cells;
    tree->children_capacity = capacity;
    return RADIX_TREE_OK;
}

/* Room for extra more children without growing. */
static int children_reserve(radix_tree *tree, int64_t extra) {
    while ((tree->children_count + extra) * 2 > tree->children_capacity) {
        int status = children_grow(tree);
        if (status != RADIX_TREE_OK) {
            return status;
        }
    }
    return RADIX_TREE_OK;
}

/* Add a child (room reserved by the caller). */
static void child_add(radix_tree *tree, int64_t parent, int64_t child) {
    child_cell cell = {page_hash(parent, node_tokens(tree, child), tree->page_size), parent, child};
    child_place(tree->children, tree->children_capacity, cell);
    tree->children_count++;
}

/* Remove cell i, shifting back the cells of its probe run (no tombstones). */
static void child_remove_cell(radix_tree *tree, int64_t i) {
    uint64_t mask = (uint64_t)tree->children_capacity - 1;
    uint64_t hole = (uint64_t)i;
    for (uint64_t j = (hole + 1) & mask; tree->children[j].child != NONE; j = (j + 1) & mask) {
        uint64_t home = tree->children[j].hash & mask;
        /* the cell at j may move into the hole unless its home lies cyclically in (hole, j] */
        int stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!stays) {
            tree->children[hole] = tree->children[j];
            hole = j;
        }
    }
    tree->children[hole].child = NONE;
    tree->children_count--;
}

/* ---------------------------------------------------------------- the set of cached page starts */

static int64_t start_cell(const radix_tree *tree, int64_t start) {
    uint64_t mask = (uint64_t)tree->starts_capacity - 1;
    for (uint64_t i = mix64((uint64_t)start) & mask;; i = (i + 1) & mask) {
        if (tree->starts[i] == start || tree->starts[i] == NONE) {
            return (int64_t)i;
        }
    }
}

static int starts_contains(const radix_tree *tree, int64_t start) {
    return tree->starts[start_cell(tree, start)] == start;
}

/* Room for extra more page starts without growing. */
static int starts_reserve(radix_tree *tree, int64_t extra) {
    int64_t capacity = tree->starts_capacity;
    while ((tree->starts_count + extra) * 2 > capacity) {
        capacity *= 2;
    }
    if (capacity == tree->starts_capacity) {
        return RADIX_TREE_OK;
    }
    int64_t *cells = block_malloc((size_t)capacity * sizeof *cells);
    if (cells == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    int64_t *old = tree->starts;
    int64_t old_capacity = tree->starts_capacity;
    for (int64_t i = 0; i < capacity; ++i) {
        cells[i] = NONE;
    }
    tree->starts = cells;
    tree->starts_capacity = capacity;
    for (int64_t i = 0; i < old_capacity; ++i) {
        if (old[i] != NONE) {
            tree->starts[start_cell(tree, old[i])] = old[i];
        }
    }
    block_free(old);
    return RADIX_TREE_OK;
}

/* Add a start (room reserved by the caller). */
static void starts_add(radix_tree *tree, int64_t start) {
    tree->starts[start_cell(tree, start)] = start;
    tree->starts_count++;
}

static void starts_remove(radix_tree *tree, int64_t start) {
    uint64_t mask = (uint64_t)tree->starts_capacity - 1;
    uint64_t hole = (uint64_t)start_cell(tree, start);
    if (tree->starts[hole] != start) {
        return;
    }
    for (uint64_t j = (hole + 1) & mask; tree->starts[j] != NONE; j = (j + 1) & mask) {
        uint64_t home = mix64((uint64_t)tree->starts[j]) & mask;
        int stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!stays) {
            tree->starts[hole] = tree->starts[j];
            hole = j;
        }
    }
    tree->starts[hole] = NONE;
    tree->starts_count--;
}

/* ---------------------------------------------------------------- the evictable leaves */

static int entry_before(leaf_entry a, leaf_entry b) {
    return a.stamp < b.stamp || (a.stamp == b.stamp && a.node < b.node);
}

static int heap_grow(radix_tree *tree) {
    int64_t capacity = tree->heap_capacity * 2;
    leaf_entry *grown = block_realloc(tree->heap, (size_t)capacity * sizeof *grown);
    if (grown == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    tree->heap = grown;
    tree->heap_capacity = capacity;
    return RADIX_TREE_OK;
}

static int heap_push(radix_tree *tree, leaf_entry entry) {
    if (tree->heap_length == tree->heap_capacity && heap_grow(tree) != RADIX_TREE_OK) {
        return RADIX_TREE_NO_MEMORY;
    }
    int64_t i = tree->heap_length++;
    while (i > 0 && entry_before(entry, tree->heap[(i - 1) / 2])) {
        tree->heap[i] = tree->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    tree->heap[i] = entry;
    return RADIX_TREE_OK;
}

static leaf_entry heap_pop(radix_tree *tree) {
    leaf_entry top = tree->heap[0];
    leaf_entry last = tree->heap[--tree->heap_length];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= tree->heap_length) {
            break;
        }
        if (child + 1 < tree->heap_length && entry_before(tree->heap[child + 1], tree->heap[child])) {
            child++;
        }
        if (!entry_before(tree->heap[child], last)) {
            break;
        }
        tree->heap[i] = tree->heap[child];
        i = child;
    }
    if (tree->heap_length > 0) {
        tree->heap[i] = last;
    }
    return top;
}

static int fifo_grow(radix_tree *tree) {
    int64_t capacity = tree->fifo_capacity * 2;
    leaf_entry *grown = block_malloc((size_t)capacity * sizeof *grown);
    if (grown == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    for (int64_t k = 0; k < tree->fifo_length; ++k) {
        grown[k] = tree->fifo[(tree->fifo_head + k) % tree->fifo_capacity];
    }
    block_free(tree->fifo);
    tree->fifo = grown;
    tree->fifo_capacity = capacity;
    tree->fifo_head = 0;
    return RADIX_TREE_OK;
}

static int fifo_push(radix_tree *tree, leaf_entry entry) {
    if (tree->fifo_length == tree->fifo_capacity && fifo_grow(tree) != RADIX_TREE_OK) {
        return RADIX_TREE_NO_MEMORY;
    }
    tree->fifo[(tree->fifo_head + tree->fifo_length++) % tree->fifo_capacity] = entry;
    tree->fifo_last = entry.stamp;
    return RADIX_TREE_OK;
}

static int is_evictable_leaf(const radix_tree *tree, int64_t id) {
    return !N(id).is_root && N(id).ref_count == 0 && N(id).child_count == 0;
}

static int queue_rebuild(radix_tree *tree);

/* Give an evictable leaf an entry at its stamp (once per stamp). */
static int queue_push(radix_tree *tree, int64_t id) {
    if (N(id).queue_stamp == N(id).timestamp) {
        return RADIX_TREE_OK;
    }
    N(id).queue_stamp = N(id).timestamp;
    leaf_entry entry = {N(id).timestamp, id, N(id).version};
    int status = (tree->fifo_length == 0 || entry.stamp > tree->fifo_last) ? fifo_push(tree, entry)
                                                                             : heap_push(tree, entry);
    if (status == RADIX_TREE_OK && tree->fifo_length + tree->heap_length > 2 * tree->node_count + 64) {
        status = queue_rebuild(tree);
    }
    return status;
}

static int compare_entries(const void *a, const void *b) {
    const leaf_entry *x = a, *y = b;
    return entry_before(*x, *y) ? -1 : entry_before(*y, *x) ? 1 : 0;
}

/* Drop the stale entries: every evictable leaf once, in stamp order, in the FIFO. O(n log n), amortized. */
static int queue_rebuild(radix_tree *tree) {
    int64_t count = 0;
    for (int64_t id = 0; id < tree->nodes_high; ++id) {
        count += N(id).alive && is_evictable_leaf(tree, id);
    }
    /* the FIFO takes them all: it is at least as long as the live entries it held */
    leaf_entry *entries = block_malloc((size_t)(count > 0 ? count : 1) * sizeof *entries);
    if (entries == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    int64_t k = 0;
    for (int64_t id = 0; id < tree->nodes_high; ++id) {
        if (!N(id).alive) {
            continue;
        }
        N(id).queue_stamp = NONE;
        if (is_evictable_leaf(tree, id)) {
            entries[k++] = (leaf_entry){N(id).timestamp, id, N(id).version};
            N(id).queue_stamp = N(id).timestamp;
        }
    }
    qsort(entries, (size_t)count, sizeof *entries, compare_entries);
    tree->fifo_head = tree->fifo_length = tree->heap_length = 0;
    int status = RADIX_TREE_OK;
    for (k = 0; k < count && status == RADIX_TREE_OK; ++k) {
        status = fifo_push(tree, entries[k]);
    }
    block_free(entries);
    return status;
}

/* The evictable leaf with the oldest stamp, or NONE; skips entries that no longer name one. */
static int64_t queue_pop(radix_tree *tree) {
    while (tree->fifo_length > 0 || tree->heap_length > 0) {
        leaf_entry entry;
        if (tree->heap_length > 0 &&
            (tree->fifo_length == 0 || entry_before(tree->heap[0], tree->fifo[tree->fifo_head]))) {
            entry = heap_pop(tree);
        } else {
            entry = tree->fifo[tree->fifo_head];
            tree->fifo_head = (tree->fifo_head + 1) % tree->fifo_capacity;
            tree->fifo_length--;
        }
        if (!node_is_live(tree, entry.node, entry.version) || N(entry.node).queue_stamp != entry.stamp) {
            continue; /* freed, or re-stamped since: a newer entry stands for it */
        }
        N(entry.node).queue_stamp = NONE;
        if (is_evictable_leaf(tree, entry.node) && N(entry.node).timestamp == entry.stamp) {
            return entry.node;
        }
        /* locked or extended since: queue_push gives it a new entry when it is a leaf again */
    }
    return NONE;
}

/* Room for nodes more nodes, as many children entries and pages more page starts, and one more queue
 * entry: after it, an insert or a split cannot fail half way. */
static int reserve(radix_tree *tree, int64_t nodes, int64_t pages) {
    if (tree->nodes_high + nodes > tree->nodes_capacity) {
        int64_t capacity = tree->nodes_capacity;
        while (tree->nodes_high + nodes > capacity) {
            capacity *= 2;
        }
        node_t *grown = block_realloc(tree->nodes, (size_t)capacity * sizeof *grown);
        if (grown == NULL) {
            return RADIX_TREE_NO_MEMORY;
        }
        tree->nodes = grown;
        tree->nodes_capacity = capacity;
    }
    int status = children_reserve(tree, nodes);
    if (status == RADIX_TREE_OK) {
        status = starts_reserve(tree, pages);
    }
    if (status == RADIX_TREE_OK && tree->fifo_length == tree->fifo_capacity) {
        status = fifo_grow(tree);
    }
    if (status == RADIX_TREE_OK && tree->heap_length == tree->heap_capacity) {
        status = heap_grow(tree);
    }
    return status;
}

/* ---------------------------------------------------------------- tree structure */

static void sibling_link(radix_tree *tree, int64_t parent, int64_t child) {
    N(child).parent = parent;
    N(child).prev_sibling = NONE;
    N(child).next_sibling = N(parent).first_child;
    if (N(parent).first_child != NONE) {
        N(N(parent).first_child).prev_sibling = child;
    }
    N(parent).first_child = child;
    N(parent).child_count++;
}

static void sibling_unlink(radix_tree *tree, int64_t child) {
    int64_t parent = N(child).parent;
    if (N(child).prev_sibling != NONE) {
        N(N(child).prev_sibling).next_sibling = N(child).next_sibling;
    } else {
        N(parent).first_child = N(child).next_sibling;
    }
    if (N(child).next_sibling != NONE) {
        N(N(child).next_sibling).prev_sibling = N(child).prev_sibling;
    }
    N(parent).child_count--;
    N(child).prev_sibling = N(child).next_sibling = NONE;
}

/* Split off the node's first pos tokens into a new parent; the node keeps the suffix (and its
 * identity). Returns the new node, or NONE when out of memory (nothing changed then). */
static int64_t split_at(radix_tree *tree, int64_t id, int64_t pos) {
    if (reserve(tree, 1, 0) != RADIX_TREE_OK) {
        return NONE;
    }
    int64_t prefix = node_alloc(tree);
    if (prefix == NONE) {
        return NONE;
    }
    int64_t parent = N(id).parent;
    N(prefix).seg = N(id).seg;
    N(prefix).seg->refs++;
    N(prefix).offset = N(id).offset;
    N(prefix).length = pos;
    N(prefix).timestamp = N(id).timestamp;
    N(prefix).generation = N(id).generation;
    /* every lock through the suffix covers the prefix */
    N(prefix).ref_count = N(id).ref_count;
    N(prefix).child_refs = N(id).ref_count;
    /* the parent's entry for this first page now leads to the prefix */
    int64_t cell = child_cell_of(tree, parent, node_tokens(tree, id), page_hash(parent, node_tokens(tree, id), tree->page_size));
    tree->children[cell].child = prefix;
    /* the prefix takes the node's place among its siblings */
    N(prefix).parent = parent;
    N(prefix).prev_sibling = N(id).prev_sibling;
    N(prefix).next_sibling = N(id).next_sibling;
    if (N(id).prev_sibling != NONE) {
        N(N(id).prev_sibling).next_sibling = prefix;
    } else {
        N(parent).first_child = prefix;
    }
    if (N(id).next_sibling != NONE) {
        N(N(id).next_sibling).prev_sibling = prefix;
    }
    N(id).offset += pos;
    N(id).length -= pos;
    N(id).prev_sibling = N(id).next_sibling = NONE;
    N(id).parent = prefix;
    N(prefix).first_child = id;
    N(prefix).child_count = 1;
    child_add(tree, prefix, id); /* room was made above */
    tree->node_count++;
    return prefix;
}

/* Remove an unlocked leaf; its pages are no longer cached. Returns its parent. */
static int64_t detach(radix_tree *tree, int64_t id) {
    int64_t parent = N(id).parent;
    const int64_t *page = node_tokens(tree, id);
    child_remove_cell(tree, child_cell_of(tree, parent, page, page_hash(parent, page, tree->page_size)));
    sibling_unlink(tree, id);
    for (int64_t k = 0; k < N(id).length; k += tree->page_size) {
        starts_remove(tree, node_slots(tree, id)[k]);
    }
    tree->evictable -= N(id).length;
    tree->page_count -= N(id).length / tree->page_size;
    tree->node_count--;
    node_free(tree, id);
    return parent;
}

/* Common prefix length of the node's tokens and tokens[0..n), rounded down to whole pages. */
static int64_t match_len(const radix_tree *tree, int64_t id, const int64_t *tokens, int64_t n) {
    int64_t limit = N(id).length < n ? N(id).length : n;
    int64_t m = radix_compare_i64(node_tokens(tree, id), tokens, limit);
    return m - m % tree->page_size;
}

/* Walk tokens[0..n) down from root, changing nothing: matched tokens and the last node. */
static int64_t find(const radix_tree *tree, int64_t root, const int64_t *tokens, int64_t n) {
    int64_t pos = 0, node = root;
    while (pos < n) {
        int64_t child = child_of(tree, node, tokens + pos);
        if (child == NONE) {
            break;
        }
        int64_t m = match_len(tree, child, tokens + pos, n - pos);
        pos += m;
        if (m != N(child).length) {
            break;
        }
        node = child;
    }
    return pos;
}

/* Walk and stamp; split the node the match ends in. */
static int walk(radix_tree *tree, int64_t root, const int64_t *tokens, int64_t n, int64_t stamp, int64_t *last,
                int64_t *matched, int queue_last) {
    int64_t pos = 0, node = root;
    while (pos < n) {
        int64_t child = child_of(tree, node, tokens + pos);
        if (child == NONE) {
            break;
        }
        int64_t m = match_len(tree, child, tokens + pos, n - pos);
        pos += m;
        if (m != N(child).length) {
            node = split_at(tree, child, m);
            if (node == NONE) {
                return RADIX_TREE_NO_MEMORY;
            }
            N(node).timestamp = stamp;
            break;
        }
        N(child).timestamp = stamp;
        node = child;
    }
    *last = node;
    *matched = pos;
    /* a leaf stamped again joins the queues at its new stamp (unless an insert is about to extend it) */
    return queue_last && is_evictable_leaf(tree, node) ? queue_push(tree, node) : RADIX_TREE_OK;
}

/* ---------------------------------------------------------------- the API */

radix_tree *radix_tree_new(int64_t page_size) {
    if (page_size < 1) {
        return NULL;
    }
    radix_tree *tree = block_calloc(1, sizeof *tree);
    if (tree == NULL) {
        return NULL;
    }
    tree->page_size = page_size;
    tree->nodes_capacity = tree->children_capacity = tree->starts_capacity = 64;
    tree->fifo_capacity = tree->heap_capacity = 64;
    tree->free_head = NONE;
    tree->nodes = block_malloc((size_t)tree->nodes_capacity * sizeof *tree->nodes);
    tree->children = block_malloc((size_t)tree->children_capacity * sizeof *tree->children);
    tree->starts = block_malloc((size_t)tree->starts_capacity * sizeof *tree->starts);
    tree->fifo = block_malloc((size_t)tree->fifo_capacity * sizeof *tree->fifo);
    tree->heap = block_malloc((size_t)tree->heap_capacity * sizeof *tree->heap);
    if (!tree->nodes || !tree->children || !tree->starts || !tree->fifo || !tree->heap) {
        radix_tree_free(tree);
        return NULL;
    }
    for (int64_t i = 0; i < tree->children_capacity; ++i) {
        tree->children[i].child = NONE;
    }
    for (int64_t i = 0; i < tree->starts_capacity; ++i) {
        tree->starts[i] = NONE;
    }
    return tree;
}

/* a new block holding a copy of bytes of block (a block of one byte for none) */
static void *block_copy(const void *block, size_t bytes) {
    void *copy = block_malloc(bytes > 0 ? bytes : 1);
    if (copy != NULL && bytes > 0) {
        memcpy(copy, block, bytes);
    }
    return copy;
}

/* the copy made of each segment of the original, found by the original's address (open addressing) */
typedef struct {
    const segment *original;
    segment *copy;
} segment_pair;

static segment *segment_copy(radix_tree *copy, segment_pair *pairs, uint64_t mask, const segment *original) {
    uint64_t at = ((uint64_t)(uintptr_t)original >> 4) & mask;
    while (pairs[at].original != NULL && pairs[at].original != original) {
        at = (at + 1) & mask;
    }
    if (pairs[at].original == NULL) {
        segment *seg = segment_new(copy, original->tokens, original->slots, original->length);
        if (seg == NULL) {
            return NULL;
        }
        seg->refs = original->refs;
        pairs[at].original = original;
        pairs[at].copy = seg;
    }
    return pairs[at].copy;
}

radix_tree *radix_tree_clone(const radix_tree *tree) {
    if (tree == NULL) {
        return NULL;
    }
    radix_tree *copy = block_malloc(sizeof *copy);
    if (copy == NULL) {
        return NULL;
    }
    *copy = *tree;
    /* the scratch buffers are the copy's own (empty until a call needs them); segments count as they are made */
    copy->wide_tokens = NULL;
    copy->wide_tokens_capacity = 0;
    copy->narrow_slots = NULL;
    copy->narrow_slots_capacity = 0;
    copy->segment_bytes = 0;
    copy->nodes = block_copy(tree->nodes, (size_t)tree->nodes_capacity * sizeof *tree->nodes);
    copy->children = block_copy(tree->children, (size_t)tree->children_capacity * sizeof *tree->children);
    copy->starts = block_copy(tree->starts, (size_t)tree->starts_capacity * sizeof *tree->starts);
    copy->fifo = block_copy(tree->fifo, (size_t)tree->fifo_capacity * sizeof *tree->fifo);
    copy->heap = block_copy(tree->heap, (size_t)tree->heap_capacity * sizeof *tree->heap);
    if (copy->nodes != NULL) {
        /* until each has its copy, no node of the copy holds a segment (radix_tree_free releases them) */
        for (int64_t id = 0; id < tree->nodes_high; ++id) {
            copy->nodes[id].seg = NULL;
        }
    }
    uint64_t mask = 1;
    while (mask < 2 * (uint64_t)tree->nodes_high + 2) {
        mask <<= 1;
    }
    segment_pair *pairs = block_calloc(mask, sizeof *pairs);
    mask -= 1;
    int ok = copy->nodes && copy->children && copy->starts && copy->fifo && copy->heap && pairs;
    for (int64_t id = 0; ok && id < tree->nodes_high; ++id) {
        const node_t *node = &tree->nodes[id];
        if (node->alive && node->seg != NULL) {
            copy->nodes[id].seg = segment_copy(copy, pairs, mask, node->seg);
            ok = copy->nodes[id].seg != NULL;
        }
    }
    block_free(pairs);
    if (!ok) {
        radix_tree_free(copy);
        return NULL;
    }
    return copy;
}

void radix_tree_free(radix_tree *tree) {
    if (tree == NULL) {
        return;
    }
    if (tree->nodes != NULL) {
        for (int64_t id = 0; id < tree->nodes_high; ++id) {
            if (N(id).alive) {
                segment_release(tree, N(id).seg);
            }
        }
    }
    block_free(tree->nodes);
    block_free(tree->children);
    block_free(tree->starts);
    block_free(tree->fifo);
    block_free(tree->heap);
    block_free(tree->wide_tokens);
    block_free(tree->narrow_slots);
    block_free(tree);
}

int64_t radix_tree_new_root(radix_tree *tree) {
    if (tree == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    int64_t root = node_alloc(tree);
    if (root == NONE) {
        return RADIX_TREE_NO_MEMORY;
    }
    N(root).is_root = 1;
    tree->root_count++;
    return root;
}

int radix_tree_drop_root(radix_tree *tree, int64_t root) {
    if (tree == NULL || root < 0 || root >= tree->nodes_high || !N(root).alive || !N(root).is_root ||
        N(root).child_count != 0) {
        return RADIX_TREE_BAD_ARGS;
    }
    node_free(tree, root);
    tree->root_count--;
    return RADIX_TREE_OK;
}

static int valid_root(const radix_tree *tree, int64_t root) {
    return root >= 0 && root < tree->nodes_high && N(root).alive && N(root).is_root;
}

/* Index of the first negative value of a[0..n), or n. Blocks are OR-ed first (vectorized), searched
 * only when one holds a negative value. */
#define FIRST_NEGATIVE(NAME, TYPE)                                       \
    static int64_t NAME(const TYPE *a, int64_t n) {                      \
        for (int64_t base = 0; base < n; base += 256) {                  \
            int64_t end = base + 256 < n ? base + 256 : n;               \
            TYPE any = 0;                                                \
            for (int64_t i = base; i < end; ++i) {                       \
                any |= a[i];                                             \
            }                                                            \
            if (any < 0) {                                               \
                for (int64_t i = base;; ++i) {                           \
                    if (a[i] < 0) {                                      \
                        return i;                                        \
                    }                                                    \
                }                                                        \
            }                                                            \
        }                                                                \
        return n;                                                        \
    }
FIRST_NEGATIVE(first_negative_i64, int64_t)
FIRST_NEGATIVE(first_negative_i32, int32_t)

/* Room for count items of size bytes in *buffer (capacity *capacity), grown by doubling. */
static int scratch_reserve(void **buffer, int64_t *capacity, int64_t count, size_t size) {
    if (count <= *capacity) {
        return RADIX_TREE_OK;
    }
    int64_t grown = *capacity > 0 ? *capacity : 256;
    while (grown < count) {
        grown *= 2;
    }
    void *bigger = block_realloc(*buffer, (size_t)grown * size);
    if (bigger == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    *buffer = bigger;
    *capacity = grown;
    return RADIX_TREE_OK;
}

/* The caller's tokens[0..count) as int64 (*out): its own buffer when width is 8, else (int32) widened into the
 * tree's scratch buffer. Checked first: RADIX_TREE_BAD_TOKEN with *bad the first negative index. */
static int read_tokens(radix_tree *tree, const void *tokens, int32_t width, int64_t count, const int64_t **out,
                       int64_t *bad) {
    if (width == 8) {
        *bad = first_negative_i64(tokens, count);
        *out = tokens;
        return *bad < count ? RADIX_TREE_BAD_TOKEN : RADIX_TREE_OK;
    }
    *bad = first_negative_i32(tokens, count);
    if (*bad < count) {
        return RADIX_TREE_BAD_TOKEN;
    }
    int status = scratch_reserve((void **)&tree->wide_tokens, &tree->wide_tokens_capacity, count, sizeof(int64_t));
    if (status != RADIX_TREE_OK) {
        return status;
    }
    const int32_t *narrow = tokens;
    for (int64_t i = 0; i < count; ++i) {
        tree->wide_tokens[i] = narrow[i];
    }
    *out = tree->wide_tokens;
    return RADIX_TREE_OK;
}

/* The caller's slots[0..count) as int32 (*out): its own buffer when width is 4, else (int64) narrowed into the
 * tree's scratch buffer. Checked first: RADIX_TREE_BAD_SLOT with *bad the first index outside [0, 2**31). */
static int read_slots(radix_tree *tree, const void *slots, int32_t width, int64_t count, const int32_t **out,
                      int64_t *bad) {
    if (width == 4) {
        *bad = first_negative_i32(slots, count);
        *out = slots;
        return *bad < count ? RADIX_TREE_BAD_SLOT : RADIX_TREE_OK;
    }
    const int64_t *wide = slots;
    for (*bad = 0; *bad < count; ++*bad) {
        if (wide[*bad] < 0 || wide[*bad] > INT32_MAX) {
            return RADIX_TREE_BAD_SLOT;
        }
    }
    int status = scratch_reserve((void **)&tree->narrow_slots, &tree->narrow_slots_capacity, count, sizeof(int32_t));
    if (status != RADIX_TREE_OK) {
        return status;
    }
    for (int64_t i = 0; i < count; ++i) {
        tree->narrow_slots[i] = (int32_t)wide[i];
    }
    *out = tree->narrow_slots;
    return RADIX_TREE_OK;
}

int radix_tree_match(radix_tree *tree, int64_t root, const void *input_tokens, int32_t token_width, int64_t n,
                     int64_t checked, int64_t stamp, radix_tree_walk *out) {
    if (tree == NULL || !valid_root(tree, root) || n < 0 || n % tree->page_size || checked < n ||
        (token_width != 4 && token_width != 8) || ((n > 0 || checked > 0) && input_tokens == NULL) || out == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    /* CHECK (and widen int32) */
    const int64_t *tokens;
    int status = read_tokens(tree, input_tokens, token_width, checked, &tokens, &out->bad);
    if (status != RADIX_TREE_OK) {
        return status;
    }
    out->bad = NONE;
    /* WALK + UPDATE */
    status = walk(tree, root, tokens, n, stamp, &out->node, &out->length, 1);
    out->version = N(out->node).version;
    return status;
}

/* The first bad new page of an insert (pages first_page.. of slots), or OK. */
static int check_new_pages(const radix_tree *tree, const int32_t *slots, int64_t first, int64_t n, int64_t *bad) {
    int64_t p = tree->page_size;
    int64_t count = (n - first) / p;
    if (count == 0) {
        return RADIX_TREE_OK;
    }
    /* the new pages' starts so far (a set: no page given twice); on the stack for a few pages */
    int64_t capacity = 64;
    while (capacity < 2 * count) {
        capacity *= 2;
    }
    int64_t on_stack[64];
    int64_t *seen = capacity == 64 ? on_stack : block_malloc((size_t)capacity * sizeof *seen);
    if (seen == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    for (int64_t i = 0; i < capacity; ++i) {
        seen[i] = NONE;
    }
    int status = RADIX_TREE_OK;
    for (int64_t at = first; at < n && status == RADIX_TREE_OK; at += p) {
        int64_t start = slots[at];
        if (start < 0 || start % p != 0) {
            status = RADIX_TREE_MISALIGNED;
        }
        for (int64_t k = 1; k < p && status == RADIX_TREE_OK; ++k) {
            if ((int64_t)slots[at + k] != start + k) {
                status = RADIX_TREE_MISALIGNED;
            }
        }
        if (status == RADIX_TREE_OK && starts_contains(tree, start)) {
            status = RADIX_TREE_DUPLICATE;
        }
        if (status == RADIX_TREE_OK) {
            uint64_t mask = (uint64_t)capacity - 1;
            uint64_t i = mix64((uint64_t)start) & mask;
            while (seen[i] != NONE && seen[i] != start) {
                i = (i + 1) & mask;
            }
            if (seen[i] == start) {
                status = RADIX_TREE_DUPLICATE;
            }
            seen[i] = start;
        }
        if (status != RADIX_TREE_OK) {
            *bad = at / p;
        }
    }
    if (seen != on_stack) {
        block_free(seen);
    }
    return status;
}

int radix_tree_insert(radix_tree *tree, int64_t root, const void *input_tokens, int32_t token_width,
                      const void *input_slots, int32_t slot_width, int64_t n, int64_t checked, int64_t stamp,
                      radix_tree_walk *out) {
    if (tree == NULL || !valid_root(tree, root) || n < 0 || n % tree->page_size || checked < n ||
        (token_width != 4 && token_width != 8) || (slot_width != 4 && slot_width != 8) ||
        (checked > 0 && (input_tokens == NULL || input_slots == NULL)) || out == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    /* CHECK: every token, every slot (widened / narrowed as they come), then every new page, before anything
     * changes */
    const int64_t *tokens;
    const int32_t *slots;
    int status = read_tokens(tree, input_tokens, token_width, checked, &tokens, &out->bad);
    if (status != RADIX_TREE_OK) {
        return status;
    }
    if ((status = read_slots(tree, input_slots, slot_width, checked, &slots, &out->bad)) != RADIX_TREE_OK) {
        return status;
    }
    out->bad = NONE;
    int64_t cached = find(tree, root, tokens, n);
    status = check_new_pages(tree, slots, cached, n, &out->bad);
    if (status != RADIX_TREE_OK) {
        return status;
    }
    /* make room first, so that nothing below can fail half way: a split, a leaf, its pages */
    segment *seg = NULL;
    if (cached < n) {
        status = reserve(tree, 2, (n - cached) / tree->page_size);
        seg = status == RADIX_TREE_OK ? segment_new(tree, tokens + cached, slots + cached, n - cached) : NULL;
        if (seg == NULL) {
            return RADIX_TREE_NO_MEMORY;
        }
    } else if ((status = reserve(tree, 1, 0)) != RADIX_TREE_OK) {
        return status;
    }
    /* WALK */
    int64_t last, matched;
    status = walk(tree, root, tokens, n, stamp, &last, &matched, cached == n);
    if (matched < n && status == RADIX_TREE_OK) {
        /* UPDATE: the new pages, one leaf under the last node matched */
        int64_t leaf = node_alloc(tree);
        N(leaf).seg = seg;
        seg->refs = 1;
        N(leaf).length = n - matched;
        N(leaf).timestamp = N(leaf).generation = stamp;
        sibling_link(tree, last, leaf);
        child_add(tree, last, leaf);
        for (int64_t k = 0; k < N(leaf).length; k += tree->page_size) {
            starts_add(tree, seg->slots[k]);
        }
        /* ACCOUNT */
        tree->evictable += N(leaf).length;
        tree->page_count += N(leaf).length / tree->page_size;
        tree->node_count++;
        status = queue_push(tree, leaf);
        last = leaf;
    } else if (seg != NULL) {
        segment_free(tree, seg); /* every page was cached already: no node took it */
    }
    out->node = last;
    out->version = N(last).version;
    out->length = cached;
    return status;
}

int radix_tree_lock(radix_tree *tree, int64_t node, int64_t version) {
    if (tree == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    if (!node_is_live(tree, node, version)) {
        return RADIX_TREE_STALE;
    }
    for (int64_t id = node; !N(id).is_root; id = N(id).parent) {
        if (N(id).ref_count == 0) {
            tree->evictable -= N(id).length;
            tree->protected_ += N(id).length;
        }
        N(id).ref_count++;
        N(N(id).parent).child_refs++;
    }
    return RADIX_TREE_OK;
}

int radix_tree_is_locked(radix_tree *tree, int64_t node, int64_t version) {
    if (tree == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    if (!node_is_live(tree, node, version)) {
        return RADIX_TREE_STALE;
    }
    return N(node).is_root || N(node).ref_count > N(node).child_refs;
}

int radix_tree_unlock(radix_tree *tree, int64_t node, int64_t version) {
    int locked = radix_tree_is_locked(tree, node, version);
    if (locked < 0) {
        return locked;
    }
    if (!locked) {
        return RADIX_TREE_NOT_LOCKED;
    }
    int status = RADIX_TREE_OK;
    for (int64_t id = node; !N(id).is_root; id = N(id).parent) {
        N(id).ref_count--;
        N(N(id).parent).child_refs--;
        if (N(id).ref_count == 0) {
            tree->evictable += N(id).length;
            tree->protected_ -= N(id).length;
            if (N(id).child_count == 0 && status == RADIX_TREE_OK) {
                status = queue_push(tree, id);
            }
        }
    }
    return status;
}

int64_t radix_tree_path_slots(radix_tree *tree, int64_t node, int64_t version, int32_t *out, int64_t capacity) {
    if (tree == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    if (!node_is_live(tree, node, version)) {
        return RADIX_TREE_STALE;
    }
    int64_t total = 0;
    for (int64_t id = node; !N(id).is_root; id = N(id).parent) {
        total += N(id).length;
    }
    if (total > capacity || (total > 0 && out == NULL)) {
        return RADIX_TREE_BAD_ARGS;
    }
    int64_t end = total;
    for (int64_t id = node; !N(id).is_root; id = N(id).parent) {
        end -= N(id).length;
        memcpy(out + end, node_slots(tree, id), (size_t)N(id).length * sizeof(int32_t));
    }
    return total;
}

int64_t radix_tree_path_tokens(radix_tree *tree, int64_t node, int64_t version, int64_t *tokens,
                               int64_t *generations, int64_t capacity) {
    if (tree == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    if (!node_is_live(tree, node, version)) {
        return RADIX_TREE_STALE;
    }
    int64_t total = 0;
    for (int64_t id = node; !N(id).is_root; id = N(id).parent) {
        total += N(id).length;
    }
    if (total > capacity || (total > 0 && (tokens == NULL || generations == NULL))) {
        return RADIX_TREE_BAD_ARGS;
    }
    int64_t end = total;
    for (int64_t id = node; !N(id).is_root; id = N(id).parent) {
        end -= N(id).length;
        memcpy(tokens + end, node_tokens(tree, id), (size_t)N(id).length * sizeof(int64_t));
        for (int64_t k = 0; k < N(id).length; k += tree->page_size) {
            generations[(end + k) / tree->page_size] = N(id).generation;
        }
    }
    return total;
}

int64_t radix_tree_depth(radix_tree *tree, int64_t node, int64_t version) {
    if (tree == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    if (!node_is_live(tree, node, version)) {
        return RADIX_TREE_STALE;
    }
    int64_t depth = 0;
    for (int64_t id = node; !N(id).is_root; id = N(id).parent) {
        depth++;
    }
    return depth;
}

static int compare_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static int compare_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int radix_tree_evict(radix_tree *tree, int64_t pages, int32_t *out, int64_t *emptied, int64_t emptied_capacity,
                     int64_t *n_emptied) {
    if (tree == NULL || pages < 0 || (pages > 0 && out == NULL) || n_emptied == NULL ||
        (emptied_capacity > 0 && emptied == NULL)) {
        return RADIX_TREE_BAD_ARGS;
    }
    *n_emptied = 0;
    int64_t p = tree->page_size;
    if (pages * p > tree->evictable) {
        return RADIX_TREE_NOT_EVICTABLE;
    }
    if (pages == 0) {
        return RADIX_TREE_OK;
    }
    /* room for the one split an eviction may make (its last node), so that the loop cannot fail half way */
    if (reserve(tree, 1, 0) != RADIX_TREE_OK) {
        return RADIX_TREE_NO_MEMORY;
    }
    /* the page starts gather at the front of out (slots fit in int32), sorted, then spread into runs */
    int32_t *starts = out;
    int64_t taken = 0;
    int status = RADIX_TREE_OK;
    while (taken < pages) {
        int64_t leaf = queue_pop(tree);
        if (leaf == NONE) {
            status = RADIX_TREE_CORRUPT; /* evictable tokens without an evictable leaf: radix_tree_check says why */
            break;
        }
        int64_t node_pages = N(leaf).length / p;
        if (node_pages > pages - taken) {
            /* only its last pages go: the prefix stays cached, as a new leaf */
            if (split_at(tree, leaf, (node_pages - (pages - taken)) * p) == NONE) {
                status = RADIX_TREE_NO_MEMORY;
                break;
            }
        }
        const int32_t *slots = node_slots(tree, leaf);
        int64_t length = N(leaf).length;
        tree->evicted_stamp_sum += N(leaf).timestamp * (length / p);
        for (int64_t k = 0; k < length; k += p) {
            starts[taken++] = slots[k];
        }
        int64_t parent = detach(tree, leaf); /* frees the leaf's segment when no split half shares it */
        if (is_evictable_leaf(tree, parent)) {
            status = queue_push(tree, parent);
        } else if (N(parent).is_root && N(parent).child_count == 0 && *n_emptied < emptied_capacity) {
            emptied[(*n_emptied)++] = parent;
        }
        if (status != RADIX_TREE_OK) {
            break;
        }
    }
    if (taken > 1) {
        qsort(starts, (size_t)taken, sizeof *starts, compare_i32);
    }
    for (int64_t i = taken - 1; i >= 0; --i) { /* backwards: page i's run starts at or after start i */
        int32_t start = starts[i];
        for (int64_t k = p - 1; k >= 0; --k) {
            out[i * p + k] = start + (int32_t)k;
        }
    }
    return status == RADIX_TREE_OK && *n_emptied > 0 ? RADIX_TREE_ROOTS_EMPTIED : status;
}

int64_t radix_tree_reset(radix_tree *tree, int32_t *out, int64_t capacity) {
    if (tree == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    if (tree->protected_ > 0) {
        return RADIX_TREE_BUSY;
    }
    int64_t p = tree->page_size;
    if (tree->page_count * p > capacity || (tree->page_count > 0 && out == NULL)) {
        return RADIX_TREE_BAD_ARGS;
    }
    int64_t *starts = block_malloc((size_t)(tree->page_count > 0 ? tree->page_count : 1) * sizeof *starts);
    if (starts == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    int64_t taken = 0;
    for (int64_t id = 0; id < tree->nodes_high; ++id) {
        if (N(id).alive && !N(id).is_root) {
            for (int64_t k = 0; k < N(id).length; k += p) {
                starts[taken++] = node_slots(tree, id)[k];
            }
            node_free(tree, id);
        } else if (N(id).alive) {
            N(id).first_child = NONE;
            N(id).child_count = 0;
            N(id).child_refs = 0;
        }
    }
    for (int64_t i = 0; i < tree->children_capacity; ++i) {
        tree->children[i].child = NONE;
    }
    for (int64_t i = 0; i < tree->starts_capacity; ++i) {
        tree->starts[i] = NONE;
    }
    tree->children_count = tree->starts_count = 0;
    tree->fifo_head = tree->fifo_length = tree->heap_length = 0;
    tree->evictable = tree->node_count = tree->page_count = 0;
    qsort(starts, (size_t)taken, sizeof *starts, compare_i64);
    for (int64_t i = 0; i < taken; ++i) {
        for (int64_t k = 0; k < p; ++k) {
            out[i * p + k] = (int32_t)(starts[i] + k);
        }
    }
    block_free(starts);
    return taken * p;
}

void radix_tree_counts(const radix_tree *tree, radix_tree_counters *out) {
    out->evictable = tree->evictable;
    out->protected_ = tree->protected_;
    out->nodes = tree->node_count;
    out->pages = tree->page_count;
    out->roots = tree->root_count;
    out->fifo = tree->fifo_length;
    out->heap = tree->heap_length;
}

int64_t radix_tree_evicted_stamp_sum(const radix_tree *tree) {
    return tree->evicted_stamp_sum;
}

int64_t radix_tree_memory(const radix_tree *tree) {
    /* each table at its element's size, written from its type (never a number to keep in step) */
    return (int64_t)sizeof *tree + tree->nodes_capacity * (int64_t)sizeof *tree->nodes +
           tree->children_capacity * (int64_t)sizeof *tree->children +
           tree->starts_capacity * (int64_t)sizeof *tree->starts +
           tree->fifo_capacity * (int64_t)sizeof *tree->fifo + tree->heap_capacity * (int64_t)sizeof *tree->heap +
           tree->segment_bytes + tree->wide_tokens_capacity * (int64_t)sizeof *tree->wide_tokens +
           tree->narrow_slots_capacity * (int64_t)sizeof *tree->narrow_slots;
}

/* The field a test breaks (radix_tree_break_invariant), or NULL. */
static int64_t *tree_field(radix_tree *tree, int field) {
    switch (field) {
    case RADIX_FIELD_EVICTABLE:
        return &tree->evictable;
    case RADIX_FIELD_PROTECTED:
        return &tree->protected_;
    case RADIX_FIELD_NODES:
        return &tree->node_count;
    case RADIX_FIELD_PAGES:
        return &tree->page_count;
    case RADIX_FIELD_ROOTS:
        return &tree->root_count;
    case RADIX_FIELD_CHILDREN:
        return &tree->children_count;
    case RADIX_FIELD_STARTS:
        return &tree->starts_count;
    case RADIX_FIELD_SEGMENT_BYTES:
        return &tree->segment_bytes;
    default:
        return NULL;
    }
}

static int64_t *node_field(radix_tree *tree, int64_t id, int field) {
    switch (field) {
    case RADIX_FIELD_REF_COUNT:
        return &N(id).ref_count;
    case RADIX_FIELD_LENGTH:
        return &N(id).length;
    case RADIX_FIELD_PARENT:
        return &N(id).parent;
    case RADIX_FIELD_CHILD_COUNT:
        return &N(id).child_count;
    case RADIX_FIELD_CHILD_REFS:
        return &N(id).child_refs;
    case RADIX_FIELD_QUEUE_STAMP:
        return &N(id).queue_stamp;
    case RADIX_FIELD_SEGMENT_REFS:
        return &N(id).seg->refs;
    default:
        return NULL;
    }
}

int radix_tree_break_invariant(radix_tree *tree, int field, int64_t nth, int64_t position, int64_t delta) {
    if (tree == NULL || nth < 0 || position < 0) {
        return RADIX_TREE_BAD_ARGS;
    }
    int64_t *counter = tree_field(tree, field);
    if (counter != NULL) {
        *counter += delta;
        return RADIX_TREE_OK;
    }
    int with_pages = field == RADIX_FIELD_SLOT || field == RADIX_FIELD_SEGMENT_REFS;
    for (int64_t id = 0; id < tree->nodes_high; ++id) {
        if (!N(id).alive || (with_pages && N(id).length == 0) || nth-- > 0) {
            continue;
        }
        if (field == RADIX_FIELD_SLOT) {
            /* modulo 2**32: a delta of 2**31 makes any slot negative, and puts it back */
            int32_t *slot = &N(id).seg->slots[N(id).offset + position % N(id).length];
            *slot = (int32_t)((uint32_t)*slot + (uint32_t)delta);
            return RADIX_TREE_OK;
        }
        int64_t *value = node_field(tree, id, field);
        if (value == NULL) {
            return RADIX_TREE_BAD_ARGS;
        }
        *value += delta;
        return RADIX_TREE_OK;
    }
    return RADIX_TREE_BAD_ARGS;
}

/* ---------------------------------------------------------------- export and check */

int radix_tree_export(const radix_tree *tree, radix_tree_record *records, int64_t *tokens, int64_t *pages,
                      int64_t *n_nodes, int64_t *n_tokens, int64_t *n_pages) {
    if (tree == NULL || n_nodes == NULL || n_tokens == NULL || n_pages == NULL) {
        return RADIX_TREE_BAD_ARGS;
    }
    int64_t count = 0, token_count = 0, page_count = 0;
    int filling = records != NULL;
    if (filling && (tokens == NULL || pages == NULL)) {
        return RADIX_TREE_BAD_ARGS;
    }
    int64_t *stack = block_malloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 1) * 2 * sizeof *stack);
    if (stack == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    for (int64_t root = 0; root < tree->nodes_high; ++root) {
        if (!N(root).alive || !N(root).is_root) {
            continue;
        }
        /* (node, its parent's index in the export) */
        int64_t top = 0;
        for (int64_t child = N(root).first_child; child != NONE; child = N(child).next_sibling) {
            stack[top++] = child;
            stack[top++] = NONE;
        }
        while (top > 0) {
            int64_t parent_index = stack[--top];
            int64_t id = stack[--top];
            if (filling) {
                if (count >= *n_nodes || token_count + N(id).length > *n_tokens ||
                    page_count + N(id).length / tree->page_size > *n_pages) {
                    block_free(stack);
                    return RADIX_TREE_BAD_ARGS;
                }
                records[count] = (radix_tree_record){parent_index, root, N(id).length, N(id).timestamp,
                                                     N(id).generation, N(id).ref_count, token_count, page_count};
                memcpy(tokens + token_count, node_tokens(tree, id), (size_t)N(id).length * sizeof(int64_t));
                for (int64_t k = 0; k < N(id).length; k += tree->page_size) {
                    pages[page_count + k / tree->page_size] = node_slots(tree, id)[k];
                }
            }
            for (int64_t child = N(id).first_child; child != NONE; child = N(child).next_sibling) {
                stack[top++] = child;
                stack[top++] = count;
            }
            token_count += N(id).length;
            page_count += N(id).length / tree->page_size;
            count++;
        }
    }
    block_free(stack);
    *n_nodes = count;
    *n_tokens = token_count;
    *n_pages = page_count;
    return RADIX_TREE_OK;
}

static int compare_segments(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (segment *const *)a, y = (uintptr_t) * (segment *const *)b;
    return (x > y) - (x < y);
}

/* segments_are_counted: each segment is shared by exactly its refs live nodes, and segment_bytes is the size of
 * the segments that live nodes hold (a segment no node holds is a leak; one freed while held, a dangling slice). */
static int check_segments(const radix_tree *tree, char *message, int64_t capacity) {
    segment **held = block_malloc((size_t)(tree->node_count > 0 ? tree->node_count : 1) * sizeof *held);
    if (held == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    int64_t count = 0;
    for (int64_t id = 0; id < tree->nodes_high && count < tree->node_count; ++id) {
        if (N(id).alive && !N(id).is_root) {
            held[count++] = N(id).seg;
        }
    }
    qsort(held, (size_t)count, sizeof *held, compare_segments);
    int64_t bytes = 0;
    for (int64_t i = 0, next; i < count; i = next) {
        for (next = i + 1; next < count && held[next] == held[i]; ++next) {
        }
        if (held[i]->refs != next - i) {
            snprintf(message, (size_t)capacity, "segments_are_counted: a segment of %lld tokens counts %lld refs, "
                     "%lld nodes hold it", (long long)held[i]->length, (long long)held[i]->refs, (long long)(next - i));
            block_free(held);
            return RADIX_TREE_CORRUPT;
        }
        bytes += segment_size(held[i]->length);
    }
    block_free(held);
    if (bytes != tree->segment_bytes) {
        snprintf(message, (size_t)capacity, "segments_are_counted: %lld segment bytes counted, the nodes hold %lld",
                 (long long)tree->segment_bytes, (long long)bytes);
        return RADIX_TREE_CORRUPT;
    }
    return RADIX_TREE_OK;
}

#define BROKEN(...)                                       \
    do {                                                  \
        snprintf(message, (size_t)capacity, __VA_ARGS__); \
        block_free(marks);                                \
        return RADIX_TREE_CORRUPT;                        \
    } while (0)

int radix_tree_check(const radix_tree *tree, char *message, int64_t capacity) {
    if (tree == NULL || message == NULL || capacity < 1) {
        return RADIX_TREE_BAD_ARGS;
    }
    int64_t p = tree->page_size;
    /* per node: children counted, queue entries seen */
    int64_t *marks = block_calloc((size_t)(tree->nodes_high > 0 ? tree->nodes_high : 1) * 2, sizeof *marks);
    if (marks == NULL) {
        return RADIX_TREE_NO_MEMORY;
    }
    int64_t evictable = 0, protected_ = 0, nodes = 0, pages = 0, roots = 0;
    for (int64_t id = 0; id < tree->nodes_high; ++id) {
        const node_t *node = &N(id);
        if (!node->alive) {
            continue;
        }
        if (node->is_root) {
            roots++;
            if (node->parent != NONE || node->length != 0 || node->ref_count != 0) {
                BROKEN("tree_is_well_formed: root %lld has a parent, pages or locks", (long long)id);
            }
            continue;
        }
        nodes++;
        if (node->parent < 0 || node->parent >= tree->nodes_high || !N(node->parent).alive) {
            BROKEN("tree_is_well_formed: node %lld has no live parent", (long long)id);
        }
        if (node->length <= 0 || node->length % p || node->seg == NULL || node->offset < 0 ||
            node->offset + node->length > node->seg->length) {
            BROKEN("tree_is_well_formed: node %lld holds %lld tokens at %lld of a segment", (long long)id,
                   (long long)node->length, (long long)node->offset);
        }
        if (child_of(tree, node->parent, node_tokens(tree, id)) != id) {
            BROKEN("children_find_every_node: node %lld is not found under its parent by its first page", (long long)id);
        }
        marks[node->parent]++;
        const int32_t *slots = node_slots(tree, id);
        for (int64_t k = 0; k < node->length; k += p) {
            if (slots[k] < 0 || slots[k] % p) {
                BROKEN("page_slots_are_aligned: node %lld page at slot %d", (long long)id, slots[k]);
            }
            for (int64_t j = 1; j < p; ++j) {
                if (slots[k + j] != slots[k] + j) {
                    BROKEN("page_slots_are_aligned: node %lld page at slot %d is not a run", (long long)id, slots[k]);
                }
            }
            if (!starts_contains(tree, slots[k])) {
                BROKEN("cached_starts_match_tree: page at slot %d is missing from the set", slots[k]);
            }
        }
        pages += node->length / p;
        if (node->ref_count) {
            protected_ += node->length;
        } else {
            evictable += node->length;
        }
        if (is_evictable_leaf(tree, id)) {
            if (node->queue_stamp != node->timestamp) {
                BROKEN("evictable_leaves_are_queued: leaf %lld (stamp %lld) has no live queue entry", (long long)id,
                       (long long)node->timestamp);
            }
        }
    }
    for (int64_t id = 0; id < tree->nodes_high; ++id) {
        const node_t *node = &N(id);
        if (!node->alive) {
            continue;
        }
        int64_t listed = 0, refs = 0;
        for (int64_t child = node->first_child; child != NONE; child = N(child).next_sibling) {
            if (listed > tree->nodes_high || N(child).parent != id) {
                BROKEN("tree_is_well_formed: the child list of node %lld is broken", (long long)id);
            }
            listed++;
            refs += N(child).ref_count;
        }
        if (listed != node->child_count || listed != marks[id]) {
            BROKEN("tree_is_well_formed: node %lld counts %lld children, lists %lld, %lld point to it", (long long)id,
                   (long long)node->child_count, (long long)listed, (long long)marks[id]);
        }
        if (refs != node->child_refs || (!node->is_root && node->ref_count < refs)) {
            BROKEN("ref_counts_cover_children: node %lld ref_count %lld, child_refs %lld, children hold %lld",
                   (long long)id, (long long)node->ref_count, (long long)node->child_refs, (long long)refs);
        }
    }
    /* every live entry of the queues names a live node at its stamp, once */
    for (int64_t k = 0; k < tree->fifo_length + tree->heap_length; ++k) {
        leaf_entry entry = k < tree->fifo_length ? tree->fifo[(tree->fifo_head + k) % tree->fifo_capacity]
                                                  : tree->heap[k - tree->fifo_length];
        if (node_is_live(tree, entry.node, entry.version) && N(entry.node).queue_stamp == entry.stamp) {
            if (marks[tree->nodes_high + entry.node]++) {
                BROKEN("evictable_leaves_are_queued: node %lld has two live entries", (long long)entry.node);
            }
        }
    }
    for (int64_t id = 0; id < tree->nodes_high; ++id) {
        if (N(id).alive && N(id).queue_stamp != NONE && !marks[tree->nodes_high + id]) {
            BROKEN("evictable_leaves_are_queued: node %lld claims an entry at %lld that is not queued", (long long)id,
                   (long long)N(id).queue_stamp);
        }
    }
    if (evictable != tree->evictable || protected_ != tree->protected_ || nodes != tree->node_count ||
        pages != tree->page_count || roots != tree->root_count) {
        BROKEN("size_counters_match_tree: counters (%lld, %lld, %lld nodes, %lld pages, %lld roots), tree (%lld, %lld, "
               "%lld, %lld, %lld)",
               (long long)tree->evictable, (long long)tree->protected_, (long long)tree->node_count,
               (long long)tree->page_count, (long long)tree->root_count, (long long)evictable, (long long)protected_,
               (long long)nodes, (long long)pages, (long long)roots);
    }
    if (tree->children_count != nodes || tree->starts_count != pages) {
        BROKEN("tables_match_tree: %lld children entries for %lld nodes, %lld starts for %lld pages",
               (long long)tree->children_count, (long long)nodes, (long long)tree->starts_count, (long long)pages);
    }
    block_free(marks);
    message[0] = 0;
    /* after the node checks: every live non-root node holds a segment, and node_count counts them */
    return check_segments(tree, message, capacity);
}
