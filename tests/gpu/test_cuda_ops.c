/* Every slot of the CUDA op table (kernels/cuda, mrl_kernels_cuda) against
 * the CPU reference table on fresh random inputs, forward and backward:
 * each case makes its inputs on the host, runs the reference slot on host
 * copies and the CUDA slot on device copies (on a stream of our own, given
 * to the table with mrl_cuda_ops_set_stream), and compares every output by
 * the normalised error max |got - ref| / max |ref| with the tolerance stated
 * below with its reason; 0 means the same bits. Outputs are compared over
 * their whole buffers, so what an op must leave alone (gaps of a leading
 * dimension, cache slots not written) is checked too. The summary prints
 * the worst error of each (op, output).
 *
 * Skips (exit 77) where no GPU is visible.
 *   test_cuda_ops [GROUP]    the checks (GROUP: only gemm, rmsnorm, rope,
 *                            swiglu, rows, convert, optim, attn, head,
 *                            paged, sample, errors or memory)
 *   test_cuda_ops --bench    also the TFLOP/s of the products and attention
 *   SEED=n test_cuda_ops     other inputs */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "check.h"
#include "model/random_arrays.h"
#include "kernels.h"
#include "cuda_backend.h"
#include "moonrl/device.h"
#include "moonrl/dtype.h"
#include "moonrl/runtime.h"

/* ---- tolerances ---- */

/* Copies, and fp32 element-wise arithmetic done as the reference does it
 * (the same operations in the same order, no fused multiply-add): rows,
 * bias and its gradient (rows added in order), panels, the K/V write,
 * AdamW, scale, the conversions. */
#define TOL_BITS 0.0
/* fp32 dot products (cuBLASLt in CUBLAS_COMPUTE_32F, our kernels' fp32
 * sums) against the reference's double sums: a few 2^-24 times the
 * square root of the terms, relative to the largest output. */
#define TOL_DOT 1e-5
/* A sum over rows the reference adds in fp32 one row at a time (the
 * weight gradient of rmsnorm, over up to 300 rows): its own rounding,
 * up to sqrt(rows) 2^-24 of the partial sums. */
#define TOL_SUMF 5e-5
/* bf16 products: the operands are rounded to bf16 the same way on both
 * sides, so their products are exact; the difference is the tensor cores'
 * fp32 accumulation, which aligns the products of a step to the largest
 * before adding (their low bits are cut, not rounded): looser than
 * TOL_DOT by an order. */
#define TOL_BF16 1e-4
/* A row's sum in double, then fp32 scaling (rmsnorm), a rotation (RoPE),
 * SwiGLU in double with the GPU's exp: a few ulp. */
#define TOL_ULPS 1e-6
/* Attention and the head: fp32 scores, expf (2 ulp) and fp32 running sums
 * over up to a few hundred keys (a vocabulary for the head), against
 * double throughout. The backward's gradients are sums of products of
 * those, over every query or key. */
#define TOL_ATTN 2e-5
#define TOL_ATTN_BWD 1e-4
#define TOL_HEAD 1e-5
/* The sampler's log-probs (x - lse with lse from a double sum of double
 * exps in another order, one log): a few ulp of |x|. Tokens: the same. */
#define TOL_SAMPLE 1e-6
/* Sums in double in another order: the reference's one accumulator over
 * n terms carries about sqrt(n) 2^-53 of relative error itself (2e-13 at
 * the 3M terms below), our blocked sums less. */
#define TOL_SUM 1e-11

static const mrl_kernels *R, *G;
static void *stream;

/* ---- device memory ---- */

static void *up(const void *h, size_t bytes) {
    void *d = NULL;
    CHECK_OK(mrl_cuda_malloc(0, bytes ? bytes : 4, &d));
    if (bytes && h) CHECK_OK(mrl_cuda_memcpy(d, h, bytes, 0, stream));
    return d;
}
static void *upf(const float *h, int64_t n) { return up(h, (size_t)n * sizeof(float)); }
static void down(void *h, const void *d, size_t bytes) {
    CHECK_OK(mrl_cuda_ops_check()); /* the op's own errors first */
    if (bytes) CHECK_OK(mrl_cuda_memcpy(h, d, bytes, 1, stream));
}
/* ---- the summary ---- */

typedef struct row {
    char name[64];
    double tol, worst;
} row;
static row rows_[128];
static int n_rows_;

static void record(const char *op, const char *out, double tol, double e, const char *shape) {
    char name[64];
    snprintf(name, sizeof name, "%s.%s", op, out);
    row *r = NULL;
    for (int i = 0; i < n_rows_; i++)
        if (!strcmp(rows_[i].name, name)) r = &rows_[i];
    if (!r) {
        r = &rows_[n_rows_++];
        snprintf(r->name, sizeof r->name, "%s", name);
        r->tol = tol, r->worst = -1;
    }
    if (e > r->worst) r->worst = e;
    if (!(e <= tol)) fprintf(stderr, "%s %s: error %.3g > %.3g\n", name, shape, e, tol);
    CHECK(e <= tol);
}

/* normalised error (tol 0: the same bits, else inf); NaN matches NaN */
static double err_f32(const float *got, const float *want, int64_t n, double tol) {
    if (tol == 0) return memcmp(got, want, sizeof(float) * n) ? INFINITY : 0;
    double d = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i]) || !isfinite(want[i])) {
            if (!(isnan(got[i]) && isnan(want[i])) && got[i] != want[i]) return INFINITY;
            continue;
        }
        if (fabs((double)got[i] - want[i]) > d) d = fabs((double)got[i] - want[i]);
        if (fabs(want[i]) > s) s = fabs(want[i]);
    }
    return s > 0 ? d / s : d;
}

/* As err_f32, relative to at least `floor`: for outputs that are
 * differences of terms of that size (a gradient that cancels to 0). */
static double err_floor(const float *got, const float *want, int64_t n, double floor) {
    double e = err_f32(got, want, n, 1), s = 0;
    for (int64_t i = 0; i < n; i++)
        if (fabs(want[i]) > s) s = fabs(want[i]);
    return s >= floor || !isfinite(e) ? e : e * (s > 0 ? s : 1) / floor;
}

/* download n floats of dev, compare with want */
static void cmp(const char *op, const char *out, const void *dev, const float *want, int64_t n, double tol,
                const char *shape) {
    float *got = malloc(sizeof(float) * (n ? n : 1));
    down(got, dev, sizeof(float) * n);
    record(op, out, tol, err_f32(got, want, n, tol), shape);
    free(got);
}

static void cmp_bytes(const char *op, const char *out, const void *dev, const void *want, size_t bytes,
                      const char *shape) {
    void *got = malloc(bytes ? bytes : 1);
    down(got, dev, bytes);
    record(op, out, 0, memcmp(got, want, bytes) ? INFINITY : 0, shape);
    free(got);
}

static int irand(int n) { return (int)(urand() * n); }

/* ---- matrix products ---- */

static void case_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, float beta) {
    int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
    int64_t na = (ta ? K : M) * lda, nb = (tb ? N : K) * ldb, nc = M * ldc;
    float *A = rnd(na, 1), *B = rnd(nb, 1), *C = rnd(nc, 1);
    for (int64_t x = 0; x < nc; x++)
        if (beta == 0 && x % ldc < N) C[x] = NAN; /* must not be read */
    char shape[96];
    snprintf(shape, sizeof shape, "%c%c %lldx%lldx%lld beta %g", ta ? 'T' : 'N', tb ? 'T' : 'N', (long long)M,
             (long long)N, (long long)K, beta);
    void *dA = upf(A, na), *dB = upf(B, nb), *dC = upf(C, nc);
    R->gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    G->gemm(ta, tb, M, N, K, alpha, dA, lda, dB, ldb, beta, dC, ldc);
    cmp("gemm", "C", dC, C, nc, TOL_DOT, shape);
    mrl_cuda_free(dA), mrl_cuda_free(dB), mrl_cuda_free(dC);
    free(A), free(B), free(C);
}

/* n random values, rounded to bf16 and stored so when bf16 (else fp32) */
static void *rnd_maybe_bf16(int64_t n, int bf16) {
    float *x = rnd(n, 1);
    if (!bf16) return x;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) h[i] = mrl_f32_to_bf16(x[i]);
    free(x);
    return h;
}

static void case_gemm_bf16(int ta, int tb, int64_t M, int64_t N, int64_t K, int a16, int b16, float alpha,
                           float beta) {
    int64_t lda = (ta ? M : K) + (a16 ? 8 : 3), ldb = (tb ? K : N) + (b16 ? 8 : 5), ldc = N + 2;
    int64_t na = (ta ? K : M) * lda, nb = (tb ? N : K) * ldb, nc = M * ldc;
    float *C = rnd(nc, 1);
    void *A = rnd_maybe_bf16(na, a16), *B = rnd_maybe_bf16(nb, b16);
    for (int64_t x = 0; x < nc; x++)
        if (beta == 0 && x % ldc < N) C[x] = NAN;
    char shape[128];
    snprintf(shape, sizeof shape, "%c%c %lldx%lldx%lld %s x %s beta %g", ta ? 'T' : 'N', tb ? 'T' : 'N',
             (long long)M, (long long)N, (long long)K, a16 ? "bf16" : "f32", b16 ? "bf16" : "f32", beta);
    void *dA = up(A, (size_t)na * (a16 ? 2 : 4)), *dB = up(B, (size_t)nb * (b16 ? 2 : 4)), *dC = upf(C, nc);
    R->gemm_bf16(ta, tb, M, N, K, alpha, A, a16, lda, B, b16, ldb, beta, C, ldc);
    G->gemm_bf16(ta, tb, M, N, K, alpha, dA, a16, lda, dB, b16, ldb, beta, dC, ldc);
    cmp("gemm_bf16", "C", dC, C, nc, TOL_BF16, shape);
    mrl_cuda_free(dA), mrl_cuda_free(dB), mrl_cuda_free(dC);
    free(A), free(B), free(C);
}

/* panels_pack, and gemm_group with a plain product and one on panels */
static void case_group(int64_t M, int64_t N, int64_t K) {
    float *W = rnd(N * K, 1), *x = rnd(M * K, 1), *B2 = rnd(K * N, 1);
    int64_t np = mrl_panels_floats(N, K);
    float *P = malloc(sizeof(float) * np);
    R->panels_pack(P, W, N, K);
    char shape[64];
    snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
    void *dW = upf(W, N * K), *dP = up(NULL, sizeof(float) * np);
    G->panels_pack(dP, dW, N, K);
    cmp("panels_pack", "P", dP, P, np, TOL_BITS, shape);
    float *C1 = rnd(M * N, 1), *C2 = rnd(M * N, 1);
    void *dx = upf(x, M * K), *dB2 = upf(B2, K * N), *dC1 = upf(C1, M * N), *dC2 = upf(C2, M * N);
    mrl_gemm_desc g[2] = {{0, 1, M, N, K, 1.0f, x, K, P, K, 0.5f, C1, N, .b_panels = 1},
                          {1, 0, M, N, K, -0.75f, x, M, B2, N, 1.0f, C2, N, 0}};
    /* the second reads x [K,M] with lda M: the same floats seen transposed */
    mrl_gemm_desc d[2] = {g[0], g[1]};
    d[0].A = dx, d[0].B = dP, d[0].C = dC1;
    d[1].A = dx, d[1].B = dB2, d[1].C = dC2;
    R->gemm_group(g, 2);
    G->gemm_group(d, 2);
    cmp("gemm_group", "C (panels)", dC1, C1, M * N, TOL_DOT, shape);
    cmp("gemm_group", "C", dC2, C2, M * N, TOL_DOT, shape);
    mrl_cuda_free(dW), mrl_cuda_free(dP), mrl_cuda_free(dx), mrl_cuda_free(dB2), mrl_cuda_free(dC1),
        mrl_cuda_free(dC2);
    free(W), free(x), free(B2), free(P), free(C1), free(C2);
}

/* panels16_pack, and gemm_bf16_panels from the panels alone (made plain
 * again on the GPU) and with the plain copy given */
static void case_panels16(int64_t M, int64_t N, int64_t K) {
    uint16_t *W = rnd_maybe_bf16(N * K, 1);
    float *x = rnd(M * K, 1), *C1 = rnd(M * N, 1), *C2 = rnd(M * N, 1);
    int64_t np = mrl_panels16_dwords(N, K);
    uint32_t *P = malloc(sizeof(uint32_t) * np);
    R->panels16_pack(P, W, N, K);
    char shape[64];
    snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
    void *dW = up(W, 2 * (size_t)N * K), *dP = up(NULL, sizeof(uint32_t) * np), *dx = upf(x, M * K);
    G->panels16_pack(dP, dW, N, K);
    cmp_bytes("panels16_pack", "P", dP, P, sizeof(uint32_t) * np, shape);
    void *dC1 = upf(C1, M * N), *dC2 = upf(C2, M * N);
    R->gemm_bf16_panels(M, N, K, 0.75f, x, K, P, NULL, 0, 0.5f, C1, N);
    R->gemm_bf16_panels(M, N, K, 1.0f, x, K, P, NULL, 0, 0.0f, C2, N);
    G->gemm_bf16_panels(M, N, K, 0.75f, dx, K, dP, NULL, 0, 0.5f, dC1, N);
    G->gemm_bf16_panels(M, N, K, 1.0f, dx, K, dP, dW, K, 0.0f, dC2, N);
    cmp("gemm_bf16_panels", "C (panels)", dC1, C1, M * N, TOL_BF16, shape);
    cmp("gemm_bf16_panels", "C (plain copy)", dC2, C2, M * N, TOL_BF16, shape);
    mrl_cuda_free(dW), mrl_cuda_free(dP), mrl_cuda_free(dx), mrl_cuda_free(dC1), mrl_cuda_free(dC2);
    free(W), free(x), free(P), free(C1), free(C2);
}

/* gemm_bf16_panels_group: one A times the panels of two weights (as q and k, or gate and up),
 * the second with its plain copy, different N and beta */
static void case_panels16_group(int64_t M, int64_t N0, int64_t N1, int64_t K) {
    int64_t N[2] = {N0, N1};
    uint16_t *W[2];
    uint32_t *P[2];
    float *C[2];
    void *dW[2], *dP[2], *dC[2];
    float *x = rnd(M * K, 1);
    void *dx = upf(x, M * K);
    mrl_panels_part h[2], d[2];
    for (int i = 0; i < 2; i++) {
        int64_t np = mrl_panels16_dwords(N[i], K);
        W[i] = rnd_maybe_bf16(N[i] * K, 1), P[i] = malloc(sizeof(uint32_t) * np), C[i] = rnd(M * N[i], 1);
        R->panels16_pack(P[i], W[i], N[i], K);
        dW[i] = up(W[i], 2 * (size_t)N[i] * K), dP[i] = up(P[i], sizeof(uint32_t) * np), dC[i] = upf(C[i], M * N[i]);
        float beta = i ? 0.5f : 0.0f;
        h[i] = (mrl_panels_part){N[i], P[i], NULL, 0, 0.75f, beta, C[i], N[i]};
        d[i] = (mrl_panels_part){N[i], dP[i], i ? dW[i] : NULL, i ? K : 0, 0.75f, beta, dC[i], N[i]};
    }
    char shape[64];
    snprintf(shape, sizeof shape, "%lldx(%lld+%lld)x%lld", (long long)M, (long long)N0, (long long)N1, (long long)K);
    R->gemm_bf16_panels_group(M, K, x, K, h, 2);
    G->gemm_bf16_panels_group(M, K, dx, K, d, 2);
    cmp("gemm_bf16_panels_group", "C (first part)", dC[0], C[0], M * N0, TOL_BF16, shape);
    cmp("gemm_bf16_panels_group", "C (second part)", dC[1], C[1], M * N1, TOL_BF16, shape);
    for (int i = 0; i < 2; i++) {
        mrl_cuda_free(dW[i]), mrl_cuda_free(dP[i]), mrl_cuda_free(dC[i]);
        free(W[i]), free(P[i]), free(C[i]);
    }
    mrl_cuda_free(dx), free(x);
}

static void cases_gemm(void) {
    static const int64_t shapes[][3] = {{1, 1, 1},   {1, 33, 31},  {7, 33, 31},   {33, 7, 257},
                                        {16, 32, 256}, {230, 530, 270}, {64, 96, 0}, {9, 70, 83}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++) {
            float beta = (float)((s + t) % 3) * 0.5f, alpha = t == 3 ? -1.5f : 0.75f;
            case_gemm(t & 1, t >> 1, shapes[s][0], shapes[s][1], shapes[s][2], alpha, beta);
            int mode = (int)(s + t) % 4;
            if (shapes[s][2] > 0)
                case_gemm_bf16(t & 1, t >> 1, shapes[s][0], shapes[s][1], shapes[s][2], mode & 1, mode >> 1, alpha,
                               beta);
        }
    case_gemm_bf16(0, 1, 512, 1024, 768, 1, 1, 1.0f, 0.0f); /* a model's shape: tensor-core kernels */
    case_gemm_bf16(1, 0, 768, 1024, 512, 0, 0, 1.0f, 1.0f); /* the weight gradient's */
    case_group(5, 70, 33);
    case_group(64, 96, 128);
    case_panels16(1, 40, 37);
    case_panels16(13, 100, 600);
    case_panels16(64, 96, 128);
    case_panels16_group(7, 40, 24, 70);
    case_panels16_group(64, 96, 32, 128);
}

/* ---- rows, norms, element-wise ---- */

static void cases_rmsnorm(void) {
    static const int shapes[][2] = {{1, 1}, {7, 33}, {64, 896}, {300, 2048}, {3, 20000}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t T = shapes[s][0];
        int D = shapes[s][1];
        char shape[64];
        snprintf(shape, sizeof shape, "T=%lld D=%d", (long long)T, D);
        float *x = rnd(T * D, 3), *w = rnd(D, 1), *out = zeros(T * D), *rstd = zeros(T);
        void *dx = upf(x, T * D), *dw = upf(w, D), *dout = up(NULL, 4 * T * D), *drstd = up(NULL, 4 * T);
        R->rmsnorm_fwd(out, rstd, x, w, T, D, 1e-6f);
        G->rmsnorm_fwd(dout, drstd, dx, dw, T, D, 1e-6f);
        cmp("rmsnorm_fwd", "out", dout, out, T * D, TOL_ULPS, shape);
        cmp("rmsnorm_fwd", "rstd", drstd, rstd, T, TOL_ULPS, shape);
        /* backward: into random dx and dw (it accumulates), the reference's rstd on both */
        float *dy = rnd(T * D, 1), *gx = rnd(T * D, 1), *gw = rnd(D, 1);
        void *ddy = upf(dy, T * D), *dgx = upf(gx, T * D), *dgw = upf(gw, D), *drs = upf(rstd, T);
        R->rmsnorm_bwd(gx, gw, dy, x, w, rstd, T, D);
        G->rmsnorm_bwd(dgx, dgw, ddy, dx, dw, drs, T, D);
        cmp("rmsnorm_bwd", "dx", dgx, gx, T * D, TOL_DOT, shape);
        cmp("rmsnorm_bwd", "dw", dgw, gw, D, TOL_SUMF, shape);
        mrl_cuda_free(dx), mrl_cuda_free(dw), mrl_cuda_free(dout), mrl_cuda_free(drstd), mrl_cuda_free(ddy),
            mrl_cuda_free(dgx), mrl_cuda_free(dgw), mrl_cuda_free(drs);
        free(x), free(w), free(out), free(rstd), free(dy), free(gx), free(gw);
    }
}

static void cases_rope(void) {
    static const int shapes[][3] = {{1, 1, 2}, {9, 4, 64}, {100, 14, 128}};
    int max_pos = 4096;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int inverse = 0; inverse < 2; inverse++) {
            int64_t T = shapes[s][0];
            int H = shapes[s][1], hd = shapes[s][2], half = hd / 2;
            char shape[64];
            snprintf(shape, sizeof shape, "T=%lld H=%d hd=%d inverse=%d", (long long)T, H, hd, inverse);
            float *cs = malloc(sizeof(float) * max_pos * half), *sn = malloc(sizeof(float) * max_pos * half);
            for (int p = 0; p < max_pos; p++)
                for (int i = 0; i < half; i++) {
                    double a = p * pow(10000.0, -2.0 * i / hd);
                    cs[p * half + i] = (float)cos(a), sn[p * half + i] = (float)sin(a);
                }
            int32_t *pos = malloc(sizeof(int32_t) * T);
            for (int64_t t = 0; t < T; t++) pos[t] = irand(max_pos);
            float *x = rnd(T * H * hd, 1);
            void *dx = upf(x, T * H * hd), *dpos = up(pos, 4 * T), *dc = upf(cs, (int64_t)max_pos * half),
                 *ds = upf(sn, (int64_t)max_pos * half);
            R->rope(x, pos, cs, sn, T, H, hd, inverse);
            G->rope(dx, dpos, dc, ds, T, H, hd, inverse);
            cmp("rope", "x", dx, x, T * H * hd, TOL_ULPS, shape);
            mrl_cuda_free(dx), mrl_cuda_free(dpos), mrl_cuda_free(dc), mrl_cuda_free(ds);
            free(cs), free(sn), free(pos), free(x);
        }
}

static void cases_swiglu(void) {
    static const int64_t sizes[] = {1, 1000, 1 << 20};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        char shape[32];
        snprintf(shape, sizeof shape, "n=%lld", (long long)n);
        float *g = rnd(n, 4), *u = rnd(n, 1), *dy = rnd(n, 1), *out = zeros(n), *dg = zeros(n), *du = zeros(n);
        void *dgate = upf(g, n), *dup_ = upf(u, n), *ddy = upf(dy, n), *dout = up(NULL, 4 * n),
             *ddg = up(NULL, 4 * n), *ddu = up(NULL, 4 * n);
        R->swiglu_fwd(out, g, u, n);
        G->swiglu_fwd(dout, dgate, dup_, n);
        cmp("swiglu_fwd", "out", dout, out, n, TOL_ULPS, shape);
        R->swiglu_bwd(dg, du, dy, g, u, n);
        G->swiglu_bwd(ddg, ddu, ddy, dgate, dup_, n);
        cmp("swiglu_bwd", "dgate", ddg, dg, n, TOL_ULPS, shape);
        cmp("swiglu_bwd", "dup", ddu, du, n, TOL_ULPS, shape);
        mrl_cuda_free(dgate), mrl_cuda_free(dup_), mrl_cuda_free(ddy), mrl_cuda_free(dout), mrl_cuda_free(ddg),
            mrl_cuda_free(ddu);
        free(g), free(u), free(dy), free(out), free(dg), free(du);
    }
}

static void cases_rows(void) {
    static const int64_t shapes[][3] = {{1, 1, 1}, {50, 64, 10}, {3000, 896, 700}}; /* n, D, rows of src */
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t n = shapes[s][0], D = shapes[s][1], V = shapes[s][2];
        char shape[64];
        snprintf(shape, sizeof shape, "n=%lld D=%lld rows=%lld", (long long)n, (long long)D, (long long)V);
        int32_t *idx = malloc(sizeof(int32_t) * n);
        for (int64_t i = 0; i < n; i++) idx[i] = irand((int)V); /* repeats: a row gets several, in order */
        float *src = rnd(V * D, 1), *out = zeros(n * D), *g = rnd(n * D, 1), *dst = rnd(V * D, 1);
        void *didx = up(idx, 4 * n), *dsrc = upf(src, V * D), *dout = up(NULL, 4 * n * D), *dg = upf(g, n * D),
             *ddst = upf(dst, V * D);
        R->gather_rows(out, src, idx, n, D);
        G->gather_rows(dout, dsrc, didx, n, D);
        cmp("gather_rows", "out", dout, out, n * D, TOL_BITS, shape);
        R->scatter_add_rows(dst, g, idx, n, D);
        G->scatter_add_rows(ddst, dg, didx, n, D);
        cmp("scatter_add_rows", "dst", ddst, dst, V * D, TOL_BITS, shape);
        /* bias: y [n, D] += b; db [D] += sum of rows */
        float *b = rnd(D, 1), *y = rnd(n * D, 1), *db = rnd(D, 1);
        void *dbias = upf(b, D), *dy = upf(y, n * D), *ddb = upf(db, D);
        R->bias_add(y, b, n, D);
        G->bias_add(dy, dbias, n, D);
        cmp("bias_add", "y", dy, y, n * D, TOL_BITS, shape);
        R->bias_bwd(db, g, n, D);
        G->bias_bwd(ddb, dg, n, D);
        cmp("bias_bwd", "db", ddb, db, D, TOL_BITS, shape);
        mrl_cuda_free(didx), mrl_cuda_free(dsrc), mrl_cuda_free(dout), mrl_cuda_free(dg), mrl_cuda_free(ddst),
            mrl_cuda_free(dbias), mrl_cuda_free(dy), mrl_cuda_free(ddb);
        free(idx), free(src), free(out), free(g), free(dst), free(b), free(y), free(db);
    }
}

/* the table's memory slots: to_device, copy (at odd offsets), zero of a middle part, to_host */
static void cases_memory(void) {
    static const int64_t sizes[] = {1, 7, 4099, 1 << 20};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        char shape[64];
        snprintf(shape, sizeof shape, "%lld bytes", (long long)n);
        unsigned char *h = malloc(n), *want = malloc(n + 3), *got = malloc(n + 3);
        for (int64_t i = 0; i < n; i++) h[i] = (unsigned char)(urand() * 256);
        void *a = up(NULL, n), *b = up(NULL, n + 3);
        CHECK_OK(G->to_device(a, h, n));
        memset(want, 0x5a, n + 3);
        CHECK_OK(G->to_device(b, want, n + 3));
        G->copy((char *)b + 3, a, n);
        memcpy(want + 3, h, n);
        int64_t z0 = n / 3, zn = n / 3;
        G->zero((char *)b + z0, zn);
        memset(want + z0, 0, zn);
        CHECK_OK(G->sync());
        CHECK_OK(G->to_host(got, b, n + 3));
        record("memory", "copy/zero/to_host", 0, memcmp(got, want, n + 3) ? INFINITY : 0, shape);
        cmp_bytes("memory", "to_device", a, h, n, shape);
        mrl_cuda_free(a), mrl_cuda_free(b);
        free(h), free(want), free(got);
    }
}

/* every bf16 / f16 bit pattern back and forth, and fp32 values around every rounding edge */
static void cases_convert(void) {
    int64_t n16 = 65536, n32 = 65536 * 4 + 64;
    uint16_t *h = malloc(2 * n16);
    for (int64_t i = 0; i < n16; i++) h[i] = (uint16_t)i;
    float *f = malloc(4 * n32);
    for (int64_t i = 0; i < 65536; i++) { /* the halfway points and their neighbours of both formats */
        uint32_t b = (uint32_t)i << 16 | 0x8000u, hb;
        memcpy(&f[4 * i], &b, 4);
        b = (uint32_t)i << 16 | 0x7fffu;
        memcpy(&f[4 * i + 1], &b, 4);
        hb = (uint32_t)(urand() * 4294967296.0);
        memcpy(&f[4 * i + 2], &hb, 4);
        f[4 * i + 3] = (float)(nrand() * pow(2.0, irand(60) - 30));
    }
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.99f, 65520.0f,
                              6.1e-5f, 5.96e-8f, 2.98e-8f, 1e-40f, -1e-45f, 3.4e38f, 1.0f};
    for (int i = 0; i < 64; i++) f[65536 * 4 + i] = specials[i % 16] * (i < 16 ? 1.0f : (float)(1 + i * 1e-3));
    float *wf = malloc(4 * n16), *wf2 = malloc(4 * n16);
    uint16_t *wh = malloc(2 * n32), *wh2 = malloc(2 * n32);
    void *dh = up(h, 2 * n16), *df = up(f, 4 * n32), *of = up(NULL, 4 * n16), *oh = up(NULL, 2 * n32);
    R->bf16_to_f32(h, wf, n16);
    G->bf16_to_f32(dh, of, n16);
    cmp_bytes("bf16_to_f32", "dst", of, wf, 4 * n16, "all 65536");
    R->f16_to_f32(h, wf2, n16);
    G->f16_to_f32(dh, of, n16);
    cmp_bytes("f16_to_f32", "dst", of, wf2, 4 * n16, "all 65536");
    R->f32_to_bf16(f, wh, n32);
    G->f32_to_bf16(df, oh, n32);
    cmp_bytes("f32_to_bf16", "dst", oh, wh, 2 * n32, "edges");
    R->f32_to_f16(f, wh2, n32);
    G->f32_to_f16(df, oh, n32);
    cmp_bytes("f32_to_f16", "dst", oh, wh2, 2 * n32, "edges");
    mrl_cuda_free(dh), mrl_cuda_free(df), mrl_cuda_free(of), mrl_cuda_free(oh);
    free(h), free(f), free(wf), free(wf2), free(wh), free(wh2);
}

/* ---- optimizer, reductions ---- */

static mrl_adamw_coeffs coeffs(double lr, double wd, int t) {
    double b1 = 0.9, b2 = 0.999;
    mrl_adamw_coeffs c = {(float)(1 - lr * wd), (float)b1, (float)(1 - b1), (float)b2, (float)(1 - b2),
                          (float)sqrt(1 - pow(b2, t)), 1e-8f, (float)(-lr / (1 - pow(b1, t)))};
    return c;
}

static void cases_optim(void) {
    static const int64_t sizes[] = {1, 1000, 3000017};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        char shape[32];
        snprintf(shape, sizeof shape, "n=%lld", (long long)n);
        float *p = rnd(n, 1), *m = rnd(n, 0.1f), *v = rnd(n, 0.01f), *g = rnd(n, 1);
        for (int64_t i = 0; i < n; i++) v[i] = fabsf(v[i]);
        int64_t ranges[8] = {0, n / 7 + 1, n / 3, n / 3 + n / 10 + 1, n - n / 5, n};
        int64_t n_ranges = n >= 20 ? 3 : 1;
        if (n < 20) ranges[1] = n;
        void *dp = upf(p, n), *dm = upf(m, n), *dv = upf(v, n), *dg = upf(g, n);
        for (int step = 1; step <= 3; step++) {
            mrl_adamw_args a = {p, m, v, g, n, coeffs(1e-3, 0.1, step), coeffs(1e-3, 0, step), ranges, n_ranges};
            mrl_adamw_args d = a;
            d.p = dp, d.m = dm, d.v = dv, d.g = dg;
            R->adamw(&a);
            G->adamw(&d);
        }
        cmp("adamw", "p", dp, p, n, TOL_BITS, shape);
        cmp("adamw", "m", dm, m, n, TOL_BITS, shape);
        cmp("adamw", "v", dv, v, n, TOL_BITS, shape);
        double sumsq;
        CHECK_OK(R->sum(g, n, 1, &sumsq));
        for (int sq = 0; sq < 2; sq++) {
            double want, got = NAN;
            CHECK_OK(R->sum(g, n, sq, &want));
            CHECK_OK(G->sum(dg, n, sq, &got));
            /* relative to the sum's scale: a sum of random signs may cancel to near 0 */
            double size = sq ? want : sqrt(sumsq);
            record("sum", sq ? "squares" : "values", TOL_SUM, fabs(got - want) / fmax(size, 1e-300), shape);
        }
        R->scale(g, n, 0.37f);
        G->scale(dg, n, 0.37f);
        cmp("scale", "x", dg, g, n, TOL_BITS, shape);
        mrl_cuda_free(dp), mrl_cuda_free(dm), mrl_cuda_free(dv), mrl_cuda_free(dg);
        free(p), free(m), free(v), free(g);
    }
}

/* ---- attention ---- */

typedef struct attn_case {
    int n_seqs, Hq, Hk, hd;
    int lens[8], prefix[8]; /* prefix[s] < s without prefix of its own, or -1 */
    int has_prefix;
} attn_case;

static void case_attn(const attn_case *c) {
    int32_t cu[9] = {0};
    for (int s = 0; s < c->n_seqs; s++) cu[s + 1] = cu[s] + c->lens[s];
    int64_t T = cu[c->n_seqs], nq = T * c->Hq * c->hd, nk = T * c->Hk * c->hd;
    float scale = 1.0f / sqrtf((float)c->hd);
    char shape[96];
    snprintf(shape, sizeof shape, "seqs=%d T=%lld Hq=%d Hk=%d hd=%d%s", c->n_seqs, (long long)T, c->Hq, c->Hk, c->hd,
             c->has_prefix ? " prefix" : "");
    float *q = rnd(nq, 1), *k = rnd(nk, 1), *v = rnd(nk, 1), *out = zeros(nq), *lse = zeros(T * c->Hq);
    const int32_t *prefix = c->has_prefix ? c->prefix : NULL;
    void *dq = upf(q, nq), *dk = upf(k, nk), *dv = upf(v, nk), *dcu = up(cu, 4 * (c->n_seqs + 1)),
         *dpre = c->has_prefix ? up(c->prefix, 4 * c->n_seqs) : NULL, *dout = up(NULL, 4 * nq),
         *dlse = up(NULL, 4 * T * c->Hq);
    R->attn_fwd(out, lse, q, k, v, cu, prefix, c->n_seqs, c->Hq, c->Hk, c->hd, scale);
    G->attn_fwd(dout, dlse, dq, dk, dv, dcu, dpre, c->n_seqs, c->Hq, c->Hk, c->hd, scale);
    cmp("attn_fwd", "out", dout, out, nq, TOL_ATTN, shape);
    cmp("attn_fwd", "lse", dlse, lse, T * c->Hq, TOL_ATTN, shape);
    /* backward from the reference's out and lse on both sides */
    float *dy = rnd(nq, 1), *gq = zeros(nq), *gk = zeros(nk), *gv = zeros(nk);
    void *ddy = upf(dy, nq), *dout_r = upf(out, nq), *dlse_r = upf(lse, T * c->Hq), *dgq = up(NULL, 4 * nq),
         *dgk = up(NULL, 4 * nk), *dgv = up(NULL, 4 * nk);
    float *nan = malloc(4 * nq); /* gradients start as NaN: the op must write every element */
    for (int64_t i = 0; i < nq; i++) nan[i] = NAN;
    CHECK_OK(mrl_cuda_memcpy(dgq, nan, 4 * nq, 0, stream));
    CHECK_OK(mrl_cuda_memcpy(dgk, nan, 4 * nk, 0, stream));
    CHECK_OK(mrl_cuda_memcpy(dgv, nan, 4 * nk, 0, stream));
    R->attn_bwd(gq, gk, gv, dy, out, lse, q, k, v, cu, prefix, c->n_seqs, c->Hq, c->Hk, c->hd, scale);
    G->attn_bwd(dgq, dgk, dgv, ddy, dout_r, dlse_r, dq, dk, dv, dcu, dpre, c->n_seqs, c->Hq, c->Hk, c->hd, scale);
    cmp("attn_bwd", "dq", dgq, gq, nq, TOL_ATTN_BWD, shape);
    cmp("attn_bwd", "dk", dgk, gk, nk, TOL_ATTN_BWD, shape);
    cmp("attn_bwd", "dv", dgv, gv, nk, TOL_ATTN_BWD, shape);
    void *dev[] = {dq, dk, dv, dcu, dpre, dout, dlse, ddy, dout_r, dlse_r, dgq, dgk, dgv};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mrl_cuda_free(dev[i]);
    free(q), free(k), free(v), free(out), free(lse), free(dy), free(gq), free(gk), free(gv), free(nan);
}

static void cases_attn(void) {
    static const attn_case cases[] = {
        {1, 1, 1, 8, {1}, {-1}, 0},
        {3, 4, 2, 64, {5, 33, 70}, {-1, -1, -1}, 0},
        {2, 8, 8, 128, {100, 31}, {-1, -1}, 0},
        {4, 6, 2, 80, {40, 17, 0, 64}, {-1, 0, -1, 0}, 1}, /* a shared prompt (and an empty sequence) */
        {5, 4, 1, 256, {20, 9, 12, 33, 3}, {-1, 0, 0, -1, 3}, 1},
        {3, 2, 2, 32, {1, 1, 1}, {-1, 0, 0}, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) case_attn(&cases[i]);
}

/* ---- head ---- */

static void cases_head(void) {
    static const int shapes[][2] = {{1, 1}, {5, 1000}, {64, 32000}, {3, 151936}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t rows = shapes[s][0];
        int V = shapes[s][1];
        float inv_temp = s % 2 ? 1.0f : 1.0f / 0.7f;
        char shape[64];
        snprintf(shape, sizeof shape, "rows=%lld V=%d", (long long)rows, V);
        float *z = rnd(rows * V, 3), *lse = zeros(rows), *ent = zeros(rows), *lp = zeros(rows);
        int32_t *tg = malloc(4 * rows);
        for (int64_t r = 0; r < rows; r++) tg[r] = r % 4 == 3 ? -1 : irand(V);
        void *dz = upf(z, rows * V), *dtg = up(tg, 4 * rows), *dlse = up(NULL, 4 * rows), *dent = up(NULL, 4 * rows),
             *dlp = up(NULL, 4 * rows);
        R->head_fwd(z, rows, V, inv_temp, tg, lse, ent, lp);
        G->head_fwd(dz, rows, V, inv_temp, dtg, dlse, dent, dlp);
        cmp("head_fwd", "lse", dlse, lse, rows, TOL_HEAD, shape);
        cmp("head_fwd", "entropy", dent, ent, rows, TOL_HEAD, shape);
        cmp("head_fwd", "logprob", dlp, lp, rows, TOL_HEAD, shape);
        float *glp = rnd(rows, 1), *gh = rnd(rows, 1);
        void *dglp = upf(glp, rows), *dgh = upf(gh, rows), *dlse_r = upf(lse, rows), *dent_r = upf(ent, rows);
        R->head_bwd(z, rows, V, inv_temp, tg, lse, ent, glp, s == 2 ? NULL : gh);
        G->head_bwd(dz, rows, V, inv_temp, dtg, dlse_r, dent_r, dglp, s == 2 ? NULL : dgh);
        /* the target's gradient is glp (1 - p): relative to glp's own size, where p ~ 1 cancels it */
        double floor = 0;
        for (int64_t r = 0; r < rows; r++) floor = fmax(floor, fabs(glp[r]) * inv_temp);
        float *got = malloc(sizeof(float) * rows * V);
        down(got, dz, sizeof(float) * rows * V);
        record("head_bwd", "dlogits", TOL_HEAD, err_floor(got, z, rows * V, floor), shape);
        free(got);
        void *dev[] = {dz, dtg, dlse, dent, dlp, dglp, dgh, dlse_r, dent_r};
        for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mrl_cuda_free(dev[i]);
        free(z), free(lse), free(ent), free(lp), free(tg), free(glp), free(gh);
    }
}

/* ---- paged K/V cache ---- */

static void case_paged(int n_seqs, const int *lens, const int *n_qs, int Hq, int Hk, int hd, int bs) {
    int max_blocks = 0, total_blocks = 0;
    for (int i = 0; i < n_seqs; i++) {
        int b = (lens[i] + bs - 1) / bs + 1; /* a spare block past the end */
        if (b > max_blocks) max_blocks = b;
        total_blocks += b;
    }
    int num_blocks = total_blocks + 3;
    int64_t cache = (int64_t)num_blocks * Hk * hd * bs;
    float *kc = rnd(cache, 1), *vc = rnd(cache, 1);
    int32_t *perm = malloc(4 * num_blocks), *tables = malloc(4 * (size_t)n_seqs * max_blocks);
    for (int i = 0; i < num_blocks; i++) perm[i] = i;
    for (int i = num_blocks - 1; i > 0; i--) {
        int j = irand(i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int used = 0;
    int32_t seq_lens[16], qs[17] = {0};
    for (int i = 0; i < n_seqs; i++) {
        for (int b = 0; b < max_blocks; b++) tables[i * max_blocks + b] = b < (lens[i] + bs - 1) / bs + 1 ? perm[used++] : 0;
        seq_lens[i] = lens[i];
        qs[i + 1] = qs[i] + n_qs[i];
    }
    int64_t T = qs[n_seqs];
    char shape[96];
    snprintf(shape, sizeof shape, "seqs=%d T=%lld Hq=%d Hk=%d hd=%d bs=%d", n_seqs, (long long)T, Hq, Hk, hd, bs);
    /* the K/V write: each query token into its slot (the last n_q positions of its sequence), one skipped */
    float *k = rnd(T * Hk * hd, 1), *v = rnd(T * Hk * hd, 1);
    int32_t *slots = malloc(4 * (T ? T : 1));
    for (int i = 0; i < n_seqs; i++)
        for (int j = 0; j < n_qs[i]; j++) {
            int p = lens[i] - n_qs[i] + j;
            slots[qs[i] + j] = tables[i * max_blocks + p / bs] * bs + p % bs;
        }
    if (T > 2) slots[1] = -1;
    void *dkc = upf(kc, cache), *dvc = upf(vc, cache), *dk = upf(k, T * Hk * hd), *dv = upf(v, T * Hk * hd),
         *dslots = up(slots, 4 * T);
    R->paged_kv_write(kc, vc, k, v, slots, T, Hk, hd, bs);
    G->paged_kv_write(dkc, dvc, dk, dv, dslots, T, Hk, hd, bs);
    cmp("paged_kv_write", "k_cache", dkc, kc, cache, TOL_BITS, shape);
    cmp("paged_kv_write", "v_cache", dvc, vc, cache, TOL_BITS, shape);
    /* attention over the cache */
    float *q = rnd(T * Hq * hd, 1), *out = zeros(T * Hq * hd);
    void *dq = upf(q, T * Hq * hd), *dout = up(NULL, 4 * T * Hq * hd), *dtab = up(tables, 4 * (size_t)n_seqs * max_blocks),
         *dlens = up(seq_lens, 4 * n_seqs), *dqs = up(qs, 4 * (n_seqs + 1));
    mrl_paged_attn a = {out, q, kc, vc, tables, seq_lens, qs, n_seqs, max_blocks, bs, Hq, Hk, hd, 1.0f / sqrtf((float)hd),
                        NULL, 0};
    mrl_paged_attn d = {dout, dq, dkc, dvc, dtab, dlens, dqs, n_seqs, max_blocks, bs, Hq, Hk, hd, a.scale, NULL, 0};
    CHECK_OK(R->paged_attn(&a));
    CHECK(G->paged_attn_workspace(&d) == 0);
    CHECK_OK(G->paged_attn(&d));
    cmp("paged_attn", "out", dout, out, T * Hq * hd, TOL_ATTN, shape);
    /* the same with the cache in bf16: the write rounds, attention reads widened */
    {
        uint16_t *kh = rnd_maybe_bf16(cache, 1), *vh = rnd_maybe_bf16(cache, 1);
        void *dkh = up(kh, 2 * cache), *dvh = up(vh, 2 * cache);
        R->paged_kv_write_bf16(kh, vh, k, v, slots, T, Hk, hd, bs);
        G->paged_kv_write_bf16(dkh, dvh, dk, dv, dslots, T, Hk, hd, bs);
        cmp_bytes("paged_kv_write_bf16", "k_cache", dkh, kh, 2 * cache, shape);
        cmp_bytes("paged_kv_write_bf16", "v_cache", dvh, vh, 2 * cache, shape);
        mrl_paged_attn a16 = a, d16 = d;
        a16.k_cache = kh, a16.v_cache = vh, a16.kv_bf16 = 1;
        d16.k_cache = dkh, d16.v_cache = dvh, d16.kv_bf16 = 1;
        CHECK_OK(R->paged_attn(&a16));
        CHECK_OK(G->paged_attn(&d16));
        cmp("paged_attn", "out (bf16 cache)", dout, out, T * Hq * hd, TOL_ATTN, shape);
        mrl_cuda_free(dkh), mrl_cuda_free(dvh);
        free(kh), free(vh);
    }
    /* a sequence whose length passes its blocks: an error, found on the device */
    if (n_seqs > 1) {
        int32_t bad[16];
        memcpy(bad, seq_lens, sizeof bad);
        bad[1] = max_blocks * bs + 1;
        CHECK_OK(mrl_cuda_memcpy(dlens, bad, 4 * n_seqs, 0, stream));
        CHECK_OK(G->paged_attn(&d));
        CHECK(mrl_cuda_ops_check() == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), "sequence 1");
        CHECK(mrl_cuda_ops_check() == MRL_OK); /* reported once */
    }
    d.Hq = Hk * 2 + 1; /* not a multiple of Hk (Hk > 1) or below it: refused before any launch */
    if (Hk > 1) {
        CHECK(G->paged_attn(&d) == MRL_ERR_INVALID);
        CHECK(mrl_cuda_ops_check() == MRL_ERR_INVALID);
    }
    void *dev[] = {dkc, dvc, dk, dv, dslots, dq, dout, dtab, dlens, dqs};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mrl_cuda_free(dev[i]);
    free(kc), free(vc), free(perm), free(tables), free(k), free(v), free(slots), free(q), free(out);
}

static void cases_paged(void) {
    int l1[] = {1}, q1[] = {1};
    case_paged(1, l1, q1, 1, 1, 8, 16);
    int l2[] = {37, 300, 5, 64}, q2[] = {1, 1, 5, 20}; /* decodes and prefill chunks */
    case_paged(4, l2, q2, 8, 2, 64, 16);
    int l3[] = {129, 77, 1000}, q3[] = {3, 1, 1};
    case_paged(3, l3, q3, 14, 2, 128, 32);
    int l4[] = {40, 41}, q4[] = {40, 2};
    case_paged(2, l4, q4, 4, 4, 1024, 8); /* the largest head */
}

/* ---- sampler ---- */

static void case_sample(int n, int V, unsigned seed) {
    float *z = rnd((int64_t)n * V, 2.5f);
    const float **hrows = malloc(sizeof(float *) * n), **drows = malloc(sizeof(float *) * n);
    mrl_sampling_params *ps = malloc(sizeof(*ps) * n);
    const mrl_sampling_params **pp = malloc(sizeof(*pp) * n);
    double *u = malloc(sizeof(double) * n);
    void *dz = upf(z, (int64_t)n * V);
    for (int r = 0; r < n; r++) {
        int src = r % 5 == 4 ? r - 1 : r; /* rows may repeat */
        hrows[r] = z + (int64_t)src * V;
        drows[r] = (const float *)dz + (int64_t)src * V;
        static const mrl_sampling_params kinds[] = {
            {0, 0, 1, 0},     {1, 0, 1, 0},      {0.7f, 50, 1, 0},   {1.0f, 0, 0.9f, 0}, {0.8f, 0, 1, 0.05f},
            {1.2f, 40, 0.8f, 0.02f}, {0.6f, 1, 1, 0}, {1, 0, 0.3f, 0},  {1, 7, 0.95f, 0},   {2.0f, 0, 0.99f, 0.001f},
        };
        ps[r] = kinds[(r + seed) % 10];
        pp[r] = &ps[r];
        u[r] = urand();
    }
    int32_t *tw = malloc(4 * n), *tg = malloc(4 * n);
    float *lw = malloc(4 * n), *lg = malloc(4 * n), *pw = malloc(4 * n), *pg = malloc(4 * n);
    char shape[64];
    snprintf(shape, sizeof shape, "n=%d V=%d", n, V);
    CHECK_OK(R->sample((const float *const *)hrows, n, V, pp, u, tw, lw, pw));
    CHECK_OK(G->sample((const float *const *)drows, n, V, pp, u, tg, lg, pg));
    int same = !memcmp(tw, tg, 4 * n);
    if (!same)
        for (int r = 0; r < n; r++)
            if (tw[r] != tg[r])
                fprintf(stderr, "sample %s row %d (T=%g k=%d p=%g min_p=%g): token %d, reference %d\n", shape, r,
                        ps[r].temperature, ps[r].top_k, ps[r].top_p, ps[r].min_p, tg[r], tw[r]);
    record("sample", "tokens", 0, same ? 0 : INFINITY, shape);
    record("sample", "logprobs", TOL_SAMPLE, err_f32(lg, lw, n, TOL_SAMPLE), shape);
    record("sample", "lp_processed", TOL_SAMPLE, err_f32(pg, pw, n, TOL_SAMPLE), shape);
    /* failing rows: the same error as the CPU's, the first one named */
    float bad_row[3] = {NAN, 0, 1}, inf_row[3] = {-INFINITY, -INFINITY, -INFINITY};
    void *dbad = upf(bad_row, 3), *dinf = upf(inf_row, 3);
    const float *hb[3] = {z, inf_row, bad_row}, *db[3] = {dz, dinf, dbad};
    char want[256];
    CHECK(R->sample(hb, 3, 3, pp, u, tw, lw, NULL) == MRL_ERR_INVALID);
    snprintf(want, sizeof want, "%s", mrl_last_error());
    CHECK(G->sample(db, 3, 3, pp, u, tg, lg, NULL) == MRL_ERR_INVALID);
    CHECK(!strcmp(want, mrl_last_error()));
    CHECK(tg[1] == -1 && tg[2] == -1 && tg[0] == tw[0]);
    mrl_cuda_free(dz), mrl_cuda_free(dbad), mrl_cuda_free(dinf);
    free(z), free(hrows), free(drows), free(ps), free(pp), free(u), free(tw), free(tg), free(lw), free(lg), free(pw),
        free(pg);
}

static void cases_sample(void) {
    case_sample(10, 7, 0);
    case_sample(40, 1000, 3);
    case_sample(30, 32000, 5);
    case_sample(10, 151936, 1);
}

/* ---- contracts of the void slots ---- */

static void cases_errors(void) {
    CHECK_OK(mrl_cuda_ops_check());
    G->attn_fwd(NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, 3, 2, 64, 1.0f); /* Hq not a multiple of Hk */
    CHECK(mrl_cuda_ops_check() == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "attn_fwd");
    G->attn_fwd(NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, 2, 2, 512, 1.0f);
    CHECK(mrl_cuda_ops_check() == MRL_ERR_UNSUPPORTED);
    G->rmsnorm_fwd(NULL, NULL, NULL, NULL, 4, 0, 1e-6f);
    CHECK(mrl_cuda_ops_check() == MRL_ERR_INVALID);
    CHECK_OK(mrl_cuda_ops_check()); /* cleared */
}

/* ---- benchmark ---- */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench(void) {
    printf("\nbenchmark (one H200-class GPU; TFLOP/s = nominal flops / time)\n");
    int64_t n = 4096;
    float *h = rnd(n * n, 1);
    void *A = upf(h, n * n), *B = upf(h, n * n), *C = up(NULL, 4 * n * n), *A16 = up(NULL, 2 * n * n),
         *B16 = up(NULL, 2 * n * n);
    free(h);
    G->f32_to_bf16(A, A16, n * n);
    G->f32_to_bf16(B, B16, n * n);
    const char *what[] = {"gemm fp32 (no TF32)", "gemm_bf16 bf16 in", "gemm_bf16 fp32 in (rounded per call)"};
    for (int mode = 0; mode < 3; mode++) {
        int reps = mode == 0 ? 5 : 20;
        double t0 = 0;
        for (int it = -1; it < reps; it++) { /* it = -1: the warm-up (cuBLASLt's first call) */
            if (it == 0) {
                CHECK_OK(mrl_cuda_ops_check());
                t0 = now();
            }
            if (mode == 0) G->gemm(0, 1, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
            else if (mode == 1) G->gemm_bf16(0, 1, n, n, n, 1.0f, A16, 1, n, B16, 1, n, 0.0f, C, n);
            else G->gemm_bf16(0, 1, n, n, n, 1.0f, A, 0, n, B, 0, n, 0.0f, C, n);
        }
        CHECK_OK(mrl_cuda_ops_check());
        double dt = (now() - t0) / reps;
        printf("  %-40s %lldx%lldx%lld  %8.3f ms  %7.1f TFLOP/s\n", what[mode], (long long)n, (long long)n,
               (long long)n, dt * 1e3, 2.0 * n * n * n / dt / 1e12);
    }
    mrl_cuda_free(A), mrl_cuda_free(B), mrl_cuda_free(C), mrl_cuda_free(A16), mrl_cuda_free(B16);
    /* attention: 8 sequences of 1024 tokens, Qwen-like heads */
    int n_seqs = 8, len = 1024, Hq = 32, Hk = 8, hd = 128;
    int64_t T = (int64_t)n_seqs * len;
    int32_t cu[9];
    for (int s = 0; s <= n_seqs; s++) cu[s] = s * len;
    void *q, *k, *v, *o, *lse, *dq, *dk, *dv, *dcu;
    size_t bq = 4 * T * Hq * hd, bk = 4 * T * Hk * hd;
    CHECK_OK(mrl_cuda_malloc(0, bq, &q));
    CHECK_OK(mrl_cuda_malloc(0, bk, &k));
    CHECK_OK(mrl_cuda_malloc(0, bk, &v));
    CHECK_OK(mrl_cuda_malloc(0, bq, &o));
    CHECK_OK(mrl_cuda_malloc(0, 4 * T * Hq, &lse));
    CHECK_OK(mrl_cuda_malloc(0, bq, &dq));
    CHECK_OK(mrl_cuda_malloc(0, bk, &dk));
    CHECK_OK(mrl_cuda_malloc(0, bk, &dv));
    dcu = up(cu, sizeof cu);
    float *hq = rnd(T * Hq * hd, 1);
    CHECK_OK(mrl_cuda_memcpy(q, hq, bq, 0, stream));
    CHECK_OK(mrl_cuda_memcpy(o, hq, bq, 0, stream));
    CHECK_OK(mrl_cuda_memcpy(k, hq, bk, 0, stream));
    CHECK_OK(mrl_cuda_memcpy(v, hq, bk, 0, stream));
    free(hq);
    double flops = 4.0 * hd * Hq * n_seqs * (double)len * (len + 1) / 2; /* QK^T and PV, causal */
    float scale = 1.0f / sqrtf((float)hd);
    for (int pass = 0; pass < 2; pass++) {
        int reps = 3;
        G->attn_fwd(o, lse, q, k, v, dcu, NULL, n_seqs, Hq, Hk, hd, scale); /* warm, and the lse for bwd */
        CHECK_OK(mrl_cuda_ops_check());
        double t0 = now();
        for (int it = 0; it < reps; it++) {
            if (pass == 0) G->attn_fwd(o, lse, q, k, v, dcu, NULL, n_seqs, Hq, Hk, hd, scale);
            else G->attn_bwd(dq, dk, dv, o, o, lse, q, k, v, dcu, NULL, n_seqs, Hq, Hk, hd, scale);
        }
        CHECK_OK(mrl_cuda_ops_check());
        double dt = (now() - t0) / reps, f = pass ? 2.5 * flops : flops; /* the backward: 2.5x (5 products) */
        printf("  %-40s %d x %d tokens Hq=%d Hk=%d hd=%d  %8.3f ms  %7.1f TFLOP/s\n",
               pass ? "attn_bwd (fp32, recompute)" : "attn_fwd (fp32, flash)", n_seqs, len, Hq, Hk, hd, dt * 1e3,
               f / dt / 1e12);
    }
    void *dev[] = {q, k, v, o, lse, dq, dk, dv, dcu};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mrl_cuda_free(dev[i]);
}

int main(int argc, char **argv) {
    CHECK_OK(mrl_init());
    if (mrl_device_cuda_count() == 0) {
        printf("no CUDA device visible: skipped\n");
        return 77;
    }
    char desc[256];
    CHECK_OK(mrl_device_describe((mrl_device){MRL_DEVICE_CUDA, 0}, desc, sizeof desc));
    printf("%s\n", desc);
    if (getenv("SEED")) rng_state = strtoull(getenv("SEED"), NULL, 10);
    R = mrl_kernels_cpu_reference();
    G = (const mrl_kernels *)mrl_kernels_cuda();
    CHECK_OK(mrl_cuda_stream_create(0, &stream));
    mrl_cuda_ops_set_stream(stream);
    CHECK(mrl_cuda_ops_stream() == stream);

    /* every slot is there */
    CHECK(G->on_device == 1);
    const void *const *slot = (const void *const *)&G->copy;
    for (size_t i = 0; i < (sizeof(mrl_kernels) - offsetof(mrl_kernels, copy)) / sizeof(void *); i++) CHECK(slot[i] != NULL);

    static const struct {
        const char *name;
        void (*run)(void);
    } groups[] = {{"gemm", cases_gemm},   {"rmsnorm", cases_rmsnorm}, {"rope", cases_rope},   {"swiglu", cases_swiglu},
                  {"rows", cases_rows},   {"convert", cases_convert}, {"optim", cases_optim}, {"attn", cases_attn},
                  {"head", cases_head},   {"paged", cases_paged},     {"sample", cases_sample}, {"errors", cases_errors},
                  {"memory", cases_memory}};
    int bench_too = 0;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bench")) bench_too = 1;
        else only = argv[i];
    }
    for (size_t i = 0; i < sizeof groups / sizeof groups[0]; i++)
        if (!only || !strcmp(only, groups[i].name)) groups[i].run();

    printf("\n%-32s %12s %12s\n", "op.output", "worst error", "tolerance");
    for (int i = 0; i < n_rows_; i++)
        printf("%-32s %12.3g %12.3g%s\n", rows_[i].name, rows_[i].worst, rows_[i].tol,
               rows_[i].worst <= rows_[i].tol ? "" : "  FAIL");
    if (bench_too) bench();
    mrl_cuda_ops_set_stream(NULL);
    mrl_cuda_ops_release();
    mrl_cuda_stream_destroy(stream);
    mrl_shutdown();
    CHECK_DONE();
}
