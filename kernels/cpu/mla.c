/* MLA's attention inputs and their backward (kernels.h, mla_qkv): copies and RoPE's rotation,
 * token by token. The fast table runs the reference's rows over the threads: each token's
 * outputs are its own, so both give the same bits. The rotation's products and sums are fp32 with
 * no fused multiply-add (rope's arithmetic, and the CUDA table's __fmul_rn). */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "cpu/mla.h"
#include "cpu/gemm_bf16.h"
#include "cpu/isa.h"
#include "cpu/paged_attention.h"
#include "base/error.h"
#include "base/parallel.h"
#include "moonrl/dtype.h"

#define NO_FMA __attribute__((optimize("fp-contract=off")))

typedef struct mla_args {
    float *o0, *o1, *o2;       /* q, k, v (forward) or dqf, dkv, dkr (backward) */
    const float *i0, *i1, *i2; /* qf, kv, kr or dq, dk, dv */
    const int32_t *pos;
    const float *cos_t, *sin_t;
    int H, dn, dr, dv, hd, interleave;
} mla_args;

/* out [dr] = x [dr] rotated (forward) by the angles of c, s [dr/2]: pair i is (2i, 2i+1) when
 * interleaved, (i, i + dr/2) otherwise; its outputs go to (i, i + dr/2). */
NO_FMA static void rotate(float *out, const float *x, const float *c, const float *s, int dr, int interleave) {
    int half = dr / 2;
    for (int i = 0; i < half; i++) {
        float a = interleave ? x[2 * i] : x[i], b = interleave ? x[2 * i + 1] : x[i + half];
        out[i] = a * c[i] - b * s[i];
        out[i + half] = b * c[i] + a * s[i];
    }
}

/* The transpose: dx [dr] from dout [dr] (rotated back, into the pair's own places); add: dx += */
NO_FMA static void rotate_back(float *dx, const float *d, const float *c, const float *s, int dr, int interleave,
                               int add) {
    int half = dr / 2;
    for (int i = 0; i < half; i++) {
        float a = d[i] * c[i] + d[i + half] * s[i], b = d[i + half] * c[i] - d[i] * s[i];
        float *pa = interleave ? &dx[2 * i] : &dx[i], *pb = interleave ? &dx[2 * i + 1] : &dx[i + half];
        if (add) *pa += a, *pb += b;
        else *pa = a, *pb = b;
    }
}

static void fwd_rows(void *vc, int64_t t0, int64_t t1) {
    const mla_args *a = vc;
    int H = a->H, dn = a->dn, dr = a->dr, dv = a->dv, hd = a->hd, half = dr / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = a->cos_t + (int64_t)a->pos[t] * half, *s = a->sin_t + (int64_t)a->pos[t] * half;
        for (int h = 0; h < H; h++) {
            int64_t th = t * H + h;
            if (a->o0) { /* (the absorbed form asks for q alone, or for k alone: NULL outputs) */
                float *q = a->o0 + th * hd;
                const float *qf = a->i0 + th * (dn + dr);
                memset(q, 0, sizeof(float) * hd);
                memcpy(q, qf, sizeof(float) * dn);
                rotate(q + dn, qf + dn, c, s, dr, a->interleave);
            }
            const float *kv = a->i1 ? a->i1 + th * (dn + dv) : NULL;
            if (a->o1) {
                float *k = a->o1 + th * hd;
                memset(k, 0, sizeof(float) * hd);
                memcpy(k, kv, sizeof(float) * dn);
                rotate(k + dn, a->i2 + t * dr, c, s, dr, a->interleave);
            }
            if (a->o2) {
                float *v = a->o2 + th * hd;
                memset(v, 0, sizeof(float) * hd);
                memcpy(v, kv + dn, sizeof(float) * dv);
            }
        }
    }
}

static void bwd_rows(void *vc, int64_t t0, int64_t t1) {
    const mla_args *a = vc;
    int H = a->H, dn = a->dn, dr = a->dr, dv = a->dv, hd = a->hd, half = dr / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = a->cos_t + (int64_t)a->pos[t] * half, *s = a->sin_t + (int64_t)a->pos[t] * half;
        float *dkr = a->o2 + t * dr;
        for (int h = 0; h < H; h++) {
            int64_t th = t * H + h;
            const float *dq = a->i0 + th * hd, *dk = a->i1 + th * hd, *dvv = a->i2 + th * hd;
            float *dqf = a->o0 + th * (dn + dr), *dkv = a->o1 + th * (dn + dv);
            memcpy(dqf, dq, sizeof(float) * dn);
            rotate_back(dqf + dn, dq + dn, c, s, dr, a->interleave, 0);
            memcpy(dkv, dk, sizeof(float) * dn);
            memcpy(dkv + dn, dvv, sizeof(float) * dv);
            rotate_back(dkr, dk + dn, c, s, dr, a->interleave, h > 0); /* the heads' sum, head by head */
        }
        if (H == 0) memset(dkr, 0, sizeof(float) * dr);
    }
}

#define FWD_ARGS                                                                                                   \
    mla_args a = {q, k, v, qf, kv, kr, pos, cos_t, sin_t, H, dn, dr, dv, hd, interleave};                         \
    if (T <= 0) return;
#define BWD_ARGS                                                                                                   \
    mla_args a = {dqf, dkv, dkr, dq, dk, dv, pos, cos_t, sin_t, H, dn, dr, dvd, hd, interleave};                  \
    if (T <= 0) return;

void mrl_cpu_ref_mla_qkv(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr,
                         const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                         int dv, int hd, int interleave) {
    FWD_ARGS
    fwd_rows(&a, 0, T);
}

void mrl_cpu_fast_mla_qkv(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr,
                          const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                          int dv, int hd, int interleave) {
    FWD_ARGS
    mrl_parallel_for(T, 16, fwd_rows, &a);
}

void mrl_cpu_ref_mla_qkv_bwd(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                             const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn,
                             int dr, int dvd, int hd, int interleave) {
    BWD_ARGS
    bwd_rows(&a, 0, T);
}

void mrl_cpu_fast_mla_qkv_bwd(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                              const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn,
                              int dr, int dvd, int hd, int interleave) {
    BWD_ARGS
    mrl_parallel_for(T, 16, bwd_rows, &a);
}

/* ---- the latent cache: its write and the absorbed attention ---- */

typedef struct latent_write {
    void *cache;
    const float *rows;
    const int32_t *slots;
    int W, bf16;
} latent_write;

static void write_rows(void *vc, int64_t t0, int64_t t1) {
    const latent_write *w = vc;
    for (int64_t t = t0; t < t1; t++) {
        if (w->slots[t] < 0) continue;
        int64_t at = (int64_t)w->slots[t] * w->W;
        const float *r = w->rows + t * w->W;
        if (w->bf16)
            for (int d = 0; d < w->W; d++) ((uint16_t *)w->cache)[at + d] = mrl_f32_to_bf16(r[d]);
        else
            memcpy((float *)w->cache + at, r, sizeof(float) * (size_t)w->W);
    }
}

void mrl_cpu_ref_latent_kv_write(void *cache, const float *rows, const int32_t *slot_mapping, int64_t T, int W,
                                 int bf16) {
    latent_write w = {cache, rows, slot_mapping, W, bf16};
    write_rows(&w, 0, T);
}

void mrl_cpu_fast_latent_kv_write(void *cache, const float *rows, const int32_t *slot_mapping, int64_t T, int W,
                                  int bf16) {
    latent_write w = {cache, rows, slot_mapping, W, bf16};
    mrl_parallel_for(T, 64, write_rows, &w);
}

static mrl_status check_latent(const mrl_paged_attn *a, const char *who) {
    int hv = a->hv ? a->hv : a->hd;
    if (a->Hk != 1 || a->Hq < 1 || a->hd < 1 || a->hd > 1024 || hv > a->hd || a->block_size < 1 || a->n_seqs < 0)
        return mrl_set_error(MRL_ERR_INVALID, "%s: Hq %d, Hk %d (must be 1), hd %d, hv %d, block_size %d", who, a->Hq,
                             a->Hk, a->hd, hv, a->block_size);
    for (int i = 0; i < a->n_seqs; i++) {
        int n_q = a->query_start[i + 1] - a->query_start[i], len = a->seq_lens[i];
        if (n_q < 0 || n_q > len || len > a->max_blocks_per_seq * a->block_size)
            return mrl_set_error(MRL_ERR_INVALID, "%s: sequence %d: %d queries, length %d, %d blocks of %d", who, i, n_q,
                                 len, a->max_blocks_per_seq, a->block_size);
    }
    return MRL_OK;
}

/* Where row c of sequence `table`'s context starts in the cache (elements) */
static inline int64_t row_at(const mrl_paged_attn *a, const int32_t *table, int c) {
    return ((int64_t)table[c / a->block_size] * a->block_size + c % a->block_size) * a->hd;
}

/* Row c of sequence `table`'s context as fp32 (bf16: widened into buf) */
static const float *latent_row(const mrl_paged_attn *a, const int32_t *table, int c, float *buf) {
    int64_t at = row_at(a, table, c);
    if (!a->kv_bf16) return (const float *)a->k_cache + at;
    const uint16_t *h = (const uint16_t *)a->k_cache + at;
    for (int d = 0; d < a->hd; d++) buf[d] = mrl_bf16_to_f32(h[d]);
    return buf;
}

/* The reference: plain loops in double, a query head at a time (what the tests trust). */
mrl_status mrl_cpu_ref_mla_paged_attn(const mrl_paged_attn *a) {
    mrl_status st = check_latent(a, "mla_paged_attn_ref");
    if (st) return st;
    int hd = a->hd, hv = a->hv ? a->hv : hd;
    float buf[1024];
    double acc[1024];
    for (int i = 0; i < a->n_seqs; i++) {
        const int32_t *table = a->block_tables + (int64_t)i * a->max_blocks_per_seq;
        int n_q = a->query_start[i + 1] - a->query_start[i], len = a->seq_lens[i];
        for (int j = 0; j < n_q; j++) {
            int64_t t = a->query_start[i] + j;
            int pos = len - n_q + j;
            for (int h = 0; h < a->Hq; h++) {
                const float *q = a->q + (t * a->Hq + h) * hd;
                double m = -INFINITY, sum = 0;
                for (int c = 0; c <= pos; c++) {
                    const float *r = latent_row(a, table, c, buf);
                    double s = 0;
                    for (int d = 0; d < hd; d++) s += (double)q[d] * r[d];
                    s *= a->scale;
                    if (s > m) m = s;
                }
                for (int d = 0; d < hv; d++) acc[d] = 0;
                for (int c = 0; c <= pos; c++) {
                    const float *r = latent_row(a, table, c, buf);
                    double s = 0;
                    for (int d = 0; d < hd; d++) s += (double)q[d] * r[d];
                    double p = exp(s * a->scale - m);
                    sum += p;
                    for (int d = 0; d < hv; d++) acc[d] += p * r[d];
                }
                float *o = a->out + (t * a->Hq + h) * hv;
                for (int d = 0; d < hv; d++) o[d] = (float)(acc[d] / sum);
            }
        }
    }
    return MRL_OK;
}

/* The fast table's: the batch's query rows, each with a run of its heads (all of them; with fewer
 * rows than twice the threads, a share of them, so that one sequence's decode still spreads), over
 * the threads. Each item reads its context's rows once for all its heads (the heads share the one
 * latent row: multi-query attention over it); the softmax in fp32 (mrl_vexp_sum). Its products:
 *  - fp32: a block at a time as two OpenBLAS products, the scores [h, W] x [rows, W]^T, then,
 *    with the softmax's weights, the rows' first hv values summed [h, rows] x [rows, hv] (a bf16
 *    cache's block widened first);
 *  - bf16 (a bf16 cache on a CPU with AVX512-BF16, W and hv multiples of 32; off with
 *    mrl_cpu_paged_attn_bf16_products(0)), as the expanded cache's paged_attn takes them: q and
 *    the normalised weights rounded to bf16, vdpbf16ps, fp32 sums. The scores: 4 heads x 4 rows
 *    of accumulators over the row (pairs along it, as the row lies), each summed across its lanes
 *    at the end. The values: rows c and c+1 interleaved (vpunpck{l,h}wd within 128-bit lanes)
 *    meet the weight pair (p[c], p[c+1]) of 4 heads, 64 values at a time, the outputs in lane
 *    order (d 0-3, 8-11, 16-19, 24-27 and 4-7, 12-15, ... of each 32) put back in order at the
 *    end; the context a run of 32 rows at a time, so that the run stays in cache across the heads. */
typedef struct latent_job {
    const mrl_paged_attn *a;
    const int32_t *seq_of; /* [T] each query token's sequence */
    int max_ctx, hc, n_hc; /* heads an item (hc), items a row (n_hc) */
    int dp;                /* the bf16 products */
    int64_t t0;            /* the first row (parallel_for's 0) */
    mrl_status st;
} latent_job;

/* block b's rows [rows, hd] of the cache as fp32: in place, or widened into buf */
static const float *latent_block(const mrl_paged_attn *a, int32_t b, int rows, float *buf) {
    int64_t at = (int64_t)b * a->block_size * a->hd;
    if (!a->kv_bf16) return (const float *)a->k_cache + at;
    const uint16_t *h = (const uint16_t *)a->k_cache + at;
    int64_t n = (int64_t)rows * a->hd;
    uint32_t *u = (uint32_t *)buf;
    for (int64_t i = 0; i < n; i++) u[i] = (uint32_t)h[i] << 16; /* (bf16's widening: exact) */
    return buf;
}

/* fp32 products: s [nh, n] the scores of the nh heads of q, then out [nh, hv]. */
static void attend_fp32(const mrl_paged_attn *a, const int32_t *table, const float *q, int nh, int n, float *s,
                        float *buf, float *out) {
    int hd = a->hd, hv = a->hv ? a->hv : hd, bs = a->block_size;
    for (int c0 = 0; c0 < n; c0 += bs) {
        int rows = n - c0 < bs ? n - c0 : bs;
        const float *k = latent_block(a, table[c0 / bs], rows, buf);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nh, rows, hd, a->scale, q, hd, k, hd, 0.0f, s + c0, n);
    }
    mrl_cpu_softmax_rows(s, nh, n);
    for (int c0 = 0; c0 < n; c0 += bs) {
        int rows = n - c0 < bs ? n - c0 : bs;
        const float *k = latent_block(a, table[c0 / bs], rows, buf);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nh, hv, rows, 1.0f, s + c0, n, k, hd, c0 ? 1.0f : 0.0f,
                    out, hv);
    }
}

#define DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* context row c of a sequence's block table, bf16 */
static inline const uint16_t *row16(const mrl_paged_attn *a, const int32_t *table, int c) {
    return (const uint16_t *)a->k_cache + row_at(a, table, c);
}

/* s [nh, n] = scale * q . row, q the nh heads as bf16 (qb [nh, hd]) */
DP_TARGET static void scores_dp(const mrl_paged_attn *a, const int32_t *table, const uint16_t *qb, int nh, int n,
                                float *s) {
    int hd = a->hd;
    for (int c0 = 0; c0 < n; c0 += 4) {
        const uint16_t *r[4];
        for (int j = 0; j < 4; j++) r[j] = row16(a, table, c0 + j < n ? c0 + j : c0); /* (past the end: not stored) */
        for (int h0 = 0; h0 < nh; h0 += 4) {
            const uint16_t *qh[4];
            for (int i = 0; i < 4; i++) qh[i] = qb + (int64_t)(h0 + i < nh ? h0 + i : h0) * hd;
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int d = 0; d < hd; d += 32) {
                __m512bh rv[4], qv[4];
                for (int j = 0; j < 4; j++) rv[j] = (__m512bh)_mm512_loadu_si512(r[j] + d);
                for (int i = 0; i < 4; i++) qv[i] = (__m512bh)_mm512_loadu_si512(qh[i] + d);
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) acc[4 * i + j] = _mm512_dpbf16_ps(acc[4 * i + j], qv[i], rv[j]);
            }
            for (int i = 0; i < 4 && h0 + i < nh; i++)
                for (int j = 0; j < 4 && c0 + j < n; j++)
                    s[(int64_t)(h0 + i) * n + c0 + j] = _mm512_reduce_add_ps(acc[4 * i + j]) * a->scale;
        }
    }
}

/* out [nh, hv] (lane order, see above) = the weight pairs of the nh heads (each at the front of
 * its row of s, [nh, n]) times the context's first hv values */
DP_TARGET static void values_dp(const mrl_paged_attn *a, const int32_t *table, const float *s, int nh, int n,
                                float *out, int hv) {
    int np = (n + 1) / 2;
    for (int p0 = 0; p0 < np; p0 += 16) { /* runs of 32 rows */
        int p1 = p0 + 16 < np ? p0 + 16 : np;
        for (int h0 = 0; h0 < nh; h0 += 4) {
            const uint32_t *pp[4];
            for (int i = 0; i < 4; i++) pp[i] = (const uint32_t *)(s + (int64_t)(h0 + i < nh ? h0 + i : h0) * n);
            for (int d0 = 0; d0 < hv; d0 += 64) {
                const int two = hv - d0 >= 64; /* 64 values, or the last 32 */
                __m512 acc[16];
                for (int i = 0; i < 4; i++)
                    for (int k = 0; k < 4; k++)
                        acc[4 * i + k] = p0 && (two || k < 2) ? _mm512_loadu_ps(out + (int64_t)(h0 + i < nh ? h0 + i : h0) * hv + d0 + 16 * k)
                                                              : _mm512_setzero_ps();
                for (int p = p0; p < p1; p++) {
                    const uint16_t *r0 = row16(a, table, 2 * p), *r1 = 2 * p + 1 < n ? row16(a, table, 2 * p + 1) : r0;
                    __m512i x0 = _mm512_loadu_si512(r0 + d0), x1 = _mm512_loadu_si512(r1 + d0), y0 = x0, y1 = x1;
                    if (two) y0 = _mm512_loadu_si512(r0 + d0 + 32), y1 = _mm512_loadu_si512(r1 + d0 + 32);
                    __m512bh v[4] = {(__m512bh)_mm512_unpacklo_epi16(x0, x1), (__m512bh)_mm512_unpackhi_epi16(x0, x1),
                                     (__m512bh)_mm512_unpacklo_epi16(y0, y1), (__m512bh)_mm512_unpackhi_epi16(y0, y1)};
                    for (int i = 0; i < 4; i++) {
                        __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[i][p]);
                        for (int k = 0; k < 4; k++) acc[4 * i + k] = _mm512_dpbf16_ps(acc[4 * i + k], w, v[k]);
                    }
                }
                for (int i = 0; i < 4 && h0 + i < nh; i++)
                    for (int k = 0; k < (two ? 4 : 2); k++) _mm512_storeu_ps(out + (int64_t)(h0 + i) * hv + d0 + 16 * k, acc[4 * i + k]);
            }
        }
    }
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int h = 0; h < nh; h++) /* lane order (lo, hi of each 32 values) back to the values' */
        for (int d = 0; d < hv; d += 32) {
            float *o = out + (int64_t)h * hv + d;
            __m512 lo = _mm512_loadu_ps(o), hi = _mm512_loadu_ps(o + 16);
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
}

/* bf16 products: the nh heads of q rounded to bf16 (qb), the scores, the weights, out [nh, hv] */
DP_TARGET static void attend_dp(const mrl_paged_attn *a, const int32_t *table, const float *q, int nh, int n, float *s,
                                uint16_t *qb, float *out) {
    int hd = a->hd, hv = a->hv ? a->hv : hd;
    for (int64_t i = 0; i < (int64_t)nh * hd; i += 32)
        _mm512_storeu_si512(qb + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(q + i)));
    scores_dp(a, table, qb, nh, n, s);
    mrl_cpu_softmax_rows(s, nh, n);
    for (int h = 0; h < nh; h++) mrl_cpu_bf16_pairs_in_place(s + (int64_t)h * n, n); /* (over the front of its row) */
    values_dp(a, table, s, nh, n, out, hv);
}

static void attend_items(void *vc, int64_t i0, int64_t i1) {
    latent_job *job = vc;
    const mrl_paged_attn *a = job->a;
    int H = a->Hq, hd = a->hd, hv = a->hv ? a->hv : hd, hc = job->hc;
    size_t n_s = (size_t)hc * job->max_ctx, n_buf = (size_t)a->block_size * hd, n_qb = ((size_t)hc * hd + 1) / 2;
    float *s = malloc(sizeof(float) * (n_s + n_buf + n_qb));
    if (!s) {
        job->st = MRL_ERR_NOMEM;
        return;
    }
    float *buf = s + n_s;
    uint16_t *qb = (uint16_t *)(buf + n_buf);
    for (int64_t it = i0; it < i1; it++) {
        int64_t t = job->t0 + it / job->n_hc;
        int h0 = (int)(it % job->n_hc) * hc, nh = H - h0 < hc ? H - h0 : hc;
        int i = job->seq_of[t], n_q = a->query_start[i + 1] - a->query_start[i];
        int n = a->seq_lens[i] - n_q + (int)(t - a->query_start[i]) + 1;
        const int32_t *table = a->block_tables + (int64_t)i * a->max_blocks_per_seq;
        const float *q = a->q + (t * H + h0) * hd;
        float *o = a->out + (t * H + h0) * hv;
        if (job->dp) attend_dp(a, table, q, nh, n, s, qb, o);
        else attend_fp32(a, table, q, nh, n, s, buf, o);
    }
    free(s);
}

mrl_status mrl_cpu_fast_mla_paged_attn(const mrl_paged_attn *a) {
    mrl_status st = check_latent(a, "mla_paged_attn");
    if (st) return st;
    /* (the rows are query_start[0] .. query_start[n_seqs]: a run of a batch's sequences starts past 0) */
    int64_t T0 = a->n_seqs ? a->query_start[0] : 0, T = a->n_seqs ? a->query_start[a->n_seqs] : 0;
    int32_t *seq_of = malloc(sizeof(int32_t) * (size_t)(T ? T : 1));
    if (!seq_of) return mrl_set_error(MRL_ERR_NOMEM, "mla_paged_attn: no memory for %lld rows", (long long)T);
    int max_ctx = 1;
    for (int i = 0; i < a->n_seqs; i++) {
        for (int t = a->query_start[i]; t < a->query_start[i + 1]; t++) seq_of[t] = i;
        if (a->seq_lens[i] > max_ctx) max_ctx = a->seq_lens[i];
    }
    int hv = a->hv ? a->hv : a->hd, threads = mrl_parallel_threads(), hc = a->Hq;
    if (T - T0 > 0 && T - T0 < 2 * threads) { /* a share of the heads an item, in fours */
        int split = (int)((2 * threads + (T - T0) - 1) / (T - T0));
        hc = (a->Hq + split - 1) / split;
        hc = (hc + 3) / 4 * 4;
        if (hc > a->Hq) hc = a->Hq;
    }
    latent_job job = {a, seq_of, max_ctx, hc, (a->Hq + hc - 1) / hc, 0, T0, MRL_OK};
    job.dp = a->kv_bf16 && a->hd % 32 == 0 && hv % 32 == 0 && mrl_cpu_isa_level() == 2 &&
             mrl_cpu_paged_attn_bf16_products_on() && mrl_cpu_has_avx512_bf16();
    mrl_parallel_for((T - T0) * job.n_hc, 1, attend_items, &job);
    free(seq_of);
    return job.st ? mrl_set_error(job.st, "mla_paged_attn: no memory for the scores of %d keys", max_ctx) : MRL_OK;
}
