/* The device abstraction: where a buffer lives and which stream runs work on
 * it. The CPU device always exists; CUDA devices exist when moonrl was built
 * with CUDA and a GPU is present at run time. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "status.h"
#include "mem.h"

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

typedef struct mrl_buffer {
    void *data;
    size_t bytes;
    mrl_device device;
    mrl_mem_category category;
} mrl_buffer;

typedef struct mrl_stream mrl_stream; /* opaque; NULL is the CPU / default stream */

/* 1 when the CUDA backend was compiled in. */
int mrl_device_cuda_built(void);
/* Number of usable CUDA devices now (0 when not built or no GPU). */
int mrl_device_cuda_count(void);
/* Parse "cpu", "cuda", "cuda:1". */
mrl_status mrl_device_parse(const char *text, mrl_device *out);
/* Describe a device into buf ("cpu", "cuda:0 (NVIDIA H200, 139 GiB)"). */
mrl_status mrl_device_describe(mrl_device device, char *buf, size_t buf_size);

mrl_status mrl_buffer_alloc(mrl_device device, size_t bytes, mrl_mem_category category, mrl_buffer *out);
void mrl_buffer_free(mrl_buffer *buffer);
/* Copy between any two buffers (host<->device, device<->device) on a stream. */
mrl_status mrl_buffer_copy(mrl_buffer *dst, size_t dst_offset, const mrl_buffer *src, size_t src_offset,
                           size_t bytes, mrl_stream *stream);
mrl_status mrl_buffer_fill_zero(mrl_buffer *buffer, mrl_stream *stream);

/* Where the memory at ptr lives: a CUDA device's (allocated by
 * mrl_buffer_alloc there) or the host's (anything else, NULL included). */
mrl_device mrl_device_of(const void *ptr);
/* bytes from src to dst wherever each lives (host, a GPU: told apart by
 * their addresses, which CUDA keeps unique across the process); complete
 * when it returns. */
mrl_status mrl_device_memcpy(void *dst, const void *src, size_t bytes);

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

#ifdef __cplusplus
}
#endif
