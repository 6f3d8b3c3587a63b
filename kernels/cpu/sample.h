/* Internal: the two tables' sample op (sample.c; kernels.h has its contract). */
#pragma once
#include "kernels.h"

mrl_status mrl_cpu_ref_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                              const double *u, int32_t *tokens, float *logprobs, float *lp_processed);
mrl_status mrl_cpu_fast_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                               const double *u, int32_t *tokens, float *logprobs, float *lp_processed);
