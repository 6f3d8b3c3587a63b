/* The timeline's JSON and the TensorBoard event file format. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "moonrl/trace.h"
#include "io/json.h"
#include "check.h"

static void *worker(void *arg) {
    (void)arg;
    mrl_trace_thread_name("worker \"quoted\"");
    for (int i = 0; i < 100; i++) {
        mrl_trace_begin("work");
        mrl_trace_end("work");
    }
    return NULL;
}

static void test_timeline(void) {
    mrl_trace_begin("ignored while disabled");
    mrl_trace_enable(3);
    CHECK(mrl_trace_event_count() == 0);
    mrl_trace_thread_name("main");
    mrl_trace_begin("step");
    mrl_trace_begin("generate");
    mrl_trace_end("generate");
    mrl_trace_counter("reward", 0.25);
    mrl_trace_end("step");
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_join(t, NULL);
    CHECK(mrl_trace_event_count() == 5 + 200);
    char path[] = "/tmp/moonrl_trace_XXXXXX";
    close(mkstemp(path));
    CHECK_OK(mrl_trace_write(path));
    mrl_json_doc *doc = NULL;
    CHECK_OK(mrl_json_parse_file(path, &doc));
    mrl_json *events = mrl_json_get(mrl_json_root(doc), "traceEvents");
    CHECK(events && events->type == MRL_JSON_ARRAY);
    int begins = 0, ends = 0, counters = 0, meta = 0, thread_named = 0;
    double last_ts = -1;
    int ordered = 1;
    for (size_t i = 0; events && i < events->length; i++) {
        mrl_json *e = events->items[i];
        const char *ph = mrl_json_get_string(e, "ph");
        int64_t pid = -1;
        CHECK(mrl_json_get_int(e, "pid", &pid) && pid == 3);
        if (!strcmp(ph, "M")) {
            meta++;
            mrl_json *args = mrl_json_get(e, "args");
            if (!strcmp(mrl_json_get_string(args, "name"), "worker \"quoted\"")) thread_named = 1;
            continue;
        }
        double ts;
        CHECK(mrl_json_get_number(e, "ts", &ts));
        if (ts < last_ts) ordered = 0;
        last_ts = ts;
        begins += !strcmp(ph, "B");
        ends += !strcmp(ph, "E");
        if (!strcmp(ph, "C")) {
            counters++;
            double v = 0;
            CHECK(mrl_json_get_number(mrl_json_get(e, "args"), "reward", &v) && v == 0.25);
        }
    }
    CHECK(begins == 102 && ends == 102 && counters == 1);
    CHECK(meta == 3 && thread_named);
    CHECK(ordered);
    mrl_json_free(doc);
    remove(path);
    mrl_trace_disable();
    mrl_trace_begin("after");
    CHECK(mrl_trace_event_count() == 205);
    CHECK(mrl_trace_write("/no/such/dir/trace.json") == MRL_ERR_IO);
}

static char *slurp(const char *path, long *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = calloc((size_t)*len + 8, 1);
    if (fread(buf, 1, (size_t)*len, f) != (size_t)*len) *len = -1;
    fclose(f);
    return buf;
}

/* The stream: what was recorded before it began, then each event as it comes, in the written
 * trace's format without its closing "]}"; a SIGKILL loses none of it. */
static void test_stream(void) {
    char spath[] = "/tmp/moonrl_stream_XXXXXX", wpath[] = "/tmp/moonrl_whole_XXXXXX";
    close(mkstemp(spath));
    close(mkstemp(wpath));
    CHECK(mrl_trace_stream(spath) == MRL_ERR_INVALID); /* not recording */
    mrl_trace_enable(2);
    mrl_trace_thread_name("main");
    mrl_trace_begin("before the stream");
    CHECK(mrl_trace_stream("/no/such/dir/trace-rank-2.json") == MRL_ERR_IO);
    CHECK_OK(mrl_trace_stream(spath));
    mrl_trace_end("before the stream");
    mrl_trace_counter("loss", 1.5);
    CHECK_OK(mrl_trace_write(wpath));
    long slen = 0, wlen = 0;
    char *streamed = slurp(spath, &slen), *whole = slurp(wpath, &wlen);
    /* the same text, less the closing line */
    CHECK(streamed && whole && wlen == slen + 4 && !memcmp(streamed, whole, (size_t)slen) &&
          !strcmp(whole + slen, "\n]}\n"));
    free(streamed);
    free(whole);
    mrl_trace_disable(); /* closes the stream: nothing more is appended */
    mrl_trace_begin("after");
    long after = 0;
    free(slurp(spath, &after));
    CHECK(after == slen);

    /* a child killed mid-run leaves every event it recorded */
    pid_t pid = fork();
    if (pid == 0) {
        mrl_trace_enable(1);
        if (mrl_trace_stream(spath) != MRL_OK) _exit(3);
        for (int i = 0; i < 50; i++) {
            mrl_trace_begin("step");
            mrl_trace_end("step");
        }
        mrl_trace_begin("generate"); /* never ended: the kill comes first */
        kill(getpid(), SIGKILL);
        _exit(4);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    long klen = 0;
    char *killed = slurp(spath, &klen);
    int steps = 0;
    for (const char *p = killed; p && (p = strstr(p, "\n{\"name\":\"step\",\"ph\":")); p++) steps++;
    CHECK(steps == 100);
    CHECK(killed && klen > 0 && killed[klen - 1] == '}' && strstr(killed, "\"name\":\"generate\",\"ph\":\"B\""));
    free(killed);
    remove(spath);
    remove(wpath);
}

/* An independent CRC32C (bitwise) and the standard check value. */
static uint32_t crc32c_bitwise(const uint8_t *d, size_t n) {
    uint32_t c = ~0u;
    for (size_t i = 0; i < n; i++) {
        c ^= d[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    }
    return ~c;
}

static uint32_t masked(const uint8_t *d, size_t n) {
    uint32_t c = crc32c_bitwise(d, n);
    return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

static void test_tensorboard(void) {
    CHECK(crc32c_bitwise((const uint8_t *)"123456789", 9) == 0xE3069283u);
    char dir[] = "/tmp/moonrl_tb_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char sub[64];
    snprintf(sub, sizeof sub, "%s/a/b", dir);
    mrl_tb_writer *w;
    CHECK_OK(mrl_tb_open(sub, &w)); /* creates the folders */
    CHECK_OK(mrl_tb_scalar(w, "reward/mean", 0.5, 7));
    CHECK_OK(mrl_tb_scalar(w, "kl", -1.25, 8));
    CHECK_OK(mrl_tb_flush(w));
    char path[512];
    snprintf(path, sizeof path, "%s", mrl_tb_path(w));
    mrl_tb_close(w);
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    uint8_t buf[4096];
    size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
    if (f) fclose(f);
    /* walk the records: each length and payload CRC must check out */
    size_t at = 0;
    int records = 0, found_version = 0, found_reward = 0, found_kl = 0;
    while (at + 12 <= n) {
        uint64_t len;
        uint32_t len_crc, data_crc;
        memcpy(&len, buf + at, 8);
        memcpy(&len_crc, buf + at + 8, 4);
        CHECK(len_crc == masked(buf + at, 8));
        CHECK(at + 12 + len + 4 <= n);
        if (at + 12 + len + 4 > n) break;
        const uint8_t *data = buf + at + 12;
        memcpy(&data_crc, data + len, 4);
        CHECK(data_crc == masked(data, len));
        if (memmem(data, len, "brain.Event:2", 13)) found_version = 1;
        const uint8_t *tag = memmem(data, len, "reward/mean", 11);
        if (tag) {
            float v;
            CHECK(tag[11] == 0x15); /* simple_value: field 2, fixed32 */
            memcpy(&v, tag + 12, 4);
            CHECK(v == 0.5f);
            found_reward = 1;
            CHECK(data[0] == 0x09 && data[9] == 0x10 && data[10] == 7); /* wall_time (fixed64), then step = 7 */
        }
        if (memmem(data, len, "kl", 2)) found_kl = 1;
        at += 12 + len + 4;
        records++;
    }
    CHECK(at == n);
    CHECK(records == 3 && found_version && found_reward && found_kl);
    remove(path);
    CHECK(mrl_tb_open("/proc/no_such_dir/tb", &w) == MRL_ERR_IO);
}

int main(void) {
    test_timeline();
    test_stream();
    test_tensorboard();
    CHECK_DONE();
}
