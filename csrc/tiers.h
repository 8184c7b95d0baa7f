/* The index of the tiered prefix cache in C (csrc/tiers.c); optimized/tiered_cache.py drives it.
 *
 * One node per page (spec/tiers.py): each holds the page's residency (its device and host page starts, -1 for
 * none), its stamps, its locks (requests' locks, host locks of the transfers reading its host copy) and the counts
 * a guard reads as they change: the transfers pinning it and those moving it by kind, its children and those of
 * them with a device copy. Nodes live in growable arrays and are named by (id, version): a freed node's version is
 * bumped. Children are found through one table keyed by (parent, page tokens) (csrc/pages.h). The controller's
 * queue, the pools and storage stay in Python; what they read of a page, this index keeps. Every call reserves its
 * memory before it changes anything, so a failed call changes nothing.
 *
 * The lines between the cdef markers are the cffi declarations too (csrc/build_ffi.py). */
#ifndef RADIXSPEC_TIERS_H
#define RADIXSPEC_TIERS_H
#include <stdint.h>

/* cdef-begin */
enum tier_status {
    TIER_OK = 0,
    /* an argument the wrapper should never pass */
    TIER_BAD_ARGS = -1,
    TIER_NO_MEMORY = -4,
    /* a page of the handle left the index or the device, or holds a newer device copy */
    TIER_STALE = -5,
    /* unlock of a path whose last page holds no lock */
    TIER_NOT_LOCKED = -6,
    /* tier_check found a broken invariant: the message says which */
    TIER_CORRUPT = -9
};

/* a page's fields, as tier_get reads them and tier_export writes them (TIER_FIELDS of them a page) */
enum tier_field {
    TIER_DEVICE = 0,
    TIER_HOST = 1,
    TIER_REFS = 2,
    TIER_HOST_LOCKS = 3,
    TIER_HITS = 4,
    TIER_PINS = 5,
    TIER_BACKING = 6,
    TIER_LOADING = 7,
    TIER_STORING = 8,
    TIER_LAST_ACCESS = 9,
    TIER_DEVICE_SINCE = 10,
    TIER_ON_DEVICE_BELOW = 11,
    TIER_CHILDREN = 12,
    TIER_DEPTH = 13,
    TIER_PARENT = 14,
    TIER_VERSION = 15,
    TIER_FIELDS = 16
};

/* what tier_handle does with a handle after checking that each page still holds the device copy it named */
enum tier_handle_op { TIER_CHECK = 0, TIER_LOCK = 1, TIER_UNLOCK = 2 };

/* the tier tier_plan evicts from */
enum tier_tier { TIER_ON_DEVICE = 0, TIER_ON_HOST = 1 };

typedef struct tier_index tier_index;

tier_index *tier_new(int64_t page_size);
void tier_free(tier_index *index);
/* a new empty root (one per namespace); -1 when out of memory */
int64_t tier_new_root(tier_index *index);
/* The pages of the index along tokens[0, pages * P) under root, from the first: writes their nodes (room for pages)
 * and returns how many; runs[0]: the pages with a device copy from the first, runs[1]: with a device or host copy */
int64_t tier_walk(const tier_index *index, int64_t root, const int64_t *tokens, int64_t pages, int64_t *nodes,
                  int64_t *runs);
/* the child of parent (a root or a page) holding the P tokens of page, or -1 */
int64_t tier_child(const tier_index *index, int64_t parent, const int64_t *page);
/* A chain of new pages under parent, tokens[0, pages * P), none of them a child there yet: page k is pinned
 * pins[k] times, stamped (last access and device since) with stamp, has no copy; writes their nodes */
int tier_add_pages(tier_index *index, int64_t parent, const int64_t *tokens, int64_t pages, const int64_t *pins,
                   int64_t stamp, int64_t *nodes);
/* a page with no copy, child or count left leaves the index (TIER_BAD_ARGS for a root or such a page) */
int tier_remove(tier_index *index, int64_t node);
/* a field of a live node (-1 for a dead one or no such field) */
int64_t tier_get(const tier_index *index, int64_t node, int field);
/* field += delta on each node: the counts (TIER_REFS to TIER_STORING); TIER_BAD_ARGS for another field or a count
 * that would go negative, nothing changed */
int tier_add(tier_index *index, const int64_t *nodes, int64_t n, int field, int64_t delta);
/* field = value on each node: TIER_DEVICE (its parent's count of children on the device kept), TIER_HOST,
 * TIER_LAST_ACCESS, TIER_DEVICE_SINCE; TIER_BAD_ARGS for another field */
int tier_set(tier_index *index, const int64_t *nodes, int64_t n, int field, int64_t value);
/* op on a handle: n pages, each with the version and device-since it had when the handle was made; TIER_STALE or
 * TIER_NOT_LOCKED change nothing */
int tier_handle(tier_index *index, int op, const int64_t *nodes, const int64_t *versions, const int64_t *since,
                int64_t n);
/* Up to pages pages of tier to evict, one at a time, each the least recently used evictable one (the shallower on
 * a tie), none of keep: a device copy of an unlocked, unpinned page whose children left the device, and which has
 * a host copy or (may_drop) whose children all leave; a host copy of an unpinned page off the device, no transfer
 * reading it, whose children all leave. Writes plan (room for pages) and returns its length, or TIER_NO_MEMORY.
 * Changes nothing: the caller applies it. */
int64_t tier_plan(const tier_index *index, int tier, int64_t pages, int may_drop, const int64_t *keep, int64_t n_keep,
                  int64_t *plan);
/* the unlocked, unpinned device pages with no host copy and no child on the device, least recently used first (the
 * shallower on a tie): at most room of them to out; returns how many are written, or TIER_NO_MEMORY */
int64_t tier_unbacked(const tier_index *index, int64_t *out, int64_t room);
/* every page (not the roots), by node: nodes[i] and its TIER_FIELDS fields values[i * TIER_FIELDS + f]; returns the
 * page count, or -needed when capacity is short */
int64_t tier_export(const tier_index *index, int64_t *nodes, int64_t *values, int64_t capacity);
/* out[0]: pages, out[1]: pages with a lock, out[2]: roots */
void tier_counts(const tier_index *index, int64_t *out);
/* free every node (roots too) */
void tier_reset(tier_index *index);
/* TIER_OK, or TIER_CORRUPT with a message naming the broken invariant */
int tier_check(const tier_index *index, char *message, int64_t capacity);
/* cdef-end */

#endif
