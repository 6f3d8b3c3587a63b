/* The sandbox's child (sandbox_internal.h): the first process of the new namespaces. It is a
 * copy of a process that has threads, so everything here is a system call on what the parent
 * prepared (sb_plan): no allocation, no stdio, no locks another thread might have held.
 *
 * (glibc calls that act on every thread, set*id, must not be used: raw system calls instead.)
 * It waits until the parent has written its user and group maps, builds the new root (bwrap's
 * way: a tmpfs becomes the root with the old one under /oldroot, from which the runtime is bound
 * read-only into /newroot, which then becomes the root), starts the program as its only child
 * (without capabilities, no_new_privs, the seccomp filter, the rlimits) and reaps until the
 * program has ended. Then it reports and exits: it is the PID namespace's first process, so the
 * kernel kills whatever the program left behind. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/seccomp.h>
#include <linux/securebits.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include "sandbox_internal.h"

static const char *const stage_names[] = {
    [SB_STAGE_SYNC] = "waiting for the user map", [SB_STAGE_IDS] = "taking the mapped ids",
    [SB_STAGE_PRIVATE] = "making the mounts private", [SB_STAGE_BASE] = "mounting the base tmpfs",
    [SB_STAGE_PIVOT] = "pivot_root to the base", [SB_STAGE_ROOT] = "mounting the new root's tmpfs",
    [SB_STAGE_OP] = "building the new root", [SB_STAGE_PROC] = "mounting /proc",
    [SB_STAGE_TMP] = "mounting /tmp", [SB_STAGE_FILE] = "writing a file into /tmp or /box",
    [SB_STAGE_BOX] = "mounting /box", [SB_STAGE_READONLY] = "making the new root read-only",
    [SB_STAGE_OLDROOT] = "detaching the old root", [SB_STAGE_ENTER] = "entering the new root",
    [SB_STAGE_HOST] = "setting the host name", [SB_STAGE_LOOPBACK] = "bringing the loopback up",
    [SB_STAGE_FORK] = "starting the program's process", [SB_STAGE_STDIO] = "its standard streams",
    [SB_STAGE_LIMITS] = "its rlimits", [SB_STAGE_CAPS] = "dropping its capabilities",
    [SB_STAGE_SECCOMP] = "installing its seccomp filter", [SB_STAGE_EXEC] = "execve",
};

const char *sb_stage_name(int stage) {
    return stage > 0 && stage <= SB_STAGE_EXEC && stage_names[stage] ? stage_names[stage] : "?";
}

static void put(int fd, const sb_report *r) {
    const char *b = (const char *)r;
    size_t left = sizeof *r;
    while (left > 0) {
        ssize_t n = write(fd, b, left);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        b += n, left -= (size_t)n;
    }
}

static _Noreturn void fail(const sb_plan *p, int stage, int op) {
    sb_report r = {.kind = SB_REPORT_FAIL, .stage = stage, .err = errno, .op = op};
    put(p->fd_report, &r);
    _exit(127);
}

static int write_all(int fd, const void *data, int64_t size) {
    const char *b = data;
    while (size > 0) {
        ssize_t n = write(fd, b, size > (1 << 20) ? (1 << 20) : (size_t)size);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        b += n, size -= n;
    }
    return 0;
}

/* path + "/" + name into buf (cap bytes) */
static int join(char *buf, size_t cap, const char *path, const char *name) {
    size_t a = strlen(path), b = strlen(name);
    if (a + b + 2 > cap) return errno = ENAMETOOLONG, -1;
    memcpy(buf, path, a);
    buf[a] = '/';
    memcpy(buf + a + 1, name, b + 1);
    return 0;
}

static int put_files(const sb_plan *p, const char *dir, int read_only) {
    char path[4096];
    for (int i = 0; i < p->n_files; i++) {
        const mrl_sandbox_file *f = &p->files[i];
        if (!f->read_only != !read_only) continue;
        if (join(path, sizeof path, dir, f->name)) return -1;
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, f->executable ? 0755 : 0644);
        if (fd < 0) return -1;
        int bad = write_all(fd, f->data, f->size);
        close(fd);
        if (bad) return -1;
    }
    return 0;
}

static int do_op(const sb_op *o) {
    switch (o->kind) {
    case SB_MKDIR: return mkdir(o->path, (mode_t)o->mode) && errno != EEXIST ? -1 : 0;
    case SB_TOUCH: {
        int fd = open(o->path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        return fd < 0 ? -1 : close(fd);
    }
    case SB_SYMLINK: return symlink(o->source, o->path);
    case SB_BIND:
        if (mount(o->source, o->path, NULL, MS_BIND | MS_REC, NULL)) return -1;
        /* read-only: a remount keeping the flags the source's mount has locked (its nosuid, nodev,
         * noexec, atime: a user namespace may add restrictions, never drop one) */
        return mount(NULL, o->path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | o->flags, NULL);
    case SB_WRITE: {
        int fd = open(o->path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, (mode_t)o->mode);
        if (fd < 0) return -1;
        int bad = write_all(fd, o->data, o->size);
        close(fd);
        return bad;
    }
    }
    return errno = EINVAL, -1;
}

static void loopback_up(const sb_plan *p) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    memcpy(ifr.ifr_name, "lo", 3);
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr)) fail(p, SB_STAGE_LOOPBACK, -1);
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(s, SIOCSIFFLAGS, &ifr)) fail(p, SB_STAGE_LOOPBACK, -1);
    close(s);
}

/* the program's process: its streams, limits, no capabilities (uid 0 of the namespace gains
 * none at execve: SECBIT_NOROOT), no_new_privs, the filter, execve */
static _Noreturn void program(const sb_plan *p) {
    /* the streams to 0, 1, 2, the report's descriptor to 3 (closed by a successful execve), a
     * pool's control socket to 4: each first copied above 10, so that no move overwrites another */
    int src[5] = {p->fd_in, p->fd_out, p->fd_err, p->fd_report, p->keep_fd}, high[5];
    for (int i = 0; i < 5; i++)
        if ((high[i] = src[i] >= 0 ? fcntl(src[i], F_DUPFD_CLOEXEC, 10) : -1) < 0 && src[i] >= 0)
            fail(p, SB_STAGE_STDIO, -1);
    sb_plan q = *p;
    q.fd_report = high[3];
    if (dup2(high[0], 0) < 0 || dup2(high[1], 1) < 0 || dup2(high[2], 2) < 0 || dup3(high[3], 3, O_CLOEXEC) < 0)
        fail(&q, SB_STAGE_STDIO, -1);
    q.fd_report = 3;
    if (high[4] >= 0 && dup2(high[4], 4) < 0) fail(&q, SB_STAGE_STDIO, -1);
    unsigned first = p->keep_fd >= 0 ? 5u : 4u;
    if (syscall(SYS_close_range, first, ~0u, 0u)) /* (whatever else the parent had open) */
        for (int fd = (int)first; fd < 65536; fd++) close(fd);
    if (chdir("/tmp")) fail(&q, SB_STAGE_STDIO, -1);
    for (int i = 0; i < q.n_rlimits && !q.privileged; i++) /* (a zygote's runs set their own, up to its) */
        if (setrlimit((__rlimit_resource_t)q.rlimit_res[i], &q.rlimits[i])) fail(&q, SB_STAGE_LIMITS, i);
    if (q.privileged) { /* a pool's zygote: its runs drop what it keeps */
        execve(q.exe, q.argv, q.envp);
        fail(&q, SB_STAGE_EXEC, -1);
    }
    if (prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
              SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE |
              SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED, 0, 0, 0))
        fail(&q, SB_STAGE_CAPS, -1);
    for (int cap = 0; cap <= 63; cap++) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0); /* (EINVAL past the last) */
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &hdr, data)) fail(&q, SB_STAGE_CAPS, -1);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) fail(&q, SB_STAGE_SECCOMP, -1);
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &q.filter, 0, 0)) fail(&q, SB_STAGE_SECCOMP, -1);
    execve(q.exe, q.argv, q.envp);
    fail(&q, SB_STAGE_EXEC, -1);
}

void sb_child(const sb_plan *p) {
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0); /* (the parent gone: so is the sandbox) */
    for (int i = 0; i < 6; i++)
        if (p->parent_fds[i] >= 0) close(p->parent_fds[i]);
    char c;
    if (read(p->fd_sync, &c, 1) != 1) fail(p, SB_STAGE_SYNC, -1);
    close(p->fd_sync);
    /* not dumpable: its memory is a copy of the parent's (its environment too), which the
     * program may not read through /proc/1 (execve makes the program dumpable again). Only now:
     * an unprivileged parent writes the user map through this process's /proc, which a process
     * that is not dumpable closes to it. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* the raw calls: glibc's set*id would make every thread of the parent (which this copy does
     * not have) take the change too, and wait for them forever. No supplementary groups (where
     * the map allows setgroups: the parent's, root's, would stay otherwise). */
    syscall(SYS_setgroups, 0, NULL);
    if (syscall(SYS_setresgid, 0, 0, 0) || syscall(SYS_setresuid, 0, 0, 0)) fail(p, SB_STAGE_IDS, -1);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) fail(p, SB_STAGE_PRIVATE, -1);
    if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")) fail(p, SB_STAGE_BASE, -1);
    if (mkdir("/tmp/oldroot", 0755) || mkdir("/tmp/newroot", 0755)) fail(p, SB_STAGE_BASE, -1);
    if (syscall(SYS_pivot_root, "/tmp", "/tmp/oldroot") || chdir("/")) fail(p, SB_STAGE_PIVOT, -1);
    if (mount("tmpfs", "/newroot", "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")) fail(p, SB_STAGE_ROOT, -1);
    for (int i = 0; i < p->n_ops; i++)
        if (do_op(&p->ops[i])) fail(p, SB_STAGE_OP, i);
    if (mount("proc", "/newroot/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL)) fail(p, SB_STAGE_PROC, -1);
    if (mount("tmpfs", "/newroot/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, p->shm_opts)) fail(p, SB_STAGE_TMP, -1);
    if (mount("tmpfs", "/newroot/tmp", "tmpfs", MS_NOSUID | MS_NODEV, p->tmp_opts)) fail(p, SB_STAGE_TMP, -1);
    if (put_files(p, "/newroot/tmp", 0)) fail(p, SB_STAGE_FILE, -1);
    if (p->has_box) { /* the read-only files: written, then the tmpfs made read-only */
        if (mount("tmpfs", "/newroot/box", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")) fail(p, SB_STAGE_BOX, -1);
        if (put_files(p, "/newroot/box", 1)) fail(p, SB_STAGE_FILE, -1);
        if (mount(NULL, "/newroot/box", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL))
            fail(p, SB_STAGE_BOX, -1);
    }
    if (mount(NULL, "/newroot", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4m,mode=0755"))
        fail(p, SB_STAGE_READONLY, -1);
    if (umount2("/oldroot", MNT_DETACH)) fail(p, SB_STAGE_OLDROOT, -1);
    /* into /newroot: pivot_root(".", ".") stacks the old root on the new one, then detached */
    if (chdir("/newroot") || syscall(SYS_pivot_root, ".", ".") || umount2(".", MNT_DETACH) || chdir("/"))
        fail(p, SB_STAGE_ENTER, -1);
    if (sethostname("sandbox", 7)) fail(p, SB_STAGE_HOST, -1);
    if (p->loopback) loopback_up(p);
    pid_t pid = (pid_t)syscall(SYS_clone, (unsigned long)SIGCHLD, 0, 0, 0, 0); /* (fork without glibc's handlers) */
    if (pid < 0) fail(p, SB_STAGE_FORK, -1);
    if (pid == 0) program(p);
    close(p->fd_in), close(p->fd_out), close(p->fd_err);
    sb_report r = {.kind = SB_REPORT_DONE};
    for (;;) { /* (the namespace's orphans come here too) */
        int st;
        pid_t w = wait4(-1, &st, 0, NULL);
        if (w == pid) {
            r.status = st;
            break;
        }
        if (w < 0 && errno != EINTR) {
            r.status = 0x7f00; /* (cannot happen: the program is our child) */
            break;
        }
    }
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    r.utime_us = (int64_t)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec;
    r.stime_us = (int64_t)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec;
    r.maxrss_kb = ru.ru_maxrss;
    struct statfs fs;
    r.disk_full = statfs("/tmp", &fs) == 0 && fs.f_bavail == 0;
    put(p->fd_report, &r);
    _exit(0);
}
