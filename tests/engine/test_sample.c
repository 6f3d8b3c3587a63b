/* Sampling: empirical distributions against the expected processed
 * distribution (chi-square with fixed seeds, so deterministic), edge cases of
 * top-k / top-p / min-p (k = 1, p = 1, ties), the two log-probs, each with the
 * sample op of both CPU tables (reference and fast); determinism whatever
 * the batch order and thread count, bad input. (The fast table's sample op
 * against the reference's at every instruction set: tests/kernels/test_ops.c.) */
#include <stdlib.h>
#include "check.h"
#include "moonrl/parallel.h"
#include "engine/sample.h"

static const mrl_kernels *K; /* the table under test */

/* The distribution the sampler should draw from, computed plainly in double:
 * temperature, min-p, top-k (ties kept), top-p (sorted by prob, ties by id). */
static void expected_probs(const float *logits, int V, mrl_sampling_params p, double *out) {
    double m = -1e300, Z = 0;
    double *x = malloc(sizeof(double) * V);
    int *keep = calloc(V, sizeof(int));
    for (int i = 0; i < V; i++) {
        x[i] = (double)(logits[i] * (1.0f / p.temperature));
        if (x[i] > m) m = x[i];
    }
    for (int i = 0; i < V; i++) keep[i] = 1;
    if (p.min_p > 0)
        for (int i = 0; i < V; i++) keep[i] = exp(x[i] - m) >= p.min_p;
    if (p.top_k > 0) { /* drop tokens with k or more kept tokens strictly above */
        int *above = calloc(V, sizeof(int));
        for (int i = 0; i < V; i++)
            for (int j = 0; j < V; j++) above[i] += keep[j] && x[j] > x[i];
        for (int i = 0; i < V; i++)
            if (above[i] >= p.top_k) keep[i] = 0;
        free(above);
    }
    if (p.top_p < 1) {
        for (int i = 0; i < V; i++) Z += keep[i] ? exp(x[i] - m) : 0;
        int *keep2 = calloc(V, sizeof(int));
        for (int i = 0; i < V; i++) {
            if (!keep[i]) continue;
            double before = 0; /* mass of kept tokens ordered before i */
            for (int j = 0; j < V; j++)
                if (keep[j] && (x[j] > x[i] || (x[j] == x[i] && j < i))) before += exp(x[j] - m);
            keep2[i] = before < p.top_p * Z;
        }
        memcpy(keep, keep2, sizeof(int) * V);
        free(keep2);
    }
    Z = 0;
    for (int i = 0; i < V; i++) Z += keep[i] ? exp(x[i] - m) : 0;
    for (int i = 0; i < V; i++) out[i] = keep[i] ? exp(x[i] - m) / Z : 0;
    free(x);
    free(keep);
}

/* Draw n samples of one row; chi-square statistic against expected_probs,
 * and every drawn token must have expected probability > 0. */
static double chi_square(const float *logits, int V, mrl_sampling_params p, int n, uint64_t key, int *bad) {
    double *e = malloc(sizeof(double) * V);
    int *cnt = calloc(V, sizeof(int));
    expected_probs(logits, V, p, e);
    *bad = 0;
    for (int t = 0; t < n; t++) {
        int32_t tok;
        float lp, lpp;
        if (mrl_sample_row(K, logits, V, &p, mrl_sample_uniform(key, t), &tok, &lp, &lpp)) { *bad = 1; break; }
        if (tok < 0 || tok >= V || e[tok] == 0) { *bad = 1; break; }
        cnt[tok]++;
        if (t < 4) { /* processed log-prob is the log of the expected prob */
            CHECK_NEAR(lpp, log(e[tok]), 1e-5);
        }
    }
    double chi = 0;
    for (int i = 0; i < V; i++)
        if (e[i] > 0) chi += (cnt[i] - n * e[i]) * (cnt[i] - n * e[i]) / (n * e[i]);
    free(e);
    free(cnt);
    return chi;
}

static void test_distributions(void) {
    const float logits[10] = {1.0f, 2.0f, 0.5f, -1.0f, 2.0f, 0.0f, 1.5f, -3.0f, 0.9f, 1.2f};
    struct { mrl_sampling_params p; int df; } cases[] = {
        {{1.0f, 0, 1.0f, 0.0f}, 9},    /* plain softmax */
        {{0.7f, 0, 1.0f, 0.0f}, 9},    /* temperature */
        {{1.3f, 4, 1.0f, 0.0f}, 3},    /* top-k */
        {{1.0f, 0, 0.8f, 0.0f}, 5},    /* top-p */
        {{1.0f, 0, 1.0f, 0.3f}, 5},    /* min-p */
        {{0.9f, 6, 0.9f, 0.1f}, 4},    /* all together */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int bad;
        double chi = chi_square(logits, 10, cases[c].p, 20000, mrl_sample_stream_key(1234, 0, (int64_t)c, 0), &bad);
        CHECK(!bad);
        /* deterministic (fixed seed): a loose bound, df + 6 sqrt(2 df) */
        double bound = cases[c].df + 6 * sqrt(2.0 * cases[c].df);
        CHECK(chi < bound);
        if (getenv("VERBOSE") || chi >= bound) fprintf(stderr, "case %zu: chi-square %.2f >= %.2f\n", c, chi, bound);
    }
}

static int32_t sample1(const float *logits, int V, mrl_sampling_params p, double u, float *lp, float *lpp) {
    int32_t tok = -1;
    CHECK_OK(mrl_sample_row(K, logits, V, &p, u, &tok, lp, lpp));
    return tok;
}

static void test_edges(void) {
    float lp, lpp;
    const float l[6] = {0.0f, 3.0f, 1.0f, 3.0f, 2.0f, 2.0f};
    /* greedy: first max; log-prob at temperature 1; processed 0 */
    CHECK(sample1(l, 6, (mrl_sampling_params){0, 0, 1, 0}, 0.99, &lp, &lpp) == 1);
    double Z = 0;
    for (int i = 0; i < 6; i++) Z += exp(l[i]);
    CHECK_NEAR(lp, 3.0 - log(Z), 1e-5);
    CHECK(lpp == 0);
    /* k = 1 with a tie at the top: both maxima kept (ties kept), nothing else */
    for (int t = 0; t < 50; t++) {
        int32_t tok = sample1(l, 6, (mrl_sampling_params){1, 1, 1, 0}, t / 50.0, &lp, &lpp);
        CHECK(tok == 1 || tok == 3);
        CHECK_NEAR(lpp, log(0.5), 1e-6);
        CHECK_NEAR(lp, 3.0 - log(Z), 1e-5); /* untruncated log-prob */
    }
    /* k = 3: the tie at the 3rd value (2.0 twice) keeps 4 tokens */
    int seen[6] = {0};
    for (int t = 0; t < 200; t++) seen[sample1(l, 6, (mrl_sampling_params){1, 3, 1, 0}, t / 200.0, &lp, &lpp)]++;
    CHECK(seen[0] == 0 && seen[2] == 0 && seen[1] && seen[3] && seen[4] && seen[5]);
    /* p = 1 and k >= V and min_p = 0 are all "off": the full distribution */
    for (int t = 0; t < 20; t++) {
        double u = (t + 0.5) / 20;
        int32_t a = sample1(l, 6, (mrl_sampling_params){1, 0, 1, 0}, u, &lp, &lpp);
        CHECK(sample1(l, 6, (mrl_sampling_params){1, 6, 1.0f, 0}, u, &lp, &lpp) == a);
        CHECK(sample1(l, 6, (mrl_sampling_params){1, 100, 1.0f, 0}, u, &lp, &lpp) == a);
        CHECK_NEAR(lp, lpp, 1e-6);
    }
    /* top-p ties: four equal tokens, p = 0.5 keeps the two lowest ids, 0.6 three */
    const float eq[4] = {1, 1, 1, 1};
    int s2[4] = {0}, s3[4] = {0};
    for (int t = 0; t < 100; t++) {
        s2[sample1(eq, 4, (mrl_sampling_params){1, 0, 0.5f, 0}, t / 100.0, &lp, &lpp)]++;
        s3[sample1(eq, 4, (mrl_sampling_params){1, 0, 0.6f, 0}, t / 100.0, &lp, &lpp)]++;
    }
    CHECK(s2[0] == 50 && s2[1] == 50 && s2[2] == 0 && s2[3] == 0);
    CHECK(s3[0] && s3[1] && s3[2] && s3[3] == 0);
    /* tiny top-p keeps only the most probable */
    CHECK(sample1(l, 6, (mrl_sampling_params){1, 0, 1e-6f, 0}, 0.99, &lp, &lpp) == 1);
    /* min-p = 1 keeps only the maxima */
    for (int t = 0; t < 10; t++) {
        int32_t tok = sample1(l, 6, (mrl_sampling_params){2, 0, 1, 1.0f}, t / 10.0, &lp, &lpp);
        CHECK(tok == 1 || tok == 3);
    }
    /* -inf logits (masked tokens) are never drawn */
    const float masked[5] = {-INFINITY, 0.0f, -INFINITY, 0.0f, -INFINITY};
    for (int t = 0; t < 20; t++) {
        int32_t tok = sample1(masked, 5, (mrl_sampling_params){1, 0, 1, 0}, t / 20.0, &lp, &lpp);
        CHECK(tok == 1 || tok == 3);
        CHECK_NEAR(lp, log(0.5), 1e-6);
    }
}

/* A large vocabulary (the AVX path's exp against double): log-probs and the
 * kept mass. */
static void test_large_vocab(void) {
    int V = 151936;
    float *l = malloc(sizeof(float) * V);
    uint64_t k = mrl_sample_stream_key(7, 0, 0, 0);
    for (int i = 0; i < V; i++) l[i] = (float)(mrl_sample_uniform(k, i) * 20 - 10);
    l[V - 1] = 12.0f;
    mrl_sampling_params p = {0.8f, 50, 0.9f, 0.0f};
    double m = -1e300, Z = 0;
    for (int i = 0; i < V; i++) m = fmax(m, (double)(l[i] * (1.0f / 0.8f)));
    for (int i = 0; i < V; i++) Z += exp((double)(l[i] * (1.0f / 0.8f)) - m);
    for (int t = 0; t < 5; t++) {
        int32_t tok;
        float lp, lpp;
        CHECK_OK(mrl_sample_row(K, l, V, &p, mrl_sample_uniform(k, 1000 + t), &tok, &lp, &lpp));
        CHECK(tok >= 0 && tok < V);
        CHECK_NEAR(lp, (double)(l[tok] * (1.0f / 0.8f)) - m - log(Z), 2e-5);
        CHECK(lpp >= lp);
    }
    free(l);
}

static void test_batch_invariance(void) {
    enum { R = 37, V = 1000 };
    float *logits = malloc(sizeof(float) * R * V), *perm_logits = malloc(sizeof(float) * R * V);
    mrl_sampling_params params[R], perm_params[R];
    uint64_t keys[R], perm_keys[R];
    int64_t ctr[R], perm_ctr[R];
    int32_t tok[R], tok2[R], tok3[R];
    float lp[R], lp2[R], lp3[R], lpp[R];
    int perm[R];
    for (int r = 0; r < R; r++) {
        for (int i = 0; i < V; i++) logits[r * V + i] = (float)(mrl_sample_uniform(99, r * V + i) * 8 - 4);
        params[r] = (mrl_sampling_params){r % 5 == 0 ? 0.0f : 0.5f + r % 3, r % 4 == 1 ? 20 : 0, r % 3 == 2 ? 0.85f : 1.0f,
                                          r % 6 == 3 ? 0.05f : 0.0f};
        keys[r] = mrl_sample_stream_key(42, 3, r / 4, r % 4);
        ctr[r] = r * 7;
        perm[r] = (r * 11) % R;
    }
    CHECK_OK(mrl_sample_rows(logits, R, V, params, keys, ctr, tok, lp, lpp));
    for (int r = 0; r < R; r++) {
        memcpy(perm_logits + perm[r] * V, logits + r * V, sizeof(float) * V);
        perm_params[perm[r]] = params[r];
        perm_keys[perm[r]] = keys[r];
        perm_ctr[perm[r]] = ctr[r];
    }
    CHECK_OK(mrl_sample_rows(perm_logits, R, V, perm_params, perm_keys, perm_ctr, tok2, lp2, NULL));
    int threads = mrl_parallel_threads();
    mrl_parallel_set_threads(1);
    CHECK_OK(mrl_sample_rows(logits, R, V, params, keys, ctr, tok3, lp3, NULL));
    mrl_parallel_set_threads(threads);
    int same = 1;
    for (int r = 0; r < R; r++) same &= tok[r] == tok2[perm[r]] && lp[r] == lp2[perm[r]] && tok[r] == tok3[r] && lp[r] == lp3[r];
    CHECK(same);
    /* streams differ by sample index and counter */
    CHECK(mrl_sample_stream_key(1, 0, 0, 0) != mrl_sample_stream_key(1, 0, 0, 1));
    CHECK(mrl_sample_stream_key(1, 0, 0, 0) != mrl_sample_stream_key(1, 1, 0, 0));
    CHECK(mrl_sample_uniform(5, 0) != mrl_sample_uniform(5, 1));
    double mean = 0;
    for (int i = 0; i < 100000; i++) mean += mrl_sample_uniform(123, i);
    CHECK_NEAR(mean / 100000, 0.5, 0.005);
    /* bad input */
    mrl_sampling_params bad = params[1];
    bad.top_p = 0;
    perm_params[3] = bad;
    CHECK(mrl_sample_rows(logits, R, V, perm_params, keys, ctr, tok, lp, NULL) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "row 3: sampling params: top_p=0");
    logits[5 * V + 17] = NAN;
    CHECK(mrl_sample_rows(logits, R, V, params, keys, ctr, tok, lp, NULL) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "row 5: sample: the logits row holds a NaN");
    for (int i = 0; i < V; i++) logits[5 * V + i] = -INFINITY;
    CHECK(mrl_sample_rows(logits, R, V, params, keys, ctr, tok, lp, NULL) == MRL_ERR_INVALID);
    CHECK(mrl_sample_rows(logits, R, 0, params, keys, ctr, tok, lp, NULL) == MRL_ERR_INVALID);
    bad = params[1];
    bad.temperature = -1;
    CHECK(mrl_sampling_params_check(&bad) == MRL_ERR_INVALID);
    bad.temperature = 1;
    bad.min_p = 1.5f;
    CHECK(mrl_sampling_params_check(&bad) == MRL_ERR_INVALID);
    free(logits);
    free(perm_logits);
}

/* One call for a batch of rows (what tests/engine/test_sample.lua checked
 * through the FFI before mrl_sample_rows became internal): seeded streams,
 * both log-probs, errors with the row's message. */
static void test_rows(void) {
    enum { R = 4, V = 1000 };
    static float logits[R * V];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < V; i++) logits[r * V + i] = (float)(sin(i * 0.37 + r) * 3);
    logits[0 * V + 42] = 20; /* row 0: a clear maximum */
    mrl_sampling_params params[R];
    for (int r = 0; r < R; r++) params[r] = (mrl_sampling_params){.temperature = 0.8f, .top_p = 1};
    params[0].temperature = 0; /* greedy */
    params[1].top_k = 20;
    params[2].top_p = 0.7f;
    params[3].min_p = 0.1f;
    uint64_t keys[R];
    int64_t ctr[R];
    for (int r = 0; r < R; r++) keys[r] = mrl_sample_stream_key(1234, 5, r, 0), ctr[r] = 0;
    int32_t tok[R], tok2[R];
    float lp[R], lpp[R], lp2[R], lpp2[R];
    CHECK_OK(mrl_sample_rows(logits, R, V, params, keys, ctr, tok, lp, lpp));
    CHECK(tok[0] == 42);  /* greedy takes the maximum */
    CHECK(lpp[0] == 0);   /* greedy: processed log-prob 0 */
    for (int r = 0; r < R; r++) {
        CHECK(tok[r] >= 0 && tok[r] < V);
        CHECK(lp[r] <= 0 && lpp[r] >= lp[r] - 1e-6f); /* truncation only raises the processed log-prob */
    }
    CHECK_OK(mrl_sample_rows(logits, R, V, params, keys, ctr, tok2, lp2, lpp2));
    for (int r = 0; r < R; r++) CHECK(tok2[r] == tok[r]); /* same key and counter, same token */
    /* the untruncated log-prob of row 1 (temperature 0.8), computed here */
    double m = -INFINITY, z = 0;
    for (int i = 0; i < V; i++) m = fmax(m, logits[V + i] / 0.8);
    for (int i = 0; i < V; i++) z += exp(logits[V + i] / 0.8 - m);
    CHECK_NEAR(lp[1], logits[V + tok[1]] / 0.8 - m - log(z), 1e-4);
    /* bad input: the message names the row */
    params[2].top_p = 0;
    CHECK(mrl_sample_rows(logits, R, V, params, keys, ctr, tok, lp, lpp) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "row 2: sampling params: top_p=0");
    params[2].top_p = 1;
    logits[3 * V + 7] = NAN;
    CHECK(mrl_sample_rows(logits, R, V, params, keys, ctr, tok, lp, lpp) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "row 3: sample: the logits row holds a NaN");
}

int main(void) {
    const mrl_kernels *tables[2] = {mrl_kernels_cpu_reference(), mrl_kernels_cpu_fast()};
    for (int t = 0; t < 2; t++) {
        K = tables[t];
        test_distributions();
        test_edges();
        test_large_vocab();
    }
    test_batch_invariance();
    test_rows();
    CHECK_DONE();
}
