/* The hybrid prefix cache's tree in C (csrc/hybrid.c); optimized/hybrid_cache.py drives it.
 *
 * One node per page (spec/hybrid.py): each node holds, per attention group, the page's slot start
 * (-1 where the group does not cache it), stamp, lock count and generation. Nodes live in growable
 * arrays and are named by (id, version): a freed node's version is bumped. Children are found
 * through one table keyed by (parent, page tokens) (csrc/pages.h). Each group's evictable pages wait in a
 * min-heap by (stamp, deeper first), with lazy deletion. Every call reserves its memory before it
 * changes anything, so a failed call changes nothing.
 *
 * The lines between the cdef markers are the cffi declarations too (csrc/build_ffi.py). */
#ifndef RADIXSPEC_HYBRID_H
#define RADIXSPEC_HYBRID_H
#include <stdint.h>

/* cdef-begin */
enum hybrid_status {
    HYBRID_OK = 0,
    /* an argument the wrapper should never pass */
    HYBRID_BAD_ARGS = -1,
    /* a new page's start is not a multiple of P; *bad names the page, *bad_group its group */
    HYBRID_MISALIGNED = -2,
    /* a new page's start is cached in its group, or given twice */
    HYBRID_DUPLICATE = -3,
    HYBRID_NO_MEMORY = -4,
    /* a page the handle uses was evicted (or evicted and cached again) */
    HYBRID_STALE = -5,
    /* unlock of a page with no lock */
    HYBRID_NOT_LOCKED = -6,
    /* evict of more pages than the group has evictable */
    HYBRID_NOT_EVICTABLE = -7,
    /* hybrid_check found a broken invariant: the message says which */
    HYBRID_CORRUPT = -9,
    /* a full-attention group is given no start for a page it does not cache */
    HYBRID_MISSING = -12
};

/* what hybrid_handle does with a handle after checking that every page it uses is still cached */
enum hybrid_handle_op { HYBRID_CHECK = 0, HYBRID_LOCK = 1, HYBRID_UNLOCK = 2, HYBRID_MATCHED = 3 };

typedef struct hybrid_tree hybrid_tree;

/* What hybrid_match and hybrid_insert report: the valid match length in tokens, and on a rejected
 * insert the page and the group at fault. */
typedef struct {
    int64_t length;
    int64_t bad;
    int64_t bad_group;
} hybrid_walk;

/* windows[g]: 0 for full attention, else the window in tokens */
hybrid_tree *hybrid_new(int64_t page_size, int64_t groups, const int64_t *windows);
void hybrid_free(hybrid_tree *tree);
/* a new empty root (one per namespace); -1 when out of memory */
int64_t hybrid_new_root(hybrid_tree *tree);

/* The longest valid match of tokens[0, pages * P) under root; stamps the pages it uses with stamp.
 * Writes, for each page of the match, its node and version (node -1 past the tree) and, per group,
 * the generation of each page the match uses (gens[g * pages + k], -1 where unused). */
int hybrid_match(hybrid_tree *tree, int64_t root, const int64_t *tokens, int64_t pages, int64_t stamp,
                 int64_t *nodes, int64_t *versions, int64_t *gens, hybrid_walk *out);
/* Cache the pages of tokens[0, pages * P): starts[g * pages + k] is page k's start in group g, -1 for
 * none. Writes unused[g * pages + k]: a start given for a page the group caches at another slot (else
 * -1); then the handle of the longest valid match of the inserted tokens, as hybrid_match does. */
int hybrid_insert(hybrid_tree *tree, int64_t root, const int64_t *tokens, int64_t pages, const int64_t *starts,
                  int64_t stamp, int64_t *unused, int64_t *nodes, int64_t *versions, int64_t *gens,
                  hybrid_walk *out);
/* op on a handle (nodes, versions, gens as hybrid_match wrote them for a match of length tokens);
 * HYBRID_MATCHED writes slots[g * pages + k] (-1 where unused). room: the pages each array holds per group
 * (nodes and versions room entries, gens and slots groups * room); HYBRID_BAD_ARGS unless length is a
 * whole number of pages, at most room, so that no array is read or written past its end */
int hybrid_handle(hybrid_tree *tree, int op, const int64_t *nodes, const int64_t *versions, const int64_t *gens,
                  int64_t room, int64_t length, int64_t *slots);
/* evict exactly pages pages of group, the oldest evictable first (deeper first on a tie); their starts
 * go to out */
int hybrid_evict(hybrid_tree *tree, int64_t group, int64_t pages, int64_t *out);
/* free every node (roots too) */
void hybrid_reset(hybrid_tree *tree);
/* out[0]: evictable pages of group, out[1]: locked pages, out[2]: nodes (roots included); -1 pages for a group
   the tree does not have */
void hybrid_counts(const hybrid_tree *tree, int64_t group, int64_t *out);
/* Every node below a root, parents first: parent[i] (an index of the export, or -1 - root for a child
 * of root), its page tokens (P per node), and per group 4 values (slot start, stamp, refs, generation).
 * Returns the node count, or -needed when capacity is short. */
int64_t hybrid_export(const hybrid_tree *tree, int64_t *parent, int64_t *tokens, int64_t *values, int64_t capacity);
/* HYBRID_OK, or HYBRID_CORRUPT with a message naming the broken invariant */
int hybrid_check(const hybrid_tree *tree, char *message, int64_t capacity);
/* cdef-end */

#endif
