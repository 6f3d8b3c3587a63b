/* Sampling of rows of logits (the order and the two log-probs are
 * described in moonrl/engine.h) with an op table's sample op (kernels.h).
 * Internal: the scheduler calls it for each step's rows. k NULL: the fast
 * CPU table. */
#pragma once
#include <stdint.h>
#include "kernels.h"
#include "moonrl/engine.h"

/* Sample one token from logits[V] with params p and the uniform u in [0, 1).
 * lp_processed may be NULL. */
mrl_status mrl_sample_row(const mrl_kernels *k, const float *logits, int V, const mrl_sampling_params *p, double u,
                          int32_t *token, float *logprob, float *lp_processed);
/* Check params (a message naming the bad field on failure). */
mrl_status mrl_sampling_params_check(const mrl_sampling_params *p);
/* Sample n rows given by pointers (rows[r], params[r] may repeat: the
 * samples of a group share their prompt's logits row), row r with the
 * uniform of stream keys[r] at counters[r]. */
mrl_status mrl_sample_gather(const mrl_kernels *k, const float *const *rows, int64_t n, int V,
                             const mrl_sampling_params *const *params, const uint64_t *keys, const int64_t *counters,
                             int32_t *tokens, float *logprobs, float *lp_processed);
