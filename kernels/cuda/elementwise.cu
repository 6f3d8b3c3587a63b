// The element-wise and row ops of the CUDA table: RoPE, SwiGLU, the rows
// (embedding gather, its gradient's scatter-add), the bias and its
// gradient, and the dtype conversions. One thread per element in
// grid-stride loops. Where the reference does fp32 arithmetic (RoPE, the
// rows, the bias, the conversions) the same operations run in the same
// order with no fused multiply-add (__fmul_rn and friends), so they give
// its bits; SwiGLU computes in double as the reference does.
#include <cub/device/device_radix_sort.cuh>
#include "ops.cuh"

#define THREADS 256
#define GRID_STRIDE(i, n) \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

// ---- RoPE ----

// one thread per pair (t, h, i < hd/2)
__global__ static void rope_kernel(float *x, const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T,
                                   int H, int hd, int inverse) {
    int half = hd / 2;
    GRID_STRIDE(e, T * H * half) {
        int i = (int)(e % half);
        int64_t th = e / half, t = th / H;
        float *v = x + th * hd;
        int64_t at = (int64_t)pos[t] * half + i;
        float c = cos_t[at], s = inverse ? -sin_t[at] : sin_t[at];
        float a = v[i], b = v[i + half];
        v[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        v[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}

void cuda_rope(float *x, const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int hd,
               int inverse) {
    if (T <= 0 || H <= 0 || hd < 2) return;
    rope_kernel<<<grid_for(T * H * (hd / 2), THREADS), THREADS, 0, cuda_ops_stream()>>>(x, pos, cos_t, sin_t, T, H,
                                                                                         hd, inverse);
    cuda_ops_launched("rope");
}

// ---- SwiGLU ----

__global__ static void swiglu_fwd_kernel(float *out, const float *gate, const float *up, int64_t n) {
    GRID_STRIDE(i, n) {
        double g = gate[i];
        out[i] = (float)(g / (1 + exp(-g)) * up[i]);
    }
}

// silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)
__global__ static void swiglu_bwd_kernel(float *dgate, float *dup, const float *dout, const float *gate,
                                         const float *up, int64_t n) {
    GRID_STRIDE(i, n) {
        double g = gate[i], s = 1 / (1 + exp(-g)), d = dout[i];
        dgate[i] = (float)(d * up[i] * s * (1 + g * (1 - s)));
        dup[i] = (float)(d * g * s);
    }
}

void cuda_swiglu_fwd(float *out, const float *gate, const float *up, int64_t n) {
    if (n <= 0) return;
    swiglu_fwd_kernel<<<grid_for(n, THREADS), THREADS, 0, cuda_ops_stream()>>>(out, gate, up, n);
    cuda_ops_launched("swiglu_fwd");
}

void cuda_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int64_t n) {
    if (n <= 0) return;
    swiglu_bwd_kernel<<<grid_for(n, THREADS), THREADS, 0, cuda_ops_stream()>>>(dgate, dup, dout, gate, up, n);
    cuda_ops_launched("swiglu_bwd");
}

// ---- rows ----

__global__ static void gather_kernel(float *out, const float *src, const int32_t *idx, int64_t n, int64_t D) {
    GRID_STRIDE(e, n * D) {
        int64_t i = e / D, j = e % D;
        out[e] = idx[i] < 0 ? 0.0f : src[(int64_t)idx[i] * D + j];
    }
}

void cuda_gather_rows(float *out, const float *src, const int32_t *idx, int64_t n, int64_t D) {
    if (n <= 0 || D <= 0) return;
    gather_kernel<<<grid_for(n * D, THREADS), THREADS, 0, cuda_ops_stream()>>>(out, src, idx, n, D);
    cuda_ops_launched("gather_rows");
}

// After a stable sort of (idx[i], i) by idx: the thread of column j at the
// first position p of each run of one row adds that row's sources in their
// original order, into a register, and writes once. The same fp32 adds in
// the same order as the reference: its bits, and no atomics.
__global__ static void scatter_runs_kernel(float *dst, const float *src, const int32_t *keys, const int32_t *order,
                                           int64_t n, int64_t D) {
    GRID_STRIDE(e, n * D) {
        int64_t p = e / D, j = e % D;
        int32_t row = keys[p];
        if (row < 0 || (p > 0 && keys[p - 1] == row)) continue; // (a negative row: none)
        float *d = dst + (int64_t)row * D + j;
        float acc = *d;
        for (int64_t q = p; q < n && keys[q] == row; q++) acc = __fadd_rn(acc, src[(int64_t)order[q] * D + j]);
        *d = acc;
    }
}

__global__ static void iota_kernel(int32_t *x, int64_t n) {
    GRID_STRIDE(i, n) x[i] = (int32_t)i;
}

void cuda_scatter_add_rows(float *dst, const float *src, const int32_t *idx, int64_t n, int64_t D) {
    if (n <= 0 || D <= 0) return;
    if (n > INT32_MAX / 2) {
        cuda_ops_fail(MRL_ERR_UNSUPPORTED, "cuda scatter_add_rows: %lld rows", (long long)n);
        return;
    }
    cudaStream_t st = cuda_ops_stream();
    size_t temp = 0;
    if (cub::DeviceRadixSort::SortPairs(NULL, temp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL,
                                        (int32_t *)NULL, (int)n, 0, 32, st) != cudaSuccess) {
        cuda_ops_fail(MRL_ERR_DEVICE, "cuda scatter_add_rows: the sort's size query failed");
        return;
    }
    size_t ints = ((size_t)n + 63) / 64 * 64;  // keep each array 256-byte aligned
    char *s = (char *)cuda_ops_scratch(3 * ints * sizeof(int32_t) + temp);
    if (!s) return;
    int32_t *keys = (int32_t *)s, *order_in = keys + ints, *order = order_in + ints;
    void *temp_p = order + ints;
    iota_kernel<<<grid_for(n, THREADS), THREADS, 0, st>>>(order_in, n);
    // LSD radix sort: stable, so a row's sources keep their order
    if (cub::DeviceRadixSort::SortPairs(temp_p, temp, idx, keys, order_in, order, (int)n, 0, 32, st) !=
        cudaSuccess) {
        cuda_ops_fail(MRL_ERR_DEVICE, "cuda scatter_add_rows: the sort failed");
        return;
    }
    scatter_runs_kernel<<<grid_for(n * D, THREADS), THREADS, 0, st>>>(dst, src, keys, order, n, D);
    cuda_ops_launched("scatter_add_rows");
}

// ---- bias ----

__global__ static void bias_add_kernel(float *y, const float *b, int64_t T, int64_t N) {
    GRID_STRIDE(e, T * N) y[e] = __fadd_rn(y[e], b[e % N]);
}

// One thread per column, rows in order: the reference's fp32 adds, its bits.
__global__ static void bias_bwd_kernel(float *db, const float *dy, int64_t T, int64_t N) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= N) return;
    float acc = db[i];
    for (int64_t t = 0; t < T; t++) acc = __fadd_rn(acc, dy[t * N + i]);
    db[i] = acc;
}

void cuda_bias_add(float *y, const float *b, int64_t T, int64_t N) {
    if (T <= 0 || N <= 0) return;
    bias_add_kernel<<<grid_for(T * N, THREADS), THREADS, 0, cuda_ops_stream()>>>(y, b, T, N);
    cuda_ops_launched("bias_add");
}

void cuda_bias_bwd(float *db, const float *dy, int64_t T, int64_t N) {
    if (T <= 0 || N <= 0) return;
    bias_bwd_kernel<<<(unsigned)((N + 127) / 128), 128, 0, cuda_ops_stream()>>>(db, dy, T, N);
    cuda_ops_launched("bias_bwd");
}

// ---- conversions: the bits of kernels/cpu/convert.c's scalar loops ----

__global__ static void bf16_to_f32_kernel(const uint16_t *src, float *dst, int64_t n) {
    GRID_STRIDE(i, n) dst[i] = __uint_as_float((uint32_t)src[i] << 16);
}

__global__ static void f32_to_bf16_kernel(const float *src, uint16_t *dst, int64_t n) {
    GRID_STRIDE(i, n) dst[i] = f32_to_bf16_bits(src[i]);
}

__device__ static float f16_to_f32(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) bits = sign | __float_as_uint(__fmul_rn((float)mant, 0x1p-24f));  // zero, subnormal: exact
    else if (exp == 31) bits = sign | 0x7f800000u | ((mant ? mant | 0x200u : 0) << 13);  // inf, quiet NaN
    else bits = sign | ((exp + 112u) << 23) | (mant << 13);
    return __uint_as_float(bits);
}

__global__ static void f16_to_f32_kernel(const uint16_t *src, float *dst, int64_t n) {
    GRID_STRIDE(i, n) dst[i] = f16_to_f32(src[i]);
}

__global__ static void f32_to_f16_kernel(const float *src, uint16_t *dst, int64_t n) {
    GRID_STRIDE(i, n) {
        uint32_t u = __float_as_uint(src[i]);
        uint16_t sign = (uint16_t)((u >> 16) & 0x8000u), r;
        u &= 0x7fffffffu;
        if (u > 0x7f800000u) r = sign | 0x7e00u;       // NaN
        else if (u >= 0x477ff000u) r = sign | 0x7c00u;  // >= 65520: inf
        else if (u < 0x38800000u)                       // subnormal half: the FPU rounds the add
            r = sign | (uint16_t)(__float_as_uint(__fadd_rn(__uint_as_float(u), 0.5f)) - 0x3f000000u);
        else r = sign | (uint16_t)((u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13);
        dst[i] = r;
    }
}

#define CONVERT(name, S, D)                                                                      \
    void cuda_##name(const S *src, D *dst, int64_t n) {                                          \
        if (n <= 0) return;                                                                      \
        name##_kernel<<<grid_for(n, THREADS), THREADS, 0, cuda_ops_stream()>>>(src, dst, n);     \
        cuda_ops_launched(#name);                                                                \
    }
CONVERT(bf16_to_f32, uint16_t, float)
CONVERT(f32_to_bf16, float, uint16_t)
CONVERT(f16_to_f32, uint16_t, float)
CONVERT(f32_to_f16, float, uint16_t)

// ---- GGML blocks (kernels.h's dequant): kernels/cpu/convert.c's bits, d * q (+ m) rounded twice ----

__device__ static float block_f16(const uint8_t *p) { return f16_to_f32((uint32_t)p[0] | (uint32_t)p[1] << 8); }

// a block's bytes; weight j of the block at b
__device__ static int block_bytes(int type) { return type == MRL_QUANT_Q8_0 ? 34 : type == MRL_QUANT_Q4_1 ? 20 : 18; }
__device__ static float block_weight(int type, const uint8_t *b, int j) {
    if (type == MRL_QUANT_Q8_0) return __fmul_rn((float)(int8_t)b[2 + j], block_f16(b));
    const uint8_t *qs = b + (type == MRL_QUANT_Q4_1 ? 4 : 2);
    int q = j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
    if (type == MRL_QUANT_Q4_1) return __fadd_rn(__fmul_rn((float)q, block_f16(b)), block_f16(b + 2));
    return __fmul_rn((float)(q - 8), block_f16(b));
}

__global__ static void dequant_kernel(int type, const uint8_t *blocks, float *dst, int64_t n) {
    GRID_STRIDE(i, n) dst[i] = block_weight(type, blocks + i / 32 * block_bytes(type), (int)(i % 32));
}

// C[m, n] = alpha * A[m] . W[n] (+ beta C): a warp an output, its lanes the weights of a block
// (each lane one of the 32), the block's sum reduced over the warp; decode's few rows.
__global__ static void qgemm_kernel(int type, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                                    int64_t lda, const uint8_t *W, float beta, float *C, int64_t ldc) {
    int64_t out = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (out >= M * N) return;
    int64_t m = out % M, n = out / M;
    int bytes = block_bytes(type);
    const uint8_t *row = W + n * (K / 32) * bytes;
    float acc = 0.0f;
    for (int64_t kb = 0; kb < K / 32; kb++)
        acc += A[m * lda + kb * 32 + lane] * block_weight(type, row + kb * bytes, lane);
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) C[m * ldc + n] = alpha * acc + (beta == 0.0f ? 0.0f : beta * C[m * ldc + n]);
}

void cuda_qgemm(int type, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const void *W,
                float beta, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0 || !mrl_quant_block_bytes(type)) return;
    int64_t threads = 32 * M * N;
    qgemm_kernel<<<(unsigned)((threads + THREADS - 1) / THREADS), THREADS, 0, cuda_ops_stream()>>>(
        type, M, N, K, alpha, A, lda, (const uint8_t *)W, beta, C, ldc);
    cuda_ops_launched("qgemm");
}

void cuda_dequant(int type, const void *blocks, float *dst, int64_t n) {
    if (n <= 0 || !mrl_quant_block_bytes(type)) return;
    dequant_kernel<<<grid_for(n, THREADS), THREADS, 0, cuda_ops_stream()>>>(type, (const uint8_t *)blocks, dst, n);
    cuda_ops_launched("dequant");
}
