/* Training DeepSeek-V3's multi-token prediction layer (moonrl/model.h, mrl_model_set_mtp_loss),
 * forward and backward side by side. T tokens of packed sequences; for token t of a sequence:
 *
 *   e = embed_mtp[token t+1] (0 at position 0, and past the sequence's end), hn = lnf[t] (the
 *   final norm's output, as the head reads it)
 *   x0 = [enorm(e), hnorm(hn)] eh_proj^T ; out = layer(x0) (its own decoder layer, attention over
 *   the sequence's earlier rows of it) ; logits = head_norm(out) head^T
 *   mtp_lp[t] = log softmax(logits)[token t+2] (0 where the sequence has none)
 * backward: d mtp_lp[t] = weight * dlogprobs[t+1] (the main loss's weight of the position whose
 * target is token t+2's predecessor) back through the head, the layer, eh_proj and the two
 * norms: into the MTP weights' gradients, its embedding's rows, and m->mtp_dlnf (lnf's
 * gradient, which the head's backward adds to its own). The engine's draft computes the same
 * layer (core/engine/engine.c, mtp_pass). fp32 products for its own matrices (eh_proj, the
 * head); its layer's products as the model's dtype has them (no bf16 copies: rounded on the way). */
#include <math.h>
#include <string.h>
#include "model_internal.h"
#include "base/error.h"

mrl_status mrl_model_set_mtp_loss(mrl_model *m, double weight) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_mtp_loss: NULL model");
    if (!(weight >= 0) || !isfinite(weight))
        return mrl_set_error(MRL_ERR_INVALID, "model mtp loss weight %g: must be a finite number >= 0", weight);
    if (weight > 0) {
        const char *why = !m->mtp.eh_proj                 ? "a model without a multi-token prediction layer "
                                                            "(num_nextn_predict_layers 1)"
                          : m->k->on_device                ? "a GPU (not yet)"
                          : m->tp_size > 1                 ? "tensor parallel (not yet)"
                          : m->cp_size > 1                 ? "context parallel (not yet)"
                          : m->pp_stages > 1               ? "pipeline parallel (not yet)"
                          : m->p_region                    ? "sharded or quantized parameters (not yet)"
                          : m->grad_acquire                ? "gradient windows, ZeRO-2 (not yet)"
                          : m->lora                        ? "LoRA adapters (not yet)"
                          : m->ep                          ? "expert parallel (not yet)"
                                                           : NULL;
        if (why) return mrl_set_error(MRL_ERR_UNSUPPORTED, "model: training the MTP layer with %s", why);
    }
    if ((weight > 0) != (m->mtp_weight > 0)) mrl_model_release_activations(m); /* (its buffers come or go) */
    m->mtp_weight = weight;
    return MRL_OK;
}

double mrl_model_mtp_loss(const mrl_model *m) { return m ? m->mtp_loss : 0; }

int64_t mrl_mtp_acts_layout(mrl_model *m, int64_t T, char *base) {
    const mrl_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, Q = (int64_t)c->num_attention_heads * c->head_dim,
            K = (int64_t)c->num_key_value_heads * c->head_dim, F = c->intermediate_size, off = 0;
    layer_acts *a = &m->mtp_a;
    if (base) *a = (layer_acts){0};
#define TAKE(ptr, type, count) MRL_LAYOUT_TAKE(base, off, ptr, type, count)
    TAKE(m->mtp_e, float, T * D);
    TAKE(m->mtp_en, float, T * D);
    TAKE(m->mtp_hn, float, T * D);
    TAKE(m->mtp_cat, float, T * 2 * D);
    TAKE(m->mtp_x0, float, T * D);
    TAKE(m->mtp_out, float, T * D);
    TAKE(m->mtp_on, float, T * D);
    TAKE(m->mtp_rstd, float, 3 * T);
    TAKE(m->mtp_lp, float, T);
    TAKE(m->mtp_lse, float, T);
    TAKE(m->mtp_ent, float, T);
    TAKE(m->mtp_dlp, float, T);
    TAKE(m->mtp_dlnf, float, T * D);
    TAKE(m->mtp_next, int32_t, T);
    TAKE(m->mtp_tgt, int32_t, T);
    /* its layer's activations (layer.c's fields, one layer's worth) */
    TAKE(a->ln1, float, T * D);
    TAKE(a->rstd1, float, T);
    TAKE(a->q, float, T * Q);
    TAKE(a->k, float, T * K);
    TAKE(a->v, float, T * K);
    TAKE(a->att, float, T * Q);
    TAKE(a->lse, float, T * c->num_attention_heads);
    TAKE(a->h, float, T * D);
    TAKE(a->ln2, float, T * D);
    TAKE(a->rstd2, float, T);
    off += mrl_mla_acts_layout(c, a, T, base ? base + off : NULL, 3);
    if (mrl_model_layer_is_moe(c, c->num_hidden_layers)) {
        off += mrl_moe_acts_layout(c, a, T, base ? base + off : NULL);
    } else {
        TAKE(a->gate, float, T * F);
        TAKE(a->up, float, T * F);
        TAKE(a->act, float, T * F);
    }
#undef TAKE
    return off;
}

mrl_status mrl_mtp_forward(mrl_model *m, int64_t T) {
    const mrl_model_config *c = &m->cfg;
    const mrl_kernels *k = m->k;
    const mtp_params *w = &m->mtp;
    int64_t D = c->hidden_size, V = c->vocab_size;
    float eps = (float)c->rms_norm_eps, *rstd = m->mtp_rstd;
    const mrl_batch *b = &m->batch;
    if (b->prefix) return mrl_set_error(MRL_ERR_UNSUPPORTED, "model forward: the MTP loss with shared prompts (not yet)");
    for (int32_t s = 0; s < b->n_seqs; s++) /* each token's next and next-but-one, within its sequence */
        for (int64_t t = b->cu_seqlens[s]; t < b->cu_seqlens[s + 1]; t++) {
            m->mtp_next[t] = t + 1 < b->cu_seqlens[s + 1] ? b->tokens[t + 1] : 0;
            m->mtp_tgt[t] = t + 2 < b->cu_seqlens[s + 1] ? b->tokens[t + 2] : -1;
        }
    k->gather_rows(m->mtp_e, w->embed, m->mtp_next, T, D);
    for (int64_t t = 0; t < T; t++) /* (vLLM's MTP: no embedding at position 0; none past the end) */
        if (m->pos[t] == 0 || m->mtp_tgt[t] < 0) k->zero(m->mtp_e + t * D, (int64_t)sizeof(float) * D);
    k->rmsnorm_fwd(m->mtp_en, rstd, m->mtp_e, w->enorm, T, (int)D, eps);
    k->rmsnorm_fwd(m->mtp_hn, rstd + T, m->lnf, w->hnorm, T, (int)D, eps);
    k->copy_rows(m->mtp_cat, 2 * D, m->mtp_en, D, T, D);
    k->copy_rows(m->mtp_cat + D, 2 * D, m->mtp_hn, D, T, D);
    k->gemm(0, 1, T, D, 2 * D, 1.0f, m->mtp_cat, 2 * D, w->eh_proj, 2 * D, 0.0f, m->mtp_x0, D);
    mrl_layer_forward_io(m, &w->layer, &m->mtp_a, m->mtp_x0, m->mtp_out, T);
    k->rmsnorm_fwd(m->mtp_on, rstd + 2 * T, m->mtp_out, w->head_norm, T, (int)D, eps);
    double sum = 0;
    int64_t n_tgt = 0, rows = m->head_chunk > 0 ? m->head_chunk : T;
    /* (mtp_loss: every token's here; the backward's, over the tokens its loss weighs, replaces it) */
    for (int64_t c0 = 0; c0 < T; c0 += rows) {
        int64_t n = T - c0 < rows ? T - c0 : rows;
        k->gemm(0, 1, n, V, D, 1.0f, m->mtp_on + c0 * D, D, w->head, D, 0.0f, m->logits, V);
        k->head_fwd(m->logits, n, (int)V, 1.0f, m->mtp_tgt + c0, m->mtp_lse + c0, m->mtp_ent + c0, m->mtp_lp + c0);
    }
    for (int64_t t = 0; t < T; t++)
        if (m->mtp_tgt[t] >= 0) sum -= m->mtp_lp[t], n_tgt++;
    m->mtp_loss = n_tgt ? sum / (double)n_tgt : 0;
    m->logits_kept = 0; /* (the head's backward recomputes its last chunk: the buffer holds the MTP's) */
    return MRL_OK;
}

void mrl_mtp_backward(mrl_model *m, const float *dlogprobs, int64_t T) {
    const mrl_model_config *c = &m->cfg;
    const mrl_kernels *k = m->k;
    const mtp_params *w = &m->mtp, *g = &m->g_mtp;
    int64_t D = c->hidden_size, V = c->vocab_size, rows = m->head_chunk > 0 ? m->head_chunk : T;
    float *rstd = m->mtp_rstd, *dout = m->mtp_e; /* (free: the embeddings are read again below from next) */
    double sum = 0;
    int64_t n_w = 0;
    for (int64_t t = 0; t < T; t++) { /* the main loss's weight of the position after, on token t+2's log-prob */
        m->mtp_dlp[t] = m->mtp_tgt[t] >= 0 ? (float)(m->mtp_weight * dlogprobs[t + 1]) : 0.0f;
        if (m->mtp_dlp[t] != 0) sum -= m->mtp_lp[t], n_w++;
    }
    m->mtp_loss = n_w ? sum / (double)n_w : 0; /* (over the tokens the loss weighs) */
    k->zero(m->mtp_dlnf, (int64_t)sizeof(float) * T * D); /* d on [T,D] here first */
    for (int64_t c0 = 0; c0 < T; c0 += rows) {
        int64_t n = T - c0 < rows ? T - c0 : rows;
        const float *x = m->mtp_on + c0 * D;
        k->gemm(0, 1, n, V, D, 1.0f, x, D, w->head, D, 0.0f, m->logits, V);
        k->head_bwd(m->logits, n, (int)V, 1.0f, m->mtp_tgt + c0, m->mtp_lse + c0, m->mtp_ent + c0, m->mtp_dlp + c0,
                    NULL); /* dlogits */
        k->gemm(1, 0, V, D, n, 1.0f, m->logits, V, x, D, 1.0f, g->head, D);
        k->gemm(0, 0, n, D, V, 1.0f, m->logits, V, w->head, D, 0.0f, m->mtp_dlnf + c0 * D, D);
    }
    k->zero(m->gs.dx, (int64_t)sizeof(float) * T * D);
    k->rmsnorm_bwd(m->gs.dx, g->head_norm, m->mtp_dlnf, m->mtp_out, w->head_norm, rstd + 2 * T, T, (int)D);
    mrl_layer_backward_io(m, &w->layer, &g->layer, &m->mtp_a, m->mtp_x0, T); /* gs.dx: d x0 */
    k->gemm(1, 0, D, 2 * D, T, 1.0f, m->gs.dx, D, m->mtp_cat, 2 * D, 1.0f, g->eh_proj, 2 * D);
    k->gemm(0, 0, T, 2 * D, D, 1.0f, m->gs.dx, D, w->eh_proj, 2 * D, 0.0f, m->mtp_cat, 2 * D); /* d cat */
    k->copy_rows(m->mtp_en, D, m->mtp_cat, 2 * D, T, D);     /* d enorm's output */
    k->copy_rows(m->mtp_hn, D, m->mtp_cat + D, 2 * D, T, D); /* d hnorm's output */
    k->gather_rows(dout, w->embed, m->mtp_next, T, D); /* the embeddings again (their norm's input) */
    for (int64_t t = 0; t < T; t++)
        if (m->pos[t] == 0 || m->mtp_tgt[t] < 0) k->zero(dout + t * D, (int64_t)sizeof(float) * D);
    k->zero(m->mtp_x0, (int64_t)sizeof(float) * T * D);
    k->rmsnorm_bwd(m->mtp_x0, g->enorm, m->mtp_en, dout, w->enorm, rstd, T, (int)D); /* d e */
    for (int64_t t = 0; t < T; t++) /* (a masked row's embedding was not read: no gradient) */
        if (m->pos[t] == 0 || m->mtp_tgt[t] < 0) k->zero(m->mtp_x0 + t * D, (int64_t)sizeof(float) * D);
    k->scatter_add_rows(g->embed, m->mtp_x0, m->mtp_next, T, D);
    k->zero(m->mtp_dlnf, (int64_t)sizeof(float) * T * D);
    k->rmsnorm_bwd(m->mtp_dlnf, g->hnorm, m->mtp_hn, m->lnf, w->hnorm, rstd + T, T, (int)D);
}
