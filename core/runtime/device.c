/* The device abstraction: CPU buffers through the memory layer, CUDA
 * buffers through kernels/cuda when it is built in. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "runtime/device_internal.h"
#include "base/error.h"
#include "base/mem.h"
#ifdef MRL_HAVE_CUDA
#include "cuda_backend.h"
#endif

/* Set once this process has allocated GPU memory: before that every pointer is the host's, and
 * asking CUDA would start its runtime (a context on the GPU) in a process that never uses one. */
static _Atomic int gpu_memory_used;

/* A stream handle: NULL-equivalent on the CPU; a cudaStream_t on a GPU. */
struct mrl_stream {
    mrl_device device;
    void *native;
};

int mrl_device_cuda_built(void) {
#ifdef MRL_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

int mrl_device_cuda_count(void) {
#ifdef MRL_HAVE_CUDA
    return mrl_cuda_device_count();
#else
    return 0;
#endif
}

static mrl_status need_cuda(mrl_device device) {
    if (!mrl_device_cuda_built())
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "device cuda:%d: moonrl was built without CUDA", device.index);
    int count = mrl_device_cuda_count();
    if (device.index < 0 || device.index >= count)
        return mrl_set_error(MRL_ERR_INVALID, "device cuda:%d: %d CUDA device(s) present", device.index, count);
    return MRL_OK;
}

mrl_status mrl_device_parse(const char *text, mrl_device *out) {
    if (!text) return mrl_set_error(MRL_ERR_INVALID, "device: no name given");
    if (!strcmp(text, "cpu")) {
        *out = (mrl_device){MRL_DEVICE_CPU, 0};
        return MRL_OK;
    }
    if (!strncmp(text, "cuda", 4)) {
        int index = 0;
        if (text[4] == ':') {
            char *end;
            long v = strtol(text + 5, &end, 10);
            if (end == text + 5 || *end || v < 0 || v > 1024)
                return mrl_set_error(MRL_ERR_INVALID, "device '%s': expected cuda:N", text);
            index = (int)v;
        } else if (text[4]) {
            return mrl_set_error(MRL_ERR_INVALID, "device '%s': expected cpu, cuda or cuda:N", text);
        }
        *out = (mrl_device){MRL_DEVICE_CUDA, index};
        return MRL_OK;
    }
    return mrl_set_error(MRL_ERR_INVALID, "device '%s': expected cpu, cuda or cuda:N", text);
}

mrl_status mrl_device_describe(mrl_device device, char *buf, size_t buf_size) {
    if (device.kind == MRL_DEVICE_CPU) {
        snprintf(buf, buf_size, "cpu");
        return MRL_OK;
    }
    mrl_status st = need_cuda(device);
    if (st != MRL_OK) return st;
#ifdef MRL_HAVE_CUDA
    return mrl_cuda_describe(device.index, buf, buf_size);
#else
    return MRL_ERR_UNSUPPORTED;
#endif
}

mrl_status mrl_buffer_alloc(mrl_device device, size_t bytes, mrl_mem_category category, mrl_buffer *out) {
    memset(out, 0, sizeof *out);
    if (device.kind == MRL_DEVICE_CPU) {
        out->data = mrl_mem_alloc(bytes, category);
        if (!out->data) return MRL_ERR_NOMEM;
    } else {
        mrl_status st = need_cuda(device);
        if (st != MRL_OK) return st;
#ifdef MRL_HAVE_CUDA
        st = mrl_cuda_malloc(device.index, bytes, &out->data);
        if (st != MRL_OK) return st;
        atomic_store(&gpu_memory_used, 1);
        st = mrl_cuda_memset_zero(out->data, bytes, NULL);
        if (st != MRL_OK) return st;
        mrl_mem_account_device(category, (int64_t)bytes);
#endif
    }
    out->bytes = bytes;
    out->device = device;
    out->category = category;
    return MRL_OK;
}

void mrl_buffer_free(mrl_buffer *buffer) {
    if (!buffer || !buffer->data) return;
    if (buffer->device.kind == MRL_DEVICE_CPU) {
        mrl_mem_free(buffer->data);
    } else {
#ifdef MRL_HAVE_CUDA
        mrl_cuda_free(buffer->data);
        mrl_mem_account_device(buffer->category, -(int64_t)buffer->bytes);
#endif
    }
    buffer->data = NULL;
    buffer->bytes = 0;
}

mrl_status mrl_buffer_copy(mrl_buffer *dst, size_t dst_offset, const mrl_buffer *src, size_t src_offset,
                           size_t bytes, mrl_stream *stream) {
    if (dst_offset > dst->bytes || bytes > dst->bytes - dst_offset || src_offset > src->bytes ||
        bytes > src->bytes - src_offset)
        return mrl_set_error(MRL_ERR_INVALID, "buffer copy of %zu bytes out of bounds (dst %zu+%zu, src %zu+%zu)",
                             bytes, dst->bytes, dst_offset, src->bytes, src_offset);
    char *d = (char *)dst->data + dst_offset;
    const char *s = (const char *)src->data + src_offset;
    if (dst->device.kind == MRL_DEVICE_CPU && src->device.kind == MRL_DEVICE_CPU) {
        memmove(d, s, bytes);
        return MRL_OK;
    }
#ifdef MRL_HAVE_CUDA
    int kind = src->device.kind == MRL_DEVICE_CPU ? 0 : dst->device.kind == MRL_DEVICE_CPU ? 1 : 2;
    return mrl_cuda_memcpy(d, s, bytes, kind, stream ? stream->native : NULL);
#else
    (void)stream;
    return mrl_set_error(MRL_ERR_UNSUPPORTED, "buffer copy to or from a CUDA device: built without CUDA");
#endif
}

mrl_status mrl_buffer_fill_zero(mrl_buffer *buffer, mrl_stream *stream) {
    if (buffer->device.kind == MRL_DEVICE_CPU) {
        memset(buffer->data, 0, buffer->bytes);
        return MRL_OK;
    }
#ifdef MRL_HAVE_CUDA
    return mrl_cuda_memset_zero(buffer->data, buffer->bytes, stream ? stream->native : NULL);
#else
    (void)stream;
    return mrl_set_error(MRL_ERR_UNSUPPORTED, "built without CUDA");
#endif
}

#ifdef MRL_HAVE_CUDA
static mrl_status gpu_reserve(const mrl_mem_backing *b, int64_t bytes, char **base, void **state) {
    return mrl_cuda_vmm_reserve(b->index, bytes, b->page, (void **)base, state);
}
static void gpu_release(void *state, char *base, int64_t bytes) { mrl_cuda_vmm_release(state, base, bytes); }
static mrl_status gpu_map(void *state, char *base, int64_t lo, int64_t hi) {
    return mrl_cuda_vmm_map(state, base, lo, hi);
}
static void gpu_unmap(void *state, char *base, int64_t lo, int64_t hi) { mrl_cuda_vmm_unmap(state, base, lo, hi); }
#endif

mrl_status mrl_device_region_create(mrl_device device, int64_t bytes, mrl_mem_category category,
                                    struct mrl_mem_region **out) {
    if (device.kind == MRL_DEVICE_CPU) return mrl_mem_region_create(bytes, category, out);
    *out = NULL;
    mrl_status st = need_cuda(device);
    if (st) return st;
#ifdef MRL_HAVE_CUDA
    enum { GPUS = 64 };
    static mrl_mem_backing backings[GPUS]; /* one a GPU, made on first use (its page size asked once) */
    if (device.index >= GPUS) return mrl_set_error(MRL_ERR_INVALID, "cuda:%d: past %d GPUs", device.index, GPUS);
    mrl_mem_backing *b = &backings[device.index];
    if (!b->page) {
        int64_t page = 0;
        if ((st = mrl_cuda_vmm_page(device.index, &page))) return st;
        *b = (mrl_mem_backing){page, 1, gpu_reserve, gpu_release, gpu_map, gpu_unmap, device.index};
    }
    atomic_store(&gpu_memory_used, 1);
    return mrl_mem_region_create_backed(bytes, category, b, out);
#else
    (void)bytes, (void)category;
    return st;
#endif
}

const mrl_kernels *mrl_kernels_for(mrl_device device) {
    if (device.kind == MRL_DEVICE_CPU) return mrl_kernels_cpu_fast();
#ifdef MRL_HAVE_CUDA
    return mrl_kernels_cuda();
#else
    return NULL;
#endif
}

mrl_device mrl_device_of(const void *ptr) {
#ifdef MRL_HAVE_CUDA
    int index = -1;
    if (ptr && atomic_load(&gpu_memory_used) && mrl_cuda_pointer_device(ptr, &index))
        return (mrl_device){MRL_DEVICE_CUDA, index};
#else
    (void)ptr;
#endif
    return (mrl_device){MRL_DEVICE_CPU, 0};
}

mrl_status mrl_device_memcpy(void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return MRL_OK;
    if (!dst || !src) return mrl_set_error(MRL_ERR_INVALID, "device memcpy of %zu bytes: NULL pointer", bytes);
#ifdef MRL_HAVE_CUDA
    if (mrl_device_of(dst).kind != MRL_DEVICE_CPU || mrl_device_of(src).kind != MRL_DEVICE_CPU)
        return mrl_cuda_memcpy(dst, src, bytes, 3, NULL);
#endif
    memmove(dst, src, bytes);
    return MRL_OK;
}

mrl_status mrl_stream_copy(void *dst, const void *src, size_t bytes, mrl_stream *stream) {
    if (!bytes || dst == src) return MRL_OK;
    if (!dst || !src) return mrl_set_error(MRL_ERR_INVALID, "stream copy of %zu bytes: NULL pointer", bytes);
#ifdef MRL_HAVE_CUDA
    int to_dev = mrl_device_of(dst).kind != MRL_DEVICE_CPU, from_dev = mrl_device_of(src).kind != MRL_DEVICE_CPU;
    if (to_dev || from_dev)
        return mrl_cuda_memcpy(dst, src, bytes, to_dev && from_dev ? 2 : to_dev ? 0 : 4, stream ? stream->native : NULL);
#else
    (void)stream;
#endif
    memmove(dst, src, bytes);
    return MRL_OK;
}

mrl_status mrl_host_pin(void *ptr, size_t bytes) {
#ifdef MRL_HAVE_CUDA
    if (ptr && bytes && mrl_cuda_device_count() > 0) return mrl_cuda_host_register(ptr, bytes);
#else
    (void)ptr, (void)bytes;
#endif
    return mrl_set_error(MRL_ERR_UNSUPPORTED, "pinning host memory: no GPU");
}

void mrl_host_unpin(void *ptr) {
#ifdef MRL_HAVE_CUDA
    if (ptr && mrl_cuda_device_count() > 0) mrl_cuda_host_unregister(ptr);
#else
    (void)ptr;
#endif
}

mrl_status mrl_stream_create(mrl_device device, mrl_stream **out) {
    *out = NULL;
    mrl_stream *s = calloc(1, sizeof *s);
    if (!s) return mrl_set_error(MRL_ERR_NOMEM, "out of memory creating a stream");
    s->device = device;
    if (device.kind == MRL_DEVICE_CUDA) {
        mrl_status st = need_cuda(device);
#ifdef MRL_HAVE_CUDA
        if (st == MRL_OK) st = mrl_cuda_stream_create(device.index, &s->native);
#endif
        if (st != MRL_OK) {
            free(s);
            return st;
        }
    }
    *out = s;
    return MRL_OK;
}

mrl_status mrl_stream_sync(mrl_stream *stream) {
    if (!stream || stream->device.kind == MRL_DEVICE_CPU) return MRL_OK;
#ifdef MRL_HAVE_CUDA
    return mrl_cuda_stream_sync(stream->native);
#else
    return MRL_OK;
#endif
}

void mrl_stream_destroy(mrl_stream *stream) {
    if (!stream) return;
#ifdef MRL_HAVE_CUDA
    if (stream->device.kind == MRL_DEVICE_CUDA) mrl_cuda_stream_destroy(stream->native);
#endif
    free(stream);
}

void mrl_stream_set_current(mrl_device device, mrl_stream *stream) {
#ifdef MRL_HAVE_CUDA
    if (device.kind == MRL_DEVICE_CUDA) mrl_cuda_ops_set_stream(stream ? stream->native : NULL);
#else
    (void)device, (void)stream;
#endif
}

uint64_t mrl_device_kernels_epoch(mrl_device device) {
#ifdef MRL_HAVE_CUDA
    if (device.kind == MRL_DEVICE_CUDA) return mrl_cuda_ops_epoch();
#else
    (void)device;
#endif
    return 0;
}

/* ---- graphs ---- */

struct mrl_graph {
    void *exec;
};

mrl_status mrl_graph_capture_begin(mrl_stream *stream) {
    if (!stream || stream->device.kind != MRL_DEVICE_CUDA)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "graph capture: a GPU's stream only");
#ifdef MRL_HAVE_CUDA
    return mrl_cuda_graph_begin(stream->native);
#else
    return MRL_ERR_UNSUPPORTED;
#endif
}

mrl_status mrl_graph_capture_end(mrl_stream *stream, mrl_graph **out) {
    *out = NULL;
    if (!stream || stream->device.kind != MRL_DEVICE_CUDA)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "graph capture: a GPU's stream only");
#ifdef MRL_HAVE_CUDA
    void *exec = NULL;
    mrl_status st = mrl_cuda_graph_end(stream->native, &exec);
    if (st) return st;
    mrl_graph *g = calloc(1, sizeof *g);
    if (!g) {
        mrl_cuda_graph_free(exec);
        return mrl_set_error(MRL_ERR_NOMEM, "graph capture: out of memory");
    }
    g->exec = exec;
    *out = g;
    return MRL_OK;
#else
    return MRL_ERR_UNSUPPORTED;
#endif
}

mrl_status mrl_graph_launch(mrl_graph *graph, mrl_stream *stream) {
    if (!graph || !stream) return mrl_set_error(MRL_ERR_INVALID, "graph launch: NULL argument");
#ifdef MRL_HAVE_CUDA
    return mrl_cuda_graph_launch(graph->exec, stream->native);
#else
    return MRL_ERR_UNSUPPORTED;
#endif
}

void mrl_graph_free(mrl_graph *graph) {
    if (!graph) return;
#ifdef MRL_HAVE_CUDA
    mrl_cuda_graph_free(graph->exec);
#endif
    free(graph);
}
