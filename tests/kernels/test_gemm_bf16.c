/* bf16 matrix products (kernels/cpu/gemm_bf16.h): the conversions against an
 * independent rounding, the reference against float64 sums of the rounded
 * inputs, and every fast path (our AVX512-BF16 kernel, oneDNN) and the
 * dispatcher against the reference on fresh random inputs: many shapes,
 * every transposition, alpha / beta, fp32 or bf16 operands, padded leading
 * dimensions. Paths this CPU lacks are skipped; with none of them the test
 * says so and exits 77 after the checks that could run.
 *
 * Tolerance (fast path vs reference), per element of C:
 *   |alpha| gamma(K + 8) S + 4u (|alpha| |P| + |beta C0|) + 2^-100,
 * u = 2^-24, gamma(n) = n u / (1 - n u), P = sum_k a_k b_k and S = sum_k
 * |a_k b_k| over the bf16-rounded inputs. Why: a product of two bf16 (8
 * significant bits each) is exact in fp32, so a path's only errors are the
 * fp32 additions; any order or blocking of K terms (dpbf16's pairs, K
 * blocks added into C, oneDNN's own order) makes at most K + a few
 * roundings along the way to each element, each at most u times a partial
 * sum bounded by S (Higham, Accuracy and Stability, 4.2); alpha, beta and
 * the blocks' adds into C are the "+ 8" and the 4u term. The reference is
 * exact to within 2^-50 S before its one rounding. 2^-100 covers denormal
 * products, read as zero by the bf16 instructions (our inputs stay far from
 * them). The bound is tight where it matters: for small K it is a few ulp,
 * so a wrong rounding of the inputs (truncation: 2^-9 relative) fails it. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "moonrl/dtype.h"
#include "base/parallel.h"
#include "cpu/gemm_bf16.h"
#include "kernels.h" /* the bf16 weight panels */
#include "random.h"

static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---- an independent rounding: the nearer of the two bf16 neighbours ---------- */

static uint16_t expected_bf16(float f) {
    uint32_t u = f32_bits(f);
    if (isnan(f)) return 0xffff; /* any NaN: checked as "is a NaN" */
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1); /* truncation, and one ulp away from zero */
    if ((u & 0xffff) == 0) return lo;
    double dlo = fabs((double)f - (double)bits_f32((uint32_t)lo << 16));
    /* hi may be inf (0x7f80 / 0xff80): its distance is from the largest bf16 plus one ulp, 2^128 */
    double vhi = (hi & 0x7fff) == 0x7f80 ? ldexp(signbit(f) ? -1.0 : 1.0, 128) : (double)bits_f32((uint32_t)hi << 16);
    double dhi = fabs((double)f - vhi);
    if (dlo != dhi) return dlo < dhi ? lo : hi;
    return (lo & 1) ? hi : lo; /* a tie: the even one */
}

static int same_bf16(uint16_t got, uint16_t want) {
    if (want == 0xffff) return (got & 0x7f80) == 0x7f80 && (got & 0x7f) != 0; /* NaN stays NaN */
    return got == want;
}

static void test_conversions(void) {
    static const uint32_t edges[] = {
        0x3f808000, /* 1 + 2^-8: a tie, rounds to even (down) */
        0x3f818000, /* a tie, rounds to even (up) */
        0x3f808001, 0x3f807fff, 0x3f800001, 0xbf808000, 0xbf818000,
        0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x007fffff, 0x00400000, 0x80018000, /* denormals */
        0x00800000, 0x00807fff, 0x00808000, /* the smallest normal */
        0x7f7f0000, 0x7f7f7fff, 0x7f7f8000, 0x7f7fffff, 0xff7fffff, /* around the largest: ties round to inf */
        0x7f800000, 0xff800000, /* inf */
        0x7fc00000, 0xffc00000, 0x7f800001, 0x7fffffff, 0xff800001, 0x7f810000, /* NaNs: quiet, signalling, payloads */
    };
    int n_edges = sizeof edges / sizeof edges[0];
    enum { N = 1 << 20 }; /* large enough to be split over the threads */
    float *src = malloc(sizeof(float) * N);
    uint16_t *dst = malloc(2 * N);
    float *back = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) {
        uint32_t u = i < n_edges ? edges[i] : (uint32_t)rand_u64();
        if (i >= n_edges && i % 4 == 0) u = (u & 0xffff0000u) | 0x8000u; /* many ties */
        src[i] = bits_f32(u);
    }
    int bad = 0;
    for (int threads = 1; threads <= 2; threads++) {
        mrl_parallel_set_threads(threads);
        memset(dst, 0, 2 * N);
        mrl_cpu_bf16_from_f32(dst, src, N);
        for (int i = 0; i < N; i++)
            if (!same_bf16(dst[i], expected_bf16(src[i])) ||
                (i < n_edges && !isnan(src[i]) && dst[i] != mrl_f32_to_bf16(src[i]))) {
                if (bad++ < 8) fprintf(stderr, "f32 %08x -> bf16 %04x, expected %04x\n", f32_bits(src[i]), dst[i],
                                       expected_bf16(src[i]));
            }
    }
    CHECK(bad == 0);
    /* a NaN stays a quiet NaN, with its sign */
    for (int i = 0; i < n_edges; i++)
        if (isnan(src[i])) CHECK((dst[i] & 0xffc0) == ((f32_bits(src[i]) >> 16 & 0x8000) | 0x7fc0));

    /* bf16 -> f32 is exact: every one of the 65536 values, and back */
    for (int i = 0; i < 65536; i++) dst[i] = (uint16_t)i;
    mrl_cpu_bf16_to_f32(back, dst, 65536);
    bad = 0;
    for (int i = 0; i < 65536; i++) bad += f32_bits(back[i]) != (uint32_t)i << 16;
    CHECK(bad == 0);
    mrl_cpu_bf16_from_f32(dst, back, 65536);
    bad = 0;
    for (int i = 0; i < 65536; i++) bad += !isnan(back[i]) && dst[i] != i;
    CHECK(bad == 0);
    mrl_parallel_set_threads(0);
    free(src), free(dst), free(back);
}

/* ---- products ------------------------------------------------------------------------ */

typedef struct product {
    int ta, tb, a_bf16, b_bf16;
    int64_t M, N, K, lda, ldb, ldc;
    float alpha, beta;
    void *A, *B;  /* as the path reads them (fp32 or bf16) */
    double *Ar, *Br; /* op(A) [M,K] and op(B) [K,N], bf16-rounded, for the float64 sums */
    float *C0;    /* C before the product */
    double *want, *tol_fast, *tol_ref; /* [M,N]: the float64 result and the two bounds */
} product;

/* A value of varied size: a few rows and columns are much larger, so that
 * the relative bound is tried on sums that cancel. */
static float value(int64_t i, int64_t j) {
    float x = (float)(2 * urand() - 1);
    if (i % 7 == 3 || j % 11 == 5) x *= 64;
    return x;
}

/* X stored [rows, cols] with leading dimension ld (entries past cols: NaN, never read) */
static void *operand(int bf16, int64_t rows, int64_t cols, int64_t ld, double *rounded, int trans) {
    size_t n = (size_t)(rows > 0 ? rows : 1) * (ld > 0 ? ld : 1);
    void *X = malloc(n * (bf16 ? 2 : 4));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++) {
            float v = c < cols ? value(r, c) : NAN;
            uint16_t h = mrl_f32_to_bf16(v);
            if (bf16) ((uint16_t *)X)[r * ld + c] = h;
            else ((float *)X)[r * ld + c] = v;
            if (c < cols) { /* logical (i, k) = stored (r, c), or (c, r) when transposed */
                int64_t lr = trans ? c : r, lc = trans ? r : c, lcols = trans ? rows : cols;
                rounded[lr * lcols + lc] = mrl_bf16_to_f32(h);
            }
        }
    return X;
}

static void free_product(product *p) {
    free(p->A), free(p->B), free(p->Ar), free(p->Br), free(p->C0), free(p->want), free(p->tol_fast), free(p->tol_ref);
}

static const double u32 = 0x1p-24;
static double gamma_n(double n) { return n * u32 / (1 - n * u32); }

/* The float64 result of the rounded inputs, and the bounds (see the top). */
static void expect(product *p) {
    p->want = malloc(sizeof(double) * p->M * p->N);
    p->tol_fast = malloc(sizeof(double) * p->M * p->N);
    p->tol_ref = malloc(sizeof(double) * p->M * p->N);
    for (int64_t m = 0; m < p->M; m++)
        for (int64_t n = 0; n < p->N; n++) {
            double sum = 0, abs_sum = 0;
            for (int64_t k = 0; k < p->K; k++) {
                double t = p->Ar[m * p->K + k] * p->Br[k * p->N + n];
                sum += t, abs_sum += fabs(t);
            }
            double c0 = p->beta != 0 ? p->C0[m * p->ldc + n] : 0;
            double want = (double)p->alpha * sum + (double)p->beta * c0;
            double big = fabs((double)p->alpha * sum) + fabs((double)p->beta * c0);
            p->want[m * p->N + n] = want;
            p->tol_fast[m * p->N + n] = fabs(p->alpha) * gamma_n((double)p->K + 8) * abs_sum + 4 * u32 * big + 0x1p-100;
            p->tol_ref[m * p->N + n] = u32 * fabs(want) + 0x1p-50 * (fabs(p->alpha) * abs_sum + big) + 0x1p-140;
        }
}

static product make_product(int ta, int tb, int a_bf16, int b_bf16, int64_t M, int64_t N, int64_t K, float alpha,
                            float beta, int pad) {
    product p = {ta, tb, a_bf16, b_bf16, M, N, K, 0, 0, 0, alpha, beta};
    int64_t a_cols = ta ? M : K, b_cols = tb ? K : N;
    p.lda = a_cols + (pad ? randi(5) : 0);
    p.ldb = b_cols + (pad ? randi(5) : 0);
    p.ldc = N + (pad ? randi(5) : 0);
    p.Ar = malloc(sizeof(double) * (M * K + 1));
    p.Br = malloc(sizeof(double) * (K * N + 1));
    p.A = operand(a_bf16, ta ? K : M, a_cols, p.lda, p.Ar, ta);
    p.B = operand(b_bf16, tb ? N : K, b_cols, p.ldb, p.Br, tb);
    p.C0 = malloc(sizeof(float) * (M * p.ldc + 1));
    for (int64_t i = 0; i < M * p.ldc; i++) p.C0[i] = beta == 0 ? NAN : (float)(2 * urand() - 1);
    expect(&p);
    return p;
}

/* C (after a product) against the float64 result, with the fast-path bound
 * or the reference's (one rounding). Returns the number of bad elements. */
static int64_t compare(const product *p, const float *C, int fast, const char *what) {
    int64_t bad = 0;
    for (int64_t m = 0; m < p->M; m++)
        for (int64_t n = 0; n < p->N; n++) {
            double want = p->want[m * p->N + n], tol = (fast ? p->tol_fast : p->tol_ref)[m * p->N + n];
            double got = C[m * p->ldc + n];
            if (!(fabs(got - want) <= tol)) {
                if (bad++ < 3)
                    fprintf(stderr, "%s: %s%s %s%s M=%lld N=%lld K=%lld alpha=%g beta=%g ld %lld/%lld/%lld: C[%lld,%lld] = %.9g, want %.9g (tol %.3g)\n",
                            what, p->ta ? "T" : "N", p->tb ? "T" : "N", p->a_bf16 ? "bf16" : "f32",
                            p->b_bf16 ? "/bf16" : "/f32", (long long)p->M, (long long)p->N, (long long)p->K,
                            p->alpha, p->beta, (long long)p->lda, (long long)p->ldb, (long long)p->ldc, (long long)m,
                            (long long)n, got, want, tol);
            }
        }
    /* the padding of C is left alone */
    for (int64_t m = 0; m < p->M; m++)
        for (int64_t n = p->N; n < p->ldc; n++) {
            float before = p->C0[m * p->ldc + n], after = C[m * p->ldc + n];
            if (memcmp(&before, &after, 4) != 0 && bad++ < 3) fprintf(stderr, "%s: wrote past N\n", what);
        }
    return bad;
}

typedef int (*path_fn)(int, int, int64_t, int64_t, int64_t, float, const void *, int, int64_t, const void *, int,
                       int64_t, float, float *, int64_t);

static int run_reference(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int a_bf16,
                         int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C, int64_t ldc) {
    mrl_cpu_gemm_bf16_reference(ta, tb, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc);
    return 0;
}
static int run_dispatch(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int a_bf16,
                        int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C, int64_t ldc) {
    mrl_cpu_gemm_bf16(ta, tb, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc);
    return 0;
}

/* x W^T with W as bf16 weight panels (the engine's products; kernels.h):
 * B (stored [N,K]) rounded to a plain bf16 copy and packed, A given as fp32
 * (a bf16 A widened, exactly); `dispatch` 0: our AVX512-BF16 kernel on the
 * panels, 1: the dispatcher, given the plain copy too, 2: our AMX kernel.
 * Only NT products. */
static int run_panels_as(int dispatch, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int a_bf16,
                         int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C, int64_t ldc) {
    uint16_t *W = malloc(2 * (N * K + 1));
    uint32_t *P = malloc(4 * (mrl_panels16_dwords(N, K) + 1));
    float *Af = malloc(4 * (M * lda + 1));
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++)
            W[n * K + k] = b_bf16 ? ((const uint16_t *)B)[n * ldb + k] : mrl_f32_to_bf16(((const float *)B)[n * ldb + k]);
    for (int64_t i = 0; i < M * lda; i++)
        Af[i] = a_bf16 ? mrl_bf16_to_f32(((const uint16_t *)A)[i]) : ((const float *)A)[i];
    mrl_cpu_panels16_pack(P, W, N, K);
    int st = 0;
    mrl_panels_part part = {N, P, NULL, 0, alpha, beta, C, ldc};
    if (dispatch == 1) mrl_cpu_gemm_bf16_panels(M, N, K, alpha, Af, lda, P, W, K, beta, C, ldc);
    else if (dispatch == 2) st = mrl_cpu_gemm_bf16_panels_group_amx(M, K, Af, lda, 1, &part);
    else st = mrl_cpu_gemm_bf16_panels_own(M, N, K, alpha, Af, lda, P, beta, C, ldc);
    free(W), free(P), free(Af);
    return st;
}
static int run_panels_own(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int a_bf16,
                          int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (ta || !tb) return -1;
    return run_panels_as(0, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc);
}
static int run_panels_amx(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int a_bf16,
                          int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (ta || !tb) return -1;
    return run_panels_as(2, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc);
}
static int run_panels_dispatch(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                               int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                               int64_t ldc) {
    if (ta || !tb) return -1;
    return run_panels_as(1, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc);
}

static float *run_on(const product *p, path_fn fn) {
    float *C = malloc(sizeof(float) * (p->M * p->ldc + 1));
    memcpy(C, p->C0, sizeof(float) * p->M * p->ldc);
    int status = fn(p->ta, p->tb, p->M, p->N, p->K, p->alpha, p->A, p->a_bf16, p->lda, p->B, p->b_bf16, p->ldb,
                    p->beta, C, p->ldc);
    CHECK(status == 0);
    return C;
}

typedef struct path {
    const char *name;
    path_fn fn;
    int fast; /* judged with the fast-path bound */
    int available;
    int nt_only; /* x W^T only (the weight panels) */
} path;

/* Edge shapes first (a single row, column or k; K odd; sizes around the
 * kernels' 16 / 48 / 8 blocks and the 256-pair K blocks), then random ones. */
static void shape(int i, int64_t *M, int64_t *N, int64_t *K) {
    static const int64_t edge[][3] = {
        {1, 1, 1},    {1, 1, 2},    {1, 1, 3},    {2, 3, 1},    {1, 48, 64},  {1, 49, 33},  {7, 1, 300},
        {8, 48, 256}, {9, 47, 257}, {16, 96, 255}, {17, 97, 258}, {15, 15, 15}, {33, 130, 511}, {64, 100, 513},
        {100, 7, 31}, {257, 50, 40}, {3, 300, 129}, {130, 145, 77}, {1, 250, 300}, {300, 1, 100},
    };
    int n_edge = sizeof edge / sizeof edge[0];
    if (i < n_edge) {
        *M = edge[i][0], *N = edge[i][1], *K = edge[i][2];
        return;
    }
    /* mostly small (many cases), sometimes up to a few hundred */
    int64_t top = randi(4) == 0 ? 320 : 64;
    *M = 1 + randi(top), *N = 1 + randi(top), *K = 1 + randi(randi(3) == 0 ? 600 : 96);
}

static void test_products(const path *paths, int n_paths, int cases) {
    static const float alphas[] = {1.0f, -0.5f, 2.5f}, betas[] = {0.0f, 1.0f, -0.75f};
    int64_t bad[8] = {0};
    for (int c = 0; c < cases; c++) {
        int64_t M, N, K;
        shape(c, &M, &N, &K);
        int combo = c % 16; /* every transposition and operand type, in turn */
        product p = make_product(combo & 1, (combo >> 1) & 1, (combo >> 2) & 1, (combo >> 3) & 1, M, N, K,
                                 alphas[randi(3)], betas[randi(3)], c % 3 != 0);
        for (int i = 0; i < n_paths; i++) {
            if (!paths[i].available || (paths[i].nt_only && (p.ta || !p.tb))) continue;
            float *C = run_on(&p, paths[i].fn);
            bad[i] += compare(&p, C, paths[i].fast, paths[i].name);
            free(C);
        }
        free_product(&p);
    }
    for (int i = 0; i < n_paths; i++) {
        if (!paths[i].available) continue;
        printf("  %-15s %d products%s, %lld elements out of bound\n", paths[i].name, cases,
               paths[i].nt_only ? " (x W^T of them)" : "", (long long)bad[i]);
        CHECK(bad[i] == 0);
    }
}

/* 1 and 2 threads: our kernel gives the same bits (each element sums its k
 * in the same blocks and order whatever the tiling); oneDNN may cut K
 * differently per thread count, so it is held to the bound only. */
static void test_threads(const path *paths, int n_paths) {
    static const int64_t shapes[][3] = {{300, 200, 150}, {2, 2000, 1100}, {333, 130, 97}, {64, 1000, 257}};
    for (int s = 0; s < 4; s++)
        for (int combo = 0; combo < 4; combo++) {
            product p = make_product(combo & 1, combo >> 1, 0, combo & 1, shapes[s][0], shapes[s][1], shapes[s][2],
                                     1.0f, combo == 3 ? 1.0f : 0.0f, 1);
            for (int i = 0; i < n_paths; i++) {
                if (!paths[i].available || !paths[i].fast || (paths[i].nt_only && (p.ta || !p.tb))) continue;
                mrl_parallel_set_threads(1);
                float *one = run_on(&p, paths[i].fn);
                mrl_parallel_set_threads(2);
                float *two = run_on(&p, paths[i].fn);
                int same = memcmp(one, two, sizeof(float) * p.M * p.ldc) == 0;
                if (strcmp(paths[i].name, "onednn") == 0) {
                    if (s == 0 && combo == 0) printf("  onednn: 1 and 2 threads %s\n", same ? "bit-identical" : "differ (within the bound)");
                    CHECK(compare(&p, one, 1, "onednn 1 thread") == 0);
                    CHECK(compare(&p, two, 1, "onednn 2 threads") == 0);
                } else {
                    if (!same) fprintf(stderr, "%s: 1 and 2 threads differ (shape %d, combo %d)\n", paths[i].name, s, combo);
                    CHECK(same);
                }
                free(one), free(two);
            }
            free_product(&p);
        }
    mrl_parallel_set_threads(0);
}

/* Two threads making products at once (the engine's thread beside the
 * trainer's): the oneDNN primitive table and the per-thread scratch must
 * keep them apart. Each thread has its own OpenMP count of 1. */
typedef struct concurrent_job {
    product *p;
    path_fn fn;
    int64_t bad;
} concurrent_job;

static void *concurrent_run(void *v) {
    concurrent_job *j = v;
    mrl_parallel_set_thread_threads(1);
    for (int r = 0; r < 20; r++) {
        product *p = &j->p[r % 4];
        float *C = malloc(sizeof(float) * (p->M * p->ldc + 1));
        memcpy(C, p->C0, sizeof(float) * p->M * p->ldc);
        j->fn(p->ta, p->tb, p->M, p->N, p->K, p->alpha, p->A, p->a_bf16, p->lda, p->B, p->b_bf16, p->ldb, p->beta, C,
              p->ldc);
        j->bad += compare(p, C, 1, "concurrent");
        free(C);
    }
    return NULL;
}

static void test_concurrent(const path *paths, int n_paths) {
    product p[4];
    for (int i = 0; i < 4; i++) /* the same shapes in both threads: the same primitives */
        p[i] = make_product(0, i & 1, 0, 1, 40 + 17 * i, 96 + 31 * i, 64 + 45 * i, 1.0f, i == 3 ? 1.0f : 0.0f, 0);
    for (int i = 1; i < n_paths; i++) {
        if (!paths[i].available || paths[i].nt_only) continue;
        concurrent_job jobs[2] = {{p, paths[i].fn, 0}, {p, paths[i].fn, 0}};
        pthread_t t[2];
        for (int k = 0; k < 2; k++) pthread_create(&t[k], NULL, concurrent_run, &jobs[k]);
        for (int k = 0; k < 2; k++) pthread_join(t[k], NULL);
        CHECK(jobs[0].bad == 0 && jobs[1].bad == 0);
    }
    for (int i = 0; i < 4; i++) free_product(&p[i]);
}

/* K = 0 or alpha = 0: C = beta C, the operands unread (NULL here); M or N = 0: nothing. */
static void test_degenerate(void) {
    float C[6] = {1, 2, 3, 4, 5, 6};
    mrl_cpu_gemm_bf16(0, 1, 2, 3, 0, 1.0f, NULL, 0, 1, NULL, 1, 1, 2.0f, C, 3);
    CHECK(C[0] == 2 && C[5] == 12);
    mrl_cpu_gemm_bf16(0, 0, 2, 3, 5, 0.0f, NULL, 0, 5, NULL, 0, 3, 0.0f, C, 3);
    CHECK(C[0] == 0 && C[5] == 0);
    C[0] = 7;
    mrl_cpu_gemm_bf16(0, 0, 0, 3, 5, 1.0f, NULL, 0, 5, NULL, 0, 3, 0.0f, C, 3);
    mrl_cpu_gemm_bf16(0, 0, 2, 0, 5, 1.0f, NULL, 0, 5, NULL, 0, 3, 0.0f, C, 3);
    CHECK(C[0] == 7);
}

int main(void) {
    printf("bf16 here: %s (available: %d)\n", mrl_cpu_bf16_path(), mrl_cpu_bf16_available());
    test_conversions();
    test_degenerate();

    path paths[] = {
        {"reference", run_reference, 0, 1},
        {"own", mrl_cpu_gemm_bf16_own, 1, mrl_cpu_bf16_has_path(MRL_BF16_OWN)},
        {"onednn", mrl_cpu_gemm_bf16_onednn, 1, mrl_cpu_bf16_has_path(MRL_BF16_ONEDNN)},
        {"dispatch", run_dispatch, 1, 1},
        {"panels", run_panels_own, 1, mrl_cpu_bf16_has_path(MRL_BF16_OWN), 1},
        {"panels-dispatch", run_panels_dispatch, 1, 1, 1},
        {"panels-amx", run_panels_amx, 1, mrl_cpu_bf16_has_path(MRL_BF16_AMX), 1},
        {"amx", mrl_cpu_gemm_bf16_amx, 1, mrl_cpu_bf16_has_path(MRL_BF16_AMX)},
    };
    int n_paths = sizeof paths / sizeof paths[0];
    for (int i = 1; i < n_paths; i++)
        if (!paths[i].available) printf("  skipped: %s (not on this CPU or not built in)\n", paths[i].name);
    /* a path that cannot run here cannot be forced either */
    CHECK(mrl_cpu_bf16_force_path(MRL_BF16_OWN) == (paths[1].available ? 0 : -1));
    CHECK(mrl_cpu_bf16_force_path(MRL_BF16_ONEDNN) == (paths[2].available ? 0 : -1));
    CHECK(mrl_cpu_bf16_force_path(MRL_BF16_AMX) == (mrl_cpu_has_amx_bf16() ? 0 : -1));
    CHECK(mrl_cpu_bf16_force_path(MRL_BF16_AUTO) == 0);

    test_products(paths, n_paths, 400);
    test_threads(paths, n_paths);
    test_concurrent(paths, n_paths);
    /* the dispatcher forced onto each path, once over fewer cases */
    for (mrl_bf16_path f = MRL_BF16_REFERENCE; f < MRL_BF16_PATHS; f++)
        if (mrl_cpu_bf16_force_path(f) == 0) {
            path forced[] = {{"forced", run_dispatch, f != MRL_BF16_REFERENCE, 1},
                             {"forced-panels", run_panels_dispatch, f != MRL_BF16_REFERENCE, 1, 1}};
            test_products(forced, 2, 40);
        }
    mrl_cpu_bf16_force_path(MRL_BF16_AUTO);

    if (!paths[1].available && !paths[2].available) {
        printf("no bf16 hardware: only the reference and the conversions were tested\n");
        if (check_failures == 0) return 77;
    }
    CHECK_DONE();
}
