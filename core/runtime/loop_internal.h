/* The event loop's own controls and its C-only work (core internal:
 * moonrl/loop.h has what Lua calls). */
#pragma once
#include "moonrl/loop.h"

/* Start / stop the loop thread (mrl_init and mrl_shutdown call them). */
mrl_status mrl_loop_start(void);
void mrl_loop_stop(void);
/* In a child of fork(): start a loop of its own (the parent's thread did not
 * come along), so that subprocesses and jobs work there too. */
mrl_status mrl_loop_restart_in_child(void);
/* From now on, subprocesses stay in the caller's process group (a forked
 * worker's: killing it then ends them too) instead of leading their own. */
void mrl_proc_spawn_in_caller_group(void);

/* A C function run on a pool thread; it returns a status (and sets the
 * error message on its own thread, which the job carries back). Never a
 * Lua function: it would run on another thread than Lua's, which is why
 * mrl_job_submit is not in the FFI. */
typedef mrl_status (*mrl_job_fn)(void *arg);
mrl_status mrl_job_submit(mrl_job_fn fn, void *arg, mrl_job **out);
