/* Heartbeats (child side) and the supervised child process (supervisor
 * side); see moonrl/supervise.h. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "moonrl/loop.h"
#include "moonrl/supervise.h"
#include "base/error.h"

extern char **environ;

/* ---------------------------------------------------------------- child */

static int beat_fd = -2; /* -2: not looked up yet, -1: none */

static int heartbeat_fd(void) {
    if (beat_fd == -2) {
        const char *env = getenv("MOONRL_HEARTBEAT_FD");
        char *end = NULL;
        long fd = env ? strtol(env, &end, 10) : -1;
        beat_fd = -1;
        if (env && end && *end == 0 && fd > 2 && fd < 1 << 20 && fcntl((int)fd, F_GETFD) >= 0) {
            beat_fd = (int)fd;
            /* never block the run on a slow supervisor; never leak the pipe into our own children */
            fcntl(beat_fd, F_SETFL, fcntl(beat_fd, F_GETFL) | O_NONBLOCK);
            fcntl(beat_fd, F_SETFD, FD_CLOEXEC);
        }
    }
    return beat_fd;
}

void mrl_heartbeat(const char *text) {
    int fd = heartbeat_fd();
    if (fd < 0) return;
    char line[256];
    int n = snprintf(line, sizeof line - 1, "%s", text ? text : "");
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    for (int i = 0; i < n; i++)
        if (line[i] == '\n') line[i] = ' ';
    line[n++] = '\n';
    /* one write of < PIPE_BUF bytes is atomic: a line is whole or absent */
    ssize_t k = write(fd, line, (size_t)n);
    (void)k;
}

/* ----------------------------------------------------------- supervisor */

enum { RECENT = 64, LINE = 256 };

struct mrl_child {
    pid_t pid;
    int fd;            /* read end of the heartbeat pipe; -1 once closed */
    int exited, status;
    double start, last_beat;
    long beats;
    char partial[LINE];
    size_t partial_len;
    char recent[RECENT][LINE];
    int recent_next;   /* ring buffer position */
    char *text;        /* mrl_child_recent's result */
};

mrl_status mrl_child_spawn(const char *const *argv, const char *const *env_extra, mrl_child **out) {
    *out = NULL;
    if (!argv || !argv[0]) return mrl_set_error(MRL_ERR_INVALID, "child: empty command");
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return mrl_set_error(MRL_ERR_IO, "child: pipe: %s", strerror(errno));
    /* keep both ends above 3, so that the dup2 onto fd 3 below is a real copy */
    for (int i = 0; i < 2; i++) {
        if (fds[i] > 3) continue;
        int moved = fcntl(fds[i], F_DUPFD_CLOEXEC, 10);
        close(fds[i]);
        fds[i] = moved;
    }
    if (fds[0] < 0 || fds[1] < 0) {
        if (fds[0] >= 0) close(fds[0]);
        if (fds[1] >= 0) close(fds[1]);
        return mrl_set_error(MRL_ERR_IO, "child: cannot move the pipe: %s", strerror(errno));
    }
    mrl_child *c = calloc(1, sizeof *c);
    size_t n_env = 0, n_extra = 0;
    while (environ[n_env]) n_env++;
    while (env_extra && env_extra[n_extra]) n_extra++;
    char **env = calloc(n_env + n_extra + 2, sizeof *env);
    char fd_var[64];
    if (!c || !env) {
        free(c);
        free(env);
        close(fds[0]);
        close(fds[1]);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    }
    size_t k = 0;
    for (size_t i = 0; i < n_env; i++)
        if (strncmp(environ[i], "MOONRL_HEARTBEAT_FD=", 20) != 0) env[k++] = environ[i];
    for (size_t i = 0; i < n_extra; i++) env[k++] = (char *)env_extra[i];
    /* the child sees the write end as fd 3 (dup2 in the file actions) */
    snprintf(fd_var, sizeof fd_var, "MOONRL_HEARTBEAT_FD=3");
    env[k++] = fd_var;
    env[k] = NULL;

    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 3); /* dup2 clears FD_CLOEXEC on the copy */
    posix_spawnattr_init(&attr);
    posix_spawnattr_setpgroup(&attr, 0);
    sigset_t none;
    sigemptyset(&none);
    posix_spawnattr_setsigmask(&attr, &none);
    /* default dispositions for everything the supervisor may have changed */
    sigset_t dflt;
    sigemptyset(&dflt);
    sigaddset(&dflt, SIGINT);
    sigaddset(&dflt, SIGTERM);
    sigaddset(&dflt, SIGPIPE);
    sigaddset(&dflt, SIGUSR1);
    posix_spawnattr_setsigdefault(&attr, &dflt);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    int rc = posix_spawn(&c->pid, argv[0], &fa, &attr, (char *const *)argv, env);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    free(env);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        free(c);
        return mrl_set_error(MRL_ERR_IO, "cannot start %s: %s", argv[0], strerror(rc));
    }
    c->fd = fds[0];
    c->start = c->last_beat = mrl_time_now();
    *out = c;
    return MRL_OK;
}

static void take_line(mrl_child *c, const char *line, size_t len) {
    if (len >= LINE) len = LINE - 1;
    memcpy(c->recent[c->recent_next], line, len);
    c->recent[c->recent_next][len] = 0;
    c->recent_next = (c->recent_next + 1) % RECENT;
    c->beats++;
    c->last_beat = mrl_time_now();
}

static void read_beats(mrl_child *c) {
    char buf[4096];
    for (;;) {
        ssize_t k = read(c->fd, buf, sizeof buf);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
                close(c->fd); /* the child (and all its copies of the pipe) closed it */
                c->fd = -1;
            }
            return;
        }
        for (ssize_t i = 0; i < k; i++) {
            if (buf[i] == '\n') {
                take_line(c, c->partial, c->partial_len);
                c->partial_len = 0;
            } else if (c->partial_len < LINE - 1) {
                c->partial[c->partial_len++] = buf[i];
            }
        }
        if (k < (ssize_t)sizeof buf) return;
    }
}

static int reap(mrl_child *c) {
    if (c->exited) return 1;
    int st;
    pid_t r = waitpid(c->pid, &st, WNOHANG);
    if (r == c->pid) {
        c->exited = 1;
        c->status = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? -WTERMSIG(st) : -1;
    }
    return c->exited;
}

int mrl_child_poll(mrl_child *c, double timeout_s) {
    double end = mrl_time_now() + (timeout_s > 0 ? timeout_s : 0);
    for (;;) {
        if (c->fd >= 0) {
            fcntl(c->fd, F_SETFL, fcntl(c->fd, F_GETFL) | O_NONBLOCK);
            read_beats(c);
        }
        if (reap(c)) {
            if (c->fd >= 0) read_beats(c); /* the last lines it wrote */
            return 1;
        }
        double left = end - mrl_time_now();
        if (left <= 0) return 0;
        /* wake for a beat, else at least every 50 ms to notice the exit */
        int ms = left > 0.05 ? 50 : (int)(left * 1000) + 1;
        if (c->fd >= 0) {
            struct pollfd p = {c->fd, POLLIN, 0};
            poll(&p, 1, ms);
        } else {
            struct timespec ts = {0, (long)ms * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
}

double mrl_child_idle_seconds(const mrl_child *c) { return mrl_time_now() - c->last_beat; }
long mrl_child_beats(const mrl_child *c) { return c->beats; }
int mrl_child_pid(const mrl_child *c) { return (int)c->pid; }
int mrl_child_status(const mrl_child *c) { return c->status; }

const char *mrl_child_recent(mrl_child *c, int count) {
    if (count > RECENT) count = RECENT;
    if (count > c->beats) count = (int)c->beats;
    if (count < 0) count = 0;
    free(c->text);
    c->text = malloc((size_t)count * LINE + 1);
    if (!c->text) return "";
    size_t used = 0;
    for (int i = count; i > 0; i--) {
        const char *line = c->recent[(c->recent_next - i + RECENT) % RECENT];
        size_t n = strlen(line);
        memcpy(c->text + used, line, n);
        used += n;
        c->text[used++] = '\n';
    }
    c->text[used] = 0;
    return c->text;
}

mrl_status mrl_child_signal(mrl_child *c, int signum) {
    if (c->exited) return MRL_OK;
    if (kill(-c->pid, signum) != 0 && kill(c->pid, signum) != 0 && errno != ESRCH)
        return mrl_set_error(MRL_ERR_IO, "cannot signal process %d: %s", (int)c->pid, strerror(errno));
    return MRL_OK;
}

void mrl_child_free(mrl_child *c) {
    if (!c) return;
    if (!reap(c)) {
        kill(-c->pid, SIGKILL);
        int st;
        while (waitpid(c->pid, &st, 0) < 0 && errno == EINTR) {}
    }
    if (c->fd >= 0) close(c->fd);
    free(c->text);
    free(c);
}
