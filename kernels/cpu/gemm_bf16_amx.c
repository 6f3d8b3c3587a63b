/* Our own AMX kernels (gemm_bf16.h): x W^T with W as bf16 weight panels
 * (kernels.h MRL_PANEL16), the products of a decode step on a CPU with AMX;
 * and the micro-tile that gemm_bf16_avx512.c's packed driver calls for any
 * product (mrl_cpu_gemm_bf16_amx: its packed B is the panels' layout, its A
 * blocks are packed as tile rows for it).
 *
 * Why ours: oneDNN's AMX matmul packs W on every call (it cannot know the
 * panels are already the tile layout), which for a decode step's few rows
 * reads and writes all of W to compute a handful of outputs. The panels are
 * AMX's B layout already: a panel's row kp holds 48 dwords, dword n =
 * (W[n][2kp], W[n][2kp+1]), so 16 consecutive rows and 16 columns are one B
 * tile (16 rows of 64 bytes at a stride of 192), loaded straight from the
 * panels with no copy.
 *
 * Tiles: C 16 rows x 16 columns fp32 (tmm0-2: the panel's three column
 * blocks), A 16 rows x 32 k bf16 (tmm3, a zero-padded bf16 copy of x), B
 * 16 pairs x 16 columns (tmm4-6). One tdpbf16ps is 16 x 16 x 32 multiply-
 * adds; for each block of 16 rows of x the panel is walked over all of K
 * (from memory for the first block, from L2 for the others: a panel is at
 * most Kp x 192 bytes, 192 KB at K = 2048) and C leaves the tiles once.
 * Every element of C sums its k in the same 32-k steps and order whatever
 * M, the thread count and the group, so results do not depend on them.
 *
 * K past the last multiple of 32 (an odd size; no model's hidden or
 * intermediate size) is added after the tiles with vdpbf16ps, last in each
 * element's sum: a partial tile would read past a panel's end, and a tile
 * configuration of its own would cost a reload of the accumulators.
 *
 * Linux hands AMX's tile state to a process only on request (arch_prctl
 * ARCH_REQ_XCOMP_PERM): without that grant the first tile instruction is
 * SIGILL, so the CPU probe (core/base/cpu.h) asks once, and
 * mrl_cpu_has_amx_bf16 says 0 when refused.
 * Compiled for AMX with the target pragma below; only called when the CPU
 * has it. */
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma")
#ifdef __clang__ /* clang ignores the GCC pragma: the same target for every function of this file */
#pragma clang attribute push(__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma"))), apply_to = function)
#endif
#include <immintrin.h>
#include <string.h>
#include "base/parallel.h"
#include "cpu/gemm_bf16.h"
#include "cpu/split.h"
#include "kernels.h" /* MRL_PANEL16, mrl_panels_part */

#define NR MRL_PANEL16 /* columns of a panel: three C tiles */
#define TILE 16        /* rows of a tile; columns of a C or B tile */
#define KSTEP 32       /* k per tdpbf16ps */
#define GROUP_MAX 8

/* The tile configuration (palette 1): every tile 16 rows of 64 bytes. */
typedef struct __attribute__((packed, aligned(64))) tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void tiles_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.colsb[t] = 64, cfg.rows[t] = TILE;
    /* gcc's _tile_loadconfig tells the compiler it reads 8 bytes of cfg, so the
     * stores above were dropped as dead (seen: ldtilecfg of a zeroed config,
     * then SIGILL at the first tile instruction): say all 64 are read */
    __asm__ volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* C (rows x cols of a 16 x 48 block) from the tiles' sums `out`: first, C =
 * alpha out + beta C (beta 0: C unread, NaN included); else C += alpha out. */
static void tiles_store(float out[TILE][NR], float *C, int64_t ldc, int64_t rows, int64_t cols, float alpha,
                        float beta, int first) {
    __mmask16 last = (__mmask16)((1u << (cols - (cols - 1) / TILE * TILE)) - 1);
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    for (int64_t r = 0; r < rows; r++) {
        float *c = C + r * ldc;
        for (int64_t v = 0; v * TILE < cols; v++) {
            __mmask16 m = (v + 1) * TILE <= cols ? (__mmask16)0xffff : last;
            __m512 y = _mm512_mul_ps(va, _mm512_load_ps(&out[r][v * TILE]));
            if (!first) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, c + v * TILE));
            else if (beta != 0) y = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, c + v * TILE), y);
            _mm512_mask_storeu_ps(c + v * TILE, m, y);
        }
    }
}

/* out = the sums of `steps` tile steps: A tile s at a + s * a_step bytes
 * (rows a_stride bytes apart), B tiles at b + s * 16 rows of the panel. */
static inline void tiles_sum(const char *a, int64_t a_step, int64_t a_stride, const uint32_t *b, int64_t steps,
                             float out[TILE][NR]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t s = 0; s < steps; s++, a += a_step, b += TILE * NR) {
        _tile_loadd(3, a, a_stride);
        _tile_loadd(4, b, NR * 4);
        _tile_loadd(5, b + TILE, NR * 4);
        _tile_loadd(6, b + 2 * TILE, NR * 4);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(0, &out[0][0], NR * 4);
    _tile_stored(1, &out[0][TILE], NR * 4);
    _tile_stored(2, &out[0][2 * TILE], NR * 4);
}

void mrl_cpu_amx_begin(void) { tiles_configure(); }
void mrl_cpu_amx_end(void) { _tile_release(); }

/* The packed driver's micro-tile (gemm_bf16_avx512.c, gemm_bf16.h). */
void mrl_cpu_amx_panel_block(const uint32_t *a, const uint32_t *b, int64_t kc, float *C, int64_t ldc, int64_t rows,
                             int64_t cols, float alpha, float beta, int first) {
    float out[TILE][NR] __attribute__((aligned(64)));
    tiles_sum((const char *)a, TILE * TILE * 4, TILE * 4, b, kc / TILE, out);
    tiles_store(out, C, ldc, rows, cols, alpha, beta, first);
}

typedef struct amx_ctx {
    const uint16_t *x;        /* A as bf16 [m_blocks * 16, kpad], zero past M and K */
    int64_t M, K, Kp, kfull, kpad, panels, n_chunks; /* kfull: K's whole tile steps; kpad: K rounded up to them */
    int n;
    const mrl_panels_part *w;
    int64_t panel0[GROUP_MAX]; /* product i's first panel in the group's row */
} amx_ctx;

/* Panel pn (48 columns) of product i, for every block of 16 rows of x. */
static void panel_amx(const amx_ctx *g, int i, int64_t pn) {
    const mrl_panels_part *p = &g->w[i];
    const uint32_t *panel = p->P + pn * g->Kp * NR;
    int64_t n0 = pn * NR, cols = p->N - n0 < NR ? p->N - n0 : NR;
    float out[TILE][NR] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < g->M; m0 += TILE) {
        const uint16_t *xa = g->x + m0 * g->kpad;
        tiles_sum((const char *)xa, KSTEP * 2, g->kpad * 2, panel, g->kfull / KSTEP, out);
        int64_t rows = g->M - m0 < TILE ? g->M - m0 : TILE;
        for (int64_t r = 0; r < rows; r++) /* the k past the tiles: a pair of x times the panel's row */
            for (int64_t kp = g->kfull / 2; kp < g->Kp; kp++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(xa + r * g->kpad))[kp]);
                for (int v = 0; v < 3; v++) {
                    __m512bh b = (__m512bh)_mm512_loadu_si512(panel + kp * NR + v * TILE);
                    _mm512_store_ps(&out[r][v * TILE], _mm512_dpbf16_ps(_mm512_load_ps(&out[r][v * TILE]), a, b));
                }
            }
        tiles_store(out, p->C + m0 * p->ldc + n0, p->ldc, rows, cols, p->alpha, p->beta, 1);
    }
}

/* Chunks c0 .. c1 of the group's row of panels, evenly. */
static void amx_range(void *vc, int64_t c0, int64_t c1) {
    const amx_ctx *g = vc;
    tiles_configure(); /* per thread: the configuration is thread state */
    int64_t p0 = g->panels * c0 / g->n_chunks, p1 = g->panels * c1 / g->n_chunks;
    for (int i = 0; i < g->n; i++) {
        int64_t first = g->panel0[i], end = first + (g->w[i].N + NR - 1) / NR;
        for (int64_t p = p0 > first ? p0 : first; p < p1 && p < end; p++) panel_amx(g, i, p - first);
    }
    _tile_release(); /* a thread that holds no tiles has less state to save at a switch */
}

/* x fp32 [M, K] (lda) to bf16 [m_blocks * 16, kpad], zero past M and K. Rounded
 * as the AVX512-BF16 kernel's packing does (vcvtne2ps2bf16: to nearest
 * even; the tiles read denormals as zero anyway). */
static inline __mmask16 mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}
static void x_to_bf16(uint16_t *dst, const float *A, int64_t lda, int64_t M, int64_t rows, int64_t K, int64_t kpad) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t k = 0; k < kpad; k += KSTEP) {
            __m512i v = _mm512_setzero_si512();
            if (m < M) {
                const float *s = A + m * lda + k;
                v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(mask16(K - k - 16), s + 16),
                                                 _mm512_maskz_loadu_ps(mask16(K - k), s));
            }
            _mm512_storeu_si512(dst + m * kpad + k, v);
        }
}

int mrl_cpu_gemm_bf16_panels_group_amx(int64_t M, int64_t K, const float *A, int64_t lda, int n,
                                       const mrl_panels_part *w) {
    if (!mrl_cpu_has_amx_bf16()) return -1;
    if (M <= 0 || K <= 0 || n < 1 || n > GROUP_MAX) return -1;
    amx_ctx g = {.M = M, .K = K, .Kp = (K + 1) / 2, .kfull = K / KSTEP * KSTEP, .n = n, .w = w};
    g.kpad = (K + KSTEP - 1) / KSTEP * KSTEP;
    int64_t N = 0;
    for (int i = 0; i < n; i++) {
        if (w[i].N <= 0) return -1;
        g.panel0[i] = g.panels;
        g.panels += (w[i].N + NR - 1) / NR;
        N += w[i].N;
    }
    int64_t rows = (M + TILE - 1) / TILE * TILE;
    uint16_t *x = mrl_cpu_bf16_scratch_take((size_t)rows * g.kpad * 2);
    if (!x) return -1;
    x_to_bf16(x, A, lda, M, rows, K, g.kpad);
    g.x = x;
    /* threads as the AVX-512 kernel's: bound by reading W for a few rows */
    static _Thread_local mrl_split_choice choice;
    int threads = mrl_parallel_threads(), measured;
    int split = mrl_split_weights(&choice, N * K, M * N * K, threads, &measured);
    g.n_chunks = split ? 4 * threads : 1;
    if (g.n_chunks > g.panels) g.n_chunks = g.panels;
    double t0 = mrl_split_now();
    if (!split) amx_range(&g, 0, g.n_chunks);
    else mrl_parallel_for(g.n_chunks, 1, amx_range, &g);
    if (measured) mrl_split_record(&choice, mrl_split_now() - t0, (double)M * N * K);
    mrl_cpu_bf16_scratch_give(x);
    return 0;
}
#ifdef __clang__
#pragma clang attribute pop
#endif
