/* The persistent thread pool of kvx.layouts._native (see _native.h). */
#include <pthread.h>
#include <unistd.h>

#include "_native.h"

/* A small persistent pool helps the calling thread: creating threads per call costs as much as
 * moving a few MiB. A call opens one slot per helper it wants (tagged with its generation); a
 * worker that wakes in time claims its slot and takes chunks. When the caller runs out of
 * work it closes the slots still open, so it never waits for a worker the OS has not run yet,
 * only for those that joined to finish their chunk. Idle workers spin briefly (back-to-back
 * per-layer calls find them awake, as PyTorch's own pool does), then sleep on a condition
 * variable. One call uses the pool at a time; a concurrent call works alone. */
#define SPINS 4000

static struct {
    pthread_mutex_t call, mu;
    pthread_cond_t wake, done;
    atomic_long generation;
    atomic_long slot[MAX_THREADS]; /* the generation worker i may join, or 0 */
    atomic_int finished;           /* joined workers done with this call's job */
    job_t *job;
    int workers;
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
    long seen = 0;
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
        long open = gen;
        if (!atomic_compare_exchange_strong(&pool.slot[me], &open, 0))
            continue; /* not wanted, or the caller already finished without us */
        run_job(pool.job);
        atomic_fetch_add(&pool.finished, 1);
        pthread_mutex_lock(&pool.mu);
        pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.mu);
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
        atomic_store(&pool.slot[pool.workers], 0);
        if (pthread_create(&tid, NULL, worker, (void *)(intptr_t)pool.workers) != 0)
            return;
        pthread_detach(tid);
        pool.workers++;
    }
}

void run_pooled(job_t *job, int threads) {
    if (threads < 2 || pthread_mutex_trylock(&pool.call) != 0) {
        run_job(job);
        return;
    }
    grow_pool(threads);
    int helpers = (pool.workers < threads ? pool.workers : threads) - 1;
    long gen = atomic_load(&pool.generation) + 1;
    pool.job = job;
    atomic_store(&pool.finished, 0);
    for (int i = 1; i <= helpers; i++)
        atomic_store(&pool.slot[i], gen);
    pthread_mutex_lock(&pool.mu);
    atomic_store(&pool.generation, gen);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    run_job(job);
    int joined = 0;
    for (int i = 1; i <= helpers; i++) {
        long open = gen;
        joined += !atomic_compare_exchange_strong(&pool.slot[i], &open, 0);
    }
    for (int i = 0; atomic_load(&pool.finished) < joined && i < SPINS; i++)
        cpu_relax();
    pthread_mutex_lock(&pool.mu);
    while (atomic_load(&pool.finished) < joined)
        pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.call);
}
