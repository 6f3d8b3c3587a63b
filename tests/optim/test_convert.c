/* fp32 <-> bf16 / f16: the scalar conversions on known values and
 * exhaustively against exact arithmetic, and every fast path against the
 * scalar one on all 16-bit patterns and on edge-case fp32 inputs. */
#include <stdlib.h>
#include <string.h>
#include "moonrl/dtype.h"
#include "moonrl/status.h"
#include "cpu/convert.h"
#include "check.h"

static float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static void test_known_values(void) {
    CHECK(mrl_f16_to_f32(0x3c00) == 1.0f);
    CHECK(mrl_f16_to_f32(0x0001) == 0x1p-24f); /* smallest subnormal */
    CHECK(mrl_f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
    CHECK(mrl_f16_to_f32(0x7bff) == 65504.0f);
    CHECK(isinf(mrl_f16_to_f32(0xfc00)) && mrl_f16_to_f32(0xfc00) < 0);
    CHECK(isnan(mrl_f16_to_f32(0x7e00)));
    CHECK(f_bits(mrl_f16_to_f32(0x8000)) == 0x80000000u);
    CHECK(mrl_f32_to_f16(65504.0f) == 0x7bff);
    CHECK(mrl_f32_to_f16(65519.0f) == 0x7bff);
    CHECK(mrl_f32_to_f16(65520.0f) == 0x7c00); /* halfway to the next: ties to even -> inf */
    CHECK(mrl_f32_to_f16(0x1p-25f) == 0x0000); /* half the smallest subnormal: ties to even -> 0 */
    CHECK(mrl_f32_to_f16(0x1.8p-24f) == 0x0002); /* 1.5 ulp: ties to even -> 2 */
    CHECK(mrl_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00); /* tie -> even */
    CHECK(mrl_f32_to_f16(1.0f + 0x1.8p-10f) == 0x3c02);
    CHECK(mrl_f32_to_f16(-0.0f) == 0x8000);
    CHECK(mrl_f32_to_f16(bits_f(0x7fc00000u)) == 0x7e00);
    CHECK(mrl_f32_to_bf16(1.0f) == 0x3f80);
    CHECK(mrl_f32_to_bf16(bits_f(0x3f808000u)) == 0x3f80); /* tie -> even */
    CHECK(mrl_f32_to_bf16(bits_f(0x3f818000u)) == 0x3f82);
    CHECK(mrl_f32_to_bf16(bits_f(0x7f7fffffu)) == 0x7f80); /* FLT_MAX rounds to inf */
    CHECK(mrl_f32_to_bf16(bits_f(0xffc00001u)) == 0xffc0);
    CHECK(mrl_bf16_to_f32(0x3f80) == 1.0f);
    CHECK(mrl_dtype_size(MRL_DTYPE_BF16) == 2 && mrl_dtype_size(MRL_DTYPE_I64) == 8);
    CHECK(mrl_dtype_parse("BOOL") == MRL_DTYPE_BOOL && mrl_dtype_parse("F8_E4M3") == -1);
    CHECK(strcmp(mrl_dtype_name(MRL_DTYPE_F16), "F16") == 0);
}

/* f16 -> f32 -> f16 is the identity on all non-NaN halves, and f32 -> f16
 * picks the nearest half (ties to even) for values between every pair. */
static void test_exhaustive_f16(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 0x7c00 && !bad; h++) {
        float a = mrl_f16_to_f32((uint16_t)h), b = mrl_f16_to_f32((uint16_t)(h + 1));
        if (mrl_f32_to_f16(a) != h) bad = 1;
        if (h + 1 < 0x7c00) {
            float mid = (float)(((double)a + b) / 2); /* exact in fp32 */
            uint16_t want = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            if (mrl_f32_to_f16(mid) != want) bad = 2;
            if (mrl_f32_to_f16(nextafterf(mid, 0)) != h) bad = 3;
            if (mrl_f32_to_f16(nextafterf(mid, 1e9f)) != h + 1) bad = 4;
        }
        if (mrl_f32_to_f16(-a) != (h | 0x8000)) bad = 5;
    }
    CHECK(bad == 0);
}

static void test_fast_paths(void) {
    int64_t n = 65536 + 13;
    uint16_t *h = malloc(n * 2), *h1 = malloc(n * 2), *h2 = malloc(n * 2);
    float *f = malloc(n * 4), *f1 = malloc(n * 4), *f2 = malloc(n * 4);
    for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)(i * 40503u);
    /* fp32 inputs: random bit patterns, rounding ties, subnormals, inf, nan */
    uint32_t s = 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        uint32_t u = s;
        if (i % 7 == 1) u = (u & 0xffff0000u) | 0x8000u;   /* bf16 tie */
        if (i % 7 == 2) u = (u & 0xffffe000u) | 0x1000u;   /* f16 tie */
        if (i % 7 == 3) u = (u & 0x807fffffu) | (uint32_t)(100 + i % 20) << 23; /* f16 subnormal range */
        if (i % 97 == 0) u = 0x7f800000u | (i & 0x80000000u);
        f[i] = bits_f(u);
    }
    typedef void (*to_fn)(const uint16_t *, float *, int64_t);
    typedef void (*from_fn)(const float *, uint16_t *, int64_t);
    struct { int ok; to_fn bf_to, h_to; from_fn to_bf, to_h; } paths[] = {
        {mrl_convert_has_avx2(), mrl_convert_bf16_to_f32_avx2, mrl_convert_f16_to_f32_avx2, mrl_convert_f32_to_bf16_avx2,
         mrl_convert_f32_to_f16_avx2},
        {mrl_convert_has_avx512(), mrl_convert_bf16_to_f32_avx512, mrl_convert_f16_to_f32_avx512,
         mrl_convert_f32_to_bf16_avx512, mrl_convert_f32_to_f16_avx512},
        {1, mrl_convert_bf16_to_f32, mrl_convert_f16_to_f32, mrl_convert_f32_to_bf16, mrl_convert_f32_to_f16},
    };
    for (int p = 0; p < 3; p++) {
        if (!paths[p].ok) continue;
        mrl_convert_bf16_to_f32_scalar(h, f1, n);
        paths[p].bf_to(h, f2, n);
        CHECK(memcmp(f1, f2, n * 4) == 0);
        mrl_convert_f16_to_f32_scalar(h, f1, n);
        paths[p].h_to(h, f2, n);
        CHECK(memcmp(f1, f2, n * 4) == 0);
        mrl_convert_f32_to_bf16_scalar(f, h1, n);
        paths[p].to_bf(f, h2, n);
        CHECK(memcmp(h1, h2, n * 2) == 0);
        mrl_convert_f32_to_f16_scalar(f, h1, n);
        paths[p].to_h(f, h2, n);
        CHECK(memcmp(h1, h2, n * 2) == 0);
    }
    free(h); free(h1); free(h2); free(f); free(f1); free(f2);
}

int main(void) {
    test_known_values();
    test_exhaustive_f16();
    test_fast_paths();
    CHECK_DONE();
}
