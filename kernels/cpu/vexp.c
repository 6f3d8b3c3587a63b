/* Vector exp-and-sum and CPU level detection (see vexp.h). */
#include <math.h>
#include <immintrin.h>
#include "cpu/vexp.h"

static double exp_sum_scalar(float *w, const float *x, float m, int64_t V) {
    double s = 0;
    for (int64_t i = 0; i < V; i++) s += (w[i] = expf(x[i] - m));
    return s;
}

/* exp(t) for t <= 0: 2^n * e^r, |r| <= ln2/2, degree-6 Taylor (error ~1e-7
 * relative); t < -87 (and -inf) gives 0. */
__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 t) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), t);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    __mmask16 ok = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(ok, y);
}

__attribute__((target("avx512f"))) static double exp_sum_avx512(float *w, const float *x, float m, int64_t V) {
    __m512 vm = _mm512_set1_ps(m);
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
        __m512 y = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
        _mm512_storeu_ps(w + i, y);
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(y)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1))));
    }
    if (i < V) {
        __mmask16 k = (__mmask16)((1u << (V - i)) - 1);
        __m512 y = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm)));
        _mm512_mask_storeu_ps(w + i, k, y);
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(y)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1))));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
}

__attribute__((target("avx2,fma"))) static inline __m256 exp256(__m256 t) {
    __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), t);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256 ok = _mm256_cmp_ps(t, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    /* clamp n so the exponent bits stay sane where the result is masked */
    n = _mm256_max_ps(n, _mm256_set1_ps(-126.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(ok, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

__attribute__((target("avx2,fma"))) static double exp_sum_avx2(float *w, const float *x, float m, int64_t V) {
    __m256 vm = _mm256_set1_ps(m);
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        __m256 y = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(w + i, y);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(y)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)));
    }
    s0 = _mm256_add_pd(s0, s1);
    double lanes[4];
    _mm256_storeu_pd(lanes, s0);
    double s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    return s + exp_sum_scalar(w + i, x + i, m, V - i);
}

static int isa_detected = -1, isa_cap = 2;

int mrl_cpu_isa_level(void) {
    if (isa_detected < 0) {
        __builtin_cpu_init();
        isa_detected = __builtin_cpu_supports("avx512f")                                    ? 2
                       : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                           : 0;
    }
    return isa_detected < isa_cap ? isa_detected : isa_cap;
}

int mrl_cpu_isa_cap(int level) {
    int old = isa_cap;
    isa_cap = level < 0 ? 0 : level > 2 ? 2 : level;
    return old;
}

const char *mrl_cpu_isa_name(void) {
    static const char *names[3] = {"scalar", "avx2", "avx512"};
    return names[mrl_cpu_isa_level()];
}

double mrl_vexp_sum(float *w, const float *x, float m, int64_t n) {
    int level = mrl_cpu_isa_level();
    if (level == 2) return exp_sum_avx512(w, x, m, n);
    if (level == 1) return exp_sum_avx2(w, x, m, n);
    return exp_sum_scalar(w, x, m, n);
}
