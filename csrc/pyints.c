/* Python lists and tuples of ints into an int64 buffer, in one pass: the list input path of the optimized
 * prefix cache (optimized/radix_cache.py). A CPython extension (optimized._pyints), not cffi: cffi cannot
 * read a list's items without converting each one through Python.
 *
 *   read_int64(values, address, capacity) -> int
 *
 * values: a list or a tuple (exactly); address: the first byte of a writable int64 buffer of capacity items
 * that the caller owns. Writes values[0..n) there and returns n when every item is an exact int (not a bool,
 * not a subclass) that fits in int64; else returns -1 - i for the first item i that is not, having written
 * only what came before it (the caller then raises the spec's error for that item). Range checks (no negative
 * token, no slot past 2**31) are the tree's, in the call that reads the buffer. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    if (out == NULL || capacity < n) {
        PyErr_SetString(PyExc_ValueError, "read_int64: the buffer is null or too small");
        return NULL;
    }
    /* no Python code runs in this loop (exact ints only): the list cannot change under it */
    PyObject **items = PySequence_Fast_ITEMS(values);
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            return PyLong_FromSsize_t(-1 - i);
        }
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) {
            return PyLong_FromSsize_t(-1 - i);
        }
        out[i] = (int64_t)value;
    }
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"read_int64", (PyCFunction)(void (*)(void))read_int64, METH_FASTCALL,
     "read_int64(values, address, capacity) -> n, or -1 - i for the first item i that is not an exact int64"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pyints", "Lists of ints into int64 buffers.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__pyints(void) {
    return PyModule_Create(&module);
}
