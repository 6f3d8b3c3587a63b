/* Inner loops of the fast CPU ops, one set per instruction set (AVX-512,
 * AVX2+FMA+F16C, baseline SSE), and THE run-time choice among them (isa.c),
 * the only CPU-feature dispatch of the kernels: every op of the fast table
 * (the paged attention, the sampler, AdamW and the dtype conversions
 * included) follows mrl_cpu_isa_get(), and mrl_kernel_isa() reports it. The
 * loops work on a range of rows or one (sequence, head); the fast table
 * spreads them over threads. */
#pragma once
#include <stdint.h>
#include "kernels.h"

typedef struct mrl_attn_args {
    float *out, *lse;              /* forward outputs */
    float *dq, *dk, *dv;           /* backward outputs */
    const float *dout;
    const float *q, *k, *v;        /* q [T,Hq,hd], k/v [T,Hk,hd] */
    const float *o, *lse_in;       /* forward results, for the backward */
    const int32_t *cu_seqlens;
    const int32_t *prefix;         /* [n_seqs] or NULL: see mrl_batch.prefix */
    int n_seqs, Hq, Hk, hd;
    int64_t max_keys;              /* the most keys a query meets: max over s of prefix + own rows */
    float scale;
} mrl_attn_args;

typedef struct mrl_cpu_isa {
    const char *name;  /* "avx512", "avx2", "sse" */
    int level;         /* 2, 1, 0 (the same order) */
    void (*rmsnorm_fwd_rows)(float *out, float *rstd, const float *x, const float *w, int64_t t0,
                             int64_t t1, int D, float eps);
    /* dx += ...; dw_part += ... over the rows [t0, t1) */
    void (*rmsnorm_bwd_rows)(float *dx, float *dw_part, const float *dout, const float *x,
                             const float *w, const float *rstd, int64_t t0, int64_t t1, int D);
    void (*swiglu_fwd)(float *out, const float *gate, const float *up, int64_t n);
    void (*swiglu_bwd)(float *dgate, float *dup, const float *dout, const float *gate,
                       const float *up, int64_t n);
    void (*head_fwd_row)(const float *z, int V, float inv_temp, int32_t target, float *lse,
                         float *entropy, float *logprob);
    void (*head_bwd_row)(float *z, int V, float inv_temp, int32_t target, float lse, float entropy,
                         float glp, float gh);
    /* scratch: mrl_attn_scratch_floats(a->max_keys, hd) floats */
    void (*attn_fwd_head)(const mrl_attn_args *a, int s, int h, float *scratch);
    void (*attn_bwd_group)(const mrl_attn_args *a, int s, int kh, float *scratch);
    /* C[m, n0..n1) = alpha * A[m] . B[n] (+ beta C) for m < M: few rows, B [N,K] streamed once */
    void (*gemm_nt_rows)(int64_t M, int64_t n0, int64_t n1, int64_t K, float alpha, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
    /* y[t, n] += s * u[t,:] . B[n,:] for t < T, n < N over r <= 64 terms (LoRA's second product:
     * its rank is the short side) */
    void (*lora_up)(int64_t T, int64_t N, int64_t r, float s, const float *u, const float *B, float *y);
    /* C[m, 32 p0 .. min(32 p1, N)) = alpha * A[m] W^T (+ beta C) for m < M, W [N,K] given as
     * panels P (kernels.h, panels_pack) */
    void (*gemm_panels)(int64_t M, int64_t p0, int64_t p1, int64_t N, int64_t K, float alpha, const float *A,
                        int64_t lda, const float *P, float beta, float *C, int64_t ldc);
    /* w[i] = exp(x[i] - m) for i < n (w may be x; x[i] <= m; below -87 gives 0),
     * and their sum in double */
    double (*exp_sum)(float *w, const float *x, float m, int64_t n);
    /* AdamW over n elements with one set of coefficients (adamw.c; the same
     * bits in every set: the same fp32 operations, no fused multiply-add) */
    void (*adamw)(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c);
    /* the dtype conversions of n elements (convert.c; the same bits in every set) */
    void (*bf16_to_f32)(const uint16_t *src, float *dst, int64_t n);
    void (*f32_to_bf16)(const float *src, uint16_t *dst, int64_t n);
    void (*f16_to_f32)(const uint16_t *src, float *dst, int64_t n);
    void (*f32_to_f16)(const float *src, uint16_t *dst, int64_t n);
    /* kernels.h's dequant of n / 32 GGML blocks (convert.c; the scalar loop's bits) */
    void (*dequant)(int type, const void *blocks, float *dst, int64_t n);
} mrl_cpu_isa;

#define ATT_QB 64 /* queries per attention block */

/* A score row's floats for up to max_keys keys (padded to 16). */
static inline int64_t mrl_attn_row_floats(int64_t max_keys) { return (max_keys + 15) / 16 * 16; }

/* Scratch of one attention worker: two [ATT_QB, row] score blocks, and
 * (sequences with a prefix) their keys, values and the two gradients gathered
 * into contiguous rows. */
static inline int64_t mrl_attn_scratch_floats(int64_t max_keys, int hd) {
    return 2 * ATT_QB * mrl_attn_row_floats(max_keys) + 4 * max_keys * (int64_t)hd + 64;
}

extern const mrl_cpu_isa mrl_cpu_isa_avx512;
extern const mrl_cpu_isa mrl_cpu_isa_avx2;
extern const mrl_cpu_isa mrl_cpu_isa_sse;

/* The set in use: the best this CPU has (AVX-512 F+DQ+VL with AVX2+FMA+F16C,
 * else AVX2+FMA+F16C, else SSE) unless changed by mrl_cpu_isa_set. */
const mrl_cpu_isa *mrl_cpu_isa_get(void);
/* Use the set named "avx512", "avx2" or "sse" (tests); 0 on success, -1
 * when this CPU lacks it or the name is unknown. Not thread-safe: call it
 * between kernels. */
int mrl_cpu_isa_set(const char *name);
/* The level in use (2, 1, 0). */
int mrl_cpu_isa_level(void);
const char *mrl_cpu_isa_name(void);
/* mrl_cpu_isa_get()->exp_sum: the one vector exp of the CPU kernels. */
double mrl_vexp_sum(float *w, const float *x, float m, int64_t n);

/* The scalar AdamW loop (adamw.c: the reference table's, and the vector
 * loops' tails). */
void mrl_cpu_adamw_scalar(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c);
/* The conversion loops the sets point at (convert.c): scalar for SSE (and
 * the reference table), intrinsics for AVX2 and AVX-512 (only called when
 * the CPU has the set). */
void mrl_cpu_bf16_to_f32_scalar(const uint16_t *src, float *dst, int64_t n);
void mrl_cpu_f32_to_bf16_scalar(const float *src, uint16_t *dst, int64_t n);
void mrl_cpu_f16_to_f32_scalar(const uint16_t *src, float *dst, int64_t n);
void mrl_cpu_f32_to_f16_scalar(const float *src, uint16_t *dst, int64_t n);
/* The GGML blocks' loop (convert.c: the reference table's dequant; the fast table runs it over
 * slices of the blocks on the cores). */
void mrl_cpu_dequant_scalar(int type, const void *blocks, float *dst, int64_t n);
void mrl_cpu_bf16_to_f32_avx2(const uint16_t *src, float *dst, int64_t n);
void mrl_cpu_f32_to_bf16_avx2(const float *src, uint16_t *dst, int64_t n);
void mrl_cpu_f16_to_f32_avx2(const uint16_t *src, float *dst, int64_t n);
void mrl_cpu_f32_to_f16_avx2(const float *src, uint16_t *dst, int64_t n);
void mrl_cpu_bf16_to_f32_avx512(const uint16_t *src, float *dst, int64_t n);
void mrl_cpu_f32_to_bf16_avx512(const float *src, uint16_t *dst, int64_t n);
void mrl_cpu_f16_to_f32_avx512(const uint16_t *src, float *dst, int64_t n);
void mrl_cpu_f32_to_f16_avx512(const float *src, uint16_t *dst, int64_t n);
void mrl_cpu_dequant_avx2(int type, const void *blocks, float *dst, int64_t n);
void mrl_cpu_dequant_avx512(int type, const void *blocks, float *dst, int64_t n);
