/* Tensor parallel (moonrl/model.h, Megatron's split): a rank holds the rows
 * of the column-parallel products (q, k, v, gate, up) and the columns of the
 * row-parallel ones (o_proj, down_proj) of every layer, and of each expert's
 * MLP alike (moe.c); the rest (the router too) is whole on every rank. The
 * layer (layer.c) sums the row-parallel outputs and the
 * column-parallel input gradients over the group with the model's
 * allreduce, so everything between them (norms, residual stream, head) is
 * the same on every rank; the embedding and head are split by vocabulary
 * (below). With more ranks than K/V heads, several ranks hold
 * each K/V head (tp_kv_copies) and sum their gradients of it once an
 * update's backwards are done (mrl_model_tp_sync_grads). */
#include <math.h>
#include <string.h>
#include "base/error.h"
#include "moonrl/mem.h"
#include "model_internal.h"

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* 1 by rows: q, k, v, gate, up (weights and biases: column-parallel), and the embedding and
 * head when split by vocabulary; 2 by columns: o_proj, down_proj (row-parallel); 0: whole
 * (norms, a value head; the embedding and head of a vocabulary the ranks do not divide). */
int mrl_model_tp_split(const mrl_model *m, const char *name) {
    if (!m || m->tp_size <= 1 || !name) return 0;
    if (m->tp_vocab && (strcmp(name, "model.embed_tokens.weight") == 0 || strcmp(name, "lm_head.weight") == 0))
        return 1;
    static const char *const rows[] = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                       "self_attn.q_proj.bias",   "self_attn.k_proj.bias",   "self_attn.v_proj.bias",
                                       "mlp.gate_proj.weight",    "mlp.up_proj.weight"};
    static const char *const cols[] = {"self_attn.o_proj.weight", "mlp.down_proj.weight"};
    if (strncmp(name, "model.layers.", 13) != 0) return 0;
    if (strstr(name, ".mlp.experts.")) /* each expert's MLP as the dense one (moe.c) */
        return ends_with(name, ".down_proj.weight") ? 2 : 1;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        if (ends_with(name, rows[i])) return 1;
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++)
        if (ends_with(name, cols[i])) return 2;
    return 0;
}

static int is_kv(const char *name) {
    return ends_with(name, "self_attn.k_proj.weight") || ends_with(name, "self_attn.v_proj.weight") ||
           ends_with(name, "self_attn.k_proj.bias") || ends_with(name, "self_attn.v_proj.bias");
}

int mrl_model_tp_copies(const mrl_model *m, const char *name) {
    return m && m->tp_size > 1 && m->tp_kv_copies > 1 && name && is_kv(name) ? m->tp_kv_copies : 1;
}

mrl_status mrl_model_tp_sync_grads(mrl_model *m, float *grads, int64_t offset, int64_t count) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_tp_sync_grads: NULL model");
    if (m->tp_size <= 1 || m->tp_kv_copies <= 1) return MRL_OK;
    if (!m->tp_sum) return mrl_set_error(MRL_ERR_INVALID, "tensor parallel: no allreduce for the group (mrl_model_set_tp_group)");
    const mrl_kernels *k = m->k; /* (a GPU's gradients: each range over to the host and back) */
    if (!grads) { /* the model's own (none before a backward) */
        if (!m->grads) return MRL_OK;
        grads = m->grads, offset = 0, count = m->n_params;
    }
    if (offset < 0 || count < 0 || offset + count > m->n_params)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_tp_sync_grads: [%lld, %lld) is not within the %lld parameters",
                             (long long)offset, (long long)(offset + count), (long long)m->n_params);
    /* each K/V head's row of a buffer of all of them: this rank's part in its head's row, zeros
     * elsewhere, summed over the group: each row then holds its head's sum over its ranks. The
     * part of each view within [offset, offset + count): the same on every rank of the group
     * (their layouts are alike, and a ZeRO shard's range with them) */
    int heads = m->tp_size / m->tp_kv_copies, slot = m->tp_rank / m->tp_kv_copies;
    int64_t most = 0;
    for (int i = 0; i < m->n_views; i++)
        if (is_kv(m->views[i].name) && m->views[i].numel > most) most = m->views[i].numel;
    float *buf = mrl_mem_alloc(sizeof(float) * (size_t)(most * heads), MRL_MEM_OTHER);
    if (!buf) return mrl_wrap_error(MRL_ERR_NOMEM, "tensor parallel: a buffer for the K/V heads' gradients");
    mrl_status st = k->sync(); /* (a GPU's gradients complete) */
    for (int i = 0; i < m->n_views && !st; i++) {
        const mrl_param_view *v = &m->views[i];
        int64_t a = v->offset > offset ? v->offset : offset;
        int64_t b = v->offset + v->numel < offset + count ? v->offset + v->numel : offset + count;
        if (!is_kv(v->name) || b <= a) continue;
        int64_t n = b - a, bytes = (int64_t)sizeof(float) * n;
        memset(buf, 0, sizeof(float) * (size_t)(n * heads));
        if (k->on_device) st = k->to_host(buf + slot * n, grads + (a - offset), bytes);
        else memcpy(buf + slot * n, grads + (a - offset), (size_t)bytes);
        if (!st && (st = m->tp_sum(m->tp_ctx, buf, n * heads)))
            st = mrl_wrap_error(st, "tensor parallel: the gradients of %s over the ranks that hold it", v->name);
        else if (!st && k->on_device)
            st = k->to_device(grads + (a - offset), buf + slot * n, bytes);
        else if (!st)
            memcpy(grads + (a - offset), buf + slot * n, (size_t)bytes);
    }
    mrl_mem_free(buf);
    return st;
}

mrl_status mrl_model_set_tp_group(mrl_model *m, mrl_tp_allreduce allreduce, mrl_tp_allgather allgather, void *ctx) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_group: NULL model");
    if (m->tp_size <= 1) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_group: not a tensor-parallel model");
    m->tp_sum = allreduce;
    m->tp_gather = allgather;
    m->tp_ctx = ctx;
    return MRL_OK;
}

mrl_status mrl_model_set_tp_device_group(mrl_model *m, mrl_tp_allreduce allreduce, mrl_tp_allgather allgather,
                                         void *ctx) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_device_group: NULL model");
    if (m->tp_size <= 1) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_device_group: not a tensor-parallel model");
    if ((allreduce == NULL) != (allgather == NULL))
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_device_group: an allreduce and an allgather, or neither");
    m->tp_dsum = allreduce;
    m->tp_dgather = allgather;
    m->tp_dctx = ctx;
    return MRL_OK;
}

/* The group's collectives take this model's buffers where they are (a GPU's, on device). */
static int device_group(const mrl_model *m) { return m->k->on_device && m->tp_dsum; }

int mrl_model_tp(const mrl_model *m, int *rank, mrl_model_config *whole) {
    if (!m) return 1;
    if (rank) *rank = m->tp_rank;
    if (whole) *whole = m->tp_size > 1 ? m->tp_cfg : m->cfg;
    return m->tp_size > 1 ? m->tp_size : 1;
}

/* A GPU model's collectives through the host (the host group's, MPI's; the head's statistics
 * combined there; context parallel's exchanges, cp.c): room for n floats of host memory, kept
 * with the model (NULL: none). */
float *mrl_model_host_stage(mrl_model *m, int64_t n) {
    if (n > m->tp_host_n) {
        mrl_mem_free(m->tp_host);
        m->tp_host_n = 0;
        m->tp_host = mrl_mem_alloc(sizeof(float) * (size_t)(n + n / 4), MRL_MEM_ACTIVATIONS);
        if (!m->tp_host) return NULL;
        m->tp_host_n = n + n / 4;
    }
    return m->tp_host;
}

void mrl_model_tp_sum(const mrl_model *cm, float *buf, int64_t n) {
    mrl_model *m = (mrl_model *)cm; /* (the layer's code takes the model const; a failure is state) */
    if (m->tp_size <= 1 || m->tp_failed) return;
    if (!m->tp_sum) {
        m->tp_failed = mrl_set_error(MRL_ERR_INVALID, "tensor parallel: no allreduce for the group "
                                     "(mrl_model_set_tp_group)");
        return;
    }
    const mrl_kernels *k = m->k;
    mrl_status st = k->sync(); /* the partial sums complete (a GPU's) */
    if (!st && device_group(m)) {
        st = m->tp_dsum(m->tp_dctx, buf, n);
    } else if (!st && k->on_device) { /* over to the host, summed, back */
        float *h = mrl_model_host_stage(m, n);
        st = h ? k->to_host(h, buf, (int64_t)sizeof(float) * n) : MRL_ERR_NOMEM;
        if (!st) st = m->tp_sum(m->tp_ctx, h, n);
        if (!st) st = k->to_device(buf, h, (int64_t)sizeof(float) * n);
    } else if (!st) {
        st = m->tp_sum(m->tp_ctx, buf, n);
    }
    if (st) m->tp_failed = mrl_wrap_error(st, "tensor parallel: a sum over the %d ranks", m->tp_size);
}

mrl_status mrl_model_tp_status(mrl_model *m) {
    mrl_status st = m->tp_failed;
    m->tp_failed = MRL_OK; /* the next forward starts clean */
    return st;
}

/* ---- the vocabulary-parallel embedding and head ----
 * Rank r holds rows [r V/size, (r + 1) V/size) of the embedding and the
 * head (tp_vocab). The embedding's rows come from the rank that holds each
 * token's and are summed over the group, the others adding zeros (exact).
 * The head's logits stay in slices: each rank's softmax statistics of its
 * slice (head_fwd: lse_r, entropy H_r, the target's log-prob where it holds
 * the target) are gathered, 3 floats a token, and every rank combines them
 * alike, in double and in rank order:
 *   lse = log sum_r exp(lse_r),  w_r = exp(lse_r - lse)
 *   H   = sum_r w_r (H_r - log w_r)          (the mixture of the slices' softmaxes)
 *   logp_t = (logp_t,r + lse_r) - lse        (r: the rank holding t)
 * The backward's head_bwd needs only the row's lse and H and each slice's
 * own targets (another slice's: the -p terms alone), so no [tokens, vocab]
 * logits ever cross the group. The engine's sampler gathers its S rows'. */

int mrl_model_tp_vocab(const mrl_model *m, int64_t *lo) {
    if (!m->tp_vocab) return 0;
    if (lo) *lo = (int64_t)m->tp_rank * m->cfg.vocab_size;
    return m->cfg.vocab_size;
}

int mrl_model_whole_vocab(const mrl_model *m) { return m->tp_size > 1 ? m->tp_cfg.vocab_size : m->cfg.vocab_size; }

/* whole-vocabulary ids (negative: none, kept -1) as rows of this rank's slice, another rank's
 * as `elsewhere` */
static void slice_rows(const mrl_model *m, const int32_t *whole, int32_t *local, int64_t T, int32_t elsewhere) {
    int64_t lo, rows = mrl_model_tp_vocab(m, &lo);
    for (int64_t i = 0; i < T; i++) {
        int64_t t = whole[i] - lo;
        local[i] = whole[i] < 0 ? -1 : t >= 0 && t < rows ? (int32_t)t : elsewhere;
    }
}

void mrl_model_tp_ids(const mrl_model *m, const int32_t *tokens, int32_t *ids, int64_t T) {
    slice_rows(m, tokens, ids, T, -1); /* -1: another rank's row (gather_rows: zeros) */
}

void mrl_model_tp_embed_rows(const mrl_model *m, float *x, const float *embed, const int32_t *ids, int64_t T) {
    m->k->gather_rows(x, embed, ids, T, m->cfg.hidden_size);
}

void mrl_model_tp_embed(const mrl_model *m, float *x, const float *embed, const int32_t *ids, int64_t T) {
    mrl_model_tp_embed_rows(m, x, embed, ids, T);
    mrl_model_tp_sum(m, x, T * m->cfg.hidden_size);
}

void mrl_model_tp_embed_bwd(const mrl_model *m, float *g_embed, const float *dx, const int32_t *ids, int64_t T) {
    m->k->scatter_add_rows(g_embed, dx, ids, T, m->cfg.hidden_size); /* in token order; -1: not this rank's */
}

void mrl_model_tp_targets(const mrl_model *m, const int32_t *whole, int32_t *local, int64_t T) {
    slice_rows(m, whole, local, T, (int32_t)m->cfg.vocab_size); /* rows: elsewhere (the head ops' convention) */
}

/* The group's all-gather (an mrl_tp_allgather of ctx = the model), or the error that it has none. */
static mrl_status group_gather(void *ctx, const float *mine, int64_t n, float *all) {
    const mrl_model *m = ctx;
    if (!m->tp_gather)
        return mrl_set_error(MRL_ERR_INVALID, "tensor parallel: no all-gather for the group (mrl_model_set_tp_group)");
    return m->tp_gather(m->tp_ctx, mine, n, all);
}

mrl_status mrl_model_tp_head_stats(mrl_model *m, float *mine, float *all, const int32_t *targets, int64_t T,
                                   float *lse, float *ent, float *lp) {
    const mrl_kernels *k = m->k;
    int n = m->tp_size, rows = m->cfg.vocab_size;
    float *dev_lse = lse, *dev_ent = ent, *dev_lp = lp; /* a GPU's: [mine | all | lse ent lp] on the host */
    mrl_status st = k->sync();
    if (!st && device_group(m)) { /* gathered on the GPU, combined on the host */
        float *h = mrl_model_host_stage(m, 3 * T * (n + 2));
        st = h ? m->tp_dgather(m->tp_dctx, mine, 3 * T, all) : MRL_ERR_NOMEM;
        if (!st) st = k->to_host(h + 3 * T, all, (int64_t)sizeof(float) * 3 * T * n);
        all = h + 3 * T, lse = all + 3 * T * n, ent = lse + T, lp = lp ? ent + T : NULL;
    } else if (!st && k->on_device) {
        float *h = mrl_model_host_stage(m, 3 * T * (n + 2));
        st = h ? k->to_host(h, mine, (int64_t)sizeof(float) * 3 * T) : MRL_ERR_NOMEM;
        mine = h, all = h + 3 * T, lse = all + 3 * T * n, ent = lse + T, lp = lp ? ent + T : NULL;
        if (!st) st = group_gather(m, mine, 3 * T, all);
    } else if (!st) {
        st = group_gather(m, mine, 3 * T, all);
    }
    if (st) return mrl_wrap_error(st, "tensor parallel: gathering the head's statistics over the %d ranks", m->tp_size);
    for (int64_t i = 0; i < T; i++) {
        double top = -INFINITY, s = 0, h = 0;
        for (int r = 0; r < n; r++) top = fmax(top, all[(int64_t)r * 3 * T + i]);
        for (int r = 0; r < n; r++) s += exp(all[(int64_t)r * 3 * T + i] - top);
        double l = top + log(s);
        for (int r = 0; r < n; r++) {
            double lw = all[(int64_t)r * 3 * T + i] - l;
            h += exp(lw) * (all[(int64_t)r * 3 * T + T + i] - lw);
        }
        lse[i] = (float)l;
        ent[i] = (float)h;
        if (!lp) continue;
        int owner = targets[i] >= 0 ? targets[i] / rows : -1;
        lp[i] = owner < 0 ? 0.0f
                          : (float)((double)all[(int64_t)owner * 3 * T + 2 * T + i] + all[(int64_t)owner * 3 * T + i] - l);
    }
    if (!k->on_device) return MRL_OK;
    int64_t bytes = (int64_t)sizeof(float) * T;
    st = k->to_device(dev_lse, lse, bytes);
    if (!st) st = k->to_device(dev_ent, ent, bytes);
    if (!st && dev_lp) st = k->to_device(dev_lp, lp, bytes);
    return st;
}

mrl_status mrl_model_tp_logits(const mrl_model *cm, const float *part, int64_t S, float *all, float *whole) {
    mrl_model *m = (mrl_model *)cm;
    const mrl_kernels *k = m->k;
    int64_t rows = m->cfg.vocab_size, n = m->tp_size;
    mrl_status st = k->sync();
    if (!st && device_group(m)) { /* gathered and put in order on the GPU */
        if ((st = m->tp_dgather(m->tp_dctx, part, S * rows, all)))
            return mrl_wrap_error(st, "tensor parallel: gathering the logits of %lld rows", (long long)S);
        for (int64_t s = 0; s < S; s++)
            for (int64_t r = 0; r < n; r++)
                k->copy(whole + (s * n + r) * rows, all + (r * S + s) * rows, (int64_t)sizeof(float) * rows);
        return MRL_OK;
    }
    float *dev_whole = whole; /* a GPU's: [part | all | whole] on the host */
    if (!st && k->on_device) {
        float *h = mrl_model_host_stage(m, S * rows * (1 + 2 * n));
        st = h ? k->to_host(h, part, (int64_t)sizeof(float) * S * rows) : MRL_ERR_NOMEM;
        part = h, all = h + S * rows, whole = all + S * rows * n;
    }
    if (!st) st = group_gather(m, part, S * rows, all);
    if (st) return mrl_wrap_error(st, "tensor parallel: gathering the logits of %lld rows", (long long)S);
    for (int64_t s = 0; s < S; s++)
        for (int64_t r = 0; r < n; r++)
            memcpy(whole + (s * n + r) * rows, all + (r * S + s) * rows, sizeof(float) * (size_t)rows);
    return k->on_device ? k->to_device(dev_whole, whole, (int64_t)sizeof(float) * S * rows * n) : MRL_OK;
}

/* ---- sequence parallel (Megatron's) ----
 * The residual stream, the norms and their outputs are split by tokens over the group (rank r
 * the rows [T r / size, T (r + 1) / size) of the batch, as context parallel splits them); a
 * norm's output is all-gathered before the column-parallel products read it, and the
 * row-parallel products' partial sums are reduce-scattered back to the rows (the group's
 * reduce-scatter; without one, and on a GPU, an all-reduce whose rows a rank keeps: the memory of
 * sequence parallel, not its traffic). A norm's
 * weight gradient from a rank's rows is summed over the group within each backward. */

/* A GPU model's gather: this rank's rows padded to most in sp_stage, gathered after them (over
 * the device group, or through the host), each rank's rows copied into place. */
static mrl_status sp_gather_device(mrl_model *m, const float *mine, float *full) {
    const mrl_kernels *k = m->k;
    int64_t T = m->batch.n_tokens, D = m->cfg.hidden_size, size = m->tp_size, most = (T + size - 1) / size, t0;
    float *pad = m->gs.sp_stage, *all = pad + most * D; /* (mine may lie in full: copied out first) */
    k->copy(pad, mine, (int64_t)sizeof(float) * m->sp_tl * D);
    mrl_status st = k->sync();
    if (!st && device_group(m)) {
        st = m->tp_dgather(m->tp_dctx, pad, most * D, all);
    } else if (!st) {
        float *h = mrl_model_host_stage(m, (1 + size) * most * D);
        st = h ? k->to_host(h, pad, (int64_t)sizeof(float) * most * D) : MRL_ERR_NOMEM;
        if (!st) st = group_gather(m, h, most * D, h + most * D);
        if (!st) st = k->to_device(all, h + most * D, (int64_t)sizeof(float) * size * most * D);
    }
    for (int r = 0; !st && r < size; r++) {
        int64_t c = mrl_model_cp_share(r, (int)size, T, &t0);
        k->copy(full + t0 * D, all + r * most * D, (int64_t)sizeof(float) * c * D);
    }
    return st;
}

void mrl_model_sp_gather(const mrl_model *cm, const float *mine, float *full) {
    mrl_model *m = (mrl_model *)cm;
    if (m->tp_failed) return;
    mrl_status st = m->k->on_device ? sp_gather_device(m, mine, full)
                                    : mrl_model_gather_shares(group_gather, m, m->tp_size, m->tp_rank, m->batch.n_tokens,
                                                              m->cfg.hidden_size, mine, m->gs.sp_stage, full);
    if (st) m->tp_failed = mrl_wrap_error(st, "sequence parallel: gathering the rows over the %d ranks", m->tp_size);
}

void mrl_model_sp_reduce_scatter(const mrl_model *cm, float *full, float *mine) {
    mrl_model *m = (mrl_model *)cm;
    int64_t D = m->cfg.hidden_size, T = m->batch.n_tokens;
    if (!m->tp_rs || m->k->on_device) { /* the allreduce: every row summed, its own kept (a GPU's too) */
        mrl_model_tp_sum(m, full, T * D);
        m->k->copy(mine, full + m->sp_t0 * D, (int64_t)sizeof(float) * m->sp_tl * D);
        return;
    }
    /* a reduce-scatter of equal pieces: each rank's rows padded to ceil(T / size) (sp_stage) */
    if (m->tp_failed) return;
    int64_t C = (T + m->tp_size - 1) / m->tp_size;
    float *stage = m->gs.sp_stage;
    for (int r = 0; r < m->tp_size; r++) {
        int64_t t0, tl = mrl_model_cp_share(r, m->tp_size, T, &t0);
        memcpy(stage + r * C * D, full + t0 * D, sizeof(float) * (size_t)(tl * D));
        memset(stage + (r * C + tl) * D, 0, sizeof(float) * (size_t)((C - tl) * D));
    }
    mrl_status st = m->k->sync();
    if (!st) st = m->tp_rs(m->tp_ctx, stage, m->tp_size * C * D);
    if (st) {
        m->tp_failed = mrl_wrap_error(st, "sequence parallel: a reduce-scatter over the %d ranks", m->tp_size);
        return;
    }
    memcpy(mine, stage + m->tp_rank * C * D, sizeof(float) * (size_t)(m->sp_tl * D));
}

mrl_status mrl_model_set_tp_reduce_scatter(mrl_model *m, mrl_tp_reduce_scatter rs) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_reduce_scatter: NULL model");
    if (m->tp_size <= 1) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_reduce_scatter: not a tensor-parallel model");
    m->tp_rs = rs;
    return MRL_OK;
}

void mrl_model_sp_norm_grad(const mrl_model *m, float *g, int64_t n) {
    mrl_model_tp_sum(m, m->gs.sp_dw, n);
    m->k->add(g, m->gs.sp_dw, n);
}

mrl_status mrl_model_set_sequence_parallel(mrl_model *m, int on) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_sequence_parallel: NULL model");
    if (on && m->tp_size <= 1)
        return mrl_set_error(MRL_ERR_INVALID, "sequence parallel: the model is not tensor parallel (dist.tp)");
    if (on && !m->tp_vocab)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "sequence parallel: the embedding and head must be split by vocabulary "
                             "(vocab_size %d is not a multiple of the %d ranks)", m->tp_cfg.vocab_size, m->tp_size);
    if (on && m->cp_size > 1) return mrl_set_error(MRL_ERR_UNSUPPORTED, "sequence parallel with context parallel: not yet");
    if (on && mrl_model_num_moe_layers(m) > 0)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "sequence parallel with a mixture of experts (num_experts %d): not yet",
                             m->cfg.num_experts);
    mrl_model_release_activations(m); /* (the layout depends on it) */
    m->tp_seq = on != 0;
    return MRL_OK;
}
