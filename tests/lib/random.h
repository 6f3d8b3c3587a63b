/* The C tests' one random generator, and the comparison of float arrays.
 *
 * xorshift64 (mrl_xorshift64, core/base/rng.h). Each test file has its own stream, `rng`:
 * the draws below take from it, and a test may set it (rng = state) or reseed it from any
 * number (rng_seed). A test that needs streams of its own (one a rank, one a fuzz run) keeps
 * a state for each: rng_stream(seed) makes one, rng_next(&s) and rng_unit(&s) draw from it.
 * Tolerances were set on these streams (the default state's, MRL_GOLDEN64's where a test
 * sets it): a test that pins numbers keeps its seed. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "base/rng.h"

/* A state from any seed (never 0, xorshift's fixed point). */
static inline uint64_t rng_stream(uint64_t seed) {
    uint64_t s = mrl_mix64(seed);
    return s ? s : MRL_GOLDEN64;
}
static inline uint64_t rng_next(uint64_t *s) { return mrl_xorshift64(s); }
static inline double rng_unit(uint64_t *s) { return mrl_unit53(mrl_xorshift64(s)); } /* [0, 1) */

static uint64_t rng = 88172645463325252ULL; /* this file's stream */
static inline void rng_seed(uint64_t seed) { rng = rng_stream(seed); }

static inline uint64_t rand_u64(void) { return rng_next(&rng); }
static inline double urand(void) { return rng_unit(&rng); }                            /* [0, 1) */
static inline float frand(void) { return (float)(urand() * 2.0 - 1.0); }                /* [-1, 1) */
static inline int64_t randi(int64_t n) { return (int64_t)(rand_u64() % (uint64_t)n); } /* [0, n) */
/* a standard normal (Box-Muller; the first uniform in (0, 1]) */
static inline float nrand(void) {
    double u1 = 1.0 - urand(), u2 = urand();
    return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

/* Arrays of n (malloc'ed, one element at least): normals times scale (rnd), uniforms in
 * [-scale, scale) (urnd), zeros. */
static inline float *rnd(int64_t n, float scale) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = scale * nrand();
    return x;
}
static inline float *urnd(int64_t n, float scale) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = frand() * scale;
    return x;
}
static inline float *zeros(int64_t n) { return calloc(n ? n : 1, sizeof(float)); }

/* max |a-b| / max |b| */
static inline double rel_err(const float *a, const float *b, int64_t n) {
    double d = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        if (fabs((double)a[i] - b[i]) > d) d = fabs((double)a[i] - b[i]);
        if (fabs(b[i]) > s) s = fabs(b[i]);
    }
    return s > 0 ? d / s : d;
}

/* max |a - b| (infinite where either is not finite and they differ) */
static inline double max_abs_diff(const float *a, const float *b, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = isfinite(a[i]) && isfinite(b[i]) ? fabs((double)a[i] - b[i]) : a[i] == b[i] ? 0 : INFINITY;
        if (!(e <= d)) d = e;
    }
    return d;
}
