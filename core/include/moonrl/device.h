/* The devices: which exist, and where an array lives. The CPU device
 * always exists; CUDA devices exist when moonrl was built with CUDA and a
 * GPU is present at run time. (The core's buffers, streams and graphs on
 * them: core/runtime/device_internal.h.) */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mrl_device_kind {
    MRL_DEVICE_CPU = 0,
    MRL_DEVICE_CUDA = 1
} mrl_device_kind;

typedef struct mrl_device {
    mrl_device_kind kind;
    int index; /* GPU ordinal; 0 for the CPU */
} mrl_device;

/* 1 when the CUDA backend was compiled in. */
int mrl_device_cuda_built(void);
/* Number of usable CUDA devices now (0 when not built or no GPU). */
int mrl_device_cuda_count(void);
/* Parse "cpu", "cuda", "cuda:1". */
mrl_status mrl_device_parse(const char *text, mrl_device *out);
/* Describe a device into buf ("cpu", "cuda:0 (NVIDIA H200, 139 GiB)"). */
mrl_status mrl_device_describe(mrl_device device, char *buf, size_t buf_size);

/* Where the memory at ptr lives: a CUDA device's (allocated by
 * mrl_buffer_alloc there) or the host's (anything else, NULL included). */
mrl_device mrl_device_of(const void *ptr);
/* bytes from src to dst wherever each lives (host, a GPU: told apart by
 * their addresses, which CUDA keeps unique across the process); complete
 * when it returns. */
mrl_status mrl_device_memcpy(void *dst, const void *src, size_t bytes);

#ifdef __cplusplus
}
#endif
