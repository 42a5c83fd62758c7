/* Segment files: several stored values in one local file, each reachable under its own key.
 *
 * Creating a file costs an inode allocation, which on ext4 can cost more than writing a small
 * value (it walks recently freed inodes). A batch of values is therefore written into one new
 * file: an index, then the values. The file is then hard-linked under every value's key (a
 * directory entry, no new inode) and its temporary name removed; a reader opens a key, finds
 * its value in the index by the XXH3-64 of the key, and reads it from there. The index is read
 * once per file and kept (`kvx_segment_cache_t`) while a batch reads the file's other values.
 *
 * Version 2 (written), little-endian:
 *
 *   0   magic "KVXS", u16 version (2), u16 zero, u32 count, u32 header_len
 *   16  u32 head_len, u32 zero, u64 payload_len, u64 data_start
 *   40  the values' common header up to its checksum (head_len - 8 bytes)
 *   ..  count entries of u64 key hash, u64 the value's checksum (its header's last 8 bytes)
 *   ..  u64 XXH3-64 of the bytes above; zeros up to header_len (a multiple of 4096)
 *   data_start (a multiple of 2 MiB; a hole before it): the payloads back to back, value i's
 *       at data_start + i * payload_len
 *
 * A value is its header (the common part, then its checksum) followed by its payload, as if
 * it were stored alone. Payloads start on a 2 MiB boundary and follow one another without a
 * gap, so the page cache keeps large folios for them (a read then costs about what reading
 * one large file does) and a run of values is one stretch of the file.
 *
 * Version 1 (still read): the same first 16 bytes, then count entries of u64 key hash, u64
 * offset, u64 length and the XXH3-64 of the bytes above, zeros up to header_len; each value
 * (header and payload) lies whole at its offset, payloads on 4 KiB boundaries.
 *
 * A file whose size is exactly the value's is a value of its own (format 3 stores, and
 * batches of one value): never parsed as a segment. A file that starts with the magic but
 * holds another version is refused (KVX_SEG_UNSUPPORTED), never read as a value.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "_fileio.h"

#define V1_FIXED 16
#define V1_ENTRY 24
#define V2_FIXED 40
#define V2_ENTRY 16

static uint64_t get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int b = 7; b >= 0; b--) v = v << 8 | p[b];
    return v;
}

static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_u64(unsigned char *p, uint64_t v) {
    for (int b = 0; b < 8; b++) p[b] = (unsigned char)(v >> (8 * b));
}

static void put_u32(unsigned char *p, uint32_t v) {
    for (int b = 0; b < 4; b++) p[b] = (unsigned char)(v >> (8 * b));
}

static Py_ssize_t round_up(Py_ssize_t n, Py_ssize_t to) { return (n + to - 1) / to * to; }

static Py_ssize_t v1_header_len(uint64_t count) {
    return round_up(V1_FIXED + V1_ENTRY * (Py_ssize_t)count + 8, KVX_SEG_ALIGN);
}

Py_ssize_t kvx_segment_header_len(Py_ssize_t count, Py_ssize_t head_len) {
    return round_up(V2_FIXED + (head_len - 8) + V2_ENTRY * count + 8, KVX_SEG_ALIGN);
}

Py_ssize_t kvx_segment_data_start(Py_ssize_t count, Py_ssize_t head_len) {
    return round_up(kvx_segment_header_len(count, head_len), KVX_SEG_DATA_ALIGN);
}

void kvx_segment_header(unsigned char *out, Py_ssize_t count, const uint64_t *key_hashes,
                        const uint64_t *checksums, const unsigned char *prefix,
                        Py_ssize_t head_len, Py_ssize_t payload_len) {
    Py_ssize_t header_len = kvx_segment_header_len(count, head_len);
    memset(out, 0, (size_t)header_len);
    memcpy(out, "KVXS", 4);
    out[4] = KVX_SEG_VERSION;
    put_u32(out + 8, (uint32_t)count);
    put_u32(out + 12, (uint32_t)header_len);
    put_u32(out + 16, (uint32_t)head_len);
    put_u64(out + 24, (uint64_t)payload_len);
    put_u64(out + 32, (uint64_t)kvx_segment_data_start(count, head_len));
    memcpy(out + V2_FIXED, prefix, (size_t)(head_len - 8));
    unsigned char *entries = out + V2_FIXED + head_len - 8;
    for (Py_ssize_t i = 0; i < count; i++) {
        put_u64(entries + V2_ENTRY * i, key_hashes[i]);
        put_u64(entries + V2_ENTRY * i + 8, checksums[i]);
    }
    Py_ssize_t used = entries + V2_ENTRY * count - out;
    put_u64(out + used, XXH3_64bits(out, (size_t)used));
}

void kvx_segment_forget(kvx_segment_cache_t *cache) {
    free(cache->index);
    *cache = (kvx_segment_cache_t){0};
}

/* The first `used` bytes of the file (of which `have` are in `first`), followed by their
 * XXH3-64, if it matches: a malloc'd copy; NULL with *status 0 if the file is too short or the
 * checksum does not match, -1 with errno set if it cannot be read. */
static unsigned char *read_checked(int fd, const unsigned char *first, size_t have, size_t used,
                                   int *status) {
    unsigned char *header = malloc(used + 8);
    *status = 0;
    if (header == NULL) {
        errno = ENOMEM;
        *status = -1;
        return NULL;
    }
    if (have > used + 8) have = used + 8;
    memcpy(header, first, have);
    while (have < used + 8) {
        ssize_t got = pread(fd, header + have, used + 8 - have, (off_t)have);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            free(header);
            if (got < 0) *status = -1;
            return NULL;
        }
        have += (size_t)got;
    }
    if (XXH3_64bits(header, used) != get_u64(header + used)) {
        free(header);
        return NULL;
    }
    return header;
}

/* Version 1's index, checked; KVX_SEG_FOUND with `cache->index` set, else as load_index. */
static int load_v1(int fd, const struct stat *st, const unsigned char *first, size_t got,
                   uint64_t count, uint64_t header_len, kvx_segment_cache_t *cache) {
    if (header_len != (uint64_t)v1_header_len(count) || header_len > (uint64_t)st->st_size)
        return KVX_SEG_NOT_SEGMENT;
    size_t used = V1_FIXED + V1_ENTRY * (size_t)count;
    int status;
    unsigned char *header = read_checked(fd, first, got, used, &status);
    if (header == NULL) return status < 0 ? -1 : KVX_SEG_NOT_SEGMENT;
    for (uint64_t i = 0; i < count; i++) { /* every value inside the file */
        const unsigned char *entry = header + V1_FIXED + V1_ENTRY * i;
        uint64_t offset = get_u64(entry + 8), length = get_u64(entry + 16);
        if (offset < header_len || length > (uint64_t)st->st_size ||
            offset > (uint64_t)st->st_size - length) {
            free(header);
            return KVX_SEG_NOT_SEGMENT;
        }
    }
    cache->index = header;
    return KVX_SEG_FOUND;
}

/* Version 2's index, checked (every payload inside the file: a segment cut short is no
 * segment); KVX_SEG_FOUND with `cache` filled, else as load_index. */
static int load_v2(int fd, const struct stat *st, const unsigned char *first, size_t got,
                   uint64_t count, uint64_t header_len, kvx_segment_cache_t *cache) {
    if (got < V2_FIXED) return KVX_SEG_NOT_SEGMENT;
    uint64_t head_len = get_u32(first + 16), payload = get_u64(first + 24);
    uint64_t start = get_u64(first + 32), size = (uint64_t)st->st_size;
    if (head_len < 8 || head_len > KVX_SEG_MAX_HEAD || get_u32(first + 20) != 0 ||
        header_len != (uint64_t)kvx_segment_header_len((Py_ssize_t)count, (Py_ssize_t)head_len) ||
        start % KVX_SEG_ALIGN != 0 || start < header_len || start > size ||
        payload > (size - start) / count)
        return KVX_SEG_NOT_SEGMENT;
    size_t used = V2_FIXED + (size_t)head_len - 8 + V2_ENTRY * (size_t)count;
    int status;
    unsigned char *header = read_checked(fd, first, got, used, &status);
    if (header == NULL) return status < 0 ? -1 : KVX_SEG_NOT_SEGMENT;
    cache->index = header;
    cache->head_len = (Py_ssize_t)head_len;
    cache->payload_len = (Py_ssize_t)payload;
    cache->data_start = (Py_ssize_t)start;
    return KVX_SEG_FOUND;
}

/* Parse the header of the segment file `fd` into `cache`: KVX_SEG_FOUND; KVX_SEG_NOT_SEGMENT
 * if it is not a well-formed segment; KVX_SEG_UNSUPPORTED (the version in the cache) for a
 * segment of a version this reader does not know; -1 with errno set if it cannot be read. */
static int load_index(int fd, const struct stat *st, kvx_segment_cache_t *cache) {
    unsigned char first[KVX_SEG_ALIGN];
    ssize_t got = pread(fd, first, sizeof first, 0);
    if (got < 0) return -1;
    kvx_segment_forget(cache);
    if (got < V1_FIXED + 8 || memcmp(first, "KVXS", 4) != 0) return KVX_SEG_NOT_SEGMENT;
    int version = first[4] | first[5] << 8;
    if (version != 1 && version != 2) {
        cache->version = version;
        return KVX_SEG_UNSUPPORTED;
    }
    uint64_t count = get_u32(first + 8), header_len = get_u32(first + 12);
    if (count == 0 || count > KVX_SEG_MAX_VALUES || first[6] != 0 || first[7] != 0)
        return KVX_SEG_NOT_SEGMENT;
    int loaded = version == 1 ? load_v1(fd, st, first, (size_t)got, count, header_len, cache)
                              : load_v2(fd, st, first, (size_t)got, count, header_len, cache);
    if (loaded != KVX_SEG_FOUND) return loaded;
    cache->version = version;
    cache->count = (Py_ssize_t)count;
    cache->dev = st->st_dev;
    cache->ino = st->st_ino;
    return KVX_SEG_FOUND;
}

int kvx_segment_find(int fd, const struct stat *st, uint64_t key_hash,
                     kvx_segment_cache_t *cache, kvx_segment_value_t *value) {
    if (cache->index == NULL || cache->dev != st->st_dev || cache->ino != st->st_ino) {
        int loaded = load_index(fd, st, cache);
        if (loaded != KVX_SEG_FOUND) return loaded;
    }
    *value = (kvx_segment_value_t){0};
    if (cache->version == 1) {
        for (Py_ssize_t i = 0; i < cache->count; i++) {
            const unsigned char *entry = cache->index + V1_FIXED + V1_ENTRY * i;
            if (get_u64(entry) == key_hash) {
                value->offset = (Py_ssize_t)get_u64(entry + 8);
                value->length = (Py_ssize_t)get_u64(entry + 16);
                return KVX_SEG_FOUND;
            }
        }
        return KVX_SEG_NO_KEY;
    }
    const unsigned char *entries = cache->index + V2_FIXED + cache->head_len - 8;
    for (Py_ssize_t i = 0; i < cache->count; i++) {
        if (get_u64(entries + V2_ENTRY * i) == key_hash) {
            value->index = i;
            value->offset = cache->data_start + i * cache->payload_len;
            value->length = cache->payload_len;
            value->prefix = cache->index + V2_FIXED;
            value->head_len = cache->head_len;
            value->checksum = get_u64(entries + V2_ENTRY * i + 8);
            return KVX_SEG_FOUND;
        }
    }
    return KVX_SEG_NO_KEY;
}
