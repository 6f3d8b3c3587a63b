/* The mixture-of-experts MLP of a sparse layer (qwen3_moe, Transformers'
 * Qwen3MoeSparseMoeBlock), forward and backward side by side.
 * T tokens, D hidden, E experts, k = num_experts_per_tok, Fe =
 * moe_intermediate_size, A = T*k assignments (token t's j-th pick is t*k + j).
 *
 *   p = softmax(x Wr^T)                               [T,E]  fp32, also in bf16
 *   sel[t] = the k largest p[t] (ties: the lower expert), w = p[t, sel]
 *            (/ their sum when norm_topk_prob)        [T,k]
 *   the A rows grouped by expert, token order inside (a counting sort):
 *     xe = x[tok]                                     [A,D]
 *   per expert e, over its rows (one product each, grouped):
 *     gate, up = xe Wg_e^T, xe Wu_e^T ; act = silu(gate) up ; ye = act Wd_e^T
 *   out[t] += sum_j w[t,j] ye[row[t*k + j]]
 *
 * Routing replay (mrl_batch.routing, R3): sel is given instead (e.g. the
 * engine's picks for the same tokens) and w = p[t, sel] as above, so the
 * experts are the engine's while the router keeps its gradient; the aux
 * loss then counts the replayed picks (the experts that ran).
 * The backward treats sel as a constant (as autograd does through topk):
 *   dw[t,j] = dy[t] . ye[row]             dye[row] = w[t,j] dy[t]
 *   d p[t,sel_j] = dw_j (norm: (dw_j - sum_i dw_i w_i) / sum_i p[t,sel_i])
 *     (+ the load-balancing loss's coef E picks_e / N^2 on every p[t,e])
 *   d logits = p (dp - sum_e p_e dp_e) ; dWr += dlogits^T x ; dx = dlogits Wr + sum over picks of dxe
 * Tensor parallel (tp.c): each rank holds rows Fe/tp of every expert's gate
 * and up and those columns of its down, so ye is its part of the outputs
 * (summed over the group with out, layer.c); the router is whole, its picks
 * the same on every rank, and the backward sums dw and the picks' dx.
 * The router's products stay fp32 in both precisions: a pick must not flip
 * because the weights were rounded, and they are E columns, cheap.
 * The products go through mrl_layer_products (fp32 grouped, bf16 one by one
 * reading the experts' bf16 copies heg, heu, hed), like the dense layers. */
#include <math.h>
#include <string.h>
#include "model_internal.h"
#include "base/error.h"

int64_t mrl_moe_acts_layout(const mrl_model_config *c, layer_acts *a, int64_t T, char *base) {
    int64_t D = c->hidden_size, E = c->num_experts, A = T * c->num_experts_per_tok, Fe = c->moe_intermediate_size;
    int64_t off = 0;
#define TAKE(ptr, type, count) MRL_LAYOUT_TAKE(base, off, ptr, type, count)
    TAKE(a->rprob, float, T * E);
    TAKE(a->sel, int32_t, A);
    TAKE(a->rw, float, A);
    TAKE(a->row, int32_t, A);
    TAKE(a->tok, int32_t, A);
    TAKE(a->eoff, int32_t, E + 1);
    TAKE(a->rhow, int32_t, T);
    TAKE(a->xe, float, A * D);
    TAKE(a->egate, float, A * Fe);
    TAKE(a->eup, float, A * Fe);
    TAKE(a->eact, float, A * Fe);
    TAKE(a->ey, float, A * D);
    int64_t Fs = (int64_t)c->n_shared_experts * Fe;
    if (Fs) {
        TAKE(a->sgate, float, T * Fs);
        TAKE(a->sup, float, T * Fs);
        TAKE(a->sact, float, T * Fs);
    } else if (base) {
        a->sgate = a->sup = a->sact = NULL;
    }
#undef TAKE
    return off;
}

/* Up to GROUP products at once (one parallel region in fp32). */
enum { GROUP = 64 };
typedef struct prod_batch {
    const mrl_model *m;
    mrl_gemm_desc d[GROUP];
    const uint16_t *w16[GROUP];
    int n;
} prod_batch;

static void flush(prod_batch *b) {
    if (b->n) mrl_layer_products(b->m, b->d, b->w16, b->n);
    b->n = 0;
}

static void push(prod_batch *b, mrl_gemm_desc d, const uint16_t *w16) {
    b->d[b->n] = d;
    b->w16[b->n++] = w16;
    if (b->n == GROUP) flush(b);
}

/* y[n,N] = x[n,K] W[N,K]^T ; dW[N,K] += dy^T x ; dx[n,K] = dy W (+ beta dx) */
static mrl_gemm_desc fwd(float *y, const float *x, const float *W, int64_t n, int64_t N, int64_t K) {
    return (mrl_gemm_desc){0, 1, n, N, K, 1.0f, x, K, W, K, 0.0f, y, N};
}
static mrl_gemm_desc dweight(float *dW, const float *dy, const float *x, int64_t n, int64_t N, int64_t K) {
    return (mrl_gemm_desc){1, 0, N, K, n, 1.0f, dy, N, x, K, 1.0f, dW, K};
}
static mrl_gemm_desc dinput(float *dx, const float *dy, const float *W, int64_t n, int64_t N, int64_t K, float beta) {
    return (mrl_gemm_desc){0, 0, n, K, N, 1.0f, dy, N, W, K, beta, dx, K};
}

static const uint16_t *at16(const uint16_t *base, int64_t off) { return base ? base + off : NULL; }

/* The router's picks of each token (the op table's moe_route: softmax, top-k, the weights,
 * the replay), then their grouping (moe_group: eoff, row, tok). Replay (a->replay): sel is
 * the given picks in their order, rw their own probabilities (renormalised likewise), so
 * replaying the model's own picks gives the same bits as not replaying. */
static void route(const mrl_kernels *k, const mrl_model_config *c, const layer_params *p, layer_acts *a, int64_t T) {
    int E = c->num_experts, K = c->num_experts_per_tok;
    if (c->arch == MRL_ARCH_DEEPSEEK_V3) /* sigmoid scores, the bias and the groups choose */
        k->moe_route_grouped(a->rprob, a->sel, a->rw, a->replay ? a->rhow : NULL, a->rprob, p->rbias, a->replay,
                             a->replay_stride, T, E, K, c->n_group, c->topk_group, c->norm_topk_prob,
                             (float)c->routed_scaling_factor);
    else
        k->moe_route(a->rprob, a->sel, a->rw, a->replay ? a->rhow : NULL, a->rprob, a->replay, a->replay_stride, T, E,
                     K, c->norm_topk_prob); /* [T,E] in place, [T,k] x2 */
    k->moe_group(a->eoff, a->row, a->tok, a->sel, T * K, E, K);
    a->replay_differ = a->replay_count = 0;
    for (int64_t t = 0; a->replay && t < T; t++) {
        a->replay_count += a->rhow[t] > 0;
        a->replay_differ += a->rhow[t] == 2;
    }
}

/* Expert e's adapter of target j (gate, up, down: lora.c), A [r, in] and B [out, r], or NULL. */
static const float *lora_at(const float *blk, int64_t e, int64_t size) { return blk ? blk + e * size : NULL; }

/* LoRA's part of target j (0 gate, 1 up, 2 down) for experts e0 .. e0 + ne, rows grouped by
 * eoff: forward (y += s (x A_e^T) B_e^T; du: the trainer's dropout scratch, or NULL) or, with G,
 * backward (dx: NULL or += du A_e). */
static void experts_lora(const mrl_model *m, const lora_layer *P, const lora_layer *G, int j, int64_t e0, int64_t ne,
                         const int32_t *eoff, const float *x, float *y, const float *dy, float *dx, float *u,
                         float *du) {
    if (!P || !P->eA[j]) return;
    int64_t r = mrl_model_lora_rank(m), N, K;
    mrl_expert_matrix(&m->cfg, j, &N, &K);
    for (int64_t i = 0; i < ne; i++) {
        int64_t e = e0 + i, r0 = eoff[i], n = eoff[i + 1] - r0;
        const float *A = lora_at(P->eA[j], e, r * K), *B = lora_at(P->eB[j], e, N * r);
        if (!G) {
            const float *xe = mrl_lora_drop(m, A, x + r0 * K, du, n, K); /* (du: the forward's xd, dropout) */
            mrl_lora_fwd(m->k, m->lora, A, B, xe, y + r0 * N, n, N, K, u);
            continue;
        }
        mrl_lora_bwd(m, A, B, G->eA[j] + e * r * K, G->eB[j] + e * N * r, x + r0 * K, dy + r0 * N,
                     dx ? dx + r0 * K : NULL, n, N, K, u, du);
    }
}

void mrl_moe_experts_forward(const mrl_model *m, const layer_params *p, int64_t e0, int64_t ne, const int32_t *eoff,
                             const float *x, float *gate, float *up, float *act, float *y, float *u, float *xd) {
    int64_t D = m->cfg.hidden_size, Fe = m->cfg.moe_intermediate_size;
    prod_batch b = {.m = m};
    for (int64_t i = 0; i < ne; i++) {
        int64_t e = e0 + i, r0 = eoff[i], n = eoff[i + 1] - r0;
        if (!n) continue;
        push(&b, fwd(gate + r0 * Fe, x + r0 * D, p->ewg + e * Fe * D, n, Fe, D), at16(p->heg, e * Fe * D));
        push(&b, fwd(up + r0 * Fe, x + r0 * D, p->ewu + e * Fe * D, n, Fe, D), at16(p->heu, e * Fe * D));
    }
    flush(&b);
    experts_lora(m, p->lora, NULL, 0, e0, ne, eoff, x, gate, NULL, NULL, u, xd);
    experts_lora(m, p->lora, NULL, 1, e0, ne, eoff, x, up, NULL, NULL, u, xd);
    m->k->swiglu_fwd(act, gate, up, (int64_t)eoff[ne] * Fe); /* [rows,Fe] */
    for (int64_t i = 0; i < ne; i++) {
        int64_t e = e0 + i, r0 = eoff[i], n = eoff[i + 1] - r0;
        if (n) push(&b, fwd(y + r0 * D, act + r0 * Fe, p->ewd + e * D * Fe, n, D, Fe), at16(p->hed, e * D * Fe));
    }
    flush(&b);
    experts_lora(m, p->lora, NULL, 2, e0, ne, eoff, act, y, NULL, NULL, u, xd);
}

void mrl_moe_forward(const mrl_model *m, const layer_params *p, layer_acts *a, float *out, int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, E = c->num_experts, K = c->num_experts_per_tok, A = T * K;
    k->gemm(0, 1, T, E, D, 1.0f, a->ln2, D, p->router, D, 0.0f, a->rprob, E); /* router logits [T,E] */
    route(k, c, p, a, T);
    k->gather_rows(a->xe, a->ln2, a->tok, A, D); /* [A,D] */
    if (a->ep) /* the rows to the ranks of their experts, the outputs back into ey (moe_ep.c) */
        mrl_moe_ep_forward(m, p, a);
    else
        mrl_moe_experts_forward(m, p, 0, E, a->eoff, a->xe, a->egate, a->eup, a->eact, a->ey, a->lora_u, a->lora_xd);
    for (int64_t t = 0; t < T; t++) { /* out[t] += sum_j w ye, picks in order */
        float *o = out + t * D;
        for (int64_t j = 0; j < K; j++) {
            float w = a->rw[t * K + j];
            const float *y = a->ey + (int64_t)a->row[t * K + j] * D;
            for (int64_t i = 0; i < D; i++) o[i] += w * y[i];
        }
    }
    if (p->swg) { /* DeepSeek's shared experts, on every token: out += SwiGLU(ln2) */
        int64_t Fs = (int64_t)c->n_shared_experts * c->moe_intermediate_size;
        mrl_gemm_desc gu[2] = {fwd(a->sgate, a->ln2, p->swg, T, Fs, D), fwd(a->sup, a->ln2, p->swu, T, Fs, D)};
        mrl_layer_products(m, gu, (const uint16_t *[]){p->hsg, p->hsu}, 2);
        k->swiglu_fwd(a->sact, a->sgate, a->sup, T * Fs);
        mrl_gemm_desc down = fwd(out, a->sact, p->swd, T, D, Fs);
        down.beta = 1.0f;
        mrl_layer_products(m, &down, (const uint16_t *[]){p->hsd}, 1);
    }
}

void mrl_moe_experts_backward(const mrl_model *m, const layer_params *p, const layer_params *g, int64_t e0, int64_t ne,
                              const int32_t *eoff, const float *x, const float *gate, const float *up,
                              const float *act, float *dy, float *df1, float *df2, float *u, float *du) {
    int64_t D = m->cfg.hidden_size, Fe = m->cfg.moe_intermediate_size;
    /* back from y = act Wd_e^T: dWd_e (none when frozen: LoRA), dact (df1) */
    prod_batch b = {.m = m};
    for (int64_t i = 0; i < ne; i++) {
        int64_t e = e0 + i, r0 = eoff[i], n = eoff[i + 1] - r0;
        if (!n) continue;
        if (g->ewd) push(&b, dweight(g->ewd + e * D * Fe, dy + r0 * D, act + r0 * Fe, n, D, Fe), NULL);
        push(&b, dinput(df1 + r0 * Fe, dy + r0 * D, p->ewd + e * D * Fe, n, D, Fe, 0), at16(p->hed, e * D * Fe));
    }
    flush(&b);
    experts_lora(m, p->lora, g->lora, 2, e0, ne, eoff, act, NULL, dy, df1, u, du);
    m->k->swiglu_bwd(df1, df2, df1, gate, up, (int64_t)eoff[ne] * Fe); /* dgate, dup [rows,Fe] */
    /* dWg_e, dWu_e, and dx = dgate Wg_e + dup Wu_e written over dy (read by nothing after the stage above) */
    for (int64_t i = 0; i < ne; i++) {
        int64_t e = e0 + i, r0 = eoff[i], n = eoff[i + 1] - r0;
        if (!n) continue;
        if (g->ewg) push(&b, dweight(g->ewg + e * Fe * D, df1 + r0 * Fe, x + r0 * D, n, Fe, D), NULL);
        if (g->ewu) push(&b, dweight(g->ewu + e * Fe * D, df2 + r0 * Fe, x + r0 * D, n, Fe, D), NULL);
        push(&b, dinput(dy + r0 * D, df1 + r0 * Fe, p->ewg + e * Fe * D, n, Fe, D, 0), at16(p->heg, e * Fe * D));
    }
    flush(&b);
    for (int64_t i = 0; i < ne; i++) {
        int64_t e = e0 + i, r0 = eoff[i], n = eoff[i + 1] - r0;
        if (n) push(&b, dinput(dy + r0 * D, df2 + r0 * Fe, p->ewu + e * Fe * D, n, Fe, D, 1.0f), at16(p->heu, e * Fe * D));
    }
    flush(&b);
    experts_lora(m, p->lora, g->lora, 0, e0, ne, eoff, x, NULL, df1, dy, u, du);
    experts_lora(m, p->lora, g->lora, 1, e0, ne, eoff, x, NULL, df2, dy, u, du);
}

void mrl_moe_backward(mrl_model *m, const layer_params *p, const layer_params *g, const layer_acts *a,
                      const float *dy, float *dln, int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    const grad_scratch *s = &m->gs;
    int64_t D = c->hidden_size, E = c->num_experts, K = c->num_experts_per_tok, A = T * K;
    /* the load-balancing loss: d(coef * aux)/dp[t,e] = coef E picks_e / N^2, the same for every token */
    double aux = m->aux_n > 0 && m->aux_coef > 0 ? m->aux_coef * (double)E / ((double)m->aux_n * m->aux_n) : 0;
    /* dw [A] = dy . ye of each pick, and dye = w dy. Tensor parallel: ye is this rank's slice's
     * part of the experts' outputs, so dw is summed over the group (dw is linear in ye), and the
     * router's gradients below are then the same on every rank. (df2 is free until the experts'
     * backward writes it.) */
    float *dws = s->df2;
    for (int64_t t = 0; t < T; t++) {
        const float *dyt = dy + t * D, *w = a->rw + t * K;
        for (int64_t j = 0; j < K; j++) {
            int64_t r = a->row[t * K + j];
            const float *y = a->ey + r * D;
            float *dyr = s->dye + r * D, dw = 0;
            for (int64_t i = 0; i < D; i++) {
                dw += dyt[i] * y[i];
                dyr[i] = w[j] * dyt[i];
            }
            dws[t * K + j] = dw;
        }
    }
    if (m->tp_size > 1) mrl_model_tp_sum(m, dws, A);
    int grouped = c->arch == MRL_ARCH_DEEPSEEK_V3; /* (sigmoid scores, no load-balancing loss) */
    float rsf = (float)c->routed_scaling_factor;
    for (int64_t t = 0; t < T; t++) {
        const float *pt = a->rprob + t * E, *w = a->rw + t * K;
        const int32_t *sel = a->sel + t * K;
        float *dl = s->dlogit + t * E; /* dp first, then d logits in place */
        memset(dl, 0, sizeof(float) * E);
        float dw_w = 0, vsum = 0;
        for (int64_t j = 0; j < K; j++) {
            float dw = dws[t * K + j];
            dl[sel[j]] = dw; /* d w_j (the picks differ): d p without renormalisation */
            dw_w += dw * w[j];
            vsum += pt[sel[j]];
        }
        if (grouped) { /* w_j = c s_j (/ S): ds_j = (c dw_j - sum_i dw_i w_i) / S, or c dw_j; then sigmoid's */
            for (int64_t j = 0; j < K; j++)
                dl[sel[j]] = c->norm_topk_prob ? (rsf * dl[sel[j]] - dw_w) / (vsum + 1e-20f) : rsf * dl[sel[j]];
            for (int64_t e = 0; e < E; e++) dl[e] *= pt[e] * (1 - pt[e]);
            continue;
        }
        if (c->norm_topk_prob) /* w_j = v_j / S: dv_j = (dw_j - sum_i dw_i w_i) / S */
            for (int64_t j = 0; j < K; j++) dl[sel[j]] = (dl[sel[j]] - dw_w) / vsum;
        if (aux > 0)
            for (int64_t e = 0; e < E; e++) dl[e] += (float)(aux * m->aux_picks[e]);
        float dot = 0;
        for (int64_t e = 0; e < E; e++) dot += pt[e] * dl[e];
        for (int64_t e = 0; e < E; e++) dl[e] = pt[e] * (dl[e] - dot);
    }
    if (a->ep) /* d ey to the ranks of the experts, d xe back (moe_ep.c) */
        mrl_moe_ep_backward(m, p, g, a, s->dye);
    else
        mrl_moe_experts_backward(m, p, g, 0, E, a->eoff, a->xe, a->egate, a->eup, a->eact, s->dye, s->df1, s->df2,
                                 a->lora_u, s->lora_du);
    /* the router (fp32; frozen under LoRA), then each pick's dxe back to its token, in grouped order */
    if (g->router) k->gemm(1, 0, E, D, T, 1.0f, s->dlogit, E, a->ln2, D, 1.0f, g->router, D); /* dWr [E,D] */
    if (m->tp_size > 1) { /* the picks' dxe are this rank's slices' parts: summed, then the router's (whole) */
        k->zero(dln, (int64_t)sizeof(float) * T * D);
        k->scatter_add_rows(dln, s->dye, a->tok, A, D);
        mrl_model_tp_sum(m, dln, T * D);
        k->gemm(0, 0, T, D, E, 1.0f, s->dlogit, E, p->router, D, 1.0f, dln, D);
        return;
    }
    k->gemm(0, 0, T, D, E, 1.0f, s->dlogit, E, p->router, D, 0.0f, dln, D);    /* dln [T,D] */
    k->scatter_add_rows(dln, s->dye, a->tok, A, D);
    if (p->swg) { /* the shared experts (df1, df2 free again): their gradients, and theirs of dln */
        int64_t Fs = (int64_t)c->n_shared_experts * c->moe_intermediate_size;
        mrl_gemm_desc down[2] = {dweight(g->swd, dy, a->sact, T, D, Fs), dinput(s->df1, dy, p->swd, T, D, Fs, 0)};
        mrl_layer_products(m, down, (const uint16_t *[]){NULL, p->hsd}, 2);
        k->swiglu_bwd(s->df1, s->df2, s->df1, a->sgate, a->sup, T * Fs);
        mrl_gemm_desc gu[3] = {dweight(g->swg, s->df1, a->ln2, T, Fs, D), dweight(g->swu, s->df2, a->ln2, T, Fs, D),
                               dinput(dln, s->df1, p->swg, T, Fs, D, 1.0f)};
        mrl_layer_products(m, gu, (const uint16_t *[]){NULL, NULL, p->hsg}, 3);
        mrl_gemm_desc up = dinput(dln, s->df2, p->swu, T, Fs, D, 1.0f);
        mrl_layer_products(m, &up, (const uint16_t *[]){p->hsu}, 1);
    }
}

void mrl_moe_aux_add(mrl_model *m, const layer_acts *a, int64_t T) {
    int64_t E = m->cfg.num_experts, A = T * m->cfg.num_experts_per_tok;
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) m->aux_psum[e] += a->rprob[t * E + e];
    for (int64_t i = 0; i < A; i++) m->aux_picks[a->sel[i]] += 1;
    m->aux_n += T;
}

/* aux = E sum_e (picks_e / N) (psum_e / N), N = tokens * sparse layers */
void mrl_moe_aux_finish(mrl_model *m) {
    double sum = 0, n = (double)m->aux_n;
    for (int64_t e = 0; e < m->cfg.num_experts && n > 0; e++) sum += m->aux_picks[e] * m->aux_psum[e];
    m->aux_loss = n > 0 ? m->cfg.num_experts * sum / (n * n) : 0;
}

void mrl_moe_record(mrl_model *m, const layer_acts *a, int64_t T, int ord) {
    int64_t K = m->cfg.num_experts_per_tok, W = (int64_t)mrl_moe_ordinal(&m->cfg, m->cfg.num_hidden_layers) * K;
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < K; j++) m->route_used[t * W + ord * K + j] = (int16_t)a->sel[t * K + j];
    m->replayed += a->replay_count;
    m->replay_differ += a->replay_differ;
}

/* A pipeline stage's sparse layers are a run of the whole model's (model_internal.h): the first's
 * ordinal among them, and how many the whole model has (a batch's routing rows are its). */
static int moe_first(const mrl_model *m) { return m->pp_stages > 1 ? m->pp_moe0 : 0; }
static int moe_all(const mrl_model *m) {
    return m->pp_stages > 1 ? m->pp_moe_all : mrl_moe_ordinal(&m->cfg, m->cfg.num_hidden_layers);
}

mrl_status mrl_moe_check_routing(const mrl_model *m, const mrl_batch *b) {
    if (!b->routing) return MRL_OK;
    int n_moe = moe_all(m);
    if (n_moe == 0)
        return mrl_set_error(MRL_ERR_INVALID, "model forward: batch routing given to a model without sparse layers");
    int64_t E = m->cfg.num_experts, K = m->cfg.num_experts_per_tok;
    for (int64_t t = 0; t < b->n_tokens; t++)
        for (int l = 0; l < n_moe; l++) {
            const int16_t *r = b->routing + (t * n_moe + l) * K;
            for (int64_t j = 0; j < K; j++) {
                if (r[0] < 0 ? r[j] != -1 : (r[j] < 0 || r[j] >= E))
                    return mrl_set_error(MRL_ERR_INVALID, "model forward: routing of token %lld, sparse layer %d, "
                                         "pick %lld is %d (k = %lld experts in 0..%lld, or k times -1)", (long long)t,
                                         l, (long long)j, r[j], (long long)K, (long long)E - 1);
                for (int64_t i = 0; i < j && r[0] >= 0; i++)
                    if (r[i] == r[j])
                        return mrl_set_error(MRL_ERR_INVALID, "model forward: routing of token %lld, sparse layer "
                                             "%d names expert %d twice", (long long)t, l, r[j]);
            }
        }
    return MRL_OK;
}

int mrl_moe_ordinal(const mrl_model_config *c, int l) {
    int n = 0;
    for (int i = 0; i < l; i++) n += mrl_model_layer_is_moe(c, i);
    return n;
}

void mrl_moe_replay_at(const mrl_model *m, layer_acts *a, int l) {
    const mrl_model_config *c = &m->cfg;
    int64_t K = c->num_experts_per_tok;
    a->replay = m->batch.routing ? m->batch.routing + (moe_first(m) + mrl_moe_ordinal(c, l)) * K : NULL;
    a->replay_stride = moe_all(m) * K;
}

int mrl_model_num_moe_layers(const mrl_model *m) { return m ? moe_all(m) : 0; }

mrl_status mrl_model_get_routing(const mrl_model *m, int16_t *out, int64_t cap) {
    if (!m || !out) return mrl_set_error(MRL_ERR_INVALID, "model get_routing: NULL argument");
    if (!m->have_forward) return mrl_set_error(MRL_ERR_INVALID, "model get_routing: no forward yet");
    /* (a pipeline stage: its own layers' columns, the others' -1) */
    int64_t K = m->cfg.num_experts_per_tok, all = moe_all(m), mine = mrl_moe_ordinal(&m->cfg, m->cfg.num_hidden_layers);
    int64_t T = m->batch.n_tokens, n = T * all * K;
    if (cap < n)
        return mrl_set_error(MRL_ERR_INVALID, "model get_routing: room for %lld entries, the last forward has %lld "
                             "(n_tokens x sparse layers x num_experts_per_tok)", (long long)cap, (long long)n);
    for (int64_t i = 0; i < n && mine < all; i++) out[i] = -1;
    for (int64_t t = 0; t < T && mine > 0; t++)
        memcpy(out + (t * all + moe_first(m)) * K, m->route_used + t * mine * K, sizeof(int16_t) * (size_t)(mine * K));
    return MRL_OK;
}

void mrl_model_routing_replay_stats(const mrl_model *m, int64_t *replayed, int64_t *differ) {
    if (replayed) *replayed = m ? m->replayed : 0;
    if (differ) *differ = m ? m->replay_differ : 0;
}
