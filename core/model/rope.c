/* RoPE tables. inv_freq[i] = theta^(-2i/hd) (hd: mrl_model_rope_dim, MLA's rope part) (float32, as Transformers
 * computes it), rescaled for rope_scaling 'llama3' or 'yarn'; cos/sin of
 * pos * inv_freq[i] for pos < rope_len (yarn: times its attention factor),
 * grown when a longer sequence comes. */
#include <math.h>
#include "moonrl/mem.h"
#include "model_internal.h"
#include "runtime/device_internal.h"

/* yarn (Transformers' _compute_yarn_parameters, its float32 steps): each frequency blends its
 * interpolation (theta^(2i/hd) * factor) and extrapolation by a linear ramp over the dimensions
 * between the correction range's bounds, the dimensions where beta_fast and beta_slow rotations
 * fit in the original context. */
#define NO_FMA __attribute__((optimize("fp-contract=off")))
static double yarn_dim(double rotations, int dim, double base, double len) {
    return (dim * log(len / (rotations * 2 * M_PI))) / (2 * log(base));
}
NO_FMA static void yarn_inv_freq(const mrl_model_config *c, float *inv_freq) {
    int dim = mrl_model_rope_dim(c), half = dim / 2;
    double base = c->rope_theta, len = c->rope_original_max_position_embeddings;
    double low = yarn_dim(c->rope_beta_fast, dim, base, len), high = yarn_dim(c->rope_beta_slow, dim, base, len);
    if (c->rope_truncate) low = floor(low), high = ceil(high);
    if (low < 0) low = 0;
    if (high > dim - 1) high = dim - 1;
    if (low == high) high += 0.001; /* (Transformers': no singularity) */
    float factor = (float)c->rope_factor, lo = (float)low, span = (float)(high - low);
    for (int i = 0; i < half; i++) {
        float pos = powf((float)base, (float)(2 * i) / (float)dim);
        float extra = 1.0f / pos, inter = 1.0f / (factor * pos);
        float ramp = ((float)i - lo) / span;
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        float ef = 1.0f - ramp;
        inv_freq[i] = inter * (1.0f - ef) + extra * ef;
    }
}

static void compute_inv_freq(const mrl_model_config *c, float *inv_freq) {
    int dim = mrl_model_rope_dim(c), half = dim / 2;
    if (c->rope_scaling == MRL_ROPE_YARN) {
        yarn_inv_freq(c, inv_freq);
        return;
    }
    for (int i = 0; i < half; i++) {
        float f = (float)(1.0 / (double)powf((float)c->rope_theta, (float)(2 * i) / (float)dim));
        if (c->rope_scaling == MRL_ROPE_LLAMA3) {
            double old_len = c->rope_original_max_position_embeddings;
            double low_wl = old_len / c->rope_low_freq_factor, high_wl = old_len / c->rope_high_freq_factor;
            double wl = 2 * M_PI / f, nf = f;
            if (wl > low_wl)
                nf = f / c->rope_factor;
            else if (wl >= high_wl) {
                double smooth = (old_len / wl - c->rope_low_freq_factor) /
                                (c->rope_high_freq_factor - c->rope_low_freq_factor);
                nf = (1 - smooth) * f / c->rope_factor + smooth * f;
            }
            f = (float)nf;
        }
        inv_freq[i] = f;
    }
}

mrl_status mrl_model_rope_prepare(mrl_model *m, int64_t max_len) {
    int half = mrl_model_rope_dim(&m->cfg) / 2;
    if (!m->inv_freq) {
        m->inv_freq = mrl_mem_alloc(sizeof(float) * half, MRL_MEM_OTHER);
        if (!m->inv_freq) return MRL_ERR_NOMEM;
        compute_inv_freq(&m->cfg, m->inv_freq);
    }
    if (max_len <= m->rope_len) return MRL_OK;
    int64_t len = m->rope_len ? m->rope_len : 256;
    while (len < max_len) len *= 2;
    /* computed on the host, then (a GPU model) copied to the device */
    size_t bytes = sizeof(float) * 2 * len * half;
    mrl_buffer buf;
    mrl_status st = mrl_buffer_alloc(m->device, bytes, MRL_MEM_OTHER, &buf);
    if (st) return st;
    float *cs = m->k->on_device ? mrl_mem_alloc(bytes, MRL_MEM_OTHER) : buf.data, *sn = cs ? cs + len * half : NULL;
    if (!cs) {
        mrl_buffer_free(&buf);
        return MRL_ERR_NOMEM;
    }
    /* yarn: cos and sin times its attention factor, in float32 as Transformers multiplies them */
    float af = m->cfg.rope_scaling == MRL_ROPE_YARN ? (float)m->cfg.rope_attention_factor : 1.0f;
    for (int64_t p = 0; p < len; p++)
        for (int i = 0; i < half; i++) {
            float angle = (float)p * m->inv_freq[i]; /* float32 product, as Transformers */
            cs[p * half + i] = (float)cos((double)angle) * af;
            sn[p * half + i] = (float)sin((double)angle) * af;
        }
    if (m->k->on_device) {
        st = m->k->to_device(buf.data, cs, (int64_t)bytes);
        mrl_mem_free(cs);
        if (st) {
            mrl_buffer_free(&buf);
            return st;
        }
    }
    mrl_buffer_free(&m->rope_mem);
    m->rope_mem = buf;
    m->rope_cos = buf.data;
    m->rope_sin = m->rope_cos + len * half;
    m->rope_len = len;
    return MRL_OK;
}

const float *mrl_model_rope_cos(const mrl_model *m) { return m->rope_cos; }
