/* Read stored values from files into the KV cache, checksumming them in the same pass, without
 * the GIL; the module's method table (reads: `_fileread.c`, writes: `_filewrite.c`).
 *
 * A stored value (header, then every layer's K and V of one block) lives in the engine's KV
 * cache as many scattered regions. `write_blocks` / `read_blocks` take a batch of values as
 * paths and block ids plus a small table saying where a block's regions lie (held here for
 * both: `kvx_hold_call`), and create (to a temporary name, renamed into place) or open, move
 * and close every file of the batch without the GIL and without a Python object per region.
 * Moving the regions with one pwritev / preadv and hashing them in a separate pass would go
 * over every byte twice, once from memory: here they move about 256 KiB at a time and each
 * piece is hashed (XXH3-64) right before it is written or right after it is read, while it is
 * in the cache. `hash_buffers` hashes regions moved some other way (Redis). Digests equal
 * `xxhash.xxh3_64()` fed the same bytes: the same algorithm, from the vendored xxhash header
 * (vendor/xxhash/, top level), with an AVX2 build (`_fileio_avx2.c`) chosen at import on CPUs
 * that have it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <string.h>

#include "_fileio.h"

void kvx_update_baseline(XXH3_state_t *state, const void *data, size_t len) {
    XXH3_64bits_update(state, data, len);
}

kvx_update_fn kvx_best_update = kvx_update_baseline;

/* The buffers of a sequence, each held as a contiguous Py_buffer (`flags` adds to that);
 * NULL with an exception set on failure. `*held` is how many to release. */
static Py_buffer *hold_buffers(PyObject *seq, Py_ssize_t n, int flags, Py_ssize_t *held) {
    Py_buffer *views = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    *held = 0;
    if (views == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (; *held < n; (*held)++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, *held);
        if (PyObject_GetBuffer(item, &views[*held], flags | PyBUF_C_CONTIGUOUS) < 0) {
            for (Py_ssize_t i = 0; i < *held; i++) PyBuffer_Release(&views[i]);
            PyMem_Free(views);
            *held = 0;
            return NULL;
        }
    }
    return views;
}

/* hash_buffers(buffers) -> XXH3-64 of their bytes in order, without the GIL. */
static PyObject *hash_buffers(PyObject *self, PyObject *args) {
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "O:hash_buffers", &parts)) return NULL;
    PyObject *seq = PySequence_Fast(parts, "hash_buffers() takes a sequence of buffers");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held;
    Py_buffer *views = hold_buffers(seq, n, PyBUF_SIMPLE, &held);
    Py_DECREF(seq);
    if (views == NULL) return NULL;
    XXH3_state_t state;
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(&state);
    for (Py_ssize_t i = 0; i < n; i++) kvx_best_update(&state, views[i].buf, (size_t)views[i].len);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    return PyLong_FromUnsignedLongLong(XXH3_64bits_digest(&state));
}

/* Block values: a value is a header, then one region of the KV cache per table entry for one
 * engine block, so the regions of every value of a batch follow from a small table and the
 * block ids; a whole batch of files is then opened, moved, hashed and closed without the GIL
 * and without a Python object per region (held here, for reads and writes alike). */

static void release_table(table_t *table) {
    for (Py_ssize_t i = 0; i < table->n; i++) PyBuffer_Release(&table->regions[i].view);
    PyMem_Free(table->regions);
    table->regions = NULL;
    table->n = 0;
}

/* Hold `spec`, a sequence of (buffer, start, size, step); 0, or -1 with an exception. */
static int hold_table(PyObject *spec, int flags, table_t *table) {
    table->n = 0;
    table->regions = NULL;
    PyObject *seq = PySequence_Fast(spec, "the region table must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    table->regions = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(region_t));
    if (table->regions == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        region_t *r = &table->regions[i];
        PyObject *buffer;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Onnn;a region is (buffer, start, "
                              "size, step)", &buffer, &r->start, &r->size, &r->step) ||
            PyObject_GetBuffer(buffer, &r->view, flags | PyBUF_C_CONTIGUOUS) < 0) {
            release_table(table);
            Py_DECREF(seq);
            return -1;
        }
        table->n = i + 1;
        if (r->start < 0 || r->size < 0 || r->step < 0) {
            PyErr_Format(PyExc_ValueError, "region %zd: start, size and step must be >= 0", i);
            release_table(table);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* Block ids as C integers, each checked to lie inside every region's buffer; NULL with an
 * exception on failure. */
static Py_ssize_t *block_ids(PyObject *blocks, Py_ssize_t n, const table_t *table) {
    Py_ssize_t *ids = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_ssize_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        ids[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(blocks, i));
        if (ids[i] == -1 && PyErr_Occurred()) break;
        for (Py_ssize_t k = 0; k < table->n; k++) {
            const region_t *r = &table->regions[k];
            if (ids[i] < 0 || (r->step > 0 && ids[i] > (r->view.len - r->start - r->size) / r->step) ||
                r->start + r->size > r->view.len) {
                PyErr_Format(PyExc_ValueError, "block %zd is outside region %zd's buffer", ids[i], k);
                break;
            }
        }
        if (PyErr_Occurred()) break;
    }
    if (PyErr_Occurred()) {
        PyMem_Free(ids);
        return NULL;
    }
    return ids;
}

void kvx_release_batch(batch_t *batch) {
    for (Py_ssize_t i = 0; i < batch->n; i++) {
        Py_XDECREF(batch->paths[i]);
        if (batch->buffers[i].obj != NULL) PyBuffer_Release(&batch->buffers[i]);
    }
    PyMem_Free(batch->paths);
    PyMem_Free(batch->buffers);
    batch->n = 0;
    batch->paths = NULL;
    batch->buffers = NULL;
}

/* Hold per value a path (unless `paths` is NULL) and a buffer (`flags`, unless `buffers` is
 * NULL); 0, or -1 with an exception. */
int kvx_hold_batch(PyObject *paths, PyObject *buffers, Py_ssize_t n, int flags, batch_t *batch) {
    batch->n = 0;
    batch->paths = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(PyObject *));
    batch->buffers = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    if (batch->paths == NULL || batch->buffers == NULL) {
        kvx_release_batch(batch);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        batch->n = i + 1;
        if ((paths != NULL &&
             !PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(paths, i), &batch->paths[i])) ||
            (buffers != NULL &&
             PyObject_GetBuffer(PySequence_Fast_GET_ITEM(buffers, i), &batch->buffers[i],
                                flags | PyBUF_C_CONTIGUOUS) < 0)) {
            kvx_release_batch(batch);
            return -1;
        }
    }
    return 0;
}

/* The regions of `block` as views (only .buf and .len are used). */
void kvx_fill_parts(Py_buffer *parts, const table_t *table, Py_ssize_t block) {
    for (Py_ssize_t k = 0; k < table->n; k++) {
        const region_t *r = &table->regions[k];
        parts[k].buf = (char *)r->view.buf + r->start + block * r->step;
        parts[k].len = r->size;
    }
}

/* Sequences of equal length `n`, as fast sequences in `out` (to DECREF); -1 with an
 * exception naming the argument (its position in `where`) that is not a sequence or is of
 * another length. */
static int same_length(PyObject **seqs, const int *where, PyObject **out, int count,
                       Py_ssize_t *n) {
    for (int i = 0; i < count; i++) out[i] = NULL;
    for (int i = 0; i < count; i++) {
        out[i] = PySequence_Fast(seqs[i], "paths, buffers and blocks must be sequences");
        if (out[i] == NULL) return -1;
        Py_ssize_t len = PySequence_Fast_GET_SIZE(out[i]);
        if (i == 0) *n = len;
        else if (len != *n) {
            PyErr_Format(PyExc_ValueError, "argument %d has %zd items, not %zd", where[i], len,
                         *n);
            return -1;
        }
    }
    return 0;
}

void kvx_release_call(call_t *call) {
    PyMem_Free(call->ids);
    call->ids = NULL;
    kvx_release_batch(&call->named);
    release_table(&call->table);
    for (int i = 0; i < 4; i++) Py_CLEAR(call->fast[i]);
}

/* Hold the shared arguments (`where`: their positions, for errors); 0, or -1 with an
 * exception. Release with release_call either way. */
int kvx_hold_call(PyObject *paths, PyObject *own, PyObject *seeds, PyObject *blocks,
                     PyObject *spec, int table_flags, const int *where, call_t *call) {
    PyObject *seqs[4] = {paths, own, seeds, blocks};
    *call = (call_t){0, 0, {NULL, NULL, NULL, NULL}, {0, NULL}, {0, NULL, NULL}, NULL};
    if (same_length(seqs, where, call->fast, 4, &call->n) < 0 ||
        hold_table(spec, table_flags, &call->table) < 0 ||
        kvx_hold_batch(call->fast[0], call->fast[2], call->n, PyBUF_SIMPLE, &call->named) < 0 ||
        (call->ids = block_ids(call->fast[3], call->n, &call->table)) == NULL)
        return -1;
    for (Py_ssize_t k = 0; k < call->table.n; k++) call->payload += call->table.regions[k].size;
    return 0;
}

/* XXH3-64 of each of `n` keys (bytes-like), as a PyMem array; NULL with an exception. */
uint64_t *kvx_key_hashes(PyObject *keys, Py_ssize_t n) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (seq == NULL) return NULL;
    uint64_t *hashes = NULL;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys for %zd values", PySequence_Fast_GET_SIZE(seq), n);
    } else if ((hashes = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(uint64_t))) == NULL) {
        PyErr_NoMemory();
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_buffer key;
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &key, PyBUF_SIMPLE) < 0) {
                PyMem_Free(hashes);
                hashes = NULL;
                break;
            }
            hashes[i] = XXH3_64bits(key.buf, (size_t)key.len);
            PyBuffer_Release(&key);
        }
    }
    Py_DECREF(seq);
    return hashes;
}

static PyObject *vector(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(kvx_best_update == kvx_update_baseline ? "baseline" : "avx2");
}

static PyMethodDef methods[] = {
    {"hash_buffers", hash_buffers, METH_VARARGS,
     "hash_buffers(buffers) -> digest: XXH3-64 of the buffers' bytes in order, computed "
     "without the GIL (for values read or written some other way)."},
    {"write_blocks", kvx_write_blocks, METH_VARARGS,
     "write_blocks(paths, tmp_paths, seeds, prefix, regions, blocks, baseline=False, mode=0o600) -> errnos: per value i, "
     "create tmp_paths[i] (which must not exist), write the regions of blocks[i] after a "
     "header of len(prefix) + 8 bytes, then the header: prefix and XXH3-64 (little-endian) of "
     "seeds[i] then the regions, and rename it to paths[i]. `regions` is a sequence of "
     "(buffer, start, size, step): block b's region is buffer[start + b * step:][:size]. "
     "Per value 0, or the errno that stopped it (its temporary file removed). Without the GIL."},
    {"read_blocks", kvx_read_blocks, METH_VARARGS,
     "read_blocks(paths, seeds, skip_start, skip_end, heads, regions, blocks, baseline=False, "
     "keys=None, hashed=True) -> per value "
     "(size, digest, errno): when the file is as long as heads[i] and the regions of "
     "blocks[i] (`regions` as for write_blocks), read it into them and digest is XXH3-64 of "
     "seeds[i] then the bytes except [skip_start, skip_end); otherwise nothing is read, "
     "digest is None and size the file's size, or None with the errno that stopped it. "
     "Without the GIL; `baseline` as for write_blocks. With `keys` (bytes, one per value), a "
     "file longer than the value that is a segment (write_segment) is read from the value of "
     "keys[i] in it (version 2: the header from the segment's index, the payload from the "
     "file), and a segment without that key counts as absent (ENOENT); a segment of a version "
     "other than 1 and 2 raises ValueError naming the file. With hashed=False nothing is "
     "hashed (digest is None) and a value of up to 1023 regions moves in one preadv."},
    {"write_segment", kvx_write_segment, METH_VARARGS,
     "write_segment(paths, keys, tmp_path, seeds, prefix, regions, blocks, baseline=False, "
     "mode=0o600) -> errnos: write 1 to 4096 values as write_blocks would into one new file "
     "tmp_path, a version-2 segment (`_segment.c`): the payloads back to back from a 2 MiB "
     "boundary, after an index holding the common prefix and per value the XXH3-64 of keys[i] "
     "and its checksum; then hard-link it as each paths[i] (replacing what is there) and "
     "remove tmp_path. Per value 0, or the errno that stopped it. Without the GIL."},
    {"vector", vector, METH_NOARGS, "vector() -> 'avx2' or 'baseline': the XXH3 build in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fileio", "Read or write a stored value and checksum it in one pass.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fileio(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) kvx_best_update = kvx_xxh3_update_avx2;
#endif
    return PyModule_Create(&module);
}
