/* Write stored values from the KV cache into files, checksumming them in the same pass,
 * without the GIL (`write_blocks`: a file per value; `write_segment`: a segment file holding a
 * batch, `_segment.c`). Arguments are held as for reads (`kvx_hold_call`, `_fileio.c`); each
 * piece of about CHUNK_BYTES is hashed right before it is written, while it is in the cache.
 */
#define _GNU_SOURCE /* fallocate() */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_fileio.h"

#define CHUNK_BYTES (256 * 1024) /* hashed, then written while in the L2 cache */
#define CHUNK_IOVS 64

/* Write the buffers to `fd` from `offset` on, about CHUNK_BYTES per pwritev, hashing each
 * chunk right before it is written (the write then copies it from the cache); the bytes
 * written, or -1 with errno set. */
static Py_ssize_t write_hashed_impl(int fd, Py_buffer *views, Py_ssize_t n, kvx_update_fn update,
                                    XXH3_state_t *state, Py_ssize_t offset) {
    struct iovec iov[CHUNK_IOVS];
    Py_ssize_t index = 0, start = offset;
    while (index < n) {
        int count = 0;
        Py_ssize_t batch = 0;
        for (; index < n && count < CHUNK_IOVS && batch < CHUNK_BYTES; index++) {
            if (views[index].len == 0) continue;
            iov[count].iov_base = views[index].buf;
            iov[count].iov_len = (size_t)views[index].len;
            update(state, views[index].buf, (size_t)views[index].len);
            batch += views[index].len;
            count++;
        }
        struct iovec *rest = iov;
        while (count > 0) { /* a short write: go on from where it stopped */
            ssize_t put = pwritev(fd, rest, count, (off_t)offset);
            if (put < 0) {
                if (errno == EINTR) continue;
                return -1;
            }
            if (put == 0) { /* no progress: never loop on it */
                errno = EIO;
                return -1;
            }
            offset += put;
            while (count > 0 && (size_t)put >= rest->iov_len) {
                put -= (ssize_t)rest->iov_len;
                rest++;
                count--;
            }
            if (count > 0) {
                rest->iov_base = (char *)rest->iov_base + put;
                rest->iov_len -= (size_t)put;
            }
        }
    }
    return offset - start;
}

/* Allocate `size` bytes of a new file from `offset` in one go: on ext4 one extent instead of a delayed
 * allocation per 4 KiB block as the data goes in, 10-20% of a write's time. 0, or the errno of
 * a real failure (a filesystem without fallocate is not one). */
static int preallocate(int fd, Py_ssize_t offset, Py_ssize_t size) {
#ifdef __linux__
    if (size > 0 && fallocate(fd, 0, (off_t)offset, (off_t)size) < 0)
        return errno == EOPNOTSUPP || errno == ENOSYS || errno == EINVAL ? 0 : errno;
#endif
    return 0;
}

/* pwrite all `len` bytes at `offset`; 0, or -1 with errno set. */
int kvx_write_all(int fd, const unsigned char *data, Py_ssize_t len, Py_ssize_t offset) {
    Py_ssize_t put = 0;
    while (put < len) {
        ssize_t got = pwrite(fd, data + put, (size_t)(len - put), (off_t)(offset + put));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            if (got == 0) errno = EIO; /* no progress: never loop on it */
            return -1;
        }
        put += got;
    }
    return 0;
}

/* Each value's errno (0: written) as a list of ints; NULL with an exception set. */
static PyObject *error_list(const int *errors, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++) {
        PyObject *code = PyLong_FromLong(errors[i]);
        if (code == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, code);
    }
    return list;
}

PyObject *kvx_write_blocks(PyObject *self, PyObject *args) {
    PyObject *paths, *tmps, *seeds, *spec, *blocks;
    Py_buffer prefix;
    int baseline = 0;
    int mode = 0600; /* new files are their owner's unless the caller says otherwise */
    if (!PyArg_ParseTuple(args, "OOOy*OO|pi:write_blocks", &paths, &tmps, &seeds, &prefix, &spec,
                          &blocks, &baseline, &mode))
        return NULL;
    kvx_update_fn update = baseline ? kvx_update_baseline : kvx_best_update;
    static const int where[4] = {1, 2, 3, 6};
    PyObject *result = NULL;
    call_t call;
    batch_t temps = {0, NULL, NULL};
    int *errors = NULL;
    Py_buffer *parts = NULL;
    if (kvx_hold_call(paths, tmps, seeds, blocks, spec, PyBUF_SIMPLE, where, &call) < 0 ||
        kvx_hold_batch(call.fast[1], NULL, call.n, PyBUF_SIMPLE, &temps) < 0)
        goto done;
    Py_ssize_t n = call.n;
    const table_t *table = &call.table;
    errors = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(int));
    parts = PyMem_Calloc(table->n > 0 ? (size_t)table->n : 1, sizeof(Py_buffer));
    unsigned char *head = PyMem_Malloc((size_t)prefix.len + 8);
    if (errors == NULL || parts == NULL || head == NULL) {
        PyMem_Free(head);
        PyErr_NoMemory();
        goto done;
    }
    memcpy(head, prefix.buf, (size_t)prefix.len);
    Py_ssize_t head_len = prefix.len + 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *tmp = PyBytes_AS_STRING(temps.paths[i]);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, (mode_t)mode);
        if (fd < 0) {
            errors[i] = errno;
            continue;
        }
        kvx_fill_parts(parts, table, call.ids[i]);
        int error = preallocate(fd, 0, head_len + call.payload);
        XXH3_state_t state;
        XXH3_64bits_reset(&state);
        XXH3_64bits_update(&state, call.named.buffers[i].buf, (size_t)call.named.buffers[i].len);
        if (!error && write_hashed_impl(fd, parts, table->n, update, &state, head_len) < 0)
            error = errno;
        if (!error) {
            XXH64_hash_t digest = XXH3_64bits_digest(&state);
            for (int b = 0; b < 8; b++) head[prefix.len + b] = (unsigned char)(digest >> (8 * b));
            if (kvx_write_all(fd, head, head_len, 0) < 0) error = errno;
        }
        if (close(fd) < 0 && !error) error = errno;
        if (!error && rename(tmp, PyBytes_AS_STRING(call.named.paths[i])) < 0) error = errno;
        if (error) {
            unlink(tmp);
            errors[i] = error;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(head);
    result = error_list(errors, n);
done:
    PyMem_Free(parts);
    PyMem_Free(errors);
    kvx_release_batch(&temps);
    kvx_release_call(&call);
    PyBuffer_Release(&prefix);
    return result;
}

/* Write the payloads (the regions in `parts` of block ids[i]) back to back into `fd` from
 * `start`, each hashed as it is written after its seed; its checksum into checksums[i]. 0 or
 * an errno. Without the GIL. */
static int write_segment_values(int fd, const call_t *call, Py_ssize_t start, kvx_update_fn update,
                                Py_buffer *parts, uint64_t *checksums) {
    for (Py_ssize_t i = 0; i < call->n; i++) {
        kvx_fill_parts(parts, &call->table, call->ids[i]);
        XXH3_state_t state;
        XXH3_64bits_reset(&state);
        XXH3_64bits_update(&state, call->named.buffers[i].buf, (size_t)call->named.buffers[i].len);
        Py_ssize_t at = start + i * call->payload;
        if (write_hashed_impl(fd, parts, call->table.n, update, &state, at) < 0)
            return errno;
        checksums[i] = XXH3_64bits_digest(&state);
    }
    return 0;
}

/* write_segment: see the method table. */
PyObject *kvx_write_segment(PyObject *self, PyObject *args) {
    PyObject *paths, *keys, *tmp_obj, *seeds, *spec, *blocks;
    Py_buffer prefix;
    int baseline = 0, mode = 0600;
    if (!PyArg_ParseTuple(args, "OOO&Oy*OO|pi:write_segment", &paths, &keys, PyUnicode_FSConverter,
                          &tmp_obj, &seeds, &prefix, &spec, &blocks, &baseline, &mode))
        return NULL;
    kvx_update_fn update = baseline ? kvx_update_baseline : kvx_best_update;
    static const int where[4] = {1, 2, 4, 7};
    PyObject *result = NULL;
    call_t call;
    int *errors = NULL;
    Py_buffer *parts = NULL;
    uint64_t *hashes = NULL, *checksums = NULL;
    unsigned char *header = NULL;
    char *alt = NULL;
    if (kvx_hold_call(paths, keys, seeds, blocks, spec, PyBUF_SIMPLE, where, &call) < 0 ||
        (hashes = kvx_key_hashes(call.fast[1], call.n)) == NULL)
        goto done;
    Py_ssize_t n = call.n, head_len = prefix.len + 8;
    if (n < 1 || n > KVX_SEG_MAX_VALUES || head_len > KVX_SEG_MAX_HEAD) {
        PyErr_Format(PyExc_ValueError, "%zd values with a %zd-byte prefix; a segment holds 1 to "
                     "%d values, each with a prefix of at most %d bytes", n, prefix.len,
                     KVX_SEG_MAX_VALUES, KVX_SEG_MAX_HEAD - 8);
        goto done;
    }
    const char *tmp = PyBytes_AS_STRING(tmp_obj);
    size_t tmp_len = (size_t)PyBytes_GET_SIZE(tmp_obj);
    Py_ssize_t header_len = kvx_segment_header_len(n, head_len);
    Py_ssize_t start = kvx_segment_data_start(n, head_len);
    errors = PyMem_Calloc((size_t)n, sizeof(int));
    checksums = PyMem_Calloc((size_t)n, sizeof(uint64_t));
    parts = PyMem_Calloc(call.table.n > 0 ? (size_t)call.table.n : 1, sizeof(Py_buffer));
    header = PyMem_Malloc((size_t)header_len);
    alt = PyMem_Malloc(tmp_len + 24);
    if (errors == NULL || checksums == NULL || parts == NULL || header == NULL || alt == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    int error = 0;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, (mode_t)mode);
    if (fd < 0) error = errno;
    if (!error) error = preallocate(fd, start, n * call.payload); /* the payloads; not the hole */
    if (!error) error = write_segment_values(fd, &call, start, update, parts, checksums);
    if (!error) {
        kvx_segment_header(header, n, hashes, checksums, prefix.buf, head_len, call.payload);
        if (kvx_write_all(fd, header, header_len, 0) < 0) error = errno;
    }
    if (fd >= 0 && close(fd) < 0 && !error) error = errno;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *path = PyBytes_AS_STRING(call.named.paths[i]);
        if (error) {
            errors[i] = error;
        } else if (link(tmp, path) < 0) { /* already stored: replaced, atomically */
            snprintf(alt, tmp_len + 24, "%s.%zd", tmp, i);
            if (errno != EEXIST || link(tmp, alt) < 0) errors[i] = errno;
            else if (rename(alt, path) < 0) {
                errors[i] = errno;
                unlink(alt);
            }
        }
    }
    if (fd >= 0) unlink(tmp);
    Py_END_ALLOW_THREADS
    result = error_list(errors, n);
done:
    PyMem_Free(alt);
    PyMem_Free(header);
    PyMem_Free(checksums);
    PyMem_Free(hashes);
    PyMem_Free(parts);
    PyMem_Free(errors);
    kvx_release_call(&call);
    Py_DECREF(tmp_obj);
    PyBuffer_Release(&prefix);
    return result;
}
