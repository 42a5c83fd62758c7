/* `_digest.c`'s XXH3 update built for AVX-512, chosen at import on CPUs that have it. */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f")
#include "_digest.h"

void kvx_digest_update_avx512(XXH3_state_t *state, const void *data, size_t len) {
    XXH3_64bits_update(state, data, len);
}
#endif
