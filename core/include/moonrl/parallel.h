/* The thread count of moonrl's CPU work (the kernels' parallel loops,
 * core/base/parallel.h, run on that many threads). */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

/* Number of worker threads: the calling thread's own count if it set one
 * (mrl_parallel_set_thread_threads, core/base/parallel.h: the engine's
 * background thread), else the process-wide count
 * (mrl_parallel_set_threads, else MOONRL_THREADS, else the number of cores);
 * at most mrl_parallel_max_threads(). */
int mrl_parallel_threads(void);
/* Set the thread count; <= 0 goes back to the default. A count over
 * mrl_parallel_max_threads() is clamped to it, with a warning in the log
 * (as is MOONRL_THREADS; one that is not a positive integer is ignored). */
void mrl_parallel_set_threads(int threads);
/* The largest thread count accepted (1024). */
int mrl_parallel_max_threads(void);

#ifdef __cplusplus
}
#endif
