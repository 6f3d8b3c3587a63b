/* The communicator (moonrl/dist.h) at whatever world size it is started
 * with: alone, or under mpirun with 2 or 3 ranks (tests/dist/mpirun.sh).
 *
 * The test never links MPI either: every rank generates every rank's input
 * from (seed, rank) and computes the expected result itself, adding the
 * ranks' values in rank order: the exact reference, bit for bit. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "moonrl/dist.h"
#include "moonrl/loop.h"
#include "random.h"

static mrl_dist *D;
static int R, N; /* this rank, the world size */

/* ------------------------------------------------------------ inputs */

/* rank's stream for the inputs of a test with this seed (tests/lib/random.h) */
static uint64_t stream_for(uint64_t seed, int rank) { return rng_stream(seed * 1000003u + (uint64_t)rank + 1); }

/* Values of many magnitudes, so that the order of the additions shows. */
static double value(uint64_t *g) {
    uint64_t u = rng_next(g);
    double m = 1.0 + (double)(u >> 11) / 9007199254740992.0; /* [1, 2) */
    int e = (int)((u >> 3) % 33) - 16;
    return (u & 1 ? -m : m) * (double)((int64_t)1 << (e + 16)) / 65536.0;
}

static void fill(void *buf, int64_t n, int dtype, uint64_t seed, int rank) {
    uint64_t g = stream_for(seed, rank);
    for (int64_t i = 0; i < n; i++) {
        switch (dtype) {
        case MRL_DIST_F32: ((float *)buf)[i] = (float)value(&g); break;
        case MRL_DIST_F64: ((double *)buf)[i] = value(&g); break;
        case MRL_DIST_I64: ((int64_t *)buf)[i] = (int64_t)rng_next(&g); break;
        case MRL_DIST_U8: ((uint8_t *)buf)[i] = (uint8_t)rng_next(&g); break;
        }
    }
}

/* The reduction of every rank's fill(seed, rank), in rank order. */
static void *reference(int64_t n, int dtype, int op, uint64_t seed) {
    int64_t esz = mrl_dist_dtype_size(dtype);
    char *acc = malloc((size_t)(n * esz) + 1), *x = malloc((size_t)(n * esz) + 1);
    fill(acc, n, dtype, seed, 0);
    for (int r = 1; r < N; r++) {
        fill(x, n, dtype, seed, r);
        for (int64_t i = 0; i < n; i++) {
#define FOLD(T, ADD)                                                  \
    {                                                                 \
        T *a = (T *)acc + i, b = ((T *)x)[i];                         \
        if (op == MRL_DIST_MAX) *a = b > *a ? b : *a;                 \
        else if (op == MRL_DIST_MIN) *a = b < *a ? b : *a;            \
        else *a = ADD;                                                \
    }
            switch (dtype) {
            case MRL_DIST_F32: FOLD(float, *a + b) break;
            case MRL_DIST_F64: FOLD(double, *a + b) break;
            case MRL_DIST_I64: FOLD(int64_t, (int64_t)((uint64_t)*a + (uint64_t)b)) break;
            case MRL_DIST_U8: FOLD(uint8_t, (uint8_t)(*a + b)) break;
            }
        }
    }
    if (op == MRL_DIST_MEAN)
        for (int64_t i = 0; i < n; i++) {
            if (dtype == MRL_DIST_F32) ((float *)acc)[i] /= (float)N;
            if (dtype == MRL_DIST_F64) ((double *)acc)[i] /= (double)N;
            if (dtype == MRL_DIST_I64) ((int64_t *)acc)[i] /= N;
        }
    free(x);
    return acc;
}

static int64_t first_diff(const void *a, const void *b, int64_t n, int64_t esz) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp((const char *)a + i * esz, (const char *)b + i * esz, (size_t)esz)) return i;
    return -1;
}

#define CHECK_SAME(a, b, n, esz, what, ...)                                                     \
    do {                                                                                        \
        int64_t at_ = first_diff((a), (b), (n), (esz));                                         \
        CHECK(at_ < 0);                                                                         \
        if (at_ >= 0) {                                                                         \
            fprintf(stderr, "rank %d: " what ": first difference at element %lld\n", R,         \
                    __VA_ARGS__, (long long)at_);                                               \
        }                                                                                       \
    } while (0)

static const char *DT[] = {"f32", "f64", "i64", "u8"};
static const char *OP[] = {"sum", "mean", "max", "min"};

/* ------------------------------------------------------------- tests */

static void test_shard(void) {
    for (int size = 1; size <= 5; size++)
        for (int64_t n = 0; n <= 23; n++) {
            int64_t next_off = 0;
            for (int r = 0; r < size; r++) {
                int64_t off, cnt;
                mrl_dist_shard(n, size, r, &off, &cnt);
                CHECK(off == next_off);
                CHECK(cnt == n / size + (r < n % size ? 1 : 0));
                next_off = off + cnt;
            }
            CHECK(next_off == n);
        }
}

static void test_env_and_handle(void) {
    mrl_dist_env e;
    CHECK_OK(mrl_dist_env_detect(&e));
    CHECK(e.size == N);
    CHECK(e.rank == R);
    CHECK(mrl_dist_local_rank(D) >= 0 && mrl_dist_local_rank(D) < mrl_dist_local_size(D));
    if (N == 1) {
        CHECK(strcmp(mrl_dist_backend(D), "none") == 0);
    } else {
        CHECK(strcmp(mrl_dist_backend(D), "mpi") == 0);
        CHECK(strcmp(e.launcher, "openmpi") == 0);
        CHECK(e.local_size == mrl_dist_local_size(D)); /* one host */
    }
    CHECK(!mrl_dist_broken(D));
}

/* Launchers' variables, read without starting anything (alone only). */
static void test_env_vars(void) {
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("SLURM_PROCID")) return;
    mrl_dist_env e;
    setenv("SLURM_PROCID", "5", 1);
    setenv("SLURM_STEP_NUM_TASKS", "8", 1);
    setenv("SLURM_LOCALID", "1", 1);
    setenv("SLURM_NODEID", "2", 1);
    setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2),3,1", 1);
    CHECK_OK(mrl_dist_env_detect(&e));
    CHECK(e.rank == 5 && e.size == 8 && e.local_rank == 1 && e.local_size == 3 && !strcmp(e.launcher, "slurm"));
    /* a batch script: Slurm's variables, but no step: one process */
    unsetenv("SLURM_STEP_NUM_TASKS");
    unsetenv("SLURM_STEP_TASKS_PER_NODE");
    setenv("SLURM_PROCID", "0", 1);
    setenv("SLURM_NTASKS", "8", 1);
    CHECK_OK(mrl_dist_env_detect(&e));
    CHECK(e.size == 1 && !strcmp(e.launcher, "none"));
    setenv("PMIX_RANK", "3", 1);
    setenv("SLURM_STEP_NUM_TASKS", "4", 1);
    CHECK_OK(mrl_dist_env_detect(&e));
    CHECK(e.rank == 3 && e.size == 4 && !strcmp(e.launcher, "pmix"));
    unsetenv("SLURM_STEP_NUM_TASKS");
    unsetenv("SLURM_NTASKS");
    CHECK_OK(mrl_dist_env_detect(&e));
    CHECK(e.size == 0); /* PMIx alone does not say: MPI will */
    unsetenv("PMIX_RANK");
    unsetenv("SLURM_PROCID");
    unsetenv("SLURM_LOCALID");
    unsetenv("SLURM_NODEID");
    setenv("OMPI_COMM_WORLD_SIZE", "two", 1);
    CHECK(mrl_dist_env_detect(&e) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "OMPI_COMM_WORLD_SIZE");
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    setenv("OMPI_COMM_WORLD_RANK", "2", 1);
    CHECK(mrl_dist_env_detect(&e) == MRL_ERR_INVALID);
    /* world size 2 but no plugin where it is looked for: a clear error, MPI never started */
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("MOONRL_MPI_PLUGIN", "/nonexistent/libmoonrl_mpi.so", 1);
    mrl_dist *d = NULL;
    CHECK(mrl_dist_init(1, &d) == MRL_ERR_UNSUPPORTED && d == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), "/nonexistent/libmoonrl_mpi.so");
    unsetenv("MOONRL_MPI_PLUGIN");
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("OMPI_COMM_WORLD_RANK");
}

static void test_invalid(void) {
    float x[4] = {0};
    CHECK(mrl_dist_allreduce(D, x, 4, 9, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK(mrl_dist_allreduce(D, x, 4, MRL_DIST_F32, 9) == MRL_ERR_INVALID);
    CHECK(mrl_dist_allreduce(D, x, -1, MRL_DIST_F32, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK(mrl_dist_allreduce(D, NULL, 4, MRL_DIST_F32, MRL_DIST_SUM) == MRL_ERR_INVALID);
    CHECK(mrl_dist_allreduce(D, x, 4, MRL_DIST_U8, MRL_DIST_MEAN) == MRL_ERR_INVALID);
    CHECK(mrl_dist_reduce_scatter(D, x, 4, MRL_DIST_F32, -1) == MRL_ERR_INVALID);
    CHECK(mrl_dist_broadcast(D, x, 4, N) == MRL_ERR_INVALID);
    CHECK(mrl_dist_broadcast(D, x, 4, -1) == MRL_ERR_INVALID);
    mrl_dist_buckets *b = NULL;
    CHECK(mrl_dist_buckets_create(D, x, 4, 0, MRL_DIST_BUCKETS_ALLREDUCE, &b) == MRL_ERR_INVALID && !b);
    CHECK(mrl_dist_buckets_create(D, x, 4, 64, 7, &b) == MRL_ERR_INVALID && !b);
    CHECK(!mrl_dist_broken(D)); /* refused before anything started */
    CHECK_OK(mrl_dist_barrier(D));
}

static int64_t sizes[32];
static int n_sizes;

static void make_sizes(void) {
    int64_t s[] = {0, 1, 2, 3, 7, (int64_t)N - 1, (int64_t)N + 1, 1000, 4097, 65537, ((int64_t)1 << 20) + 3};
    for (size_t i = 0; i < sizeof s / sizeof *s; i++) {
        int dup = 0;
        for (int j = 0; j < n_sizes; j++) dup |= sizes[j] == s[i];
        if (!dup) sizes[n_sizes++] = s[i];
    }
}

/* all-reduce = the reference; reduce-scatter leaves the shard summed and
 * the rest alone; all-gather of the shards then equals the all-reduce */
static void test_reductions(void) {
    uint64_t seed = 100;
    for (int si = 0; si < n_sizes; si++) {
        int64_t n = sizes[si];
        for (int dt = 0; dt < 4; dt++)
            for (int op = 0; op < 4; op++) {
                if (dt == MRL_DIST_U8 && op == MRL_DIST_MEAN) continue;
                /* the largest size: the float sums only (the pipeline's paths) */
                if (n > 100000 && !(op == MRL_DIST_SUM && dt <= MRL_DIST_F64) && !(op == MRL_DIST_MAX && dt == 0))
                    continue;
                seed++;
                int64_t esz = mrl_dist_dtype_size(dt);
                void *ref = reference(n, dt, op, seed);
                char *a = malloc((size_t)(n * esz) + 1), *b = malloc((size_t)(n * esz) + 1);
                char *mine = malloc((size_t)(n * esz) + 1);
                fill(a, n, dt, seed, R);
                fill(mine, n, dt, seed, R);
                CHECK_OK(mrl_dist_allreduce(D, a, n, dt, op));
                CHECK_SAME(a, ref, n, esz, "allreduce %s %s n=%lld", DT[dt], OP[op], (long long)n);

                fill(b, n, dt, seed, R);
                CHECK_OK(mrl_dist_reduce_scatter(D, b, n, dt, op));
                int64_t off, cnt;
                mrl_dist_shard(n, N, R, &off, &cnt);
                CHECK_SAME(b + off * esz, (char *)ref + off * esz, cnt, esz, "reduce_scatter shard %s %s n=%lld",
                           DT[dt], OP[op], (long long)n);
                CHECK_SAME(b, mine, off, esz, "reduce_scatter before the shard %s n=%lld", OP[op], (long long)n);
                CHECK_SAME(b + (off + cnt) * esz, mine + (off + cnt) * esz, n - off - cnt, esz,
                           "reduce_scatter after the shard %s n=%lld", OP[op], (long long)n);
                CHECK_OK(mrl_dist_allgather_shards(D, b, n, dt));
                CHECK_SAME(b, a, n, esz, "reduce_scatter + allgather_shards vs allreduce %s %s n=%lld", DT[dt],
                           OP[op], (long long)n);
                free(ref);
                free(a);
                free(b);
                free(mine);
            }
    }
}

/* all-gather of the shards alone: every rank's shard, the rest garbage */
static void test_allgather_shards(void) {
    for (int si = 0; si < n_sizes; si++) {
        int64_t n = sizes[si];
        for (int dt = 0; dt < 4; dt += 3) { /* f32, u8 */
            int64_t esz = mrl_dist_dtype_size(dt);
            char *want = malloc((size_t)(n * esz) + 1), *buf = malloc((size_t)(n * esz) + 1);
            for (int r = 0; r < N; r++) {
                int64_t off, cnt;
                mrl_dist_shard(n, N, r, &off, &cnt);
                fill(want + off * esz, cnt, dt, 7 + (uint64_t)n, r);
            }
            memset(buf, 0xa5, (size_t)(n * esz));
            int64_t off, cnt;
            mrl_dist_shard(n, N, R, &off, &cnt);
            memcpy(buf + off * esz, want + off * esz, (size_t)(cnt * esz));
            CHECK_OK(mrl_dist_allgather_shards(D, buf, n, dt));
            CHECK_SAME(buf, want, n, esz, "allgather_shards %s n=%lld", DT[dt], (long long)n);
            free(want);
            free(buf);
        }
    }
}

static void test_broadcast(void) {
    int64_t lens[] = {0, 1, 5, (3 << 20) + 5};
    int roots[] = {N - 1, 0};
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
        for (int ri = 0; ri < 2; ri++) {
            int64_t n = lens[li];
            int root = roots[ri];
            uint8_t *want = malloc((size_t)n + 1), *buf = malloc((size_t)n + 1);
            fill(want, n, MRL_DIST_U8, 55 + (uint64_t)li, root);
            if (R == root) memcpy(buf, want, (size_t)n);
            else memset(buf, 0x5a, (size_t)n);
            CHECK_OK(mrl_dist_broadcast(D, buf, n, root));
            CHECK_SAME(buf, want, n, 1, "broadcast of %lld bytes from %d", (long long)n, root);
            free(want);
            free(buf);
        }
}

static void test_allgather(void) {
    int64_t lens[] = {0, 1, 13, 100000};
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
        int64_t n = lens[li];
        uint8_t *send = malloc((size_t)n + 1), *recv = malloc((size_t)(n * N) + 1), *want = malloc((size_t)(n * N) + 1);
        for (int r = 0; r < N; r++) fill(want + r * n, n, MRL_DIST_U8, 77 + (uint64_t)li, r);
        fill(send, n, MRL_DIST_U8, 77 + (uint64_t)li, R);
        memset(recv, 0, (size_t)(n * N));
        CHECK_OK(mrl_dist_allgather(D, send, n, recv));
        CHECK_SAME(recv, want, n * N, 1, "allgather of %lld bytes", (long long)n);
        /* in place: this rank's part already where it goes */
        memset(recv, 0, (size_t)(n * N));
        memcpy(recv + R * n, send, (size_t)n);
        CHECK_OK(mrl_dist_allgather(D, recv + R * n, n, recv));
        CHECK_SAME(recv, want, n * N, 1, "allgather in place of %lld bytes", (long long)n);
        free(send);
        free(recv);
        free(want);
    }
}

static int64_t blob_len(int pattern, int r) {
    switch (pattern) {
    case 0: return (r * 37 + 5) % 11; /* some empty (r = 5 mod 11...), mostly short */
    case 1: return 0;                 /* all empty */
    case 2: return r == N - 1 ? 200001 : 0;
    default: return r == 0 ? 0 : 1000 + r;
    }
}

/* rank r sends rank q (r + 2q) % 5 rows of `unit` bytes, row i holding (r, q, i); some pairs send
 * nothing (expert parallelism's dispatch: a rank routes no token to another's experts) */
static int64_t a2a_rows(int from, int to, int round) { return (from + 2 * to + round) % 5 * (round == 2 ? 300 : 1); }
static void test_alltoallv(void) {
    for (int round = 0; round < 3; round++) {
        int64_t unit = round == 1 ? 3 : 12; /* rows of 3 bytes (u8 triples) or 12 (3 x i32) */
        int64_t sc[64], rc[64], ns = 0, nr = 0;
        for (int q = 0; q < N; q++) {
            sc[q] = a2a_rows(R, q, round);
            rc[q] = a2a_rows(q, R, round);
            ns += sc[q];
            nr += rc[q];
        }
        uint8_t *send = malloc((size_t)(ns * unit) + 1), *recv = malloc((size_t)(nr * unit) + 1);
        uint8_t *p = send;
        for (int q = 0; q < N; q++)
            for (int64_t i = 0; i < sc[q]; i++, p += unit) {
                int32_t v[3] = {R, q, (int32_t)i};
                if (unit == 12) memcpy(p, v, 12);
                else p[0] = (uint8_t)R, p[1] = (uint8_t)q, p[2] = (uint8_t)i;
            }
        memset(recv, 0xa5, (size_t)(nr * unit));
        CHECK_OK(mrl_dist_alltoallv(D, send, sc, recv, rc, unit));
        p = recv;
        for (int q = 0; q < N; q++)
            for (int64_t i = 0; i < rc[q]; i++, p += unit) {
                int32_t v[3] = {0, 0, 0};
                if (unit == 12) memcpy(v, p, 12);
                else v[0] = p[0], v[1] = p[1], v[2] = p[2];
                CHECK(v[0] == q && v[1] == R && v[2] == (unit == 12 ? (int32_t)i : (int32_t)(uint8_t)i));
            }
        free(send);
        free(recv);
    }
    int64_t zero[64] = {0}, one[64];
    for (int q = 0; q < N; q++) one[q] = 1;
    CHECK(mrl_dist_alltoallv(D, NULL, zero, NULL, zero, 0) == MRL_ERR_INVALID); /* unit 0 */
    CHECK(mrl_dist_alltoallv(D, NULL, one, NULL, zero, 4) == MRL_ERR_INVALID);  /* rows without a buffer */
    zero[0] = -1;
    CHECK(mrl_dist_alltoallv(D, NULL, zero, NULL, zero, 4) == MRL_ERR_INVALID);
    CHECK(!mrl_dist_broken(D));
}

static void test_blobs(void) {
    for (int pattern = 0; pattern < 4; pattern++) {
        int64_t len = blob_len(pattern, R);
        uint8_t *mine = malloc((size_t)len + 1);
        fill(mine, len, MRL_DIST_U8, 900 + (uint64_t)pattern, R);
        const uint8_t *data = NULL;
        const int64_t *off = NULL;
        CHECK_OK(mrl_dist_allgather_blobs(D, len ? mine : NULL, len, &data, &off));
        if (!data || !off) {
            free(mine);
            continue;
        }
        CHECK(off[0] == 0);
        for (int r = 0; r < N; r++) {
            int64_t l = blob_len(pattern, r);
            CHECK(off[r + 1] - off[r] == l);
            uint8_t *want = malloc((size_t)l + 1);
            fill(want, l, MRL_DIST_U8, 900 + (uint64_t)pattern, r);
            CHECK_SAME(data + off[r], want, l, 1, "blob of rank %d, pattern %d", r, pattern);
            free(want);
        }
        free(mine);
    }
}

/* The ranges a backward reports, from the end of the buffer to its start,
 * in pieces of tensor-like sizes (they straddle the buckets' edges). */
static void ready_backward(mrl_dist_buckets *b, int64_t n, uint64_t seed) {
    uint64_t g = stream_for(seed, 99);
    int64_t hi = n;
    while (hi > 0) {
        int64_t len = 1 + (int64_t)(rng_next(&g) % 5000);
        int64_t lo = hi - len > 0 ? hi - len : 0;
        mrl_dist_buckets_ready(b, lo, hi - lo);
        hi = lo;
    }
}

/* The same ranges in a random order, some twice. */
static void ready_shuffled(mrl_dist_buckets *b, int64_t n, uint64_t seed) {
    uint64_t g = stream_for(seed, 98);
    int64_t (*r)[2] = malloc(sizeof *r * (size_t)(n / 1 + 2));
    int k = 0;
    for (int64_t lo = 0; lo < n;) {
        int64_t len = 1 + (int64_t)(rng_next(&g) % 3000);
        r[k][0] = lo;
        r[k][1] = lo + len < n ? len : n - lo;
        lo += r[k][1];
        k++;
    }
    for (int i = k - 1; i > 0; i--) {
        int j = (int)(rng_next(&g) % (uint64_t)(i + 1));
        int64_t t0 = r[i][0], t1 = r[i][1];
        r[i][0] = r[j][0], r[i][1] = r[j][1];
        r[j][0] = t0, r[j][1] = t1;
    }
    for (int i = 0; i < k; i++) {
        mrl_dist_buckets_ready(b, r[i][0], r[i][1]);
        if (i % 3 == 0) mrl_dist_buckets_ready(b, r[i][0], r[i][1]);
    }
    free(r);
}

static void test_buckets(void) {
    int64_t ns[] = {0, 1, 5, 1000, 300001};
    int64_t bbytes[] = {28, 4096, 1 << 20};
    uint64_t seed = 5000;
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (size_t bi = 0; bi < sizeof bbytes / sizeof *bbytes; bi++)
            for (int mode = 0; mode < 2; mode++) {
                int64_t n = ns[ni];
                if (n > 100000 && bbytes[bi] < 4096) continue; /* 10^4 buckets: slow, nothing new */
                float *g = malloc(sizeof(float) * (size_t)n + 1), *mine = malloc(sizeof(float) * (size_t)n + 1);
                float *ar = malloc(sizeof(float) * (size_t)n + 1);
                mrl_dist_buckets *b = NULL;
                CHECK_OK(mrl_dist_buckets_create(D, g, n, bbytes[bi], mode, &b));
                if (!b) continue;
                int64_t blen = bbytes[bi] / 4;
                CHECK(mrl_dist_buckets_count(b) == (n + blen - 1) / blen);
                /* three rounds: not armed (an accumulation's earlier backward), then armed twice */
                for (int round = 0; round < 3; round++) {
                    seed++;
                    fill(g, n, MRL_DIST_F32, seed, R);
                    fill(mine, n, MRL_DIST_F32, seed, R);
                    fill(ar, n, MRL_DIST_F32, seed, R);
                    CHECK_OK(mrl_dist_allreduce(D, ar, n, MRL_DIST_F32, MRL_DIST_SUM));
                    if (round > 0) mrl_dist_buckets_arm(b, 1);
                    /* the last rank never says anything; rank 1 says it out of order */
                    int how = N > 1 && R == N - 1 ? 0 : R == 1 ? 2 : 1;
                    if (how == 1) ready_backward(b, n, seed);
                    if (how == 2) ready_shuffled(b, n, seed);
                    CHECK_OK(mrl_dist_buckets_finish(b));
                    int64_t off = 0, cnt = n;
                    if (mode == MRL_DIST_BUCKETS_REDUCE_SCATTER) mrl_dist_shard(n, N, R, &off, &cnt);
                    CHECK_SAME(g + off, ar + off, cnt, 4,
                               "buckets (mode %d, n=%lld, %lld bytes, round %d) vs allreduce", mode, (long long)n,
                               (long long)bbytes[bi], round);
                    CHECK_SAME(g, mine, off, 4, "buckets: before the shard, n=%lld", (long long)n);
                    CHECK_SAME(g + off + cnt, mine + off + cnt, n - off - cnt, 4, "buckets: after the shard, n=%lld",
                               (long long)n);
                    int want = round == 0 || how == 0 ? 0 : mrl_dist_buckets_count(b);
                    CHECK(mrl_dist_buckets_overlapped(b) == want);
                }
                mrl_dist_buckets_free(b);
                free(g);
                free(mine);
                free(ar);
            }
}

/* Sharded gradients (mrl_dist_grad_shard): a backward's ranges, of tensor-like
 * sizes from the end of the layout to its start, each lent, filled with this
 * rank's values and handed back as final (a few lent ahead, as a tied head
 * keeps the embedding's); three backwards accumulate. The shard must hold
 * the rank-order sum of each backward's all-reduce added backward by
 * backward, bit for bit, whatever the segment size. */
static void test_grad_shard(void) {
    int64_t ns[] = {3, 1000, 300001};
    int64_t seg_bytes[] = {12, 4096, 1 << 20};
    uint64_t seed = 7000;
    for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
        for (size_t si = 0; si < sizeof seg_bytes / sizeof *seg_bytes; si++) {
            int64_t n = ns[ni];
            if (n < N) continue;
            if (n > 100000 && seg_bytes[si] < 4096) continue; /* 10^5 segments: slow, nothing new */
            mrl_dist_grad_shard *gs = NULL;
            CHECK_OK(mrl_dist_grad_shard_create(D, n, seg_bytes[si], N, &gs));
            if (!gs) continue;
            int64_t off, cnt;
            mrl_dist_shard(n, N, R, &off, &cnt);
            float *whole = malloc(sizeof(float) * (size_t)n), *want = calloc((size_t)cnt + 1, sizeof(float));
            mrl_dist_grad_shard_zero(gs);
            for (int round = 0; round < 3; round++) {
                seed++;
                fill(whole, n, MRL_DIST_F32, seed, R);
                /* the ranges: from the end, 1 .. 5000 long; the first (the head's) stays lent to the end */
                uint64_t g = stream_for(seed, 97);
                int64_t head_lo = n - 1 - (int64_t)(rng_next(&g) % (uint64_t)(n < 50 ? 1 : 50));
                float *head = mrl_dist_grad_shard_acquire(gs, head_lo, n - head_lo);
                CHECK(head != NULL);
                for (int64_t hi = head_lo; hi > 0;) {
                    int64_t len = 1 + (int64_t)(rng_next(&g) % 5000);
                    int64_t lo = hi - len > 0 ? hi - len : 0;
                    float *w = mrl_dist_grad_shard_acquire(gs, lo, hi - lo);
                    CHECK(w != NULL);
                    if (!w) break;
                    for (int64_t i = 0; i < hi - lo; i++) CHECK(w[i] == 0.0f); /* lent zeroed */
                    memcpy(w, whole + lo, sizeof(float) * (size_t)(hi - lo));
                    mrl_dist_grad_shard_ready(gs, lo, hi - lo);
                    hi = lo;
                }
                if (head) memcpy(head, whole + head_lo, sizeof(float) * (size_t)(n - head_lo));
                mrl_dist_grad_shard_ready(gs, head_lo, n - head_lo);
                CHECK_OK(mrl_dist_grad_shard_finish(gs));
                CHECK_OK(mrl_dist_allreduce(D, whole, n, MRL_DIST_F32, MRL_DIST_SUM));
                for (int64_t i = 0; i < cnt; i++) want[i] += whole[off + i];
                CHECK_SAME(mrl_dist_grad_shard_grads(gs), want, cnt, 4,
                           "grad shard (n=%lld, %lld-byte segments, round %d) vs allreduce", (long long)n,
                           (long long)seg_bytes[si], round);
                if (round == 1) { /* the pool given back between updates: the next round lends anew */
                    CHECK(mrl_dist_grad_shard_window_bytes(gs) > 0);
                    mrl_dist_grad_shard_trim(gs);
                    CHECK(mrl_dist_grad_shard_window_bytes(gs) == 0);
                }
            }
            CHECK(mrl_dist_grad_shard_window_peak(gs) > 0);
            /* a range lent and never final fails finish, naming it; the next round starts clean */
            CHECK(mrl_dist_grad_shard_acquire(gs, 0, 1) != NULL);
            CHECK(mrl_dist_grad_shard_finish(gs) == MRL_ERR_INVALID);
            CHECK(strstr(mrl_last_error(), "[0, 1) lent and never final") != NULL);
            CHECK(mrl_dist_grad_shard_acquire(gs, -1, 2) == NULL && mrl_last_error()[0]);
            mrl_dist_grad_shard_zero(gs);
            for (int64_t i = 0; i < cnt; i++) CHECK(mrl_dist_grad_shard_grads(gs)[i] == 0.0f);
            mrl_dist_grad_shard_free(gs);
            free(whole);
            free(want);
        }
}

/* The ranks' order of addition is what gives these bits: another order
 * gives others (a check that the test above could see a wrong order). */
static void test_order_matters(void) {
    if (N < 3) return;
    int64_t n = 10000;
    float *ref = reference(n, MRL_DIST_F32, MRL_DIST_SUM, 4242);
    float *acc = calloc((size_t)n, sizeof(float)), *x = malloc((size_t)n * sizeof(float));
    for (int r = N - 1; r >= 0; r--) {
        fill(x, n, MRL_DIST_F32, 4242, r);
        for (int64_t i = 0; i < n; i++) acc[i] = r == N - 1 ? x[i] : acc[i] + x[i];
    }
    CHECK(first_diff(acc, ref, n, 4) >= 0);
    free(ref);
    free(acc);
    free(x);
}

/* Sub-communicators: the even ranks and the odd ones (the last rank in none), each summing
 * its members' values in their order; then the world goes on. */
/* send_pieces as hybrid sharding's trainers use it: rank 0 alone sends its piece to the last
 * rank, the ranks between send and receive nothing; then an all-gather of blobs and another
 * round, which must match on every rank (as one MPI_Ialltoallv, Open MPI 4.1 hung in the
 * all-gather); and the same through mrl_dist_alltoallv. */
static void test_send_pieces(void) {
    if (N < 3) return;
    float piece[5] = {1, 2, 3, 4, 5}, got[5] = {0};
    uint8_t to[8] = {0};
    int64_t counts[8] = {0};
    to[N - 1] = 1;
    counts[0] = 5;
    for (int round = 0; round < 2; round++) {
        CHECK_OK(mrl_dist_send_pieces(D, R == 0 ? piece : NULL, R == 0 ? 5 : 0, to, R == N - 1 ? got : NULL,
                                      counts, sizeof(float)));
        if (R == N - 1) CHECK(memcmp(got, piece, sizeof piece) == 0);
        const uint8_t *data;
        const int64_t *off;
        char mine[16];
        int len = snprintf(mine, sizeof mine, "r%d", R);
        CHECK_OK(mrl_dist_allgather_blobs(D, mine, len, &data, &off));
        CHECK(off && off[N] > 0);
    }
    /* the same shape through mrl_dist_alltoallv (expert parallelism's exchange: a rank whose
     * tokens all stay home sends and receives nothing) */
    for (int round = 0; round < 2; round++) {
        int64_t sc[8] = {0}, rc[8] = {0};
        float in[5] = {0};
        if (R == 0) sc[N - 1] = 5;
        if (R == N - 1) rc[0] = 5;
        CHECK_OK(mrl_dist_alltoallv(D, piece, sc, in, rc, sizeof(float)));
        const uint8_t *data;
        const int64_t *off;
        CHECK_OK(mrl_dist_allgather_blobs(D, "x", 1, &data, &off));
    }
}

static void test_split(void) {
    int color = (N > 2 && R == N - 1) ? -1 : R % 2;
    mrl_dist *sub = NULL;
    CHECK_OK(mrl_dist_split(D, color, color == 0 ? "even" : "odd", &sub));
    if (color < 0) {
        CHECK(sub == NULL);
    } else {
        CHECK(sub != NULL);
        int members = 0, my_index = -1;
        for (int r = 0; r < N; r++)
            if (!(N > 2 && r == N - 1) && r % 2 == color) {
                if (r == R) my_index = members;
                members++;
            }
        CHECK(mrl_dist_size(sub) == members);
        CHECK(mrl_dist_rank(sub) == my_index);
        double x = R + 1, want = 0;
        for (int r = 0; r < N; r++)
            if (!(N > 2 && r == N - 1) && r % 2 == color) want += r + 1;
        CHECK_OK(mrl_dist_allreduce(sub, &x, 1, MRL_DIST_F64, MRL_DIST_SUM));
        CHECK(x == want);
        mrl_dist_free(sub);
    }
    double y = 1;
    CHECK_OK(mrl_dist_allreduce(D, &y, 1, MRL_DIST_F64, MRL_DIST_SUM));
    CHECK(y == N);
}

int main(void) {
    CHECK_OK(mrl_dist_init(60, &D)); /* a bug here fails with a report instead of hanging */
    if (!D) CHECK_DONE();
    R = mrl_dist_rank(D);
    N = mrl_dist_size(D);
    mrl_dist_set_step(D, 0);
    double t0 = mrl_time_now();
    make_sizes();
    test_shard();
    test_env_and_handle();
    if (N == 1) test_env_vars();
    test_invalid();
    test_reductions();
    test_allgather_shards();
    test_broadcast();
    test_allgather();
    test_blobs();
    test_alltoallv();
    test_buckets();
    test_grad_shard();
    test_order_matters();
    test_send_pieces();
    test_split();
    CHECK_OK(mrl_dist_barrier(D));
    CHECK(!mrl_dist_broken(D));
    if (R == 0) printf("rank 0 of %d (%s): %.2f s\n", N, mrl_dist_backend(D), mrl_time_now() - t0);
    /* every rank's verdict: a failure anywhere fails the run */
    int64_t failed = check_failures;
    CHECK_OK(mrl_dist_allreduce(D, &failed, 1, MRL_DIST_I64, MRL_DIST_MAX));
    mrl_dist_finalize(D);
    if (failed && !check_failures) check_failures = 1;
    if (R != 0 && !check_failures) return 0; /* one summary line for the job */
    CHECK_DONE();
}
