/* Sampling: the counter-based random stream of each sample (see
 * moonrl/engine.h), the check of the params, and the gathering of rows for
 * the op table's sample op (kernels.h: the numeric work, temperature, min-p,
 * top-k, top-p and the draw, lives in kernels/cpu/sample.c). The stream
 * stays here, above the kernels, so that every table draws with the same
 * uniforms. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "engine/sample.h"
#include "base/rng.h"
#include "base/error.h"

/* ---- random stream (splitmix64's finaliser as a hash, core/base/rng.h) ---- */

uint64_t mrl_sample_stream_key(uint64_t seed, int64_t step, int64_t prompt_index, int64_t sample_index) {
    uint64_t k = mrl_mix64(seed ^ 0x6d6f6f6e726c2121ULL);
    k = mrl_mix64(k ^ (uint64_t)step);
    k = mrl_mix64(k ^ (uint64_t)prompt_index);
    return mrl_mix64(k ^ (uint64_t)sample_index);
}

double mrl_sample_uniform(uint64_t key, int64_t counter) {
    return mrl_unit53(mrl_mix64(key ^ mrl_mix64((uint64_t)counter * 0xd1342543de82ef95ULL + 1)));
}

/* ---- params ---- */

mrl_status mrl_sampling_params_check(const mrl_sampling_params *p) {
    if (!p) return mrl_set_error(MRL_ERR_INVALID, "sampling params: NULL");
    if (!(p->temperature >= 0) || isinf(p->temperature))
        return mrl_set_error(MRL_ERR_INVALID, "sampling params: temperature=%g (want >= 0, finite)", p->temperature);
    if (!(p->top_p > 0 && p->top_p <= 1))
        return mrl_set_error(MRL_ERR_INVALID, "sampling params: top_p=%g (want 0 < top_p <= 1)", p->top_p);
    if (!(p->min_p >= 0 && p->min_p <= 1))
        return mrl_set_error(MRL_ERR_INVALID, "sampling params: min_p=%g (want 0 <= min_p <= 1)", p->min_p);
    return MRL_OK;
}

/* ---- rows ---- */

/* "<what>: " + the message already set */
static mrl_status prefix_error(mrl_status st, const char *what) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mrl_last_error());
    return mrl_set_error(st, "%s: %s", what, msg);
}

mrl_status mrl_sample_row(const mrl_kernels *k, const float *logits, int V, const mrl_sampling_params *p, double u,
                          int32_t *token, float *logprob, float *lp_processed) {
    mrl_status st = mrl_sampling_params_check(p);
    if (st) return st;
    if (V <= 0 || !logits) return mrl_set_error(MRL_ERR_INVALID, "sample: vocab=%d", V);
    return (k ? k : mrl_kernels_cpu_fast())->sample(&logits, 1, V, &p, &u, token, logprob, lp_processed);
}

mrl_status mrl_sample_gather(const mrl_kernels *k, const float *const *rows, int64_t n, int V,
                             const mrl_sampling_params *const *params, const uint64_t *keys, const int64_t *counters,
                             int32_t *tokens, float *logprobs, float *lp_processed) {
    for (int64_t r = 0; r < n; r++) {
        mrl_status st = mrl_sampling_params_check(params[r]);
        if (st) {
            char what[64];
            snprintf(what, sizeof what, "sample_rows: row %lld", (long long)r);
            return prefix_error(st, what);
        }
    }
    if (n <= 0) return MRL_OK;
    double *u = malloc(sizeof(double) * (size_t)n);
    if (!u) return mrl_set_error(MRL_ERR_NOMEM, "sample_rows: out of memory");
    for (int64_t r = 0; r < n; r++) u[r] = mrl_sample_uniform(keys[r], counters[r]);
    mrl_status st = (k ? k : mrl_kernels_cpu_fast())->sample(rows, n, V, params, u, tokens, logprobs, lp_processed);
    free(u);
    return st ? prefix_error(st, "sample_rows") : MRL_OK;
}

mrl_status mrl_sample_rows(const float *logits, int64_t rows, int vocab, const mrl_sampling_params *params,
                           const uint64_t *keys, const int64_t *counters, int32_t *tokens, float *logprobs,
                           float *logprobs_processed) {
    if (rows < 0 || vocab <= 0 || (rows > 0 && (!logits || !params || !keys || !counters || !tokens || !logprobs)))
        return mrl_set_error(MRL_ERR_INVALID, "sample_rows: bad arguments (rows=%lld vocab=%d)", (long long)rows, vocab);
    if (rows == 0) return MRL_OK;
    const float **rp = malloc((size_t)rows * sizeof(*rp));
    const mrl_sampling_params **pp = malloc((size_t)rows * sizeof(*pp));
    mrl_status st = MRL_OK;
    if (!rp || !pp) {
        st = mrl_set_error(MRL_ERR_NOMEM, "sample_rows: out of memory");
    } else {
        for (int64_t r = 0; r < rows; r++) {
            rp[r] = logits + r * vocab;
            pp[r] = &params[r];
        }
        st = mrl_sample_gather(NULL, rp, rows, vocab, pp, keys, counters, tokens, logprobs, logprobs_processed);
    }
    free(rp);
    free(pp);
    return st;
}

mrl_status mrl_sample_verify(const mrl_kernels *k, const float *logits, int V, const mrl_sampling_params *p, double u,
                             int32_t d, float *scratch, int32_t *token, float *logprob, float *lp_processed,
                             int *accepted) {
    if (d < 0 || d >= V) return mrl_set_error(MRL_ERR_INVALID, "sample_verify: draft %d outside the vocabulary (%d)", d, V);
    *accepted = 0;
    if (p->temperature < 1e-5f) { /* greedy: the row's own token */
        mrl_status st = mrl_sample_row(k, logits, V, p, u, token, logprob, lp_processed);
        *accepted = !st && *token == d;
        return st;
    }
    if (p->top_k > 0 || p->top_p < 1 || p->min_p > 0)
        return mrl_set_error(MRL_ERR_INVALID, "sample_verify: only greedy or plain-temperature sampling verifies a draft");
    double inv_t = 1.0 / p->temperature, m = -INFINITY, z = 0;
    for (int i = 0; i < V; i++) m = logits[i] * inv_t > m ? logits[i] * inv_t : m;
    for (int i = 0; i < V; i++) z += exp(logits[i] * inv_t - m);
    double lse = m + log(z), pd = exp(logits[d] * inv_t - lse);
    if (u < pd) {
        *token = d, *accepted = 1;
    } else { /* the residual: p without d, renormalised */
        memcpy(scratch, logits, sizeof(float) * (size_t)V);
        scratch[d] = -INFINITY;
        double u2 = pd < 1 ? (u - pd) / (1 - pd) : 0;
        if (u2 >= 1) u2 = nextafter(1.0, 0.0);
        float lp2, lpp2;
        mrl_status st = mrl_sample_row(k, scratch, V, p, u2, token, &lp2, &lpp2);
        if (st) return st;
    }
    *logprob = (float)(logits[*token] * inv_t - lse);
    if (lp_processed) *lp_processed = *logprob;
    return MRL_OK;
}
