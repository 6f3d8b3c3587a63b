/* Inner loops of the fast CPU ops, one set per instruction set (AVX-512,
 * AVX2+FMA, baseline SSE), chosen at run time by fast.c. They work on a
 * range of rows or one (sequence, head); fast.c spreads them over threads. */
#pragma once
#include <stdint.h>

typedef struct mrl_attn_args {
    float *out, *lse;              /* forward outputs */
    float *dq, *dk, *dv;           /* backward outputs */
    const float *dout;
    const float *q, *k, *v;        /* q [T,Hq,hd], k/v [T,Hk,hd] */
    const float *o, *lse_in;       /* forward results, for the backward */
    const int32_t *cu_seqlens;
    int n_seqs, Hq, Hk, hd;
    float scale;
} mrl_attn_args;

typedef struct mrl_cpu_isa {
    const char *name;
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
    /* scratch: mrl_attn_scratch_floats(max_len, hd) floats */
    void (*attn_fwd_head)(const mrl_attn_args *a, int s, int h, float *scratch);
    void (*attn_bwd_group)(const mrl_attn_args *a, int s, int kh, float *scratch);
} mrl_cpu_isa;

#define ATT_QB 64 /* queries per attention block */

static inline int64_t mrl_attn_scratch_floats(int64_t max_len, int hd) {
    (void)hd;
    return 2 * ATT_QB * ((max_len + 15) / 16 * 16) + 64;
}

extern const mrl_cpu_isa mrl_cpu_isa_avx512;
extern const mrl_cpu_isa mrl_cpu_isa_avx2;
extern const mrl_cpu_isa mrl_cpu_isa_sse;
