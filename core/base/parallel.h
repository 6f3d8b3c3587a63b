/* Parallel-for for the CPU kernels and the core (core internal: its body is
 * a C function, never a Lua one; moonrl/parallel.h has the thread counts
 * Lua sets). Built on OpenMP: see bench/RESULTS.md ("parallel-for") for the
 * measurement behind that choice. */
#pragma once
#include <stdint.h>
#include "moonrl/parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Body of a parallel loop: process the half-open range [begin, end). */
typedef void (*mrl_range_fn)(void *ctx, int64_t begin, int64_t end);

/* Split [0, n) into contiguous chunks of at least `grain` items and run
 * fn on them across the worker threads; returns when all are done. Runs
 * inline when n <= grain or only one thread is configured. */
void mrl_parallel_for(int64_t n, int64_t grain, mrl_range_fn fn, void *ctx);
/* This thread's count, for the loops it starts, whatever the process-wide
 * count is or becomes; <= 0: the process-wide one. Clamped like
 * mrl_parallel_set_threads. Other threads are not affected (the engine's
 * background thread, mrl_engine_run_async, sets its own). */
void mrl_parallel_set_thread_threads(int threads);

#ifdef __cplusplus
}
#endif
