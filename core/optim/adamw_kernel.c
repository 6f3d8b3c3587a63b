/* The AdamW element loop. All kernels do the same fp32 operations in the
 * same order with no fused multiply-add, so their results are bit-identical
 * (checked by tests/optim/test_optim.c):
 *   p = p * decay
 *   m = m * beta1 + (1 - beta1) * g
 *   v = v * beta2 + (1 - beta2) * g * g
 *   p = p + neg_step * (m / (sqrt(v) / bc2_sqrt + eps))                    */
#include <math.h>
#include <immintrin.h>
#include "optim/adamw_kernel.h"

#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

void mrl_adamw_coeffs_init(mrl_adamw_coeffs *c, const mrl_adamw_config *cfg, double lr, int64_t step, int decay) {
    double t = (double)step;
    c->decay = decay ? (float)(1.0 - lr * cfg->weight_decay) : 1.0f;
    c->beta1 = (float)cfg->beta1;
    c->one_minus_beta1 = (float)(1.0 - cfg->beta1);
    c->beta2 = (float)cfg->beta2;
    c->one_minus_beta2 = (float)(1.0 - cfg->beta2);
    c->bc2_sqrt = (float)sqrt(1.0 - pow(cfg->beta2, t));
    c->eps = (float)cfg->eps;
    c->neg_step = (float)(-(lr / (1.0 - pow(cfg->beta1, t))));
}

NO_CONTRACT void mrl_adamw_kernel_scalar(float *p, const float *g, float *m, float *v, int64_t n,
                                         const mrl_adamw_coeffs *c) {
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float pi = p[i] * c->decay;
        float mi = m[i] * c->beta1 + c->one_minus_beta1 * gi;
        float vi = v[i] * c->beta2 + c->one_minus_beta2 * gi * gi;
        float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
        p[i] = pi + c->neg_step * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}

#define AVX2 __attribute__((target("avx2"), optimize("fp-contract=off")))
#define AVX512 __attribute__((target("avx512f,avx2"), optimize("fp-contract=off")))

AVX2 void mrl_adamw_kernel_avx2(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c) {
    const __m256 decay = _mm256_set1_ps(c->decay), b1 = _mm256_set1_ps(c->beta1), omb1 = _mm256_set1_ps(c->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(c->beta2), omb2 = _mm256_set1_ps(c->one_minus_beta2);
    const __m256 bc2 = _mm256_set1_ps(c->bc2_sqrt), eps = _mm256_set1_ps(c->eps), ns = _mm256_set1_ps(c->neg_step);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gi = _mm256_loadu_ps(g + i);
        __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
        __m256 mi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + i), b1), _mm256_mul_ps(omb1, gi));
        __m256 vi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), b2), _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
        _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_mul_ps(ns, _mm256_div_ps(mi, denom))));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
    }
    mrl_adamw_kernel_scalar(p + i, g + i, m + i, v + i, n - i, c);
}

AVX512 void mrl_adamw_kernel_avx512(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c) {
    const __m512 decay = _mm512_set1_ps(c->decay), b1 = _mm512_set1_ps(c->beta1), omb1 = _mm512_set1_ps(c->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(c->beta2), omb2 = _mm512_set1_ps(c->one_minus_beta2);
    const __m512 bc2 = _mm512_set1_ps(c->bc2_sqrt), eps = _mm512_set1_ps(c->eps), ns = _mm512_set1_ps(c->neg_step);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 gi = _mm512_loadu_ps(g + i);
        __m512 pi = _mm512_mul_ps(_mm512_loadu_ps(p + i), decay);
        __m512 mi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(m + i), b1), _mm512_mul_ps(omb1, gi));
        __m512 vi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), b2), _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
        _mm512_storeu_ps(p + i, _mm512_add_ps(pi, _mm512_mul_ps(ns, _mm512_div_ps(mi, denom))));
        _mm512_storeu_ps(m + i, mi);
        _mm512_storeu_ps(v + i, vi);
    }
    mrl_adamw_kernel_scalar(p + i, g + i, m + i, v + i, n - i, c);
}

mrl_adamw_kernel_fn mrl_adamw_kernel_best(void) {
    static mrl_adamw_kernel_fn best;
    if (!best) {
        if (__builtin_cpu_supports("avx512f")) best = mrl_adamw_kernel_avx512;
        else if (__builtin_cpu_supports("avx2")) best = mrl_adamw_kernel_avx2;
        else best = mrl_adamw_kernel_scalar;
    }
    return best;
}
