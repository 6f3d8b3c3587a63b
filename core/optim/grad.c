/* Gradient helpers over one contiguous buffer: norm (the fast table's sum
 * of squares: double, fixed blocks, so identical for any thread count),
 * clipping as torch.nn.utils.clip_grad_norm_, scaling and zeroing. A buffer
 * on a GPU (mrl_device_of) is worked on by the CUDA table. */
#include <math.h>
#include <string.h>
#include "kernels.h"
#include "moonrl/optim.h"
#include "base/parallel.h"
#include "base/error.h"
#include "runtime/device_internal.h"

enum { ELEM_GRAIN = 1 << 16 };

mrl_status mrl_grad_norm(const float *grads, int64_t n, double *out) {
    if (!out || n < 0 || (n > 0 && !grads))
        return mrl_set_error(MRL_ERR_INVALID, "grad_norm: bad arguments (n=%lld)", (long long)n);
    double sum_squares;
    mrl_status st = mrl_kernels_for(mrl_device_of(grads))->sum(grads, n, 1, &sum_squares);
    if (st == MRL_OK) *out = sqrt(sum_squares);
    return st;
}

static void zero_range(void *vctx, int64_t begin, int64_t end) {
    memset((float *)vctx + begin, 0, (size_t)(end - begin) * sizeof(float));
}

mrl_status mrl_grad_scale(float *grads, int64_t n, float scale) {
    if (n < 0 || (n > 0 && !grads)) return mrl_set_error(MRL_ERR_INVALID, "grad_scale: bad arguments (n=%lld)", (long long)n);
    mrl_kernels_for(mrl_device_of(grads))->scale(grads, n, scale);
    return MRL_OK;
}

mrl_status mrl_grad_zero(float *grads, int64_t n) {
    if (n < 0 || (n > 0 && !grads)) return mrl_set_error(MRL_ERR_INVALID, "grad_zero: bad arguments (n=%lld)", (long long)n);
    mrl_device device = mrl_device_of(grads);
    if (device.kind != MRL_DEVICE_CPU) mrl_kernels_for(device)->zero(grads, n * (int64_t)sizeof(float));
    else mrl_parallel_for(n, ELEM_GRAIN, zero_range, grads);
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
