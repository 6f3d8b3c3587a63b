/* Tensor parallel (moonrl/model.h, Megatron's split): a rank holds the rows
 * of the column-parallel products (q, k, v, gate, up) and the columns of the
 * row-parallel ones (o_proj, down_proj) of every layer; the rest is whole on
 * every rank. The layer (layer.c) sums the row-parallel outputs and the
 * column-parallel input gradients over the group with the model's
 * allreduce, so everything between them (norms, residual stream, head) is
 * the same on every rank. */
#include <string.h>
#include "base/error.h"
#include "model_internal.h"

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* 1 by rows: q, k, v, gate, up (weights and biases: column-parallel); 2 by columns: o_proj,
 * down_proj (row-parallel); 0: whole (norms, embedding, head). */
int mrl_model_tp_split(const char *name) {
    static const char *const rows[] = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                       "self_attn.q_proj.bias",   "self_attn.k_proj.bias",   "self_attn.v_proj.bias",
                                       "mlp.gate_proj.weight",    "mlp.up_proj.weight"};
    static const char *const cols[] = {"self_attn.o_proj.weight", "mlp.down_proj.weight"};
    if (strncmp(name, "model.layers.", 13) != 0) return 0;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        if (ends_with(name, rows[i])) return 1;
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++)
        if (ends_with(name, cols[i])) return 2;
    return 0;
}

mrl_status mrl_model_set_tp_group(mrl_model *m, mrl_tp_allreduce allreduce, mrl_tp_allgather allgather, void *ctx) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_group: NULL model");
    if (m->tp_size <= 1) return mrl_set_error(MRL_ERR_INVALID, "mrl_model_set_tp_group: not a tensor-parallel model");
    m->tp_sum = allreduce;
    m->tp_gather = allgather;
    m->tp_ctx = ctx;
    return MRL_OK;
}

int mrl_model_tp(const mrl_model *m, int *rank, mrl_model_config *whole) {
    if (!m) return 1;
    if (rank) *rank = m->tp_rank;
    if (whole) *whole = m->tp_size > 1 ? m->tp_cfg : m->cfg;
    return m->tp_size > 1 ? m->tp_size : 1;
}

void mrl_model_tp_sum(const mrl_model *cm, float *buf, int64_t n) {
    mrl_model *m = (mrl_model *)cm; /* (the layer's code takes the model const; a failure is state) */
    if (m->tp_size <= 1 || m->tp_failed) return;
    if (!m->tp_sum) {
        m->tp_failed = mrl_set_error(MRL_ERR_INVALID, "tensor parallel: no allreduce for the group "
                                     "(mrl_model_set_tp_group)");
        return;
    }
    mrl_status st = m->k->sync(); /* the partial sums complete (a GPU's) */
    if (!st) st = m->tp_sum(m->tp_ctx, buf, n);
    if (st) m->tp_failed = mrl_wrap_error(st, "tensor parallel: a sum over the %d ranks", m->tp_size);
}

mrl_status mrl_model_tp_status(mrl_model *m) {
    mrl_status st = m->tp_failed;
    m->tp_failed = MRL_OK; /* the next forward starts clean */
    return st;
}
