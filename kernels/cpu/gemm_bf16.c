/* bf16 matrix products: the reference, the conversions, the per-thread
 * scratch of the fast paths and the choice between them (gemm_bf16.h).
 * The kernels themselves are in gemm_bf16_avx512.c and gemm_bf16_onednn.c. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include "moonrl/dtype.h"
#include "moonrl/mem.h"
#include "base/cpu.h"
#include "cpu/gemm_bf16.h"
#include "kernels.h" /* the bf16 weight panels */

/* ---- conversions ---------------------------------------------------------- */

/* Not vcvtne2ps2bf16: it flushes denormals to zero (measured on Zen 4, as
 * Intel documents), and these copies must keep the bits of mrl_f32_to_bf16.
 * convert.c's AVX-512 integer rounding is as fast here: the loop is bound
 * by memory, and it is already parallel. (The kernels' own packing does use
 * the instruction: dpbf16 reads denormals as zero anyway.) */
void mrl_cpu_bf16_from_f32(uint16_t *dst, const float *src, int64_t n) { mrl_convert_f32_to_bf16(src, dst, n); }
void mrl_cpu_bf16_to_f32(float *dst, const uint16_t *src, int64_t n) { mrl_convert_bf16_to_f32(src, dst, n); }

/* ---- reference ---------------------------------------------------------------- */

/* op(X)'s element (i, k) as its bf16 value, X [rows, cols] with leading dimension ld. */
static inline double bf16_at(const void *X, int bf16, int64_t ld, int trans, int64_t i, int64_t k) {
    int64_t at = trans ? k * ld + i : i * ld + k;
    uint16_t h = bf16 ? ((const uint16_t *)X)[at] : mrl_f32_to_bf16(((const float *)X)[at]);
    return mrl_bf16_to_f32(h);
}

/* Products of two bf16 values are exact in double (and in fp32), and so is
 * a sum of K of them to within K 2^-53 of its size: this C is the exact
 * product rounded once to fp32, what every fast path is compared with. */
void mrl_cpu_gemm_bf16_reference(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                                 const void *A, int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb,
                                 float beta, float *C, int64_t ldc) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double sum = 0;
            if (alpha != 0)
                for (int64_t k = 0; k < K; k++)
                    sum += bf16_at(A, a_bf16, lda, trans_a, m, k) * bf16_at(B, b_bf16, ldb, !trans_b, n, k);
            float *c = C + m * ldc + n;
            *c = (float)((double)alpha * sum + (beta != 0 ? (double)beta * *c : 0.0));
        }
}

void mrl_cpu_gemm_bf16_panels_reference(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                                        const uint32_t *P, float beta, float *C, int64_t ldc) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double sum = 0;
            if (alpha != 0)
                for (int64_t k = 0; k < K; k++)
                    sum += bf16_at(A, 0, lda, 0, m, k) * mrl_bf16_to_f32(mrl_panel16_at(P, K, n, k));
            float *c = C + m * ldc + n;
            *c = (float)((double)alpha * sum + (beta != 0 ? (double)beta * *c : 0.0));
        }
}

/* ---- per-thread scratch ----------------------------------------------------------- */

/* One buffer per calling thread, kept between products: a decode step makes
 * hundreds of small products, and allocating (and zero-filling) their packed
 * copies each time would cost as much as the arithmetic. Requests above
 * SCRATCH_KEEP get a buffer of their own, freed after the product, so that
 * one large product does not pin its memory for the life of the thread.
 * Accounted as "other" (kernel workspace that outlives any one model), not
 * as a model's activations. */
#define SCRATCH_KEEP ((size_t)64 << 20)

typedef struct scratch_buf {
    void *p;
    size_t bytes;
} scratch_buf;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_destroy(void *v) {
    scratch_buf *s = v;
    mrl_mem_free(s->p);
    free(s);
}
static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_destroy); }

void *mrl_cpu_bf16_scratch_take(size_t bytes) {
    if (bytes > SCRATCH_KEEP) return mrl_mem_alloc(bytes, MRL_MEM_OTHER);
    pthread_once(&scratch_once, scratch_init);
    scratch_buf *s = pthread_getspecific(scratch_key);
    if (!s) {
        if (!(s = calloc(1, sizeof *s))) return NULL;
        pthread_setspecific(scratch_key, s);
    }
    if (s->bytes < bytes) {
        mrl_mem_free(s->p);
        size_t grown = bytes + bytes / 2 < SCRATCH_KEEP ? bytes + bytes / 2 : SCRATCH_KEEP;
        s->p = mrl_mem_alloc(grown, MRL_MEM_OTHER);
        s->bytes = s->p ? grown : 0;
    }
    return s->p;
}

void mrl_cpu_bf16_scratch_give(void *p) {
    scratch_buf *s = pthread_getspecific(scratch_key);
    if (p && (!s || p != s->p)) mrl_mem_free(p);
}

/* ---- the choice ---------------------------------------------------------------------- */

int mrl_cpu_has_avx512_bf16(void) {
    const mrl_cpu_info *c = mrl_cpu();
    return c->avx512bf16 && c->avx512bw && c->avx512vl && c->avx512dq;
}

/* The tiles' tails and the few-rows products are AVX512-BF16 code. */
int mrl_cpu_has_amx_bf16(void) { return mrl_cpu_has_avx512_bf16() && mrl_cpu()->amx_tiles; }

/* oneDNN with bf16 hardware (AVX512-BF16 or AMX): without it oneDNN would
 * emulate bf16, slower than the fp32 path. */
static int onednn_bf16(void) {
    const char *isa = mrl_cpu_onednn_isa();
    return isa && (strcmp(isa, "avx512_core_bf16") == 0 || strcmp(isa, "avx512_core_amx") == 0);
}

int mrl_cpu_bf16_has_path(mrl_bf16_path path) {
    switch (path) {
    case MRL_BF16_AUTO:
    case MRL_BF16_REFERENCE: return 1;
    case MRL_BF16_OWN: return mrl_cpu_has_avx512_bf16();
    case MRL_BF16_ONEDNN: return onednn_bf16();
    case MRL_BF16_AMX: return mrl_cpu_has_amx_bf16();
    default: return 0;
    }
}

int mrl_cpu_bf16_available(void) { return mrl_cpu_has_avx512_bf16() || onednn_bf16(); }

static mrl_bf16_path forced = MRL_BF16_AUTO;

int mrl_cpu_bf16_force_path(mrl_bf16_path path) {
    if (!mrl_cpu_bf16_has_path(path)) return -1;
    forced = path;
    return 0;
}

/* The rule, from bench/gemm/gemm_bf16.c (bench/RESULTS.md, "bf16 products",
 * on AVX512-BF16 without AMX and on AMX):
 *   - x W^T with at most MRL_BF16_FEW_ROWS rows (decode): our kernel, which
 *     reads W in place. Bound by reading W, it beat oneDNN (which packs W
 *     and pays more per call) up to 16 rows; from 32 rows oneDNN was ahead.
 *   - everything else: oneDNN, ahead of our packed kernel on a training
 *     step's products without AMX. With AMX our packed kernel on AMX tiles
 *     beat it alone on most dX and dW products of a step, but not inside
 *     the step, where the steps were level; so oneDNN keeps them;
 *   - without oneDNN, our kernel (AMX tiles where they run); with neither,
 *     the reference (mrl_cpu_bf16_available() = 0). */
mrl_bf16_path mrl_cpu_bf16_pick(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K) {
    (void)N, (void)K;
    int own = mrl_cpu_has_avx512_bf16();
    if (own && !trans_a && trans_b && M <= MRL_BF16_FEW_ROWS) return MRL_BF16_OWN;
    if (onednn_bf16()) return MRL_BF16_ONEDNN;
    if (mrl_cpu_has_amx_bf16()) return MRL_BF16_AMX;
    return own ? MRL_BF16_OWN : MRL_BF16_REFERENCE;
}

const char *mrl_cpu_bf16_path(void) {
    static char text[128];
    if (!text[0]) {
        const char *isa = mrl_cpu_onednn_isa();
        const char *own = mrl_cpu_has_amx_bf16() ? "amx (weight panels, 5-255 rows) + avx512_bf16 (few rows)"
                                                 : "avx512_bf16 (few rows, weight panels)";
        if (onednn_bf16() && mrl_cpu_has_avx512_bf16())
            snprintf(text, sizeof text, "onednn (%s) + %s", isa, own);
        else if (onednn_bf16())
            snprintf(text, sizeof text, "onednn (%s)", isa);
        else if (mrl_cpu_has_avx512_bf16())
            snprintf(text, sizeof text, "%s", mrl_cpu_has_amx_bf16() ? "amx + avx512_bf16" : "avx512_bf16");
        else
            snprintf(text, sizeof text, "reference (no bf16 hardware)");
    }
    return text;
}

void mrl_cpu_gemm_bf16(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                       int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb, float beta, float *C,
                       int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0 || alpha == 0) { /* C = beta C, operands unread */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) C[m * ldc + n] = beta != 0 ? beta * C[m * ldc + n] : 0.0f;
        return;
    }
    mrl_bf16_path path = forced != MRL_BF16_AUTO ? forced : mrl_cpu_bf16_pick(trans_a, trans_b, M, N, K);
    /* a fast path that cannot run (no memory, oneDNN failing) falls back:
     * AMX or oneDNN to our AVX512-BF16 kernel, any to the reference */
    if (path == MRL_BF16_AMX &&
        mrl_cpu_gemm_bf16_amx(trans_a, trans_b, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc) == 0)
        return;
    if (path == MRL_BF16_ONEDNN &&
        mrl_cpu_gemm_bf16_onednn(trans_a, trans_b, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc) == 0)
        return;
    if (path != MRL_BF16_REFERENCE && mrl_cpu_has_avx512_bf16() &&
        mrl_cpu_gemm_bf16_own(trans_a, trans_b, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc) == 0)
        return;
    mrl_cpu_gemm_bf16_reference(trans_a, trans_b, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, ldc);
}

/* The rule for W given as bf16 weight panels and as its plain copy, from
 * bench/gemm/gemm_bf16.c's "panels" and "amx" columns (bench/RESULTS.md, "bf16
 * products"):
 *   - with AMX (our tile kernel on the panels): the panels from 5 to 255
 *     rows, where they beat our few-rows kernel and oneDNN (which packs W
 *     each call) on most shapes; at 1-4 rows the few-rows kernel on the
 *     plain copy, level with the tiles or ahead (all of them bound by
 *     reading W); from 256 oneDNN. Without ours (MOONRL_AMX=0), oneDNN's
 *     tiles from 17 rows;
 *   - with AVX512-BF16 only: the panels beat the best of our few-rows
 *     kernel and oneDNN on the plain copy from 2 rows (they pack nothing of
 *     W and stream it once), were level at 1 row, and stayed level or ahead
 *     up to 2048 rows, except on narrow W (N < 384: few panels to share, A
 *     read again for each) from 64 rows. */
int mrl_cpu_bf16_panels_pick(int64_t M, int64_t N) {
    if (!mrl_cpu_has_avx512_bf16()) return 0;
    if (mrl_cpu_has_amx_bf16()) return M > 4 && M < 256;
    const char *isa = mrl_cpu_onednn_isa(); /* AMX through oneDNN only (MOONRL_AMX=0): its tiles from 17 rows */
    if (isa && strcmp(isa, "avx512_core_amx") == 0) return M <= MRL_BF16_FEW_ROWS;
    return M <= 32 || N >= 384;
}

/* Our kernels over the panels: AMX where it runs (and unless ours is
 * forced), else AVX512-BF16; -1 when neither could. */
static int panels_fast(int64_t M, int64_t K, const float *A, int64_t lda, const mrl_panels_part *w, int n) {
    if (forced != MRL_BF16_OWN && mrl_cpu_gemm_bf16_panels_group_amx(M, K, A, lda, n, w) == 0) return 0;
    return forced == MRL_BF16_AMX ? -1 : mrl_cpu_gemm_bf16_panels_group_own(M, K, A, lda, n, w);
}

void mrl_cpu_gemm_bf16_panels(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                              const uint32_t *P, const uint16_t *W16, int64_t ldw, float beta, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0 || alpha == 0) { /* C = beta C, operands unread */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) C[m * ldc + n] = beta != 0 ? beta * C[m * ldc + n] : 0.0f;
        return;
    }
    /* a forced path (tests, benchmarks) holds here too: the reference reads
     * the panels, oneDNN the plain copy, ours the panels */
    int panels = forced == MRL_BF16_AUTO ? !W16 || mrl_cpu_bf16_panels_pick(M, N) : forced != MRL_BF16_ONEDNN;
    if (W16 && !panels) {
        mrl_cpu_gemm_bf16(0, 1, M, N, K, alpha, A, 0, lda, W16, 1, ldw, beta, C, ldc);
        return;
    }
    mrl_panels_part w = {N, P, NULL, 0, alpha, beta, C, ldc};
    if (forced != MRL_BF16_REFERENCE && panels_fast(M, K, A, lda, &w, 1) == 0) return;
    mrl_cpu_gemm_bf16_panels_reference(M, N, K, alpha, A, lda, P, beta, C, ldc);
}

void mrl_cpu_gemm_bf16_panels_group(int64_t M, int64_t K, const float *A, int64_t lda, const mrl_panels_part *w,
                                    int n) {
    int64_t N = 0;
    int plain = 0, degenerate = M <= 0 || K <= 0;
    for (int i = 0; i < n; i++) {
        N += w[i].N;
        plain |= w[i].W16 != NULL;
        degenerate |= w[i].N <= 0 || w[i].alpha == 0;
    }
    /* the rule on the group as one product: its panels are shared as one W's */
    int panels = forced == MRL_BF16_AUTO ? !plain || mrl_cpu_bf16_panels_pick(M, N)
                                         : forced == MRL_BF16_OWN || forced == MRL_BF16_AMX;
    if (!degenerate && panels && panels_fast(M, K, A, lda, w, n) == 0) return;
    for (int i = 0; i < n; i++)
        mrl_cpu_gemm_bf16_panels(M, w[i].N, K, w[i].alpha, A, lda, w[i].P, w[i].W16, w[i].ldw, w[i].beta, w[i].C,
                                 w[i].ldc);
}

void mrl_cpu_panels16_pack(uint32_t *P, const uint16_t *W, int64_t N, int64_t K) {
    if (mrl_cpu_panels16_pack_own(P, W, N, K) == 0) return;
    for (int64_t b = 0; b < (N + MRL_PANEL16 - 1) / MRL_PANEL16; b++) mrl_panel16_pack(P, W, N, K, b);
}
