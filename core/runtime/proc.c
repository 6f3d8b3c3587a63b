/* Subprocesses with timeouts (moonrl/loop.h): spawned, fed their standard
 * input, read and killed on the loop thread; the caller's thread waits on
 * the mrl_proc's lock and condition. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "runtime/loop_thread.h"
#include "base/error.h"

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
    int own_group; /* it leads a process group of its own */
    mrl_proc_result result;
    char spawn_error[256];
    uv_mutex_t lock;
    uv_cond_t cond;
    int done;
};

/* Subprocesses lead process groups of their own, so that a kill reaches
 * their children too; but a forked worker's stay in the worker's group, so
 * that the kill of a worker that ran late (mrl_worker_free) reaches them. */
static int spawn_own_group = 1;
void mrl_proc_spawn_in_caller_group(void) { spawn_own_group = 0; }

/* the child and, when it leads one, its group */
static void kill_child(mrl_proc *p) {
    if (p->own_group) kill(-p->process.pid, SIGKILL);
    else kill(p->process.pid, SIGKILL);
}

void mrl_proc_handle_closed(uv_handle_t *handle) {
    mrl_proc *p = handle->data;
    if (--p->open_handles == 0) {
        uv_mutex_lock(&p->lock);
        p->done = 1;
        uv_cond_broadcast(&p->cond);
        uv_mutex_unlock(&p->lock);
    }
}

static void proc_close(uv_handle_t *handle) {
    if (!uv_is_closing(handle)) uv_close(handle, mrl_proc_handle_closed);
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

void mrl_proc_kill_on_loop(mrl_proc *p) {
    if (p->spawned && !p->exited) kill_child(p);
}

static void proc_timeout(uv_timer_t *timer) {
    mrl_proc *p = timer->data;
    p->result.timed_out = 1;
    mrl_proc_kill_on_loop(p);
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
    if (p->own_group) kill(-process->pid, SIGKILL);
}

static void proc_written(uv_write_t *req, int status) {
    (void)status;
    mrl_proc *p = req->data;
    proc_close((uv_handle_t *)&p->pipe_in);
}

void mrl_proc_spawn_on_loop(mrl_proc *p) {
    uv_pipe_t *pipes[3] = {&p->pipe_in, &p->pipe_out, &p->pipe_err};
    uv_handle_t *handles[5] = {(uv_handle_t *)&p->process, (uv_handle_t *)&p->timer, (uv_handle_t *)pipes[0],
                               (uv_handle_t *)pipes[1], (uv_handle_t *)pipes[2]};
    for (int i = 0; i < 3; i++) uv_pipe_init(mrl_uv_loop, pipes[i], 0);
    uv_timer_init(mrl_uv_loop, &p->timer);
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
    p->own_group = spawn_own_group;
    opts.flags = p->own_group ? UV_PROCESS_DETACHED : 0; /* own process group, so a timeout kills grandchildren too */
    opts.stdio_count = 3;
    opts.stdio = stdio;
    p->start_time = mrl_time_now();
    int rc = uv_spawn(mrl_uv_loop, &p->process, &opts);
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

/* ---------------------------------------------------------------- API */

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
    mrl_status st = mrl_loop_post(CMD_SPAWN, p, 0);
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

/* Wait for the child's end; with `stoppable`, a stop requested while it waits (SIGINT, SIGTERM,
 * the deadline) kills it: the wait is bounded by the child's timeout or by the user. A stop
 * requested before (the child is part of stopping) lets it run. */
static int wait_done(mrl_proc *p, int stoppable) {
    int stopped = 0;
    if (mrl_stop_requested()) stoppable = 0;
    uv_mutex_lock(&p->lock);
    while (!p->done) {
        if (!stoppable) {
            uv_cond_wait(&p->cond, &p->lock);
            continue;
        }
        uv_cond_timedwait(&p->cond, &p->lock, 20 * 1000 * 1000); /* 20 ms: often enough to see a stop */
        if (!stopped && !p->done && mrl_stop_requested()) {
            stopped = 1;
            uv_mutex_unlock(&p->lock);
            mrl_loop_post(CMD_KILL, p, 0); /* its end closes the handles, which sets done */
            uv_mutex_lock(&p->lock);
        }
    }
    uv_mutex_unlock(&p->lock);
    return stopped;
}

mrl_status mrl_proc_wait(mrl_proc *p, mrl_proc_result *result) {
    int stopped = wait_done(p, 1);
    if (result) *result = p->result;
    if (stopped)
        return mrl_set_error(MRL_ERR_STOPPED, "stopped while waiting for '%s' (killed): %s", p->argv[0],
                             mrl_stop_reason());
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
        mrl_loop_post(CMD_KILL, p, 0);
        wait_done(p, 0);
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
