/* One-pass CPU kernel for kvx.layouts' block gather/scatter (module kvx.layouts._native).
 *
 * gather_scatter moves "units": `per_src` source blocks that hold, in their logical element
 * order, the same elements as `per_dst` destination blocks. Each byte is read from memory once
 * and written once, like memcpy, in one of two ways:
 *
 * - in place (vLLM's receive-side post-processes: the same block is source and destination),
 *   a block is read front to back into a small cache-resident scratch, then written back
 *   through the destination's strides: the permuted writes hit lines just read;
 * - otherwise, when the two block shapes nest, the source is copied straight into the
 *   destination in one joint walk (the scratch detour costs ~25% when destination lines are not
 *   in cache); when they do not nest, through the scratch as above.
 *
 * Elements are opaque 1/2/4/8/16-byte words: nothing is computed, every bit pattern survives.
 * The caller (kvx/layouts/_kernels.py) hands over raw addresses, shapes and strides of torch
 * tensors; this module trusts them but checks every block id against the block count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "_native.h"

static atomic_llong streamed_calls; /* calls that streamed, for tests (`streamed_calls()`) */

/* Parse one side: address of its first element, shape and strides (in elements) of the whole
 * tensor with blocks on dim 0, address of its int64 block ids, blocks per unit; check the ids. */
static int parse_side(side_t *s, unsigned long long addr, PyObject *shape_obj,
                      PyObject *stride_obj, unsigned long long idx_addr, long long per,
                      long long units, long long elem, const char *name, int64_t *elems) {
    int64_t shape[MAX_DIMS + 1], stride[MAX_DIMS + 1];
    PyObject *shape_seq = PySequence_Fast(shape_obj, "shape must be a sequence");
    if (!shape_seq)
        return -1;
    PyObject *stride_seq = PySequence_Fast(stride_obj, "strides must be a sequence");
    if (!stride_seq) {
        Py_DECREF(shape_seq);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(shape_seq);
    int ok = n >= 1 && n <= MAX_DIMS + 1 && n == PySequence_Fast_GET_SIZE(stride_seq) && per >= 1;
    *elems = 1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        shape[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(shape_seq, i));
        stride[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(stride_seq, i)) * elem;
        ok = !PyErr_Occurred() && shape[i] >= (i ? 1 : 0) && stride[i] >= 0;
        *elems *= ok && i ? shape[i] : 1;
    }
    Py_DECREF(shape_seq);
    Py_DECREF(stride_seq);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError,
                         "%s: need blocks plus <= %d dims of size >= 1, strides >= 0 and blocks "
                         "per unit >= 1", name, MAX_DIMS);
        return -1;
    }
    s->base = (char *)(uintptr_t)addr;
    s->block_stride = stride[0];
    s->idx = (const int64_t *)(uintptr_t)idx_addr;
    s->per = per;
    s->ndim = (int)n - 1;
    memcpy(s->shape, shape + 1, (size_t)s->ndim * sizeof(int64_t));
    memcpy(s->stride, stride + 1, (size_t)s->ndim * sizeof(int64_t));
    for (int64_t i = 0; i < per * units; i++) {
        if (s->idx[i] < 0 || s->idx[i] >= shape[0]) {
            PyErr_Format(PyExc_IndexError, "%s: block id %lld is out of range for %lld blocks",
                         name, (long long)s->idx[i], (long long)shape[0]);
            return -1;
        }
    }
    return 0;
}

static int compare_ids(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* For in-place calls: the ids sorted (blocks visited in address order) without repeats, which
 * would otherwise be transformed twice. Returns a malloc'ed array and sets *units. */
static int64_t *unique_ids(const int64_t *ids, long long *units) {
    int64_t *out = malloc((size_t)(*units ? *units : 1) * sizeof(int64_t));
    if (!out)
        return NULL;
    memcpy(out, ids, (size_t)*units * sizeof(int64_t));
    qsort(out, (size_t)*units, sizeof(int64_t), compare_ids);
    long long n = 0;
    for (long long i = 0; i < *units; i++)
        if (n == 0 || out[i] != out[n - 1])
            out[n++] = out[i];
    *units = n;
    return out;
}

/* The body of both entry points: the same geometry and ids for `n` (source, destination)
 * address pairs, one pair per layer, checked once and run one after the other. */
static PyObject *run_layers(const unsigned long long *src_addrs, const unsigned long long *dst_addrs,
                            Py_ssize_t n, PyObject *src_shape, PyObject *src_strides,
                            unsigned long long src_idx, long long src_per, PyObject *dst_shape,
                            PyObject *dst_strides, unsigned long long dst_idx, long long dst_per,
                            long long units, long long elem, long long threads, int in_place,
                            int allow_direct, long long stream_bytes) {
    if (!(elem == 1 || elem == 2 || elem == 4 || elem == 8 || elem == 16)) {
        PyErr_Format(PyExc_ValueError, "element size must be 1, 2, 4, 8 or 16 bytes, got %lld",
                     elem);
        return NULL;
    }
    if (units < 0 || threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "need units >= 0 and 1 <= threads <= %d, got %lld, %lld",
                     MAX_THREADS, units, threads);
        return NULL;
    }
    for (Py_ssize_t i = 0; in_place && i < n; i++) {
        if (src_addrs[i] != dst_addrs[i] || src_idx != dst_idx || src_per != 1 || dst_per != 1) {
            PyErr_SetString(PyExc_ValueError,
                            "in place needs the same tensor address, ids and one block per unit");
            return NULL;
        }
    }
    if (n == 0)
        Py_RETURN_NONE;
    side_t src, dst;
    int64_t src_elems, dst_elems;
    if (parse_side(&src, src_addrs[0], src_shape, src_strides, src_idx, src_per, units, elem,
                   "src", &src_elems) < 0 ||
        parse_side(&dst, dst_addrs[0], dst_shape, dst_strides, dst_idx, dst_per, units, elem,
                   "dst", &dst_elems) < 0)
        return NULL;
    if (src_elems * src_per != dst_elems * dst_per) {
        PyErr_Format(PyExc_ValueError,
                     "a unit is %lld source elements but %lld destination elements",
                     (long long)(src_elems * src_per), (long long)(dst_elems * dst_per));
        return NULL;
    }
    if (units == 0)
        Py_RETURN_NONE;
    int64_t *ids = NULL;
    if (in_place) {
        if (!(ids = unique_ids(src.idx, &units)))
            return PyErr_NoMemory();
        src.idx = dst.idx = ids;
    }
    if (threads > units)
        threads = units;
    direct_t direct;
    walk_t gather, scatter;
    const direct_t *plan =
        allow_direct && !in_place && plan_direct(&src, &dst, (size_t)elem, &direct) ? &direct
                                                                                   : NULL;
    plan_scratch(&src, (size_t)elem, 1, &gather);
    plan_scratch(&dst, (size_t)elem, 0, &scatter);

    int64_t chunk = units / (8 * threads);
    job_t job = {.src = &src,
                 .dst = &dst,
                 .direct = plan,
                 .gather = &gather,
                 .scatter = &scatter,
                 .units = units,
                 .chunk = chunk < 1 ? 1 : chunk > 16 ? 16 : chunk,
                 .elem = (size_t)elem,
                 .src_block_bytes = (size_t)(src_elems * elem),
                 .dst_block_bytes = (size_t)(dst_elems * elem),
                 .stream = !in_place && stream_bytes >= 0 && can_stream() &&
                           (long double)n * units * dst_elems * elem * dst_per >= stream_bytes};
    atomic_init(&job.failed, 0);
    if (job.stream)
        atomic_fetch_add(&streamed_calls, 1);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !atomic_load(&job.failed); i++) {
        src.base = (char *)(uintptr_t)src_addrs[i];
        dst.base = (char *)(uintptr_t)dst_addrs[i];
        atomic_init(&job.next, 0);
        run_pooled(&job, (int)threads);
    }
    Py_END_ALLOW_THREADS
    int failed = atomic_load(&job.failed);
    free(ids);
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *gather_scatter(PyObject *self, PyObject *args) {
    unsigned long long src_addr, src_idx, dst_addr, dst_idx;
    long long src_per, dst_per, units, elem, threads;
    long long stream_bytes = -1;
    int in_place, allow_direct;
    PyObject *src_shape, *src_strides, *dst_shape, *dst_strides;
    (void)self;
    if (!PyArg_ParseTuple(args, "KOOKLKOOKLLLLpp|L", &src_addr, &src_shape, &src_strides,
                          &src_idx, &src_per, &dst_addr, &dst_shape, &dst_strides, &dst_idx,
                          &dst_per, &units, &elem, &threads, &in_place, &allow_direct,
                          &stream_bytes))
        return NULL;
    return run_layers(&src_addr, &dst_addr, 1, src_shape, src_strides, src_idx, src_per,
                      dst_shape, dst_strides, dst_idx, dst_per, units, elem, threads, in_place,
                      allow_direct, stream_bytes);
}

/* A sequence of Python ints as a malloc'ed array of addresses (NULL with an exception set). */
static unsigned long long *addresses(PyObject *obj, const char *name, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(obj, "addresses must be a sequence");
    if (!seq)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    unsigned long long *out = malloc((size_t)(*n ? *n : 1) * sizeof(unsigned long long));
    if (!out) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        out[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] is not an address", name, i);
            free(out);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return out;
}

/* Block ids given as an address of int64s (a Python int), or as a list or tuple of Python
 * ints (`name` in errors) of `count` ids, each checked in [0, blocks of `shape`): then copied
 * into *owned (free it) and *addr points there. Lists skip building a tensor per call, which
 * costs more than a small copy's own Python when the caches are cold. */
static int block_ids(PyObject *obj, const char *name, long long count, PyObject *shape,
                     int64_t **owned, unsigned long long *addr) {
    *owned = NULL;
    if (PyLong_Check(obj)) {
        *addr = PyLong_AsUnsignedLongLong(obj);
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: need an address or a list of ids", name);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    if (n != count) {
        PyErr_Format(PyExc_ValueError, "%s has %zd ids, expected %lld", name, n, count);
        return -1;
    }
    PyObject *first = PySequence_GetItem(shape, 0);
    long long blocks = first ? PyLong_AsLongLong(first) : -1;
    Py_XDECREF(first);
    if (PyErr_Occurred())
        return -1;
    int64_t *ids = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!ids) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* ints and what converts to one exactly (numpy's integers); not bools or floats */
        PyObject *index = PyBool_Check(items[i]) ? NULL : PyNumber_Index(items[i]);
        long long id = index ? PyLong_AsLongLong(index) : -1;
        Py_XDECREF(index);
        if (!index || (id == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "%s must be a 1-d list or tensor of integer block ids, got an item of "
                         "type %s", name, Py_TYPE(items[i])->tp_name);
            free(ids);
            return -1;
        }
        if (id < 0 || id >= blocks) {
            PyErr_Format(PyExc_ValueError,
                         "%s: block id %lld is out of range; the cache has %lld blocks "
                         "(ids 0..%lld)", name, id, blocks, blocks - 1);
            free(ids);
            return -1;
        }
        ids[i] = id;
    }
    *owned = ids;
    *addr = (unsigned long long)(uintptr_t)ids;
    return 0;
}

static PyObject *gather_scatter_layers(PyObject *self, PyObject *args) {
    unsigned long long src_idx, dst_idx;
    long long src_per, dst_per, units, elem, threads, stream_bytes = -1;
    int allow_direct;
    PyObject *src_list, *dst_list, *src_shape, *src_strides, *dst_shape, *dst_strides;
    PyObject *src_ids, *dst_ids;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOLOOOOLLLLp|L", &src_list, &src_shape, &src_strides,
                          &src_ids, &src_per, &dst_list, &dst_shape, &dst_strides, &dst_ids,
                          &dst_per, &units, &elem, &threads, &allow_direct, &stream_bytes))
        return NULL;
    int64_t *src_owned = NULL, *dst_owned = NULL;
    if (block_ids(src_ids, "src_block_ids", src_per * units, src_shape, &src_owned, &src_idx) < 0)
        return NULL;
    if (block_ids(dst_ids, "dst_block_ids", dst_per * units, dst_shape, &dst_owned, &dst_idx) < 0) {
        free(src_owned);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n_src, n_dst;
    unsigned long long *src_addrs = addresses(src_list, "src_addrs", &n_src);
    unsigned long long *dst_addrs = src_addrs ? addresses(dst_list, "dst_addrs", &n_dst) : NULL;
    if (src_addrs && dst_addrs) {
        if (n_src != n_dst)
            PyErr_Format(PyExc_ValueError, "%zd source but %zd destination addresses", n_src,
                         n_dst);
        else
            out = run_layers(src_addrs, dst_addrs, n_src, src_shape, src_strides, src_idx,
                             src_per, dst_shape, dst_strides, dst_idx, dst_per, units, elem,
                             threads, 0, allow_direct, stream_bytes);
    }
    free(src_addrs);
    free(dst_addrs);
    free(src_owned);
    free(dst_owned);
    return out;
}

static PyObject *streamed(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyLong_FromLongLong(atomic_load(&streamed_calls));
}

static PyMethodDef methods[] = {
    {"gather_scatter", gather_scatter, METH_VARARGS,
     "gather_scatter(src_addr, src_shape, src_strides, src_ids_addr, src_per_unit, dst_addr, "
     "dst_shape, dst_strides, dst_ids_addr, dst_per_unit, units, elem_size, threads, "
     "in_place, allow_direct, stream_bytes=-1)\n\nMove `units` groups of blocks (blocks on dim 0, strides in "
     "elements of elem_size bytes, ids int64): each unit's source blocks are read into a "
     "contiguous scratch, then written through the destination's strides, or (allow_direct, not "
     "in place, shapes that nest) copied straight across. in_place: same tensor and ids, "
     "repeated ids moved once. A call (not in place) writing >= stream_bytes (>= 0) writes "
     "runs of a page or more with non-temporal stores where the CPU has them (x86-64 AVX2). "
     "Addresses are raw and trusted; see kvx.layouts._kernels."},
    {"gather_scatter_layers", gather_scatter_layers, METH_VARARGS,
     "gather_scatter_layers(src_addrs, src_shape, src_strides, src_ids, src_per_unit, "
     "dst_addrs, dst_shape, dst_strides, dst_ids, dst_per_unit, units, elem_size, threads, "
     "allow_direct, stream_bytes=-1)\n\ngather_scatter (not in place) for each (src_addrs[i], dst_addrs[i]) "
     "pair in turn: tensors of one geometry, such as every layer of a cache, with the ids "
     "checked once for all of them; stream_bytes counts the bytes of every pair. Ids are an "
     "address of int64s or a list (or tuple) of ints, checked here (ValueError)."},
    {"streamed_calls", streamed, METH_NOARGS,
     "streamed_calls()\n\nHow many calls so far wrote with non-temporal stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvx.layouts._native",
    "Native one-pass block gather/scatter for kvx.layouts (CPU).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
