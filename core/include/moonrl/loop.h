/* The process's event loop (libuv), run on a background thread so that it
 * keeps serving signals, timers and subprocesses while the main thread is
 * busy in Lua or in a long C call (mrl_init starts it). The main thread
 * talks to it through the calls below; none of them ever calls back into
 * Lua. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Seconds from an arbitrary fixed point, monotonic, nanosecond resolution. */
double mrl_time_now(void);
/* Sleep; returns MRL_ERR_STOPPED early if a stop is requested meanwhile. */
mrl_status mrl_sleep(double seconds);

/* --- Stopping cleanly -------------------------------------------------- */
/* Install SIGINT/SIGTERM handlers on the loop: the first signal requests a
 * stop (the run ends at its next safe point); a second one exits at once.
 * SIGUSR2 counts as SIGTERM: it is how `moonrl launch` passes a stop through
 * mpirun (which forwards SIGUSR1/2 to the ranks but kills them on SIGTERM). */
mrl_status mrl_signals_install(void);
/* For a supervisor, which forwards signals to its child: from now on SIGINT
 * and SIGTERM are only counted (no second-signal exit); it polls the count. */
void mrl_signals_count_only(void);
/* While on, the first SIGINT / SIGTERM ends the process at once (exit
 * status 128 + the signal), as a second one does: around a wait that would
 * never see a stop request, such as a read of standard input. Returns the
 * previous setting. */
int mrl_signals_exit_at_once(int on);
/* Signals received so far (SIGINT and SIGTERM), and the last one's number. */
int mrl_signals_received(void);
int mrl_signal_last(void);
/* 0 when no stop was requested, else the signal number, or -1 for a
 * deadline, or -2 for a stop requested by the program itself. */
int mrl_stop_requested(void);
/* Why the stop was requested ("SIGINT", "deadline of 30 s passed", ...). */
const char *mrl_stop_reason(void);
void mrl_request_stop(int code, const char *reason);
void mrl_clear_stop(void);
/* After `seconds` (0..MRL_DEADLINE_MAX, finite), request a stop (code -1). 0 cancels the deadline. */
#define MRL_DEADLINE_MAX 1e12
mrl_status mrl_deadline_set(double seconds);

/* --- Subprocesses with timeouts ---------------------------------------- */
typedef struct mrl_proc mrl_proc;

typedef struct mrl_proc_result {
    int exited;        /* 1 when the child exited by itself */
    int exit_status;   /* its exit status when exited */
    int term_signal;   /* the signal that ended it, else 0 */
    int timed_out;     /* 1 when it was killed for running past its timeout */
    double seconds;    /* wall time from spawn to exit */
} mrl_proc_result;

/* Start argv[0] (looked up in PATH) with argv; stdin_data (may be NULL) is
 * written to its standard input, stdout and stderr are captured (up to
 * max_output bytes each; 0 means 16 MiB). After timeout_s seconds (0: none)
 * the child is sent SIGKILL. */
mrl_status mrl_proc_spawn(const char *const *argv, const char *stdin_data, size_t stdin_len,
                          double timeout_s, size_t max_output, mrl_proc **out);
/* 1 when the child has ended and its output is complete. */
int mrl_proc_done(mrl_proc *proc);
/* Block until the child has ended. A stop requested meanwhile (SIGINT,
 * SIGTERM, the deadline) kills it and returns MRL_ERR_STOPPED. */
mrl_status mrl_proc_wait(mrl_proc *proc, mrl_proc_result *result);
/* Captured output; valid until mrl_proc_free. */
const char *mrl_proc_stdout(mrl_proc *proc, size_t *len);
const char *mrl_proc_stderr(mrl_proc *proc, size_t *len);
/* Free (kills the child first if it still runs). */
void mrl_proc_free(mrl_proc *proc);

/* --- Forked workers ----------------------------------------------------- */
/* A worker is a child process, forked from the caller, that runs the
 * caller's own code (a Lua function, with the state as it was at the fork)
 * on task numbers the parent sends, and sends back a reply for each: what
 * runs side by side and can be killed whatever it blocks in (rewards with a
 * time limit, moonrl.io.workers). The child has its own process group, the
 * default action for SIGINT and SIGTERM, one thread for parallel loops and
 * an event loop of its own (subprocesses work). */
typedef struct mrl_worker mrl_worker;

/* Fork a worker. In the parent *is_child is 0 and *out the worker; in the
 * child *is_child is 1 and *out its own end (for mrl_worker_next). */
mrl_status mrl_worker_fork(mrl_worker **out, int *is_child);
/* Parent: give the worker task number `task` (>= 0); its reply so far is
 * forgotten. */
mrl_status mrl_worker_send(mrl_worker *worker, int64_t task);
/* Parent: wait until one of workers[0..n) (NULL entries are skipped) has a
 * whole reply or has ended (died, or was killed), at most timeout_s seconds.
 * Returns its index; -1 when none within the time; -2 when a stop was
 * requested meanwhile (the message says why). */
int mrl_worker_wait(mrl_worker *const *workers, int n, double timeout_s);
/* Parent: the reply (NULL while there is none; valid until the next send or
 * free), and whether the worker has ended. */
const char *mrl_worker_reply(mrl_worker *worker, size_t *len);
int mrl_worker_ended(const mrl_worker *worker);
/* Parent: kill the worker and its process group, reap it, free it. */
void mrl_worker_free(mrl_worker *worker);
/* Child: the next task number, blocking; -1 when the parent has gone. */
int64_t mrl_worker_next(mrl_worker *self);
/* Child: the reply to the task taken last. */
mrl_status mrl_worker_answer(mrl_worker *self, const void *data, size_t len);
/* Child: flush stdio and end the process (no atexit handlers, no Lua
 * finalizers: the parent's objects are not the child's to close). */
void mrl_worker_exit(int status);

/* --- Background work on the loop's thread pool ------------------------- */
/* A job: one piece of work on a pool thread (the core's C functions,
 * core/runtime/loop_internal.h; Lua starts the ones below). */
typedef struct mrl_job mrl_job;

/* Write `bytes` of data (copied at submit) to path atomically: to a
 * temporary file, fsync, then rename over path. */
mrl_status mrl_job_write_file(const char *path, const void *data, size_t bytes, mrl_job **out);
int mrl_job_done(mrl_job *job);
/* Block until the job ends; returns its status (its message in mrl_last_error). */
mrl_status mrl_job_wait(mrl_job *job);
/* Free a job (waits for it first if it still runs). */
void mrl_job_free(mrl_job *job);

#ifdef __cplusplus
}
#endif
