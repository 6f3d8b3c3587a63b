/* Our own bf16 matrix product on AVX512-BF16 (gemm_bf16.h): vdpbf16ps
 * multiplies 16 pairs of bf16 and adds both products of each pair into one
 * fp32 lane, so both operands are packed as bf16 pairs along K.
 *
 * Packed operand: blocks of 16 lanes (rows of op(A), columns of op(B)); a
 * block holds, for each pair of k (kp = k/2), 16 dwords (a zmm), dword i =
 * (x[lane i][2kp], x[lane i][2kp+1]), lanes and k past the end zero. A
 * block of A is a panel of its own (kp stride 16 dwords); B's panels hold
 * three blocks side by side (kp stride 48), the micro-tile's width.
 *
 * Micro-tile: 8 rows x 48 columns, 24 zmm accumulators; per kp it loads 3
 * vectors of B and broadcasts 8 dwords of A into 24 vdpbf16ps (the
 * micro-tile runs near the instruction-only loop's rate, bench/gemm/gemm_bf16.c
 * and bench/RESULTS.md, "bf16 products"). Blocking (Goto), k outermost: a
 * block of KC pairs of all of op(A) and op(B) is packed (in parallel), then
 * the tiles of C (up to MC rows) take it (in parallel); a B panel's block
 * (KC x 48 dwords, 48 KB) is reused by every 8-row slice of the tile's A
 * block (MC x KC, 256 KB, in L2). KC 192-256 measured alike and above 128.
 * Every element of C sums its k in the same
 * blocks and order whatever the tiling, so results do not depend on the
 * thread count.
 *
 * Only called when the CPU has AVX512-BF16 (mrl_cpu_has_avx512_bf16);
 * compiled for it with the target pragma below, as isa_avx512.c is. */
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma")
#ifdef __clang__ /* clang ignores the GCC pragma: the same target for every function of this file */
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma"))), apply_to = function)
#endif
#include <immintrin.h>
#include <string.h>
#include "base/parallel.h"
#include "cpu/gemm_bf16.h"
#include "cpu/split.h"
#include "kernels.h" /* MRL_PANEL16 */

#define LANES 16 /* lanes of a packed block: one zmm of fp32, or of bf16 pairs */
#define MR 8     /* rows of the micro-tile */
#define NV 3     /* vectors of 16 columns in the micro-tile */
#define NR (NV * LANES)
#define KC 256   /* k pairs per block (512 k) */
#define MC 256   /* rows of C in a tile: a multiple of 16 */
#define NC_MAX (32 * NR) /* columns of C in a tile, at most */

/* Products below this many multiply-adds run on one thread (as fast.c's). */
#define PARALLEL_MACS MRL_SPLIT_ALWAYS_MACS

/* ---- packing ---------------------------------------------------------------- */

/* One operand as the packer sees it: element (lane, k) of op(X), stored at
 * p[lane * ld + k] (k_contig) or p[k * ld + lane]. */
typedef struct operand {
    const void *p;
    int bf16, k_contig;
    int64_t ld, lanes, K;
} operand;

static inline __mmask16 mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* 32 consecutive k of one lane (fewer past K: zeros) as 16 bf16 pairs. */
static inline __m512i pairs32(const operand *o, int64_t lane, int64_t k0) {
    int64_t n = o->K - k0;
    if (o->bf16) {
        const uint16_t *s = (const uint16_t *)o->p + lane * o->ld + k0;
        __mmask32 m = n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1);
        return _mm512_maskz_loadu_epi16(m, s);
    }
    const float *s = (const float *)o->p + lane * o->ld + k0;
    __m512 lo = _mm512_maskz_loadu_ps(mask16(n), s), hi = _mm512_maskz_loadu_ps(mask16(n - 16), s + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* r[i] (16 dwords each) becomes column i of the 16 x 16 dword matrix. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* group g of four rows: u[4g + c] holds, in 128-bit lane q, rows 4g..4g+3 of column 4q + c */
    for (int g = 0; g < 16; g += 4) {
        r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        __m512i v2 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee), v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        t[c] = _mm512_shuffle_i32x4(v0, v1, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(v0, v1, 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(v2, v3, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(v2, v3, 0xdd);
    }
    memcpy(r, t, sizeof t);
}

/* 16 lanes from `lane0` of one k row (k past K, lanes past the end: zeros), as bf16 in 16 words. */
static inline __m256i row16(const operand *o, int64_t k, int64_t lane0) {
    if (k >= o->K) return _mm256_setzero_si256();
    __mmask16 m = mask16(o->lanes - lane0);
    if (o->bf16) return _mm256_maskz_loadu_epi16(m, (const uint16_t *)o->p + k * o->ld + lane0);
    return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, (const float *)o->p + k * o->ld + lane0));
}

/* Block `b` (lanes 16b ..) of the packed operand, pairs kp0 .. kp0 + kc, to
 * dst (kp stride `stride` dwords; any alignment: the weight panels are the
 * caller's memory, and unaligned moves of aligned data cost nothing here). */
static void pack_block(const operand *o, int64_t b, int64_t kp0, int64_t kc, uint32_t *dst, int64_t stride) {
    int64_t lane0 = b * LANES, lanes = o->lanes - lane0 < LANES ? o->lanes - lane0 : LANES;
    if (lanes <= 0) { /* a block wholly past the end (B's last panel) */
        for (int64_t kp = 0; kp < kc; kp++) _mm512_storeu_si512(dst + kp * stride, _mm512_setzero_si512());
        return;
    }
    if (o->k_contig) { /* 16 lanes x 16 pairs at a time, transposed */
        for (int64_t kp = 0; kp < kc; kp += 16) {
            __m512i r[16];
            for (int l = 0; l < 16; l++)
                r[l] = l < lanes ? pairs32(o, lane0 + l, 2 * (kp0 + kp)) : _mm512_setzero_si512();
            transpose16(r);
            for (int j = 0; j < 16 && kp + j < kc; j++) _mm512_storeu_si512(dst + (kp + j) * stride, r[j]);
        }
        return;
    }
    /* k rows 2kp and 2kp+1, interleaved word by word */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t kp = 0; kp < kc; kp++) {
        int64_t k = 2 * (kp0 + kp);
        __m512i two = _mm512_inserti64x4(_mm512_castsi256_si512(row16(o, k, lane0)), row16(o, k + 1, lane0), 1);
        _mm512_storeu_si512(dst + kp * stride, _mm512_permutexvar_epi16(interleave, two));
    }
}

/* ---- micro-tile ------------------------------------------------------------------ */

typedef struct tile_args {
    int64_t kc;
    const uint32_t *a, *b; /* A panel at the tile's first row and kp; B panel at its kp */
    float *C;
    int64_t ldc;
    __mmask16 last; /* columns of the last vector that exist */
    float alpha, beta;
    int first; /* first k block: C = alpha acc + beta C; later ones: C += alpha acc */
    const char *pf; /* NULL, or a line to prefetch into L2 per k, from here (the weight panels' next slice) */
} tile_args;

/* mr rows x nv vectors, both constants in each instance below (the loops
 * unroll and the accumulators live in registers). */
static inline __attribute__((always_inline)) void micro(const int mr, const int nv, const tile_args *t) {
    __m512 acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    const uint32_t *a = t->a, *b = t->b;
    /* unrolled by hand's worth of pragmas: gcc -O2 leaves these loops rolled,
     * and the accumulators in memory (at well under half the rate) */
    for (int64_t k = 0; k < t->kc; k++, a += LANES, b += NR) {
        if (t->pf) _mm_prefetch(t->pf + 64 * k, _MM_HINT_T1);
        __m512bh bv[NV];
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) bv[v] = (__m512bh)_mm512_loadu_si512(b + v * LANES);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[r]);
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
        }
    }
    const __m512 alpha = _mm512_set1_ps(t->alpha), beta = _mm512_set1_ps(t->beta);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        float *c = t->C + r * t->ldc;
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) {
            __m512 x = _mm512_mul_ps(alpha, acc[r][v]);
            if (v < nv - 1 || t->last == 0xffff) { /* no masked moves where not needed: slow on AMD */
                if (!t->first) x = _mm512_add_ps(x, _mm512_loadu_ps(c + v * LANES));
                else if (t->beta != 0) x = _mm512_fmadd_ps(beta, _mm512_loadu_ps(c + v * LANES), x);
                _mm512_storeu_ps(c + v * LANES, x);
            } else {
                if (!t->first) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(t->last, c + v * LANES));
                else if (t->beta != 0) x = _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(t->last, c + v * LANES), x);
                _mm512_mask_storeu_ps(c + v * LANES, t->last, x);
            }
        }
    }
}

typedef void (*micro_fn)(const tile_args *t);
#define MICRO(mr, nv) \
    static void micro_##mr##_##nv(const tile_args *t) { micro(mr, nv, t); }
#define MICRO_ROWS(mr) MICRO(mr, 1) MICRO(mr, 2) MICRO(mr, 3)
MICRO_ROWS(1) MICRO_ROWS(2) MICRO_ROWS(3) MICRO_ROWS(4) MICRO_ROWS(5) MICRO_ROWS(6) MICRO_ROWS(7) MICRO_ROWS(8)
#define MICRO_ENTRY(mr) {micro_##mr##_1, micro_##mr##_2, micro_##mr##_3}
static const micro_fn micro_table[MR][NV] = {MICRO_ENTRY(1), MICRO_ENTRY(2), MICRO_ENTRY(3), MICRO_ENTRY(4),
                                             MICRO_ENTRY(5), MICRO_ENTRY(6), MICRO_ENTRY(7), MICRO_ENTRY(8)};

/* ---- few rows: x W^T with W read in place ---------------------------------------- */

/* A decode step's products (a few rows x W^T, W [N,K] a weight): packing
 * W would read and write all of it for a handful of rows, so W's rows are
 * read where they are, 32 k at a time, each dotted with every row of x (a
 * bf16 copy, zero-padded to a multiple of 32 k); each output is a zmm of
 * sums, added across its lanes at the end. W streams once from memory;
 * rows of x past the first 4 find its block of 8 rows in L1. */
#define PREFETCH 8 /* rows of W ahead (one block): 8 measured best of 0, 8, 16, 32 */

typedef struct few_ctx {
    const uint16_t *x; /* [M, kpad] bf16 */
    int64_t M, N, K, kpad;
    const void *W;
    int w_bf16;
    int64_t ldw;
    float alpha, beta, *C;
    int64_t ldc;
} few_ctx;

/* 32 k of W's row from k0 (fewer past K: zeros) as 32 bf16. */
static inline __m512bh w32(const few_ctx *f, const void *row, int64_t k0) {
    int64_t n = f->K - k0;
    if (f->w_bf16) {
        __mmask32 m = n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1);
        return (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)row + k0);
    }
    const float *r = (const float *)row + k0;
    return _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(mask16(n - 16), r + 16), _mm512_maskz_loadu_ps(mask16(n), r));
}

/* Rows m0 .. m0 + mm of x times W's rows n0 .. n0 + nc (mm, nc constants
 * in each use: the sums stay in registers); rows of W past N repeat the
 * last one and their sums are dropped. */
static inline __attribute__((always_inline)) void few_block(const int mm, const int nc, const few_ctx *f, int64_t m0,
                                                            int64_t n0) {
    size_t wsize = f->w_bf16 ? 2 : 4;
    const char *w[8];
#pragma GCC unroll 8
    for (int j = 0; j < nc; j++)
        w[j] = (const char *)f->W + (size_t)(n0 + j < f->N ? n0 + j : f->N - 1) * f->ldw * wsize;
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int i = 0; i < mm; i++)
#pragma GCC unroll 8
        for (int j = 0; j < nc; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < f->K; k += 32) {
        __m512bh wv[8];
#pragma GCC unroll 8
        for (int j = 0; j < nc; j++) {
            wv[j] = w32(f, w[j], k);
            _mm_prefetch(w[j] + (PREFETCH * (size_t)f->ldw + k) * wsize, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int i = 0; i < mm; i++) {
            __m512bh xv = (__m512bh)_mm512_load_si512(f->x + (m0 + i) * f->kpad + k);
#pragma GCC unroll 8
            for (int j = 0; j < nc; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mm; i++)
#pragma GCC unroll 8
        for (int j = 0; j < nc; j++)
            if (n0 + j < f->N) {
                float *c = f->C + (m0 + i) * f->ldc + n0 + j, sum = f->alpha * _mm512_reduce_add_ps(acc[i][j]);
                *c = f->beta != 0 ? sum + f->beta * *c : sum;
            }
}

/* Blocks of 8 rows of W: 4 rows of x at a time against each half, the
 * last 1-3 rows of x against all 8 (fewer sums, more rows of W in flight). */
static void few_range(void *vc, int64_t b0, int64_t b1) {
    const few_ctx *f = vc;
    for (int64_t b = b0; b < b1; b++) {
        int64_t n0 = b * 8, m0 = 0;
        for (; m0 + 4 <= f->M; m0 += 4) few_block(4, 4, f, m0, n0), few_block(4, 4, f, m0, n0 + 4);
        switch (f->M - m0) {
        case 3: few_block(2, 8, f, m0, n0), few_block(1, 8, f, m0 + 2, n0); break;
        case 2: few_block(2, 8, f, m0, n0); break;
        case 1: few_block(1, 8, f, m0, n0); break;
        }
    }
}

/* ---- driver -------------------------------------------------------------------------- */

typedef struct gemm_ctx {
    operand a, b;
    int64_t M, N, a_blocks, b_blocks;
    int64_t k0, kc;    /* the k block in hand (pairs) */
    uint32_t *Ap, *Bp; /* that block packed: ceil(M/16) panels of kc x 16, ceil(N/48) of kc x 48 */
    int64_t mc, nc, m_tiles, n_tiles;
    float alpha, beta, *C;
    int64_t ldc;
    int amx; /* AMX tiles (gemm_bf16_amx.c) instead of the vdpbf16ps micro-tile */
} gemm_ctx;

/* For AMX, block b of A as tiles: each 16 pairs of the block, 16 rows of
 * 16 dwords (row = lane: 32 consecutive k of one row of op(A)), the
 * packed block's 16 x 16 dwords transposed. kc a multiple of 16 (past K:
 * zeros). */
static void pack_block_rows(const operand *o, int64_t b, int64_t kp0, int64_t kc, uint32_t *dst) {
    pack_block(o, b, kp0, kc, dst, LANES);
    for (int64_t s = 0; s < kc; s += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(dst + (s + j) * LANES);
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + (s + j) * LANES, r[j]);
    }
}

static void pack_range(void *vc, int64_t i0, int64_t i1) {
    gemm_ctx *g = vc;
    /* AMX's tiles take 16 pairs at a time: the block's last pairs are padded with zeros */
    int64_t kc = g->amx ? (g->kc + 15) / 16 * 16 : g->kc;
    for (int64_t i = i0; i < i1; i++) {
        if (i < g->a_blocks && g->amx)
            pack_block_rows(&g->a, i, g->k0, kc, g->Ap + i * KC * LANES);
        else if (i < g->a_blocks)
            pack_block(&g->a, i, g->k0, kc, g->Ap + i * KC * LANES, LANES);
        else {
            int64_t b = i - g->a_blocks; /* block b: panel b / NV, its (b % NV)-th 16 columns */
            pack_block(&g->b, b, g->k0, kc, g->Bp + (b / NV) * KC * NR + (b % NV) * LANES, NR);
        }
    }
}

/* The tiles of C i0 .. i1 with AMX: 16 rows x one panel (48 columns) a call. */
static void tile_range_amx(const gemm_ctx *g, int64_t i0, int64_t i1) {
    int64_t kc = (g->kc + 15) / 16 * 16;
    mrl_cpu_amx_begin();
    for (int64_t i = i0; i < i1; i++) {
        int64_t m0 = i / g->n_tiles * g->mc, n0 = i % g->n_tiles * g->nc;
        int64_t m1 = m0 + g->mc < g->M ? m0 + g->mc : g->M, n1 = n0 + g->nc < g->N ? n0 + g->nc : g->N;
        for (int64_t n = n0; n < n1; n += NR)
            for (int64_t m = m0; m < m1; m += LANES)
                mrl_cpu_amx_panel_block(g->Ap + m / LANES * KC * LANES, g->Bp + n / NR * KC * NR, kc,
                                        g->C + m * g->ldc + n, g->ldc, m1 - m < LANES ? m1 - m : LANES,
                                        n1 - n < NR ? n1 - n : NR, g->alpha, g->beta, g->k0 == 0);
    }
    mrl_cpu_amx_end();
}

static void tile_range(void *vc, int64_t i0, int64_t i1) {
    const gemm_ctx *g = vc;
    if (g->amx) {
        tile_range_amx(g, i0, i1);
        return;
    }
    tile_args t = {.kc = g->kc, .ldc = g->ldc, .alpha = g->alpha, .beta = g->beta, .first = g->k0 == 0};
    for (int64_t i = i0; i < i1; i++) {
        int64_t m0 = i / g->n_tiles * g->mc, n0 = i % g->n_tiles * g->nc;
        int64_t m1 = m0 + g->mc < g->M ? m0 + g->mc : g->M, n1 = n0 + g->nc < g->N ? n0 + g->nc : g->N;
        for (int64_t n = n0; n < n1; n += NR) {
            int64_t cols = n1 - n < NR ? n1 - n : NR, nv = (cols + LANES - 1) / LANES;
            t.b = g->Bp + n / NR * KC * NR;
            t.last = mask16(cols - (nv - 1) * LANES);
            for (int64_t m = m0; m < m1; m += MR) {
                int64_t rows = m1 - m < MR ? m1 - m : MR;
                t.a = g->Ap + m / LANES * KC * LANES + m % LANES;
                t.C = g->C + m * g->ldc + n;
                micro_table[rows - 1][nv - 1](&t);
            }
        }
    }
}

/* Goto's loop with the k blocks outermost: each block of KC pairs of all of
 * op(A) and op(B) is packed (in parallel), then every tile of C takes that
 * block (in parallel). The packed copy is one block, not the whole
 * operands: 4 KC (M + N) bytes, 50 MB for a 49152-row head. */
static int packed_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                       int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                       int64_t ldc, int amx) {
    gemm_ctx g = {.a = {A, a_bf16, !trans_a, lda, M, K}, .b = {B, b_bf16, trans_b, ldb, N, K},
                  .M = M, .N = N, .alpha = alpha, .beta = beta, .C = C, .ldc = ldc, .amx = amx};
    g.a_blocks = (M + LANES - 1) / LANES;
    int64_t b_panels = (N + NR - 1) / NR, Kp = (K + 1) / 2;
    g.b_blocks = b_panels * NV; /* blocks past N are packed as zeros */
    size_t a_bytes = (size_t)g.a_blocks * KC * LANES * 4, b_bytes = (size_t)b_panels * KC * NR * 4;
    char *scratch = mrl_cpu_bf16_scratch_take(a_bytes + b_bytes);
    if (!scratch) return -1;
    g.Ap = (uint32_t *)scratch;
    g.Bp = (uint32_t *)(scratch + a_bytes);

    int threads = M * N * K < PARALLEL_MACS ? 1 : mrl_parallel_threads();
    /* tiles: up to MC rows, as even as whole blocks of 16 allow (262 rows: 144 + 118, not
     * 256 + 6, which left one thread the small tiles), and columns cut so that there are
     * about 4 tiles a thread */
    g.m_tiles = (M + MC - 1) / MC;
    g.mc = ((M + g.m_tiles - 1) / g.m_tiles + LANES - 1) / LANES * LANES;
    g.m_tiles = (M + g.mc - 1) / g.mc;
    int64_t want = (4 * threads + g.m_tiles - 1) / g.m_tiles;
    g.nc = (b_panels + want - 1) / want * NR;
    if (g.nc > NC_MAX) g.nc = NC_MAX;
    g.n_tiles = (N + g.nc - 1) / g.nc;

    for (g.k0 = 0; g.k0 < Kp; g.k0 += KC) {
        g.kc = Kp - g.k0 < KC ? Kp - g.k0 : KC;
        if (threads == 1) {
            pack_range(&g, 0, g.a_blocks + g.b_blocks);
            tile_range(&g, 0, g.m_tiles * g.n_tiles);
        } else {
            mrl_parallel_for(g.a_blocks + g.b_blocks, 1, pack_range, &g);
            mrl_parallel_for(g.m_tiles * g.n_tiles, 1, tile_range, &g);
        }
    }
    mrl_cpu_bf16_scratch_give(scratch);
    return 0;
}

/* x W^T for M <= MRL_BF16_FEW_ROWS rows (trans_a 0, trans_b 1). */
static int few_gemm(int64_t M, int64_t N, int64_t K, float alpha, const void *A, int a_bf16, int64_t lda,
                    const void *W, int w_bf16, int64_t ldw, float beta, float *C, int64_t ldc) {
    int64_t kpad = (K + 31) / 32 * 32;
    uint16_t *x = mrl_cpu_bf16_scratch_take((size_t)M * kpad * 2);
    if (!x) return -1;
    for (int64_t m = 0; m < M; m++) { /* the bf16 copy of x, zeros past K */
        const operand row = {(const char *)A + (size_t)m * lda * (a_bf16 ? 2 : 4), a_bf16, 1, 0, 1, K};
        for (int64_t k = 0; k < kpad; k += 32) _mm512_store_si512(x + m * kpad + k, pairs32(&row, 0, k));
    }
    few_ctx f = {x, M, N, K, kpad, W, w_bf16, ldw, alpha, beta, C, ldc};
    int64_t blocks = (N + 7) / 8;
    /* threads from a smaller size than the packed path's: these products are
     * bound by reading W, and a second core reads more of it. From
     * PARALLEL_MACS multiply-adds always; below it (a decode step of one row
     * makes dozens of such products) by measurement (cpu/split.h): on a
     * machine with more runnable threads than cores each parallel region
     * waits for its second thread to be scheduled, on an idle one splitting
     * is faster (bench/RESULTS.md, "Decode on two threads"). Our kernel's
     * bits do not depend on the split. */
    static _Thread_local mrl_split_choice choice;
    int measured, split = mrl_split_weights(&choice, N * K, M * N * K, mrl_parallel_threads(), &measured);
    double t0 = mrl_split_now();
    if (split) mrl_parallel_for(blocks, 4, few_range, &f);
    else few_range(&f, 0, blocks);
    if (measured) mrl_split_record(&choice, mrl_split_now() - t0, (double)M * N * K);
    mrl_cpu_bf16_scratch_give(x);
    return 0;
}

/* ---- B as bf16 weight panels (kernels.h, MRL_PANEL16) ------------------------------- */

/* The engine keeps its weights packed once per update in the layout the
 * micro-tile reads (a panel of 48 columns is B's packed panel over all of
 * K), so a product with them packs only its few rows of A: nothing of W is
 * read twice from memory or rewritten per call, and each panel streams
 * contiguously. */
_Static_assert(NR == MRL_PANEL16, "bf16 weight panels are the micro-tile's width");

typedef struct panels_arg {
    uint32_t *P;
    const uint16_t *W;
    int64_t N, K;
} panels_arg;

static void panels_pack_range(void *vc, int64_t b0, int64_t b1) {
    const panels_arg *a = vc;
    const operand w = {a->W, 1, 1, a->K, a->N, a->K};
    int64_t Kp = (a->K + 1) / 2;
    for (int64_t b = b0; b < b1; b++) /* block b: panel b / NV, its (b % NV)-th 16 columns */
        pack_block(&w, b, 0, Kp, a->P + (b / NV) * Kp * NR + (b % NV) * LANES, NR);
}

int mrl_cpu_panels16_pack_own(uint32_t *P, const uint16_t *W, int64_t N, int64_t K) {
    if (!mrl_cpu_has_avx512_bf16()) return -1;
    panels_arg a = {P, W, N, K};
    int64_t blocks = (N + NR - 1) / NR * NV;
    if (N * K < PARALLEL_MACS) panels_pack_range(&a, 0, blocks);
    else mrl_parallel_for(blocks, NV, panels_pack_range, &a);
    return 0;
}

/* A group of products x W_i^T with one A (the engine's q, k, v and its gate,
 * up): A packed once over all of K, the panels of every W_i counted as one
 * row of panels, cut evenly between the threads in one parallel region. */
#define GROUP_MAX 8
typedef struct pgemm_ctx {
    const uint32_t *Ap;       /* A packed over all of K (ceil(M/16) panels of Kp x 16) */
    int64_t M, Kp, mc, m_tiles, panels, n_chunks;
    int n;
    const mrl_panels_part *w;   /* the products (their W16 unread) */
    int64_t panel0[GROUP_MAX];  /* product i's first panel in the group's row */
} pgemm_ctx;

/* Panel pn (48 columns) of product i for rows m0 .. m1. The panel is
 * walked from its first k block to its last (it lies contiguous in memory:
 * one stream), and within a k block its slice (KC x 48 dwords) is read once
 * from memory and then from cache by the other 8-row slices. Every element
 * sums its k in the same blocks and order as packed_gemm's, whatever M and
 * the tiling. */
static void panel_rows(const pgemm_ctx *g, int i, int64_t pn, int64_t m0, int64_t m1) {
    tile_args t = {.ldc = g->w[i].ldc, .alpha = g->w[i].alpha, .beta = g->w[i].beta};
    int64_t n = pn * NR, cols = g->w[i].N - n < NR ? g->w[i].N - n : NR, nv = (cols + LANES - 1) / LANES;
    t.last = mask16(cols - (nv - 1) * LANES);
    for (int64_t k0 = 0; k0 < g->Kp; k0 += KC) {
        t.kc = g->Kp - k0 < KC ? g->Kp - k0 : KC;
        t.first = k0 == 0;
        t.b = g->w[i].P + pn * g->Kp * NR + k0 * NR;
        /* the first 8-row slice reads the panel's slice from memory, the others
         * from cache: those fetch the next slice (it follows this one in memory,
         * in this panel or the next) a line per k, so that the memory stream runs
         * under their arithmetic instead of stalling the next first slice */
        const char *next = (const char *)(t.b + t.kc * NR);
        int64_t next_bytes = (int64_t)KC * NR * 4;
        for (int64_t m = m0, j = 0; m < m1; m += MR, j++) {
            int64_t rows = m1 - m < MR ? m1 - m : MR;
            t.a = g->Ap + m / LANES * g->Kp * LANES + k0 * LANES + m % LANES;
            t.C = g->w[i].C + m * t.ldc + n;
            t.pf = j > 0 && (j - 1) * t.kc * 64 < next_bytes ? next + (j - 1) * t.kc * 64 : NULL;
            micro_table[rows - 1][nv - 1](&t);
        }
    }
}

/* Chunks c0 .. c1: chunk c is row tile c / (n_chunks / m_tiles) and an even
 * share of the group's row of panels. */
static void panels_chunk_range(void *vc, int64_t c0, int64_t c1) {
    const pgemm_ctx *g = vc;
    int64_t per_tile = g->n_chunks / g->m_tiles;
    for (int64_t c = c0; c < c1; c++) {
        int64_t mt = c / per_tile, j = c % per_tile;
        int64_t m0 = mt * g->mc, m1 = m0 + g->mc < g->M ? m0 + g->mc : g->M;
        int64_t p0 = g->panels * j / per_tile, p1 = g->panels * (j + 1) / per_tile;
        for (int i = 0; i < g->n; i++) {
            int64_t first = g->panel0[i], end = first + (g->w[i].N + NR - 1) / NR;
            for (int64_t p = p0 > first ? p0 : first; p < p1 && p < end; p++) panel_rows(g, i, p - first, m0, m1);
        }
    }
}

static void panels_pack_a(void *vc, int64_t b0, int64_t b1) {
    const gemm_ctx *g = vc; /* only .a, .k0 = 0, .kc = all pairs, .Ap */
    for (int64_t b = b0; b < b1; b++) pack_block(&g->a, b, 0, g->kc, g->Ap + b * g->kc * LANES, LANES);
}

int mrl_cpu_gemm_bf16_panels_group_own(int64_t M, int64_t K, const float *A, int64_t lda, int n,
                                       const mrl_panels_part *w) {
    if (!mrl_cpu_has_avx512_bf16()) return -1;
    if (M <= 0 || K <= 0 || n < 1 || n > GROUP_MAX) return -1; /* the dispatcher handles those */
    int64_t Kp = (K + 1) / 2, a_blocks = (M + LANES - 1) / LANES, N = 0;
    pgemm_ctx g = {.M = M, .Kp = Kp, .n = n, .w = w};
    for (int i = 0; i < n; i++) {
        if (w[i].N <= 0) return -1;
        g.panel0[i] = g.panels;
        g.panels += (w[i].N + NR - 1) / NR;
        N += w[i].N;
    }
    uint32_t *Ap = mrl_cpu_bf16_scratch_take((size_t)a_blocks * Kp * LANES * 4);
    if (!Ap) return -1;
    g.Ap = Ap;
    gemm_ctx pack = {.a = {A, 0, 1, lda, M, K}, .kc = Kp, .Ap = Ap};
    /* threads as few_gemm's: these are bound by reading W for a few rows */
    static _Thread_local mrl_split_choice choice;
    int threads = mrl_parallel_threads(), measured;
    if (!mrl_split_weights(&choice, N * K, M * N * K, threads, &measured)) threads = 1;
    /* row tiles of up to MC rows, as even as whole blocks of 16 allow; about 4 chunks a thread */
    g.m_tiles = (M + MC - 1) / MC;
    g.mc = ((M + g.m_tiles - 1) / g.m_tiles + LANES - 1) / LANES * LANES;
    g.m_tiles = (M + g.mc - 1) / g.mc;
    int64_t per_tile = (4 * threads + g.m_tiles - 1) / g.m_tiles;
    if (per_tile > g.panels) per_tile = g.panels;
    g.n_chunks = g.m_tiles * per_tile;
    double t0 = mrl_split_now();
    if (threads == 1 || a_blocks < 16) panels_pack_a(&pack, 0, a_blocks);
    else mrl_parallel_for(a_blocks, 1, panels_pack_a, &pack);
    if (threads == 1) panels_chunk_range(&g, 0, g.n_chunks);
    else mrl_parallel_for(g.n_chunks, 1, panels_chunk_range, &g);
    if (measured) mrl_split_record(&choice, mrl_split_now() - t0, (double)M * N * K);
    mrl_cpu_bf16_scratch_give(Ap);
    return 0;
}

int mrl_cpu_gemm_bf16_panels_own(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                                 const uint32_t *P, float beta, float *C, int64_t ldc) {
    mrl_panels_part w = {N, P, NULL, 0, alpha, beta, C, ldc};
    return mrl_cpu_gemm_bf16_panels_group_own(M, K, A, lda, 1, &w);
}

int mrl_cpu_gemm_bf16_own(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                          int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                          int64_t ldc) {
    if (!mrl_cpu_has_avx512_bf16()) return -1;
    if (M <= 0 || N <= 0 || K <= 0) return -1; /* the dispatcher handles those */
    if (!trans_a && trans_b && M <= MRL_BF16_FEW_ROWS)
        return few_gemm(M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc);
    return packed_gemm(trans_a, trans_b, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc, 0);
}

/* The same driver with AMX tiles for the micro-tile (gemm_bf16.h): the
 * packed B panels are AMX's B layout, A's blocks are packed as rows. */
int mrl_cpu_gemm_bf16_amx(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                          int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                          int64_t ldc) {
    if (!mrl_cpu_has_amx_bf16()) return -1;
    if (M <= 0 || N <= 0 || K <= 0) return -1; /* the dispatcher handles those */
    return packed_gemm(trans_a, trans_b, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc, 1);
}

#ifdef __clang__
#pragma clang attribute pop
#endif
