/* Internal: the CPU tables' memory slots (memory.c): host memory is the
 * table's memory, so every copy is a memmove. */
#pragma once
#include <stdint.h>
#include "moonrl/status.h"

void mrl_cpu_copy(void *dst, const void *src, int64_t bytes);
void mrl_cpu_zero(void *dst, int64_t bytes);
mrl_status mrl_cpu_transfer(void *dst, const void *src, int64_t bytes);
mrl_status mrl_cpu_sync(void);
void mrl_cpu_copy_rows(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols);
