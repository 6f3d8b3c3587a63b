/* Memory accounting of bytes the core gets elsewhere than mrl_mem_alloc
 * (core internal; moonrl/mem.h has the allocator and the counters). */
#pragma once
#include <stdint.h>
#include "moonrl/mem.h"
#include "moonrl/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Record bytes allocated elsewhere (a mapping) under a category. */
void mrl_mem_account(mrl_mem_category category, int64_t delta_bytes);
/* The same for device memory (mrl_buffer_alloc on a GPU): counters of their
 * own, over every GPU of the process (mrl_mem_get_device_stats). */
void mrl_mem_account_device(mrl_mem_category category, int64_t delta_bytes);

/* A region: `bytes` of reserved address space whose pages hold memory only
 * while pinned (ZeRO-3's parameter buffer: the rank's shard pinned for the
 * run, the rest while a layer is gathered into place). pin makes the pages
 * of bytes [lo, hi) readable and writable (zero-filled when they had no
 * memory), counts them under the category and checks them against the
 * budget (MRL_ERR_NOMEM then, nothing pinned); unpin gives back the pages it
 * leaves without a pin, which become unreadable (a stray read faults
 * instead of seeing stale values). Pages are 4 KiB on the host; pins nest
 * (at most 255 on a page). One thread. */
typedef struct mrl_mem_region mrl_mem_region;
mrl_status mrl_mem_region_create(int64_t bytes, mrl_mem_category category, mrl_mem_region **out);
/* Where a region's pages come from other than the host's: a GPU's memory
 * (runtime/device.c's mrl_device_region_create: CUDA's virtual memory, pages
 * of its granularity), counted as device memory, outside the host budget.
 * reserve gives the address space and the backing's state for the region;
 * map gives bytes [lo, hi) of it memory, zero-filled; unmap takes it back. */
typedef struct mrl_mem_backing {
    int64_t page; /* bytes */
    int device;   /* counted by mrl_mem_account_device */
    mrl_status (*reserve)(const struct mrl_mem_backing *b, int64_t bytes, char **base, void **state);
    void (*release)(void *state, char *base, int64_t bytes);
    mrl_status (*map)(void *state, char *base, int64_t lo, int64_t hi);
    void (*unmap)(void *state, char *base, int64_t lo, int64_t hi);
    int index; /* the device's */
} mrl_mem_backing;
mrl_status mrl_mem_region_create_backed(int64_t bytes, mrl_mem_category category, const mrl_mem_backing *b,
                                        mrl_mem_region **out);
void mrl_mem_region_free(mrl_mem_region *r);
void *mrl_mem_region_base(const mrl_mem_region *r);
mrl_status mrl_mem_region_pin(mrl_mem_region *r, int64_t lo, int64_t hi);
void mrl_mem_region_unpin(mrl_mem_region *r, int64_t lo, int64_t hi);
int64_t mrl_mem_region_resident(const mrl_mem_region *r);
int64_t mrl_mem_region_page(const mrl_mem_region *r); /* bytes a page */

#ifdef __cplusplus
}
#endif
