/* Optimizer over one contiguous fp32 parameter buffer and one gradient
 * buffer of the same length (the model keeps all parameters in one
 * allocation and all gradients in another).
 *
 * AdamW follows torch.optim.AdamW exactly:
 *   t += 1
 *   p  = p * (1 - lr * wd)                      (not for no-decay ranges)
 *   m  = beta1 * m + (1 - beta1) * g
 *   v  = beta2 * v + (1 - beta2) * g * g
 *   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * The state m and v live in one MRL_MEM_OPTIM allocation of 2*n floats
 * (m first, then v). */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_adamw mrl_adamw;

typedef struct mrl_adamw_config {
    double lr;           /* default lr for mrl_adamw_step when lr < 0 is passed */
    double beta1;        /* 0.9 */
    double beta2;        /* 0.999 */
    double eps;          /* 1e-8 */
    double weight_decay; /* 0.01 */
} mrl_adamw_config;

/* params and grads hold n floats each and must outlive the optimizer;
 * both host memory, or both on one GPU (a model's on mrl_model_set_device):
 * the state is then made there and the steps run there. The state starts
 * at zero, step 0. */
mrl_status mrl_adamw_create(float *params, const float *grads, int64_t n, const mrl_adamw_config *config,
                            mrl_adamw **out);
void mrl_adamw_free(mrl_adamw *opt);
/* Exclude ranges from weight decay: ranges holds count pairs
 * (offset, length) of elements, each inside [0, n); they may touch or
 * overlap. Replaces any earlier mask. */
mrl_status mrl_adamw_set_no_decay(mrl_adamw *opt, const int64_t *ranges, int64_t count);
/* One update with learning rate lr (lr < 0: the config's lr). */
mrl_status mrl_adamw_step(mrl_adamw *opt, double lr);
/* The same update through the plain scalar loop (reference for tests). */
mrl_status mrl_adamw_step_reference(mrl_adamw *opt, double lr);
/* Steps taken so far. */
int64_t mrl_adamw_steps(const mrl_adamw *opt);
/* The same update chunk by chunk ([0, chunk), [chunk, 2 chunk), ...: the
 * same bits), fn(ctx, 0, lo, hi) called before chunk [lo, hi) is stepped and
 * fn(ctx, 1, lo, hi) after; a failing fn stops the update there (the step
 * is counted). Overlaps transfers with the update (mrl_offload_step). */
typedef mrl_status (*mrl_adamw_chunk_fn)(void *ctx, int after, int64_t lo, int64_t hi);
mrl_status mrl_adamw_step_chunked(mrl_adamw *opt, double lr, int64_t chunk, mrl_adamw_chunk_fn fn, void *ctx);

/* Optimizer offload (dist.offload=optimizer): a GPU model's n parameters
 * updated from its gradients by an AdamW in host memory. The offload holds
 * the fp32 master weights (a copy of dev_params made here), a host copy of
 * the gradients (both page-locked while it lives, MRL_MEM_PARAMS and
 * MRL_MEM_GRADS) and the AdamW over them (mrl_offload_adamw: its no-decay
 * ranges, state and steps; freed with the offload). mrl_offload_step waits
 * for the GPU's work, then pipelines in chunks of `chunk` floats: the next
 * chunk's gradients come over while the CPU steps this one, and each
 * stepped chunk's weights go back while the CPU steps the next; it returns
 * once the weights are on the GPU. The same bits as copying everything,
 * stepping, and copying back. mrl_offload_pull copies dev_params into the
 * master weights again (a restore). On host buffers (no GPU) the copies are
 * memmoves. */
typedef struct mrl_offload mrl_offload;
mrl_status mrl_offload_create(float *dev_params, const float *dev_grads, int64_t n, const mrl_adamw_config *config,
                              int64_t chunk, mrl_offload **out);
mrl_adamw *mrl_offload_adamw(mrl_offload *o);
mrl_status mrl_offload_step(mrl_offload *o, double lr);
mrl_status mrl_offload_pull(mrl_offload *o);
void mrl_offload_free(mrl_offload *o);

/* Checkpoint state: the optimizer's m and v (n floats each, owned by the
 * optimizer, where the parameters are: read a GPU's with mrl_device_memcpy;
 * write to them to restore, or use mrl_adamw_load_state) and the step count. */
typedef struct mrl_adamw_state {
    float *m;
    float *v;
    int64_t n;
    int64_t step;
    int64_t bytes; /* bytes of m and v together: 2 * n * 4 */
} mrl_adamw_state;

mrl_status mrl_adamw_get_state(mrl_adamw *opt, mrl_adamw_state *out);
/* Copy m and v (n floats each, host or device memory; n must match) in and
 * set the step count. */
mrl_status mrl_adamw_load_state(mrl_adamw *opt, const float *m, const float *v, int64_t n, int64_t step);

/* --- Gradient helpers over a raw buffer (host, or one GPU's) ----------- */
/* *out = sqrt(sum g^2) accumulated in double; identical for any thread count. */
mrl_status mrl_grad_norm(const float *grads, int64_t n, double *out);
/* torch.nn.utils.clip_grad_norm_: norm as above, coef = max_norm /
 * (norm + 1e-6) clamped to at most 1, grads *= coef (as fp32). *norm_out
 * gets the norm before clipping (may be NULL). max_norm must be > 0. */
mrl_status mrl_grad_clip_norm(float *grads, int64_t n, double max_norm, double *norm_out);
/* grads *= scale (e.g. 1 / accumulation steps). */
mrl_status mrl_grad_scale(float *grads, int64_t n, float scale);
/* grads = 0. */
mrl_status mrl_grad_zero(float *grads, int64_t n);

#ifdef __cplusplus
}
#endif
