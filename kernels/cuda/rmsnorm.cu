// RMSNorm forward and backward on CUDA (the rmsnorm_fwd / rmsnorm_bwd slots;
// kernels/cpu/reference.c has the math). One block per row: the row's sum
// (of squares, or of w dy x) in double through a block reduction, then the
// element-wise pass. The weight gradient sums over rows: per chunk of rows
// in double into the scratch, then the chunks in order, so it is the same
// from run to run.
#include "ops.cuh"

#define ROW_THREADS 256
#define DW_CHUNK 128  // rows per partial sum of dw

// out = x * r * w, r = 1 / sqrt(mean(x^2) + eps): the products rounded
// one by one in fp32 as the reference does (no fused multiply-add), so
// with the same r the same bits.
__global__ static void rmsnorm_fwd_kernel(float *out, float *rstd, const float *x, const float *w, int D, float eps) {
    __shared__ double sh[33];
    const float *xr = x + (int64_t)blockIdx.x * D;
    float *o = out + (int64_t)blockIdx.x * D;
    double ss = 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += (double)xr[i] * xr[i];
    ss = block_sum(ss, sh);
    float r = (float)(1.0 / sqrt(ss / D + eps));
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = __fmul_rn(__fmul_rn(xr[i], r), w[i]);
}

// dx += r w dy - x r^3 / D * sum(w dy x)
__global__ static void rmsnorm_dx_kernel(float *dx, const float *dout, const float *x, const float *w,
                                         const float *rstd, int D) {
    __shared__ double sh[33];
    int64_t base = (int64_t)blockIdx.x * D;
    const float *xr = x + base, *dy = dout + base;
    double r = rstd[blockIdx.x], dot = 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) dot += (double)dy[i] * w[i] * xr[i];
    dot = block_sum(dot, sh);
    double c = dot * r * r * r / D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) dx[base + i] += (float)(r * w[i] * dy[i] - c * xr[i]);
}

// part[chunk][i] = sum over the chunk's rows t of dy[t,i] x[t,i] r[t]
__global__ static void rmsnorm_dw_partial(double *part, const float *dout, const float *x, const float *rstd,
                                          int64_t T, int D) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= D) return;
    int64_t t0 = (int64_t)blockIdx.y * DW_CHUNK, t1 = t0 + DW_CHUNK < T ? t0 + DW_CHUNK : T;
    double s = 0;
    for (int64_t t = t0; t < t1; t++) s += (double)dout[t * D + i] * x[t * D + i] * rstd[t];
    part[(int64_t)blockIdx.y * D + i] = s;
}

__global__ static void rmsnorm_dw_sum(float *dw, const double *part, int chunks, int D) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= D) return;
    double s = 0;
    for (int c = 0; c < chunks; c++) s += part[(int64_t)c * D + i];
    dw[i] += (float)s;
}

void cuda_rmsnorm_fwd(float *out, float *rstd, const float *x, const float *w, int64_t T, int D, float eps) {
    if (T <= 0) return;
    if (D <= 0 || T > INT32_MAX) {
        cuda_ops_fail(MRL_ERR_INVALID, "cuda rmsnorm_fwd: T=%lld D=%d", (long long)T, D);
        return;
    }
    rmsnorm_fwd_kernel<<<(unsigned)T, ROW_THREADS, 0, cuda_ops_stream()>>>(out, rstd, x, w, D, eps);
    cuda_ops_launched("rmsnorm_fwd");
}

void cuda_rmsnorm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w, const float *rstd,
                      int64_t T, int D) {
    if (T <= 0) return;
    if (D <= 0 || T > INT32_MAX) {
        cuda_ops_fail(MRL_ERR_INVALID, "cuda rmsnorm_bwd: T=%lld D=%d", (long long)T, D);
        return;
    }
    cudaStream_t st = cuda_ops_stream();
    rmsnorm_dx_kernel<<<(unsigned)T, ROW_THREADS, 0, st>>>(dx, dout, x, w, rstd, D);
    if (cuda_ops_launched("rmsnorm_bwd") || !dw) return;
    int64_t chunks = (T + DW_CHUNK - 1) / DW_CHUNK;
    if (chunks > 65535) {
        cuda_ops_fail(MRL_ERR_UNSUPPORTED, "cuda rmsnorm_bwd: T=%lld rows is more than %d", (long long)T,
                      65535 * DW_CHUNK);
        return;
    }
    double *part = (double *)cuda_ops_scratch((size_t)chunks * D * sizeof(double));
    if (!part) return;
    dim3 grid((D + 255) / 256, (unsigned)chunks);
    rmsnorm_dw_partial<<<grid, 256, 0, st>>>(part, dout, x, rstd, T, D);
    rmsnorm_dw_sum<<<(D + 255) / 256, 256, 0, st>>>(dw, part, (int)chunks, D);
    cuda_ops_launched("rmsnorm_bwd (dw)");
}
