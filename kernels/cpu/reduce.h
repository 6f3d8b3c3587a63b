/* Internal: the two tables' sum, scale and add ops (reduce.c). */
#pragma once
#include <stdint.h>
#include "moonrl/status.h"

mrl_status mrl_cpu_ref_sum(const float *x, int64_t n, int squares, double *out);
mrl_status mrl_cpu_fast_sum(const float *x, int64_t n, int squares, double *out);
void mrl_cpu_ref_scale(float *x, int64_t n, float s);
void mrl_cpu_fast_scale(float *x, int64_t n, float s);
void mrl_cpu_ref_add(float *y, const float *x, int64_t n);
void mrl_cpu_fast_add(float *y, const float *x, int64_t n);
