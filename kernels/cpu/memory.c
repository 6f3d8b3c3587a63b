/* The CPU tables' memory slots (kernels.h): the host's memory is theirs,
 * so copies between "host" and "table" are plain copies. */
#include <string.h>
#include "cpu/memory.h"

void mrl_cpu_copy(void *dst, const void *src, int64_t bytes) {
    if (bytes > 0 && dst != src) memmove(dst, src, (size_t)bytes);
}

void mrl_cpu_zero(void *dst, int64_t bytes) {
    if (bytes > 0) memset(dst, 0, (size_t)bytes);
}

mrl_status mrl_cpu_transfer(void *dst, const void *src, int64_t bytes) {
    mrl_cpu_copy(dst, src, bytes);
    return MRL_OK;
}

mrl_status mrl_cpu_sync(void) { return MRL_OK; }

void mrl_cpu_copy_rows(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows && cols > 0; r++) memmove(dst + r * ldd, src + r * lds, sizeof(float) * (size_t)cols);
}
