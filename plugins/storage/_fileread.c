/* Read stored values from files into the KV cache, checksumming them in the same pass, without
 * the GIL (`read_blocks`; the method table is in `_fileio.c`, writes in `_filewrite.c`).
 *
 * A batch's files are looked up from their common directory, opened once per batch, so each
 * lookup walks only the last components of a path. Consecutive values of a segment file
 * (`_segment.c`) are hard links of one file: it is opened once and kept open while its index
 * is cached, and each next value's path is looked up with a stat only; the open file is read
 * when the path names that file (the same device and inode), otherwise the path is opened
 * anew. While a segment is kept, the next LOOKAHEAD paths are looked up together before their
 * values are read: a lookup right after another finds the directory entries in the CPU's
 * caches, one after copying a value does not (about 1 us less per value). A file kept open
 * cannot be deleted and its inode number reused while its index is cached, so a cached index
 * always belongs to the file it is read from.
 */
#define _GNU_SOURCE /* O_PATH */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_fileio.h"

#define CHUNK_BYTES (256 * 1024) /* read, then hashed while in the L2 cache */
#define CHUNK_IOVS 64
#define MAX_IOVS 1024 /* IOV_MAX on Linux: a whole value per preadv when nothing is hashed */
#define LOOKAHEAD 32   /* paths looked up together while a segment file is kept open */

/* Hash `len` bytes of the stream at offset `at` from `data`, leaving out [s0, s1). */
static void hash_piece(kvx_update_fn update, XXH3_state_t *state, const char *data, Py_ssize_t at,
                       Py_ssize_t len, Py_ssize_t s0, Py_ssize_t s1) {
    Py_ssize_t end = at + len;
    if (end <= s0 || at >= s1) {
        update(state, data, (size_t)len);
        return;
    }
    if (at < s0) update(state, data, (size_t)(s0 - at));
    if (end > s1) update(state, data + (s1 - at), (size_t)(end - s1));
}

/* Read from `fd` (offset `base` on) straight into the buffers until they are full or the file
 * ends, about CHUNK_BYTES per preadv, hashing each chunk right after it is read (while it is
 * in the cache; `s0`, `s1` count from `base`); without `update`, nothing is hashed and each
 * preadv takes up to MAX_IOVS buffers whatever their size. The bytes read, or -1 with errno
 * set. */
static Py_ssize_t read_hashed_impl(int fd, Py_ssize_t base, Py_buffer *views, Py_ssize_t n,
                                   kvx_update_fn update, XXH3_state_t *state, Py_ssize_t s0,
                                   Py_ssize_t s1) {
    struct iovec iov[MAX_IOVS];
    Py_ssize_t index = 0, offset_in = 0, done = 0;
    const Py_ssize_t chunk = update != NULL ? CHUNK_BYTES : PY_SSIZE_T_MAX;
    const int most = update != NULL ? CHUNK_IOVS : MAX_IOVS;
    while (index < n) {
        int count = 0;
        Py_ssize_t batch = 0;
        for (Py_ssize_t i = index; i < n && count < most && batch < chunk; i++) {
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
        ssize_t got = preadv(fd, iov, count, (off_t)(base + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) break; /* the file is shorter than the buffers */
        for (int k = 0; k < count && got > 0; k++) {
            Py_ssize_t take = (Py_ssize_t)iov[k].iov_len < got ? (Py_ssize_t)iov[k].iov_len : got;
            if (update != NULL) hash_piece(update, state, iov[k].iov_base, done, take, s0, s1);
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


/* Where a batch's values are opened from (see the top of the file). */
typedef struct {
    int dir;     /* the paths' common directory (O_PATH), or AT_FDCWD */
    size_t skip; /* the bytes of every path that `dir` stands for */
    int segment; /* the segment file whose index is cached, kept open; or -1 */
    dev_t dev;   /* its identity */
    ino_t ino;
    Py_ssize_t ahead_from, ahead_count; /* the values whose paths were looked up ahead */
    struct stat ahead[LOOKAHEAD];       /* what each path named then */
    int ahead_errno[LOOKAHEAD];         /* or why it could not be looked up */
} files_t;

static void no_files(files_t *files) {
    files->dir = AT_FDCWD;
    files->skip = 0;
    files->segment = -1;
    files->ahead_from = files->ahead_count = 0;
}

/* Open the longest directory every path of the batch lies under (a prefix ending in '/'); with
 * none but the root, or when it cannot be opened, paths are looked up whole. */
static void open_common_dir(files_t *files, PyObject *const *paths, Py_ssize_t n) {
    no_files(files);
    if (n < 2) return;
    const char *first = PyBytes_AS_STRING(paths[0]);
    size_t common = (size_t)PyBytes_GET_SIZE(paths[0]);
    for (Py_ssize_t i = 1; i < n && common > 0; i++) {
        const char *path = PyBytes_AS_STRING(paths[i]);
        size_t k = 0;
        while (k < common && path[k] == first[k]) k++;
        common = k;
    }
    while (common > 0 && first[common - 1] != '/') common--;
    if (common < 2) return; /* nothing in common, or only "/" */
    char *dir = PyMem_RawMalloc(common + 1);
    if (dir == NULL) return;
    memcpy(dir, first, common);
    dir[common] = '\0';
    int fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    PyMem_RawFree(dir);
    if (fd >= 0) {
        files->dir = fd;
        files->skip = common;
    }
}

static void close_files(files_t *files) {
    if (files->segment >= 0) close(files->segment);
    if (files->dir != AT_FDCWD) close(files->dir);
    no_files(files);
}

/* Where `path` is looked up from: the directory (`*dir`) and the rest of the path. */
static const char *relative(const files_t *files, const char *path, int *dir) {
    const char *rest = path + files->skip;
    while (*rest == '/') rest++;
    *dir = files->dir;
    if (files->skip == 0 || *rest == '\0') { /* looked up whole */
        *dir = AT_FDCWD;
        return path;
    }
    return rest;
}

/* Look up the paths of values `i` on (up to LOOKAHEAD of them) one after another. */
static void look_ahead(files_t *files, PyObject *const *paths, Py_ssize_t n, Py_ssize_t i) {
    files->ahead_from = i;
    files->ahead_count = n - i < LOOKAHEAD ? n - i : LOOKAHEAD;
    for (Py_ssize_t k = 0; k < files->ahead_count; k++) {
        int dir;
        const char *rest = relative(files, PyBytes_AS_STRING(paths[i + k]), &dir);
        files->ahead_errno[k] = fstatat(dir, rest, &files->ahead[k], 0) < 0 ? errno : 0;
    }
}

/* The file of value `i` open for reading, and its fstat in `st`: the segment file kept open
 * when the value's path names it (`*kept` set: not to be closed), else a new descriptor; -1
 * with errno set if it cannot be opened. */
static int open_value(files_t *files, PyObject *const *paths, Py_ssize_t n, Py_ssize_t i,
                      struct stat *st, int *kept) {
    *kept = 0;
    if (files->segment >= 0) {
        if (i < files->ahead_from || i >= files->ahead_from + files->ahead_count)
            look_ahead(files, paths, n, i);
        Py_ssize_t k = i - files->ahead_from;
        if (files->ahead_errno[k] != 0) {
            errno = files->ahead_errno[k];
            return -1;
        }
        *st = files->ahead[k];
        if (st->st_dev == files->dev && st->st_ino == files->ino) {
            *kept = 1;
            return files->segment;
        }
    }
    int dir;
    const char *rest = relative(files, PyBytes_AS_STRING(paths[i]), &dir);
    /* O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files are read.
     * O_NOFOLLOW: a value that is a symbolic link is not followed (ELOOP), in or out of the
     * store */
    int fd = openat(dir, rest, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) return -1;
    int error;
    if (fstat(fd, st) < 0) error = errno;
    else if (S_ISREG(st->st_mode)) return fd;
    else error = S_ISDIR(st->st_mode) ? EISDIR : EINVAL; /* EINVAL: a FIFO, device or socket */
    close(fd);
    errno = error;
    return -1;
}

/* Keep `fd` (`st` its fstat) open as the segment file whose index `cache` now holds. */
static void keep_segment(files_t *files, int fd, const struct stat *st) {
    if (files->segment >= 0) close(files->segment);
    files->segment = fd;
    files->dev = st->st_dev;
    files->ino = st->st_ino;
}

PyObject *kvx_read_blocks(PyObject *self, PyObject *args) {
    PyObject *paths, *seeds, *heads, *spec, *blocks, *keys = Py_None;
    Py_ssize_t s0, s1;
    int baseline = 0, hashed = 1;
    if (!PyArg_ParseTuple(args, "OOnnOOO|pOp:read_blocks", &paths, &seeds, &s0, &s1, &heads, &spec,
                          &blocks, &baseline, &keys, &hashed))
        return NULL;
    kvx_update_fn update = !hashed ? NULL : baseline ? kvx_update_baseline : kvx_best_update;
    static const int where[4] = {1, 5, 2, 7};
    PyObject *result = NULL;
    call_t call;
    batch_t tops = {0, NULL, NULL};
    Py_ssize_t *sizes = NULL;
    XXH64_hash_t *digests = NULL;
    Py_buffer *parts = NULL;
    uint64_t *hashes = NULL; /* per value its key's hash, to find it in a segment file */
    kvx_segment_cache_t segment = {0};
    Py_ssize_t unsupported = -1; /* the first value found in a segment of an unknown version */
    int unsupported_version = 0;
    if (kvx_hold_call(paths, heads, seeds, blocks, spec, PyBUF_WRITABLE, where, &call) < 0 ||
        kvx_hold_batch(NULL, call.fast[1], call.n, PyBUF_WRITABLE, &tops) < 0 ||
        (keys != Py_None && (hashes = kvx_key_hashes(keys, call.n)) == NULL))
        goto done;
    Py_ssize_t n = call.n;
    const table_t *table = &call.table;
    sizes = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_ssize_t));
    digests = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(XXH64_hash_t));
    parts = PyMem_Calloc((size_t)table->n + 1, sizeof(Py_buffer));
    if (sizes == NULL || digests == NULL || parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    files_t files;
    Py_BEGIN_ALLOW_THREADS
    open_common_dir(&files, call.named.paths, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        struct stat st;
        int kept;
        int fd = open_value(&files, call.named.paths, n, i, &st, &kept);
        if (fd < 0) {
            sizes[i] = -(Py_ssize_t)errno - 1; /* -1 - errno: not read */
            continue;
        }
        parts[0].buf = tops.buffers[i].buf;
        parts[0].len = tops.buffers[i].len;
        kvx_fill_parts(parts + 1, table, call.ids[i]);
        Py_ssize_t total = tops.buffers[i].len + call.payload;
        kvx_segment_value_t where = {0, 0, (Py_ssize_t)st.st_size, NULL, 0, 0};
        sizes[i] = (Py_ssize_t)st.st_size;
        if (hashes != NULL && sizes[i] > total) { /* a segment file holding several values? */
            int found = kvx_segment_find(fd, &st, hashes[i], &segment, &where);
            if (!kept && segment.index != NULL && segment.dev == st.st_dev &&
                segment.ino == st.st_ino) {
                keep_segment(&files, fd, &st); /* its index is cached: read its next values */
                kept = 1;
            }
            if (found == KVX_SEG_UNSUPPORTED && unsupported < 0) {
                unsupported = i;
                unsupported_version = segment.version;
            }
            if (found == KVX_SEG_FOUND) sizes[i] = where.head_len + where.length;
            else if (found != KVX_SEG_NOT_SEGMENT) /* not in it, or unreadable: not read */
                sizes[i] = -(Py_ssize_t)(found < 0 ? errno : found == KVX_SEG_NO_KEY ? ENOENT
                                                                                      : EPROTO) - 1;
        }
        if (sizes[i] == total && where.prefix != NULL && where.head_len != parts[0].len)
            sizes[i] = -(Py_ssize_t)EINVAL - 1; /* a header of another length: never half-read */
        if (sizes[i] == total) {
            XXH3_state_t state;
            XXH3_64bits_reset(&state);
            XXH3_64bits_update(&state, call.named.buffers[i].buf,
                               (size_t)call.named.buffers[i].len);
            Py_ssize_t got, skip = 0;
            if (where.prefix != NULL) { /* version 2: the header is in the segment's index */
                unsigned char *head = parts[0].buf;
                memcpy(head, where.prefix, (size_t)where.head_len - 8);
                for (int b = 0; b < 8; b++)
                    head[where.head_len - 8 + b] = (unsigned char)(where.checksum >> (8 * b));
                if (update != NULL)
                    hash_piece(update, &state, parts[0].buf, 0, where.head_len, s0, s1);
                skip = where.head_len;
            }
            got = read_hashed_impl(fd, where.offset, parts + (skip ? 1 : 0),
                                   table->n + (skip ? 0 : 1), update, &state, s0 - skip, s1 - skip);
            if (got >= 0) got += skip;
            if (got < 0) sizes[i] = -(Py_ssize_t)errno - 1;
            else if (got != total) sizes[i] = got; /* shrank since fstat: no digest */
            else if (hashed) digests[i] = XXH3_64bits_digest(&state);
        }
        if (!kept) close(fd);
    }
    close_files(&files);
    Py_END_ALLOW_THREADS
    if (unsupported >= 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: a segment file of version %d; this kvx reads segment versions 1 and %d "
                     "(written by a newer kvx? load it with that one, or remove the file)",
                     PyBytes_AS_STRING(call.named.paths[unsupported]), unsupported_version,
                     KVX_SEG_VERSION);
        goto done;
    }
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        Py_ssize_t total = tops.buffers[i].len + call.payload;
        PyObject *item = sizes[i] < 0 ? Py_BuildValue("(OOi)", Py_None, Py_None, (int)(-1 - sizes[i]))
                         : sizes[i] == total && hashed
                             ? Py_BuildValue("(nKi)", sizes[i], (unsigned long long)digests[i], 0)
                             : Py_BuildValue("(nOi)", sizes[i], Py_None, 0);
        if (item == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, item);
    }
done:
    kvx_segment_forget(&segment);
    PyMem_Free(hashes);
    PyMem_Free(parts);
    PyMem_Free(digests);
    PyMem_Free(sizes);
    kvx_release_batch(&tops);
    kvx_release_call(&call);
    return result;
}

