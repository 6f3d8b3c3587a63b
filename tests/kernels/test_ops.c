/* Every op of every op table (kernels/kernels.h) against the CPU reference,
 * in the spirit of ggml's test-backend-ops: one table of cases, one row of
 * results per backend.
 *
 * Backends (`tables` below): the reference; the fast CPU table at each
 * instruction set this CPU has (avx512, avx2, sse: kernels/cpu/isa.c) and
 * with its fp32 products through oneDNN; and the CUDA table when moonrl was
 * built with CUDA and a GPU is visible: a real one, or the emulated one of
 * tests/gpu/emu (its library preloaded: the cuda_ops_emu test). A device
 * table's arrays are copied into its memory and back (mrl_buffer_alloc, its
 * to_device and to_host slots), but for those its slots take in host memory
 * (kernels/cuda/cuda_backend.h). Backends not built in or not here are
 * skipped.
 *
 * Forward: each op runs on fresh random inputs of several shapes, on every
 * table; its outputs are compared with the reference's on the same inputs
 * by the normalised error max |got - ref| / max |ref| (0: the same bits),
 * against the tolerance stated per output with its reason (TOL_* below; a
 * GPU's own where its arithmetic differs, TOL_GPU_*). Inputs an op only
 * reads must come back untouched, outputs start as NaN (what an op leaves
 * unwritten shows), and a fast CPU table must give the same bits on 1
 * thread as on all of them. Some shapes are the GPU's alone (its kernels'
 * tiles, tensor-core paths, the largest heads and vocabularies), some
 * paths the CPU's alone (paged attention's workspace and fp32 loops).
 *
 * Backward: every backward op of every table, the reference's included,
 * against central differences of the reference forward (the loss, a random
 * weighting of the outputs, summed in double), on small shapes.
 *
 * Contracts: every slot filled; the memory slots; the shape checks of paged
 * attention and the failing rows of the sampler give the same errors on
 * every table; a GPU's void slots report bad shapes through sync.
 *
 *   test_ops [OP [TABLE]]   only the cases of op OP (a slot name; "all":
 *                           every op), only on TABLE; exits 77 (skipped)
 *                           when TABLE is not on this machine
 *   SEED=n test_ops         other random inputs (the default seed is fixed) */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"
#include "random.h"
#include "kernels.h"
#include "cpu/blas.h"
#include "cpu/paged_attention.h"
#include "cpu/split.h"
#include "moonrl/device.h"
#include "moonrl/mem.h"
#include "runtime/device_internal.h"
#include "moonrl/dtype.h"
#include "moonrl/parallel.h"
#include "moonrl/runtime.h"
#include "moonrl/status.h"
#ifdef MRL_HAVE_CUDA
#include "cuda_backend.h"
#endif

/* ---- tolerances: the normalised error each output may have, and why ---- */

/* Copies and element-wise fp32 arithmetic done the same way as the
 * reference (the same operations in the same order, no fused multiply-add):
 * the same bits. So: rows, biases, panels, the K/V write, AdamW, scale, add, the
 * dtype conversions (each rounding is defined bit for bit). */
#define TOL_BITS 0.0
/* Dot products over at most a few hundred terms summed in fp32 lanes and
 * blocks (OpenBLAS, our vector loops) against the reference's double sums:
 * a few units of 2^-24 times sqrt(terms), relative to the largest output. */
#define TOL_DOT 1e-5
/* One fp32 sum of a row's squares then a scale (rmsnorm, its rstd), a rotation
 * (RoPE), or the vector exp (a degree-7 polynomial, below 1e-8 relative) in
 * SwiGLU: a few ulp. */
#define TOL_ULPS 1e-6
/* Paged attention: fp32 scores and weighted sums over up to 300 keys, the
 * vector exp; the bound its own test against plain attention always met. */
#define TOL_PAGED 2e-6
/* Paged attention over a bf16 cache with bf16 products (AVX512-BF16): q is
 * given bf16-exact (what the kernel rounds it to), so what differs from the
 * exact reference is the softmax weights rounded to bf16, each within half
 * an ulp of itself (2^-9 to 2^-8 relative): an output, a weighted mean of V
 * rows, moves by up to 2^-8 max|V|, and the largest output here is about
 * max|V| (contexts from 1 token): 2^-7 leaves room for one near max|V|/2.
 * Row by row against attention with the weights so rounded, at 2e-6:
 * tests/engine/test_paged_attention.c. */
#define TOL_PAGED_BF16 7.8e-3
/* The sampler's log-probs: x - lse with lse from a sum of vector exps in
 * double and one fp32 log, against libm's exp: a few ulp of |x|. The
 * tokens themselves must be the same. */
#define TOL_SAMPLE 1e-6
/* Sums in double in another order (blocks of 8192, four lanes): n 2^-53. */
#define TOL_SUM 1e-12
/* Central differences of the fp32 reference forward with h = 1e-3: the
 * truncation error O(h^2) and the rounding of the outputs, 2^-24 / h
 * relative, summed over the outputs. */
#define TOL_FD 3e-3

/* A GPU's own, where its arithmetic is not the CPU's (the CUDA table):
 * A sum over rows the reference adds in fp32 one row at a time (the weight
 * gradient of rmsnorm, over up to 300 rows): its own rounding, up to
 * sqrt(rows) 2^-24 of the partial sums. */
#define TOL_GPU_SUMF 5e-5
/* bf16 products: the operands are rounded to bf16 the same way on both
 * sides, so their products are exact; the difference is the tensor cores'
 * fp32 accumulation, which aligns the products of a step to the largest
 * before adding (their low bits are cut, not rounded): looser than
 * TOL_DOT by an order. */
#define TOL_GPU_BF16 1e-4
/* Attention and the head: fp32 scores, expf (2 ulp) and fp32 running sums
 * over up to a few hundred keys (a vocabulary for the head), against
 * double throughout. The backward's gradients are sums of products of
 * those, over every query or key. Paged attention likewise, over a bf16
 * cache read widened (exactly, as the reference reads it). */
#define TOL_GPU_ATTN 2e-5
#define TOL_GPU_ATTN_BWD 1e-4
#define TOL_GPU_HEAD 1e-5
/* Sums in double in another order: the reference's one accumulator over
 * n terms carries about sqrt(n) 2^-53 of relative error itself (2e-13 at
 * 3M terms), the GPU's blocked sums less; relative to the sum's scale (the
 * square root of the sum of squares: a sum of random signs may cancel). */
#define TOL_GPU_SUM 1e-11
/* The router's probabilities (moe_route): each row's softmax in the
 * reference's order, the exp rounded otherwise (a GPU's double exp rounded
 * to fp32 against libm's expf, each within a little over half an ulp): a
 * few ulp of the largest. The picks and the grouping: the same. */
#define TOL_ROUTE 1e-6

/* ---- tables ---- */

typedef struct table {
    const char *name;
    const mrl_kernels *(*get)(void);
    const char *isa;      /* the fast CPU table: the instruction set to select first */
    int threaded;         /* its results must not depend on mrl_parallel's thread count */
    int f32_onednn; /* the fast CPU table with its fp32 products through oneDNN (cpu/blas.h) */
    /* a GPU's table: its ops take its own memory (on_device), device `dev`; tolerances TOL_GPU_* */
    int device;
    mrl_device dev;
} table;

static const mrl_kernels *cuda_get(void);

static const table tables[] = {
    {"reference", mrl_kernels_cpu_reference, NULL, 0},
    {"fast-avx512", mrl_kernels_cpu_fast, "avx512", 1},
    {"fast-avx2", mrl_kernels_cpu_fast, "avx2", 1},
    {"fast-sse", mrl_kernels_cpu_fast, "sse", 1},
    /* what a CPU whose OpenBLAS runs kernels below its instruction set gets; held to the error
     * bound across thread counts (cpu/blas.h), the same bits at one count (onednn32_repeat) */
    {"fast-onednn32", mrl_kernels_cpu_fast, "avx512", 0, .f32_onednn = 1},
    {"cuda", cuda_get, NULL, 0, .device = 1, .dev = {MRL_DEVICE_CUDA, 0}},
};
enum { N_TABLES = sizeof tables / sizeof tables[0] };

static const char *only_op, *only_table;

/* The CUDA table when moonrl was built with CUDA and a GPU is visible. */
static const mrl_kernels *cuda_get(void) {
    static int count = -1;
    if (count < 0) count = mrl_device_cuda_count();
    return count > 0 ? mrl_kernels_for(tables[N_TABLES - 1].dev) : NULL;
}

/* The table's ops, its instruction set selected; NULL: not here. */
static const mrl_kernels *use(const table *t) {
    if (only_table && t != &tables[0] && strcmp(only_table, t->name)) return NULL;
    if (t->isa && mrl_kernels_cpu_fast_set_isa(t->isa) != 0) return NULL;
    if (t->isa && mrl_cpu_f32_force_path(t->f32_onednn ? MRL_F32_ONEDNN : MRL_F32_OPENBLAS) != 0) return NULL;
    return t->get();
}

/* 1 when a device table runs here (the GPU's shapes are worth making). */
static int gpu_here(void) {
    for (int t = 1; t < N_TABLES; t++)
        if (tables[t].device && use(&tables[t])) return 1;
    return 0;
}

/* bytes in table t's memory (a CPU table's: the host's), and back */
typedef struct tmem {
    mrl_buffer b;
    void *p;
} tmem;

static void *tmem_alloc(const table *t, tmem *m, size_t bytes) {
    memset(m, 0, sizeof *m);
    if (!t->device) return m->p = malloc(bytes ? bytes : 1);
    CHECK_OK(mrl_buffer_alloc(t->dev, bytes ? bytes : 1, MRL_MEM_OTHER, &m->b));
    return m->p = m->b.data;
}

static void tmem_free(const table *t, tmem *m) {
    if (t->device) mrl_buffer_free(&m->b);
    else free(m->p);
}

/* ---- op cases: arrays, parameters, and the call ---- */

enum { F32, U16, I32, F64 };
enum { IN, OUT, INOUT };
static const size_t elem_size[] = {4, 2, 4, 8};

typedef struct arr {
    const char *name;
    int type, role;
    int64_t n;
    void *init; /* IN, INOUT: the values; OUT: NULL (starts with every bit set: NaN, -1) */
    double tol; /* OUT, INOUT: TOL_* */
    double scale; /* the error is relative to at least this (0: to the largest output alone) */
    double dtol, dscale; /* the same on a GPU (gpu_tol; -1: tol, scale) */
    int host; /* in host memory on every table (what a device table's slot takes from the host) */
} arr;

#define MAXA 12
typedef struct op_case op_case;
/* p[j]: array j in the table's memory */
typedef void (*run_fn)(const mrl_kernels *k, void *const *p, const op_case *c);
struct op_case {
    const char *op; /* the slot */
    char shape[128];
    arr a[MAXA];
    int na;
    int64_t i[10];     /* sizes and integer parameters */
    float f[4];        /* float parameters */
    const void *extra; /* host data the op reads as is (sampling params, descriptors) */
    run_fn run;
    int gpu_only; /* a shape for a GPU's kernels: the reference and the device tables only */
    int cpu_only; /* a path of the CPU's kernels alone: not on the device tables */
};

static op_case *new_case(op_case *c, const char *op, run_fn run, const char *fmt, ...) {
    memset(c, 0, sizeof *c);
    c->op = op;
    c->run = run;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->shape, sizeof c->shape, fmt, ap);
    va_end(ap);
    return c;
}

static size_t bytes_of(const arr *a) { return (size_t)a->n * elem_size[a->type]; }

/* Add an array (init copied); returns its index. */
static int add(op_case *c, const char *name, int type, int role, int64_t n, const void *init, double tol) {
    arr *a = &c->a[c->na];
    *a = (arr){name, type, role, n, NULL, tol, 0, -1, -1, 0};
    if (init) {
        a->init = malloc(bytes_of(a) + 1);
        memcpy(a->init, init, bytes_of(a));
    }
    return c->na++;
}

static int in_rnd(op_case *c, const char *name, int64_t n, float scale) {
    float *x = rnd(n, scale);
    int j = add(c, name, F32, IN, n, x, 0);
    free(x);
    return j;
}

static int inout_rnd(op_case *c, const char *name, int64_t n, float scale, double tol) {
    float *x = rnd(n, scale);
    int j = add(c, name, F32, INOUT, n, x, tol);
    free(x);
    return j;
}

/* Output j's tolerance on a GPU, where its arithmetic differs from the CPU's (TOL_GPU_*). */
static void gpu_tol(op_case *c, int j, double tol) { c->a[j].dtol = tol; }

/* Array j stays in host memory on every table. */
static void on_host(op_case *c, int j) { c->a[j].host = 1; }

static void free_case(op_case *c) {
    for (int j = 0; j < c->na; j++) free(c->a[j].init);
    c->na = 0;
}

/* Run c with table t's ops k: the arrays copied into its memory (outputs with
 * every bit set), the op, the outputs copied back into out[j] (host, for the
 * caller to free; NULL for inputs). Returns the index of an input the op
 * changed, or -1. */
static int run_case(const table *t, const mrl_kernels *k, const op_case *c, void **out) {
    void *p[MAXA], *host[MAXA];
    tmem mem[MAXA];
    for (int j = 0; j < c->na; j++) {
        const arr *a = &c->a[j];
        host[j] = malloc(bytes_of(a) + 1);
        if (a->init) memcpy(host[j], a->init, bytes_of(a));
        else memset(host[j], 0xff, bytes_of(a));
        p[j] = host[j];
        if (t->device && !a->host) {
            p[j] = tmem_alloc(t, &mem[j], bytes_of(a) + 1);
            CHECK_OK(k->to_device(p[j], host[j], (int64_t)bytes_of(a)));
        }
    }
    c->run(k, p, c);
    if (t->device) CHECK_OK(k->sync()); /* the op's own errors first */
    int touched = -1;
    for (int j = 0; j < c->na; j++) {
        const arr *a = &c->a[j];
        if (t->device && !a->host) {
            CHECK_OK(k->to_host(host[j], p[j], (int64_t)bytes_of(a)));
            tmem_free(t, &mem[j]);
        }
        out[j] = a->role == IN ? NULL : host[j];
        if (a->role != IN) continue;
        if (memcmp(host[j], a->init, bytes_of(a))) touched = j;
        free(host[j]);
    }
    return touched;
}

static void free_outputs(const op_case *c, void **out) {
    for (int j = 0; j < c->na; j++) free(out[j]);
}

/* Output a's tolerance and scale on table t. */
static double tol_on(const arr *a, const table *t) { return t->device && a->dtol >= 0 ? a->dtol : a->tol; }
static double scale_on(const arr *a, const table *t) { return t->device && a->dscale >= 0 ? a->dscale : a->scale; }

/* The normalised error of got against want: max |got - want| / max |want|
 * over the values (at least `scale`); a NaN or infinity where the other has
 * another value: inf. tol 0 and integers: 0 for the same bits, else inf. */
static double error_of(const arr *a, double tol, double scale, const void *got, const void *want) {
    if (tol == 0 || a->type == I32 || a->type == U16) return memcmp(got, want, bytes_of(a)) ? INFINITY : 0;
    double d = 0, s = 0;
    for (int64_t i = 0; i < a->n; i++) {
        double g = a->type == F32 ? ((const float *)got)[i] : ((const double *)got)[i];
        double w = a->type == F32 ? ((const float *)want)[i] : ((const double *)want)[i];
        if (!isfinite(g) || !isfinite(w)) {
            if (!(isnan(g) && isnan(w)) && g != w) return INFINITY;
            continue;
        }
        if (fabs(g - w) > d) d = fabs(g - w);
        if (fabs(w) > s) s = fabs(w);
    }
    if (scale > s) s = scale;
    return s > 0 ? d / s : d;
}

/* ---- the summary: the worst error of each (op, output) on each table ---- */

typedef struct row {
    const char *op;
    char output[48];
    double tol, worst[N_TABLES]; /* -1: not run */
} row;

static row rows[128];
static int n_rows;

static row *row_of(const char *op, const char *output, double tol) {
    for (int r = 0; r < n_rows; r++)
        if (!strcmp(rows[r].op, op) && !strcmp(rows[r].output, output) && rows[r].tol == tol) return &rows[r];
    row *r = &rows[n_rows++];
    r->op = op;
    snprintf(r->output, sizeof r->output, "%s", output);
    r->tol = tol;
    for (int t = 0; t < N_TABLES; t++) r->worst[t] = -1;
    return r;
}

static void record(const char *op, const char *output, double tol, int t, double e) {
    row *r = row_of(op, output, tol);
    if (e > r->worst[t]) r->worst[t] = e;
}

static int wanted(const char *op) { return !only_op || !strcmp(only_op, op); }

/* One case on every table against the reference; frees the case. */
static void check_case(op_case *c) {
    if (!wanted(c->op)) {
        free_case(c);
        return;
    }
    int runs = 0; /* a table other than the reference takes it (a GPU's shapes need a GPU) */
    for (int t = 1; t < N_TABLES; t++) runs += !(tables[t].device ? c->cpu_only : c->gpu_only) && use(&tables[t]);
    if (!runs) {
        free_case(c);
        return;
    }
    void *want[MAXA], *got[MAXA], *got1[MAXA];
    const mrl_kernels *R = use(&tables[0]);
    int touched = run_case(&tables[0], R, c, want);
    if (touched >= 0) fprintf(stderr, "%s %s: the reference wrote its input %s\n", c->op, c->shape, c->a[touched].name);
    CHECK(touched < 0);
    for (int t = 1; t < N_TABLES; t++) {
        int skip = tables[t].device ? c->cpu_only : c->gpu_only;
        const mrl_kernels *k = skip ? NULL : use(&tables[t]);
        if (!k) continue;
        touched = run_case(&tables[t], k, c, got);
        if (touched >= 0) fprintf(stderr, "%s %s on %s: wrote its input %s\n", c->op, c->shape, tables[t].name, c->a[touched].name);
        CHECK(touched < 0);
        for (int j = 0; j < c->na; j++) {
            const arr *a = &c->a[j];
            if (a->role == IN) continue;
            double tol = tol_on(a, &tables[t]), e = error_of(a, tol, scale_on(a, &tables[t]), got[j], want[j]);
            record(c->op, a->name, tol, t, e);
            if (!(e <= tol)) fprintf(stderr, "%s %s on %s: %s error %.3g > %.3g\n", c->op, c->shape, tables[t].name, a->name, e, tol);
            CHECK(e <= tol);
        }
        if (tables[t].threaded && mrl_parallel_threads() > 1) { /* the same bits on one thread */
            int threads = mrl_parallel_threads();
            mrl_parallel_set_threads(1);
            run_case(&tables[t], k, c, got1);
            mrl_parallel_set_threads(threads);
            for (int j = 0; j < c->na; j++) {
                if (c->a[j].role == IN || !memcmp(got[j], got1[j], bytes_of(&c->a[j]))) continue;
                fprintf(stderr, "%s %s on %s: %s differs on 1 and %d threads\n", c->op, c->shape, tables[t].name,
                        c->a[j].name, threads);
                CHECK(0);
            }
            free_outputs(c, got1);
        }
        free_outputs(c, got);
    }
    free_outputs(c, want);
    free_case(c);
}

/* ---- matrix products ---- */

/* p: A, B, C */
static void run_gemm(const mrl_kernels *k, void *const *p, const op_case *c) {
    const int64_t *i = c->i;
    k->gemm((int)i[0], (int)i[1], i[2], i[3], i[4], c->f[0], p[0], i[5], p[1], i[6], c->f[1], p[2], i[7]);
}

static void gemm_params(op_case *c, int ta, int tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                        int64_t ldc, float alpha, float beta) {
    int64_t i[8] = {ta, tb, M, N, K, lda, ldb, ldc};
    memcpy(c->i, i, sizeof i);
    c->f[0] = alpha, c->f[1] = beta;
}

/* A product's C: M rows of ldc random values, those of its N columns NaN when beta is 0 (they
 * must not be read), the gaps to stay as they are. */
static void inout_gemm_c(op_case *c, int64_t M, int64_t N, int64_t ldc, float beta) {
    float *C = rnd(M * ldc, 1);
    for (int64_t x = 0; x < M * ldc; x++)
        if (beta == 0 && x % ldc < N) C[x] = NAN;
    add(c, "C", F32, INOUT, M * ldc, C, TOL_DOT);
    free(C);
}

/* Shapes with edges (1, 7, 31, 33, 257; larger than a cache block: 230 rows,
 * 530 columns, 270 deep; few rows times a transposed matrix: the decode
 * path; many rows of few columns, cut into more slices than one thread
 * would make if the slicing followed the thread count), every transpose,
 * alpha, beta 0 (C full of NaN: must not be read), 0.5 and 1, leading
 * dimensions wider than the matrices (the gaps must stay as they were). */
static void cases_gemm(void) {
    static const int64_t shapes[][3] = {{1, 1, 1},    {1, 33, 31},  {7, 33, 31},  {31, 33, 7},   {33, 7, 31},
                                        {257, 33, 7}, {31, 257, 7}, {33, 7, 257}, {16, 32, 256}, {230, 530, 270},
                                        {64, 96, 0},  {9, 70, 83},  {600, 40, 300}};
    op_case c;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++) {
            int ta = t & 1, tb = t >> 1;
            int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
            int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
            float alpha = t == 3 ? -1.5f : 0.75f, beta = (float)((s + t) % 3) * 0.5f;
            new_case(&c, "gemm", run_gemm, "%c%c %lldx%lldx%lld beta %g", ta ? 'T' : 'N', tb ? 'T' : 'N',
                     (long long)M, (long long)N, (long long)K, beta);
            in_rnd(&c, "A", (ta ? K : M) * lda, 1);
            in_rnd(&c, "B", (tb ? N : K) * ldb, 1);
            inout_gemm_c(&c, M, N, ldc, beta);
            gemm_params(&c, ta, tb, M, N, K, lda, ldb, ldc, alpha, beta);
            check_case(&c);
        }
}

/* p: y, u, x, A, B; i: T, N, K, r; f[0]: the scale */
static void run_lora_fwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->lora_fwd(p[0], p[1], p[2], p[3], p[4], c->i[0], c->i[1], c->i[2], c->i[3], c->f[0]);
}

/* LoRA's two thin products: one row, a decode step's rows (the few-rows kernel, up to 64), more
 * (the library's products), ranks 1 to 64, SmolLM2's q and down shapes, odd edges. */
static void cases_lora(void) {
    static const int64_t shapes[][4] = {{1, 33, 31, 1},    {16, 576, 576, 16}, {5, 576, 1536, 8},
                                        {64, 96, 200, 64}, {65, 257, 130, 4},  {300, 40, 33, 2}}; /* T, N, K, r */
    op_case c;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t T = shapes[s][0], N = shapes[s][1], K = shapes[s][2], r = shapes[s][3];
        new_case(&c, "lora_fwd", run_lora_fwd, "%lldx%lld <- %lld, rank %lld", (long long)T, (long long)N, (long long)K,
                 (long long)r);
        inout_rnd(&c, "y", T * N, 1, TOL_DOT);
        add(&c, "u", F32, OUT, T * r, NULL, TOL_DOT);
        in_rnd(&c, "x", T * K, 1);
        in_rnd(&c, "A", r * K, 0.3f);
        in_rnd(&c, "B", N * r, 0.3f);
        c.i[0] = T, c.i[1] = N, c.i[2] = K, c.i[3] = r;
        c.f[0] = 2.0f;
        check_case(&c);
    }
}

/* p: A, B, C; i[8], i[9]: A, B given as bf16 (else fp32, rounded on the way in) */
static void run_gemm_bf16(const mrl_kernels *k, void *const *p, const op_case *c) {
    const int64_t *i = c->i;
    k->gemm_bf16((int)i[0], (int)i[1], i[2], i[3], i[4], c->f[0], p[0], (int)i[8], i[5], p[1], (int)i[9], i[6],
                 c->f[1], p[2], i[7]);
}

/* n random values rounded to bf16 (the operands a bf16 model keeps). */
static uint16_t *rnd_bf16(int64_t n) {
    float *x = rnd(n, 1);
    uint16_t *h = malloc(sizeof(uint16_t) * (n + 1));
    for (int64_t i = 0; i < n; i++) h[i] = mrl_f32_to_bf16(x[i]);
    free(x);
    return h;
}

/* An input of n random values: rounded to bf16 and given as bf16 when bf16, else fp32. */
static void in_rnd_maybe_bf16(op_case *c, const char *name, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *h = rnd_bf16(n);
        add(c, name, U16, IN, n, h, 0);
        free(h);
    } else {
        in_rnd(c, name, n, 1);
    }
}

/* The bf16 products of a model in dtype bf16: every transpose, operands fp32
 * (rounded on the way in) or bf16 already, few rows (our AVX512-BF16
 * kernel) and many (oneDNN), beta 0 (C full of NaN), 0.5 and 1, leading
 * dimensions wider than the matrices. Against the reference's exact bf16
 * products summed in double: the fast paths sum the same products in fp32
 * (TOL_DOT; tests/kernels/test_gemm_bf16.c holds each path to the
 * element-wise bound). */
static void case_gemm_bf16(int ta, int tb, int64_t M, int64_t N, int64_t K, int a16, int b16, float alpha, float beta,
                           int pad16, int gpu_only) {
    if (gpu_only && !gpu_here()) return;
    int64_t lda = (ta ? M : K) + (a16 ? pad16 : 3), ldb = (tb ? K : N) + (b16 ? pad16 : 5), ldc = N + 2;
    int64_t na = (ta ? K : M) * lda, nb = (tb ? N : K) * ldb;
    op_case c;
    new_case(&c, "gemm_bf16", run_gemm_bf16, "%c%c %lldx%lldx%lld %s x %s beta %g", ta ? 'T' : 'N', tb ? 'T' : 'N',
             (long long)M, (long long)N, (long long)K, a16 ? "bf16" : "f32", b16 ? "bf16" : "f32", beta);
    in_rnd_maybe_bf16(&c, "A", na, a16);
    in_rnd_maybe_bf16(&c, "B", nb, b16);
    inout_gemm_c(&c, M, N, ldc, beta);
    gpu_tol(&c, 2, TOL_GPU_BF16);
    gemm_params(&c, ta, tb, M, N, K, lda, ldb, ldc, alpha, beta);
    c.i[8] = a16, c.i[9] = b16, c.gpu_only = gpu_only;
    check_case(&c);
}

/* The bf16 products of a model in dtype bf16: every transpose, operands fp32
 * (rounded on the way in) or bf16 already, few rows (our AVX512-BF16
 * kernel) and many (oneDNN), beta 0 (C full of NaN), 0.5 and 1, leading
 * dimensions wider than the matrices. Against the reference's exact bf16
 * products summed in double: the fast paths sum the same products in fp32
 * (TOL_DOT; tests/kernels/test_gemm_bf16.c holds each path to the
 * element-wise bound). Then the GPU's shapes: bf16 rows padded to 8
 * elements (16 bytes, what its tensor-core kernels want), and a model's
 * shape and its weight gradient's (tensor-core tiles; the GPU's alone). */
static void cases_gemm_bf16(void) {
    static const int64_t shapes[][3] = {{1, 33, 31}, {7, 64, 96}, {16, 200, 64}, {33, 70, 257}, {230, 130, 70}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 4; t++) {
            int mode = (int)(s + t) % 4;
            case_gemm_bf16(t & 1, t >> 1, shapes[s][0], shapes[s][1], shapes[s][2], mode & 1, mode >> 1,
                           t == 3 ? -1.5f : 0.75f, (float)((s + t) % 3) * 0.5f, 3, 0);
        }
    static const int64_t gpu[][3] = {{1, 1, 1},    {1, 33, 31},     {7, 33, 31}, {33, 7, 257},
                                     {16, 32, 256}, {230, 530, 270}, {64, 96, 0}, {9, 70, 83}};
    for (size_t s = 0; s < sizeof gpu / sizeof gpu[0]; s++)
        for (int t = 0; t < 4 && gpu[s][2] > 0; t++) {
            int mode = (int)(s + t) % 4;
            case_gemm_bf16(t & 1, t >> 1, gpu[s][0], gpu[s][1], gpu[s][2], mode & 1, mode >> 1,
                           t == 3 ? -1.5f : 0.75f, (float)((s + t) % 3) * 0.5f, 8, 0);
        }
    case_gemm_bf16(0, 1, 512, 1024, 768, 1, 1, 1.0f, 0.0f, 8, 1); /* a model's shape: tensor-core kernels */
    case_gemm_bf16(1, 0, 768, 1024, 512, 0, 0, 1.0f, 1.0f, 8, 1); /* the weight gradient's */
}

static void run_gemm_bf16_panels(const mrl_kernels *k, void *const *p, const op_case *c) {
    const int64_t *i = c->i;
    k->gemm_bf16_panels(i[0], i[1], i[2], c->f[0], p[0], i[3], p[1], i[5] ? p[2] : NULL, i[2], c->f[1], p[3], i[4]);
}

static void run_panels16_pack(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->panels16_pack(p[0], p[1], c->i[0], c->i[1]);
}

/* One product of W's bf16 panels (packed by the reference; `pack`: the packing checked too),
 * with or without its plain copy; *worst: the reference's panels against its plain product. */
static void case_gemm_bf16_panels(int64_t M, int64_t N, int64_t K, float alpha, float beta, int with_w16, int pack,
                                  double *worst) {
    const mrl_kernels *R = mrl_kernels_cpu_reference();
    int64_t ldc = N + 3, lda = K + 1, np = mrl_panels16_dwords(N, K);
    uint16_t *W = rnd_bf16(N * K);
    uint32_t *P = malloc(sizeof(uint32_t) * np);
    R->panels16_pack(P, W, N, K);
    op_case c;
    if (pack) {
        new_case(&c, "panels16_pack", run_panels16_pack, "%lldx%lld", (long long)N, (long long)K);
        add(&c, "P", I32, OUT, np, NULL, TOL_BITS);
        add(&c, "W", U16, IN, N * K, W, 0);
        c.i[0] = N, c.i[1] = K;
        check_case(&c);
    }
    new_case(&c, "gemm_bf16_panels", run_gemm_bf16_panels, "%lldx%lldx%lld beta %g%s", (long long)M, (long long)N,
             (long long)K, beta, with_w16 ? " (+ plain copy)" : "");
    in_rnd(&c, "A", M * lda, 1);
    add(&c, "P", I32, IN, np, P, 0);
    add(&c, "W16", U16, IN, N * K, W, 0);
    inout_gemm_c(&c, M, N, ldc, beta);
    gpu_tol(&c, 3, TOL_GPU_BF16);
    int64_t i[6] = {M, N, K, lda, ldc, with_w16};
    memcpy(c.i, i, sizeof i);
    c.f[0] = alpha, c.f[1] = beta;
    if (wanted(c.op)) { /* the reference's panels against its plain product */
        float *C1 = malloc(sizeof(float) * M * ldc), *C2 = malloc(sizeof(float) * M * ldc);
        memcpy(C1, c.a[3].init, sizeof(float) * M * ldc);
        memcpy(C2, c.a[3].init, sizeof(float) * M * ldc);
        R->gemm_bf16(0, 1, M, N, K, alpha, c.a[0].init, 0, lda, W, 1, K, beta, C1, ldc);
        R->gemm_bf16_panels(M, N, K, alpha, c.a[0].init, lda, P, NULL, 0, beta, C2, ldc);
        double e = error_of(&c.a[3], c.a[3].tol, c.a[3].scale, C2, C1);
        *worst = e > *worst ? e : *worst;
        free(C1), free(C2);
    }
    check_case(&c);
    free(W), free(P);
}

/* The engine's products in bf16: W as bf16 weight panels, with and without
 * its plain copy (the fast table then picks per shape, and may take either:
 * the same values). Rows around the micro-tile's 8 and a block of 16 (1, 3,
 * 8, 13, 64, 131), widths ending inside a panel of 48 (40, 100, 400) or on
 * one (96), depths odd (37: the last pair half zero), 64, and past one k
 * block of 512 (600); beta 0 (C NaN), 1.3. The reference reads the panels;
 * its product is also held to gemm_bf16's on the plain copy (the same
 * products in double: the same bits). The packing: every dword, padding
 * included. Then the GPU's shapes, each from its panels alone and with
 * its plain copy (which the GPU reads instead of unpacking the panels). */
static void cases_gemm_bf16_panels(void) {
    static const int64_t rows_[] = {1, 3, 8, 13, 64, 131}, cols[] = {40, 96, 100, 400}, depth[] = {37, 64, 600};
    double worst = 0;
    int n = 0;
    for (size_t a = 0; a < sizeof rows_ / sizeof rows_[0]; a++)
        for (size_t b = 0; b < sizeof cols / sizeof cols[0]; b++)
            for (size_t d = 0; d < sizeof depth / sizeof depth[0]; d++, n++)
                case_gemm_bf16_panels(rows_[a], cols[b], depth[d], n % 3 ? 0.7f : -1.0f, n % 2 ? 1.3f : 0.0f,
                                      n % 4 < 2, b == 0 || a == 0, &worst);
    static const int64_t gpu[][3] = {{1, 40, 37}, {13, 100, 600}, {64, 96, 128}};
    for (size_t g = 0; g < sizeof gpu / sizeof gpu[0]; g++) {
        case_gemm_bf16_panels(gpu[g][0], gpu[g][1], gpu[g][2], 0.75f, 0.5f, 0, 1, &worst);
        case_gemm_bf16_panels(gpu[g][0], gpu[g][1], gpu[g][2], 1.0f, 0.0f, 1, 0, &worst);
    }
    if (wanted("gemm_bf16_panels")) record("gemm_bf16_panels", "panels vs plain (reference)", TOL_BITS, 0, worst);
    CHECK(worst == 0);
}

/* c->extra: a group's parts, their P, W16 and C as offsets into p[1], p[2], p[3] */
typedef struct panels_group {
    int n, w16; /* bit i: part i given its plain copy */
    int64_t M, K, lda, N[8], p_at[8], w_at[8], c_at[8], ldc[8];
    float alpha[8], beta[8];
} panels_group;

static void group_parts(const panels_group *g, void *const *p, int w16, mrl_panels_part *w) {
    for (int i = 0; i < g->n; i++)
        w[i] = (mrl_panels_part){g->N[i], (const uint32_t *)p[1] + g->p_at[i],
                                 w16 >> i & 1 ? (const uint16_t *)p[2] + g->w_at[i] : NULL, g->K, g->alpha[i],
                                 g->beta[i], (float *)p[3] + g->c_at[i], g->ldc[i]};
}

static void run_gemm_bf16_panels_group(const mrl_kernels *k, void *const *p, const op_case *c) {
    const panels_group *g = c->extra;
    mrl_panels_part w[8];
    group_parts(g, p, g->w16, w);
    k->gemm_bf16_panels_group(g->M, g->K, p[0], g->lda, w, g->n);
}

/* Groups of one A (the engine's q, k, v: 576 + 192 + 192; gate, up; widths
 * ending inside a panel, 1 to 8 parts), rows 1 to 300 (two row tiles),
 * depths odd, 576 and past a k block; each part its own alpha, beta (0: C
 * NaN) and ldc; with and without the plain copies, and (the GPU's groups)
 * the second part alone with its copy. Each C against the reference as
 * gemm_bf16_panels' are, and on the fast table the same bits as each part
 * alone over its panels. */
static void cases_gemm_bf16_panels_group(void) {
    static const struct { int64_t M, K; int n; int64_t N[8]; int mixed; } groups[] = {
        {1, 576, 3, {576, 192, 192}}, {64, 576, 3, {576, 192, 192}}, {64, 576, 2, {1536, 1536}},
        {13, 37, 3, {100, 40, 400}},  {131, 600, 2, {96, 50}},       {300, 64, 4, {48, 7, 200, 96}},
        {8, 130, 8, {40, 48, 49, 1, 96, 100, 20, 60}}, {5, 600, 1, {400}},
        {7, 70, 2, {40, 24}, 1}, {64, 128, 2, {96, 32}, 1}};
    const mrl_kernels *R = mrl_kernels_cpu_reference(), *F = mrl_kernels_cpu_fast();
    double worst = 0;
    for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++)
        for (int mode = 0; mode < 2 + groups[gi].mixed; mode++) {
            int w16 = mode == 0 ? 0 : mode == 1 ? 0xff : 2;
            panels_group g = {.n = groups[gi].n, .w16 = w16, .M = groups[gi].M, .K = groups[gi].K,
                              .lda = groups[gi].K + 3};
            int64_t np = 0, nw = 0, nc = 0;
            for (int i = 0; i < g.n; i++) {
                g.N[i] = groups[gi].N[i], g.ldc[i] = g.N[i] + i;
                g.p_at[i] = np, g.w_at[i] = nw, g.c_at[i] = nc;
                np += mrl_panels16_dwords(g.N[i], g.K), nw += g.N[i] * g.K, nc += g.M * g.ldc[i];
                g.alpha[i] = i % 2 ? 0.7f : -1.0f, g.beta[i] = (i + (int)gi) % 3 ? 0.0f : 1.3f;
            }
            uint16_t *W = rnd_bf16(nw);
            uint32_t *P = malloc(sizeof(uint32_t) * np);
            float *C = rnd(nc, 1);
            for (int i = 0; i < g.n; i++) {
                R->panels16_pack(P + g.p_at[i], W + g.w_at[i], g.N[i], g.K);
                for (int64_t x = 0; x < g.M * g.ldc[i]; x++)
                    if (g.beta[i] == 0 && x % g.ldc[i] < g.N[i]) C[g.c_at[i] + x] = NAN;
            }
            op_case c;
            new_case(&c, "gemm_bf16_panels_group", run_gemm_bf16_panels_group, "%lld rows, %d parts, depth %lld%s",
                     (long long)g.M, g.n, (long long)g.K,
                     mode == 1 ? " (+ plain copies)" : mode == 2 ? " (+ the second's plain copy)" : "");
            in_rnd(&c, "A", g.M * g.lda, 1);
            add(&c, "P", I32, IN, np, P, 0);
            add(&c, "W16", U16, IN, nw, W, 0);
            gpu_tol(&c, add(&c, "C", F32, INOUT, nc, C, TOL_DOT), TOL_GPU_BF16);
            c.extra = &g;
            if (wanted(c.op) && !w16) { /* the fast group against each part alone, over its panels */
                float *C1 = malloc(sizeof(float) * nc), *C2 = malloc(sizeof(float) * nc);
                memcpy(C1, C, sizeof(float) * nc), memcpy(C2, C, sizeof(float) * nc);
                void *p1[4] = {c.a[0].init, P, W, C1}, *p2[4] = {c.a[0].init, P, W, C2};
                mrl_panels_part w[8];
                group_parts(&g, p1, 0, w);
                F->gemm_bf16_panels_group(g.M, g.K, c.a[0].init, g.lda, w, g.n);
                group_parts(&g, p2, 0, w);
                for (int i = 0; i < g.n; i++)
                    F->gemm_bf16_panels(g.M, w[i].N, g.K, w[i].alpha, c.a[0].init, g.lda, w[i].P, NULL, 0, w[i].beta,
                                        w[i].C, w[i].ldc);
                for (int64_t x = 0; x < nc; x++)
                    if (memcmp(&C1[x], &C2[x], 4)) worst = 1;
                free(C1), free(C2);
            }
            check_case(&c);
            free(W), free(P), free(C);
        }
    if (wanted("gemm_bf16_panels_group")) record("gemm_bf16_panels_group", "group vs each alone (fast)", TOL_BITS, 1, worst);
    CHECK(worst == 0);
}

/* c->extra: n descriptors whose A, B, C are offsets into p[0], p[1], p[2] */
static void run_gemm_group(const mrl_kernels *k, void *const *p, const op_case *c) {
    int n = (int)c->i[0];
    mrl_gemm_desc g[16];
    memcpy(g, c->extra, sizeof(mrl_gemm_desc) * n);
    for (int j = 0; j < n; j++) {
        g[j].A = (const float *)p[0] + (intptr_t)g[j].A;
        g[j].B = (const float *)p[1] + (intptr_t)g[j].B;
        g[j].C = (float *)p[2] + (intptr_t)g[j].C;
    }
    k->gemm_group(g, n);
}

#define AT(offset) ((float *)(intptr_t)(offset)) /* an offset in a descriptor of run_gemm_group */

/* Groups: three products of other shapes (one empty), and ten (more than the
 * fast table's eight at a time), outputs apart. */
static void cases_gemm_group(void) {
    op_case c;
    int64_t M = 37, N = 29, K = 45;
    mrl_gemm_desc three[3] = {{0, 1, M, N, K, 1.0f, AT(0), K, AT(0), K, 0.0f, AT(0), N},
                              {1, 0, N, M, K / 2, 2.0f, AT(0), N, AT(0), M, 1.0f, AT(M * N), M},
                              {0, 0, 0, N, K, 1.0f, AT(0), K, AT(0), N, 0.0f, AT(2 * M * N), N}};
    new_case(&c, "gemm_group", run_gemm_group, "3 products, one empty");
    in_rnd(&c, "A", M * K, 1);
    in_rnd(&c, "B", K * N, 1);
    inout_rnd(&c, "C", 3 * M * N, 1, TOL_DOT);
    c.i[0] = 3, c.extra = three;
    check_case(&c);
    mrl_gemm_desc ten[10];
    for (int j = 0; j < 10; j++)
        ten[j] = (mrl_gemm_desc){j % 2, 1, 5 + j, 11, 13, 1.0f, AT(0), j % 2 ? 5 + j : 13, AT(0), 13, 0.5f, AT(j * 16 * 11), 11};
    new_case(&c, "gemm_group", run_gemm_group, "10 products");
    in_rnd(&c, "A", 16 * 13, 1);
    in_rnd(&c, "B", 11 * 13, 1);
    inout_rnd(&c, "C", 10 * 16 * 11, 1, TOL_DOT);
    c.i[0] = 10, c.extra = ten;
    check_case(&c);
    /* a product on panels (B = W [N,K] packed) and a plain one reading the same x as [K,M] */
    static const int64_t mixed[][3] = {{5, 70, 33}, {64, 96, 128}};
    for (int s = 0; s < 2; s++) {
        int64_t M = mixed[s][0], N = mixed[s][1], K = mixed[s][2], np = mrl_panels_floats(N, K);
        float *W = rnd(N * K, 1), *B = zeros(np + K * N), *B2 = rnd(K * N, 1);
        mrl_kernels_cpu_reference()->panels_pack(B, W, N, K);
        memcpy(B + np, B2, sizeof(float) * K * N);
        mrl_gemm_desc two[2] = {{0, 1, M, N, K, 1.0f, AT(0), K, AT(0), K, 0.5f, AT(0), N, .b_panels = 1},
                                {1, 0, M, N, K, -0.75f, AT(0), M, AT(np), N, 1.0f, AT(M * N), N, 0}};
        new_case(&c, "gemm_group", run_gemm_group, "panels and plain %lldx%lldx%lld", (long long)M, (long long)N,
                 (long long)K);
        in_rnd(&c, "A", M * K, 1);
        add(&c, "B", F32, IN, np + K * N, B, 0);
        inout_rnd(&c, "C", 2 * M * N, 1, TOL_DOT);
        c.i[0] = 2, c.extra = two;
        check_case(&c);
        free(W), free(B), free(B2);
    }
}

/* Products with W given as weight panels (the engine's decode products):
 * row counts around the tile heights (1..7, 13, 64, 131), widths that end
 * inside a panel (40, 100) or on one (96), beta 0 (C NaN: not read) and
 * 1.3, ldc wider than N (the gap untouched). The reference's panel product
 * is also held to its plain product on W. */
static void cases_gemm_panels(void) {
    static const int64_t rows_[] = {1, 2, 3, 4, 5, 6, 7, 13, 64, 131}, cols[] = {40, 96, 100}, depth[] = {37, 64};
    const mrl_kernels *R = mrl_kernels_cpu_reference();
    op_case c;
    double worst = 0;
    for (size_t a = 0; a < sizeof rows_ / sizeof rows_[0]; a++)
        for (size_t b = 0; b < sizeof cols / sizeof cols[0]; b++)
            for (size_t d = 0; d < sizeof depth / sizeof depth[0]; d++) {
                int64_t M = rows_[a], N = cols[b], K = depth[d], ldc = N + 3;
                float beta = (a + b + d) % 2 ? 1.3f : 0.0f;
                float *A = rnd(M * K, 1), *W = rnd(N * K, 1), *P = zeros(mrl_panels_floats(N, K)), *C = rnd(M * ldc, 1);
                for (int64_t x = 0; x < M * ldc; x++)
                    if (beta == 0 && x % ldc < N) C[x] = NAN;
                R->panels_pack(P, W, N, K);
                mrl_gemm_desc g = {0, 1, M, N, K, 0.7f, AT(0), K, AT(0), 0, beta, AT(0), ldc, .b_panels = 1};
                new_case(&c, "gemm_group", run_gemm_group, "panels %lldx%lldx%lld beta %g", (long long)M, (long long)N,
                         (long long)K, beta);
                add(&c, "A", F32, IN, M * K, A, 0);
                add(&c, "P", F32, IN, mrl_panels_floats(N, K), P, 0);
                add(&c, "C", F32, INOUT, M * ldc, C, TOL_DOT);
                c.i[0] = 1, c.extra = &g;
                if (wanted(c.op)) { /* the reference's panels against its plain product on W */
                    float *C1 = zeros(M * ldc), *C2 = zeros(M * ldc);
                    memcpy(C1, C, sizeof(float) * M * ldc);
                    memcpy(C2, C, sizeof(float) * M * ldc);
                    R->gemm(0, 1, M, N, K, 0.7f, A, K, W, K, beta, C1, ldc);
                    mrl_gemm_desc h = g;
                    h.A = A, h.B = P, h.C = C2;
                    R->gemm_group(&h, 1);
                    double e = error_of(&c.a[2], c.a[2].tol, c.a[2].scale, C2, C1);
                    worst = e > worst ? e : worst;
                    free(C1), free(C2);
                }
                check_case(&c);
                free(A), free(W), free(P), free(C);
            }
    if (wanted("gemm_group")) record("gemm_group", "panels vs plain (reference)", TOL_DOT, 0, worst);
    CHECK(worst <= TOL_DOT);
}

/* ---- rmsnorm, rope, swiglu ---- */

static const int64_t norm_shapes[][2] = {{1, 3}, {3, 7}, {150, 67}, {130, 128}}; /* D = 1: dx is all cancellation */

static void run_rmsnorm_fwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->rmsnorm_fwd(p[0], p[1], p[2], p[3], c->i[0], (int)c->i[1], c->f[0]);
}

static void run_rmsnorm_bwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->rmsnorm_bwd(p[0], p[1], p[2], p[3], p[4], p[5], c->i[0], (int)c->i[1]);
}

static void case_rmsnorm(int64_t T, int64_t D, float x_scale, int gpu_only) {
    if (gpu_only && !gpu_here()) return;
    op_case c;
    float *x = rnd(T * D, x_scale), *w = rnd(D, 1), *out = zeros(T * D), *rstd = zeros(T);
    mrl_kernels_cpu_reference()->rmsnorm_fwd(out, rstd, x, w, T, (int)D, 1e-6f);
    new_case(&c, "rmsnorm_fwd", run_rmsnorm_fwd, "%lldx%lld", (long long)T, (long long)D);
    add(&c, "out", F32, OUT, T * D, NULL, TOL_ULPS);
    add(&c, "rstd", F32, OUT, T, NULL, TOL_ULPS);
    add(&c, "x", F32, IN, T * D, x, 0);
    add(&c, "w", F32, IN, D, w, 0);
    c.i[0] = T, c.i[1] = D, c.f[0] = 1e-6f, c.gpu_only = gpu_only;
    check_case(&c);
    new_case(&c, "rmsnorm_bwd", run_rmsnorm_bwd, "%lldx%lld", (long long)T, (long long)D);
    gpu_tol(&c, inout_rnd(&c, "dx", T * D, 1, TOL_ULPS), TOL_DOT); /* the GPU's row dot in fp32 */
    gpu_tol(&c, inout_rnd(&c, "dw", D, 1, TOL_DOT), TOL_GPU_SUMF); /* T rows summed in fp32 blocks */
    in_rnd(&c, "dout", T * D, 1);
    add(&c, "x", F32, IN, T * D, x, 0);
    add(&c, "w", F32, IN, D, w, 0);
    add(&c, "rstd", F32, IN, T, rstd, 0);
    c.i[0] = T, c.i[1] = D, c.gpu_only = gpu_only;
    check_case(&c);
    free(x), free(w), free(out), free(rstd);
}

/* Then the GPU's: one row of 1, rows of a model's widths (896, 2048) and one
 * wider than a block's share (20000), x of scale 3. */
static void cases_rmsnorm(void) {
    for (size_t s = 0; s < sizeof norm_shapes / sizeof norm_shapes[0]; s++) case_rmsnorm(norm_shapes[s][0], norm_shapes[s][1], 1, 0);
    static const int64_t gpu[][2] = {{1, 1}, {7, 33}, {64, 896}, {300, 2048}, {3, 20000}};
    for (size_t s = 0; s < sizeof gpu / sizeof gpu[0]; s++) case_rmsnorm(gpu[s][0], gpu[s][1], 3, 1);
}

static void run_rope(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->rope(p[0], p[1], p[2], p[3], c->i[0], (int)c->i[1], (int)c->i[2], (int)c->i[3]);
}

static void case_rope(int T, int H, int hd, int inverse, const int32_t *pos, const float *cs, const float *sn, int P) {
    op_case c;
    int half = hd / 2;
    new_case(&c, "rope", run_rope, "%dx%dx%d%s", T, H, hd, inverse ? " inverse" : "");
    inout_rnd(&c, "x", (int64_t)T * H * hd, 1, TOL_ULPS);
    add(&c, "pos", I32, IN, T, pos, 0);
    add(&c, "cos", F32, IN, (int64_t)P * half, cs, 0);
    add(&c, "sin", F32, IN, (int64_t)P * half, sn, 0);
    c.i[0] = T, c.i[1] = H, c.i[2] = hd, c.i[3] = inverse;
    check_case(&c);
}

/* Random tables of 40 positions; then the GPU's shapes over a model's tables of 4096 positions
 * (one head of 2, Qwen-like heads of 64 and 128), at random positions. */
static void cases_rope(void) {
    static const int shapes[][3] = {{5, 2, 6}, {150, 3, 10}, {64, 4, 128}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int inverse = 0; inverse < 2; inverse++) {
            int T = shapes[s][0], hd = shapes[s][2], half = hd / 2, P = 40;
            int32_t *pos = malloc(sizeof(int32_t) * T);
            for (int t = 0; t < T; t++) pos[t] = (t * 7) % P;
            float *cs = rnd(P * half, 1), *sn = rnd(P * half, 1);
            case_rope(T, shapes[s][1], hd, inverse, pos, cs, sn, P);
            free(pos), free(cs), free(sn);
        }
    static const int gpu[][3] = {{1, 1, 2}, {9, 4, 64}, {100, 14, 128}};
    int P = 4096;
    for (size_t s = 0; s < sizeof gpu / sizeof gpu[0]; s++)
        for (int inverse = 0; inverse < 2; inverse++) {
            int T = gpu[s][0], hd = gpu[s][2], half = hd / 2;
            float *cs = malloc(sizeof(float) * P * half), *sn = malloc(sizeof(float) * P * half);
            for (int q = 0; q < P; q++)
                for (int i = 0; i < half; i++) {
                    double a = q * pow(10000.0, -2.0 * i / hd);
                    cs[q * half + i] = (float)cos(a), sn[q * half + i] = (float)sin(a);
                }
            int32_t *pos = malloc(sizeof(int32_t) * T);
            for (int t = 0; t < T; t++) pos[t] = (int32_t)(urand() * P);
            case_rope(T, gpu[s][1], hd, inverse, pos, cs, sn, P);
            free(cs), free(sn), free(pos);
        }
}

/* ---- MLA's attention inputs (mla_qkv, its backward) and copy_rows ---- */

static void run_mla_qkv(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->mla_qkv(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], c->i[0], (int)c->i[1], (int)c->i[2], (int)c->i[3],
               (int)c->i[4], (int)c->i[5], (int)c->i[6]);
}

static void run_mla_qkv_bwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->mla_qkv_bwd(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], c->i[0], (int)c->i[1], (int)c->i[2],
                   (int)c->i[3], (int)c->i[4], (int)c->i[5], (int)c->i[6]);
}

/* T tokens, H heads: nope dn, rope dr, values dv, padded to hd; tables of P positions */
static void case_mla(int T, int H, int dn, int dr, int dv, int hd, int il, int P, int gpu_only) {
    if (gpu_only && !gpu_here()) return;
    int half = dr / 2;
    int32_t *pos = malloc(sizeof(int32_t) * T);
    for (int t = 0; t < T; t++) pos[t] = (int32_t)(urand() * P);
    float *cs = rnd((int64_t)P * half, 1), *sn = rnd((int64_t)P * half, 1);
    int64_t n = (int64_t)T * H * hd;
    op_case c;
    new_case(&c, "mla_qkv", run_mla_qkv, "%dx%d nope %d rope %d v %d hd %d%s", T, H, dn, dr, dv, hd,
             il ? " interleaved" : "");
    add(&c, "q", F32, OUT, n, NULL, TOL_ULPS);      /* copies and rope's rotation: the same arithmetic */
    add(&c, "k", F32, OUT, n, NULL, TOL_ULPS);
    add(&c, "v", F32, OUT, n, NULL, TOL_BITS);
    in_rnd(&c, "qf", (int64_t)T * H * (dn + dr), 1);
    in_rnd(&c, "kv", (int64_t)T * H * (dn + dv), 1);
    in_rnd(&c, "kr", (int64_t)T * dr, 1);
    add(&c, "pos", I32, IN, T, pos, 0);
    add(&c, "cos", F32, IN, (int64_t)P * half, cs, 0);
    add(&c, "sin", F32, IN, (int64_t)P * half, sn, 0);
    c.i[0] = T, c.i[1] = H, c.i[2] = dn, c.i[3] = dr, c.i[4] = dv, c.i[5] = hd, c.i[6] = il, c.gpu_only = gpu_only;
    check_case(&c);
    new_case(&c, "mla_qkv_bwd", run_mla_qkv_bwd, "%dx%d nope %d rope %d v %d hd %d%s", T, H, dn, dr, dv, hd,
             il ? " interleaved" : "");
    add(&c, "dqf", F32, OUT, (int64_t)T * H * (dn + dr), NULL, TOL_ULPS);
    add(&c, "dkv", F32, OUT, (int64_t)T * H * (dn + dv), NULL, TOL_BITS);
    add(&c, "dkr", F32, OUT, (int64_t)T * dr, NULL, TOL_ULPS); /* the heads' sum in head order */
    in_rnd(&c, "dq", n, 1);
    in_rnd(&c, "dk", n, 1);
    in_rnd(&c, "dv", n, 1);
    add(&c, "pos", I32, IN, T, pos, 0);
    add(&c, "cos", F32, IN, (int64_t)P * half, cs, 0);
    add(&c, "sin", F32, IN, (int64_t)P * half, sn, 0);
    c.i[0] = T, c.i[1] = H, c.i[2] = dn, c.i[3] = dr, c.i[4] = dv, c.i[5] = hd, c.i[6] = il, c.gpu_only = gpu_only;
    check_case(&c);
    free(pos), free(cs), free(sn);
}

static void run_copy_rows(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->copy_rows(p[0], c->i[0], p[1], c->i[1], c->i[2], c->i[3]);
}

/* A tiny MLA; values wider than the queries (padded to dv); no nope part; a model's heads (DeepSeek-V3:
 * 128 + 64, values 128) on the GPU. copy_rows: a part of each row into a narrower and a wider one. */
static void cases_mla(void) {
    static const int shapes[][6] = {{3, 2, 4, 2, 3, 6}, {5, 3, 6, 4, 12, 12}, {7, 2, 0, 4, 6, 6}, {40, 4, 16, 8, 16, 24}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int il = 0; il < 2; il++) {
            const int *x = shapes[s];
            case_mla(x[0], x[1], x[2], x[3], x[4], x[5], il, 40, 0);
        }
    for (int il = 0; il < 2; il++) case_mla(64, 16, 128, 64, 128, 192, il, 4096, 1);
    static const int64_t rows[][4] = {{1, 5, 3, 3}, {7, 9, 4, 9}, {20, 6, 10, 6}, {300, 576, 512, 512}};
    for (size_t s = 0; s < sizeof rows / sizeof rows[0]; s++) {
        int64_t R = rows[s][0], lds = rows[s][1], cols = rows[s][2], ldd = rows[s][3];
        op_case c;
        new_case(&c, "copy_rows", run_copy_rows, "%lld rows of %lld from %lld into %lld", (long long)R, (long long)cols,
                 (long long)lds, (long long)ldd);
        inout_rnd(&c, "dst", (R - 1) * ldd + cols + 2, 1, TOL_BITS); /* what lies between the rows stays */
        in_rnd(&c, "src", (R - 1) * lds + cols, 1);
        c.i[0] = ldd, c.i[1] = lds, c.i[2] = R, c.i[3] = cols;
        check_case(&c);
    }
}

static void run_swiglu_fwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->swiglu_fwd(p[0], p[1], p[2], c->i[0]);
}

static void run_swiglu_bwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->swiglu_bwd(p[0], p[1], p[2], p[3], p[4], c->i[0]);
}

/* 40000: over one thread's share; the GPU's 1000 and 2^20 with gates of scale 4 */
static void cases_swiglu(void) {
    static const int64_t sizes[] = {1, 19, 1003, 40000, 1000, 1 << 20};
    op_case c;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        float gs = s < 4 ? 3 : 4;
        new_case(&c, "swiglu_fwd", run_swiglu_fwd, "%lld", (long long)n);
        add(&c, "out", F32, OUT, n, NULL, TOL_ULPS);
        in_rnd(&c, "gate", n, gs);
        in_rnd(&c, "up", n, 1);
        c.i[0] = n;
        check_case(&c);
        new_case(&c, "swiglu_bwd", run_swiglu_bwd, "%lld", (long long)n);
        add(&c, "dgate", F32, OUT, n, NULL, TOL_ULPS);
        add(&c, "dup", F32, OUT, n, NULL, TOL_ULPS);
        in_rnd(&c, "dout", n, 1);
        in_rnd(&c, "gate", n, gs);
        in_rnd(&c, "up", n, 1);
        c.i[0] = n;
        check_case(&c);
    }
}

/* ---- attention ---- */

/* A packed batch: n sequences, their cumulative lengths and prefixes. */
typedef struct attn_layout {
    const char *name;
    int n;
    int32_t cu[9], prefix[8]; /* prefix[0] = -2: none */
    int Hq, Hk, hd;
    int gpu; /* the GPU's: scale 1/sqrt(hd) (else 0.3) */
} attn_layout;

/* 4 sequences (one of length 1, one longer than a query block of 64); the
 * shared-prompt layout of mrl_batch.prefix (0 a prefix of 9 rows with
 * children of 5, 1 and 70 rows; 4 alone; 5 a prefix of 66 rows with one
 * child); a small MHA one. Then the GPU's, at scale 1/sqrt(hd): one token;
 * heads of 64, 128, 80 and 256 (its tiles' widths); shared prompts with an
 * empty sequence, and one-token children. */
static const attn_layout attn_layouts[] = {
    {"4 seqs, GQA 6/2, hd 20", 4, {0, 1, 71, 100, 150}, {-2}, 6, 2, 20},
    {"prefixes, GQA 6/2, hd 20", 7, {0, 9, 14, 15, 85, 88, 154, 158}, {-1, 0, 0, 0, -1, -1, 5}, 6, 2, 20},
    {"3 seqs, MHA 2/2, hd 7", 3, {0, 4, 5, 9}, {-2}, 2, 2, 7},
    {"1 token, hd 8", 1, {0, 1}, {-2}, 1, 1, 8, 1},
    {"3 seqs, GQA 4/2, hd 64", 3, {0, 5, 38, 108}, {-2}, 4, 2, 64, 1},
    {"2 seqs, MHA 8/8, hd 128", 2, {0, 100, 131}, {-2}, 8, 8, 128, 1},
    {"prefixes and an empty seq, GQA 6/2, hd 80", 4, {0, 40, 57, 57, 121}, {-1, 0, -1, 0}, 6, 2, 80, 1},
    {"prefixes, GQA 4/1, hd 256", 5, {0, 20, 29, 41, 74, 77}, {-1, 0, 0, -1, 3}, 4, 1, 256, 1},
    {"one-token children, MHA 2/2, hd 32", 3, {0, 1, 2, 3}, {-1, 0, 0}, 2, 2, 32, 1},
};

static const int32_t *prefix_of(const attn_layout *L) { return L->prefix[0] == -2 ? NULL : L->prefix; }

/* p: out, lse, q, k, v, cu, prefix (when the layout has one) */
static void run_attn_fwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->attn_fwd(p[0], p[1], p[2], p[3], p[4], p[5], c->i[1] ? p[6] : NULL, (int)c->i[0], (int)c->i[2], (int)c->i[3],
                (int)c->i[4], c->f[0]);
}

/* p: dq, dk, dv, dout, out, lse, q, k, v, cu, prefix */
static void run_attn_bwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->attn_bwd(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], c->i[1] ? p[10] : NULL, (int)c->i[0],
                (int)c->i[2], (int)c->i[3], (int)c->i[4], c->f[0]);
}

static void attn_params(op_case *c, const attn_layout *L, float scale) {
    c->i[0] = L->n, c->i[1] = prefix_of(L) != NULL, c->i[2] = L->Hq, c->i[3] = L->Hk, c->i[4] = L->hd;
    c->f[0] = scale;
}

static void cases_attention(void) {
    op_case c;
    for (size_t s = 0; s < sizeof attn_layouts / sizeof attn_layouts[0]; s++) {
        const attn_layout *L = &attn_layouts[s];
        int64_t T = L->cu[L->n], nq = T * L->Hq * L->hd, nk = T * L->Hk * L->hd;
        float scale = L->gpu ? 1.0f / sqrtf((float)L->hd) : 0.3f;
        float *q = rnd(nq, 1), *k = rnd(nk, 1), *v = rnd(nk, 1), *out = zeros(nq), *lse = zeros(T * L->Hq);
        mrl_kernels_cpu_reference()->attn_fwd(out, lse, q, k, v, L->cu, prefix_of(L), L->n, L->Hq, L->Hk, L->hd, scale);
        new_case(&c, "attn_fwd", run_attn_fwd, "%s", L->name);
        gpu_tol(&c, add(&c, "out", F32, OUT, nq, NULL, TOL_DOT), TOL_GPU_ATTN);
        gpu_tol(&c, add(&c, "lse", F32, OUT, T * L->Hq, NULL, TOL_ULPS), TOL_GPU_ATTN);
        add(&c, "q", F32, IN, nq, q, 0);
        add(&c, "k", F32, IN, nk, k, 0);
        add(&c, "v", F32, IN, nk, v, 0);
        add(&c, "cu", I32, IN, L->n + 1, L->cu, 0);
        if (prefix_of(L)) add(&c, "prefix", I32, IN, L->n, L->prefix, 0);
        attn_params(&c, L, scale);
        check_case(&c);
        new_case(&c, "attn_bwd", run_attn_bwd, "%s", L->name);
        gpu_tol(&c, add(&c, "dq", F32, OUT, nq, NULL, TOL_DOT), TOL_GPU_ATTN_BWD);
        gpu_tol(&c, add(&c, "dk", F32, OUT, nk, NULL, TOL_DOT), TOL_GPU_ATTN_BWD);
        gpu_tol(&c, add(&c, "dv", F32, OUT, nk, NULL, TOL_DOT), TOL_GPU_ATTN_BWD);
        in_rnd(&c, "dout", nq, 1);
        add(&c, "out", F32, IN, nq, out, 0);
        add(&c, "lse", F32, IN, T * L->Hq, lse, 0);
        add(&c, "q", F32, IN, nq, q, 0);
        add(&c, "k", F32, IN, nk, k, 0);
        add(&c, "v", F32, IN, nk, v, 0);
        add(&c, "cu", I32, IN, L->n + 1, L->cu, 0);
        if (prefix_of(L)) add(&c, "prefix", I32, IN, L->n, L->prefix, 0);
        attn_params(&c, L, scale);
        check_case(&c);
        free(q), free(k), free(v), free(out), free(lse);
    }
}

/* ---- the head ---- */

/* p: logits, targets, lse, entropy, logprob */
static void run_head_fwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->head_fwd(p[0], c->i[0], (int)c->i[1], c->f[0], p[1], p[2], p[3], p[4]);
}

/* p: logits (in place), targets, lse, entropy, dlogprob, dentropy (i[2]: given) */
static void run_head_bwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->head_bwd(p[0], c->i[0], (int)c->i[1], c->f[0], p[1], p[2], p[3], p[4], c->i[2] ? p[5] : NULL);
}

static int32_t *head_targets(int64_t rows, int V) {
    int32_t *tg = malloc(sizeof(int32_t) * rows);
    /* none every fourth row, and every fifth one in another rank's slice of the vocabulary */
    for (int64_t r = 0; r < rows; r++) tg[r] = r % 4 == 3 ? -1 : r % 5 == 2 ? V + (int32_t)r : (int32_t)((r * 97) % V);
    return tg;
}

/* The GPU's (gpu): a vocabulary of 1, a model's (32000, 151936) over up to 64 rows, inverse
 * temperatures 1 and 1/0.7, targets at random; held to its own bound without the logits'
 * scale, and dlogits to one relative to the upstream dlogprob's size (the target's gradient,
 * dlogprob (1 - p), cancels where p is near 1). */
static void case_head(int64_t rows, int V, float inv_temp, int gpu) {
    if (gpu && !gpu_here()) return;
    op_case c;
    float *z = rnd(rows * V, 3), *lse = zeros(rows), *ent = zeros(rows), *lp = zeros(rows);
    int32_t *tg = head_targets(rows, V);
    for (int64_t r = 0; gpu && r < rows; r++) tg[r] = r % 4 == 3 ? -1 : r % 5 == 2 ? V : (int32_t)(urand() * V);
    mrl_kernels_cpu_reference()->head_fwd(z, rows, V, inv_temp, tg, lse, ent, lp);
    new_case(&c, "head_fwd", run_head_fwd, "%lldx%d", (long long)rows, V);
    add(&c, "logits", F32, IN, rows * V, z, 0);
    add(&c, "targets", I32, IN, rows, tg, 0);
    /* entropy = lse - sum p z and logprob = z_t - lse are differences of terms of the logits'
     * size: their rounding is relative to that, not to the difference (a row of 7 logits with
     * one far above the rest has an entropy near 0) */
    double zmax = 0;
    for (int64_t i = 0; i < rows * V; i++) zmax = fmax(zmax, fabs(z[i]) * inv_temp);
    gpu_tol(&c, add(&c, "lse", F32, OUT, rows, NULL, TOL_ULPS), TOL_GPU_HEAD);
    for (int j = 0; j < 2; j++) {
        int o = add(&c, j ? "logprob" : "entropy", F32, OUT, rows, NULL, TOL_DOT);
        c.a[o].scale = zmax;
        gpu_tol(&c, o, TOL_GPU_HEAD);
        if (gpu) c.a[o].dscale = 0;
    }
    c.i[0] = rows, c.i[1] = V, c.f[0] = inv_temp, c.gpu_only = gpu;
    check_case(&c);
    for (int with_entropy = 0; with_entropy < 2; with_entropy++) {
        new_case(&c, "head_bwd", run_head_bwd, "%lldx%d%s", (long long)rows, V, with_entropy ? " entropy" : "");
        /* dlogits = inv_temp p (dlogprob-side terms + dentropy (E z - z)): of the size of
         * inv_temp (1 + zmax) for inputs in [-1, 1] */
        int d = add(&c, "dlogits", F32, INOUT, rows * V, z, TOL_DOT);
        c.a[d].scale = inv_temp * (1 + zmax);
        gpu_tol(&c, d, TOL_GPU_HEAD);
        add(&c, "targets", I32, IN, rows, tg, 0);
        add(&c, "lse", F32, IN, rows, lse, 0);
        add(&c, "entropy", F32, IN, rows, ent, 0);
        int g = in_rnd(&c, "dlogprob", rows, 1);
        in_rnd(&c, "dentropy", rows, 1);
        if (gpu) {
            double floor = 0;
            for (int64_t r = 0; r < rows; r++) floor = fmax(floor, fabs(((float *)c.a[g].init)[r]) * inv_temp);
            c.a[d].dscale = floor;
        }
        c.i[0] = rows, c.i[1] = V, c.i[2] = with_entropy, c.f[0] = inv_temp, c.gpu_only = gpu;
        check_case(&c);
    }
    free(z), free(lse), free(ent), free(lp), free(tg);
}

static void cases_head(void) {
    static const int shapes[][2] = {{1, 7}, {4, 32}, {13, 1003}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) case_head(shapes[s][0], shapes[s][1], 1 / 0.7f, 0);
    static const int gpu[][2] = {{1, 1}, {5, 1000}, {64, 32000}, {3, 151936}};
    for (size_t s = 0; s < sizeof gpu / sizeof gpu[0]; s++) case_head(gpu[s][0], gpu[s][1], s % 2 ? 1.0f : 1 / 0.7f, 1);
}

/* ---- rows, biases, panels ---- */

static void run_gather_rows(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->gather_rows(p[0], p[1], p[2], c->i[0], c->i[1]);
}

static void run_scatter_add_rows(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->scatter_add_rows(p[0], p[1], p[2], c->i[0], c->i[1]);
}

static void run_bias_add(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->bias_add(p[0], p[1], c->i[0], c->i[1]);
}

static void run_bias_bwd(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->bias_bwd(p[0], p[1], c->i[0], c->i[1]);
}

static void run_panels_pack(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->panels_pack(p[0], p[1], c->i[0], c->i[1]);
}

/* Rows named several times (the same token twice in a batch; in order, as
 * the GPU's sorted runs must keep them), rows named -1 (none), a table of rows (V) and the rows
 * taken (n) of several widths; biases over few and
 * many rows; panels ending inside a panel and on one. */
static void cases_rows(void) {
    static const int64_t shapes[][3] = {{5, 7, 3}, {300, 256, 40}, {2048, 64, 151}, /* n, D, V */
                                        {1, 1, 1}, {50, 64, 10}, {3000, 896, 700}}; /* the GPU's: rows at random */
    op_case c;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t n = shapes[s][0], D = shapes[s][1], V = shapes[s][2];
        int32_t *idx = malloc(sizeof(int32_t) * n);
        for (int64_t i = 0; i < n; i++) idx[i] = s < 3 ? (int32_t)((i * 31 + i * i) % V) : (int32_t)(urand() * V);
        if (s == 0 || s == 4) /* rows of another rank's vocabulary slice: zeros, and no gradient */
            for (int64_t i = 1; i < n; i += 3) idx[i] = -1;
        new_case(&c, "gather_rows", run_gather_rows, "%lld of %lldx%lld", (long long)n, (long long)V, (long long)D);
        add(&c, "out", F32, OUT, n * D, NULL, TOL_BITS);
        in_rnd(&c, "src", V * D, 1);
        add(&c, "idx", I32, IN, n, idx, 0);
        c.i[0] = n, c.i[1] = D;
        check_case(&c);
        new_case(&c, "scatter_add_rows", run_scatter_add_rows, "%lld into %lldx%lld", (long long)n, (long long)V,
                 (long long)D);
        inout_rnd(&c, "dst", V * D, 1, TOL_BITS);
        in_rnd(&c, "src", n * D, 1);
        add(&c, "idx", I32, IN, n, idx, 0);
        c.i[0] = n, c.i[1] = D;
        check_case(&c);
        free(idx);
        new_case(&c, "bias_add", run_bias_add, "%lldx%lld", (long long)n, (long long)D);
        inout_rnd(&c, "y", n * D, 1, TOL_BITS);
        in_rnd(&c, "b", D, 1);
        c.i[0] = n, c.i[1] = D;
        check_case(&c);
        new_case(&c, "bias_bwd", run_bias_bwd, "%lldx%lld", (long long)n, (long long)D);
        inout_rnd(&c, "db", D, 1, TOL_BITS);
        in_rnd(&c, "dy", n * D, 1);
        c.i[0] = n, c.i[1] = D;
        check_case(&c);
    }
    static const int64_t panels[][2] = {{40, 37}, {96, 64}, {100, 1}, {1000, 128}, {70, 33}, {96, 128}}; /* N, K */
    for (size_t s = 0; s < sizeof panels / sizeof panels[0]; s++) {
        int64_t N = panels[s][0], K = panels[s][1];
        new_case(&c, "panels_pack", run_panels_pack, "%lldx%lld", (long long)N, (long long)K);
        add(&c, "P", F32, OUT, mrl_panels_floats(N, K), NULL, TOL_BITS);
        in_rnd(&c, "W", N * K, 1);
        c.i[0] = N, c.i[1] = K;
        check_case(&c);
    }
}

/* ---- the paged KV cache ---- */

/* A random permutation of 0..n-1. */
static int32_t *permutation(int n) {
    int32_t *p = malloc(sizeof(int32_t) * (n ? n : 1));
    for (int i = 0; i < n; i++) p[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(urand() * (i + 1)), t = p[i];
        p[i] = p[j], p[j] = t;
    }
    return p;
}

static void run_kv_write(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->paged_kv_write(p[0], p[1], p[2], p[3], p[4], c->i[0], (int)c->i[1], (int)c->i[2], (int)c->i[3]);
}

static void run_kv_write_bf16(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->paged_kv_write_bf16(p[0], p[1], p[2], p[3], p[4], c->i[0], (int)c->i[1], (int)c->i[2], (int)c->i[3]);
}

/* p: out, q, k_cache, v_cache, block_tables, seq_lens, query_start;
 * i: n_seqs, max_blocks, block_size, Hq, Hk, hd, with a workspace */
static void run_paged_attn(const mrl_kernels *k, void *const *p, const op_case *c) {
    mrl_paged_attn a = {.out = p[0], .q = p[1], .k_cache = p[2], .v_cache = p[3], .block_tables = p[4],
                        .seq_lens = p[5], .query_start = p[6], .n_seqs = (int)c->i[0],
                        .max_blocks_per_seq = (int)c->i[1], .block_size = (int)c->i[2], .Hq = (int)c->i[3],
                        .Hk = (int)c->i[4], .hd = (int)c->i[5], .scale = c->f[0], .kv_bf16 = (int)c->i[7]};
    void *ws = NULL;
    if (c->i[6]) { /* the caller's workspace, exactly the size asked for */
        a.workspace_bytes = k->paged_attn_workspace(&a);
        a.workspace = ws = a.workspace_bytes > 0 ? malloc((size_t)a.workspace_bytes) : NULL;
    }
    if (c->i[8]) mrl_cpu_paged_attn_bf16_products(0); /* the fp32 loops over the bf16 cache */
    CHECK_OK(k->paged_attn(&a));
    mrl_cpu_paged_attn_bf16_products(1);
    free(ws);
}

/* One step over a paged cache of nb blocks: n_seqs sequences of lens[i] tokens, the last
 * qs[i+1] - qs[i] of them new (their K/V written first, every fifth token's skipped), their
 * blocks tables_ [n_seqs, max_blocks]. */
static void case_paged(int n_seqs, const int32_t *lens, const int32_t *qs, const int32_t *tables_, int max_blocks,
                       int nb, int Hq, int Hk, int hd, int bs, int gpu_only) {
    op_case c;
    int64_t cache = (int64_t)nb * Hk * bs * hd, T = qs[n_seqs];
    int32_t *slots = malloc(sizeof(int32_t) * (T ? T : 1));
    for (int i = 0; i < n_seqs; i++)
        for (int32_t t = qs[i]; t < qs[i + 1]; t++) {
            int pos = lens[i] - (qs[i + 1] - qs[i]) + (t - qs[i]);
            slots[t] = t % 5 == 4 ? -1 : tables_[i * max_blocks + pos / bs] * bs + pos % bs;
        }
    new_case(&c, "paged_kv_write", run_kv_write, "%lld tokens, Hk %d hd %d, blocks of %d", (long long)T, Hk, hd, bs);
    inout_rnd(&c, "k_cache", cache, 1, TOL_BITS);
    inout_rnd(&c, "v_cache", cache, 1, TOL_BITS);
    in_rnd(&c, "k", T * Hk * hd, 1);
    in_rnd(&c, "v", T * Hk * hd, 1);
    add(&c, "slots", I32, IN, T, slots, 0);
    c.i[0] = T, c.i[1] = Hk, c.i[2] = hd, c.i[3] = bs, c.gpu_only = gpu_only;
    check_case(&c);
    new_case(&c, "paged_kv_write_bf16", run_kv_write_bf16, "%lld tokens, Hk %d hd %d, blocks of %d", (long long)T,
             Hk, hd, bs);
    uint16_t *kc16 = rnd_bf16(cache), *vc16 = rnd_bf16(cache);
    add(&c, "k_cache", U16, INOUT, cache, kc16, TOL_BITS);
    add(&c, "v_cache", U16, INOUT, cache, vc16, TOL_BITS);
    in_rnd(&c, "k", T * Hk * hd, 1);
    in_rnd(&c, "v", T * Hk * hd, 1);
    add(&c, "slots", I32, IN, T, slots, 0);
    c.i[0] = T, c.i[1] = Hk, c.i[2] = hd, c.i[3] = bs, c.gpu_only = gpu_only;
    check_case(&c);
    for (int run = 0; run < 4; run++) {
        int ws = run == 1, bf16 = run >= 2, fp32_products = run == 3;
        new_case(&c, "paged_attn", run_paged_attn, "GQA %d/%d hd %d, blocks of %d%s", Hq, Hk, hd, bs,
                 ws ? ", the caller's workspace" : fp32_products ? ", bf16 cache, fp32 products" : bf16 ? ", bf16 cache" : "");
        if (bf16 && !fp32_products) gpu_tol(&c, add(&c, "out (bf16 cache)", F32, OUT, T * Hq * hd, NULL, TOL_PAGED_BF16), TOL_GPU_ATTN);
        else gpu_tol(&c, add(&c, "out", F32, OUT, T * Hq * hd, NULL, TOL_PAGED), TOL_GPU_ATTN);
        if (bf16) { /* q bf16-exact: the bf16 products round it to itself */
            float *q = rnd(T * Hq * hd, 1);
            for (int64_t j = 0; j < T * Hq * hd; j++) q[j] = mrl_bf16_to_f32(mrl_f32_to_bf16(q[j]));
            add(&c, "q", F32, IN, T * Hq * hd, q, 0);
            free(q);
        } else {
            in_rnd(&c, "q", T * Hq * hd, 1);
        }
        if (bf16) {
            add(&c, "k_cache", U16, IN, cache, kc16, 0);
            add(&c, "v_cache", U16, IN, cache, vc16, 0);
        } else {
            in_rnd(&c, "k_cache", cache, 2);
            in_rnd(&c, "v_cache", cache, 1);
        }
        add(&c, "block_tables", I32, IN, (int64_t)n_seqs * max_blocks, tables_, 0);
        add(&c, "seq_lens", I32, IN, n_seqs, lens, 0);
        add(&c, "query_start", I32, IN, n_seqs + 1, qs, 0);
        c.i[0] = n_seqs, c.i[1] = max_blocks, c.i[2] = bs, c.i[3] = Hq, c.i[4] = Hk, c.i[5] = hd, c.i[6] = ws;
        c.i[7] = bf16, c.i[8] = fp32_products, c.gpu_only = gpu_only;
        c.cpu_only = ws || fp32_products; /* a GPU takes no workspace, and reads a bf16 cache widened always */
        c.f[0] = 1.0f / sqrtf((float)hd);
        check_case(&c);
    }
    free(slots), free(kc16), free(vc16);
}

/* The errors a GPU finds on the device: a sequence longer than its blocks hold (its output
 * NaN, the error reported by sync, once); and Hq not a multiple of Hk, refused before any
 * launch. The step of case_paged, on the device table t. */
static void gpu_paged_errors(const table *t, const mrl_kernels *k, int n_seqs, const int32_t *lens, const int32_t *qs,
                             const int32_t *tables_, int max_blocks, int nb, int Hq, int Hk, int hd, int bs) {
    int64_t cache = (int64_t)nb * Hk * bs * hd, T = qs[n_seqs];
    float *q = rnd(T * Hq * hd, 1), *kc = rnd(cache, 1);
    tmem m[7];
    float *dq = tmem_alloc(t, &m[0], sizeof(float) * T * Hq * hd), *dout = tmem_alloc(t, &m[1], sizeof(float) * T * Hq * hd);
    float *dkc = tmem_alloc(t, &m[2], sizeof(float) * cache), *dvc = tmem_alloc(t, &m[3], sizeof(float) * cache);
    int32_t *dtab = tmem_alloc(t, &m[4], sizeof(int32_t) * n_seqs * max_blocks);
    int32_t *dlens = tmem_alloc(t, &m[5], sizeof(int32_t) * n_seqs), *dqs = tmem_alloc(t, &m[6], sizeof(int32_t) * (n_seqs + 1));
    CHECK_OK(k->to_device(dq, q, sizeof(float) * T * Hq * hd));
    CHECK_OK(k->to_device(dkc, kc, sizeof(float) * cache));
    CHECK_OK(k->to_device(dvc, kc, sizeof(float) * cache));
    CHECK_OK(k->to_device(dtab, tables_, sizeof(int32_t) * n_seqs * max_blocks));
    CHECK_OK(k->to_device(dqs, qs, sizeof(int32_t) * (n_seqs + 1)));
    int32_t bad[16];
    memcpy(bad, lens, sizeof(int32_t) * n_seqs);
    bad[1] = max_blocks * bs + 1;
    CHECK_OK(k->to_device(dlens, bad, sizeof(int32_t) * n_seqs));
    mrl_paged_attn d = {.out = dout, .q = dq, .k_cache = dkc, .v_cache = dvc, .block_tables = dtab, .seq_lens = dlens,
                        .query_start = dqs, .n_seqs = n_seqs, .max_blocks_per_seq = max_blocks, .block_size = bs,
                        .Hq = Hq, .Hk = Hk, .hd = hd, .scale = 1.0f / sqrtf((float)hd)};
    CHECK(k->paged_attn_workspace(&d) == 0);
    CHECK_OK(k->paged_attn(&d));
    CHECK(k->sync() == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "sequence 1");
    CHECK_OK(k->sync()); /* reported once */
    if (Hk > 1) { /* not a multiple of Hk: refused before any launch */
        d.Hq = Hk * 2 + 1;
        CHECK(k->paged_attn(&d) == MRL_ERR_INVALID);
        CHECK(k->sync() == MRL_ERR_INVALID);
    }
    for (int i = 0; i < 7; i++) tmem_free(t, &m[i]);
    free(q), free(kc);
}

/* Sequences whose blocks are scattered over the cache (a random block table
 * each), mixed prefill chunks and single-token decodes, contexts up to 300
 * tokens (past the fast kernel's key tile of 256); GQA 2:1, 4:1, 7:1
 * (Qwen2.5-0.5B: head runs of 4 + 3), 16:1, MHA; blocks of 4, 16, 5, 7
 * and 32 (not a multiple of 16: the plain loops); hd 8 .. 128. Each with the
 * cache in fp32 and in bf16 (its values rounded: the same for every table).
 * Then the GPU's: one token; decodes and prefill chunks over contexts up
 * to 1000, heads of 128 and of 1024 (the largest), each sequence's blocks
 * with a spare one past its end; and the errors it finds on the device. */
static void cases_paged(void) {
    static const int shapes[][4] = {{4, 2, 16, 4}, {8, 2, 64, 16}, {14, 2, 64, 16},
                                    {3, 3, 24, 5}, {2, 1, 128, 7}, {16, 1, 8, 32},
                                    {6, 2, 64, 16}, {10, 2, 40, 16}, {12, 2, 32, 32}}; /* Hq, Hk, hd, block_size:
                                    groups of 1-8 heads (each its own run in the AVX-512 loops) and 16 */
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int Hq = shapes[s][0], Hk = shapes[s][1], hd = shapes[s][2], bs = shapes[s][3], n_seqs = 5, max_len = 300;
        int max_blocks = (max_len + bs - 1) / bs, nb = n_seqs * max_blocks + 3;
        int32_t lens[5], qs[6] = {0}, *tables_ = malloc(sizeof(int32_t) * n_seqs * max_blocks), *perm = permutation(nb);
        for (int i = 0; i < n_seqs; i++) {
            lens[i] = i == 0 ? max_len : 1 + (int)(urand() * max_len);
            int n_q = i % 2 ? 1 : 1 + (int)(urand() * (lens[i] < 48 ? lens[i] : 48)); /* decodes and chunks */
            qs[i + 1] = qs[i] + n_q;
            for (int b = 0; b < max_blocks; b++) tables_[i * max_blocks + b] = perm[i * max_blocks + b];
        }
        case_paged(n_seqs, lens, qs, tables_, max_blocks, nb, Hq, Hk, hd, bs, 0);
        free(tables_), free(perm);
    }
    static const struct { int n; int32_t lens[4], n_q[4]; int Hq, Hk, hd, bs; } gpu[] = {
        {1, {1}, {1}, 1, 1, 8, 16},
        {4, {37, 300, 5, 64}, {1, 1, 5, 20}, 8, 2, 64, 16},
        {3, {129, 77, 1000}, {3, 1, 1}, 14, 2, 128, 32},
        {2, {40, 41}, {40, 2}, 4, 4, 1024, 8}};
    for (size_t s = 0; s < sizeof gpu / sizeof gpu[0] && gpu_here(); s++) {
        int n = gpu[s].n, bs = gpu[s].bs, max_blocks = 0, nb = 3;
        for (int i = 0; i < n; i++) {
            int b = (gpu[s].lens[i] + bs - 1) / bs + 1; /* a spare block past the end */
            max_blocks = b > max_blocks ? b : max_blocks;
            nb += b;
        }
        int32_t qs[5] = {0}, *tables_ = calloc((size_t)n * max_blocks, sizeof(int32_t)), *perm = permutation(nb), used = 0;
        for (int i = 0; i < n; i++) {
            for (int b = 0; b < (gpu[s].lens[i] + bs - 1) / bs + 1; b++) tables_[i * max_blocks + b] = perm[used++];
            qs[i + 1] = qs[i] + gpu[s].n_q[i];
        }
        case_paged(n, gpu[s].lens, qs, tables_, max_blocks, nb, gpu[s].Hq, gpu[s].Hk, gpu[s].hd, bs, 1);
        for (int t = 1; t < N_TABLES && n > 1 && wanted("paged_attn"); t++) {
            const mrl_kernels *k = tables[t].device ? use(&tables[t]) : NULL;
            if (k) gpu_paged_errors(&tables[t], k, n, gpu[s].lens, qs, tables_, max_blocks, nb, gpu[s].Hq, gpu[s].Hk,
                                    gpu[s].hd, bs);
        }
        free(tables_), free(perm);
    }
}

/* ---- the latent cache (multi-head latent attention's absorbed form) ---- */

static void run_latent_write(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->latent_kv_write(p[0], p[1], p[2], c->i[0], (int)c->i[1], (int)c->i[2]);
}

static void run_mla_paged_attn(const mrl_kernels *k, void *const *p, const op_case *c) {
    mrl_paged_attn a = {.out = p[0], .q = p[1], .k_cache = p[2], .block_tables = p[3], .seq_lens = p[4],
                        .query_start = p[5], .n_seqs = (int)c->i[0], .max_blocks_per_seq = (int)c->i[1],
                        .block_size = (int)c->i[2], .Hq = (int)c->i[3], .Hk = 1, .hd = (int)c->i[4],
                        .hv = (int)c->i[5], .scale = c->f[0], .kv_bf16 = (int)c->i[6]};
    if (!c->i[7] || a.n_seqs < 2) {
        if (c->i[8]) mrl_cpu_paged_attn_bf16_products(0); /* the fp32 products over the bf16 cache */
        CHECK_OK(k->mla_paged_attn(&a));
        mrl_cpu_paged_attn_bf16_products(1);
        return;
    }
    /* (in two runs, the engine's mixed steps: the first sequence alone, then the rest from its end) */
    mrl_paged_attn first = a, rest = a;
    first.n_seqs = 1;
    rest.n_seqs = a.n_seqs - 1, rest.query_start = a.query_start + 1, rest.seq_lens = a.seq_lens + 1;
    rest.block_tables = a.block_tables + a.max_blocks_per_seq;
    CHECK_OK(k->mla_paged_attn(&rest));
    CHECK_OK(k->mla_paged_attn(&first));
}

/* One step over a latent cache of nb blocks (case_paged's batch): rows of W, values hv, H heads.
 * The write (every fifth row skipped), fp32 and bf16; the attention over an fp32 and a bf16 cache. */
static void case_latent(int n_seqs, const int32_t *lens, const int32_t *qs, const int32_t *tables_, int max_blocks,
                        int nb, int H, int W, int hv, int bs, int gpu_only) {
    int64_t cache = (int64_t)nb * bs * W, T = qs[n_seqs];
    int32_t *slots = malloc(sizeof(int32_t) * (T ? T : 1));
    for (int i = 0; i < n_seqs; i++)
        for (int32_t t = qs[i]; t < qs[i + 1]; t++) {
            int pos = lens[i] - (qs[i + 1] - qs[i]) + (t - qs[i]);
            slots[t] = t % 5 == 4 ? -1 : tables_[i * max_blocks + pos / bs] * bs + pos % bs;
        }
    uint16_t *c16 = rnd_bf16(cache);
    for (int run = 0; run < 4; run++) {
        int bf16 = run == 1 || run == 3, split = run == 2, fp32_products = run == 3;
        op_case c;
        if (!split && !fp32_products) {
            new_case(&c, "latent_kv_write", run_latent_write, "%lld rows of %d, blocks of %d%s", (long long)T, W, bs,
                     bf16 ? ", bf16" : "");
            if (bf16) add(&c, "cache", U16, INOUT, cache, c16, TOL_BITS);
            else inout_rnd(&c, "cache", cache, 1, TOL_BITS);
            in_rnd(&c, "rows", T * W, 1);
            add(&c, "slots", I32, IN, T, slots, 0);
            c.i[0] = T, c.i[1] = W, c.i[2] = bf16, c.gpu_only = gpu_only;
            check_case(&c);
        }
        new_case(&c, "mla_paged_attn", run_mla_paged_attn, "%d heads, rows of %d, values %d, blocks of %d%s", H, W, hv,
                 bs, fp32_products ? ", bf16 cache, fp32 products" : bf16 ? ", bf16 cache" : split ? ", in two runs (the second past row 0)" : "");
        if (bf16 && !fp32_products) gpu_tol(&c, add(&c, "out (bf16 cache)", F32, OUT, T * H * hv, NULL, TOL_PAGED_BF16), TOL_GPU_ATTN);
        else gpu_tol(&c, add(&c, "out", F32, OUT, T * H * hv, NULL, TOL_PAGED), TOL_GPU_ATTN);
        float *q = rnd(T * H * W, 0.3f);
        for (int64_t j = 0; bf16 && j < T * H * W; j++) q[j] = mrl_bf16_to_f32(mrl_f32_to_bf16(q[j])); /* (bf16-exact) */
        add(&c, "q", F32, IN, T * H * W, q, 0);
        free(q);
        if (bf16) add(&c, "cache", U16, IN, cache, c16, 0);
        else in_rnd(&c, "cache", cache, 1);
        add(&c, "block_tables", I32, IN, (int64_t)n_seqs * max_blocks, tables_, 0);
        add(&c, "seq_lens", I32, IN, n_seqs, lens, 0);
        add(&c, "query_start", I32, IN, n_seqs + 1, qs, 0);
        c.i[0] = n_seqs, c.i[1] = max_blocks, c.i[2] = bs, c.i[3] = H, c.i[4] = W, c.i[5] = hv, c.i[6] = bf16;
        c.i[7] = split, c.i[8] = fp32_products, c.gpu_only = gpu_only, c.cpu_only = fp32_products;
        c.f[0] = 1.0f / sqrtf((float)W);
        check_case(&c);
    }
    free(slots), free(c16);
}

/* Decodes and prefill chunks of 5 sequences up to 300 tokens: a tiny latent (12 + 4, heads of 4),
 * one of 36 + 8 in blocks of 5, values all of the row; two whose rows and values the bf16
 * products take (heads of 8 and 7, blocks of 16 and of 5, odd: row pairs across blocks) and
 * DeepSeek-V3's (512 + 64, values 512, 16 heads); on the GPU DeepSeek-V3's. */
static void cases_latent(void) {
    static const int shapes[][4] = {{4, 16, 12, 16}, {3, 44, 36, 5}, {2, 24, 24, 16},  /* H, W, hv, block_size */
                                    {8, 64, 32, 16}, {7, 96, 64, 5}, /* (the bf16 products: W, hv multiples of 32) */
                                    {16, 576, 512, 16}}; /* (DeepSeek-V3's) */
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int H = shapes[s][0], W = shapes[s][1], hv = shapes[s][2], bs = shapes[s][3], n_seqs = 5, max_len = 300;
        int max_blocks = (max_len + bs - 1) / bs, nb = n_seqs * max_blocks + 3;
        int32_t lens[5], qs[6] = {0}, *tables_ = malloc(sizeof(int32_t) * n_seqs * max_blocks), *perm = permutation(nb);
        for (int i = 0; i < n_seqs; i++) {
            lens[i] = i == 0 ? max_len : 1 + (int)(urand() * max_len);
            int n_q = i % 2 ? 1 : 1 + (int)(urand() * (lens[i] < 48 ? lens[i] : 48));
            qs[i + 1] = qs[i] + n_q;
            for (int b = 0; b < max_blocks; b++) tables_[i * max_blocks + b] = perm[i * max_blocks + b];
        }
        case_latent(n_seqs, lens, qs, tables_, max_blocks, nb, H, W, hv, bs, 0);
        free(tables_), free(perm);
    }
    if (!gpu_here()) return;
    int32_t lens[2] = {200, 37}, qs[3] = {0, 1, 6}, tables_[2 * 13], *perm = permutation(30);
    for (int i = 0; i < 26; i++) tables_[i] = perm[i];
    case_latent(2, lens, qs, tables_, 13, 30, 16, 576, 512, 16, 1);
    free(perm);
}

/* ---- sampling ---- */

/* p: logits [n_logits, V], which row each sample reads, u; then tokens,
 * logprobs, lp_processed. extra: the params of each sample. */
static void run_sample(const mrl_kernels *k, void *const *p, const op_case *c) {
    int64_t n = c->i[0];
    int V = (int)c->i[1];
    const float **rows_ = malloc(sizeof(*rows_) * n);
    const mrl_sampling_params **pp = malloc(sizeof(*pp) * n);
    for (int64_t r = 0; r < n; r++) {
        rows_[r] = (const float *)p[0] + (int64_t)((const int32_t *)p[1])[r] * V;
        pp[r] = (const mrl_sampling_params *)c->extra + r;
    }
    CHECK_OK(k->sample(rows_, n, V, pp, p[2], p[3], p[4], p[5]));
    free(rows_), free(pp);
}

/* n samples of rows [n_rows, V]: sample r reads row which[r] with params[r] and u[r]. */
static void sample_case(int n, int n_rows, int V, const float *logits, const int32_t *which, const double *u,
                        const mrl_sampling_params *params) {
    op_case c;
    new_case(&c, "sample", run_sample, "%d samples of %d rows of %d", n, n_rows, V);
    add(&c, "logits", F32, IN, (int64_t)n_rows * V, logits, 0);
    on_host(&c, add(&c, "rows", I32, IN, n, which, 0)); /* read by run_sample */
    on_host(&c, add(&c, "u", F64, IN, n, u, 0));        /* the slot's host arrays */
    on_host(&c, add(&c, "tokens", I32, OUT, n, NULL, 0));
    on_host(&c, add(&c, "logprobs", F32, OUT, n, NULL, TOL_SAMPLE));
    on_host(&c, add(&c, "lp_processed", F32, OUT, n, NULL, TOL_SAMPLE));
    c.i[0] = n, c.i[1] = V, c.extra = params;
    check_case(&c);
}

/* Greedy, plain, temperature, top-k (with ties), top-p, min-p and all
 * together; samples of a group sharing one row; a vocabulary of 1000 and
 * one of 151,936 (Qwen2.5). Then the GPU's: vocabularies of 7 to 151,936,
 * logits of scale 2.5 (its radix selections over many near values). */
static void cases_sample(void) {
    static const int vocab[] = {1000, 151936}, n_samples[] = {37, 6};
    for (int s = 0; s < 2; s++) {
        int V = vocab[s], n = n_samples[s], n_rows = n - n / 4; /* the last quarter share rows */
        float *logits = malloc(sizeof(float) * n_rows * V);
        for (int64_t x = 0; x < (int64_t)n_rows * V; x++) logits[x] = (float)(urand() * 8 - 4);
        for (int x = 0; x < 40; x++) logits[x] = 5.0f; /* ties at the top of row 0 */
        mrl_sampling_params *params = malloc(sizeof(*params) * n);
        int32_t *which = malloc(sizeof(int32_t) * n);
        double *u = malloc(sizeof(double) * n);
        for (int r = 0; r < n; r++) {
            params[r] = (mrl_sampling_params){r % 5 == 0 ? 0.0f : 0.5f + r % 3, r % 4 == 1 ? 20 : 0,
                                              r % 3 == 2 ? 0.85f : 1.0f, r % 6 == 3 ? 0.05f : 0.0f};
            which[r] = r < n_rows ? r : r % n_rows;
            u[r] = urand();
        }
        params[0] = (mrl_sampling_params){1.0f, 10, 1.0f, 0.0f}; /* top-k inside the ties */
        sample_case(n, n_rows, V, logits, which, u, params);
        free(logits), free(params), free(which), free(u);
    }
    /* the GPU's: the ten kinds of params in turn, every fifth sample on the row before */
    static const mrl_sampling_params kinds[] = {
        {0, 0, 1, 0},     {1, 0, 1, 0},      {0.7f, 50, 1, 0},   {1.0f, 0, 0.9f, 0}, {0.8f, 0, 1, 0.05f},
        {1.2f, 40, 0.8f, 0.02f}, {0.6f, 1, 1, 0}, {1, 0, 0.3f, 0},  {1, 7, 0.95f, 0},   {2.0f, 0, 0.99f, 0.001f},
    };
    static const int gpu[][3] = {{10, 7, 0}, {40, 1000, 3}, {30, 32000, 5}, {10, 151936, 1}}; /* n, V, first kind */
    for (int s = 0; s < 4; s++) {
        int n = gpu[s][0], V = gpu[s][1];
        float *logits = rnd((int64_t)n * V, 2.5f);
        mrl_sampling_params *params = malloc(sizeof(*params) * n);
        int32_t *which = malloc(sizeof(int32_t) * n);
        double *u = malloc(sizeof(double) * n);
        for (int r = 0; r < n; r++) {
            which[r] = r % 5 == 4 ? r - 1 : r;
            params[r] = kinds[(r + gpu[s][2]) % 10];
            u[r] = urand();
        }
        sample_case(n, n, V, logits, which, u, params);
        free(logits), free(params), free(which), free(u);
    }
}

/* p: logits [n_logits, V], which row each of the n reads; then ids [n,k] and lps [n,k].
 * extra: the params of each. */
static void run_top_logprobs(const mrl_kernels *k, void *const *p, const op_case *c) {
    int64_t n = c->i[0];
    int V = (int)c->i[1];
    const float **rows_ = malloc(sizeof(*rows_) * (n ? n : 1));
    const mrl_sampling_params **pp = malloc(sizeof(*pp) * (n ? n : 1));
    for (int64_t r = 0; r < n; r++) {
        rows_[r] = (const float *)p[0] + (int64_t)((const int32_t *)p[1])[r] * V;
        pp[r] = (const mrl_sampling_params *)c->extra + r;
    }
    CHECK_OK(k->top_logprobs(rows_, n, V, pp, (int)c->i[2], p[2], p[3]));
    free(rows_), free(pp);
}

/* The engine's most likely tokens: 1 to 20 of them (its most) and all of a vocabulary of 7;
 * greedy and other temperatures; rows shared by several; ties across the cut (the lower ids
 * first) and at the top; -inf logits (a masked token) ranked last by id; a vocabulary of
 * 1000 and one of 151,936. The ids: the same on every table; the log-probs: x - lse, lse
 * from a double sum of double exps in another order (TOL_SAMPLE, the sampler's). */
static void cases_top_logprobs(void) {
    static const int shape[][3] = {{12, 7, 7}, {37, 1000, 20}, {9, 1000, 1}, {6, 151936, 5}}; /* n, V, k */
    for (int s = 0; s < 4; s++) {
        int n = shape[s][0], V = shape[s][1], k = shape[s][2], n_rows = n - n / 4; /* the last quarter share rows */
        float *logits = malloc(sizeof(float) * n_rows * V);
        for (int64_t x = 0; x < (int64_t)n_rows * V; x++) logits[x] = (float)(urand() * 8 - 4);
        for (int x = 0; x < 40 && x < V; x++) logits[x] = 5.0f;                   /* ties at the top of row 0 */
        for (int x = 3; x < V; x += 5) logits[V + x] = logits[V + 1];            /* ties anywhere in row 1 */
        for (int x = 0; x < V; x += 2) logits[2 * V + x] = -INFINITY;            /* masked tokens in row 2 */
        mrl_sampling_params *params = malloc(sizeof(*params) * n);
        int32_t *which = malloc(sizeof(int32_t) * n);
        for (int r = 0; r < n; r++) {
            params[r] = (mrl_sampling_params){r % 4 == 0 ? 0.0f : 0.5f + r % 3, 0, 1.0f, 0.0f};
            which[r] = r < n_rows ? r : r % n_rows;
        }
        op_case c;
        new_case(&c, "top_logprobs", run_top_logprobs, "%d of %d rows of %d, k = %d", n, n_rows, V, k);
        add(&c, "logits", F32, IN, (int64_t)n_rows * V, logits, 0);
        on_host(&c, add(&c, "rows", I32, IN, n, which, 0));
        on_host(&c, add(&c, "ids", I32, OUT, (int64_t)n * k, NULL, 0));
        on_host(&c, add(&c, "lps", F32, OUT, (int64_t)n * k, NULL, TOL_SAMPLE));
        c.i[0] = n, c.i[1] = V, c.i[2] = k, c.extra = params;
        check_case(&c);
        free(logits), free(params), free(which);
    }
}

/* ---- the router of a sparse layer ---- */

/* p: logits (prob too when in place: i[6]), prob, sel, w, how, replay; i: T, E, k, norm,
 * replay_stride, with replay, in place */
static void run_moe_route(const mrl_kernels *k, void *const *p, const op_case *c) {
    const int64_t *i = c->i;
    float *prob = i[6] ? p[0] : p[1];
    k->moe_route(prob, p[2], p[3], i[5] ? p[4] : NULL, p[0], i[5] ? (const int16_t *)p[5] + i[2] : NULL, i[4], i[0],
                 (int)i[1], (int)i[2], (int)i[3]);
}

static void run_moe_group(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->moe_group(p[0], p[1], p[2], p[3], c->i[0], (int)c->i[1], (int)c->i[2]);
}

/* Router logits [T,E] with no two within rounding of each other unless equal: each row a
 * random order of E values 0.05 apart (probabilities 5% apart: no table's rounding reorders
 * them), and exact ties, which every table breaks alike (the lower expert): in every fifth
 * row the second best and a later expert, in every seventh all equal. */
static float *router_logits(int64_t T, int E) {
    float *x = malloc(sizeof(float) * T * E);
    int32_t *order = malloc(sizeof(int32_t) * E);
    for (int64_t t = 0; t < T; t++) {
        float base = (float)(urand() * 4 - 2);
        for (int e = 0; e < E; e++) order[e] = e;
        for (int e = E - 1; e > 0; e--) {
            int j = (int)(urand() * (e + 1)), tmp = order[e];
            order[e] = order[j], order[j] = tmp;
        }
        for (int e = 0; e < E; e++) x[t * E + order[e]] = base - 0.05f * e;
        if (t % 5 == 1 && E > 2) x[t * E + order[E - 1]] = x[t * E + order[1]];
        if (t % 7 == 3)
            for (int e = 0; e < E; e++) x[t * E + e] = base;
    }
    free(order);
    return x;
}

/* Qwen3-MoE's router (128 experts, 8 picks), Qwen1.5-MoE's (60, 4), small ones, a token of
 * one pick; with and without renormalised weights; in place (as the model calls it) and not;
 * the tokens over the fast table's threads. With replay, from the second of three sparse
 * layers' columns: a third of the tokens their own picks (-1), a third their own set reordered,
 * a third another set. Then the grouping of such picks, experts without any included, and of
 * none. */
/* Replay rows of three layers' picks [T, stride = 3k] whose middle layer's are, token by token:
 * none (-1), the own picks sel [T,k] backwards, k distinct others. */
static void replay_rows(int16_t *rp, const int32_t *sel, int64_t T, int E, int k, int64_t stride) {
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < stride; j++) {
            int at = j - k;
            int16_t v = (int16_t)((t + j) % E);
            if (at >= 0 && at < k)
                v = t % 3 == 0 ? -1 : t % 3 == 1 ? (int16_t)sel[t * k + (k - 1 - at)] : (int16_t)((t + at) % E);
            rp[t * stride + j] = v;
        }
}

/* A router case's arrays 0..5 (run_moe_route's): the logits (or prob in place), prob, sel, w,
 * how (replayed: an output), the replay rows */
static void route_arrays(op_case *c, const float *x, const int32_t *sel, const int16_t *rp, int64_t T, int E, int k,
                         int64_t stride, int replay, int in_place) {
    if (in_place) gpu_tol(c, add(c, "prob (in place)", F32, INOUT, T * E, x, TOL_BITS), TOL_ROUTE);
    else add(c, "logits", F32, IN, T * E, x, 0);
    gpu_tol(c, add(c, "prob", F32, in_place ? IN : OUT, T * E, in_place ? x : NULL, TOL_BITS), TOL_ROUTE);
    add(c, "sel", I32, OUT, T * k, NULL, 0);
    gpu_tol(c, add(c, "w", F32, OUT, T * k, NULL, TOL_BITS), TOL_ROUTE);
    add(c, "how", I32, replay ? OUT : IN, T, replay ? NULL : sel, 0);
    add(c, "replay", U16, IN, T * stride, rp, 0);
}

static void cases_moe(void) {
    static const int shape[][3] = {{1, 4, 1}, {37, 8, 2}, {300, 64, 6}, {130, 128, 8}, {513, 60, 4}}; /* T, E, k */
    const mrl_kernels *R = mrl_kernels_cpu_reference();
    for (int s = 0; s < 5; s++)
        for (int mode = 0; mode < 3; mode++) { /* plain, in place, replayed */
            int64_t T = shape[s][0];
            int E = shape[s][1], k = shape[s][2], norm = (s + mode) % 2, replay = mode == 2, in_place = mode == 1;
            int64_t stride = 3 * k;
            float *x = router_logits(T, E), *prob = malloc(sizeof(float) * T * E), *w = malloc(sizeof(float) * T * k);
            int32_t *sel = malloc(sizeof(int32_t) * T * k);
            int16_t *rp = malloc(sizeof(int16_t) * T * stride);
            R->moe_route(prob, sel, w, NULL, x, NULL, 0, T, E, k, norm); /* the own picks, for the replay */
            replay_rows(rp, sel, T, E, k, stride);
            op_case c;
            new_case(&c, "moe_route", run_moe_route, "%lld tokens, %d experts, %d picks%s%s", (long long)T, E, k,
                     norm ? ", normalised" : "", in_place ? ", in place" : replay ? ", replayed" : "");
            route_arrays(&c, x, sel, rp, T, E, k, stride, replay, in_place);
            int64_t i[7] = {T, E, k, norm, stride, replay, in_place};
            memcpy(c.i, i, sizeof i);
            check_case(&c);
            free(x), free(prob), free(w), free(sel), free(rp);
            if (in_place) continue;
            /* the grouping of the picks as routed (the replayed ones included) */
            x = router_logits(T, E), prob = malloc(sizeof(float) * T * E), w = malloc(sizeof(float) * T * k);
            sel = malloc(sizeof(int32_t) * T * k);
            R->moe_route(prob, sel, w, NULL, x, NULL, 0, T, E, k, norm);
            int32_t *picks = malloc(sizeof(int32_t) * T * k);
            for (int64_t t = 0; t < T; t++)
                for (int j = 0; j < k; j++)
                    picks[t * k + j] = replay && t % 3 ? (int32_t)((t + j) % E) : sel[t * k + j];
            new_case(&c, "moe_group", run_moe_group, "%lld picks of %d experts, %d a token", (long long)T * k, E, k);
            add(&c, "eoff", I32, OUT, E + 1, NULL, 0);
            add(&c, "row", I32, OUT, T * k, NULL, 0);
            add(&c, "tok", I32, OUT, T * k, NULL, 0);
            add(&c, "sel", I32, IN, T * k, picks, 0);
            c.i[0] = T * k, c.i[1] = E, c.i[2] = k;
            check_case(&c);
            free(x), free(prob), free(w), free(sel), free(picks);
        }
    /* picks that leave most experts empty, and none at all */
    static const int group[][3] = {{50, 16, 2}, {0, 4, 2}};
    for (int s = 0; s < 2; s++) {
        int64_t A = (int64_t)group[s][0] * group[s][2];
        int32_t *picks = malloc(sizeof(int32_t) * (A ? A : 1));
        for (int64_t i = 0; i < A; i++) picks[i] = i % 2 ? 3 : 11;
        op_case c;
        new_case(&c, "moe_group", run_moe_group, "%lld picks of %d experts, %d a token", (long long)A, group[s][1],
                 group[s][2]);
        add(&c, "eoff", I32, OUT, group[s][1] + 1, NULL, 0);
        add(&c, "row", I32, OUT, A, NULL, 0);
        add(&c, "tok", I32, OUT, A, NULL, 0);
        add(&c, "sel", I32, IN, A, picks, 0);
        c.i[0] = A, c.i[1] = group[s][1], c.i[2] = group[s][2];
        check_case(&c);
        free(picks);
    }
}

static void run_moe_route_grouped(const mrl_kernels *k, void *const *p, const op_case *c) {
    const int64_t *i = c->i;
    float *prob = i[6] ? p[0] : p[1];
    k->moe_route_grouped(prob, p[2], p[3], i[5] ? p[4] : NULL, p[0], p[6], i[5] ? (const int16_t *)p[5] + i[2] : NULL,
                         i[4], i[0], (int)i[1], (int)i[2], (int)i[7], (int)i[8], (int)i[3], c->f[0]);
}

/* DeepSeek-V3's router: the groups of a tiny model, a one-group router, DeepSeek-V3's own shape
 * (256 experts in 8 groups, 4 taken, 8 picks); a bias of multiples of 1/64 (choices that no
 * table's rounding reorders); plain, in place, replayed as moe_route's. */
static void cases_moe_grouped(void) {
    static const int shape[][5] = {{1, 4, 1, 2, 1}, {37, 8, 2, 4, 2}, {300, 64, 6, 8, 4}, {130, 256, 8, 8, 4},
                                   {50, 16, 4, 1, 1}}; /* T, E, k, groups, taken */
    const mrl_kernels *R = mrl_kernels_cpu_reference();
    for (int s = 0; s < 5; s++)
        for (int mode = 0; mode < 3; mode++) {
            int64_t T = shape[s][0];
            int E = shape[s][1], k = shape[s][2], G = shape[s][3], tg = shape[s][4], norm = (s + mode) % 2;
            int replay = mode == 2, in_place = mode == 1;
            int64_t stride = 3 * k;
            float *x = router_logits(T, E), *prob = malloc(sizeof(float) * T * E), *w = malloc(sizeof(float) * T * k);
            float *bias = malloc(sizeof(float) * E);
            for (int e = 0; e < E; e++) bias[e] = (float)((int)(urand() * 16) - 8) / 64.0f;
            int32_t *sel = malloc(sizeof(int32_t) * T * k);
            int16_t *rp = malloc(sizeof(int16_t) * T * stride);
            R->moe_route_grouped(prob, sel, w, NULL, x, bias, NULL, 0, T, E, k, G, tg, norm, 2.5f);
            replay_rows(rp, sel, T, E, k, stride);
            op_case c;
            new_case(&c, "moe_route_grouped", run_moe_route_grouped, "%lld tokens, %d experts in %d groups (%d), %d picks%s%s",
                     (long long)T, E, G, tg, k, norm ? ", normalised" : "", in_place ? ", in place" : replay ? ", replayed" : "");
            route_arrays(&c, x, sel, rp, T, E, k, stride, replay, in_place);
            add(&c, "bias", F32, IN, E, bias, 0);
            int64_t i[9] = {T, E, k, norm, stride, replay, in_place, G, tg};
            memcpy(c.i, i, sizeof i);
            c.f[0] = 2.5f;
            check_case(&c);
            free(x), free(prob), free(w), free(sel), free(rp), free(bias);
        }
}

/* ---- the optimizer, sums, scaling, conversions ---- */

/* p: p, m, v, g; extra: the coefficients (decay, no_decay) of each step and the ranges */
typedef struct adamw_extra {
    mrl_adamw_coeffs decay[3], no_decay[3];
    int64_t ranges[8];
    int n_ranges, steps;
} adamw_extra;

static void run_adamw(const mrl_kernels *k, void *const *p, const op_case *c) {
    const adamw_extra *x = c->extra;
    for (int s = 0; s < (x->steps ? x->steps : 1); s++) {
        mrl_adamw_args a = {.p = p[0], .m = p[1], .v = p[2], .g = p[3], .n = c->i[0], .decay = x->decay[s],
                            .no_decay = x->no_decay[s], .ranges = x->ranges, .n_ranges = x->n_ranges};
        k->adamw(&a);
    }
}

/* The coefficients of step t of lr, weight decay wd (the rounding of core/optim/adamw.c). */
static mrl_adamw_coeffs adamw_coeffs(double lr, double wd, int t) {
    double b1 = 0.9, b2 = 0.999;
    return (mrl_adamw_coeffs){(float)(1 - lr * wd), (float)b1, (float)(1 - b1), (float)b2, (float)(1 - b2),
                              (float)sqrt(1 - pow(b2, t)), 1e-8f, (float)(-lr / (1 - pow(b1, t)))};
}

/* n parameters from random p, m (of scale ms), the given v and g (of scale gs), x's steps. */
static void adamw_case(int64_t n, const adamw_extra *x, const float *v, float ms, float gs) {
    op_case c;
    new_case(&c, "adamw", run_adamw, "%lld, %d step(s)", (long long)n, x->steps ? x->steps : 1);
    inout_rnd(&c, "p", n, 1, TOL_BITS);
    inout_rnd(&c, "m", n, ms, TOL_BITS);
    add(&c, "v", F32, INOUT, n, v, TOL_BITS);
    in_rnd(&c, "g", n, gs);
    c.i[0] = n, c.extra = x;
    check_case(&c);
}

/* Odd sizes (vector tails, slices), no-decay ranges at the ends and inside,
 * the coefficients of step 3 of lr 1e-3, weight decay 0.1. */
static void cases_adamw(void) {
    static const int64_t sizes[] = {1001, 300007};
    for (int s = 0; s < 2; s++) {
        int64_t n = sizes[s];
        adamw_extra x = {.decay = {{1.0f - 1e-4f, 0.9f, 0.1f, 0.999f, 0.001f, sqrtf(1.0f - powf(0.999f, 3)), 1e-8f,
                                    -1e-3f / (1.0f - powf(0.9f, 3))}},
                         .ranges = {0, 3, 10, 110, n / 2, n / 2 + 4999, n - 7, n},
                         .n_ranges = 4};
        x.no_decay[0] = x.decay[0];
        x.no_decay[0].decay = 1.0f;
        float *v = rnd(n, 0.03f);
        for (int64_t i = 0; i < n; i++) v[i] *= v[i];
        adamw_case(n, &x, v, 0.01f, 0.1f);
        free(v);
    }
    /* the GPU's: steps 1 to 3 in a row, sizes 1, 1000 and 3M, no-decay ranges at the start, inside and at the end */
    static const int64_t gpu[] = {1, 1000, 3000017};
    for (int s = 0; s < 3; s++) {
        int64_t n = gpu[s];
        adamw_extra x = {.ranges = {0, n / 7 + 1, n / 3, n / 3 + n / 10 + 1, n - n / 5, n}, .n_ranges = n >= 20 ? 3 : 1,
                         .steps = 3};
        if (n < 20) x.ranges[1] = n;
        for (int t = 0; t < 3; t++) x.decay[t] = adamw_coeffs(1e-3, 0.1, t + 1), x.no_decay[t] = adamw_coeffs(1e-3, 0, t + 1);
        float *v = rnd(n, 0.01f);
        for (int64_t i = 0; i < n; i++) v[i] = fabsf(v[i]);
        adamw_case(n, &x, v, 0.1f, 1);
        free(v);
    }
}

static void run_sum(const mrl_kernels *k, void *const *p, const op_case *c) {
    CHECK_OK(k->sum(p[1], c->i[0], (int)c->i[1], p[0]));
}

static void run_scale(const mrl_kernels *k, void *const *p, const op_case *c) { k->scale(p[0], c->i[0], c->f[0]); }
static void run_add(const mrl_kernels *k, void *const *p, const op_case *c) { k->add(p[0], p[1], c->i[0]); }

/* Sizes around the blocks, and the GPU's 1000 and 3M; a GPU's sum of values is held relative
 * to the square root of the sum of squares (TOL_GPU_SUM). */
static void cases_sum_scale(void) {
    static const int64_t sizes[] = {0, 1, 7, 8193, 300007, 1 << 20, 1000, 3000017};
    op_case c;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        float *x = rnd(n, 1);
        double squares_sum = 0;
        for (int64_t i = 0; i < n; i++) squares_sum += (double)x[i] * x[i];
        for (int squares = 0; squares < 2; squares++) {
            new_case(&c, "sum", run_sum, "%lld%s", (long long)n, squares ? " squares" : "");
            int o = add(&c, "sum", F64, OUT, 1, NULL, TOL_SUM);
            on_host(&c, o); /* the slot's *out */
            gpu_tol(&c, o, TOL_GPU_SUM);
            c.a[o].dscale = squares ? 0 : sqrt(squares_sum);
            add(&c, "x", F32, IN, n, x, 0);
            c.i[0] = n, c.i[1] = squares;
            check_case(&c);
        }
        free(x);
        new_case(&c, "scale", run_scale, "%lld", (long long)n);
        inout_rnd(&c, "x", n, 1, TOL_BITS);
        c.i[0] = n, c.f[0] = 0.37f;
        check_case(&c);
        new_case(&c, "add", run_add, "%lld", (long long)n);
        inout_rnd(&c, "y", n, 1, TOL_BITS);
        in_rnd(&c, "x", n, 3);
        c.i[0] = n;
        check_case(&c);
    }
}

static void run_bf16_to_f32(const mrl_kernels *k, void *const *p, const op_case *c) { k->bf16_to_f32(p[0], p[1], c->i[0]); }
static void run_f16_to_f32(const mrl_kernels *k, void *const *p, const op_case *c) { k->f16_to_f32(p[0], p[1], c->i[0]); }
static void run_f32_to_bf16(const mrl_kernels *k, void *const *p, const op_case *c) { k->f32_to_bf16(p[0], p[1], c->i[0]); }
static void run_f32_to_f16(const mrl_kernels *k, void *const *p, const op_case *c) { k->f32_to_f16(p[0], p[1], c->i[0]); }

static void run_dequant(const mrl_kernels *k, void *const *p, const op_case *c) {
    k->dequant((int)c->i[1], p[0], p[1], c->i[0]);
}

/* GGML blocks of random bytes, each scale (and minimum) a finite fp16 of any size, subnormals
 * included: every table gives the reference's bits. */
static void cases_dequant(void) {
    static const int types[] = {MRL_QUANT_Q4_0, MRL_QUANT_Q4_1, MRL_QUANT_Q8_0};
    static const int64_t sizes[] = {32, 32 * 7, 32 * 4099};
    op_case c;
    for (int t = 0; t < 3; t++)
        for (int z = 0; z < 3; z++) {
            int64_t n = sizes[z], bytes = mrl_quant_block_bytes(types[t]), nb = n / 32;
            uint16_t *b = malloc((size_t)(nb * bytes));
            uint8_t *u = (uint8_t *)b;
            for (int64_t i = 0; i < nb * bytes; i++) u[i] = (uint8_t)(urand() * 256);
            for (int64_t i = 0; i < nb; i++) /* the scale, and Q4_1's minimum: finite */
                for (int h = 0; h < (types[t] == MRL_QUANT_Q4_1 ? 2 : 1); h++) {
                    uint16_t f = (uint16_t)(urand() * 65536);
                    if (((f >> 10) & 0x1f) == 31) f &= 0xbfffu;
                    memcpy(u + i * bytes + 2 * h, &f, 2);
                }
            new_case(&c, "dequant", run_dequant, "type %d, %lld weights", types[t], (long long)n);
            add(&c, "blocks", U16, IN, nb * bytes / 2, b, 0);
            add(&c, "dst", F32, OUT, n, NULL, TOL_BITS);
            c.i[0] = n, c.i[1] = types[t];
            check_case(&c);
            free(b);
        }
}

static void run_qgemm(const mrl_kernels *k, void *const *p, const op_case *c) {
    const int64_t *i = c->i;
    k->qgemm((int)i[3], i[0], i[1], i[2], c->f[0], p[0], i[4], p[1], c->f[1], p[2], i[5]);
}

/* GGML blocks of random weights (gguf-py's layout: finite scales), rows of A past K (lda), C a
 * slice of a wider matrix (ldc) kept or added to (beta): decode's few rows, a prefill's many. */
static void cases_qgemm(void) {
    static const int types[] = {MRL_QUANT_Q4_0, MRL_QUANT_Q4_1, MRL_QUANT_Q8_0};
    static const int64_t shapes[][3] = {{1, 33, 64}, {16, 576, 576}, {5, 1536, 576}, {70, 96, 1536}, {3, 40, 32},
                                        {2, 3, 32800}}; /* (the last: a row longer than the fast table's chunk) */
    op_case c;
    for (int t = 0; t < 3; t++)
        for (size_t z = 0; z < sizeof shapes / sizeof shapes[0]; z++) {
            int64_t M = shapes[z][0], N = shapes[z][1], K = shapes[z][2], bytes = mrl_quant_block_bytes(types[t]);
            int64_t nb = N * K / 32, lda = K + 3, ldc = N + 5;
            uint8_t *b = malloc((size_t)(nb * bytes));
            for (int64_t i = 0; i < nb * bytes; i++) b[i] = (uint8_t)(urand() * 256);
            for (int64_t i = 0; i < nb; i++) /* scales of 2^-7 .. 2^-4, a Q4_1 minimum of either sign */
                for (int h = 0; h < (types[t] == MRL_QUANT_Q4_1 ? 2 : 1); h++) {
                    uint16_t f = (uint16_t)((0x2000u + (uint16_t)(urand() * 0xc00)) | (h && urand() < 0.5 ? 0x8000u : 0));
                    memcpy(b + i * bytes + 2 * h, &f, 2);
                }
            float beta = z % 2 ? 1.0f : 0.0f;
            new_case(&c, "qgemm", run_qgemm, "type %d, %lldx%lld <- %lld, beta %g", types[t], (long long)M, (long long)N,
                     (long long)K, beta);
            in_rnd(&c, "A", M * lda, 1);
            add(&c, "W", U16, IN, nb * bytes / 2, (uint16_t *)b, 0);
            inout_rnd(&c, "C", M * ldc, 1, TOL_DOT);
            c.i[0] = M, c.i[1] = N, c.i[2] = K, c.i[3] = types[t], c.i[4] = lda, c.i[5] = ldc;
            c.f[0] = 0.5f, c.f[1] = beta;
            check_case(&c);
            free(b);
        }
}

/* From 16 bits: every pattern (with NaNs, infinities, subnormals). From fp32:
 * random bit patterns, rounding ties of both formats, the f16 subnormal
 * range, infinities and NaNs; n leaves a vector tail and spans slices. */
static void cases_convert(void) {
    int64_t n = 65536 + 13;
    uint16_t *h = malloc(n * 2);
    uint32_t *f = malloc(n * 4);
    for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)(i * 40503u);
    uint32_t s = 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        uint32_t u = s;
        if (i % 7 == 1) u = (u & 0xffff0000u) | 0x8000u;                        /* bf16 tie */
        if (i % 7 == 2) u = (u & 0xffffe000u) | 0x1000u;                        /* f16 tie */
        if (i % 7 == 3) u = (u & 0x807fffffu) | (uint32_t)(100 + i % 20) << 23; /* f16 subnormal range */
        if (i % 97 == 0) u = 0x7f800000u | (i & 0x80000000u);
        if (i % 89 == 0) u = 0x7fc00000u | (u & 0x803fffffu); /* NaNs with payloads */
        f[i] = u;
    }
    struct { const char *op; run_fn run; int from16; } ops[] = {
        {"bf16_to_f32", run_bf16_to_f32, 1}, {"f16_to_f32", run_f16_to_f32, 1},
        {"f32_to_bf16", run_f32_to_bf16, 0}, {"f32_to_f16", run_f32_to_f16, 0}};
    op_case c;
    for (int o = 0; o < 4; o++) {
        new_case(&c, ops[o].op, ops[o].run, "%lld", (long long)n);
        if (ops[o].from16) {
            add(&c, "src", U16, IN, n, h, 0);
            add(&c, "dst", F32, OUT, n, NULL, TOL_BITS);
        } else {
            add(&c, "src", F32, IN, n, f, 0);
            add(&c, "dst", U16, OUT, n, NULL, TOL_BITS);
        }
        c.i[0] = n;
        check_case(&c);
    }
    free(h), free(f);
    /* the GPU's edges: every bf16 halfway point (and the value below it) of each of the 65536
     * upper halves, random bit patterns, normals of every scale, the specials of both formats */
    int64_t n32 = 65536 * 4 + 64;
    float *e = malloc(sizeof(float) * n32);
    for (int64_t i = 0; i < 65536; i++) {
        uint32_t b = (uint32_t)i << 16 | 0x8000u, r = (uint32_t)(urand() * 4294967296.0);
        memcpy(&e[4 * i], &b, 4);
        b = (uint32_t)i << 16 | 0x7fffu;
        memcpy(&e[4 * i + 1], &b, 4);
        memcpy(&e[4 * i + 2], &r, 4);
        e[4 * i + 3] = (float)(nrand() * pow(2.0, (int)(urand() * 60) - 30));
    }
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.99f, 65520.0f,
                              6.1e-5f, 5.96e-8f, 2.98e-8f, 1e-40f, -1e-45f, 3.4e38f, 1.0f};
    for (int i = 0; i < 64; i++) e[65536 * 4 + i] = specials[i % 16] * (i < 16 ? 1.0f : (float)(1 + i * 1e-3));
    for (int o = 2; o < 4; o++) {
        new_case(&c, ops[o].op, ops[o].run, "%lld edges", (long long)n32);
        add(&c, "src", F32, IN, n32, e, 0);
        add(&c, "dst", U16, OUT, n32, NULL, TOL_BITS);
        c.i[0] = n32;
        check_case(&c);
    }
    free(e);
}

/* ---- backward ops against central differences of the reference forward ---- */

typedef double (*loss_fn)(void *ctx);

/* d loss / d x[i] for i < n by central differences (x restored). */
static float *numeric_grad(loss_fn f, void *ctx, float *x, int64_t n, float h) {
    float *g = zeros(n);
    for (int64_t i = 0; i < n; i++) {
        float keep = x[i];
        x[i] = keep + h;
        double up = f(ctx);
        x[i] = keep - h;
        double down = f(ctx);
        x[i] = keep;
        g[i] = (float)((up - down) / (2.0 * (double)h));
    }
    return g;
}

static double weighted(const float *out, const float *r, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)r[i] * out[i];
    return s;
}

/* The gradients table t's backward (the case c, run through run_case) puts
 * in outputs which[0..n) against numeric[0..n). */
static void fd_compare(int t, const mrl_kernels *k, op_case *c, const int *which, float *const *numeric, int n) {
    void *got[MAXA];
    run_case(&tables[t], k, c, got);
    for (int j = 0; j < n; j++) {
        const arr *a = &c->a[which[j]];
        double e = error_of(a, TOL_FD, a->scale, got[which[j]], numeric[j]);
        char what[64];
        snprintf(what, sizeof what, "d%s (differences)", a->name);
        record(c->op, what, TOL_FD, t, e);
        if (!(e <= TOL_FD)) fprintf(stderr, "%s %s on %s: %s against differences: %.3g\n", c->op, c->shape, tables[t].name, a->name, e);
        CHECK(e <= TOL_FD);
    }
    free_outputs(c, got);
}

/* rmsnorm: loss = sum r out(x, w) */
typedef struct fd_norm { float *x, *w, *out, *rstd, *r; int64_t T; int D; } fd_norm;
static double loss_norm(void *vc) {
    fd_norm *c = vc;
    mrl_kernels_cpu_reference()->rmsnorm_fwd(c->out, c->rstd, c->x, c->w, c->T, c->D, 1e-5f);
    return weighted(c->out, c->r, c->T * c->D);
}

static void fd_rmsnorm(int t, const mrl_kernels *k) {
    fd_norm f = {rnd(21, 1), rnd(7, 1), zeros(21), zeros(3), rnd(21, 1), 3, 7};
    loss_norm(&f);
    float *num[2] = {numeric_grad(loss_norm, &f, f.x, 21, 1e-3f), numeric_grad(loss_norm, &f, f.w, 7, 1e-3f)};
    float *z = zeros(21);
    op_case c;
    new_case(&c, "rmsnorm_bwd", run_rmsnorm_bwd, "3x7");
    add(&c, "x", F32, INOUT, 21, z, TOL_FD); /* dx, dw from 0 */
    add(&c, "w", F32, INOUT, 7, z, TOL_FD);
    add(&c, "dout", F32, IN, 21, f.r, 0);
    add(&c, "xin", F32, IN, 21, f.x, 0);
    add(&c, "win", F32, IN, 7, f.w, 0);
    add(&c, "rstd", F32, IN, 3, f.rstd, 0);
    c.i[0] = 3, c.i[1] = 7;
    fd_compare(t, k, &c, (int[]){0, 1}, num, 2);
    free_case(&c);
    free(f.x), free(f.w), free(f.out), free(f.rstd), free(f.r), free(num[0]), free(num[1]), free(z);
}

typedef struct fd_swiglu { float *g, *u, *out, *r; int64_t n; } fd_swiglu;
static double loss_swiglu(void *vc) {
    fd_swiglu *c = vc;
    mrl_kernels_cpu_reference()->swiglu_fwd(c->out, c->g, c->u, c->n);
    return weighted(c->out, c->r, c->n);
}

static void fd_swiglu_(int t, const mrl_kernels *k) {
    fd_swiglu f = {rnd(19, 2), rnd(19, 1), zeros(19), rnd(19, 1), 19};
    float *num[2] = {numeric_grad(loss_swiglu, &f, f.g, 19, 1e-3f), numeric_grad(loss_swiglu, &f, f.u, 19, 1e-3f)};
    op_case c;
    new_case(&c, "swiglu_bwd", run_swiglu_bwd, "19");
    add(&c, "gate", F32, OUT, 19, NULL, TOL_FD);
    add(&c, "up", F32, OUT, 19, NULL, TOL_FD);
    add(&c, "dout", F32, IN, 19, f.r, 0);
    add(&c, "gin", F32, IN, 19, f.g, 0);
    add(&c, "uin", F32, IN, 19, f.u, 0);
    c.i[0] = 19;
    fd_compare(t, k, &c, (int[]){0, 1}, num, 2);
    free_case(&c);
    free(f.g), free(f.u), free(f.out), free(f.r), free(num[0]), free(num[1]);
}

/* RoPE is linear; its backward (inverse = 1) must be its transpose. */
typedef struct fd_rope { float *x, *y, *r; int32_t pos[5]; float *cs, *sn; } fd_rope;
static double loss_rope(void *vc) {
    fd_rope *c = vc;
    memcpy(c->y, c->x, sizeof(float) * 60);
    mrl_kernels_cpu_reference()->rope(c->y, c->pos, c->cs, c->sn, 5, 2, 6, 0);
    return weighted(c->y, c->r, 60);
}

static void fd_rope_(int t, const mrl_kernels *k) {
    fd_rope f = {rnd(60, 1), zeros(60), rnd(60, 1), {0, 1, 2, 0, 3}, zeros(12), zeros(12)};
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 3; i++) f.cs[p * 3 + i] = cosf(p * (i + 1) * 0.7f), f.sn[p * 3 + i] = sinf(p * (i + 1) * 0.7f);
    float *num[1] = {numeric_grad(loss_rope, &f, f.x, 60, 1e-3f)};
    op_case c;
    new_case(&c, "rope", run_rope, "5x2x6 inverse");
    add(&c, "x", F32, INOUT, 60, f.r, TOL_FD);
    add(&c, "pos", I32, IN, 5, f.pos, 0);
    add(&c, "cos", F32, IN, 12, f.cs, 0);
    add(&c, "sin", F32, IN, 12, f.sn, 0);
    c.i[0] = 5, c.i[1] = 2, c.i[2] = 6, c.i[3] = 1;
    fd_compare(t, k, &c, (int[]){0}, num, 1);
    free_case(&c);
    free(f.x), free(f.y), free(f.r), free(f.cs), free(f.sn), free(num[0]);
}

/* mla_qkv is linear; its backward must be its transpose (padding of dq, dk, dv unread: the
 * loss weights it too, and its derivative does not depend on them). */
typedef struct fd_mla { float *qf, *kv, *kr, *q, *k, *v, *rq, *rk, *rv; int32_t pos[4]; float *cs, *sn; int il; } fd_mla;
enum { MLA_T = 4, MLA_H = 2, MLA_DN = 3, MLA_DR = 4, MLA_DV = 5, MLA_HD = 8 };
static double loss_mla(void *vc) {
    fd_mla *c = vc;
    mrl_kernels_cpu_reference()->mla_qkv(c->q, c->k, c->v, c->qf, c->kv, c->kr, c->pos, c->cs, c->sn, MLA_T, MLA_H,
                                         MLA_DN, MLA_DR, MLA_DV, MLA_HD, c->il);
    int64_t n = MLA_T * MLA_H * MLA_HD;
    return weighted(c->q, c->rq, n) + weighted(c->k, c->rk, n) + weighted(c->v, c->rv, n);
}

static void fd_mla_(int t, const mrl_kernels *k) {
    int64_t n = MLA_T * MLA_H * MLA_HD, nq = MLA_T * MLA_H * (MLA_DN + MLA_DR), nkv = MLA_T * MLA_H * (MLA_DN + MLA_DV),
            nr = MLA_T * MLA_DR;
    for (int il = 0; il < 2; il++) {
        fd_mla f = {rnd(nq, 1), rnd(nkv, 1), rnd(nr, 1), zeros(n), zeros(n), zeros(n), rnd(n, 1), rnd(n, 1), rnd(n, 1),
                    {0, 1, 2, 1}, zeros(6), zeros(6), il};
        for (int p = 0; p < 3; p++)
            for (int i = 0; i < 2; i++) f.cs[p * 2 + i] = cosf(p * (i + 1) * 0.7f), f.sn[p * 2 + i] = sinf(p * (i + 1) * 0.7f);
        float *num[3] = {numeric_grad(loss_mla, &f, f.qf, nq, 1e-3f), numeric_grad(loss_mla, &f, f.kv, nkv, 1e-3f),
                         numeric_grad(loss_mla, &f, f.kr, nr, 1e-3f)};
        op_case c;
        new_case(&c, "mla_qkv_bwd", run_mla_qkv_bwd, "4x2 nope 3 rope 4 v 5 hd 8%s", il ? " interleaved" : "");
        add(&c, "qf", F32, OUT, nq, NULL, TOL_FD);
        add(&c, "kv", F32, OUT, nkv, NULL, TOL_FD);
        add(&c, "kr", F32, OUT, nr, NULL, TOL_FD);
        add(&c, "dq", F32, IN, n, f.rq, 0);
        add(&c, "dk", F32, IN, n, f.rk, 0);
        add(&c, "dv", F32, IN, n, f.rv, 0);
        add(&c, "pos", I32, IN, 4, f.pos, 0);
        add(&c, "cos", F32, IN, 6, f.cs, 0);
        add(&c, "sin", F32, IN, 6, f.sn, 0);
        c.i[0] = MLA_T, c.i[1] = MLA_H, c.i[2] = MLA_DN, c.i[3] = MLA_DR, c.i[4] = MLA_DV, c.i[5] = MLA_HD, c.i[6] = il;
        fd_compare(t, k, &c, (int[]){0, 1, 2}, num, 3);
        free_case(&c);
        float *bufs[] = {f.qf, f.kv, f.kr, f.q, f.k, f.v, f.rq, f.rk, f.rv, f.cs, f.sn, num[0], num[1], num[2]};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    }
}

/* attention: small layouts without and with a prefix */
typedef struct fd_attn { float *q, *k, *v, *out, *lse, *r; const attn_layout *L; } fd_attn;
static double loss_attn(void *vc) {
    fd_attn *c = vc;
    const attn_layout *L = c->L;
    mrl_kernels_cpu_reference()->attn_fwd(c->out, c->lse, c->q, c->k, c->v, L->cu, prefix_of(L), L->n, L->Hq, L->Hk,
                                          L->hd, 0.4f);
    return weighted(c->out, c->r, (int64_t)L->cu[L->n] * L->Hq * L->hd);
}

static void fd_attention(int t, const mrl_kernels *k) {
    static const attn_layout small[] = {
        {"3 seqs, GQA 4/2, hd 3", 3, {0, 4, 5, 9}, {-2}, 4, 2, 3},
        {"a prefix and 2 children, GQA 4/2, hd 3", 4, {0, 3, 5, 6, 8}, {-1, 0, 0, -1}, 4, 2, 3},
    };
    for (int s = 0; s < 2; s++) {
        const attn_layout *L = &small[s];
        int64_t T = L->cu[L->n], nq = T * L->Hq * L->hd, nk = T * L->Hk * L->hd;
        fd_attn f = {rnd(nq, 1), rnd(nk, 1), rnd(nk, 1), zeros(nq), zeros(T * L->Hq), rnd(nq, 1), L};
        loss_attn(&f);
        float *out = zeros(nq), *lse = zeros(T * L->Hq);
        memcpy(out, f.out, sizeof(float) * nq);
        memcpy(lse, f.lse, sizeof(float) * T * L->Hq);
        float *num[3] = {numeric_grad(loss_attn, &f, f.q, nq, 1e-3f), numeric_grad(loss_attn, &f, f.k, nk, 1e-3f),
                         numeric_grad(loss_attn, &f, f.v, nk, 1e-3f)};
        op_case c;
        new_case(&c, "attn_bwd", run_attn_bwd, "%s", L->name);
        add(&c, "q", F32, OUT, nq, NULL, TOL_FD);
        add(&c, "k", F32, OUT, nk, NULL, TOL_FD);
        add(&c, "v", F32, OUT, nk, NULL, TOL_FD);
        add(&c, "dout", F32, IN, nq, f.r, 0);
        add(&c, "out", F32, IN, nq, out, 0);
        add(&c, "lse", F32, IN, T * L->Hq, lse, 0);
        add(&c, "qin", F32, IN, nq, f.q, 0);
        add(&c, "kin", F32, IN, nk, f.k, 0);
        add(&c, "vin", F32, IN, nk, f.v, 0);
        add(&c, "cu", I32, IN, L->n + 1, L->cu, 0);
        if (prefix_of(L)) add(&c, "prefix", I32, IN, L->n, L->prefix, 0);
        attn_params(&c, L, 0.4f);
        fd_compare(t, k, &c, (int[]){0, 1, 2}, num, 3);
        free_case(&c);
        free(f.q), free(f.k), free(f.v), free(f.out), free(f.lse), free(f.r), free(out), free(lse);
        for (int j = 0; j < 3; j++) free(num[j]);
    }
}

/* head: loss = sum a logprob + b entropy at temperature 0.8, some rows without target */
typedef struct fd_head { float *z, *lse, *ent, *lp, *a, *b; int32_t tg[3]; } fd_head;
static double loss_head(void *vc) {
    fd_head *c = vc;
    mrl_kernels_cpu_reference()->head_fwd(c->z, 3, 11, 1 / 0.8f, c->tg, c->lse, c->ent, c->lp);
    return weighted(c->lp, c->a, 3) + weighted(c->ent, c->b, 3);
}

static void fd_head_(int t, const mrl_kernels *k) {
    fd_head f = {rnd(33, 1.5f), zeros(3), zeros(3), zeros(3), rnd(3, 1), rnd(3, 1), {3, -1, 10}};
    loss_head(&f);
    float *lse = zeros(3), *ent = zeros(3);
    memcpy(lse, f.lse, sizeof(float) * 3);
    memcpy(ent, f.ent, sizeof(float) * 3);
    float *num[1] = {numeric_grad(loss_head, &f, f.z, 33, 1e-3f)};
    op_case c;
    new_case(&c, "head_bwd", run_head_bwd, "3x11 logprob + entropy");
    add(&c, "logits", F32, INOUT, 33, f.z, TOL_FD);
    add(&c, "targets", I32, IN, 3, f.tg, 0);
    add(&c, "lse", F32, IN, 3, lse, 0);
    add(&c, "entropy", F32, IN, 3, ent, 0);
    add(&c, "dlogprob", F32, IN, 3, f.a, 0);
    add(&c, "dentropy", F32, IN, 3, f.b, 0);
    c.i[0] = 3, c.i[1] = 11, c.i[2] = 1, c.f[0] = 1 / 0.8f;
    fd_compare(t, k, &c, (int[]){0}, num, 1);
    free_case(&c);
    free(f.z), free(f.lse), free(f.ent), free(f.lp), free(f.a), free(f.b), free(lse), free(ent), free(num[0]);
}

/* the embedding: scatter_add_rows is gather_rows' backward; bias_bwd is bias_add's */
typedef struct fd_rows { float *src, *out, *r, *b; int32_t idx[6]; } fd_rows;
static double loss_gather(void *vc) {
    fd_rows *c = vc;
    mrl_kernels_cpu_reference()->gather_rows(c->out, c->src, c->idx, 6, 5);
    return weighted(c->out, c->r, 30);
}
static double loss_bias(void *vc) {
    fd_rows *c = vc;
    memset(c->out, 0, sizeof(float) * 30);
    mrl_kernels_cpu_reference()->bias_add(c->out, c->b, 6, 5);
    return weighted(c->out, c->r, 30);
}

static void fd_scatter(int t, const mrl_kernels *k) {
    fd_rows f = {rnd(20, 1), zeros(30), rnd(30, 1), NULL, {3, 0, 3, 1, 3, 2}};
    float *num[1] = {numeric_grad(loss_gather, &f, f.src, 20, 1e-3f)}, *z = zeros(20);
    op_case c;
    new_case(&c, "scatter_add_rows", run_scatter_add_rows, "6 into 4x5");
    add(&c, "src", F32, INOUT, 20, z, TOL_FD);
    add(&c, "dout", F32, IN, 30, f.r, 0);
    add(&c, "idx", I32, IN, 6, f.idx, 0);
    c.i[0] = 6, c.i[1] = 5;
    fd_compare(t, k, &c, (int[]){0}, num, 1);
    free_case(&c);
    free(f.src), free(f.out), free(f.r), free(num[0]), free(z);
}

static void fd_bias(int t, const mrl_kernels *k) {
    fd_rows f = {NULL, zeros(30), rnd(30, 1), rnd(5, 1), {0}};
    float *num[1] = {numeric_grad(loss_bias, &f, f.b, 5, 1e-3f)}, *z = zeros(5);
    op_case c;
    new_case(&c, "bias_bwd", run_bias_bwd, "6x5");
    add(&c, "b", F32, INOUT, 5, z, TOL_FD);
    add(&c, "dy", F32, IN, 30, f.r, 0);
    c.i[0] = 6, c.i[1] = 5;
    fd_compare(t, k, &c, (int[]){0}, num, 1);
    free_case(&c);
    free(f.out), free(f.r), free(f.b), free(num[0]), free(z);
}

/* A linear layer y = x W^T: its backward is two more products, dW += dy^T x
 * and dx = dy W (the model's lin_dw, lin_dx). */
typedef struct fd_lin { float *x, *w, *y, *r; } fd_lin;
static double loss_lin(void *vc) {
    fd_lin *c = vc;
    mrl_kernels_cpu_reference()->gemm(0, 1, 4, 3, 5, 1.0f, c->x, 5, c->w, 5, 0.0f, c->y, 3);
    return weighted(c->y, c->r, 12);
}

static void fd_gemm(int t, const mrl_kernels *k) {
    fd_lin f = {rnd(20, 1), rnd(15, 1), zeros(12), rnd(12, 1)};
    float *num[1], *z = zeros(20);
    op_case c;
    num[0] = numeric_grad(loss_lin, &f, f.w, 15, 1e-3f);
    new_case(&c, "gemm", run_gemm, "dW += dy^T x, 3x5 from 4 rows");
    add(&c, "dy", F32, IN, 12, f.r, 0);
    add(&c, "x", F32, IN, 20, f.x, 0);
    add(&c, "W", F32, INOUT, 15, z, TOL_FD);
    gemm_params(&c, 1, 0, 3, 5, 4, 3, 5, 5, 1, 1);
    fd_compare(t, k, &c, (int[]){2}, num, 1);
    free_case(&c);
    free(num[0]);
    num[0] = numeric_grad(loss_lin, &f, f.x, 20, 1e-3f);
    new_case(&c, "gemm", run_gemm, "dx = dy W, 4x5 from 3 outputs");
    add(&c, "dy", F32, IN, 12, f.r, 0);
    add(&c, "W", F32, IN, 15, f.w, 0);
    add(&c, "x", F32, OUT, 20, NULL, TOL_FD);
    gemm_params(&c, 0, 0, 4, 5, 3, 3, 5, 5, 1, 0);
    fd_compare(t, k, &c, (int[]){2}, num, 1);
    free_case(&c);
    free(f.x), free(f.w), free(f.y), free(f.r), free(num[0]), free(z);
}

static void backward_checks(void) {
    struct { const char *op; void (*check)(int t, const mrl_kernels *k); } fds[] = {
        {"rmsnorm_bwd", fd_rmsnorm},  {"swiglu_bwd", fd_swiglu_},        {"rope", fd_rope_},
        {"attn_bwd", fd_attention},   {"head_bwd", fd_head_},            {"scatter_add_rows", fd_scatter},
        {"bias_bwd", fd_bias},        {"gemm", fd_gemm},                 {"mla_qkv_bwd", fd_mla_},
    };
    for (size_t f = 0; f < sizeof fds / sizeof fds[0]; f++) {
        if (!wanted(fds[f].op)) continue;
        for (int t = 0; t < N_TABLES; t++) {
            const mrl_kernels *k = use(&tables[t]);
            if (k) fds[f].check(t, k);
        }
    }
}

/* ---- contracts: the same errors on every table ---- */

/* oneDNN's fp32 products (cpu/blas.h): the same bits when the same product runs again at the
 * same thread count, on a product large enough to be sliced over the threads. */
static void onednn32_repeat(void) {
    if (!wanted("gemm") || mrl_cpu_f32_force_path(MRL_F32_ONEDNN) != 0) return;
    int64_t M = 230, N = 530, K = 270;
    float *A = rnd(M * K, 1.0f), *B = rnd(N * K, 1.0f);
    float *C0 = malloc(sizeof(float) * M * N), *C1 = malloc(sizeof(float) * M * N);
    const mrl_kernels *k = mrl_kernels_cpu_fast();
    for (int rep = 0; rep < 4; rep++) {
        float *C = rep ? C1 : C0;
        for (int64_t i = 0; i < M * N; i++) C[i] = 0.5f;
        k->gemm(0, 1, M, N, K, 0.7f, A, K, B, K, 1.0f, C, N);
        if (rep) CHECK(memcmp(C0, C1, sizeof(float) * M * N) == 0);
    }
    mrl_cpu_f32_force_path(MRL_F32_OPENBLAS);
    free(A), free(B), free(C0), free(C1);
}

/* The rule that picks the fp32 product library (cpu/blas.h), on the cases it is made for. */
static void f32_rule(void) {
    CHECK(mrl_openblas_core_level("Prescott") == 0 && mrl_openblas_core_level("HASWELL") == 2);
    CHECK(mrl_openblas_core_level("SkylakeX") == 3 && mrl_openblas_core_level("Zen") == 2);
    CHECK(mrl_openblas_core_level("NoSuchCore") == -1 && mrl_openblas_core_level(NULL) == -1);
    CHECK(mrl_cpu_f32_rule("Prescott", 2, 1) == MRL_F32_ONEDNN);    /* the Xeon family 6 model 207 case */
    CHECK(mrl_cpu_f32_rule("Sandybridge", 1, 1) == MRL_F32_ONEDNN); /* AVX kernels, an AVX2 CPU */
    CHECK(mrl_cpu_f32_rule("Prescott", 2, 0) == MRL_F32_OPENBLAS);  /* no oneDNN: nothing better */
    CHECK(mrl_cpu_f32_rule("Prescott", 0, 1) == MRL_F32_OPENBLAS);  /* an SSE-only CPU */
    CHECK(mrl_cpu_f32_rule("Haswell", 2, 1) == MRL_F32_ONEDNN);     /* AVX2 kernels, an AVX-512 CPU */
    CHECK(mrl_cpu_f32_rule("Zen", 2, 1) == MRL_F32_ONEDNN);
    CHECK(mrl_cpu_f32_rule("Haswell", 1, 1) == MRL_F32_OPENBLAS);   /* AVX2 kernels, an AVX2 CPU */
    CHECK(mrl_cpu_f32_rule("Cooperlake", 2, 1) == MRL_F32_OPENBLAS);
    CHECK(mrl_cpu_f32_rule("unknown", 2, 1) == MRL_F32_OPENBLAS);   /* no evidence against OpenBLAS */
}

/* The measured choice between splitting a decode product over the threads and not (cpu/split.h),
 * fed made-up timings: per window of products `seconds_per_mac[split]`, changed halfway. Returns
 * the share of windows run split in each half. */
static void split_windows(double first_split, double first_serial, double then_split, double then_serial,
                          double share[2]) {
    mrl_split_choice c = {0};
    int split_windows[2] = {0, 0};
    for (int w = 0; w < 400; w++) {
        int half = w >= 200, split = 0;
        for (int p = 0; p < MRL_SPLIT_WINDOW; p++) {
            split = mrl_split_pick(&c);
            double per_mac = half ? (split ? then_split : then_serial) : (split ? first_split : first_serial);
            mrl_split_record(&c, per_mac * 1000, 1000);
        }
        split_windows[half] += split;
    }
    share[0] = split_windows[0] / 200.0, share[1] = split_windows[1] / 200.0;
}

static void split_rule(void) {
    double share[2];
    split_windows(1.0, 1.6, 1.0, 1.6, share); /* an idle machine: splitting is faster */
    CHECK(share[0] > 0.9 && share[1] > 0.9);
    split_windows(2.0, 1.0, 2.0, 1.0, share); /* oversubscribed: one thread is faster */
    CHECK(share[0] < 0.1 && share[1] < 0.1);
    split_windows(1.0, 1.6, 2.0, 1.0, share); /* the load comes halfway: it follows */
    CHECK(share[0] > 0.9 && share[1] < 0.15);
    split_windows(2.0, 1.0, 1.0, 1.6, share); /* and goes: found at the next try, at most EXPLORE_MAX windows on */
    CHECK(share[0] < 0.1 && share[1] >= (200.0 - MRL_SPLIT_EXPLORE_MAX - 4) / 200);
}

/* The memory slots on table t: to_device, copy at an odd offset, zero of a middle part, sync,
 * to_host, on sizes from 1 byte to 1 MiB. */
static void memory_moves(const table *t, const mrl_kernels *k) {
    static const int64_t sizes[] = {1, 7, 4099, 1 << 20};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        unsigned char *h = malloc(n), *want = malloc(n + 3), *got = malloc(n + 3);
        for (int64_t i = 0; i < n; i++) h[i] = (unsigned char)(urand() * 256);
        tmem ma, mb;
        char *a = tmem_alloc(t, &ma, n), *b = tmem_alloc(t, &mb, n + 3);
        CHECK_OK(k->to_device(a, h, n));
        memset(want, 0x5a, n + 3);
        CHECK_OK(k->to_device(b, want, n + 3));
        k->copy(b + 3, a, n);
        memcpy(want + 3, h, n);
        k->zero(b + n / 3, n / 3);
        memset(want + n / 3, 0, n / 3);
        CHECK_OK(k->sync());
        CHECK_OK(k->to_host(got, b, n + 3));
        record("memory", "copy/zero/to_host", 0, (int)(t - tables), memcmp(got, want, n + 3) ? INFINITY : 0);
        CHECK(memcmp(got, want, n + 3) == 0);
        CHECK_OK(k->to_host(got, a, n));
        record("memory", "to_device", 0, (int)(t - tables), memcmp(got, h, n) ? INFINITY : 0);
        CHECK(memcmp(got, h, n) == 0);
        tmem_free(t, &ma), tmem_free(t, &mb);
        free(h), free(want), free(got);
    }
}

/* The sampler's failing rows on table t: rows 1 and 2 fail, the message is row 1's (the
 * reference's words), both tokens -1, the others' tokens the reference's. */
static void sample_failures(const table *t, const mrl_kernels *k) {
    float l[4][5] = {{0, 1, 2, 3, 4}, {0, NAN, 0, 0, 0}, {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY},
                     {1, 1, 1, 1, 1}};
    const float *rows_[4];
    tmem m[4];
    for (int r = 0; r < 4; r++) {
        rows_[r] = t->device ? tmem_alloc(t, &m[r], sizeof l[r]) : l[r];
        if (t->device) CHECK_OK(k->to_device((void *)rows_[r], l[r], sizeof l[r]));
    }
    mrl_sampling_params p = {1, 0, 1, 0};
    const mrl_sampling_params *pp[4] = {&p, &p, &p, &p};
    double u[4] = {0.5, 0.5, 0.5, 0.5};
    int32_t tok[4], want_tok[4];
    float lp[4];
    const float *host_rows[4] = {l[0], l[1], l[2], l[3]};
    CHECK(mrl_kernels_cpu_reference()->sample(host_rows, 4, 5, pp, u, want_tok, lp, NULL) == MRL_ERR_INVALID);
    char want[512];
    snprintf(want, sizeof want, "%s", mrl_last_error());
    CHECK_STR_CONTAINS(want, "row 1: sample: the logits row holds a NaN");
    CHECK(k->sample(rows_, 4, 5, pp, u, tok, lp, NULL) == MRL_ERR_INVALID);
    CHECK(!strcmp(mrl_last_error(), want));
    CHECK(tok[0] == want_tok[0] && tok[1] == -1 && tok[2] == -1 && tok[3] == want_tok[3]);
    CHECK(tok[0] >= 0 && tok[3] >= 0);
    if (t->device) {
        CHECK_OK(k->sync());
        for (int r = 0; r < 4; r++) tmem_free(t, &m[r]);
    }
}

/* A GPU's void slots given bad shapes: nothing launched, the error reported by sync, once. */
static void gpu_void_errors(const mrl_kernels *k) {
    CHECK_OK(k->sync());
    k->attn_fwd(NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, 3, 2, 64, 1.0f); /* Hq not a multiple of Hk */
    CHECK(k->sync() == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "attn_fwd");
    k->attn_fwd(NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, 2, 2, 512, 1.0f);
    CHECK(k->sync() == MRL_ERR_UNSUPPORTED);
    k->rmsnorm_fwd(NULL, NULL, NULL, NULL, 4, 0, 1e-6f);
    CHECK(k->sync() == MRL_ERR_INVALID);
    k->moe_route(NULL, NULL, NULL, NULL, NULL, NULL, 0, 4, 8, 9, 0); /* more picks than experts */
    CHECK(k->sync() == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "moe_route");
    CHECK_OK(k->sync()); /* cleared */
}

static void contracts(void) {
    for (int t = 0; t < N_TABLES; t++) {
        const mrl_kernels *k = use(&tables[t]);
        if (!k) continue;
        if (wanted("slots")) { /* every slot filled */
            CHECK(k->name && k->on_device == tables[t].device);
            const void *const *slot = (const void *const *)&k->copy;
            for (size_t i = 0; i < (sizeof(mrl_kernels) - offsetof(mrl_kernels, copy)) / sizeof(void *); i++)
                CHECK(slot[i] != NULL);
        }
        if (wanted("memory")) memory_moves(&tables[t], k);
        if (wanted("sample")) sample_failures(&tables[t], k);
        if (wanted("top_logprobs")) { /* k outside 1..V */
            float l[3] = {0, 1, 2};
            const float *rows_[1] = {l};
            mrl_sampling_params p = {1, 0, 1, 0};
            const mrl_sampling_params *pp[1] = {&p};
            int32_t ids[4];
            float lps[4];
            CHECK(k->top_logprobs(rows_, 1, 3, pp, 4, ids, lps) == MRL_ERR_INVALID);
            CHECK(k->top_logprobs(rows_, 1, 3, pp, 0, ids, lps) == MRL_ERR_INVALID);
            CHECK_OK(k->top_logprobs(rows_, 0, 3, pp, 4, ids, lps)); /* no rows: nothing to check */
        }
        if (tables[t].device) {
            if (wanted("errors")) gpu_void_errors(k);
            continue; /* host arrays below */
        }
        if (wanted("memory")) { /* a CPU table's memory is the host's: the slots are plain copies */
            unsigned char a[19], b[19], want[19];
            for (int i = 0; i < 19; i++) a[i] = (unsigned char)(i * 37 + 1), b[i] = 0xee;
            CHECK(k->on_device == 0);
            CHECK_OK(k->to_device(b, a, 11));
            k->copy(b + 11, a, 8);
            k->zero(b + 2, 3);
            CHECK_OK(k->sync());
            memcpy(want, a, 11), memcpy(want + 11, a, 8), memset(want + 2, 0, 3);
            CHECK(memcmp(b, want, 19) == 0);
            CHECK_OK(k->to_host(a, b, 19));
            CHECK(memcmp(a, want, 19) == 0);
        }
        if (wanted("paged_attn")) {
            float buf[64] = {0};
            int32_t table_[2] = {0, 1}, lens[1] = {4}, qs[2] = {0, 1};
            mrl_paged_attn a = {.out = buf, .q = buf, .k_cache = buf, .v_cache = buf, .block_tables = table_,
                                .seq_lens = lens, .query_start = qs, .n_seqs = 1, .max_blocks_per_seq = 2,
                                .block_size = 2, .Hq = 2, .Hk = 1, .hd = 4, .scale = 0.5f};
            CHECK_OK(k->paged_attn(&a));
            a.Hq = 3, a.Hk = 2;
            CHECK(k->paged_attn(&a) == MRL_ERR_INVALID);
            CHECK_STR_CONTAINS(mrl_last_error(), "Hq=3 Hk=2");
            a.Hq = 2, a.Hk = 1, lens[0] = 5; /* more tokens than 2 blocks of 2 hold */
            CHECK(k->paged_attn(&a) == MRL_ERR_INVALID);
            lens[0] = 4, qs[1] = 5; /* more queries than tokens */
            CHECK(k->paged_attn(&a) == MRL_ERR_INVALID);
            qs[1] = 1, a.hd = 0;
            CHECK(k->paged_attn(&a) == MRL_ERR_INVALID);
            a.hd = 4, a.q = NULL;
            CHECK(k->paged_attn(&a) == MRL_ERR_INVALID);
            CHECK(k->paged_attn_workspace(&a) == 0);
        }
    }
}

static void print_summary(void) {
    printf("\n%-17s %-28s %8s", "op", "output", "tol");
    for (int t = 0; t < N_TABLES; t++) printf(" %12s", tables[t].name);
    printf("\n");
    for (int r = 0; r < n_rows; r++) {
        printf("%-17s %-28s %8.0e", rows[r].op, rows[r].output, rows[r].tol);
        for (int t = 0; t < N_TABLES; t++)
            if (rows[r].worst[t] < 0) printf(" %12s", "-");
            else if (rows[r].tol == 0 && t) printf(" %12s", rows[r].worst[t] == 0 ? "same bits" : "DIFFER");
            else printf(" %12.1e", rows[r].worst[t]);
        printf("\n");
    }
}

int main(int argc, char **argv) {
    only_op = argc > 1 && strcmp(argv[1], "all") ? argv[1] : NULL;
    only_table = argc > 2 ? argv[2] : NULL;
    const char *seed = getenv("SEED");
    if (seed) rng_seed(strtoull(seed, NULL, 10));
    CHECK_OK(mrl_init());
    int here = 0;
    for (int t = 1; t < N_TABLES; t++) {
        if (only_table && strcmp(only_table, tables[t].name)) continue;
        const mrl_kernels *k = use(&tables[t]);
        if (!k) printf("(%s: not on this machine)\n", tables[t].name);
        here += k != NULL;
        if (k && tables[t].device) {
            char desc[256];
            CHECK_OK(mrl_device_describe(tables[t].dev, desc, sizeof desc));
            printf("%s: %s\n", tables[t].name, desc);
        }
    }
    if (only_table && strcmp(only_table, "reference") && !here) { /* the backend asked for is not here: skipped */
        mrl_shutdown();
        return 77;
    }
#ifdef MRL_HAVE_CUDA
    /* the CUDA table's ops on a stream of our own, as the model's and the engine's run */
    void *stream = NULL;
    if (cuda_get()) {
        CHECK_OK(mrl_cuda_stream_create(0, &stream));
        mrl_cuda_ops_set_stream(stream);
        CHECK(mrl_cuda_ops_stream() == stream);
    }
#endif
    cases_gemm();
    cases_gemm_group();
    cases_gemm_panels();
    cases_gemm_bf16();
    cases_gemm_bf16_panels();
    cases_gemm_bf16_panels_group();
    cases_rmsnorm();
    cases_rope();
    cases_mla();
    cases_swiglu();
    cases_attention();
    cases_head();
    cases_rows();
    cases_lora();
    cases_paged();
    cases_latent();
    cases_sample();
    cases_top_logprobs();
    cases_moe();
    cases_moe_grouped();
    cases_adamw();
    cases_sum_scale();
    cases_convert();
    cases_dequant();
    cases_qgemm();
    backward_checks();
    if (!only_table || !strncmp(only_table, "fast", 4)) { /* the fast CPU table's own rules */
        onednn32_repeat();
        f32_rule();
        split_rule();
    }
    contracts();
    print_summary();
#ifdef MRL_HAVE_CUDA
    if (stream) {
        mrl_cuda_ops_set_stream(NULL);
        mrl_cuda_ops_release();
        mrl_cuda_stream_destroy(stream);
    }
#endif
    mrl_shutdown();
    CHECK_DONE();
}
