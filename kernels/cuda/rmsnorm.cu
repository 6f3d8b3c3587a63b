// RMSNorm forward on CUDA: one block per row, a block-wide sum of squares
// reduced through warp shuffles, then the scaled write. Checked against the
// CPU reference by tests/gpu (kernels/cpu/rmsnorm.c).
#include <cuda_runtime.h>
#include "cuda_backend.h"

__device__ static float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__global__ static void rmsnorm_forward_kernel(float *out, float *rms_inv, const float *x, const float *weight,
                                              int dim, float eps) {
    __shared__ float partial[32];
    const float *row = x + (size_t)blockIdx.x * dim;
    float *out_row = out + (size_t)blockIdx.x * dim;
    float sum = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i] * row[i];
    sum = warp_sum(sum);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        int warps = (blockDim.x + 31) >> 5;
        sum = lane < warps ? partial[lane] : 0.f;
        sum = warp_sum(sum);
        if (lane == 0) partial[0] = rsqrtf(sum / dim + eps);
    }
    __syncthreads();
    float scale = partial[0];
    if (threadIdx.x == 0 && rms_inv) rms_inv[blockIdx.x] = scale;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out_row[i] = row[i] * scale * weight[i];
}

extern "C" mrl_status mrl_cuda_rmsnorm_forward(float *out, float *rms_inv, const float *x, const float *weight,
                                               int rows, int dim, float eps, void *stream) {
    if (rows <= 0 || dim <= 0) return mrl_set_error(MRL_ERR_INVALID, "rmsnorm: rows=%d dim=%d", rows, dim);
    int threads = dim >= 1024 ? 1024 : ((dim + 31) / 32) * 32;
    rmsnorm_forward_kernel<<<rows, threads, 0, (cudaStream_t)stream>>>(out, rms_inv, x, weight, dim, eps);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return mrl_set_error(MRL_ERR_DEVICE, "rmsnorm_forward launch failed: %s", cudaGetErrorString(err));
    return MRL_OK;
}
