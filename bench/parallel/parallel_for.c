/* Which parallel-for should the CPU kernels use? Measures, in one process:
 *   omp    - mrl_parallel_for (OpenMP, libgomp)
 *   cond   - a pthread pool whose workers sleep on a condition variable
 *   spin   - a pthread pool whose workers spin on an atomic generation counter
 * on (1) an empty body, i.e. the fork/join cost, (2) a memory-bound
 * y = a*x + y over 1M floats, (3) a small compute-bound body (16K floats of
 * exp-like polynomial). Prints microseconds per call and the ratio to omp.
 * usage: bench_parallel_for [iterations] */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "base/parallel.h"
#include "moonrl/runtime.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------ the pools */
typedef struct pool {
    int threads, spin;
    pthread_t *tids;
    pthread_mutex_t lock;
    pthread_cond_t start, done;
    _Atomic long generation;
    _Atomic int remaining;
    int quit;
    int64_t n;
    mrl_range_fn fn;
    void *ctx;
} pool;

typedef struct worker_arg { pool *p; int index; } worker_arg;

static void run_share(pool *p, int index) {
    int64_t b = p->n * index / p->threads, e = p->n * (index + 1) / p->threads;
    if (b < e) p->fn(p->ctx, b, e);
}

static void *worker(void *varg) {
    worker_arg *a = varg;
    pool *p = a->p;
    long seen = 0;
    for (;;) {
        if (p->spin) {
            while (atomic_load(&p->generation) == seen) {}
        } else {
            pthread_mutex_lock(&p->lock);
            while (atomic_load(&p->generation) == seen) pthread_cond_wait(&p->start, &p->lock);
            pthread_mutex_unlock(&p->lock);
        }
        seen = atomic_load(&p->generation);
        if (p->quit) return NULL;
        run_share(p, a->index);
        if (atomic_fetch_sub(&p->remaining, 1) == 1 && !p->spin) {
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->lock);
        }
    }
}

static void pool_run(pool *p, int64_t n, mrl_range_fn fn, void *ctx) {
    p->n = n;
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->remaining, p->threads - 1);
    if (p->spin) {
        atomic_fetch_add(&p->generation, 1);
    } else {
        pthread_mutex_lock(&p->lock);
        atomic_fetch_add(&p->generation, 1);
        pthread_cond_broadcast(&p->start);
        pthread_mutex_unlock(&p->lock);
    }
    run_share(p, 0); /* the caller takes share 0 */
    if (p->spin) {
        while (atomic_load(&p->remaining) > 0) {}
    } else {
        pthread_mutex_lock(&p->lock);
        while (atomic_load(&p->remaining) > 0) pthread_cond_wait(&p->done, &p->lock);
        pthread_mutex_unlock(&p->lock);
    }
}

static pool *pool_create(int threads, int spin) {
    pool *p = calloc(1, sizeof *p);
    p->threads = threads;
    p->spin = spin;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->start, NULL);
    pthread_cond_init(&p->done, NULL);
    p->tids = calloc((size_t)threads, sizeof(pthread_t));
    for (int i = 1; i < threads; i++) {
        worker_arg *a = malloc(sizeof *a);
        a->p = p;
        a->index = i;
        pthread_create(&p->tids[i], NULL, worker, a);
    }
    return p;
}

static void pool_destroy(pool *p) {
    p->quit = 1;
    pthread_mutex_lock(&p->lock);
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->threads; i++) pthread_join(p->tids[i], NULL);
    free(p->tids);
    free(p);
}

/* ---------------------------------------------------------- the bodies */
typedef struct work { float *x, *y; float a; } work;

static void empty_body(void *ctx, int64_t b, int64_t e) { (void)ctx; (void)b; (void)e; }

static void axpy_body(void *vctx, int64_t b, int64_t e) {
    work *w = vctx;
    for (int64_t i = b; i < e; i++) w->y[i] += w->a * w->x[i];
}

static void poly_body(void *vctx, int64_t b, int64_t e) {
    work *w = vctx;
    for (int64_t i = b; i < e; i++) {
        float v = w->x[i], acc = 1.f;
        for (int k = 8; k > 0; k--) acc = 1.f + acc * v / (float)k;
        w->y[i] = acc;
    }
}

typedef void (*runner)(void *impl, int64_t n, mrl_range_fn fn, void *ctx);
static void run_omp(void *impl, int64_t n, mrl_range_fn fn, void *ctx) { (void)impl; mrl_parallel_for(n, 1, fn, ctx); }
static void run_pool(void *impl, int64_t n, mrl_range_fn fn, void *ctx) { pool_run(impl, n, fn, ctx); }

static double time_it(runner r, void *impl, int64_t n, mrl_range_fn fn, void *ctx, int iters) {
    for (int i = 0; i < iters / 10 + 1; i++) r(impl, n, fn, ctx); /* warm up */
    double t0 = now();
    for (int i = 0; i < iters; i++) r(impl, n, fn, ctx);
    return (now() - t0) / iters * 1e6;
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 20000;
    mrl_init();
    int threads = mrl_parallel_threads();
    int64_t big = 1 << 20, small = 1 << 14;
    work w = {malloc(big * sizeof(float)), malloc(big * sizeof(float)), 0.5f};
    for (int64_t i = 0; i < big; i++) { w.x[i] = (float)(i % 100) * 0.01f; w.y[i] = 0; }
    struct { const char *name; int64_t n; mrl_range_fn fn; int iters; } cases[] = {
        {"empty body (fork/join cost)", 1024, empty_body, iters},
        {"axpy, 1M floats (memory-bound)", big, axpy_body, iters / 20 + 1},
        {"polynomial, 16K floats (small compute)", small, poly_body, iters},
    };
    printf("threads: %d\n%-40s %10s %10s %10s %10s %10s\n", threads, "case", "omp us", "cond us", "spin us",
           "cond/omp", "spin/omp");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        /* each pool lives only while it is measured: an idle spinning pool
         * would otherwise steal a core from the others */
        double t_omp = time_it(run_omp, NULL, cases[c].n, cases[c].fn, &w, cases[c].iters);
        pool *cond = pool_create(threads, 0);
        double t_cond = time_it(run_pool, cond, cases[c].n, cases[c].fn, &w, cases[c].iters);
        pool_destroy(cond);
        pool *spin = pool_create(threads, 1);
        double t_spin = time_it(run_pool, spin, cases[c].n, cases[c].fn, &w, cases[c].iters);
        pool_destroy(spin);
        printf("%-40s %10.2f %10.2f %10.2f %10.2f %10.2f\n", cases[c].name, t_omp, t_cond, t_spin, t_cond / t_omp,
               t_spin / t_omp);
    }
    mrl_shutdown();
    return 0;
}
