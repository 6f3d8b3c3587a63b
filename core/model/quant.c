/* A quantized base (QLoRA, moonrl/model.h's mrl_model_create_quantized): the
 * matrices of a GGUF model stay in their GGML blocks (Q4_0, Q4_1, Q8_0), and
 * the parameter buffer is a region (core/base/mem.h) as a sharded model's is
 * (shard.c): the other tensors (embedding, norms, head) are pinned for the
 * model's life, a matrix has memory only while a forward, a backward or an
 * engine step uses its layer, and its "gather" is the kernels' dequant op
 * writing the blocks' weights into place. The weights made so are the bits
 * of the whole dequantized model (the dequant op's, which the file reader
 * uses too), so the model computes what that fp32 model computes while it
 * holds its blocks, the other tensors and one layer. The base is frozen:
 * LoRA's adapters are what trains. */
#include <stdlib.h>
#include <string.h>
#include "base/error.h"
#include "base/mem.h"
#include "model_internal.h"
#include "runtime/device_internal.h"

#define MRL_QUANT_BF16 30 /* (ggml's BF16) a base stored as the model's bf16 copies, mrl_model_freeze_bf16 */

typedef struct mrl_quant {
    int n;
    struct quant_tensor {
        int64_t offset, numel, at; /* its parameters; where its blocks start in `blocks` (bytes) */
        int type;
    } *t;
    mrl_buffer blocks; /* on the model's device */
    int64_t bytes;
    /* a base stored in bf16 (mrl_model_freeze_bf16): its tensors' source is the model's bf16
     * copies (type MRL_QUANT_BF16), which the products read: made whole in fp32 only for a read
     * of the parameters (mrl_model_fetch, fetching), never for a computation */
    int bf16, fetching;
} mrl_quant;

static int by_offset(const void *a, const void *b) {
    int64_t x = ((const struct quant_tensor *)a)->offset, y = ((const struct quant_tensor *)b)->offset;
    return x < y ? -1 : x > y;
}

/* The parameters between the quantized tensors (the dense ones): pinned [lo, hi) ranges, in
 * order; *n how many. NULL without memory. */
static int64_t (*dense_ranges(const mrl_model *m, int *n))[2] {
    const mrl_quant *q = m->quant;
    int64_t (*r)[2] = malloc(sizeof *r * (size_t)(q->n + 1));
    if (!r) return NULL;
    int k = 0;
    int64_t at = 0;
    for (int i = 0; i <= q->n; i++) {
        int64_t end = i < q->n ? q->t[i].offset : m->n_params;
        if (end > at) r[k][0] = at, r[k][1] = end, k++;
        if (i < q->n) at = q->t[i].offset + q->t[i].numel;
    }
    *n = k;
    return r;
}

/* the region on m->device with the dense ranges pinned (their contents not yet there) */
static mrl_status pinned_region(const mrl_model *m, mrl_device device, mrl_mem_region **out) {
    int n;
    int64_t (*r)[2] = dense_ranges(m, &n);
    if (!r) return MRL_ERR_NOMEM;
    mrl_status st = mrl_device_region_create(device, 4 * m->n_params, MRL_MEM_PARAMS, out);
    for (int i = 0; !st && i < n; i++) st = mrl_mem_region_pin(*out, 4 * r[i][0], 4 * r[i][1]);
    free(r);
    if (st) {
        mrl_mem_region_free(*out);
        *out = NULL;
        return mrl_wrap_error(st, "quantized base: the %lld parameters outside its matrices", (long long)m->n_params);
    }
    return MRL_OK;
}

/* The dense ranges' floats from src into dst (each the parameters' layout, either device). */
static mrl_status copy_dense(const mrl_model *m, float *dst, const float *src) {
    int n;
    int64_t (*r)[2] = dense_ranges(m, &n);
    if (!r) return MRL_ERR_NOMEM;
    mrl_status st = MRL_OK;
    for (int i = 0; !st && i < n; i++)
        st = mrl_device_memcpy(dst + r[i][0], src + r[i][0], (size_t)(4 * (r[i][1] - r[i][0])));
    free(r);
    return st;
}

/* The dequantized weights of [lo, lo + count) into params (mrl_model_use's gather): each
 * quantized tensor there, whole blocks (the ranges used are whole tensors or layers). */
static mrl_status dequantize_into(void *ctx, float *params, int64_t lo, int64_t count) {
    mrl_model *m = ctx;
    const mrl_quant *q = m->quant;
    int64_t hi = lo + count;
    for (int i = 0; i < q->n; i++) {
        const struct quant_tensor *t = &q->t[i];
        int64_t a = t->offset > lo ? t->offset : lo, b = t->offset + t->numel < hi ? t->offset + t->numel : hi;
        if (a >= b) continue;
        if ((a - t->offset) % 32 || (b - t->offset) % 32)
            return mrl_set_error(MRL_ERR_INTERNAL, "quantized base: parameters [%lld, %lld) cut a block of a matrix",
                                 (long long)lo, (long long)hi);
        if (t->type == MRL_QUANT_BF16) { /* (a bf16 base: its copies, exact in fp32) */
            m->k->bf16_to_f32(m->w16 + a, params + a, b - a);
            continue;
        }
        const char *blocks = (const char *)q->blocks.data + t->at + (a - t->offset) / 32 * mrl_quant_block_bytes(t->type);
        m->k->dequant(t->type, blocks, params + a, b - a);
    }
    return MRL_OK;
}

static mrl_status nothing_to_wait(void *ctx, float *params, int64_t lo, int64_t count) {
    (void)ctx, (void)params, (void)lo, (void)count;
    return MRL_OK;
}

mrl_status mrl_model_create_quantized(const mrl_model_config *cfg, const mrl_quant_tensor *tensors, int n,
                                      mrl_model **out) {
    if (!cfg || !out || n < 0 || (n > 0 && !tensors))
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_create_quantized: NULL argument");
    *out = NULL;
    if (mrl_model_is_mla(cfg))
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "a quantized base: not yet for deepseek_v3 (multi-head latent attention)");
    mrl_model *m;
    mrl_status st = mrl_model_alloc_layout(cfg, &m);
    if (st) return st;
    mrl_quant *q = m->quant = calloc(1, sizeof *q);
    if (!q || !(q->t = malloc(sizeof *q->t * (size_t)(n ? n : 1)))) {
        mrl_model_free(m);
        return MRL_ERR_NOMEM;
    }
    q->n = n;
    for (int i = 0; i < n && !st; i++) { /* checked, and the blocks' bytes counted */
        const mrl_quant_tensor *t = &tensors[i];
        int bytes = mrl_quant_block_bytes(t->type);
        int64_t offset = -1, whole = 0; /* (a layer's experts: all of them from the first's view) */
        for (int v = 0; t->name && v < m->n_views && offset < 0; v++)
            if (!strcmp(m->views[v].name, t->name))
                offset = m->views[v].offset,
                whole = m->views[v].numel * (strstr(t->name, ".experts.0.") ? m->cfg.num_experts : 1);
        if (offset < 0)
            st = mrl_set_error(MRL_ERR_INVALID, "quantized base: tensor %d names %s, which the model has not", i,
                               t->name ? t->name : "nothing");
        else if (!bytes)
            st = mrl_set_error(MRL_ERR_UNSUPPORTED, "quantized base: tensor %d is of ggml type %d; the matrices stay "
                               "quantized as Q4_0, Q4_1 or Q8_0", i, t->type);
        else if (t->numel != whole || t->numel % 32 || !t->blocks)
            st = mrl_set_error(MRL_ERR_INVALID, "quantized base: %s: %lld weights given, the model has %lld there (in "
                               "whole blocks of 32)", t->name, (long long)t->numel, (long long)whole);
        else q->bytes += t->numel / 32 * bytes;
        q->t[i].offset = offset;
    }
    /* (the model is on the CPU until mrl_model_set_device: the blocks are copied in as they are) */
    if (!st && mrl_buffer_alloc(m->device, (size_t)(q->bytes ? q->bytes : 1), MRL_MEM_PARAMS, &q->blocks))
        st = mrl_wrap_error(MRL_ERR_NOMEM, "quantized base: no memory for its blocks (%lld bytes)", (long long)q->bytes);
    int64_t at = 0;
    for (int i = 0; i < n && !st; i++) {
        const mrl_quant_tensor *t = &tensors[i];
        int64_t bytes = t->numel / 32 * mrl_quant_block_bytes(t->type);
        q->t[i] = (struct quant_tensor){q->t[i].offset, t->numel, at, t->type};
        memcpy((char *)q->blocks.data + at, t->blocks, (size_t)bytes);
        at += bytes;
    }
    if (!st) qsort(q->t, (size_t)n, sizeof *q->t, by_offset);
    for (int i = 1; i < n && !st; i++)
        if (q->t[i].offset < q->t[i - 1].offset + q->t[i - 1].numel)
            st = mrl_set_error(MRL_ERR_INVALID, "quantized base: two tensors share parameter %lld",
                               (long long)q->t[i].offset);
    if (!st) st = pinned_region(m, m->device, &m->p_region);
    if (!st) st = mrl_model_point_params(m, mrl_mem_region_base(m->p_region));
    if (st) {
        mrl_model_free(m);
        return st;
    }
    m->gather_start = dequantize_into, m->gather_wait = nothing_to_wait, m->gather_ctx = m;
    m->shard_writer = 1; /* (saving: the whole model, tensor by tensor, mrl_model_fetch'd) */
    *out = m;
    return MRL_OK;
}

int64_t mrl_model_quantized_bytes(const mrl_model *m) { return m && m->quant ? m->quant->bytes : 0; }

void mrl_model_quant_free(mrl_model *m) {
    if (!m->quant) return;
    mrl_buffer_free(&m->quant->blocks);
    free(m->quant->t);
    free(m->quant);
    m->quant = NULL;
}

mrl_status mrl_model_quant_move(mrl_model *m, mrl_device to) {
    mrl_quant *q = m->quant;
    mrl_mem_region *r = NULL;
    mrl_buffer blocks;
    mrl_status st = pinned_region(m, to, &r);
    if (!st) st = copy_dense(m, mrl_mem_region_base(r), m->params);
    if (!st && (st = mrl_buffer_alloc(to, (size_t)(q->bytes ? q->bytes : 1), MRL_MEM_PARAMS, &blocks)) == MRL_OK) {
        st = mrl_buffer_copy(&blocks, 0, &q->blocks, 0, (size_t)q->bytes, NULL);
        if (st) mrl_buffer_free(&blocks);
    }
    if (st) {
        mrl_mem_region_free(r);
        return mrl_wrap_error(st, "quantized base: moved");
    }
    mrl_buffer_free(&q->blocks);
    q->blocks = blocks;
    mrl_mem_region_free(m->p_region);
    mrl_mem_region_free(m->w16_region); /* (a bf16 model's: made again there, mrl_model_quant_w16) */
    m->p_region = r, m->w16_region = NULL;
    m->w16 = NULL;
    return MRL_OK;
}

mrl_status mrl_model_quant_w16(mrl_model *m) {
    mrl_status st = mrl_model_shard_w16(m);
    int n;
    int64_t (*r)[2] = st ? NULL : dense_ranges(m, &n);
    if (!st && !r) st = MRL_ERR_NOMEM;
    for (int i = 0; !st && i < n; i++) { /* the other tensors' copies: for the model's life (frozen) */
        st = mrl_mem_region_pin(m->w16_region, 2 * r[i][0], 2 * r[i][1]);
        if (!st) mrl_model_bf16_convert_range(m, m->params, m->w16, r[i][0], r[i][1]);
    }
    free(r);
    if (st) {
        mrl_mem_region_free(m->w16_region);
        m->w16_region = NULL, m->w16 = NULL;
        return mrl_wrap_error(st, "quantized base: bf16 copies of the tensors outside its matrices");
    }
    return MRL_OK;
}

void mrl_model_quant_bf16(mrl_model *m, int64_t lo, int64_t hi) {
    const mrl_quant *q = m->quant;
    for (int i = 0; i < q->n; i++) {
        const struct quant_tensor *t = &q->t[i];
        int64_t a = t->offset > lo ? t->offset : lo, b = t->offset + t->numel < hi ? t->offset + t->numel : hi;
        if (a < b && t->type != MRL_QUANT_BF16) m->k->f32_to_bf16(m->params + a, m->w16 + a, b - a);
    }
}

mrl_status mrl_model_layer_use(mrl_model *m, int l) {
    if (!m->quant) return MRL_OK;
    int64_t lo, hi;
    mrl_model_layer_range(m, l, &lo, &hi);
    return mrl_model_use(m, lo, hi, 0, 0);
}

void mrl_model_layer_unuse(mrl_model *m, int l) {
    if (!m->quant) return;
    int64_t lo, hi;
    mrl_model_layer_range(m, l, &lo, &hi);
    mrl_model_unuse(m, lo, hi);
}

int mrl_model_quant_layer(const mrl_model *m, int l, quant_layer *out) {
    *out = (quant_layer){{0}};
    if (!m->quant) return 0;
    mrl_layer_matrix mats[7];
    mrl_layer_matrices(&m->cfg, (layer_params *)&m->lp[l], mats);
    int any = 0;
    for (int i = 0; i < 7; i++)
        for (int j = 0; mats[i].w && j < m->quant->n; j++)
            if (m->quant->t[j].offset == mats[i].w - m->params) {
                out->w[i] = (const char *)m->quant->blocks.data + m->quant->t[j].at;
                out->type[i] = m->quant->t[j].type;
                any = 1;
            }
    return any;
}

/* ---- a frozen base stored in bf16 (moonrl/model.h, mrl_model_freeze_bf16) ---- */

mrl_status mrl_model_freeze_bf16(mrl_model *m) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_freeze_bf16: NULL model");
    if (m->quant) return m->quant->bf16 ? MRL_OK : mrl_set_error(MRL_ERR_INVALID, "a quantized base: already frozen");
    const char *why = !m->lora                         ? "the model trains no LoRA adapters (its base is not frozen)"
                      : m->dtype != MRL_MODEL_BF16     ? "the model is not in bf16"
                      : m->p_region                    ? "its parameters are sharded"
                      : m->tp_size > 1 || m->pp_stages > 1 ? "it is split over ranks"
                      : !m->w16_buf.data               ? "it has no bf16 copies"
                                                       : NULL;
    if (why) return mrl_set_error(MRL_ERR_INVALID, "freezing the base in bf16: %s", why);
    mrl_status st = mrl_model_refresh_bf16(m); /* (the copies are the weights from here on) */
    if (st) return st;
    const mrl_model_config *c = &m->cfg;
    mrl_quant *q = calloc(1, sizeof *q);
    if (!q || !(q->t = malloc(sizeof *q->t * (size_t)(10 * c->num_hidden_layers + 1)))) {
        free(q);
        return MRL_ERR_NOMEM;
    }
    q->bf16 = 1;
    int64_t E = c->num_experts, Fe = c->moe_intermediate_size, D = c->hidden_size;
    for (int l = 0; l < c->num_hidden_layers; l++) { /* what the products read as bf16 copies */
        mrl_layer_matrix mats[7];
        mrl_layer_matrices(c, &m->lp[l], mats);
        for (int i = 0; i < 7; i++)
            if (mats[i].w) q->t[q->n++] = (struct quant_tensor){mats[i].w - m->params, mats[i].N * mats[i].K, 0, MRL_QUANT_BF16};
        const float *experts[3] = {m->lp[l].ewg, m->lp[l].ewu, m->lp[l].ewd};
        for (int i = 0; i < 3; i++)
            if (experts[i]) q->t[q->n++] = (struct quant_tensor){experts[i] - m->params, E * Fe * D, 0, MRL_QUANT_BF16};
    }
    if (!c->tie_word_embeddings && m->lm_head) /* (a tied head is the embedding, which the lookup reads in fp32) */
        q->t[q->n++] = (struct quant_tensor){m->lm_head - m->params, (int64_t)c->vocab_size * D, 0, MRL_QUANT_BF16};
    qsort(q->t, (size_t)q->n, sizeof *q->t, by_offset);
    m->quant = q;
    mrl_mem_region *r = NULL;
    st = pinned_region(m, m->device, &r);
    float *base = r ? mrl_mem_region_base(r) : NULL;
    if (!st) st = copy_dense(m, base, m->params);
    if (st) {
        mrl_mem_region_free(r);
        mrl_model_quant_free(m);
        return mrl_wrap_error(st, "freezing the base in bf16");
    }
    mrl_buffer_free(&m->params_buf); /* the fp32 matrices go */
    mrl_buffer_free(&m->p16_buf);    /* (panels: packed again from the copies, mrl_model_bf16_panels) */
    m->p_region = r;
    m->gather_start = dequantize_into, m->gather_wait = nothing_to_wait, m->gather_ctx = m;
    m->shard_writer = 1;
    mrl_model_release_activations(m);
    mrl_model_point_params(m, base); /* (and the bf16 pointers: the copies stay where they are) */
    return MRL_OK;
}

int mrl_model_frozen_bf16(const mrl_model *m) { return m && m->quant && m->quant->bf16; }

int mrl_model_quant_lazy(const mrl_model *m) { return m->quant && m->quant->bf16 && !m->quant->fetching; }

void mrl_model_quant_fetching(mrl_model *m, int on) {
    if (m->quant) m->quant->fetching = on;
}

mrl_status mrl_model_read_params(mrl_model *m, float *host) {
    if (!m || !host) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_read_params: NULL argument");
    if (!m->p_region) return mrl_device_memcpy(host, m->params, sizeof(float) * (size_t)m->n_params);
    if (!m->quant) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_read_params: the parameters are sharded");
    mrl_status st = MRL_OK;
    for (int i = 0; !st && i < m->n_views; i++) { /* each view made whole where it is, copied, let go */
        const mrl_param_view *v = &m->views[i];
        if ((st = mrl_model_fetch(m, v->offset, v->numel))) break;
        st = mrl_device_memcpy(host + v->offset, m->params + v->offset, sizeof(float) * (size_t)v->numel);
        mrl_model_drop(m, v->offset, v->numel);
    }
    return st;
}
