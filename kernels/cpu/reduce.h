/* Deterministic parallel reductions over host float arrays (internal). */
#pragma once
#include <stdint.h>
#include "moonrl/status.h"

/* *out = sum of x[i] (squares = 0) or of x[i]^2 (squares = 1), in double,
 * over fixed blocks added in a fixed order: bit-identical for any number of
 * threads. `what` names the caller in error messages. */
mrl_status mrl_reduce_f32(const float *x, int64_t n, int squares, const char *what, double *out);
