/* Gradient helpers over one contiguous buffer: norm (double, fixed blocks,
 * so identical for any thread count), clipping as
 * torch.nn.utils.clip_grad_norm_, scaling and zeroing. */
#include <math.h>
#include <string.h>
#include "moonrl/optim.h"
#include "moonrl/mem.h"
#include "moonrl/parallel.h"

enum { NORM_BLOCK = 8192, ELEM_GRAIN = 1 << 16 };

typedef struct norm_ctx {
    const float *g;
    int64_t n;
    double *block_sums;
} norm_ctx;

/* Four interleaved double accumulators per block, summed in a fixed order. */
static void norm_blocks(void *vctx, int64_t begin, int64_t end) {
    norm_ctx *c = vctx;
    for (int64_t b = begin; b < end; b++) {
        int64_t lo = b * NORM_BLOCK, hi = lo + NORM_BLOCK < c->n ? lo + NORM_BLOCK : c->n;
        double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        int64_t i = lo;
        for (; i + 4 <= hi; i += 4) {
            double x0 = c->g[i], x1 = c->g[i + 1], x2 = c->g[i + 2], x3 = c->g[i + 3];
            a0 += x0 * x0;
            a1 += x1 * x1;
            a2 += x2 * x2;
            a3 += x3 * x3;
        }
        for (; i < hi; i++) a0 += (double)c->g[i] * c->g[i];
        c->block_sums[b] = (a0 + a1) + (a2 + a3);
    }
}

mrl_status mrl_grad_norm(const float *grads, int64_t n, double *out) {
    if (!out || n < 0 || (n > 0 && !grads))
        return mrl_set_error(MRL_ERR_INVALID, "grad_norm: bad arguments (n=%lld)", (long long)n);
    int64_t blocks = (n + NORM_BLOCK - 1) / NORM_BLOCK;
    double *sums = mrl_mem_alloc((size_t)(blocks ? blocks : 1) * sizeof(double), MRL_MEM_OTHER);
    if (!sums) return MRL_ERR_NOMEM;
    norm_ctx c = {grads, n, sums};
    mrl_parallel_for(blocks, 4, norm_blocks, &c);
    double total = 0;
    for (int64_t b = 0; b < blocks; b++) total += sums[b];
    mrl_mem_free(sums);
    *out = sqrt(total);
    return MRL_OK;
}

typedef struct scale_ctx {
    float *g;
    float s;
} scale_ctx;

static void scale_range(void *vctx, int64_t begin, int64_t end) {
    scale_ctx *c = vctx;
    float *g = c->g;
    float s = c->s;
    for (int64_t i = begin; i < end; i++) g[i] *= s;
}

static void zero_range(void *vctx, int64_t begin, int64_t end) {
    scale_ctx *c = vctx;
    memset(c->g + begin, 0, (size_t)(end - begin) * sizeof(float));
}

mrl_status mrl_grad_scale(float *grads, int64_t n, float scale) {
    if (n < 0 || (n > 0 && !grads)) return mrl_set_error(MRL_ERR_INVALID, "grad_scale: bad arguments (n=%lld)", (long long)n);
    scale_ctx c = {grads, scale};
    mrl_parallel_for(n, ELEM_GRAIN, scale_range, &c);
    return MRL_OK;
}

mrl_status mrl_grad_zero(float *grads, int64_t n) {
    if (n < 0 || (n > 0 && !grads)) return mrl_set_error(MRL_ERR_INVALID, "grad_zero: bad arguments (n=%lld)", (long long)n);
    scale_ctx c = {grads, 0};
    mrl_parallel_for(n, ELEM_GRAIN, zero_range, &c);
    return MRL_OK;
}

mrl_status mrl_grad_clip_norm(float *grads, int64_t n, double max_norm, double *norm_out) {
    if (!(max_norm > 0) || isinf(max_norm))
        return mrl_set_error(MRL_ERR_INVALID, "grad_clip_norm: max_norm must be a finite number > 0 (got %g)", max_norm);
    double norm;
    mrl_status st = mrl_grad_norm(grads, n, &norm);
    if (st) return st;
    if (norm_out) *norm_out = norm;
    /* torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1, in fp32 */
    float coef = (float)max_norm / ((float)norm + 1e-6f);
    if (!(coef >= 1.0f)) return mrl_grad_scale(grads, n, coef); /* NaN norm -> NaN grads, as torch */
    return MRL_OK;
}
