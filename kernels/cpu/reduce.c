/* Reductions over host float arrays. The sum is blocked at a fixed size and
 * the block sums are added in order, so the result is bit-identical for any
 * number of threads (determinism over speed of the last few adds). */
#include "moonrl/ops.h"
#include "moonrl/parallel.h"
#include "moonrl/mem.h"

#define SUM_BLOCK 4096

typedef struct sum_ctx {
    const float *x;
    int64_t n;
    double *block_sums;
} sum_ctx;

static void sum_blocks(void *vctx, int64_t begin, int64_t end) {
    sum_ctx *ctx = vctx;
    for (int64_t b = begin; b < end; b++) {
        int64_t lo = b * SUM_BLOCK, hi = lo + SUM_BLOCK < ctx->n ? lo + SUM_BLOCK : ctx->n;
        double acc = 0;
        for (int64_t i = lo; i < hi; i++) acc += ctx->x[i];
        ctx->block_sums[b] = acc;
    }
}

mrl_status mrl_ops_sum_f32(const float *x, int64_t n, double *out) {
    if (!out || n < 0 || (n > 0 && !x)) return mrl_set_error(MRL_ERR_INVALID, "sum_f32: bad arguments (n=%lld)", (long long)n);
    int64_t blocks = (n + SUM_BLOCK - 1) / SUM_BLOCK;
    double *block_sums = mrl_mem_alloc((size_t)(blocks ? blocks : 1) * sizeof(double), MRL_MEM_OTHER);
    if (!block_sums) return MRL_ERR_NOMEM;
    sum_ctx ctx = {x, n, block_sums};
    mrl_parallel_for(blocks, 8, sum_blocks, &ctx);
    double total = 0;
    for (int64_t b = 0; b < blocks; b++) total += block_sums[b];
    mrl_mem_free(block_sums);
    *out = total;
    return MRL_OK;
}
