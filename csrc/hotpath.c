/* The hot path of the optimized prefix cache (optimized/radix_cache.py): a CPython extension,
 * ``radixspec.optimized._hotpath``, whose methods are called with vectorcall and call the C tree (csrc/tree.c)
 * directly, with the GIL held, instead of through cffi.
 *
 *   Core          the C base class of RadixPrefixCache: its clock, roots, events, the counter's table (of
 *                 Counts), its mutex, and match_prefix / insert_prefix / evict. Each takes the common case whole
 *                 in C (a torch tensor, a list or tuple of ints, or a buffer of native int32/int64; a namespace
 *                 that holds pages; no events; the counters' entry present; an exact int size, an int32 out=)
 *                 and hands every other call, unchanged, to the Python method of the same operation
 *                 (``_match_prefix``, ``_insert_prefix``, ``_evict``), which checks and raises as the spec says.
 *                 Nothing is changed before the hand-over: the tree's calls check everything first and change
 *                 nothing on error.
 *   Handle        the C base class of RadixCacheHandle (cached_len, node, version, namespace, cache).
 *   Counts        the C base class of the cache's per-namespace counters (spec/metrics.py's NamespaceStats
 *                 fields, as C integers): the hot path counts without making Python ints.
 *   Mutex         the lock of a cache (``with cache._mutex``): a threading.RLock and how deep it is held. A
 *                 call takes the hot path only while no Python method of the cache holds it; once past that
 *                 check it runs no Python code (so no other thread runs) until the tree has changed and the
 *                 clock, the counters and the handle say so.
 *   read_int64    lists and tuples of exact ints into an int64 buffer (the Python methods' list reader).
 *
 * setup(...) binds the tree's functions (their addresses, from cffi), torch's Tensor and dtypes and the
 * result classes, once per process, from optimized/radix_cache.py. torch is read by name through its
 * attribute descriptors (``dtype``, ``is_cpu``, ``ndim``, ``is_contiguous``, ``data_ptr``, ``numel``), not
 * through its C++ headers: the build does not depend on the torch version (a torch without one of them: tensors
 * go to the Python methods). A free-threaded CPython build
 * (no GIL) always takes the Python methods. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#include "tree.h"

/* the spec's bounds (radixspec.spec.domains): NAMESPACE_DEPTH_LIMIT, and the tree's root-less node */
#define NAMESPACE_DEPTH_LIMIT 32
#define ROOT_NODE (-1)
/* evict sizes above this go to the Python method (radix_cache._LARGE_EVICT: checked before a buffer is made) */
#define LARGE_EVICT (1 << 20)

typedef int (*match_fn)(radix_tree *, int64_t, const void *, int32_t, int64_t, int64_t, int64_t, radix_tree_walk *);
typedef int (*insert_fn)(radix_tree *, int64_t, const void *, int32_t, const void *, int32_t, int64_t, int64_t, int64_t,
                         radix_tree_walk *);
typedef int (*evict_fn)(radix_tree *, int64_t, int32_t *, int64_t *, int64_t, int64_t *);
typedef int (*drop_root_fn)(radix_tree *, int64_t);
#ifdef __GNUC__
_Static_assert(__builtin_types_compatible_p(__typeof__(&radix_tree_match), match_fn), "radix_tree_match's type");
_Static_assert(__builtin_types_compatible_p(__typeof__(&radix_tree_insert), insert_fn), "radix_tree_insert's type");
_Static_assert(__builtin_types_compatible_p(__typeof__(&radix_tree_evict), evict_fn), "radix_tree_evict's type");
_Static_assert(__builtin_types_compatible_p(__typeof__(&radix_tree_drop_root), drop_root_fn), "drop_root's type");
#endif

/* ------------------------------------------------------------------ bound once by setup() */

static struct {
    int ready;
    match_fn match;
    insert_fn insert;
    evict_fn evict;
    drop_root_fn drop_root;
    PyObject *new_slots;
    PyTypeObject *tensor_type;
    PyObject *int32, *int64;
    getter get_dtype, get_is_cpu, get_ndim;
    void *dtype_closure, *is_cpu_closure, *ndim_closure;
    PyObject *is_contiguous, *data_ptr, *numel;
    PyTypeObject *handle_type, *insert_result_type;
} bound;

static PyObject *s_match_slow, *s_insert_slow, *s_evict_slow, *s_size, *s_out, *s_input_ids, *s_indices, *s_namespace, *s_acquire, *s_release;

/* ------------------------------------------------------------------ read_int64 */

/* an exact int's value when it fits in int64: 1, else 0. One or two digits are read in place (token ids and
 * slots are small); any other size goes through PyLong_AsLongLongAndOverflow. */
static inline int small_int_value(PyObject *item, int64_t *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)item);
        return 1;
    }
#elif PyLong_SHIFT == 30
    Py_ssize_t size = Py_SIZE(item);
    const digit *digits = ((PyLongObject *)item)->ob_digit;
    if (size == 1) {
        *out = (int64_t)digits[0];
        return 1;
    }
    if (size == 0) {
        *out = 0;
        return 1;
    }
    if (size == 2) {
        *out = (int64_t)digits[0] | ((int64_t)digits[1] << PyLong_SHIFT);
        return 1;
    }
#endif
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    *out = (int64_t)value;
    return !overflow;
}

/* values (an exact list or tuple) into out[0..n): n, or -1 - i for the first item i that is not an exact int
 * that fits in int64 (the items before it written). No Python code runs: the list cannot change under it. */
static Py_ssize_t read_list(PyObject *values, int64_t *out) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    PyObject **items = PySequence_Fast_ITEMS(values);
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item) || !small_int_value(item, &out[i])) {
            return -1 - i;
        }
    }
    return n;
}

static PyObject *read_int64(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "read_int64(values, address, capacity) takes 3 arguments");
        return NULL;
    }
    PyObject *values = args[0];
    if (!PyList_CheckExact(values) && !PyTuple_CheckExact(values)) {
        PyErr_SetString(PyExc_TypeError, "read_int64: values must be a list or a tuple");
        return NULL;
    }
    int64_t *out = (int64_t *)PyLong_AsVoidPtr(args[1]);
    Py_ssize_t capacity = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (out == NULL || capacity < PySequence_Fast_GET_SIZE(values)) {
        PyErr_SetString(PyExc_ValueError, "read_int64: the buffer is null or too small");
        return NULL;
    }
    return PyLong_FromSsize_t(read_list(values, out));
}

/* ------------------------------------------------------------------ Mutex */

typedef struct {
    PyObject_HEAD
    PyObject *lock;
    Py_ssize_t held;
} Mutex;

static int mutex_init(Mutex *self, PyObject *args, PyObject *kwargs) {
    PyObject *lock;
    static char *names[] = {"lock", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Mutex", names, &lock)) {
        return -1;
    }
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "Mutex: cannot change the lock while it is held");
        return -1;
    }
    Py_INCREF(lock);
    Py_XSETREF(self->lock, lock);
    return 0;
}

static PyObject *mutex_enter(Mutex *self, PyObject *unused) {
    (void)unused;
    if (self->lock == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Mutex: no lock");
        return NULL;
    }
    PyObject *got = PyObject_CallMethodNoArgs(self->lock, s_acquire);
    if (got == NULL) {
        return NULL;
    }
    Py_DECREF(got);
    self->held += 1;
    Py_RETURN_NONE;
}

static PyObject *mutex_exit(Mutex *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)args;
    (void)nargs;
    if (self->lock == NULL || self->held == 0) {
        PyErr_SetString(PyExc_RuntimeError, "Mutex: released without being held");
        return NULL;
    }
    self->held -= 1;
    PyObject *done = PyObject_CallMethodNoArgs(self->lock, s_release);
    if (done == NULL) {
        self->held += 1;
        return NULL;
    }
    Py_DECREF(done);
    Py_RETURN_FALSE;
}

static int mutex_traverse(Mutex *self, visitproc visit, void *arg) {
    Py_VISIT(self->lock);
    return 0;
}

static int mutex_clear(Mutex *self) {
    Py_CLEAR(self->lock);
    return 0;
}

static void mutex_dealloc(Mutex *self) {
    PyObject_GC_UnTrack(self);
    mutex_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef mutex_methods[] = {
    {"__enter__", (PyCFunction)mutex_enter, METH_NOARGS, "Acquire the lock."},
    {"__exit__", (PyCFunction)(void (*)(void))mutex_exit, METH_FASTCALL, "Release the lock."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef mutex_members[] = {
    {"held", T_PYSSIZET, offsetof(Mutex, held), READONLY, "how many times the lock is held (by its one owner)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject MutexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "radixspec.optimized._hotpath.Mutex",
    .tp_basicsize = sizeof(Mutex),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Mutex(lock): a context manager over a threading.RLock that counts how deep it is held.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mutex_init,
    .tp_dealloc = (destructor)mutex_dealloc,
    .tp_traverse = (traverseproc)mutex_traverse,
    .tp_clear = (inquiry)mutex_clear,
    .tp_methods = mutex_methods,
    .tp_members = mutex_members,
};

/* ------------------------------------------------------------------ Handle */

typedef struct {
    PyObject_HEAD
    PyObject *cached_len, *node, *version, *namespace, *cache;
} Handle;

static int handle_init(Handle *self, PyObject *args, PyObject *kwargs) {
    PyObject *cached_len, *node, *version, *namespace, *cache;
    static char *names[] = {"cached_len", "node", "version", "namespace", "cache", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO", names, &cached_len, &node, &version, &namespace,
                                     &cache)) {
        return -1;
    }
    Py_INCREF(cached_len);
    Py_XSETREF(self->cached_len, cached_len);
    Py_INCREF(node);
    Py_XSETREF(self->node, node);
    Py_INCREF(version);
    Py_XSETREF(self->version, version);
    Py_INCREF(namespace);
    Py_XSETREF(self->namespace, namespace);
    Py_INCREF(cache);
    Py_XSETREF(self->cache, cache);
    return 0;
}

static int handle_traverse(Handle *self, visitproc visit, void *arg) {
    /* (a subclass's type is visited by subtype_traverse) */
    Py_VISIT(self->cached_len);
    Py_VISIT(self->node);
    Py_VISIT(self->version);
    Py_VISIT(self->namespace);
    Py_VISIT(self->cache);
    return 0;
}

static int handle_clear(Handle *self) {
    Py_CLEAR(self->cached_len);
    Py_CLEAR(self->node);
    Py_CLEAR(self->version);
    Py_CLEAR(self->namespace);
    Py_CLEAR(self->cache);
    return 0;
}

static void handle_dealloc(Handle *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    handle_clear(self);
    /* a subclass's instance: subtype_dealloc drops the reference to its type after this */
    type->tp_free((PyObject *)self);
}

static PyMemberDef handle_members[] = {
    {"cached_len", T_OBJECT_EX, offsetof(Handle, cached_len), 0, "tokens matched (page aligned)"},
    {"node", T_OBJECT_EX, offsetof(Handle, node), 0, "the C tree's node the path ends at (-1: nothing matched)"},
    {"version", T_OBJECT_EX, offsetof(Handle, version), 0, "the node's version (a freed node's is bumped)"},
    {"namespace", T_OBJECT_EX, offsetof(Handle, namespace), 0, "the namespace of the path"},
    {"cache", T_OBJECT_EX, offsetof(Handle, cache), 0, "the cache the path is in"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "radixspec.optimized._hotpath.Handle",
    .tp_basicsize = sizeof(Handle),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Handle(cached_len, node, version, namespace, cache): the fields of RadixCacheHandle.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)handle_init,
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_traverse = (traverseproc)handle_traverse,
    .tp_clear = (inquiry)handle_clear,
    .tp_members = handle_members,
};

/* ------------------------------------------------------------------ Counts */

/* The counters of one namespace (spec/metrics.py, NamespaceStats' fields) as C integers: the C base class of the
 * cache's NamespaceStats, so that the hot path counts without making Python ints. */
typedef struct {
    PyObject_HEAD
    long long match_requests, hit_requests, match_tokens, hit_tokens, pages_stored, pages_evicted, pages_dropped;
} Counts;

static PyMemberDef counts_members[] = {
    {"match_requests", T_LONGLONG, offsetof(Counts, match_requests), 0, "match_prefix calls"},
    {"hit_requests", T_LONGLONG, offsetof(Counts, hit_requests), 0, "match_prefix calls that found a page"},
    {"match_tokens", T_LONGLONG, offsetof(Counts, match_tokens), 0, "tokens asked"},
    {"hit_tokens", T_LONGLONG, offsetof(Counts, hit_tokens), 0, "tokens matched"},
    {"pages_stored", T_LONGLONG, offsetof(Counts, pages_stored), 0, "pages an insert cached"},
    {"pages_evicted", T_LONGLONG, offsetof(Counts, pages_evicted), 0, "pages evict took"},
    {"pages_dropped", T_LONGLONG, offsetof(Counts, pages_dropped), 0, "pages reset dropped"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CountsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "radixspec.optimized._hotpath.Counts",
    .tp_basicsize = sizeof(Counts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The counters of one namespace as C integers (the fields of spec.metrics.NamespaceStats).",
    .tp_new = PyType_GenericNew,
    .tp_members = counts_members,
};

/* ------------------------------------------------------------------ Core */

typedef struct {
    int64_t *values;
    Py_ssize_t capacity;
} Room;

typedef struct {
    PyObject_HEAD
    radix_tree *tree;
    PyObject *tree_owner;
    int64_t page_size;
    long long clock;
    long long evict_clock_sum;
    int on_host;
    int entered;
    PyObject *roots, *namespace_of, *events, *counts, *mutex;
    Room token_room, slot_room;
    /* roots an evict emptied (room for every root) */
    int64_t *emptied;
    Py_ssize_t emptied_capacity;
} Core;

/* What one argument gave: a pointer and count for the tree, its width in bytes, and the buffer to release. */
typedef struct {
    const void *data;
    Py_ssize_t n;
    int32_t width;
    int has_view;
    Py_buffer view;
} Input;

static int room_fit(Room *room, Py_ssize_t n) {
    if (n <= room->capacity) {
        return 0;
    }
    Py_ssize_t capacity = n < 256 ? 256 : 2 * n;
    int64_t *values = PyMem_Realloc(room->values, (size_t)capacity * sizeof(int64_t));
    if (values == NULL) {
        return -1;
    }
    room->values = values;
    room->capacity = capacity;
    return 0;
}

/* a torch tensor's attribute through its type's descriptor (no lookup): a new reference, or NULL */
static PyObject *call_getter(getter get, void *closure, PyObject *tensor) {
    return get(tensor, closure);
}

static long long call_method_ll(PyObject *method, PyObject *tensor) {
    PyObject *result = PyObject_Vectorcall(method, &tensor, 1, NULL);
    if (result == NULL) {
        return -1;
    }
    long long value = PyLong_AsLongLong(result);
    Py_DECREF(result);
    return value;
}

/* A 1-D contiguous int32/int64 CPU tensor (exactly torch.Tensor) read in place: 1, 0 when it is not one, -1 on
 * an error (cleared: the Python method then checks the same tensor). */
static int read_tensor(PyObject *tensor, Input *input) {
    PyObject *dtype = call_getter(bound.get_dtype, bound.dtype_closure, tensor);
    if (dtype == NULL) {
        return -1;
    }
    int32_t width = dtype == bound.int64 ? 8 : dtype == bound.int32 ? 4 : 0;
    Py_DECREF(dtype);
    if (width == 0) {
        return 0;
    }
    PyObject *is_cpu = call_getter(bound.get_is_cpu, bound.is_cpu_closure, tensor);
    if (is_cpu == NULL) {
        return -1;
    }
    Py_DECREF(is_cpu);
    if (is_cpu != Py_True) {
        return 0;
    }
    PyObject *ndim = call_getter(bound.get_ndim, bound.ndim_closure, tensor);
    if (ndim == NULL) {
        return -1;
    }
    long dims = PyLong_AsLong(ndim);
    Py_DECREF(ndim);
    if (dims != 1) {
        return dims == -1 && PyErr_Occurred() ? -1 : 0;
    }
    PyObject *contiguous = PyObject_Vectorcall(bound.is_contiguous, &tensor, 1, NULL);
    if (contiguous == NULL) {
        return -1;
    }
    Py_DECREF(contiguous);
    if (contiguous != Py_True) {
        return 0;
    }
    long long n = call_method_ll(bound.numel, tensor);
    if (n < 0) {
        return -1;
    }
    PyObject *address = PyObject_Vectorcall(bound.data_ptr, &tensor, 1, NULL);
    if (address == NULL) {
        return -1;
    }
    void *data = PyLong_AsVoidPtr(address);
    Py_DECREF(address);
    if (data == NULL && PyErr_Occurred()) {
        return -1;
    }
    input->data = data;
    input->n = (Py_ssize_t)n;
    input->width = width;
    return 1;
}

/* a buffer of native int32/int64, 1-D and contiguous (numpy, array('q' / 'l' / 'i')), as radix_cache.int_view
 * takes it: 1, 0 when it is not one (nothing held), -1 on an error */
static int read_buffer(PyObject *values, Input *input) {
    PyTypeObject *type = Py_TYPE(values);
    if (type->tp_as_buffer == NULL || type->tp_as_buffer->bf_getbuffer == NULL || PyBytes_Check(values) ||
        PyByteArray_Check(values) || PyUnicode_Check(values)) {
        return 0;
    }
    if (PyObject_GetBuffer(values, &input->view, PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        return 0;
    }
    Py_buffer *view = &input->view;
    const char *format = view->format == NULL ? "B" : view->format;
    int native = strcmp(format, "q") == 0 || strcmp(format, "l") == 0 || strcmp(format, "i") == 0;
    if (view->ndim != 1 || !native || (view->itemsize != 4 && view->itemsize != 8) ||
        !PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        return 0;
    }
    input->has_view = 1;
    input->data = view->buf;
    input->n = view->shape[0];
    input->width = (int32_t)view->itemsize;
    return 1;
}

/* one argument (token ids or slots) for the tree: 1, or 0 when the Python method must take the call */
static int read_input(PyObject *values, Room *room, Input *input) {
    input->has_view = 0;
    if (Py_IS_TYPE(values, bound.tensor_type)) {
        int read = read_tensor(values, input);
        if (read < 0) {
            PyErr_Clear();
        }
        return read > 0;
    }
    if (PyList_CheckExact(values) || PyTuple_CheckExact(values)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
        if (room_fit(room, n) < 0) {
            return 0;
        }
        if (read_list(values, room->values) != n) {
            return 0;
        }
        input->data = room->values;
        input->n = n;
        input->width = 8;
        return 1;
    }
    return read_buffer(values, input);
}

static void release_input(Input *input) {
    if (input->has_view) {
        input->has_view = 0;
        PyBuffer_Release(&input->view);
    }
}

/* namespace in the spec's domain (None, or tuples of exact str / bytes / int nested at most
 * NAMESPACE_DEPTH_LIMIT deep): 1, else 0 (the Python method raises the spec's error) */
static int in_namespace_domain(PyObject *value, int depth) {
    if (!PyTuple_CheckExact(value)) {
        return PyUnicode_CheckExact(value) || PyBytes_CheckExact(value) || PyLong_CheckExact(value);
    }
    if (depth > NAMESPACE_DEPTH_LIMIT) {
        return 0;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(value);
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!in_namespace_domain(PyTuple_GET_ITEM(value, i), depth + 1)) {
            return 0;
        }
    }
    return 1;
}

/* the arguments of a call by name: positional first, then keywords; 0 when they do not fit (the Python method
 * then raises Python's own TypeError) */
static int bind_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **names,
                          Py_ssize_t n_names, Py_ssize_t required, PyObject **out) {
    if (nargs > n_names) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n_names; ++i) {
        out[i] = i < nargs ? args[i] : NULL;
    }
    Py_ssize_t n_kw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < n_kw; ++k) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t slot = -1;
        for (Py_ssize_t i = 0; i < n_names; ++i) {
            if (name == names[i] || PyUnicode_Compare(name, names[i]) == 0) {
                slot = i;
                break;
            }
        }
        if (slot < 0 || out[slot] != NULL) {
            return 0;
        }
        out[slot] = args[nargs + k];
    }
    for (Py_ssize_t i = 0; i < required; ++i) {
        if (out[i] == NULL) {
            return 0;
        }
    }
    return 1;
}

/* the Python method of the same operation, with the very same arguments */
static PyObject *hand_over(Core *self, PyObject *method, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    Py_ssize_t n_kw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *stack[8];
    if (nargs + n_kw + 1 > 8) {
        PyObject *found = PyObject_GetAttr((PyObject *)self, method);
        if (found == NULL) {
            return NULL;
        }
        PyObject *result = PyObject_Vectorcall(found, args, (size_t)nargs, kwnames);
        Py_DECREF(found);
        return result;
    }
    stack[0] = (PyObject *)self;
    for (Py_ssize_t i = 0; i < nargs + n_kw; ++i) {
        stack[i + 1] = args[i];
    }
    return PyObject_VectorcallMethod(method, stack, (size_t)(nargs + 1), kwnames);
}

/* The counters of namespace (borrowed), or NULL when the hot path cannot count there (no entry yet: the Python
 * method makes it, maybe retiring others) */
static Counts *counts_of(Core *self, PyObject *namespace) {
    if (self->counts == NULL || !PyDict_CheckExact(self->counts)) {
        return NULL;
    }
    PyObject *stats = PyDict_GetItemWithError(self->counts, namespace);
    if (stats == NULL || !PyObject_TypeCheck(stats, &CountsType)) {
        PyErr_Clear();
        return NULL;
    }
    return (Counts *)stats;
}

/* whether a call may take the hot path now: bound, on a GIL build, no Python method of this cache running */
static int hot_path_open(Core *self) {
#ifdef Py_GIL_DISABLED
    (void)self;
    return 0;
#else
    return bound.ready && self->tree != NULL && !self->entered && self->mutex != NULL &&
           Py_IS_TYPE(self->mutex, &MutexType) && self->roots != NULL && PyDict_CheckExact(self->roots);
#endif
}

/* the root of namespace, or -1 when it holds no page (the Python method takes the call) */
static int64_t root_of(Core *self, PyObject *namespace) {
    PyObject *root = PyDict_GetItemWithError(self->roots, namespace);
    if (root == NULL || !PyLong_CheckExact(root)) {
        PyErr_Clear();
        return -1;
    }
    long long value = PyLong_AsLongLong(root);
    if (value < 0) {
        PyErr_Clear();
        return -1;
    }
    return value;
}

static Handle *new_handle(void) {
    return (Handle *)bound.handle_type->tp_alloc(bound.handle_type, 0);
}

/* fill a handle made by new_handle: 0, or -1 with an error set */
static int fill_handle(Handle *handle, long long cached_len, long long node, long long version, PyObject *namespace,
                       Core *cache) {
    handle->cached_len = PyLong_FromLongLong(cached_len);
    handle->node = PyLong_FromLongLong(node);
    handle->version = PyLong_FromLongLong(version);
    if (handle->cached_len == NULL || handle->node == NULL || handle->version == NULL) {
        return -1;
    }
    Py_INCREF(namespace);
    handle->namespace = namespace;
    Py_INCREF(cache);
    handle->cache = (PyObject *)cache;
    return 0;
}

static PyObject *core_match_prefix(Core *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *names[2] = {s_input_ids, s_namespace};
    PyObject *given[2];
    if (!hot_path_open(self) || !bind_arguments(args, nargs, kwnames, names, 2, 1, given)) {
        return hand_over(self, s_match_slow, args, nargs, kwnames);
    }
    PyObject *namespace = given[1] == NULL ? Py_None : given[1];
    if (namespace != Py_None && !in_namespace_domain(namespace, 1)) {
        return hand_over(self, s_match_slow, args, nargs, kwnames);
    }
    self->entered = 1;
    Input tokens;
    Handle *handle = NULL;
    if (!read_input(given[0], &self->token_room, &tokens)) {
        goto hand_over;
    }
    if (tokens.n < self->page_size) {
        goto hand_over;
    }
    /* allocated before the tree is looked at: an allocation may collect garbage, and so run Python code */
    handle = new_handle();
    if (handle == NULL) {
        PyErr_Clear();
        goto hand_over;
    }
    /* from here to the tree's change, no Python code runs: no other thread can come between */
    if (((Mutex *)self->mutex)->held) {
        goto hand_over;
    }
    int64_t root = root_of(self, namespace);
    Counts *counts = root < 0 ? NULL : counts_of(self, namespace);
    if (counts == NULL) {
        goto hand_over;
    }
    int64_t n = tokens.n;
    radix_tree_walk walk;
    int status =
        bound.match(self->tree, root, tokens.data, tokens.width, n - n % self->page_size, n, self->clock, &walk);
    if (status != RADIX_TREE_OK) {
        goto hand_over; /* nothing changed: the Python method raises the error */
    }
    self->clock += 1;
    release_input(&tokens);
    self->entered = 0;
    int64_t length = walk.length;
    counts->match_requests += 1;
    counts->match_tokens += n;
    if (length) {
        counts->hit_requests += 1;
        counts->hit_tokens += length;
    }
    if (fill_handle(handle, length, length ? walk.node : ROOT_NODE, length ? walk.version : 0, namespace, self)) {
        Py_DECREF(handle);
        return NULL;
    }
    return (PyObject *)handle;

hand_over:
    Py_XDECREF(handle);
    release_input(&tokens);
    self->entered = 0;
    return hand_over(self, s_match_slow, args, nargs, kwnames);
}

static PyObject *core_insert_prefix(Core *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *names[3] = {s_input_ids, s_indices, s_namespace};
    PyObject *given[3];
    if (!hot_path_open(self) || !self->on_host || self->events != Py_None ||
        !bind_arguments(args, nargs, kwnames, names, 3, 2, given)) {
        return hand_over(self, s_insert_slow, args, nargs, kwnames);
    }
    PyObject *namespace = given[2] == NULL ? Py_None : given[2];
    if (namespace != Py_None && !in_namespace_domain(namespace, 1)) {
        return hand_over(self, s_insert_slow, args, nargs, kwnames);
    }
    self->entered = 1;
    Input tokens, slots;
    slots.has_view = 0;
    Handle *handle = NULL;
    PyObject *result = NULL;
    if (!read_input(given[0], &self->token_room, &tokens) || !read_input(given[1], &self->slot_room, &slots)) {
        goto hand_over;
    }
    int64_t n = tokens.n;
    int64_t end = n - n % self->page_size;
    if (slots.n != n || end == 0) {
        goto hand_over;
    }
    handle = new_handle();
    result = handle == NULL ? NULL : bound.insert_result_type->tp_alloc(bound.insert_result_type, 2);
    if (result == NULL) {
        PyErr_Clear();
        goto hand_over;
    }
    /* from here to the tree's change, no Python code runs */
    if (((Mutex *)self->mutex)->held) {
        goto hand_over;
    }
    int64_t root = root_of(self, namespace);
    Counts *counts = root < 0 ? NULL : counts_of(self, namespace);
    if (counts == NULL) {
        goto hand_over;
    }
    radix_tree_walk walk;
    int status = bound.insert(self->tree, root, tokens.data, tokens.width, slots.data, slots.width, end, n,
                              self->clock, &walk);
    if (status != RADIX_TREE_OK) {
        goto hand_over; /* nothing changed: the Python method raises the error */
    }
    self->clock += 1;
    release_input(&tokens);
    release_input(&slots);
    self->entered = 0;
    int64_t cached_len = walk.length;
    counts->pages_stored += (end - cached_len) / self->page_size;
    PyObject *boxed = PyLong_FromLongLong(cached_len);
    if (fill_handle(handle, end, walk.node, walk.version, namespace, self) || boxed == NULL) {
        Py_XDECREF(boxed);
        Py_DECREF(handle);
        Py_DECREF(result);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 0, boxed);
    PyTuple_SET_ITEM(result, 1, (PyObject *)handle);
    return result;

hand_over:
    Py_XDECREF(result);
    Py_XDECREF(handle);
    release_input(&tokens);
    release_input(&slots);
    self->entered = 0;
    return hand_over(self, s_insert_slow, args, nargs, kwnames);
}

/* after an evict that emptied roots: each namespace whose last page went keeps no root (as _drop_root does);
 * 0, or -1 with an error set (the tables disagree: IntegrityError's job, raised by the caller's check) */
static int drop_emptied_roots(Core *self, int64_t n_emptied) {
    for (int64_t k = 0; k < n_emptied; ++k) {
        PyObject *root = PyLong_FromLongLong(self->emptied[k]);
        if (root == NULL) {
            return -1;
        }
        PyObject *namespace = PyDict_GetItemWithError(self->namespace_of, root);
        if (namespace == NULL) {
            Py_DECREF(root);
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "evict: an emptied root has no namespace");
            }
            return -1;
        }
        Py_INCREF(namespace);
        int status = PyDict_DelItem(self->roots, namespace) || PyDict_DelItem(self->namespace_of, root);
        Py_DECREF(namespace);
        Py_DECREF(root);
        if (status || bound.drop_root(self->tree, self->emptied[k]) != RADIX_TREE_OK) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "evict: the tree kept an emptied root");
            }
            return -1;
        }
    }
    return 0;
}

static PyObject *core_evict(Core *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *names[2] = {s_size, s_out};
    PyObject *given[2];
    if (!hot_path_open(self) || !self->on_host || self->events != Py_None || self->namespace_of == NULL ||
        !PyDict_CheckExact(self->namespace_of) || !bind_arguments(args, nargs, kwnames, names, 2, 1, given) ||
        !PyLong_CheckExact(given[0])) {
        return hand_over(self, s_evict_slow, args, nargs, kwnames);
    }
    int overflow = 0;
    long long size = PyLong_AsLongLongAndOverflow(given[0], &overflow);
    if (overflow || size < 0 || size > LARGE_EVICT) {
        PyErr_Clear();
        return hand_over(self, s_evict_slow, args, nargs, kwnames);
    }
    int64_t p = self->page_size;
    int64_t pages = (size + p - 1) / p;
    PyObject *out = given[1] == NULL ? Py_None : given[1];
    self->entered = 1;
    PyObject *slots = NULL;
    Input buffer;
    buffer.has_view = 0;
    if (out == Py_None) {
        /* a new tensor of exactly the slots (allocated before the tree is looked at: it may run Python code) */
        PyObject *count = PyLong_FromLongLong(pages * p);
        if (count == NULL) {
            PyErr_Clear();
            goto hand_over;
        }
        slots = PyObject_Vectorcall(bound.new_slots, &count, 1, NULL);
        Py_DECREF(count);
        if (slots == NULL) {
            PyErr_Clear();
            goto hand_over;
        }
    } else {
        Py_INCREF(out);
        slots = out;
    }
    /* the slots' buffer: a 1-D contiguous int32 CPU tensor of room for every slot, else the Python method says why */
    if (!Py_IS_TYPE(slots, bound.tensor_type) || read_tensor(slots, &buffer) != 1 || buffer.width != 4 ||
        buffer.n < pages * p || (pages > 0 && buffer.data == NULL)) {
        PyErr_Clear();
        goto hand_over;
    }
    Py_ssize_t roots = PyDict_GET_SIZE(self->roots);
    if (self->emptied_capacity < roots) {
        Py_ssize_t capacity = 2 * roots < 16 ? 16 : 2 * roots;
        int64_t *grown = PyMem_Realloc(self->emptied, (size_t)capacity * sizeof(int64_t));
        if (grown == NULL) {
            goto hand_over;
        }
        self->emptied = grown;
        self->emptied_capacity = capacity;
    }
    /* from here to the tree's change, no Python code runs */
    if (((Mutex *)self->mutex)->held) {
        goto hand_over;
    }
    int64_t n_emptied = 0;
    int status = bound.evict(self->tree, pages, (int32_t *)buffer.data, self->emptied, self->emptied_capacity,
                             &n_emptied);
    if (status == RADIX_TREE_NOT_EVICTABLE || status == RADIX_TREE_BAD_ARGS) {
        goto hand_over; /* refused before anything changed: the Python method raises the error */
    }
    if (status == RADIX_TREE_OK || status == RADIX_TREE_ROOTS_EMPTIED) {
        self->evict_clock_sum += self->clock * pages;
    }
    /* a failure half way (a corrupted tree, no memory) may have evicted, and emptied roots, already: as the Python
     * method does, the emptied roots go, then the status's error is raised (by the Python method that maps it) */
    int dropped = drop_emptied_roots(self, n_emptied);
    self->entered = 0;
    if (dropped < 0 || (status != RADIX_TREE_OK && status != RADIX_TREE_ROOTS_EMPTIED)) {
        Py_DECREF(slots);
        if (dropped < 0) {
            return NULL;
        }
        PyObject *raised = PyObject_CallMethod((PyObject *)self, "_raise_for", "i", status);
        Py_XDECREF(raised);
        if (raised != NULL) {
            PyErr_Format(PyExc_RuntimeError, "evict: the tree's status %d raised nothing", status);
        }
        return NULL;
    }
    return slots;

hand_over:
    Py_XDECREF(slots);
    self->entered = 0;
    return hand_over(self, s_evict_slow, args, nargs, kwnames);
}

static PyObject *core_bind_tree(Core *self, PyObject *args) {
    PyObject *owner;
    unsigned long long address;
    long long page_size;
    int on_host;
    if (!PyArg_ParseTuple(args, "OKLp:_bind_tree", &owner, &address, &page_size, &on_host)) {
        return NULL;
    }
    if (self->tree != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_bind_tree: this cache's tree is bound already");
        return NULL;
    }
    if (address == 0 || page_size < 1) {
        PyErr_SetString(PyExc_ValueError, "_bind_tree: a null tree or a page size below 1");
        return NULL;
    }
    Py_INCREF(owner);
    self->tree_owner = owner;
    self->tree = (radix_tree *)(uintptr_t)address;
    self->page_size = page_size;
    self->on_host = on_host;
    Py_RETURN_NONE;
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    Core *self = (Core *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    Py_INCREF(Py_None);
    self->events = Py_None;
    return (PyObject *)self;
}

static int core_traverse(Core *self, visitproc visit, void *arg) {
    Py_VISIT(self->roots);
    Py_VISIT(self->namespace_of);
    Py_VISIT(self->events);
    Py_VISIT(self->counts);
    Py_VISIT(self->mutex);
    Py_VISIT(self->tree_owner);
    return 0;
}

static int core_clear(Core *self) {
    Py_CLEAR(self->roots);
    Py_CLEAR(self->namespace_of);
    Py_CLEAR(self->events);
    Py_CLEAR(self->counts);
    Py_CLEAR(self->mutex);
    /* the tree is freed with its owner: never use it after */
    self->tree = NULL;
    Py_CLEAR(self->tree_owner);
    return 0;
}

static void core_dealloc(Core *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    core_clear(self);
    PyMem_Free(self->token_room.values);
    PyMem_Free(self->slot_room.values);
    PyMem_Free(self->emptied);
    /* a subclass's instance: subtype_dealloc drops the reference to its type after this */
    type->tp_free((PyObject *)self);
}

static PyMethodDef core_methods[] = {
    {"match_prefix", (PyCFunction)(void (*)(void))core_match_prefix, METH_FASTCALL | METH_KEYWORDS,
     "match_prefix($self, input_ids, namespace=None)\n--\n\n"
     "Longest cached page-aligned prefix; stamps its nodes, splitting the last one if needed."},
    {"insert_prefix", (PyCFunction)(void (*)(void))core_insert_prefix, METH_FASTCALL | METH_KEYWORDS,
     "insert_prefix($self, input_ids, indices, namespace=None)\n--\n\n"
     "Cache the whole pages of input_ids; new pages take their slots from indices."},
    {"evict", (PyCFunction)(void (*)(void))core_evict, METH_FASTCALL | METH_KEYWORDS,
     "evict($self, size, out=None)\n--\n\n"
     "Evict exactly ceil(size / P) pages, LRU evictable leaf first; slots ascending (int32).\n\n"
     "out: for a cache on the CPU, a 1-D contiguous int32 CPU tensor of at least ceil(size / P) * P slots. The\n"
     "slots are written to its front and out itself is returned (nothing is allocated: an engine that evicts a\n"
     "page at a time keeps one buffer). Without it, a new tensor of exactly the slots."},
    {"_bind_tree", (PyCFunction)core_bind_tree, METH_VARARGS,
     "_bind_tree(owner, address, page_size, on_host): the C tree this cache drives (once)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef core_members[] = {
    {"clock", T_LONGLONG, offsetof(Core, clock), 0, "the logical clock: +1 per match_prefix and insert_prefix"},
    {"roots", T_OBJECT_EX, offsetof(Core, roots), 0, "one root per namespace that holds pages"},
    {"_namespace_of", T_OBJECT_EX, offsetof(Core, namespace_of), 0, "root id -> namespace"},
    {"_evict_clock_sum", T_LONGLONG, offsetof(Core, evict_clock_sum), 0,
     "the clock summed over evicted pages (the eviction ages' first half)"},
    {"events", T_OBJECT, offsetof(Core, events), 0, "KV events not yet taken, or None while none are emitted"},
    {"_counts", T_OBJECT_EX, offsetof(Core, counts), 0, "the counter's table: namespace -> NamespaceStats"},
    {"_mutex", T_OBJECT_EX, offsetof(Core, mutex), 0, "the cache's Mutex"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "radixspec.optimized._hotpath.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The C base class of RadixPrefixCache: match_prefix and insert_prefix on the hot path.",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_members = core_members,
};

/* ------------------------------------------------------------------ setup */

static int getset_of(PyTypeObject *type, const char *name, getter *get, void **closure) {
    PyObject *found = PyObject_GetAttrString((PyObject *)type, name);
    if (found == NULL) {
        return -1;
    }
    int ok = Py_IS_TYPE(found, &PyGetSetDescr_Type) && ((PyGetSetDescrObject *)found)->d_getset->get != NULL;
    if (ok) {
        *get = ((PyGetSetDescrObject *)found)->d_getset->get;
        *closure = ((PyGetSetDescrObject *)found)->d_getset->closure;
    }
    Py_DECREF(found);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "setup: %s.%s is not an attribute descriptor", type->tp_name, name);
        return -1;
    }
    return 0;
}

static PyObject *setup(PyObject *module, PyObject *args) {
    (void)module;
    unsigned long long match_address, insert_address, evict_address, drop_root_address;
    PyObject *tensor_type, *int32, *int64, *new_slots, *handle_type, *insert_result_type;
    if (!PyArg_ParseTuple(args, "KKKKO!OOOO!O!:setup", &match_address, &insert_address, &evict_address,
                          &drop_root_address, &PyType_Type, &tensor_type, &int32, &int64, &new_slots, &PyType_Type,
                          &handle_type, &PyType_Type, &insert_result_type)) {
        return NULL;
    }
    if (bound.ready) {
        PyErr_SetString(PyExc_RuntimeError, "setup: bound already (once per process)");
        return NULL;
    }
    PyTypeObject *handles = (PyTypeObject *)handle_type, *results = (PyTypeObject *)insert_result_type;
    if (match_address == 0 || insert_address == 0 || evict_address == 0 || drop_root_address == 0) {
        PyErr_SetString(PyExc_ValueError, "setup: a null function");
        return NULL;
    }
    if (!PyType_IsSubtype(handles, &HandleType) || handles->tp_basicsize != HandleType.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "setup: the handle class must subclass Handle with __slots__ = ()");
        return NULL;
    }
    if (!PyType_IsSubtype(results, &PyTuple_Type) || results->tp_basicsize != PyTuple_Type.tp_basicsize ||
        results->tp_itemsize != PyTuple_Type.tp_itemsize) {
        PyErr_SetString(PyExc_TypeError, "setup: the insert result must be a named tuple");
        return NULL;
    }
    /* torch's Tensor read through these attributes; a torch whose Tensor lacks one of them still works, every tensor
     * then going to the Python methods (test_hotpath.py sees the hot path take tensors on the torch installed) */
    PyTypeObject *tensors = (PyTypeObject *)tensor_type;
    int readable = getset_of(tensors, "dtype", &bound.get_dtype, &bound.dtype_closure) == 0 &&
                   getset_of(tensors, "is_cpu", &bound.get_is_cpu, &bound.is_cpu_closure) == 0 &&
                   getset_of(tensors, "ndim", &bound.get_ndim, &bound.ndim_closure) == 0 &&
                   (bound.is_contiguous = PyObject_GetAttrString(tensor_type, "is_contiguous")) != NULL &&
                   (bound.data_ptr = PyObject_GetAttrString(tensor_type, "data_ptr")) != NULL &&
                   (bound.numel = PyObject_GetAttrString(tensor_type, "numel")) != NULL;
    if (!readable) {
        PyErr_Clear();
    }
    bound.match = (match_fn)(uintptr_t)match_address;
    bound.insert = (insert_fn)(uintptr_t)insert_address;
    bound.evict = (evict_fn)(uintptr_t)evict_address;
    bound.drop_root = (drop_root_fn)(uintptr_t)drop_root_address;
    Py_INCREF(new_slots);
    bound.new_slots = new_slots;
    if (readable) {
        Py_INCREF(tensor_type);
        bound.tensor_type = tensors;
    }
    Py_INCREF(int32);
    bound.int32 = int32;
    Py_INCREF(int64);
    bound.int64 = int64;
    Py_INCREF(handle_type);
    bound.handle_type = handles;
    Py_INCREF(insert_result_type);
    bound.insert_result_type = results;
    bound.ready = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"read_int64", (PyCFunction)(void (*)(void))read_int64, METH_FASTCALL,
     "read_int64(values, address, capacity) -> n, or -1 - i for the first item i that is not an exact int64"},
    {"setup", (PyCFunction)setup, METH_VARARGS,
     "setup(match, insert, evict, drop_root, Tensor, int32, int64, new_slots, handle_class, insert_result_class): once "
     "per "
     "process, from radixspec.optimized.radix_cache"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hotpath",
    .m_doc = "The hot path of the optimized prefix cache (csrc/hotpath.c).",
    .m_size = -1,
    .m_methods = methods,
};

static int intern(PyObject **slot, const char *text) {
    *slot = PyUnicode_InternFromString(text);
    return *slot == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit__hotpath(void) {
    if (intern(&s_match_slow, "_match_prefix") || intern(&s_evict_slow, "_evict") || intern(&s_size, "size") ||
        intern(&s_out, "out") ||
        intern(&s_insert_slow, "_insert_prefix") || intern(&s_input_ids, "input_ids") ||
        intern(&s_indices, "indices") || intern(&s_namespace, "namespace") || intern(&s_acquire, "acquire") ||
        intern(&s_release, "release")) {
        return NULL;
    }
    if (PyType_Ready(&MutexType) < 0 || PyType_Ready(&HandleType) < 0 || PyType_Ready(&CountsType) < 0 ||
        PyType_Ready(&CoreType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Mutex", (PyObject *)&MutexType) < 0 ||
        PyModule_AddObjectRef(m, "Handle", (PyObject *)&HandleType) < 0 ||
        PyModule_AddObjectRef(m, "Counts", (PyObject *)&CountsType) < 0 ||
        PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
