/* Optimizer offload (moonrl/optim.h, dist.offload=optimizer): a GPU model's
 * update on the host, pipelined in chunks so that the PCIe copies run while
 * the CPU computes (ZeRO-Offload's overlap): one stream brings the
 * gradients of the chunk after the one being stepped, another takes each
 * stepped chunk's weights back. The copies run asynchronously because the
 * host buffers are page-locked for the offload's life. */
#include <stdlib.h>
#include "base/error.h"
#include "kernels.h"
#include "moonrl/mem.h"
#include "moonrl/optim.h"
#include "runtime/device_internal.h"

struct mrl_offload {
    mrl_adamw *opt;          /* over host_p, host_g */
    float *host_p, *host_g;  /* pinned when `pinned` */
    float *dev_p;
    const float *dev_g;
    int64_t n, chunk;
    mrl_device device;       /* the GPU's */
    mrl_stream *in, *out;    /* gradients to the host; weights to the GPU */
    int pinned;
};

void mrl_offload_free(mrl_offload *o) {
    if (!o) return;
    mrl_stream_sync(o->in);
    mrl_stream_sync(o->out);
    mrl_stream_destroy(o->in);
    mrl_stream_destroy(o->out);
    mrl_adamw_free(o->opt);
    if (o->pinned) {
        mrl_host_unpin(o->host_p);
        mrl_host_unpin(o->host_g);
    }
    mrl_mem_free(o->host_p);
    mrl_mem_free(o->host_g);
    free(o);
}

mrl_status mrl_offload_create(float *dev_params, const float *dev_grads, int64_t n, const mrl_adamw_config *config,
                              int64_t chunk, mrl_offload **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "offload: out is NULL");
    *out = NULL;
    if (!dev_params || !dev_grads || !config || n <= 0 || chunk <= 0)
        return mrl_set_error(MRL_ERR_INVALID, "offload: bad arguments (n=%lld, chunk=%lld)", (long long)n,
                             (long long)chunk);
    mrl_offload *o = calloc(1, sizeof *o);
    if (!o) return mrl_set_error(MRL_ERR_NOMEM, "offload: out of memory");
    size_t bytes = sizeof(float) * (size_t)n;
    *o = (mrl_offload){.dev_p = dev_params, .dev_g = dev_grads, .n = n, .chunk = chunk,
                       .device = mrl_device_of(dev_params), .host_p = mrl_mem_alloc(bytes, MRL_MEM_PARAMS),
                       .host_g = mrl_mem_alloc(bytes, MRL_MEM_GRADS)};
    mrl_status st = o->host_p && o->host_g ? MRL_OK
                                           : mrl_set_error(MRL_ERR_NOMEM, "offload: no host memory for the master weights "
                                                           "and gradients of %lld parameters", (long long)n);
    if (!st) st = mrl_device_memcpy(o->host_p, dev_params, bytes);
    if (!st) st = mrl_adamw_create(o->host_p, o->host_g, n, config, &o->opt);
    if (!st) st = mrl_stream_create(o->device, &o->in);
    if (!st) st = mrl_stream_create(o->device, &o->out);
    if (st) {
        mrl_offload_free(o);
        return st;
    }
    /* without page-locked memory the copies still work, synchronously (the CPU's case) */
    if (o->device.kind != MRL_DEVICE_CPU && !mrl_host_pin(o->host_p, bytes)) {
        if (!mrl_host_pin(o->host_g, bytes))
            o->pinned = 1;
        else
            mrl_host_unpin(o->host_p);
    }
    *out = o;
    return MRL_OK;
}

mrl_adamw *mrl_offload_adamw(mrl_offload *o) { return o ? o->opt : NULL; }

mrl_status mrl_offload_pull(mrl_offload *o) {
    if (!o) return mrl_set_error(MRL_ERR_INVALID, "offload_pull: NULL offload");
    return mrl_device_memcpy(o->host_p, o->dev_p, sizeof(float) * (size_t)o->n);
}

/* before chunk [lo, hi): its gradients are here; the next chunk's start over. After: its
 * weights go back. */
static mrl_status pipeline(void *ctx, int after, int64_t lo, int64_t hi) {
    mrl_offload *o = ctx;
    if (after) return mrl_stream_copy(o->dev_p + lo, o->host_p + lo, sizeof(float) * (size_t)(hi - lo), o->out);
    mrl_status st = mrl_stream_sync(o->in);
    int64_t next_hi = o->n - hi < o->chunk ? o->n : hi + o->chunk;
    if (!st && next_hi > hi)
        st = mrl_stream_copy(o->host_g + hi, o->dev_g + hi, sizeof(float) * (size_t)(next_hi - hi), o->in);
    return st;
}

mrl_status mrl_offload_step(mrl_offload *o, double lr) {
    if (!o) return mrl_set_error(MRL_ERR_INVALID, "offload_step: NULL offload");
    /* the gradients are final once the GPU's work so far is done (the streams here do not wait
     * for the ops' stream by themselves) */
    const mrl_kernels *k = mrl_kernels_for(o->device);
    mrl_status st = k ? k->sync() : MRL_OK;
    int64_t first = o->n < o->chunk ? o->n : o->chunk;
    if (!st) st = mrl_stream_copy(o->host_g, o->dev_g, sizeof(float) * (size_t)first, o->in);
    if (!st) st = mrl_adamw_step_chunked(o->opt, lr, o->chunk, pipeline, o);
    mrl_status in = mrl_stream_sync(o->in), out = mrl_stream_sync(o->out); /* (also after a failure) */
    return st ? st : in ? in : out;
}
