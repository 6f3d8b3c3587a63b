/* Sampling of one row of logits (the order and the two log-probs are
 * described in moonrl/engine.h). Internal: the scheduler calls it per row. */
#pragma once
#include <stdint.h>
#include "moonrl/engine.h"

/* Floats of work space mrl_sample_row needs for a vocabulary of V. */
int64_t mrl_sample_work_floats(int V);
/* Sample one token from logits[V] with params p and the uniform u in [0, 1);
 * work holds mrl_sample_work_floats(V) floats. lp_processed may be NULL. */
mrl_status mrl_sample_row(const float *logits, int V, const mrl_sampling_params *p, double u, float *work,
                          int32_t *token, float *logprob, float *lp_processed);
/* Check params (a message naming the bad field on failure). */
mrl_status mrl_sampling_params_check(const mrl_sampling_params *p);
/* Sample n rows given by pointers (rows[r], params[r] may repeat: the
 * samples of a group share their prompt's logits row), in parallel. */
mrl_status mrl_sample_gather(const float *const *rows, int64_t n, int V, const mrl_sampling_params *const *params,
                             const uint64_t *keys, const int64_t *counters, int32_t *tokens, float *logprobs,
                             float *lp_processed);
