/* Shared by `_fileio.c`, `_fileio_avx2.c` and `_segment.c`: XXH3-64 streaming updates, one
 * build per instruction set (the same result from either), and the segment-file format. */
#ifndef KVX_STORAGE_FILEIO_H
#define KVX_STORAGE_FILEIO_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash/xxhash.h" /* vendored, see vendor/xxhash/README.md */

/* XXH3_64bits_update built for AVX2 (only called on CPUs that have it). */
void kvx_xxh3_update_avx2(XXH3_state_t *state, const void *data, size_t len);

/* Segment files (`_segment.c`). */
#define KVX_SEG_VERSION 1
#define KVX_SEG_FIXED 16
#define KVX_SEG_ENTRY 24
#define KVX_SEG_ALIGN 4096
#define KVX_SEG_MAX_VALUES 4096

typedef struct { /* the index of the segment file last looked into */
    dev_t dev;
    ino_t ino;
    Py_ssize_t count;
    unsigned char *index; /* its header, malloc'd */
} kvx_segment_cache_t;

/* Bytes before the first value of a segment of `count` values. */
Py_ssize_t kvx_segment_header_len(Py_ssize_t count);
/* Fill `out` (kvx_segment_header_len(count) bytes): values of `value_len` bytes each, back to
 * back after the header, value i under key hash key_hashes[i]. */
void kvx_segment_header(unsigned char *out, Py_ssize_t count, const uint64_t *key_hashes,
                        Py_ssize_t value_len);
/* Where the value of key hash `key_hash` lies in the file `fd` (`st` its fstat): 1 with
 * `offset` and `length` set; 0 if the file is not a well-formed segment or has no such key;
 * -1 with errno set when it cannot be read. Without the GIL; keeps the index in `cache`. */
int kvx_segment_find(int fd, const struct stat *st, uint64_t key_hash,
                     kvx_segment_cache_t *cache, Py_ssize_t *offset, Py_ssize_t *length);
void kvx_segment_forget(kvx_segment_cache_t *cache);
#endif
