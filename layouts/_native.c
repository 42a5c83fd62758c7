/* One-pass CPU kernel for kvx.layouts' block gather/scatter (module kvx.layouts._native).
 *
 * gather_scatter moves "units": `per_src` source blocks, read in order through their strides
 * into a small contiguous scratch buffer (their elements in logical order), then written out
 * as `per_dst` destination blocks through the destination's strides. Each byte is read from
 * memory once and written once, like memcpy; the permutation happens between the cache-resident
 * scratch and the strided side. Reading a whole unit before writing it makes the in-place
 * transforms safe (source and destination blocks may be the same memory, as long as no two
 * units share a block). Elements are opaque 1/2/4/8/16-byte words: nothing is computed.
 *
 * The caller (kvx/layouts/_kernels.py) hands over raw addresses, shapes and strides from torch
 * tensors; this module trusts them but checks every block id against the block count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_DIMS 16
#define MAX_THREADS 64

typedef struct {
    char *base;            /* address of block 0's first element */
    int64_t block_stride;  /* bytes between consecutive blocks */
    const int64_t *idx;    /* block ids, `per * units` of them */
    int64_t per;           /* blocks per unit */
    int ndim;              /* dims of one block after coalescing (>= 1) */
    int64_t shape[MAX_DIMS];
    int64_t stride[MAX_DIMS]; /* bytes */
    int raw_ndim;          /* dims of one block as given */
    int64_t raw_shape[MAX_DIMS], raw_stride[MAX_DIMS];
} side_t;

#define MAX_JOINT (2 * MAX_DIMS)

/* Not in place, source and destination are walked together, without the scratch: a detour
 * through it costs ~25% when the destination lines are not in cache (measured). A unit is
 * `pieces` pieces, each one whole block of the side with more blocks per unit and one slice
 * (along its first dim) of the other side's block. */
typedef struct {
    int ndim;
    int64_t shape[MAX_JOINT], src_stride[MAX_JOINT], dst_stride[MAX_JOINT]; /* bytes */
    int64_t pieces;
    int split_dst;         /* pieces slice the destination block (else the source block) */
    int64_t piece_offset;  /* bytes between consecutive slices of the sliced block */
} direct_t;

typedef struct {
    const side_t *src, *dst;
    const direct_t *direct; /* NULL: through the scratch */
    int64_t first, last;   /* units [first, last) */
    size_t elem;
    size_t unit_bytes;
    int failed;
} job_t;

/* Drop size-1 dims and merge dims that are contiguous with the next, so the innermost dim is
 * as long as the memory allows (a 16-word head_size row plus more when tokens/heads follow). */
static void coalesce(side_t *s, const int64_t *shape, const int64_t *stride, int ndim) {
    int n = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == 1)
            continue;
        if (n > 0 && s->stride[n - 1] == shape[i] * stride[i]) {
            s->shape[n - 1] *= shape[i];
            s->stride[n - 1] = stride[i];
        } else {
            s->shape[n] = shape[i];
            s->stride[n] = stride[i];
            n++;
        }
    }
    if (n == 0) { /* a one-element block */
        s->shape[0] = 1;
        s->stride[0] = 0;
        n = 1;
    }
    s->ndim = n;
}

/* Copy `count` elements spaced `stride` bytes apart to/from a contiguous run. */
#define STRIDED_LOOP(T)                                                        \
    do {                                                                       \
        if (to_scratch)                                                        \
            for (int64_t i = 0; i < count; i++)                                \
                memcpy(run + i * sizeof(T), mem + i * stride, sizeof(T));      \
        else                                                                   \
            for (int64_t i = 0; i < count; i++)                                \
                memcpy(mem + i * stride, run + i * sizeof(T), sizeof(T));      \
    } while (0)

static inline void move_row(char *mem, char *run, int64_t count, int64_t stride, size_t elem,
                            int to_scratch) {
    if ((size_t)stride == elem) {
        if (to_scratch)
            memcpy(run, mem, (size_t)count * elem);
        else
            memcpy(mem, run, (size_t)count * elem);
        return;
    }
    switch (elem) {
    case 1: STRIDED_LOOP(uint8_t); break;
    case 2: STRIDED_LOOP(uint16_t); break;
    case 4: STRIDED_LOOP(uint32_t); break;
    case 8: STRIDED_LOOP(uint64_t); break;
    default: {
        typedef struct { uint64_t w[2]; } word16;
        STRIDED_LOOP(word16);
    }
    }
}

/* Move one block between memory (strided) and `scratch` (contiguous, logical order). Returns
 * the scratch position after it. */
static char *move_block(const side_t *s, char *block, char *scratch, size_t elem,
                        int to_scratch) {
    const int nd = s->ndim;
    const int64_t rows = nd >= 2 ? s->shape[nd - 2] : 1;
    const int64_t row_stride = nd >= 2 ? s->stride[nd - 2] : 0;
    const int64_t cols = s->shape[nd - 1], col_stride = s->stride[nd - 1];
    const size_t row_bytes = (size_t)cols * elem;
    int64_t counter[MAX_DIMS] = {0};
    const int outer = nd - 2; /* dims [0, outer) are walked with counters */
    char *base = block;
    for (;;) {
        char *mem = base;
        for (int64_t r = 0; r < rows; r++, mem += row_stride, scratch += row_bytes)
            move_row(mem, scratch, cols, col_stride, elem, to_scratch);
        int d = outer - 1;
        for (; d >= 0; d--) {
            base += s->stride[d];
            if (++counter[d] < s->shape[d])
                break;
            base -= s->stride[d] * s->shape[d];
            counter[d] = 0;
        }
        if (d < 0)
            return scratch;
    }
}

/* Plan a joint walk: split both piece shapes (innermost first) into dims that are whole dims
 * of each side, then merge dims contiguous on both sides. Returns 0 when the shapes do not
 * nest (the scratch path handles any pair). */
static int plan_direct(const side_t *src, const side_t *dst, direct_t *p) {
    if (src->per > 1 && dst->per > 1)
        return 0;
    p->split_dst = src->per >= dst->per;
    p->pieces = p->split_dst ? src->per : dst->per;
    const side_t *sliced = p->split_dst ? dst : src;
    int64_t cut[MAX_DIMS];
    memcpy(cut, sliced->raw_shape, (size_t)sliced->raw_ndim * sizeof(int64_t));
    p->piece_offset = 0;
    if (p->pieces > 1) {
        if (sliced->raw_ndim == 0 || cut[0] % p->pieces)
            return 0;
        cut[0] /= p->pieces;
        p->piece_offset = cut[0] * sliced->raw_stride[0];
    }
    const int64_t *as = src->raw_stride, *bs = dst->raw_stride;
    const int64_t *a = p->split_dst ? src->raw_shape : cut, *b = p->split_dst ? cut : dst->raw_shape;
    int i = src->raw_ndim - 1, j = dst->raw_ndim - 1, k = 0;
    int64_t ra = 1, rb = 1, sa = 0, sb = 0, shape[MAX_JOINT], sst[MAX_JOINT], dstr[MAX_JOINT];
    for (;;) {
        while (ra == 1 && i >= 0) {
            ra = a[i];
            sa = as[i--];
        }
        while (rb == 1 && j >= 0) {
            rb = b[j];
            sb = bs[j--];
        }
        if (ra == 1 || rb == 1)
            break;
        int64_t m = ra < rb ? ra : rb;
        if (ra % m || rb % m || k == MAX_JOINT)
            return 0;
        shape[k] = m;
        sst[k] = sa;
        dstr[k++] = sb;
        ra /= m;
        sa *= m;
        rb /= m;
        sb *= m;
    }
    if (ra != 1 || rb != 1)
        return 0;
    p->ndim = 0; /* outermost first, merged where contiguous on both sides */
    for (int d = k - 1; d >= 0; d--) {
        int n = p->ndim;
        if (n > 0 && p->src_stride[n - 1] == shape[d] * sst[d] &&
            p->dst_stride[n - 1] == shape[d] * dstr[d]) {
            p->shape[n - 1] *= shape[d];
            p->src_stride[n - 1] = sst[d];
            p->dst_stride[n - 1] = dstr[d];
        } else {
            p->shape[n] = shape[d];
            p->src_stride[n] = sst[d];
            p->dst_stride[n] = dstr[d];
            p->ndim++;
        }
    }
    if (p->ndim == 0) { /* one element */
        p->shape[0] = 1;
        p->src_stride[0] = p->dst_stride[0] = 0;
        p->ndim = 1;
    }
    return 1;
}

#define PAIR_LOOP(T)                                                                   \
    for (int64_t e = 0; e < count; e++)                                                \
        memcpy(to + e * to_stride, from + e * from_stride, sizeof(T))

static void copy_piece(const direct_t *p, const char *from_block, char *to_block, size_t elem) {
    const int nd = p->ndim;
    const int64_t rows = nd >= 2 ? p->shape[nd - 2] : 1;
    const int64_t from_row = nd >= 2 ? p->src_stride[nd - 2] : 0;
    const int64_t to_row = nd >= 2 ? p->dst_stride[nd - 2] : 0;
    const int64_t count = p->shape[nd - 1];
    const int64_t from_stride = p->src_stride[nd - 1], to_stride = p->dst_stride[nd - 1];
    const int contiguous = (size_t)from_stride == elem && (size_t)to_stride == elem;
    int64_t counter[MAX_JOINT] = {0};
    for (;;) {
        const char *from = from_block;
        char *to = to_block;
        for (int64_t r = 0; r < rows; r++, from += from_row, to += to_row) {
            if (contiguous) {
                memcpy(to, from, (size_t)count * elem);
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
        int d = nd - 3;
        for (; d >= 0; d--) {
            from_block += p->src_stride[d];
            to_block += p->dst_stride[d];
            if (++counter[d] < p->shape[d])
                break;
            from_block -= p->src_stride[d] * p->shape[d];
            to_block -= p->dst_stride[d] * p->shape[d];
            counter[d] = 0;
        }
        if (d < 0)
            return;
    }
}

static void run_direct(job_t *job) {
    const side_t *src = job->src, *dst = job->dst;
    const direct_t *p = job->direct;
    for (int64_t u = job->first; u < job->last; u++) {
        for (int64_t k = 0; k < p->pieces; k++) {
            const char *from;
            char *to;
            if (p->split_dst) {
                from = src->base + src->idx[u * src->per + k] * src->block_stride;
                to = dst->base + dst->idx[u] * dst->block_stride + k * p->piece_offset;
            } else {
                from = src->base + src->idx[u] * src->block_stride + k * p->piece_offset;
                to = dst->base + dst->idx[u * dst->per + k] * dst->block_stride;
            }
            copy_piece(p, from, to, job->elem);
        }
    }
}

static void run_job(job_t *job) {
    if (job->direct) {
        run_direct(job);
        return;
    }
    /* cache-line aligned: with malloc's 16-byte alignment every row of the scratch straddles
     * one more line than it needs (measured ~1.5x slower overall) */
    char *scratch = aligned_alloc(64, (job->unit_bytes + 63) / 64 * 64);
    if (!scratch) {
        job->failed = 1;
        return;
    }
    const side_t *src = job->src, *dst = job->dst;
    for (int64_t u = job->first; u < job->last; u++) {
        char *pos = scratch;
        for (int64_t i = 0; i < src->per; i++) {
            char *block = src->base + src->idx[u * src->per + i] * src->block_stride;
            pos = move_block(src, block, pos, job->elem, 1);
        }
        pos = scratch;
        for (int64_t i = 0; i < dst->per; i++) {
            char *block = dst->base + dst->idx[u * dst->per + i] * dst->block_stride;
            pos = move_block(dst, block, pos, job->elem, 0);
        }
    }
    free(scratch);
}

/* A small persistent pool runs jobs[1..n-1] while the calling thread runs jobs[0]: creating
 * threads per call costs as much as moving a few MiB. Idle workers spin briefly (back-to-back
 * per-layer calls find them awake, as PyTorch's own pool does) and then sleep on a condition
 * variable. One call uses the pool at a time; a concurrent call runs its jobs inline. */
#define SPINS 4000

static struct {
    pthread_mutex_t call, mu;
    pthread_cond_t wake, done;
    atomic_long generation;
    atomic_int pending;
    job_t *jobs;
    int njobs, workers;
    long start_gen[MAX_THREADS];
    pid_t pid;
} pool = {.call = PTHREAD_MUTEX_INITIALIZER,
          .mu = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    long seen = pool.start_gen[me];
    for (;;) {
        long gen = atomic_load(&pool.generation);
        for (int i = 0; gen == seen && i < SPINS; i++) {
            cpu_relax();
            gen = atomic_load(&pool.generation);
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool.mu);
            while ((gen = atomic_load(&pool.generation)) == seen)
                pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        if (me < pool.njobs)
            run_job(&pool.jobs[me]);
        if (atomic_fetch_sub(&pool.pending, 1) == 1) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

/* Workers 1..n-1 exist (a forked child has none of its parent's). Called with `call` held. */
static void grow_pool(int n) {
    if (pool.pid != getpid()) { /* first call, or a child forked while a worker held `mu` */
        pool.pid = getpid();
        pool.workers = 1;
        pthread_mutex_init(&pool.mu, NULL);
        pthread_cond_init(&pool.wake, NULL);
        pthread_cond_init(&pool.done, NULL);
    }
    while (pool.workers < n) {
        pthread_t tid;
        pool.start_gen[pool.workers] = atomic_load(&pool.generation);
        if (pthread_create(&tid, NULL, worker, (void *)(intptr_t)pool.workers) != 0)
            return;
        pthread_detach(tid);
        pool.workers++;
    }
}

static void run_jobs(job_t *jobs, int n) {
    if (n > 1 && pthread_mutex_trylock(&pool.call) == 0) {
        grow_pool(n);
        int helped = pool.workers < n ? pool.workers : n; /* jobs the pool takes: [1, helped) */
        pool.jobs = jobs;
        pool.njobs = helped;
        atomic_store(&pool.pending, pool.workers - 1);
        pthread_mutex_lock(&pool.mu);
        atomic_fetch_add(&pool.generation, 1);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
        run_job(&jobs[0]);
        for (int t = helped; t < n; t++) /* workers that could not be started */
            run_job(&jobs[t]);
        for (int i = 0; atomic_load(&pool.pending) > 0 && i < SPINS; i++)
            cpu_relax();
        pthread_mutex_lock(&pool.mu);
        while (atomic_load(&pool.pending) > 0)
            pthread_cond_wait(&pool.done, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
        pthread_mutex_unlock(&pool.call);
        return;
    }
    for (int t = 0; t < n; t++)
        run_job(&jobs[t]);
}

/* Parse one side: address of its first element, shape and strides (in elements) of the whole
 * tensor with blocks on dim 0, address of its int64 block ids, blocks per unit; check the ids. */
static int parse_side(side_t *s, unsigned long long addr, PyObject *shape_obj,
                      PyObject *stride_obj, unsigned long long idx_addr, long long per,
                      long long units, long long elem, const char *name, int64_t *elems) {
    int64_t shape[MAX_DIMS + 1], stride[MAX_DIMS + 1];
    PyObject *shape_seq = PySequence_Fast(shape_obj, "shape must be a sequence");
    if (!shape_seq)
        return -1;
    PyObject *stride_seq = PySequence_Fast(stride_obj, "strides must be a sequence");
    if (!stride_seq) {
        Py_DECREF(shape_seq);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(shape_seq);
    int ok = n >= 1 && n <= MAX_DIMS + 1 && n == PySequence_Fast_GET_SIZE(stride_seq) && per >= 1;
    *elems = 1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        shape[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(shape_seq, i));
        stride[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(stride_seq, i)) * elem;
        ok = !PyErr_Occurred() && shape[i] >= (i ? 1 : 0) && stride[i] >= 0;
        *elems *= ok && i ? shape[i] : 1;
    }
    Py_DECREF(shape_seq);
    Py_DECREF(stride_seq);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError,
                         "%s: need blocks plus <= %d dims of size >= 1, strides >= 0 and blocks "
                         "per unit >= 1", name, MAX_DIMS);
        return -1;
    }
    s->base = (char *)(uintptr_t)addr;
    s->block_stride = stride[0];
    s->idx = (const int64_t *)(uintptr_t)idx_addr;
    s->per = per;
    s->raw_ndim = (int)n - 1;
    memcpy(s->raw_shape, shape + 1, (size_t)(n - 1) * sizeof(int64_t));
    memcpy(s->raw_stride, stride + 1, (size_t)(n - 1) * sizeof(int64_t));
    for (int64_t i = 0; i < per * units; i++) {
        if (s->idx[i] < 0 || s->idx[i] >= shape[0]) {
            PyErr_Format(PyExc_IndexError, "%s: block id %lld is out of range for %lld blocks",
                         name, (long long)s->idx[i], (long long)shape[0]);
            return -1;
        }
    }
    coalesce(s, shape + 1, stride + 1, (int)n - 1);
    return 0;
}

static int compare_ids(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* For in-place calls: the ids sorted (blocks visited in address order) without repeats, which
 * would otherwise be transformed twice. Returns a malloc'ed array and sets *units. */
static int64_t *unique_ids(const int64_t *ids, long long *units) {
    int64_t *out = malloc((size_t)(*units ? *units : 1) * sizeof(int64_t));
    if (!out)
        return NULL;
    memcpy(out, ids, (size_t)*units * sizeof(int64_t));
    qsort(out, (size_t)*units, sizeof(int64_t), compare_ids);
    long long n = 0;
    for (long long i = 0; i < *units; i++)
        if (n == 0 || out[i] != out[n - 1])
            out[n++] = out[i];
    *units = n;
    return out;
}

static PyObject *gather_scatter(PyObject *self, PyObject *args) {
    unsigned long long src_addr, src_idx, dst_addr, dst_idx;
    long long src_per, dst_per, units, elem, threads;
    int in_place, allow_direct;
    PyObject *src_shape, *src_strides, *dst_shape, *dst_strides;
    (void)self;
    if (!PyArg_ParseTuple(args, "KOOKLKOOKLLLLpp", &src_addr, &src_shape, &src_strides,
                          &src_idx, &src_per, &dst_addr, &dst_shape, &dst_strides, &dst_idx,
                          &dst_per, &units, &elem, &threads, &in_place, &allow_direct))
        return NULL;
    if (!(elem == 1 || elem == 2 || elem == 4 || elem == 8 || elem == 16)) {
        PyErr_Format(PyExc_ValueError, "element size must be 1, 2, 4, 8 or 16 bytes, got %lld",
                     elem);
        return NULL;
    }
    if (units < 0 || threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "need units >= 0 and 1 <= threads <= %d, got %lld, %lld",
                     MAX_THREADS, units, threads);
        return NULL;
    }
    if (in_place && (src_addr != dst_addr || src_idx != dst_idx || src_per != 1 || dst_per != 1)) {
        PyErr_SetString(PyExc_ValueError,
                        "in place needs the same tensor address, ids and one block per unit");
        return NULL;
    }
    side_t src, dst;
    int64_t src_elems, dst_elems;
    if (parse_side(&src, src_addr, src_shape, src_strides, src_idx, src_per, units, elem, "src",
                   &src_elems) < 0 ||
        parse_side(&dst, dst_addr, dst_shape, dst_strides, dst_idx, dst_per, units, elem, "dst",
                   &dst_elems) < 0)
        return NULL;
    if (src_elems * src_per != dst_elems * dst_per) {
        PyErr_Format(PyExc_ValueError,
                     "a unit is %lld source elements but %lld destination elements",
                     (long long)(src_elems * src_per), (long long)(dst_elems * dst_per));
        return NULL;
    }
    if (units == 0)
        Py_RETURN_NONE;
    int64_t *ids = NULL;
    if (in_place) {
        if (!(ids = unique_ids(src.idx, &units)))
            return PyErr_NoMemory();
        src.idx = dst.idx = ids;
    }
    if (threads > units)
        threads = units;
    direct_t direct;
    const direct_t *plan =
        allow_direct && !in_place && plan_direct(&src, &dst, &direct) ? &direct : NULL;

    job_t jobs[MAX_THREADS];
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (long long t = 0; t < threads; t++) {
        jobs[t] = (job_t){&src, &dst, plan, units * t / threads, units * (t + 1) / threads,
                          (size_t)elem, (size_t)(src_elems * src_per * elem), 0};
    }
    run_jobs(jobs, (int)threads);
    for (long long t = 0; t < threads; t++)
        failed |= jobs[t].failed;
    Py_END_ALLOW_THREADS
    free(ids);
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gather_scatter", gather_scatter, METH_VARARGS,
     "gather_scatter(src_addr, src_shape, src_strides, src_ids_addr, src_per_unit, dst_addr, "
     "dst_shape, dst_strides, dst_ids_addr, dst_per_unit, units, elem_size, threads, "
     "in_place, allow_direct)\n\nMove `units` groups of blocks (blocks on dim 0, strides in "
     "elements of elem_size bytes, ids int64): each unit's source blocks are read into a "
     "contiguous scratch, then written through the destination's strides, or (allow_direct, not "
     "in place, shapes that nest) copied straight across. in_place: same tensor and ids, "
     "repeated ids moved once. Addresses are raw and trusted; see kvx.layouts._kernels."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvx.layouts._native",
    "Native one-pass block gather/scatter for kvx.layouts (CPU).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
