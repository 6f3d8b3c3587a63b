/* The ops Lua calls on host arrays (moonrl/ops.h): the fast table's. */
#include "kernels.h"
#include "moonrl/ops.h"

mrl_status mrl_ops_sum_f32(const float *x, int64_t n, double *out) {
    if (!out || n < 0 || (n > 0 && !x))
        return mrl_set_error(MRL_ERR_INVALID, "sum_f32: bad arguments (n=%lld)", (long long)n);
    return mrl_kernels_cpu_fast()->sum(x, n, 0, out);
}
