/* The sandbox's parent side (moonrl/sandbox.h): the plan for the child (child.c), the clone
 * into new namespaces, the user map and the cgroup, then the run's streams, deadline and CPU
 * time on one poll loop in the calling thread, and its result. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "base/error.h"
#include "sandbox_internal.h"

/* the host's runtime, bound read-only where it exists (symbolic links kept as links) */
static const char *const runtime_paths[] = {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                                            "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf",
                                            "/etc/ld.so.conf.d", "/etc/localtime", NULL};
static const char *const dev_files[] = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", NULL};
static const char passwd[] = "root:x:0:0:sandbox:/tmp:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";
static const char group[] = "root:x:0:\nnogroup:x:65534:\n";
static const char hosts[] = "127.0.0.1 localhost\n::1 localhost\n";
static const char *const search_path[] = {"/usr/local/bin", "/usr/bin", "/bin", NULL};

const char *mrl_sandbox_limit_name(int limit) {
    static const char *const names[] = {"none", "wall", "cpu", "memory", "procs", "output", "file", "disk"};
    return limit >= 0 && limit <= MRL_SANDBOX_LIMIT_DISK ? names[limit] : "?";
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double sb_now(void) { return now_s(); }

/* ---- the plan ---- */


static char *own(builder *b, char *s) {
    if (!s) return b->failed = 1, NULL;
    if (b->n_owned == b->cap_owned) {
        int cap = b->cap_owned ? 2 * b->cap_owned : 64;
        char **o = realloc(b->owned, sizeof *o * (size_t)cap);
        if (!o) return free(s), b->failed = 1, NULL;
        b->owned = o, b->cap_owned = cap;
    }
    return b->owned[b->n_owned++] = s;
}

static char *fmt(builder *b, const char *f, const char *a) {
    char *s = NULL;
    if (asprintf(&s, f, a) < 0) s = NULL;
    return own(b, s);
}

static void add(builder *b, sb_op op) {
    if (b->failed) return;
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 64;
        sb_op *o = realloc(b->ops, sizeof *o * (size_t)cap);
        if (!o) {
            b->failed = 1;
            return;
        }
        b->ops = o, b->cap = cap;
    }
    b->ops[b->n++] = op;
}

/* mkdir of each directory above path (under /newroot), once */
static void parents(builder *b, const char *path) {
    for (const char *s = strchr(path + 1, '/'); s && !b->failed; s = strchr(s + 1, '/')) {
        char *dir = own(b, strndup(path, (size_t)(s - path)));
        if (!dir) return;
        char *at = fmt(b, "/newroot%s", dir);
        int made = 0;
        for (int i = 0; i < b->n && at; i++) made |= b->ops[i].kind == SB_MKDIR && strcmp(b->ops[i].path, at) == 0;
        if (at && !made) add(b, (sb_op){.kind = SB_MKDIR, .path = at, .mode = 0755});
    }
}

/* the flags a remount of a bind of path keeps (its mount's locked ones) */
static unsigned long locked_flags(const char *path, int device) {
    struct statvfs v;
    unsigned long f = MS_NOSUID | (device ? 0 : MS_NODEV);
    if (statvfs(path, &v) == 0) {
        if (v.f_flag & ST_NODEV) f |= MS_NODEV;
        if (v.f_flag & ST_NOEXEC) f |= MS_NOEXEC;
        if (v.f_flag & ST_NOATIME) f |= MS_NOATIME;
        if (v.f_flag & ST_NODIRATIME) f |= MS_NODIRATIME;
        if (v.f_flag & ST_RELATIME) f |= MS_RELATIME;
    }
    return f;
}

/* host path bound read-only at the same place; 0, or -1 where it does not exist */
static int bind_path(builder *b, const char *path, int device) {
    struct stat st;
    if (lstat(path, &st)) return -1;
    parents(b, path);
    char *at = fmt(b, "/newroot%s", path);
    if (S_ISLNK(st.st_mode)) {
        char target[4096];
        ssize_t n = readlink(path, target, sizeof target - 1);
        if (n < 0) return -1;
        target[n] = 0;
        add(b, (sb_op){.kind = SB_SYMLINK, .path = at, .source = fmt(b, "%s", target)});
        return 0;
    }
    add(b, (sb_op){.kind = S_ISDIR(st.st_mode) ? SB_MKDIR : SB_TOUCH, .path = at, .mode = 0755});
    add(b, (sb_op){.kind = SB_BIND, .path = at, .source = fmt(b, "/oldroot%s", path),
                   .flags = locked_flags(path, device)});
    return 0;
}

static int under(const char *path, const char *dir) {
    size_t n = strlen(dir);
    return strncmp(path, dir, n) == 0 && (path[n] == '/' || path[n] == 0);
}

mrl_status sb_check_spec(const mrl_sandbox_spec *s, mrl_sandbox_limits *lim) {
    if (!s->argv || !s->argv[0] || !s->argv[0][0])
        return mrl_set_error(MRL_ERR_INVALID, "sandbox: argv is empty (the program to run)");
    const struct { const char *name; double v; } nums[] = {
        {"wall_s", s->limits.wall_s}, {"cpu_s", s->limits.cpu_s}, {"memory_bytes", (double)s->limits.memory_bytes},
        {"procs", s->limits.procs}, {"files", s->limits.files}, {"file_bytes", (double)s->limits.file_bytes},
        {"tmpfs_bytes", (double)s->limits.tmpfs_bytes}, {"output_bytes", (double)s->limits.output_bytes}};
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++)
        if (!(nums[i].v >= 0) || !isfinite(nums[i].v))
            return mrl_set_error(MRL_ERR_INVALID, "sandbox: limits.%s is %g (0 for the default, else > 0)",
                                 nums[i].name, nums[i].v);
    *lim = s->limits;
    if (lim->wall_s == 0) lim->wall_s = 10;
    if (lim->cpu_s == 0) lim->cpu_s = lim->wall_s;
    if (lim->memory_bytes == 0) lim->memory_bytes = 512ll << 20;
    if (lim->procs == 0) lim->procs = 64;
    if (lim->files == 0) lim->files = 256;
    if (lim->file_bytes == 0) lim->file_bytes = 64ll << 20;
    if (lim->tmpfs_bytes == 0) lim->tmpfs_bytes = 64ll << 20;
    if (lim->output_bytes == 0) lim->output_bytes = 1ll << 20;
    if (lim->memory_bytes < (4ll << 20))
        return mrl_set_error(MRL_ERR_INVALID, "sandbox: limits.memory_bytes %lld is under 4 MiB",
                             (long long)lim->memory_bytes);
    if (s->network != MRL_SANDBOX_NET_NONE && s->network != MRL_SANDBOX_NET_LOOPBACK)
        return mrl_set_error(MRL_ERR_INVALID, "sandbox: network %d (none 0, loopback 1)", s->network);
    if (s->n_files < 0 || (s->n_files > 0 && !s->files))
        return mrl_set_error(MRL_ERR_INVALID, "sandbox: %d files and no array", s->n_files);
    for (int i = 0; i < s->n_files; i++) {
        const mrl_sandbox_file *f = &s->files[i];
        if (!f->name || !f->name[0] || strchr(f->name, '/') || strcmp(f->name, ".") == 0 ||
            strcmp(f->name, "..") == 0 || strlen(f->name) > 255)
            return mrl_set_error(MRL_ERR_INVALID, "sandbox: files[%d].name '%s' is not one path component", i,
                                 f->name ? f->name : "(null)");
        if (f->size < 0 || (f->size > 0 && !f->data))
            return mrl_set_error(MRL_ERR_INVALID, "sandbox: files[%d] ('%s') has size %lld and no data", i, f->name,
                                 (long long)f->size);
        for (int j = 0; j < i; j++)
            if (strcmp(s->files[j].name, f->name) == 0 && !s->files[j].read_only == !f->read_only)
                return mrl_set_error(MRL_ERR_INVALID, "sandbox: files[%d].name '%s' given twice", i, f->name);
    }
    for (int i = 0; s->env && s->env[i]; i++)
        if (!strchr(s->env[i], '=') || s->env[i][0] == '=')
            return mrl_set_error(MRL_ERR_INVALID, "sandbox: env[%d] '%s' is not KEY=VALUE", i, s->env[i]);
    return MRL_OK;
}

mrl_status sb_build_plan(const mrl_sandbox_spec *s, const mrl_sandbox_limits *lim, int cgroup, builder *b,
                         sb_plan *p) {
    memset(p, 0, sizeof *p);
    p->keep_fd = -1;
    for (int i = 0; runtime_paths[i]; i++) bind_path(b, runtime_paths[i], 0);
    add(b, (sb_op){.kind = SB_MKDIR, .path = "/newroot/etc", .mode = 0755});
    add(b, (sb_op){.kind = SB_WRITE, .path = "/newroot/etc/passwd", .data = passwd, .size = sizeof passwd - 1, .mode = 0644});
    add(b, (sb_op){.kind = SB_WRITE, .path = "/newroot/etc/group", .data = group, .size = sizeof group - 1, .mode = 0644});
    add(b, (sb_op){.kind = SB_WRITE, .path = "/newroot/etc/hosts", .data = hosts, .size = sizeof hosts - 1, .mode = 0644});
    add(b, (sb_op){.kind = SB_MKDIR, .path = "/newroot/dev", .mode = 0755});
    for (int i = 0; dev_files[i]; i++) bind_path(b, dev_files[i], 1);
    static const char *const links[][2] = {{"/proc/self/fd", "/newroot/dev/fd"}, {"/proc/self/fd/0", "/newroot/dev/stdin"},
                                           {"/proc/self/fd/1", "/newroot/dev/stdout"}, {"/proc/self/fd/2", "/newroot/dev/stderr"}};
    for (int i = 0; i < 4; i++) add(b, (sb_op){.kind = SB_SYMLINK, .path = links[i][1], .source = links[i][0]});
    add(b, (sb_op){.kind = SB_MKDIR, .path = "/newroot/dev/shm", .mode = 0755});
    add(b, (sb_op){.kind = SB_MKDIR, .path = "/newroot/proc", .mode = 0755});
    add(b, (sb_op){.kind = SB_MKDIR, .path = "/newroot/tmp", .mode = 0755});
    for (int i = 0; i < s->n_files; i++) p->has_box |= s->files[i].read_only != 0;
    if (p->has_box) add(b, (sb_op){.kind = SB_MKDIR, .path = "/newroot/box", .mode = 0755});
    for (int i = 0; s->ro_paths && s->ro_paths[i]; i++) {
        char *real = own(b, realpath(s->ro_paths[i], NULL));
        if (!real) return mrl_set_error(MRL_ERR_INVALID, "sandbox: ro_paths[%d] '%s': %s", i, s->ro_paths[i], strerror(errno));
        static const char *const hidden[] = {"/tmp", "/box", "/proc", "/dev", "/etc", NULL};
        for (int h = 0; hidden[h]; h++)
            if (under(real, hidden[h]) || strcmp(real, "/") == 0)
                return mrl_set_error(MRL_ERR_INVALID, "sandbox: ro_paths[%d] '%s' is under %s, which the sandbox "
                                     "makes its own", i, real, strcmp(real, "/") == 0 ? "/" : hidden[h]);
        if (bind_path(b, real, 0)) return mrl_set_error(MRL_ERR_INVALID, "sandbox: ro_paths[%d] '%s': %s", i, real, strerror(errno));
    }
    /* the program: argv[0] looked up in the sandbox's PATH (the host's /usr is the sandbox's) */
    const char *exe = s->argv[0];
    if (!strchr(exe, '/')) {
        const char *found = NULL;
        for (int i = 0; search_path[i] && !found; i++) {
            char *c = NULL;
            if (asprintf(&c, "%s/%s", search_path[i], exe) < 0) c = NULL;
            if ((c = own(b, c)) && access(c, X_OK) == 0) found = c;
        }
        if (!found)
            return mrl_set_error(MRL_ERR_INVALID, "sandbox: program '%s' is not in the sandbox's PATH "
                                 "(/usr/local/bin:/usr/bin:/bin)", exe);
        exe = found;
    }
    p->exe = exe;
    int n_args = 0, n_env = 0;
    while (s->argv[n_args]) n_args++;
    while (s->env && s->env[n_env]) n_env++;
    char **argv = calloc((size_t)n_args + 1, sizeof *argv), **envp = calloc((size_t)n_env + 5, sizeof *envp);
    own(b, (char *)argv), own(b, (char *)envp);
    if (b->failed) return mrl_set_error(MRL_ERR_NOMEM, "sandbox: the plan");
    for (int i = 0; i < n_args; i++) argv[i] = (char *)s->argv[i];
    int e = 0;
    envp[e++] = "PATH=/usr/local/bin:/usr/bin:/bin", envp[e++] = "HOME=/tmp", envp[e++] = "TMPDIR=/tmp";
    envp[e++] = "LANG=C.UTF-8";
    for (int i = 0; i < n_env; i++) envp[e++] = (char *)s->env[i];
    p->argv = argv, p->envp = envp;
    snprintf(p->tmp_opts, sizeof p->tmp_opts, "size=%lld,mode=0755", (long long)lim->tmpfs_bytes);
    snprintf(p->shm_opts, sizeof p->shm_opts, "size=%lld,mode=1777", (long long)lim->tmpfs_bytes);
    p->files = s->files, p->n_files = s->n_files;
    p->loopback = s->network == MRL_SANDBOX_NET_LOOPBACK;
    /* rlimits: a process's CPU time (the tree's is the cgroup's, sandbox_run), open files, file
     * size, no core files; memory and processes where no cgroup holds them */
    rlim_t cpu = (rlim_t)ceil(lim->cpu_s);
    const struct { int res; rlim_t v, hard; } rl[] = {
        {RLIMIT_CPU, cpu, cpu + 1}, {RLIMIT_NOFILE, (rlim_t)lim->files, (rlim_t)lim->files},
        {RLIMIT_FSIZE, (rlim_t)lim->file_bytes, (rlim_t)lim->file_bytes}, {RLIMIT_CORE, 0, 0},
        {RLIMIT_AS, (rlim_t)lim->memory_bytes, (rlim_t)lim->memory_bytes},
        {RLIMIT_NPROC, (rlim_t)lim->procs, (rlim_t)lim->procs}};
    for (int i = 0; i < (int)(sizeof rl / sizeof rl[0]); i++) {
        if (cgroup && (rl[i].res == RLIMIT_AS || rl[i].res == RLIMIT_NPROC)) continue;
        p->rlimit_res[p->n_rlimits] = rl[i].res;
        p->rlimits[p->n_rlimits++] = (struct rlimit){rl[i].v, rl[i].hard};
    }
    if (sb_seccomp_filter(&p->filter)) return mrl_set_error(MRL_ERR_NOMEM, "sandbox: the seccomp filter");
    p->ops = b->ops, p->n_ops = b->n;
    return MRL_OK;
}

void sb_free_builder(builder *b) {
    for (int i = 0; i < b->n_owned; i++) free(b->owned[i]);
    free(b->owned);
    free(b->ops);
}

/* ---- the run ---- */

typedef struct stream {
    int fd;
    char *buf;
    int64_t len, cap, max;
    int truncated;
} stream;

/* reads what is there; returns 1 at its end (or error), 0 while open; sets *over past max */
static int pump(stream *s, int *over) {
    char chunk[65536];
    for (;;) {
        ssize_t n = read(s->fd, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return 0;
        if (n <= 0) return 1;
        int64_t keep = n;
        if (s->len + keep > s->max) keep = s->max - s->len, s->truncated = 1, *over = 1;
        if (keep > 0) {
            if (s->len + keep + 1 > s->cap) {
                int64_t cap = s->cap ? s->cap : 4096;
                while (cap < s->len + keep + 1) cap *= 2;
                char *b = realloc(s->buf, (size_t)cap);
                if (!b) return s->truncated = 1, *over = 1, 1;
                s->buf = b, s->cap = cap;
            }
            memcpy(s->buf + s->len, chunk, (size_t)keep);
            s->len += keep;
        }
        if (*over) return 0;
    }
}

static int write_map(int pid, const char *file, const char *text) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", pid, file);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    close(fd);
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

/* the user and group maps: the namespace's root is nobody outside (when we may map another id),
 * else ourselves */
static int map_ids(int pid) {
    char map[64];
    if (geteuid() == 0 && write_map(pid, "uid_map", "0 65534 1\n") == 0 && write_map(pid, "gid_map", "0 65534 1\n") == 0)
        return 0;
    if (write_map(pid, "setgroups", "deny") && errno != ENOENT) return -1;
    snprintf(map, sizeof map, "0 %d 1\n", (int)geteuid());
    if (write_map(pid, "uid_map", map)) return -1;
    snprintf(map, sizeof map, "0 %d 1\n", (int)getegid());
    return write_map(pid, "gid_map", map);
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* The pipes of a run: the child's ends in the plan, the parent's in s (the program's streams may
 * be opened again by path, /dev/stdout being /proc/self/fd/1, which checks the pipe's owner: ours,
 * not the program's; the path needs access to a process holding the pipe, the program's own). */
static mrl_status make_pipes(sb_plan *p, int *sync_fd, sb_streams *s) {
    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1}, rep[2] = {-1, -1}, sync[2] = {-1, -1};
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(rep, O_CLOEXEC) ||
        (sync_fd && pipe2(sync, O_CLOEXEC))) {
        mrl_status st = mrl_set_error(MRL_ERR_IO, "sandbox: pipes: %s", strerror(errno));
        int *all[] = {in, out, err, rep, sync};
        for (int i = 0; i < 5; i++) close_fd(&all[i][0]), close_fd(&all[i][1]);
        return st;
    }
    fchmod(in[0], 0666), fchmod(out[1], 0666), fchmod(err[1], 0666);
    p->fd_in = in[0], p->fd_out = out[1], p->fd_err = err[1], p->fd_report = rep[1], p->fd_sync = sync[0];
    int extra = p->parent_fds[5]; /* (a pool's socket end, set by the caller; 0 in a fresh plan: none) */
    int parent_fds[6] = {in[1], out[0], err[0], rep[0], sync[1], extra > 0 ? extra : -1};
    memcpy(p->parent_fds, parent_fds, sizeof parent_fds);
    *s = (sb_streams){in[1], out[0], err[0], rep[0]};
    if (sync_fd) *sync_fd = sync[1];
    return MRL_OK;
}

static void close_child_ends(sb_plan *p) {
    close_fd(&p->fd_in), close_fd(&p->fd_out), close_fd(&p->fd_err), close_fd(&p->fd_report), close_fd(&p->fd_sync);
}

void sb_streams_close(sb_streams *s) { close_fd(&s->in), close_fd(&s->out), close_fd(&s->err), close_fd(&s->rep); }

/* The child in its namespaces: cloned, its user map written, added to its cgroup, then released
 * (it waits for that on its sync pipe). */
mrl_status sb_spawn(sb_plan *p, sb_cgroup *cg, long *pid_out, sb_streams *s) {
    int sync = -1;
    mrl_status st = make_pipes(p, &sync, s);
    if (st) return st;
    long pid = syscall(SYS_clone, (unsigned long)(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET |
                                                  CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD), 0, 0, 0, 0);
    if (pid == 0) sb_child(p); /* (never returns) */
    int clone_errno = errno;
    close_child_ends(p);
    if (pid < 0) {
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "sandbox: clone into new user, PID, mount, network, IPC and UTS "
                           "namespaces: %s (moonrl doctor tells what this machine allows)", strerror(clone_errno));
    } else if (map_ids((int)pid)) {
        st = mrl_set_error(MRL_ERR_UNSUPPORTED, "sandbox: writing the user namespace's map: %s", strerror(errno));
    } else if (cg->version && sb_cgroup_attach(cg, (int)pid)) {
        st = mrl_set_error(MRL_ERR_IO, "sandbox: adding the run to its cgroup %s: %s", cg->mem, strerror(errno));
    } else if (write(sync, "g", 1) != 1) {
        st = mrl_set_error(MRL_ERR_IO, "sandbox: starting the child: %s", strerror(errno));
    }
    close_fd(&sync);
    if (st) {
        if (pid > 0) kill((pid_t)pid, SIGKILL), waitpid((pid_t)pid, NULL, 0);
        sb_streams_close(s);
        return st;
    }
    *pid_out = pid;
    return MRL_OK;
}

static void kill_run(long pid, sb_cgroup *cg) {
    if (pid > 0) kill((pid_t)pid, SIGKILL); /* the namespace's first process: the kernel takes the rest with it */
    else sb_cgroup_kill(cg);                /* (a pool's run: every process of its cgroup) */
}

/* The run's streams, deadline and CPU time until its end, then its result. pid > 0: the
 * namespace's first process (killed at a limit, then waited for); 0: a pool's run, whose
 * processes are its cgroup's. plan (NULL for a pool's run) names what a failure report means;
 * killed: the caller has killed the run already. */
mrl_status sb_watch(const mrl_sandbox_spec *spec, const mrl_sandbox_limits *lim, long pid, sb_streams *s,
                    sb_cgroup *cg, const sb_plan *plan, double t0, int killed, mrl_sandbox_result *r) {
    /* a write to a program that closed its stdin must not raise SIGPIPE here */
    sigset_t pipe_set, old_set;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
    stream so = {.fd = s->out, .max = lim->output_bytes}, se = {.fd = s->err, .max = lim->output_bytes};
    s->out = s->err = -1;
    sb_report got[2], report = {0}, fail = {0}; /* a failure of the program's setup, or the end */
    int64_t rep_got = 0, fed = 0;
    int limit = 0;
    double killed_at = sb_now(); /* (killed: the caller killed it already, a session's close) */
    int fds4[4] = {s->in, so.fd, se.fd, s->rep};
    for (int i = 0; i < 4; i++)
        if (fds4[i] >= 0) fcntl(fds4[i], F_SETFL, O_NONBLOCK);
    if (spec->stdin_len <= 0) close_fd(&s->in);
    double deadline = t0 + lim->wall_s;
    int64_t cpu_ns_max = (int64_t)(lim->cpu_s * 1e9);
    while (so.fd >= 0 || se.fd >= 0 || s->rep >= 0) {
        struct pollfd fds[4] = {{so.fd, POLLIN, 0}, {se.fd, POLLIN, 0}, {s->rep, POLLIN, 0}, {s->in, POLLOUT, 0}};
        double left = deadline - now_s();
        int wait_ms = killed ? 1000 : left <= 0 ? 0 : (int)ceil(left * 1000);
        if (!killed && sb_cgroup_cpu_ns(cg) >= 0 && wait_ms > 20) wait_ms = 20; /* (the tree's CPU time, read often) */
        int n = poll(fds, 4, wait_ms);
        if (n < 0 && errno != EINTR) break;
        if (n == 0 && killed && pid <= 0) { /* a pool's run: one may have forked meanwhile */
            sb_cgroup_kill(cg);
            if (now_s() > killed_at + 5) break; /* (a run its zygote never started holds no process to kill) */
        }
        int over = 0;
        if (so.fd >= 0 && fds[0].revents && pump(&so, &over)) close_fd(&so.fd);
        if (se.fd >= 0 && fds[1].revents && pump(&se, &over)) close_fd(&se.fd);
        while (s->rep >= 0 && fds[2].revents) {
            ssize_t k = read(s->rep, (char *)got + rep_got, sizeof got - (size_t)rep_got);
            if (k < 0 && errno == EINTR) continue;
            if (k < 0 && errno == EAGAIN) break;
            if (k <= 0) close_fd(&s->rep);
            else rep_got += k;
        }
        if (s->in >= 0 && fds[3].revents) {
            if (fds[3].revents & (POLLERR | POLLHUP)) close_fd(&s->in);
            else {
                ssize_t k = write(s->in, (const char *)spec->stdin_data + fed, (size_t)(spec->stdin_len - fed));
                if (k > 0) fed += k;
                if ((k < 0 && errno != EAGAIN && errno != EINTR) || fed >= spec->stdin_len) close_fd(&s->in);
            }
        }
        if (killed) continue;
        int64_t cpu = sb_cgroup_cpu_ns(cg);
        if (over) limit = MRL_SANDBOX_LIMIT_OUTPUT;
        else if (now_s() >= deadline) limit = MRL_SANDBOX_LIMIT_WALL;
        else if (cpu >= cpu_ns_max) limit = MRL_SANDBOX_LIMIT_CPU;
        if (limit) {
            kill_run(pid, cg);
            killed = 1, killed_at = now_s();
            close_fd(&s->in);
        }
    }
    close_fd(&so.fd), close_fd(&se.fd);
    sb_streams_close(s);
    int wst = 0;
    while (pid > 0 && waitpid((pid_t)pid, &wst, 0) < 0 && errno == EINTR) {}
    sigset_t pending;
    sigpending(&pending);
    if (sigismember(&pending, SIGPIPE)) sigwaitinfo(&pipe_set, NULL);
    pthread_sigmask(SIG_SETMASK, &old_set, NULL);
    for (int i = 0; i < (int)(rep_got / (int64_t)sizeof(sb_report)); i++) {
        if (got[i].kind == SB_REPORT_FAIL) fail = got[i];
        if (got[i].kind == SB_REPORT_DONE) report = got[i];
    }
    r->wall_s = now_s() - t0;
    r->out = so.buf ? so.buf : calloc(1, 1), r->out_len = so.len, r->out_truncated = so.truncated;
    r->err = se.buf ? se.buf : calloc(1, 1), r->err_len = se.len, r->err_truncated = se.truncated;
    if (!r->out || !r->err) return mrl_set_error(MRL_ERR_NOMEM, "sandbox: the output");
    r->out[r->out_len] = 0, r->err[r->err_len] = 0;
    if (fail.kind == SB_REPORT_FAIL && !killed) { /* the sandbox's own failure, not the program's */
        const char *what = sb_stage_name(fail.stage);
        if (plan && fail.stage == SB_STAGE_OP && fail.op >= 0 && fail.op < plan->n_ops)
            return mrl_set_error(MRL_ERR_IO, "sandbox: %s (%s): %s", what, plan->ops[fail.op].path, strerror(fail.err));
        if (fail.stage == SB_STAGE_EXEC)
            return mrl_set_error(MRL_ERR_INVALID, "sandbox: execve %s: %s", plan ? plan->exe : spec->argv[1] ? spec->argv[1] :
                                 spec->argv[0], strerror(fail.err));
        return mrl_set_error(MRL_ERR_IO, "sandbox: %s: %s", what, strerror(fail.err));
    }
    if (pid <= 0 && report.kind != SB_REPORT_DONE && !killed) /* (a pool's run: its first process never reported) */
        return mrl_set_error(MRL_ERR_IO, "sandbox pool: the run ended without its report (the pool's zygote gone?)");
    int64_t peak = -1, ooms = 0, refused = 0, cg_cpu = sb_cgroup_cpu_ns(cg); /* (every process's, the killed too) */
    sb_cgroup_finish(cg, &peak, &ooms, &refused);
    if (report.kind == SB_REPORT_DONE) {
        int st = report.status;
        r->exited = WIFEXITED(st), r->status = WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st);
        r->cpu_s = 1e-6 * (double)(report.utime_us + report.stime_us);
        r->peak_memory_bytes = report.maxrss_kb * 1024;
    } else { /* killed before its end */
        r->exited = 0, r->status = WIFSIGNALED(wst) ? WTERMSIG(wst) : SIGKILL;
    }
    if (peak > 0) r->peak_memory_bytes = peak;
    if (cg_cpu >= 0) r->cpu_s = 1e-9 * (double)cg_cpu;
    if (!limit) {
        int sig = r->exited ? 0 : r->status;
        if (ooms > 0) limit = MRL_SANDBOX_LIMIT_MEMORY;
        else if (sig == SIGXCPU || (sig == SIGKILL && r->cpu_s >= lim->cpu_s)) limit = MRL_SANDBOX_LIMIT_CPU;
        else if (sig == SIGXFSZ) limit = MRL_SANDBOX_LIMIT_FILE;
        else if (refused > 0) limit = MRL_SANDBOX_LIMIT_PROCS;
        else if (report.disk_full) limit = MRL_SANDBOX_LIMIT_DISK;
    }
    r->limit = limit;
    return MRL_OK;
}

static mrl_status run(const mrl_sandbox_spec *spec, const mrl_sandbox_limits *lim, sb_plan *p, sb_cgroup *cg,
                      mrl_sandbox_result *r) {
    long pid = 0;
    sb_streams s;
    double t0 = now_s();
    mrl_status st = sb_spawn(p, cg, &pid, &s);
    return st ? st : sb_watch(spec, lim, pid, &s, cg, p, t0, 0, r);
}

mrl_status mrl_sandbox_run(const mrl_sandbox_spec *spec, mrl_sandbox_result *result) {
    if (!spec || !result) return mrl_set_error(MRL_ERR_INVALID, "mrl_sandbox_run: NULL argument");
    memset(result, 0, sizeof *result);
    if (spec->pool) return sb_pool_run(spec->pool, spec, result);
    mrl_sandbox_limits lim = {0};
    mrl_status st = sb_check_spec(spec, &lim);
    if (st) return st;
    sb_cgroup cg;
    int have_cg = sb_cgroup_create(&cg, lim.memory_bytes, lim.procs);
    builder b = {0};
    sb_plan plan;
    st = sb_build_plan(spec, &lim, have_cg, &b, &plan);
    if (!st) st = run(spec, &lim, &plan, &cg, result);
    if (have_cg) sb_cgroup_finish(&cg, NULL, NULL, NULL); /* (where the run failed before its own) */
    free(plan.filter.filter);
    sb_free_builder(&b);
    if (st) mrl_sandbox_result_free(result);
    return st;
}

void mrl_sandbox_result_free(mrl_sandbox_result *r) {
    if (!r) return;
    free(r->out);
    free(r->err);
    r->out = r->err = NULL;
    r->out_len = r->err_len = 0;
}

mrl_status mrl_sandbox_probe(mrl_sandbox_caps *caps) {
    if (!caps) return mrl_set_error(MRL_ERR_INVALID, "mrl_sandbox_probe: NULL argument");
    memset(caps, 0, sizeof *caps);
    char cg[256];
    caps->cgroup = sb_cgroup_version(cg, sizeof cg);
    caps->seccomp = prctl(PR_GET_SECCOMP, 0, 0, 0, 0) >= 0;
    const char *argv[] = {"true", NULL};
    mrl_sandbox_spec spec = {.argv = argv, .limits = {.wall_s = 10}};
    mrl_sandbox_result r;
    mrl_status st = mrl_sandbox_run(&spec, &r);
    caps->namespaces = st == MRL_OK && r.exited && r.status == 0;
    snprintf(caps->detail, sizeof caps->detail, "namespaces: %s; seccomp: %s; limits: %s",
             caps->namespaces ? "user, pid, mount, network, ipc, uts" : st ? mrl_last_error() : "a run of true failed",
             caps->seccomp ? "filter" : "unavailable", cg);
    if (!st) mrl_sandbox_result_free(&r);
    return MRL_OK;
}
