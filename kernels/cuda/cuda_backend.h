/* The CUDA backend's C interface, seen by the core (device.c) and by the
 * op table. Only compiled in when meson finds nvcc and the CUDA libraries
 * (MRL_HAVE_CUDA). Every function returns an mrl_status and sets the
 * thread's last error on failure. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "base/error.h"

#ifdef __cplusplus
extern "C" {
#endif

int mrl_cuda_device_count(void);
mrl_status mrl_cuda_describe(int device, char *buf, size_t buf_size);
mrl_status mrl_cuda_malloc(int device, size_t bytes, void **out);
void mrl_cuda_free(void *ptr);
/* kind: 0 host->device, 1 device->host, 2 device->device, 3 either way
 * (told by the addresses), 4 device->host not waited for; complete on
 * return for 1 and 3 */
mrl_status mrl_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, void *stream);
/* Page-lock host memory (cudaHostRegister), so that copies to and from it
 * run asynchronously; unregister before it is freed. */
mrl_status mrl_cuda_host_register(void *ptr, size_t bytes);
void mrl_cuda_host_unregister(void *ptr);
/* 1 and *device when ptr is device memory of this process; 0 otherwise */
int mrl_cuda_pointer_device(const void *ptr, int *device);
mrl_status mrl_cuda_memset_zero(void *ptr, size_t bytes, void *stream);
/* Virtual memory (a region's backing, core/base/mem.h): page = the allocation granularity;
 * reserve bytes (a multiple of page) of address space; map gives bytes [lo, hi) (page
 * multiples) memory, zero-filled; unmap gives it back after the device's queued work. */
mrl_status mrl_cuda_vmm_page(int device, int64_t *page);
mrl_status mrl_cuda_vmm_reserve(int device, int64_t bytes, int64_t page, void **base, void **state);
mrl_status mrl_cuda_vmm_map(void *state, void *base, int64_t lo, int64_t hi);
void mrl_cuda_vmm_unmap(void *state, void *base, int64_t lo, int64_t hi);
void mrl_cuda_vmm_release(void *state, void *base, int64_t bytes);
mrl_status mrl_cuda_stream_create(int device, void **out);
mrl_status mrl_cuda_stream_sync(void *stream);
void mrl_cuda_stream_destroy(void *stream);

/* CUDA graphs: the table's ops launched on `stream` (a created stream, not
 * the legacy default one) between begin and end, captured instead of run,
 * as one executable graph that launch runs again on a stream, with the
 * same pointers and shapes (the engine's decode steps). An op that may not
 * be captured (an allocation, a wait for the host) makes end fail, with
 * nothing run. */
mrl_status mrl_cuda_graph_begin(void *stream);
mrl_status mrl_cuda_graph_end(void *stream, void **exec);
mrl_status mrl_cuda_graph_launch(void *exec, void *stream);
void mrl_cuda_graph_free(void *exec);

/* The CUDA op table (kernels/cuda/table.cu): the slots of kernels/kernels.h
 * with the same signatures and meaning, on device memory. Host memory are
 * only: gemm_group's array of descriptors; the mrl_paged_attn and
 * mrl_adamw_args structs themselves (their arrays are device memory, except
 * adamw's `ranges`, host); sum's *out; and every array of the sample call
 * (rows, params, u, tokens, logprobs, lp_processed) except the logits rows
 * the `rows` pointers point to, and likewise of top_logprobs (rows, params,
 * ids, lps). The ops that return a status wait for their kernels (sum,
 * sample, top_logprobs); the others only launch. Declared by the
 * struct's tag, so this header needs no kernels.h. */
const struct mrl_kernels *mrl_kernels_cuda(void);
/* The stream the table's ops launch on (NULL, the default: the legacy
 * default stream). Process-wide: set it between ops, from the thread that
 * calls them; the table serves one stream at a time. */
void mrl_cuda_ops_set_stream(void *stream);
void *mrl_cuda_ops_stream(void);
/* Wait for the stream, then the first error of the table's ops since the
 * last check (bad shapes given to a void slot, launch and cuBLASLt
 * failures, paged attention's per-sequence length checks, which run on the
 * device), and clear it. MRL_OK when there was none. */
mrl_status mrl_cuda_ops_check(void);
/* Free the table's scratch and cuBLASLt handle (it makes them again on use). */
void mrl_cuda_ops_release(void);
/* Counts the times the table's own buffers (scratch, cuBLASLt workspace,
 * the error flag) were allocated or freed: a graph captured before a change
 * holds addresses that are gone. */
uint64_t mrl_cuda_ops_epoch(void);

#ifdef __cplusplus
}
#endif
