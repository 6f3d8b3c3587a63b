/* The whole model's forward and backward over a packed batch, and the
 * activation buffer they use.
 *
 *   x0 = embed[tokens]; x_{l+1} = layer_l(x_l); lnf = rmsnorm(x_L)
 *   per token chunk: logits = lnf W_lm^T / temperature -> logprob, entropy, lse
 *   values = lnf score^T
 * The backward recomputes each chunk's logits but the last one's, still in
 * the buffer from the forward (a batch of one chunk: none). With
 * dtype bf16 (moonrl/model.h) the products read the weights' bf16 copies,
 * refreshed here first when stale; the value head stays fp32 (one column). */
#include <math.h>
#include <string.h>
#include "moonrl/mem.h"
#include "model_internal.h"
#include "base/error.h"
#include "runtime/device_internal.h"

/* The logits one head chunk holds by default: the memory the backward
 * spends to recompute fewer of them. 128 MiB holds a whole batch of 1,024
 * tokens at a 32k vocabulary (no product recomputed) and 220 tokens at a
 * 152k one; a larger budget shortened the training step for a few percent
 * more peak memory (bench/RESULTS.md, "The head's logits budget"). */
#define HEAD_LOGITS_BYTES ((int64_t)128 << 20)

/* Carve the activation buffer (base NULL: only count). Returns bytes. (pp.c carves a slot's again.) */
int64_t mrl_model_layout_acts(mrl_model *m, int64_t T, char *base) {
    const mrl_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, F = c->intermediate_size, hd = c->head_dim, Hq = c->num_attention_heads,
            Hk = c->num_key_value_heads, Q = Hq * hd, K = Hk * hd, V = c->vocab_size;
    int L = c->num_hidden_layers, qwen3 = mrl_arch_qk_norm(c->arch);
    /* context parallel (cp.c): T is this rank's tokens; what attention reads and writes is every
     * token's rows of Hq / cp and Hk / cp heads, Tw tokens at most (a rank has T / cp, floored) */
    int cp = m->cp_size > 1 ? m->cp_size : 1;
    int64_t Tw = cp > 1 ? cp * (T + 1) : T, Qh = Q / cp, Kh = K / cp;
    /* sequence parallel (tp.c): the residual stream and the norms on Ts rows at most */
    int64_t Ts = m->tp_seq ? (T + m->tp_size - 1) / m->tp_size : T;
    /* sparse layers: their MoE buffers in place of gate, up, act (recomputing:
     * the one shared set of buffers holds both kinds when the model has both) */
    int n_moe = 0;
    for (int l = 0; l < L; l++) n_moe += mrl_model_layer_is_moe(c, l);
    int64_t A = n_moe ? T * c->num_experts_per_tok : 0, Fe = c->moe_intermediate_size;
    int64_t off = 0;
#define TAKE(ptr, type, count) MRL_LAYOUT_TAKE(base, off, ptr, type, count)
    for (int l = 0; l <= L; l++) TAKE(m->xs[l], float, Ts * D);
    layer_acts mla = {0}; /* multi-head latent attention's scratch, one for every layer (layer.c) */
    off += mrl_mla_acts_layout(c, &mla, T, base ? base + off : NULL, 2);
    for (int l = 0; l < L; l++) {
        layer_acts *a = &m->la[l];
        if (m->recompute && l > 0) {
            if (base) *a = m->la[0];
            continue;
        }
        off += mrl_mla_acts_layout(c, a, T, base ? base + off : NULL, 1);
        if (base) a->qf = mla.qf, a->kva = mla.kva, a->kr = mla.kr, a->kvb = mla.kvb;
        TAKE(a->ln1, float, Ts * D);
        TAKE(a->rstd1, float, Ts);
        if (qwen3) {
            TAKE(a->qraw, float, T * Q);
            TAKE(a->kraw, float, T * K);
            TAKE(a->rstdq, float, T * Hq);
            TAKE(a->rstdk, float, T * Hk);
        } else if (base) {
            a->qraw = a->kraw = a->rstdq = a->rstdk = NULL;
        }
        TAKE(a->q, float, Tw * Qh);
        TAKE(a->k, float, Tw * Kh);
        TAKE(a->v, float, Tw * Kh);
        TAKE(a->att, float, T * Q);
        TAKE(a->lse, float, Tw * (Hq / cp));
        if (cp > 1) TAKE(a->att_h, float, Tw * Qh);
        else if (base) a->att_h = NULL;
        TAKE(a->h, float, Ts * D);
        TAKE(a->ln2, float, Ts * D);
        TAKE(a->rstd2, float, Ts);
        int moe = m->recompute ? n_moe > 0 : mrl_model_layer_is_moe(c, l);
        int dense = m->recompute ? n_moe < L : !moe;
        if (dense) {
            TAKE(a->gate, float, T * F);
            TAKE(a->up, float, T * F);
            TAKE(a->act, float, T * F);
        } else if (base) {
            a->gate = a->up = a->act = NULL;
        }
        if (moe) off += mrl_moe_acts_layout(c, a, T, base ? base + off : NULL);
        else if (base) a->rprob = NULL;
    }
    grad_scratch *g = &m->gs;
    TAKE(g->dx, float, T * D);
    TAKE(g->dln, float, T * D);
    int64_t Fmax = n_moe < L ? T * F : 0; /* df1, df2: the larger of [T,F] and [A,Fe] */
    if (A * Fe > Fmax) Fmax = A * Fe;
    if (n_moe && T * c->n_shared_experts * Fe > Fmax) Fmax = T * c->n_shared_experts * Fe; /* (DeepSeek's shared experts) */
    TAKE(g->df1, float, Fmax);
    TAKE(g->df2, float, Fmax);
    if (n_moe) {
        TAKE(g->dye, float, A * D);
        TAKE(g->dlogit, float, T * c->num_experts);
    }
    TAKE(g->datt, float, T * Q);
    TAKE(g->dq, float, T * Q);
    TAKE(g->dk, float, T * K);
    TAKE(g->dv, float, T * K);
    if (qwen3) TAKE(g->dk2, float, T * K);
    if (mrl_model_is_mla(c)) { /* (layer.c's mla_backward) */
        int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim, rq = c->q_lora_rank,
                rkv = c->kv_lora_rank;
        TAKE(g->mla_datt, float, T * Hq * dv);
        TAKE(g->mla_dqf, float, T * Hq * (dn + dr));
        TAKE(g->mla_dkvb, float, T * Hq * (dn + dv));
        TAKE(g->mla_dkr, float, T * dr);
        TAKE(g->mla_dcn, float, T * rkv);
        TAKE(g->mla_dc, float, T * rkv);
        TAKE(g->mla_dkva, float, T * (rkv + dr));
        TAKE(g->mla_dqan, float, T * rq);
        TAKE(g->mla_dqa, float, T * rq);
    }
    if (qwen3 && m->tp_size > 1) TAKE(g->dnorm, float, 2 * c->head_dim);
    if (cp > 1) {
        TAKE(g->cp_datt, float, Tw * Qh);
        TAKE(g->cp_dq, float, Tw * Qh);
        TAKE(g->cp_dk, float, Tw * Kh);
        TAKE(g->cp_dv, float, Tw * Kh);
        TAKE(g->cp_pack, float, T * Q);
        TAKE(m->cp_out, float, (1 + cp) * (T + 1));
    } else if (base) {
        g->cp_datt = g->cp_dq = g->cp_dk = g->cp_dv = g->cp_pack = m->cp_out = NULL;
    }
    /* LoRA (lora.c): one scratch for every layer's forward (u) and the backward's du beside it */
    int64_t lora = mrl_model_lora_scratch(m, T);
    /* (and with dropout a masked input: the widest of the adapted products' inputs, rows of the
     * experts' too) */
    int64_t widest = D > Q ? D : Q, xd_n = 0;
    if (F > widest) widest = F;
    if (lora && m->lora->cfg.dropout > 0) xd_n = T * widest > A * (D > Fe ? D : Fe) ? T * widest : A * (D > Fe ? D : Fe);
    if (lora) {
        float *u = NULL;
        TAKE(u, float, lora);
        TAKE(g->lora_du, float, lora);
        if (xd_n) TAKE(m->lora_xd, float, xd_n);
        else if (base) m->lora_xd = NULL;
        for (int l = 0; base && l < L; l++) m->la[l].lora_u = u, m->la[l].lora_xd = m->lora_xd;
    } else if (base) {
        g->lora_du = NULL;
        m->lora_xd = NULL;
        for (int l = 0; l < L; l++) m->la[l].lora_u = NULL, m->la[l].lora_xd = NULL;
    }
    if (m->tp_seq) {
        TAKE(g->sp_full, float, T * D);
        TAKE(g->sp_stage, float, (1 + m->tp_size) * Ts * D);
        TAKE(g->sp_loc, float, Ts * D);
        TAKE(g->sp_dw, float, D);
    } else if (base) {
        g->sp_full = g->sp_stage = g->sp_loc = g->sp_dw = NULL;
    }
    TAKE(m->lnf, float, T * D);
    TAKE(m->rstdf, float, T);
    TAKE(m->head_lse, float, T);
    TAKE(m->head_ent, float, T);
    if (m->tp_vocab) { /* (tp.c) */
        TAKE(m->tp_stats, float, 3 * T * (1 + m->tp_size));
        TAKE(m->tp_ids, int32_t, T);
    } else if (base) {
        m->tp_stats = NULL, m->tp_ids = NULL;
    }
    /* default: HEAD_LOGITS_BYTES of logits, but at least 128 tokens (a
     * matrix product with fewer rows is slow and rereads the whole lm_head
     * gradient) */
    int64_t chunk = m->head_chunk_setting > 0 ? m->head_chunk_setting : HEAD_LOGITS_BYTES / ((int64_t)sizeof(float) * V);
    if (m->head_chunk_setting <= 0 && chunk < 128) chunk = 128;
    if (chunk > T) chunk = T;
    if (base) m->head_chunk = chunk;
    TAKE(m->logits, float, chunk * V);
    if (m->dtype == MRL_MODEL_BF16) TAKE(m->logits16, uint16_t, chunk * V); /* the backward's dlogits in bf16 */
    else if (base) m->logits16 = NULL;
    TAKE(m->pos, int32_t, T);
    TAKE(m->targets, int32_t, T);
    if (m->k->on_device) { /* the batch's copies (context parallel: every token's, Tw at most) and the
                            * per-token values to and from the host */
        TAKE(m->dev_tokens, int32_t, Tw);
        TAKE(m->dev_cu_seqlens, int32_t, Tw + 1);
        TAKE(m->dev_prefix, int32_t, Tw);
        for (int i = 0; i < 3; i++) TAKE(m->dev_io[i], float, T);
    }
    if (n_moe) TAKE(m->route_used, int16_t, T * n_moe * c->num_experts_per_tok); /* mrl_model_get_routing */
    if (m->mtp_weight > 0) off += mrl_mtp_acts_layout(m, T, base ? base + off : NULL); /* (mtp.c) */
#undef TAKE
    return off;
}

/* The rows of each of a batch's head chunks: at most head_chunk, and as
 * even as their count allows (1,024 tokens at most 262 a chunk: 4 of 256,
 * not 3 of 262 and one of 238), so that the last one, whose logits the
 * backward reuses, saves as much as any. */
static int64_t head_rows(const mrl_model *m, int64_t T) {
    int64_t chunks = (T + m->head_chunk - 1) / m->head_chunk;
    return chunks > 1 ? (T + chunks - 1) / chunks : m->head_chunk;
}

int64_t mrl_model_activation_bytes(const mrl_model *m, int64_t n_tokens) {
    if (!m || n_tokens <= 0) return 0;
    mrl_model tmp = *m; /* layout_acts writes head_chunk only with a base */
    return mrl_model_layout_acts(&tmp, n_tokens, NULL);
}

void mrl_model_set_head_chunk(mrl_model *m, int64_t tokens) {
    if (!m) return;
    mrl_model_release_activations(m);
    m->head_chunk_setting = tokens > 0 ? tokens : 0;
}

void mrl_model_release_activations(mrl_model *m) {
    if (!m) return;
    mrl_buffer_free(&m->act_mem);
    mrl_mem_free(m->xs);
    mrl_mem_free(m->la);
    mrl_mem_free(m->host_pos_targets);
    m->host_pos_targets = NULL;
    m->act_buf = NULL;
    m->xs = NULL;
    m->la = NULL;
    m->act_tokens = 0;
    m->have_forward = 0;
}

static mrl_status ensure_acts(mrl_model *m, int64_t T) {
    if (m->act_buf && m->act_tokens >= T) return MRL_OK;
    mrl_model_release_activations(m);
    int L = m->cfg.num_hidden_layers;
    m->xs = mrl_mem_alloc(sizeof(float *) * (L + 1), MRL_MEM_OTHER);
    m->la = mrl_mem_alloc(sizeof(layer_acts) * L, MRL_MEM_OTHER);
    int64_t bytes = mrl_model_layout_acts(m, T, NULL);
    if (m->xs && m->la && mrl_buffer_alloc(m->device, (size_t)bytes, MRL_MEM_ACTIVATIONS, &m->act_mem) == MRL_OK)
        m->act_buf = m->act_mem.data;
    if (m->act_buf && m->k->on_device) { /* positions and targets (and tp_ids) are computed on the host */
        m->host_pos_targets = mrl_mem_alloc(sizeof(int32_t) * (m->tp_vocab ? 3 : 2) * T, MRL_MEM_ACTIVATIONS);
        if (!m->host_pos_targets) m->act_buf = NULL;
    }
    if (!m->act_buf) {
        mrl_model_release_activations(m);
        return mrl_wrap_error(MRL_ERR_NOMEM, "model: no memory for the activations of %lld tokens (%lld bytes)",
                             (long long)T, (long long)bytes);
    }
    mrl_model_layout_acts(m, T, m->act_buf);
    m->act_tokens = T;
    return MRL_OK;
}

static mrl_status check_batch(const mrl_model *m, const mrl_batch *b, int64_t *max_len) {
    if (!b || !b->cu_seqlens || (!b->tokens && b->n_tokens > 0))
        return mrl_set_error(MRL_ERR_INVALID, "model forward: batch, tokens and cu_seqlens must not be NULL");
    /* no tokens here: where the forward and backward are collectives of the ranks (expert
     * parallelism, a sharded model's gathers, its gradients' reduce-scatters), this rank still
     * takes its part in them for the others (model.h) */
    if ((m->ep || m->gather_start || m->grad_acquire) && b->n_tokens == 0 && b->n_seqs == 0 && b->cu_seqlens[0] == 0) {
        *max_len = 0;
        return MRL_OK;
    }
    if (b->n_tokens <= 0 || b->n_seqs <= 0 || b->n_tokens > ((int64_t)1 << 31) - 1)
        return mrl_set_error(MRL_ERR_INVALID, "model forward: n_tokens = %lld, n_seqs = %d (both must be > 0)",
                             (long long)b->n_tokens, b->n_seqs);
    if (b->cu_seqlens[0] != 0 || b->cu_seqlens[b->n_seqs] != b->n_tokens)
        return mrl_set_error(MRL_ERR_INVALID, "model forward: cu_seqlens must start at 0 and end at n_tokens = %lld (got %d .. %d)",
                             (long long)b->n_tokens, b->cu_seqlens[0], b->cu_seqlens[b->n_seqs]);
    *max_len = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        int64_t len = (int64_t)b->cu_seqlens[s + 1] - b->cu_seqlens[s];
        if (len < 0)
            return mrl_set_error(MRL_ERR_INVALID, "model forward: cu_seqlens decreases at sequence %d", s);
        if (b->prefix && b->prefix[s] >= 0) {
            int p = b->prefix[s];
            if (p >= s || b->prefix[p] >= 0)
                return mrl_set_error(MRL_ERR_INVALID, "model forward: prefix[%d] = %d must name an earlier sequence "
                                     "that has no prefix itself", s, p);
            len += (int64_t)b->cu_seqlens[p + 1] - b->cu_seqlens[p]; /* positions go on from the prefix */
        } else if (b->prefix && b->prefix[s] != -1) {
            return mrl_set_error(MRL_ERR_INVALID, "model forward: prefix[%d] = %d (a sequence index or -1)", s,
                                 b->prefix[s]);
        }
        if (len > *max_len) *max_len = len;
    }
    int V = mrl_model_whole_vocab(m);
    for (int64_t i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= V)
            return mrl_set_error(MRL_ERR_INVALID, "model forward: token %d at position %lld is outside the vocabulary (0..%d)",
                                 b->tokens[i], (long long)i, V - 1);
        if (b->targets && (b->targets[i] < -1 || b->targets[i] >= V))
            return mrl_set_error(MRL_ERR_INVALID, "model forward: target %d at position %lld is outside -1..%d",
                                 b->targets[i], (long long)i, V - 1);
    }
    return MRL_OK;
}

/* logits [n,V] = x[n,D] W_lm^T of one head chunk: in bf16, x rounded on
 * its way in and the lm_head's bf16 copy, fp32 sums (the softmax, log-probs
 * and entropy after it stay fp32). */
static void head_logits(mrl_model *m, const float *x, int64_t n) {
    int64_t D = m->cfg.hidden_size, V = m->cfg.vocab_size;
    if (m->dtype == MRL_MODEL_BF16)
        m->k->gemm_bf16(0, 1, n, V, D, 1.0f, x, 0, D, m->lm_head16, 1, D, 0.0f, m->logits, V);
    else
        m->k->gemm(0, 1, n, V, D, 1.0f, x, D, m->lm_head, D, 0.0f, m->logits, V);
}

mrl_status mrl_model_forward(mrl_model *m, const mrl_batch *b, float temperature, float *logprobs,
                             float *entropy, float *values) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "model forward: NULL model");
    if (!(temperature > 0)) return mrl_set_error(MRL_ERR_INVALID, "model forward: temperature %g must be > 0", temperature);
    if (values && !m->score) return mrl_set_error(MRL_ERR_INVALID, "model forward: values asked of a model without value head");
    int64_t max_len = 0, cp0 = 0; /* context parallel: this rank's tokens start at cp0 */
    mrl_status st = check_batch(m, b, &max_len);
    int64_t T = st ? 0 : b->n_tokens; /* this rank's tokens: all of them, or its share (cp.c); (b may be NULL) */
    if (!st && m->cp_size > 1) /* (fewer tokens than ranks: some have none, and still take part) */
        T = mrl_model_cp_share(m->cp_rank, m->cp_size, b->n_tokens, &cp0);
    if (!st) st = mrl_moe_check_routing(m, b);
    if (!st) st = ensure_acts(m, T > 0 ? T : 1);
    if (!st) st = mrl_model_rope_prepare(m, max_len);
    if (!st) mrl_lora_begin_forward(m); /* (a training forward: LoRA's dropout, its masks) */
    if (!st) st = mrl_model_refresh_bf16(m); /* bf16: the copies of weights changed since the last use */
    if (st) return st;
    const mrl_model_config *c = &m->cfg;
    const mrl_kernels *k = m->k;
    int64_t D = c->hidden_size, V = c->vocab_size;
    int cp = m->cp_size > 1;
    m->batch = *b;
    m->cp_t0 = cp0, m->cp_tl = T;
    if (m->tp_seq) m->sp_tl = mrl_model_cp_share(m->tp_rank, m->tp_size, T, &m->sp_t0); /* (tp.c) */
    m->logits_kept = 0;
    m->inv_temp = 1.0f / temperature;
    int dev = k->on_device; /* on a GPU: what the ops read goes over first */
    int32_t *pos = dev ? m->host_pos_targets : m->pos, *targets = dev ? m->host_pos_targets + T : m->targets;
    for (int s = 0; s < b->n_seqs; s++) { /* (this rank's tokens' positions: [cp0, cp0 + T)) */
        int32_t p = b->prefix ? b->prefix[s] : -1, start = p >= 0 ? b->cu_seqlens[p + 1] - b->cu_seqlens[p] : 0;
        int64_t lo = b->cu_seqlens[s] > cp0 ? b->cu_seqlens[s] : cp0;
        int64_t hi = b->cu_seqlens[s + 1] < cp0 + T ? b->cu_seqlens[s + 1] : cp0 + T;
        for (int64_t i = lo; i < hi; i++) pos[i - cp0] = (int32_t)(start + i - b->cu_seqlens[s]);
    }
    for (int64_t i = 0; i < T; i++) targets[i] = b->targets ? b->targets[cp0 + i] : -1;
    int32_t *ids = dev ? m->host_pos_targets + 2 * T : m->tp_ids;
    if (m->tp_vocab) { /* as this rank's slice reads them (tp.c) */
        mrl_model_tp_targets(m, targets, targets, T);
        mrl_model_tp_ids(m, b->tokens + cp0, ids, T);
    }
    m->op_tokens = b->tokens, m->op_cu_seqlens = b->cu_seqlens, m->op_prefix = b->prefix;
    if (dev) {
        int64_t ints = (int64_t)sizeof(int32_t);
        st = k->to_device(m->pos, pos, ints * T);
        if (!st) st = k->to_device(m->targets, targets, ints * T);
        if (!st && m->tp_vocab) st = k->to_device(m->tp_ids, ids, ints * T);
        if (!st) st = k->to_device(m->dev_tokens, b->tokens, ints * b->n_tokens); /* (every token: op_tokens + cp0) */
        if (!st) st = k->to_device(m->dev_cu_seqlens, b->cu_seqlens, ints * (b->n_seqs + 1));
        if (!st && b->prefix) st = k->to_device(m->dev_prefix, b->prefix, ints * b->n_seqs);
        if (st) return st;
        m->op_tokens = m->dev_tokens, m->op_cu_seqlens = m->dev_cu_seqlens;
        m->op_prefix = b->prefix ? m->dev_prefix : NULL;
    }
    /* sharded parameters (shard.c): each part gathered into place just before it is read, the
     * next one's gather started meanwhile, and let go after (nothing happens otherwise) */
    int L = c->num_hidden_layers;
    int64_t embed_end = m->lp[0].ln1 - m->params, layers_end = mrl_model_layers_end(m);
    mrl_model_head_unkeep(m); /* (a forward's that no backward took) */
    if ((st = mrl_model_use(m, 0, embed_end, embed_end, L > 1 ? m->lp[1].ln1 - m->params : layers_end))) {
        m->have_forward = 0; /* (no backward through a forward that did not run) */
        return st;
    }
    if (!mrl_model_has_embed(m)) { /* pipeline parallel: the stage before's output rows (pp.c) */
        if (!m->pp_in) {
            m->have_forward = 0;
            return mrl_set_error(MRL_ERR_INVALID, "model forward: pipeline stage %d has no input (mrl_model_pp_set_input)",
                                 m->pp_stage);
        }
        int64_t bytes = (int64_t)sizeof(float) * (m->tp_seq ? m->sp_tl : T) * D; /* (host rows: a GPU's copied over) */
        if (k->on_device) st = k->to_device(m->xs[0], m->pp_in, bytes);
        else k->copy(m->xs[0], m->pp_in, bytes);
        m->pp_in = NULL; /* (one forward's) */
        if (st) {
            m->have_forward = 0;
            return st;
        }
    } else if (m->tp_seq) { /* this rank's vocabulary rows, summed into each rank's token rows (tp.c) */
        mrl_model_tp_embed_rows(m, m->gs.sp_full, m->embed, m->tp_ids, T);
        mrl_model_sp_reduce_scatter(m, m->gs.sp_full, m->xs[0]);
    } else if (m->tp_vocab) mrl_model_tp_embed(m, m->xs[0], m->embed, m->tp_ids, T); /* (tp.c) */
    else k->gather_rows(m->xs[0], m->embed, m->op_tokens + cp0, T, D); /* [T,D] */
    mrl_model_unuse(m, 0, embed_end);
    if (m->aux_picks) { /* the load-balancing statistics, summed over the sparse layers (a pipeline
                         * stage's continuing the stages before's sums: one process's order) */
        if (m->aux_in_set) memcpy(m->aux_picks, m->aux_in, sizeof(double) * 2 * c->num_experts);
        else memset(m->aux_picks, 0, sizeof(double) * 2 * c->num_experts);
        m->aux_n = m->aux_in_set ? (int64_t)m->aux_in[2 * c->num_experts] : 0;
        m->aux_in_set = 0;
    }
    m->replayed = m->replay_differ = 0;
    mrl_moe_ep_begin(m);
    for (int l = 0, ord = 0; l < c->num_hidden_layers; l++) {
        int64_t lo, hi;
        mrl_model_layer_range(m, l, &lo, &hi);
        int64_t next_hi = l + 2 < L ? m->lp[l + 2].ln1 - m->params : l + 1 < L ? layers_end : m->n_params;
        if ((st = mrl_model_use(m, lo, hi, hi, next_hi))) { /* (the one after it: the head's last) */
            m->have_forward = 0;
            return st;
        }
        mrl_layer_forward(m, l, T);
        mrl_model_unuse(m, lo, hi);
        if (!m->lp[l].router) continue;
        if (c->arch != MRL_ARCH_DEEPSEEK_V3) mrl_moe_aux_add(m, &m->la[l], T); /* (a softmax router's statistics) */
        mrl_moe_record(m, &m->la[l], T, ord++); /* what the layer used, before recompute reuses la */
    }
    if (m->aux_picks) mrl_moe_aux_finish(m);
    if ((st = mrl_moe_ep_status(m)) || (st = mrl_model_tp_status(m))) { /* no backward through it */
        m->have_forward = 0;
        return st;
    }
    if (!mrl_model_has_head(m)) { /* pipeline parallel: the output is xs[L], for the next stage (pp.c) */
        if ((st = k->sync())) return st;
        m->have_forward = 1;
        return MRL_OK;
    }
    /* the final norm and head (a tied head is the embedding) */
    if ((st = mrl_model_use(m, layers_end, m->n_params, 0, 0)) ||
        (c->tie_word_embeddings && (st = mrl_model_use(m, 0, embed_end, 0, 0)))) {
        m->have_forward = 0;
        return st;
    }
    /* sharded: kept in use for the backward, which starts with it (FSDP's root module, not
     * resharded after its forward); the next forward lets it go if no backward came */
    m->head_kept = m->p_region != NULL;
    if (m->tp_seq) { /* this rank's rows, gathered: the head reads every token (tp.c) */
        k->rmsnorm_fwd(m->lnf + m->sp_t0 * D, m->rstdf, m->xs[L], m->final_norm, m->sp_tl, (int)D,
                       (float)c->rms_norm_eps);
        mrl_model_sp_gather(m, m->lnf + m->sp_t0 * D, m->lnf);
        if ((st = mrl_model_tp_status(m))) {
            m->have_forward = 0;
            return st;
        }
    } else {
        k->rmsnorm_fwd(m->lnf, m->rstdf, m->xs[L], m->final_norm, T, (int)D, (float)c->rms_norm_eps);
    }
    /* the outputs, in the table's memory (on a GPU: copied back at the end) */
    float *lp_out = logprobs && dev ? m->dev_io[0] : logprobs, *val_out = values && dev ? m->dev_io[2] : values;
    if (cp) /* this rank's tokens' outputs, in dx (free in the forward), gathered at the end */
        lp_out = logprobs ? m->gs.dx : NULL, val_out = values ? m->gs.dx + T : NULL;
    /* vocabulary-parallel (tp.c): the statistics of this rank's slice, [lse | entropy | logprob] */
    float *lse = m->tp_vocab ? m->tp_stats : m->head_lse, *ent = m->tp_vocab ? m->tp_stats + T : m->head_ent;
    int64_t rows = head_rows(m, T);
    for (int64_t c0 = 0; c0 < T; c0 += rows) {
        int64_t n = T - c0 < rows ? T - c0 : rows;
        head_logits(m, m->lnf + c0 * D, n); /* [n,V] */
        /* logprob goes to a scratch row when not wanted: dx is free during the forward */
        float *lp = m->tp_vocab ? m->tp_stats + 2 * T + c0 : lp_out ? lp_out + c0 : m->gs.dx;
        k->head_fwd(m->logits, n, (int)V, m->inv_temp, m->targets + c0, lse + c0, ent + c0, lp);
        if (m->head_tap) m->head_tap(m->head_tap_ctx, m->logits, lse + c0, c0, n, V);
    }
    if (m->tp_vocab && (st = mrl_model_tp_head_stats(m, m->tp_stats, m->tp_stats + 3 * T, b->targets ? b->targets + cp0 : NULL,
                                                     T, m->head_lse, m->head_ent, b->targets ? lp_out : NULL))) {
        m->have_forward = 0;
        return st;
    }
    if (m->tp_vocab && lp_out && !b->targets) k->zero(lp_out, (int64_t)sizeof(float) * T);
    if (values) k->gemm(0, 1, T, 1, D, 1.0f, m->lnf, D, m->score, D, 0.0f, val_out, 1); /* [T,1] */
    if (m->mtp_weight > 0 && (st = mrl_mtp_forward(m, T))) { /* the multi-token prediction layer (mtp.c) */
        m->have_forward = 0;
        return st;
    }
    if (cp) { /* every rank's tokens' outputs (cp.c) */
        if (logprobs) mrl_model_cp_gather(m, lp_out, logprobs);
        if (entropy) mrl_model_cp_gather(m, m->head_ent, entropy);
        if (values) mrl_model_cp_gather(m, val_out, values);
        if ((st = mrl_model_tp_status(m))) {
            m->have_forward = 0;
            return st;
        }
        entropy = logprobs = values = NULL; /* (gathered) */
    }
    int64_t floats = (int64_t)sizeof(float) * T;
    st = k->sync(); /* a GPU's first failure since the last sync (nothing on the CPU) */
    if (!st && entropy) st = k->to_host(entropy, m->head_ent, floats);
    if (!st && dev && logprobs) st = k->to_host(logprobs, lp_out, floats);
    if (!st && dev && values) st = k->to_host(values, val_out, floats);
    if (st) return st;
    /* the last head chunk's logits are still in the buffer (a batch that fits
     * one chunk: all of them): the backward, which takes the chunks last
     * first, starts from them instead of recomputing that product */
    m->logits_kept = T > 0 && m->mtp_weight <= 0; /* (the MTP's head used the buffer after) */
    m->have_forward = 1;
    return MRL_OK;
}

/* With gradient windows: the window for [lo, hi) of the layout, and the gradient pointers of
 * layer l (l < 0: the embedding, head and norms in it) pointed into it. */
static mrl_status lend(mrl_model *m, int l, int64_t lo, int64_t hi) {
    float *w = m->grad_acquire(m->grad_acquire_ctx, lo, hi - lo);
    if (!w)
        return mrl_wrap_error(MRL_ERR_NOMEM, "model backward: no gradient window for parameters [%lld, %lld)",
                              (long long)lo, (long long)hi);
    mrl_model_point_window(m, l, w, lo, hi);
    return MRL_OK;
}

/* The backward of the final norm and the head (and the value head): from the per-token
 * gradients into gs.dx [own rows, D], the head's gradients added, its range handed to the hook. */
static mrl_status head_backward(mrl_model *m, const float *dlogprobs, const float *dentropy, const float *dvalues,
                                int64_t T) {
    const mrl_model_config *c = &m->cfg;
    const mrl_kernels *k = m->k;
    int64_t D = c->hidden_size, V = c->vocab_size;
    int L = c->num_hidden_layers;
    int64_t layers_end = mrl_model_layers_end(m), embed_end = m->lp[0].ln1 - m->params;
    mrl_status st = MRL_OK;
    /* sharded parameters: the head's part (and a tied head's embedding) still in use from the
     * forward, the last layer's gather started while the head's backward runs; each layer's as
     * its backward comes, the one before it started meanwhile */
    int64_t last_lo = L > 0 ? m->lp[L - 1].ln1 - m->params : layers_end;
    if (m->head_kept) {
        m->head_kept = 0;
        mrl_model_prefetch(m, last_lo, layers_end);
    } else if ((c->tie_word_embeddings && (st = mrl_model_use(m, 0, embed_end, 0, 0))) ||
               (st = mrl_model_use(m, layers_end, m->n_params, last_lo, layers_end))) {
        return st;
    }
    int mtp = m->mtp_weight > 0 && dlogprobs; /* the MTP layer's part of dlnf first (mtp.c: it uses the scratch) */
    if (mtp) mrl_mtp_backward(m, dlogprobs, T);
    float *dlnf = m->gs.dln; /* [T,D] */
    k->zero(dlnf, (int64_t)sizeof(float) * T * D);
    int64_t rows = head_rows(m, T);
    if (dlogprobs || dentropy)
        for (int64_t t0 = T > 0 ? (T - 1) / rows * rows : -1; t0 >= 0; t0 -= rows) {
            int64_t n = T - t0 < rows ? T - t0 : rows;
            const float *x = m->lnf + t0 * D;
            if (!m->logits_kept) head_logits(m, x, n);
            m->logits_kept = 0; /* head_bwd turns them into dlogits in place */
            k->head_bwd(m->logits, n, (int)V, m->inv_temp, m->targets + t0, m->head_lse + t0, m->head_ent + t0,
                        dlogprobs ? dlogprobs + t0 : NULL, dentropy ? dentropy + t0 : NULL); /* dlogits [n,V] */
            if (m->dtype == MRL_MODEL_BF16) { /* the same two products, in bf16 (head_logits) */
                k->f32_to_bf16(m->logits, m->logits16, n * V); /* once for both */
                if (m->g_lm_head) /* (frozen: LoRA) */
                    k->gemm_bf16(1, 0, V, D, n, 1.0f, m->logits16, 1, V, x, 0, D, 1.0f, m->g_lm_head, D);
                k->gemm_bf16(0, 0, n, D, V, 1.0f, m->logits16, 1, V, m->lm_head16, 1, D, 1.0f, dlnf + t0 * D, D);
                continue;
            }
            if (m->g_lm_head) k->gemm(1, 0, V, D, n, 1.0f, m->logits, V, x, D, 1.0f, m->g_lm_head, D); /* dW [V,D] */
            k->gemm(0, 0, n, D, V, 1.0f, m->logits, V, m->lm_head, D, 1.0f, dlnf + t0 * D, D); /* dlnf [n,D] */
        }
    if (mtp) k->add(dlnf, m->mtp_dlnf, T * D);
    /* sequence parallel: this rank's rows of it (each rank's vocabulary part summed) from here */
    int64_t own = m->tp_seq ? m->sp_tl : T, r0 = m->tp_seq ? m->sp_t0 : 0;
    if (m->tp_seq) {
        if (dlogprobs || dentropy) mrl_model_sp_reduce_scatter(m, dlnf, m->gs.sp_loc);
        else k->zero(m->gs.sp_loc, (int64_t)sizeof(float) * own * D);
        dlnf = m->gs.sp_loc;
    } else if (m->tp_vocab && (dlogprobs || dentropy)) {
        mrl_model_tp_sum(m, dlnf, T * D); /* each slice's part (tp.c) */
    }
    if (dvalues) { /* (the value head's gradient from every token, the same on every rank) */
        k->gemm(1, 0, 1, D, T, 1.0f, dvalues, 1, m->lnf, D, 1.0f, m->g_score, D);         /* dscore [1,D] */
        k->gemm(0, 0, own, D, 1, 1.0f, dvalues + r0, 1, m->score, D, 1.0f, dlnf, D);     /* dlnf += dv score */
    }
    k->zero(m->gs.dx, (int64_t)sizeof(float) * own * D);
    if (m->tp_seq) { /* the norm's weight gradient of this rank's rows, summed over the group */
        k->zero(m->gs.sp_dw, (int64_t)sizeof(float) * D);
        k->rmsnorm_bwd(m->gs.dx, m->gs.sp_dw, dlnf, m->xs[L], m->final_norm, m->rstdf, own, (int)D);
        mrl_model_sp_norm_grad(m, m->g_final_norm, D);
    } else {
        k->rmsnorm_bwd(m->gs.dx, m->g_final_norm, dlnf, m->xs[L], m->final_norm, m->rstdf, T, (int)D);
    }
    mrl_model_unuse(m, layers_end, m->n_params);
    if (c->tie_word_embeddings) mrl_model_unuse(m, 0, embed_end);
    if (m->grad_hook && !m->lora) m->grad_hook(m->grad_hook_ctx, layers_end, m->n_params - layers_end);
    return MRL_OK;
}

mrl_status mrl_model_backward(mrl_model *m, const float *dlogprobs, const float *dentropy, const float *dvalues) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "model backward: NULL model");
    if (!m->have_forward) return mrl_set_error(MRL_ERR_INVALID, "model backward: no forward to go back through");
    if (dvalues && !m->score) return mrl_set_error(MRL_ERR_INVALID, "model backward: dvalues given to a model without value head");
    if (m->lora && m->grad_acquire)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "model backward: gradient windows (ZeRO-2) not yet with LoRA");
    mrl_status st = m->grad_acquire || m->lora ? MRL_OK : mrl_model_ensure_grads(m);
    if (st) return st;
    if (m->lora) /* the frozen norms' weight gradients, written beside their dx, go there (lora.c) */
        m->k->zero(m->lora->sink, (int64_t)sizeof(float) * m->lora->sink_n);
    if (m->grad_acquire && !m->grad_hook)
        return mrl_set_error(MRL_ERR_INVALID, "model backward: gradient windows without a grad hook to return them");
    const mrl_model_config *c = &m->cfg;
    const mrl_kernels *k = m->k;
    int64_t T = m->batch.n_tokens, D = c->hidden_size;
    int L = c->num_hidden_layers;
    if (m->cp_size > 1) { /* context parallel (cp.c): this rank's tokens' part of the upstream gradients */
        T = m->cp_tl;
        dlogprobs = dlogprobs ? dlogprobs + m->cp_t0 : NULL;
        dentropy = dentropy ? dentropy + m->cp_t0 : NULL;
        dvalues = dvalues ? dvalues + m->cp_t0 : NULL;
    }
    /* the buffer is embed, layer 0 .. L-1, final norm, [lm_head], [score]: each part is final once
     * its backward is done (a tied lm_head is the embedding, final at the very end) */
    int64_t layers_end = mrl_model_layers_end(m), embed_end = m->lp[0].ln1 - m->params;
    int head = mrl_model_has_head(m); /* (pipeline parallel: else the next stage's gradient of the output) */
    if (!head && !m->pp_dy)
        return mrl_set_error(MRL_ERR_INVALID, "model backward: pipeline stage %d has no output gradient "
                             "(mrl_model_pp_set_output_grad)", m->pp_stage);
    if (m->grad_acquire && head) { /* the head's range, and the embedding's now when the head is it */
        if ((st = lend(m, -1, layers_end, m->n_params))) return st;
        if (c->tie_word_embeddings && (st = lend(m, -1, 0, embed_end))) return st;
    }
    if (k->on_device) { /* the per-token gradients go over first */
        const float *host[3] = {dlogprobs, dentropy, dvalues};
        for (int i = 0; i < 3 && !st; i++)
            if (host[i]) st = k->to_device(m->dev_io[i], host[i], (int64_t)sizeof(float) * T);
        if (st) return st;
        dlogprobs = dlogprobs ? m->dev_io[0] : NULL;
        dentropy = dentropy ? m->dev_io[1] : NULL;
        dvalues = dvalues ? m->dev_io[2] : NULL;
    }
    if (m->aux_in_set) { /* a pipeline stage: the whole model's load-balancing counts (pp.c) */
        memcpy(m->aux_picks, m->aux_in, sizeof(double) * 2 * c->num_experts);
        m->aux_n = (int64_t)m->aux_in[2 * c->num_experts];
        m->aux_in_set = 0;
    }
    if (!head) { /* pipeline parallel: the next stage's gradient of this one's output rows */
        int64_t bytes = (int64_t)sizeof(float) * (m->tp_seq ? m->sp_tl : T) * D; /* (host rows: a GPU's copied over) */
        if (k->on_device) st = k->to_device(m->gs.dx, m->pp_dy, bytes);
        else k->copy(m->gs.dx, m->pp_dy, bytes);
        m->pp_dy = NULL; /* (one backward's) */
        if (st) return st;
    } else if ((st = head_backward(m, dlogprobs, dentropy, dvalues, T))) {
        return st;
    }
    mrl_moe_ep_begin(m);
    for (int l = L - 1; l >= 0; l--) {
        int64_t begin, end;
        mrl_model_layer_range(m, l, &begin, &end);
        if (m->grad_acquire && (st = lend(m, l, begin, end))) return st;
        if ((st = mrl_model_use(m, begin, end, l > 0 ? m->lp[l - 1].ln1 - m->params : 0, l > 0 ? begin : 0)))
            return st;
        if (m->recompute) mrl_layer_forward(m, l, T);
        mrl_layer_backward(m, l, T);
        mrl_model_unuse(m, begin, end);
        if (m->lora) { /* the hook names the adapters' ranges (moonrl/model.h) */
            int64_t lo = m->lora->layer_off[l], n = m->lora->layer_off[l + 1] - lo;
            if (m->grad_hook && n > 0) m->grad_hook(m->grad_hook_ctx, lo, n);
            continue;
        }
        if (m->grad_hook) m->grad_hook(m->grad_hook_ctx, begin, end - begin);
    }
    if ((st = mrl_moe_ep_status(m)) || (st = mrl_model_tp_status(m))) return st; /* the gradients are then meaningless */
    if (!mrl_model_has_embed(m)) { /* pipeline parallel: gs.dx is the stage's input gradient (pp.c) */
        if ((st = k->sync())) return st;
        if (m->grad_hook && embed_end > 0) m->grad_hook(m->grad_hook_ctx, 0, embed_end); /* (a tied head's copy) */
        return MRL_OK;
    }
    /* (a tied head lent the embedding's window already; a pipeline's first stage has no head) */
    if (m->grad_acquire && !(c->tie_word_embeddings && head) && (st = lend(m, -1, 0, embed_end))) return st;
    if (m->tp_seq) { /* every token's rows, then this rank's vocabulary rows of them (tp.c) */
        mrl_model_sp_gather(m, m->gs.dx, m->gs.sp_full);
        if ((st = mrl_model_tp_status(m))) return st;
        mrl_model_tp_embed_bwd(m, m->g_embed, m->gs.sp_full, m->tp_ids, T);
    } else if (m->tp_vocab) mrl_model_tp_embed_bwd(m, m->g_embed, m->gs.dx, m->tp_ids, T); /* this rank's rows */
    else if (m->g_embed) k->scatter_add_rows(m->g_embed, m->gs.dx, m->op_tokens + m->cp_t0, T, D); /* rows, token order */
    if ((st = k->sync())) return st; /* before the hook: the gradients are final on a GPU too */
    if (m->grad_hook && !m->lora) m->grad_hook(m->grad_hook_ctx, 0, embed_end);
    return MRL_OK;
}

/* ---- the k most likely tokens of every position (mrl_model_forward_top) ---- */

typedef struct top_ctx {
    int k;
    float inv_temp;
    int32_t *ids;
    float *lps;
    const int32_t *targets; /* the batch's (host), with ranks */
    int32_t *ranks;
} top_ctx;

/* Each row's k largest logits, best first (ties: the lower id), as log-probs under the chunk's lse. */
static void top_tap(void *vc, const float *logits, const float *lse, int64_t row0, int64_t n, int64_t V) {
    top_ctx *c = vc;
    for (int64_t r = 0; r < n; r++) {
        const float *z = logits + r * V;
        int32_t *ids = c->ids + (row0 + r) * c->k;
        float *lps = c->lps + (row0 + r) * c->k;
        int have = 0;
        for (int64_t v = 0; v < V; v++) {
            if (have == c->k && !(z[v] > z[ids[have - 1]])) continue;
            int at = have < c->k ? have++ : c->k - 1; /* the slot it takes, moved up past the smaller ones */
            while (at > 0 && z[v] > z[ids[at - 1]]) {
                ids[at] = ids[at - 1];
                at--;
            }
            ids[at] = (int32_t)v;
        }
        for (int j = 0; j < c->k; j++) lps[j] = j < have ? z[ids[j]] * c->inv_temp - lse[r] : -INFINITY;
        if (c->ranks) { /* 1 + the tokens more likely than the target (0: no target) */
            int32_t t = c->targets[row0 + r], above = 0;
            if (t >= 0 && t < V)
                for (int64_t v = 0; v < V; v++) above += z[v] > z[t];
            c->ranks[row0 + r] = t >= 0 && t < V ? above + 1 : 0;
        }
    }
}

mrl_status mrl_model_forward_top(mrl_model *m, const mrl_batch *b, float temperature, int k, float *logprobs,
                                 int32_t *top_ids, float *top_lps, int32_t *target_ranks) {
    if (!m || !b || !top_ids || !top_lps) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_forward_top: NULL argument");
    if (k < 1 || k > 20) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_forward_top: k must be in 1..20, got %d", k);
    if (m->device.kind != MRL_DEVICE_CPU || m->tp_size > 1 || m->cp_size > 1 || m->pp_stages > 1)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_forward_top: a whole model on the CPU only");
    if (!(temperature > 0)) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_forward_top: temperature must be > 0");
    if (target_ranks && !b->targets)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_forward_top: target ranks need the batch's targets");
    top_ctx c = { k, 1.0f / temperature, top_ids, top_lps, b->targets, target_ranks };
    m->head_tap = top_tap;
    m->head_tap_ctx = &c;
    mrl_status st = mrl_model_forward(m, b, temperature, logprobs, NULL, NULL);
    m->head_tap = NULL;
    m->head_tap_ctx = NULL;
    return st;
}
