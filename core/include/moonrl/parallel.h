/* Parallel-for for CPU kernels. Built on OpenMP: see bench/RESULTS.md
 * ("parallel-for") for the measurement behind that choice. */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Body of a parallel loop: process the half-open range [begin, end). */
typedef void (*mrl_range_fn)(void *ctx, int64_t begin, int64_t end);

/* Split [0, n) into contiguous chunks of at least `grain` items and run
 * fn on them across the worker threads; returns when all are done. Runs
 * inline when n <= grain or only one thread is configured. */
void mrl_parallel_for(int64_t n, int64_t grain, mrl_range_fn fn, void *ctx);
/* Number of worker threads: the calling thread's own count if it set one
 * (mrl_parallel_set_thread_threads), else the process-wide count
 * (mrl_parallel_set_threads, else MOONRL_THREADS, else the number of cores);
 * at most mrl_parallel_max_threads(). */
int mrl_parallel_threads(void);
/* Set the thread count; <= 0 goes back to the default. A count over
 * mrl_parallel_max_threads() is clamped to it, with a warning in the log
 * (as is MOONRL_THREADS; one that is not a positive integer is ignored). */
void mrl_parallel_set_threads(int threads);
/* This thread's count, for the loops it starts, whatever the process-wide
 * count is or becomes; <= 0: the process-wide one. Clamped like
 * mrl_parallel_set_threads. Other threads are not affected (the engine's
 * background thread, mrl_engine_run_async, sets its own). */
void mrl_parallel_set_thread_threads(int threads);
/* The largest thread count accepted (1024). */
int mrl_parallel_max_threads(void);

#ifdef __cplusplus
}
#endif
