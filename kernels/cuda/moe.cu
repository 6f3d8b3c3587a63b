// The router of a sparse layer on CUDA: the moe_route and moe_group slots
// (kernels.h has their contract; kernels/cpu/moe.c the CPU's).
//
// moe_route: one thread a token, doing what the CPU's route_token does in
// its order: the max, the exps summed in fp32 in expert order, the
// divisions, k passes over the row for the picks, the weights. With the
// CPU's order of the sum, a probability differs from the CPU's only by its
// exp's rounding (here the double exp rounded to fp32: within half an ulp
// plus a little, as libm's expf), and a pick can flip only between experts
// within an ulp of each other. A token is E * (k + 3) steps, nothing next
// to its experts' products, so one thread each is enough (its row read by
// that thread alone, uncoalesced: E floats).
//
// moe_group: one block an expert. Block e counts, over all the picks, those
// of the experts before e (where e's rows start) and, per thread's range of
// picks, its own; an exclusive scan of its own counts in thread order gives
// each range its first row, so e's rows keep the picks' order: the CPU's
// stable counting sort, with no block waiting for another.
#include "ops.cuh"

#define ROUTE_THREADS 128
#define GROUP_THREADS 256

// Token t's replayed picks (replay NULL, or its row's first -1: none) in place of its own, and how
// (0 own, 1 replayed the same set, 2 another; the caller checked: k distinct experts).
__device__ static void replay_picks(int32_t *sel, int32_t *how, const int16_t *replay, int64_t replay_stride, int64_t t,
                                    int K) {
    const int16_t *rp = replay ? replay + t * replay_stride : NULL;
    if (how) how[t] = 0;
    if (!rp || rp[0] < 0) return;
    int same = 1;
    for (int j = 0; j < K && same; j++) {
        int found = 0;
        for (int i = 0; i < K && !found; i++) found = sel[j] == rp[i];
        same = found;
    }
    if (how) how[t] = same ? 1 : 2;
    for (int j = 0; j < K; j++) sel[j] = rp[j];
}

// w [K] = p at the picks; returns their sum, in pick order.
__device__ static float weights_at(float *w, const float *p, const int32_t *sel, int K) {
    float sum = 0;
    for (int j = 0; j < K; j++) {
        w[j] = p[sel[j]];
        sum = __fadd_rn(sum, w[j]);
    }
    return sum;
}

__global__ static void __launch_bounds__(ROUTE_THREADS)
moe_route_kernel(float *prob, int32_t *sel_all, float *w_all, int32_t *how, const float *logits, const int16_t *replay,
                 int64_t replay_stride, int64_t T, int E, int K, int norm) {
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < T; t += (int64_t)gridDim.x * blockDim.x) {
        const float *x = logits + t * E;
        float *p = prob + t * E;  // may be x
        float mx = x[0];
        for (int i = 1; i < E; i++) mx = x[i] > mx ? x[i] : mx;
        float sum = 0;
        for (int i = 0; i < E; i++) {
            p[i] = (float)exp((double)__fsub_rn(x[i], mx));
            sum = __fadd_rn(sum, p[i]);
        }
        for (int i = 0; i < E; i++) p[i] = __fdiv_rn(p[i], sum);
        int32_t *sel = sel_all + t * K;
        for (int j = 0; j < K; j++) {  // the largest not yet taken; strict > keeps the lower index on ties
            int32_t best = -1;
            for (int32_t e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j && !taken; i++) taken = sel[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            sel[j] = best;
        }
        replay_picks(sel, how, replay, replay_stride, t, K);
        float *w = w_all + t * K, wsum = weights_at(w, p, sel, K);
        if (norm)
            for (int j = 0; j < K; j++) w[j] = __fdiv_rn(w[j], wsum);
    }
}

void cuda_moe_route(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits, const int16_t *replay,
                    int64_t replay_stride, int64_t T, int E, int k, int norm) {
    if (T <= 0) return;
    if (E < 1 || k < 1 || k > E) {
        cuda_ops_fail(MRL_ERR_INVALID, "moe_route: %d picks of %d experts", k, E);
        return;
    }
    moe_route_kernel<<<grid_for(T, ROUTE_THREADS), ROUTE_THREADS, 0, cuda_ops_stream()>>>(
        prob, sel, w, how, logits, replay, replay_stride, T, E, k, norm);
    cuda_ops_launched("moe_route");
}

// moe_route_grouped (DeepSeek-V3's router): one thread a token, route_grouped_token's steps in its
// order (kernels/cpu/moe.c). The choice scores prob + bias are recomputed where read (the same fp32
// add), and a group's score, the sum of its two best, where a group is weighed.
#define MAX_GROUPS 64
__device__ static float group_score(const float *p, const float *bias, int g, int per) {
    int b0 = -1, b1 = -1;
    for (int i = g * per; i < (g + 1) * per; i++) {
        float c = __fadd_rn(p[i], bias[i]);
        if (b0 < 0 || c > __fadd_rn(p[b0], bias[b0])) b1 = b0, b0 = i;
        else if (b1 < 0 || c > __fadd_rn(p[b1], bias[b1])) b1 = i;
    }
    return __fadd_rn(__fadd_rn(p[b0], bias[b0]), __fadd_rn(p[b1], bias[b1]));
}

__global__ static void __launch_bounds__(ROUTE_THREADS)
moe_route_grouped_kernel(float *prob, int32_t *sel_all, float *w_all, int32_t *how, const float *logits,
                         const float *bias, const int16_t *replay, int64_t replay_stride, int64_t T, int E, int K,
                         int G, int topk_group, int norm, float scale) {
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < T; t += (int64_t)gridDim.x * blockDim.x) {
        const float *x = logits + t * E;
        float *p = prob + t * E;  // may be x
        for (int e = 0; e < E; e++) p[e] = __fdiv_rn(1.0f, __fadd_rn(1.0f, (float)exp(-(double)x[e])));
        int per = E / G, gsel[MAX_GROUPS];
        for (int j = 0; j < topk_group; j++) {  // the best groups not yet taken, ties the lower
            int best = -1;
            float bs = 0;
            for (int g = 0; g < G; g++) {
                int taken = 0;
                for (int i = 0; i < j && !taken; i++) taken = gsel[i] == g;
                if (taken) continue;
                float s = group_score(p, bias, g, per);
                if (best < 0 || s > bs) best = g, bs = s;
            }
            gsel[j] = best;
        }
        int32_t *sel = sel_all + t * K;
        for (int j = 0; j < K; j++) {  // the best choices of the groups taken, ties the lower expert
            int32_t best = -1;
            for (int32_t e = 0; e < E; e++) {
                int ok = 0;
                for (int i = 0; i < topk_group && !ok; i++) ok = gsel[i] == e / per;
                for (int i = 0; i < j && ok; i++) ok = sel[i] != e;
                if (ok && (best < 0 || __fadd_rn(p[e], bias[e]) > __fadd_rn(p[best], bias[best]))) best = e;
            }
            sel[j] = best;
        }
        replay_picks(sel, how, replay, replay_stride, t, K);
        float *w = w_all + t * K, wsum = weights_at(w, p, sel, K);
        for (int j = 0; j < K; j++) {
            if (norm) w[j] = __fdiv_rn(w[j], __fadd_rn(wsum, 1e-20f));
            w[j] = __fmul_rn(w[j], scale);
        }
    }
}

void cuda_moe_route_grouped(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits, const float *bias,
                            const int16_t *replay, int64_t replay_stride, int64_t T, int E, int k, int groups,
                            int topk_group, int norm, float scale) {
    if (T <= 0) return;
    if (groups < 1 || groups > MAX_GROUPS || E % groups || E / groups < 2 || topk_group < 1 || topk_group > groups ||
        k < 1 || k > topk_group * (E / groups)) {
        cuda_ops_fail(MRL_ERR_INVALID, "moe_route_grouped: %d picks of %d experts in %d groups (%d taken)", k, E, groups,
                      topk_group);
        return;
    }
    moe_route_grouped_kernel<<<grid_for(T, ROUTE_THREADS), ROUTE_THREADS, 0, cuda_ops_stream()>>>(
        prob, sel, w, how, logits, bias, replay, replay_stride, T, E, k, groups, topk_group, norm, scale);
    cuda_ops_launched("moe_route_grouped");
}

__global__ static void __launch_bounds__(GROUP_THREADS)
moe_group_kernel(int32_t *eoff, int32_t *row, int32_t *tok, const int32_t *sel, int64_t A, int E, int k) {
    __shared__ int64_t sh[33];
    const int e = blockIdx.x;
    int64_t chunk = (A + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * chunk, hi = min(A, lo + chunk);
    int64_t mine = 0, below = 0;
    for (int64_t i = lo; i < hi; i++) {
        int32_t s = sel[i];
        mine += s == e;
        below += s < e;
    }
    int64_t first = block_sum(below, sh), total;  // eoff[e]: the picks of the experts before e
    int64_t at = first + block_exclusive_scan(mine, sh, &total);
    for (int64_t i = lo; i < hi && mine; i++)
        if (sel[i] == e) {
            row[i] = (int32_t)at;
            tok[at++] = (int32_t)(i / k);
        }
    if (threadIdx.x == 0) {
        eoff[e] = (int32_t)first;
        if (e == E - 1) eoff[E] = (int32_t)A;
    }
}

void cuda_moe_group(int32_t *eoff, int32_t *row, int32_t *tok, const int32_t *sel, int64_t A, int E, int k) {
    if (E < 1 || k < 1 || A < 0 || A > INT32_MAX) {
        cuda_ops_fail(MRL_ERR_INVALID, "moe_group: %lld picks of %d experts, %d a token", (long long)A, E, k);
        return;
    }
    moe_group_kernel<<<(unsigned)E, GROUP_THREADS, 0, cuda_ops_stream()>>>(eoff, row, tok, sel, A, E, k);
    cuda_ops_launched("moe_group");
}
