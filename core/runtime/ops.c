/* The ops Lua calls on arrays (moonrl/ops.h): the table of the device the
 * array is on (mrl_device_of; the CPU's fast table for host memory). */
#include "kernels.h"
#include "moonrl/ops.h"
#include "base/error.h"
#include "runtime/device_internal.h"

mrl_status mrl_ops_sum_f32(const float *x, int64_t n, double *out) {
    if (!out || n < 0 || (n > 0 && !x))
        return mrl_set_error(MRL_ERR_INVALID, "sum_f32: bad arguments (n=%lld)", (long long)n);
    return mrl_kernels_for(mrl_device_of(x))->sum(x, n, 0, out);
}
