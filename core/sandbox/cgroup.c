/* The sandbox's cgroups (sandbox_internal.h): a directory per run under this process's own
 * cgroup, holding the memory and process limits of the whole tree, and telling afterwards its
 * peak memory, its OOM kills, its refused forks and its CPU time.
 *
 * cgroup v2 where this process's cgroup delegates the memory and pids controllers to its
 * children (its cgroup.subtree_control has them); else v1's memory and pids hierarchies (and
 * cpuacct for the CPU time); else none, and the sandbox falls back to rlimits (sandbox.c).
 * Found once: /proc/self/mountinfo for the hierarchies, /proc/self/cgroup for our place in
 * them, then a trial directory in each. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "base/log.h"
#include "sandbox_internal.h"

static struct {
    int version;
    char mem[384], pids[384], cpu[384]; /* our own cgroup in each hierarchy (v2: the same) */
    char detail[1400];
} cg_root;
static pthread_once_t cg_once = PTHREAD_ONCE_INIT;
static atomic_int cg_serial;

static int put_file(const char *dir, const char *name, const char *value) {
    char path[640];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "we");
    if (!f) return -1;
    int bad = fputs(value, f) < 0;
    bad |= fclose(f) != 0;
    return bad ? -1 : 0;
}

/* the number after `key` in a file of "key value" lines (-1: none) */
static int64_t read_key(const char *dir, const char *name, const char *key) {
    char path[640], line[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    int64_t v = -1;
    size_t k = key ? strlen(key) : 0;
    while (fgets(line, sizeof line, f)) {
        if (!key) {
            v = strtoll(line, NULL, 10);
            break;
        }
        if (strncmp(line, key, k) == 0 && line[k] == ' ') {
            v = strtoll(line + k + 1, NULL, 10);
            break;
        }
    }
    fclose(f);
    return v;
}

/* whether the comma-separated list (changed in place) holds word */
static int in_list(char *list, const char *word) {
    for (char *sv, *t = strtok_r(list, ",", &sv); t; t = strtok_r(NULL, ",", &sv))
        if (strcmp(t, word) == 0) return 1;
    return 0;
}

/* this process's path in the hierarchy whose /proc/self/cgroup line names `ctrl` (v2: "") */
static int own_path(const char *ctrl, char *out, size_t cap) {
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f) return -1;
    char line[1024];
    int found = -1;
    while (fgets(line, sizeof line, f)) {
        char *a = strchr(line, ':'), *b = a ? strchr(a + 1, ':') : NULL;
        if (!b) continue;
        *b = 0;
        char *path = b + 1;
        path[strcspn(path, "\n")] = 0;
        int match = !*ctrl ? a[1] == 0 && line[0] == '0' : in_list(a + 1, ctrl);
        if (match) {
            snprintf(out, cap, "%s", path);
            found = 0;
            break;
        }
    }
    fclose(f);
    return found;
}

/* the mount point of the v1 hierarchy with controller ctrl, or of cgroup2 (ctrl "") */
static int mount_of(const char *ctrl, char *out, size_t cap) {
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f) return -1;
    char line[2048];
    int found = -1;
    while (found && fgets(line, sizeof line, f)) {
        char mnt[1024], fstype[64], opts[1024];
        char *dash = strstr(line, " - ");
        if (!dash || sscanf(line, "%*s %*s %*s %*s %1023s", mnt) != 1) continue;
        if (sscanf(dash + 3, "%63s %*s %1023s", fstype, opts) != 2) continue;
        if (!*ctrl) {
            if (strcmp(fstype, "cgroup2") == 0) found = snprintf(out, cap, "%s", mnt) < (int)cap ? 0 : -1;
            continue;
        }
        if (strcmp(fstype, "cgroup") == 0 && in_list(opts, ctrl)) found = snprintf(out, cap, "%s", mnt) < (int)cap ? 0 : -1;
    }
    fclose(f);
    return found;
}

static int hierarchy(const char *ctrl, char *out, size_t cap) {
    char mnt[1024], path[1024];
    if (mount_of(ctrl, mnt, sizeof mnt) || own_path(ctrl, path, sizeof path)) return -1;
    return snprintf(out, cap, "%s%s", mnt, strcmp(path, "/") == 0 ? "" : path) < (int)cap ? 0 : -1;
}

/* a trial child directory: can we make it and write its limit */
static int trial(const char *dir, const char *file, const char *value) {
    char path[512];
    snprintf(path, sizeof path, "%s/moonrl-sandbox-probe-%d", dir, (int)getpid());
    if (mkdir(path, 0755) && errno != EEXIST) return -1;
    int bad = put_file(path, file, value);
    rmdir(path);
    return bad;
}

static void find_root(void) {
    char v2[384], sub[256] = "";  /* (v2: our own cgroup, where the children go) */
    if (hierarchy("", v2, sizeof v2) == 0) {
        char path[640];
        snprintf(path, sizeof path, "%s/cgroup.subtree_control", v2);
        FILE *f = fopen(path, "re");
        if (f) {
            if (!fgets(sub, sizeof sub, f)) sub[0] = 0;
            fclose(f);
        }
        if (strstr(sub, "memory") && strstr(sub, "pids") && trial(v2, "memory.max", "max") == 0) {
            cg_root.version = 2;
            snprintf(cg_root.mem, sizeof cg_root.mem, "%s", v2);
            snprintf(cg_root.pids, sizeof cg_root.pids, "%s", v2);
            snprintf(cg_root.cpu, sizeof cg_root.cpu, "%s", v2);
            if (snprintf(cg_root.detail, sizeof cg_root.detail, "cgroup v2 at %s", v2) < 0) cg_root.detail[0] = 0;
            return;
        }
    }
    if (hierarchy("memory", cg_root.mem, sizeof cg_root.mem) == 0 &&
        hierarchy("pids", cg_root.pids, sizeof cg_root.pids) == 0 &&
        trial(cg_root.mem, "memory.limit_in_bytes", "-1") == 0 && trial(cg_root.pids, "pids.max", "max") == 0) {
        cg_root.version = 1;
        if (hierarchy("cpuacct", cg_root.cpu, sizeof cg_root.cpu) || trial(cg_root.cpu, "notify_on_release", "0"))
            cg_root.cpu[0] = 0;
        if (snprintf(cg_root.detail, sizeof cg_root.detail, "cgroup v1: memory at %s, pids at %s%s%s", cg_root.mem,
                     cg_root.pids, cg_root.cpu[0] ? ", cpuacct at " : " (no cpuacct)", cg_root.cpu) < 0)
            cg_root.detail[0] = 0;
        return;
    }
    cg_root.version = 0;
    snprintf(cg_root.detail, sizeof cg_root.detail, "no usable cgroup (v2 without delegated memory and pids "
             "controllers%s, v1 memory and pids not writable): rlimits (RLIMIT_AS, RLIMIT_NPROC)",
             sub[0] ? "" : " here");
    /* (weaker isolation, said once: never a silent fallback) */
    mrl_logf(MRL_LOG_WARN, "sandbox: %s, weaker: memory as address space, processes counted per user; "
             "moonrl doctor says more", cg_root.detail);
}

int sb_cgroup_version(char *detail, int cap) {
    pthread_once(&cg_once, find_root);
    if (detail && cap > 0) snprintf(detail, (size_t)cap, "%s", cg_root.detail);
    return cg_root.version;
}

int sb_cgroup_create(sb_cgroup *cg, int64_t memory_bytes, int procs) {
    memset(cg, 0, sizeof *cg);
    if (sb_cgroup_version(NULL, 0) == 0) return 0;
    int serial = atomic_fetch_add(&cg_serial, 1);
    char name[64], num[32];
    snprintf(name, sizeof name, "moonrl-sandbox-%d-%d", (int)getpid(), serial);
    if (snprintf(cg->mem, sizeof cg->mem, "%s/%s", cg_root.mem, name) >= (int)sizeof cg->mem ||
        snprintf(cg->pids, sizeof cg->pids, "%s/%s", cg_root.pids, name) >= (int)sizeof cg->pids ||
        (cg_root.cpu[0] && snprintf(cg->cpu, sizeof cg->cpu, "%s/%s", cg_root.cpu, name) >= (int)sizeof cg->cpu))
        return 0;
    int v2 = cg_root.version == 2;
    if (mkdir(cg->mem, 0755) || (!v2 && mkdir(cg->pids, 0755)) || (!v2 && cg->cpu[0] && mkdir(cg->cpu, 0755))) {
        sb_cgroup_finish(cg, NULL, NULL, NULL);
        return 0;
    }
    cg->version = cg_root.version;
    snprintf(num, sizeof num, "%lld", (long long)memory_bytes);
    int bad = put_file(cg->mem, v2 ? "memory.max" : "memory.limit_in_bytes", num);
    if (v2) put_file(cg->mem, "memory.swap.max", "0"); /* (no swap past the limit, where it has any) */
    else put_file(cg->mem, "memory.memsw.limit_in_bytes", num);
    snprintf(num, sizeof num, "%d", procs);
    bad |= put_file(cg->pids, "pids.max", num);
    if (bad) {
        sb_cgroup_finish(cg, NULL, NULL, NULL);
        return 0;
    }
    return 1;
}

int sb_cgroup_attach(const sb_cgroup *cg, int pid) {
    char num[32];
    snprintf(num, sizeof num, "%d", pid);
    if (put_file(cg->mem, "cgroup.procs", num)) return -1;
    if (cg->version == 1 && put_file(cg->pids, "cgroup.procs", num)) return -1;
    if (cg->version == 1 && cg->cpu[0] && put_file(cg->cpu, "cgroup.procs", num)) return -1;
    return 0;
}

int64_t sb_cgroup_cpu_ns(const sb_cgroup *cg) {
    if (cg->version == 2) {
        int64_t us = read_key(cg->mem, "cpu.stat", "usage_usec");
        return us < 0 ? -1 : us * 1000;
    }
    return cg->version == 1 && cg->cpu[0] ? read_key(cg->cpu, "cpuacct.usage", NULL) : -1;
}

void sb_cgroup_kill(const sb_cgroup *cg) {
    if (!cg->version) return;
    if (cg->version == 2 && put_file(cg->mem, "cgroup.kill", "1") == 0) return;
    char path[640], line[64];
    snprintf(path, sizeof path, "%s/cgroup.procs", cg->mem);
    FILE *f = fopen(path, "re");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        long pid = strtol(line, NULL, 10);
        if (pid > 0) kill((pid_t)pid, SIGKILL);
    }
    fclose(f);
}

int sb_cgroup_procs_fds(const sb_cgroup *cg, int fds[3]) {
    const char *dirs[3] = {cg->mem, cg->version == 1 ? cg->pids : "", cg->version == 1 ? cg->cpu : ""};
    int n = 0;
    for (int i = 0; i < 3; i++) {
        if (!dirs[i][0]) continue;
        char path[640];
        snprintf(path, sizeof path, "%s/cgroup.procs", dirs[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0) {
            for (int j = 0; j < n; j++) close(fds[j]);
            return -1;
        }
        fds[n++] = fd;
    }
    return n;
}

/* the run's numbers, then its directories removed (their last processes may still be leaving:
 * a removal is tried again for up to half a second); once */
void sb_cgroup_finish(sb_cgroup *cg, int64_t *peak_bytes, int64_t *oom_kills, int64_t *pids_refused) {
    int v2 = cg->version == 2;
    if (cg->version) {
        if (peak_bytes) *peak_bytes = read_key(cg->mem, v2 ? "memory.peak" : "memory.max_usage_in_bytes", NULL);
        if (oom_kills) *oom_kills = read_key(cg->mem, v2 ? "memory.events" : "memory.oom_control", "oom_kill");
        if (pids_refused) *pids_refused = read_key(cg->pids, "pids.events", "max");
        if (v2) put_file(cg->mem, "cgroup.kill", "1");
    }
    const char *dirs[3] = {cg->mem, v2 ? "" : cg->pids, v2 ? "" : cg->cpu};
    for (int i = 0; i < 3; i++) {
        if (!dirs[i][0]) continue;
        for (int tries = 0; rmdir(dirs[i]) && errno == EBUSY && tries < 500; tries++)
            nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    memset(cg, 0, sizeof *cg); /* (done: a second call does nothing) */
}
