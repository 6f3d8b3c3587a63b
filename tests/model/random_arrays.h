/* Seeded random float arrays and their comparison, for the kernel tests.
 * Each test file has its own generator state (set rng_state to reseed). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "base/rng.h"

static uint64_t rng_state = 12345;
static inline double urand(void) { return ((mrl_lcg64(&rng_state) >> 11) + 0.5) * 0x1.0p-53; }
static inline float nrand(void) { return (float)(sqrt(-2 * log(urand())) * cos(6.283185307179586 * urand())); }
static inline float *rnd(int64_t n, float scale) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = scale * nrand();
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
