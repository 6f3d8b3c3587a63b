/* The process's libuv event loop on a background thread.
 *
 * The main thread never touches libuv handles directly: it queues a command
 * (spawn a process, start a job, set a deadline, ...) under a mutex and wakes
 * the loop with uv_async_send; the loop thread carries it out. Completion is
 * signalled back through a mutex/condition pair per object. This file is the
 * thread and its queue; what the commands do is in signals.c, proc.c and
 * job.c (loop_thread.h). */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include "runtime/loop_thread.h"
#include "base/error.h"

typedef struct command {
    mrl_loop_cmd kind;
    void *target;
    double seconds;
    struct command *next;
} command;

static uv_loop_t first_loop;
uv_loop_t *mrl_uv_loop = &first_loop; /* (a forked worker makes one of its own: mrl_loop_restart_in_child) */
static uv_thread_t loop_thread;
static uv_async_t wake;
static uv_mutex_t queue_lock;
static command *queue_head, *queue_tail;
static int loop_running;

double mrl_time_now(void) { return (double)uv_hrtime() * 1e-9; }

/* ----------------------------------------------------------- the thread */

static void handle_command(command *c) {
    switch (c->kind) {
    case CMD_SPAWN: mrl_proc_spawn_on_loop(c->target); break;
    case CMD_KILL: mrl_proc_kill_on_loop(c->target); break;
    case CMD_JOB: mrl_job_queue_on_loop(c->target); break;
    case CMD_DEADLINE: mrl_deadline_on_loop(c->seconds); break;
    case CMD_SIGNALS: mrl_signals_on_loop(); break;
    case CMD_QUIT: break;
    }
}

static void close_walk(uv_handle_t *handle, void *arg) {
    (void)arg;
    if (handle->type == UV_PROCESS) kill(-((uv_process_t *)handle)->pid, SIGKILL);
    /* an mrl_proc's handles (the only ones with data) report their close */
    if (!uv_is_closing(handle)) uv_close(handle, handle->data ? mrl_proc_handle_closed : NULL);
}

static void on_wake(uv_async_t *async) {
    (void)async;
    for (;;) {
        uv_mutex_lock(&queue_lock);
        command *c = queue_head;
        if (c) {
            queue_head = c->next;
            if (!queue_head) queue_tail = NULL;
        }
        uv_mutex_unlock(&queue_lock);
        if (!c) break;
        int quit = c->kind == CMD_QUIT;
        handle_command(c);
        free(c);
        if (quit) {
            uv_walk(mrl_uv_loop, close_walk, NULL);
            return;
        }
    }
}

static void loop_main(void *arg) {
    (void)arg;
    uv_run(mrl_uv_loop, UV_RUN_DEFAULT);
}

mrl_status mrl_loop_post(mrl_loop_cmd kind, void *target, double seconds) {
    if (!loop_running) return mrl_set_error(MRL_ERR_INTERNAL, "the event loop is not running (call mrl_init)");
    command *c = calloc(1, sizeof *c);
    if (!c) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    c->kind = kind;
    c->target = target;
    c->seconds = seconds;
    uv_mutex_lock(&queue_lock);
    if (queue_tail) queue_tail->next = c;
    else queue_head = c;
    queue_tail = c;
    uv_mutex_unlock(&queue_lock);
    uv_async_send(&wake);
    return MRL_OK;
}

/* A fork while another thread holds the queue's lock would leave it locked
 * for ever in the child: the fork waits for it. */
static void fork_prepare(void) { uv_mutex_lock(&queue_lock); }
static void fork_done(void) { uv_mutex_unlock(&queue_lock); }

mrl_status mrl_loop_start(void) {
    static int fork_handlers;
    if (loop_running) return MRL_OK;
    int rc = uv_loop_init(mrl_uv_loop);
    if (rc) return mrl_set_error(MRL_ERR_INTERNAL, "uv_loop_init: %s", uv_strerror(rc));
    uv_mutex_init(&queue_lock);
    uv_async_init(mrl_uv_loop, &wake, on_wake);
    mrl_signals_loop_init();
    rc = uv_thread_create(&loop_thread, loop_main, NULL);
    if (rc) return mrl_set_error(MRL_ERR_INTERNAL, "cannot start the event loop thread: %s", uv_strerror(rc));
    if (!fork_handlers && pthread_atfork(fork_prepare, fork_done, fork_done) == 0) fork_handlers = 1;
    loop_running = 1;
    return MRL_OK;
}

/* The loop thread stayed in the parent, and the loop's handles and
 * descriptors, and libuv's process-wide list of signal watchers, still
 * describe the parent's loop. The child gets a loop of its own at another
 * address: the parent's is left as it was (initialising a loop over it would
 * corrupt that list, which holds its SIGCHLD watcher), and so are its
 * descriptors (the parent shares them). Its queued commands are the parent's
 * objects: dropped. The locks are initialised again (unlocked: fork_prepare
 * held the queue's; signals.c's are only held for a few instructions). */
mrl_status mrl_loop_restart_in_child(void) {
    if (!loop_running) return MRL_OK;
    uv_loop_t *own = malloc(sizeof *own);
    if (!own) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    mrl_uv_loop = own;
    queue_head = queue_tail = NULL;
    loop_running = 0;
    return mrl_loop_start();
}

void mrl_loop_stop(void) {
    if (!loop_running) return;
    mrl_loop_post(CMD_QUIT, NULL, 0);
    uv_thread_join(&loop_thread);
    loop_running = 0;
    uv_loop_close(mrl_uv_loop);
    uv_mutex_destroy(&queue_lock);
    mrl_signals_loop_close();
}
