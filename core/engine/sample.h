/* Sampling of rows of logits (the order and the two log-probs are
 * described in moonrl/engine.h) with an op table's sample op (kernels.h).
 * Internal: the scheduler calls it for each step's rows. k NULL: the fast
 * CPU table. */
#pragma once
#include <stdint.h>
#include "kernels.h"
#include "moonrl/sampling.h"
#include "base/error.h"

/* The uniform in [0, 1) that stream `key` gives at `counter`. */
double mrl_sample_uniform(uint64_t key, int64_t counter);

/* Sample one token from each of `rows` rows of logits [rows, vocab] with
 * the fast CPU table; params[r], keys[r], counters[r] per row. Outputs per
 * row: tokens, logprobs (temperature-scaled, untruncated) and
 * logprobs_processed (may be NULL). Rows run in parallel. Fails on bad
 * params or a row that is all -inf or holds a NaN. */
mrl_status mrl_sample_rows(const float *logits, int64_t rows, int vocab, const mrl_sampling_params *params,
                           const uint64_t *keys, const int64_t *counters, int32_t *tokens, float *logprobs,
                           float *logprobs_processed);

/* Sample one token from logits[V] with params p and the uniform u in [0, 1).
 * lp_processed may be NULL. */
mrl_status mrl_sample_row(const mrl_kernels *k, const float *logits, int V, const mrl_sampling_params *p, double u,
                          int32_t *token, float *logprob, float *lp_processed);
/* Speculative decoding's verification of a draft token d (engine.c) against the row logits[V]
 * for params p, greedy or plain temperature (no top-k, top-p, min-p), with the position's uniform
 * u: greedy, the row's own token (mrl_sample_row's), accepted when it is d; temperature, d
 * accepted with its probability p(d), else a token of p without d, drawn with (u - p(d)) /
 * (1 - p(d)) (the standard rule's residual for a draft that is a point mass: every token has
 * probability p). token, logprob (under p) and lp_processed as mrl_sample_row's; scratch [V]. */
mrl_status mrl_sample_verify(const mrl_kernels *k, const float *logits, int V, const mrl_sampling_params *p, double u,
                             int32_t d, float *scratch, int32_t *token, float *logprob, float *lp_processed,
                             int *accepted);
/* Check params (a message naming the bad field on failure). */
mrl_status mrl_sampling_params_check(const mrl_sampling_params *p);
/* Sample n rows given by pointers (rows[r], params[r] may repeat: the
 * samples of a group share their prompt's logits row), row r with the
 * uniform of stream keys[r] at counters[r]. */
mrl_status mrl_sample_gather(const mrl_kernels *k, const float *const *rows, int64_t n, int V,
                             const mrl_sampling_params *const *params, const uint64_t *keys, const int64_t *counters,
                             int32_t *tokens, float *logprobs, float *lp_processed);
