// Internal to kernels/cuda: what the op files share. The table's state
// (its stream, its scratch, its pending error) lives in table.cu; each op
// family is one .cu file that defines the slots in the cuda_ops_* functions
// declared here, and table.cu gathers them into the mrl_kernels struct.
//
// Memory: every array an op reads or writes is device memory, except what
// the host must read to decide the launch or what it returns to the host
// (kernels/cuda/cuda_backend.h lists them per slot).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include "kernels.h"
#include "cuda_backend.h"

// ---- table state (table.cu) ----

// The stream every op launches on (mrl_cuda_ops_set_stream).
cudaStream_t cuda_ops_stream(void);
// Record an error of a void op (the first one wins; mrl_cuda_ops_check
// returns it). Also sets the thread's last error. Returns the status.
mrl_status cuda_ops_fail(mrl_status st, const char *fmt, ...);
// After a launch: a launch error becomes the pending error. 0 when fine.
mrl_status cuda_ops_launched(const char *what);
// The table's scratch: at least `bytes` of device memory, 256-byte aligned,
// valid until the next call of cuda_ops_scratch (ops on one stream run in
// order, so one op's kernels are done with it before the next op's start).
// NULL (and a pending error) when it cannot be had.
void *cuda_ops_scratch(size_t bytes);
// A device int the kernels set on bad input found on the device (paged
// attention's per-sequence lengths); mrl_cuda_ops_check reads and clears it.
int *cuda_ops_device_flag(void);
// The table's own device memory was allocated or freed (mrl_cuda_ops_epoch).
void cuda_ops_memory_changed(void);
// The number of multiprocessors of the current device.
int cuda_ops_sm_count(void);

// ---- the slots, per file ----

// gemm.cu
void cuda_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
               const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
void cuda_gemm_group(const mrl_gemm_desc *g, int n);
void cuda_gemm_bf16(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int a_bf16,
                    int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C, int64_t ldc);
void cuda_panels_pack(float *P, const float *W, int64_t N, int64_t K);
void cuda_paged_kv_write_bf16(uint16_t *k_cache, uint16_t *v_cache, const float *k, const float *v,
                              const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size);
void cuda_panels16_pack(uint32_t *P, const uint16_t *W, int64_t N, int64_t K);
void cuda_gemm_bf16_panels(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const uint32_t *P,
                           const uint16_t *W16, int64_t ldw, float beta, float *C, int64_t ldc);
void cuda_gemm_bf16_panels_group(int64_t M, int64_t K, const float *A, int64_t lda, const mrl_panels_part *w, int n);
void cuda_gemm_release(void);
// rmsnorm.cu
void cuda_rmsnorm_fwd(float *out, float *rstd, const float *x, const float *w, int64_t T, int D, float eps);
void cuda_rmsnorm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w, const float *rstd,
                      int64_t T, int D);
// mla.cu
void cuda_copy_rows(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols);
void cuda_mla_qkv(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr, const int32_t *pos,
                  const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr, int dv, int hd,
                  int interleave);
void cuda_mla_qkv_bwd(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                      const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                      int dvd, int hd, int interleave);
mrl_status cuda_mla_paged_attn(const mrl_paged_attn *a);
void cuda_latent_kv_write(void *cache, const float *rows, const int32_t *slot_mapping, int64_t T, int W, int bf16);
// elementwise.cu
void cuda_rope(float *x, const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int hd,
               int inverse);
void cuda_swiglu_fwd(float *out, const float *gate, const float *up, int64_t n);
void cuda_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n);
void cuda_gather_rows(float *out, const float *src, const int32_t *idx, int64_t n, int64_t D);
void cuda_scatter_add_rows(float *dst, const float *src, const int32_t *idx, int64_t n, int64_t D);
void cuda_bias_add(float *y, const float *b, int64_t T, int64_t N);
void cuda_bias_bwd(float *db, const float *dy, int64_t T, int64_t N);
void cuda_lora_fwd(float *y, float *u, const float *x, const float *A, const float *B, int64_t T, int64_t N, int64_t K,
                   int64_t r, float s);
void cuda_bf16_to_f32(const uint16_t *src, float *dst, int64_t n);
void cuda_f32_to_bf16(const float *src, uint16_t *dst, int64_t n);
void cuda_f16_to_f32(const uint16_t *src, float *dst, int64_t n);
void cuda_f32_to_f16(const float *src, uint16_t *dst, int64_t n);
void cuda_dequant(int type, const void *blocks, float *dst, int64_t n);
void cuda_qgemm(int type, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const void *W,
                float beta, float *C, int64_t ldc);
// optim.cu
void cuda_adamw(const mrl_adamw_args *a);
mrl_status cuda_sum(const float *x, int64_t n, int squares, double *out);
void cuda_scale(float *x, int64_t n, float s);
void cuda_add(float *y, const float *x, int64_t n);
// attention.cu
void cuda_attn_fwd(float *out, float *lse, const float *q, const float *k, const float *v, const int32_t *cu,
                   const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd, float scale);
void cuda_attn_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                   const float *q, const float *k, const float *v, const int32_t *cu, const int32_t *prefix,
                   int n_seqs, int Hq, int Hk, int hd, float scale);
// head.cu
void cuda_head_fwd(const float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets, float *lse,
                   float *entropy, float *logprob);
void cuda_head_bwd(float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets, const float *lse,
                   const float *entropy, const float *dlogprob, const float *dentropy);
// paged.cu
void cuda_paged_kv_write(float *k_cache, float *v_cache, const float *k, const float *v, const int32_t *slot_mapping,
                         int64_t T, int Hk, int hd, int block_size);
int64_t cuda_paged_attn_workspace(const mrl_paged_attn *a);
mrl_status cuda_paged_attn(const mrl_paged_attn *a);
// sample.cu
mrl_status cuda_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                       const double *u, int32_t *tokens, float *logprobs, float *lp_processed);
mrl_status cuda_top_logprobs(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params, int k,
                             int32_t *ids, float *lps);
// moe.cu
void cuda_moe_route(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits, const int16_t *replay,
                    int64_t replay_stride, int64_t T, int E, int k, int norm);
void cuda_moe_route_grouped(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits, const float *bias,
                            const int16_t *replay, int64_t replay_stride, int64_t T, int E, int k, int groups,
                            int topk_group, int norm, float scale);
void cuda_moe_group(int32_t *eoff, int32_t *row, int32_t *tok, const int32_t *sel, int64_t A, int E, int k);

// ---- device helpers ----

#define FULL_MASK 0xffffffffu

// The rounding of moonrl/dtype.h: to nearest, ties to even; NaN stays NaN.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
// A value of a cache or copy, fp32 or bf16 (exact).
__device__ __forceinline__ float load_f32(const float *p) { return *p; }
__device__ __forceinline__ float load_f32(const uint16_t *p) { return __uint_as_float((uint32_t)*p << 16); }
__device__ __forceinline__ void store_f32(float *p, float v) { *p = v; }
__device__ __forceinline__ void store_f32(uint16_t *p, float v) { *p = f32_to_bf16_bits(v); }

__device__ __forceinline__ float warp_sum_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide sum of v (blockDim.x a multiple of 32, <= 1024); every thread
// gets the result. `sh` holds 33 values; the block must reach this call
// together. The order of the adds is fixed by the block's shape, so a
// result does not change from run to run.
template <typename Tv>
__device__ __forceinline__ Tv block_sum(Tv v, Tv *sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();  // sh may still be read by a previous call
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        Tv w = lane < warps ? sh[lane] : (Tv)0;
        for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(FULL_MASK, w, o);
        if (lane == 0) sh[32] = w;
    }
    __syncthreads();
    return sh[32];
}

__device__ __forceinline__ float block_max(float v, float *sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max_f(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < warps ? sh[lane] : -INFINITY;
        w = warp_max_f(w);
        if (lane == 0) sh[32] = w;
    }
    __syncthreads();
    return sh[32];
}

// Exclusive prefix sum over the block of one value per thread (thread
// order); *total gets the block's sum. `sh` holds 33 values.
template <typename Tv>
__device__ __forceinline__ Tv block_exclusive_scan(Tv v, Tv *sh, Tv *total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Tv inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        Tv y = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads();  // sh may still be read by a previous call
    if (lane == 31) sh[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        Tv wv = lane < (int)(blockDim.x >> 5) ? sh[lane] : (Tv)0, winc = wv;
        for (int o = 1; o < 32; o <<= 1) {
            Tv y = __shfl_up_sync(FULL_MASK, winc, o);
            if (lane >= o) winc += y;
        }
        sh[lane] = winc - wv;  // exclusive over the warps
        if (lane == 31) sh[32] = winc;
    }
    __syncthreads();
    *total = sh[32];
    return sh[warp] + inc - v;
}

// Blocks for n elements at `threads` a block, capped for grid-stride loops.
static inline unsigned grid_for(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > 65535LL * 16) b = 65535LL * 16;
    return (unsigned)b;
}
