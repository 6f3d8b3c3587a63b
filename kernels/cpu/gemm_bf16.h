/* bf16 matrix products on the CPU (internal; the op table is to call them):
 * C = alpha * bf16(A) bf16(B) + beta * C with fp32 accumulation, the mixed
 * precision of docs/architecture.md ("Precision"): fp32 master weights, bf16 copies
 * for the products. Four paths behind one entry, chosen per shape
 * (bench/RESULTS.md, "bf16 products"):
 *   - a portable reference (scalar, exact bf16 products summed in double)
 *     that the tests trust;
 *   - our own AVX512-BF16 kernel (gemm_bf16_avx512.c, vdpbf16ps): packed
 *     panels, or W read in place for a few rows times W^T (decode);
 *   - oneDNN's matmul (gemm_bf16_onednn.c; AMX where the CPU has it),
 *     built in only where libdnnl is found;
 *   - our own AMX kernels (gemm_bf16_amx.c): the packed kernel's blocking
 *     with AMX tiles, and x W^T straight from the weight panels.
 * Layout as the op table's gemm (kernels.h): row-major, op(A) [M,K] is A
 * [M,K] or (trans_a) A stored [K,M]; op(B) [K,N] is B [K,N] or (trans_b) B
 * stored [N,K] (a linear layer's weight). Each operand is fp32 (x_bf16 = 0:
 * rounded to bf16, to nearest even, on the way in) or bf16 already (x_bf16 =
 * 1: uint16_t storage, leading dimension in elements). beta = 0 ignores
 * what C held (NaN included), as BLAS does.
 *
 * Thread counts: our kernels give the same bits at any thread count (each
 * element sums its k in fixed blocks and order); oneDNN is held to the
 * error bound only (tests/kernels/test_gemm_bf16.c; it gave the same bits
 * at 1 and 2 threads on the shapes tried there).
 *
 * Denormal bf16 inputs: the AVX512-BF16 and AMX instructions read them as
 * zero (and flush denormal partial sums), the reference does not; the
 * difference is below 2^-126 times the other factor, per product. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "kernels.h" /* mrl_panels_part */

void mrl_cpu_gemm_bf16(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                       int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                       int64_t ldc);

/* 1 when this CPU has fast bf16 products (AVX512-BF16, or AMX through
 * oneDNN); 0 when it has not: mrl_cpu_gemm_bf16 still computes (the
 * reference, far slower than the fp32 gemm), and callers should stay fp32. */
int mrl_cpu_bf16_available(void);
/* What the dispatch uses here, for reports: "onednn (avx512_core_bf16) +
 * avx512_bf16 (few rows, weight panels)", "onednn (avx512_core_amx) + amx
 * (weight panels, 5-255 rows) + avx512_bf16 (few rows)", "avx512_bf16",
 * "reference (no bf16 hardware)". */
const char *mrl_cpu_bf16_path(void);

/* fp32 -> bf16 (round to nearest, ties to even; NaN stays a quiet NaN, inf
 * stays inf, denormals are kept, not flushed) and back (exact); parallel
 * for large n. The same bits as mrl_f32_to_bf16 (moonrl/dtype.h). */
void mrl_cpu_bf16_from_f32(uint16_t *dst, const float *src, int64_t n);
void mrl_cpu_bf16_to_f32(float *dst, const uint16_t *src, int64_t n);

/* Our kernel takes x W^T (trans_a 0, trans_b 1) of at most this many rows
 * (a decode step's) by reading W in place, not packing it; the dispatcher
 * sends such products to it. */
#define MRL_BF16_FEW_ROWS 16

/* ---- the paths one by one (tests and bench/gemm/gemm_bf16.c) ---------------- */

typedef enum mrl_bf16_path {
    MRL_BF16_AUTO = 0,  /* the per-shape rule */
    MRL_BF16_REFERENCE, /* scalar, always there */
    MRL_BF16_OWN,       /* our AVX512-BF16 kernel */
    MRL_BF16_ONEDNN,    /* oneDNN's matmul */
    MRL_BF16_AMX,       /* our AMX kernels (tiles; over weight panels, the panels one) */
    MRL_BF16_PATHS
} mrl_bf16_path;

/* Whether `path` can run here (AUTO and REFERENCE always can). */
int mrl_cpu_bf16_has_path(mrl_bf16_path path);
/* Make mrl_cpu_gemm_bf16 always take `path`: 0, or -1 (nothing changed)
 * when it cannot run here. Not thread-safe: call it between products. */
int mrl_cpu_bf16_force_path(mrl_bf16_path path);
/* The path the rule picks for this product (never AUTO). */
mrl_bf16_path mrl_cpu_bf16_pick(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K);

/* Same arguments as mrl_cpu_gemm_bf16. The reference always computes; the
 * others return 0 when they computed C, and -1 when they could not (CPU
 * without the instructions, oneDNN not built in or failing, no memory for
 * their packed copies), C then untouched. */
void mrl_cpu_gemm_bf16_reference(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                                 const void *A, int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb,
                                 float beta, float *C, int64_t ldc);
int mrl_cpu_gemm_bf16_own(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                          int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                          int64_t ldc);
int mrl_cpu_gemm_bf16_onednn(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                             const void *A, int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb,
                             float beta, float *C, int64_t ldc);
/* oneDNN's fp32 matmul (the fp32 gemm where OpenBLAS's kernels are below the CPU: cpu/blas.h). */
int mrl_cpu_gemm_f32_onednn(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                            int64_t ldc);

/* The op table's gemm_bf16_panels and panels16_pack (kernels.h): C = alpha
 * bf16(A) W^T + beta C for A fp32 [M,K] (lda), W [N,K] given as bf16
 * weight panels P and, optionally, as its plain bf16 copy W16 (ldw): the
 * faster for the shape is read (mrl_cpu_bf16_panels_pick: 1 panels, 0 the
 * plain copy through mrl_cpu_gemm_bf16). */
void mrl_cpu_gemm_bf16_panels(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                              const uint32_t *P, const uint16_t *W16, int64_t ldw, float beta, float *C, int64_t ldc);
void mrl_cpu_panels16_pack(uint32_t *P, const uint16_t *W, int64_t N, int64_t K);
int mrl_cpu_bf16_panels_pick(int64_t M, int64_t N);
/* The op table's gemm_bf16_panels_group: with the panels picked for the
 * group's M and total N, ours over every part at once (A packed once, one
 * parallel region, each C the same bits as alone); else each part through
 * mrl_cpu_gemm_bf16_panels. */
void mrl_cpu_gemm_bf16_panels_group(int64_t M, int64_t K, const float *A, int64_t lda, const mrl_panels_part *w,
                                    int n);
/* The paths: our kernel over the panels (0, or -1: no AVX512-BF16, no
 * memory) and its packer; the reference (reads P) always computes. */
int mrl_cpu_gemm_bf16_panels_own(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                                 const uint32_t *P, float beta, float *C, int64_t ldc);
int mrl_cpu_gemm_bf16_panels_group_own(int64_t M, int64_t K, const float *A, int64_t lda, int n,
                                       const mrl_panels_part *w);
int mrl_cpu_panels16_pack_own(uint32_t *P, const uint16_t *W, int64_t N, int64_t K);
/* Our AMX kernels: any product (mrl_cpu_gemm_bf16_amx, the AVX512-BF16
 * kernel's packing and blocking with AMX tiles for its micro-tile) and x
 * W^T over the panels (gemm_bf16_amx.c); 0, or -1 (no AMX, no memory), C
 * then untouched. */
int mrl_cpu_gemm_bf16_amx(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                          int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                          int64_t ldc);
/* Between the two files: the calling thread's tile configuration (begin)
 * and its release (end) around calls of mrl_cpu_amx_panel_block, which
 * adds to C (rows x cols, at most 16 x 48) the product of A as packed rows
 * (kc / 16 tiles of 16 x 16 dwords, one after the other) and a panel's
 * block (kc rows of 48 dwords; kc a multiple of 16): first, C = alpha
 * acc + beta C (beta 0: C unread); else C += alpha acc. */
void mrl_cpu_amx_begin(void);
void mrl_cpu_amx_end(void);
void mrl_cpu_amx_panel_block(const uint32_t *a, const uint32_t *b, int64_t kc, float *C, int64_t ldc, int64_t rows,
                             int64_t cols, float alpha, float beta, int first);
int mrl_cpu_gemm_bf16_panels_group_amx(int64_t M, int64_t K, const float *A, int64_t lda, int n,
                                       const mrl_panels_part *w);
void mrl_cpu_gemm_bf16_panels_reference(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                                        const uint32_t *P, float beta, float *C, int64_t ldc);

/* oneDNN as built in: NULL when absent, else its ISA on this CPU
 * ("avx512_core_amx", "avx512_core_bf16", ...). */
const char *mrl_cpu_onednn_isa(void);
/* 1 when this CPU has AVX512-BF16 (our kernel can run); read from the CPU
 * probe, core/base/cpu.h, as the one below. */
int mrl_cpu_has_avx512_bf16(void);
/* 1 when it has AMX-BF16 too and Linux granted this process the tile
 * state (our AMX kernel can run; 0 with MOONRL_AMX=0). */
int mrl_cpu_has_amx_bf16(void);

/* Between the paths: the calling thread's scratch buffer of at least `bytes`
 * (64-byte aligned, contents undefined), NULL when out of memory; give it
 * back after the product (a large one is freed then). */
void *mrl_cpu_bf16_scratch_take(size_t bytes);
void mrl_cpu_bf16_scratch_give(void *p);
