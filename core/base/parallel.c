/* Parallel-for on OpenMP. Why OpenMP and not our own pool: measured in
 * bench/parallel/parallel_for.c (see bench/RESULTS.md), libgomp's fork/join costs
 * about as little as a spinning pthread pool and far less than a condvar
 * pool, and it needs no code of ours to keep correct.
 * Thread counts are kept in [1, MAX_THREADS]: libgomp aborts the process when
 * it cannot create the threads asked for (run.threads=100000), so a larger
 * request is clamped, with a warning.
 *
 * A thread may have its own count (mrl_parallel_set_thread_threads): the
 * engine's background thread (mrl_engine_run_async) generates with a few
 * threads while the caller's thread trains with its own. Each OS thread that
 * opens a parallel region is the master of its own libgomp team and pool,
 * so two such threads never share workers. Inside a region loops run
 * inline (omp_in_parallel): a worker asking for the count (to size slices,
 * which no result depends on) gets the process-wide one. */
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>
#include <omp.h>
#include "base/log.h"
#include "base/parallel.h"

enum { MAX_THREADS = 1024 };

/* the process-wide count (0: not read from the environment yet); atomic
 * because a background thread may read it while another sets it */
static _Atomic int thread_count = 0;
static _Thread_local int own_count = 0; /* this thread's, 0: the process-wide one */

int mrl_parallel_max_threads(void) { return MAX_THREADS; }

static int clamp_threads(long n, const char *source) {
    if (n <= MAX_THREADS) return (int)n;
    mrl_logf(MRL_LOG_WARN, "%s%ld: over the limit of %d threads, using %d", source, n, MAX_THREADS, MAX_THREADS);
    return MAX_THREADS;
}

int mrl_parallel_threads(void) {
    if (own_count > 0) return own_count;
    int count = atomic_load(&thread_count);
    if (count <= 0) {
        const char *env = getenv("MOONRL_THREADS");
        char *end = NULL;
        long n = env ? strtol(env, &end, 10) : 0; /* too large: LONG_MAX, clamped below */
        if (env && (end == env || *end != 0 || n < 0)) { /* "" and "0": the default, silently */
            if (*env) mrl_logf(MRL_LOG_WARN, "MOONRL_THREADS = '%s' is not a thread count in 1..%d: ignored", env, MAX_THREADS);
            n = 0;
        }
        if (n > 0) n = clamp_threads(n, "MOONRL_THREADS = ");
        else n = sysconf(_SC_NPROCESSORS_ONLN);
        if (n > MAX_THREADS) n = MAX_THREADS; /* a machine with more cores */
        int zero = 0, found = n > 0 ? (int)n : 1;
        /* only if still unset: a count set meanwhile by another thread wins */
        count = atomic_compare_exchange_strong(&thread_count, &zero, found) ? found : zero;
    }
    return count;
}

void mrl_parallel_set_threads(int threads) {
    atomic_store(&thread_count, threads > 0 ? clamp_threads(threads, "thread count ") : 0);
}

void mrl_parallel_set_thread_threads(int threads) {
    own_count = threads > 0 ? clamp_threads(threads, "thread count ") : 0;
}

void mrl_parallel_for(int64_t n, int64_t grain, mrl_range_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    int threads = mrl_parallel_threads();
    int64_t max_chunks = (n + grain - 1) / grain;
    if (threads > max_chunks) threads = (int)max_chunks;
    if (threads <= 1 || omp_in_parallel()) {
        fn(ctx, 0, n);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t begin = n * t / nt, end = n * (t + 1) / nt;
        if (begin < end) fn(ctx, begin, end);
    }
}
