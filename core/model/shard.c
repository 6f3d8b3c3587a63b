/* Sharded parameters (ZeRO-3, moonrl/model.h): the parameter buffer is a
 * region (core/base/mem.h) holding the rank's shard for the run and the
 * parts of the model in use, gathered into place by the caller's gather
 * functions (core/dist's mrl_dist_param_gather). Pointer arithmetic on the
 * parameters (views, layer tables) stays that of a whole buffer: only
 * memory is missing where nothing is in use. */
#include <stdlib.h>
#include <string.h>
#include "base/error.h"
#include "base/mem.h"
#include "model_internal.h"
#include "runtime/device_internal.h"

int mrl_model_shard(const mrl_model *m, int64_t *offset, int64_t *count) {
    if (!m || !m->p_region || m->quant) return 0; /* (a quantized base's region is no shard: quant.c) */
    if (offset) *offset = m->shard_off;
    if (count) *count = m->shard_count;
    return 1;
}

mrl_status mrl_model_set_param_gather(mrl_model *m, mrl_param_gather start, mrl_param_gather wait, void *ctx,
                                      int writer) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_param_gather: NULL model");
    if (!m->p_region) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_param_gather: the parameters are not sharded");
    if (!start != !wait) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_param_gather: start and wait go together");
    m->gather_start = start;
    m->gather_wait = wait;
    m->gather_ctx = ctx;
    m->shard_writer = writer != 0;
    return MRL_OK;
}

/* Bytes the regions hold beyond the shard's own pages: the parts gathered and their bf16 copies. */
static int64_t gathered(const mrl_model *m) {
    int64_t page = mrl_mem_region_page(m->p_region);
    int64_t shard_pages = (4 * (m->shard_off + m->shard_count) + page - 1) / page - 4 * m->shard_off / page;
    return mrl_mem_region_resident(m->p_region) - page * shard_pages + mrl_mem_region_resident(m->w16_region);
}

static void note_gathered(mrl_model *m) {
    int64_t g = gathered(m);
    if (g > m->gathered_peak) m->gathered_peak = g;
}

int64_t mrl_model_gathered_bytes(mrl_model *m, int64_t *peak) {
    if (!m || !m->p_region) {
        if (peak) *peak = 0;
        return 0;
    }
    int64_t now = gathered(m);
    if (peak) *peak = m->gathered_peak;
    m->gathered_peak = now; /* the next peak from here */
    return now;
}

/* pin [lo, hi) and start its gather */
static mrl_status begin(mrl_model *m, int64_t lo, int64_t hi) {
    mrl_status st = mrl_mem_region_pin(m->p_region, 4 * lo, 4 * hi);
    if (st) return mrl_wrap_error(st, "model: parameters [%lld, %lld) gathered into place", (long long)lo, (long long)hi);
    if ((st = m->gather_start(m->gather_ctx, m->params, lo, hi - lo))) mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
    return st;
}

mrl_status mrl_model_use(mrl_model *m, int64_t lo, int64_t hi, int64_t next_lo, int64_t next_hi) {
    if (!m->p_region || hi <= lo || mrl_model_quant_lazy(m)) return MRL_OK;
    if (!m->gather_start)
        return mrl_set_error(MRL_ERR_INVALID, "model: the parameters are sharded and nothing gathers them "
                             "(mrl_model_set_param_gather)");
    if (m->quant) next_lo = next_hi = 0; /* (a quantized base's gather is the dequantization itself: none ahead) */
    int ahead = m->ahead_hi > m->ahead_lo && m->ahead_lo == lo && m->ahead_hi == hi;
    mrl_status st = MRL_OK;
    if (!ahead && m->ahead_hi > m->ahead_lo) { /* started ahead for another use: finished and let go */
        st = m->gather_wait(m->gather_ctx, m->params, m->ahead_lo, m->ahead_hi - m->ahead_lo);
        mrl_mem_region_unpin(m->p_region, 4 * m->ahead_lo, 4 * m->ahead_hi);
    }
    m->ahead_lo = m->ahead_hi = 0;
    if (st) return st;
    if (!ahead && (st = begin(m, lo, hi))) return st;
    if (next_hi > next_lo) { /* the next part's gather while this one computes */
        if ((st = begin(m, next_lo, next_hi))) {
            mrl_status w = m->gather_wait(m->gather_ctx, m->params, lo, hi - lo);
            (void)w;
            mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
            return st;
        }
        m->ahead_lo = next_lo, m->ahead_hi = next_hi;
    }
    note_gathered(m);
    if ((st = m->gather_wait(m->gather_ctx, m->params, lo, hi - lo))) {
        mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
        return st;
    }
    if (m->w16_region) { /* the products read bf16 copies: of this part, made now */
        if ((st = mrl_mem_region_pin(m->w16_region, 2 * lo, 2 * hi))) {
            mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
            return mrl_wrap_error(st, "model: bf16 copies of parameters [%lld, %lld)", (long long)lo, (long long)hi);
        }
        if (m->quant) mrl_model_quant_bf16(m, lo, hi); /* (the other tensors' copies are there already) */
        else mrl_model_bf16_convert_range(m, m->params, m->w16, lo, hi);
        note_gathered(m);
    }
    return MRL_OK;
}

void mrl_model_prefetch(mrl_model *m, int64_t lo, int64_t hi) {
    if (!m->p_region || m->quant || hi <= lo || !m->gather_start || m->ahead_hi > m->ahead_lo) return;
    if (begin(m, lo, hi) == MRL_OK) m->ahead_lo = lo, m->ahead_hi = hi;
}

void mrl_model_unuse(mrl_model *m, int64_t lo, int64_t hi) {
    if (!m->p_region || hi <= lo || mrl_model_quant_lazy(m)) return;
    mrl_mem_region_unpin(m->p_region, 4 * lo, 4 * hi);
    if (m->w16_region) mrl_mem_region_unpin(m->w16_region, 2 * lo, 2 * hi);
}

void mrl_model_head_unkeep(mrl_model *m) {
    if (!m->head_kept) return;
    int64_t embed_end = m->lp[0].ln1 - m->params;
    mrl_model_unuse(m, mrl_model_layers_end(m), m->n_params);
    if (m->cfg.tie_word_embeddings) mrl_model_unuse(m, 0, embed_end);
    m->head_kept = 0;
}

mrl_status mrl_model_fetch(mrl_model *m, int64_t offset, int64_t count) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_fetch: NULL model");
    if (offset < 0 || count < 0 || offset + count > m->n_params)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_fetch: [%lld, %lld) outside the %lld parameters",
                             (long long)offset, (long long)(offset + count), (long long)m->n_params);
    mrl_model_quant_fetching(m, 1); /* (a bf16-stored base: made whole for the read) */
    mrl_status st = mrl_model_use(m, offset, offset + count, 0, 0);
    mrl_model_quant_fetching(m, 0);
    return st;
}

void mrl_model_drop(mrl_model *m, int64_t offset, int64_t count) {
    if (!m || offset < 0 || count <= 0 || offset + count > m->n_params) return;
    mrl_model_quant_fetching(m, 1);
    mrl_model_unuse(m, offset, offset + count);
    mrl_model_quant_fetching(m, 0);
}

mrl_status mrl_model_shard_w16(mrl_model *m) {
    mrl_status st = mrl_device_region_create(m->device, 2 * m->n_params, MRL_MEM_PARAMS, &m->w16_region);
    if (st) return st;
    m->w16 = mrl_mem_region_base(m->w16_region);
    return MRL_OK;
}

/* The region in place of the parameter buffer, the shard pinned for the run. */
mrl_status mrl_model_alloc_shard(mrl_model *m, int64_t offset, int64_t count) {
    if (offset < 0 || count <= 0 || offset + count > m->n_params)
        return mrl_set_error(MRL_ERR_INVALID, "model: shard [%lld, %lld) of %lld parameters", (long long)offset,
                             (long long)(offset + count), (long long)m->n_params);
    mrl_status st = mrl_device_region_create(m->device, 4 * m->n_params, MRL_MEM_PARAMS, &m->p_region);
    if (!st) st = mrl_mem_region_pin(m->p_region, 4 * offset, 4 * (offset + count));
    if (st) return mrl_wrap_error(st, "model: this rank's %lld parameters", (long long)count);
    m->shard_off = offset;
    m->shard_count = count;
    return mrl_model_point_params(m, mrl_mem_region_base(m->p_region));
}

mrl_status mrl_model_move_shard(mrl_model *m, mrl_device to) {
    if (m->ahead_hi > m->ahead_lo) return mrl_set_error(MRL_ERR_INVALID, "model: a sharded model moved mid-gather");
    mrl_mem_region *old = m->p_region, *old16 = m->w16_region;
    int64_t lo = 4 * m->shard_off, hi = 4 * (m->shard_off + m->shard_count);
    mrl_mem_region *r = NULL, *r16 = NULL;
    mrl_status st = mrl_device_region_create(to, 4 * m->n_params, MRL_MEM_PARAMS, &r);
    if (!st) st = mrl_mem_region_pin(r, lo, hi);
    if (!st) st = mrl_device_memcpy((char *)mrl_mem_region_base(r) + lo, (char *)mrl_mem_region_base(old) + lo,
                                    (size_t)(hi - lo));
    if (!st && old16) st = mrl_device_region_create(to, 2 * m->n_params, MRL_MEM_PARAMS, &r16);
    if (st) {
        mrl_mem_region_free(r);
        return mrl_wrap_error(st, "model: this rank's %lld parameters moved", (long long)m->shard_count);
    }
    m->p_region = r, m->w16_region = r16;
    m->w16 = r16 ? mrl_mem_region_base(r16) : NULL;
    mrl_mem_region_free(old);
    mrl_mem_region_free(old16);
    return MRL_OK;
}

/* ---- the compute copy of a sharded model (moonrl/model.h) ---- */

struct mrl_model_copy {
    mrl_model *m;
    mrl_mem_region *f32; /* the tensors an engine reads in fp32, pinned for the copy's life */
    mrl_buffer w16, p16; /* the bf16 copies of the layers' matrices and the head; their panels */
    int64_t (*keep)[2];  /* the fp32 tensors' ranges, merged, in buffer order */
    int n_keep;
};

/* The ranges the bf16 products read in bf16 (mrl_model_weights16_at): each layer's matrices
 * and experts, and a head of its own (a tied head is the embedding, which the lookup reads in
 * fp32). *n: how many; NULL without memory. */
static int64_t (*bf16_matrices(const mrl_model *m, int *n))[2] {
    const mrl_model_config *c = &m->cfg;
    int64_t (*r)[2] = malloc(sizeof *r * (10 * (size_t)c->num_hidden_layers + 1));
    if (!r) return NULL;
    int k = 0;
    int64_t D = c->hidden_size, E = c->num_experts, Fe = c->moe_intermediate_size;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        mrl_layer_matrix mats[7];
        mrl_layer_matrices(c, (layer_params *)&m->lp[l], mats);
        for (int i = 0; i < 7; i++)
            if (mats[i].w) r[k][0] = mats[i].w - m->params, r[k][1] = r[k][0] + mats[i].N * mats[i].K, k++;
        const float *experts[3] = {m->lp[l].ewg, m->lp[l].ewu, m->lp[l].ewd};
        for (int i = 0; i < 3; i++)
            if (experts[i]) r[k][0] = experts[i] - m->params, r[k][1] = r[k][0] + E * Fe * D, k++;
    }
    if (!c->tie_word_embeddings) r[k][0] = m->lm_head - m->params, r[k][1] = r[k][0] + (int64_t)c->vocab_size * D, k++;
    *n = k;
    return r;
}

static int inside(int64_t (*r)[2], int n, int64_t lo, int64_t hi) {
    for (int i = 0; i < n; i++)
        if (r[i][0] <= lo && hi <= r[i][1]) return 1;
    return 0;
}

void mrl_model_copy_free(mrl_model_copy *c) {
    if (!c) return;
    mrl_mem_region_free(c->f32);
    mrl_buffer_free(&c->w16);
    mrl_buffer_free(&c->p16);
    free(c->keep);
    free(c);
}

mrl_status mrl_model_copy_create(mrl_model *m, int flags, mrl_model_copy **out) {
    if (!m || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_copy_create: NULL argument");
    if (!m->p_region) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_copy_create: the model is not sharded");
    int bf16 = m->dtype == MRL_MODEL_BF16 && !(flags & MRL_MODEL_COPY_FP32), panels = flags & MRL_MODEL_COPY_PANELS;
    mrl_model_copy *c = calloc(1, sizeof *c);
    int n_mat = 0, nv = mrl_model_num_views(m);
    int64_t (*mat)[2] = bf16 ? bf16_matrices(m, &n_mat) : NULL; /* fp32: no matrix in bf16 */
    if (!c || (bf16 && !mat) || !(c->keep = malloc(sizeof *c->keep * (size_t)(nv > 0 ? nv : 1)))) {
        free(mat);
        mrl_model_copy_free(c);
        return mrl_set_error(MRL_ERR_NOMEM, "model copy: no memory for its tables");
    }
    c->m = m;
    for (int i = 0; i < nv; i++) { /* every view outside the matrices: read in fp32 */
        mrl_param_view v;
        mrl_model_view(m, i, &v);
        if (inside(mat, n_mat, v.offset, v.offset + v.numel)) continue;
        if (c->n_keep && c->keep[c->n_keep - 1][1] == v.offset)
            c->keep[c->n_keep - 1][1] += v.numel;
        else
            c->keep[c->n_keep][0] = v.offset, c->keep[c->n_keep][1] = v.offset + v.numel, c->n_keep++;
    }
    free(mat);
    mrl_status st = mrl_device_region_create(m->device, 4 * m->n_params, MRL_MEM_PARAMS, &c->f32);
    for (int i = 0; !st && i < c->n_keep; i++) st = mrl_mem_region_pin(c->f32, 4 * c->keep[i][0], 4 * c->keep[i][1]);
    if (!st && bf16 && mrl_buffer_alloc(m->device, sizeof(uint16_t) * (size_t)m->n_params, MRL_MEM_PARAMS, &c->w16))
        st = mrl_set_error(MRL_ERR_NOMEM, "no memory for the bf16 copy of %lld parameters", (long long)m->n_params);
    if (!st && bf16 && panels && mrl_buffer_alloc(m->device, (size_t)mrl_model_panels16_bytes(m), MRL_MEM_PARAMS, &c->p16))
        st = mrl_set_error(MRL_ERR_NOMEM, "no memory for the bf16 weight panels (%lld bytes)",
                           (long long)mrl_model_panels16_bytes(m));
    if (st) {
        mrl_model_copy_free(c);
        return mrl_wrap_error(st, "the engine's copy of a sharded model");
    }
    *out = c;
    return MRL_OK;
}

mrl_status mrl_model_copy_refresh(mrl_model_copy *c) {
    if (!c) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_copy_refresh: NULL copy");
    mrl_model *m = c->m;
    int L = m->cfg.num_hidden_layers;
    /* the forward's parts: the embedding, each layer, the final norm and head */
    int64_t *cut = malloc(sizeof *cut * ((size_t)L + 3));
    if (!cut) return mrl_set_error(MRL_ERR_NOMEM, "model copy: no memory");
    cut[0] = 0;
    for (int l = 0; l < L; l++) cut[l + 1] = m->lp[l].ln1 - m->params;
    cut[L + 1] = m->final_norm - m->params, cut[L + 2] = m->n_params;
    float *f32 = mrl_mem_region_base(c->f32);
    mrl_status st = MRL_OK;
    for (int p = 0; p < L + 2 && !st; p++) { /* each part gathered, the next one's gather started */
        int64_t lo = cut[p], hi = cut[p + 1];
        if ((st = mrl_model_use(m, lo, hi, hi, p + 2 < L + 3 ? cut[p + 2] : hi))) break;
        if (c->w16.data) mrl_model_bf16_convert_range(m, m->params, c->w16.data, lo, hi);
        for (int i = 0; i < c->n_keep && !st; i++) {
            int64_t a = c->keep[i][0] > lo ? c->keep[i][0] : lo, b = c->keep[i][1] < hi ? c->keep[i][1] : hi;
            if (b > a) st = mrl_device_memcpy(f32 + a, m->params + a, sizeof(float) * (size_t)(b - a));
        }
        mrl_model_unuse(m, lo, hi);
    }
    free(cut);
    if (st) return mrl_wrap_error(st, "refreshing the engine's copy of a sharded model");
    if (c->p16.data) mrl_model_bf16_pack_panels(m, c->w16.data, c->p16.data);
    return MRL_OK;
}

const float *mrl_model_copy_params(const mrl_model_copy *c) { return c ? mrl_mem_region_base(c->f32) : NULL; }
const uint16_t *mrl_model_copy_bf16(const mrl_model_copy *c) { return c ? c->w16.data : NULL; }
const uint32_t *mrl_model_copy_panels(const mrl_model_copy *c) { return c ? c->p16.data : NULL; }

int64_t mrl_model_copy_bytes(const mrl_model_copy *c) {
    return c ? mrl_mem_region_resident(c->f32) + (int64_t)c->w16.bytes + (int64_t)c->p16.bytes : 0;
}
