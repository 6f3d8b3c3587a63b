/* Context parallel (moonrl/model.h, DeepSpeed-Ulysses): the ranks of a group
 * hold the whole model and split each batch's tokens, rank r taking the
 * contiguous [T r / size, T (r + 1) / size). Everything but attention is per
 * token and runs on a rank's own; attention needs every token of a sequence,
 * so around it an all-to-all trades the tokens' rows of every head for every
 * token's rows of this rank's heads (Hq / size query and Hk / size K/V heads,
 * whose grouping is then the whole model's), attention runs on those, and a
 * second all-to-all brings its output back to the tokens. Each rank's share
 * of the attention is even whatever the causal mask does (all tokens, a
 * slice of the heads), which is why Ulysses needs no zigzag ordering. The
 * forward gathers the per-token outputs (a few floats a token), so the loss
 * boundary is the whole batch on every rank; the backward reads its tokens'
 * part of the upstream gradients and leaves their part of the parameter
 * gradients, summed over the group with the data-parallel sums. */
#include <string.h>
#include "base/error.h"
#include "model_internal.h"

int64_t mrl_model_cp_share(int rank, int size, int64_t T, int64_t *t0) {
    *t0 = T * rank / size;
    return T * (rank + 1) / size - *t0;
}

mrl_status mrl_model_gather_shares(mrl_tp_allgather gather, void *ctx, int size, int rank, int64_t T, int64_t unit,
                                   const float *mine, float *stage, float *whole) {
    int64_t most = (T + size - 1) / size, t0, c = mrl_model_cp_share(rank, size, T, &t0);
    float *pad = stage, *all = stage + most * unit; /* (mine may lie in whole: copied out first) */
    memcpy(pad, mine, sizeof(float) * (size_t)(c * unit));
    mrl_status st = gather(ctx, pad, most * unit, all);
    for (int r = 0; !st && r < size; r++) {
        c = mrl_model_cp_share(r, size, T, &t0);
        memcpy(whole + t0 * unit, all + r * most * unit, sizeof(float) * (size_t)(c * unit));
    }
    return st;
}

mrl_status mrl_model_set_cp_group(mrl_model *m, int rank, int size, mrl_tp_allgather allgather, mrl_cp_alltoallv alltoallv,
                                  void *ctx) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_cp_group: NULL model");
    if (m->lora && size > 1) return mrl_set_error(MRL_ERR_UNSUPPORTED, "context parallel: not yet with LoRA adapters");
    if (mrl_model_is_mla(&m->cfg) && size > 1)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "context parallel: not yet with multi-head latent attention (deepseek_v3)");
    if (size < 1 || rank < 0 || rank >= size)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_cp_group: rank %d of %d", rank, size);
    const mrl_model_config *c = &m->cfg;
    if (size > 1) { /* (a tensor-parallel model's heads are its slices': those are split further) */
        if (!allgather || !alltoallv) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_cp_group: NULL collective");
        if (c->num_attention_heads % size || c->num_key_value_heads % size)
            return mrl_set_error(MRL_ERR_INVALID, "context parallel over %d ranks: %s (%d) is not a multiple of %d", size,
                                 c->num_attention_heads % size ? "num_attention_heads" : "num_key_value_heads",
                                 c->num_attention_heads % size ? c->num_attention_heads : c->num_key_value_heads, size);
        if (c->num_experts > 0)
            return mrl_set_error(MRL_ERR_UNSUPPORTED, "context parallel: a mixture-of-experts model (num_experts %d): "
                                 "not yet", c->num_experts);
    }
    mrl_model_release_activations(m); /* (the layout depends on it) */
    m->cp_rank = size > 1 ? rank : 0;
    m->cp_size = size > 1 ? size : 0;
    m->cp_gather = allgather, m->cp_a2a = alltoallv, m->cp_ctx = ctx;
    return MRL_OK;
}

/* The group's all-to-all of rows of w floats; a GPU model's through host memory (the group's
 * collectives are MPI's): the rows it sends copied over, exchanged, the rows it gets copied back. */
static mrl_status exchange(const mrl_model *cm, const float *send, const int64_t *sc, float *recv, const int64_t *rc,
                           int64_t w) {
    mrl_model *m = (mrl_model *)cm;
    const mrl_kernels *k = m->k;
    if (!k->on_device) return m->cp_a2a(m->cp_ctx, send, sc, recv, rc, w);
    mrl_status st = k->sync(); /* (the blocks packed) */
    if (!st && m->cp_da2a) st = m->cp_da2a(m->cp_dctx, send, sc, recv, rc, w);
    if (st || m->cp_da2a) return st;
    int64_t ns = 0, nr = 0;
    for (int r = 0; r < m->cp_size; r++) ns += sc[r], nr += rc[r];
    float *h = mrl_model_host_stage(m, (ns + nr) * w);
    if (!h) return mrl_set_error(MRL_ERR_NOMEM, "context parallel: a host buffer of %lld floats", (long long)((ns + nr) * w));
    st = k->to_host(h, send, (int64_t)sizeof(float) * ns * w);
    if (!st) st = m->cp_a2a(m->cp_ctx, h, sc, h + ns * w, rc, w);
    if (!st) st = k->to_device(recv, h + ns * w, (int64_t)sizeof(float) * nr * w);
    return st;
}

mrl_status mrl_model_set_cp_device_group(mrl_model *m, mrl_tp_allgather allgather, mrl_cp_alltoallv alltoallv,
                                         void *ctx) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_cp_device_group: NULL model");
    if ((allgather == NULL) != (alltoallv == NULL))
        return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_cp_device_group: an allgather and an alltoallv, or neither");
    m->cp_dgather = allgather, m->cp_da2a = alltoallv, m->cp_dctx = ctx;
    return MRL_OK;
}

static void fail(const mrl_model *cm, mrl_status st, const char *what) {
    mrl_model *m = (mrl_model *)cm; /* (called from the layers, which take the model const) */
    if (st && !m->tp_failed) m->tp_failed = mrl_wrap_error(st, "context parallel: %s over %d ranks", what, m->cp_size);
}

enum { MAX_CP = 256 };

/* An all-to-all's row counts (tokens) and width (floats a row: H / size heads of hd): this rank
 * sends or receives tl rows from each rank (mine), every rank its own share (theirs). */
static int64_t exchange_rows(const mrl_model *m, int H, int64_t *mine, int64_t *theirs) {
    int64_t t0, T = m->batch.n_tokens;
    for (int r = 0; r < m->cp_size; r++) mine[r] = m->cp_tl, theirs[r] = mrl_model_cp_share(r, m->cp_size, T, &t0);
    return (int64_t)H / m->cp_size * m->cfg.head_dim;
}

void mrl_model_cp_to_heads(const mrl_model *m, const float *local, int H, float *heads) {
    if (m->tp_failed) return;
    int64_t mine[MAX_CP], theirs[MAX_CP], Tl = m->cp_tl, row = (int64_t)H * m->cfg.head_dim;
    int64_t w = exchange_rows(m, H, mine, theirs);
    /* to rank r: this rank's tokens' columns of r's heads, as one block [Tl, w] (the op table's
     * copies: a GPU's in its memory) */
    for (int r = 0; r < m->cp_size; r++)
        for (int64_t t = 0; t < Tl; t++)
            m->k->copy(m->gs.cp_pack + (r * Tl + t) * w, local + t * row + r * w, (int64_t)sizeof(float) * w);
    /* from rank r: its tokens' rows of our heads, which follow each other in token order */
    fail(m, exchange(m, m->gs.cp_pack, mine, heads, theirs, w), "the attention's inputs");
}

void mrl_model_cp_to_tokens(const mrl_model *m, const float *heads, int H, float *local) {
    if (m->tp_failed) return;
    int64_t mine[MAX_CP], theirs[MAX_CP], Tl = m->cp_tl, row = (int64_t)H * m->cfg.head_dim;
    int64_t w = exchange_rows(m, H, mine, theirs);
    /* to rank r: its tokens' rows (contiguous); from rank r: our tokens' rows of its heads */
    fail(m, exchange(m, heads, theirs, m->gs.cp_pack, mine, w), "the attention's outputs");
    if (m->tp_failed) return;
    for (int r = 0; r < m->cp_size; r++)
        for (int64_t t = 0; t < Tl; t++)
            m->k->copy(local + t * row + r * w, m->gs.cp_pack + (r * Tl + t) * w, (int64_t)sizeof(float) * w);
}

/* whole: host memory (the forward's per-token outputs); a GPU model's rows copied over first, and
 * gathered in host memory */
void mrl_model_cp_gather(const mrl_model *cm, const float *mine, float *whole) {
    mrl_model *m = (mrl_model *)cm;
    if (m->tp_failed) return;
    float *stage = m->cp_out;
    if (m->k->on_device && m->cp_dgather) { /* gathered on the GPUs, each rank's rows padded to most */
        int64_t T = m->batch.n_tokens, size = m->cp_size, most = (T + size - 1) / size, t0;
        float *h = mrl_model_host_stage(m, size * most);
        mrl_status st = h ? MRL_OK : mrl_set_error(MRL_ERR_NOMEM, "a host buffer of %lld floats", (long long)(size * most));
        if (!st) {
            m->k->copy(stage, mine, (int64_t)sizeof(float) * m->cp_tl);
            st = m->k->sync();
        }
        if (!st) st = m->cp_dgather(m->cp_dctx, stage, most, stage + most);
        if (!st) st = m->k->to_host(h, stage + most, (int64_t)sizeof(float) * size * most);
        for (int r = 0; !st && r < size; r++) {
            int64_t c = mrl_model_cp_share(r, (int)size, T, &t0);
            memcpy(whole + t0, h + r * most, sizeof(float) * (size_t)c);
        }
        fail(m, st, "the per-token outputs");
        return;
    }
    if (m->k->on_device) {
        int64_t T = m->batch.n_tokens, most = (T + m->cp_size - 1) / m->cp_size;
        float *h = mrl_model_host_stage(m, m->cp_tl + (1 + m->cp_size) * most);
        mrl_status st = h ? m->k->sync() : MRL_ERR_NOMEM;
        if (!st) st = m->k->to_host(h, mine, (int64_t)sizeof(float) * m->cp_tl);
        if (st) {
            fail(m, st, "the per-token outputs");
            return;
        }
        mine = h, stage = h + m->cp_tl;
    }
    fail(m, mrl_model_gather_shares(m->cp_gather, m->cp_ctx, m->cp_size, m->cp_rank, m->batch.n_tokens, 1, mine,
                                    stage, whole), "the per-token outputs");
}
