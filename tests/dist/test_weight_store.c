/* The weight store (moonrl/weight_store.h): readers in threads of this
 * process (a private store) and in fork()ed processes (a shared one).
 *
 * The writer publishes versions 0..N-1, version v's float i being
 * pattern(v, i); every reader checks that every float it holds matches the
 * version it got, twice when it is slow (before and after holding it for a
 * while, during which the writer goes on publishing): a slot written while
 * held, or handed out half-written, shows as a mismatch. Versions a reader
 * gets never go backwards. Writers fast and readers slow, and the other way
 * round, with 1 and 2 readers; small slots and many versions to hammer the
 * protocol. Then STOP, timeouts, stop requests, errors, and what a killed
 * writer or reader leaves behind. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "check.h"
#include "random.h"
#include "moonrl/dtype.h"
#include "moonrl/loop.h"
#include "moonrl/parallel.h"
#include "moonrl/weight_store.h"

/* Exact in a float (24 bits), different at every index from one version to the next. */
static float pattern(int64_t v, int64_t i) { return (float)((uint64_t)(v * 1000003 + i) & 0xffffff); }

static void fill(float *buf, int64_t n, int64_t v) {
    for (int64_t i = 0; i < n; i++) buf[i] = pattern(v, i);
}

/* The first index where p is not version v, -1 when none. */
static int64_t mismatch(const float *p, int64_t n, int64_t v) {
    for (int64_t i = 0; i < n; i++)
        if (p[i] != pattern(v, i)) return i;
    return -1;
}

static void sleep_us(int us) {
    struct timespec t = {us / 1000000, (long)(us % 1000000) * 1000};
    nanosleep(&t, NULL);
}

static void make_name(char *buf, size_t size, const char *what) {
    snprintf(buf, size, "/moonrl-test-%d-%s", (int)getpid(), what);
}

static int shm_exists(const char *name) {
    char path[300];
    snprintf(path, sizeof path, "/dev/shm%s", name);
    return access(path, F_OK) == 0;
}

/* Reader `reader` of w gets exactly version v (within 5 s), every float right. */
static void check_acquire(mrl_weight_store *w, int reader, int64_t v, int64_t n) {
    const float *p = NULL;
    int64_t got = -1;
    CHECK_OK(mrl_weight_store_acquire(w, reader, v, 5, &p, &got, NULL));
    CHECK(got == v && p && mismatch(p, n, v) < 0);
}

/* ------------------------------------------------------ writer and readers */

typedef struct reader_run {
    mrl_weight_store *w;
    int reader;
    int64_t n_versions, n_floats;
    int slow_us;   /* hold each version this long, then check it again */
    int wait_next; /* 1: ask for the next version (waits); 0: for whatever is latest (never waits) */
    int failures;
    int64_t acquired, distinct;
} reader_run;

/* Acquires until it holds the last version; counts what is wrong (in a
 * child process the CHECK counters are not the parent's). */
static void *read_versions(void *arg) {
    reader_run *a = arg;
    int64_t last = -1;
    while (last < a->n_versions - 1) {
        const float *p = NULL;
        int64_t v = -1;
        int flags = -1;
        int64_t want = a->wait_next ? last + 1 : (last < 0 ? 0 : last);
        if (mrl_weight_store_acquire(a->w, a->reader, want, 30, &p, &v, &flags) != MRL_OK) {
            fprintf(stderr, "reader %d: %s\n", a->reader, mrl_last_error());
            a->failures++;
            break;
        }
        int64_t bad = p ? mismatch(p, a->n_floats, v) : 0;
        if (v < want || flags != 0 || bad >= 0) {
            fprintf(stderr, "reader %d: asked for >= %lld, got version %lld flags %d, float %lld is %g\n", a->reader,
                    (long long)want, (long long)v, flags, (long long)bad, bad >= 0 && p ? p[bad] : 0.0);
            a->failures++;
            break;
        }
        if (a->slow_us) {
            sleep_us(a->slow_us);
            if ((bad = mismatch(p, a->n_floats, v)) >= 0) {
                fprintf(stderr, "reader %d: version %lld changed while held, at float %lld\n", a->reader,
                        (long long)v, (long long)bad);
                a->failures++;
                break;
            }
        }
        a->distinct += v != last;
        a->acquired++;
        last = v;
    }
    mrl_weight_store_release(a->w, a->reader);
    return NULL;
}

static void write_versions(mrl_weight_store *w, int64_t n_versions, int slow_us) {
    int64_t n = mrl_weight_store_floats(w);
    float *buf = malloc((size_t)n * sizeof *buf);
    for (int64_t v = 0; v < n_versions; v++) {
        fill(buf, n, v);
        CHECK_OK(mrl_weight_store_publish(w, buf, v, 0));
        if (slow_us) sleep_us(slow_us);
    }
    free(buf);
}

typedef struct config {
    int64_t n_floats, n_versions;
    int writer_slow_us;
    int reader_slow_us[2];
    int wait_next[2];
} config;

static const config configs[] = {
    /* writer fast, readers slow: they skip versions, and hold theirs while the writer laps them */
    {1 << 20, 200, 0, {3000, 1500}, {1, 0}},
    /* writer slow, readers fast: they re-acquire the same version over and over, or wait for the next */
    {1 << 20, 100, 2000, {0, 0}, {0, 1}},
    /* small slots, many versions, everyone fast: the protocol's races, often */
    {4096, 20000, 0, {0, 0}, {0, 0}},
};

static void check_runs(const reader_run *runs, int n_readers, const config *c) {
    for (int r = 0; r < n_readers; r++) {
        CHECK(runs[r].failures == 0);
        CHECK(runs[r].distinct >= 1 && runs[r].distinct <= c->n_versions);
        if (c->wait_next[r] && !c->reader_slow_us[r] && c->writer_slow_us)
            CHECK(runs[r].distinct > c->n_versions / 2); /* a fast waiting reader sees most versions */
    }
}

/* A private store, the readers in threads of this process. */
static void test_threads(const config *c, int n_readers) {
    mrl_weight_store *w = NULL;
    CHECK_OK(mrl_weight_store_create(NULL, c->n_floats, n_readers, &w));
    if (!w) return;
    CHECK(mrl_weight_store_latest(w, NULL) == -1);
    reader_run runs[2];
    pthread_t threads[2];
    for (int r = 0; r < n_readers; r++) {
        runs[r] = (reader_run){w, r, c->n_versions, c->n_floats, c->reader_slow_us[r], c->wait_next[r], 0, 0, 0};
        pthread_create(&threads[r], NULL, read_versions, &runs[r]);
    }
    write_versions(w, c->n_versions, c->writer_slow_us);
    for (int r = 0; r < n_readers; r++) pthread_join(threads[r], NULL);
    check_runs(runs, n_readers, c);
    int flags = -1;
    CHECK(mrl_weight_store_latest(w, &flags) == c->n_versions - 1 && flags == 0);
    mrl_weight_store_free(w);
}

/* A reader process: opens the store by name, says so on ready_fd (1: open,
 * 0: failed), reads, and exits 0 when all was right. */
static pid_t spawn_reader(const char *name, const config *c, int reader, int ready_fd) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    mrl_weight_store *w = NULL;
    char ok = mrl_weight_store_open(name, c->n_floats, reader, &w) == MRL_OK;
    if (!ok) fprintf(stderr, "reader %d: %s\n", reader, mrl_last_error());
    if (write(ready_fd, &ok, 1) != 1 || !ok) _exit(2);
    reader_run run = {w, reader, c->n_versions, c->n_floats, c->reader_slow_us[reader], c->wait_next[reader], 0, 0, 0};
    read_versions(&run);
    mrl_weight_store_free(w);
    _exit(run.failures == 0 && run.distinct >= 1 ? 0 : 1);
}

/* Waits for n one-byte answers on fd; 1 when all said yes. */
static int all_ready(int fd, int n) {
    int yes = 0;
    for (int i = 0; i < n; i++) {
        char c = 0;
        if (read(fd, &c, 1) == 1) yes += c == 1;
    }
    return yes == n;
}

static int exited_ok(pid_t pid) {
    int st = 0;
    return waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* A shared store, the readers in other processes. */
static void test_processes(const config *c, int n_readers, int k) {
    char name[64], what[24];
    snprintf(what, sizeof what, "procs%d", k);
    make_name(name, sizeof name, what);
    mrl_weight_store *w = NULL;
    CHECK_OK(mrl_weight_store_create(name, c->n_floats, n_readers, &w));
    if (!w) return;
    CHECK(shm_exists(name));
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t pids[2];
    for (int r = 0; r < n_readers; r++) pids[r] = spawn_reader(name, c, r, fds[1]);
    CHECK(all_ready(fds[0], n_readers));
    CHECK_OK(mrl_weight_store_unlink(w)); /* every reader has it: the name can go */
    CHECK(!shm_exists(name));
    CHECK_OK(mrl_weight_store_unlink(w)); /* idempotent */
    write_versions(w, c->n_versions, c->writer_slow_us);
    for (int r = 0; r < n_readers; r++) CHECK(exited_ok(pids[r]));
    close(fds[0]);
    close(fds[1]);
    mrl_weight_store_free(w);
}

/* Two writers (sharded trainers): a co-writer process writes the second half of every
 * version into the slot the writer began, the writer the first half, then commits; a reader
 * that never waits sees only whole versions. The co-writer may not begin, commit or read; a
 * reader may not write; a write outside the slot is refused. */
static void test_co_writers(void) {
    char name[64];
    make_name(name, sizeof name, "cowrite");
    enum { N = 1 << 16, V = 300 };
    mrl_weight_store *w = NULL;
    CHECK_OK(mrl_weight_store_create(name, N, 1, &w));
    if (!w) return;
    int to_child[2], to_parent[2];
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(to_child[1]); /* (the parent's ends: EOF when it closes its own) */
        close(to_parent[0]);
        mrl_weight_store *c = NULL;
        int bad = mrl_weight_store_open_writer(name, N, &c) != MRL_OK;
        int slot = 0, ack = 1;
        bad += c && mrl_weight_store_begin(c, &slot) != MRL_ERR_INVALID;
        bad += c && mrl_weight_store_commit(c, 0, 0, 0) != MRL_ERR_INVALID;
        bad += c && mrl_weight_store_acquire(c, 0, 0, 0, NULL, NULL, NULL) != MRL_ERR_INVALID;
        bad += c && mrl_weight_store_write(c, 0, N / 2, NULL, N) != MRL_ERR_INVALID;
        if (write(to_parent[1], &bad, sizeof bad) != sizeof bad) _exit(2);
        float *half = malloc(sizeof(float) * N / 2);
        int64_t msg[2];
        while (read(to_child[0], msg, sizeof msg) == sizeof msg) { /* slot, version */
            for (int64_t i = 0; i < N / 2; i++) half[i] = pattern(msg[1], N / 2 + i);
            ack = c && mrl_weight_store_write(c, (int)msg[0], N / 2, half, N / 2) == MRL_OK;
            if (write(to_parent[1], &ack, sizeof ack) != sizeof ack) _exit(2);
        }
        mrl_weight_store_free(c);
        _exit(0);
    }
    close(to_child[0]);
    close(to_parent[1]);
    int bad = -1;
    CHECK(read(to_parent[0], &bad, sizeof bad) == sizeof bad && bad == 0);
    CHECK_OK(mrl_weight_store_unlink(w));
    reader_run run = {.w = w, .reader = 0, .n_versions = V, .n_floats = N};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, read_versions, &run) == 0);
    float *half = malloc(sizeof(float) * N / 2);
    for (int64_t v = 0; v < V; v++) {
        int slot = -1, ack = 0;
        CHECK_OK(mrl_weight_store_begin(w, &slot));
        int64_t msg[2] = {slot, v};
        CHECK(write(to_child[1], msg, sizeof msg) == sizeof msg);
        for (int64_t i = 0; i < N / 2; i++) half[i] = pattern(v, i);
        CHECK_OK(mrl_weight_store_write(w, slot, 0, half, N / 2));
        CHECK(read(to_parent[0], &ack, sizeof ack) == sizeof ack && ack == 1);
        CHECK_OK(mrl_weight_store_commit(w, slot, v, 0));
    }
    pthread_join(th, NULL);
    CHECK(run.failures == 0 && run.distinct >= 1);
    CHECK(mrl_weight_store_write(w, 0, N - 1, half, 2) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_commit(w, 0, V - 1, 0) == MRL_ERR_INVALID); /* (versions increase) */
    close(to_child[1]);
    CHECK(exited_ok(pid));
    close(to_parent[0]);
    free(half);
    mrl_weight_store_free(w);
}

/* ------------------------------------------------- flags, waits, stops */

typedef struct waiter {
    mrl_weight_store *w;
    int64_t min_version;
    mrl_status st;
    const float *params;
    int64_t version;
    int flags;
} waiter;

static void *wait_for_version(void *arg) {
    waiter *a = arg;
    a->st = mrl_weight_store_acquire(a->w, 0, a->min_version, 10, &a->params, &a->version, &a->flags);
    return NULL;
}

static void test_wait_and_stop_flag(void) {
    enum { N = 1000 };
    mrl_weight_store *w = NULL;
    CHECK_OK(mrl_weight_store_create(NULL, N, 1, &w));
    if (!w) return;
    float buf[N];
    /* a reader waiting for version 3 gets it, whole, and not 0..2 */
    waiter a = {w, 3, -1, NULL, -1, -1};
    pthread_t t;
    pthread_create(&t, NULL, wait_for_version, &a);
    for (int v = 0; v <= 3; v++) {
        sleep_us(20000);
        fill(buf, N, v);
        CHECK_OK(mrl_weight_store_publish(w, buf, v, 0));
    }
    pthread_join(t, NULL);
    CHECK(a.st == MRL_OK && a.version == 3 && a.flags == 0 && a.params && mismatch(a.params, N, 3) < 0);
    /* a STOP without weights ends the wait of one who waits for a version that will never come */
    a = (waiter){w, 100, -1, NULL, -1, -1};
    pthread_create(&t, NULL, wait_for_version, &a);
    sleep_us(50000);
    CHECK_OK(mrl_weight_store_publish(w, NULL, 5, MRL_WS_STOP));
    pthread_join(t, NULL);
    CHECK(a.st == MRL_OK && a.version == 5 && a.flags == MRL_WS_STOP && a.params == NULL);
    int flags = 0;
    CHECK(mrl_weight_store_latest(w, &flags) == 5 && flags == MRL_WS_STOP);
    /* weights after it, with a flag */
    fill(buf, N, 6);
    CHECK_OK(mrl_weight_store_publish(w, buf, 6, MRL_WS_ROLLBACK));
    const float *p = NULL;
    int64_t v = -1;
    CHECK_OK(mrl_weight_store_acquire(w, 0, 6, 1, &p, &v, &flags));
    CHECK(v == 6 && flags == MRL_WS_ROLLBACK && p && mismatch(p, N, 6) < 0);
    mrl_weight_store_release(w, 0);
    mrl_weight_store_free(w);
}

static void *request_stop_soon(void *arg) {
    sleep_us(50000);
    mrl_request_stop(0, "test: stop while waiting");
    return NULL;
}

static void test_timeout_and_stop_request(void) {
    mrl_weight_store *w = NULL;
    CHECK_OK(mrl_weight_store_create(NULL, 100, 2, &w));
    if (!w) return;
    const float *p;
    int64_t v;
    int flags;
    double t0 = mrl_time_now();
    CHECK(mrl_weight_store_acquire(w, 1, 1000, 0.2, &p, &v, &flags) == MRL_ERR_TIMEOUT);
    double took = mrl_time_now() - t0;
    CHECK(took >= 0.2 && took < 2.0);
    CHECK_STR_CONTAINS(mrl_last_error(), "reader 1 waited 0.2 s for version >= 1000");
    CHECK_STR_CONTAINS(mrl_last_error(), "latest seen is -1 (none published)");
    CHECK_OK(mrl_weight_store_publish(w, NULL, 7, 0));
    CHECK(mrl_weight_store_acquire(w, 0, 8, 0.05, &p, &v, &flags) == MRL_ERR_TIMEOUT);
    CHECK_STR_CONTAINS(mrl_last_error(), "latest seen is 7");
    /* no time limit: a stop request ends the wait */
    pthread_t t;
    pthread_create(&t, NULL, request_stop_soon, NULL);
    t0 = mrl_time_now();
    CHECK(mrl_weight_store_acquire(w, 0, 1000, 0, &p, &v, &flags) == MRL_ERR_STOPPED);
    CHECK(mrl_time_now() - t0 < 5.0);
    CHECK_STR_CONTAINS(mrl_last_error(), "test: stop while waiting");
    pthread_join(t, NULL);
    mrl_clear_stop();
    mrl_weight_store_free(w);
}

/* ------------------------------------------------------------ errors */

static void test_errors(void) {
    char name[64], junk[64], junk2[64];
    make_name(name, sizeof name, "errors");
    make_name(junk, sizeof junk, "junk");
    make_name(junk2, sizeof junk2, "junk2");
    mrl_weight_store *w = NULL, *r = NULL, *r2 = NULL;
    /* bad arguments */
    CHECK(mrl_weight_store_create("no-slash", 10, 1, &w) == MRL_ERR_INVALID && !w);
    CHECK_STR_CONTAINS(mrl_last_error(), "'no-slash'");
    CHECK(mrl_weight_store_create("/a/b", 10, 1, &w) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_create("/", 10, 1, &w) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_create(NULL, 0, 1, &w) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_create(NULL, 10, 0, &w) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_create(NULL, 10, 129, &w) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_create(name, (int64_t)1 << 44, 1, &w) == MRL_ERR_NOMEM && !w);
    CHECK_STR_CONTAINS(mrl_last_error(), "physical memory");
    CHECK(!shm_exists(name));
    /* an existing name */
    CHECK_OK(mrl_weight_store_create(name, 1000, 1, &w));
    if (!w) return;
    CHECK(shm_exists(name));
    mrl_weight_store *w2 = NULL;
    CHECK(mrl_weight_store_create(name, 1000, 1, &w2) == MRL_ERR_IO && !w2);
    CHECK_STR_CONTAINS(mrl_last_error(), name);
    CHECK_STR_CONTAINS(mrl_last_error(), "exists already");
    CHECK(shm_exists(name)); /* the failed create did not remove the other's name */
    /* opening: size, reader index */
    CHECK(mrl_weight_store_open(name, 999, 0, &r) == MRL_ERR_INVALID && !r);
    CHECK_STR_CONTAINS(mrl_last_error(), "holds 1000 floats per slot, the reader expects 999");
    CHECK(mrl_weight_store_open(name, 1000, 1, &r) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "reader 1 (the store has readers 0..0)");
    CHECK(mrl_weight_store_open(name, 1000, -1, &r) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_open(NULL, 1000, 0, &r) == MRL_ERR_INVALID);
    CHECK_OK(mrl_weight_store_open(name, 1000, 0, &r));
    CHECK(mrl_weight_store_open(name, 1000, 0, &r2) == MRL_ERR_INVALID && !r2);
    CHECK_STR_CONTAINS(mrl_last_error(), "reader 0 is open already");
    const float *p;
    int64_t v;
    int flags;
    if (r) {
        CHECK(mrl_weight_store_acquire(r, 1, 0, 0.01, &p, &v, &flags) == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), "opened as reader 0, not 1");
        CHECK(mrl_weight_store_publish(r, NULL, 0, 0) == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), "only the writer publishes");
        CHECK(mrl_weight_store_unlink(r) == MRL_ERR_INVALID);
    }
    CHECK(mrl_weight_store_acquire(w, 1, 0, 0.01, &p, &v, &flags) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_acquire(w, 0, 0, -1, &p, &v, &flags) == MRL_ERR_INVALID);
    /* versions */
    float buf[1000];
    fill(buf, 1000, 3);
    CHECK(mrl_weight_store_publish(w, buf, -1, 0) == MRL_ERR_INVALID);
    CHECK_OK(mrl_weight_store_publish(w, buf, 3, 0));
    CHECK(mrl_weight_store_publish(w, buf, 3, 0) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "version 3 after version 3");
    CHECK(mrl_weight_store_publish(w, buf, 2, 0) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_publish(w, buf, 4, 4) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "unknown flags 0x4");
    CHECK(mrl_weight_store_publish(w, buf, (int64_t)1 << 47, 0) == MRL_ERR_INVALID);
    CHECK(mrl_weight_store_latest(w, NULL) == 3);
    if (r) {
        CHECK(mrl_weight_store_latest(r, NULL) == 3);
        check_acquire(r, 0, 3, 1000);
    }
    /* a freed reader's index can be opened again */
    mrl_weight_store_free(r);
    CHECK_OK(mrl_weight_store_open(name, 1000, 0, &r));
    mrl_weight_store_free(r);
    /* free without unlink removes the name */
    mrl_weight_store_free(w);
    CHECK(!shm_exists(name));
    CHECK(mrl_weight_store_open(name, 1000, 0, &r) == MRL_ERR_IO && !r);
    CHECK_STR_CONTAINS(mrl_last_error(), name);
    CHECK_STR_CONTAINS(mrl_last_error(), "does not exist");
    /* files that are not stores: too short, and long enough but junk */
    const char *junk_names[2] = {junk, junk2};
    for (int k = 0; k < 2; k++) {
        int fd = shm_open(junk_names[k], O_RDWR | O_CREAT | O_EXCL, 0600);
        CHECK(fd >= 0);
        if (fd < 0) continue;
        char bytes[65536];
        memset(bytes, 'x', sizeof bytes);
        size_t n = k == 0 ? 5 : sizeof bytes;
        CHECK(write(fd, bytes, n) == (ssize_t)n);
        close(fd);
        CHECK(mrl_weight_store_open(junk_names[k], 1000, 0, &r) == MRL_ERR_FORMAT && !r);
        CHECK_STR_CONTAINS(mrl_last_error(), junk_names[k]);
        CHECK_STR_CONTAINS(mrl_last_error(), k == 0 ? "not a weight store: 5 bytes" : "magic");
        shm_unlink(junk_names[k]);
    }
}

/* --------------------------------------------------- killed processes */

/* A writer killed after its readers opened and it unlinked leaves nothing
 * in /dev/shm, and the reader still has the weights it published. */
static void test_killed_writer(void) {
    enum { N = 50000 };
    char name[64];
    make_name(name, sizeof name, "killed");
    int to_parent[2], to_child[2];
    CHECK(pipe(to_parent) == 0 && pipe(to_child) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        mrl_parallel_set_threads(1); /* OpenMP's pool does not survive fork */
        mrl_weight_store *w = NULL;
        char c = mrl_weight_store_create(name, N, 1, &w) == MRL_OK;
        if (write(to_parent[1], &c, 1) != 1 || !c) _exit(2);
        if (read(to_child[0], &c, 1) != 1) _exit(3); /* the reader has opened */
        static float buf[N];
        fill(buf, N, 7);
        c = mrl_weight_store_unlink(w) == MRL_OK && mrl_weight_store_publish(w, buf, 7, 0) == MRL_OK;
        if (write(to_parent[1], &c, 1) != 1) _exit(4);
        for (;;) pause();
    }
    CHECK(all_ready(to_parent[0], 1));
    mrl_weight_store *r = NULL;
    CHECK_OK(mrl_weight_store_open(name, N, 0, &r));
    char c = 1;
    CHECK(write(to_child[1], &c, 1) == 1);
    CHECK(all_ready(to_parent[0], 1));
    kill(pid, SIGKILL);
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    CHECK(!shm_exists(name));
    if (r) {
        check_acquire(r, 0, 7, N); /* the mapping outlives the writer */
        CHECK(mrl_weight_store_acquire(r, 0, 8, 0.05, NULL, NULL, NULL) == MRL_ERR_TIMEOUT);
        CHECK_STR_CONTAINS(mrl_last_error(), "latest seen is 7; the writer, process");
        CHECK_STR_CONTAINS(mrl_last_error(), "is gone");
    }
    mrl_weight_store_free(r);
    for (int k = 0; k < 2; k++) {
        close(to_parent[k]);
        close(to_child[k]);
    }
}

/* A reader killed while it holds a slot: the writer goes on publishing (it
 * never waits), and a new process takes over the dead one's index. */
static void test_killed_reader(void) {
    enum { N = 10000 };
    char name[64];
    make_name(name, sizeof name, "deadreader");
    mrl_weight_store *w = NULL;
    CHECK_OK(mrl_weight_store_create(name, N, 1, &w));
    if (!w) return;
    static float buf[N];
    fill(buf, N, 0);
    CHECK_OK(mrl_weight_store_publish(w, buf, 0, 0));
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        mrl_weight_store *r = NULL;
        const float *p = NULL;
        char c = mrl_weight_store_open(name, N, 0, &r) == MRL_OK &&
                 mrl_weight_store_acquire(r, 0, 0, 5, &p, NULL, NULL) == MRL_OK;
        if (write(fds[1], &c, 1) != 1) _exit(2);
        for (;;) pause(); /* holds version 0 until killed */
    }
    CHECK(all_ready(fds[0], 1));
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    double t0 = mrl_time_now();
    for (int v = 1; v <= 100; v++) {
        fill(buf, N, v);
        CHECK_OK(mrl_weight_store_publish(w, buf, v, 0));
    }
    CHECK(mrl_time_now() - t0 < 5.0);
    mrl_weight_store *r = NULL;
    CHECK_OK(mrl_weight_store_open(name, N, 0, &r));
    if (r) check_acquire(r, 0, 100, N);
    mrl_weight_store_free(r);
    mrl_weight_store_free(w);
    CHECK(!shm_exists(name));
    close(fds[0]);
    close(fds[1]);
}

/* mrl_weights_bf16_delta: a version whose few elements change their bf16 value (and many change
 * only below it) gives exactly those, in order, with their new bf16 values; applying them to the
 * last version's bf16 gives this version's; past cap, the count and old16 still this version's. */
static void test_bf16_delta(void) {
    enum { N = 5000 };
    static float w[N];
    static uint16_t old16[N], ref[N];
    static uint32_t at[N];
    static uint16_t val[N];
    for (int i = 0; i < N; i++) w[i] = (float)((urand() - 0.5) * 0.1);
    mrl_convert_f32_to_bf16(w, old16, N);
    for (int i = 0; i < N; i++) w[i] *= 1.0f + 1e-5f; /* below a bf16 step for almost all */
    for (int i = 0; i < N; i += 97) w[i] += 0.01f;   /* a real change */
    mrl_convert_f32_to_bf16(w, ref, N);
    int64_t want = 0;
    for (int i = 0; i < N; i++) want += ref[i] != old16[i];
    static uint16_t before[N];
    memcpy(before, old16, sizeof before);
    int64_t k = mrl_weights_bf16_delta(old16, w, N, N, at, val);
    CHECK(k == want && k >= N / 97 && k < N / 10);
    for (int64_t j = 0; j < k; j++) {
        CHECK(j == 0 || at[j] > at[j - 1]);
        before[at[j]] = val[j];
    }
    CHECK(memcmp(before, ref, sizeof ref) == 0 && memcmp(old16, ref, sizeof ref) == 0);
    /* applied through copies that map the stream (two runs of it, swapped, one element skipped): the
     * changed elements' bf16 values where the copies put them, nothing else touched */
    static float dst[N];
    int64_t start[2] = {0, N / 2}, to[2] = {N / 2, 0}, count[2] = {N / 2 - 1, N - N / 2};
    for (int i = 0; i < N; i++) dst[i] = -7.0f;
    mrl_weights_bf16_apply(dst, start, to, count, 2, at, val, k);
    int ok = 1, skipped = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t pos = at[j];
        if (pos == N / 2 - 1) skipped++; /* (no copy holds it) */
        else ok = ok && dst[pos < N / 2 ? N / 2 + pos : pos - N / 2] == mrl_bf16_to_f32(val[j]);
    }
    int touched = 0;
    for (int i = 0; i < N; i++) touched += dst[i] != -7.0f;
    CHECK(ok && touched == k - skipped);
    CHECK(mrl_weights_bf16_delta(old16, w, N, N, at, val) == 0); /* the same version again: nothing */
    for (int i = 0; i < N; i++) w[i] += 0.01f;
    mrl_convert_f32_to_bf16(w, ref, N);
    CHECK(mrl_weights_bf16_delta(old16, w, N, 3, at, val) > 3 && memcmp(old16, ref, sizeof ref) == 0);
}

int main(void) {
    test_bf16_delta();
    test_killed_writer();
    test_killed_reader();
    int k = 0;
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++)
        for (int n_readers = 1; n_readers <= 2; n_readers++) test_processes(&configs[i], n_readers, k++);
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++)
        for (int n_readers = 1; n_readers <= 2; n_readers++) test_threads(&configs[i], n_readers);
    test_co_writers();
    test_wait_and_stop_flag();
    test_timeout_and_stop_request();
    test_errors();
    CHECK_DONE();
}
