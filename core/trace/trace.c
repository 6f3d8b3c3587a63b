/* The timeline: phases recorded in memory (a few per training step, so one
 * mutex is cheap enough) and written as Chrome trace-event JSON.
 *
 * A run also streams them (mrl_trace_stream): each event is appended to a
 * file with one write(2) as it is recorded, so that a rank killed mid-run
 * (SIGKILL, the OOM killer, a lost node) still leaves its timeline up to
 * that moment; `moonrl trace merge` joins such files. Where CUDA is built
 * each phase is also an NVTX range on the calling thread, so Nsight Systems
 * shows the same phases above the GPU's kernels. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef MRL_HAVE_CUDA
#include <nvtx3/nvToolsExt.h> /* header-only: nvtx3 finds Nsight's collector at run time, else is a no-op */
#endif
#include "base/log.h"
#include "moonrl/loop.h"
#include "moonrl/trace.h"
#include "moonrl/fs.h"
#include "base/error.h"

typedef struct trace_event {
    char phase;     /* 'B' begin, 'E' end, 'C' counter, 'X' complete (value: its duration in us) */
    int tid;
    double ts_us;
    double value;
    char *name;
} trace_event;

typedef struct thread_name {
    int tid;
    char *name;
} thread_name;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int enabled;
static int trace_rank;
static double t0;
static double t0_unix_us; /* the wall clock at t0: merges the traces of several processes (moonrl.train.trace.merge) */
static trace_event *events;
static int64_t count, cap;
static thread_name *names;
static int name_count;
static int stream_fd = -1; /* the file events are appended to as they happen, or -1 */
static char *stream_path;
static _Atomic int next_tid = 1;
static _Thread_local int my_tid;

/* A growable text buffer for the JSON. */
typedef struct text {
    char *data;
    size_t len, cap;
    int failed;
} text;

static void put(text *t, const char *s, size_t n) {
    if (t->failed) return;
    if (t->len + n + 1 > t->cap) {
        size_t c = t->cap ? t->cap * 2 : 256; /* one event a line when streaming: start small */
        while (c < t->len + n + 1) c *= 2;
        char *grown = realloc(t->data, c);
        if (!grown) {
            t->failed = 1;
            return;
        }
        t->data = grown;
        t->cap = c;
    }
    memcpy(t->data + t->len, s, n);
    t->len += n;
    t->data[t->len] = 0;
}

static void putf(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(text *t, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) put(t, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

static void put_json_string(text *t, const char *s) {
    put(t, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char esc[2] = {'\\', (char)c};
            put(t, esc, 2);
        } else if (c < 0x20) {
            putf(t, "\\u%04x", c);
        } else {
            put(t, (const char *)&c, 1);
        }
    }
    put(t, "\"", 1);
}

static void put_event(text *t, const trace_event *e);
static void put_thread_name(text *t, const thread_name *n);
static void stream_put(text *t);

static int current_tid(void) {
    if (!my_tid) my_tid = atomic_fetch_add(&next_tid, 1);
    return my_tid;
}

static void stream_close_locked(void) {
    if (stream_fd >= 0) close(stream_fd);
    stream_fd = -1;
    free(stream_path);
    stream_path = NULL;
}

static void clear_locked(void) {
    stream_close_locked();
    for (int64_t i = 0; i < count; i++) free(events[i].name);
    free(events);
    events = NULL;
    count = cap = 0;
}

void mrl_trace_enable(int rank) {
    pthread_mutex_lock(&lock);
    clear_locked();
    trace_rank = rank;
    t0 = mrl_time_now();
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    t0_unix_us = (double)wall.tv_sec * 1e6 + wall.tv_nsec / 1e3;
    atomic_store(&enabled, 1);
    pthread_mutex_unlock(&lock);
}

void mrl_trace_disable(void) {
    atomic_store(&enabled, 0);
    pthread_mutex_lock(&lock);
    stream_close_locked();
    pthread_mutex_unlock(&lock);
}

static void record_at(char phase, const char *name, double value, double ts) {
    int tid = current_tid();
    char *copy = strdup(name);
    if (!copy) return; /* out of memory: drop the event rather than fail the run */
    pthread_mutex_lock(&lock);
    if (count == cap) {
        int64_t grown_cap = cap ? cap * 2 : 1024;
        trace_event *grown = realloc(events, (size_t)grown_cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&lock);
            free(copy);
            return;
        }
        events = grown;
        cap = grown_cap;
    }
    events[count++] = (trace_event){phase, tid, ts, value, copy};
    if (stream_fd >= 0) { /* under the lock: the file's lines are in the order of the events */
        text line = {0};
        put_event(&line, &events[count - 1]);
        stream_put(&line);
    }
    pthread_mutex_unlock(&lock);
}

/* NVTX ranges are per thread and nest, as the begin/end pairs of one track do. */
static void record(char phase, const char *name, double value) {
    if (!atomic_load(&enabled) || !name) return;
    record_at(phase, name, value, (mrl_time_now() - t0) * 1e6);
}

void mrl_trace_complete(const char *name, double start_s, double dur_s) {
    if (!atomic_load(&enabled) || !name) return;
    record_at('X', name, dur_s > 0 ? dur_s * 1e6 : 0, (start_s - t0) * 1e6);
}

void mrl_trace_begin(const char *name) {
#ifdef MRL_HAVE_CUDA
    if (name && atomic_load(&enabled)) nvtxRangePushA(name);
#endif
    record('B', name, 0);
}
void mrl_trace_end(const char *name) {
#ifdef MRL_HAVE_CUDA
    if (name && atomic_load(&enabled)) nvtxRangePop();
#endif
    record('E', name, 0);
}
void mrl_trace_counter(const char *name, double value) { record('C', name, value); }

void mrl_trace_thread_name(const char *name) {
    if (!name) return;
    int tid = current_tid();
    pthread_mutex_lock(&lock);
    for (int i = 0; i < name_count; i++)
        if (names[i].tid == tid) {
            free(names[i].name);
            names[i].name = strdup(name);
            if (stream_fd >= 0) { /* a later metadata event renames the track */
                text line = {0};
                put_thread_name(&line, &names[i]);
                stream_put(&line);
            }
            pthread_mutex_unlock(&lock);
            return;
        }
    thread_name *grown = realloc(names, (size_t)(name_count + 1) * sizeof *grown);
    if (grown) {
        names = grown;
        names[name_count++] = (thread_name){tid, strdup(name)};
        if (stream_fd >= 0) {
            text line = {0};
            put_thread_name(&line, &names[name_count - 1]);
            stream_put(&line);
        }
    }
    pthread_mutex_unlock(&lock);
}

int64_t mrl_trace_event_count(void) {
    pthread_mutex_lock(&lock);
    int64_t n = count;
    pthread_mutex_unlock(&lock);
    return n;
}

/* The first lines of a trace: what mrl_trace_write and the stream both begin with. */
static void put_header(text *t) {
    putf(t, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":%d,\"t0_unix_us\":%.0f},\"traceEvents\":[\n",
         trace_rank, t0_unix_us);
    putf(t, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"rank %d\"}}", trace_rank,
         trace_rank);
}

/* One event, as ",\n{...}": one line each, which a reader of a cut file relies on. */
static void put_thread_name(text *t, const thread_name *n) {
    putf(t, ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":", trace_rank, n->tid);
    put_json_string(t, n->name ? n->name : "");
    put(t, "}}", 2);
}

static void put_event(text *t, const trace_event *e) {
    put(t, ",\n{\"name\":", 10);
    put_json_string(t, e->name);
    putf(t, ",\"ph\":\"%c\",\"ts\":%.3f,\"pid\":%d,\"tid\":%d", e->phase, e->ts_us, trace_rank, e->tid);
    if (e->phase == 'X') putf(t, ",\"dur\":%.3f", e->value);
    if (e->phase == 'C') {
        put(t, ",\"args\":{", 9);
        put_json_string(t, e->name);
        putf(t, ":%.17g}", e->value);
    }
    put(t, "}", 1);
}

/* Append t to the stream with write(2) (no stdio buffer a SIGKILL would lose) and free it. A
 * failing write (a full disk) stops the stream with one warning: the run and the in-memory
 * trace go on. Called with the lock held. */
static void stream_put(text *t) {
    size_t done = 0;
    while (!t->failed && done < t->len) {
        ssize_t n = write(stream_fd, t->data + done, t->len - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            mrl_logf(MRL_LOG_WARN, "%s: cannot append to the trace (%s); it is no longer streamed", stream_path,
                     n < 0 ? strerror(errno) : "short write");
            stream_close_locked();
            break;
        }
        done += (size_t)n;
    }
    free(t->data);
}

mrl_status mrl_trace_stream(const char *path) {
    if (!path) return mrl_set_error(MRL_ERR_INVALID, "trace stream: no path");
    pthread_mutex_lock(&lock);
    if (!atomic_load(&enabled)) {
        pthread_mutex_unlock(&lock);
        return mrl_set_error(MRL_ERR_INVALID, "%s: the trace is not recording (mrl_trace_enable first)", path);
    }
    stream_close_locked();
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        int err = errno;
        pthread_mutex_unlock(&lock);
        return mrl_set_error(MRL_ERR_IO, "%s: cannot create the trace stream: %s", path, strerror(err));
    }
    stream_fd = fd;
    stream_path = strdup(path);
    text t = {0}; /* what was recorded before the stream began, then each event as it comes */
    put_header(&t);
    for (int i = 0; i < name_count; i++) put_thread_name(&t, &names[i]);
    for (int64_t i = 0; i < count; i++) put_event(&t, &events[i]);
    stream_put(&t);
    int ok = stream_fd >= 0;
    pthread_mutex_unlock(&lock);
    if (!ok) return mrl_set_error(MRL_ERR_IO, "%s: cannot write the trace stream", path);
    return MRL_OK;
}

mrl_status mrl_trace_write(const char *path) {
    text t = {0};
    pthread_mutex_lock(&lock);
    put_header(&t);
    for (int i = 0; i < name_count; i++) put_thread_name(&t, &names[i]);
    for (int64_t i = 0; i < count; i++) put_event(&t, &events[i]);
    pthread_mutex_unlock(&lock);
    put(&t, "\n]}\n", 4);
    if (t.failed) {
        free(t.data);
        return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory writing the trace", path);
    }
    mrl_status st = mrl_fs_write_file(path, t.data, t.len);
    free(t.data);
    return st;
}
