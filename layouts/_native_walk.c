/* The copy itself for kvx.layouts._native (see _native.c for what a call moves): planning a
 * unit's walk over source and destination, walking it (memcpy or non-temporal runs), and the
 * chunked loop the calling thread and the pool's workers share. No Python here. */
#include <stdlib.h>
#include <string.h>

#include "_native.h"
#if defined(__x86_64__)
#include <immintrin.h>

/* `n` bytes with non-temporal stores (AVX2, 32-byte aligned), the unaligned ends by memcpy. */
__attribute__((target("avx2"))) static void stream_avx2(char *to, const char *from, size_t n) {
    size_t head = (size_t)(-(uintptr_t)to & 31);
    if (head > n)
        head = n;
    memcpy(to, from, head);
    to += head, from += head, n -= head;
    for (; n >= 128; n -= 128, to += 128, from += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)from);
        __m256i b = _mm256_loadu_si256((const __m256i *)(from + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(from + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(from + 96));
        _mm256_stream_si256((__m256i *)to, a);
        _mm256_stream_si256((__m256i *)(to + 32), b);
        _mm256_stream_si256((__m256i *)(to + 64), c);
        _mm256_stream_si256((__m256i *)(to + 96), d);
    }
    memcpy(to, from, n);
}
#endif

/* Whether this CPU can stream (see job_t.stream): x86-64 with AVX2. */
int can_stream(void) {
#if defined(__x86_64__)
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}


/* One contiguous run: memcpy, or with `stream` and a run of at least a page, non-temporal. */
static inline void copy_run(char *to, const char *from, size_t n, int stream) {
#if defined(__x86_64__)
    if (stream && n >= 4096) {
        stream_avx2(to, from, n);
        return;
    }
#endif
    (void)stream;
    memcpy(to, from, n);
}

/* Append dim (size, from, to) to `w` (outermost first), merged into the previous dim when it is
 * contiguous with it on both sides; size-1 dims are dropped. */
static void add_dim(walk_t *w, int64_t size, int64_t from, int64_t to) {
    int n = w->ndim;
    if (size == 1)
        return;
    if (n > 0 && w->from_stride[n - 1] == size * from && w->to_stride[n - 1] == size * to) {
        w->shape[n - 1] *= size;
        w->from_stride[n - 1] = from;
        w->to_stride[n - 1] = to;
        return;
    }
    w->shape[n] = size;
    w->from_stride[n] = from;
    w->to_stride[n] = to;
    w->ndim = n + 1;
}

static void finish_walk(walk_t *w, size_t elem) {
    if (w->ndim == 0) { /* a one-element grid */
        w->shape[0] = 1;
        w->from_stride[0] = w->to_stride[0] = (int64_t)elem;
        w->ndim = 1;
    }
}

/* A block of `s` to (to_scratch) or from a contiguous scratch in its logical order. */
void plan_scratch(const side_t *s, size_t elem, int to_scratch, walk_t *w) {
    int64_t run[MAX_DIMS], bytes = (int64_t)elem;
    for (int i = s->ndim - 1; i >= 0; i--) {
        run[i] = bytes;
        bytes *= s->shape[i];
    }
    w->ndim = 0;
    for (int i = 0; i < s->ndim; i++)
        add_dim(w, s->shape[i], to_scratch ? s->stride[i] : run[i],
                to_scratch ? run[i] : s->stride[i]);
    finish_walk(w, elem);
}

/* The direct copy: split both piece shapes (innermost first) into dims that are whole parts
 * of a dim on each side. Returns 0 when the shapes do not nest. */
int plan_direct(const side_t *src, const side_t *dst, size_t elem, direct_t *p) {
    if (src->per > 1 && dst->per > 1)
        return 0;
    p->split_dst = src->per >= dst->per;
    p->pieces = p->split_dst ? src->per : dst->per;
    const side_t *sliced = p->split_dst ? dst : src;
    int64_t cut[MAX_DIMS];
    memcpy(cut, sliced->shape, (size_t)sliced->ndim * sizeof(int64_t));
    p->piece_offset = 0;
    if (p->pieces > 1) {
        if (sliced->ndim == 0 || cut[0] % p->pieces)
            return 0;
        cut[0] /= p->pieces;
        p->piece_offset = cut[0] * sliced->stride[0];
    }
    const int64_t *a = p->split_dst ? src->shape : cut, *b = p->split_dst ? cut : dst->shape;
    int i = src->ndim - 1, j = dst->ndim - 1, k = 0;
    int64_t ra = 1, rb = 1, sa = 0, sb = 0, shape[MAX_JOINT], from[MAX_JOINT], to[MAX_JOINT];
    for (;;) {
        while (ra == 1 && i >= 0) {
            ra = a[i];
            sa = src->stride[i--];
        }
        while (rb == 1 && j >= 0) {
            rb = b[j];
            sb = dst->stride[j--];
        }
        if (ra == 1 || rb == 1)
            break;
        int64_t m = ra < rb ? ra : rb;
        if (ra % m || rb % m || k == MAX_JOINT)
            return 0;
        shape[k] = m;
        from[k] = sa;
        to[k++] = sb;
        ra /= m;
        sa *= m;
        rb /= m;
        sb *= m;
    }
    if (ra != 1 || rb != 1)
        return 0;
    p->walk.ndim = 0;
    while (k-- > 0)
        add_dim(&p->walk, shape[k], from[k], to[k]);
    finish_walk(&p->walk, elem);
    return 1;
}

#define PAIR_LOOP(T)                                                                   \
    for (int64_t e = 0; e < count; e++)                                                \
        memcpy(to + e * to_step, from + e * from_step, sizeof(T))

/* Copy the grid at `from_block` to the grid at `to_block` along `w`. */
static void walk_copy(const walk_t *w, const char *from_block, char *to_block, size_t elem,
                      int stream) {
    const int nd = w->ndim;
    const int64_t rows = nd >= 2 ? w->shape[nd - 2] : 1;
    const int64_t from_row = nd >= 2 ? w->from_stride[nd - 2] : 0;
    const int64_t to_row = nd >= 2 ? w->to_stride[nd - 2] : 0;
    const int64_t count = w->shape[nd - 1];
    const int64_t from_step = w->from_stride[nd - 1], to_step = w->to_stride[nd - 1];
    const int contiguous = (size_t)from_step == elem && (size_t)to_step == elem;
    int64_t counter[MAX_JOINT] = {0};
    for (;;) {
        const char *from = from_block;
        char *to = to_block;
        for (int64_t r = 0; r < rows; r++, from += from_row, to += to_row) {
            if (contiguous) {
                copy_run(to, from, (size_t)count * elem, stream);
                continue;
            }
            switch (elem) {
            case 1: PAIR_LOOP(uint8_t); break;
            case 2: PAIR_LOOP(uint16_t); break;
            case 4: PAIR_LOOP(uint32_t); break;
            case 8: PAIR_LOOP(uint64_t); break;
            default: {
                typedef struct { uint64_t w[2]; } word16;
                PAIR_LOOP(word16);
            }
            }
        }
        int d = nd - 3; /* the dims outside the rows, walked like an odometer */
        for (; d >= 0; d--) {
            from_block += w->from_stride[d];
            to_block += w->to_stride[d];
            if (++counter[d] < w->shape[d])
                break;
            from_block -= w->from_stride[d] * w->shape[d];
            to_block -= w->to_stride[d] * w->shape[d];
            counter[d] = 0;
        }
        if (d < 0)
            return;
    }
}

static inline char *block_at(const side_t *s, int64_t unit, int64_t k) {
    return s->base + s->idx[unit * s->per + k] * s->block_stride;
}

/* Units [first, last) straight from source to destination. */
static void run_direct(job_t *job, int64_t first, int64_t last) {
    const direct_t *p = job->direct;
    for (int64_t u = first; u < last; u++) {
        for (int64_t k = 0; k < p->pieces; k++) {
            const char *from = p->split_dst ? block_at(job->src, u, k)
                                            : block_at(job->src, u, 0) + k * p->piece_offset;
            char *to = p->split_dst ? block_at(job->dst, u, 0) + k * p->piece_offset
                                    : block_at(job->dst, u, k);
            walk_copy(&p->walk, from, to, job->elem, job->stream);
        }
    }
}

/* Units [first, last) through `scratch`, one unit at a time. */
static void run_scratch(job_t *job, char *scratch, int64_t first, int64_t last) {
    for (int64_t u = first; u < last; u++) {
        for (int64_t k = 0; k < job->src->per; k++)
            walk_copy(job->gather, block_at(job->src, u, k), scratch + k * job->src_block_bytes,
                      job->elem, 0);
        for (int64_t k = 0; k < job->dst->per; k++)
            walk_copy(job->scatter, scratch + k * job->dst_block_bytes, block_at(job->dst, u, k),
                      job->elem, job->stream);
    }
}

/* Take chunks of units until none are left. */
void run_job(job_t *job) {
    char *scratch = NULL;
    if (!job->direct) {
        /* cache-line aligned: with malloc's 16-byte alignment every row of the scratch
         * straddles one more line than it needs (measured ~1.5x slower overall) */
        size_t unit_bytes = (size_t)job->src->per * job->src_block_bytes;
        scratch = aligned_alloc(64, (unit_bytes + 63) / 64 * 64);
        if (!scratch) {
            atomic_store(&job->failed, 1);
            return;
        }
    }
    for (;;) {
        int64_t first = atomic_fetch_add(&job->next, job->chunk);
        if (first >= job->units)
            break;
        int64_t last = first + job->chunk < job->units ? first + job->chunk : job->units;
        if (job->direct)
            run_direct(job, first, last);
        else
            run_scratch(job, scratch, first, last);
    }
#if defined(__x86_64__)
    if (job->stream)
        _mm_sfence(); /* the streamed stores are visible before the call is reported done */
#endif
    free(scratch);
}
