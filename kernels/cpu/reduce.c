/* Reductions and scaling over host float arrays, the two tables' ops.
 * Reference: one pass, one double accumulator. Fast: sums over fixed blocks
 * (four interleaved double accumulators each) added in block order, so the
 * result is bit-identical for any number of threads (determinism over the
 * speed of the last few adds). */
#include "cpu/reduce.h"
#include "base/parallel.h"
#include "moonrl/mem.h"
#include "base/error.h"

mrl_status mrl_cpu_ref_sum(const float *x, int64_t n, int squares, double *out) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += squares ? (double)x[i] * x[i] : x[i];
    *out = s;
    return MRL_OK;
}

void mrl_cpu_ref_scale(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

void mrl_cpu_ref_add(float *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

enum { REDUCE_BLOCK = 8192, SCALE_GRAIN = 1 << 16 };

typedef struct reduce_ctx {
    const float *x;
    int64_t n;
    int squares;
    double *block_sums;
    float s;  /* scale */
    float *y; /* add */
} reduce_ctx;

static void reduce_blocks(void *vctx, int64_t begin, int64_t end) {
    reduce_ctx *c = vctx;
    for (int64_t b = begin; b < end; b++) {
        int64_t lo = b * REDUCE_BLOCK, hi = lo + REDUCE_BLOCK < c->n ? lo + REDUCE_BLOCK : c->n;
        double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        int64_t i = lo;
        if (c->squares) {
            for (; i + 4 <= hi; i += 4) {
                double x0 = c->x[i], x1 = c->x[i + 1], x2 = c->x[i + 2], x3 = c->x[i + 3];
                a0 += x0 * x0, a1 += x1 * x1, a2 += x2 * x2, a3 += x3 * x3;
            }
            for (; i < hi; i++) a0 += (double)c->x[i] * c->x[i];
        } else {
            for (; i + 4 <= hi; i += 4) a0 += c->x[i], a1 += c->x[i + 1], a2 += c->x[i + 2], a3 += c->x[i + 3];
            for (; i < hi; i++) a0 += c->x[i];
        }
        c->block_sums[b] = (a0 + a1) + (a2 + a3);
    }
}

mrl_status mrl_cpu_fast_sum(const float *x, int64_t n, int squares, double *out) {
    int64_t blocks = (n + REDUCE_BLOCK - 1) / REDUCE_BLOCK;
    double *block_sums = mrl_mem_alloc((size_t)(blocks ? blocks : 1) * sizeof(double), MRL_MEM_OTHER);
    if (!block_sums)
        return mrl_set_error(MRL_ERR_NOMEM, "sum: no memory for the sums of %lld blocks", (long long)blocks);
    reduce_ctx ctx = {.x = x, .n = n, .squares = squares, .block_sums = block_sums};
    mrl_parallel_for(blocks, 4, reduce_blocks, &ctx);
    double total = 0;
    for (int64_t b = 0; b < blocks; b++) total += block_sums[b];
    mrl_mem_free(block_sums);
    *out = total;
    return MRL_OK;
}

static void scale_range(void *vctx, int64_t begin, int64_t end) {
    reduce_ctx *c = vctx;
    float *x = (float *)c->x, s = c->s;
    for (int64_t i = begin; i < end; i++) x[i] *= s;
}

void mrl_cpu_fast_scale(float *x, int64_t n, float s) {
    reduce_ctx c = {.x = x, .s = s};
    mrl_parallel_for(n, SCALE_GRAIN, scale_range, &c);
}

static void add_range(void *vctx, int64_t begin, int64_t end) {
    reduce_ctx *c = vctx;
    for (int64_t i = begin; i < end; i++) c->y[i] += c->x[i];
}

void mrl_cpu_fast_add(float *y, const float *x, int64_t n) {
    reduce_ctx c = {.x = x, .y = y};
    mrl_parallel_for(n, SCALE_GRAIN, add_range, &c);
}
