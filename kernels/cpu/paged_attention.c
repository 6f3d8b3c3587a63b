/* Paged attention on the CPU (see paged_attention.h). The reference is plain
 * loops in double; the fast version computes, per (sequence, kv head, tile
 * of query tokens), the scores of the group's query heads against each key
 * read once through the block table, a softmax per head, then the weighted
 * sum of V rows. Dot products and AXPYs use AVX-512 or AVX2+FMA, chosen at
 * run time with __builtin_cpu_supports. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "cpu/paged_attention.h"
#include "moonrl/parallel.h"

#define QUERY_TILE 16

static inline const float *kv_row(const float *cache, const mrl_paged_attn *a, const int32_t *table, int pos,
                                  int g) {
    int blk = table[pos / a->block_size];
    return cache + (((int64_t)blk * a->Hk + g) * a->block_size + pos % a->block_size) * a->hd;
}

/* ---- reference ---- */

void mrl_paged_attention_ref(const mrl_paged_attn *a) {
    int G = a->Hq / a->Hk, hd = a->hd;
    double *p = NULL;
    int cap = 0;
    for (int i = 0; i < a->n_seqs; i++) {
        const int32_t *table = a->block_tables + (int64_t)i * a->max_blocks_per_seq;
        int n_q = a->query_start[i + 1] - a->query_start[i], len = a->seq_lens[i];
        if (len > cap) {
            cap = len;
            p = realloc(p, (size_t)cap * sizeof(double));
        }
        for (int j = 0; j < n_q; j++) {
            int64_t t = a->query_start[i] + j;
            int pos = len - n_q + j;
            for (int h = 0; h < a->Hq; h++) {
                const float *q = a->q + (t * a->Hq + h) * hd;
                float *o = a->out + (t * a->Hq + h) * hd;
                int g = h / G;
                double m = -INFINITY, sum = 0;
                for (int c = 0; c <= pos; c++) {
                    const float *k = kv_row(a->k_cache, a, table, c, g);
                    double s = 0;
                    for (int d = 0; d < hd; d++) s += (double)q[d] * k[d];
                    p[c] = s * a->scale;
                    if (p[c] > m) m = p[c];
                }
                for (int c = 0; c <= pos; c++) sum += (p[c] = exp(p[c] - m));
                for (int d = 0; d < hd; d++) {
                    double acc = 0;
                    for (int c = 0; c <= pos; c++) acc += p[c] * kv_row(a->v_cache, a, table, c, g)[d];
                    o[d] = (float)(acc / sum);
                }
            }
        }
    }
    free(p);
}

/* ---- vector primitives ---- */

typedef float (*dot_fn)(const float *a, const float *b, int n);
typedef void (*axpy_fn)(float *y, float a, const float *x, int n);

static float dot_scalar(const float *a, const float *b, int n) {
    float s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_scalar(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc0 = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float r = _mm_cvtss_f32(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

__attribute__((target("avx2,fma"))) static void axpy_avx2(float *y, float a, const float *x, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

__attribute__((target("avx512f"))) static float dot_avx512(const float *a, const float *b, int n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

__attribute__((target("avx512f"))) static void axpy_avx512(float *y, float a, const float *x, int n) {
    __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i),
                                                       _mm512_maskz_loadu_ps(m, y + i)));
    }
}

/* ---- fast version ---- */

typedef struct attn_item {
    int32_t seq, g, t0, t1; /* query tokens t0..t1 of the batch, kv head g */
} attn_item;

typedef struct attn_ctx {
    const mrl_paged_attn *a;
    const attn_item *items;
    int max_len;
} attn_ctx;

/* One work item; dot/axpy are constants at each call site so that the
 * compiler inlines them into the target-specific copies below. */
static inline __attribute__((always_inline)) void attend_item(const mrl_paged_attn *a, const attn_item *it,
                                                              float *scores, dot_fn dot, axpy_fn axpy) {
    int G = a->Hq / a->Hk, hd = a->hd, bs = a->block_size, g = it->g;
    const int32_t *table = a->block_tables + (int64_t)it->seq * a->max_blocks_per_seq;
    int len = a->seq_lens[it->seq], q0 = a->query_start[it->seq];
    int n_q = a->query_start[it->seq + 1] - q0;
    for (int t = it->t0; t < it->t1; t++) {
        int pos = len - n_q + (t - q0), n_ctx = pos + 1;
        const float *q = a->q + ((int64_t)t * a->Hq + (int64_t)g * G) * hd;
        float *out = a->out + ((int64_t)t * a->Hq + (int64_t)g * G) * hd;
        /* scores[r * n_ctx + c] for query head g*G + r */
        for (int c0 = 0; c0 < n_ctx; c0 += bs) {
            const float *kb = a->k_cache + ((int64_t)table[c0 / bs] * a->Hk + g) * bs * hd;
            int cn = n_ctx - c0 < bs ? n_ctx - c0 : bs;
            for (int c = 0; c < cn; c++)
                for (int r = 0; r < G; r++)
                    scores[(int64_t)r * n_ctx + c0 + c] = dot(q + (int64_t)r * hd, kb + (int64_t)c * hd, hd) * a->scale;
        }
        for (int r = 0; r < G; r++) {
            float *s = scores + (int64_t)r * n_ctx, m = -INFINITY;
            for (int c = 0; c < n_ctx; c++) m = s[c] > m ? s[c] : m;
            double sum = 0;
            for (int c = 0; c < n_ctx; c++) sum += (s[c] = expf(s[c] - m));
            float inv = (float)(1.0 / sum);
            for (int c = 0; c < n_ctx; c++) s[c] *= inv;
            memset(out + (int64_t)r * hd, 0, (size_t)hd * sizeof(float));
        }
        for (int c0 = 0; c0 < n_ctx; c0 += bs) {
            const float *vb = a->v_cache + ((int64_t)table[c0 / bs] * a->Hk + g) * bs * hd;
            int cn = n_ctx - c0 < bs ? n_ctx - c0 : bs;
            for (int c = 0; c < cn; c++)
                for (int r = 0; r < G; r++)
                    axpy(out + (int64_t)r * hd, scores[(int64_t)r * n_ctx + c0 + c], vb + (int64_t)c * hd, hd);
        }
    }
}

static void items_scalar(const attn_ctx *ctx, int64_t b, int64_t e, float *scores) {
    for (int64_t i = b; i < e; i++) attend_item(ctx->a, &ctx->items[i], scores, dot_scalar, axpy_scalar);
}

__attribute__((target("avx2,fma"))) static void items_avx2(const attn_ctx *ctx, int64_t b, int64_t e,
                                                           float *scores) {
    for (int64_t i = b; i < e; i++) attend_item(ctx->a, &ctx->items[i], scores, dot_avx2, axpy_avx2);
}

__attribute__((target("avx512f"))) static void items_avx512(const attn_ctx *ctx, int64_t b, int64_t e,
                                                            float *scores) {
    for (int64_t i = b; i < e; i++) attend_item(ctx->a, &ctx->items[i], scores, dot_avx512, axpy_avx512);
}

const char *mrl_paged_attention_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return "avx512";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
    return "scalar";
}

static void attend_range(void *vctx, int64_t b, int64_t e) {
    const attn_ctx *ctx = vctx;
    int G = ctx->a->Hq / ctx->a->Hk;
    float *scores = malloc((size_t)G * (ctx->max_len > 0 ? ctx->max_len : 1) * sizeof(float));
    if (!scores) return; /* cannot happen for sane sizes; output left as is */
    const char *isa = mrl_paged_attention_isa();
    if (isa[0] == 'a' && isa[3] == '5') items_avx512(ctx, b, e, scores);
    else if (isa[0] == 'a') items_avx2(ctx, b, e, scores);
    else items_scalar(ctx, b, e, scores);
    free(scores);
}

void mrl_paged_attention(const mrl_paged_attn *a) {
    int64_t n_items = 0;
    int max_len = 0;
    for (int i = 0; i < a->n_seqs; i++) {
        int n_q = a->query_start[i + 1] - a->query_start[i];
        n_items += (int64_t)a->Hk * ((n_q + QUERY_TILE - 1) / QUERY_TILE);
        if (a->seq_lens[i] > max_len) max_len = a->seq_lens[i];
    }
    if (n_items == 0) return;
    attn_item *items = malloc((size_t)n_items * sizeof(attn_item));
    if (!items) {
        mrl_paged_attention_ref(a);
        return;
    }
    int64_t k = 0;
    for (int i = 0; i < a->n_seqs; i++)
        for (int g = 0; g < a->Hk; g++)
            for (int t = a->query_start[i]; t < a->query_start[i + 1]; t += QUERY_TILE) {
                int t1 = t + QUERY_TILE < a->query_start[i + 1] ? t + QUERY_TILE : a->query_start[i + 1];
                items[k++] = (attn_item){i, g, t, t1};
            }
    attn_ctx ctx = {a, items, max_len};
    mrl_parallel_for(n_items, 1, attend_range, &ctx);
    free(items);
}

void mrl_paged_kv_write(float *k_cache, float *v_cache, const float *k, const float *v,
                        const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    for (int64_t t = 0; t < T; t++) {
        int32_t slot = slot_mapping[t];
        if (slot < 0) continue;
        int64_t blk = slot / block_size, off = slot % block_size;
        for (int h = 0; h < Hk; h++) {
            int64_t dst = ((blk * Hk + h) * block_size + off) * hd, src = (t * Hk + h) * (int64_t)hd;
            memcpy(k_cache + dst, k + src, (size_t)hd * sizeof(float));
            memcpy(v_cache + dst, v + src, (size_t)hd * sizeof(float));
        }
    }
}
