/* Memory accounting of bytes the core gets elsewhere than mrl_mem_alloc
 * (core internal; moonrl/mem.h has the allocator and the counters). */
#pragma once
#include <stdint.h>
#include "moonrl/mem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Record bytes allocated elsewhere (a mapping) under a category. */
void mrl_mem_account(mrl_mem_category category, int64_t delta_bytes);
/* The same for device memory (mrl_buffer_alloc on a GPU): counters of their
 * own, over every GPU of the process (mrl_mem_get_device_stats). */
void mrl_mem_account_device(mrl_mem_category category, int64_t delta_bytes);

#ifdef __cplusplus
}
#endif
