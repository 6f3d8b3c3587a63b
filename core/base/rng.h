/* The random numbers of the C code, in one place (core internal; the C
 * tests use it too). The library's streams are pinned: model init, the
 * sampler's uniforms, the KV cache's block hashes and the data order are
 * reproduced bit for bit from a seed (tests and saved runs hold them), so
 * no constant or step here may change.
 *
 * splitmix64 (Steele, Lea and Flood; Vigna's constants): a 64-bit state
 * advanced by the golden ratio, each value mixed by a finaliser. mrl_mix64
 * is that finaliser applied to x + golden (the value splitmix64 returns from
 * state x): a good 64-bit hash, which the counter-based streams use. */
#pragma once
#include <math.h>
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

/* x's top 53 bits as a double in [0, 1). */
static inline double mrl_unit53(uint64_t x) { return (double)(x >> 11) * 0x1.0p-53; }

/* A normal deviate from splitmix64 state *s (model init): Box-Muller on two
 * 53-bit uniforms, the first in (0, 1]. */
static inline double mrl_normal(uint64_t *s) {
    double u1 = ((mrl_splitmix64(s) >> 11) + 1) * 0x1.0p-53, u2 = mrl_unit53(mrl_splitmix64(s));
    return sqrt(-2 * log(u1)) * cos(2 * M_PI * u2);
}

/* xoshiro256** (Blackman and Vigna) over the state s[4]: the data order's
 * generator (core/data/shuffle.c), seeded by four splitmix64 outputs. */
static inline uint64_t mrl_xoshiro256ss(uint64_t s[4]) {
    uint64_t result = s[1] * 5;
    result = ((result << 7) | (result >> 57)) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = (s[3] << 45) | (s[3] >> 19);
    return result;
}

/* Two small generators of the C tests' inputs (their streams are what the
 * tests' tolerances were set on): xorshift64 (Marsaglia's 13, 7, 17) and
 * the 64-bit LCG of Knuth's MMIX (PCG's multiplier). Not for the library. */
static inline uint64_t mrl_xorshift64(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}
static inline uint64_t mrl_lcg64(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s;
}
