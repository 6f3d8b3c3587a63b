/* A batch of sandbox runs on threads of its own (moonrl/sandbox.h): each thread takes the next
 * run until none is left; every run's result and status stay in the batch, in order, until
 * taken. mrl_sandbox_run is thread-safe, so the runs only share the counter. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "base/error.h"
#include "sandbox_internal.h"

typedef struct run_slot {
    mrl_sandbox_result result;
    mrl_status status;
    char *error; /* the sandbox's failure message */
    int taken;
} run_slot;

struct mrl_sandbox_batch {
    const mrl_sandbox_spec *specs;
    int n, n_threads, joined;
    run_slot *runs;
    pthread_t *threads;
    atomic_int next, ended;
};

static void *worker(void *arg) {
    mrl_sandbox_batch *b = arg;
    for (int i; (i = atomic_fetch_add(&b->next, 1)) < b->n;) {
        run_slot *r = &b->runs[i];
        r->status = mrl_sandbox_run(&b->specs[i], &r->result);
        if (r->status) r->error = strdup(mrl_last_error());
        atomic_fetch_add(&b->ended, 1);
    }
    return NULL;
}

mrl_status mrl_sandbox_batch_start(const mrl_sandbox_spec *specs, int n, int concurrency, mrl_sandbox_batch **out) {
    if (!out || (n > 0 && !specs) || n < 0)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_sandbox_batch_start: %d runs, specs %p", n, (const void *)specs);
    if (concurrency < 0) return mrl_set_error(MRL_ERR_INVALID, "sandbox batch: concurrency %d (0: 2 a CPU)", concurrency);
    *out = NULL;
    if (concurrency == 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        concurrency = 2 * (int)(cpus > 0 ? cpus : 1);
    }
    mrl_sandbox_batch *b = calloc(1, sizeof *b);
    int threads = n < concurrency ? n : concurrency;
    if (b) b->runs = calloc((size_t)n + 1, sizeof *b->runs), b->threads = calloc((size_t)threads + 1, sizeof *b->threads);
    if (!b || !b->runs || !b->threads) {
        if (b) free(b->runs), free(b->threads);
        free(b);
        return mrl_set_error(MRL_ERR_NOMEM, "sandbox batch: %d runs", n);
    }
    b->specs = specs, b->n = n;
    for (int t = 0; t < threads; t++) {
        if (pthread_create(&b->threads[t], NULL, worker, b)) break;
        b->n_threads++;
    }
    if (n > 0 && b->n_threads == 0) {
        free(b->runs), free(b->threads), free(b);
        return mrl_set_error(MRL_ERR_NOMEM, "sandbox batch: no thread could start");
    }
    *out = b;
    return MRL_OK;
}

int mrl_sandbox_batch_done(const mrl_sandbox_batch *b) {
    return !b || atomic_load(&((mrl_sandbox_batch *)b)->ended) >= b->n;
}

void mrl_sandbox_batch_wait(mrl_sandbox_batch *b) {
    if (!b || b->joined) return;
    for (int t = 0; t < b->n_threads; t++) pthread_join(b->threads[t], NULL);
    b->joined = 1;
}

mrl_status mrl_sandbox_batch_take(mrl_sandbox_batch *b, int i, mrl_sandbox_result *result) {
    if (!b || !result) return mrl_set_error(MRL_ERR_INVALID, "mrl_sandbox_batch_take: NULL argument");
    if (i < 0 || i >= b->n) return mrl_set_error(MRL_ERR_INVALID, "sandbox batch: run %d of %d", i, b->n);
    mrl_sandbox_batch_wait(b);
    run_slot *r = &b->runs[i];
    if (r->taken) return mrl_set_error(MRL_ERR_INVALID, "sandbox batch: run %d taken already", i);
    r->taken = 1;
    *result = r->result;
    memset(&r->result, 0, sizeof r->result);
    if (r->status) return mrl_set_error(r->status, "%s", r->error ? r->error : "sandbox: the run failed");
    return MRL_OK;
}

void mrl_sandbox_batch_free(mrl_sandbox_batch *b) {
    if (!b) return;
    mrl_sandbox_batch_wait(b);
    for (int i = 0; i < b->n; i++) {
        mrl_sandbox_result_free(&b->runs[i].result);
        free(b->runs[i].error);
    }
    free(b->runs), free(b->threads), free(b);
}
