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
    int privileged; /* a pool's zygote (ours): keeps its capabilities, no filter (its runs drop them) */
    int keep_fd;    /* a descriptor the program keeps, as 4 (a pool's control socket), or -1 */
    int fd_in, fd_out, fd_err, fd_report, fd_sync; /* the child's ends */
    int parent_fds[6];                             /* the parent's, closed in the child (-1: none) */
} sb_plan;

/* the parent's side (sandbox.c): the spec checked (lim: its limits with the defaults), the plan
 * built (its strings owned by b), the child spawned (s: the parent's ends of its pipes), its run
 * watched to the end (pid 0: a pool's run, whose processes are its cgroup's) */
typedef struct builder {
    sb_op *ops;
    int n, cap;
    char **owned; /* every string made for the plan */
    int n_owned, cap_owned;
    int failed;
} builder;
typedef struct sb_streams {
    int in, out, err, rep;
} sb_streams;
typedef struct sb_cgroup sb_cgroup;
mrl_status sb_check_spec(const mrl_sandbox_spec *s, mrl_sandbox_limits *lim);
mrl_status sb_build_plan(const mrl_sandbox_spec *s, const mrl_sandbox_limits *lim, int cgroup, builder *b, sb_plan *p);
void sb_free_builder(builder *b);
mrl_status sb_spawn(sb_plan *p, sb_cgroup *cg, long *pid, sb_streams *s);
mrl_status sb_watch(const mrl_sandbox_spec *spec, const mrl_sandbox_limits *lim, long pid, sb_streams *s,
                    sb_cgroup *cg, const sb_plan *plan, double t0, int killed, mrl_sandbox_result *r);
void sb_streams_close(sb_streams *s);
/* a run on a pool (pool.c): started (its cgroup and the parent's ends of its pipes), watched */
mrl_status sb_pool_run(mrl_sandbox_pool *pool, const mrl_sandbox_spec *spec, mrl_sandbox_result *r);
mrl_status sb_pool_start(mrl_sandbox_pool *pool, const mrl_sandbox_spec *spec, const mrl_sandbox_limits *lim,
                         sb_cgroup *cg, sb_streams *s);
mrl_status sb_pool_watch(mrl_sandbox_pool *pool, const mrl_sandbox_spec *spec, const mrl_sandbox_limits *lim,
                         sb_cgroup *cg, sb_streams *s, double t0, int killed, mrl_sandbox_result *r);
double sb_now(void);

/* the child: never returns */
void sb_child(const sb_plan *p);
const char *sb_stage_name(int stage);
/* the seccomp filter (allocated: free filter->filter) */
int sb_seccomp_filter(struct sock_fprog *filter);

/* cgroups (cgroup.c): version 2, 1, or 0 (none usable: rlimits) */
struct sb_cgroup {
    int version;
    char mem[448], pids[448], cpu[448]; /* this run's directories (v2: all three the same) */
};
int sb_cgroup_version(char *detail, int cap);
/* this run's cgroup with its limits; 0 when there is none (version 0, or creating it failed) */
int sb_cgroup_create(sb_cgroup *cg, int64_t memory_bytes, int procs);
int sb_cgroup_attach(const sb_cgroup *cg, int pid);
int64_t sb_cgroup_cpu_ns(const sb_cgroup *cg); /* -1 where it cannot tell */
void sb_cgroup_kill(const sb_cgroup *cg);     /* every process in it */
/* descriptors of its cgroup.procs files, to write "0" into (a pool's run moves itself in): n of them */
int sb_cgroup_procs_fds(const sb_cgroup *cg, int fds[3]);
void sb_cgroup_finish(sb_cgroup *cg, int64_t *peak_bytes, int64_t *oom_kills, int64_t *pids_refused);
