/* Sampling from rows of fp32 logits, the two tables' sample op: temperature,
 * min-p, top-k, top-p and the draw, in the order of moonrl/engine.h. The
 * caller (core/engine/sample.c) checks the params and gives each row its
 * uniform from the row's counter-based stream, so every table draws with the
 * same randomness.
 *
 * One row is a few passes over the vocabulary, written once (sample_row);
 * the tables differ in the pass that matters, the exp of every scaled logit
 * and their sum: the reference takes libm's exp in double, one row after the
 * other; the fast table the ISA set's vector exp (isa.h, exp_sum), rows
 * spread over the cores. Top-k selects with a three-way quickselect over the
 * candidates; top-p sorts only the few most probable tokens that cover the
 * mass (widening the set until it does), never the whole vocabulary.
 *
 * The top_logprobs op (the engine's most likely tokens per position) is
 * written once too (top_row): the reference runs it row after row, the fast
 * table spreads the rows over the cores (the same bits; its exps are libm's
 * in double on both, as the log-probs the engine returned before it was an
 * op). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cpu/isa.h"
#include "cpu/sample.h"
#include "base/parallel.h"
#include "base/error.h"

#define GREEDY_EPS 1e-5f

/* w[i] = exp(x[i] - m) (x[i] <= m) and their sum in double. */
typedef double (*exp_sum_fn)(float *w, const float *x, float m, int64_t n);

static double ref_exp_sum(float *w, const float *x, float m, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = exp((double)x[i] - m);
        w[i] = (float)e;
        s += e;
    }
    return s;
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

/* Floats of work space one row takes: x, w, and the candidates (wid pairs). */
static int64_t work_floats(int V) { return (int64_t)4 * V + 16; }

/* One token from logits[V] (p checked, u in [0, 1)); work: work_floats(V). */
static mrl_status sample_row(const float *logits, int V, const mrl_sampling_params *p, double u, float *work,
                             exp_sum_fn exp_sum, int32_t *token, float *logprob, float *lp_processed) {
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
    double Z = exp_sum(w, x, m, V);
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
    const double *u;
    int32_t *tokens;
    float *logprobs, *lp_processed;
    exp_sum_fn exp_sum;
    _Atomic int failed; /* some row failed (or its work space could not be had) */
} rows_ctx;

static void sample_range(void *vctx, int64_t b, int64_t e) {
    rows_ctx *c = vctx;
    float *work = malloc((size_t)work_floats(c->V) * sizeof(float));
    for (int64_t r = b; r < e; r++) {
        float lpp;
        if (!work || sample_row(c->rows[r], c->V, c->params[r], c->u[r], work, c->exp_sum, &c->tokens[r],
                                &c->logprobs[r], &lpp)) {
            c->failed = 1;
            c->tokens[r] = -1;
            continue;
        }
        if (c->lp_processed) c->lp_processed[r] = lpp;
    }
    free(work);
}

/* The first failing row again on the calling thread, for its message there
 * (mrl_last_error is per thread): "row R: ...". */
static mrl_status report_failure(const rows_ctx *c, int64_t n) {
    float *work = malloc((size_t)work_floats(c->V) * sizeof(float));
    if (!work) return mrl_set_error(MRL_ERR_NOMEM, "sample: no memory for the work space of %d logits", c->V);
    mrl_status st = MRL_OK;
    for (int64_t r = 0; r < n && !st; r++) {
        if (c->tokens[r] >= 0) continue;
        int32_t t;
        float lp;
        st = sample_row(c->rows[r], c->V, c->params[r], 0, work, c->exp_sum, &t, &lp, NULL);
        if (st) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", mrl_last_error());
            st = mrl_set_error(st, "row %lld: %s", (long long)r, msg);
        }
    }
    free(work);
    return st ? st : mrl_set_error(MRL_ERR_INTERNAL, "sample: a row failed, and not again");
}

static mrl_status sample_rows(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                              const double *u, int32_t *tokens, float *logprobs, float *lp_processed, exp_sum_fn f,
                              int parallel) {
    rows_ctx c = {rows, V, params, u, tokens, logprobs, lp_processed, f, 0};
    if (parallel)
        mrl_parallel_for(n, V >= (1 << 17) ? 1 : (1 << 17) / V, sample_range, &c); /* >= 128K logits a thread */
    else
        sample_range(&c, 0, n);
    return c.failed ? report_failure(&c, n) : MRL_OK;
}

mrl_status mrl_cpu_ref_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                              const double *u, int32_t *tokens, float *logprobs, float *lp_processed) {
    return sample_rows(rows, n, V, params, u, tokens, logprobs, lp_processed, ref_exp_sum, 0);
}

mrl_status mrl_cpu_fast_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                               const double *u, int32_t *tokens, float *logprobs, float *lp_processed) {
    return sample_rows(rows, n, V, params, u, tokens, logprobs, lp_processed, mrl_cpu_isa_get()->exp_sum, 1);
}

/* ---- the most likely tokens ---- */

/* The n most likely tokens of logits x[V] and their log-probs under softmax(x / t) over the
 * whole vocabulary, best first, ties the lower id: one pass keeping a sorted list of n. */
static void top_row(const float *x, int V, const mrl_sampling_params *p, int n, int32_t *ids, float *lps) {
    float inv = p->temperature < GREEDY_EPS ? 1.0f : 1.0f / p->temperature;
    float mx = -INFINITY;
    for (int v = 0; v < V; v++) mx = x[v] > mx ? x[v] : mx;
    double sum = 0;
    for (int v = 0; v < V; v++) sum += exp((double)(x[v] - mx) * inv);
    float lse = (float)(mx * inv + log(sum));
    int have = 0;
    for (int v = 0; v < V; v++) {
        if (have == n && !(x[v] > x[ids[n - 1]])) continue; /* strict: an equal later id stays out */
        int at = have < n ? have++ : n - 1;
        while (at > 0 && x[v] > x[ids[at - 1]]) { /* shift the smaller ones down */
            ids[at] = ids[at - 1];
            at--;
        }
        ids[at] = v;
    }
    for (int i = 0; i < n; i++) lps[i] = x[ids[i]] * inv - lse;
}

typedef struct top_ctx {
    const float *const *rows;
    int V, k;
    const mrl_sampling_params *const *params;
    int32_t *ids;
    float *lps;
} top_ctx;

static void top_range(void *vc, int64_t r0, int64_t r1) {
    const top_ctx *c = vc;
    for (int64_t r = r0; r < r1; r++) top_row(c->rows[r], c->V, c->params[r], c->k, c->ids + r * c->k, c->lps + r * c->k);
}

static mrl_status top_logprobs(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                               int k, int32_t *ids, float *lps, int parallel) {
    if (n <= 0) return MRL_OK;
    if (V <= 0 || k < 1 || k > V) return mrl_set_error(MRL_ERR_INVALID, "top_logprobs: %d of %d logits", k, V);
    top_ctx c = {rows, V, k, params, ids, lps};
    if (parallel)
        mrl_parallel_for(n, V >= (1 << 17) ? 1 : (1 << 17) / V, top_range, &c); /* >= 128K logits a thread */
    else
        top_range(&c, 0, n);
    return MRL_OK;
}

mrl_status mrl_cpu_ref_top_logprobs(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                                    int k, int32_t *ids, float *lps) {
    return top_logprobs(rows, n, V, params, k, ids, lps, 0);
}

mrl_status mrl_cpu_fast_top_logprobs(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                                     int k, int32_t *ids, float *lps) {
    return top_logprobs(rows, n, V, params, k, ids, lps, 1);
}
