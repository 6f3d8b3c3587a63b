/* Expert parallelism for the sparse layers (mrl_model_set_expert_parallel):
 * the E experts are cut over the P ranks of a communicator in contiguous
 * blocks (mrl_dist_shard: rank q owns experts first[q] .. first[q+1]), and
 * each rank runs only its own experts, on the rows every rank routed to
 * them. Forward and backward side by side:
 *
 *   forward (after the local router and grouping of moe.c: xe [A,D], rows
 *   grouped by expert, so the rows for rank q's experts are one block):
 *     counts   every rank's eoff [E+1], all-gathered
 *     dispatch xe's block for q -> rank q (all-to-all)      arrive [R,D]
 *              arrive holds, source by source, each source's rows of my
 *              experts grouped by expert; perm reorders them expert-major
 *              (expert by expert, sources in rank order inside)   x [R,D]
 *     experts  mrl_moe_experts_forward on x                  y [R,D]
 *     combine  y back in arrival order -> its source (all-to-all): ey [A,D],
 *              every row where the single-rank layer has it
 *   backward:
 *     dispatch d ey's blocks, the same counts               dy [R,D]
 *     experts  mrl_moe_experts_backward: my experts' gradients, d x
 *     combine  d x back into the sources' d xe [A,D]
 *
 * Every rank keeps all the weights (the engine generates alone, checkpoints
 * and saves need no gather); a rank's expert gradients are its own experts'
 * over all ranks' tokens and zero for the others, so the data-parallel sum
 * over the ranks is the whole gradient everywhere. The router, the
 * attention and the dense layers stay data parallel. Each forward and
 * backward of the model is then a collective of the communicator: every
 * rank runs the same sequence of them. */
#include <stdio.h>
#include <string.h>
#include "model_internal.h"
#include "moonrl/dist.h"
#include "moonrl/mem.h"
#include "base/error.h"

/* one sparse layer's exchange, kept from its forward for its backward */
struct moe_ep_layer {
    int64_t rows, cap;          /* R rows this rank's experts got (all sources), and room */
    float *x, *gate, *up, *act; /* [R,D] [R,Fe] x3, expert-major */
    int32_t *perm;              /* [R] the arrival row of each expert-major row */
    int32_t *eoff;              /* [own + 1] my expert i's rows in x: eoff[i] .. eoff[i+1] */
    int64_t *scount, *rcount;   /* [P] rows sent to and received from each rank */
};

struct moe_ep {
    mrl_dist *d;
    int rank, size;
    int64_t *first;              /* [P + 1] the first expert of each rank */
    int n_layers;
    struct moe_ep_layer *layers; /* [sparse layers] */
    int32_t *all_eoff;           /* [P, E+1] every rank's grouping of the layer at hand */
    float *arrive, *work;        /* [cap, D] scratch */
    float *df1, *df2;            /* [cap, Fe] scratch */
    int64_t cap;
    mrl_status st;               /* the first failure since mrl_moe_ep_begin */
};

/* keeps the first failure; returns 1 for `if (failed(...)) return;` */
static int failed(struct moe_ep *ep, mrl_status st) {
    if (st && !ep->st) ep->st = st;
    return st != MRL_OK;
}

/* room for rows in *buf (floats of width w each); the old contents are not kept */
static int grow(float **buf, int64_t rows, int64_t w) {
    mrl_mem_free(*buf);
    *buf = mrl_mem_alloc((size_t)(rows > 0 ? rows : 1) * (size_t)w * sizeof(float), MRL_MEM_ACTIVATIONS);
    return *buf != NULL;
}

static int ensure_rows(struct moe_ep *ep, struct moe_ep_layer *L, int64_t rows, int64_t D, int64_t Fe) {
    if (rows > L->cap) {
        int64_t cap = rows + rows / 4;
        mrl_mem_free(L->perm);
        L->perm = mrl_mem_alloc((size_t)cap * sizeof(int32_t), MRL_MEM_ACTIVATIONS);
        if (!L->perm || !grow(&L->x, cap, D) || !grow(&L->gate, cap, Fe) || !grow(&L->up, cap, Fe) ||
            !grow(&L->act, cap, Fe)) {
            L->cap = 0;
            return 0;
        }
        L->cap = cap;
    }
    if (rows > ep->cap) {
        int64_t cap = rows + rows / 4;
        if (!grow(&ep->arrive, cap, D) || !grow(&ep->work, cap, D) || !grow(&ep->df1, cap, Fe) ||
            !grow(&ep->df2, cap, Fe)) {
            ep->cap = 0;
            return 0;
        }
        ep->cap = cap;
    }
    return 1;
}

/* rows of width D: dst[j] = src[perm[j]] (to expert-major) or dst[perm[j]] = src[j] (back) */
static void permute_rows(float *dst, const float *src, const int32_t *perm, int64_t n, int64_t D, int back) {
    for (int64_t j = 0; j < n; j++) {
        int64_t from = back ? j : perm[j], to = back ? perm[j] : j;
        memcpy(dst + to * D, src + from * D, sizeof(float) * D);
    }
}

void mrl_moe_ep_forward(const mrl_model *m, const layer_params *p, layer_acts *a) {
    struct moe_ep *ep = m->ep;
    struct moe_ep_layer *L = a->ep;
    const mrl_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, E = c->num_experts, Fe = c->moe_intermediate_size;
    int P = ep->size, me = ep->rank;
    int64_t e0 = ep->first[me], ne = ep->first[me + 1] - e0;
    if (ep->st) return; /* the exchange failed earlier in this pass: the others stop too */
    mrl_status st = mrl_dist_allgather(ep->d, a->eoff, (int64_t)sizeof(int32_t) * (E + 1), ep->all_eoff);
    if (failed(ep, st)) return;
    int64_t rows = 0;
    for (int q = 0; q < P; q++) {
        const int32_t *oq = ep->all_eoff + (int64_t)q * (E + 1);
        L->scount[q] = a->eoff[ep->first[q + 1]] - a->eoff[ep->first[q]];
        L->rcount[q] = oq[e0 + ne] - oq[e0];
        rows += L->rcount[q];
    }
    if (rows > INT32_MAX || !ensure_rows(ep, L, rows, D, Fe)) {
        failed(ep, mrl_set_error(MRL_ERR_NOMEM, "model forward: expert parallelism: no room for %lld rows of this "
                                 "rank's experts", (long long)rows));
        return;
    }
    L->rows = rows;
    if (failed(ep, mrl_dist_alltoallv(ep->d, a->xe, L->scount, ep->arrive, L->rcount, (int64_t)sizeof(float) * D)))
        return;
    /* expert-major: my expert e's rows from source 0, then source 1, ... (token order in each) */
    int64_t j = 0;
    for (int64_t i = 0; i < ne; i++) {
        L->eoff[i] = (int32_t)j;
        int64_t base = 0; /* where source q's rows start in arrive */
        for (int q = 0; q < P; q++) {
            const int32_t *oq = ep->all_eoff + (int64_t)q * (E + 1);
            int64_t start = base + oq[e0 + i] - oq[e0], n = oq[e0 + i + 1] - oq[e0 + i];
            for (int64_t r = 0; r < n; r++) L->perm[j++] = (int32_t)(start + r);
            base += L->rcount[q];
        }
    }
    L->eoff[ne] = (int32_t)j;
    permute_rows(L->x, ep->arrive, L->perm, rows, D, 0);
    mrl_moe_experts_forward(m, p, e0, ne, L->eoff, L->x, L->gate, L->up, L->act, ep->work, NULL, NULL);
    permute_rows(ep->arrive, ep->work, L->perm, rows, D, 1);
    failed(ep, mrl_dist_alltoallv(ep->d, ep->arrive, L->rcount, a->ey, L->scount, (int64_t)sizeof(float) * D));
}

void mrl_moe_ep_backward(const mrl_model *m, const layer_params *p, const layer_params *g, const layer_acts *a,
                         float *dye) {
    struct moe_ep *ep = m->ep;
    const struct moe_ep_layer *L = a->ep;
    int64_t D = m->cfg.hidden_size;
    int64_t e0 = ep->first[ep->rank], ne = ep->first[ep->rank + 1] - e0;
    if (ep->st) return;
    if (failed(ep, mrl_dist_alltoallv(ep->d, dye, L->scount, ep->arrive, L->rcount, (int64_t)sizeof(float) * D)))
        return;
    permute_rows(ep->work, ep->arrive, L->perm, L->rows, D, 0);
    mrl_moe_experts_backward(m, p, g, e0, ne, L->eoff, L->x, L->gate, L->up, L->act, ep->work, ep->df1, ep->df2, NULL,
                             NULL); /* (no LoRA under EP yet) */
    permute_rows(ep->arrive, ep->work, L->perm, L->rows, D, 1);
    failed(ep, mrl_dist_alltoallv(ep->d, ep->arrive, L->rcount, dye, L->scount, (int64_t)sizeof(float) * D));
}

struct moe_ep_layer *mrl_moe_ep_layer(const mrl_model *m, int ord) {
    return m->ep && ord < m->ep->n_layers ? &m->ep->layers[ord] : NULL;
}

void mrl_moe_ep_begin(const mrl_model *m) {
    if (m->ep) m->ep->st = MRL_OK;
}

mrl_status mrl_moe_ep_status(const mrl_model *m) {
    if (!m->ep || !m->ep->st) return MRL_OK;
    char why[512];
    snprintf(why, sizeof why, "%s", mrl_last_error());
    return mrl_set_error(m->ep->st, "model: expert parallelism: %s", why);
}

void mrl_moe_ep_free(mrl_model *m) {
    struct moe_ep *ep = m->ep;
    if (!ep) return;
    for (int i = 0; i < ep->n_layers; i++) {
        struct moe_ep_layer *L = &ep->layers[i];
        mrl_mem_free(L->x);
        mrl_mem_free(L->gate);
        mrl_mem_free(L->up);
        mrl_mem_free(L->act);
        mrl_mem_free(L->perm);
        mrl_mem_free(L->eoff);
        mrl_mem_free(L->scount);
        mrl_mem_free(L->rcount);
    }
    mrl_mem_free(ep->layers);
    mrl_mem_free(ep->first);
    mrl_mem_free(ep->all_eoff);
    mrl_mem_free(ep->arrive);
    mrl_mem_free(ep->work);
    mrl_mem_free(ep->df1);
    mrl_mem_free(ep->df2);
    mrl_mem_free(ep);
    m->ep = NULL;
}

mrl_status mrl_model_set_expert_parallel(mrl_model *m, mrl_dist *d) {
    if (!m) return mrl_set_error(MRL_ERR_INVALID, "model set_expert_parallel: NULL model");
    mrl_moe_ep_free(m);
    if (!d) return MRL_OK;
    if (m->lora) return mrl_set_error(MRL_ERR_UNSUPPORTED, "model set_expert_parallel: not yet with LoRA adapters");
    int n_moe = mrl_moe_ordinal(&m->cfg, m->cfg.num_hidden_layers); /* (this model's own) */
    if (n_moe == 0)
        return mrl_set_error(MRL_ERR_INVALID, "model set_expert_parallel: the model has no sparse layers "
                             "(expert parallelism is for a mixture of experts: qwen3_moe)");
    int P = mrl_dist_size(d);
    int64_t E = m->cfg.num_experts;
    struct moe_ep *ep = mrl_mem_alloc(sizeof *ep, MRL_MEM_OTHER);
    if (!ep) return MRL_ERR_NOMEM; /* (mrl_mem_alloc said why) */
    m->ep = ep;
    ep->d = d;
    ep->rank = mrl_dist_rank(d);
    ep->size = P;
    ep->n_layers = n_moe;
    ep->first = mrl_mem_alloc(sizeof(int64_t) * (size_t)(P + 1), MRL_MEM_OTHER);
    ep->all_eoff = mrl_mem_alloc(sizeof(int32_t) * (size_t)P * (size_t)(E + 1), MRL_MEM_OTHER);
    ep->layers = mrl_mem_alloc(sizeof *ep->layers * (size_t)n_moe, MRL_MEM_OTHER);
    int ok = ep->first && ep->all_eoff && ep->layers;
    for (int q = 0; ok && q < P; q++) {
        int64_t off, n;
        mrl_dist_shard(E, P, q, &off, &n);
        ep->first[q] = off;
        ep->first[q + 1] = off + n;
    }
    for (int i = 0; ok && i < n_moe; i++) {
        struct moe_ep_layer *L = &ep->layers[i];
        L->eoff = mrl_mem_alloc(sizeof(int32_t) * (size_t)(E + 1), MRL_MEM_OTHER);
        L->scount = mrl_mem_alloc(sizeof(int64_t) * (size_t)P, MRL_MEM_OTHER);
        L->rcount = mrl_mem_alloc(sizeof(int64_t) * (size_t)P, MRL_MEM_OTHER);
        ok = L->eoff && L->scount && L->rcount;
    }
    if (!ok) {
        mrl_moe_ep_free(m);
        return MRL_ERR_NOMEM;
    }
    return MRL_OK;
}

int mrl_model_expert_range(const mrl_model *m, int64_t *first, int64_t *count) {
    if (!m || !m->ep) {
        if (first) *first = 0;
        if (count) *count = m ? m->cfg.num_experts : 0;
        return 0;
    }
    if (first) *first = m->ep->first[m->ep->rank];
    if (count) *count = m->ep->first[m->ep->rank + 1] - m->ep->first[m->ep->rank];
    return 1;
}
