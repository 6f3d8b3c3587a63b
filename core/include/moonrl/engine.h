/* The generation engine: what Lua calls. For now the sampling parameters and
 * the sampler over rows of logits; request submission comes with the engine
 * loop once the model is in.
 *
 * Sampling of one row of fp32 logits, in this order (vLLM v1's sampler):
 *   1. temperature: x = logits / temperature; temperature < 1e-5 is greedy
 *      (argmax, the lowest token id among ties; the other knobs are ignored);
 *   2. min-p: keep tokens with p >= min_p * p_max (p = softmax(x));
 *   3. top-k: keep tokens whose x is >= the k-th largest x among those kept
 *      (ties with the k-th value are all kept, as in vLLM and HF);
 *   4. top-p: among those kept, renormalised, keep the smallest set of the
 *      most probable tokens whose mass reaches top_p (sorted by probability,
 *      ties by lower token id first; the token that crosses top_p is kept);
 *   5. draw from the kept tokens with one uniform u from the counter-based
 *      stream: the first token, in token-id order, whose cumulative mass
 *      exceeds u times the kept mass.
 * (HF's generate applies top-k, top-p, then min-p after temperature; the
 * orders differ only when min-p is combined with top-k or top-p.)
 *
 * Two log-probabilities come back for the sampled token:
 *   logprob            under softmax(logits / temperature) over the WHOLE
 *                      vocabulary, no truncation: what the trainer computes
 *                      for the same token at the same temperature, so the
 *                      one RL uses (importance ratios, KL);
 *   logprob_processed  under the distribution actually sampled from (after
 *                      min-p / top-k / top-p, renormalised), vLLM's
 *                      "processed_logprobs".
 * For greedy rows logprob is the log-softmax at temperature 1 and
 * logprob_processed is 0.
 *
 * Randomness: sample j of prompt i at training step s of a run seeded with
 * `seed` has the stream key mrl_sample_stream_key(seed, s, i, j); its n-th
 * generated token uses counter n. The uniform is a hash of (key, counter)
 * (splitmix64 finaliser), so a token never depends on which other requests
 * share the batch, on the batch order or on the thread count. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_sampling_params {
    float temperature; /* < 1e-5 (e.g. 0): greedy */
    int top_k;         /* <= 0: off */
    float top_p;       /* in (0, 1]; 1: off */
    float min_p;       /* in [0, 1]; 0: off */
} mrl_sampling_params;

/* The key of one sample's random stream. */
uint64_t mrl_sample_stream_key(uint64_t seed, int64_t step, int64_t prompt_index, int64_t sample_index);
/* The uniform in [0, 1) that stream `key` gives at `counter`. */
double mrl_sample_uniform(uint64_t key, int64_t counter);

/* Sample one token from each of `rows` rows of logits [rows, vocab];
 * params[r], keys[r], counters[r] per row. Outputs per row: tokens,
 * logprobs (temperature-scaled, untruncated) and logprobs_processed (may be
 * NULL). Rows run in parallel. Fails on bad params or a row that is all
 * -inf or holds a NaN. */
mrl_status mrl_sample_rows(const float *logits, int64_t rows, int vocab, const mrl_sampling_params *params,
                           const uint64_t *keys, const int64_t *counters, int32_t *tokens, float *logprobs,
                           float *logprobs_processed);

#ifdef __cplusplus
}
#endif
