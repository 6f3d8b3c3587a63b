/* The CUDA backend's C interface, seen by the core (device.c) and by the
 * op table. Only compiled in when meson finds nvcc and the CUDA libraries
 * (MRL_HAVE_CUDA). Every function returns an mrl_status and sets the
 * thread's last error on failure. */
#pragma once
#include <stddef.h>
#include "moonrl/status.h"

#ifdef __cplusplus
extern "C" {
#endif

int mrl_cuda_device_count(void);
mrl_status mrl_cuda_describe(int device, char *buf, size_t buf_size);
mrl_status mrl_cuda_malloc(int device, size_t bytes, void **out);
void mrl_cuda_free(void *ptr);
/* kind: 0 host->device, 1 device->host, 2 device->device */
mrl_status mrl_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, void *stream);
mrl_status mrl_cuda_memset_zero(void *ptr, size_t bytes, void *stream);
mrl_status mrl_cuda_stream_create(int device, void **out);
mrl_status mrl_cuda_stream_sync(void *stream);
void mrl_cuda_stream_destroy(void *stream);

/* Kernels: device pointers, launched on `stream` (NULL: default stream). */
/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight; rms_inv[r] saved for backward. */
mrl_status mrl_cuda_rmsnorm_forward(float *out, float *rms_inv, const float *x, const float *weight,
                                    int rows, int dim, float eps, void *stream);

#ifdef __cplusplus
}
#endif
