// The sampler on CUDA (the sample slot): one token from each row of logits
// by temperature, min-p, top-k, top-p and the draw with the row's uniform,
// in the order and with the arithmetic of kernels/cpu/sample.c, so the
// tokens are the CPU's wherever no two choices are within rounding of each
// other (the sums run in another order here).
//
// One block of 1024 threads per row, a few passes over the row (it stays
// in L2), nothing stored per element: each pass recomputes x = logit *
// inv_t (fp32, as the CPU) and w = (float)exp((double)x - max) (double exp,
// as the CPU's reference). The selections that the CPU does by sorting are
// radix selections here, 8 bits a pass:
//   top-k  the k-th largest x among the kept: counts per bin of the
//          order-preserving bits of x;
//   top-p  the CPU keeps the smallest prefix of the kept tokens sorted by
//          (w desc, id asc) whose mass reaches top_p * Zc: here the weight
//          W* where the mass of w >= W* first reaches it (masses per bin),
//          then as many of the tokens of weight exactly W* (in id order) as
//          that prefix takes;
//   draw   the first kept token, in id order, whose cumulative weight
//          exceeds u * Zk: each thread's contiguous range of ids summed, an
//          exclusive scan of those sums, and the range that crosses.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "ops.cuh"
#include "base/error.h"

#define THREADS 1024
#define GREEDY_EPS 1e-5f

enum { SAMPLE_OK = 0, SAMPLE_NAN = 1, SAMPLE_NO_MAX = 2 };

// A row's params, and logf(min_p) taken on the host: the CPU's libm, so
// the min-p threshold has the CPU's bits.
typedef struct row_params {
    mrl_sampling_params p;
    float log_min_p;
} row_params;

typedef struct row_out {
    int32_t token, fail;
    float logprob, lp_processed;
} row_out;

// float bits as an unsigned key with the order of the floats
__device__ __forceinline__ uint32_t order_key(float f) {
    uint32_t u = __float_as_uint(f);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}
__device__ __forceinline__ float key_float(uint32_t k) {
    return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

struct row_view {
    const float *z;
    int V;
    float inv_t, m;
    // __fmul_rn: never fused into a later add, so x has the CPU's bits wherever it is used
    __device__ float x(int i) const { return __fmul_rn(z[i], inv_t); }
    __device__ float w(int i) const { return (float)exp((double)x(i) - m); }
};

// The first kept id (in id order) where the cumulative weight exceeds t;
// the last kept id if none does. kept(i, x, w) decides.
template <typename Kept>
__device__ static int draw(const row_view &r, double t, Kept kept, double *shd, int *shi) {
    int chunk = (r.V + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * chunk, hi = min(r.V, lo + chunk);
    double mine = 0;
    int last = -1;
    for (int i = lo; i < hi; i++) {
        float x = r.x(i), w = r.w(i);
        if (kept(i, x, w)) mine += w, last = i;
    }
    double total;
    double c = block_exclusive_scan(mine, shd, &total);
    if (threadIdx.x == 0) shi[0] = INT32_MAX, shi[1] = -1;
    __syncthreads();
    if (last >= 0) atomicMax(&shi[1], last);
    if (c + mine > t && last >= 0)  // this range crosses (or its rounding lets an earlier one): walk it
        for (int i = lo; i < hi; i++) {
            float x = r.x(i), w = r.w(i);
            if (kept(i, x, w) && (c += w) > t) {
                atomicMin(&shi[0], i);
                break;
            }
        }
    __syncthreads();
    int tok = shi[0] != INT32_MAX ? shi[0] : shi[1];
    __syncthreads();
    return tok;
}

__global__ static void __launch_bounds__(THREADS)
sample_kernel(const float *const *rows, int V, const row_params *params, const double *u, row_out *out) {
    __shared__ double shd[33];
    __shared__ float shf[33];
    __shared__ int shi[2];
    __shared__ unsigned hist_n[256];
    __shared__ double hist_w[256];
    __shared__ int s_nan;
    const int64_t rix = blockIdx.x;
    const mrl_sampling_params p = params[rix].p;
    const int greedy = p.temperature < GREEDY_EPS;
    row_view r = {rows[rix], V, greedy ? 1.0f : 1.0f / p.temperature, 0};
    row_out res = {-1, SAMPLE_OK, 0, 0};

    // max and NaN
    if (threadIdx.x == 0) s_nan = 0;
    __syncthreads();
    float m = -INFINITY;
    int nan = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float x = r.x(i);
        nan |= x != x;
        m = x > m ? x : m;
    }
    if (nan) s_nan = 1;
    m = block_max(m, shf);
    if (s_nan || isinf(m)) {
        if (threadIdx.x == 0) {
            res.fail = s_nan ? SAMPLE_NAN : SAMPLE_NO_MAX;
            out[rix] = res;
        }
        return;
    }
    r.m = m;
    double Z = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) Z += exp((double)r.x(i) - m);
    Z = block_sum(Z, shd);
    float lse = m + (float)log(Z);

    if (greedy) {  // the first maximum
        if (threadIdx.x == 0) shi[0] = INT32_MAX;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            if (r.x(i) == m) {
                atomicMin(&shi[0], i);
                break;
            }
        __syncthreads();
        if (threadIdx.x == 0) {
            res.token = shi[0];
            res.logprob = r.x(shi[0]) - lse;
            out[rix] = res;
        }
        return;
    }

    // min-p and top-k: a threshold on x (ties at it kept)
    float thr = -INFINITY;
    if (p.min_p > 0) thr = m + params[rix].log_min_p;
    if (p.top_k > 0 && p.top_k < V) {
        double n = 0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) n += r.x(i) >= thr;
        n = block_sum(n, shd);
        if (n > p.top_k) {
            uint32_t prefix = 0, mask = 0;
            unsigned want = (unsigned)p.top_k;  // rank from the top among the tokens matching prefix
            for (int shift = 24; shift >= 0; shift -= 8) {
                for (int b = threadIdx.x; b < 256; b += blockDim.x) hist_n[b] = 0;
                __syncthreads();
                for (int i = threadIdx.x; i < V; i += blockDim.x) {
                    float x = r.x(i);
                    uint32_t k = order_key(x);
                    if (x >= thr && (k & mask) == prefix) atomicAdd(&hist_n[(k >> shift) & 0xff], 1u);
                }
                __syncthreads();
                unsigned above = 0;
                int b = 255;
                for (; b > 0 && above + hist_n[b] < want; b--) above += hist_n[b];
                want -= above;
                prefix |= (uint32_t)b << shift;
                mask |= 0xffu << shift;
                __syncthreads();
            }
            thr = key_float(prefix);
        }
    }

    double Zk = 0;
    int tok;
    double uu = u[rix];
    if (p.top_p < 1) {
        double Zc = 0;
        if (thr == -INFINITY) Zc = Z;
        else {
            for (int i = threadIdx.x; i < V; i += blockDim.x)
                if (r.x(i) >= thr) Zc += r.w(i);
            Zc = block_sum(Zc, shd);
        }
        double target = (double)p.top_p * Zc;
        // W*: the weight whose tokens, after every heavier one, first reach the target
        uint32_t prefix = 0, mask = 0;
        double above = 0;
        int found = 1;
        unsigned ties = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) hist_n[b] = 0, hist_w[b] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < V; i += blockDim.x) {
                float x = r.x(i), w = r.w(i);
                uint32_t k = __float_as_uint(w);  // w >= 0: its bits have its order
                if (x >= thr && (k & mask) == prefix) {
                    atomicAdd(&hist_n[(k >> shift) & 0xff], 1u);
                    atomicAdd(&hist_w[(k >> shift) & 0xff], (double)w);
                }
            }
            __syncthreads();
            int b = 255;
            for (; b >= 0; b--) {
                if (above + hist_w[b] >= target && hist_n[b]) break;
                above += hist_w[b];
            }
            if (b < 0) {  // rounding: the whole kept set holds less than the target; keep it all
                found = 0;
                __syncthreads();
                break;
            }
            ties = hist_n[b];
            prefix |= (uint32_t)b << shift;
            mask |= 0xffu << shift;
            __syncthreads();
        }
        float Wstar = __uint_as_float(prefix);
        int cut = V;  // the kept tokens of weight W* are those with id <= cut
        if (found) {
            // the CPU adds ties one by one while the sum stays below the target
            double need = Wstar > 0 ? ceil((target - above) / Wstar) : (double)ties;
            unsigned take = need < 1 ? 1u : need > ties ? ties : (unsigned)need;
            // the id of the take-th token of weight W*
            int chunk = (V + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * chunk, hi = min(V, lo + chunk);
            double cnt = 0, total;
            for (int i = lo; i < hi; i++) cnt += r.x(i) >= thr && r.w(i) == Wstar;
            double before = block_exclusive_scan(cnt, shd, &total);
            if (threadIdx.x == 0) shi[0] = V - 1;
            __syncthreads();
            if (before < take && before + cnt >= take) {
                double seen = before;
                for (int i = lo; i < hi; i++)
                    if (r.x(i) >= thr && r.w(i) == Wstar && ++seen == take) {
                        shi[0] = i;
                        break;
                    }
            }
            __syncthreads();
            cut = shi[0];
            __syncthreads();
        }
        auto kept = [=](int i, float x, float w) {
            return x >= thr && (!found || w > Wstar || (w == Wstar && i <= cut));
        };
        double mass = 0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            float x = r.x(i), w = r.w(i);
            if (kept(i, x, w)) mass += w;
        }
        Zk = block_sum(mass, shd);
        tok = draw(r, uu * Zk, kept, shd, shi);
    } else {
        if (thr == -INFINITY) Zk = Z;
        else {
            double mass = 0;
            for (int i = threadIdx.x; i < V; i += blockDim.x)
                if (r.x(i) >= thr) mass += r.w(i);
            Zk = block_sum(mass, shd);
        }
        auto kept = [=](int i, float x, float w) { return x >= thr; };
        tok = draw(r, uu * Zk, kept, shd, shi);
    }
    if (threadIdx.x == 0) {
        float xt = r.x(tok);
        res.token = tok;
        res.logprob = xt - lse;
        res.lp_processed = xt - m - (float)log(Zk);
        out[rix] = res;
    }
}

mrl_status cuda_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                       const double *u, int32_t *tokens, float *logprobs, float *lp_processed) {
    if (n <= 0) return MRL_OK;
    if (V <= 0 || n > INT32_MAX)
        return cuda_ops_fail(MRL_ERR_INVALID, "sample: %lld rows of %d logits", (long long)n, V);
    // the call's arrays into one upload: row pointers, params, uniforms; the results come back after them
    size_t b_rows = (size_t)n * sizeof(float *), b_par = (size_t)n * sizeof(row_params);
    size_t b_u = (size_t)n * sizeof(double), b_out = (size_t)n * sizeof(row_out);
    size_t o_par = (b_rows + 15) / 16 * 16, o_u = o_par + (b_par + 15) / 16 * 16, o_out = o_u + (b_u + 15) / 16 * 16;
    size_t up = o_out, total = o_out + b_out;
    char *host = (char *)malloc(total);
    if (!host) return mrl_set_error(MRL_ERR_NOMEM, "sample: no memory for %lld rows", (long long)n);
    memcpy(host, rows, b_rows);
    for (int64_t r = 0; r < n; r++) {
        row_params *rp = (row_params *)(host + o_par) + r;
        rp->p = *params[r];
        rp->log_min_p = params[r]->min_p > 0 ? logf(params[r]->min_p) : 0.0f;
    }
    memcpy(host + o_u, u, b_u);
    char *dev = (char *)cuda_ops_scratch(total);
    if (!dev) {
        free(host);
        return MRL_ERR_NOMEM;
    }
    cudaStream_t st = cuda_ops_stream();
    cudaError_t err = cudaMemcpyAsync(dev, host, up, cudaMemcpyHostToDevice, st);
    if (err == cudaSuccess) {
        sample_kernel<<<(unsigned)n, THREADS, 0, st>>>((const float *const *)dev, V,
                                                        (const row_params *)(dev + o_par),
                                                        (const double *)(dev + o_u), (row_out *)(dev + o_out));
        err = cudaGetLastError();
    }
    if (err == cudaSuccess) err = cudaMemcpyAsync(host + o_out, dev + o_out, b_out, cudaMemcpyDeviceToHost, st);
    if (err == cudaSuccess) err = cudaStreamSynchronize(st);
    if (err != cudaSuccess) {
        free(host);
        return cuda_ops_fail(MRL_ERR_DEVICE, "sample: %s", cudaGetErrorString(err));
    }
    const row_out *res = (const row_out *)(host + o_out);
    int64_t first_bad = -1;
    for (int64_t r = 0; r < n; r++) {
        tokens[r] = res[r].token;
        if (res[r].fail) {
            tokens[r] = -1;
            if (first_bad < 0) first_bad = r;
            continue;
        }
        logprobs[r] = res[r].logprob;
        if (lp_processed) lp_processed[r] = res[r].lp_processed;
    }
    mrl_status s = MRL_OK;
    if (first_bad >= 0)
        s = mrl_set_error(MRL_ERR_INVALID, "row %lld: sample: the logits row %s", (long long)first_bad,
                          res[first_bad].fail == SAMPLE_NAN ? "holds a NaN" : "has no finite maximum");
    free(host);
    return s;
}

// ---- top_logprobs: the k most likely tokens of each row ----
//
// One block of THREADS per row. The log-sum-exp as the CPU's (kernels/cpu/
// sample.c, top_row) takes it: the max of the raw logits, then
// exp((double)(x - max) * inv) summed in double (in another order: the
// log-probs differ by rounding), lse = (float)(max * inv + log(sum)). Then
// the k best, one block-wide arg-max a round, each over the tokens after the
// previous pick in the order (logit desc, id asc): k passes over the row
// (the engine asks for at most 20), nothing stored per element, the CPU's
// ids exactly.

// (x, i) comes before (y, j): the larger logit, then the lower id
__device__ __forceinline__ bool top_ahead(float x, int i, float y, int j) { return x > y || (x == y && i < j); }

__device__ __forceinline__ void warp_best(float *x, int *i) {
    for (int o = 16; o > 0; o >>= 1) {
        float y = __shfl_xor_sync(FULL_MASK, *x, o);
        int j = __shfl_xor_sync(FULL_MASK, *i, o);
        if (top_ahead(y, j, *x, *i)) *x = y, *i = j;
    }
}

__global__ static void __launch_bounds__(THREADS)
top_logprobs_kernel(const float *const *rows, int V, const float *invs, int k, int32_t *ids_all, float *lps_all) {
    __shared__ double shd[33];
    __shared__ float shf[33], best_x[32], prev_x;
    __shared__ int best_i[32], prev_i;
    const int64_t r = blockIdx.x;
    const float *z = rows[r], inv = invs[r];
    int32_t *ids = ids_all + r * k;
    float *lps = lps_all + r * k;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) m = z[i] > m ? z[i] : m;
    m = block_max(m, shf);
    double sum = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) sum += exp((double)__fsub_rn(z[i], m) * inv);
    sum = block_sum(sum, shd);
    float lse = (float)((double)__fmul_rn(m, inv) + log(sum));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int n = 0; n < k; n++) {
        float px = n ? prev_x : INFINITY;  // the candidates: after the previous pick
        int pi = n ? prev_i : -1;
        float bx = -INFINITY;
        int bi = INT32_MAX;  // none yet (any token, -inf included, comes before it)
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            float x = z[i];
            if (top_ahead(px, pi, x, i) && top_ahead(x, i, bx, bi)) bx = x, bi = i;
        }
        warp_best(&bx, &bi);
        if (lane == 0) best_x[warp] = bx, best_i[warp] = bi;
        __syncthreads();
        if (warp == 0) {
            bx = lane < warps ? best_x[lane] : -INFINITY;
            bi = lane < warps ? best_i[lane] : INT32_MAX;
            warp_best(&bx, &bi);
            if (lane == 0) {
                ids[n] = bi;
                lps[n] = __fsub_rn(__fmul_rn(bx, inv), lse);
                prev_x = bx, prev_i = bi;
            }
        }
        __syncthreads();
    }
}

mrl_status cuda_top_logprobs(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params, int k,
                             int32_t *ids, float *lps) {
    if (n <= 0) return MRL_OK;
    if (V <= 0 || k < 1 || k > V || n > INT32_MAX)
        return mrl_set_error(MRL_ERR_INVALID, "top_logprobs: %d of %d logits", k, V);
    // one upload (row pointers, each row's 1 / temperature as the CPU takes it), the results after
    size_t b_rows = (size_t)n * sizeof(float *), b_inv = (size_t)n * sizeof(float);
    size_t b_ids = (size_t)n * k * sizeof(int32_t), b_lps = (size_t)n * k * sizeof(float);
    size_t o_inv = (b_rows + 15) / 16 * 16, o_ids = o_inv + (b_inv + 15) / 16 * 16, o_lps = o_ids + (b_ids + 15) / 16 * 16;
    size_t total = o_lps + b_lps;
    char *host = (char *)malloc(total);
    if (!host) return mrl_set_error(MRL_ERR_NOMEM, "top_logprobs: no memory for %lld rows", (long long)n);
    memcpy(host, rows, b_rows);
    for (int64_t r = 0; r < n; r++)
        ((float *)(host + o_inv))[r] = params[r]->temperature < GREEDY_EPS ? 1.0f : 1.0f / params[r]->temperature;
    char *dev = (char *)cuda_ops_scratch(total);
    if (!dev) {
        free(host);
        return MRL_ERR_NOMEM;
    }
    cudaStream_t st = cuda_ops_stream();
    cudaError_t err = cudaMemcpyAsync(dev, host, o_ids, cudaMemcpyHostToDevice, st);
    if (err == cudaSuccess) {
        top_logprobs_kernel<<<(unsigned)n, THREADS, 0, st>>>((const float *const *)dev, V, (const float *)(dev + o_inv),
                                                              k, (int32_t *)(dev + o_ids), (float *)(dev + o_lps));
        err = cudaGetLastError();
    }
    if (err == cudaSuccess) err = cudaMemcpyAsync(host + o_ids, dev + o_ids, total - o_ids, cudaMemcpyDeviceToHost, st);
    if (err == cudaSuccess) err = cudaStreamSynchronize(st);
    if (err == cudaSuccess) {
        memcpy(ids, host + o_ids, b_ids);
        memcpy(lps, host + o_lps, b_lps);
    }
    free(host);
    return err == cudaSuccess ? MRL_OK : cuda_ops_fail(MRL_ERR_DEVICE, "top_logprobs: %s", cudaGetErrorString(err));
}
