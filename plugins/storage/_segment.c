/* Segment files: several stored values in one local file, each reachable under its own key.
 *
 * Creating a file costs an inode allocation, which on ext4 can cost more than writing a small
 * value (it walks recently freed inodes). A batch of values is therefore written into one new
 * file: a header with an index, then the values back to back, each exactly as it would be
 * stored alone. The file is then hard-linked under every value's key (a directory entry, no
 * new inode) and its temporary name removed; a reader opens a key, finds its value in the
 * index by the XXH3-64 of the key, and reads it from there. Layout (little-endian):
 *
 *   0   magic "KVXS", u16 version (1), u16 zero, u32 count, u32 header_len
 *   16  count entries of u64 key hash, u64 offset, u64 length
 *   ..  u64 XXH3-64 of the bytes above; zeros up to header_len (a multiple of 4096)
 *
 * A file whose size is exactly the value's is a value of its own (format 3 stores, and
 * batches of one value): never parsed as a segment.
 *
 * Writers place each value so that its payload starts on a 4 KiB boundary (the value's header
 * ends there; the bytes between values are a hole): a write that starts inside a page costs
 * the page cache a partial-page update per page, about half again the time of the write.
 * Readers go by the index's offsets, so segments written back to back still load.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "_fileio.h"

static uint64_t get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int b = 7; b >= 0; b--) v = v << 8 | p[b];
    return v;
}

static void put_u64(unsigned char *p, uint64_t v) {
    for (int b = 0; b < 8; b++) p[b] = (unsigned char)(v >> (8 * b));
}

Py_ssize_t kvx_segment_header_len(Py_ssize_t count) {
    Py_ssize_t used = KVX_SEG_FIXED + KVX_SEG_ENTRY * count + 8;
    return (used + KVX_SEG_ALIGN - 1) / KVX_SEG_ALIGN * KVX_SEG_ALIGN;
}

Py_ssize_t kvx_segment_value_at(Py_ssize_t count, Py_ssize_t i, Py_ssize_t head_len,
                                Py_ssize_t value_len) {
    Py_ssize_t lead = (head_len + KVX_SEG_ALIGN - 1) / KVX_SEG_ALIGN * KVX_SEG_ALIGN;
    Py_ssize_t payload = value_len - head_len;
    Py_ssize_t stride = lead + (payload + KVX_SEG_ALIGN - 1) / KVX_SEG_ALIGN * KVX_SEG_ALIGN;
    return kvx_segment_header_len(count) + i * stride + lead - head_len;
}

void kvx_segment_header(unsigned char *out, Py_ssize_t count, const uint64_t *key_hashes,
                        Py_ssize_t head_len, Py_ssize_t value_len) {
    Py_ssize_t header_len = kvx_segment_header_len(count);
    memset(out, 0, (size_t)header_len);
    memcpy(out, "KVXS", 4);
    out[4] = KVX_SEG_VERSION;
    for (int b = 0; b < 4; b++) {
        out[8 + b] = (unsigned char)((uint64_t)count >> (8 * b));
        out[12 + b] = (unsigned char)((uint64_t)header_len >> (8 * b));
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned char *entry = out + KVX_SEG_FIXED + KVX_SEG_ENTRY * i;
        put_u64(entry, key_hashes[i]);
        put_u64(entry + 8, (uint64_t)kvx_segment_value_at(count, i, head_len, value_len));
        put_u64(entry + 16, (uint64_t)value_len);
    }
    Py_ssize_t used = KVX_SEG_FIXED + KVX_SEG_ENTRY * count;
    put_u64(out + used, XXH3_64bits(out, (size_t)used));
}

void kvx_segment_forget(kvx_segment_cache_t *cache) {
    free(cache->index);
    cache->index = NULL;
    cache->count = 0;
    cache->ino = 0;
    cache->dev = 0;
}

/* Parse the header of the segment file `fd` into `cache`: 1, 0 if it is not a well-formed
 * segment (nothing cached), -1 with errno set if it cannot be read. */
static int load_index(int fd, const struct stat *st, kvx_segment_cache_t *cache) {
    unsigned char first[KVX_SEG_ALIGN];
    ssize_t got = pread(fd, first, sizeof first, 0);
    if (got < 0) return -1;
    if (got < KVX_SEG_FIXED + 8 || memcmp(first, "KVXS", 4) != 0 || first[4] != KVX_SEG_VERSION ||
        first[5] != 0)
        return 0;
    uint64_t count = 0, header_len = 0;
    for (int b = 3; b >= 0; b--) {
        count = count << 8 | first[8 + b];
        header_len = header_len << 8 | first[12 + b];
    }
    if (count == 0 || count > KVX_SEG_MAX_VALUES ||
        header_len != (uint64_t)kvx_segment_header_len((Py_ssize_t)count) ||
        header_len > (uint64_t)st->st_size)
        return 0;
    size_t used = KVX_SEG_FIXED + KVX_SEG_ENTRY * (size_t)count;
    unsigned char *header = malloc(used + 8);
    if (header == NULL) {
        errno = ENOMEM;
        return -1;
    }
    size_t have = (size_t)got < used + 8 ? (size_t)got : used + 8;
    memcpy(header, first, have);
    while (have < used + 8) {
        got = pread(fd, header + have, used + 8 - have, (off_t)have);
        if (got <= 0) {
            free(header);
            if (got < 0 && errno != EINTR) return -1;
            if (got == 0) return 0;
            continue;
        }
        have += (size_t)got;
    }
    if (XXH3_64bits(header, used) != get_u64(header + used)) {
        free(header);
        return 0;
    }
    for (uint64_t i = 0; i < count; i++) { /* every value inside the file */
        const unsigned char *entry = header + KVX_SEG_FIXED + KVX_SEG_ENTRY * i;
        uint64_t offset = get_u64(entry + 8), length = get_u64(entry + 16);
        if (offset < header_len || length > (uint64_t)st->st_size ||
            offset > (uint64_t)st->st_size - length) {
            free(header);
            return 0;
        }
    }
    kvx_segment_forget(cache);
    cache->index = header;
    cache->count = (Py_ssize_t)count;
    cache->dev = st->st_dev;
    cache->ino = st->st_ino;
    return 1;
}

int kvx_segment_find(int fd, const struct stat *st, uint64_t key_hash,
                     kvx_segment_cache_t *cache, Py_ssize_t *offset, Py_ssize_t *length) {
    if (cache->index == NULL || cache->dev != st->st_dev || cache->ino != st->st_ino) {
        int loaded = load_index(fd, st, cache);
        if (loaded <= 0) return loaded;
    }
    for (Py_ssize_t i = 0; i < cache->count; i++) {
        const unsigned char *entry = cache->index + KVX_SEG_FIXED + KVX_SEG_ENTRY * i;
        if (get_u64(entry) == key_hash) {
            *offset = (Py_ssize_t)get_u64(entry + 8);
            *length = (Py_ssize_t)get_u64(entry + 16);
            return 1;
        }
    }
    return 0;
}
