/* Read or write a stored value between a file and many buffers, checksumming it in the same
 * pass, without the GIL.
 *
 * A stored value (header, then every layer's K and V of one block) lives in the engine's KV
 * cache as many scattered regions. Moving them with one preadv / writev and hashing them in
 * a separate pass goes over every byte twice, once from memory. Here the regions move about
 * 256 KiB at a time and each piece is hashed (XXH3-64) right after it is read, or right before
 * it is written, while it is in the cache. `hash_buffers` hashes regions moved some other way
 * (Redis). Digests equal `xxhash.xxh3_64()` fed the same bytes: the same algorithm, from the
 * system's xxhash header (Debian: libxxhash-dev), with an AVX2 build (`_fileio_avx2.c`) chosen
 * at import on CPUs that have it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_fileio.h"

#define CHUNK_BYTES (256 * 1024) /* read, then hashed while in the L2 cache */
#define CHUNK_IOVS 64

typedef void (*update_fn)(XXH3_state_t *, const void *, size_t);

static void update_baseline(XXH3_state_t *state, const void *data, size_t len) {
    XXH3_64bits_update(state, data, len);
}

static update_fn best_update = update_baseline;

/* Hash `len` bytes of the stream at offset `at` from `data`, leaving out [s0, s1). */
static void hash_piece(update_fn update, XXH3_state_t *state, const char *data, Py_ssize_t at,
                       Py_ssize_t len, Py_ssize_t s0, Py_ssize_t s1) {
    Py_ssize_t end = at + len;
    if (end <= s0 || at >= s1) {
        update(state, data, (size_t)len);
        return;
    }
    if (at < s0) update(state, data, (size_t)(s0 - at));
    if (end > s1) update(state, data + (s1 - at), (size_t)(end - s1));
}

/* Read from `fd` (offset 0 on) straight into the buffers until they are full or the file
 * ends, about CHUNK_BYTES per preadv, hashing each chunk right after it is read (while it is
 * in the cache); the bytes read, or -1 with errno set. */
static Py_ssize_t read_hashed_impl(int fd, Py_buffer *views, Py_ssize_t n, update_fn update,
                                   XXH3_state_t *state, Py_ssize_t s0, Py_ssize_t s1) {
    struct iovec iov[CHUNK_IOVS];
    Py_ssize_t index = 0, offset_in = 0, done = 0;
    while (index < n) {
        int count = 0;
        Py_ssize_t batch = 0;
        for (Py_ssize_t i = index; i < n && count < CHUNK_IOVS && batch < CHUNK_BYTES; i++) {
            Py_ssize_t skip = i == index ? offset_in : 0;
            iov[count].iov_base = (char *)views[i].buf + skip;
            iov[count].iov_len = (size_t)(views[i].len - skip);
            batch += views[i].len - skip;
            count++;
        }
        if (batch == 0) { /* only empty buffers left */
            index = n;
            break;
        }
        ssize_t got = preadv(fd, iov, count, (off_t)done);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) break; /* the file is shorter than the buffers */
        for (int k = 0; k < count && got > 0; k++) {
            Py_ssize_t take = (Py_ssize_t)iov[k].iov_len < got ? (Py_ssize_t)iov[k].iov_len : got;
            hash_piece(update, state, iov[k].iov_base, done, take, s0, s1);
            done += take;
            got -= take;
            offset_in += take;
            if (offset_in == views[index].len) {
                index++;
                offset_in = 0;
            }
        }
        while (index < n && views[index].len == 0) index++;
    }
    return done;
}

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

/* Write the buffers to `fd` from `offset` on, about CHUNK_BYTES per pwritev, hashing each
 * chunk right before it is written (the write then copies it from the cache); the bytes
 * written, or -1 with errno set. `unused` keeps the signature of `read_hashed_impl`. */
static Py_ssize_t write_hashed_impl(int fd, Py_buffer *views, Py_ssize_t n, update_fn update,
                                    XXH3_state_t *state, Py_ssize_t offset, Py_ssize_t unused) {
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

typedef Py_ssize_t (*move_fn)(int, Py_buffer *, Py_ssize_t, update_fn, XXH3_state_t *,
                              Py_ssize_t, Py_ssize_t);

/* Hold the buffers of `parts`, then without the GIL: hash `seed` (may be NULL) and, with
 * `move`, move the buffers to or from `fd` hashing as it goes (`a`, `b`: its arguments), or
 * without, hash the buffers. 0 with `*moved` and `*digest` set, or -1 with an exception. */
static int run(PyObject *parts, const char *what, int flags, const Py_buffer *seed, int baseline,
               move_fn move, int fd, Py_ssize_t a, Py_ssize_t b, Py_ssize_t *moved,
               XXH64_hash_t *digest) {
    PyObject *seq = PySequence_Fast(parts, what);
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held;
    Py_buffer *views = hold_buffers(seq, n, flags, &held);
    int status = -1;
    if (views != NULL) {
        update_fn update = baseline ? update_baseline : best_update;
        XXH3_state_t state;
        Py_ssize_t done = 0;
        int error = 0;
        Py_BEGIN_ALLOW_THREADS
        XXH3_64bits_reset(&state);
        if (seed != NULL) XXH3_64bits_update(&state, seed->buf, (size_t)seed->len);
        if (move != NULL) {
            done = move(fd, views, n, update, &state, a, b);
            if (done < 0) error = errno;
        } else {
            for (Py_ssize_t i = 0; i < n; i++) update(&state, views[i].buf, (size_t)views[i].len);
        }
        Py_END_ALLOW_THREADS
        if (done < 0) {
            errno = error;
            PyErr_SetFromErrno(PyExc_OSError);
        } else {
            *moved = done;
            *digest = XXH3_64bits_digest(&state);
            status = 0;
        }
        for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
        PyMem_Free(views);
    }
    Py_DECREF(seq);
    return status;
}

static PyObject *read_hashed(PyObject *self, PyObject *args) {
    int fd, baseline = 0;
    Py_buffer seed;
    Py_ssize_t s0, s1, got;
    XXH64_hash_t digest;
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "iy*nnO|p:read_hashed", &fd, &seed, &s0, &s1, &parts, &baseline))
        return NULL;
    int status = run(parts, "read_hashed() takes a sequence of buffers", PyBUF_WRITABLE, &seed,
                     baseline, read_hashed_impl, fd, s0, s1, &got, &digest);
    PyBuffer_Release(&seed);
    return status < 0 ? NULL : Py_BuildValue("nK", got, (unsigned long long)digest);
}

static PyObject *write_hashed(PyObject *self, PyObject *args) {
    int fd, baseline = 0;
    Py_buffer seed;
    Py_ssize_t offset, written;
    XXH64_hash_t digest;
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "iy*nO|p:write_hashed", &fd, &seed, &offset, &parts, &baseline))
        return NULL;
    int status = run(parts, "write_hashed() takes a sequence of buffers", PyBUF_SIMPLE, &seed,
                     baseline, write_hashed_impl, fd, offset, 0, &written, &digest);
    PyBuffer_Release(&seed);
    return status < 0 ? NULL : PyLong_FromUnsignedLongLong(digest);
}

static PyObject *hash_buffers(PyObject *self, PyObject *args) {
    Py_ssize_t unused;
    XXH64_hash_t digest;
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "O:hash_buffers", &parts)) return NULL;
    if (run(parts, "hash_buffers() takes a sequence of buffers", PyBUF_SIMPLE, NULL, 0, NULL,
            -1, 0, 0, &unused, &digest) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(digest);
}

static PyObject *vector(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(best_update == update_baseline ? "baseline" : "avx2");
}

static PyMethodDef methods[] = {
    {"read_hashed", read_hashed, METH_VARARGS,
     "read_hashed(fd, seed, skip_start, skip_end, buffers, baseline=False) -> (read, digest): "
     "read the file from offset 0 into the buffers in order until they are full or it ends; "
     "digest is XXH3-64 of seed, then the bytes read except [skip_start, skip_end). The GIL "
     "is released while reading; `baseline` forces the baseline build of XXH3 (for tests)."},
    {"hash_buffers", hash_buffers, METH_VARARGS,
     "hash_buffers(buffers) -> digest: XXH3-64 of the buffers' bytes in order, computed "
     "without the GIL (for values read or written some other way)."},
    {"write_hashed", write_hashed, METH_VARARGS,
     "write_hashed(fd, seed, offset, buffers, baseline=False) -> digest: write the buffers to "
     "the file from `offset` on; digest is XXH3-64 of seed, then the bytes written. The GIL "
     "is released while writing."},
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
    if (__builtin_cpu_supports("avx2")) best_update = kvx_xxh3_update_avx2;
#endif
    return PyModule_Create(&module);
}
