/* The model object: the parameter and gradient buffers with their named
 * views (Hugging Face names, view order = buffer order), random init, raw
 * f32 load/save, getters. The gradient buffer is created on first use
 * (mrl_model_grads, the first backward): inference never pays for it. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include "moonrl/mem.h"
#include "base/parallel.h"
#include "model_internal.h"
#include "base/error.h"
#include "base/mem.h"
#include "base/rng.h"
#include "io/write.h"
#include "runtime/device_internal.h"

typedef struct layout {
    mrl_model *m;
    int64_t offset;
    int n;
    char *names;
    size_t names_len;
    int frozen; /* views that never train (the multi-token prediction layer's): no weight decay */
} layout;

/* Add a view (when m->views is allocated) and return where it lives (NULL
 * while m->params is not allocated yet). */
static float *add_view(layout *lo, int decay, int64_t d0, int64_t d1, const char *fmt, int layer) {
    mrl_model *m = lo->m;
    char name[128];
    snprintf(name, sizeof name, fmt, layer);
    size_t nlen = strlen(name) + 1;
    int64_t numel = d0 * (d1 ? d1 : 1);
    float *p = NULL;
    if (m->views) {
        mrl_param_view *v = &m->views[lo->n];
        memcpy(lo->names + lo->names_len, name, nlen);
        v->name = lo->names + lo->names_len;
        v->offset = lo->offset;
        v->numel = numel;
        v->ndim = d1 ? 2 : 1;
        v->shape[0] = d0;
        v->shape[1] = d1;
        v->weight_decay = decay && !lo->frozen;
    }
    if (m->params) p = m->params + lo->offset;
    lo->names_len += nlen;
    lo->offset += numel;
    lo->n++;
    return p;
}

/* Layer l's views (l: the model's own numbering, which says whether it is sparse; gl: the whole
 * model's, which names it) and its parameter table. */
static layer_params layer_views(layout *lo, int l, int gl) {
    mrl_model *m = lo->m;
    const mrl_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, F = c->intermediate_size, hd = c->head_dim;
    int64_t Q = c->num_attention_heads * hd, K = c->num_key_value_heads * hd;
    layer_params p = {0};
    const char *pre = "model.layers.%d.";
    char f[160];
#define NAME(s) (snprintf(f, sizeof f, "%s%s", pre, s), f)
    p.ln1 = add_view(lo, 0, D, 0, NAME("input_layernorm.weight"), gl);
    if (mrl_model_is_mla(c)) { /* multi-head latent attention (moonrl/model.h) */
        int64_t H = c->num_attention_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
                dv = c->v_head_dim, rq = c->q_lora_rank, rkv = c->kv_lora_rank;
        if (rq) {
            p.wqa = add_view(lo, 1, rq, D, NAME("self_attn.q_a_proj.weight"), gl);
            p.q_a_norm = add_view(lo, 0, rq, 0, NAME("self_attn.q_a_layernorm.weight"), gl);
            p.wq = add_view(lo, 1, H * (dn + dr), rq, NAME("self_attn.q_b_proj.weight"), gl);
        } else {
            p.wq = add_view(lo, 1, H * (dn + dr), D, NAME("self_attn.q_proj.weight"), gl);
        }
        p.wk = add_view(lo, 1, rkv + dr, D, NAME("self_attn.kv_a_proj_with_mqa.weight"), gl);
        p.kv_a_norm = add_view(lo, 0, rkv, 0, NAME("self_attn.kv_a_layernorm.weight"), gl);
        p.wv = add_view(lo, 1, H * (dn + dv), rkv, NAME("self_attn.kv_b_proj.weight"), gl);
        p.wo = add_view(lo, 1, D, H * dv, NAME("self_attn.o_proj.weight"), gl);
        goto mlp;
    }
    p.wq = add_view(lo, 1, Q, D, NAME("self_attn.q_proj.weight"), gl);
    if (c->attention_bias) p.bq = add_view(lo, 0, Q, 0, NAME("self_attn.q_proj.bias"), gl);
    p.wk = add_view(lo, 1, K, D, NAME("self_attn.k_proj.weight"), gl);
    if (c->attention_bias) p.bk = add_view(lo, 0, K, 0, NAME("self_attn.k_proj.bias"), gl);
    p.wv = add_view(lo, 1, K, D, NAME("self_attn.v_proj.weight"), gl);
    if (c->attention_bias) p.bv = add_view(lo, 0, K, 0, NAME("self_attn.v_proj.bias"), gl);
    p.wo = add_view(lo, 1, D, Q, NAME("self_attn.o_proj.weight"), gl);
    if (mrl_arch_qk_norm(c->arch)) {
        p.q_norm = add_view(lo, 0, hd, 0, NAME("self_attn.q_norm.weight"), gl);
        p.k_norm = add_view(lo, 0, hd, 0, NAME("self_attn.k_norm.weight"), gl);
    }
mlp:
    p.ln2 = add_view(lo, 0, D, 0, NAME("post_attention_layernorm.weight"), gl);
    if (mrl_model_layer_is_moe(c, l)) {
        /* the router, then each kind of expert matrix stacked over the
         * experts: expert e's gate_proj is ewg + e*Fe*D (one product per
         * expert reads it in place; a GGUF's [E, ...] tensor is one range) */
        int64_t E = c->num_experts, Fe = c->moe_intermediate_size;
        p.router = add_view(lo, 1, E, D, NAME("mlp.gate.weight"), gl);
        if (c->arch == MRL_ARCH_DEEPSEEK_V3) /* (frozen: its gradient stays 0, no decay) */
            p.rbias = add_view(lo, 0, E, 0, NAME("mlp.gate.e_score_correction_bias"), gl);
        static const char *kind[3] = {"gate_proj", "up_proj", "down_proj"};
        float **stack[3] = {&p.ewg, &p.ewu, &p.ewd};
        for (int w = 0; w < 3; w++)
            for (int64_t e = 0; e < E; e++) {
                char ef[96];
                snprintf(ef, sizeof ef, "mlp.experts.%lld.%s.weight", (long long)e, kind[w]);
                float *v = add_view(lo, 1, w < 2 ? Fe : D, w < 2 ? D : Fe, NAME(ef), gl);
                if (e == 0) *stack[w] = v;
            }
        int64_t Fs = (int64_t)c->n_shared_experts * Fe;
        if (Fs) {
            p.swg = add_view(lo, 1, Fs, D, NAME("mlp.shared_experts.gate_proj.weight"), gl);
            p.swu = add_view(lo, 1, Fs, D, NAME("mlp.shared_experts.up_proj.weight"), gl);
            p.swd = add_view(lo, 1, D, Fs, NAME("mlp.shared_experts.down_proj.weight"), gl);
        }
    } else {
        p.wg = add_view(lo, 1, F, D, NAME("mlp.gate_proj.weight"), gl);
        p.wu = add_view(lo, 1, F, D, NAME("mlp.up_proj.weight"), gl);
        p.wd = add_view(lo, 1, D, F, NAME("mlp.down_proj.weight"), gl);
    }
#undef NAME
    return p;
}

/* The one place that defines the parameter layout. Run once to count, once
 * to fill the views, once more to point at the parameters. */
static void build_layout(layout *lo) {
    mrl_model *m = lo->m;
    const mrl_model_config *c = &m->cfg;
    int64_t V = c->vocab_size, D = c->hidden_size;
    /* pipeline parallel: a stage's own parts (the last stage's tied head is its own copy of the
     * embedding, whose gradient the caller sums with the first stage's) */
    int first = mrl_model_has_embed(m), last = mrl_model_has_head(m);
    m->embed = first || (last && c->tie_word_embeddings) ? add_view(lo, 1, V, D, "model.embed_tokens.weight", 0) : NULL;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        layer_params p = layer_views(lo, l, l + m->pp_l0); /* (the whole model's layer number) */
        if (m->lp) m->lp[l] = p;
    }
    if (!last) {
        m->final_norm = m->lm_head = m->score = NULL;
        return;
    }
    m->final_norm = add_view(lo, 0, D, 0, "model.norm.weight", 0);
    m->lm_head = c->tie_word_embeddings ? m->embed : add_view(lo, 1, V, D, "lm_head.weight", 0);
    m->score = c->value_head ? add_view(lo, 1, 1, D, "score.weight", 0) : NULL;
    /* DeepSeek-V3's multi-token prediction layer (moonrl/model.h), named as the layer after the last:
     * the engine's draft (its weights do not train: no decay, no gradient) */
    m->mtp = (mtp_params){0};
    if (c->num_nextn_predict_layers && last) {
        int L = c->num_hidden_layers, gl = L + m->pp_l0;
        lo->frozen = 1;
        m->mtp.enorm = add_view(lo, 0, D, 0, "model.layers.%d.enorm.weight", gl);
        m->mtp.hnorm = add_view(lo, 0, D, 0, "model.layers.%d.hnorm.weight", gl);
        m->mtp.eh_proj = add_view(lo, 0, D, 2 * D, "model.layers.%d.eh_proj.weight", gl);
        m->mtp.embed = add_view(lo, 0, V, D, "model.layers.%d.embed_tokens.weight", gl);
        m->mtp.layer = layer_views(lo, L, gl);
        m->mtp.head_norm = add_view(lo, 0, D, 0, "model.layers.%d.shared_head.norm.weight", gl);
        m->mtp.head = add_view(lo, 0, V, D, "model.layers.%d.shared_head.head.weight", gl);
        lo->frozen = 0;
    }
}

/* 2-D weights ~ normal(0, initializer_range), norm weights 1, biases 0;
 * draws continue from the generator state *s (splitmix64, core/base/rng.h:
 * the documented init). */
void mrl_model_init_view(const mrl_model *m, const mrl_param_view *v, uint64_t *s, float *p) {
    if (v->ndim == 2)
        for (int64_t j = 0; j < v->numel; j++) p[j] = (float)(mrl_normal(s) * m->cfg.initializer_range);
    else {
        float val = strstr(v->name, "norm") ? 1.0f : 0.0f;
        for (int64_t j = 0; j < v->numel; j++) p[j] = val;
    }
}

mrl_status mrl_model_create(const mrl_model_config *cfg, uint64_t seed, mrl_model **out) {
    mrl_status st = mrl_model_alloc(cfg, out);
    if (st) return st;
    uint64_t s = seed; /* views in order, one generator */
    mrl_model *m = *out;
    for (int i = 0; i < m->n_views; i++) mrl_model_init_view(m, &m->views[i], &s, m->params + m->views[i].offset);
    return MRL_OK;
}

mrl_status mrl_model_alloc_layout(const mrl_model_config *cfg, mrl_model **out) {
    return mrl_model_alloc_stage_layout(cfg, NULL, out);
}

mrl_status mrl_model_alloc_stage_layout(const mrl_model_config *cfg, const mrl_model_stage *stage, mrl_model **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_create: NULL out");
    *out = NULL;
    mrl_status st = mrl_model_config_validate(cfg);
    if (st) return st;
    mrl_model *m = mrl_mem_alloc(sizeof *m, MRL_MEM_OTHER);
    if (!m) return MRL_ERR_NOMEM;
    m->cfg = *cfg;
    if (stage && stage->stages > 1) { /* (cfg: the stage's layers) */
        m->pp_stage = stage->stage, m->pp_stages = stage->stages;
        m->pp_l0 = stage->first_layer; /* (pp_whole, the whole model's config: the loader's) */
    }
    m->k = mrl_kernels_cpu_fast();
    pthread_mutex_init(&m->w16_lock, NULL);
    layout lo = {.m = m};
    build_layout(&lo); /* count */
    m->n_params = lo.offset;
    m->n_views = lo.n;
    m->views = mrl_mem_alloc(sizeof(mrl_param_view) * m->n_views, MRL_MEM_OTHER);
    m->names = mrl_mem_alloc(lo.names_len, MRL_MEM_OTHER);
    m->lp = mrl_mem_alloc(sizeof(layer_params) * cfg->num_hidden_layers, MRL_MEM_OTHER);
    m->lg = mrl_mem_alloc(sizeof(layer_params) * cfg->num_hidden_layers, MRL_MEM_OTHER);
    if (cfg->num_experts > 0) {
        m->aux_picks = mrl_mem_alloc(sizeof(double) * (4 * cfg->num_experts + 1), MRL_MEM_OTHER);
        if (m->aux_picks) m->aux_psum = m->aux_picks + cfg->num_experts, m->aux_in = m->aux_psum + cfg->num_experts;
        m->aux_coef = cfg->output_router_logits ? cfg->router_aux_loss_coef : 0;
    }
    if (!m->views || !m->names || !m->lp || !m->lg || (cfg->num_experts > 0 && !m->aux_picks)) {
        mrl_model_free(m);
        return MRL_ERR_NOMEM;
    }
    lo = (layout){.m = m, .names = m->names};
    build_layout(&lo); /* fill the views */
    *out = m;
    return MRL_OK;
}

mrl_status mrl_model_alloc_params(mrl_model *m) {
    if (mrl_buffer_alloc(m->device, sizeof(float) * m->n_params, MRL_MEM_PARAMS, &m->params_buf))
        return mrl_wrap_error(MRL_ERR_NOMEM, "model: no memory for %lld parameters (%lld bytes)",
                             (long long)m->n_params, (long long)m->n_params * 4);
    return mrl_model_point_params(m, m->params_buf.data);
}

mrl_status mrl_model_point_params(mrl_model *m, float *base) {
    m->params = base;
    layout lo = {.m = m, .names = m->names};
    build_layout(&lo); /* point at the parameters (the views come out the same) */
    mrl_lora_point(m); /* (the layer tables were rebuilt) */
    mrl_model_point_w16(m);
    return MRL_OK;
}

void mrl_model_point_w16(mrl_model *m) {
    mrl_model_weights16_at(m, m->w16, NULL, m->lp); /* the trainer's layers read them (NULL: none) */
    m->lm_head16 = m->w16 ? m->w16 + (m->lm_head - m->params) : NULL;
}

mrl_status mrl_model_alloc(const mrl_model_config *cfg, mrl_model **out) {
    mrl_status st = mrl_model_alloc_layout(cfg, out);
    if (!st) st = mrl_model_alloc_params(*out);
    if (st && *out) {
        mrl_model_free(*out);
        *out = NULL;
    }
    return st;
}

/* The gradient pointers (lg, g_*) into m->grads, by the parameters' offsets. */
static void point_grads(mrl_model *m) {
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) { /* the parameters' fields, up to the copies (pq ...) */
        float **p = (float **)&m->lp[l], **g = (float **)&m->lg[l];
        for (size_t i = 0; i < offsetof(layer_params, pq) / sizeof(float *); i++) g[i] = grad_of(m, p[i]);
    }
    m->g_embed = grad_of(m, m->embed);
    m->g_final_norm = grad_of(m, m->final_norm);
    m->g_lm_head = grad_of(m, m->lm_head);
    m->g_score = grad_of(m, m->score);
    if (m->grads) mrl_model_mtp_at(m, m->grads, &m->g_mtp);
}

/* g = where p's gradient lies in window w of [lo, hi) (NULL: p is not there) */
static float *in_window(const mrl_model *m, const float *p, float *w, int64_t lo, int64_t hi) {
    if (!p) return NULL;
    int64_t at = p - m->params;
    return at >= lo && at < hi ? w + (at - lo) : NULL;
}

void mrl_model_point_window(mrl_model *m, int l, float *w, int64_t lo, int64_t hi) {
    if (l >= 0) {
        float **p = (float **)&m->lp[l], **g = (float **)&m->lg[l];
        for (size_t i = 0; i < offsetof(layer_params, pq) / sizeof(float *); i++) g[i] = in_window(m, p[i], w, lo, hi);
        return;
    }
    float **g[4] = {&m->g_embed, &m->g_final_norm, &m->g_lm_head, &m->g_score};
    const float *p[4] = {m->embed, m->final_norm, m->lm_head, m->score};
    for (int i = 0; i < 4; i++) {
        float *at = in_window(m, p[i], w, lo, hi);
        if (at) *g[i] = at;
    }
}

void mrl_model_set_grad_windows(mrl_model *m, mrl_grad_acquire acquire, void *ctx) {
    if (!m) return;
    m->grad_acquire = acquire;
    m->grad_acquire_ctx = ctx;
    if (!acquire && m->grads) point_grads(m); /* back to the buffer */
}

mrl_status mrl_model_ensure_grads(mrl_model *m) {
    if (m->quant && !m->lora)
        return mrl_set_error(MRL_ERR_INVALID, "model: its base is quantized (GGML blocks) and frozen: LoRA's adapters "
                             "are what trains (mrl_model_set_lora)");
    if (m->lora)
        return mrl_set_error(MRL_ERR_INVALID, "model: its parameters are frozen under LoRA (no gradient buffer): "
                             "the gradients are the adapters' (mrl_model_lora_grads)");
    if (m->grad_acquire)
        return mrl_set_error(MRL_ERR_INVALID, "model: the gradients are lent range by range (gradient windows: "
                             "dist.zero=2 shards them over the ranks); there is no whole gradient buffer");
    if (m->grads) return MRL_OK;
    if (mrl_buffer_alloc(m->device, sizeof(float) * m->n_params, MRL_MEM_GRADS, &m->grads_buf)) /* zeroed */
        return mrl_wrap_error(MRL_ERR_NOMEM, "model: no memory for the gradients of %lld parameters (%lld bytes)",
                             (long long)m->n_params, (long long)m->n_params * 4);
    m->grads = m->grads_buf.data;
    point_grads(m);
    return MRL_OK;
}

void mrl_model_free(mrl_model *m) {
    if (!m) return;
    mrl_model_pp_free_slots(m);
    mrl_model_release_activations(m);
    mrl_moe_ep_free(m);
    mrl_lora_free(m->lora);
    mrl_mem_free(m->tp_host);
    mrl_buffer_free(&m->params_buf);
    mrl_buffer_free(&m->w16_buf);
    mrl_buffer_free(&m->p16_buf);
    pthread_mutex_destroy(&m->w16_lock);
    mrl_buffer_free(&m->grads_buf);
    mrl_mem_region_free(m->p_region);
    mrl_model_quant_free(m);
    mrl_mem_region_free(m->w16_region);
    mrl_mem_free(m->views);
    mrl_mem_free(m->names);
    mrl_mem_free(m->lp);
    mrl_mem_free(m->lg);
    mrl_mem_free(m->aux_picks);
    mrl_mem_free(m->inv_freq);
    mrl_buffer_free(&m->rope_mem);
    mrl_mem_free(m);
}

const mrl_model_config *mrl_model_get_config(const mrl_model *m) { return m ? &m->cfg : NULL; }
int64_t mrl_model_num_params(const mrl_model *m) { return m ? m->n_params : 0; }
float *mrl_model_params(mrl_model *m) { return m ? m->params : NULL; }
float *mrl_model_grads(mrl_model *m) { return m && mrl_model_ensure_grads(m) == MRL_OK ? m->grads : NULL; }
int mrl_model_num_views(const mrl_model *m) { return m ? m->n_views : 0; }

mrl_status mrl_model_view(const mrl_model *m, int i, mrl_param_view *out) {
    if (!m || !out || i < 0 || i >= m->n_views)
        return mrl_set_error(MRL_ERR_INVALID, "model view %d out of range (0..%d)", i, m ? m->n_views - 1 : -1);
    *out = m->views[i];
    return MRL_OK;
}

mrl_status mrl_model_find_view(const mrl_model *m, const char *name, mrl_param_view *out) {
    if (!m || !name || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_find_view: NULL argument");
    for (int i = 0; i < m->n_views; i++)
        if (strcmp(m->views[i].name, name) == 0) {
            *out = m->views[i];
            return MRL_OK;
        }
    return mrl_set_error(MRL_ERR_INVALID, "model has no parameter named '%s'", name);
}

double mrl_model_router_aux_loss(const mrl_model *m) { return m ? m->aux_loss : 0; }
double mrl_model_router_aux_coef(const mrl_model *m) { return m ? m->aux_coef : 0; }
void mrl_model_set_router_aux_coef(mrl_model *m, double coef) {
    if (m && coef >= 0) m->aux_coef = coef;
}

void mrl_model_zero_grad(mrl_model *m) {
    if (m && m->lora) m->k->zero(m->lora->grads, (int64_t)sizeof(float) * m->lora->n);
    if (m && m->grads) m->k->zero(m->grads, (int64_t)sizeof(float) * m->n_params); /* none yet: zero when created */
}

void mrl_model_set_grad_hook(mrl_model *m, mrl_grad_hook hook, void *ctx) {
    if (!m) return;
    m->grad_hook = hook;
    m->grad_hook_ctx = ctx;
}

void mrl_model_set_recompute(mrl_model *m, int on) {
    if (!m || m->recompute == (on != 0)) return;
    mrl_model_release_activations(m); /* the layout changes */
    m->recompute = on != 0;
}

mrl_status mrl_model_set_kernels(mrl_model *m, int backend) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_kernels: NULL model");
    if (m->device.kind != MRL_DEVICE_CPU)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_kernels: the model is on cuda:%d, whose kernels it uses "
                             "(mrl_model_set_device to cpu first)", m->device.index);
    if (backend == MRL_KERNELS_CPU_FAST) m->k = mrl_kernels_cpu_fast();
    else if (backend == MRL_KERNELS_CPU_REFERENCE) m->k = mrl_kernels_cpu_reference();
    else return mrl_set_error(MRL_ERR_INVALID, "unknown kernel backend %d (0 cpu fast, 1 cpu reference)", backend);
    return MRL_OK;
}

const mrl_kernels *mrl_model_kernels(const mrl_model *m) { return m->k; }
void mrl_model_use_kernels(mrl_model *m, const mrl_kernels *k) { m->k = k; }

void mrl_model_weights_at(const mrl_model *m, const float *base, mrl_model_weights *out, layer_params *layers) {
#define AT(p) ((p) ? (float *)(base + ((p) - m->params)) : NULL)
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) { /* every parameter field (ln1 .. ewd), no copies */
        float *const *s = (float *const *)&m->lp[l];
        layers[l] = (layer_params){0};
        float **d = (float **)&layers[l];
        for (size_t i = 0; i < offsetof(layer_params, pq) / sizeof(float *); i++) d[i] = AT(s[i]);
        layers[l].lora = m->lp[l].lora; /* the model's adapters, read in place */
    }
    *out = (mrl_model_weights){AT(m->embed), AT(m->final_norm), AT(m->lm_head)};
#undef AT
}

/* ---- precision: the bf16 copies (moonrl/model.h) ---- */

/* The ranges of the buffer the bf16 products read: all layers (their norms
 * and biases come along: a few floats, and one range instead of 7 per
 * layer), and the lm_head (the embedding when tied; an untied embedding is
 * only gathered, in fp32). */
static void bf16_ranges(const mrl_model *m, int64_t r[4]) {
    r[0] = m->cfg.num_hidden_layers > 0 ? m->lp[0].ln1 - m->params : 0;
    r[1] = mrl_model_layers_end(m);
    r[2] = m->lm_head ? m->lm_head - m->params : m->n_params; /* (a pipeline stage without the head: none) */
    r[3] = m->lm_head ? r[2] + (int64_t)m->cfg.vocab_size * m->cfg.hidden_size : r[2];
}

void mrl_model_bf16_convert(const mrl_model *m, const float *base, uint16_t *dst) {
    int64_t r[4];
    bf16_ranges(m, r);
    for (int i = 0; i < 4; i += 2) m->k->f32_to_bf16(base + r[i], dst + r[i], r[i + 1] - r[i]);
}

void mrl_model_bf16_convert_range(const mrl_model *m, const float *base, uint16_t *dst, int64_t lo, int64_t hi) {
    int64_t r[4];
    bf16_ranges(m, r);
    for (int i = 0; i < 4; i += 2) {
        int64_t a = r[i] > lo ? r[i] : lo, b = r[i + 1] < hi ? r[i + 1] : hi;
        if (b > a) m->k->f32_to_bf16(base + a, dst + a, b - a);
    }
}

int mrl_model_mtp_at(const mrl_model *m, const float *base, mtp_params *out) {
    *out = (mtp_params){0};
    if (!m->mtp.eh_proj) return 0;
#define AT(p) ((p) ? (float *)base + ((p) - m->params) : NULL)
    const mtp_params *s = &m->mtp;
    *out = (mtp_params){AT(s->enorm), AT(s->hnorm), AT(s->eh_proj), AT(s->embed), AT(s->head_norm), AT(s->head)};
    float *const *src = (float *const *)&s->layer;
    float **dst = (float **)&out->layer;
    for (size_t i = 0; i < offsetof(layer_params, pq) / sizeof(float *); i++) dst[i] = AT(src[i]);
#undef AT
    return 1;
}

void mrl_model_weights16_at(const mrl_model *m, const uint16_t *base16, mrl_model_weights *out,
                            layer_params *layers) {
#define AT16(p) (base16 && (p) ? base16 + ((p) - m->params) : NULL)
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const layer_params *s = &m->lp[l];
        layer_params *d = &layers[l];
        d->hq = AT16(s->wq), d->hk = AT16(s->wk), d->hv = AT16(s->wv), d->ho = AT16(s->wo);
        d->hg = AT16(s->wg), d->hu = AT16(s->wu), d->hd = AT16(s->wd);
        d->heg = AT16(s->ewg), d->heu = AT16(s->ewu), d->hed = AT16(s->ewd);
        d->hqa = AT16(s->wqa);
        d->hsg = AT16(s->swg), d->hsu = AT16(s->swu), d->hsd = AT16(s->swd);
    }
    if (out) out->lm_head16 = AT16(m->lm_head);
#undef AT16
}

mrl_status mrl_model_set_dtype(mrl_model *m, int dtype) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_dtype: NULL model");
    if (dtype != MRL_MODEL_FP32 && dtype != MRL_MODEL_BF16)
        return mrl_set_error(MRL_ERR_INVALID, "model dtype %d (0 fp32, 1 bf16)", dtype);
    if (dtype == m->dtype) return MRL_OK;
    if (mrl_model_frozen_bf16(m))
        return mrl_set_error(MRL_ERR_INVALID, "model: its frozen base is stored in bf16 (mrl_model_freeze_bf16): its "
                             "dtype stays bf16");
    mrl_model_head_unkeep(m); /* (its bf16 pins, or none, are the dtype's it was kept in) */
    m->have_forward = 0;
    if (dtype == MRL_MODEL_BF16 && m->p_region) { /* sharded: copies of the parts in use only (shard.c) */
        mrl_status st = m->quant ? mrl_model_quant_w16(m) : mrl_model_shard_w16(m);
        if (st) return st;
    } else if (dtype == MRL_MODEL_BF16) {
        if (mrl_buffer_alloc(m->device, sizeof(uint16_t) * m->n_params, MRL_MEM_PARAMS, &m->w16_buf))
            return mrl_wrap_error(MRL_ERR_NOMEM, "model: no memory for the bf16 copy of %lld parameters (%lld bytes)",
                                 (long long)m->n_params, (long long)m->n_params * 2);
        m->w16 = m->w16_buf.data;
        atomic_store(&m->w16_stale, 1);
    } else {
        mrl_buffer_free(&m->w16_buf);
        mrl_buffer_free(&m->p16_buf);
        mrl_mem_region_free(m->w16_region);
        m->w16_region = NULL;
        m->w16 = NULL;
    }
    mrl_model_point_w16(m);
    mrl_model_release_activations(m); /* laid out again for the dtype (the head's bf16 buffer) */
    m->dtype = dtype;
    return MRL_OK;
}

int mrl_model_dtype(const mrl_model *m) { return m ? m->dtype : MRL_MODEL_FP32; }

void mrl_model_weights_changed(mrl_model *m) {
    if (!m) return;
    atomic_store(&m->w16_stale, 1);
    atomic_fetch_add(&m->weights_gen, 1);
}

int64_t mrl_model_weights_generation(const mrl_model *m) {
    return m ? atomic_load(&((mrl_model *)m)->weights_gen) : 0;
}

mrl_status mrl_model_refresh_bf16(mrl_model *m) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_refresh_bf16: NULL model");
    if (!m->w16 || !atomic_load(&m->w16_stale)) return MRL_OK;
    if (m->p_region) return MRL_OK; /* sharded: each part's copies are made as it is gathered (shard.c) */
    pthread_mutex_lock(&m->w16_lock);
    if (atomic_exchange(&m->w16_stale, 0)) { /* one pass over the weights: both layouts */
        mrl_model_bf16_convert(m, m->params, m->w16);
        if (m->p16_buf.data) mrl_model_bf16_pack_panels(m, m->w16, m->p16_buf.data);
    }
    pthread_mutex_unlock(&m->w16_lock);
    return MRL_OK;
}

const uint16_t *mrl_model_bf16_params(mrl_model *m) {
    if (!m || !m->w16) return NULL;
    mrl_model_refresh_bf16(m);
    return m->w16;
}

/* ---- bf16 weight panels (layer.h) ---- */

/* Matrix i of those the panels hold, each layer's seven then the head
 * (panels16_count in all): where it is in the parameters (NULL: a
 * sparse layer's MLP, none), its shape [N,K], and its panel slot in a layer
 * table (NULL for the head). */
typedef struct panel16_mat {
    const float *w;
    int64_t N, K;
    const void **slot;
} panel16_mat;

static int64_t panels16_count(const mrl_model *m) { return 7 * (int64_t)m->cfg.num_hidden_layers + 1; }

static panel16_mat panels16_mat(const mrl_model *m, layer_params *layers, int64_t i) {
    const mrl_model_config *c = &m->cfg;
    if (i == 7 * (int64_t)c->num_hidden_layers) return (panel16_mat){m->lm_head, c->vocab_size, c->hidden_size, NULL};
    mrl_layer_matrix own[7], theirs[7]; /* the weights are the model's, the slots the caller's layers' */
    mrl_layer_matrices(c, &m->lp[i / 7], own);
    if (layers) mrl_layer_matrices(c, &layers[i / 7], theirs);
    const mrl_layer_matrix *a = &own[i % 7];
    return (panel16_mat){a->w, a->N, a->K, layers ? theirs[i % 7].panels : NULL};
}

/* The dwords matrix a's panels take, rounded so that each matrix starts 16-dword aligned. */
static int64_t panels16_size(panel16_mat a) { return a.w ? (mrl_panels16_dwords(a.N, a.K) + 15) / 16 * 16 : 0; }

void mrl_model_panels16_at(const mrl_model *m, const uint32_t *p16, mrl_model_weights *out, layer_params *layers) {
    int64_t off = 0, n = panels16_count(m);
    for (int64_t i = 0; i < n; i++) {
        panel16_mat a = panels16_mat(m, layers, i);
        const uint32_t *at = p16 && a.w ? p16 + off : NULL;
        if (a.slot) *a.slot = at;
        else if (i == n - 1 && out) out->lm_head_p16 = at;
        off += panels16_size(a);
    }
}

typedef struct pack_job {
    const mrl_model *m;
    const uint16_t *w16;
    uint32_t *p16;
} pack_job;

/* Matrices [first, last): the offset of the first walked once, then carried along. */
static void pack_matrices(void *ctx, int64_t first, int64_t last) {
    const pack_job *j = ctx;
    int64_t off = 0;
    for (int64_t i = 0; i < first; i++) off += panels16_size(panels16_mat(j->m, NULL, i));
    for (int64_t i = first; i < last; i++) {
        panel16_mat a = panels16_mat(j->m, NULL, i);
        if (a.w) j->m->k->panels16_pack(j->p16 + off, j->w16 + (a.w - j->m->params), a.N, a.K);
        off += panels16_size(a);
    }
}

void mrl_model_bf16_pack_panels(const mrl_model *m, const uint16_t *w16, uint32_t *p16) {
    pack_job j = {m, w16, p16};
    int64_t n = panels16_count(m);
    mrl_parallel_for(n - 1, 1, pack_matrices, &j); /* the layers' matrices spread over the threads */
    pack_matrices(&j, n - 1, n);                    /* the head, parallel inside */
}

int64_t mrl_model_panels16_bytes(const mrl_model *m) {
    int64_t off = 0;
    for (int64_t i = 0; i < panels16_count(m); i++) off += panels16_size(panels16_mat(m, NULL, i));
    return 4 * off;
}

const uint32_t *mrl_model_bf16_panels(mrl_model *m) {
    int frozen = mrl_model_frozen_bf16(m); /* (its copies are whole and final: packed once) */
    if (!m || !m->w16 || m->device.kind != MRL_DEVICE_CPU || (m->p_region && !frozen)) return NULL; /* (a region: none whole) */
    if (!m->p16_buf.data) {
        pthread_mutex_lock(&m->w16_lock);
        if (!m->p16_buf.data &&
            !mrl_buffer_alloc(m->device, (size_t)mrl_model_panels16_bytes(m), MRL_MEM_PARAMS, &m->p16_buf)) {
            atomic_store(&m->w16_stale, 1); /* the refresh below writes both */
            if (frozen) mrl_model_bf16_pack_panels(m, m->w16, m->p16_buf.data);
        }
        pthread_mutex_unlock(&m->w16_lock);
        if (!m->p16_buf.data) return NULL;
    }
    mrl_model_refresh_bf16(m);
    return m->p16_buf.data;
}

/* ---- the device (moonrl/model.h) ---- */

/* The parameters as host memory: the buffer itself on the CPU, else a copy
 * in *tmp (the caller frees it). */
const float *mrl_model_host_params(mrl_model *m, float **tmp) {
    *tmp = NULL;
    if (!m->k->on_device) return m->params;
    *tmp = mrl_mem_alloc(sizeof(float) * m->n_params, MRL_MEM_OTHER);
    if (!*tmp) return NULL;
    if (m->k->to_host(*tmp, m->params, (int64_t)sizeof(float) * m->n_params)) {
        mrl_mem_free(*tmp);
        return *tmp = NULL;
    }
    return *tmp;
}

/* *buf (of `bytes`, maybe none) moved to device `to`; its data pointer changes. */
static mrl_status move_buffer(mrl_buffer *buf, size_t bytes, mrl_device to) {
    if (!buf->data) return MRL_OK;
    mrl_buffer moved;
    mrl_status st = mrl_buffer_alloc(to, bytes, buf->category, &moved);
    if (!st) st = mrl_buffer_copy(&moved, 0, buf, 0, bytes, NULL);
    if (st) {
        mrl_buffer_free(&moved);
        return st;
    }
    mrl_buffer_free(buf);
    *buf = moved;
    return MRL_OK;
}

mrl_status mrl_model_set_device(mrl_model *m, mrl_device device) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_device: NULL model");
    if (device.kind == m->device.kind && device.index == m->device.index) return MRL_OK;
    if (m->lora) return mrl_set_error(MRL_ERR_UNSUPPORTED, "model with LoRA adapters: on the CPU only for now");
    const mrl_kernels *k = mrl_kernels_cpu_fast();
    if (device.kind == MRL_DEVICE_CUDA) {
        char what[160];
        mrl_status st = mrl_device_describe(device, what, sizeof what); /* built with CUDA, and the GPU is there */
        if (st) return st;
        if (m->cfg.num_experts > 0)
            return mrl_set_error(MRL_ERR_UNSUPPORTED, "model on %s: a mixture-of-experts model (qwen3_moe) runs on the "
                                 "CPU only for now (its experts' outputs are combined, and its router's gradient "
                                 "taken, on the host)", what);
        if (m->ep) return mrl_set_error(MRL_ERR_UNSUPPORTED, "model on %s: expert parallelism is CPU only", what);
        k = mrl_kernels_for(device);
        if (!k) return mrl_set_error(MRL_ERR_UNSUPPORTED, "model on %s: moonrl was built without CUDA", what);
    } else if (device.kind != MRL_DEVICE_CPU) {
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_device: unknown device kind %d", (int)device.kind);
    }
    mrl_model_head_unkeep(m); /* (its pins are the old regions') */
    m->have_forward = 0;
    mrl_model_release_activations(m);
    mrl_buffer_free(&m->rope_mem); /* made again on the new device at the next forward */
    m->rope_cos = m->rope_sin = NULL;
    m->rope_len = 0;
    size_t n = (size_t)m->n_params;
    mrl_status st = MRL_OK;
    if (m->quant) { /* its blocks, and the region with its other tensors */
        st = mrl_model_quant_move(m, device);
        if (st) return st;
    } else if (m->p_region) { /* sharded: the shard's pages, and regions for the parts (and copies) it gathers */
        st = mrl_model_move_shard(m, device);
        if (st) return st;
    } else {
        st = move_buffer(&m->params_buf, sizeof(float) * n, device);
    }
    if (!st) st = move_buffer(&m->grads_buf, sizeof(float) * n, device);
    mrl_buffer_free(&m->p16_buf); /* a CPU layout: the engine on a GPU reads w16 */
    if (!st && m->w16_buf.data) { /* converted again there, on first use */
        mrl_buffer_free(&m->w16_buf);
        st = mrl_buffer_alloc(device, sizeof(uint16_t) * n, MRL_MEM_PARAMS, &m->w16_buf);
        atomic_store(&m->w16_stale, 1);
    }
    /* point everything at where the buffers are now (a failure above leaves a part behind:
     * the model is then only fit for mrl_model_free) */
    m->grads = m->grads_buf.data;
    if (!m->w16_region) m->w16 = m->w16_buf.data;
    mrl_model_point_params(m, m->p_region ? mrl_mem_region_base(m->p_region) : m->params_buf.data);
    if (m->grads) point_grads(m);
    m->device = device;
    m->k = k;
    if (!st && m->quant && m->dtype == MRL_MODEL_BF16) { /* its copies made again there */
        st = mrl_model_quant_w16(m);
        mrl_model_point_w16(m);
    }
    return st;
}

mrl_device mrl_model_get_device(const mrl_model *m) { return m ? m->device : (mrl_device){MRL_DEVICE_CPU, 0}; }

mrl_status mrl_model_load_raw(mrl_model *m, const char *path) {
    if (!m || !path) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_load_raw: NULL argument");
    FILE *f;
    mrl_status opened = mrl_io_fopen_read(path, &f);
    if (opened) return opened;
    float *host = m->k->on_device ? mrl_mem_alloc(sizeof(float) * m->n_params, MRL_MEM_OTHER) : m->params;
    if (!host) {
        fclose(f);
        return MRL_ERR_NOMEM;
    }
    size_t n = fread(host, sizeof(float), (size_t)m->n_params, f);
    int extra = fgetc(f) != EOF;
    fclose(f);
    mrl_model_weights_changed(m);
    mrl_status st = MRL_OK;
    if (n != (size_t)m->n_params || extra)
        st = mrl_set_error(MRL_ERR_FORMAT, "%s: expected exactly %lld floats (%lld bytes) for this model",
                           path, (long long)m->n_params, (long long)m->n_params * 4);
    else if (host != m->params)
        st = m->k->to_device(m->params, host, (int64_t)sizeof(float) * m->n_params);
    if (host != m->params) mrl_mem_free(host);
    return st;
}

mrl_status mrl_model_save_raw(mrl_model *m, const char *path) {
    if (!m || !path) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_save_raw: NULL argument");
    float *tmp;
    const float *host = mrl_model_host_params(m, &tmp);
    if (!host) return mrl_set_error(MRL_ERR_NOMEM, "%s: no host memory for a copy of the parameters", path);
    FILE *f = fopen(path, "wb");
    mrl_status st = MRL_OK;
    if (!f) {
        st = mrl_set_error(MRL_ERR_IO, "%s: cannot create", path);
    } else {
        size_t n = fwrite(host, sizeof(float), (size_t)m->n_params, f);
        if (fclose(f) != 0 || n != (size_t)m->n_params) st = mrl_set_error(MRL_ERR_IO, "%s: write failed", path);
    }
    mrl_mem_free(tmp);
    return st;
}
