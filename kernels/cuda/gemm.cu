// The matrix products of the CUDA table through cuBLASLt: gemm (fp32 in,
// fp32 accumulation: CUBLAS_COMPUTE_32F, no TF32, so the results stay within
// fp32 rounding of the CPU reference), gemm_bf16 (bf16 in, fp32
// accumulation and output) and gemm_group (its products one after the
// other on the table's stream: each is large enough to fill the GPU).
//
// Row-major to cuBLAS's column-major: a row-major X [r, c] with leading
// dimension ld is the column-major X^T [c, r] with the same ld. So the
// table's C = op(A) op(B) is, column-major, C^T = op(B)^T op(A)^T: cuBLAS's
// "A" is our B and its "B" is our A, with m = N, n = M, k = K:
//   B stored [K,N] (trans_b 0) = col-major N x K   -> op N
//   B stored [N,K] (trans_b 1) = col-major K x N   -> op T
//   A stored [M,K] (trans_a 0) = col-major K x M   -> op N
//   A stored [K,M] (trans_a 1) = col-major M x K   -> op T
//   C [M,N] ld ldc             = col-major N x M.
// With beta = 0, cuBLASLt does not read C (a C full of NaN stays out).
//
// When cuBLASLt's heuristic offers no algorithm (an odd leading dimension
// of bf16 data, say), or its algorithm refuses the call, cublasGemmEx does
// the same product. (The descriptors are made per call: a few microseconds,
// small beside the products of a training step; a cache keyed by shape
// would take them off the decode path.)
#include <cublasLt.h>
#include <cublas_v2.h>
#include "ops.cuh"

#define LT_WORKSPACE ((size_t)32 << 20)

static cublasLtHandle_t g_lt;
static cublasHandle_t g_blas;
static void *g_ws;  // cuBLASLt's workspace (not the table's scratch: gemm_bf16 keeps its bf16 copies there)

void cuda_gemm_release(void) {
    if (g_lt) cublasLtDestroy(g_lt);
    if (g_blas) cublasDestroy(g_blas);
    if (g_ws) cudaFree(g_ws), cuda_ops_memory_changed();
    g_lt = NULL, g_blas = NULL, g_ws = NULL;
}

static int handles(void) {
    if (!g_lt && cublasLtCreate(&g_lt) != CUBLAS_STATUS_SUCCESS) {
        g_lt = NULL;
        cuda_ops_fail(MRL_ERR_DEVICE, "cuda gemm: cublasLtCreate failed");
        return 0;
    }
    if (!g_blas && cublasCreate(&g_blas) != CUBLAS_STATUS_SUCCESS) {
        g_blas = NULL;
        cuda_ops_fail(MRL_ERR_DEVICE, "cuda gemm: cublasCreate failed");
        return 0;
    }
    if (!g_ws && (cuda_ops_memory_changed(), cudaMalloc(&g_ws, LT_WORKSPACE)) != cudaSuccess) {
        g_ws = NULL;
        cuda_ops_fail(MRL_ERR_NOMEM, "cuda gemm: no device memory for cuBLASLt's workspace");
        return 0;
    }
    return 1;
}

// The largest power of two (<= 256) that divides the address: what the
// heuristic must assume of a matrix.
static uint32_t alignment_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1;
    return al;
}

// One column-major product D = alpha op_x(X) op_y(Y) + beta C (D = C),
// m x n, depth k; X is stored x_rows x x_cols with leading dimension ldx.
static mrl_status lt_matmul(cublasOperation_t opx, cublasOperation_t opy, int64_t m, int64_t n, int64_t k,
                            float alpha, const void *X, cudaDataType_t xt, int64_t ldx, const void *Y,
                            cudaDataType_t yt, int64_t ldy, float beta, float *C, int64_t ldc) {
    if (!handles()) return MRL_ERR_DEVICE;
    int64_t x_rows = opx == CUBLAS_OP_N ? m : k, x_cols = opx == CUBLAS_OP_N ? k : m;
    int64_t y_rows = opy == CUBLAS_OP_N ? k : n, y_cols = opy == CUBLAS_OP_N ? n : k;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t lx = NULL, ly = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    cublasStatus_t s = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    int32_t ox = opx, oy = opy;
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ox, sizeof ox);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &oy, sizeof oy);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&lx, xt, x_rows, x_cols, ldx);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&ly, yt, y_rows, y_cols, ldy);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, m, n, ldc);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceCreate(&pref);
    uint64_t ws = LT_WORKSPACE;
    uint32_t ax = alignment_of(X), ay = alignment_of(Y), ac = alignment_of(C);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ax, sizeof ax);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ay, sizeof ay);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac);
    if (s == CUBLAS_STATUS_SUCCESS) {
        cublasStatus_t h = cublasLtMatmulAlgoGetHeuristic(g_lt, desc, lx, ly, lc, lc, pref, 1, &heur, &found);
        if (h != CUBLAS_STATUS_SUCCESS) found = 0;  // none: cublasGemmEx below
    }
    if (s == CUBLAS_STATUS_SUCCESS && found &&
        cublasLtMatmul(g_lt, desc, &alpha, X, lx, Y, ly, &beta, C, lc, C, lc, &heur.algo, g_ws, LT_WORKSPACE,
                       cuda_ops_stream()) != CUBLAS_STATUS_SUCCESS)
        found = 0;  // the algorithm refused the call: cublasGemmEx below
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (ly) cublasLtMatrixLayoutDestroy(ly);
    if (lx) cublasLtMatrixLayoutDestroy(lx);
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (s == CUBLAS_STATUS_SUCCESS && !found) {
        if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || ldx > INT32_MAX || ldy > INT32_MAX || ldc > INT32_MAX)
            return cuda_ops_fail(MRL_ERR_UNSUPPORTED, "cuda gemm: %lldx%lldx%lld: no cuBLASLt algorithm, and too "
                                 "large for cublasGemmEx", (long long)m, (long long)n, (long long)k);
        s = cublasSetStream(g_blas, cuda_ops_stream());
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasGemmEx(g_blas, opx, opy, (int)m, (int)n, (int)k, &alpha, X, xt, (int)ldx, Y, yt, (int)ldy,
                             &beta, C, CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    if (s != CUBLAS_STATUS_SUCCESS)
        return cuda_ops_fail(MRL_ERR_DEVICE, "cuda gemm %lldx%lldx%lld: %s", (long long)m, (long long)n,
                             (long long)k, cublasGetStatusString(s));
    return MRL_OK;
}

// C[M,N] = beta C (0 when beta is 0, whatever C held): a product of depth 0,
// or alpha 0.
__global__ static void scale_c_kernel(float *C, int64_t M, int64_t N, int64_t ldc, float beta) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * N; i += (int64_t)gridDim.x * blockDim.x) {
        float *c = C + i / N * ldc + i % N;
        *c = beta == 0 ? 0.0f : beta * *c;
    }
}

static void scale_c(float *C, int64_t M, int64_t N, int64_t ldc, float beta) {
    scale_c_kernel<<<grid_for(M * N, 256), 256, 0, cuda_ops_stream()>>>(C, M, N, ldc, beta);
    cuda_ops_launched("gemm (depth 0)");
}

// The table's row-major product on cuBLASLt's column-major one (above).
static void rowmajor(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, cudaDataType_t at,
                     int64_t lda, const void *B, cudaDataType_t bt, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0 || alpha == 0) {
        scale_c(C, M, N, ldc, beta);
        return;
    }
    lt_matmul(tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, alpha, B, bt, ldb, A, at,
              lda, beta, C, ldc);
}

void cuda_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
               const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    rowmajor(ta, tb, M, N, K, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta, C, ldc);
}

// ---- weight panels (kernels.h): the CPU's layout for few-row products ----

// P[b][k][j] = W[b * 32 + j][k] (0 past N): one thread per element of P.
__global__ static void panels_pack_kernel(float *P, const float *W, int64_t N, int64_t K, int64_t total) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t b = i / (MRL_PANEL * K), r = i % (MRL_PANEL * K), k = r / MRL_PANEL, j = r % MRL_PANEL;
        int64_t n = b * MRL_PANEL + j;
        P[i] = n < N ? W[n * K + k] : 0.0f;
    }
}

// The inverse: W[n][k] = P[n / 32][k][n % 32].
__global__ static void panels_unpack_kernel(float *W, const float *P, int64_t N, int64_t K) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N * K; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t n = i / K, k = i % K;
        W[i] = P[n / MRL_PANEL * MRL_PANEL * K + k * MRL_PANEL + n % MRL_PANEL];
    }
}

void cuda_panels_pack(float *P, const float *W, int64_t N, int64_t K) {
    int64_t total = mrl_panels_floats(N, K);
    if (total <= 0) return;
    panels_pack_kernel<<<grid_for(total, 256), 256, 0, cuda_ops_stream()>>>(P, W, N, K, total);
    cuda_ops_launched("panels_pack");
}

// A product whose B is given as panels: the panels made a plain W [N,K]
// again in the scratch (on a GPU the panel layout buys nothing; the engine
// there keeps W as it is), then the usual product with trans_b = 1.
static void gemm_panels(const mrl_gemm_desc *g) {
    if (g->trans_b != 1)
        cuda_ops_fail(MRL_ERR_INVALID, "cuda gemm_group: panels need trans_b = 1 (got %d)", g->trans_b);
    if (g->trans_b != 1 || g->M <= 0 || g->N <= 0) return;
    float *W = (float *)cuda_ops_scratch((size_t)(g->N * g->K + 1) * sizeof(float));
    if (!W) return;
    if (g->K > 0) {
        panels_unpack_kernel<<<grid_for(g->N * g->K, 256), 256, 0, cuda_ops_stream()>>>(W, g->B, g->N, g->K);
        if (cuda_ops_launched("gemm_group (panels)")) return;
    }
    cuda_gemm(g->trans_a, 1, g->M, g->N, g->K, g->alpha, g->A, g->lda, W, g->K, g->beta, g->C, g->ldc);
}

void cuda_gemm_group(const mrl_gemm_desc *g, int n) {
    for (int i = 0; i < n; i++) {
        if (g[i].b_panels) gemm_panels(&g[i]);
        else
            cuda_gemm(g[i].trans_a, g[i].trans_b, g[i].M, g[i].N, g[i].K, g[i].alpha, g[i].A, g[i].lda, g[i].B,
                      g[i].ldb, g[i].beta, g[i].C, g[i].ldc);
    }
}

// ---- bf16 ----


// dst [rows, ld_dst] (bf16) = src [rows, cols] (fp32, ld_src) rounded.
__global__ static void to_bf16_2d(uint16_t *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows,
                                  int64_t cols) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * cols; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / cols, c = i % cols;
        dst[r * ld_dst + c] = f32_to_bf16_bits(src[r * ld_src + c]);
    }
}

// The leading dimension of an fp32 operand's bf16 copy in the scratch: its
// columns rounded up to 8, so that each row starts 16-byte aligned (what
// the tensor-core kernels want).
static int64_t round_ld(int64_t cols) { return (cols + 7) / 8 * 8; }

void cuda_gemm_bf16(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int a_bf16,
                    int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0 || alpha == 0) {  // the reference adds no products when alpha is 0
        scale_c(C, M, N, ldc, beta);
        return;
    }
    int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
    int64_t a_ld = a_bf16 ? lda : round_ld(a_cols), b_ld = b_bf16 ? ldb : round_ld(b_cols);
    size_t a_elems = a_bf16 ? 0 : (size_t)(a_rows * a_ld), b_elems = b_bf16 ? 0 : (size_t)(b_rows * b_ld);
    uint16_t *s = NULL;
    if (a_elems + b_elems) {
        s = (uint16_t *)cuda_ops_scratch((a_elems + b_elems) * 2 + 256);
        if (!s) return;
    }
    const void *a16 = A, *b16 = B;
    if (!a_bf16) {
        to_bf16_2d<<<grid_for(a_rows * a_cols, 256), 256, 0, cuda_ops_stream()>>>(s, a_ld, (const float *)A, lda,
                                                                                   a_rows, a_cols);
        a16 = s;
    }
    if (!b_bf16) {
        uint16_t *bs = s + (a_elems + 127) / 128 * 128;  // 256-byte aligned
        to_bf16_2d<<<grid_for(b_rows * b_cols, 256), 256, 0, cuda_ops_stream()>>>(bs, b_ld, (const float *)B, ldb,
                                                                                   b_rows, b_cols);
        b16 = bs;
    }
    if (cuda_ops_launched("gemm_bf16 (rounding)")) return;
    rowmajor(ta, tb, M, N, K, alpha, a16, CUDA_R_16BF, a_ld, b16, CUDA_R_16BF, b_ld, beta, C, ldc);
}

// ---- bf16 weight panels (kernels.h, MRL_PANEL16) ----

// One thread per dword of P: (kp, j) of panel b holds W[48b + j][2kp, 2kp + 1].
__global__ static void panels16_pack_kernel(uint32_t *P, const uint16_t *W, int64_t N, int64_t K, int64_t total) {
    int64_t Kp = (K + 1) / 2;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t b = i / (MRL_PANEL16 * Kp), r = i % (MRL_PANEL16 * Kp), kp = r / MRL_PANEL16, j = r % MRL_PANEL16;
        int64_t n = b * MRL_PANEL16 + j;
        uint32_t lo = n < N ? W[n * K + 2 * kp] : 0, hi = n < N && 2 * kp + 1 < K ? W[n * K + 2 * kp + 1] : 0;
        P[i] = lo | hi << 16;
    }
}

// The inverse, into W [N, ld].
__global__ static void panels16_unpack_kernel(uint16_t *W, int64_t ld, const uint32_t *P, int64_t N, int64_t K) {
    int64_t Kp = (K + 1) / 2;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N * K; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t n = i / K, k = i % K;
        uint32_t d = P[n / MRL_PANEL16 * MRL_PANEL16 * Kp + k / 2 * MRL_PANEL16 + n % MRL_PANEL16];
        W[n * ld + k] = (uint16_t)(k % 2 ? d >> 16 : d);
    }
}

void cuda_panels16_pack(uint32_t *P, const uint16_t *W, int64_t N, int64_t K) {
    int64_t total = mrl_panels16_dwords(N, K);
    if (total <= 0) return;
    panels16_pack_kernel<<<grid_for(total, 256), 256, 0, cuda_ops_stream()>>>(P, W, N, K, total);
    cuda_ops_launched("panels16_pack");
}

// The plain copy when given (the engine on a GPU keeps no panels: cuBLASLt
// reads W as it is); else the panels made a plain W again in the scratch,
// beside A's bf16 copy.
// The parts one after the other: cuBLASLt reads each W as it is.
void cuda_gemm_bf16_panels_group(int64_t M, int64_t K, const float *A, int64_t lda, const mrl_panels_part *w, int n) {
    for (int i = 0; i < n; i++)
        cuda_gemm_bf16_panels(M, w[i].N, K, w[i].alpha, A, lda, w[i].P, w[i].W16, w[i].ldw, w[i].beta, w[i].C, w[i].ldc);
}

void cuda_gemm_bf16_panels(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const uint32_t *P,
                           const uint16_t *W16, int64_t ldw, float beta, float *C, int64_t ldc) {
    if (W16 || M <= 0 || N <= 0 || K <= 0 || alpha == 0) {  // cuda_gemm_bf16 reads no B in the last three
        cuda_gemm_bf16(0, 1, M, N, K, alpha, A, 0, lda, W16, 1, ldw, beta, C, ldc);
        return;
    }
    int64_t ld = round_ld(K), a_elems = (M * ld + 127) / 128 * 128;
    uint16_t *s = (uint16_t *)cuda_ops_scratch((size_t)(a_elems + N * ld) * 2 + 256);
    if (!s) return;
    to_bf16_2d<<<grid_for(M * K, 256), 256, 0, cuda_ops_stream()>>>(s, ld, A, lda, M, K);
    panels16_unpack_kernel<<<grid_for(N * K, 256), 256, 0, cuda_ops_stream()>>>(s + a_elems, ld, P, N, K);
    if (cuda_ops_launched("gemm_bf16_panels (unpacking)")) return;
    rowmajor(0, 1, M, N, K, alpha, s, CUDA_R_16BF, ld, s + a_elems, CUDA_R_16BF, ld, beta, C, ldc);
}

/* LoRA's part of a product (kernels.h): two cuBLASLt products on the ops stream, u = x A^T then
 * y += s u B^T (the rank is small: each is a thin product the library tiles well enough). */
void cuda_lora_fwd(float *y, float *u, const float *x, const float *A, const float *B, int64_t T, int64_t N, int64_t K,
                   int64_t r, float s) {
    if (T <= 0) return;
    cuda_gemm(0, 1, T, r, K, 1.0f, x, K, A, K, 0.0f, u, r);
    cuda_gemm(0, 1, T, N, r, s, u, r, B, r, 1.0f, y, N);
}
