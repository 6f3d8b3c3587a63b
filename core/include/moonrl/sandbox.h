/* The sandbox: untrusted programs (model-written code, its tests) run contained, on Linux's own
 * isolation (docs/sandbox.md says what that protects against and what not).
 *
 * Each execution starts in fresh user, PID, mount, network, IPC and UTS namespaces. Its file
 * system is a new root: the host's runtime (/usr, /lib, /bin, ... and the caller's ro_paths)
 * bound read-only, a fresh /proc, /dev with null, zero, random and urandom only, and a private
 * tmpfs /tmp (size-capped, the working directory, HOME) holding the caller's files; files marked
 * read-only go to /box instead, a tmpfs that is read-only once they are written. No network (an
 * empty network namespace; MRL_SANDBOX_NET_LOOPBACK brings its own loopback up, never the
 * host's). The environment is PATH, HOME, LANG and the caller's env only. The program runs
 * without capabilities, with no_new_privs and a seccomp filter that refuses (EPERM) what
 * untrusted code never needs: ptrace, mount, namespaces, kernel modules, keyctl, bpf, perf,
 * io_uring, reboot, clock setting, ... .
 *
 * Limits: wall time (the caller's deadline), CPU time of the whole process tree, memory, number
 * of processes, open files, file size, the work directory's size, and each of stdout and
 * stderr. Memory and processes are cgroup limits where the machine offers cgroups (v2, or the
 * v1 memory, pids and cpuacct controllers), else rlimits (RLIMIT_AS, RLIMIT_NPROC):
 * mrl_sandbox_probe says which. When the program ends, or a limit is hit, the namespace's first
 * process ends and the kernel kills every process left in it: a setsid or double-forked child
 * does not survive its run. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mrl_sandbox_net {
    MRL_SANDBOX_NET_NONE = 0,    /* an empty network namespace */
    MRL_SANDBOX_NET_LOOPBACK = 1 /* its own loopback interface, up */
} mrl_sandbox_net;

/* Which limit ended (or constrained) a run: NONE for a run that ended by itself. */
typedef enum mrl_sandbox_limit {
    MRL_SANDBOX_LIMIT_NONE = 0,
    MRL_SANDBOX_LIMIT_WALL = 1,   /* killed at the wall-clock deadline */
    MRL_SANDBOX_LIMIT_CPU = 2,    /* killed at the CPU time (of all its processes) */
    MRL_SANDBOX_LIMIT_MEMORY = 3, /* killed by the memory limit (the cgroup's OOM kill) */
    MRL_SANDBOX_LIMIT_PROCS = 4,  /* a fork or clone refused at the process limit */
    MRL_SANDBOX_LIMIT_OUTPUT = 5, /* killed when stdout or stderr passed output_bytes */
    MRL_SANDBOX_LIMIT_FILE = 6,   /* a write past file_bytes (SIGXFSZ) */
    MRL_SANDBOX_LIMIT_DISK = 7    /* the work directory's tmpfs filled */
} mrl_sandbox_limit;

/* 0 in a field takes its default (in brackets). */
typedef struct mrl_sandbox_limits {
    double wall_s;         /* [10] */
    double cpu_s;          /* [wall_s] */
    int64_t memory_bytes;  /* [512 MiB] */
    int procs;             /* processes and threads at once [64] */
    int files;             /* open files a process [256] */
    int64_t file_bytes;    /* the largest file a process writes [64 MiB] */
    int64_t tmpfs_bytes;   /* /tmp's size [64 MiB] */
    int64_t output_bytes;  /* each of stdout and stderr kept [1 MiB]; past it the run is killed */
} mrl_sandbox_limits;

/* A file put in the sandbox before the program starts: /tmp/name, or /box/name when read_only
 * (which the program cannot change: a test harness). name is one path component. */
typedef struct mrl_sandbox_file {
    const char *name;
    const void *data;
    int64_t size;
    int executable;
    int read_only;
} mrl_sandbox_file;

typedef struct mrl_sandbox_pool mrl_sandbox_pool;

typedef struct mrl_sandbox_spec {
    const char *const *argv;   /* NULL-terminated; argv[0] without a '/' looked up in the sandbox's PATH */
    const char *const *env;    /* NULL-terminated "KEY=VALUE" added to the clean environment, or NULL */
    const void *stdin_data;    /* written to the program's standard input, then closed */
    int64_t stdin_len;
    const mrl_sandbox_file *files;
    int n_files;
    const char *const *ro_paths; /* NULL-terminated host paths also bound read-only, or NULL */
    mrl_sandbox_limits limits;
    int network;                 /* mrl_sandbox_net */
    mrl_sandbox_pool *pool;      /* run on this warm pool (below), or NULL: a sandbox of its own */
} mrl_sandbox_spec;

typedef struct mrl_sandbox_result {
    int exited;            /* 1: the program exited with status; 0: killed by signal status */
    int status;
    int limit;             /* mrl_sandbox_limit */
    char *out, *err;       /* stdout and stderr (NUL-terminated, out_len / err_len bytes) */
    int64_t out_len, err_len;
    int out_truncated, err_truncated; /* more was written than output_bytes */
    double wall_s;         /* start to end of the run */
    double cpu_s;          /* user + system of its processes */
    int64_t peak_memory_bytes; /* the cgroup's peak, else the largest process's resident peak */
} mrl_sandbox_result;

/* Runs spec's program to its end or its first limit (the call waits; it is thread-safe, so a
 * batch runs in threads). A result that is not MRL_OK is the sandbox's own failure (namespaces
 * refused, a mount, the program not found: "sandbox: ..."), never the program's. Free the
 * result with mrl_sandbox_result_free. */
mrl_status mrl_sandbox_run(const mrl_sandbox_spec *spec, mrl_sandbox_result *result);
void mrl_sandbox_result_free(mrl_sandbox_result *result);
/* The name of a limit: "none", "wall", "cpu", "memory", "procs", "output", "file", "disk". */
const char *mrl_sandbox_limit_name(int limit);

/* A batch: n runs (specs[i], which stay the caller's until the batch is waited for) on threads of
 * its own, at most `concurrency` at once (0: 2 a CPU), so that the caller goes on meanwhile
 * (generation, another batch). _done says whether every run has ended (it never waits); _wait
 * waits for them all; _take moves run i's result out (the caller frees it) and returns its
 * status: MRL_OK, or the sandbox's own failure of that run (its message is the thread's last
 * error, "sandbox: ..."). _free waits for the runs first, and frees what was not taken. */
typedef struct mrl_sandbox_batch mrl_sandbox_batch;
mrl_status mrl_sandbox_batch_start(const mrl_sandbox_spec *specs, int n, int concurrency, mrl_sandbox_batch **out);
int mrl_sandbox_batch_done(const mrl_sandbox_batch *batch);
void mrl_sandbox_batch_wait(mrl_sandbox_batch *batch);
mrl_status mrl_sandbox_batch_take(mrl_sandbox_batch *batch, int i, mrl_sandbox_result *result);
void mrl_sandbox_batch_free(mrl_sandbox_batch *batch);

/* A warm pool (the zygote approach) for "python": one sandbox whose program is a Python
 * interpreter started once, its common modules imported, that forks each run (a spec whose pool
 * is this one): a run costs a fork, not an interpreter's start. Each run still has its own PID,
 * mount and IPC namespaces (its processes die with it, its /tmp, /box and /dev/shm are fresh
 * tmpfs), its own cgroup (memory, processes, CPU time), its own rlimits, and drops every
 * capability and installs the seccomp filter before the program's first line; the runs of a
 * pool share its user and network namespaces (network: the pool's, for all its runs) and its
 * read-only runtime (ro_paths: the pool's). A run's argv is `python3 FILE ARGS...` (FILE in /tmp
 * or /box) or `python3 -c CODE ARGS...`. Runs are thread-safe and may overlap (a batch); a zygote
 * that died is started again at the next run. Needs cgroups (mrl_sandbox_probe). */
mrl_status mrl_sandbox_pool_open(const char *language, int network, const char *const *ro_paths,
                                 mrl_sandbox_pool **out);
void mrl_sandbox_pool_close(mrl_sandbox_pool *pool);

/* A session: a run the caller talks to while it goes on (a tool's interpreter kept across an
 * episode's turns). Started as mrl_sandbox_run starts one (cold, or on spec->pool; spec's
 * stdin_data is ignored: its standard input stays open), under the same limits, the wall limit
 * counting from its start. _send writes to its standard input (waiting at most timeout_s);
 * _recv reads its standard output until `delim` (or, NULL, any bytes) has come, timeout_s has
 * passed, or the run has ended: *out (malloc'd, NUL-terminated, the caller frees it) holds what
 * came up to and with the delimiter, *ended says the run's standard output is closed (the rest
 * waits for the next _recv), and MRL_ERR_TIMEOUT says the time passed first. Its standard error
 * is kept (up to output_bytes) for the result. _close ends its standard input, waits for its end
 * within its wall limit (kill: at once), and gives its result as mrl_sandbox_run does (out: what
 * no _recv took); result may be NULL. A session is one caller's (no locking). */
typedef struct mrl_sandbox_session mrl_sandbox_session;
mrl_status mrl_sandbox_session_start(const mrl_sandbox_spec *spec, mrl_sandbox_session **out);
mrl_status mrl_sandbox_session_send(mrl_sandbox_session *s, const void *data, int64_t n, double timeout_s);
mrl_status mrl_sandbox_session_recv(mrl_sandbox_session *s, const char *delim, double timeout_s, char **out,
                                    int64_t *len, int *ended);
mrl_status mrl_sandbox_session_close(mrl_sandbox_session *s, int kill, mrl_sandbox_result *result);

/* What this machine gives the sandbox: namespaces (one run of `true` in them), seccomp, and
 * which cgroup version holds the limits (2, 1, or 0: rlimits only), in words in detail. */
typedef struct mrl_sandbox_caps {
    int namespaces;
    int seccomp;
    int cgroup;
    char detail[512];
} mrl_sandbox_caps;
mrl_status mrl_sandbox_probe(mrl_sandbox_caps *caps);

#ifdef __cplusplus
}
#endif
