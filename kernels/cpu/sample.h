/* Internal: the two tables' sample and top_logprobs ops (sample.c; kernels.h has their contract). */
#pragma once
#include "kernels.h"

mrl_status mrl_cpu_ref_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                              const double *u, int32_t *tokens, float *logprobs, float *lp_processed);
mrl_status mrl_cpu_fast_sample(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                               const double *u, int32_t *tokens, float *logprobs, float *lp_processed);
mrl_status mrl_cpu_ref_top_logprobs(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                                    int k, int32_t *ids, float *lps);
mrl_status mrl_cpu_fast_top_logprobs(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                                     int k, int32_t *ids, float *lps);
