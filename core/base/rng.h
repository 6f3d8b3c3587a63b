/* The random numbers of the C code, in one place (core internal). Every
 * stream here is pinned: model init, the sampler's uniforms, the KV cache's
 * block hashes and the data order are reproduced bit for bit from a seed, so
 * no constant or step may change.
 *
 * splitmix64 (Steele, Lea and Flood; Vigna's constants): a 64-bit state
 * advanced by the golden ratio, each value mixed by a finaliser. mrl_mix64
 * is that finaliser applied to x + golden (the value splitmix64 returns from
 * state x): a good 64-bit hash, which the counter-based streams use. */
#pragma once
#include <stdint.h>

#define MRL_GOLDEN64 0x9e3779b97f4a7c15ULL

static inline uint64_t mrl_mix64(uint64_t x) {
    x += MRL_GOLDEN64;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* One step of splitmix64: advances *state and returns the next value. */
static inline uint64_t mrl_splitmix64(uint64_t *state) {
    uint64_t z = mrl_mix64(*state);
    *state += MRL_GOLDEN64;
    return z;
}
