/* fp32 <-> bf16 / f16: the scalar conversions on known values and
 * exhaustively against exact arithmetic, and the public array conversions
 * against them. */
#include <stdlib.h>
#include <string.h>
#include "moonrl/dtype.h"
#include "moonrl/status.h"
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

/* The public array conversions (the fast table's ops, checked bit for bit
 * against the scalar loops on every instruction set by
 * tests/kernels/test_ops.c) against the scalar conversions here. */
static void test_arrays(void) {
    enum { N = 1000 };
    uint16_t h[N], h2[N];
    float f[N], f2[N];
    for (int i = 0; i < N; i++) h[i] = (uint16_t)(i * 40503u), f[i] = bits_f((uint32_t)i * 2654435761u);
    mrl_convert_bf16_to_f32(h, f2, N);
    for (int i = 0; i < N; i++) CHECK(f_bits(f2[i]) == f_bits(mrl_bf16_to_f32(h[i])));
    mrl_convert_f16_to_f32(h, f2, N);
    for (int i = 0; i < N; i++) CHECK(f_bits(f2[i]) == f_bits(mrl_f16_to_f32(h[i])));
    mrl_convert_f32_to_bf16(f, h2, N);
    for (int i = 0; i < N; i++) CHECK(h2[i] == mrl_f32_to_bf16(f[i]));
    mrl_convert_f32_to_f16(f, h2, N);
    for (int i = 0; i < N; i++) CHECK(h2[i] == mrl_f32_to_f16(f[i]));
}

int main(void) {
    test_known_values();
    test_exhaustive_f16();
    test_arrays();
    CHECK_DONE();
}
