/* Shared by `_digest.c` (the module) and `_digest_avx2.c`: XXH3-64 streaming updates, one build
 * per instruction set (the same digests from either). */
#ifndef KVX_CONTRACT_DIGEST_H
#define KVX_CONTRACT_DIGEST_H
#include <stddef.h>

#define XXH_INLINE_ALL
#include "xxhash.h" /* vendored: vendor/xxhash (setup.py's include_dirs) */

typedef void (*kvx_digest_update_fn)(XXH3_state_t *, const void *, size_t);
/* XXH3_64bits_update built for AVX2 (only called on CPUs that have it). */
void kvx_digest_update_avx2(XXH3_state_t *state, const void *data, size_t len);
/* The same for AVX-512 (only called on CPUs that have it). */
void kvx_digest_update_avx512(XXH3_state_t *state, const void *data, size_t len);

#endif
