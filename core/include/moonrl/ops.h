/* Element-wise and reduction ops over arrays that Lua calls directly (one
 * call per array, never per element): host memory, or a GPU's (a model's
 * buffers there), worked on where they are. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* *out = sum of x[0..n), accumulated in double, in parallel; the result
 * does not depend on the thread count (fixed blocks, fixed order). */
mrl_status mrl_ops_sum_f32(const float *x, int64_t n, double *out);

#ifdef __cplusplus
}
#endif
