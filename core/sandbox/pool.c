/* The warm pool (moonrl/sandbox.h): one sandbox whose program is the zygote (zygote.py, embedded
 * in the library), a Python interpreter with its capabilities in the sandbox's user namespace,
 * and a stream socket to it. A run: its cgroup made here, its pipes, and a request (the program,
 * its environment, files and limits) sent with those descriptors attached; the zygote forks the
 * run, which moves itself into the cgroup, takes its own PID, mount and IPC namespaces and
 * reports its end as a sandbox's first process does (sb_report). This side then watches it as a
 * cold run (sb_watch), its processes being its cgroup's. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "base/error.h"
#include "sandbox_internal.h"

extern const char mrl_sandbox_zygote_py[];
extern const size_t mrl_sandbox_zygote_py_size;

struct mrl_sandbox_pool {
    pthread_mutex_t lock;
    int ctl;         /* our end of the zygote's socket (-1: no zygote) */
    long pid;        /* the pool's sandbox's first process */
    sb_streams s;    /* the zygote's streams */
    sb_cgroup cg;    /* the zygote's own */
    int network;
    char **ro_paths; /* (a copy, NULL-terminated) */
};

static void stop_zygote(mrl_sandbox_pool *p) {
    if (p->ctl >= 0) close(p->ctl);
    p->ctl = -1;
    if (p->pid > 0) {
        kill((pid_t)p->pid, SIGKILL);
        while (waitpid((pid_t)p->pid, NULL, 0) < 0 && errno == EINTR) {}
    }
    p->pid = 0;
    sb_streams_close(&p->s);
    sb_cgroup_finish(&p->cg, NULL, NULL, NULL);
}

/* the zygote started in its sandbox, and ready ("ready" on its stdout) */
static mrl_status start_zygote(mrl_sandbox_pool *p) {
    struct sock_fprog filter = {0};
    if (sb_seccomp_filter(&filter)) return mrl_set_error(MRL_ERR_NOMEM, "sandbox pool: the seccomp filter");
    mrl_sandbox_file files[2] = {
        {"zygote.py", mrl_sandbox_zygote_py, (int64_t)mrl_sandbox_zygote_py_size, 0, 1},
        {"seccomp.bpf", filter.filter, (int64_t)(sizeof(struct sock_filter) * filter.len), 0, 1}};
    const char *argv[] = {"python3", "/box/zygote.py", NULL};
    mrl_sandbox_spec spec = {.argv = argv, .files = files, .n_files = 2, .network = p->network,
                             .ro_paths = (const char *const *)p->ro_paths,
                             .limits = {.memory_bytes = 1ll << 30, .procs = 4096}};
    mrl_sandbox_limits lim;
    builder b = {0};
    sb_plan plan;
    int sv[2] = {-1, -1};
    mrl_status st = sb_check_spec(&spec, &lim);
    if (!st && !sb_cgroup_create(&p->cg, lim.memory_bytes, lim.procs))
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "sandbox pool: needs cgroups (its runs' limits and ends are theirs; "
                           "moonrl doctor says what this machine has)");
    if (!st && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv))
        st = mrl_set_error(MRL_ERR_IO, "sandbox pool: socketpair: %s", strerror(errno));
    if (!st) st = sb_build_plan(&spec, &lim, 1, &b, &plan);
    if (!st) {
        plan.privileged = 1, plan.keep_fd = sv[1], plan.parent_fds[5] = sv[0];
        st = sb_spawn(&plan, &p->cg, &p->pid, &p->s);
    }
    free(plan.filter.filter);
    sb_free_builder(&b);
    free(filter.filter);
    if (sv[1] >= 0) close(sv[1]);
    p->ctl = sv[0];
    if (st) {
        stop_zygote(p);
        return st;
    }
    close(p->s.in), p->s.in = -1;
    /* its "ready": the interpreter up, its modules imported */
    char line[256] = "";
    size_t got = 0;
    double deadline = sb_now() + 30;
    while (got < 6 && sb_now() < deadline) {
        struct pollfd f = {p->s.out, POLLIN, 0};
        if (poll(&f, 1, 100) <= 0) continue;
        ssize_t n = read(p->s.out, line + got, sizeof line - 1 - got);
        if (n <= 0) break;
        got += (size_t)n;
    }
    line[got] = 0;
    if (strncmp(line, "ready\n", 6) != 0) {
        char err[512] = "";
        fcntl(p->s.err, F_SETFL, O_NONBLOCK);
        ssize_t n = read(p->s.err, err, sizeof err - 1);
        err[n > 0 ? n : 0] = 0;
        stop_zygote(p);
        return mrl_set_error(MRL_ERR_IO, "sandbox pool: the Python zygote did not start%s%s", err[0] ? ": " : "", err);
    }
    return MRL_OK;
}

mrl_status mrl_sandbox_pool_open(const char *language, int network, const char *const *ro_paths,
                                 mrl_sandbox_pool **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "mrl_sandbox_pool_open: NULL argument");
    *out = NULL;
    if (!language || strcmp(language, "python") != 0)
        return mrl_set_error(MRL_ERR_INVALID, "sandbox pool: language '%s' (python)", language ? language : "(null)");
    if (network != MRL_SANDBOX_NET_NONE && network != MRL_SANDBOX_NET_LOOPBACK)
        return mrl_set_error(MRL_ERR_INVALID, "sandbox pool: network %d (none 0, loopback 1)", network);
    mrl_sandbox_pool *p = calloc(1, sizeof *p);
    int n = 0;
    while (ro_paths && ro_paths[n]) n++;
    if (p) p->ro_paths = calloc((size_t)n + 1, sizeof *p->ro_paths);
    for (int i = 0; p && p->ro_paths && i < n; i++) p->ro_paths[i] = strdup(ro_paths[i]);
    if (!p || !p->ro_paths) {
        if (p) free(p->ro_paths);
        free(p);
        return mrl_set_error(MRL_ERR_NOMEM, "sandbox pool");
    }
    pthread_mutex_init(&p->lock, NULL);
    p->ctl = -1, p->network = network;
    p->s = (sb_streams){-1, -1, -1, -1};
    mrl_status st = start_zygote(p);
    if (st) {
        mrl_sandbox_pool_close(p);
        return st;
    }
    *out = p;
    return MRL_OK;
}

void mrl_sandbox_pool_close(mrl_sandbox_pool *p) {
    if (!p) return;
    stop_zygote(p);
    for (int i = 0; p->ro_paths && p->ro_paths[i]; i++) free(p->ro_paths[i]);
    free(p->ro_paths);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

/* ---- a run's request ---- */

typedef struct buf {
    char *data;
    size_t len, cap;
    int failed;
} buf;

static void put(buf *b, const void *data, size_t n) {
    if (b->failed) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) {
            b->failed = 1;
            return;
        }
        b->data = d, b->cap = cap;
    }
    memcpy(b->data + b->len, data, n);
    b->len += n;
}

static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_blob(buf *b, const void *data, uint64_t n) {
    put(b, &n, 8);
    put(b, data, (size_t)n);
}
static void put_str(buf *b, const char *s) { put_blob(b, s, strlen(s)); }

/* the body zygote.py's parse() reads: argv, environment, files, then the limits it applies */
static int request(buf *b, const mrl_sandbox_spec *s, const mrl_sandbox_limits *lim) {
    static const char *const base_env[] = {"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp", "TMPDIR=/tmp", "LANG=C.UTF-8"};
    uint32_t n = 0, e = 0;
    put(b, "MRLZ\0\0\0\0", 8); /* (its length, below) */
    while (s->argv[n]) n++;
    put_u32(b, n);
    for (uint32_t i = 0; i < n; i++) put_str(b, s->argv[i]);
    while (s->env && s->env[e]) e++;
    put_u32(b, e + 4);
    for (int i = 0; i < 4; i++) put_str(b, base_env[i]);
    for (uint32_t i = 0; i < e; i++) put_str(b, s->env[i]);
    put_u32(b, (uint32_t)s->n_files);
    for (int i = 0; i < s->n_files; i++) {
        const mrl_sandbox_file *f = &s->files[i];
        put_str(b, f->name);
        put_blob(b, f->data, (uint64_t)f->size);
        put_u32(b, (f->executable ? 1u : 0u) | (f->read_only ? 2u : 0u));
    }
    int64_t as_bytes = 0, fsize = lim->file_bytes, tmpfs = lim->tmpfs_bytes;
    int32_t nproc = 0, nofile = lim->files;
    put(b, &lim->cpu_s, 8), put(b, &as_bytes, 8), put(b, &nproc, 4), put(b, &nofile, 4);
    put(b, &fsize, 8), put(b, &tmpfs, 8);
    if (b->failed || b->len - 8 > UINT32_MAX) return -1;
    uint32_t len = (uint32_t)(b->len - 8);
    memcpy(b->data + 4, &len, 4);
    return 0;
}

/* the request and its descriptors to the zygote (under the pool's lock: one at a time) */
static int send_request(int ctl, const buf *b, const int *fds, int n_fds) {
    char cbuf[CMSG_SPACE(sizeof(int) * 8)];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {b->data, 8};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                         .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n_fds)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n_fds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)n_fds);
    ssize_t k;
    while ((k = sendmsg(ctl, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR) {}
    if (k != 8) return -1;
    for (size_t at = 8; at < b->len;) {
        k = send(ctl, b->data + at, b->len - at, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        at += (size_t)k;
    }
    return 0;
}

static int is_python(const char *a) {
    const char *base = strrchr(a, '/');
    base = base ? base + 1 : a;
    return strcmp(base, "python3") == 0 || strcmp(base, "python") == 0;
}

/* A run started on the pool: its cgroup (cg), the parent's ends of its pipes (s). */
mrl_status sb_pool_start(mrl_sandbox_pool *pool, const mrl_sandbox_spec *spec, const mrl_sandbox_limits *lim,
                         sb_cgroup *cg, sb_streams *s) {
    const char *const *a = spec->argv;
    if (!a || !a[0] || !is_python(a[0]) || !a[1] || (strcmp(a[1], "-c") == 0 && !a[2]))
        return mrl_set_error(MRL_ERR_INVALID, "sandbox pool: a run is `python3 FILE ARGS` or `python3 -c CODE ARGS` "
                             "(argv[0] '%s')", a && a[0] ? a[0] : "(none)");
    if (spec->network != pool->network)
        return mrl_set_error(MRL_ERR_INVALID, "sandbox pool: the run asks network %d, the pool has %d", spec->network,
                             pool->network);
    if (spec->ro_paths && spec->ro_paths[0])
        return mrl_set_error(MRL_ERR_INVALID, "sandbox pool: a run's ro_paths are its pool's (given when it opens)");
    if (!sb_cgroup_create(cg, lim->memory_bytes, lim->procs))
        return mrl_set_error(MRL_ERR_IO, "sandbox pool: the run's cgroup: %s", strerror(errno));
    int fds[7], n_cg = sb_cgroup_procs_fds(cg, fds + 4);
    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1}, rep[2] = {-1, -1};
    buf b = {0};
    mrl_status st = MRL_OK;
    if (n_cg < 0 || pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(rep, O_CLOEXEC) ||
        request(&b, spec, lim)) {
        st = mrl_set_error(MRL_ERR_IO, "sandbox pool: the run's pipes, cgroup files or request: %s", strerror(errno));
    } else {
        fchmod(in[0], 0666), fchmod(out[1], 0666), fchmod(err[1], 0666); /* (as a cold run's: sandbox.c) */
        fds[0] = in[0], fds[1] = out[1], fds[2] = err[1], fds[3] = rep[1];
        pthread_mutex_lock(&pool->lock);
        int sent = pool->ctl >= 0 && send_request(pool->ctl, &b, fds, 4 + n_cg) == 0;
        if (!sent) { /* the zygote is gone: started again, once */
            stop_zygote(pool);
            st = start_zygote(pool);
            sent = !st && send_request(pool->ctl, &b, fds, 4 + n_cg) == 0;
            if (!st && !sent) st = mrl_set_error(MRL_ERR_IO, "sandbox pool: the zygote takes no run: %s", strerror(errno));
        }
        pthread_mutex_unlock(&pool->lock);
    }
    free(b.data);
    for (int i = 0; i < n_cg; i++) close(fds[4 + i]);
    int child_ends[4] = {in[0], out[1], err[1], rep[1]};
    for (int i = 0; i < 4; i++)
        if (child_ends[i] >= 0) close(child_ends[i]);
    *s = (sb_streams){in[1], out[0], err[0], rep[0]};
    if (st) {
        sb_streams_close(s);
        sb_cgroup_finish(cg, NULL, NULL, NULL);
    }
    return st;
}

/* The end of a pool's run watched (sb_watch), its cgroup emptied and removed, and what the zygote
 * said of a run that failed. */
mrl_status sb_pool_watch(mrl_sandbox_pool *pool, const mrl_sandbox_spec *spec, const mrl_sandbox_limits *lim,
                         sb_cgroup *cg, sb_streams *s, double t0, int killed, mrl_sandbox_result *r) {
    mrl_status st = sb_watch(spec, lim, 0, s, cg, NULL, t0, killed, r);
    sb_cgroup_kill(cg);                    /* (a run that failed before its end: what it started) */
    sb_cgroup_finish(cg, NULL, NULL, NULL); /* (the same: its numbers were read where it ended) */
    if (st == MRL_ERR_IO) { /* what the zygote said about it, if anything */
        char said[2048] = "";
        pthread_mutex_lock(&pool->lock);
        if (pool->s.err >= 0) {
            fcntl(pool->s.err, F_SETFL, O_NONBLOCK);
            ssize_t n = read(pool->s.err, said, sizeof said - 1);
            said[n > 0 ? n : 0] = 0;
        }
        pthread_mutex_unlock(&pool->lock);
        if (said[0]) {
            char first[1024];
            snprintf(first, sizeof first, "%s", mrl_last_error());
            st = mrl_set_error(st, "%s; the zygote: %s", first, said);
        }
    }
    return st;
}

mrl_status sb_pool_run(mrl_sandbox_pool *pool, const mrl_sandbox_spec *spec, mrl_sandbox_result *r) {
    mrl_sandbox_limits lim = {0};
    mrl_status st = sb_check_spec(spec, &lim);
    sb_cgroup cg;
    sb_streams s;
    if (!st) st = sb_pool_start(pool, spec, &lim, &cg, &s);
    return st ? st : sb_pool_watch(pool, spec, &lim, &cg, &s, sb_now(), 0, r);
}
