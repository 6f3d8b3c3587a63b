/* AdamW over one contiguous fp32 parameter buffer (torch.optim.AdamW
 * semantics), with a no-decay mask made of element ranges. The step's
 * arithmetic is the op table's adamw (kernels.h; the fast table's for
 * mrl_adamw_step, the reference's for mrl_adamw_step_reference: the same
 * bits). The state lives where the parameters do (mrl_device_of): on a
 * GPU, the step is the CUDA table's. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "moonrl/optim.h"
#include "runtime/device_internal.h"
#include "moonrl/mem.h"
#include "base/error.h"

struct mrl_adamw {
    float *params;
    const float *grads;
    int64_t n;
    mrl_adamw_config config;
    float *state; /* m: state[0..n), v: state[n..2n); state_buf's data */
    mrl_buffer state_buf;
    mrl_device device; /* of params, grads and state */
    int64_t step;
    int64_t *no_decay; /* merged sorted ranges: begin0, end0, begin1, end1, ... */
    int64_t no_decay_count;
};

static int bad_double(double x) { return !isfinite(x); }

mrl_status mrl_adamw_create(float *params, const float *grads, int64_t n, const mrl_adamw_config *config,
                            mrl_adamw **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "adamw: out is NULL");
    *out = NULL;
    if (!params || !grads || !config || n <= 0)
        return mrl_set_error(MRL_ERR_INVALID, "adamw: need params, grads, a config and n > 0 (n=%lld)", (long long)n);
    const mrl_adamw_config *c = config;
    if (bad_double(c->lr) || c->lr < 0) return mrl_set_error(MRL_ERR_INVALID, "adamw: lr must be >= 0 (got %g)", c->lr);
    if (bad_double(c->beta1) || c->beta1 < 0 || c->beta1 >= 1)
        return mrl_set_error(MRL_ERR_INVALID, "adamw: beta1 must be in [0, 1) (got %g)", c->beta1);
    if (bad_double(c->beta2) || c->beta2 < 0 || c->beta2 >= 1)
        return mrl_set_error(MRL_ERR_INVALID, "adamw: beta2 must be in [0, 1) (got %g)", c->beta2);
    if (bad_double(c->eps) || c->eps < 0) return mrl_set_error(MRL_ERR_INVALID, "adamw: eps must be >= 0 (got %g)", c->eps);
    if (bad_double(c->weight_decay) || c->weight_decay < 0)
        return mrl_set_error(MRL_ERR_INVALID, "adamw: weight_decay must be >= 0 (got %g)", c->weight_decay);
    if ((uint64_t)n > SIZE_MAX / (2 * sizeof(float)))
        return mrl_set_error(MRL_ERR_INVALID, "adamw: n=%lld is too large", (long long)n);
    mrl_device device = mrl_device_of(params);
    if (mrl_device_of(grads).kind != device.kind || mrl_device_of(grads).index != device.index)
        return mrl_set_error(MRL_ERR_INVALID, "adamw: the parameters and the gradients are on different devices");
    if (!mrl_kernels_for(device)) return mrl_set_error(MRL_ERR_UNSUPPORTED, "adamw: no kernels for this device");
    mrl_adamw *opt = calloc(1, sizeof *opt);
    if (!opt) return mrl_set_error(MRL_ERR_NOMEM, "adamw: out of memory");
    if (mrl_buffer_alloc(device, (size_t)n * 2 * sizeof(float), MRL_MEM_OPTIM, &opt->state_buf)) { /* zeroed */
        free(opt);
        return mrl_wrap_error(MRL_ERR_NOMEM, "adamw: the optimizer state of %lld parameters", (long long)n);
    }
    opt->state = opt->state_buf.data;
    opt->device = device;
    opt->params = params;
    opt->grads = grads;
    opt->n = n;
    opt->config = *c;
    *out = opt;
    return MRL_OK;
}

void mrl_adamw_free(mrl_adamw *opt) {
    if (!opt) return;
    mrl_buffer_free(&opt->state_buf);
    free(opt->no_decay);
    free(opt);
}

static int cmp_range(const void *a, const void *b) {
    const int64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : (x[1] < y[1] ? -1 : x[1] > y[1]);
}

mrl_status mrl_adamw_set_no_decay(mrl_adamw *opt, const int64_t *ranges, int64_t count) {
    if (!opt || count < 0 || (count > 0 && !ranges))
        return mrl_set_error(MRL_ERR_INVALID, "adamw_set_no_decay: bad arguments (count=%lld)", (long long)count);
    int64_t *r = NULL;
    if (count > 0) {
        if ((uint64_t)count > SIZE_MAX / (2 * sizeof(int64_t)))
            return mrl_set_error(MRL_ERR_INVALID, "adamw_set_no_decay: count=%lld is too large", (long long)count);
        r = malloc((size_t)count * 2 * sizeof(int64_t));
        if (!r) return mrl_set_error(MRL_ERR_NOMEM, "adamw_set_no_decay: out of memory");
    }
    for (int64_t i = 0; i < count; i++) {
        int64_t off = ranges[2 * i], len = ranges[2 * i + 1];
        if (off < 0 || len < 0 || off > opt->n || len > opt->n - off) {
            free(r);
            return mrl_set_error(MRL_ERR_INVALID,
                                 "adamw_set_no_decay: range %lld (offset %lld, count %lld) is outside the %lld parameters",
                                 (long long)i, (long long)off, (long long)len, (long long)opt->n);
        }
        r[2 * i] = off;
        r[2 * i + 1] = off + len;
    }
    if (count > 1) qsort(r, (size_t)count, 2 * sizeof(int64_t), cmp_range);
    int64_t m = 0; /* merge overlapping or touching ranges, drop empty ones */
    for (int64_t i = 0; i < count; i++) {
        if (r[2 * i] == r[2 * i + 1]) continue;
        if (m > 0 && r[2 * i] <= r[2 * m - 1]) {
            if (r[2 * i + 1] > r[2 * m - 1]) r[2 * m - 1] = r[2 * i + 1];
        } else {
            r[2 * m] = r[2 * i];
            r[2 * m + 1] = r[2 * i + 1];
            m++;
        }
    }
    free(opt->no_decay);
    opt->no_decay = r;
    opt->no_decay_count = m;
    return MRL_OK;
}

/* fp32 coefficients of step `step`, rounded as PyTorch rounds its scalars. */
static void coeffs_init(mrl_adamw_coeffs *c, const mrl_adamw_config *cfg, double lr, int64_t step, int decay) {
    double t = (double)step;
    c->decay = decay ? (float)(1.0 - lr * cfg->weight_decay) : 1.0f;
    c->beta1 = (float)cfg->beta1;
    c->one_minus_beta1 = (float)(1.0 - cfg->beta1);
    c->beta2 = (float)cfg->beta2;
    c->one_minus_beta2 = (float)(1.0 - cfg->beta2);
    c->bc2_sqrt = (float)sqrt(1.0 - pow(cfg->beta2, t));
    c->eps = (float)cfg->eps;
    c->neg_step = (float)(-(lr / (1.0 - pow(cfg->beta1, t))));
}

/* A new step: lr checked (< 0: the config's), the count advanced, its coefficients into a. */
static mrl_status start_step(mrl_adamw *opt, double lr, mrl_adamw_args *a, const char *what) {
    if (lr < 0) lr = opt->config.lr;
    if (!isfinite(lr)) return mrl_set_error(MRL_ERR_INVALID, "%s: lr must be finite (got %g)", what, lr);
    opt->step++;
    coeffs_init(&a->decay, &opt->config, lr, opt->step, 1);
    coeffs_init(&a->no_decay, &opt->config, lr, opt->step, 0);
    return MRL_OK;
}

static mrl_status do_step(mrl_adamw *opt, double lr, const mrl_kernels *k, const char *what) {
    if (!opt) return mrl_set_error(MRL_ERR_INVALID, "%s: optimizer is NULL", what);
    mrl_adamw_args a = {.p = opt->params, .m = opt->state, .v = opt->state + opt->n, .g = opt->grads, .n = opt->n,
                        .ranges = opt->no_decay, .n_ranges = opt->no_decay_count};
    mrl_status st = start_step(opt, lr, &a, what);
    if (!st) k->adamw(&a);
    return st;
}

mrl_status mrl_adamw_step_chunked(mrl_adamw *opt, double lr, int64_t chunk, mrl_adamw_chunk_fn fn, void *ctx) {
    if (!opt || !fn || chunk <= 0) return mrl_set_error(MRL_ERR_INVALID, "adamw_step_chunked: bad arguments");
    /* the no-decay ranges of a chunk, clipped to it and relative to its start */
    int64_t *r = malloc(sizeof *r * (size_t)(2 * opt->no_decay_count + 2));
    if (!r) return mrl_set_error(MRL_ERR_NOMEM, "adamw_step_chunked: out of memory");
    const mrl_kernels *k = mrl_kernels_for(opt->device);
    mrl_adamw_args a = {0};
    mrl_status st = start_step(opt, lr, &a, "adamw_step_chunked");
    for (int64_t lo = 0; lo < opt->n && !st; lo += chunk) {
        int64_t hi = opt->n - lo < chunk ? opt->n : lo + chunk, nr = 0;
        for (int64_t i = 0; i < opt->no_decay_count; i++) {
            int64_t b = opt->no_decay[2 * i] > lo ? opt->no_decay[2 * i] : lo;
            int64_t e = opt->no_decay[2 * i + 1] < hi ? opt->no_decay[2 * i + 1] : hi;
            if (e > b) r[2 * nr] = b - lo, r[2 * nr + 1] = e - lo, nr++;
        }
        if ((st = fn(ctx, 0, lo, hi))) break;
        a.p = opt->params + lo, a.m = opt->state + lo, a.v = opt->state + opt->n + lo, a.g = opt->grads + lo;
        a.n = hi - lo, a.ranges = nr ? r : NULL, a.n_ranges = nr;
        k->adamw(&a);
        st = fn(ctx, 1, lo, hi);
    }
    free(r);
    return st;
}

mrl_status mrl_adamw_step(mrl_adamw *opt, double lr) {
    return do_step(opt, lr, opt ? mrl_kernels_for(opt->device) : NULL, "adamw_step");
}

mrl_status mrl_adamw_step_reference(mrl_adamw *opt, double lr) {
    if (opt && opt->device.kind != MRL_DEVICE_CPU)
        return mrl_set_error(MRL_ERR_INVALID, "adamw_step_reference: the parameters are on a GPU (the reference "
                             "kernels are the CPU's)");
    return do_step(opt, lr, mrl_kernels_cpu_reference(), "adamw_step_reference");
}

int64_t mrl_adamw_steps(const mrl_adamw *opt) { return opt ? opt->step : 0; }

mrl_status mrl_adamw_get_state(mrl_adamw *opt, mrl_adamw_state *out) {
    if (!opt || !out) return mrl_set_error(MRL_ERR_INVALID, "adamw_get_state: bad arguments");
    out->m = opt->state;
    out->v = opt->state + opt->n;
    out->n = opt->n;
    out->step = opt->step;
    out->bytes = opt->n * 2 * (int64_t)sizeof(float);
    return MRL_OK;
}

mrl_status mrl_adamw_load_state(mrl_adamw *opt, const float *m, const float *v, int64_t n, int64_t step) {
    if (!opt || !m || !v) return mrl_set_error(MRL_ERR_INVALID, "adamw_load_state: bad arguments");
    if (n != opt->n)
        return mrl_set_error(MRL_ERR_INVALID, "adamw_load_state: state holds %lld parameters, the optimizer %lld",
                             (long long)n, (long long)opt->n);
    if (step < 0) return mrl_set_error(MRL_ERR_INVALID, "adamw_load_state: step must be >= 0 (got %lld)", (long long)step);
    /* from the host or the optimizer's device */
    mrl_status st = mrl_device_memcpy(opt->state, m, (size_t)n * sizeof(float));
    if (!st) st = mrl_device_memcpy(opt->state + n, v, (size_t)n * sizeof(float));
    if (!st) opt->step = step;
    return st;
}
