/* Shared by `_fileio.c` (the module), `_fileread.c` (reads), `_filewrite.c` (writes),
 * `_fileio_avx2.c` and `_segment.c`: XXH3-64 streaming updates, one build per instruction set
 * (the same result from either), the held arguments of a batch of values, and the segment-file
 * format. */
#ifndef KVX_STORAGE_FILEIO_H
#define KVX_STORAGE_FILEIO_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#define XXH_INLINE_ALL
#include "xxhash.h" /* vendored: vendor/xxhash (setup.py's include_dirs), see its README.md */

/* XXH3_64bits_update built for AVX2 (only called on CPUs that have it). */
void kvx_xxh3_update_avx2(XXH3_state_t *state, const void *data, size_t len);

typedef void (*kvx_update_fn)(XXH3_state_t *, const void *, size_t);
void kvx_update_baseline(XXH3_state_t *state, const void *data, size_t len);
extern kvx_update_fn kvx_best_update; /* the AVX2 build where the CPU has it */

/* Block values: a value is a header, then one region of the KV cache per table entry for one
 * engine block (`_fileio.c` holds the arguments of a batch, `_filewrite.c` writes it). */
typedef struct {
    Py_buffer view;
    Py_ssize_t start, size, step; /* block b's region: view.buf[start + b * step, + size) */
} region_t;

typedef struct {
    Py_ssize_t n;
    region_t *regions;
} table_t;

/* Per value: its path (a bytes object from PyUnicode_FSConverter) and a held buffer. */
typedef struct {
    Py_ssize_t n;
    PyObject **paths;
    Py_buffer *buffers;
} batch_t;

/* What write_blocks and read_blocks share, held: per value a path and a checksum seed
 * (`named`), the block ids, the region table, and the fast sequences of the arguments (paths,
 * the caller's own per-value sequence, seeds, blocks). */
typedef struct {
    Py_ssize_t n, payload; /* values; bytes of a block's regions */
    PyObject *fast[4];
    table_t table;
    batch_t named;
    Py_ssize_t *ids;
} call_t;

/* Hold the arguments shared by reads and writes (`where`: their positions, for errors); 0, or
 * -1 with an exception. Release with kvx_release_call either way. */
int kvx_hold_call(PyObject *paths, PyObject *own, PyObject *seeds, PyObject *blocks,
                  PyObject *spec, int table_flags, const int *where, call_t *call);
void kvx_release_call(call_t *call);
/* Hold per value a path (unless `paths` is NULL) and a buffer (`flags`, unless `buffers` is
 * NULL); 0, or -1 with an exception. */
int kvx_hold_batch(PyObject *paths, PyObject *buffers, Py_ssize_t n, int flags, batch_t *batch);
void kvx_release_batch(batch_t *batch);
/* The regions of `block` as views (only .buf and .len are used). */
void kvx_fill_parts(Py_buffer *parts, const table_t *table, Py_ssize_t block);
/* XXH3-64 of each of `n` keys (bytes-like), as a PyMem array; NULL with an exception. */
uint64_t *kvx_key_hashes(PyObject *keys, Py_ssize_t n);
/* read_blocks (`_fileread.c`), write_blocks / write_segment (`_filewrite.c`; see the method
 * table in `_fileio.c`). */
PyObject *kvx_read_blocks(PyObject *self, PyObject *args);
PyObject *kvx_write_blocks(PyObject *self, PyObject *args);
PyObject *kvx_write_segment(PyObject *self, PyObject *args);

/* Segment files (`_segment.c`). */
#define KVX_SEG_VERSION 2 /* written; version 1 is still read */
#define KVX_SEG_ALIGN 4096
#define KVX_SEG_DATA_ALIGN (2 << 20) /* where payloads start: a huge page's boundary */
#define KVX_SEG_MAX_VALUES 4096
#define KVX_SEG_MAX_HEAD 4096 /* a value's header, checksum included: 64 bytes in block format 3 */

/* What kvx_segment_find says of a file (or -1 with errno set when it cannot be read). */
#define KVX_SEG_NOT_SEGMENT 0 /* not a well-formed segment: a value of its own, or damaged */
#define KVX_SEG_FOUND 1
#define KVX_SEG_NO_KEY 2      /* a segment that does not hold the key */
#define KVX_SEG_UNSUPPORTED 3 /* a segment of a version this reader does not know */

typedef struct { /* the index of the segment file last looked into */
    dev_t dev;
    ino_t ino;
    int version; /* also set for KVX_SEG_UNSUPPORTED (then index is NULL) */
    Py_ssize_t count;
    Py_ssize_t head_len, payload_len, data_start; /* version 2 */
    unsigned char *index;                          /* its header, malloc'd */
} kvx_segment_cache_t;

typedef struct { /* where one value lies in a segment */
    Py_ssize_t index;          /* its place in the segment (version 2) */
    Py_ssize_t offset, length; /* version 1: the whole value; version 2: its payload */
    const unsigned char *prefix; /* version 2: its header up to the checksum (in the cache) */
    Py_ssize_t head_len;       /* version 2: bytes of its header, checksum included */
    uint64_t checksum;         /* version 2: its header's last 8 bytes */
} kvx_segment_value_t;

/* Bytes before the first payload's 2 MiB boundary holds the index (version 2). */
Py_ssize_t kvx_segment_header_len(Py_ssize_t count, Py_ssize_t head_len);
/* Where the payloads of a version-2 segment begin. */
Py_ssize_t kvx_segment_data_start(Py_ssize_t count, Py_ssize_t head_len);
/* Fill `out` (kvx_segment_header_len(count, head_len) bytes) with a version-2 index: value i,
 * under key hash key_hashes[i], is `prefix` (head_len - 8 bytes) and checksums[i], then its
 * payload of payload_len bytes. */
void kvx_segment_header(unsigned char *out, Py_ssize_t count, const uint64_t *key_hashes,
                        const uint64_t *checksums, const unsigned char *prefix,
                        Py_ssize_t head_len, Py_ssize_t payload_len);
/* Where the value of key hash `key_hash` lies in the file `fd` (`st` its fstat): a KVX_SEG_*
 * code (`value` set for KVX_SEG_FOUND), or -1 with errno set. Without the GIL; keeps the
 * index in `cache`. */
int kvx_segment_find(int fd, const struct stat *st, uint64_t key_hash,
                     kvx_segment_cache_t *cache, kvx_segment_value_t *value);
void kvx_segment_forget(kvx_segment_cache_t *cache);
#endif
