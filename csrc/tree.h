/* The radix tree of the optimized prefix cache, in C (csrc/tree.c); optimized/radix_cache.py drives it.
 *
 * Nodes live in one growable array and are named by (id, version): a freed node's version is
 * bumped, so a handle on it is stale. Each node holds a run of whole pages: a slice of a
 * segment (the tokens and slots of one insert, reference counted, shared by the halves of a
 * split). Children are found through one hash table keyed by (parent, first page). Evictable
 * leaves wait in a FIFO of in-order stamps and a min-heap for the rest, with lazy deletion.
 *
 * The lines between the cdef markers are the cffi declarations too (csrc/build_ffi.py). */
#ifndef RADIXSPEC_TREE_H
#define RADIXSPEC_TREE_H
#include <stdint.h>

/* cdef-begin */
enum radix_tree_status {
    RADIX_TREE_OK = 0,
    /* radix_tree_evict did its work, and roots lost their last page (*n_emptied of them, in emptied) */
    RADIX_TREE_ROOTS_EMPTIED = 1,
    /* an argument the wrapper should never pass */
    RADIX_TREE_BAD_ARGS = -1,
    /* a new page is not an aligned run of slots; *bad names it */
    RADIX_TREE_MISALIGNED = -2,
    /* a new page takes a slot that is cached, or given to another new page; *bad names it */
    RADIX_TREE_DUPLICATE = -3,
    RADIX_TREE_NO_MEMORY = -4,
    /* the node of a handle was freed (evicted or reset) */
    RADIX_TREE_STALE = -5,
    /* unlock of a path that holds no lock of its own */
    RADIX_TREE_NOT_LOCKED = -6,
    /* evict of more pages than are evictable */
    RADIX_TREE_NOT_EVICTABLE = -7,
    /* reset while a page is locked */
    RADIX_TREE_BUSY = -8,
    /* radix_tree_check found a broken invariant: the message says which */
    RADIX_TREE_CORRUPT = -9,
    /* a token id is negative; *bad is its index */
    RADIX_TREE_BAD_TOKEN = -10,
    /* a slot is negative (or, given as int64, 2**31 or more); *bad is its index */
    RADIX_TREE_BAD_SLOT = -11
};

typedef struct radix_tree radix_tree;

/* What radix_tree_match and radix_tree_insert report: the last node of the path (the root when nothing
 * matched) and its version, the tokens matched (match) or already cached before the call (insert), and on
 * a rejected input the index of the bad token or slot, or of the bad page (its index in tokens / P). */
typedef struct {
    int64_t node;
    int64_t version;
    int64_t length;
    int64_t bad;
} radix_tree_walk;

/* The tree's counters: evictable and protected tokens, nodes, cached pages, roots, and the entries of
 * the leaf queues (stale ones included): the in-order FIFO and the heap. */
typedef struct {
    int64_t evictable;
    int64_t protected_;
    int64_t nodes;
    int64_t pages;
    int64_t roots;
    int64_t fifo;
    int64_t heap;
} radix_tree_counters;

/* One node of radix_tree_export: its parent's index in the export (-1 under a root), its root, its
 * pages, and the offsets of its tokens and page starts in the export's buffers. */
typedef struct {
    int64_t parent;
    int64_t root;
    int64_t length;
    int64_t timestamp;
    int64_t generation;
    int64_t ref_count;
    int64_t token_offset;
    int64_t page_offset;
} radix_tree_record;

radix_tree *radix_tree_new(int64_t page_size);
/* An independent tree in the same state: the same nodes under the same (id, version) names (a handle on the
 * original names the same path in the copy), stamps, locks, queues and counters; segments of its own, shared
 * by the halves of a split as in the original. NULL when out of memory (or tree is NULL). */
radix_tree *radix_tree_clone(const radix_tree *tree);
void radix_tree_free(radix_tree *tree);

/* A root for a namespace; its id (>= 0) or a negative status. */
int64_t radix_tree_new_root(radix_tree *tree);
/* Free an empty root (the namespace holds no page any more). */
int radix_tree_drop_root(radix_tree *tree, int64_t root);

/* Token ids and slots come as the caller holds them: token_width / slot_width is 8 (int64_t) or 4 (int32_t).
 * int32 token ids are widened, int64 slots narrowed (each must be below 2**31), into a buffer the tree keeps,
 * in the same pass that checks them. */

/* Follow tokens[0..n) (whole pages) down from root, stamping every node passed with stamp and
 * splitting the node the match ends in. walk: the last node and the matched tokens (length).
 * tokens[0..checked) are checked first (not negative, else RADIX_TREE_BAD_TOKEN and walk->bad, with
 * nothing changed): the caller's whole input, whole pages or not. */
int radix_tree_match(radix_tree *tree, int64_t root, const void *tokens, int32_t token_width, int64_t n,
                     int64_t checked, int64_t stamp, radix_tree_walk *walk);

/* Cache tokens[0..n) (whole pages): pages already cached keep their slots, new ones take
 * slots[...]. Checked first, in the reference's order, with nothing changed on error: every token
 * and slot of [0..checked) (a token not negative, a slot in [0, 2**31): RADIX_TREE_BAD_TOKEN,
 * RADIX_TREE_BAD_SLOT, walk->bad their index), then every new page (an aligned run, not cached, not given
 * twice; walk->bad the page's index in tokens). walk: the last node of the whole path, and the tokens already
 * cached (length). */
int radix_tree_insert(radix_tree *tree, int64_t root, const void *tokens, int32_t token_width, const void *slots,
                      int32_t slot_width, int64_t n, int64_t checked, int64_t stamp, radix_tree_walk *walk);

/* +1 / -1 lock on every node from node up to its root. unlock needs a lock of this very path. */
int radix_tree_lock(radix_tree *tree, int64_t node, int64_t version);
int radix_tree_unlock(radix_tree *tree, int64_t node, int64_t version);
/* 1 when a lock of this very path is outstanding, 0 when not, or a negative status. */
int radix_tree_is_locked(radix_tree *tree, int64_t node, int64_t version);

/* Slots of the path from its root to node, in sequence order, into out (capacity slots). The
 * number written, or a negative status. */
int64_t radix_tree_path_slots(radix_tree *tree, int64_t node, int64_t version, int32_t *out, int64_t capacity);
/* Tokens of the same path into tokens (capacity tokens), each page's generation into generations. */
int64_t radix_tree_path_tokens(radix_tree *tree, int64_t node, int64_t version, int64_t *tokens,
                               int64_t *generations, int64_t capacity);
/* Nodes from node up to its root (the root not counted), or a negative status. */
int64_t radix_tree_depth(radix_tree *tree, int64_t node, int64_t version);

/* Evict exactly pages pages, the least recently used evictable leaf page first (a node is split
 * when only its last pages go). Their slots, ascending, into out (pages * page_size). Roots left
 * without a child are written to emptied (capacity: as many as there are roots), *n_emptied of
 * them, and the status is then RADIX_TREE_ROOTS_EMPTIED. */
int radix_tree_evict(radix_tree *tree, int64_t pages, int32_t *out, int64_t *emptied, int64_t emptied_capacity,
                     int64_t *n_emptied);

/* Empty every root (refused while locked); every slot the tree held, ascending, into out. The
 * number written, or a negative status. Roots stay; the caller drops them. */
int64_t radix_tree_reset(radix_tree *tree, int32_t *out, int64_t capacity);

/* Metrics: the sum of the last-access stamps of the pages evicted so far (the caller knows its clock at each
 * eviction; the difference is the eviction age). */
int64_t radix_tree_evicted_stamp_sum(const radix_tree *tree);

/* The counters, into out. */
void radix_tree_counts(const radix_tree *tree, radix_tree_counters *out);

/* Check every structural invariant; RADIX_TREE_CORRUPT with a message naming the broken one. */
int radix_tree_check(const radix_tree *tree, char *message, int64_t capacity);

/* Every node under every root, parents before children: records, tokens, page starts. Call with
 * null buffers to learn the sizes (*n_nodes, *n_tokens, *n_pages), then with buffers that big. */
int radix_tree_export(const radix_tree *tree, radix_tree_record *records, int64_t *tokens, int64_t *pages,
                      int64_t *n_nodes, int64_t *n_tokens, int64_t *n_pages);

/* Bytes of memory the tree holds (nodes, segments, tables, queues). */
int64_t radix_tree_memory(const radix_tree *tree);

/* Test support: the blocks of memory that csrc/tree.c allocated and has not freed, all trees of the process
 * together. A freed tree, and every call once it returns, leave none of their own behind. */
int64_t radix_tree_live_blocks(void);

/* Test support: the fields radix_tree_break_invariant changes. */
enum radix_tree_field {
    /* of a node (roots included) */
    RADIX_FIELD_REF_COUNT = 0,
    RADIX_FIELD_LENGTH = 1,
    RADIX_FIELD_PARENT = 2,
    RADIX_FIELD_CHILD_COUNT = 3,
    RADIX_FIELD_CHILD_REFS = 4,
    RADIX_FIELD_QUEUE_STAMP = 5,
    /* of a node that holds pages: the slot at a token position */
    RADIX_FIELD_SLOT = 6,
    /* of the tree: its counters */
    RADIX_FIELD_EVICTABLE = 7,
    RADIX_FIELD_PROTECTED = 8,
    RADIX_FIELD_NODES = 9,
    RADIX_FIELD_PAGES = 10,
    RADIX_FIELD_ROOTS = 11,
    RADIX_FIELD_CHILDREN = 12,
    RADIX_FIELD_STARTS = 13,
    RADIX_FIELD_SEGMENT_BYTES = 14,
    /* of a node that holds pages: the refs of the segment it holds a slice of */
    RADIX_FIELD_SEGMENT_REFS = 15
};

/* Test support, so that radix_tree_check is itself checked: add delta to one field, of the nth live node
 * (in id order; for RADIX_FIELD_SLOT, of the nth live node that holds pages, at token position
 * position modulo its length) or of the tree. The same call with -delta puts it back. RADIX_TREE_BAD_ARGS
 * when there is no such node or field (nothing changed then). */
int radix_tree_break_invariant(radix_tree *tree, int field, int64_t nth, int64_t position, int64_t delta);
/* cdef-end */

#endif
