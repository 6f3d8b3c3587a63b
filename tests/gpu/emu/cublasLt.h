// A stand-in for the parts of cuBLASLt and cuBLAS that kernels/cuda/gemm.cu
// calls (tests/gpu/emu): the column-major product of their documentation
// in double, after checking each matrix layout against m, n, k and the
// transposes (a wrong mapping of the row-major table onto them fails here
// with the shapes printed). With beta = 0, C is not read. The heuristic
// finds no algorithm when the first operand's leading dimension is odd, so
// that gemm.cu's cublasGemmEx path runs too.
#pragma once
#include "cuda_runtime.h"
#include <cstdio>
typedef int cublasStatus_t;
enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType_t;
enum { CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB };
enum { CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES };
#define CUBLAS_GEMM_DEFAULT (-1)
struct emu_desc { int ta, tb; };
struct emu_layout { cudaDataType_t t; uint64_t rows, cols; int64_t ld; };
typedef struct emu_desc *cublasLtMatmulDesc_t;
typedef struct emu_layout *cublasLtMatrixLayout_t;
typedef void *cublasLtMatmulPreference_t;
typedef void *cublasLtHandle_t;
typedef void *cublasHandle_t;
struct cublasLtMatmulAlgo_t { int x; };
struct cublasLtMatmulHeuristicResult_t { cublasLtMatmulAlgo_t algo; };
inline cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) { *h = (void *)1; return 0; }
inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t) { return 0; }
inline cublasStatus_t cublasCreate(cublasHandle_t *h) { *h = (void *)1; return 0; }
inline cublasStatus_t cublasDestroy(cublasHandle_t) { return 0; }
inline cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t) { return 0; }
inline const char *cublasGetStatusString(cublasStatus_t) { return "emulated cublas error"; }
inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t, cudaDataType_t) { *d = new emu_desc{0, 0}; return 0; }
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, int a, const void *v, size_t) { (a ? d->tb : d->ta) = *(const int32_t *)v; return 0; }
inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { delete d; return 0; }
inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t t, uint64_t r, uint64_t c, int64_t ld) { *l = new emu_layout{t, r, c, ld}; return 0; }
inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { delete l; return 0; }
inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) { *p = (void *)1; return 0; }
inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t, int, const void *, size_t) { return 0; }
inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t) { return 0; }
extern int emu_gemm_calls[2];
// the heuristic finds nothing for an odd leading dimension of A: gemm.cu's cublasGemmEx path then runs
inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int, cublasLtMatmulHeuristicResult_t *, int *found) { *found = a->ld % 2 == 0; return *found ? 0 : CUBLAS_STATUS_NOT_SUPPORTED; }
// the product reads and writes device memory (every operand must be: checked first)
struct emu_device_guard {
  emu_device_guard() { emu_device_open(); }
  ~emu_device_guard() { emu_device_close(); }
};
inline float emu_at(const void *p, cudaDataType_t t, int64_t i) { if (t == CUDA_R_32F) return ((const float *)p)[i]; uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16; return __uint_as_float(u); }
inline cublasStatus_t emu_gemm(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const void *A, cudaDataType_t at, int64_t lda, int64_t ar, int64_t ac, const void *B, cudaDataType_t bt, int64_t ldb, int64_t br, int64_t bc, float beta, float *C, int64_t ldc, int64_t cr, int64_t cc) {
  emu_check_pointer("cublas matmul", 0, A), emu_check_pointer("cublas matmul", 1, B), emu_check_pointer("cublas matmul", 2, C);
  if (ar != (ta ? k : m) || ac != (ta ? m : k) || br != (tb ? n : k) || bc != (tb ? k : n) || cr != m || cc != n || lda < ar || ldb < br || ldc < cr || lda < 1 || ldb < 1) {
    fprintf(stderr, "EMU GEMM: bad layouts m=%lld n=%lld k=%lld ta=%d tb=%d A %lldx%lld ld %lld B %lldx%lld ld %lld C %lldx%lld ld %lld\n", (long long)m, (long long)n, (long long)k, ta, tb, (long long)ar, (long long)ac, (long long)lda, (long long)br, (long long)bc, (long long)ldb, (long long)cr, (long long)cc, (long long)ldc);
    return CUBLAS_STATUS_INVALID_VALUE; }
  emu_enqueue([=]() {  // checked now, computed now or when a captured graph runs
    emu_device_guard open_while_here;
    for (int64_t j = 0; j < n; j++) for (int64_t i = 0; i < m; i++) {
      double s = 0;
      for (int64_t p = 0; p < k; p++) s += (double)emu_at(A, at, ta ? p + i * lda : i + p * lda) * emu_at(B, bt, tb ? j + p * ldb : p + j * ldb);
      float *c = C + i + j * ldc; *c = (float)(alpha * s + (beta != 0 ? (double)beta * *c : 0.0)); }
  });
  return 0; }
inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void *alpha, const void *A, cublasLtMatrixLayout_t la, const void *B, cublasLtMatrixLayout_t lb, const void *beta, const void *C, cublasLtMatrixLayout_t lc, void *D, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t) {
  emu_gemm_calls[0]++;
  if (C != D) return CUBLAS_STATUS_INVALID_VALUE;
  int64_t m = lc->rows, n = lc->cols, k = d->ta ? la->rows : la->cols;
  return emu_gemm(d->ta, d->tb, m, n, k, *(const float *)alpha, A, la->t, la->ld, la->rows, la->cols, B, lb->t, lb->ld, lb->rows, lb->cols, *(const float *)beta, (float *)D, lc->ld, lc->rows, lc->cols); }
inline cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *alpha, const void *A, cudaDataType_t at, int lda, const void *B, cudaDataType_t bt, int ldb, const void *beta, void *C, cudaDataType_t, int ldc, cublasComputeType_t, int) {
  emu_gemm_calls[1]++;
  return emu_gemm(ta, tb, m, n, k, *(const float *)alpha, A, at, lda, ta ? k : m, ta ? m : k, B, bt, ldb, tb ? n : k, tb ? k : n, *(const float *)beta, (float *)C, ldc, m, n); }
