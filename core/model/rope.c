/* RoPE tables. inv_freq[i] = theta^(-2i/hd) (float32, as Transformers
 * computes it), rescaled for rope_scaling 'llama3'; cos/sin of
 * pos * inv_freq[i] for pos < rope_len, grown when a longer sequence comes. */
#include <math.h>
#include "moonrl/mem.h"
#include "model_internal.h"
#include "runtime/device_internal.h"

static void compute_inv_freq(const mrl_model_config *c, float *inv_freq) {
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        float f = (float)(1.0 / (double)powf((float)c->rope_theta, (float)(2 * i) / (float)c->head_dim));
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
    int half = m->cfg.head_dim / 2;
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
    for (int64_t p = 0; p < len; p++)
        for (int i = 0; i < half; i++) {
            float angle = (float)p * m->inv_freq[i]; /* float32 product, as Transformers */
            cs[p * half + i] = (float)cos((double)angle);
            sn[p * half + i] = (float)sin((double)angle);
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
