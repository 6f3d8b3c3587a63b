/* Status codes, logging, the memory layer, devices, parallel-for. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
#include <string.h>
#include "runtime/device_internal.h"
#include "base/cpu.h"
#include "base/log.h"
#include "base/mem.h"
#include "moonrl/mem.h"
#include "moonrl/ops.h"
#include "base/parallel.h"
#include "moonrl/runtime.h"
#include "check.h"
#include "base/error.h"

static void test_errors(void) {
    mrl_clear_error();
    CHECK(strcmp(mrl_last_error(), "") == 0);
    CHECK(mrl_set_error(MRL_ERR_IO, "file %s: %d", "x.bin", 7) == MRL_ERR_IO);
    CHECK(strcmp(mrl_last_error(), "file x.bin: 7") == 0);
    CHECK(strcmp(mrl_status_name(MRL_ERR_FORMAT), "MRL_ERR_FORMAT") == 0);
    CHECK(strcmp(mrl_status_name((mrl_status)99), "MRL_ERR_UNKNOWN") == 0);
    /* a context in front of the cause a lower layer gave (the memory layer's refusal) */
    mrl_set_error(MRL_ERR_NOMEM, "grads asks for %d MiB", 8);
    CHECK(mrl_wrap_error(MRL_ERR_NOMEM, "model: the gradients of %d parameters", 2) == MRL_ERR_NOMEM);
    CHECK(strcmp(mrl_last_error(), "model: the gradients of 2 parameters: grads asks for 8 MiB") == 0);
    mrl_clear_error();
    mrl_wrap_error(MRL_ERR_NOMEM, "no cause");
    CHECK(strcmp(mrl_last_error(), "no cause") == 0);
    char longer[1500];
    memset(longer, 'x', sizeof longer - 1);
    longer[sizeof longer - 1] = 0;
    mrl_set_error(MRL_ERR_NOMEM, "%s", longer);
    mrl_wrap_error(MRL_ERR_NOMEM, "ctx"); /* cut to the buffer, still a string */
    CHECK(strncmp(mrl_last_error(), "ctx: xxx", 8) == 0 && strlen(mrl_last_error()) == 1023);
}

static void test_log(void) {
    CHECK(mrl_log_level_parse("debug") == MRL_LOG_DEBUG);
    CHECK(mrl_log_level_parse("loud") == -1);
    CHECK(mrl_log_level_parse(NULL) == -1);
}

/* 1 when the mapping holding p carries the huge-page advice (VmFlags "hg"
 * in /proc/self/smaps), 0 when not, -1 when that cannot be read. Whether
 * the kernel then gives huge pages depends on its THP setting and on free
 * memory, so the advice is what is checked. */
static int advised_huge(const void *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512];
    int inside = 0, found = -1;
    while (found < 0 && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char dash;
        if (sscanf(line, "%lx%c%lx ", &lo, &dash, &hi) == 3 && dash == '-')
            inside = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        else if (inside && strncmp(line, "VmFlags:", 8) == 0)
            found = strstr(line, " hg") != NULL;
    }
    fclose(f);
    return found;
}

static void test_mem(void) {
    mrl_mem_stats before, during, after;
    mrl_mem_get_stats(&before);
    float *a = mrl_mem_alloc(1000 * sizeof(float), MRL_MEM_PARAMS);
    char *b = mrl_mem_alloc(333, MRL_MEM_KV_CACHE);
    CHECK(a && b);
    CHECK(((uintptr_t)a % 64) == 0 && ((uintptr_t)b % 64) == 0);
    CHECK(a[999] == 0.0f && b[332] == 0); /* zero-filled */
    mrl_mem_get_stats(&during);
    CHECK(during.current[MRL_MEM_PARAMS] - before.current[MRL_MEM_PARAMS] == 4000);
    CHECK(during.current[MRL_MEM_KV_CACHE] - before.current[MRL_MEM_KV_CACHE] == 333);
    CHECK(during.total - before.total == 4333);
    mrl_mem_free(a);
    mrl_mem_free(b);
    mrl_mem_get_stats(&after);
    CHECK(after.total == before.total);
    CHECK(after.peak[MRL_MEM_PARAMS] >= before.current[MRL_MEM_PARAMS] + 4000);
    mrl_mem_reset_peak();
    mrl_mem_get_stats(&after);
    CHECK(after.total_peak == after.total);
    /* an absurd request fails with a message, not a crash */
    CHECK(mrl_mem_alloc((size_t)1 << 60, MRL_MEM_OTHER) == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), "too large");
    /* more than the machine (or container) has: refused before the zero fill, naming the
     * category and both sizes (the kernel's overcommit would promise it and kill us later) */
    int64_t avail = mrl_mem_available();
    CHECK(avail > 0);
    if (avail > 0 && avail < ((int64_t)1 << 45)) {
        CHECK(mrl_mem_alloc((size_t)avail + ((size_t)1 << 30), MRL_MEM_KV_CACHE) == NULL);
        CHECK_STR_CONTAINS(mrl_last_error(), "kv_cache asks for");
        CHECK_STR_CONTAINS(mrl_last_error(), "GiB of memory available");
    }
    /* the resident set and its peak; a reset brings the peak down to what is resident now */
    int64_t rss = mrl_mem_rss();
    CHECK(rss > 0 && mrl_mem_rss_peak() >= rss);
    size_t big = (size_t)96 << 20;
    char *touch = mrl_mem_alloc(big, MRL_MEM_ACTIVATIONS); /* zero-filled: resident */
    CHECK(touch != NULL);
    CHECK(mrl_mem_rss_peak() >= rss + (int64_t)big / 2);
    /* a large block starts (its 64-byte header) on a 2 MiB boundary and is
     * advised into transparent huge pages; a small one is not */
    char *weights = mrl_mem_alloc(big, MRL_MEM_PARAMS), *small = mrl_mem_alloc(1000, MRL_MEM_PARAMS);
    CHECK(weights != NULL && weights[big - 1] == 0 && small != NULL);
    CHECK(((uintptr_t)weights - 64) % ((uintptr_t)2 << 20) == 0);
    if (advised_huge(weights) >= 0) {
        CHECK(advised_huge(weights) == 1);
        CHECK(advised_huge(weights + big / 2) == 1);
        CHECK(advised_huge(small) == 0);
    }
    mrl_mem_free(weights);
    mrl_mem_free(small);
    mrl_mem_free(touch);
    mrl_mem_reset_rss_peak();
    /* down to what is resident now (under ASan the freed block stays resident: its quarantine) */
    CHECK(mrl_mem_rss_peak() <= mrl_mem_rss() + ((int64_t)4 << 20));
    CHECK(strcmp(mrl_mem_category_name(MRL_MEM_OPTIM), "optim") == 0);
}

/* A per-process budget (run.memory_budget_mb): an allocation of any size that
 * would take what the process holds through moonrl past it fails at once,
 * naming the budget; at or under it, or with the budget off, it is made. */
static void test_mem_budget(void) {
    mrl_mem_stats s;
    mrl_mem_get_stats(&s);
    CHECK(mrl_mem_budget() == 0);
    int64_t room = (int64_t)1 << 20;
    CHECK_OK(mrl_mem_set_budget(s.total + room, "run.memory_budget_mb"));
    CHECK(mrl_mem_budget() == s.total + room);
    char *fits = mrl_mem_alloc((size_t)room - 4096, MRL_MEM_GRADS); /* under the budget */
    CHECK(fits != NULL);
    mrl_clear_error();
    CHECK(mrl_mem_alloc(8192, MRL_MEM_OPTIM) == NULL); /* small, but past it */
    CHECK_STR_CONTAINS(mrl_last_error(), "optim asks for");
    CHECK_STR_CONTAINS(mrl_last_error(), "past run.memory_budget_mb (");
    char *exact = mrl_mem_alloc(4096, MRL_MEM_OPTIM); /* exactly to the budget */
    CHECK(exact != NULL);
    CHECK(mrl_mem_alloc(1, MRL_MEM_OTHER) == NULL);
    mrl_mem_free(exact);
    mrl_mem_free(fits);
    char *again = mrl_mem_alloc((size_t)room, MRL_MEM_GRADS); /* freed bytes count no more */
    CHECK(again != NULL);
    mrl_mem_free(again);
    /* a large allocation is refused by the budget before the memory available is read */
    CHECK(mrl_mem_alloc((size_t)80 << 20, MRL_MEM_PARAMS) == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), "params asks for 80.0 MiB");
    CHECK_STR_CONTAINS(mrl_last_error(), "run.memory_budget_mb");
    CHECK(mrl_mem_set_budget(-1, NULL) == MRL_ERR_INVALID);
    CHECK_OK(mrl_mem_set_budget(room, NULL)); /* no name: said plainly */
    CHECK(mrl_mem_alloc((size_t)room + 1, MRL_MEM_OTHER) == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), "past the memory budget");
    CHECK_OK(mrl_mem_set_budget(0, NULL)); /* off */
    char *big = mrl_mem_alloc((size_t)80 << 20, MRL_MEM_PARAMS);
    CHECK(big != NULL);
    mrl_mem_free(big);
    /* the lifetime peak of the resident set outlives a reset of VmHWM */
    int64_t peak = mrl_mem_rss_peak_lifetime();
    CHECK(peak >= mrl_mem_rss_peak() && peak >= mrl_mem_rss());
    mrl_mem_reset_rss_peak();
    CHECK(mrl_mem_rss_peak_lifetime() >= peak);
}

/* Regions (base/mem.h): reserved address space with memory only where pinned. Pins nest and
 * count whole 4 KiB pages under their category; a page's content lives while any pin holds it and
 * reads zero once pinned again; the budget refuses a pin past it, pinning nothing; an unpinned page
 * faults when read. */
static void test_region(void) {
    mrl_mem_stats s0, s1;
    mrl_mem_get_stats(&s0);
    mrl_mem_region *r = NULL;
    CHECK(mrl_mem_region_create(0, MRL_MEM_PARAMS, &r) == MRL_ERR_INVALID && !r);
    CHECK_OK(mrl_mem_region_create((int64_t)64 << 20, MRL_MEM_PARAMS, &r));
    if (!r) return;
    char *b = mrl_mem_region_base(r);
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_PARAMS] == s0.current[MRL_MEM_PARAMS]); /* reserved: nothing held */
    CHECK_OK(mrl_mem_region_pin(r, 100, 5000)); /* pages 0 and 1 */
    CHECK(mrl_mem_region_resident(r) == 8192);
    memset(b + 100, 7, 4900);
    CHECK_OK(mrl_mem_region_pin(r, 4096, 12288)); /* page 1 again, page 2 */
    CHECK(mrl_mem_region_resident(r) == 12288);
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_PARAMS] - s0.current[MRL_MEM_PARAMS] == 12288);
    mrl_mem_region_unpin(r, 100, 5000); /* page 0 goes; page 1 still held by the second pin */
    CHECK(mrl_mem_region_resident(r) == 8192);
    CHECK(b[4096] == 7 && b[5000 - 1] == 7);
    CHECK_OK(mrl_mem_region_pin(r, 0, 10)); /* page 0 again: zero */
    CHECK(b[100] == 0);
    mrl_mem_region_unpin(r, 0, 10);
    mrl_mem_region_unpin(r, 4096, 12288);
    CHECK(mrl_mem_region_resident(r) == 0);
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_PARAMS] == s0.current[MRL_MEM_PARAMS]);
    CHECK(mrl_mem_region_pin(r, -1, 10) == MRL_ERR_INVALID && mrl_mem_region_pin(r, 0, (int64_t)65 << 20) == MRL_ERR_INVALID);
    /* the budget: a pin past it is refused whole, naming the budget */
    CHECK_OK(mrl_mem_set_budget(s1.total + ((int64_t)1 << 20), "run.memory_budget_mb"));
    CHECK(mrl_mem_region_pin(r, 0, (int64_t)2 << 20) == MRL_ERR_NOMEM);
    CHECK_STR_CONTAINS(mrl_last_error(), "run.memory_budget_mb");
    CHECK(mrl_mem_region_resident(r) == 0);
    CHECK_OK(mrl_mem_region_pin(r, 0, (int64_t)1 << 19));
    CHECK_OK(mrl_mem_set_budget(0, NULL));
    /* an unpinned page faults when read (in a child) */
    mrl_mem_region_unpin(r, 0, (int64_t)1 << 19);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        volatile char x = b[0];
        (void)x;
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    /* a fault: SIGSEGV (under ASan its report and a failing exit) */
    CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV) || (WIFEXITED(status) && WEXITSTATUS(status) != 0));
    CHECK_OK(mrl_mem_region_pin(r, (int64_t)32 << 20, (int64_t)33 << 20));
    mrl_mem_region_free(r); /* what it held goes with it */
    mrl_mem_get_stats(&s1);
    CHECK(s1.current[MRL_MEM_PARAMS] == s0.current[MRL_MEM_PARAMS]);
}

static void test_device(void) {
    mrl_device d;
    CHECK_OK(mrl_device_parse("cpu", &d));
    CHECK(d.kind == MRL_DEVICE_CPU);
    CHECK_OK(mrl_device_parse("cuda:3", &d));
    CHECK(d.kind == MRL_DEVICE_CUDA && d.index == 3);
    CHECK(mrl_device_parse("cuda:x", &d) == MRL_ERR_INVALID);
    CHECK(mrl_device_parse("tpu", &d) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "tpu");

    mrl_device cpu = {MRL_DEVICE_CPU, 0};
    mrl_buffer a, b;
    CHECK_OK(mrl_buffer_alloc(cpu, 64, MRL_MEM_OTHER, &a));
    CHECK_OK(mrl_buffer_alloc(cpu, 64, MRL_MEM_OTHER, &b));
    memset(a.data, 7, 64);
    CHECK_OK(mrl_buffer_copy(&b, 8, &a, 0, 32, NULL));
    CHECK(((char *)b.data)[8] == 7 && ((char *)b.data)[39] == 7 && ((char *)b.data)[40] == 0);
    CHECK(mrl_buffer_copy(&b, 40, &a, 0, 32, NULL) == MRL_ERR_INVALID); /* out of bounds */
    CHECK_OK(mrl_buffer_fill_zero(&a, NULL));
    CHECK(((char *)a.data)[5] == 0);
    mrl_buffer_free(&a);
    mrl_buffer_free(&b);

    /* a CUDA device that is not there is an error, never a crash */
    mrl_device gpu = {MRL_DEVICE_CUDA, mrl_device_cuda_count()};
    CHECK(mrl_buffer_alloc(gpu, 64, MRL_MEM_OTHER, &a) != MRL_OK);
    char desc[128];
    CHECK_OK(mrl_device_describe(cpu, desc, sizeof desc));
    CHECK(strcmp(desc, "cpu") == 0);
    mrl_stream *s;
    CHECK_OK(mrl_stream_create(cpu, &s));
    CHECK_OK(mrl_stream_sync(s));
    mrl_stream_destroy(s);
}

typedef struct { int *hits; } mark_ctx;
static void mark_range(void *vctx, int64_t begin, int64_t end) {
    mark_ctx *ctx = vctx;
    for (int64_t i = begin; i < end; i++) ctx->hits[i]++;
}

static void test_parallel(void) {
    enum { N = 100003 };
    int *hits = calloc(N, sizeof(int));
    mark_ctx ctx = {hits};
    mrl_parallel_for(N, 1, mark_range, &ctx);
    int all_once = 1;
    for (int i = 0; i < N; i++) all_once &= hits[i] == 1;
    CHECK(all_once); /* every index exactly once */
    mrl_parallel_for(0, 1, mark_range, &ctx);
    mrl_parallel_for(-5, 1, mark_range, &ctx);
    CHECK(hits[0] == 1);
    free(hits);

    /* the sum is the same on 1 thread and on all of them, bit for bit */
    enum { M = 1000000 };
    float *x = malloc(M * sizeof(float));
    double exact = 0;
    for (int i = 0; i < M; i++) {
        x[i] = (float)((i % 97) - 48) * 0.125f;
        exact += x[i];
    }
    double s_all, s_one;
    CHECK_OK(mrl_ops_sum_f32(x, M, &s_all));
    int threads = mrl_parallel_threads();
    mrl_parallel_set_threads(1);
    CHECK_OK(mrl_ops_sum_f32(x, M, &s_one));
    mrl_parallel_set_threads(threads);
    CHECK(s_all == s_one);
    CHECK_NEAR(s_all, exact, 1e-6);
    CHECK(mrl_ops_sum_f32(NULL, 5, &s_one) == MRL_ERR_INVALID);
    free(x);
}

/* Thread counts outside [1, mrl_parallel_max_threads()] are clamped or
 * ignored (libgomp aborts when it cannot start the threads asked for). */
static void test_thread_limits(void) {
    int max = mrl_parallel_max_threads(), saved = mrl_parallel_threads();
    CHECK(max == 1024);
    mrl_parallel_set_threads(100000);
    CHECK(mrl_parallel_threads() == max);
    mrl_parallel_set_threads(max);
    CHECK(mrl_parallel_threads() == max);
    enum { N = 8 };
    int hits[N] = {0};
    mark_ctx ctx = {hits};
    mrl_parallel_for(N, 1, mark_range, &ctx); /* a loop still runs (on N threads) */
    CHECK(hits[0] == 1 && hits[N - 1] == 1);
    const char *env = getenv("MOONRL_THREADS");
    char *old = env ? strdup(env) : NULL;
    unsetenv("MOONRL_THREADS");
    mrl_parallel_set_threads(0);
    int fallback = mrl_parallel_threads(); /* the cores, at most max */
    CHECK(fallback >= 1 && fallback <= max);
    const char *cases[][2] = {{"100000", "max"}, {"99999999999999999999", "max"}, {"7", "7"}, {"-3", "default"},
                              {"abc", "default"}, {"4x", "default"}, {"0", "default"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        setenv("MOONRL_THREADS", cases[i][0], 1);
        mrl_parallel_set_threads(0); /* read the environment again */
        int want = strcmp(cases[i][1], "max") == 0 ? max : strcmp(cases[i][1], "7") == 0 ? 7 : fallback;
        CHECK(mrl_parallel_threads() == want);
    }
    if (old) setenv("MOONRL_THREADS", old, 1);
    else unsetenv("MOONRL_THREADS");
    free(old);
    mrl_parallel_set_threads(saved);
}

static void test_runtime_info(void) {
    CHECK(strlen(mrl_version()) > 0);
    CHECK(strlen(mrl_git_revision()) > 0);
    CHECK_STR_CONTAINS(mrl_backends(), "cpu");
    CHECK(mrl_cpu_has("no-such-feature") == 0);
    CHECK(strlen(mrl_cpu_features()) > 0);
    /* one probe: what version prints and what the dispatchers read agree */
    const mrl_cpu_info *c = mrl_cpu();
    CHECK(c == mrl_cpu());
    CHECK(mrl_cpu_has("avx2") == c->avx2 && mrl_cpu_has("avx512bf16") == c->avx512bf16 &&
          mrl_cpu_has("amx_bf16") == c->amx_bf16);
    CHECK(!c->amx_tiles || c->amx_bf16); /* tiles granted only on a CPU with AMX */
    CHECK((strstr(mrl_cpu_features(), "avx512f") != NULL) == c->avx512f);
}

int main(void) {
    CHECK_OK(mrl_init());
    test_errors();
    test_log();
    test_mem();
    test_mem_budget();
    test_region();
    test_device();
    test_parallel();
    test_thread_limits();
    test_runtime_info();
    mrl_shutdown();
    CHECK_DONE();
}
