// The optimizer's ops on CUDA: AdamW over the flat fp32 buffers, the sum
// (of squares: the gradient norm) and the scale (its clipping). The bf16
// refresh of the weights is the f32_to_bf16 slot (elementwise.cu).
#include "ops.cuh"

#define THREADS 256

// One AdamW step, element-wise: the fp32 operations of
// kernels/cpu/adamw.c in its order with no fused multiply-add, so the same
// bits as every CPU table. An element is in a no-decay range when the
// first range ending after it begins at or before it (binary search over
// the ranges, copied to the device).
__global__ static void adamw_kernel(float *p, float *m, float *v, const float *g, int64_t n, mrl_adamw_coeffs dc,
                                    mrl_adamw_coeffs nd, const int64_t *ranges, int64_t n_ranges) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t lo = 0, hi = n_ranges;
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (ranges[2 * mid + 1] <= i) lo = mid + 1;
            else hi = mid;
        }
        const mrl_adamw_coeffs &c = lo < n_ranges && ranges[2 * lo] <= i ? nd : dc;
        float gi = g[i];
        float pi = __fmul_rn(p[i], c.decay);
        float mi = __fadd_rn(__fmul_rn(m[i], c.beta1), __fmul_rn(c.one_minus_beta1, gi));
        float vi = __fadd_rn(__fmul_rn(v[i], c.beta2), __fmul_rn(__fmul_rn(c.one_minus_beta2, gi), gi));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps);
        p[i] = __fadd_rn(pi, __fmul_rn(c.neg_step, __fdiv_rn(mi, denom)));
        m[i] = mi;
        v[i] = vi;
    }
}

void cuda_adamw(const mrl_adamw_args *a) {
    if (a->n <= 0) return;
    const int64_t *ranges = NULL;
    if (a->n_ranges > 0) {
        size_t bytes = (size_t)a->n_ranges * 2 * sizeof(int64_t);
        int64_t *d = (int64_t *)cuda_ops_scratch(bytes);
        if (!d) return;
        // from pageable memory: the call returns once the host array has been read
        cudaError_t err = cudaMemcpyAsync(d, a->ranges, bytes, cudaMemcpyHostToDevice, cuda_ops_stream());
        if (err != cudaSuccess) {
            cuda_ops_fail(MRL_ERR_DEVICE, "cuda adamw: copying %lld ranges: %s", (long long)a->n_ranges,
                          cudaGetErrorString(err));
            return;
        }
        ranges = d;
    }
    adamw_kernel<<<grid_for(a->n, THREADS), THREADS, 0, cuda_ops_stream()>>>(
        a->p, a->m, a->v, a->g, a->n, a->decay, a->no_decay, ranges, a->n_ranges > 0 ? a->n_ranges : 0);
    cuda_ops_launched("adamw");
}

// ---- sum ----

#define SUM_CHUNK (THREADS * 16)  // elements per block: each block's partial is fixed by n alone

__global__ static void sum_partial_kernel(double *part, const float *x, int64_t n, int squares) {
    __shared__ double sh[33];
    int64_t lo = (int64_t)blockIdx.x * SUM_CHUNK, hi = lo + SUM_CHUNK < n ? lo + SUM_CHUNK : n;
    double s = 0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) s += squares ? (double)x[i] * x[i] : (double)x[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

__global__ static void sum_final_kernel(double *out, const double *part, int64_t parts) {
    __shared__ double sh[33];
    double s = 0;
    for (int64_t i = threadIdx.x; i < parts; i += blockDim.x) s += part[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) *out = s;
}

mrl_status cuda_sum(const float *x, int64_t n, int squares, double *out) {
    if (n <= 0) {
        *out = 0;
        return MRL_OK;
    }
    int64_t parts = (n + SUM_CHUNK - 1) / SUM_CHUNK;
    if (parts > INT32_MAX) return cuda_ops_fail(MRL_ERR_UNSUPPORTED, "cuda sum: %lld elements", (long long)n);
    double *part = (double *)cuda_ops_scratch((size_t)(parts + 1) * sizeof(double));
    if (!part) return MRL_ERR_NOMEM;
    cudaStream_t st = cuda_ops_stream();
    sum_partial_kernel<<<(unsigned)parts, THREADS, 0, st>>>(part, x, n, squares);
    sum_final_kernel<<<1, 1024, 0, st>>>(part + parts, part, parts);
    mrl_status s = cuda_ops_launched("sum");
    if (s) return s;
    cudaError_t err = cudaMemcpyAsync(out, part + parts, sizeof(double), cudaMemcpyDeviceToHost, st);
    if (err == cudaSuccess) err = cudaStreamSynchronize(st);
    if (err != cudaSuccess) return cuda_ops_fail(MRL_ERR_DEVICE, "cuda sum: %s", cudaGetErrorString(err));
    return MRL_OK;
}

// ---- scale ----

__global__ static void scale_kernel(float *x, int64_t n, float s) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], s);
}

void cuda_scale(float *x, int64_t n, float s) {
    if (n <= 0) return;
    scale_kernel<<<grid_for(n, THREADS), THREADS, 0, cuda_ops_stream()>>>(x, n, s);
    cuda_ops_launched("scale");
}

// ---- add ----

__global__ static void add_kernel(float *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

void cuda_add(float *y, const float *x, int64_t n) {
    if (n <= 0) return;
    add_kernel<<<grid_for(n, THREADS), THREADS, 0, cuda_ops_stream()>>>(y, x, n);
    cuda_ops_launched("add");
}
