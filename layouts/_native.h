/* Shared by kvx.layouts._native's three files: the Python entry points (_native.c), the copy
 * planning and walking (_native_walk.c) and the thread pool that runs a call's units on several
 * cores (_native_pool.c). */
#ifndef KVX_LAYOUTS_NATIVE_H
#define KVX_LAYOUTS_NATIVE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_DIMS 16
#define MAX_JOINT (2 * MAX_DIMS)
#define MAX_THREADS 64

/* One side of a call: blocks selected by id, each a strided grid of elements. */
typedef struct {
    char *base;            /* address of block 0's first element */
    int64_t block_stride;  /* bytes between consecutive blocks */
    const int64_t *idx;    /* block ids, `per * units` of them */
    int64_t per;           /* blocks per unit */
    int ndim;              /* dims of one block */
    int64_t shape[MAX_DIMS], stride[MAX_DIMS]; /* strides in bytes */
} side_t;

/* A walk over two grids of the same shape, `from` and `to`, each with its own byte strides
 * (outermost dim first). */
typedef struct {
    int ndim;
    int64_t shape[MAX_JOINT], from_stride[MAX_JOINT], to_stride[MAX_JOINT];
} walk_t;

/* The direct copy: a unit is `pieces` pieces, each one whole block of the side with more blocks
 * per unit and one slice (along its first dim) of the other side's single block. */
typedef struct {
    walk_t walk;
    int64_t pieces;
    int split_dst;         /* the pieces slice the destination block (else the source block) */
    int64_t piece_offset;  /* bytes between consecutive slices of the sliced block */
} direct_t;

/* One call's work, shared by the calling thread and the pool's workers: each takes the next
 * `chunk` units until none are left, so a worker the OS runs late just does less. */
typedef struct {
    const side_t *src, *dst;
    const direct_t *direct;         /* or else, through the scratch: */
    const walk_t *gather, *scatter; /* a source block -> scratch, scratch -> a destination block */
    int64_t units, chunk;
    size_t elem, src_block_bytes, dst_block_bytes;
    atomic_llong next;              /* first unit not yet taken */
    atomic_int failed;              /* a scratch could not be allocated */
    int stream;                     /* contiguous runs of a page or more: non-temporal stores */
} job_t;

/* Whether this CPU can stream (see job_t.stream): x86-64 with AVX2. */
__attribute__((visibility("hidden"))) int can_stream(void);

/* The walk that copies one block of `s` to (to_scratch) or from a contiguous scratch. */
__attribute__((visibility("hidden"))) void plan_scratch(const side_t *s, size_t elem,
                                                        int to_scratch, walk_t *w);

/* The direct copy of a unit from `src` to `dst`, if their block shapes nest (else 0). */
__attribute__((visibility("hidden"))) int plan_direct(const side_t *src, const side_t *dst,
                                                      size_t elem, direct_t *p);

/* Take chunks of `job`'s units on the calling thread until none are left. */
__attribute__((visibility("hidden"))) void run_job(job_t *job);

/* Run `job` on the calling thread and up to `threads - 1` pool workers. */
__attribute__((visibility("hidden"))) void run_pooled(job_t *job, int threads);

#endif
