/* Deterministic permutations: splitmix64 seeds xoshiro256** (Blackman and
 * Vigna), Fisher-Yates draws from it. The exact sequence is part of the
 * data-position contract (a saved run resumes on the same order), so the
 * algorithm must not change. */
#include "moonrl/data.h"
#include "base/error.h"
#include "base/rng.h"

uint64_t mrl_data_mix_seed(uint64_t x) { return mrl_mix64(x); }

/* uniform in [0, bound] by rejection (no modulo bias) */
static uint64_t below_inclusive(uint64_t s[4], uint64_t bound) {
    if (bound == UINT64_MAX) return mrl_xoshiro256ss(s);
    uint64_t range = bound + 1;
    uint64_t limit = UINT64_MAX - (UINT64_MAX % range);
    uint64_t r;
    do r = mrl_xoshiro256ss(s); while (r >= limit);
    return r % range;
}

mrl_status mrl_data_permutation(uint64_t seed, int64_t n, int64_t *out) {
    if (n < 0) return mrl_set_error(MRL_ERR_INVALID, "mrl_data_permutation: negative length %lld", (long long)n);
    if (n > 0 && !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_data_permutation: NULL output");
    uint64_t sm = seed, s[4];
    for (int i = 0; i < 4; i++) s[i] = mrl_splitmix64(&sm);
    for (int64_t i = 0; i < n; i++) out[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)below_inclusive(s, (uint64_t)i);
        int64_t tmp = out[i];
        out[i] = out[j];
        out[j] = tmp;
    }
    return MRL_OK;
}
