/* Sampling from rows of fp32 logits: temperature, min-p, top-k, top-p, with
 * a counter-based random stream per sample (see moonrl/engine.h).
 *
 * Cost per row is a few passes over the vocabulary; the pass that matters
 * (exp of every scaled logit and their sum) runs on AVX-512 or AVX2 where
 * the CPU has them (kernels/cpu/isa.h, mrl_vexp_sum). Top-k selects with a three-way quickselect over the
 * candidates; top-p sorts only the few most probable tokens that cover the
 * mass (widening the set until it does), never the whole vocabulary. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "engine/sample.h"
#include "cpu/isa.h"
#include "moonrl/mem.h"
#include "moonrl/parallel.h"

#define GREEDY_EPS 1e-5f

/* ---- random stream ---- */

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

uint64_t mrl_sample_stream_key(uint64_t seed, int64_t step, int64_t prompt_index, int64_t sample_index) {
    uint64_t k = mix64(seed ^ 0x6d6f6f6e726c2121ULL);
    k = mix64(k ^ (uint64_t)step);
    k = mix64(k ^ (uint64_t)prompt_index);
    return mix64(k ^ (uint64_t)sample_index);
}

double mrl_sample_uniform(uint64_t key, int64_t counter) {
    uint64_t x = mix64(key ^ mix64((uint64_t)counter * 0xd1342543de82ef95ULL + 1));
    return (double)(x >> 11) * 0x1.0p-53;
}

/* ---- selection helpers ---- */

/* The k-th largest (1-based) of v[0..n), 0 < k <= n; v is reordered. */
static float kth_largest(float *v, int n, int k) {
    int lo = 0, hi = n, want = k - 1; /* index in descending order */
    while (hi - lo > 1) {
        float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];
        float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        /* three-way partition, descending: [> pivot][== pivot][< pivot] */
        int gt = lo, i = lo, lt = hi;
        while (i < lt) {
            if (v[i] > pivot) { float t = v[i]; v[i] = v[gt]; v[gt] = t; gt++; i++; }
            else if (v[i] < pivot) { lt--; float t = v[i]; v[i] = v[lt]; v[lt] = t; }
            else i++;
        }
        if (want < gt) hi = gt;
        else if (want < lt) return pivot;
        else lo = lt;
    }
    return v[lo];
}

typedef struct wid {
    float w;
    int32_t id;
} wid;

static int wid_cmp(const void *pa, const void *pb) {
    const wid *a = pa, *b = pb;
    if (a->w != b->w) return a->w > b->w ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static int wid_cmp_id(const void *pa, const void *pb) {
    const wid *a = pa, *b = pb;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* ---- one row ---- */

int64_t mrl_sample_work_floats(int V) { return (int64_t)4 * (V > 0 ? V : 1) + 16; }

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

mrl_status mrl_sample_row(const float *logits, int V, const mrl_sampling_params *p, double u, float *work,
                          int32_t *token, float *logprob, float *lp_processed) {
    mrl_status st = mrl_sampling_params_check(p);
    if (st) return st;
    if (V <= 0 || !logits || !work) return mrl_set_error(MRL_ERR_INVALID, "sample: vocab=%d", V);
    float *x = work, *w = work + V;
    wid *cand = (wid *)(work + 2 * (int64_t)V);
    int greedy = p->temperature < GREEDY_EPS;
    float inv_t = greedy ? 1.0f : 1.0f / p->temperature;
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int i = 0; i < V; i++) {
        float xi = logits[i] * inv_t;
        nan |= xi != xi;
        x[i] = xi;
        m = xi > m ? xi : m;
    }
    if (nan || isinf(m))
        return mrl_set_error(MRL_ERR_INVALID, "sample: the logits row %s", nan ? "holds a NaN" : "has no finite maximum");
    double Z = mrl_vexp_sum(w, x, m, V);
    float lse = m + (float)log(Z);
    if (greedy) {
        int arg = 0;
        while (x[arg] != m) arg++; /* the first maximum */
        *token = arg;
        *logprob = x[arg] - lse;
        if (lp_processed) *lp_processed = 0;
        return MRL_OK;
    }
    /* min-p and top-k: a threshold on x (ties at the threshold kept) */
    float thr = -INFINITY;
    if (p->min_p > 0) thr = m + logf(p->min_p);
    if (p->top_k > 0 && p->top_k < V) {
        float *v = (float *)cand;
        int n = 0;
        for (int i = 0; i < V; i++)
            if (x[i] >= thr) v[n++] = x[i];
        if (n > p->top_k) thr = kth_largest(v, n, p->top_k);
    }
    int tok = -1;
    double Zk = 0;
    if (p->top_p < 1) {
        /* top-p over the kept set, ordered by (w desc, id asc); only the
         * tokens above a weight tau are gathered and sorted, tau lowered
         * until they hold the mass */
        double Zc = 0;
        if (thr == -INFINITY) Zc = Z;
        else
            for (int i = 0; i < V; i++)
                if (x[i] >= thr) Zc += w[i];
        double target = (double)p->top_p * Zc;
        int n = 0;
        for (float tau = 0x1.0p-8f;; tau = tau > 0x1.0p-100f ? tau * tau : 0) {
            double mass = 0;
            n = 0;
            for (int i = 0; i < V; i++)
                if (x[i] >= thr && w[i] >= tau) {
                    cand[n++] = (wid){w[i], i};
                    mass += w[i];
                }
            if (mass >= target || tau == 0) break;
        }
        qsort(cand, (size_t)n, sizeof(wid), wid_cmp);
        double cum = 0;
        int kept = 1;
        while (kept < n && cum + cand[kept - 1].w < target) cum += cand[kept++ - 1].w;
        /* the kept tokens back in id order: the draw below and the sum
         * run in the same order as over the whole vocabulary */
        qsort(cand, (size_t)kept, sizeof(wid), wid_cmp_id);
        for (int j = 0; j < kept; j++) Zk += cand[j].w;
        double t = u * Zk, c = 0;
        for (int j = 0; j < kept; j++) {
            tok = cand[j].id;
            if ((c += cand[j].w) > t) break;
        }
    } else {
        /* draw: the first kept token (id order) whose cumulative mass exceeds u * Zk */
        if (thr == -INFINITY) Zk = Z;
        else
            for (int i = 0; i < V; i++)
                if (x[i] >= thr) Zk += w[i];
        double t = u * Zk, c = 0;
        for (int i = 0; i < V; i++)
            if (x[i] >= thr) {
                tok = i;
                if ((c += w[i]) > t) break;
            }
    }
    *token = tok;
    *logprob = x[tok] - lse;
    if (lp_processed) *lp_processed = x[tok] - m - (float)log(Zk);
    return MRL_OK;
}

/* ---- many rows ---- */

typedef struct rows_ctx {
    const float *const *rows;
    int V;
    const mrl_sampling_params *const *params;
    const uint64_t *keys;
    const int64_t *counters;
    int32_t *tokens;
    float *logprobs, *lp_processed;
    int64_t failed_row; /* a row that failed, or -1 */
} rows_ctx;

static void sample_range(void *vctx, int64_t b, int64_t e) {
    rows_ctx *ctx = vctx;
    float *work = malloc((size_t)mrl_sample_work_floats(ctx->V) * sizeof(float));
    for (int64_t r = b; r < e; r++) {
        float lpp;
        double u = mrl_sample_uniform(ctx->keys[r], ctx->counters[r]);
        if (!work || mrl_sample_row(ctx->rows[r], ctx->V, ctx->params[r], u, work, &ctx->tokens[r], &ctx->logprobs[r],
                                    &lpp)) {
            __atomic_store_n(&ctx->failed_row, r, __ATOMIC_RELAXED);
            ctx->tokens[r] = -1;
            continue;
        }
        if (ctx->lp_processed) ctx->lp_processed[r] = lpp;
    }
    free(work);
}

/* "sample: row R: " + the message already set */
static mrl_status prefix_error(mrl_status st, int64_t row) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mrl_last_error());
    return mrl_set_error(st, "sample_rows: row %lld: %s", (long long)row, msg);
}

mrl_status mrl_sample_gather(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                             const uint64_t *keys, const int64_t *counters, int32_t *tokens, float *logprobs,
                             float *lp_processed) {
    for (int64_t r = 0; r < n; r++) {
        mrl_status st = mrl_sampling_params_check(params[r]);
        if (st) return prefix_error(st, r);
    }
    rows_ctx ctx = {rows, V, params, keys, counters, tokens, logprobs, lp_processed, -1};
    mrl_parallel_for(n, V >= (1 << 17) ? 1 : (1 << 17) / V, sample_range, &ctx); /* >= 128K logits a thread */
    if (ctx.failed_row >= 0) {
        int32_t t;
        float lp;
        float *work = malloc((size_t)mrl_sample_work_floats(V) * sizeof(float));
        if (!work) return mrl_set_error(MRL_ERR_NOMEM, "sample_rows: out of memory");
        /* redo the failing row on this thread to get its message here */
        mrl_status st = mrl_sample_row(rows[ctx.failed_row], V, params[ctx.failed_row], 0, work, &t, &lp, NULL);
        free(work);
        if (!st) return mrl_set_error(MRL_ERR_INTERNAL, "sample_rows: row %lld failed", (long long)ctx.failed_row);
        return prefix_error(st, ctx.failed_row);
    }
    return MRL_OK;
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
        st = mrl_sample_gather(rp, rows, vocab, pp, keys, counters, tokens, logprobs, logprobs_processed);
    }
    free(rp);
    free(pp);
    return st;
}
