/* The fast CPU ops: matrix products through OpenBLAS sgemm (faster than our
 * own fp32 kernels; few-row products excepted; oneDNN's
 * where OpenBLAS runs kernels below the CPU's instruction set, cpu/blas.h), the
 * other ops from the AVX-512, AVX2 or SSE inner loops (isa_*.c, the set
 * chosen at run time by isa.c), spread over the cores with
 * mrl_parallel_for. Results do not depend on the thread count: every
 * reduction has a fixed blocking and order. The ops of the engine, the
 * optimizer and the conversions live beside their reference versions
 * (paged_attention.c, sample.c, moe.c, adamw.c, reduce.c, convert.c) and are
 * gathered into the table here. */
#include <cblas.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "kernels.h"
#include "cpu/memory.h"
#include "cpu/adamw.h"
#include "cpu/blas.h"
#include "cpu/gemm_bf16.h"
#include "cpu/convert.h"
#include "cpu/isa.h"
#include "cpu/mla.h"
#include "cpu/moe.h"
#include "cpu/paged_attention.h"
#include "cpu/reduce.h"
#include "cpu/sample.h"
#include "cpu/split.h"
#include "moonrl/mem.h"
#include "base/parallel.h"


/* Dynamic scheduling on top of mrl_parallel_for: one range per thread, and
 * each thread takes the next item until none is left, so that a thread the
 * OS delays (the machine is shared) does not hold the others back. Items
 * are independent, so the results do not depend on who takes which. */
typedef struct dyn_ctx {
    _Atomic int64_t next;
    int64_t n;
    void (*item)(void *ctx, int64_t i);
    void *ctx;
} dyn_ctx;

static void dyn_range(void *vc, int64_t t0, int64_t t1) {
    (void)t0, (void)t1;
    dyn_ctx *d = vc;
    for (int64_t i; (i = atomic_fetch_add(&d->next, 1)) < d->n;) d->item(d->ctx, i);
}

static void dyn_for(int64_t n, void (*item)(void *ctx, int64_t i), void *ctx) {
    dyn_ctx d = {0, n, item, ctx};
    int64_t threads = mrl_parallel_threads();
    if (n <= 1 || threads <= 1) {
        for (int64_t i = 0; i < n; i++) item(ctx, i);
        return;
    }
    mrl_parallel_for(threads < n ? threads : n, 1, dyn_range, &d);
}


/* OpenBLAS runs single-threaded inside our own parallel-for: its own thread
 * pool and libgomp's spun against each other on 2 cores (half the time in
 * sched_yield, bench/RESULTS.md). C is cut into slices of rows (or of
 * columns when there are few rows), taken by the threads in turn. A slice's
 * bits are not those of the same elements in one whole call: OpenBLAS picks
 * its blocking, tile edges and small-matrix kernels by the size it is given
 * (its Haswell kernels differ at most slice edges; its SkylakeX ones for
 * slices of few columns). So the slices are cut by the shape and the
 * machine's core count alone (gemm_slices), never by the thread count:
 * one thread runs the same calls in turn, and the results do not depend on
 * the thread count. */
typedef struct gemm_job {
    mrl_gemm_desc d;
    int64_t parts, first; /* slices, and the index of the first in the group */
    int split_rows;
    int few; /* few rows times a transposed matrix: our kernel, slices of columns */
    /* B given as weight panels: our kernel, slices of whole panels */
} gemm_job;

typedef struct gemm_group_ctx {
    gemm_job jobs[8];
    int n;
} gemm_group_ctx;

static void gemm_call(const mrl_gemm_desc *g, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (m1 <= m0 || n1 <= n0) return;
    const float *A = g->trans_a ? g->A + m0 : g->A + m0 * g->lda;
    const float *B = g->trans_b ? g->B + n0 * g->ldb : g->B + n0;
    cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans, g->trans_b ? CblasTrans : CblasNoTrans,
                (blasint)(m1 - m0), (blasint)(n1 - n0), (blasint)g->K, g->alpha, A, (blasint)g->lda, B,
                (blasint)g->ldb, g->beta, g->C + m0 * g->ldc + n0, (blasint)g->ldc);
}

static void gemm_part(void *vc, int64_t item) {
    const gemm_group_ctx *c = vc;
    int j = 0;
    while (j + 1 < c->n && item >= c->jobs[j + 1].first) j++;
    const gemm_job *g = &c->jobs[j];
    int64_t p = item - g->first;
    if (g->d.b_panels) { /* slices of whole panels */
        const mrl_gemm_desc *d = &g->d;
        int64_t panels = (d->N + MRL_PANEL - 1) / MRL_PANEL, step = (panels + g->parts - 1) / g->parts;
        int64_t lo = p * step, hi = lo + step < panels ? lo + step : panels;
        if (lo < hi)
            mrl_cpu_isa_get()->gemm_panels(d->M, lo, hi, d->N, d->K, d->alpha, d->A, d->lda, d->B, d->beta, d->C,
                                           d->ldc);
        return;
    }
    /* slices rounded to 16 rows/columns (whole vector blocks) */
    int64_t n = g->split_rows ? g->d.M : g->d.N, step = ((n + g->parts - 1) / g->parts + 15) / 16 * 16;
    int64_t lo = p * step, hi = lo + step < n ? lo + step : n;
    if (g->few) {
        const mrl_gemm_desc *d = &g->d;
        if (lo < hi)
            mrl_cpu_isa_get()->gemm_nt_rows(d->M, lo, hi, d->K, d->alpha, d->A, d->lda, d->B, d->ldb, d->beta, d->C,
                                            d->ldc);
    } else if (g->split_rows)
        gemm_call(&g->d, lo, hi, 0, g->d.N);
    else
        gemm_call(&g->d, 0, g->d.M, lo, hi);
}

/* Products below this many multiply-adds run on one thread: a parallel
 * region costs more than it saves for them, and far more on a loaded
 * machine, where it waits for every thread to be scheduled (decode steps
 * issue dozens of such products). */
#define PARALLEL_MACS ((int64_t)1 << 22)

/* Slices of one shared OpenBLAS product: 4 per core of the machine (enough
 * for the threads to even out a delayed one), fixed for the process so
 * that the slicing, and with it every bit, is the same at any thread
 * count. */
static int64_t gemm_slices(void) {
    static _Atomic int64_t slices = 0;
    int64_t s = atomic_load(&slices);
    if (s <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        s = 4 * (cores > 1 ? (cores < 256 ? cores : 256) : 1);
        atomic_store(&slices, s);
    }
    return s;
}

/* Few rows times a transposed matrix (a decode step's x W^T, 2..16 rows):
 * our own kernel streams W once; OpenBLAS would first copy (pack) all of W
 * (one row: OpenBLAS's small-matrix kernel is as fast). */
#define FEW_ROWS 16

static void fast_gemm_openblas(const mrl_gemm_desc *g, int n);

/* A decode step's products on our own kernels (few rows, or weight panels: bits that do not
 * depend on the slicing) from this many multiply-adds to PARALLEL_MACS: split over the threads
 * or not by measurement (cpu/split.h), per calling thread. */
#define DECODE_SPLIT_MACS ((int64_t)1 << 17)
static _Thread_local mrl_split_choice decode_choice;

/* How a group of at most 8 products is run: 2 shared, each product as its size says (a group of
 * PARALLEL_MACS or more); by measurement (decode_choice) 1 shared or 0 on this thread; -1 on this
 * thread, unmeasured (OpenBLAS's products, a group below DECODE_SPLIT_MACS, or one thread). */
static int group_shared(const mrl_gemm_desc *g, int n) {
    int64_t total = 0;
    int ours = 1;
    for (int i = 0; i < n; i++) {
        total += g[i].M * g[i].N * (g[i].K > 0 ? g[i].K : 1);
        ours &= g[i].b_panels || (!g[i].trans_a && g[i].trans_b && g[i].M >= 2 && g[i].M <= FEW_ROWS);
    }
    if (total >= PARALLEL_MACS) return 2;
    if (!ours || total < DECODE_SPLIT_MACS || mrl_parallel_threads() < 2) return -1;
    return mrl_split_pick(&decode_choice);
}

static void fast_gemm_group(const mrl_gemm_desc *g, int n) {
    if (mrl_cpu_f32_path() == MRL_F32_ONEDNN) {
        /* oneDNN takes each product whole, on its own threads (called from inside our parallel
         * region, one product's results moved in the last bits with the thread running it); what
         * it does not take (few rows, weight panels: our kernels; K = 0) goes on below */
        mrl_gemm_desc rest[8];
        int left = 0;
        for (int i = 0; i < n; i++) {
            const mrl_gemm_desc *d = &g[i];
            int few = !d->trans_a && d->trans_b && d->M >= 2 && d->M <= FEW_ROWS;
            if (d->b_panels || few || d->K <= 0 ||
                mrl_cpu_gemm_f32_onednn(d->trans_a, d->trans_b, d->M, d->N, d->K, d->alpha, d->A, d->lda, d->B,
                                        d->ldb, d->beta, d->C, d->ldc) != 0) {
                if (left == 8) fast_gemm_openblas(rest, left), left = 0;
                rest[left++] = *d;
            }
        }
        if (left) fast_gemm_openblas(rest, left);
        return;
    }
    fast_gemm_openblas(g, n);
}

/* Cut each product into slices of rows (or of columns when there are few
 * rows), a few per thread, at least 64 wide; all slices of the group are
 * taken dynamically in one parallel region. */
static void fast_gemm_openblas(const mrl_gemm_desc *g, int n) {
    gemm_group_ctx c;
    int64_t items = 0, total = 0;
    for (int off = 0; off < n; off += 8) { /* groups larger than 8 run 8 at a time */
        c.n = n - off < 8 ? n - off : 8;
        items = 0;
        int share = group_shared(g + off, c.n);
        double t0 = share == 0 || share == 1 ? mrl_split_now() : 0;
        for (int i = 0; i < c.n; i++) {
            gemm_job *j = &c.jobs[i];
            j->d = g[off + i];
            j->few = !j->d.b_panels && !j->d.trans_a && j->d.trans_b && j->d.M >= 2 && j->d.M <= FEW_ROWS &&
                     j->d.K > 0;
            j->split_rows = !j->few && !j->d.b_panels && (j->d.M >= j->d.N || j->d.M >= 256);
            int64_t work = j->d.M * j->d.N * (j->d.K > 0 ? j->d.K : 1), split = j->split_rows ? j->d.M : j->d.N;
            j->parts = gemm_slices();
            if (share <= 0 || (share == 2 && work < PARALLEL_MACS)) j->parts = 1; /* too small to share */
            if (j->parts > (split + 63) / 64) j->parts = (split + 63) / 64; /* slices of at least 64 */
            if (j->parts < 1 || j->d.M <= 0 || j->d.N <= 0) j->parts = j->d.M > 0 && j->d.N > 0;
            j->first = items;
            items += j->parts;
            total += work;
        }
        if (share <= 0) /* the whole group is too small to share, or not shared by measurement */
            for (int64_t i = 0; i < items; i++) gemm_part(&c, i);
        else
            dyn_for(items, gemm_part, &c);
        if (share == 0 || share == 1) mrl_split_record(&decode_choice, mrl_split_now() - t0, (double)total);
        total = 0;
    }
}

static void fast_gemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                      int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    mrl_gemm_desc d = {ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc};
    fast_gemm_group(&d, 1);
}

/* ---- rmsnorm ------------------------------------------------------------ */

typedef struct norm_ctx {
    float *out, *rstd, *dx, *dw_part;
    const float *x, *w, *dout, *rstd_in;
    int D;
    float eps;
    int64_t T;
} norm_ctx;

static void norm_fwd_range(void *vc, int64_t t0, int64_t t1) {
    norm_ctx *c = vc;
    mrl_cpu_isa_get()->rmsnorm_fwd_rows(c->out, c->rstd, c->x, c->w, t0, t1, c->D, c->eps);
}

static void fast_rmsnorm_fwd(float *out, float *rstd, const float *x, const float *w, int64_t T, int D,
                             float eps) {
    norm_ctx c = {.out = out, .rstd = rstd, .x = x, .w = w, .D = D, .eps = eps};
    mrl_parallel_for(T, 16, norm_fwd_range, &c);
}

#define NORM_BLOCK 64 /* tokens per dw partial sum: fixed, so results do not depend on threads */

static void norm_bwd_range(void *vc, int64_t b0, int64_t b1) {
    norm_ctx *c = vc;
    for (int64_t b = b0; b < b1; b++) {
        int64_t t0 = b * NORM_BLOCK, t1 = t0 + NORM_BLOCK < c->T ? t0 + NORM_BLOCK : c->T;
        mrl_cpu_isa_get()->rmsnorm_bwd_rows(c->dx, c->dw_part + b * c->D, c->dout, c->x, c->w, c->rstd_in, t0, t1, c->D);
    }
}

static void fast_rmsnorm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w,
                             const float *rstd, int64_t T, int D) {
    int64_t blocks = (T + NORM_BLOCK - 1) / NORM_BLOCK;
    float *part = mrl_mem_alloc((size_t)blocks * D * sizeof(float), MRL_MEM_ACTIVATIONS);
    norm_ctx c = {.dx = dx, .dw_part = part, .dout = dout, .x = x, .w = w, .rstd_in = rstd, .D = D, .T = T};
    if (!part) { /* no memory for the partial sums: one serial pass straight into dw */
        c.dw_part = dw;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t t0 = b * NORM_BLOCK, t1 = t0 + NORM_BLOCK < T ? t0 + NORM_BLOCK : T;
            mrl_cpu_isa_get()->rmsnorm_bwd_rows(dx, dw, dout, x, w, rstd, t0, t1, D);
        }
        return;
    }
    mrl_parallel_for(blocks, 1, norm_bwd_range, &c);
    for (int64_t b = 0; b < blocks; b++)
        for (int i = 0; i < D; i++) dw[i] += part[b * D + i];
    mrl_mem_free(part);
}

/* ---- rope ------------------------------------------------------------------ */

typedef struct rope_ctx {
    float *x;
    const int32_t *pos;
    const float *cos_t, *sin_t;
    int H, hd, inverse;
} rope_ctx;

static void rope_range(void *vc, int64_t t0, int64_t t1) {
    rope_ctx *c = vc;
    int half = c->hd / 2;
    float sign = c->inverse ? -1.0f : 1.0f;
    for (int64_t t = t0; t < t1; t++) {
        const float *cs = c->cos_t + (int64_t)c->pos[t] * half, *sn = c->sin_t + (int64_t)c->pos[t] * half;
        for (int h = 0; h < c->H; h++) {
            float *v = c->x + (t * c->H + h) * c->hd;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half], s = sign * sn[i];
                v[i] = a * cs[i] - b * s;
                v[i + half] = b * cs[i] + a * s;
            }
        }
    }
}

static void fast_rope(float *x, const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H,
                      int hd, int inverse) {
    rope_ctx c = {x, pos, cos_t, sin_t, H, hd, inverse};
    mrl_parallel_for(T, 32, rope_range, &c);
}

/* ---- swiglu ---------------------------------------------------------------- */

typedef struct swiglu_ctx {
    float *out, *dup;
    const float *gate, *up, *dout;
} swiglu_ctx;

static void swiglu_fwd_range(void *vc, int64_t i0, int64_t i1) {
    swiglu_ctx *c = vc;
    mrl_cpu_isa_get()->swiglu_fwd(c->out + i0, c->gate + i0, c->up + i0, i1 - i0);
}

static void swiglu_bwd_range(void *vc, int64_t i0, int64_t i1) {
    swiglu_ctx *c = vc;
    mrl_cpu_isa_get()->swiglu_bwd(c->out + i0, c->dup + i0, c->dout + i0, c->gate + i0, c->up + i0, i1 - i0);
}

static void fast_swiglu_fwd(float *out, const float *gate, const float *up, int64_t n) {
    swiglu_ctx c = {.out = out, .gate = gate, .up = up};
    mrl_parallel_for(n, 32768, swiglu_fwd_range, &c);
}

static void fast_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                            int64_t n) {
    swiglu_ctx c = {.out = dgate, .dup = dup, .gate = gate, .up = up, .dout = dout};
    mrl_parallel_for(n, 4096, swiglu_bwd_range, &c);
}

/* ---- attention --------------------------------------------------------------- */

typedef struct attn_ctx {
    mrl_attn_args a;
    int heads; /* tasks per sequence: Hq (forward) or Hk (backward) */
    int64_t scratch_floats;
    int backward;
    _Atomic int64_t next;
    int64_t items;
} attn_ctx;

/* one thread's share: its own scratch, then (sequence, head) items taken dynamically */
static void attn_range(void *vc, int64_t t0, int64_t t1) {
    (void)t0, (void)t1;
    attn_ctx *c = vc;
    float *scratch = mrl_mem_alloc((size_t)c->scratch_floats * sizeof(float), MRL_MEM_ACTIVATIONS);
    if (!scratch) return; /* cannot happen for sane sizes; the outputs stay as they were */
    for (int64_t w; (w = atomic_fetch_add(&c->next, 1)) < c->items;) {
        int s = (int)(w / c->heads), h = (int)(w % c->heads);
        if (c->backward)
            mrl_cpu_isa_get()->attn_bwd_group(&c->a, s, h, scratch);
        else
            mrl_cpu_isa_get()->attn_fwd_head(&c->a, s, h, scratch);
    }
    mrl_mem_free(scratch);
}

static void attn_run(attn_ctx *c, int64_t items) {
    c->items = items;
    int64_t threads = mrl_parallel_threads();
    mrl_parallel_for(threads < items ? threads : items, 1, attn_range, c);
}

/* The most keys a query meets: a sequence's rows plus its prefix's. */
static int64_t max_keys(const int32_t *cu, const int32_t *prefix, int n) {
    int64_t m = 1;
    for (int s = 0; s < n; s++) {
        int64_t keys = cu[s + 1] - cu[s];
        if (prefix && prefix[s] >= 0) keys += cu[prefix[s] + 1] - cu[prefix[s]];
        if (keys > m) m = keys;
    }
    return m;
}

static void fast_attn_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                          const int32_t *cu, const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd,
                          float scale) {
    int64_t keys = max_keys(cu, prefix, n_seqs);
    attn_ctx c = {.a = {.out = out, .lse = lse, .q = q, .k = k, .v = v, .cu_seqlens = cu, .prefix = prefix,
                        .n_seqs = n_seqs, .Hq = Hq, .Hk = Hk, .hd = hd, .max_keys = keys, .scale = scale},
                  .heads = Hq,
                  .scratch_floats = mrl_attn_scratch_floats(keys, hd)};
    attn_run(&c, (int64_t)n_seqs * Hq);
}

static void fast_attn_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out,
                          const float *lse, const float *q, const float *k, const float *v, const int32_t *cu,
                          const int32_t *prefix, int n_seqs, int Hq, int Hk, int hd, float scale) {
    int64_t keys = max_keys(cu, prefix, n_seqs);
    attn_ctx c = {.a = {.dq = dq, .dk = dk, .dv = dv, .dout = dout, .o = out, .lse_in = lse, .q = q, .k = k,
                        .v = v, .cu_seqlens = cu, .prefix = prefix, .n_seqs = n_seqs, .Hq = Hq, .Hk = Hk,
                        .hd = hd, .max_keys = keys, .scale = scale},
                  .heads = Hk,
                  .scratch_floats = mrl_attn_scratch_floats(keys, hd),
                  .backward = 1};
    attn_run(&c, (int64_t)n_seqs * Hk);
}

/* ---- head -------------------------------------------------------------------- */

typedef struct head_ctx {
    float *logits;
    int V;
    float inv_temp;
    const int32_t *targets;
    float *lse, *entropy, *logprob;
    const float *lse_in, *ent_in, *dlogprob, *dentropy;
} head_ctx;

static void head_fwd_range(void *vc, int64_t r0, int64_t r1) {
    head_ctx *c = vc;
    for (int64_t r = r0; r < r1; r++)
        mrl_cpu_isa_get()->head_fwd_row(c->logits + r * c->V, c->V, c->inv_temp, c->targets[r], c->lse + r, c->entropy + r,
                          c->logprob + r);
}

static void head_bwd_range(void *vc, int64_t r0, int64_t r1) {
    head_ctx *c = vc;
    for (int64_t r = r0; r < r1; r++) {
        float glp = c->dlogprob && c->targets[r] >= 0 ? c->dlogprob[r] : 0.0f;
        float gh = c->dentropy ? c->dentropy[r] : 0.0f;
        mrl_cpu_isa_get()->head_bwd_row(c->logits + r * c->V, c->V, c->inv_temp, c->targets[r], c->lse_in[r], c->ent_in[r],
                          glp, gh);
    }
}

static void fast_head_fwd(const float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets,
                          float *lse, float *entropy, float *logprob) {
    head_ctx c = {.logits = (float *)logits, .V = V, .inv_temp = inv_temp, .targets = targets, .lse = lse,
                  .entropy = entropy, .logprob = logprob};
    mrl_parallel_for(rows, 1, head_fwd_range, &c);
}

static void fast_head_bwd(float *logits, int64_t rows, int V, float inv_temp, const int32_t *targets,
                          const float *lse, const float *entropy, const float *dlogprob, const float *dentropy) {
    head_ctx c = {.logits = logits, .V = V, .inv_temp = inv_temp, .targets = targets, .lse_in = lse,
                  .ent_in = entropy, .dlogprob = dlogprob, .dentropy = dentropy};
    mrl_parallel_for(rows, 1, head_bwd_range, &c);
}

/* ---- rows, biases, weight panels ----------------------------------------------
 * Copies and adds spread over rows, or over column slices when rows add into
 * the same place (each element's adds then stay in row order: the
 * reference's bits). Under 64K floats they run on the calling thread. */

#define COPY_GRAIN ((int64_t)1 << 16) /* floats per thread at least */

typedef struct rows_ctx {
    float *out;
    const float *src;
    const int32_t *idx;
    int64_t n, D;
} rows_ctx;

static int64_t row_grain(int64_t D) { return D >= COPY_GRAIN ? 1 : COPY_GRAIN / (D > 0 ? D : 1); }

static void gather_range(void *vc, int64_t i0, int64_t i1) {
    rows_ctx *c = vc;
    for (int64_t i = i0; i < i1; i++)
        if (c->idx[i] < 0) memset(c->out + i * c->D, 0, sizeof(float) * c->D);
        else memcpy(c->out + i * c->D, c->src + (int64_t)c->idx[i] * c->D, sizeof(float) * c->D);
}

static void fast_gather_rows(float *out, const float *src, const int32_t *idx, int64_t n, int64_t D) {
    rows_ctx c = {out, src, idx, n, D};
    mrl_parallel_for(n, row_grain(D), gather_range, &c);
}

/* columns [j0, j1) of every row, rows in order */
static void scatter_add_cols(void *vc, int64_t j0, int64_t j1) {
    rows_ctx *c = vc;
    for (int64_t i = 0; i < c->n; i++) {
        if (c->idx[i] < 0) continue;
        float *d = c->out + (int64_t)c->idx[i] * c->D;
        const float *s = c->src + i * c->D;
        for (int64_t j = j0; j < j1; j++) d[j] += s[j];
    }
}

static void fast_scatter_add_rows(float *dst, const float *src, const int32_t *idx, int64_t n, int64_t D) {
    rows_ctx c = {dst, src, idx, n, D};
    mrl_parallel_for(D, n >= COPY_GRAIN ? 16 : (COPY_GRAIN / (n > 0 ? n : 1) + 15) / 16 * 16, scatter_add_cols, &c);
}

static void bias_add_range(void *vc, int64_t t0, int64_t t1) {
    rows_ctx *c = vc;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t i = 0; i < c->D; i++) c->out[t * c->D + i] += c->src[i];
}

static void fast_bias_add(float *y, const float *b, int64_t T, int64_t N) {
    rows_ctx c = {.out = y, .src = b, .n = T, .D = N};
    mrl_parallel_for(T, row_grain(N), bias_add_range, &c);
}

static void bias_bwd_cols(void *vc, int64_t j0, int64_t j1) {
    rows_ctx *c = vc;
    for (int64_t t = 0; t < c->n; t++)
        for (int64_t j = j0; j < j1; j++) c->out[j] += c->src[t * c->D + j];
}

static void fast_bias_bwd(float *db, const float *dy, int64_t T, int64_t N) {
    rows_ctx c = {.out = db, .src = dy, .n = T, .D = N};
    mrl_parallel_for(N, T >= COPY_GRAIN ? 16 : (COPY_GRAIN / (T > 0 ? T : 1) + 15) / 16 * 16, bias_bwd_cols, &c);
}

/* A decode step's rows (up to LORA_FEW) on this thread: x A^T through the few-rows kernel (r
 * outputs a row over K), u B^T through lora_up (N outputs over r terms): no parallel region, no
 * packing, one call a matrix of the layer. More rows, or ranks past 64: the two products of the
 * group's path (shared, packed). */
#define LORA_FEW 64
static void fast_lora_fwd(float *y, float *u, const float *x, const float *A, const float *B, int64_t T, int64_t N,
                          int64_t K, int64_t r, float s) {
    if (T <= 0) return;
    if (T <= LORA_FEW && r <= 64) {
        const mrl_cpu_isa *isa = mrl_cpu_isa_get();
        isa->gemm_nt_rows(T, 0, r, K, 1.0f, x, K, A, K, 0.0f, u, r);
        isa->lora_up(T, N, r, s, u, B, y);
        return;
    }
    fast_gemm(0, 1, T, r, K, 1.0f, x, K, A, K, 0.0f, u, r);
    fast_gemm(0, 1, T, N, r, s, u, r, B, r, 1.0f, y, N);
}

/* qgemm: slices of W's rows, each dequantized into this thread's buffer a chunk of rows at a
 * time (the chunk in L2), then the few-rows kernel over the chunk: the blocks are read once,
 * no dequantized copy of W is made. */
#define QGEMM_CHUNK_FLOATS (1 << 15)
typedef struct qgemm_ctx {
    int type;
    int64_t M, N, K, lda, ldc, rows; /* rows: a chunk's */
    float alpha, beta;
    const float *A;
    const char *W;
    float *C;
} qgemm_ctx;

static void qgemm_range(void *vc, int64_t c0, int64_t c1) { /* (chunks c0 .. c1) */
    const qgemm_ctx *c = vc;
    static _Thread_local float chunk[QGEMM_CHUNK_FLOATS]; /* (128 KiB: a thread's, not its stack's) */
    /* (a row longer than the buffer: one row at a time, through the heap) */
    float *w = c->rows * c->K <= QGEMM_CHUNK_FLOATS ? chunk : malloc(sizeof(float) * (size_t)c->K);
    if (!w) return;
    int64_t row_bytes = c->K / 32 * mrl_quant_block_bytes(c->type);
    for (int64_t ch = c0; ch < c1; ch++) {
        int64_t n0 = ch * c->rows, n = c->N - n0 < c->rows ? c->N - n0 : c->rows;
        mrl_cpu_isa_get()->dequant(c->type, c->W + n0 * row_bytes, w, n * c->K);
        mrl_cpu_isa_get()->gemm_nt_rows(c->M, 0, n, c->K, c->alpha, c->A, c->lda, w, c->K, c->beta, c->C + n0, c->ldc);
    }
    if (w != chunk) free(w);
}

static void fast_qgemm(int type, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                       const void *W, float beta, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    int64_t rows = K <= QGEMM_CHUNK_FLOATS ? QGEMM_CHUNK_FLOATS / K : 1;
    if (rows > 16) rows = rows / 16 * 16; /* (whole vector blocks of the few-rows kernel) */
    qgemm_ctx c = {type, M, N, K, lda, ldc, rows, alpha, beta, A, W, C};
    int64_t chunks = (N + rows - 1) / rows;
    if (M * N * K < PARALLEL_MACS) qgemm_range(&c, 0, chunks);
    else mrl_parallel_for(chunks, 1, qgemm_range, &c);
}

typedef struct pack_ctx {
    float *P;
    const float *W;
    int64_t N, K;
} pack_ctx;

static void pack_range(void *vc, int64_t b0, int64_t b1) {
    pack_ctx *c = vc;
    for (int64_t b = b0; b < b1; b++) mrl_panel_pack(c->P, c->W, c->N, c->K, b);
}

static void fast_panels_pack(float *P, const float *W, int64_t N, int64_t K) {
    pack_ctx c = {P, W, N, K};
    int64_t panel = MRL_PANEL * (K > 0 ? K : 1);
    mrl_parallel_for((N + MRL_PANEL - 1) / MRL_PANEL, panel >= COPY_GRAIN ? 1 : COPY_GRAIN / panel, pack_range, &c);
}

static const mrl_kernels fast_table = {
    .name = "cpu-fast",
    .on_device = 0,
    .copy = mrl_cpu_copy,
    .zero = mrl_cpu_zero,
    .to_device = mrl_cpu_transfer,
    .to_host = mrl_cpu_transfer,
    .sync = mrl_cpu_sync,
    .copy_rows = mrl_cpu_copy_rows,
    .gemm = fast_gemm,
    .gemm_group = fast_gemm_group,
    .qgemm = fast_qgemm,
    .gemm_bf16 = mrl_cpu_gemm_bf16,
    .gemm_bf16_panels = mrl_cpu_gemm_bf16_panels,
    .gemm_bf16_panels_group = mrl_cpu_gemm_bf16_panels_group,
    .rmsnorm_fwd = fast_rmsnorm_fwd,
    .rmsnorm_bwd = fast_rmsnorm_bwd,
    .rope = fast_rope,
    .mla_qkv = mrl_cpu_fast_mla_qkv,
    .mla_qkv_bwd = mrl_cpu_fast_mla_qkv_bwd,
    .swiglu_fwd = fast_swiglu_fwd,
    .swiglu_bwd = fast_swiglu_bwd,
    .attn_fwd = fast_attn_fwd,
    .attn_bwd = fast_attn_bwd,
    .head_fwd = fast_head_fwd,
    .head_bwd = fast_head_bwd,
    .gather_rows = fast_gather_rows,
    .scatter_add_rows = fast_scatter_add_rows,
    .bias_add = fast_bias_add,
    .bias_bwd = fast_bias_bwd,
    .lora_fwd = fast_lora_fwd,
    .panels_pack = fast_panels_pack,
    .panels16_pack = mrl_cpu_panels16_pack,
    .paged_kv_write = mrl_cpu_fast_paged_kv_write,
    .paged_kv_write_bf16 = mrl_cpu_fast_paged_kv_write_bf16,
    .paged_attn_workspace = mrl_cpu_fast_paged_attn_workspace,
    .paged_attn = mrl_cpu_fast_paged_attn,
    .mla_paged_attn = mrl_cpu_fast_mla_paged_attn,
    .latent_kv_write = mrl_cpu_fast_latent_kv_write,
    .sample = mrl_cpu_fast_sample,
    .top_logprobs = mrl_cpu_fast_top_logprobs,
    .moe_route = mrl_cpu_fast_moe_route,
    .moe_route_grouped = mrl_cpu_fast_moe_route_grouped,
    .moe_group = mrl_cpu_moe_group,
    .adamw = mrl_cpu_fast_adamw,
    .sum = mrl_cpu_fast_sum,
    .scale = mrl_cpu_fast_scale,
    .add = mrl_cpu_fast_add,
    .bf16_to_f32 = mrl_cpu_fast_bf16_to_f32,
    .f32_to_bf16 = mrl_cpu_fast_f32_to_bf16,
    .f16_to_f32 = mrl_cpu_fast_f16_to_f32,
    .f32_to_f16 = mrl_cpu_fast_f32_to_f16,
    .dequant = mrl_cpu_fast_dequant,
};

const mrl_kernels *mrl_kernels_cpu_fast(void) {
    static _Atomic int ready;
    if (!atomic_load_explicit(&ready, memory_order_acquire)) { /* twice at worst: both calls are idempotent */
        openblas_set_num_threads(1); /* see fast_gemm */
        mrl_cpu_isa_get();
        atomic_store_explicit(&ready, 1, memory_order_release);
    }
    return &fast_table;
}

const char *mrl_kernels_cpu_fast_isa(void) { return mrl_cpu_isa_name(); }

int mrl_kernels_cpu_fast_set_isa(const char *name) { return mrl_cpu_isa_set(name); }
