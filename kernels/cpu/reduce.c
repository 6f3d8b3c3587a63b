/* Reductions over host float arrays. Sums are taken over fixed blocks (four
 * interleaved double accumulators each) and the block sums are added in
 * order, so the result is bit-identical for any number of threads
 * (determinism over the speed of the last few adds). */
#include "reduce.h"
#include "moonrl/ops.h"
#include "moonrl/parallel.h"
#include "moonrl/mem.h"

enum { REDUCE_BLOCK = 8192 };

typedef struct reduce_ctx {
    const float *x;
    int64_t n;
    int squares;
    double *block_sums;
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

mrl_status mrl_reduce_f32(const float *x, int64_t n, int squares, const char *what, double *out) {
    if (!out || n < 0 || (n > 0 && !x))
        return mrl_set_error(MRL_ERR_INVALID, "%s: bad arguments (n=%lld)", what, (long long)n);
    int64_t blocks = (n + REDUCE_BLOCK - 1) / REDUCE_BLOCK;
    double *block_sums = mrl_mem_alloc((size_t)(blocks ? blocks : 1) * sizeof(double), MRL_MEM_OTHER);
    if (!block_sums) return MRL_ERR_NOMEM;
    reduce_ctx ctx = {x, n, squares, block_sums};
    mrl_parallel_for(blocks, 4, reduce_blocks, &ctx);
    double total = 0;
    for (int64_t b = 0; b < blocks; b++) total += block_sums[b];
    mrl_mem_free(block_sums);
    *out = total;
    return MRL_OK;
}

mrl_status mrl_ops_sum_f32(const float *x, int64_t n, double *out) {
    return mrl_reduce_f32(x, n, 0, "sum_f32", out);
}
