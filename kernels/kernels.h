/* The op table: one struct of function pointers per backend. The model
 * calls ops only through it, so a backend is a new table. CPU reference
 * (plain loops, trusted by tests), CPU fast (OpenBLAS + AVX2/AVX-512 chosen
 * at run time); CUDA later. Internal to the core (not part of the FFI).
 *
 * Row-major everywhere. T = tokens, D = row width. Functions whose name
 * ends in _bwd ACCUMULATE (+=) into parameter gradients; what they do to
 * input gradients is said per op. */
#pragma once
#include <stdint.h>

/* Weight panels: W [N,K] (row-major, a linear layer's weight) laid out again
 * as ceil(N/32) panels of [K][32], columns past N zero. A product of few rows
 * with W then streams each panel once, contiguously, with nothing to pack per
 * call (OpenBLAS packs all of W on every call, which costs as much as the
 * arithmetic at decode batch sizes). The engine keeps its weights so. */
#define MRL_PANEL 32
static inline int64_t mrl_panels_floats(int64_t N, int64_t K) {
    return (N + MRL_PANEL - 1) / MRL_PANEL * MRL_PANEL * K;
}
/* P[mrl_panels_floats(N, K)] from W [N,K]. */
void mrl_panels_pack(float *P, const float *W, int64_t N, int64_t K);

/* One matrix product C = alpha op(A) op(B) + beta C (see gemm below).
 * b_panels: B is W [N,K] packed by mrl_panels_pack (op(B) = W^T; trans_a
 * must be 0 and trans_b 1; ldb is ignored). */
typedef struct mrl_gemm_desc {
    int trans_a, trans_b;
    int64_t M, N, K;
    float alpha;
    const float *A;
    int64_t lda;
    const float *B;
    int64_t ldb;
    float beta;
    float *C;
    int64_t ldc;
    int b_panels;
} mrl_gemm_desc;

typedef struct mrl_kernels {
    const char *name;

    /* C[M,N] = alpha * op(A) op(B) + beta * C, op(X) = X or X^T
     * (trans_a: A is stored [K,M]; trans_b: B is stored [N,K]). */
    void (*gemm)(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                 int64_t ldc);

    /* n independent products at once (one parallel region); no output may
     * overlap another product's output or inputs. */
    void (*gemm_group)(const mrl_gemm_desc *g, int n);

    /* out[t] = x[t] * rstd[t] * w, rstd[t] = 1/sqrt(mean(x[t]^2) + eps); x [T,D]. */
    void (*rmsnorm_fwd)(float *out, float *rstd, const float *x, const float *w, int64_t T, int D,
                        float eps);
    /* dx[T,D] += d/dx; dw[D] += d/dw. */
    void (*rmsnorm_bwd)(float *dx, float *dw, const float *dout, const float *x, const float *w,
                        const float *rstd, int64_t T, int D);

    /* In place on x [T, H, hd]: rotate pairs (i, i + hd/2) by pos[t] * inv_freq[i]
     * using cos/sin tables [max_pos, hd/2]; inverse = 1 rotates back (the backward). */
    void (*rope)(float *x, const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T,
                 int H, int hd, int inverse);

    /* out = silu(gate) * up, n elements. */
    void (*swiglu_fwd)(float *out, const float *gate, const float *up, int64_t n);
    /* dgate = dout * up * silu'(gate), dup = dout * silu(gate) (overwritten). */
    void (*swiglu_bwd)(float *dgate, float *dup, const float *dout, const float *gate,
                       const float *up, int64_t n);

    /* Causal attention per sequence and head; q [T,Hq,hd], k/v [T,Hk,hd],
     * out [T,Hq,hd], lse [T,Hq] (log-sum-exp of the scaled scores).
     * prefix (NULL: none): [n_seqs], sequence s first attends to all rows of
     * sequence prefix[s] (an earlier one without prefix; -1: none), then
     * causally to its own: the layout of mrl_batch.prefix. */
    void (*attn_fwd)(float *out, float *lse, const float *q, const float *k, const float *v,
                     const int32_t *cu_seqlens, const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd,
                     float scale);
    /* dq, dk, dv (overwritten) from dout; a prefix's dk / dv sum over every
     * sequence that attends to it. */
    void (*attn_bwd)(float *dq, float *dk, float *dv, const float *dout, const float *out,
                     const float *lse, const float *q, const float *k, const float *v,
                     const int32_t *cu_seqlens, const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd,
                     float scale);

    /* Head statistics of logits rows [rows, V] scaled by inv_temp: per row
     * lse, entropy, and logprob of target (0 if target < 0). */
    void (*head_fwd)(const float *logits, int64_t rows, int V, float inv_temp,
                     const int32_t *targets, float *lse, float *entropy, float *logprob);
    /* In place: logits row -> d loss / d raw logits, given the row's lse and
     * entropy and the upstream dlogprob / dentropy (NULL = 0). */
    void (*head_bwd)(float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets,
                     const float *lse, const float *entropy, const float *dlogprob,
                     const float *dentropy);
} mrl_kernels;

const mrl_kernels *mrl_kernels_cpu_reference(void);
const mrl_kernels *mrl_kernels_cpu_fast(void);
/* Which vector path the fast table uses here: "avx512", "avx2" or "sse" (kernels/cpu/isa.h). */
const char *mrl_kernels_cpu_fast_isa(void);
/* Make the fast table use "avx512", "avx2" or "sse" (tests); 0 on success,
 * -1 when this CPU lacks it or the name is unknown. */
int mrl_kernels_cpu_fast_set_isa(const char *name);
