/* Paged attention on the CPU (see paged_attention.h).
 *
 * The reference is plain loops in double. The fast version works per
 * (sequence, kv head, tile of query tokens) — GQA: the group's query heads
 * are done together, so each K and V block is read once for all of them:
 *   scores  K is stored transposed in a block ([hd][block_size]), so the
 *           scores of 16 keys for one head are one vector accumulated over
 *           d with broadcast q[d]: no horizontal sums;
 *   softmax per head over the context (vector exp, mrl_vexp_sum in kernels/cpu/isa.h);
 *   values  out[h][d-chunk] += p[h][key] * V[key][d-chunk], keys in tiles
 *           that stay in cache while every d-chunk is accumulated.
 * AVX-512 in intrinsics; AVX2 and scalar from the same plain C loops (their
 * inner loops run over contiguous memory and are vectorised by the compiler
 * under each target). The path is the ISA set's (isa.c, mrl_cpu_isa_level);
 * a bf16 cache with AVX512-BF16 takes vdpbf16ps instead of the fp32
 * multiply-adds (the bf16 products below). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "cpu/paged_attention.h"
#include "cpu/isa.h"
#include "cpu/gemm_bf16.h"
#include "moonrl/dtype.h"
#include "base/parallel.h"
#include "base/error.h"

#define QUERY_TILE 16
#define MAX_HEAD_DIM 1024
#define MAX_BLOCK_SIZE 4096 /* the engine's bound on block_size (engine.h) */
#define KEY_TILE 256 /* keys whose V rows are reused across the d-chunks */

/* Block `blk`, kv head g: K as [hd][bs], V as [bs][hd] (same offset). */
static inline int64_t block_offset(const mrl_paged_attn *a, int blk, int g) {
    return ((int64_t)blk * a->Hk + g) * a->block_size * a->hd;
}

/* A cache's element i (fp32, or bf16 when kv_bf16) and the address of element i. */
static inline float kv_get(const void *cache, int bf16, int64_t i) {
    return bf16 ? mrl_bf16_to_f32(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}
static inline const void *kv_ptr(const void *cache, int bf16, int64_t i) {
    return (const char *)cache + i * (bf16 ? 2 : 4);
}

/* Shapes and offsets that keep every read and write inside the arrays
 * the caller describes (block ids themselves are the caller's to get right). */
static mrl_status check_args(const mrl_paged_attn *a, const char *fn) {
    if (!a || !a->out || !a->q || !a->k_cache || !a->v_cache || !a->seq_lens || !a->query_start ||
        (a->n_seqs > 0 && !a->block_tables))
        return mrl_set_error(MRL_ERR_INVALID, "%s: NULL argument", fn);
    if (a->n_seqs < 0 || a->Hk < 1 || a->Hq < a->Hk || a->Hq % a->Hk || a->hd < 1 || a->hd > MAX_HEAD_DIM ||
        a->block_size < 1 || a->block_size > MAX_BLOCK_SIZE || a->max_blocks_per_seq < 0 || a->query_start[0] != 0)
        return mrl_set_error(MRL_ERR_INVALID, "%s: bad shape (n_seqs=%d Hq=%d Hk=%d hd=%d block_size=%d)", fn,
                             a->n_seqs, a->Hq, a->Hk, a->hd, a->block_size);
    for (int i = 0; i < a->n_seqs; i++) {
        int n_q = a->query_start[i + 1] - a->query_start[i];
        if (n_q < 0 || n_q > a->seq_lens[i] || a->seq_lens[i] > (int64_t)a->max_blocks_per_seq * a->block_size)
            return mrl_set_error(MRL_ERR_INVALID,
                                 "%s: sequence %d has %d queries over %d tokens with %d blocks of %d", fn, i, n_q,
                                 a->seq_lens[i], a->max_blocks_per_seq, a->block_size);
    }
    return MRL_OK;
}

/* ---- reference ---- */

static double ref_score(const mrl_paged_attn *a, const int32_t *table, const float *q, int c, int g) {
    int64_t kt = block_offset(a, table[c / a->block_size], g) + c % a->block_size;
    double s = 0;
    for (int d = 0; d < a->hd; d++) s += (double)q[d] * kv_get(a->k_cache, a->kv_bf16, kt + (int64_t)d * a->block_size);
    return s * a->scale;
}

int64_t mrl_cpu_ref_paged_attn_workspace(const mrl_paged_attn *a) { return 0; }

mrl_status mrl_cpu_ref_paged_attn(const mrl_paged_attn *a) {
    mrl_status st = check_args(a, "paged_attention_ref");
    if (st) return st;
    int G = a->Hq / a->Hk, hd = a->hd;
    double acc[MAX_HEAD_DIM];
    for (int i = 0; i < a->n_seqs; i++) {
        const int32_t *table = a->block_tables + (int64_t)i * a->max_blocks_per_seq;
        int n_q = a->query_start[i + 1] - a->query_start[i], len = a->seq_lens[i];
        for (int j = 0; j < n_q; j++) {
            int64_t t = a->query_start[i] + j;
            int pos = len - n_q + j;
            for (int h = 0; h < a->Hq; h++) {
                const float *q = a->q + (t * a->Hq + h) * hd;
                float *o = a->out + (t * a->Hq + h) * hd;
                int g = h / G;
                double m = -INFINITY, sum = 0;
                for (int c = 0; c <= pos; c++) { /* pass 1: the max score */
                    double s = ref_score(a, table, q, c, g);
                    if (s > m) m = s;
                }
                for (int d = 0; d < hd; d++) acc[d] = 0;
                for (int c = 0; c <= pos; c++) { /* pass 2: weights and the sum of V rows */
                    double p = exp(ref_score(a, table, q, c, g) - m);
                    int64_t v = block_offset(a, table[c / a->block_size], g) + (int64_t)(c % a->block_size) * hd;
                    sum += p;
                    for (int d = 0; d < hd; d++) acc[d] += p * kv_get(a->v_cache, a->kv_bf16, v + d);
                }
                for (int d = 0; d < hd; d++) o[d] = (float)(acc[d] / sum);
            }
        }
    }
    return MRL_OK;
}

/* ---- fast version: one work item ---- */

typedef struct attn_item {
    int32_t seq, g, t0, t1; /* query tokens t0..t1 of the batch, kv head g */
} attn_item;

/* scores[r * n_ctx + c] for the group's query head r */
typedef struct item_view {
    const mrl_paged_attn *a;
    const int32_t *table;
    const float *q; /* [G, hd] of this token */
    float *out;     /* [G, hd] */
    float *scores;  /* [G, n_ctx] */
    int n_ctx, g, G;
} item_view;

/* n elements of a cache from element `at`, as fp32: in place, or (bf16)
 * widened into buf. */
static inline const float *kv_row(float *buf, const void *cache, const int bf16, int64_t at, int n) {
    if (!bf16) return (const float *)cache + at;
    const uint16_t *h = (const uint16_t *)cache + at;
    for (int i = 0; i < n; i++) buf[i] = mrl_bf16_to_f32(h[i]);
    return buf;
}

/* Plain C: the compiler vectorises the inner loops for the caller's target.
 * A bf16 cache is widened a row at a time (a K row is block_size <= 4096
 * keys, a V row hd <= MAX_HEAD_DIM). */
static inline __attribute__((always_inline)) void scores_plain(const item_view *v, const int bf16) {
    const mrl_paged_attn *a = v->a;
    int bs = a->block_size, hd = a->hd;
    float row[MAX_BLOCK_SIZE];
    for (int c0 = 0; c0 < v->n_ctx; c0 += bs) {
        int64_t kt = block_offset(a, v->table[c0 / bs], v->g);
        int cn = v->n_ctx - c0 < bs ? v->n_ctx - c0 : bs;
        for (int r = 0; r < v->G; r++) {
            float *s = v->scores + (int64_t)r * v->n_ctx + c0;
            const float *q = v->q + (int64_t)r * hd;
            for (int c = 0; c < cn; c++) s[c] = 0;
            for (int d = 0; d < hd; d++) {
                float qd = q[d];
                const float *k = kv_row(row, a->k_cache, bf16, kt + (int64_t)d * bs, cn);
#pragma omp simd
                for (int c = 0; c < cn; c++) s[c] += qd * k[c];
            }
            for (int c = 0; c < cn; c++) s[c] *= a->scale;
        }
    }
}

static inline __attribute__((always_inline)) void values_plain(const item_view *v, const int bf16) {
    const mrl_paged_attn *a = v->a;
    int bs = a->block_size, hd = a->hd;
    float row[MAX_HEAD_DIM];
    memset(v->out, 0, (size_t)v->G * hd * sizeof(float));
    for (int c0 = 0; c0 < v->n_ctx; c0 += bs) {
        int64_t vb = block_offset(a, v->table[c0 / bs], v->g);
        int cn = v->n_ctx - c0 < bs ? v->n_ctx - c0 : bs;
        for (int r = 0; r < v->G; r++) {
            float *o = v->out + (int64_t)r * hd;
            const float *p = v->scores + (int64_t)r * v->n_ctx + c0;
            for (int c = 0; c < cn; c++) {
                float pc = p[c];
                const float *vr = kv_row(row, a->v_cache, bf16, vb + (int64_t)c * hd, hd);
#pragma omp simd
                for (int d = 0; d < hd; d++) o[d] += pc * vr[d];
            }
        }
    }
}

/* AVX-512, scores of RN query heads (from head r0) against KC chunks of 16
 * keys: chunk i starts at kp[i] (its rows d are block_size apart) and its
 * scores go to column c0 + 16 i; the last chunk is masked by mlast. RN * KC
 * accumulators stay in registers; each K vector serves RN heads. */
/* 16 elements of a cache from p (those of mask m; the others 0), fp32 or bf16. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) __m512
load16(const void *p, int64_t i, const int bf16, __mmask16 m) {
    if (bf16) { /* bf16 -> fp32 is the bits shifted up: exact. m is a prefix of the lanes (a tail) */
        const uint16_t *h = (const uint16_t *)p + i;
        uint16_t tail[16] = {0};
        if (m != 0xffff) h = memcpy(tail, h, sizeof(uint16_t) * __builtin_popcount(m)); /* no AVX512BW needed */
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
    }
    return m == 0xffff ? _mm512_loadu_ps((const float *)p + i) : _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
score_chunks_512(const item_view *v, int r0, const int RN, const void *const *kp, const int KC, __mmask16 mlast,
                 int c0, const int bf16) {
    int bs = v->a->block_size, hd = v->a->hd;
    const float *q = v->q + (int64_t)r0 * hd;
    __m512 acc[24], k[4]; /* RN * KC <= 24 */
    for (int i = 0; i < RN * KC; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        for (int i = 0; i < KC; i++) k[i] = load16(kp[i], (int64_t)d * bs, bf16, i == KC - 1 ? mlast : 0xffff);
        for (int r = 0; r < RN; r++) {
            __m512 qb = _mm512_set1_ps(q[(int64_t)r * hd + d]);
            for (int i = 0; i < KC; i++) acc[r * KC + i] = _mm512_fmadd_ps(qb, k[i], acc[r * KC + i]);
        }
    }
    __m512 scale = _mm512_set1_ps(v->a->scale);
    for (int r = 0; r < RN; r++)
        for (int i = 0; i < KC; i++)
            _mm512_mask_storeu_ps(v->scores + (int64_t)(r0 + r) * v->n_ctx + c0 + 16 * i, i == KC - 1 ? mlast : 0xffff,
                                  _mm512_mul_ps(acc[r * KC + i], scale));
}

/* The whole context for RN heads: chunks of 16 keys (block_size a multiple
 * of 16, so a chunk never straddles blocks), KC at a time, then the rest. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
scores_512(const item_view *v, int r0, const int RN, const int KC, const int bf16) {
    const mrl_paged_attn *a = v->a;
    int bs = a->block_size, n_full = v->n_ctx / 16, rem = v->n_ctx % 16, c = 0;
    const void *kp[4];
#define CHUNK_PTR(c) kv_ptr(a->k_cache, bf16, block_offset(a, v->table[(c) / bs], v->g) + (c) % bs)
    for (; c + 16 * KC <= 16 * n_full; c += 16 * KC) {
        for (int i = 0; i < KC; i++) kp[i] = CHUNK_PTR(c + 16 * i);
        score_chunks_512(v, r0, RN, kp, KC, 0xffff, c, bf16);
    }
    for (; c < 16 * n_full; c += 16) {
        kp[0] = CHUNK_PTR(c);
        score_chunks_512(v, r0, RN, kp, 1, 0xffff, c, bf16);
    }
    if (rem) {
        kp[0] = CHUNK_PTR(c);
        score_chunks_512(v, r0, RN, kp, 1, (__mmask16)((1u << rem) - 1), c, bf16);
    }
#undef CHUNK_PTR
}

/* out[r0 .. r0+RN)[d0 .. d0 + 16 DC) += sum over keys k0..k1 of p * V rows;
 * the last d-chunk masked by mlast; RN * DC accumulators in registers. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
value_chunks_512(const item_view *v, int r0, const int RN, int d0, const int DC, __mmask16 mlast, int k0, int k1,
                 const int bf16) {
    const mrl_paged_attn *a = v->a;
    int bs = a->block_size, hd = a->hd;
    __m512 acc[24]; /* RN * DC <= 24 */
    for (int r = 0; r < RN; r++)
        for (int i = 0; i < DC; i++) {
            __mmask16 m = i == DC - 1 ? mlast : 0xffff;
            acc[r * DC + i] = k0 ? _mm512_maskz_loadu_ps(m, v->out + (int64_t)(r0 + r) * hd + d0 + 16 * i)
                                 : _mm512_setzero_ps();
        }
    for (int c = k0; c < k1;) { /* keys of one block at a time */
        int64_t vb = block_offset(a, v->table[c / bs], v->g) + d0;
        int cend = (c / bs + 1) * bs < k1 ? (c / bs + 1) * bs : k1;
        for (; c < cend; c++) {
            __m512 x[4];
            int64_t row = vb + (int64_t)(c % bs) * hd;
            for (int i = 0; i < DC; i++) x[i] = load16(a->v_cache, row + 16 * i, bf16, i == DC - 1 ? mlast : 0xffff);
            for (int r = 0; r < RN; r++) {
                __m512 p = _mm512_set1_ps(v->scores[(int64_t)(r0 + r) * v->n_ctx + c]);
                for (int i = 0; i < DC; i++) acc[r * DC + i] = _mm512_fmadd_ps(p, x[i], acc[r * DC + i]);
            }
        }
    }
    for (int r = 0; r < RN; r++)
        for (int i = 0; i < DC; i++)
            _mm512_mask_storeu_ps(v->out + (int64_t)(r0 + r) * hd + d0 + 16 * i, i == DC - 1 ? mlast : 0xffff,
                                  acc[r * DC + i]);
}

/* Keys in tiles that stay in cache while every d-chunk is accumulated. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
values_512(const item_view *v, int r0, const int RN, const int DC, const int bf16) {
    int hd = v->a->hd;
    for (int k0 = 0; k0 < v->n_ctx; k0 += KEY_TILE) {
        int k1 = k0 + KEY_TILE < v->n_ctx ? k0 + KEY_TILE : v->n_ctx, d0 = 0;
        for (; d0 + 16 * DC <= hd; d0 += 16 * DC) value_chunks_512(v, r0, RN, d0, DC, 0xffff, k0, k1, bf16);
        for (; d0 < hd; d0 += 16)
            value_chunks_512(v, r0, RN, d0, 1, hd - d0 >= 16 ? 0xffff : (__mmask16)((1u << (hd - d0)) - 1), k0, k1,
                             bf16);
    }
}

/* fn (scores_512 or values_512; the bf16 products' scores_dp, values_dp
 * below) over the group's query heads: runs of 8 with C8 key (or d)
 * chunks, then the rest (1-7) in one run of up to 6 heads (7: 4 and 3)
 * with C chunks (4-24 accumulators of the 32 registers), so that a group of
 * 3, 5 or 6 heads reads each K and V vector once, not once per run of a
 * power of two; the further arguments (bf16) constants in each use (the
 * loads are compiled for them). */
#define HEAD_RUNS(fn, C8, C, ...)                                                 \
    do {                                                                          \
        int r = 0;                                                                \
        for (; r + 8 <= v->G; r += 8) fn(v, r, 8, C8, ##__VA_ARGS__);             \
        switch (v->G - r) {                                                       \
        case 7: fn(v, r, 4, C, ##__VA_ARGS__); fn(v, r + 4, 3, C, ##__VA_ARGS__); break; \
        case 6: fn(v, r, 6, C, ##__VA_ARGS__); break;                             \
        case 5: fn(v, r, 5, C, ##__VA_ARGS__); break;                             \
        case 4: fn(v, r, 4, C, ##__VA_ARGS__); break;                             \
        case 3: fn(v, r, 3, C, ##__VA_ARGS__); break;                             \
        case 2: fn(v, r, 2, C, ##__VA_ARGS__); break;                             \
        case 1: fn(v, r, 1, C, ##__VA_ARGS__); break;                             \
        }                                                                         \
    } while (0)

__attribute__((target("avx512f"))) static void scores_avx512(const item_view *v) {
    if (v->a->block_size % 16) { /* chunks would straddle blocks: the plain loops */
        if (v->a->kv_bf16) scores_plain(v, 1);
        else scores_plain(v, 0);
        return;
    }
    if (v->a->kv_bf16) HEAD_RUNS(scores_512, 2, 4, 1);
    else HEAD_RUNS(scores_512, 2, 4, 0);
}

__attribute__((target("avx512f"))) static void values_avx512(const item_view *v) {
    if (v->a->kv_bf16) HEAD_RUNS(values_512, 2, 4, 1);
    else HEAD_RUNS(values_512, 2, 4, 0);
}

/* ---- AVX512-BF16: bf16 products, fp32 sums ----
 * With a bf16 cache and vdpbf16ps the two products take bf16 operands, as
 * the bf16 model's other products do: q rounded to bf16 (once per pass) and
 * the softmax weights rounded to bf16 (after normalising), each
 * instruction summing a pair of products into an fp32 lane. K holds 16 keys
 * per row of a block ([hd][bs]): rows d and d+1 interleaved (vpermw) give
 * the pairs (K[d][j], K[d+1][j]) that meet (q[d], q[d+1]). V rows c and c+1
 * interleaved (vpunpck{l,h}wd, within 128-bit lanes) give the pairs
 * (V[c][d], V[c+1][d]) that meet the weights (p[c], p[c+1]); the outputs of
 * a 32-wide d-chunk then sit in two accumulators in lane order (d 0-3, 8-11,
 * 16-19, 24-27 and 4-7, 12-15, ...), put back in order once at the end.
 * Needs hd a multiple of 32 and block_size of 16 (pairs of keys never
 * straddle a block; K rows d and d+1 adjacent); other shapes take the fp32
 * loops above. */
#define DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

DP_TARGET static inline __attribute__((always_inline)) void
score_chunks_dp(const item_view *v, const uint32_t *qp, int r0, const int RN, const uint16_t *const *kp,
                const int KC, __mmask16 mlast, int c0) {
    int hd2 = v->a->hd / 2;
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 acc[24];
    __m512i k[4];
    for (int i = 0; i < RN * KC; i++) acc[i] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < hd2; d2++) {
        for (int i = 0; i < KC; i++) k[i] = _mm512_permutexvar_epi16(ilv, _mm512_loadu_si512(kp[i] + 32 * d2));
        for (int r = 0; r < RN; r++) {
            __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[r * hd2 + d2]);
            for (int i = 0; i < KC; i++) acc[r * KC + i] = _mm512_dpbf16_ps(acc[r * KC + i], qb, (__m512bh)k[i]);
        }
    }
    __m512 scale = _mm512_set1_ps(v->a->scale);
    for (int r = 0; r < RN; r++)
        for (int i = 0; i < KC; i++)
            _mm512_mask_storeu_ps(v->scores + (int64_t)(r0 + r) * v->n_ctx + c0 + 16 * i, i == KC - 1 ? mlast : 0xffff,
                                  _mm512_mul_ps(acc[r * KC + i], scale));
}

/* q of heads r0 .. r0+RN rounded to bf16 pairs (qp[r][d/2]). */
DP_TARGET static inline void round_pairs(uint32_t *dst, const float *src, int n) {
    for (int i = 0; i < n; i += 32)
        _mm512_storeu_si512(dst + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16),
                                                                     _mm512_loadu_ps(src + i)));
}

DP_TARGET static inline __attribute__((always_inline)) void scores_dp(const item_view *v, int r0, const int RN,
                                                                      const int KC) {
    const mrl_paged_attn *a = v->a;
    int n_full = v->n_ctx / 16, rem = v->n_ctx % 16, c = 0;
    uint32_t qp[8 * MAX_HEAD_DIM / 2];
    round_pairs(qp, v->q + (int64_t)r0 * a->hd, RN * a->hd);
    const uint16_t *kp[4];
#define CHUNK_PTR(c) ((const uint16_t *)a->k_cache + block_offset(a, v->table[(c) / 16], v->g))
    for (; c + 16 * KC <= 16 * n_full; c += 16 * KC) {
        for (int i = 0; i < KC; i++) kp[i] = CHUNK_PTR(c + 16 * i);
        score_chunks_dp(v, qp, r0, RN, kp, KC, 0xffff, c);
    }
    for (; c < 16 * n_full; c += 16) {
        kp[0] = CHUNK_PTR(c);
        score_chunks_dp(v, qp, r0, RN, kp, 1, 0xffff, c);
    }
    if (rem) { /* the keys past the context in this block are read (they are in the block) but not stored */
        kp[0] = CHUNK_PTR(c);
        score_chunks_dp(v, qp, r0, RN, kp, 1, (__mmask16)((1u << rem) - 1), c);
    }
#undef CHUNK_PTR
}

/* n fp32 weights (s) as bf16 pairs written over their own front (pp[c/2] holds keys c, c+1; the
 * pair past an odd count padded with 0); mla.c's too. */
DP_TARGET uint32_t *mrl_cpu_bf16_pairs_in_place(float *s, int n) {
    uint32_t *pp = (uint32_t *)s;
    int i = 0;
    for (; i + 32 <= n; i += 32) /* writes [i/2, i/2+16) after reading [i, i+32): never ahead of the reads */
        _mm512_storeu_si512(pp + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + i + 16), _mm512_loadu_ps(s + i)));
    if (i < n) {
        __mmask16 lo = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __mmask16 hi = n - i <= 16 ? 0 : (__mmask16)((1u << (n - i - 16)) - 1);
        __m512i w = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, s + i + 16), _mm512_maskz_loadu_ps(lo, s + i));
        _mm512_mask_storeu_epi32(pp + i / 2, (__mmask16)((1u << ((n - i + 1) / 2)) - 1), w);
    }
    return pp;
}

/* The weights of head r as bf16 pairs, over the front of its own score row. */
DP_TARGET static inline uint32_t *weight_pairs(const item_view *v, int r) {
    return mrl_cpu_bf16_pairs_in_place(v->scores + (int64_t)r * v->n_ctx, v->n_ctx);
}

/* out[r0 .. r0+RN)[d0 .. d0 + 32 DC) += the keys k0..k1 (k0 even) of V
 * times the weight pairs, the outputs in lane order (see above). */
DP_TARGET static inline __attribute__((always_inline)) void
value_chunks_dp(const item_view *v, const uint32_t *const *pp, int r0, const int RN, int d0, const int DC, int k0,
                int k1) {
    const mrl_paged_attn *a = v->a;
    int hd = a->hd;
    __m512 acc[24]; /* RN * DC * 2 <= 24 */
    for (int r = 0; r < RN; r++)
        for (int i = 0; i < 2 * DC; i++)
            acc[r * 2 * DC + i] = k0 ? _mm512_loadu_ps(v->out + (int64_t)(r0 + r) * hd + d0 + 16 * i) : _mm512_setzero_ps();
    for (int c = k0; c < k1; c += 2) {
        const uint16_t *row = (const uint16_t *)a->v_cache + block_offset(a, v->table[c / 16], v->g) +
                              (int64_t)(c % 16) * hd + d0;
        int pair = c + 1 < k1; /* an odd last key meets a zero row: the cache past the context is not read */
        for (int i = 0; i < DC; i++) {
            __m512i x0 = _mm512_loadu_si512(row + 32 * i);
            __m512i x1 = pair ? _mm512_loadu_si512(row + hd + 32 * i) : _mm512_setzero_si512();
            __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
            for (int r = 0; r < RN; r++) {
                __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[r][c / 2]);
                acc[r * 2 * DC + 2 * i] = _mm512_dpbf16_ps(acc[r * 2 * DC + 2 * i], p, lo);
                acc[r * 2 * DC + 2 * i + 1] = _mm512_dpbf16_ps(acc[r * 2 * DC + 2 * i + 1], p, hi);
            }
        }
    }
    for (int r = 0; r < RN; r++)
        for (int i = 0; i < 2 * DC; i++) _mm512_storeu_ps(v->out + (int64_t)(r0 + r) * hd + d0 + 16 * i, acc[r * 2 * DC + i]);
}

DP_TARGET static inline __attribute__((always_inline)) void values_dp(const item_view *v, int r0, const int RN,
                                                                      const int DC) {
    int hd = v->a->hd;
    const uint32_t *pp[8];
    for (int r = 0; r < RN; r++) pp[r] = weight_pairs(v, r0 + r);
    for (int k0 = 0; k0 < v->n_ctx; k0 += KEY_TILE) {
        int k1 = k0 + KEY_TILE < v->n_ctx ? k0 + KEY_TILE : v->n_ctx, d0 = 0;
        for (; d0 + 32 * DC <= hd; d0 += 32 * DC) value_chunks_dp(v, pp, r0, RN, d0, DC, k0, k1);
        for (; d0 < hd; d0 += 32) value_chunks_dp(v, pp, r0, RN, d0, 1, k0, k1);
    }
    /* lane order back to d order: chunk (lo, hi) -> (lo0 hi0 lo1 hi1 | lo2 hi2 lo3 hi3) by 128-bit lanes */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int r = 0; r < RN; r++)
        for (int d = 0; d < hd; d += 32) {
            float *o = v->out + (int64_t)(r0 + r) * hd + d;
            __m512 lo = _mm512_loadu_ps(o), hi = _mm512_loadu_ps(o + 16);
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
}


DP_TARGET static void scores_avx512_bf16(const item_view *v) { HEAD_RUNS(scores_dp, 2, 4); }
/* values: two accumulators per 32 outputs, 8 heads x 1 chunk (16), up to 6 x 2 (24) */
DP_TARGET static void values_avx512_bf16(const item_view *v) { HEAD_RUNS(values_dp, 1, 2); }

static int bf16_products = 1; /* tests turn the path off to reach the fp32 loops on this CPU */

void mrl_cpu_paged_attn_bf16_products(int on) { bf16_products = on; }
int mrl_cpu_paged_attn_bf16_products_on(void) { return bf16_products; }

/* Whether this batch takes the bf16 products. */
static int use_dp(const mrl_paged_attn *a, int level) {
    return level == 2 && bf16_products && a->kv_bf16 && a->block_size == 16 && a->hd % 32 == 0 &&
           mrl_cpu_has_avx512_bf16();
}

int mrl_cpu_paged_attn_takes_bf16_products(const mrl_paged_attn *a) { return use_dp(a, mrl_cpu_isa_level()); }

#define PLAIN(fn, v) ((v)->a->kv_bf16 ? fn##_plain(v, 1) : fn##_plain(v, 0))
__attribute__((target("avx2,fma"))) static void scores_avx2(const item_view *v) { PLAIN(scores, v); }
__attribute__((target("avx2,fma"))) static void values_avx2(const item_view *v) { PLAIN(values, v); }
static void scores_scalar(const item_view *v) { PLAIN(scores, v); }
static void values_scalar(const item_view *v) { PLAIN(values, v); }

void mrl_cpu_softmax_rows(float *s, int rows, int n) {
    for (int r = 0; r < rows; r++) {
        float *sr = s + (int64_t)r * n, m = -INFINITY;
        for (int c = 0; c < n; c++) m = sr[c] > m ? sr[c] : m;
        float inv = (float)(1.0 / mrl_vexp_sum(sr, sr, m, n));
        for (int c = 0; c < n; c++) sr[c] *= inv;
    }
}

static void attend_item(const mrl_paged_attn *a, const attn_item *it, float *scores, int level, int dp) {
    int G = a->Hq / a->Hk, hd = a->hd;
    int len = a->seq_lens[it->seq], q0 = a->query_start[it->seq];
    int n_q = a->query_start[it->seq + 1] - q0;
    item_view v = {a, a->block_tables + (int64_t)it->seq * a->max_blocks_per_seq, NULL, NULL, scores, 0, it->g, G};
    for (int t = it->t0; t < it->t1; t++) {
        v.n_ctx = len - n_q + (t - q0) + 1;
        v.q = a->q + ((int64_t)t * a->Hq + (int64_t)it->g * G) * hd;
        v.out = a->out + ((int64_t)t * a->Hq + (int64_t)it->g * G) * hd;
        if (dp) scores_avx512_bf16(&v);
        else if (level == 2) scores_avx512(&v);
        else if (level == 1) scores_avx2(&v);
        else scores_scalar(&v);
        mrl_cpu_softmax_rows(scores, G, v.n_ctx);
        if (dp) values_avx512_bf16(&v);
        else if (level == 2) values_avx512(&v);
        else if (level == 1) values_avx2(&v);
        else values_scalar(&v);
    }
}

/* ---- fast version: the batch ---- */

typedef struct attn_ctx {
    const mrl_paged_attn *a;
    const attn_item *items;
    int64_t n_items, n_chunks;
    float *scratch; /* per chunk: G * max_len scores */
    int64_t scratch_per_chunk;
    int level, dp;
} attn_ctx;

/* Chunks [b, e) of the work list: chunk c has its own score rows. */
static void attend_range(void *vctx, int64_t b, int64_t e) {
    const attn_ctx *ctx = vctx;
    for (int64_t c = b; c < e; c++) {
        int64_t i0 = ctx->n_items * c / ctx->n_chunks, i1 = ctx->n_items * (c + 1) / ctx->n_chunks;
        for (int64_t i = i0; i < i1; i++)
            attend_item(ctx->a, &ctx->items[i], ctx->scratch + c * ctx->scratch_per_chunk, ctx->level, ctx->dp);
    }
}

/* Work list and scratch sizes of a batch (shapes already checked). */
typedef struct attn_plan {
    int64_t n_items, n_chunks, per_chunk, bytes;
} attn_plan;

static attn_plan plan(const mrl_paged_attn *a) {
    attn_plan p = {0, 0, 0, 0};
    int max_len = 1;
    int64_t work = 0; /* query x key dot products */
    for (int i = 0; i < a->n_seqs; i++) {
        int n_q = a->query_start[i + 1] - a->query_start[i];
        work += (int64_t)n_q * a->seq_lens[i] * a->Hq;
        p.n_items += (int64_t)a->Hk * ((n_q + QUERY_TILE - 1) / QUERY_TILE);
        if (a->seq_lens[i] > max_len) max_len = a->seq_lens[i];
    }
    /* a few chunks of consecutive items per thread (items differ in cost);
     * one when the work is too small to pay for a parallel region */
    p.n_chunks = work * a->hd < ((int64_t)1 << 21) ? 1 : 4 * (int64_t)mrl_parallel_threads();
    if (p.n_chunks > p.n_items) p.n_chunks = p.n_items;
    p.per_chunk = ((int64_t)(a->Hq / a->Hk) * max_len + 15) & ~(int64_t)15;
    p.bytes = p.per_chunk * p.n_chunks * (int64_t)sizeof(float) + p.n_items * (int64_t)sizeof(attn_item);
    return p;
}

int64_t mrl_cpu_fast_paged_attn_workspace(const mrl_paged_attn *a) {
    if (check_args(a, "paged_attention_workspace_bytes")) return 0;
    return plan(a).bytes;
}

mrl_status mrl_cpu_fast_paged_attn(const mrl_paged_attn *a) {
    mrl_status st = check_args(a, "paged_attention");
    if (st) return st;
    attn_plan p = plan(a);
    if (p.n_items == 0) return MRL_OK;
    void *own = NULL, *ws = a->workspace;
    if (!ws || a->workspace_bytes < p.bytes) {
        if (ws)
            return mrl_set_error(MRL_ERR_INVALID, "paged_attention: workspace of %lld bytes, %lld needed",
                                 (long long)a->workspace_bytes, (long long)p.bytes);
        ws = own = malloc((size_t)p.bytes); /* not zero-filled: no page clearing per call */
        if (!own)
            return mrl_set_error(MRL_ERR_NOMEM, "paged_attention: no memory for a %lld-byte workspace",
                                 (long long)p.bytes);
    }
    float *scratch = ws;
    attn_item *items = (attn_item *)(scratch + p.per_chunk * p.n_chunks);
    int64_t k = 0;
    for (int i = 0; i < a->n_seqs; i++)
        for (int g = 0; g < a->Hk; g++)
            for (int t = a->query_start[i]; t < a->query_start[i + 1]; t += QUERY_TILE) {
                int t1 = t + QUERY_TILE < a->query_start[i + 1] ? t + QUERY_TILE : a->query_start[i + 1];
                items[k++] = (attn_item){i, g, t, t1};
            }
    int level = mrl_cpu_isa_level();
    attn_ctx ctx = {a, items, p.n_items, p.n_chunks, scratch, p.per_chunk, level, use_dp(a, level)};
    mrl_parallel_for(p.n_chunks, 1, attend_range, &ctx);
    free(own);
    return MRL_OK;
}

/* Token t's K and V rows into slot slot_mapping[t] (negative: none), as
 * fp32 or (bf16) rounded to nearest even (mrl_f32_to_bf16). */
static void kv_write_token(void *k_cache, void *v_cache, int bf16, const float *k, const float *v,
                           const int32_t *slot_mapping, int64_t t, int Hk, int hd, int block_size) {
    int32_t slot = slot_mapping[t];
    if (slot < 0) return;
    int64_t blk = slot / block_size, off = slot % block_size;
    for (int h = 0; h < Hk; h++) {
        int64_t base = (blk * Hk + h) * (int64_t)block_size * hd;
        const float *ks = k + (t * Hk + h) * (int64_t)hd, *vs = v + (t * Hk + h) * (int64_t)hd;
        if (bf16) {
            uint16_t *kc = k_cache, *vc = v_cache;
            for (int d = 0; d < hd; d++) kc[base + (int64_t)d * block_size + off] = mrl_f32_to_bf16(ks[d]);
            for (int d = 0; d < hd; d++) vc[base + off * hd + d] = mrl_f32_to_bf16(vs[d]);
        } else {
            float *kc = k_cache;
            for (int d = 0; d < hd; d++) kc[base + (int64_t)d * block_size + off] = ks[d];
            memcpy((float *)v_cache + base + off * hd, vs, (size_t)hd * sizeof(float));
        }
    }
}

void mrl_cpu_ref_paged_kv_write(float *k_cache, float *v_cache, const float *k, const float *v,
                                const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    for (int64_t t = 0; t < T; t++) kv_write_token(k_cache, v_cache, 0, k, v, slot_mapping, t, Hk, hd, block_size);
}

void mrl_cpu_ref_paged_kv_write_bf16(uint16_t *k_cache, uint16_t *v_cache, const float *k, const float *v,
                                     const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    for (int64_t t = 0; t < T; t++) kv_write_token(k_cache, v_cache, 1, k, v, slot_mapping, t, Hk, hd, block_size);
}

typedef struct kv_write_ctx {
    void *k_cache, *v_cache;
    int bf16;
    const float *k, *v;
    const int32_t *slot_mapping;
    int Hk, hd, block_size;
} kv_write_ctx;

static void kv_write_range(void *vctx, int64_t t0, int64_t t1) {
    const kv_write_ctx *c = vctx;
    for (int64_t t = t0; t < t1; t++)
        kv_write_token(c->k_cache, c->v_cache, c->bf16, c->k, c->v, c->slot_mapping, t, c->Hk, c->hd, c->block_size);
}

/* A prefill's tokens over the cores; a decode step's few on this thread (64K
 * floats per thread at least: a parallel region costs more than that copy). */
static void fast_kv_write(void *k_cache, void *v_cache, int bf16, const float *k, const float *v,
                          const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    kv_write_ctx c = {k_cache, v_cache, bf16, k, v, slot_mapping, Hk, hd, block_size};
    int64_t per_token = 2 * (int64_t)Hk * hd;
    mrl_parallel_for(T, per_token >= (1 << 16) ? 1 : (1 << 16) / per_token, kv_write_range, &c);
}

void mrl_cpu_fast_paged_kv_write(float *k_cache, float *v_cache, const float *k, const float *v,
                                 const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    fast_kv_write(k_cache, v_cache, 0, k, v, slot_mapping, T, Hk, hd, block_size);
}

void mrl_cpu_fast_paged_kv_write_bf16(uint16_t *k_cache, uint16_t *v_cache, const float *k, const float *v,
                                      const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size) {
    fast_kv_write(k_cache, v_cache, 1, k, v, slot_mapping, T, Hk, hd, block_size);
}
