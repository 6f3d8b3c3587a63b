/* A sandbox session (moonrl/sandbox.h): a run started as a cold one (sb_spawn) or on a pool
 * (sb_pool_start), whose streams the caller drives: each send or receive is one poll loop over
 * its standard input, output and error that also keeps its wall and CPU limits and its output cap
 * (a run that passes one is killed, and says which at its close). The close is a run's end
 * (sb_watch), with what the session had read and not handed out put back in front. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "base/error.h"
#include "sandbox_internal.h"

struct mrl_sandbox_session {
    mrl_sandbox_pool *pool;
    long pid; /* a cold run's first process (0 on a pool: its cgroup's processes) */
    sb_cgroup cg;
    int have_cg;
    sb_streams s;
    mrl_sandbox_limits lim;
    double t0;
    builder b; /* (a cold run's plan, for its failure messages) */
    sb_plan plan;
    char *argv[3]; /* (its program, for the same) */
    char *pending; /* standard output read and not yet handed out */
    int64_t pending_len, pending_cap;
    char *err;
    int64_t err_len, err_cap;
    int err_truncated, out_eof, limit;
};

static int grow(char **buf, int64_t *cap, int64_t need) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 4096;
    while (c < need) c *= 2;
    char *b = realloc(*buf, (size_t)c);
    if (!b) return -1;
    *buf = b, *cap = c;
    return 0;
}

static void kill_it(mrl_sandbox_session *s, int limit) {
    if (s->pid > 0) kill((pid_t)s->pid, SIGKILL);
    else sb_cgroup_kill(&s->cg);
    if (!s->limit) s->limit = limit;
}

/* One round of the session's streams: wait at most wait_s for any of them (stdin too when data is
 * given: written as far as it takes), keep the limits. Returns the bytes of data written. */
static int64_t pump(mrl_sandbox_session *s, const char *data, int64_t n, double wait_s) {
    double left = s->t0 + s->lim.wall_s - sb_now();
    if (!s->limit && left <= 0) kill_it(s, MRL_SANDBOX_LIMIT_WALL);
    if (wait_s > left && left > 0) wait_s = left;
    int64_t cpu = sb_cgroup_cpu_ns(&s->cg);
    if (cpu >= 0 && wait_s > 0.02) wait_s = 0.02; /* (the CPU time, read often) */
    struct pollfd fds[3] = {{s->out_eof ? -1 : s->s.out, POLLIN, 0}, {s->s.err, POLLIN, 0},
                            {n > 0 ? s->s.in : -1, POLLOUT, 0}};
    int64_t wrote = 0;
    if (poll(fds, 3, wait_s > 0 ? (int)ceil(wait_s * 1000) : 0) > 0) {
        char chunk[65536];
        if (fds[0].revents) {
            ssize_t k = read(s->s.out, chunk, sizeof chunk);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) s->out_eof = 1;
            else if (k > 0) {
                if (s->pending_len + k > s->lim.output_bytes) kill_it(s, MRL_SANDBOX_LIMIT_OUTPUT);
                else if (grow(&s->pending, &s->pending_cap, s->pending_len + k + 1) == 0) {
                    memcpy(s->pending + s->pending_len, chunk, (size_t)k);
                    s->pending_len += k;
                }
            }
        }
        if (fds[1].revents) {
            ssize_t k = read(s->s.err, chunk, sizeof chunk);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) {
                close(s->s.err);
                s->s.err = -1;
            } else if (k > 0) {
                int64_t keep = k;
                if (s->err_len + keep > s->lim.output_bytes) keep = s->lim.output_bytes - s->err_len, s->err_truncated = 1;
                if (keep > 0 && grow(&s->err, &s->err_cap, s->err_len + keep + 1) == 0) {
                    memcpy(s->err + s->err_len, chunk, (size_t)keep);
                    s->err_len += keep;
                }
            }
        }
        if (fds[2].revents & (POLLERR | POLLHUP)) wrote = -1;
        else if (fds[2].revents) {
            ssize_t k = write(s->s.in, data, (size_t)n);
            wrote = k > 0 ? k : (errno == EAGAIN || errno == EINTR ? 0 : -1);
        }
    }
    if (!s->limit && cpu >= (int64_t)(s->lim.cpu_s * 1e9)) kill_it(s, MRL_SANDBOX_LIMIT_CPU);
    return wrote;
}

mrl_status mrl_sandbox_session_start(const mrl_sandbox_spec *spec, mrl_sandbox_session **out) {
    if (!spec || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_sandbox_session_start: NULL argument");
    *out = NULL;
    mrl_sandbox_session *s = calloc(1, sizeof *s);
    if (!s) return mrl_set_error(MRL_ERR_NOMEM, "sandbox session");
    s->s = (sb_streams){-1, -1, -1, -1};
    mrl_status st = sb_check_spec(spec, &s->lim);
    for (int i = 0; i < 2 && !st && spec->argv[i]; i++)
        if (!(s->argv[i] = strdup(spec->argv[i]))) st = mrl_set_error(MRL_ERR_NOMEM, "sandbox session");
    s->t0 = sb_now();
    if (!st && spec->pool) {
        s->pool = spec->pool;
        st = sb_pool_start(spec->pool, spec, &s->lim, &s->cg, &s->s);
        s->have_cg = !st;
    } else if (!st) {
        s->have_cg = sb_cgroup_create(&s->cg, s->lim.memory_bytes, s->lim.procs);
        st = sb_build_plan(spec, &s->lim, s->have_cg, &s->b, &s->plan);
        if (!st) st = sb_spawn(&s->plan, &s->cg, &s->pid, &s->s);
        free(s->plan.filter.filter);
        s->plan.filter.filter = NULL;
    }
    if (st) {
        if (s->have_cg) sb_cgroup_finish(&s->cg, NULL, NULL, NULL);
        sb_free_builder(&s->b);
        free(s->argv[0]), free(s->argv[1]), free(s);
        return st;
    }
    int fds[3] = {s->s.in, s->s.out, s->s.err};
    for (int i = 0; i < 3; i++) fcntl(fds[i], F_SETFL, O_NONBLOCK);
    *out = s;
    return MRL_OK;
}

mrl_status mrl_sandbox_session_send(mrl_sandbox_session *s, const void *data, int64_t n, double timeout_s) {
    if (!s || (n > 0 && !data)) return mrl_set_error(MRL_ERR_INVALID, "mrl_sandbox_session_send: NULL argument");
    if (s->s.in < 0) return mrl_set_error(MRL_ERR_INVALID, "sandbox session: its standard input is closed");
    double deadline = sb_now() + timeout_s;
    for (int64_t at = 0; at < n;) {
        if (s->limit) return mrl_set_error(MRL_ERR_IO, "sandbox session: the run was killed (limit %s)",
                                           mrl_sandbox_limit_name(s->limit));
        double left = deadline - sb_now();
        if (left <= 0) return mrl_set_error(MRL_ERR_TIMEOUT, "sandbox session: %lld of %lld bytes sent in %g s",
                                            (long long)at, (long long)n, timeout_s);
        int64_t k = pump(s, (const char *)data + at, n - at, left);
        if (k < 0) return mrl_set_error(MRL_ERR_IO, "sandbox session: the program closed its standard input");
        at += k;
    }
    return MRL_OK;
}

/* the first `delim` in the pending output: its end's offset, or -1 */
static int64_t find(const mrl_sandbox_session *s, const char *delim) {
    if (!delim || !delim[0]) return s->pending_len > 0 ? s->pending_len : -1;
    size_t d = strlen(delim);
    for (int64_t i = 0; i + (int64_t)d <= s->pending_len; i++)
        if (memcmp(s->pending + i, delim, d) == 0) return i + (int64_t)d;
    return -1;
}

mrl_status mrl_sandbox_session_recv(mrl_sandbox_session *s, const char *delim, double timeout_s, char **out,
                                    int64_t *len, int *ended) {
    if (!s || !out || !len) return mrl_set_error(MRL_ERR_INVALID, "mrl_sandbox_session_recv: NULL argument");
    *out = NULL, *len = 0;
    double deadline = sb_now() + timeout_s;
    int64_t end;
    while ((end = find(s, delim)) < 0 && !s->out_eof) {
        double left = deadline - sb_now();
        if (left <= 0) break;
        pump(s, NULL, 0, left);
    }
    int done = s->out_eof && end < 0;
    if (done) end = s->pending_len; /* (its end: all there is) */
    if (ended) *ended = s->out_eof;
    if (end < 0) return mrl_set_error(MRL_ERR_TIMEOUT, "sandbox session: no %s within %g s%s",
                                      delim ? "delimiter" : "output", timeout_s, s->limit ? " (the run was killed)" : "");
    char *o = malloc((size_t)end + 1);
    if (!o) return mrl_set_error(MRL_ERR_NOMEM, "sandbox session");
    memcpy(o, s->pending, (size_t)end);
    o[end] = 0;
    memmove(s->pending, s->pending + end, (size_t)(s->pending_len - end));
    s->pending_len -= end;
    *out = o, *len = end;
    return MRL_OK;
}

/* a + b as one malloc'd, NUL-terminated string into *dst (b: the run's own, freed) */
static int prepend(char **dst, int64_t *dst_len, const char *a, int64_t a_len) {
    if (a_len <= 0) return 0;
    char *c = malloc((size_t)(a_len + *dst_len + 1));
    if (!c) return -1;
    memcpy(c, a, (size_t)a_len);
    if (*dst) memcpy(c + a_len, *dst, (size_t)*dst_len);
    c[a_len + *dst_len] = 0;
    free(*dst);
    *dst = c, *dst_len += a_len;
    return 0;
}

mrl_status mrl_sandbox_session_close(mrl_sandbox_session *s, int kill_now, mrl_sandbox_result *result) {
    if (!s) return MRL_OK;
    if (kill_now) kill_it(s, 0);
    mrl_sandbox_result r = {0};
    const char *argv[3] = {s->argv[0], s->argv[1], NULL};
    mrl_sandbox_spec spec = {.argv = argv};
    int killed = kill_now || s->limit != 0;
    mrl_status st = s->pool ? sb_pool_watch(s->pool, &spec, &s->lim, &s->cg, &s->s, s->t0, killed, &r)
                            : sb_watch(&spec, &s->lim, s->pid, &s->s, &s->cg, &s->plan, s->t0, killed, &r);
    if (!s->pool && s->have_cg) sb_cgroup_finish(&s->cg, NULL, NULL, NULL);
    if (!st && (prepend(&r.out, &r.out_len, s->pending, s->pending_len) ||
                prepend(&r.err, &r.err_len, s->err, s->err_len)))
        st = mrl_set_error(MRL_ERR_NOMEM, "sandbox session: its output");
    if (!st) {
        r.err_truncated |= s->err_truncated;
        if (s->limit) r.limit = s->limit, r.out_truncated |= s->limit == MRL_SANDBOX_LIMIT_OUTPUT;
    }
    if (result && !st) *result = r;
    else mrl_sandbox_result_free(&r);
    sb_free_builder(&s->b);
    free(s->pending), free(s->err), free(s->argv[0]), free(s->argv[1]), free(s);
    return st;
}
