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

/* Token t's replayed picks in place of its own (none when its row starts with -1; the caller
 * checked the rest: k distinct experts), and how (route_args). */
static void replay_picks(const route_args *r, int64_t t, int32_t *sel) {
    const int16_t *rp = r->replay ? r->replay + t * r->replay_stride : NULL;
    if (r->how) r->how[t] = 0;
    if (!rp || rp[0] < 0) return;
    if (r->how) r->how[t] = same_set(sel, rp, r->k) ? 1 : 2;
    for (int64_t j = 0; j < r->k; j++) sel[j] = rp[j];
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
    replay_picks(r, t, sel);
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

/* DeepSeek-V3's grouped router (kernels.h, moe_route_grouped): the same per-token code on both
 * tables, as route_token. */
typedef struct grouped_args {
    route_args r;
    const float *bias;
    int groups, topk_group;
    float scale;
} grouped_args;

/* The best of n values v[i] (i < n) not in taken[0..nt), ties the lower i; -1 when none. */
static int32_t best_of(const float *v, int32_t n, const int32_t *taken, int64_t nt, const uint8_t *allowed) {
    int32_t best = -1;
    for (int32_t i = 0; i < n; i++) {
        if (allowed && !allowed[i]) continue;
        int out = 0;
        for (int64_t j = 0; j < nt && !out; j++) out = taken[j] == i;
        if (!out && (best < 0 || v[i] > v[best])) best = i;
    }
    return best;
}

#define GROUPED_MAX_E 4096 /* (the config's bound on n_routed_experts) */
static void route_grouped_token(const grouped_args *g, int64_t t) {
    const route_args *r = &g->r;
    int64_t E = r->E, K = r->k;
    int G = g->groups, per = (int)(E / G);
    const float *x = r->logits + t * E;
    float *p = r->prob + t * E; /* may be x */
    float choice[GROUPED_MAX_E], gscore[GROUPED_MAX_E];
    uint8_t allowed[GROUPED_MAX_E];
    int32_t gsel[GROUPED_MAX_E], two[2];
    for (int64_t e = 0; e < E; e++) {
        p[e] = 1.0f / (1.0f + expf(-x[e]));
        choice[e] = p[e] + g->bias[e];
    }
    for (int gi = 0; gi < G; gi++) { /* the group's two best choices, summed */
        const float *c = choice + (int64_t)gi * per;
        two[0] = best_of(c, per, NULL, 0, NULL);
        two[1] = best_of(c, per, two, 1, NULL);
        gscore[gi] = c[two[0]] + c[two[1]];
    }
    for (int j = 0; j < g->topk_group; j++) gsel[j] = best_of(gscore, G, gsel, j, NULL);
    memset(allowed, 0, (size_t)E);
    for (int j = 0; j < g->topk_group; j++) memset(allowed + (int64_t)gsel[j] * per, 1, (size_t)per);
    int32_t *sel = r->sel + t * K;
    for (int64_t j = 0; j < K; j++) sel[j] = best_of(choice, (int32_t)E, sel, j, allowed);
    replay_picks(r, t, sel);
    float *w = r->w + t * K, wsum = 0;
    for (int64_t j = 0; j < K; j++) wsum += w[j] = p[sel[j]];
    for (int64_t j = 0; j < K; j++) {
        if (r->norm) w[j] /= wsum + 1e-20f;
        w[j] *= g->scale;
    }
}

static void grouped_range(void *vg, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) route_grouped_token(vg, t);
}

void mrl_cpu_ref_moe_route_grouped(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                                   const float *bias, const int16_t *replay, int64_t replay_stride, int64_t T, int E,
                                   int k, int groups, int topk_group, int norm, float scale) {
    grouped_args g = {{prob, w, sel, how, logits, replay, replay_stride, E, k, norm}, bias, groups, topk_group, scale};
    if (E <= GROUPED_MAX_E && groups > 0) grouped_range(&g, 0, T);
}

void mrl_cpu_fast_moe_route_grouped(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                                    const float *bias, const int16_t *replay, int64_t replay_stride, int64_t T, int E,
                                    int k, int groups, int topk_group, int norm, float scale) {
    grouped_args g = {{prob, w, sel, how, logits, replay, replay_stride, E, k, norm}, bias, groups, topk_group, scale};
    int64_t work = (int64_t)E * (k + 6);
    if (E <= GROUPED_MAX_E && groups > 0)
        mrl_parallel_for(T, work >= 16384 ? 1 : 16384 / (work > 0 ? work : 1), grouped_range, &g);
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
