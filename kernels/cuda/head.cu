// The head statistics on CUDA (head_fwd / head_bwd slots): per row of
// logits, the log-sum-exp, the entropy and the target's log-prob at
// temperature 1 / inv_temp, and their gradient in place. The model calls
// them on vocabulary-sized rows of a chunk of tokens at a time, so the full
// [tokens, vocab] logits never exist at once.
//
// One block per row. The scaled logits and their exp are fp32 (expf: 2 ulp),
// the sums of exp and of exp * z in double, so a row's statistics carry a few
// ulp of fp32 where the reference computes in double throughout.
#include "ops.cuh"

#define THREADS 512

__global__ static void __launch_bounds__(THREADS)
head_fwd_kernel(const float *logits, int V, float inv_temp, const int32_t *targets, float *lse, float *entropy,
                float *logprob) {
    __shared__ float shf[33];
    __shared__ double shd[33];
    const float *z = logits + (int64_t)blockIdx.x * V;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, __fmul_rn(z[j], inv_temp));
    m = block_max(m, shf);
    double s = 0, sz = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float zj = __fmul_rn(z[j], inv_temp), e = expf(zj - m);  // the max's own zj - m is 0
        s += e;
        sz += (double)e * zj;
    }
    s = block_sum(s, shd);
    sz = block_sum(sz, shd);
    if (threadIdx.x == 0) {
        double l = m + log(s);
        int t = targets[blockIdx.x];
        lse[blockIdx.x] = (float)l;
        entropy[blockIdx.x] = (float)(l - sz / s);
        logprob[blockIdx.x] = t >= 0 && t < V ? (float)((double)z[t] * inv_temp - l) : 0.0f;
    }
}

// d logp_t / dz_j = [j = t] - p_j;  dH / dz_j = -p_j (logp_j + H); times inv_temp for the raw logits
__global__ static void __launch_bounds__(THREADS)
head_bwd_kernel(float *logits, int V, float inv_temp, const int32_t *targets, const float *lse,
                const float *entropy, const float *dlogprob, const float *dentropy) {
    int64_t r = blockIdx.x;
    float *z = logits + r * V;
    int t = targets[r];
    float glp = dlogprob && t >= 0 ? dlogprob[r] : 0.0f, gh = dentropy ? dentropy[r] : 0.0f;
    float L = lse[r], H = entropy[r];
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float lp = z[j] * inv_temp - L, p = expf(lp);
        float g = -glp * p - gh * p * (lp + H);
        if (j == t) g += glp;
        z[j] = g * inv_temp;
    }
}

static int head_shape(const char *fn, int64_t rows, int V) {
    if (rows <= 0) return 0;
    if (V <= 0 || rows > INT32_MAX) {
        cuda_ops_fail(MRL_ERR_INVALID, "cuda %s: rows=%lld V=%d", fn, (long long)rows, V);
        return 0;
    }
    return 1;
}

void cuda_head_fwd(const float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets, float *lse,
                   float *entropy, float *logprob) {
    if (!head_shape("head_fwd", rows, V)) return;
    head_fwd_kernel<<<(unsigned)rows, THREADS, 0, cuda_ops_stream()>>>(logits, V, inv_temp, targets, lse, entropy,
                                                                       logprob);
    cuda_ops_launched("head_fwd");
}

void cuda_head_bwd(float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets, const float *lse,
                   const float *entropy, const float *dlogprob, const float *dentropy) {
    if (!head_shape("head_bwd", rows, V)) return;
    head_bwd_kernel<<<(unsigned)rows, THREADS, 0, cuda_ops_stream()>>>(logits, V, inv_temp, targets, lse, entropy,
                                                                       dlogprob, dentropy);
    cuda_ops_launched("head_bwd");
}
