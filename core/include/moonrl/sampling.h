/* What a request asks of the sampler, and the key of each sample's random
 * stream. The order the knobs apply in, the log-probs that come back and
 * how a stream draws are described in moonrl/engine.h. A header of its own
 * because the kernels' sample op takes these params too (kernels.h), and
 * the kernels include nothing of the engine. */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_sampling_params {
    float temperature; /* < 1e-5 (e.g. 0): greedy */
    int top_k;         /* <= 0: off */
    float top_p;       /* in (0, 1]; 1: off */
    float min_p;       /* in [0, 1]; 0: off */
} mrl_sampling_params;

/* The key of one sample's random stream: sample j of prompt i at training
 * step s of a run seeded with `seed` (moonrl/engine.h, "Randomness"). */
uint64_t mrl_sample_stream_key(uint64_t seed, int64_t step, int64_t prompt_index, int64_t sample_index);

#ifdef __cplusplus
}
#endif
