/* The process's libuv event loop on a background thread.
 *
 * The main thread never touches libuv handles directly: it queues a command
 * (spawn a process, start a job, set a deadline, ...) under a mutex and wakes
 * the loop with uv_async_send; the loop thread carries it out. Completion is
 * signalled back through a mutex/condition pair per object. */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>
#include "runtime/loop_internal.h"
#include "moonrl/log.h"
#include "moonrl/supervise.h"
#include "moonrl/fs.h"
#include "base/error.h"

typedef enum { CMD_SPAWN, CMD_KILL, CMD_JOB, CMD_DEADLINE, CMD_SIGNALS, CMD_QUIT } command_kind;

typedef struct command {
    command_kind kind;
    void *target;
    double seconds;
    struct command *next;
} command;

static uv_loop_t loop;
static uv_thread_t loop_thread;
static uv_async_t wake;
static uv_mutex_t queue_lock;
static command *queue_head, *queue_tail;
static int loop_running;

static uv_signal_t sigint_handle, sigterm_handle, sigusr2_handle;
static int signals_installed;          /* guarded by signals_lock */
static uv_mutex_t signals_lock;
static uv_cond_t signals_cond;
static uv_timer_t deadline_timer;

static _Atomic int stop_code;
static char stop_reason[256];

/* ---------------------------------------------------------------- time */

double mrl_time_now(void) { return (double)uv_hrtime() * 1e-9; }

mrl_status mrl_sleep(double seconds) {
    double end = mrl_time_now() + seconds;
    for (;;) {
        if (atomic_load(&stop_code)) return mrl_set_error(MRL_ERR_STOPPED, "stopped: %s", stop_reason);
        double left = end - mrl_time_now();
        if (left <= 0) return MRL_OK;
        if (left > 0.01) left = 0.01; /* wake often enough to notice a stop */
        struct timespec ts = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

/* ---------------------------------------------------------------- stop */

int mrl_stop_requested(void) { return atomic_load(&stop_code); }
const char *mrl_stop_reason(void) { return atomic_load(&stop_code) ? stop_reason : ""; }

void mrl_request_stop(int code, const char *reason) {
    if (atomic_load(&stop_code)) return; /* keep the first reason */
    snprintf(stop_reason, sizeof stop_reason, "%s", reason ? reason : "stop requested");
    atomic_store(&stop_code, code ? code : -2);
}

void mrl_clear_stop(void) {
    stop_reason[0] = 0;
    atomic_store(&stop_code, 0);
}

static _Atomic int count_only, signals_received, signal_last;

void mrl_signals_count_only(void) { atomic_store(&count_only, 1); }
int mrl_signals_received(void) { return atomic_load(&signals_received); }
int mrl_signal_last(void) { return atomic_load(&signal_last); }

static void on_signal(uv_signal_t *handle, int signum) {
    (void)handle;
    /* SIGUSR2 is a SIGINT / SIGTERM that `moonrl launch` forwarded through mpirun, which passes
     * SIGUSR1/2 on to every rank but ends the job on SIGTERM: the ranks stop as on SIGTERM */
    const char *name = signum == SIGINT ? "SIGINT" : signum == SIGTERM ? "SIGTERM" : "SIGUSR2 (a stop from the launcher)";
    if (signum == SIGUSR2) signum = SIGTERM;
    atomic_store(&signal_last, signum);
    atomic_fetch_add(&signals_received, 1);
    if (atomic_load(&count_only)) return;
    if (atomic_load(&stop_code) > 0) {
        /* second signal: the user does not want to wait for a safe point */
        fprintf(stderr, "moonrl: second %s, exiting now\n", name);
        fflush(stderr);
        _exit(128 + signum);
    }
    fprintf(stderr, "moonrl: received %s, stopping at the next safe point (send it again to exit now)\n", name);
    fflush(stderr);
    snprintf(stop_reason, sizeof stop_reason, "%s", name);
    atomic_store(&stop_code, signum);
    char beat[64];
    snprintf(beat, sizeof beat, "signal %s", name); /* a supervisor then need not forward it */
    mrl_heartbeat(beat);
}

static void on_deadline(uv_timer_t *timer) {
    char reason[128];
    snprintf(reason, sizeof reason, "deadline of %.3g s passed", *(double *)timer->data);
    mrl_request_stop(-1, reason);
}

/* ------------------------------------------------------------- processes */

typedef struct output_buffer {
    char *data;
    size_t len, cap, max;
} output_buffer;

struct mrl_proc {
    char **argv;
    char *stdin_data;
    size_t stdin_len;
    double timeout_s;
    double start_time;
    uv_process_t process;
    uv_pipe_t pipe_in, pipe_out, pipe_err;
    uv_timer_t timer;
    uv_write_t write_req;
    output_buffer out, err;
    int open_handles;   /* handles not yet closed by the loop */
    int spawned, exited;
    mrl_proc_result result;
    char spawn_error[256];
    uv_mutex_t lock;
    uv_cond_t cond;
    int done;
};

static void proc_handle_closed(uv_handle_t *handle) {
    mrl_proc *p = handle->data;
    if (--p->open_handles == 0) {
        uv_mutex_lock(&p->lock);
        p->done = 1;
        uv_cond_broadcast(&p->cond);
        uv_mutex_unlock(&p->lock);
    }
}

static void proc_close(uv_handle_t *handle) {
    if (!uv_is_closing(handle)) uv_close(handle, proc_handle_closed);
}

static void proc_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
    (void)suggested;
    mrl_proc *p = handle->data;
    output_buffer *ob = (uv_pipe_t *)handle == &p->pipe_out ? &p->out : &p->err;
    if (ob->cap - ob->len < 4096) {
        size_t cap = ob->cap ? ob->cap * 2 : 8192;
        char *grown = realloc(ob->data, cap + 1);
        if (grown) {
            ob->data = grown;
            ob->cap = cap;
        }
    }
    buf->base = ob->data ? ob->data + ob->len : NULL;
    buf->len = ob->data ? ob->cap - ob->len : 0;
}

static void proc_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
    (void)buf;
    mrl_proc *p = stream->data;
    output_buffer *ob = (uv_pipe_t *)stream == &p->pipe_out ? &p->out : &p->err;
    if (nread > 0) {
        ob->len += (size_t)nread;
        if (ob->len > ob->max) ob->len = ob->max; /* keep the first max bytes, drop the rest */
        ob->data[ob->len] = 0;
    } else if (nread < 0) {
        proc_close((uv_handle_t *)stream); /* EOF or error */
    }
}

static void proc_kill_group(mrl_proc *p) {
    if (p->spawned && !p->exited) kill(-p->process.pid, SIGKILL); /* the child leads its own group */
}

static void proc_timeout(uv_timer_t *timer) {
    mrl_proc *p = timer->data;
    p->result.timed_out = 1;
    proc_kill_group(p);
}

static void proc_exit(uv_process_t *process, int64_t exit_status, int term_signal) {
    mrl_proc *p = process->data;
    p->exited = 1;
    p->result.exited = term_signal == 0;
    p->result.exit_status = (int)exit_status;
    p->result.term_signal = term_signal;
    p->result.seconds = mrl_time_now() - p->start_time;
    proc_close((uv_handle_t *)&p->timer);
    proc_close((uv_handle_t *)process);
    /* grandchildren may still hold the pipes open: end the whole group */
    kill(-process->pid, SIGKILL);
}

static void proc_written(uv_write_t *req, int status) {
    (void)status;
    mrl_proc *p = req->data;
    proc_close((uv_handle_t *)&p->pipe_in);
}

static void loop_spawn(mrl_proc *p) {
    uv_pipe_t *pipes[3] = {&p->pipe_in, &p->pipe_out, &p->pipe_err};
    uv_handle_t *handles[5] = {(uv_handle_t *)&p->process, (uv_handle_t *)&p->timer, (uv_handle_t *)pipes[0],
                               (uv_handle_t *)pipes[1], (uv_handle_t *)pipes[2]};
    for (int i = 0; i < 3; i++) uv_pipe_init(&loop, pipes[i], 0);
    uv_timer_init(&loop, &p->timer);
    for (int i = 0; i < 5; i++) handles[i]->data = p;
    p->open_handles = 5;

    uv_stdio_container_t stdio[3];
    stdio[0].flags = UV_CREATE_PIPE | UV_READABLE_PIPE;
    stdio[0].data.stream = (uv_stream_t *)&p->pipe_in;
    stdio[1].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
    stdio[1].data.stream = (uv_stream_t *)&p->pipe_out;
    stdio[2].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
    stdio[2].data.stream = (uv_stream_t *)&p->pipe_err;
    uv_process_options_t opts;
    memset(&opts, 0, sizeof opts);
    opts.file = p->argv[0];
    opts.args = p->argv;
    opts.exit_cb = proc_exit;
    opts.flags = UV_PROCESS_DETACHED; /* own process group, so a timeout kills grandchildren too */
    opts.stdio_count = 3;
    opts.stdio = stdio;
    p->start_time = mrl_time_now();
    int rc = uv_spawn(&loop, &p->process, &opts);
    if (rc != 0) {
        snprintf(p->spawn_error, sizeof p->spawn_error, "cannot start '%s': %s", p->argv[0], uv_strerror(rc));
        p->exited = 1;
        for (int i = 0; i < 5; i++) proc_close(handles[i]);
        return;
    }
    p->spawned = 1;
    uv_read_start((uv_stream_t *)&p->pipe_out, proc_alloc, proc_read);
    uv_read_start((uv_stream_t *)&p->pipe_err, proc_alloc, proc_read);
    if (p->stdin_len) {
        uv_buf_t buf = uv_buf_init(p->stdin_data, (unsigned)p->stdin_len);
        p->write_req.data = p;
        if (uv_write(&p->write_req, (uv_stream_t *)&p->pipe_in, &buf, 1, proc_written) != 0)
            proc_close((uv_handle_t *)&p->pipe_in);
    } else {
        proc_close((uv_handle_t *)&p->pipe_in);
    }
    if (p->timeout_s > 0) uv_timer_start(&p->timer, proc_timeout, (uint64_t)(p->timeout_s * 1000.0 + 0.5), 0);
}

/* ------------------------------------------------------------------ jobs */

typedef struct write_file_arg {
    char *path;
    void *data;
    size_t bytes;
} write_file_arg;

struct mrl_job {
    uv_work_t work;
    mrl_job_fn fn;
    void *arg;
    write_file_arg *owned; /* freed with the job (mrl_job_write_file) */
    mrl_status status;
    char message[1024];
    uv_mutex_t lock;
    uv_cond_t cond;
    int done;
};

static void job_run(uv_work_t *work) {
    mrl_job *job = work->data;
    mrl_clear_error();
    job->status = job->fn(job->arg);
    snprintf(job->message, sizeof job->message, "%s", mrl_last_error());
}

static void job_finished(uv_work_t *work, int status) {
    mrl_job *job = work->data;
    if (status == UV_ECANCELED) {
        job->status = MRL_ERR_STOPPED;
        snprintf(job->message, sizeof job->message, "job cancelled");
    }
    uv_mutex_lock(&job->lock);
    job->done = 1;
    uv_cond_broadcast(&job->cond);
    uv_mutex_unlock(&job->lock);
}

/* ----------------------------------------------------------- the thread */

static void handle_command(command *c) {
    switch (c->kind) {
    case CMD_SPAWN: loop_spawn(c->target); break;
    case CMD_KILL: proc_kill_group(c->target); break;
    case CMD_JOB: {
        mrl_job *job = c->target;
        job->work.data = job;
        int rc = uv_queue_work(&loop, &job->work, job_run, job_finished);
        if (rc != 0) {
            job->status = MRL_ERR_INTERNAL;
            snprintf(job->message, sizeof job->message, "cannot queue work: %s", uv_strerror(rc));
            job_finished(&job->work, 0);
        }
        break;
    }
    case CMD_DEADLINE:
        uv_timer_stop(&deadline_timer);
        if (c->seconds > 0) {
            static double seconds;
            seconds = c->seconds;
            deadline_timer.data = &seconds;
            uv_timer_start(&deadline_timer, on_deadline, (uint64_t)(c->seconds * 1000.0 + 0.5), 0);
        }
        break;
    case CMD_SIGNALS:
        if (!signals_installed) {
            uv_signal_init(&loop, &sigint_handle);
            uv_signal_init(&loop, &sigterm_handle);
            uv_signal_start(&sigint_handle, on_signal, SIGINT);
            uv_signal_start(&sigterm_handle, on_signal, SIGTERM);
            uv_signal_init(&loop, &sigusr2_handle);
            uv_signal_start(&sigusr2_handle, on_signal, SIGUSR2);
            uv_mutex_lock(&signals_lock);
            signals_installed = 1;
            uv_cond_broadcast(&signals_cond);
            uv_mutex_unlock(&signals_lock);
        }
        break;
    case CMD_QUIT: break;
    }
}

static void close_walk(uv_handle_t *handle, void *arg) {
    (void)arg;
    if (handle->type == UV_PROCESS) kill(-((uv_process_t *)handle)->pid, SIGKILL);
    if (!uv_is_closing(handle)) {
        /* process handles belong to mrl_proc objects and report their close */
        if (handle->data && (handle->type == UV_PROCESS || handle->type == UV_NAMED_PIPE ||
                             (handle->type == UV_TIMER && handle != (uv_handle_t *)&deadline_timer)))
            uv_close(handle, proc_handle_closed);
        else
            uv_close(handle, NULL);
    }
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
            uv_walk(&loop, close_walk, NULL);
            return;
        }
    }
}

static void loop_main(void *arg) {
    (void)arg;
    uv_run(&loop, UV_RUN_DEFAULT);
}

static mrl_status post(command_kind kind, void *target, double seconds) {
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

mrl_status mrl_loop_start(void) {
    if (loop_running) return MRL_OK;
    int rc = uv_loop_init(&loop);
    if (rc) return mrl_set_error(MRL_ERR_INTERNAL, "uv_loop_init: %s", uv_strerror(rc));
    uv_mutex_init(&queue_lock);
    uv_mutex_init(&signals_lock);
    uv_cond_init(&signals_cond);
    uv_async_init(&loop, &wake, on_wake);
    uv_timer_init(&loop, &deadline_timer);
    rc = uv_thread_create(&loop_thread, loop_main, NULL);
    if (rc) return mrl_set_error(MRL_ERR_INTERNAL, "cannot start the event loop thread: %s", uv_strerror(rc));
    loop_running = 1;
    return MRL_OK;
}

void mrl_loop_stop(void) {
    if (!loop_running) return;
    post(CMD_QUIT, NULL, 0);
    uv_thread_join(&loop_thread);
    loop_running = 0;
    signals_installed = 0;
    uv_loop_close(&loop);
    uv_mutex_destroy(&queue_lock);
    uv_mutex_destroy(&signals_lock);
    uv_cond_destroy(&signals_cond);
}

/* Returns once the handlers are in place: a signal sent after this call is a
 * stop request, never the default action (the run would die unsaved). */
mrl_status mrl_signals_install(void) {
    mrl_status st = post(CMD_SIGNALS, NULL, 0);
    if (st != MRL_OK) return st;
    uv_mutex_lock(&signals_lock);
    while (!signals_installed) uv_cond_wait(&signals_cond, &signals_lock);
    uv_mutex_unlock(&signals_lock);
    return MRL_OK;
}

mrl_status mrl_deadline_set(double seconds) {
    if (!(seconds >= 0)) return mrl_set_error(MRL_ERR_INVALID, "deadline must be >= 0 seconds, got %g", seconds);
    return post(CMD_DEADLINE, NULL, seconds);
}

/* ------------------------------------------------------ process API */

mrl_status mrl_proc_spawn(const char *const *argv, const char *stdin_data, size_t stdin_len, double timeout_s,
                          size_t max_output, mrl_proc **out) {
    *out = NULL;
    if (!argv || !argv[0] || !argv[0][0]) return mrl_set_error(MRL_ERR_INVALID, "spawn: empty command");
    if (!(timeout_s >= 0)) return mrl_set_error(MRL_ERR_INVALID, "spawn: timeout must be >= 0, got %g", timeout_s);
    mrl_proc *p = calloc(1, sizeof *p);
    if (!p) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    int argc = 0;
    while (argv[argc]) argc++;
    p->argv = calloc((size_t)argc + 1, sizeof(char *));
    for (int i = 0; p->argv && i < argc; i++) p->argv[i] = strdup(argv[i]);
    if (stdin_len) {
        p->stdin_data = malloc(stdin_len);
        if (p->stdin_data) memcpy(p->stdin_data, stdin_data, stdin_len);
    }
    p->stdin_len = stdin_len;
    p->timeout_s = timeout_s;
    p->out.max = p->err.max = max_output ? max_output : ((size_t)16 << 20);
    uv_mutex_init(&p->lock);
    uv_cond_init(&p->cond);
    if (!p->argv || (stdin_len && !p->stdin_data)) {
        p->done = 1;
        mrl_proc_free(p);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    }
    mrl_status st = post(CMD_SPAWN, p, 0);
    if (st != MRL_OK) {
        p->done = 1;
        mrl_proc_free(p);
        return st;
    }
    *out = p;
    return MRL_OK;
}

int mrl_proc_done(mrl_proc *p) {
    uv_mutex_lock(&p->lock);
    int done = p->done;
    uv_mutex_unlock(&p->lock);
    return done;
}

mrl_status mrl_proc_wait(mrl_proc *p, mrl_proc_result *result) {
    uv_mutex_lock(&p->lock);
    while (!p->done) uv_cond_wait(&p->cond, &p->lock);
    uv_mutex_unlock(&p->lock);
    if (result) *result = p->result;
    if (p->spawn_error[0]) return mrl_set_error(MRL_ERR_IO, "%s", p->spawn_error);
    return MRL_OK;
}

const char *mrl_proc_stdout(mrl_proc *p, size_t *len) {
    if (len) *len = p->out.len;
    return p->out.data ? p->out.data : "";
}

const char *mrl_proc_stderr(mrl_proc *p, size_t *len) {
    if (len) *len = p->err.len;
    return p->err.data ? p->err.data : "";
}

void mrl_proc_free(mrl_proc *p) {
    if (!p) return;
    if (!mrl_proc_done(p)) {
        post(CMD_KILL, p, 0);
        mrl_proc_wait(p, NULL);
    }
    for (int i = 0; p->argv && p->argv[i]; i++) free(p->argv[i]);
    free(p->argv);
    free(p->stdin_data);
    free(p->out.data);
    free(p->err.data);
    uv_mutex_destroy(&p->lock);
    uv_cond_destroy(&p->cond);
    free(p);
}

/* ------------------------------------------------------------ job API */

mrl_status mrl_job_submit(mrl_job_fn fn, void *arg, mrl_job **out) {
    *out = NULL;
    if (!fn) return mrl_set_error(MRL_ERR_INVALID, "job: no function");
    mrl_job *job = calloc(1, sizeof *job);
    if (!job) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    job->fn = fn;
    job->arg = arg;
    uv_mutex_init(&job->lock);
    uv_cond_init(&job->cond);
    mrl_status st = post(CMD_JOB, job, 0);
    if (st != MRL_OK) {
        uv_mutex_destroy(&job->lock);
        uv_cond_destroy(&job->cond);
        free(job);
        return st;
    }
    *out = job;
    return MRL_OK;
}

static mrl_status write_file_job(void *varg) {
    write_file_arg *a = varg;
    return mrl_fs_write_file(a->path, a->data, a->bytes);
}

mrl_status mrl_job_write_file(const char *path, const void *data, size_t bytes, mrl_job **out) {
    *out = NULL;
    if (!path || !path[0]) return mrl_set_error(MRL_ERR_INVALID, "write_file: empty path");
    write_file_arg *a = calloc(1, sizeof *a);
    if (!a) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    a->path = strdup(path);
    a->data = malloc(bytes ? bytes : 1);
    if (!a->path || !a->data) {
        free(a->path);
        free(a->data);
        free(a);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory copying %zu bytes for %s", bytes, path);
    }
    memcpy(a->data, data, bytes);
    a->bytes = bytes;
    mrl_status st = mrl_job_submit(write_file_job, a, out);
    if (st != MRL_OK) {
        free(a->path);
        free(a->data);
        free(a);
        return st;
    }
    (*out)->owned = a;
    return MRL_OK;
}

int mrl_job_done(mrl_job *job) {
    uv_mutex_lock(&job->lock);
    int done = job->done;
    uv_mutex_unlock(&job->lock);
    return done;
}

mrl_status mrl_job_wait(mrl_job *job) {
    uv_mutex_lock(&job->lock);
    while (!job->done) uv_cond_wait(&job->cond, &job->lock);
    uv_mutex_unlock(&job->lock);
    if (job->status != MRL_OK) mrl_set_error(job->status, "%s", job->message);
    return job->status;
}

void mrl_job_free(mrl_job *job) {
    if (!job) return;
    mrl_job_wait(job);
    if (job->owned) {
        free(job->owned->path);
        free(job->owned->data);
        free(job->owned);
    }
    uv_mutex_destroy(&job->lock);
    uv_cond_destroy(&job->cond);
    free(job);
}
