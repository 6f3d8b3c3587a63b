/* Shared-prompt packing (mrl_batch.prefix): a batch where G sequences continue
 * one prefix sequence must give what packing each sequence whole gives.
 * (1) attention kernels: reference and fast, shared layout against the
 *     expanded one (every child carries its own copy of the prefix rows;
 *     fast against reference on the shared layout: tests/kernels/test_ops.c);
 * (2) the whole model: log-probs, entropy and every parameter gradient of a
 *     shared batch against the same samples packed whole, both kernel sets;
 * (3) bad prefix arrays are errors naming the sequence. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "random.h"
#include "kernels.h"
#include "moonrl/model.h"
#include "moonrl/parallel.h"
#include "moonrl/status.h"


static void cmp(const char *what, const float *got, const float *want, int64_t n, double tol) {
    double e = rel_err(got, want, n);
    if (!(e <= tol)) fprintf(stderr, "%s: relative error %.3g > %.3g\n", what, e, tol);
    CHECK(e <= tol);
}

/* The shared layout: 7 sequences. 0 is a prefix of 9 rows with children 1 (5 rows),
 * 2 (1 row) and 3 (70 rows: two query blocks past the prefix); 4 stands alone (3 rows);
 * 5 is a prefix of 66 rows (more than a query block) with one child 6 (4 rows). */
enum { NS = 7 };
static const int32_t cu_shared[NS + 1] = {0, 9, 14, 15, 85, 88, 154, 158};
static const int32_t prefix_of[NS] = {-1, 0, 0, 0, -1, -1, 5};
#define T_SHARED 158

/* The expanded layout: prefixes stay where they are, and each child becomes its
 * prefix's rows followed by its own. row_of[e] is the shared row an expanded row
 * copies; copy[e] is 1 for the prefix rows copied into a child. */
typedef struct expanded {
    int32_t cu[NS + 1];
    int64_t T;
    int64_t row_of[1024];
    int copy[1024];
} expanded;

static void expand(expanded *x) {
    int64_t e = 0;
    for (int s = 0; s < NS; s++) {
        x->cu[s] = (int32_t)e;
        int p = prefix_of[s];
        if (p >= 0)
            for (int32_t r = cu_shared[p]; r < cu_shared[p + 1]; r++) x->row_of[e] = r, x->copy[e++] = 1;
        for (int32_t r = cu_shared[s]; r < cu_shared[s + 1]; r++) x->row_of[e] = r, x->copy[e++] = 0;
    }
    x->cu[NS] = (int32_t)e;
    x->T = e;
}

/* rows of w floats: out[e] = in[row_of[e]] (zero for copied rows when zero_copies) */
static float *gather(const expanded *x, const float *in, int w, int zero_copies) {
    float *out = zeros(x->T * w);
    for (int64_t e = 0; e < x->T; e++)
        if (!(zero_copies && x->copy[e])) memcpy(out + e * w, in + x->row_of[e] * w, sizeof(float) * w);
    return out;
}

/* the sum over every expanded row that copies a shared row */
static float *scatter_add(const expanded *x, const float *in, int w) {
    float *out = zeros(T_SHARED * w);
    for (int64_t e = 0; e < x->T; e++)
        for (int i = 0; i < w; i++) out[x->row_of[e] * w + i] += in[e * w + i];
    return out;
}

/* the expanded rows that are not copies, back in the shared layout */
static float *own_rows(const expanded *x, const float *in, int w) {
    float *out = zeros(T_SHARED * w);
    for (int64_t e = 0; e < x->T; e++)
        if (!x->copy[e]) memcpy(out + x->row_of[e] * w, in + e * w, sizeof(float) * w);
    return out;
}

static void test_attention(const mrl_kernels *K, const char *name) {
    int Hq = 6, Hk = 2, hd = 20;
    float scale = 0.3f;
    expanded x;
    expand(&x);
    int64_t nq = T_SHARED * Hq * hd, nk = T_SHARED * Hk * hd;
    float *q = rnd(nq, 1), *k = rnd(nk, 1), *v = rnd(nk, 1), *dout = rnd(nq, 1);
    float *out = zeros(nq), *lse = zeros(T_SHARED * Hq), *dq = zeros(nq), *dk = rnd(nk, 1), *dv = rnd(nk, 1);
    K->attn_fwd(out, lse, q, k, v, cu_shared, prefix_of, NS, Hq, Hk, hd, scale);
    K->attn_bwd(dq, dk, dv, dout, out, lse, q, k, v, cu_shared, prefix_of, NS, Hq, Hk, hd, scale);

    float *xq = gather(&x, q, Hq * hd, 0), *xk = gather(&x, k, Hk * hd, 0), *xv = gather(&x, v, Hk * hd, 0);
    float *xdout = gather(&x, dout, Hq * hd, 1); /* a copied prefix row's output is not used */
    float *xout = zeros(x.T * Hq * hd), *xlse = zeros(x.T * Hq), *xdq = zeros(x.T * Hq * hd),
          *xdk = zeros(x.T * Hk * hd), *xdv = zeros(x.T * Hk * hd);
    K->attn_fwd(xout, xlse, xq, xk, xv, x.cu, NULL, NS, Hq, Hk, hd, scale);
    K->attn_bwd(xdq, xdk, xdv, xdout, xout, xlse, xq, xk, xv, x.cu, NULL, NS, Hq, Hk, hd, scale);
    float *want_out = own_rows(&x, xout, Hq * hd), *want_lse = own_rows(&x, xlse, Hq),
          *want_dq = own_rows(&x, xdq, Hq * hd), *want_dk = scatter_add(&x, xdk, Hk * hd),
          *want_dv = scatter_add(&x, xdv, Hk * hd);
    char what[64];
    snprintf(what, sizeof what, "%s shared out", name);
    cmp(what, out, want_out, nq, 2e-6);
    snprintf(what, sizeof what, "%s shared lse", name);
    cmp(what, lse, want_lse, T_SHARED * Hq, 2e-6);
    snprintf(what, sizeof what, "%s shared dq", name);
    cmp(what, dq, want_dq, nq, 1e-5);
    snprintf(what, sizeof what, "%s shared dk", name);
    cmp(what, dk, want_dk, nk, 1e-5);
    snprintf(what, sizeof what, "%s shared dv", name);
    cmp(what, dv, want_dv, nk, 1e-5);

    free(q), free(k), free(v), free(dout), free(out), free(lse), free(dq), free(dk), free(dv);
    free(xq), free(xk), free(xv), free(xdout), free(xout), free(xlse), free(xdq), free(xdk), free(xdv);
    free(want_out), free(want_lse), free(want_dq), free(want_dk), free(want_dv);
}

/* The model: 3 samples of one 6-token prompt and a fourth of another, with responses
 * of 4, 1, 7 and 3 tokens; log-probs wanted on the responses only. */
static void test_model(int backend) {
    mrl_model_config c;
    const char *cfg = "{\"model_type\": \"qwen2\", \"vocab_size\": 40, \"hidden_size\": 32, \"intermediate_size\": 48, "
                      "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2}";
    CHECK_OK(mrl_model_config_parse(cfg, strlen(cfg), "config", &c));
    mrl_model *m = NULL;
    CHECK_OK(mrl_model_create(&c, 11, &m));
    if (!m) return;
    CHECK_OK(mrl_model_set_kernels(m, backend));
    int32_t prompt_a[6] = {1, 7, 9, 3, 22, 5}, prompt_b[4] = {1, 30, 31, 2};
    int32_t resp[4][7] = {{4, 8, 15, 16}, {23}, {39, 38, 37, 36, 35, 34, 33}, {10, 11, 12}};
    int rlen[4] = {4, 1, 7, 3};
    /* whole: each sample is prompt + response */
    int32_t wt[64], wtg[64], wcu[5] = {0};
    int64_t wn = 0, wfirst[4];
    for (int i = 0; i < 4; i++) {
        const int32_t *p = i < 3 ? prompt_a : prompt_b;
        int pl = i < 3 ? 6 : 4;
        for (int j = 0; j < pl; j++) wt[wn++] = p[j];
        wfirst[i] = wn - 1;
        for (int j = 0; j < rlen[i]; j++) wt[wn++] = resp[i][j];
        wcu[i + 1] = (int32_t)wn;
    }
    for (int s = 0; s < 4; s++)
        for (int32_t r = wcu[s]; r < wcu[s + 1]; r++) wtg[r] = r + 1 < wcu[s + 1] ? wt[r + 1] : -1;
    /* shared: prompt_a[0..5) once, then children "prompt_a[5] + response"; prompt_b whole */
    int32_t st[64], stg[64], scu[6] = {0}, spre[5] = {-1, 0, 0, 0, -1};
    int64_t sn = 0, sfirst[4];
    for (int j = 0; j < 5; j++) st[sn++] = prompt_a[j];
    scu[1] = (int32_t)sn;
    for (int i = 0; i < 3; i++) {
        sfirst[i] = sn;
        st[sn++] = prompt_a[5];
        for (int j = 0; j < rlen[i]; j++) st[sn++] = resp[i][j];
        scu[i + 2] = (int32_t)sn;
    }
    for (int j = 0; j < 4; j++) st[sn++] = prompt_b[j];
    sfirst[3] = sn - 1;
    for (int j = 0; j < rlen[3]; j++) st[sn++] = resp[3][j];
    scu[5] = (int32_t)sn;
    for (int s = 0; s < 5; s++)
        for (int32_t r = scu[s]; r < scu[s + 1]; r++) stg[r] = r + 1 < scu[s + 1] ? st[r + 1] : -1;
    stg[scu[1] - 1] = -1; /* the prefix's last row has no target of its own */
    CHECK(sn < wn);

    /* the same per-response-token loss weights on both sides */
    float dw[64] = {0}, ds[64] = {0}, ew[64] = {0}, es[64] = {0};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < rlen[i]; j++) {
            float a = nrand(), b = 0.1f * nrand();
            dw[wfirst[i] + j] = ds[sfirst[i] + j] = a;
            ew[wfirst[i] + j] = es[sfirst[i] + j] = b;
        }
    int64_t n = mrl_model_num_params(m);
    float lpw[64], entw[64], lps[64], ents[64];
    mrl_batch whole = {wt, wtg, wcu, wn, 4, NULL}, shared = {st, stg, scu, sn, 5, spre};
    CHECK_OK(mrl_model_forward(m, &whole, 0.8f, lpw, entw, NULL));
    mrl_model_zero_grad(m);
    CHECK_OK(mrl_model_backward(m, dw, ew, NULL));
    float *gw = malloc(sizeof(float) * n);
    memcpy(gw, mrl_model_grads(m), sizeof(float) * n);
    CHECK_OK(mrl_model_forward(m, &shared, 0.8f, lps, ents, NULL));
    mrl_model_zero_grad(m);
    CHECK_OK(mrl_model_backward(m, ds, es, NULL));
    double worst_lp = 0;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < rlen[i]; j++) {
            double d = fabs(lps[sfirst[i] + j] - lpw[wfirst[i] + j]);
            double de = fabs(ents[sfirst[i] + j] - entw[wfirst[i] + j]);
            if (d > worst_lp) worst_lp = d;
            if (de > worst_lp) worst_lp = de;
        }
    if (!(worst_lp < 2e-6)) fprintf(stderr, "backend %d: log-prob/entropy differ by %.3g\n", backend, worst_lp);
    CHECK(worst_lp < 2e-6);
    cmp(backend ? "model grads (reference kernels)" : "model grads (fast kernels)", mrl_model_grads(m), gw, n, 2e-5);
    free(gw);

    /* bad prefix arrays name the sequence */
    int32_t bad[5] = {-1, 0, 2, 0, -1};
    shared.prefix = bad; /* 2 continues itself */
    CHECK(mrl_model_forward(m, &shared, 1.0f, lps, NULL, NULL) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "prefix[2]");
    bad[2] = 1; /* 1 has a prefix itself */
    CHECK(mrl_model_forward(m, &shared, 1.0f, lps, NULL, NULL) == MRL_ERR_INVALID);
    bad[2] = -3;
    CHECK(mrl_model_forward(m, &shared, 1.0f, lps, NULL, NULL) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "-1");
    mrl_model_free(m);
}

int main(void) {
    rng_seed(2024);
    test_attention(mrl_kernels_cpu_reference(), "reference");
    test_attention(mrl_kernels_cpu_fast(), "fast");
    mrl_parallel_set_threads(2);
    test_model(MRL_KERNELS_CPU_REFERENCE);
    test_model(MRL_KERNELS_CPU_FAST);
    CHECK_DONE();
}
