/* Parallel-for on OpenMP. Why OpenMP and not our own pool: measured in
 * bench/parallel_for.c (see bench/RESULTS.md), libgomp's fork/join costs
 * about as little as a spinning pthread pool and far less than a condvar
 * pool, and it needs no code of ours to keep correct. */
#include <stdlib.h>
#include <unistd.h>
#include <omp.h>
#include "moonrl/parallel.h"

static int thread_count = 0;

int mrl_parallel_threads(void) {
    if (thread_count <= 0) {
        const char *env = getenv("MOONRL_THREADS");
        int n = env ? atoi(env) : 0;
        if (n <= 0) n = (int)sysconf(_SC_NPROCESSORS_ONLN);
        if (n <= 0) n = 1;
        thread_count = n;
    }
    return thread_count;
}

void mrl_parallel_set_threads(int threads) { thread_count = threads > 0 ? threads : 0; }

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
