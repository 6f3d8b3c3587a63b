/* Internal: the fast table's dtype conversions (convert.c): the ISA set's
 * loop (isa.h) over slices of the array on the cores. The reference table
 * uses the scalar loops, mrl_cpu_*_scalar (isa.h). */
#pragma once
#include <stdint.h>

void mrl_cpu_fast_bf16_to_f32(const uint16_t *src, float *dst, int64_t n);
void mrl_cpu_fast_f32_to_bf16(const float *src, uint16_t *dst, int64_t n);
void mrl_cpu_fast_f16_to_f32(const uint16_t *src, float *dst, int64_t n);
void mrl_cpu_fast_f32_to_f16(const float *src, uint16_t *dst, int64_t n);
void mrl_cpu_fast_dequant(int type, const void *blocks, float *dst, int64_t n);
