/* bf16 matrix products (kernels/cpu/gemm_bf16.h) against the fp32 path, on
 * the products of a training step and of decoding, at 1 and 2 threads:
 *   sgemm   the fast table's gemm (OpenBLAS sgemm, or oneDNN's fp32 matmul where
 *           OpenBLAS's kernels are below the CPU's: cpu/blas.h), everything fp32
 *   own     our AVX512-BF16 kernel
 *   dnnl    oneDNN's bf16 matmul
 *   dnnl32  oneDNN's fp32 matmul (a candidate for the fp32 path)
 *   auto    mrl_cpu_gemm_bf16's per-shape choice
 *   panels  our kernel with W as bf16 weight panels (kernels.h, MRL_PANEL16:
 *           packed once per update, as the engine keeps them), x W^T only
 *   amx     our AMX kernel on the same panels (gemm_bf16_amx.c), x W^T only
 *   tiles   our packed kernel with AMX tiles for its micro-tile (any product)
 * The bf16 paths get operands as the model will hold them: weights as bf16
 * copies, activations and gradients fp32 (rounded while packing, or copied
 * to bf16 first for oneDNN; that cost is in the times), except the head's
 * dlogits, which the model rounds to bf16 once for both of its products.
 *
 * Shapes: (i) a ~100M Llama (hidden 768, intermediate 2048, 12 heads of 64,
 * vocab 32000) over T = 2048 tokens: each linear layer's forward x W^T (NT),
 * input gradient dy W (NN) and weight gradient dy^T x (TN); the head over
 * its chunks of at most 2^25 / V tokens, cut evenly as core/model/forward.c does; (ii)
 * SmolLM2-135M (hidden 576, intermediate 1536, 9 heads and 3 kv heads of
 * 64, vocab 49152) likewise; (iii) decode x W^T with M = 1, 4, 16, 32, 64 rows
 * against each weight matrix, cycling through copies of it that together
 * pass 64 MB in bf16 (twice the L3), so that W comes from memory, as in a
 * decode step over all layers of a model (the 100M model: 200 MB in bf16).
 *
 *   build/bench/bench_gemm_bf16 [reps=5] [threads: 0 = 1 and 2] [part: 0 all, 1 training, 2 decode]
 *   BENCH_COPIES=n: the training products too in turn over n copies of both operands (default 1)
 * Prints markdown tables of GFLOP/s (best of reps) and the bf16 peak. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kernels.h"
#include "moonrl/dtype.h"
#include "base/parallel.h"
#include "cpu/blas.h"
#include "cpu/gemm_bf16.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

enum { SGEMM, OWN, DNNL, DNNL32, AUTO, PANELS, AMX, TILES, PATHS };
static const char *path_names[PATHS] = {"sgemm", "own", "dnnl", "dnnl32", "auto", "panels", "amx", "tiles"};

typedef struct shape {
    const char *model, *name;
    int ta, tb;
    int64_t M, N, K;
    int weight_b; /* B is a weight (bf16 copy for the bf16 paths); else an fp32 activation */
    int a16;      /* A is bf16 already for the bf16 paths (the head's dlogits: the model keeps a bf16 copy) */
} shape;

/* One linear layer [out, in] over T tokens: forward, input gradient, weight gradient. */
static int layer(shape *s, const char *model, const char *name, int64_t T, int64_t out, int64_t in) {
    int head = strcmp(name, "head") == 0;
    s[0] = (shape){model, name, 0, 1, T, out, in, 1, 0};     /* y = x W^T   */
    s[1] = (shape){model, name, 0, 0, T, in, out, 1, head};  /* dx = dy W   */
    s[2] = (shape){model, name, 1, 0, out, in, T, 0, head};  /* dW = dy^T x */
    return 3;
}

static int model_shapes(shape *s, const char *model, int64_t T, int64_t D, int64_t F, int64_t Q, int64_t KV,
                        int64_t V) {
    int n = 0;
    n += layer(s + n, model, "q / o", T, Q, D);
    if (KV != Q) n += layer(s + n, model, "k, v", T, KV, D);
    n += layer(s + n, model, "gate, up", T, F, D);
    n += layer(s + n, model, "down", T, D, F);
    /* the model's head chunks (core/model/forward.c): at most 128 MiB of logits, cut evenly */
    int64_t chunk = ((int64_t)1 << 25) / V, chunks = (T + chunk - 1) / chunk;
    n += layer(s + n, model, "head", (T + chunks - 1) / chunks, V, D);
    return n;
}

/* How many products of each shape one training step of the model makes per
 * layer (q, o: 2 of [D,D]; k, v: 2; gate, up: 2; down: 1), for the
 * time-weighted totals; the head once per chunk (T / chunk) for all layers. */
static double step_count(const shape *s, int64_t T, int layers) {
    if (strcmp(s->name, "head") == 0) return (double)T / (s->ta ? s->K : s->M); /* chunks */
    if (strcmp(s->name, "down") == 0) return layers;
    if (strcmp(s->name, "q / o") == 0 && strstr(s->model, "100M")) return 4.0 * layers; /* q, k, v, o all [D,D] */
    return 2.0 * layers;
}

static float *filled(int64_t n) {
    float *x = malloc(sizeof(float) * (n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
    return x;
}

static uint16_t *bf16_copy(const float *x, int64_t n) {
    uint16_t *h = malloc(2 * (n > 0 ? n : 1));
    mrl_cpu_bf16_from_f32(h, x, n);
    return h;
}

/* One product on one path; returns 0, or -1 when the path cannot run. */
static int product(int path, const shape *s, const float *Af, const uint16_t *Ah, const float *B, const uint16_t *Bh,
                   const uint32_t *Bp, float *C) {
    int64_t lda = s->ta ? s->M : s->K, ldb = s->tb ? s->K : s->N;
    const void *b = s->weight_b ? (const void *)Bh : (const void *)B;
    const float *A = Af; /* the fp32 paths' A (and the panels', x W^T only) */
    const void *a = s->a16 ? (const void *)Ah : (const void *)Af;
    int ab = s->a16;
    switch (path) {
    case SGEMM:
        mrl_kernels_cpu_fast()->gemm(s->ta, s->tb, s->M, s->N, s->K, 1.0f, A, lda, B, ldb, 0.0f, C, s->N);
        return 0;
    case OWN:
        return mrl_cpu_gemm_bf16_own(s->ta, s->tb, s->M, s->N, s->K, 1.0f, a, ab, lda, b, s->weight_b, ldb, 0.0f, C,
                                     s->N);
    case DNNL:
        return mrl_cpu_gemm_bf16_onednn(s->ta, s->tb, s->M, s->N, s->K, 1.0f, a, ab, lda, b, s->weight_b, ldb, 0.0f,
                                        C, s->N);
    case PANELS:
        if (!Bp) return -1;
        return mrl_cpu_gemm_bf16_panels_own(s->M, s->N, s->K, 1.0f, A, lda, Bp, 0.0f, C, s->N);
    case AMX: {
        if (!Bp) return -1;
        mrl_panels_part w = {s->N, Bp, NULL, 0, 1.0f, 0.0f, C, s->N};
        return mrl_cpu_gemm_bf16_panels_group_amx(s->M, s->K, A, lda, 1, &w);
    }
    case TILES:
        return mrl_cpu_gemm_bf16_amx(s->ta, s->tb, s->M, s->N, s->K, 1.0f, a, ab, lda, b, s->weight_b, ldb, 0.0f, C,
                                     s->N);
    case DNNL32:
        return mrl_cpu_gemm_f32_onednn(s->ta, s->tb, s->M, s->N, s->K, 1.0f, A, lda, B, ldb, 0.0f, C, s->N);
    default:
        mrl_cpu_gemm_bf16(s->ta, s->tb, s->M, s->N, s->K, 1.0f, a, ab, lda, b, s->weight_b, ldb, 0.0f, C, s->N);
        return 0;
    }
}

/* Seconds of one pass over `copies` products (each with its own B). */
static double pass_time(int path, const shape *s, int copies, int a_copies, float **A, uint16_t **Ah, float **B,
                        uint16_t **Bh, uint32_t **Bp, float *C) {
    double t0 = now();
    for (int i = 0; i < copies; i++) product(path, s, A[i % a_copies], Ah[i % a_copies], B[i], Bh[i], Bp[i], C);
    return now() - t0;
}

static const char *op_name(const shape *s) { return s->ta ? "TN dW" : s->tb ? "NT fwd" : "NN dX"; }

/* Times every path on every shape; rates[i][path] in GFLOP/s (0: cannot run). */
#define MAX_COPIES 64

/* copies = 0: as many as pass 64 MB of bf16 (at most MAX_COPIES) */
static void run_shapes(const shape *s, int n, int want_copies, int reps, double (*rates)[PATHS]) {
    for (int i = 0; i < n; i++) {
        int64_t a_n = s[i].M * s[i].K, b_n = s[i].K * s[i].N;
        int copies = want_copies ? want_copies : (int)(((int64_t)64 << 20) / (2 * b_n) + 1);
        if (copies > MAX_COPIES) copies = MAX_COPIES;
        /* the training products (want_copies > 1) cycle A too: a step's activations come from memory */
        int a_copies = want_copies > 1 ? copies : 1;
        float *A[MAX_COPIES], *C = filled(s[i].M * s[i].N);
        uint16_t *Ah[MAX_COPIES];
        for (int c = 0; c < a_copies; c++) A[c] = filled(a_n), Ah[c] = bf16_copy(A[c], a_n);
        float *B[MAX_COPIES];
        uint16_t *Bh[MAX_COPIES];
        uint32_t *Bp[MAX_COPIES];
        int panels = s[i].weight_b && !s[i].ta && s[i].tb && mrl_cpu_has_avx512_bf16();
        for (int c = 0; c < copies; c++) {
            B[c] = filled(b_n), Bh[c] = bf16_copy(B[c], b_n), Bp[c] = NULL;
            if (panels) {
                Bp[c] = aligned_alloc(64, (4 * mrl_panels16_dwords(s[i].N, s[i].K) + 63) / 64 * 64);
                mrl_cpu_panels16_pack_own(Bp[c], Bh[c], s[i].N, s[i].K);
            }
        }
        /* the paths in turn within each repetition, so that a burst of load
         * on the (shared) machine falls on all of them alike; best of reps */
        double best[PATHS];
        for (int p = 0; p < PATHS; p++) /* warm-up (primitives, scratch); -1: cannot run */
            best[p] = product(p, &s[i], A[0], Ah[0], B[0], Bh[0], Bp[0], C) == 0 ? 1e30 : -1;
        for (int r = 0; r < reps; r++)
            for (int p = 0; p < PATHS; p++) {
                if (best[p] < 0) continue;
                double t = pass_time(p, &s[i], copies, a_copies, A, Ah, B, Bh, Bp, C);
                if (t < best[p]) best[p] = t;
            }
        for (int p = 0; p < PATHS; p++)
            rates[i][p] = best[p] > 0 ? 2.0 * s[i].M * s[i].N * s[i].K * copies / best[p] * 1e-9 : 0;
        for (int c = 0; c < copies; c++) free(B[c]), free(Bh[c]), free(Bp[c]);
        for (int c = 0; c < a_copies; c++) free(A[c]), free(Ah[c]);
        free(C);
    }
}

static const char *path_label(mrl_bf16_path p) {
    return p == MRL_BF16_OWN ? "own" : p == MRL_BF16_ONEDNN ? "dnnl" : p == MRL_BF16_AMX ? "tiles" : "reference";
}

static void print_table(const char *title, const shape *s, int n, double (*rates)[PATHS], int threads) {
    printf("\n%s, %d thread%s (GFLOP/s)\n\n", title, threads, threads > 1 ? "s" : "");
    printf("| model | matrix | op | M x N x K | sgemm | own | dnnl | dnnl32 | auto (picks) | panels | amx | tiles |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++) {
        printf("| %s | %s | %s | %lld x %lld x %lld |", s[i].model, s[i].name, op_name(&s[i]), (long long)s[i].M,
               (long long)s[i].N, (long long)s[i].K);
        for (int p = 0; p < PATHS; p++) {
            if (p == PANELS) printf(" (%s) |", path_label(mrl_cpu_bf16_pick(s[i].ta, s[i].tb, s[i].M, s[i].N, s[i].K)));
            if (rates[i][p] <= 0) printf(" - |");
            else printf(" %.1f%s", rates[i][p], p == AUTO ? "" : " |");
        }
        printf("\n");
    }
}

/* Time-weighted rate over a step's products: total flops / total time. */
static void print_step(const char *model, const shape *s, int n, double (*rates)[PATHS], int64_t T, int layers,
                       double best, double peak) {
    double flops = 0, time[PATHS] = {0};
    for (int i = 0; i < n; i++) {
        if (strcmp(s[i].model, model) != 0) continue;
        double f = 2.0 * s[i].M * s[i].N * s[i].K * step_count(&s[i], T, layers);
        flops += f;
        for (int p = 0; p < PATHS; p++) time[p] += rates[i][p] > 0 ? f / (rates[i][p] * 1e9) : 1e30;
    }
    printf("\n%s, one step's products (time-weighted):", model);
    for (int p = 0; p < PATHS; p++)
        if (time[p] < 1e29) printf(" %s %.1f%s", path_names[p], flops / time[p] * 1e-9, p < PATHS - 1 ? "," : "");
    if (best > 0 && time[AUTO] < 1e29)
        printf(" -> auto at %.0f%% of the best bf16 product, %.0f%% of the vdpbf16ps peak",
               100 * flops / time[AUTO] * 1e-9 / best, peak > 0 ? 100 * flops / time[AUTO] * 1e-9 / peak : 0.0);
    printf("\n");
}

/* ---- the instruction's own peak: 24 chains of vdpbf16ps, no loads ---------- */

#define DP(r) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define DP24 DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11) DP(12) DP(13) DP(14) \
    DP(15) DP(16) DP(17) DP(18) DP(19) DP(20) DP(21) DP(22) DP(23)
#define CLOBBERS                                                                                         \
    "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20",        \
        "xmm21", "xmm22", "xmm23"

__attribute__((target("avx512f,avx512bf16"))) static void dp_loop(void *ctx, int64_t t0, int64_t t1) {
    long n = *(long *)ctx;
    for (int64_t t = t0; t < t1; t++)
        for (long i = 0; i < n; i++) __asm__ volatile(DP24 ::: CLOBBERS);
}

/* GFLOP/s of `threads` threads each running the chains (64 flops per instruction). */
static double dp_peak(int threads) {
    if (!mrl_cpu_has_avx512_bf16()) return 0;
    long n = 20000000;
    double best = 0;
    for (int r = 0; r < 3; r++) {
        double t0 = now();
        mrl_parallel_for(threads, 1, dp_loop, &n);
        double rate = threads * n * 24 * 64.0 / (now() - t0) * 1e-9;
        if (rate > best) best = rate;
    }
    return best;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5, only = argc > 2 ? atoi(argv[2]) : 0, part = argc > 3 ? atoi(argv[3]) : 0;
    printf("bf16 path: %s; fp32 path (sgemm): %s\n", mrl_cpu_bf16_path(), mrl_cpu_f32_path_name());
    shape train[64], decode[64];
    int n_train = 0, n_decode = 0;
    n_train += model_shapes(train + n_train, "100M", 2048, 768, 2048, 768, 768, 32000);
    n_train += model_shapes(train + n_train, "SmolLM2-135M", 2048, 576, 1536, 576, 192, 49152);
    /* decode: x W^T against each weight (the head excepted: one product a step, at the end) */
    for (int i = 0; i < n_train; i++) {
        const shape *s = &train[i];
        if (s->ta || !s->tb || strcmp(s->name, "head") == 0) continue;
        for (int64_t M = 1; M <= 1024; M = M == 1 ? 4 : M >= 64 ? 4 * M : M * 2)
            decode[n_decode++] = (shape){s->model, s->name, 0, 1, M, s->N, s->K, 1, 0};
    }
    static double rates[64][PATHS], drates[64][PATHS];
    for (int threads = 1; threads <= 2; threads++) {
        if (only && threads != only) continue;
        mrl_parallel_set_threads(threads);
        double peak = dp_peak(threads);
        if (part != 2) run_shapes(train, n_train, getenv("BENCH_COPIES") ? atoi(getenv("BENCH_COPIES")) : 1, reps, rates);
        if (part != 1) run_shapes(decode, n_decode, 0, reps, drates);
        double best = 0; /* the best bf16 rate of any shape and path */
        for (int p = OWN; p < PATHS; p++) {
            if (p == DNNL32) continue;
            for (int i = 0; i < n_train; i++) best = rates[i][p] > best ? rates[i][p] : best;
            for (int i = 0; i < n_decode; i++) best = drates[i][p] > best ? drates[i][p] : best;
        }
        printf("\n## %d thread%s: vdpbf16ps peak (24 chains, no loads) %.1f GFLOP/s; best bf16 product %.1f GFLOP/s\n",
               threads, threads > 1 ? "s" : "", peak, best);
        if (part != 2) {
            print_table("Training products (T = 2048; head: one chunk)", train, n_train, rates, threads);
            print_step("100M", train, n_train, rates, 2048, 12, best, peak);
            print_step("SmolLM2-135M", train, n_train, rates, 2048, 30, best, peak);
        }
        if (part != 1) print_table("Decode x W^T (copies of W passing 64 MB, in turn)", decode, n_decode, drates, threads);
    }
    mrl_parallel_set_threads(0);
    return 0;
}
