/* fp32 <-> bf16 / f16 conversions: the scalar loops (the reference table's
 * ops and the SSE set's), AVX2(+F16C) and AVX-512 loops (the ISA sets'
 * of isa.h, chosen at run time by isa.c), the fast table's parallel ops, and
 * the public array conversions of moonrl/dtype.h, which are the fast table's.
 * Every path gives the same bits as the scalar one (a NaN input gives the
 * scalar path's NaN). Rounding is to nearest, ties to even, like PyTorch. */
#include <string.h>
#include <immintrin.h>
#include "moonrl/dtype.h"
#include "base/parallel.h"
#include "cpu/convert.h"
#include "cpu/isa.h"

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* --- dtype table -------------------------------------------------------- */
static const struct { const char *name; size_t size; } dtype_table[MRL_DTYPE_COUNT] = {
    [MRL_DTYPE_F32] = {"F32", 4},  [MRL_DTYPE_BF16] = {"BF16", 2}, [MRL_DTYPE_F16] = {"F16", 2},
    [MRL_DTYPE_F64] = {"F64", 8},  [MRL_DTYPE_I64] = {"I64", 8},   [MRL_DTYPE_I32] = {"I32", 4},
    [MRL_DTYPE_I16] = {"I16", 2},  [MRL_DTYPE_I8] = {"I8", 1},     [MRL_DTYPE_U8] = {"U8", 1},
    [MRL_DTYPE_BOOL] = {"BOOL", 1},
};

size_t mrl_dtype_size(mrl_dtype dtype) {
    return (unsigned)dtype < MRL_DTYPE_COUNT ? dtype_table[dtype].size : 0;
}

const char *mrl_dtype_name(mrl_dtype dtype) {
    return (unsigned)dtype < MRL_DTYPE_COUNT ? dtype_table[dtype].name : "?";
}

int mrl_dtype_parse(const char *name) {
    if (!name) return -1;
    for (int i = 0; i < MRL_DTYPE_COUNT; i++)
        if (strcmp(name, dtype_table[i].name) == 0) return i;
    return -1;
}

/* --- scalar ------------------------------------------------------------- */
float mrl_bf16_to_f32(uint16_t x) { return bits_f32((uint32_t)x << 16); }

uint16_t mrl_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float mrl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24 is exact in fp32 */
        float v = (float)mant * 0x1p-24f;
        return bits_f32(sign | f32_bits(v));
    }
    if (exp == 31) /* inf, or NaN made quiet as the hardware does */
        return bits_f32(sign | 0x7f800000u | ((mant ? mant | 0x200u : 0) << 13));
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t mrl_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u;      /* NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00u;     /* >= 65520 rounds to inf (and inf) */
    if (u < 0x38800000u) {
        /* below 2^-14: a subnormal or zero half. Adding 0.5 puts the half's
         * bits in the low mantissa, rounded to nearest-even by the FPU. */
        float v = bits_f32(u) + 0.5f;
        return sign | (uint16_t)(f32_bits(v) - 0x3f000000u);
    }
    uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd; /* rebias exponent (-112 << 23) and round */
    return sign | (uint16_t)(u >> 13);
}

void mrl_cpu_bf16_to_f32_scalar(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = mrl_bf16_to_f32(src[i]);
}
void mrl_cpu_f32_to_bf16_scalar(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = mrl_f32_to_bf16(src[i]);
}
void mrl_cpu_f16_to_f32_scalar(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = mrl_f16_to_f32(src[i]);
}
void mrl_cpu_f32_to_f16_scalar(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = mrl_f32_to_f16(src[i]);
}

/* GGML blocks (kernels.h's dequant): the block's fp16 scale, then its weights' low nibbles
 * (the first 16) and high nibbles (the last 16), or 32 signed bytes. No fused multiply-add
 * (gguf-py computes d * q + m in two roundings): the same bits as gguf-py and the GPU's kernel. */
#define DEQ __attribute__((optimize("fp-contract=off")))

static float block_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return mrl_f16_to_f32(h);
}

DEQ static void deq_q4_0(const uint8_t *b, float *y) {
    float d = block_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0x0F) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

DEQ static void deq_q4_1(const uint8_t *b, float *y) {
    float d = block_f16(b), m = block_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0x0F) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

DEQ static void deq_q8_0(const uint8_t *b, float *y) {
    float d = block_f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

void mrl_cpu_dequant_scalar(int type, const void *blocks, float *dst, int64_t n) {
    int bytes = mrl_quant_block_bytes(type);
    const uint8_t *b = blocks;
    for (int64_t i = 0; i < n / 32; i++, b += bytes, dst += 32) {
        if (type == MRL_QUANT_Q4_0) deq_q4_0(b, dst);
        else if (type == MRL_QUANT_Q4_1) deq_q4_1(b, dst);
        else if (type == MRL_QUANT_Q8_0) deq_q8_0(b, dst);
    }
}

/* --- AVX2 + F16C -------------------------------------------------------- */
#define AVX2 __attribute__((target("avx2,f16c,fma")))

AVX2 void mrl_cpu_bf16_to_f32_avx2(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(x, 16));
    }
    mrl_cpu_bf16_to_f32_scalar(src + i, dst + i, n - i);
}

AVX2 static inline __m256i bf16_round8(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                    _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m256i nan = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                  _mm256_set1_epi32(0x7fc0));
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, nan, is_nan);
}

AVX2 void mrl_cpu_f32_to_bf16_avx2(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = bf16_round8(_mm256_loadu_ps(src + i));
        __m256i b = bf16_round8(_mm256_loadu_ps(src + i + 8));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        _mm256_storeu_si256((__m256i *)(dst + i), packed);
    }
    mrl_cpu_f32_to_bf16_scalar(src + i, dst + i, n - i);
}

AVX2 void mrl_cpu_f16_to_f32_avx2(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    mrl_cpu_f16_to_f32_scalar(src + i, dst + i, n - i);
}

AVX2 static inline __m128i f16_round8(__m256 f) {
    __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* NaN: sign | 0x7e00, like the scalar path (the hardware keeps payload bits) */
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    __m128i nan_mask = _mm_packs_epi32(_mm256_castsi256_si128(is_nan), _mm256_extracti128_si256(is_nan, 1));
    __m128i nan = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16((short)0x8000)), _mm_set1_epi16(0x7e00));
    return _mm_blendv_epi8(h, nan, nan_mask);
}

AVX2 void mrl_cpu_f32_to_f16_avx2(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(dst + i), f16_round8(_mm256_loadu_ps(src + i)));
    mrl_cpu_f32_to_f16_scalar(src + i, dst + i, n - i);
}

/* --- AVX-512 ------------------------------------------------------------ */
#define AVX512 __attribute__((target("avx512f,avx2,f16c,fma")))

AVX512 void mrl_cpu_bf16_to_f32_avx512(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_si512(dst + i, _mm512_slli_epi32(x, 16));
    }
    mrl_cpu_bf16_to_f32_scalar(src + i, dst + i, n - i);
}

AVX512 void mrl_cpu_f32_to_bf16_avx512(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    const __m512i sign = _mm512_set1_epi32(0x8000), qnan = _mm512_set1_epi32(0x7fc0);
    for (; i + 16 <= n; i += 16) {
        __m512 f = _mm512_loadu_ps(src + i);
        __m512i u = _mm512_castps_si512(f);
        __m512i hi = _mm512_srli_epi32(u, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(hi, one), half)), 16);
        __mmask16 is_nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, is_nan, _mm512_or_si512(_mm512_and_si512(hi, sign), qnan));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(r));
    }
    mrl_cpu_f32_to_bf16_scalar(src + i, dst + i, n - i);
}

AVX512 void mrl_cpu_f16_to_f32_avx512(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    mrl_cpu_f16_to_f32_scalar(src + i, dst + i, n - i);
}

AVX512 void mrl_cpu_f32_to_f16_avx512(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(dst + i), f16_round8(_mm256_loadu_ps(src + i)));
    mrl_cpu_f32_to_f16_scalar(src + i, dst + i, n - i);
}

/* --- GGML blocks in vector lanes: d * q (+ m) rounded apart, as the scalar loop -------------- */
#define DEQ_AVX2 __attribute__((target("avx2,f16c,fma"), optimize("fp-contract=off")))
#define DEQ_AVX512 __attribute__((target("avx512f,avx2,f16c,fma"), optimize("fp-contract=off")))

__attribute__((target("f16c"))) static inline float f16_at(const uint8_t *p) { /* (F16C: the scalar conversion's bits, a NaN quieted as it does) */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

DEQ_AVX512 void mrl_cpu_dequant_avx512(int type, const void *blocks, float *dst, int64_t n) {
    int bytes = mrl_quant_block_bytes(type);
    const uint8_t *b = blocks;
    for (int64_t i = 0; i < n / 32; i++, b += bytes, dst += 32) {
        __m512 d = _mm512_set1_ps(f16_at(b)), lo, hi;
        if (type == MRL_QUANT_Q8_0) {
            lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
            hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
            lo = _mm512_mul_ps(lo, d), hi = _mm512_mul_ps(hi, d);
        } else {
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (type == MRL_QUANT_Q4_1 ? 4 : 2))));
            __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(0x0F)), qh = _mm512_srli_epi32(q, 4);
            if (type == MRL_QUANT_Q4_0)
                ql = _mm512_sub_epi32(ql, _mm512_set1_epi32(8)), qh = _mm512_sub_epi32(qh, _mm512_set1_epi32(8));
            lo = _mm512_mul_ps(_mm512_cvtepi32_ps(ql), d), hi = _mm512_mul_ps(_mm512_cvtepi32_ps(qh), d);
            if (type == MRL_QUANT_Q4_1) {
                __m512 m = _mm512_set1_ps(f16_at(b + 2));
                lo = _mm512_add_ps(lo, m), hi = _mm512_add_ps(hi, m);
            }
        }
        _mm512_storeu_ps(dst, lo);
        _mm512_storeu_ps(dst + 16, hi);
    }
}

DEQ_AVX2 void mrl_cpu_dequant_avx2(int type, const void *blocks, float *dst, int64_t n) {
    int bytes = mrl_quant_block_bytes(type);
    const uint8_t *b = blocks;
    for (int64_t i = 0; i < n / 32; i++, b += bytes, dst += 32) {
        __m256 d = _mm256_set1_ps(f16_at(b)), m = _mm256_set1_ps(type == MRL_QUANT_Q4_1 ? f16_at(b + 2) : 0.0f);
        for (int h = 0; h < 2; h++) { /* weights 8h .. 8h + 8 and 16 + 8h .. (Q8_0: 16h ..) */
            __m256 lo, hi;
            if (type == MRL_QUANT_Q8_0) {
                lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 16 * h))));
                hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 10 + 16 * h))));
                _mm256_storeu_ps(dst + 16 * h, _mm256_mul_ps(lo, d));
                _mm256_storeu_ps(dst + 16 * h + 8, _mm256_mul_ps(hi, d));
                continue;
            }
            __m256i q = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const __m128i *)(b + (type == MRL_QUANT_Q4_1 ? 4 : 2) + 8 * h)));
            __m256i ql = _mm256_and_si256(q, _mm256_set1_epi32(0x0F)), qh = _mm256_srli_epi32(q, 4);
            if (type == MRL_QUANT_Q4_0)
                ql = _mm256_sub_epi32(ql, _mm256_set1_epi32(8)), qh = _mm256_sub_epi32(qh, _mm256_set1_epi32(8));
            lo = _mm256_mul_ps(_mm256_cvtepi32_ps(ql), d), hi = _mm256_mul_ps(_mm256_cvtepi32_ps(qh), d);
            if (type == MRL_QUANT_Q4_1) lo = _mm256_add_ps(lo, m), hi = _mm256_add_ps(hi, m);
            _mm256_storeu_ps(dst + 8 * h, lo);
            _mm256_storeu_ps(dst + 16 + 8 * h, hi);
        }
    }
}

/* --- the fast table's ops: the ISA set's loop over slices of the array ---- */
typedef void (*to_f32_fn)(const uint16_t *, float *, int64_t);
typedef void (*from_f32_fn)(const float *, uint16_t *, int64_t);

typedef struct convert_ctx {
    const void *src;
    void *dst;
    to_f32_fn to_f32;
    from_f32_fn from_f32;
} convert_ctx;

static void convert_range(void *vctx, int64_t begin, int64_t end) {
    convert_ctx *c = vctx;
    if (c->to_f32)
        c->to_f32((const uint16_t *)c->src + begin, (float *)c->dst + begin, end - begin);
    else
        c->from_f32((const float *)c->src + begin, (uint16_t *)c->dst + begin, end - begin);
}

enum { CONVERT_GRAIN = 1 << 16 };

static void run_to_f32(const uint16_t *src, float *dst, int64_t n, to_f32_fn f) {
    convert_ctx c = {src, dst, f, NULL};
    mrl_parallel_for(n, CONVERT_GRAIN, convert_range, &c);
}

static void run_from_f32(const float *src, uint16_t *dst, int64_t n, from_f32_fn f) {
    convert_ctx c = {src, dst, NULL, f};
    mrl_parallel_for(n, CONVERT_GRAIN, convert_range, &c);
}

void mrl_cpu_fast_bf16_to_f32(const uint16_t *src, float *dst, int64_t n) {
    run_to_f32(src, dst, n, mrl_cpu_isa_get()->bf16_to_f32);
}
void mrl_cpu_fast_f16_to_f32(const uint16_t *src, float *dst, int64_t n) {
    run_to_f32(src, dst, n, mrl_cpu_isa_get()->f16_to_f32);
}
void mrl_cpu_fast_f32_to_bf16(const float *src, uint16_t *dst, int64_t n) {
    run_from_f32(src, dst, n, mrl_cpu_isa_get()->f32_to_bf16);
}
void mrl_cpu_fast_f32_to_f16(const float *src, uint16_t *dst, int64_t n) {
    run_from_f32(src, dst, n, mrl_cpu_isa_get()->f32_to_f16);
}

typedef struct dequant_ctx {
    int type;
    const uint8_t *blocks;
    float *dst;
} dequant_ctx;

static void dequant_range(void *vctx, int64_t begin, int64_t end) { /* (blocks begin .. end) */
    const dequant_ctx *c = vctx;
    mrl_cpu_isa_get()->dequant(c->type, c->blocks + begin * mrl_quant_block_bytes(c->type), c->dst + 32 * begin,
                           32 * (end - begin));
}

void mrl_cpu_fast_dequant(int type, const void *blocks, float *dst, int64_t n) {
    dequant_ctx c = {type, blocks, dst};
    mrl_parallel_for(n / 32, CONVERT_GRAIN / 32, dequant_range, &c);
}

/* --- moonrl/dtype.h's array conversions: the fast table's ----------------- */
void mrl_convert_bf16_to_f32(const uint16_t *src, float *dst, int64_t n) { mrl_kernels_cpu_fast()->bf16_to_f32(src, dst, n); }
void mrl_convert_f16_to_f32(const uint16_t *src, float *dst, int64_t n) { mrl_kernels_cpu_fast()->f16_to_f32(src, dst, n); }
void mrl_convert_f32_to_bf16(const float *src, uint16_t *dst, int64_t n) { mrl_kernels_cpu_fast()->f32_to_bf16(src, dst, n); }
void mrl_convert_f32_to_f16(const float *src, uint16_t *dst, int64_t n) { mrl_kernels_cpu_fast()->f32_to_f16(src, dst, n); }
