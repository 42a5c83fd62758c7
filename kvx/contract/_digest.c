/* Per-block XXH3-64 digests of KV blocks in place, one call for many blocks, without the GIL
 * and without copying: what `kvx.contract.integrity` computes on both sides of a P/D transfer.
 *
 * `region_digests` digests blocks of a paged cache: a block's bytes are one region per table
 * row (e.g. each layer's K and V), each at `start + block * step`, optionally per part of each
 * region (a head range of a block: `merge_digests` turns a range of parts into one digest).
 * `chunk_digests` digests
 * blocks whose memory-order bytes are the concatenation of buffers cut anywhere, laid out
 * `[outer, blocks, bytes per block]`. Digests equal `xxhash.xxh3_64()` fed the same bytes (the
 * vendored xxhash header, with AVX-512 and AVX2 builds chosen at import where the CPU has them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

#include "_digest.h"

static void update_baseline(XXH3_state_t *state, const void *data, size_t len) {
    XXH3_64bits_update(state, data, len);
}

static kvx_digest_update_fn best_update = update_baseline;

typedef struct {
    Py_buffer view;
    Py_ssize_t start, size, step;
} region_t;

static void release_views(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* The digests as a list of Python ints; NULL with an exception on failure. */
static PyObject *as_list(const uint64_t *digests, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyLong_FromUnsignedLongLong(digests[i]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* Hold `spec` (a sequence of (buffer, start, size, step)) into `regions`; the number held, or
 * -1 with an exception (nothing left held). */
static Py_ssize_t hold_regions(PyObject *seq, region_t *regions) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        region_t *r = &regions[i];
        PyObject *buffer;
        int ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i),
                                  "Onnn;a region is (buffer, start, size, step)", &buffer,
                                  &r->start, &r->size, &r->step);
        if (ok && PyObject_GetBuffer(buffer, &r->view, PyBUF_C_CONTIGUOUS) == 0) {
            if (r->start >= 0 && r->size >= 0 && r->step >= 0) continue;
            PyBuffer_Release(&r->view);
            PyErr_Format(PyExc_ValueError,
                         "region %zd: start, size and step must be >= 0, not %zd, %zd, %zd", i,
                         r->start, r->size, r->step);
        }
        for (Py_ssize_t j = 0; j < i; j++) PyBuffer_Release(&regions[j].view);
        return -1;
    }
    return n;
}

/* XXH3-64 of `count` digests as little-endian 8-byte words: a head range's digest. */
static uint64_t merge_words(const uint64_t *digests, Py_ssize_t count) {
    unsigned char bytes[8 * 64];
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (Py_ssize_t i = 0; i < count;) {
        Py_ssize_t n = count - i < 64 ? count - i : 64;
        for (Py_ssize_t k = 0; k < n; k++)
            for (int byte = 0; byte < 8; byte++)
                bytes[8 * k + byte] = (unsigned char)(digests[i + k] >> (8 * byte));
        XXH3_64bits_update(&state, bytes, (size_t)(8 * n));
        i += n;
    }
    return XXH3_64bits_digest(&state);
}

/* region_digests(regions, blocks, parts=1, merge=False) -> digests */
static PyObject *region_digests(PyObject *self, PyObject *args) {
    PyObject *spec, *blocks;
    Py_ssize_t parts = 1;
    int merge = 0;
    if (!PyArg_ParseTuple(args, "OO|np:region_digests", &spec, &blocks, &parts, &merge))
        return NULL;
    if (parts < 1 || parts > (1 << 16)) {
        PyErr_Format(PyExc_ValueError, "parts must be 1..65536, not %zd", parts);
        return NULL;
    }
    PyObject *rseq = PySequence_Fast(spec, "regions must be a sequence");
    if (rseq == NULL) return NULL;
    PyObject *bseq = PySequence_Fast(blocks, "blocks must be a sequence of ints");
    if (bseq == NULL) {
        Py_DECREF(rseq);
        return NULL;
    }
    Py_ssize_t nr = PySequence_Fast_GET_SIZE(rseq), nb = PySequence_Fast_GET_SIZE(bseq);
    Py_ssize_t nd = nb > 0 ? nb * parts : 1;
    region_t *regions = PyMem_Calloc(nr > 0 ? (size_t)nr : 1, sizeof(region_t));
    Py_ssize_t *ids = PyMem_Calloc(nb > 0 ? (size_t)nb : 1, sizeof(Py_ssize_t));
    uint64_t *digests = PyMem_Calloc((size_t)nd, sizeof(uint64_t));
    PyObject *out = NULL;
    Py_ssize_t held = -1;
    if (regions == NULL || ids == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    held = hold_regions(rseq, regions);
    if (held < 0) goto done;
    for (Py_ssize_t j = 0; j < nr; j++) {
        if (regions[j].size % parts) {
            PyErr_Format(PyExc_ValueError, "region %zd: %zd bytes do not split into %zd parts",
                         j, regions[j].size, parts);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < nb; i++) {
        Py_ssize_t b = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(bseq, i), PyExc_OverflowError);
        if (b == -1 && PyErr_Occurred()) goto done;
        for (Py_ssize_t j = 0; j < nr; j++) {
            region_t *r = &regions[j];
            /* start + b * step + size <= len, without overflow */
            Py_ssize_t room = r->view.len - r->size - r->start; /* room for b * step */
            if (b < 0 || r->size > r->view.len || r->start > r->view.len - r->size ||
                (r->step > 0 && b > room / r->step)) {
                PyErr_Format(PyExc_ValueError,
                             "block %zd: region %zd (start %zd, size %zd, step %zd) lies outside "
                             "its buffer of %zd bytes",
                             b, j, r->start, r->size, r->step, r->view.len);
                goto done;
            }
        }
        ids[i] = b;
    }
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t state;
    for (Py_ssize_t i = 0; i < nb; i++) {
        for (Py_ssize_t p = 0; p < parts; p++) {
            XXH3_64bits_reset(&state);
            for (Py_ssize_t j = 0; j < nr; j++) {
                const region_t *r = &regions[j];
                Py_ssize_t part = r->size / parts;
                best_update(&state, (const char *)r->view.buf + r->start + ids[i] * r->step + p * part,
                            (size_t)part);
            }
            digests[i * parts + p] = XXH3_64bits_digest(&state);
        }
        if (merge) digests[i] = merge_words(&digests[i * parts], parts);
    }
    Py_END_ALLOW_THREADS
    out = as_list(digests, merge ? nb : nb * parts);
done:
    if (held > 0) {
        for (Py_ssize_t j = 0; j < held; j++) PyBuffer_Release(&regions[j].view);
    }
    PyMem_Free(regions);
    PyMem_Free(ids);
    PyMem_Free(digests);
    Py_DECREF(rseq);
    Py_DECREF(bseq);
    return out;
}

/* merge_digests(digests, parts, first, count) -> digests */
static PyObject *merge_digests(PyObject *self, PyObject *args) {
    PyObject *given;
    Py_ssize_t parts, first, count;
    if (!PyArg_ParseTuple(args, "Onnn:merge_digests", &given, &parts, &first, &count))
        return NULL;
    PyObject *seq = PySequence_Fast(given, "digests must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (parts < 1 || first < 0 || count < 1 || first > parts - count || n % parts) {
        PyErr_Format(PyExc_ValueError,
                     "cannot merge %zd parts from part %zd of %zd digests in groups of %zd: need "
                     "0 <= first, 1 <= count, first + count <= parts and whole groups",
                     count, first, n, parts);
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t nb = n / parts;
    uint64_t *words = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(uint64_t));
    uint64_t *digests = PyMem_Calloc((size_t)(nb > 0 ? nb : 1), sizeof(uint64_t));
    PyObject *out = NULL;
    if (words == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        for (Py_ssize_t k = 0; k < count; k++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, b * parts + first + k);
            words[k] = PyLong_AsUnsignedLongLong(item);
            if (words[k] == (uint64_t)-1 && PyErr_Occurred()) goto done;
        }
        digests[b] = merge_words(words, count);
    }
    out = as_list(digests, nb);
done:
    PyMem_Free(words);
    PyMem_Free(digests);
    Py_DECREF(seq);
    return out;
}

/* chunk_digests(buffers, num_blocks, outer) -> digests */
static PyObject *chunk_digests(PyObject *self, PyObject *args) {
    PyObject *parts;
    Py_ssize_t nblocks, outer;
    if (!PyArg_ParseTuple(args, "Onn:chunk_digests", &parts, &nblocks, &outer)) return NULL;
    if (nblocks <= 0 || outer <= 0) return PyList_New(0);
    PyObject *seq = PySequence_Fast(parts, "buffers must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held = 0, total = 0;
    Py_buffer *views = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    uint64_t *digests = PyMem_Calloc((size_t)nblocks, sizeof(uint64_t));
    XXH3_state_t *states = NULL;
    PyObject *out = NULL;
    if (views == NULL || digests == NULL || (size_t)nblocks > SIZE_MAX / sizeof(XXH3_state_t) ||
        posix_memalign((void **)&states, 64, (size_t)nblocks * sizeof(XXH3_state_t)) != 0) {
        states = NULL;
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        total += views[held].len;
    }
    if (outer > PY_SSIZE_T_MAX / nblocks || total % (outer * nblocks)) {
        PyErr_Format(PyExc_ValueError, "%zd bytes do not split into %zd x %zd equal blocks",
                     total, outer, nblocks);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t per = total / (outer * nblocks), chunk = 0, filled = 0;
    for (Py_ssize_t b = 0; b < nblocks; b++) XXH3_64bits_reset(&states[b]);
    for (Py_ssize_t i = 0; i < n && per > 0; i++) {
        const char *data = views[i].buf;
        Py_ssize_t pos = 0;
        while (pos < views[i].len) {
            Py_ssize_t take = per - filled;
            if (take > views[i].len - pos) take = views[i].len - pos;
            best_update(&states[chunk % nblocks], data + pos, (size_t)take);
            pos += take;
            filled += take;
            if (filled == per) chunk++, filled = 0;
        }
    }
    for (Py_ssize_t b = 0; b < nblocks; b++) digests[b] = XXH3_64bits_digest(&states[b]);
    Py_END_ALLOW_THREADS
    out = as_list(digests, nblocks);
done:
    release_views(views, held);
    PyMem_Free(views);
    PyMem_Free(digests);
    free(states);
    Py_DECREF(seq);
    return out;
}

static PyObject *vector(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(best_update == update_baseline      ? "baseline"
                                : best_update == kvx_digest_update_avx2 ? "avx2"
                                                                        : "avx512");
}

static PyMethodDef methods[] = {
    {"region_digests", region_digests, METH_VARARGS,
     "region_digests(regions, blocks, parts=1, merge=False) -> digests: per block id b of "
     "`blocks` and part p, XXH3-64 of part p of `parts` equal parts of the bytes "
     "buffer[start + b * step:][:size] of every (buffer, start, size, step) of `regions` in "
     "order (block-major). With `merge`, per block the merge of its parts' digests (see "
     "merge_digests). ValueError when a block's region lies outside its buffer or a region's "
     "size does not split into `parts`. Without the GIL."},
    {"merge_digests", merge_digests, METH_VARARGS,
     "merge_digests(digests, parts, first, count) -> digests: `digests` in groups of `parts` "
     "(one group per block); per group, XXH3-64 of its digests first..first+count-1 as "
     "little-endian 8-byte words. ValueError for a range outside a group."},
    {"chunk_digests", chunk_digests, METH_VARARGS,
     "chunk_digests(buffers, num_blocks, outer) -> digests: the buffers' bytes in order are "
     "[outer, num_blocks, bytes per block]; per block, XXH3-64 of its bytes in every outer "
     "index in order. ValueError when they do not split into outer x num_blocks equal chunks. "
     "Without the GIL."},
    {"vector", vector, METH_NOARGS, "vector() -> 'avx512', 'avx2' or 'baseline': the XXH3 build in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_digest", "Per-block XXH3-64 digests of KV blocks in place.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__digest(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        best_update = kvx_digest_update_avx512;
    else if (__builtin_cpu_supports("avx2"))
        best_update = kvx_digest_update_avx2;
#endif
    return PyModule_Create(&module);
}
