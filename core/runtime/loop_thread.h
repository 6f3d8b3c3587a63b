/* The event loop's thread and what runs on it, shared by the files of the
 * loop (core/runtime: loop.c the thread and its command queue, signals.c
 * stops, signals and the deadline, proc.c subprocesses, job.c thread-pool
 * jobs). Nothing outside them touches libuv: other threads queue a command
 * (mrl_loop_post) and the loop thread carries it out. */
#pragma once
#include <uv.h>
#include "runtime/loop_internal.h"

typedef enum { CMD_SPAWN, CMD_KILL, CMD_JOB, CMD_DEADLINE, CMD_SIGNALS, CMD_QUIT } mrl_loop_cmd;

/* The loop (loop.c), run by its thread between mrl_loop_start and mrl_loop_stop. */
extern uv_loop_t *mrl_uv_loop;
/* Queue a command for the loop thread and wake it (from any thread). */
mrl_status mrl_loop_post(mrl_loop_cmd kind, void *target, double seconds);

/* What each command does, on the loop thread. */
void mrl_signals_on_loop(void);            /* CMD_SIGNALS (signals.c) */
void mrl_deadline_on_loop(double seconds); /* CMD_DEADLINE (signals.c) */
void mrl_proc_spawn_on_loop(mrl_proc *p);  /* CMD_SPAWN (proc.c) */
void mrl_proc_kill_on_loop(mrl_proc *p);   /* CMD_KILL (proc.c) */
void mrl_job_queue_on_loop(mrl_job *job);  /* CMD_JOB (job.c) */
/* The close callback of an mrl_proc's handles, the only handles of the loop
 * with data: at quit the loop closes those with it, so that their waiters
 * wake (proc.c). */
void mrl_proc_handle_closed(uv_handle_t *handle);

/* signals.c's part of mrl_loop_start and mrl_loop_stop: its lock and
 * condition, and the deadline's timer on the loop. */
void mrl_signals_loop_init(void);
void mrl_signals_loop_close(void);
