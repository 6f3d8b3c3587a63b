/* The router of a sparse layer on the CPU: the moe_route and moe_group
 * slots (kernels.h has their contract; core/model/moe.c calls them).
 *
 * The picks decide which experts run, and tests pin MoE models' outputs
 * against PyTorch with them: both tables run the same per-token code
 * (route_token), the reference one token after the other, the fast table
 * with the tokens spread over the cores, which gives the same bits (each
 * token is its own). A vector exp would change the probabilities' last bits
 * and could flip a pick between experts within an ulp of each other; the
 * router is E exps a token, nothing next to its experts' products.
 *
 * The grouping is one pass over the A picks in order (a counting sort):
 * one function for both tables; a parallel one is not worth its code at
 * A + E steps next to the experts' A * 3 * D * Fe multiply-adds. */
#include <math.h>
#include <string.h>
#include "cpu/moe.h"
#include "base/parallel.h"

typedef struct route_args {
    float *prob, *w;
    int32_t *sel, *how;
    const float *logits;
    const int16_t *replay;
    int64_t replay_stride;
    int E, k, norm;
} route_args;

/* 1 when the k picks a and b name the same set of experts (each holds k distinct ones). */
static int same_set(const int32_t *a, const int16_t *b, int64_t k) {
    for (int64_t j = 0; j < k; j++) {
        int found = 0;
        for (int64_t i = 0; i < k && !found; i++) found = a[j] == b[i];
        if (!found) return 0;
    }
    return 1;
}

static void route_token(const route_args *r, int64_t t) {
    int64_t E = r->E, K = r->k;
    const float *x = r->logits + t * E;
    float *p = r->prob + t * E; /* may be x */
    /* softmax in fp32: the max, the exps summed in expert order, the divisions */
    float mx = x[0];
    for (int64_t i = 1; i < E; i++) mx = x[i] > mx ? x[i] : mx;
    float sum = 0;
    for (int64_t i = 0; i < E; i++) sum += p[i] = expf(x[i] - mx);
    for (int64_t i = 0; i < E; i++) p[i] /= sum;
    int32_t *sel = r->sel + t * K;
    for (int64_t j = 0; j < K; j++) { /* the largest not yet taken; strict > keeps the lower index on ties */
        int32_t best = -1;
        for (int32_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j && !taken; i++) taken = sel[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        sel[j] = best;
    }
    const int16_t *rp = r->replay ? r->replay + t * r->replay_stride : NULL;
    if (r->how) r->how[t] = 0;
    if (rp && rp[0] >= 0) { /* checked by the caller: k distinct experts */
        if (r->how) r->how[t] = same_set(sel, rp, K) ? 1 : 2;
        for (int64_t j = 0; j < K; j++) sel[j] = rp[j];
    }
    float *w = r->w + t * K, wsum = 0;
    for (int64_t j = 0; j < K; j++) wsum += w[j] = p[sel[j]];
    if (r->norm)
        for (int64_t j = 0; j < K; j++) w[j] /= wsum;
}

static void route_range(void *vr, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) route_token(vr, t);
}

void mrl_cpu_ref_moe_route(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                           const int16_t *replay, int64_t replay_stride, int64_t T, int E, int k, int norm) {
    route_args r = {prob, w, sel, how, logits, replay, replay_stride, E, k, norm};
    route_range(&r, 0, T);
}

void mrl_cpu_fast_moe_route(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                            const int16_t *replay, int64_t replay_stride, int64_t T, int E, int k, int norm) {
    route_args r = {prob, w, sel, how, logits, replay, replay_stride, E, k, norm};
    int64_t work = (int64_t)E * (k + 4); /* the exps, and k passes over the row to pick */
    mrl_parallel_for(T, work >= 16384 ? 1 : 16384 / (work > 0 ? work : 1), route_range, &r);
}

void mrl_cpu_moe_group(int32_t *eoff, int32_t *row, int32_t *tok, const int32_t *sel, int64_t A, int E, int k) {
    /* eoff[e] = first row of expert e; row[i] its place, tok[row] its token */
    memset(eoff, 0, sizeof(int32_t) * ((size_t)E + 1));
    for (int64_t i = 0; i < A; i++) eoff[sel[i] + 1]++;
    for (int64_t e = 0; e < E; e++) eoff[e + 1] += eoff[e];
    for (int64_t i = 0; i < A; i++) { /* eoff[e] walks to the end of e's rows ... */
        int32_t r = eoff[sel[i]]++;
        row[i] = r;
        tok[r] = (int32_t)(i / k);
    }
    for (int64_t e = E; e > 0; e--) eoff[e] = eoff[e - 1]; /* ... which is where e + 1 starts: shift back */
    eoff[0] = 0;
}
