/* Forked workers (moonrl/loop.h): a child process that runs the caller's
 * own code on task numbers sent by the parent and sends a reply for each.
 * What they are for: rewards with a time limit, run side by side and killed
 * when late, whatever they block in (a Lua loop, a C call, a subprocess).
 *
 * Two channels per worker: tasks (an int64 each) down a socket pair (the
 * parent sends with MSG_NOSIGNAL: a worker that died is an error, not a
 * SIGPIPE that ends the trainer), replies (a uint32 length, then the bytes)
 * up a pipe. The parent reads replies without blocking and
 * waits on all workers at once with poll(2). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include "runtime/loop_internal.h"
#include "base/error.h"
#include "base/mem.h"
#include "base/parallel.h"

struct mrl_worker {
    pid_t pid;    /* the child (in the parent); 0 in the child */
    int task_fd;  /* parent: write end of the tasks; child: read end */
    int reply_fd; /* parent: read end of the replies; child: write end */
    char *buf;    /* parent: the reply being read (4-byte length, then the bytes) */
    size_t len, cap;
    int ready; /* a whole reply is in buf */
    int ended; /* the replies' pipe reached its end (the child is gone) */
};

enum { MAX_WAIT = 1024 }; /* workers one wait watches */

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* The child's side of the fork: its own process group, where the
 * subprocesses it starts stay (a kill of the group ends them too; a Ctrl-C
 * on the terminal reaches the trainer, which kills it), the default action of the signals
 * the trainer handles (libuv's handlers would report them to the parent's
 * loop), one thread for the parallel loops (the parent's OpenMP threads do
 * not exist here), and an event loop of its own. It dies with the parent. */
static mrl_status become_worker(pid_t parent) {
    /* a trainer killed outright (SIGKILL, the OOM killer) takes its workers along */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0);
    setpgid(0, 0);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGUSR2, SIG_DFL);
    mrl_parallel_set_threads(1);
    /* run.memory_budget_mb is the trainer's: the worker shares its pages and counts them again,
     * so a trainer near its budget would have every allocation of its rewards refused */
    mrl_mem_set_budget(0, NULL);
    mrl_proc_spawn_in_caller_group();
    return mrl_loop_restart_in_child();
}

mrl_status mrl_worker_fork(mrl_worker **out, int *is_child) {
    *out = NULL;
    *is_child = 0;
    mrl_worker *w = calloc(1, sizeof *w);
    if (!w) return mrl_set_error(MRL_ERR_NOMEM, "worker: out of memory");
    int tasks[2], replies[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, tasks) != 0) {
        free(w);
        return mrl_set_error(MRL_ERR_IO, "worker: pipe: %s", strerror(errno));
    }
    if (pipe2(replies, O_CLOEXEC) != 0) {
        int err = errno;
        close(tasks[0]), close(tasks[1]);
        free(w);
        return mrl_set_error(MRL_ERR_IO, "worker: pipe: %s", strerror(err));
    }
    /* what stdio buffers hold would otherwise be written twice */
    fflush(NULL);
    pid_t parent = getpid(), pid = fork();
    if (pid < 0) {
        int err = errno;
        for (int i = 0; i < 2; i++) close(tasks[i]), close(replies[i]);
        free(w);
        return mrl_set_error(MRL_ERR_IO, "worker: fork: %s", strerror(err));
    }
    if (pid == 0) {
        close(tasks[1]);
        close(replies[0]);
        w->task_fd = tasks[0];
        w->reply_fd = replies[1];
        if (become_worker(parent) != MRL_OK) _exit(70); /* (the parent sees it end, and says so) */
        *is_child = 1;
        *out = w;
        return MRL_OK;
    }
    setpgid(pid, pid); /* (in the child too: whichever runs first) */
    close(tasks[0]);
    close(replies[1]);
    w->pid = pid;
    w->task_fd = tasks[1];
    w->reply_fd = replies[0];
    fcntl(w->reply_fd, F_SETFL, fcntl(w->reply_fd, F_GETFL) | O_NONBLOCK);
    *out = w;
    return MRL_OK;
}

/* write all of it (send on a socket: no SIGPIPE); 0 or an errno */
static int write_full(int fd, const void *data, size_t n, int socket) {
    const char *p = data;
    while (n > 0) {
        ssize_t k = socket ? send(fd, p, n, MSG_NOSIGNAL) : write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return k < 0 ? errno : EIO;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

mrl_status mrl_worker_send(mrl_worker *w, int64_t task) {
    if (!w || !w->pid) return mrl_set_error(MRL_ERR_INVALID, "worker send: not a worker of this process");
    if (task < 0) return mrl_set_error(MRL_ERR_INVALID, "worker send: task %lld is negative", (long long)task);
    w->ready = 0;
    w->len = 0;
    int err = write_full(w->task_fd, &task, sizeof task, 1);
    if (err) return mrl_set_error(MRL_ERR_IO, "worker %d: cannot send a task: %s", (int)w->pid, strerror(err));
    return MRL_OK;
}

int64_t mrl_worker_next(mrl_worker *w) {
    int64_t task;
    size_t got = 0;
    while (got < sizeof task) {
        ssize_t k = read(w->task_fd, (char *)&task + got, sizeof task - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    return task;
}

mrl_status mrl_worker_answer(mrl_worker *w, const void *data, size_t len) {
    if (len > UINT32_MAX - sizeof(uint32_t))
        return mrl_set_error(MRL_ERR_INVALID, "worker reply: %zu bytes is too long", len);
    uint32_t n = (uint32_t)len;
    int err = write_full(w->reply_fd, &n, sizeof n, 0);
    if (!err) err = write_full(w->reply_fd, data, len, 0);
    if (err) return mrl_set_error(MRL_ERR_IO, "worker reply: %s", strerror(err));
    return MRL_OK;
}

void mrl_worker_exit(int status) {
    fflush(NULL);
    _exit(status);
}

/* Read what the pipe holds without blocking; sets ready or ended. */
static void drain(mrl_worker *w) {
    while (!w->ready && !w->ended) {
        size_t want = sizeof(uint32_t);
        if (w->len >= want) {
            uint32_t n;
            memcpy(&n, w->buf, sizeof n);
            want += n;
            if (w->len == want) {
                w->ready = 1;
                return;
            }
        }
        if (w->cap < want) {
            size_t cap = want < 256 ? 256 : want;
            char *grown = realloc(w->buf, cap);
            if (!grown) { /* a reply the parent cannot hold: as if the worker had died */
                w->ended = 1;
                return;
            }
            w->buf = grown;
            w->cap = cap;
        }
        ssize_t k = read(w->reply_fd, w->buf + w->len, want - w->len);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (k <= 0) {
            w->ended = 1;
            return;
        }
        w->len += (size_t)k;
    }
}

int mrl_worker_wait(mrl_worker *const *ws, int n, double timeout_s) {
    if (n > MAX_WAIT) n = MAX_WAIT;
    double end = mrl_time_now() + (timeout_s > 0 ? timeout_s : 0);
    struct pollfd fds[MAX_WAIT];
    for (;;) {
        int count = 0;
        for (int i = 0; i < n; i++) {
            if (!ws[i]) continue;
            drain(ws[i]);
            if (ws[i]->ready || ws[i]->ended) return i;
        }
        if (mrl_stop_requested()) {
            mrl_set_error(MRL_ERR_STOPPED, "stopped (%s) while workers ran", mrl_stop_reason());
            return -2;
        }
        for (int i = 0; i < n; i++) {
            fds[i].fd = ws[i] ? ws[i]->reply_fd : -1; /* (poll skips a negative fd) */
            fds[i].events = POLLIN;
            fds[i].revents = 0;
            count += ws[i] != NULL;
        }
        double left = end - mrl_time_now();
        if (count == 0 || left <= 0) return -1;
        /* a tenth of a second at most, to see a stop request */
        int ms = left > 0.1 ? 100 : (int)(left * 1000.0) + 1;
        if (poll(fds, (nfds_t)n, ms) < 0 && errno != EINTR) return -1;
    }
}

const char *mrl_worker_reply(mrl_worker *w, size_t *len) {
    if (!w || !w->ready) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = w->len - sizeof(uint32_t);
    return w->buf + sizeof(uint32_t);
}

int mrl_worker_ended(const mrl_worker *w) { return w && w->ended; }

void mrl_worker_free(mrl_worker *w) {
    if (!w) return;
    close_fd(&w->task_fd);
    close_fd(&w->reply_fd);
    if (w->pid > 0) {
        kill(-w->pid, SIGKILL); /* its group: the subprocesses it started in it too */
        kill(w->pid, SIGKILL);
        int status;
        while (waitpid(w->pid, &status, 0) < 0 && errno == EINTR) {}
    }
    free(w->buf);
    free(w);
}
