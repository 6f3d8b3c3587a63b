/* The op table: (1) each backward of the reference kernels against finite
 * differences of its forward (fp32, small sizes, central differences);
 * (2) the fast table against the reference on fresh random inputs, with
 * sizes that leave vector tails. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "random_arrays.h"
#include "kernels.h"
#include "moonrl/parallel.h"
#include "moonrl/status.h"


static const mrl_kernels *R, *Fk;

/* ---- finite differences: loss = sum_i r_i out_i, in double ------------------------ */

typedef double (*loss_fn)(void *ctx);

/* Compare grad[0..n) with central differences of f over x[0..n). */
static double fd_check(loss_fn f, void *ctx, float *x, const float *grad, int64_t n, float h) {
    float *num = zeros(n);
    for (int64_t i = 0; i < n; i++) {
        float keep = x[i];
        x[i] = keep + h;
        double up = f(ctx);
        x[i] = keep - h;
        double down = f(ctx);
        x[i] = keep;
        num[i] = (float)((up - down) / (2.0 * h));
    }
    double e = rel_err(grad, num, n);
    free(num);
    return e;
}

static double weighted(const float *out, const float *r, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)r[i] * out[i];
    return s;
}

typedef struct norm_case {
    float *x, *w, *out, *rstd, *r;
    int64_t T;
    int D;
} norm_case;

static double norm_loss(void *vc) {
    norm_case *c = vc;
    R->rmsnorm_fwd(c->out, c->rstd, c->x, c->w, c->T, c->D, 1e-5f);
    return weighted(c->out, c->r, c->T * c->D);
}

static void fd_rmsnorm(void) {
    norm_case c = {.T = 3, .D = 7};
    c.x = rnd(21, 1), c.w = rnd(7, 1), c.out = zeros(21), c.rstd = zeros(3), c.r = rnd(21, 1);
    float *dx = zeros(21), *dw = zeros(7);
    norm_loss(&c);
    R->rmsnorm_bwd(dx, dw, c.r, c.x, c.w, c.rstd, c.T, c.D);
    double ex = fd_check(norm_loss, &c, c.x, dx, 21, 1e-3f), ew = fd_check(norm_loss, &c, c.w, dw, 7, 1e-3f);
    printf("fd rmsnorm: dx %.1e dw %.1e\n", ex, ew);
    CHECK(ex < 3e-3);
    CHECK(ew < 3e-3);
    free(c.x), free(c.w), free(c.out), free(c.rstd), free(c.r), free(dx), free(dw);
}

typedef struct swiglu_case {
    float *g, *u, *out, *r;
    int64_t n;
} swiglu_case;

static double swiglu_loss(void *vc) {
    swiglu_case *c = vc;
    R->swiglu_fwd(c->out, c->g, c->u, c->n);
    return weighted(c->out, c->r, c->n);
}

static void fd_swiglu(void) {
    swiglu_case c = {.n = 19};
    c.g = rnd(19, 2), c.u = rnd(19, 1), c.out = zeros(19), c.r = rnd(19, 1);
    float *dg = zeros(19), *du = zeros(19);
    R->swiglu_bwd(dg, du, c.r, c.g, c.u, c.n);
    double eg = fd_check(swiglu_loss, &c, c.g, dg, 19, 1e-3f), eu = fd_check(swiglu_loss, &c, c.u, du, 19, 1e-3f);
    printf("fd swiglu: dgate %.1e dup %.1e\n", eg, eu);
    CHECK(eg < 3e-3);
    CHECK(eu < 3e-3);
    free(c.g), free(c.u), free(c.out), free(c.r), free(dg), free(du);
}

/* RoPE is linear: its backward (inverse = 1) must be its transpose, <R x, y> = <x, R^T y>. */
static void check_rope_transpose(void) {
    int T = 5, H = 2, hd = 6, half = 3;
    int32_t pos[5] = {0, 1, 2, 0, 3};
    float *cs = zeros(4 * half), *sn = zeros(4 * half);
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < half; i++) cs[p * half + i] = cosf(p * (i + 1) * 0.7f), sn[p * half + i] = sinf(p * (i + 1) * 0.7f);
    float *x = rnd(T * H * hd, 1), *y = rnd(T * H * hd, 1), *rx = zeros(T * H * hd), *ry = zeros(T * H * hd);
    memcpy(rx, x, sizeof(float) * T * H * hd);
    memcpy(ry, y, sizeof(float) * T * H * hd);
    R->rope(rx, pos, cs, sn, T, H, hd, 0);
    R->rope(ry, pos, cs, sn, T, H, hd, 1);
    double a = weighted(rx, y, T * H * hd), b = weighted(x, ry, T * H * hd);
    printf("rope transpose: %.3e vs %.3e\n", a, b);
    CHECK_NEAR(a, b, 1e-5 * (1 + fabs(b)));
    free(cs), free(sn), free(x), free(y), free(rx), free(ry);
}

typedef struct attn_case {
    float *q, *k, *v, *out, *lse, *r;
    int32_t cu[4];
    int n_seqs, Hq, Hk, hd;
    int64_t T;
} attn_case;

static double attn_loss(void *vc) {
    attn_case *c = vc;
    R->attn_fwd(c->out, c->lse, c->q, c->k, c->v, c->cu, NULL, c->n_seqs, c->Hq, c->Hk, c->hd, 0.4f);
    return weighted(c->out, c->r, c->T * c->Hq * c->hd);
}

static void fd_attention(void) {
    attn_case c = {.cu = {0, 4, 5, 9}, .n_seqs = 3, .Hq = 4, .Hk = 2, .hd = 3, .T = 9};
    int64_t nq = c.T * c.Hq * c.hd, nk = c.T * c.Hk * c.hd;
    c.q = rnd(nq, 1), c.k = rnd(nk, 1), c.v = rnd(nk, 1), c.out = zeros(nq), c.lse = zeros(c.T * c.Hq), c.r = rnd(nq, 1);
    float *dq = zeros(nq), *dk = zeros(nk), *dv = zeros(nk);
    attn_loss(&c);
    R->attn_bwd(dq, dk, dv, c.r, c.out, c.lse, c.q, c.k, c.v, c.cu, NULL, c.n_seqs, c.Hq, c.Hk, c.hd, 0.4f);
    double eq = fd_check(attn_loss, &c, c.q, dq, nq, 1e-3f), ek = fd_check(attn_loss, &c, c.k, dk, nk, 1e-3f),
           ev = fd_check(attn_loss, &c, c.v, dv, nk, 1e-3f);
    printf("fd attention: dq %.1e dk %.1e dv %.1e\n", eq, ek, ev);
    CHECK(eq < 3e-3);
    CHECK(ek < 3e-3);
    CHECK(ev < 3e-3);
    free(c.q), free(c.k), free(c.v), free(c.out), free(c.lse), free(c.r), free(dq), free(dk), free(dv);
}

typedef struct head_case {
    float *z, *lse, *ent, *lp, *a, *b;
    int32_t targets[3];
    int64_t rows;
    int V;
    float inv_temp;
} head_case;

static double head_loss(void *vc) {
    head_case *c = vc;
    R->head_fwd(c->z, c->rows, c->V, c->inv_temp, c->targets, c->lse, c->ent, c->lp);
    return weighted(c->lp, c->a, c->rows) + weighted(c->ent, c->b, c->rows);
}

static void fd_head(void) {
    head_case c = {.targets = {3, -1, 10}, .rows = 3, .V = 11, .inv_temp = 1.0f / 0.8f};
    c.z = rnd(33, 1.5f), c.lse = zeros(3), c.ent = zeros(3), c.lp = zeros(3), c.a = rnd(3, 1), c.b = rnd(3, 1);
    head_loss(&c);
    float *g = zeros(33);
    memcpy(g, c.z, sizeof(float) * 33);
    R->head_bwd(g, c.rows, c.V, c.inv_temp, c.targets, c.lse, c.ent, c.a, c.b);
    double e = fd_check(head_loss, &c, c.z, g, 33, 1e-3f);
    printf("fd head (logprob + entropy, temperature 0.8): %.1e\n", e);
    CHECK(e < 3e-3);
    free(c.z), free(c.lse), free(c.ent), free(c.lp), free(c.a), free(c.b), free(g);
}

/* ---- fast against reference --------------------------------------------------------- */

static void cmp(const char *what, const float *fast, const float *ref, int64_t n, double tol) {
    double e = rel_err(fast, ref, n);
    printf("fast vs reference %-16s %.1e\n", what, e);
    if (!(e <= tol)) fprintf(stderr, "%s: error %.3g above %.3g\n", what, e, tol);
    CHECK(e <= tol);
}

typedef void (*gemm_fn)(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                        const float *B, int64_t ldb, float beta, float *C, int64_t ldc);

/* `gemm` against the reference over shapes with edges (1, 7, 31, 33, 257;
 * larger than a cache block: 230 rows, 530 columns, 270 deep), every
 * transpose, alpha, beta 0 (C full of NaN: must not be read), 1 (accumulate)
 * and 0.5, and leading dimensions wider than the matrices (the gaps must
 * stay untouched). */
static void gemm_shapes(const char *what, gemm_fn gemm) {
    static const int64_t shapes[][3] = {{1, 1, 1},    {1, 33, 31},  {7, 33, 31},  {31, 33, 7},   {33, 7, 31},
                                        {257, 33, 7}, {31, 257, 7}, {33, 7, 257}, {16, 32, 256}, {230, 530, 270},
                                        {64, 96, 0}};
    double worst = 0;
    int bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++) {
            int ta = t & 1, tb = t >> 1;
            int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
            int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
            float alpha = t == 3 ? -1.5f : 0.75f, beta = (float)((s + t) % 3) * 0.5f; /* 0, 0.5, 1 */
            float *A = rnd((ta ? K : M) * lda, 1), *B = rnd((tb ? N : K) * ldb, 1), *C1 = rnd(M * ldc, 1),
                  *C2 = zeros(M * ldc);
            for (int64_t i = 0; i < M * ldc; i++)
                if (beta == 0.0f && i % ldc < N) C1[i] = NAN;
            memcpy(C2, C1, sizeof(float) * M * ldc);
            R->gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C1, ldc);
            gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C2, ldc);
            double e = rel_err(C2, C1, M * ldc);
            for (int64_t i = 0; i < M * ldc; i++)
                if (!isfinite(C2[i])) e = INFINITY;
            if (!(e <= 1e-5) && bad++ < 5)
                fprintf(stderr, "%s %c%c %lldx%lldx%lld beta %g: error %.3g\n", what, ta ? 'T' : 'N', tb ? 'T' : 'N',
                        (long long)M, (long long)N, (long long)K, beta, e);
            worst = e > worst ? e : worst;
            free(A), free(B), free(C1), free(C2);
        }
    printf("%-22s vs reference, %d shapes x 4 transposes: %.1e\n", what, (int)(sizeof shapes / sizeof shapes[0]),
           worst);
    CHECK(bad == 0);
}

/* Products with W given as weight panels (the engine's decode products):
 * reference and fast against the reference on W itself, over row counts
 * around the tile heights (1..7, 13, 64, 131), widths that end inside a
 * panel (40, 100) or on one (96), alpha, beta 0 (C NaN: not read) and 1.3,
 * ldc wider than N (the gap untouched), on one and two threads. */
static void panel_products(void) {
    static const int64_t rows[] = {1, 2, 3, 4, 5, 6, 7, 13, 64, 131}, cols[] = {40, 96, 100}, depth[] = {37, 64};
    double worst = 0;
    int bad = 0;
    for (int threads = 1; threads <= 2; threads++) {
        mrl_parallel_set_threads(threads);
        for (size_t a = 0; a < sizeof rows / sizeof rows[0]; a++)
            for (size_t b = 0; b < sizeof cols / sizeof cols[0]; b++)
                for (size_t c = 0; c < sizeof depth / sizeof depth[0]; c++) {
                    int64_t M = rows[a], N = cols[b], K = depth[c], ldc = N + 3;
                    float beta = (a + b + c) % 2 ? 1.3f : 0.0f;
                    float *A = rnd(M * K, 1), *W = rnd(N * K, 1), *P = zeros(mrl_panels_floats(N, K));
                    float *C0 = rnd(M * ldc, 1), *C1 = zeros(M * ldc), *C2 = zeros(M * ldc);
                    for (int64_t i = 0; i < M * ldc; i++)
                        if (beta == 0.0f && i % ldc < N) C0[i] = NAN;
                    memcpy(C1, C0, sizeof(float) * M * ldc);
                    memcpy(C2, C0, sizeof(float) * M * ldc);
                    mrl_panels_pack(P, W, N, K);
                    R->gemm(0, 1, M, N, K, 0.7f, A, K, W, K, beta, C0, ldc);
                    mrl_gemm_desc d = {0, 1, M, N, K, 0.7f, A, K, P, 0, beta, C1, ldc, .b_panels = 1};
                    R->gemm_group(&d, 1);
                    d.C = C2;
                    Fk->gemm_group(&d, 1);
                    double e = fmax(rel_err(C1, C0, M * ldc), rel_err(C2, C0, M * ldc));
                    for (int64_t i = 0; i < M * ldc; i++)
                        if (!isfinite(C1[i]) || !isfinite(C2[i])) e = INFINITY;
                    if (!(e <= 1e-5) && bad++ < 5)
                        fprintf(stderr, "panels %lldx%lldx%lld beta %g threads %d: error %.3g\n", (long long)M,
                                (long long)N, (long long)K, beta, threads, e);
                    worst = e > worst ? e : worst;
                    free(A), free(W), free(P), free(C0), free(C1), free(C2);
                }
    }
    mrl_parallel_set_threads(0);
    printf("weight panels (reference and fast) vs reference on W: %.1e\n", worst);
    CHECK(bad == 0);
}

static void fast_vs_reference(void) {
    gemm_shapes("fast gemm", Fk->gemm);
    panel_products();
    /* gemm, all transposes */
    int64_t M = 37, N = 29, K = 45;
    float *A = rnd(M * K, 1), *B = rnd(K * N, 1), *C1 = rnd(M * N, 1), *C2 = zeros(M * N);
    memcpy(C2, C1, sizeof(float) * M * N);
    for (int t = 0; t < 4; t++) {
        int ta = t & 1, tb = t >> 1;
        R->gemm(ta, tb, M, N, K, 0.5f, A, ta ? M : K, B, tb ? K : N, 1.0f, C1, N);
        Fk->gemm(ta, tb, M, N, K, 0.5f, A, ta ? M : K, B, tb ? K : N, 1.0f, C2, N);
    }
    cmp("gemm", C2, C1, M * N, 1e-5);
    /* a group: three products of other shapes (one empty), outputs apart */
    float *G1 = rnd(3 * M * N, 1), *G2 = zeros(3 * M * N);
    memcpy(G2, G1, sizeof(float) * 3 * M * N);
    for (int r = 0; r < 2; r++) {
        float *G = r ? G2 : G1;
        mrl_gemm_desc g[3] = {{0, 1, M, N, K, 1.0f, A, K, B, K, 0.0f, G, N},
                              {1, 0, N, M, K / 2, 2.0f, B, N, A, M, 1.0f, G + M * N, M},
                              {0, 0, 0, N, K, 1.0f, A, K, B, N, 0.0f, G + 2 * M * N, N}};
        (r ? Fk : R)->gemm_group(g, 3);
    }
    cmp("gemm group", G2, G1, 3 * M * N, 1e-5);
    free(G1), free(G2);
    free(A), free(B), free(C1), free(C2);
    /* few rows times a transposed matrix (the decode path), beta 0 and 1 */
    for (int64_t m = 1; m <= 17; m += 8) {
        int64_t n = 70, k = 83;
        float *a = rnd(m * k, 1), *b = rnd(n * k, 1), *c1 = rnd(m * n, 1), *c2 = zeros(m * n);
        memcpy(c2, c1, sizeof(float) * m * n);
        for (int beta = 0; beta < 2; beta++) {
            R->gemm(0, 1, m, n, k, 0.5f, a, k, b, k, (float)beta, c1, n);
            Fk->gemm(0, 1, m, n, k, 0.5f, a, k, b, k, (float)beta, c2, n);
        }
        cmp("gemm few rows", c2, c1, m * n, 1e-5);
        free(a), free(b), free(c1), free(c2);
    }

    int64_t T = 150;
    int D = 67;
    float *x = rnd(T * D, 1), *w = rnd(D, 1), *o1 = zeros(T * D), *o2 = zeros(T * D), *r1 = zeros(T), *r2 = zeros(T);
    R->rmsnorm_fwd(o1, r1, x, w, T, D, 1e-6f);
    Fk->rmsnorm_fwd(o2, r2, x, w, T, D, 1e-6f);
    cmp("rmsnorm", o2, o1, T * D, 1e-6);
    float *dy = rnd(T * D, 1), *dx1 = rnd(T * D, 1), *dx2 = zeros(T * D), *dw1 = zeros(D), *dw2 = zeros(D);
    memcpy(dx2, dx1, sizeof(float) * T * D);
    R->rmsnorm_bwd(dx1, dw1, dy, x, w, r1, T, D);
    Fk->rmsnorm_bwd(dx2, dw2, dy, x, w, r1, T, D);
    cmp("rmsnorm dx", dx2, dx1, T * D, 1e-6);
    cmp("rmsnorm dw", dw2, dw1, D, 1e-5);
    free(x), free(w), free(o1), free(o2), free(r1), free(r2), free(dy), free(dx1), free(dx2), free(dw1), free(dw2);

    int64_t n = 1003;
    float *g = rnd(n, 3), *u = rnd(n, 1), *s1 = zeros(n), *s2 = zeros(n), *d = rnd(n, 1), *a1 = zeros(n), *a2 = zeros(n),
          *b1 = zeros(n), *b2 = zeros(n);
    R->swiglu_fwd(s1, g, u, n);
    Fk->swiglu_fwd(s2, g, u, n);
    cmp("swiglu", s2, s1, n, 1e-6);
    R->swiglu_bwd(a1, b1, d, g, u, n);
    Fk->swiglu_bwd(a2, b2, d, g, u, n);
    cmp("swiglu dgate", a2, a1, n, 1e-6);
    cmp("swiglu dup", b2, b1, n, 1e-6);
    free(g), free(u), free(s1), free(s2), free(d), free(a1), free(a2), free(b1), free(b2);

    /* rope */
    int H = 3, hd = 10, half = 5;
    int32_t *pos = malloc(sizeof(int32_t) * T);
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)(t % 40);
    float *cs = rnd(40 * half, 1), *sn = rnd(40 * half, 1), *v1 = rnd(T * H * hd, 1), *v2 = zeros(T * H * hd);
    memcpy(v2, v1, sizeof(float) * T * H * hd);
    for (int inv = 0; inv < 2; inv++) {
        R->rope(v1, pos, cs, sn, T, H, hd, inv);
        Fk->rope(v2, pos, cs, sn, T, H, hd, inv);
    }
    cmp("rope", v2, v1, T * H * hd, 1e-6);
    free(pos), free(cs), free(sn), free(v1), free(v2);

    /* attention: 4 sequences (one of length 1, one longer than 64), GQA 6/2, hd 20 */
    int32_t cu[5] = {0, 1, 71, 100, 150};
    int Hq = 6, Hk = 2;
    hd = 20;
    int64_t nq = T * Hq * hd, nk = T * Hk * hd;
    float *q = rnd(nq, 1), *k = rnd(nk, 1), *v = rnd(nk, 1), *out1 = zeros(nq), *out2 = zeros(nq), *l1 = zeros(T * Hq),
          *l2 = zeros(T * Hq);
    R->attn_fwd(out1, l1, q, k, v, cu, NULL, 4, Hq, Hk, hd, 0.3f);
    Fk->attn_fwd(out2, l2, q, k, v, cu, NULL, 4, Hq, Hk, hd, 0.3f);
    cmp("attention", out2, out1, nq, 1e-5);
    cmp("attention lse", l2, l1, T * Hq, 1e-6);
    float *dout = rnd(nq, 1), *dq1 = zeros(nq), *dq2 = zeros(nq), *dk1 = zeros(nk), *dk2 = rnd(nk, 1), *dv1 = zeros(nk),
          *dv2 = rnd(nk, 1);
    R->attn_bwd(dq1, dk1, dv1, dout, out1, l1, q, k, v, cu, NULL, 4, Hq, Hk, hd, 0.3f);
    Fk->attn_bwd(dq2, dk2, dv2, dout, out1, l1, q, k, v, cu, NULL, 4, Hq, Hk, hd, 0.3f);
    cmp("attention dq", dq2, dq1, nq, 1e-5);
    cmp("attention dk", dk2, dk1, nk, 1e-5);
    cmp("attention dv", dv2, dv1, nk, 1e-5);
    free(q), free(k), free(v), free(out1), free(out2), free(l1), free(l2), free(dout), free(dq1), free(dq2), free(dk1),
        free(dk2), free(dv1), free(dv2);

    /* head: V with a tail, temperature 0.7, some rows without target */
    int64_t rows = 13;
    int V = 1003;
    float *z = rnd(rows * V, 3), *z2 = zeros(rows * V), *hl1 = zeros(rows), *hl2 = zeros(rows), *he1 = zeros(rows),
          *he2 = zeros(rows), *hp1 = zeros(rows), *hp2 = zeros(rows), *ga = rnd(rows, 1), *gb = rnd(rows, 1);
    int32_t tg[13];
    for (int i = 0; i < 13; i++) tg[i] = i % 4 == 3 ? -1 : (i * 97) % V;
    R->head_fwd(z, rows, V, 1 / 0.7f, tg, hl1, he1, hp1);
    Fk->head_fwd(z, rows, V, 1 / 0.7f, tg, hl2, he2, hp2);
    cmp("head lse", hl2, hl1, rows, 1e-6);
    cmp("head entropy", he2, he1, rows, 1e-5);
    cmp("head logprob", hp2, hp1, rows, 1e-5);
    memcpy(z2, z, sizeof(float) * rows * V);
    R->head_bwd(z, rows, V, 1 / 0.7f, tg, hl1, he1, ga, gb);
    Fk->head_bwd(z2, rows, V, 1 / 0.7f, tg, hl1, he1, ga, gb);
    cmp("head backward", z2, z, rows * V, 1e-5);
    free(z), free(z2), free(hl1), free(hl2), free(he1), free(he2), free(hp1), free(hp2), free(ga), free(gb);
}

int main(void) {
    R = mrl_kernels_cpu_reference();
    Fk = mrl_kernels_cpu_fast();
    fd_rmsnorm();
    fd_swiglu();
    check_rope_transpose();
    fd_attention();
    fd_head();
    const char *isas[] = {"avx512", "avx2", "sse"};
    for (int i = 0; i < 3; i++) {
        if (mrl_kernels_cpu_fast_set_isa(isas[i]) != 0) {
            printf("(%s not available here)\n", isas[i]);
            continue;
        }
        printf("-- fast kernels with %s\n", mrl_kernels_cpu_fast_isa());
        fast_vs_reference();
    }
    CHECK_DONE();
}
