/* Pipeline parallel (moonrl/model.h): a stage model holds a run of the
 * whole model's layers, the first stage the embedding too, the last the
 * final norm and head. forward.c runs a stage like the whole model but for
 * its ends: a non-first stage's forward starts from the rows the stage
 * before sent (pp_in) instead of the embedding, a non-last stage's stops
 * after its layers (its output is xs[L]); its backward starts from the next
 * stage's gradient of that output (pp_dy) instead of the head's, and a
 * non-first stage's leaves its input's gradient in gs.dx. The transfers and
 * the schedule (1F1B) are the caller's: the C model only computes.
 *
 * A 1F1B stage keeps the activations of up to `stages` micro-batches whose
 * backward has not come yet: the activation slots. A slot is everything a
 * forward leaves for its backward (the activation buffer and the batch it
 * read); switching slots saves the model's into the old one and lays the
 * new one's buffer out again (the layout is a function of its token count). */
#include <string.h>
#include "base/error.h"
#include "moonrl/mem.h"
#include "model_internal.h"

typedef struct pp_slot {
    mrl_buffer act_mem;
    void *act_buf;
    int64_t act_tokens, bytes;
    float **xs;
    layer_acts *la;
    int32_t *host_pos_targets;
    mrl_batch batch;
    float inv_temp;
    int have_forward, logits_kept;
    int64_t cp_t0, cp_tl, sp_t0, sp_tl;
    const int32_t *op_tokens, *op_cu_seqlens, *op_prefix;
} pp_slot;

static void slot_save(mrl_model *m, pp_slot *s) {
    *s = (pp_slot){m->act_mem, m->act_buf, m->act_tokens, 0, m->xs, m->la, m->host_pos_targets, m->batch,
                   m->inv_temp, m->have_forward, m->logits_kept, m->cp_t0, m->cp_tl, m->sp_t0, m->sp_tl,
                   m->op_tokens, m->op_cu_seqlens, m->op_prefix};
    if (m->act_buf) s->bytes = mrl_model_layout_acts(m, m->act_tokens, NULL); /* (what its buffer was laid out for) */
}

static void slot_load(mrl_model *m, const pp_slot *s) {
    m->act_mem = s->act_mem, m->act_buf = s->act_buf, m->act_tokens = s->act_tokens;
    m->xs = s->xs, m->la = s->la, m->host_pos_targets = s->host_pos_targets;
    m->batch = s->batch, m->inv_temp = s->inv_temp, m->have_forward = s->have_forward, m->logits_kept = s->logits_kept;
    m->cp_t0 = s->cp_t0, m->cp_tl = s->cp_tl, m->sp_t0 = s->sp_t0, m->sp_tl = s->sp_tl;
    m->op_tokens = s->op_tokens, m->op_cu_seqlens = s->op_cu_seqlens, m->op_prefix = s->op_prefix;
    if (!m->act_buf) return;
    if (mrl_model_layout_acts(m, m->act_tokens, NULL) != s->bytes) /* a setting changed the layout since */
        mrl_model_release_activations(m);
    else
        mrl_model_layout_acts(m, m->act_tokens, m->act_buf);
}

void mrl_model_pp_free_slots(mrl_model *m) {
    if (m->pp_nslots) slot_save(m, &m->pp_slots[m->pp_slot]); /* (the model's own: kept, the others freed) */
    for (int i = 0; i < m->pp_nslots; i++) {
        if (i == m->pp_slot) continue; /* (the model's own: mrl_model_release_activations) */
        slot_load(m, &m->pp_slots[i]);
        mrl_model_release_activations(m);
    }
    if (m->pp_nslots) slot_load(m, &m->pp_slots[m->pp_slot]);
    mrl_mem_free(m->pp_slots);
    m->pp_slots = NULL;
    m->pp_nslots = m->pp_slot = 0;
}

mrl_status mrl_model_pp_slots(mrl_model *m, int n) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_slots: NULL model");
    if (n < 1 || n > 4096) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_slots: %d slots (1 .. 4096)", n);
    if (n == m->pp_nslots) return MRL_OK;
    pp_slot *s = mrl_mem_alloc(sizeof(pp_slot) * (size_t)n, MRL_MEM_OTHER); /* zeroed: no activations yet */
    if (!s) return mrl_wrap_error(MRL_ERR_NOMEM, "model: %d activation slots", n);
    if (m->pp_nslots) { /* the first n kept (the model's own in slot 0), the rest freed */
        mrl_model_pp_use_slot(m, 0);
        for (int i = n; i < m->pp_nslots; i++) {
            slot_save(m, &m->pp_slots[0]);
            slot_load(m, &m->pp_slots[i]);
            mrl_model_release_activations(m);
            slot_load(m, &m->pp_slots[0]);
        }
        memcpy(s, m->pp_slots, sizeof(pp_slot) * (size_t)(n < m->pp_nslots ? n : m->pp_nslots));
        mrl_mem_free(m->pp_slots);
    }
    m->pp_slots = s;
    m->pp_nslots = n;
    m->pp_slot = 0;
    return MRL_OK;
}

mrl_status mrl_model_pp_use_slot(mrl_model *m, int i) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_use_slot: NULL model");
    int n = m->pp_nslots ? m->pp_nslots : 1;
    if (i < 0 || i >= n) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_use_slot: slot %d of %d", i, n);
    if (i == m->pp_slot) return MRL_OK;
    slot_save(m, &m->pp_slots[m->pp_slot]);
    slot_load(m, &m->pp_slots[i]);
    m->pp_slot = i;
    return MRL_OK;
}

int mrl_model_pp(const mrl_model *m, mrl_model_stage *out) {
    int n = m && m->pp_stages > 1 ? m->pp_stages : 1;
    if (out && m) {
        *out = (mrl_model_stage){m->pp_stage, n, m->pp_l0, m->cfg.num_hidden_layers};
    }
    return n;
}

int mrl_model_pp_layers(const mrl_model *m) {
    return !m ? 0 : m->pp_stages > 1 ? m->pp_whole.num_hidden_layers : m->cfg.num_hidden_layers;
}

int64_t mrl_model_pp_rows(const mrl_model *m, const mrl_batch *b) {
    if (!m || !b) return 0;
    int64_t T = b->n_tokens, t0;
    if (m->cp_size > 1) T = mrl_model_cp_share(m->cp_rank, m->cp_size, T, &t0);
    if (m->tp_seq) T = mrl_model_cp_share(m->tp_rank, m->tp_size, T, &t0);
    return T;
}

mrl_status mrl_model_pp_set_input(mrl_model *m, const float *x) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_set_input: NULL model");
    if (mrl_model_has_embed(m))
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_set_input: the first pipeline stage reads tokens");
    m->pp_in = x;
    return MRL_OK;
}

const float *mrl_model_pp_output(const mrl_model *m) {
    return m && m->have_forward && !mrl_model_has_head(m) && m->xs ? m->xs[m->cfg.num_hidden_layers] : NULL;
}

mrl_status mrl_model_pp_set_output_grad(mrl_model *m, const float *dy) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_set_output_grad: NULL model");
    if (mrl_model_has_head(m))
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_set_output_grad: the last pipeline stage starts from "
                             "the per-token gradients");
    m->pp_dy = dy;
    return MRL_OK;
}

const float *mrl_model_pp_input_grad(const mrl_model *m) {
    return m && !mrl_model_has_embed(m) && m->act_buf ? m->gs.dx : NULL;
}

/* The load-balancing statistics cross the stages with the rows (model.h): a non-first stage's
 * forward continues the sums of the stages before (so the last stage's are one process's, added
 * in the same order), and every stage's backward takes the last stage's. */
int64_t mrl_model_pp_aux_size(const mrl_model *m) {
    return m && m->pp_stages > 1 && m->aux_picks ? 2 * m->cfg.num_experts + 1 : 0;
}

mrl_status mrl_model_pp_aux_get(const mrl_model *m, double *out) {
    int64_t n = mrl_model_pp_aux_size(m);
    if (!n || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_aux_get: not a mixture of experts' pipeline stage");
    memcpy(out, m->aux_picks, sizeof(double) * (size_t)(n - 1));
    out[n - 1] = (double)m->aux_n;
    return MRL_OK;
}

mrl_status mrl_model_pp_aux_set(mrl_model *m, const double *in) {
    int64_t n = mrl_model_pp_aux_size(m);
    if (!n || !in) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_aux_set: not a mixture of experts' pipeline stage");
    if (!(in[n - 1] >= 0 && in[n - 1] <= (double)INT64_MAX / 2))
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_pp_aux_set: a token count of %g", in[n - 1]);
    memcpy(m->aux_in, in, sizeof(double) * (size_t)n);
    m->aux_in_set = 1;
    return MRL_OK;
}

mrl_status mrl_model_set_pp_group(mrl_model *m, mrl_pp_send send, mrl_pp_recv recv, void *ctx) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_pp_group: NULL model");
    if (m->pp_stages <= 1) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_pp_group: not a pipeline stage");
    m->pp_send = send, m->pp_recv = recv, m->pp_ctx = ctx;
    return MRL_OK;
}
