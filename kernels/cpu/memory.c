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
