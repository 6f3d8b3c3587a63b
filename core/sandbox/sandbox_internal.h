/* The sandbox's parts (moonrl/sandbox.h): the parent builds a plan (every path, string and
 * filter the child needs, made before the clone), the child carries it out with system calls
 * only (it is a copy of a process with threads: no malloc, no stdio, no locks), cgroup.c holds
 * the limits where cgroups are usable. */
#pragma once
#include <linux/filter.h>
#include <stdint.h>
#include <sys/resource.h>
#include "moonrl/sandbox.h"

/* the new root's file system, built under /newroot in the child, in order */
enum { SB_MKDIR, SB_TOUCH, SB_SYMLINK, SB_BIND, SB_WRITE };
typedef struct sb_op {
    int kind;
    const char *path;     /* under /newroot */
    const char *source;   /* SB_BIND: under /oldroot; SB_SYMLINK: the target */
    unsigned long flags;  /* SB_BIND: the remount's flags (read-only and the source's locked ones) */
    const void *data;     /* SB_WRITE */
    int64_t size;
    int mode;
} sb_op;

/* where the child stopped, for the parent's message */
enum {
    SB_STAGE_SYNC = 1, SB_STAGE_IDS, SB_STAGE_PRIVATE, SB_STAGE_BASE, SB_STAGE_PIVOT, SB_STAGE_ROOT, SB_STAGE_OP,
    SB_STAGE_PROC, SB_STAGE_TMP, SB_STAGE_FILE, SB_STAGE_BOX, SB_STAGE_READONLY, SB_STAGE_OLDROOT, SB_STAGE_ENTER,
    SB_STAGE_HOST, SB_STAGE_LOOPBACK, SB_STAGE_FORK, SB_STAGE_STDIO, SB_STAGE_LIMITS, SB_STAGE_CAPS,
    SB_STAGE_SECCOMP, SB_STAGE_EXEC
};

/* what the child sends back: a failure (the stage and errno), or the program's end */
enum { SB_REPORT_FAIL = 1, SB_REPORT_DONE = 2 };
typedef struct sb_report {
    int kind, stage, err, status; /* status: wait4's */
    int disk_full, op;            /* op: the failed sb_op's index */
    int64_t utime_us, stime_us, maxrss_kb;
} sb_report;

enum { SB_RLIMITS = 8 };
typedef struct sb_plan {
    sb_op *ops;
    int n_ops;
    char tmp_opts[64], shm_opts[64];
    const mrl_sandbox_file *files;
    int n_files, has_box;
    const char *exe;
    char *const *argv;
    char *const *envp;
    int n_rlimits;
    int rlimit_res[SB_RLIMITS];
    struct rlimit rlimits[SB_RLIMITS];
    struct sock_fprog filter;
    int loopback;
    int fd_in, fd_out, fd_err, fd_report, fd_sync; /* the child's ends */
    int parent_fds[5];                             /* the parent's, closed in the child */
} sb_plan;

/* the child: never returns */
void sb_child(const sb_plan *p);
const char *sb_stage_name(int stage);
/* the seccomp filter (allocated: free filter->filter) */
int sb_seccomp_filter(struct sock_fprog *filter);

/* cgroups (cgroup.c): version 2, 1, or 0 (none usable: rlimits) */
typedef struct sb_cgroup {
    int version;
    char mem[448], pids[448], cpu[448]; /* this run's directories (v2: all three the same) */
} sb_cgroup;
int sb_cgroup_version(char *detail, int cap);
/* this run's cgroup with its limits; 0 when there is none (version 0, or creating it failed) */
int sb_cgroup_create(sb_cgroup *cg, int64_t memory_bytes, int procs);
int sb_cgroup_attach(const sb_cgroup *cg, int pid);
int64_t sb_cgroup_cpu_ns(const sb_cgroup *cg); /* -1 where it cannot tell */
void sb_cgroup_finish(sb_cgroup *cg, int64_t *peak_bytes, int64_t *oom_kills, int64_t *pids_refused);
