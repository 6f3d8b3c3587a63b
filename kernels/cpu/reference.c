/* The CPU reference ops: plain loops, one thread, sums in double. Tests
 * trust these; every other table is compared against them
 * (tests/kernels/test_ops.c). The ops of the engine, the optimizer and the
 * conversions live beside their fast versions (paged_attention.c,
 * sample.c, moe.c, adamw.c, reduce.c, convert.c) and are gathered here. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "cpu/memory.h"
#include "cpu/adamw.h"
#include "cpu/gemm_bf16.h"
#include "cpu/isa.h"
#include "cpu/mla.h"
#include "cpu/moe.h"
#include "cpu/paged_attention.h"
#include "cpu/reduce.h"
#include "cpu/sample.h"

static void ref_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                     int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = 0;
            for (int64_t p = 0; p < K; p++) {
                float a = ta ? A[p * lda + i] : A[i * lda + p];
                float b = tb ? B[j * ldb + p] : B[p * ldb + j];
                acc += (double)a * b;
            }
            float c = beta == 0 ? 0.0f : beta * C[i * ldc + j];
            C[i * ldc + j] = (float)(alpha * acc) + c;
        }
}

/* C = alpha A W^T + beta C with W given as GGML blocks: each row of W dequantized (the
 * reference's dequant), then the reference's product of it */
static void ref_qgemm(int type, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                      const void *W, float beta, float *C, int64_t ldc) {
    float *w = malloc(sizeof(float) * (size_t)K);
    if (!w) return;
    int64_t row_bytes = K / 32 * mrl_quant_block_bytes(type);
    for (int64_t j = 0; j < N; j++) {
        mrl_cpu_dequant_scalar(type, (const char *)W + j * row_bytes, w, K);
        ref_gemm(0, 1, M, 1, K, alpha, A, lda, w, K, beta, C + j, ldc);
    }
    free(w);
}

/* C = alpha op(A) W^T + beta C with W given as panels (kernels.h) */
static void ref_gemm_panels(const mrl_gemm_desc *g) {
    for (int64_t i = 0; i < g->M; i++)
        for (int64_t j = 0; j < g->N; j++) {
            const float *w = g->B + j / MRL_PANEL * MRL_PANEL * g->K + j % MRL_PANEL; /* W[j, p] = w[p * 32] */
            double acc = 0;
            for (int64_t p = 0; p < g->K; p++) {
                float a = g->trans_a ? g->A[p * g->lda + i] : g->A[i * g->lda + p];
                acc += (double)a * w[p * MRL_PANEL];
            }
            float c = g->beta == 0 ? 0.0f : g->beta * g->C[i * g->ldc + j];
            g->C[i * g->ldc + j] = (float)(g->alpha * acc) + c;
        }
}

static void ref_gemm_group(const mrl_gemm_desc *g, int n) {
    for (int i = 0; i < n; i++) {
        if (g[i].b_panels) {
            ref_gemm_panels(&g[i]);
            continue;
        }
        ref_gemm(g[i].trans_a, g[i].trans_b, g[i].M, g[i].N, g[i].K, g[i].alpha, g[i].A, g[i].lda, g[i].B, g[i].ldb,
                 g[i].beta, g[i].C, g[i].ldc);
    }
}

static void ref_panels_pack(float *P, const float *W, int64_t N, int64_t K) {
    for (int64_t b = 0; b < (N + MRL_PANEL - 1) / MRL_PANEL; b++) mrl_panel_pack(P, W, N, K, b);
}

static void ref_panels16_pack(uint32_t *P, const uint16_t *W, int64_t N, int64_t K) {
    for (int64_t b = 0; b < (N + MRL_PANEL16 - 1) / MRL_PANEL16; b++) mrl_panel16_pack(P, W, N, K, b);
}

/* Reads the panels, never W16: what the tables' panels are held to. */
static void ref_gemm_bf16_panels(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                                 const uint32_t *P, const uint16_t *W16, int64_t ldw, float beta, float *C,
                                 int64_t ldc) {
    (void)W16, (void)ldw;
    mrl_cpu_gemm_bf16_panels_reference(M, N, K, alpha, A, lda, P, beta, C, ldc);
}

static void ref_gemm_bf16_panels_group(int64_t M, int64_t K, const float *A, int64_t lda, const mrl_panels_part *w,
                                       int n) {
    for (int i = 0; i < n; i++)
        mrl_cpu_gemm_bf16_panels_reference(M, w[i].N, K, w[i].alpha, A, lda, w[i].P, w[i].beta, w[i].C, w[i].ldc);
}

static void ref_gather_rows(float *out, const float *src, const int32_t *idx, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0) memset(out + i * D, 0, sizeof(float) * D);
        else memcpy(out + i * D, src + (int64_t)idx[i] * D, sizeof(float) * D);
}

static void ref_scatter_add_rows(float *dst, const float *src, const int32_t *idx, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++) {
        if (idx[i] < 0) continue;
        float *d = dst + (int64_t)idx[i] * D;
        for (int64_t j = 0; j < D; j++) d[j] += src[i * D + j];
    }
}

static void ref_bias_add(float *y, const float *b, int64_t T, int64_t N) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < N; i++) y[t * N + i] += b[i];
}

/* fp32 adds in t order, as the fast version's (the same bits) */
static void ref_bias_bwd(float *db, const float *dy, int64_t T, int64_t N) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < N; i++) db[i] += dy[t * N + i];
}

static void ref_lora_fwd(float *y, float *u, const float *x, const float *A, const float *B, int64_t T, int64_t N,
                         int64_t K, int64_t r, float s) {
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < r; j++) {
            double acc = 0;
            for (int64_t k = 0; k < K; k++) acc += (double)x[t * K + k] * A[j * K + k];
            u[t * r + j] = (float)acc;
        }
        for (int64_t n = 0; n < N; n++) {
            double acc = 0;
            for (int64_t j = 0; j < r; j++) acc += (double)u[t * r + j] * B[n * r + j];
            y[t * N + n] = (float)(y[t * N + n] + s * acc);
        }
    }
}

static void ref_rmsnorm_fwd(float *out, float *rstd, const float *x, const float *w, int64_t T, int D,
                            float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D;
        double ss = 0;
        for (int i = 0; i < D; i++) ss += (double)xr[i] * xr[i];
        float r = (float)(1.0 / sqrt(ss / D + eps));
        rstd[t] = r;
        for (int i = 0; i < D; i++) out[t * D + i] = xr[i] * r * w[i];
    }
}

/* y = x r w, r = (mean x^2 + eps)^-1/2:
 * dx = r (w dy) - x r^3 / D * sum(w dy x);  dw = sum_t dy x r */
static void ref_rmsnorm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w,
                            const float *rstd, int64_t T, int D) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D, *dy = dout + t * D;
        double r = rstd[t], dot = 0;
        for (int i = 0; i < D; i++) dot += (double)dy[i] * w[i] * xr[i];
        double c = dot * r * r * r / D;
        for (int i = 0; i < D; i++) dx[t * D + i] += (float)(r * w[i] * dy[i] - c * xr[i]);
        if (dw)
            for (int i = 0; i < D; i++) dw[i] += (float)(dy[i] * xr[i] * r);
    }
}

static void ref_rope(float *x, const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T,
                     int H, int hd, int inverse) {
    int half = hd / 2;
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            float *v = x + (t * H + h) * hd;
            const float *c = cos_t + (int64_t)pos[t] * half, *s = sin_t + (int64_t)pos[t] * half;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half], sn = inverse ? -s[i] : s[i];
                v[i] = a * c[i] - b * sn;
                v[i + half] = b * c[i] + a * sn;
            }
        }
}

static void ref_swiglu_fwd(float *out, const float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double g = gate[i];
        out[i] = (float)(g / (1 + exp(-g)) * up[i]);
    }
}

/* silu(g) = g s, s = sigmoid(g); silu'(g) = s (1 + g (1 - s)) */
static void ref_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate,
                           const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double g = gate[i], s = 1 / (1 + exp(-g)), d = dout[i];
        dgate[i] = (float)(d * up[i] * s * (1 + g * (1 - s)));
        dup[i] = (float)(d * g * s);
    }
}

/* The keys of query row i of sequence s: all rows of its prefix sequence
 * (when it has one), then its own rows up to i. key(r, n) gives the n-th. */
typedef struct ref_keys {
    int64_t pre_first, pre, own_first, n;
} ref_keys;

static ref_keys ref_keys_of(const int32_t *cu, const int32_t *prefix, int s, int64_t i) {
    ref_keys r = {0, 0, cu[s], i - cu[s] + 1};
    if (prefix && prefix[s] >= 0) {
        r.pre_first = cu[prefix[s]];
        r.pre = cu[prefix[s] + 1] - cu[prefix[s]];
        r.n += r.pre;
    }
    return r;
}

static int64_t ref_key(const ref_keys *r, int64_t n) { return n < r->pre ? r->pre_first + n : r->own_first + n - r->pre; }

static void ref_attn_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                         const int32_t *cu, const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd,
                         float scale) {
    int group = Hq / Hk;
    for (int s = 0; s < n_seqs; s++)
        for (int h = 0; h < Hq; h++)
            for (int64_t i = cu[s]; i < cu[s + 1]; i++) {
                const float *qi = q + (i * Hq + h) * hd;
                ref_keys keys = ref_keys_of(cu, prefix, s, i);
                double m = -INFINITY, sum = 0;
                for (int64_t n = 0; n < keys.n; n++) {
                    const float *kj = k + (ref_key(&keys, n) * Hk + h / group) * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++) d += (double)qi[e] * kj[e];
                    if (d * scale > m) m = d * scale;
                }
                double acc[hd];
                for (int e = 0; e < hd; e++) acc[e] = 0;
                for (int64_t n = 0; n < keys.n; n++) {
                    int64_t j = ref_key(&keys, n);
                    const float *kj = k + (j * Hk + h / group) * hd, *vj = v + (j * Hk + h / group) * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++) d += (double)qi[e] * kj[e];
                    double p = exp(d * scale - m);
                    sum += p;
                    for (int e = 0; e < hd; e++) acc[e] += p * vj[e];
                }
                for (int e = 0; e < hd; e++) out[(i * Hq + h) * hd + e] = (float)(acc[e] / sum);
                lse[i * Hq + h] = (float)(m + log(sum));
            }
}

/* P = softmax(S), S = scale q k^T (causal). dV = P^T dO; dP = dO V^T;
 * dS = P (dP - rowsum(dO * O)); dQ = scale dS K; dK = scale dS^T Q. */
static void ref_attn_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out,
                         const float *lse, const float *q, const float *k, const float *v,
                         const int32_t *cu, const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd,
                         float scale) {
    int group = Hq / Hk;
    int64_t T = cu[n_seqs];
    for (int64_t i = 0; i < T * Hq * hd; i++) dq[i] = 0;
    for (int64_t i = 0; i < T * Hk * hd; i++) dk[i] = dv[i] = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int h = 0; h < Hq; h++) {
            int kh = h / group;
            for (int64_t i = cu[s]; i < cu[s + 1]; i++) {
                const float *qi = q + (i * Hq + h) * hd, *doi = dout + (i * Hq + h) * hd;
                const float *oi = out + (i * Hq + h) * hd;
                ref_keys keys = ref_keys_of(cu, prefix, s, i);
                double Di = 0;
                for (int e = 0; e < hd; e++) Di += (double)doi[e] * oi[e];
                for (int64_t n = 0; n < keys.n; n++) {
                    int64_t j = ref_key(&keys, n);
                    const float *kj = k + (j * Hk + kh) * hd, *vj = v + (j * Hk + kh) * hd;
                    double d = 0, dp = 0;
                    for (int e = 0; e < hd; e++) d += (double)qi[e] * kj[e];
                    for (int e = 0; e < hd; e++) dp += (double)doi[e] * vj[e];
                    double p = exp(d * scale - lse[i * Hq + h]);
                    double ds = p * (dp - Di) * scale;
                    for (int e = 0; e < hd; e++) {
                        dv[(j * Hk + kh) * hd + e] += (float)(p * doi[e]);
                        dq[(i * Hq + h) * hd + e] += (float)(ds * kj[e]);
                        dk[(j * Hk + kh) * hd + e] += (float)(ds * qi[e]);
                    }
                }
            }
        }
}

static void ref_head_fwd(const float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets,
                         float *lse, float *entropy, float *logprob) {
    for (int64_t r = 0; r < rows; r++) {
        const float *z = logits + r * V;
        double m = -INFINITY, s = 0, sz = 0;
        for (int j = 0; j < V; j++)
            if ((double)z[j] * inv_temp > m) m = (double)z[j] * inv_temp;
        for (int j = 0; j < V; j++) {
            double zj = (double)z[j] * inv_temp, e = exp(zj - m);
            s += e;
            sz += e * zj;
        }
        double l = m + log(s);
        lse[r] = (float)l;
        entropy[r] = (float)(l - sz / s);
        logprob[r] = targets[r] >= 0 && targets[r] < V ? (float)((double)z[targets[r]] * inv_temp - l) : 0.0f;
    }
}

/* logp_j = z_j - lse, p_j = exp(logp_j), H = -sum p logp.
 * d logp_t / dz_j = [j = t] - p_j;  dH/dz_j = -p_j (logp_j + H); raw logits = z * temp. */
static void ref_head_bwd(float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets,
                         const float *lse, const float *entropy, const float *dlogprob,
                         const float *dentropy) {
    for (int64_t r = 0; r < rows; r++) {
        float *z = logits + r * V;
        double glp = dlogprob && targets[r] >= 0 ? dlogprob[r] : 0, gh = dentropy ? dentropy[r] : 0;
        for (int j = 0; j < V; j++) {
            double lp = (double)z[j] * inv_temp - lse[r], p = exp(lp);
            double g = -glp * p - gh * p * (lp + entropy[r]);
            if (j == targets[r]) g += glp;
            z[j] = (float)(g * inv_temp);
        }
    }
}

static const mrl_kernels reference_table = {
    .name = "cpu-reference",
    .on_device = 0,
    .copy = mrl_cpu_copy,
    .zero = mrl_cpu_zero,
    .to_device = mrl_cpu_transfer,
    .to_host = mrl_cpu_transfer,
    .sync = mrl_cpu_sync,
    .copy_rows = mrl_cpu_copy_rows,
    .gemm = ref_gemm,
    .gemm_group = ref_gemm_group,
    .qgemm = ref_qgemm,
    .gemm_bf16 = mrl_cpu_gemm_bf16_reference,
    .gemm_bf16_panels = ref_gemm_bf16_panels,
    .gemm_bf16_panels_group = ref_gemm_bf16_panels_group,
    .rmsnorm_fwd = ref_rmsnorm_fwd,
    .rmsnorm_bwd = ref_rmsnorm_bwd,
    .rope = ref_rope,
    .mla_qkv = mrl_cpu_ref_mla_qkv,
    .mla_qkv_bwd = mrl_cpu_ref_mla_qkv_bwd,
    .swiglu_fwd = ref_swiglu_fwd,
    .swiglu_bwd = ref_swiglu_bwd,
    .attn_fwd = ref_attn_fwd,
    .attn_bwd = ref_attn_bwd,
    .head_fwd = ref_head_fwd,
    .head_bwd = ref_head_bwd,
    .gather_rows = ref_gather_rows,
    .scatter_add_rows = ref_scatter_add_rows,
    .bias_add = ref_bias_add,
    .bias_bwd = ref_bias_bwd,
    .lora_fwd = ref_lora_fwd,
    .panels_pack = ref_panels_pack,
    .panels16_pack = ref_panels16_pack,
    .paged_kv_write = mrl_cpu_ref_paged_kv_write,
    .paged_kv_write_bf16 = mrl_cpu_ref_paged_kv_write_bf16,
    .paged_attn_workspace = mrl_cpu_ref_paged_attn_workspace,
    .paged_attn = mrl_cpu_ref_paged_attn,
    .mla_paged_attn = mrl_cpu_ref_mla_paged_attn,
    .latent_kv_write = mrl_cpu_ref_latent_kv_write,
    .sample = mrl_cpu_ref_sample,
    .top_logprobs = mrl_cpu_ref_top_logprobs,
    .moe_route = mrl_cpu_ref_moe_route,
    .moe_route_grouped = mrl_cpu_ref_moe_route_grouped,
    .moe_group = mrl_cpu_moe_group,
    .adamw = mrl_cpu_ref_adamw,
    .sum = mrl_cpu_ref_sum,
    .scale = mrl_cpu_ref_scale,
    .add = mrl_cpu_ref_add,
    .bf16_to_f32 = mrl_cpu_bf16_to_f32_scalar,
    .f32_to_bf16 = mrl_cpu_f32_to_bf16_scalar,
    .f16_to_f32 = mrl_cpu_f16_to_f32_scalar,
    .f32_to_f16 = mrl_cpu_f32_to_f16_scalar,
    .dequant = mrl_cpu_dequant_scalar,
};

const mrl_kernels *mrl_kernels_cpu_reference(void) { return &reference_table; }
