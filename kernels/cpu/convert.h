/* Internal: the per-ISA serial loops behind mrl_convert_* (dtype.h), so
 * that tests can check each fast path against the scalar one. The avx2 /
 * avx512 functions may only be called when the CPU has the feature
 * (mrl_convert_has_avx2 / _avx512). */
#pragma once
#include <stdint.h>

int mrl_convert_has_avx2(void);   /* avx2 + f16c */
int mrl_convert_has_avx512(void); /* avx512f */

void mrl_convert_bf16_to_f32_scalar(const uint16_t *src, float *dst, int64_t n);
void mrl_convert_f32_to_bf16_scalar(const float *src, uint16_t *dst, int64_t n);
void mrl_convert_f16_to_f32_scalar(const uint16_t *src, float *dst, int64_t n);
void mrl_convert_f32_to_f16_scalar(const float *src, uint16_t *dst, int64_t n);

void mrl_convert_bf16_to_f32_avx2(const uint16_t *src, float *dst, int64_t n);
void mrl_convert_f32_to_bf16_avx2(const float *src, uint16_t *dst, int64_t n);
void mrl_convert_f16_to_f32_avx2(const uint16_t *src, float *dst, int64_t n);
void mrl_convert_f32_to_f16_avx2(const float *src, uint16_t *dst, int64_t n);

void mrl_convert_bf16_to_f32_avx512(const uint16_t *src, float *dst, int64_t n);
void mrl_convert_f32_to_bf16_avx512(const float *src, uint16_t *dst, int64_t n);
void mrl_convert_f16_to_f32_avx512(const uint16_t *src, float *dst, int64_t n);
void mrl_convert_f32_to_f16_avx512(const float *src, uint16_t *dst, int64_t n);
