/* The core's use of a device (core internal: moonrl/device.h has what Lua
 * sees): buffers, streams, graphs and the op table of each device. Above
 * the kernels: this is where the core dispatches over backends
 * (core/runtime/device.c). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "moonrl/device.h"
#include "moonrl/mem.h"
#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_buffer {
    void *data;
    size_t bytes;
    mrl_device device;
    mrl_mem_category category;
} mrl_buffer;

typedef struct mrl_stream mrl_stream; /* opaque; NULL is the CPU / default stream */

mrl_status mrl_buffer_alloc(mrl_device device, size_t bytes, mrl_mem_category category, mrl_buffer *out);
void mrl_buffer_free(mrl_buffer *buffer);
/* Copy between any two buffers (host<->device, device<->device) on a stream. */
mrl_status mrl_buffer_copy(mrl_buffer *dst, size_t dst_offset, const mrl_buffer *src, size_t src_offset,
                           size_t bytes, mrl_stream *stream);
mrl_status mrl_buffer_fill_zero(mrl_buffer *buffer, mrl_stream *stream);
/* A region (core/base/mem.h: address space with memory only where pinned) on a device: the
 * host's pages, or a GPU's through CUDA's virtual memory (pages of its allocation granularity,
 * 2 MiB on current GPUs; device memory, mrl_device_of tells it). */
struct mrl_mem_region;
mrl_status mrl_device_region_create(mrl_device device, int64_t bytes, mrl_mem_category category,
                                    struct mrl_mem_region **out);
/* bytes between host memory and a GPU's (or within a GPU) on a stream, not
 * waited for: mrl_stream_sync says when they are done. The host side runs
 * asynchronously only when pinned (mrl_host_pin); both host: a memmove now. */
mrl_status mrl_stream_copy(void *dst, const void *src, size_t bytes, mrl_stream *stream);
/* Page-lock host memory for asynchronous copies (mrl_host_unpin before it
 * is freed); MRL_ERR_UNSUPPORTED where there is no GPU (nothing to do). */
mrl_status mrl_host_pin(void *ptr, size_t bytes);
void mrl_host_unpin(void *ptr);

mrl_status mrl_stream_create(mrl_device device, mrl_stream **out);
mrl_status mrl_stream_sync(mrl_stream *stream);
void mrl_stream_destroy(mrl_stream *stream);
/* The stream the device's kernels launch on from now on (NULL: its default
 * stream); nothing on the CPU. Process-wide on a GPU (its op table serves
 * one stream at a time): set it, run, set it back. */
void mrl_stream_set_current(mrl_device device, mrl_stream *stream);
/* Changes whenever the device's kernels allocate or free memory of their
 * own (scratch, library workspaces): a graph captured before holds
 * addresses that are gone. 0 on the CPU. */
uint64_t mrl_device_kernels_epoch(mrl_device device);

/* Graphs (CUDA graphs): the kernels launched on a GPU's stream between
 * begin and end are captured instead of run, into a graph that launch runs
 * again, with the same pointers and shapes (what is read through those
 * pointers may change). An operation that cannot be captured (an
 * allocation, a wait, a copy from the host) makes end fail, with nothing
 * run. MRL_ERR_UNSUPPORTED on the CPU. */
typedef struct mrl_graph mrl_graph;
mrl_status mrl_graph_capture_begin(mrl_stream *stream);
mrl_status mrl_graph_capture_end(mrl_stream *stream, mrl_graph **out);
mrl_status mrl_graph_launch(mrl_graph *graph, mrl_stream *stream);
void mrl_graph_free(mrl_graph *graph);

/* The table of a device: the CPU's fast table, or the CUDA table for a GPU
 * (NULL when moonrl was built without CUDA). With mrl_device_of, the table
 * that can work on a given array. */
const mrl_kernels *mrl_kernels_for(mrl_device device);

#ifdef __cplusplus
}
#endif
