/* Element types of tensors in files and buffers, and conversions between
 * the 16-bit float formats and fp32 (kernels/cpu/convert.c: AVX-512 / AVX2
 * fast paths with a scalar reference; all give identical bits). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mrl_dtype {
    MRL_DTYPE_F32 = 0,
    MRL_DTYPE_BF16 = 1,
    MRL_DTYPE_F16 = 2,
    MRL_DTYPE_F64 = 3,
    MRL_DTYPE_I64 = 4,
    MRL_DTYPE_I32 = 5,
    MRL_DTYPE_I16 = 6,
    MRL_DTYPE_I8 = 7,
    MRL_DTYPE_U8 = 8,
    MRL_DTYPE_BOOL = 9,
    MRL_DTYPE_COUNT = 10
} mrl_dtype;

/* Bytes per element (0 for a value outside the enum). */
size_t mrl_dtype_size(mrl_dtype dtype);
/* The safetensors name: "F32", "BF16", ... ("?" outside the enum). */
const char *mrl_dtype_name(mrl_dtype dtype);
/* Parse a safetensors dtype name; -1 when unknown. */
int mrl_dtype_parse(const char *name);

/* Scalar conversions. bf16/f16 -> f32 are exact (f16 subnormals, inf and
 * NaN included; a signalling f16 NaN comes back quiet, as F16C does).
 * f32 -> bf16 / f16 round to nearest, ties to even, as
 * PyTorch's .to(torch.bfloat16) / .to(torch.float16) do; overflow goes to
 * inf; NaN stays NaN (bf16 0x7FC0 / f16 0x7E00 with the sign kept). */
float mrl_bf16_to_f32(uint16_t x);
uint16_t mrl_f32_to_bf16(float x);
float mrl_f16_to_f32(uint16_t x);
uint16_t mrl_f32_to_f16(float x);

/* Array conversions (vectorised, in parallel for large n). */
void mrl_convert_bf16_to_f32(const uint16_t *src, float *dst, int64_t n);
void mrl_convert_f32_to_bf16(const float *src, uint16_t *dst, int64_t n);
void mrl_convert_f16_to_f32(const uint16_t *src, float *dst, int64_t n);
void mrl_convert_f32_to_f16(const float *src, uint16_t *dst, int64_t n);

#ifdef __cplusplus
}
#endif
