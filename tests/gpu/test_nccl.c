/* The NCCL communicator (moonrl/dist_nccl.h) against the CPU: all-reduce
 * (sum, mean, max, min over f32; bf16, f64, i64, u8), broadcast, all-gather,
 * reduce-scatter on fresh random buffers of several sizes, and over uneven
 * pieces (each rank's mrl_dist_shard of a buffer, the sharded training
 * state's); an all-to-all-v (context parallel's); bad arguments;
 * the wait stream; a deadline that passes (abort, broken, later calls fail
 * at once). Written for any world size (each rank's inputs derive from the
 * seed and its rank, so every rank computes the expected result alone);
 * meson test runs it at world size 1 on device 0. Skips (exit 77) where no
 * GPU is visible.
 *
 * `test_nccl --bench`: all-reduce bus bandwidth, 1 MiB .. 256 MiB of f32
 * (at world size 1 the bus bandwidth is 0 by definition, 2 (n - 1) / n of
 * the algorithm bandwidth: the time is then the call's own overhead). */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include "moonrl/device.h"
#include "moonrl/dist.h"
#include "moonrl/dist_nccl.h"
#include "moonrl/dtype.h"
#include "moonrl/runtime.h"
#include "cuda_backend.h"
#include "check.h"
#include "random.h"

static int g_rank, g_size;

/* rank r's input for a test with this seed (tests/lib/random.h) */
static void fill_f32(float *x, int64_t n, uint32_t seed, int r) {
    uint64_t s = rng_stream((uint64_t)seed * 7919u + (uint64_t)r);
    for (int64_t i = 0; i < n; i++) x[i] = (float)(rng_unit(&s) * 2.0 - 1.0) * 4;
}
static void fill_bytes(uint8_t *x, int64_t n, uint32_t seed, int r) {
    uint64_t s = rng_stream((uint64_t)seed * 7919u + (uint64_t)r);
    for (int64_t i = 0; i < n; i++) x[i] = (uint8_t)(rng_next(&s) >> 56);
}

static void *dev_alloc(int device, int64_t bytes) {
    void *p = NULL;
    CHECK_OK(mrl_cuda_malloc(device, (size_t)bytes, &p));
    return p;
}
static void to_dev(void *d, const void *h, int64_t bytes) { CHECK_OK(mrl_cuda_memcpy(d, h, (size_t)bytes, 0, NULL)); }
static void to_host(void *h, const void *d, int64_t bytes) { CHECK_OK(mrl_cuda_memcpy(h, d, (size_t)bytes, 1, NULL)); }

static const char *op_name(int op) {
    return op == MRL_DIST_SUM ? "sum" : op == MRL_DIST_MEAN ? "mean" : op == MRL_DIST_MAX ? "max" : "min";
}

static void test_allreduce_f32(mrl_nccl *nc, int device, int64_t n, int op, uint32_t seed) {
    float *mine = malloc(n * 4), *other = malloc(n * 4), *got = malloc(n * 4);
    double *want = calloc(n, sizeof *want), *mag = calloc(n, sizeof *mag);
    fill_f32(mine, n, seed, g_rank);
    for (int r = 0; r < g_size; r++) {
        fill_f32(other, n, seed, r);
        for (int64_t i = 0; i < n; i++) {
            double v = other[i];
            if (op == MRL_DIST_SUM || op == MRL_DIST_MEAN) want[i] += v;
            else if (r == 0 || (op == MRL_DIST_MAX ? v > want[i] : v < want[i])) want[i] = v;
            mag[i] += fabs(v);
        }
    }
    if (op == MRL_DIST_MEAN)
        for (int64_t i = 0; i < n; i++) want[i] /= g_size, mag[i] /= g_size;
    float *d = dev_alloc(device, n * 4);
    to_dev(d, mine, n * 4);
    CHECK_OK(mrl_nccl_allreduce(nc, d, n, MRL_DIST_F32, op));
    to_host(got, d, n * 4);
    double max_err = 0;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(got[i] - want[i]);
        /* one rank: the buffer unchanged, bit for bit; more: rounding of the sum */
        double tol = g_size == 1 || op == MRL_DIST_MAX || op == MRL_DIST_MIN ? 0 : 1e-6 * mag[i] * g_size;
        if (!(e <= tol)) bad++;
        if (e > max_err) max_err = e;
    }
    printf("allreduce f32 %-4s n=%-8lld max abs error %.3g\n", op_name(op), (long long)n, max_err);
    CHECK(bad == 0);
    mrl_cuda_free(d);
    free(mine), free(other), free(got), free(want), free(mag);
}

/* The other types, summed (u8: max), with exactly representable values. */
static void test_allreduce_types(mrl_nccl *nc, int device, int64_t n, uint32_t seed) {
    /* bf16: small integers, exact in bf16 while |sum| <= 256 */
    uint16_t *hb = malloc(n * 2), *gb = malloc(n * 2);
    double *f64 = malloc(n * 8), *g64 = malloc(n * 8);
    int64_t *i64 = malloc(n * 8), *gi = malloc(n * 8);
    uint8_t *u8 = malloc(n), *gu = malloc(n);
    int bad_b = 0, bad_f = 0, bad_i = 0, bad_u = 0;
    for (int64_t i = 0; i < n; i++) {
        /* rank r's value at i: a function of (seed, i, r) the others can compute */
        hb[i] = mrl_f32_to_bf16((float)((int)((seed + i * 7 + g_rank * 3) % 9) - 4));
        f64[i] = (double)(i % 1000) * 0.25 + g_rank;
        i64[i] = (int64_t)i * 1000003 + g_rank;
        u8[i] = (uint8_t)((i * 31 + g_rank * 17 + seed) & 255);
    }
    void *db = dev_alloc(device, n * 2), *df = dev_alloc(device, n * 8), *di = dev_alloc(device, n * 8),
         *du = dev_alloc(device, n);
    to_dev(db, hb, n * 2), to_dev(df, f64, n * 8), to_dev(di, i64, n * 8), to_dev(du, u8, n);
    CHECK_OK(mrl_nccl_allreduce(nc, db, n, MRL_NCCL_BF16, MRL_DIST_SUM));
    CHECK_OK(mrl_nccl_allreduce(nc, df, n, MRL_DIST_F64, MRL_DIST_SUM));
    CHECK_OK(mrl_nccl_allreduce(nc, di, n, MRL_DIST_I64, MRL_DIST_SUM));
    CHECK_OK(mrl_nccl_allreduce(nc, du, n, MRL_DIST_U8, MRL_DIST_MAX));
    to_host(gb, db, n * 2), to_host(g64, df, n * 8), to_host(gi, di, n * 8), to_host(gu, du, n);
    for (int64_t i = 0; i < n; i++) {
        double wb = 0, wf = 0;
        int64_t wi = 0;
        int wu = 0;
        for (int r = 0; r < g_size; r++) {
            wb += (int)((seed + i * 7 + r * 3) % 9) - 4;
            wf += (double)(i % 1000) * 0.25 + r;
            wi += (int64_t)i * 1000003 + r;
            int u = (int)((i * 31 + r * 17 + seed) & 255);
            if (u > wu) wu = u;
        }
        if (fabs(wb) <= 256 && mrl_bf16_to_f32(gb[i]) != (float)wb) bad_b++;
        if (g64[i] != wf) bad_f++;
        if (gi[i] != wi) bad_i++;
        if (gu[i] != wu) bad_u++;
    }
    printf("allreduce bf16/f64/i64 sum, u8 max n=%lld: %d/%d/%d/%d wrong\n", (long long)n, bad_b, bad_f, bad_i, bad_u);
    CHECK(bad_b == 0 && bad_f == 0 && bad_i == 0 && bad_u == 0);
    mrl_cuda_free(db), mrl_cuda_free(df), mrl_cuda_free(di), mrl_cuda_free(du);
    free(hb), free(gb), free(f64), free(g64), free(i64), free(gi), free(u8), free(gu);
}

static void test_broadcast(mrl_nccl *nc, int device, int64_t bytes, int root, uint32_t seed) {
    uint8_t *h = malloc(bytes), *want = malloc(bytes), *got = malloc(bytes);
    fill_bytes(h, bytes, seed, g_rank);
    fill_bytes(want, bytes, seed, root);
    void *d = dev_alloc(device, bytes);
    to_dev(d, h, bytes);
    CHECK_OK(mrl_nccl_broadcast(nc, d, bytes, root));
    to_host(got, d, bytes);
    int ok = memcmp(got, want, bytes) == 0;
    printf("broadcast bytes=%-8lld root=%d: %s\n", (long long)bytes, root, ok ? "ok" : "WRONG");
    CHECK(ok);
    mrl_cuda_free(d);
    free(h), free(want), free(got);
}

static void test_allgather(mrl_nccl *nc, int device, int64_t bytes, int in_place, uint32_t seed) {
    int64_t total = bytes * g_size;
    uint8_t *h = malloc(bytes), *want = malloc(total), *got = malloc(total);
    fill_bytes(h, bytes, seed, g_rank);
    for (int r = 0; r < g_size; r++) fill_bytes(want + r * bytes, bytes, seed, r);
    uint8_t *recv = dev_alloc(device, total);
    CHECK_OK(mrl_cuda_memset_zero(recv, (size_t)total, NULL));
    uint8_t *send = in_place ? recv + g_rank * bytes : dev_alloc(device, bytes);
    to_dev(send, h, bytes);
    CHECK_OK(mrl_nccl_allgather(nc, send, bytes, recv));
    to_host(got, recv, total);
    int ok = memcmp(got, want, total) == 0;
    printf("allgather bytes=%-8lld%s: %s\n", (long long)bytes, in_place ? " in place" : "", ok ? "ok" : "WRONG");
    CHECK(ok);
    if (!in_place) mrl_cuda_free(send);
    mrl_cuda_free(recv);
    free(h), free(want), free(got);
}

/* rows of `unit` bytes from every rank to every rank: (r + q) % 3 rows (0: none) from rank r to
 * rank q, its bytes derived from the seed and the pair */
static void test_alltoallv(mrl_nccl *nc, int device, int64_t unit, uint32_t seed) {
    int64_t sc[64], rc[64], ns = 0, nr = 0;
    for (int q = 0; q < g_size; q++) {
        sc[q] = (g_rank + q) % 3, rc[q] = (q + g_rank) % 3;
        ns += sc[q], nr += rc[q];
    }
    uint8_t *h = malloc((size_t)(ns * unit + 1)), *want = malloc((size_t)(nr * unit + 1)), *got = malloc((size_t)(nr * unit + 1));
    int64_t so = 0, ro = 0;
    for (int q = 0; q < g_size; q++) {
        fill_bytes(h + so, sc[q] * unit, seed, g_rank * 64 + q); /* (this rank's block for q) */
        fill_bytes(want + ro, rc[q] * unit, seed, q * 64 + g_rank); /* (q's block for this rank) */
        so += sc[q] * unit, ro += rc[q] * unit;
    }
    uint8_t *send = dev_alloc(device, ns * unit + 1), *recv = dev_alloc(device, nr * unit + 1);
    to_dev(send, h, ns * unit);
    CHECK_OK(mrl_nccl_alltoallv(nc, send, sc, recv, rc, unit));
    to_host(got, recv, nr * unit);
    int ok = memcmp(got, want, (size_t)(nr * unit)) == 0;
    printf("alltoallv unit=%-6lld %lld rows out, %lld in: %s\n", (long long)unit, (long long)ns, (long long)nr,
           ok ? "ok" : "WRONG");
    CHECK(ok);
    int64_t bad[64];
    for (int q = 0; q < g_size; q++) bad[q] = q == g_rank ? rc[q] + 1 : rc[q];
    CHECK(mrl_nccl_alltoallv(nc, send, sc, recv, bad, unit) == MRL_ERR_INVALID); /* (its own block: both ways) */
    mrl_cuda_free(send), mrl_cuda_free(recv);
    free(h), free(want), free(got);
}

static void test_reduce_scatter(mrl_nccl *nc, int device, int64_t rc, int op, int in_place, uint32_t seed) {
    int64_t n = rc * g_size;
    float *mine = malloc(n * 4), *other = malloc(n * 4), *got = malloc(rc * 4);
    double *want = calloc(rc, sizeof *want), *mag = calloc(rc, sizeof *mag);
    fill_f32(mine, n, seed, g_rank);
    for (int r = 0; r < g_size; r++) {
        fill_f32(other, n, seed, r);
        for (int64_t i = 0; i < rc; i++) {
            double v = other[g_rank * rc + i];
            if (op == MRL_DIST_SUM || op == MRL_DIST_MEAN) want[i] += v;
            else if (r == 0 || (op == MRL_DIST_MAX ? v > want[i] : v < want[i])) want[i] = v;
            mag[i] += fabs(v);
        }
    }
    if (op == MRL_DIST_MEAN)
        for (int64_t i = 0; i < rc; i++) want[i] /= g_size, mag[i] /= g_size;
    float *send = dev_alloc(device, n * 4);
    float *recv = in_place ? send + g_rank * rc : dev_alloc(device, rc * 4);
    to_dev(send, mine, n * 4);
    CHECK_OK(mrl_nccl_reduce_scatter(nc, send, recv, rc, MRL_DIST_F32, op));
    to_host(got, recv, rc * 4);
    double max_err = 0;
    int64_t bad = 0;
    for (int64_t i = 0; i < rc; i++) {
        double e = fabs(got[i] - want[i]);
        double tol = g_size == 1 || op == MRL_DIST_MAX || op == MRL_DIST_MIN ? 0 : 1e-6 * mag[i] * g_size;
        if (!(e <= tol)) bad++;
        if (e > max_err) max_err = e;
    }
    printf("reduce_scatter f32 %-4s recv_count=%-8lld%s max abs error %.3g\n", op_name(op), (long long)rc,
           in_place ? " in place" : "", max_err);
    CHECK(bad == 0);
    if (!in_place) mrl_cuda_free(recv);
    mrl_cuda_free(send);
    free(mine), free(other), free(got), free(want), free(mag);
}

/* Uneven pieces: rank r's mrl_dist_shard of n floats. allgather_pieces makes every rank's buffer
 * whole from its own shard; reduce_scatter_pieces gives each rank the sum of its shard. */
static void test_pieces(mrl_nccl *nc, int device, int64_t n, uint32_t seed) {
    int64_t off[64], cnt[64], boff[64], bytes[64];
    for (int r = 0; r < g_size; r++) {
        mrl_dist_shard(n, g_size, r, &off[r], &cnt[r]);
        boff[r] = 4 * off[r], bytes[r] = 4 * cnt[r];
    }
    float *whole = malloc(n * 4), *got = malloc(n * 4), *mine = malloc(n * 4), *other = malloc(n * 4);
    double *want = calloc((size_t)n, sizeof *want), *mag = calloc((size_t)n, sizeof *mag);
    for (int r = 0; r < g_size; r++) { /* the whole buffer: rank r's values in its shard */
        fill_f32(other, n, seed, r);
        memcpy(whole + off[r], other + off[r], 4 * (size_t)cnt[r]);
        for (int64_t i = 0; i < n; i++) want[i] += other[i], mag[i] += fabs(other[i]);
    }
    fill_f32(mine, n, seed, g_rank);
    float *d = dev_alloc(device, n * 4), *recv = dev_alloc(device, cnt[g_rank] * 4 + 4);
    CHECK_OK(mrl_cuda_memset_zero(d, (size_t)n * 4, NULL));
    to_dev(d + off[g_rank], mine + off[g_rank], bytes[g_rank]);
    CHECK_OK(mrl_nccl_allgather_pieces(nc, d, boff, bytes));
    to_host(got, d, n * 4);
    int ok = memcmp(got, whole, (size_t)n * 4) == 0;
    to_dev(d, mine, n * 4);
    CHECK_OK(mrl_nccl_reduce_scatter_pieces(nc, d, recv, off, cnt, MRL_DIST_F32, MRL_DIST_SUM));
    to_host(got, recv, bytes[g_rank]);
    int64_t bad = 0;
    for (int64_t i = 0; i < cnt[g_rank]; i++) {
        int64_t j = off[g_rank] + i;
        bad += !(fabs(got[i] - want[j]) <= (g_size == 1 ? 0 : 1e-6 * mag[j] * g_size));
    }
    printf("pieces n=%-8lld allgather %s, reduce_scatter %lld wrong\n", (long long)n, ok ? "ok" : "WRONG", (long long)bad);
    CHECK(ok && bad == 0);
    /* bad pieces: errors before anything runs */
    CHECK(mrl_nccl_allgather_pieces(nc, d, NULL, bytes) == MRL_ERR_INVALID);
    int64_t neg = bytes[0];
    bytes[0] = -1;
    CHECK(mrl_nccl_allgather_pieces(nc, d, boff, bytes) == MRL_ERR_INVALID);
    bytes[0] = neg;
    CHECK(mrl_nccl_reduce_scatter_pieces(nc, d, recv, off, cnt, 99, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_broken(nc) == 0);
    mrl_cuda_free(d), mrl_cuda_free(recv);
    free(whole), free(got), free(mine), free(other), free(want), free(mag);
}

/* Bad arguments are errors before anything runs, and break nothing. */
static void test_bad_arguments(mrl_nccl *nc, int device) {
    float *d = dev_alloc(device, 64 * 4);
    float host[64] = {0};
    CHECK(mrl_nccl_allreduce(nc, d, 64, 99, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_allreduce(nc, d, 64, MRL_DIST_F32, 99) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_allreduce(nc, NULL, 64, MRL_DIST_F32, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_allreduce(nc, host, 64, MRL_DIST_F32, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "not device memory");
    CHECK(mrl_nccl_allreduce(nc, d, -1, MRL_DIST_F32, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_broadcast(nc, d, 16, g_size) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_broadcast(nc, d, 16, -1) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_allgather(nc, host, 16, d) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_reduce_scatter(nc, d, NULL, 4, MRL_DIST_F32, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK(mrl_nccl_allreduce(NULL, d, 64, MRL_DIST_F32, MRL_DIST_SUM) == MRL_ERR_INVALID);
    /* zero elements: nothing to do, even with NULL */
    CHECK_OK(mrl_nccl_allreduce(nc, NULL, 0, MRL_DIST_F32, MRL_DIST_SUM));
    CHECK(mrl_nccl_broken(nc) == 0);
    mrl_cuda_free(d);
}

/* A collective waits for the work queued on the wait stream before it. */
static void test_wait_stream(mrl_nccl *nc, int device) {
    const int64_t big = 256 << 20, n = 1 << 20;
    void *s = NULL;
    CHECK_OK(mrl_cuda_stream_create(device, &s));
    void *a = dev_alloc(device, big), *b = dev_alloc(device, big);
    float *src = dev_alloc(device, n * 4), *buf = dev_alloc(device, n * 4);
    float *h = malloc(n * 4), *got = malloc(n * 4);
    fill_f32(h, n, 77, g_rank);
    to_dev(src, h, n * 4);
    CHECK_OK(mrl_cuda_memset_zero(buf, n * 4, NULL));
    CHECK_OK(mrl_cuda_memset_zero(a, big, NULL));
    CHECK_OK(mrl_cuda_stream_sync(NULL));
    /* slow work, then the write of the input, all on s */
    for (int i = 0; i < 4; i++) CHECK_OK(mrl_cuda_memcpy(b, a, big, 2, s));
    CHECK_OK(mrl_cuda_memcpy(buf, src, n * 4, 2, s));
    mrl_nccl_set_wait_stream(nc, s);
    CHECK_OK(mrl_nccl_allreduce(nc, buf, n, MRL_DIST_F32, MRL_DIST_MAX));
    mrl_nccl_set_wait_stream(nc, NULL);
    to_host(got, buf, n * 4);
    if (g_size == 1) {
        int ok = memcmp(got, h, n * 4) == 0;
        printf("allreduce after the wait stream's work: %s\n", ok ? "ok" : "WRONG");
        CHECK(ok);
    }
    CHECK_OK(mrl_cuda_stream_sync(s));
    mrl_cuda_stream_destroy(s);
    mrl_cuda_free(a), mrl_cuda_free(b), mrl_cuda_free(src), mrl_cuda_free(buf);
    free(h), free(got);
}

/* A deadline that passes, and the communicator broken from then on (later calls fail at once
 * with the same error). At world size 1 the wait stream holds milliseconds of copies and the
 * timeout is 10 us (a GPU's: the emulated GPU's copies are done when queued, so it skips);
 * with more ranks, rank 0 calls an all-reduce the others never join. */
static void test_timeout(mrl_dist *d, int device, int emulated) {
    if (g_size == 1 && emulated) {
        printf("timeout: skipped at world size 1 on the emulated GPU (its wait stream is never busy)\n");
        return;
    }
    mrl_nccl *nc2 = NULL;
    CHECK_OK(mrl_nccl_create(d, device, 30, &nc2));
    if (!nc2) return;
    const int64_t big = 256 << 20;
    void *s = NULL, *a = NULL, *b = NULL;
    float *buf = dev_alloc(device, 4096);
    if (g_size == 1) {
        CHECK_OK(mrl_cuda_stream_create(device, &s));
        a = dev_alloc(device, big), b = dev_alloc(device, big);
        for (int i = 0; i < 16; i++) CHECK_OK(mrl_cuda_memcpy(b, a, big, 2, s));
        mrl_nccl_set_wait_stream(nc2, s);
        mrl_nccl_set_timeout(nc2, 1e-5);
    } else {
        mrl_nccl_set_timeout(nc2, 1.0);
    }
    if (g_rank == 0) {
        mrl_status st = mrl_nccl_allreduce(nc2, buf, 1024, MRL_DIST_F32, MRL_DIST_SUM);
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", mrl_last_error());
        printf("timeout: %s: %s\n", mrl_status_name(st), msg);
        CHECK(st == MRL_ERR_TIMEOUT);
        CHECK_STR_CONTAINS(msg, "allreduce #0");
        CHECK_STR_CONTAINS(msg, g_size == 1 ? "rank 0 of 1" : "another rank did not join it");
        CHECK(mrl_nccl_broken(nc2) == 1);
        /* broken: later calls fail at once with the same error */
        mrl_nccl_set_timeout(nc2, 30);
        CHECK(mrl_nccl_broadcast(nc2, buf, 16, 0) == MRL_ERR_TIMEOUT);
        CHECK(strcmp(mrl_last_error(), msg) == 0);
        CHECK(mrl_nccl_seq(nc2) == 1);
    }
    CHECK_OK(mrl_dist_barrier(d)); /* (rank 0 has given up before the others free theirs) */
    mrl_nccl_free(nc2);
    if (s) {
        CHECK_OK(mrl_cuda_stream_sync(s));
        mrl_cuda_stream_destroy(s);
    }
    mrl_cuda_free(a), mrl_cuda_free(b), mrl_cuda_free(buf);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench(mrl_nccl *nc, int device) {
    const int64_t max_bytes = 256 << 20;
    float *d = dev_alloc(device, max_bytes);
    CHECK_OK(mrl_cuda_memset_zero(d, max_bytes, NULL));
    if (g_rank == 0) {
        printf("# NCCL all-reduce (f32 sum, in place), world size %d, through mrl_nccl_allreduce (each call waits)\n",
               g_size);
        printf("# %12s %10s %12s %12s\n", "bytes", "time_us", "algbw_GB/s", "busbw_GB/s");
    }
    for (int64_t bytes = 1 << 20; bytes <= max_bytes; bytes *= 2) {
        int64_t n = bytes / 4;
        for (int i = 0; i < 5; i++) CHECK_OK(mrl_nccl_allreduce(nc, d, n, MRL_DIST_F32, MRL_DIST_SUM));
        /* the same number of iterations on every rank */
        int iters = (int)(2000 / (bytes >> 20));
        if (iters < 20) iters = 20;
        double t0 = now_s();
        for (int i = 0; i < iters; i++) CHECK_OK(mrl_nccl_allreduce(nc, d, n, MRL_DIST_F32, MRL_DIST_SUM));
        double t = (now_s() - t0) / iters;
        double algbw = bytes / t / 1e9, busbw = algbw * 2.0 * (g_size - 1) / g_size;
        if (g_rank == 0) printf("  %12lld %10.1f %12.1f %12.1f\n", (long long)bytes, t * 1e6, algbw, busbw);
    }
    mrl_cuda_free(d);
}

int main(int argc, char **argv) {
    int bench_mode = argc > 1 && strcmp(argv[1], "--bench") == 0;
    CHECK_OK(mrl_init());
    int ndev = mrl_device_cuda_count();
    if (ndev == 0) {
        printf("no CUDA device visible: skipped\n");
        return 77;
    }
    mrl_dist *d = NULL;
    CHECK_OK(mrl_dist_init(60, &d));
    if (!d) CHECK_DONE();
    g_rank = mrl_dist_rank(d);
    g_size = mrl_dist_size(d);
    int device = mrl_dist_local_rank(d) % ndev;
    char desc[256];
    CHECK_OK(mrl_device_describe((mrl_device){MRL_DEVICE_CUDA, device}, desc, sizeof desc));
    printf("rank %d of %d on %s\n", g_rank, g_size, desc);

    /* creation: bad arguments */
    mrl_nccl *bad = (mrl_nccl *)1;
    CHECK(mrl_nccl_create(d, ndev + 100, 30, &bad) == MRL_ERR_INVALID);
    CHECK(bad == NULL);
    CHECK(mrl_nccl_create(d, device, -1, &bad) == MRL_ERR_INVALID);

    mrl_nccl *nc = NULL;
    CHECK_OK(mrl_nccl_create(d, device, 60, &nc));
    if (!nc) CHECK_DONE();
    CHECK(mrl_nccl_rank(nc) == g_rank && mrl_nccl_size(nc) == g_size && mrl_nccl_device(nc) == device);
    CHECK(mrl_nccl_stream(nc) != NULL);

    if (bench_mode) {
        bench(nc, device);
    } else {
        uint32_t seed = 1000;
        const int64_t sizes[] = {1, 7, 1000, 65537, (1 << 20) + 3, 16 << 20};
        const int ops[] = {MRL_DIST_SUM, MRL_DIST_MEAN, MRL_DIST_MAX, MRL_DIST_MIN};
        for (int s = 0; s < (int)(sizeof sizes / sizeof *sizes); s++)
            for (int o = 0; o < 4; o++) test_allreduce_f32(nc, device, sizes[s], ops[o], seed++);
        test_allreduce_types(nc, device, 1, seed++);
        test_allreduce_types(nc, device, 100003, seed++);
        const int64_t bsizes[] = {1, 1000, (1 << 20) + 5};
        for (int s = 0; s < 3; s++) {
            test_broadcast(nc, device, bsizes[s], 0, seed++);
            test_broadcast(nc, device, bsizes[s], g_size - 1, seed++);
            test_allgather(nc, device, bsizes[s], 0, seed++);
            test_allgather(nc, device, bsizes[s], 1, seed++);
        }
        const int64_t rsizes[] = {1, 1000, 65537, (1 << 20) + 1};
        for (int s = 0; s < 4; s++) {
            test_reduce_scatter(nc, device, rsizes[s], MRL_DIST_SUM, 0, seed++);
            test_reduce_scatter(nc, device, rsizes[s], MRL_DIST_MEAN, 1, seed++);
            test_reduce_scatter(nc, device, rsizes[s], MRL_DIST_MAX, 0, seed++);
        }
        const int64_t psizes[] = {1, 1001, (1 << 20) + 7};
        for (int s = 0; s < 3; s++)
            if (psizes[s] >= g_size && g_size <= 64) test_pieces(nc, device, psizes[s], seed++);
        if (g_size <= 64) {
            test_alltoallv(nc, device, 4, seed++);
            test_alltoallv(nc, device, 4096 + 12, seed++);
        }
        test_bad_arguments(nc, device);
        test_wait_stream(nc, device);
        test_timeout(d, device, strstr(desc, "emulation") != NULL);
        /* the first communicator still works after another one broke */
        test_allreduce_f32(nc, device, 4097, MRL_DIST_SUM, seed++);
        CHECK(mrl_nccl_broken(nc) == 0);
        printf("%lld NCCL operations\n", (long long)mrl_nccl_seq(nc));
    }
    mrl_nccl_free(nc);
    mrl_dist_finalize(d);
    mrl_shutdown();
    CHECK_DONE();
}
