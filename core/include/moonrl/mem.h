/* The memory layer: every large allocation in moonrl goes through it and is
 * accounted to a category, so that a run can report where its bytes went
 * and its peak. Counters are per device kind (host, CUDA). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mrl_mem_category {
    MRL_MEM_PARAMS = 0,
    MRL_MEM_GRADS = 1,
    MRL_MEM_OPTIM = 2,
    MRL_MEM_ACTIVATIONS = 3,
    MRL_MEM_KV_CACHE = 4,
    MRL_MEM_OTHER = 5,
    MRL_MEM_NUM_CATEGORIES = 6
} mrl_mem_category;

typedef struct mrl_mem_stats {
    int64_t current[6]; /* bytes live now, per category */
    int64_t peak[6];    /* highest `current` seen, per category */
    int64_t total;      /* bytes live now, all categories */
    int64_t total_peak; /* highest `total` seen */
} mrl_mem_stats;

/* Host allocation, 64-byte aligned, zero-filled. API, not only the core's:
 * Lua keeps its large arrays here (a dataset's permutation of millions of
 * rows, lua/moonrl/data.lua), outside LuaJIT's heap and counted under a
 * category. NULL (and an error) on failure; an allocation of 64 MiB or
 * more that is larger than the memory available (mrl_mem_available) fails
 * at once with an error naming the category and both sizes, instead of the
 * kernel's OOM killer later. */
void *mrl_mem_alloc(size_t bytes, mrl_mem_category category);
void mrl_mem_free(void *ptr);
/* A budget for the host bytes this process holds through moonrl (the
 * counters' total: mrl_mem_alloc and the mappings it accounts), 0 for none:
 * an allocation of any size that would take the total past it fails at once
 * (NULL, MRL_ERR_NOMEM) with an error naming `name` (what set the budget, as
 * "run.memory_budget_mb"; NULL: "the memory budget"), both sizes and the
 * budget; what is held already stays. Device memory is not counted.
 * MRL_ERR_INVALID when bytes < 0. */
mrl_status mrl_mem_set_budget(int64_t bytes, const char *name);
int64_t mrl_mem_budget(void);
/* The host's counters (mrl_mem_alloc, and mappings the core accounts). */
void mrl_mem_get_stats(mrl_mem_stats *out);
/* Device memory (mrl_buffer_alloc on a GPU): its own counters, over every
 * GPU of the process; all zero without one. */
void mrl_mem_get_device_stats(mrl_mem_stats *out);
/* Bytes the process could still get: /proc/meminfo's MemAvailable, or what
 * the cgroup v2 limit leaves when that is less; -1 when neither is known. */
int64_t mrl_mem_available(void);
/* This process's resident set now and its peak since the last reset (bytes;
 * -1 where /proc/self/status is not there). */
int64_t mrl_mem_rss(void);
int64_t mrl_mem_rss_peak(void);
/* The resident set's peak since the process began, through the resets of
 * mrl_mem_reset_rss_peak (what `moonrl status` shows as a rank's peak). */
int64_t mrl_mem_rss_peak_lifetime(void);
/* Reset the resident-set peak to the resident set now (Linux: clear_refs). */
void mrl_mem_reset_rss_peak(void);
/* Reset the peaks (host and device) to the current values (to measure one phase). */
void mrl_mem_reset_peak(void);
const char *mrl_mem_category_name(mrl_mem_category category);

#ifdef __cplusplus
}
#endif
