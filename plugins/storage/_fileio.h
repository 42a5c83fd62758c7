/* Shared by `_fileio.c` and `_fileio_avx2.c`: XXH3-64 streaming updates, one build per
 * instruction set (the same result from either). */
#ifndef KVX_STORAGE_FILEIO_H
#define KVX_STORAGE_FILEIO_H
#include <stddef.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash/xxhash.h" /* vendored, see vendor/xxhash/README.md */

/* XXH3_64bits_update built for AVX2 (only called on CPUs that have it). */
void kvx_xxh3_update_avx2(XXH3_state_t *state, const void *data, size_t len);
#endif
