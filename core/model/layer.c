/* One transformer layer, forward and backward side by side.
 * T tokens, D hidden, Hq/Hk heads of hd, Q = Hq*hd, K = Hk*hd, F intermediate.
 *
 *   ln1 = rmsnorm(x) ; q,k,v = ln1 Wq^T (+bq), ...  ; [qwen3: q,k = rmsnorm per head]
 *   q,k = rope(q,k) ; att = attention(q,k,v) ; h = x + att Wo^T
 *   ln2 = rmsnorm(h) ; act = silu(ln2 Wg^T) * (ln2 Wu^T) ; x' = h + act Wd^T
 * Tensor parallel (tp.c): the config's heads and F are this rank's slices;
 * att Wo^T and act Wd^T are then partial sums, and so are the input
 * gradients dln1, dln2 of the sliced products: each is summed over the
 * group before the residual stream or the norm reads it. Context parallel
 * (cp.c): T is this rank's share of the tokens, and attention runs on every
 * token of this rank's share of the heads, between two all-to-alls. */
#include <math.h>
#include "model_internal.h"

static void add_bias(const mrl_kernels *k, float *y, const float *b, int64_t T, int N) {
    if (b) k->bias_add(y, b, T, N);
}

/* db[N] += sum_t dy[t] */
static void bias_grad(const mrl_kernels *k, float *db, const float *dy, int64_t T, int N) {
    if (db) k->bias_bwd(db, dy, T, N);
}

/* y[T,N] = x[T,K] W[N,K]^T (+ beta y); Wp: W as weight panels (the engine's, in the
 * model's dtype's layout), or NULL */
static mrl_gemm_desc lin_p(float *y, const float *x, const float *W, const void *Wp, int64_t T, int N, int K,
                           float beta) {
    if (Wp) return (mrl_gemm_desc){0, 1, T, N, K, 1.0f, x, K, (const float *)Wp, K, beta, y, N, .b_panels = 1};
    return (mrl_gemm_desc){0, 1, T, N, K, 1.0f, x, K, W, K, beta, y, N};
}

/* product i of the seven (mrl_layer_matrices' order): lin_p's, or read from a quantized base's
 * blocks (p->quant: the engine's steps of few rows) */
static mrl_gemm_desc lin_w(const layer_params *p, int i, float *y, const float *x, const float *W, const void *Wp,
                           int64_t T, int N, int K, float beta) {
    if (p->quant && p->quant->w[i])
        return (mrl_gemm_desc){0, 1, T, N, K, 1.0f, x, K, (const float *)p->quant->w[i], K, beta, y, N,
                               .b_quant = p->quant->type[i]};
    return lin_p(y, x, W, Wp, T, N, K, beta);
}

/* dW[N,K] += dy[T,N]^T x[T,K] */
static mrl_gemm_desc lin_dw(float *dW, const float *dy, const float *x, int64_t T, int N, int K) {
    return (mrl_gemm_desc){1, 0, N, K, T, 1.0f, dy, N, x, K, 1.0f, dW, K};
}

/* dx[T,K] = dy[T,N] W[N,K] (+ beta dx) */
static mrl_gemm_desc lin_dx(float *dx, const float *dy, const float *W, int64_t T, int N, int K, float beta) {
    return (mrl_gemm_desc){0, 0, T, K, N, 1.0f, dy, N, W, K, beta, dx, K};
}

/* The products of one stage: in fp32 together (gemm_group), in bf16 one
 * after the other through gemm_bf16, each parallel inside, with fp32
 * accumulation (moonrl/model.h, "precision"). w16[i]: product i's B as the
 * bf16 copy of the weight it reads (x W^T, dy W), or NULL: B is fp32 and
 * rounded on its way in (dW = dy^T x: both operands are activations; or a
 * model in bf16 whose caller gave no copies). A is always rounded on its
 * way in. B given as weight panels (the engine's): bf16 weight panels in
 * bf16, read with (or instead of) the plain copy by gemm_bf16_panels. */
static void products(const mrl_model *m, const mrl_gemm_desc *d, const uint16_t *const *w16, int n) {
    const mrl_kernels *k = m->k;
    mrl_gemm_desc kept[8];
    const uint16_t *kept16[8];
    int drop = 0;
    for (int i = 0; i < n; i++) { /* (a quantized base's blocks: their own product, done here) */
        if (d[i].b_quant && d[i].C)
            k->qgemm(d[i].b_quant, d[i].M, d[i].N, d[i].K, d[i].alpha, d[i].A, d[i].lda, d[i].B, d[i].beta, d[i].C,
                     d[i].ldc);
        drop += d[i].C == NULL || d[i].b_quant;
    }
    if (drop && n <= 8) { /* a frozen weight's gradient (LoRA: lora.c) has no destination: not computed */
        int j = 0;
        for (int i = 0; i < n; i++)
            if (d[i].C && !d[i].b_quant) kept[j] = d[i], kept16[j++] = w16 ? w16[i] : NULL;
        d = kept, w16 = kept16, n = j;
    }
    if (m->dtype != MRL_MODEL_BF16) {
        k->gemm_group(d, n);
        return;
    }
    int one_a = n > 1 && n <= 8; /* every B as panels, one A: a group (A packed once, one parallel region) */
    for (int i = 0; i < n && one_a; i++)
        one_a = d[i].b_panels && d[i].A == d[0].A && d[i].M == d[0].M && d[i].K == d[0].K && d[i].lda == d[0].lda;
    if (one_a) {
        mrl_panels_part w[8];
        for (int i = 0; i < n; i++)
            w[i] = (mrl_panels_part){d[i].N, (const uint32_t *)d[i].B, w16 ? w16[i] : NULL, d[i].K, d[i].alpha,
                                     d[i].beta, d[i].C, d[i].ldc};
        k->gemm_bf16_panels_group(d[0].M, d[0].K, d[0].A, d[0].lda, w, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        const mrl_gemm_desc *g = &d[i];
        const uint16_t *b = w16 ? w16[i] : NULL;
        if (g->b_panels) { /* bf16 weight panels, and the plain copy: the table reads the faster */
            k->gemm_bf16_panels(g->M, g->N, g->K, g->alpha, g->A, g->lda, (const uint32_t *)g->B, b, g->K, g->beta,
                                g->C, g->ldc);
            continue;
        }
        k->gemm_bf16(g->trans_a, g->trans_b, g->M, g->N, g->K, g->alpha, g->A, 0, g->lda, b ? (const void *)b : g->B,
                     b != NULL, g->ldb, g->beta, g->C, g->ldc);
    }
}

static void run1(const mrl_model *m, mrl_gemm_desc d, const uint16_t *w16) { products(m, &d, &w16, 1); }

void mrl_layer_products(const mrl_model *m, const mrl_gemm_desc *d, const uint16_t *const *w16, int n) {
    products(m, d, w16, n);
}

/* LoRA's part of product i (mrl_layer_matrices' order) of x [T,K] into y [T,N] (lora.c): the
 * model's adapters (p->lora), or the engine's segments of rows, each with an adapter of its own
 * (a->lora_segs: several adapters in one batch; a segment without adapters is the base). */
static void lora_fwd(const mrl_model *m, const layer_params *p, const layer_acts *a, int i, const float *x, float *y,
                     int64_t T, int64_t N, int64_t K) {
    if (a->lora_segs) {
        for (int s = 0; s < a->n_lora_segs; s++) {
            const lora_seg *g = &a->lora_segs[s];
            if (g->L && g->L->A[i])
                mrl_lora_fwd(m->k, g->ad, g->L->A[i], g->L->B[i], x + g->row0 * K, y + g->row0 * N, g->rows, N, K,
                             a->lora_u);
        }
        return;
    }
    if (p->lora && p->lora->A[i]) /* (a training forward of the trainer's: dropout, a->lora_xd) */
        mrl_lora_fwd(m->k, m->lora, p->lora->A[i], p->lora->B[i], mrl_lora_drop(m, p->lora->A[i], x, a->lora_xd, T, K),
                     y, T, N, K, a->lora_u);
}

/* The absorbed form's inputs (the engine over a latent cache, engine.h MRL_MLA_LATENT), once
 * mla_proj has the queries (a->qf) and the normed latent and rope key (a->cn, a->kr):
 *   qcat[t,h] = [q_nope[t,h] Wuk_h, q_rope[t,h]]   Wuk_h = kv_b_proj's key rows of head h [dn, rkv]
 *   qabs = qcat with its rope part turned; lat[t] = [c'[t], rope(kr[t])]   (W = rkv + dr values)
 * so that qabs[t,h] . lat[j] = q_nope k_nope + q_rope k_rope of the expanded form. */
void mrl_layer_mla_absorb(const mrl_model *m, const layer_params *p, layer_acts *a, const int32_t *pos, int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    int H = c->num_attention_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim,
        rkv = c->kv_lora_rank, W = rkv + dr;
    enum { BATCH = 64 };
    mrl_gemm_desc d[BATCH];
    const uint16_t *w16[BATCH];
    for (int h0 = 0; h0 < H; h0 += BATCH) { /* q_nope[t,h] [dn] times Wuk_h [dn, rkv], a product a head */
        int n = H - h0 < BATCH ? H - h0 : BATCH;
        for (int i = 0; i < n; i++) {
            int64_t off = (int64_t)(h0 + i) * (dn + dv) * rkv;
            d[i] = (mrl_gemm_desc){0, 0, T, rkv, dn, 1.0f, a->qf + (int64_t)(h0 + i) * (dn + dr), (int64_t)H * (dn + dr),
                                   p->wv + off, rkv, 0.0f, a->mla_qcat + (int64_t)(h0 + i) * W, (int64_t)H * W};
            w16[i] = p->hv ? p->hv + off : NULL;
        }
        products(m, d, w16, n);
    }
    k->copy_rows(a->mla_qcat + rkv, W, a->qf + dn, dn + dr, T * H, dr); /* each head's rope part */
    k->mla_qkv(a->mla_qabs, NULL, NULL, a->mla_qcat, NULL, NULL, pos, m->rope_cos, m->rope_sin, T, H, rkv, dr, 0, W,
               c->rope_interleave);
    k->mla_qkv(NULL, a->mla_lat, NULL, NULL, a->cn, a->kr, pos, m->rope_cos, m->rope_sin, T, 1, rkv, dr, 0, W,
               c->rope_interleave);
}

/* The absorbed form's output: att_v[t,h] = olat[t,h] Wuv_h^T, Wuv_h = kv_b_proj's value rows of
 * head h [dv, rkv]: the attention's output in the values' space, o_proj's input. */
void mrl_layer_mla_unabsorb(const mrl_model *m, const layer_params *p, layer_acts *a, int64_t T) {
    const mrl_model_config *c = &m->cfg;
    int H = c->num_attention_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim, rkv = c->kv_lora_rank;
    enum { BATCH = 64 };
    mrl_gemm_desc d[BATCH];
    const uint16_t *w16[BATCH];
    for (int h0 = 0; h0 < H; h0 += BATCH) {
        int n = H - h0 < BATCH ? H - h0 : BATCH;
        for (int i = 0; i < n; i++) {
            int64_t off = ((int64_t)(h0 + i) * (dn + dv) + dn) * rkv;
            d[i] = (mrl_gemm_desc){0, 1, T, dv, rkv, 1.0f, a->mla_olat + (int64_t)(h0 + i) * rkv, (int64_t)H * rkv,
                                   p->wv + off, rkv, 0.0f, a->att_v + (int64_t)(h0 + i) * dv, (int64_t)H * dv};
            w16[i] = p->hv ? p->hv + off : NULL;
        }
        products(m, d, w16, n);
    }
}

/* Multi-head latent attention's inputs (moonrl/model.h) of T tokens from ln [T,D]: the queries
 * (through q_a_proj, its norm and q_b_proj when q_lora_rank > 0), the latent and the rope key
 * (kv_a_proj_with_mqa's output, split), the latent normed, kv_b_proj's keys and values of every
 * head; then mla_qkv turns the rope parts and pads q, k, v to the attention's head. */
static void mla_proj(const mrl_model *m, const layer_params *p, layer_acts *a, const float *ln, const int32_t *pos,
                     int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    int D = c->hidden_size, H = c->num_attention_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
        dv = c->v_head_dim, rq = c->q_lora_rank, rkv = c->kv_lora_rank;
    float eps = (float)c->rms_norm_eps;
    const float *qin = ln;
    if (rq) { /* q = q_b_proj(q_a_layernorm(q_a_proj(x))) */
        run1(m, lin_p(a->qa, ln, p->wqa, NULL, T, rq, D, 0), p->hqa);
        k->rmsnorm_fwd(a->qan, a->rstdqa, a->qa, p->q_a_norm, T, rq, eps);
        qin = a->qan;
    }
    mrl_gemm_desc d[2] = {lin_w(p, 0, a->qf, qin, p->wq, p->pq, T, H * (dn + dr), rq ? rq : D, 0),
                          lin_w(p, 1, a->kva, ln, p->wk, p->pk, T, rkv + dr, D, 0)};
    products(m, d, (const uint16_t *[]){p->hq, p->hk}, 2);
    k->copy_rows(a->ckv, rkv, a->kva, rkv + dr, T, rkv); /* [c | kr] apart */
    k->copy_rows(a->kr, dr, a->kva + rkv, rkv + dr, T, dr);
    k->rmsnorm_fwd(a->cn, a->rstdc, a->ckv, p->kv_a_norm, T, rkv, eps);
    if (a->mla_absorbed == 1) { /* the engine's latent cache (engine.h): no per-head keys and values */
        mrl_layer_mla_absorb(m, p, a, pos, T);
        return;
    }
    run1(m, lin_w(p, 2, a->kvb, a->cn, p->wv, p->pv, T, H * (dn + dv), rkv, 0), p->hv);
    k->mla_qkv(a->q, a->k, a->v, a->qf, a->kvb, a->kr, pos, m->rope_cos, m->rope_sin, T, H, dn, dr, dv, c->head_dim,
               c->rope_interleave);
}

int64_t mrl_mla_acts_layout(const mrl_model_config *c, layer_acts *a, int64_t T, char *base, int what) {
    int64_t off = 0;
    if (base) a->mla_absorbed = 0, a->mla_qcat = a->mla_qabs = a->mla_lat = a->mla_olat = NULL; /* (the engine's) */
    if (!mrl_model_is_mla(c)) {
        if (base) a->qa = a->qan = a->rstdqa = a->ckv = a->cn = a->rstdc = a->att_v = a->qf = a->kva = a->kr = a->kvb = NULL;
        return 0;
    }
    int64_t H = c->num_attention_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim,
            rq = c->q_lora_rank, rkv = c->kv_lora_rank;
#define TAKE(ptr, count) MRL_LAYOUT_TAKE(base, off, ptr, float, count)
    if (what & 1) {
        if (rq) {
            TAKE(a->qa, T * rq);
            TAKE(a->qan, T * rq);
            TAKE(a->rstdqa, T);
        } else if (base) {
            a->qa = a->qan = a->rstdqa = NULL;
        }
        TAKE(a->ckv, T * rkv);
        TAKE(a->cn, T * rkv);
        TAKE(a->rstdc, T);
        TAKE(a->att_v, T * H * dv);
    }
    if (what & 2) {
        TAKE(a->qf, T * H * (dn + dr));
        TAKE(a->kva, T * (rkv + dr));
        TAKE(a->kr, T * dr);
        TAKE(a->kvb, T * H * (dn + dv));
    }
#undef TAKE
    return off;
}

/* The attention inputs of T tokens at positions pos: ln1 = rmsnorm(x), q, k, v
 * (+ biases, qwen3 per-head norms), RoPE on q and k. Fills a's ln1, rstd1,
 * (qraw, kraw, rstdq, rstdk,) q, k, v. Shared with the engine. */
/* q, k, v of T tokens from ln [T,D] (the norm's output; under sequence parallel, gathered) */
static void qkv_proj(const mrl_model *m, const layer_params *p, layer_acts *a, const float *ln, const int32_t *pos,
                     int64_t T) {
    if (mrl_model_is_mla(&m->cfg)) {
        mla_proj(m, p, a, ln, pos, T);
        return;
    }
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    int D = c->hidden_size, hd = c->head_dim, Hq = c->num_attention_heads, Hk = c->num_key_value_heads,
        Q = Hq * hd, K = Hk * hd;
    float eps = (float)c->rms_norm_eps;
    float *q = a->qraw ? a->qraw : a->q, *kk = a->kraw ? a->kraw : a->k;
    mrl_gemm_desc qkv[3] = {lin_w(p, 0, q, ln, p->wq, p->pq, T, Q, D, 0),     /* [T,Q] */
                            lin_w(p, 1, kk, ln, p->wk, p->pk, T, K, D, 0),    /* [T,K] */
                            lin_w(p, 2, a->v, ln, p->wv, p->pv, T, K, D, 0)}; /* [T,K] */
    products(m, qkv, (const uint16_t *[]){p->hq, p->hk, p->hv}, 3);
    lora_fwd(m, p, a, 0, ln, q, T, Q, D);
    lora_fwd(m, p, a, 1, ln, kk, T, K, D);
    lora_fwd(m, p, a, 2, ln, a->v, T, K, D);
    add_bias(k, q, p->bq, T, Q);
    add_bias(k, kk, p->bk, T, K);
    add_bias(k, a->v, p->bv, T, K);
    if (a->qraw) {                                                       /* per head [T*H, hd] */
        k->rmsnorm_fwd(a->q, a->rstdq, a->qraw, p->q_norm, T * Hq, hd, eps);
        k->rmsnorm_fwd(a->k, a->rstdk, a->kraw, p->k_norm, T * Hk, hd, eps);
    }
    k->rope(a->q, pos, m->rope_cos, m->rope_sin, T, Hq, hd, 0);
    k->rope(a->k, pos, m->rope_cos, m->rope_sin, T, Hk, hd, 0);
}

void mrl_layer_qkv(const mrl_model *m, const layer_params *p, layer_acts *a, const float *x, const int32_t *pos,
                   int64_t T) {
    m->k->rmsnorm_fwd(a->ln1, a->rstd1, x, p->ln1, T, m->cfg.hidden_size, (float)m->cfg.rms_norm_eps); /* [T,D] */
    qkv_proj(m, p, a, a->ln1, pos, T);
}

/* The rest of the layer once a->att holds the attention output:
 * h = x + att Wo^T, ln2 = rmsnorm(h), act = silu(ln2 Wg^T) * (ln2 Wu^T),
 * out = h + act Wd^T (out may be x). Shared with the engine. */
void mrl_layer_out(const mrl_model *m, const layer_params *p, layer_acts *a, const float *x, float *out,
                   int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    int D = c->hidden_size, F = c->intermediate_size, Q = c->num_attention_heads * c->head_dim;
    int64_t TD = T * D;
    const float *att = a->att;
    if (mrl_model_is_mla(c)) { /* each head's dv values (of its padded head, or of the latent's): o_proj's input */
        int H = c->num_attention_heads, dv = c->v_head_dim;
        if (a->mla_absorbed == 1) mrl_layer_mla_unabsorb(m, p, a, T);
        else if (a->mla_absorbed == 0) k->copy_rows(a->att_v, dv, a->att, c->head_dim, T * H, dv);
        /* (2: the engine filled att_v itself, some rows each way) */
        att = a->att_v, Q = H * dv;
    }
    if (m->tp_size > 1) { /* h = x + the sum over the group of each rank's heads' part */
        run1(m, lin_w(p, 3, a->h, att, p->wo, p->po, T, D, Q, 0), p->ho);
        mrl_model_tp_sum(m, a->h, TD);
        k->add(a->h, x, TD);
    } else {
        k->copy(a->h, x, (int64_t)sizeof(float) * TD);
        run1(m, lin_w(p, 3, a->h, att, p->wo, p->po, T, D, Q, 1.0f), p->ho); /* h = x + att Wo^T */
        lora_fwd(m, p, a, 3, att, a->h, T, D, Q);
    }
    k->rmsnorm_fwd(a->ln2, a->rstd2, a->h, p->ln2, T, D, (float)c->rms_norm_eps);
    if (p->router) { /* a sparse layer: out = h + the experts' weighted sum */
        if (m->tp_size > 1) { /* (each rank's slice of every expert: its part of the sum, moe.c) */
            k->zero(out, (int64_t)sizeof(float) * TD);
            mrl_moe_forward(m, p, a, out, T);
            mrl_model_tp_sum(m, out, TD);
            k->add(out, a->h, TD);
            return;
        }
        k->copy(out, a->h, (int64_t)sizeof(float) * T * D);
        mrl_moe_forward(m, p, a, out, T);
        return;
    }
    mrl_gemm_desc gu[2] = {lin_w(p, 4, a->gate, a->ln2, p->wg, p->pg, T, F, D, 0), /* [T,F] */
                           lin_w(p, 5, a->up, a->ln2, p->wu, p->pu, T, F, D, 0)};  /* [T,F] */
    products(m, gu, (const uint16_t *[]){p->hg, p->hu}, 2);
    lora_fwd(m, p, a, 4, a->ln2, a->gate, T, F, D);
    lora_fwd(m, p, a, 5, a->ln2, a->up, T, F, D);
    k->swiglu_fwd(a->act, a->gate, a->up, T * F);
    if (m->tp_size > 1) { /* out = h + the sum over the group of each rank's slice's part */
        run1(m, lin_w(p, 6, out, a->act, p->wd, p->pd, T, D, F, 0), p->hd);
        mrl_model_tp_sum(m, out, TD);
        k->add(out, a->h, TD);
        return;
    }
    k->copy(out, a->h, (int64_t)sizeof(float) * TD);
    run1(m, lin_w(p, 6, out, a->act, p->wd, p->pd, T, D, F, 1.0f), p->hd);     /* out = h + act Wd^T */
    lora_fwd(m, p, a, 6, a->act, out, T, D, F);
}

/* Sequence parallel (tp.c): x and out are this rank's rows [tl,D] of the residual stream, and
 * so are ln1, h, ln2 and their rstd; the norms' outputs are gathered into gs.sp_full for the
 * column-parallel products (T rows), whose row-parallel partial sums are reduce-scattered. */
static void sp_forward(mrl_model *m, int l, int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    const layer_params *p = &m->lp[l];
    layer_acts *a = &m->la[l];
    int D = c->hidden_size, F = c->intermediate_size, Hq = c->num_attention_heads, Q = Hq * c->head_dim;
    float eps = (float)c->rms_norm_eps, *full = m->gs.sp_full, *out = m->xs[l + 1];
    const float *x = m->xs[l];
    int64_t tl = m->sp_tl;
    k->rmsnorm_fwd(a->ln1, a->rstd1, x, p->ln1, tl, D, eps);
    mrl_model_sp_gather(m, a->ln1, full);                                      /* ln1 [T,D] */
    qkv_proj(m, p, a, full, m->pos, T);
    m->k->attn_fwd(a->att, a->lse, a->q, a->k, a->v, m->op_cu_seqlens, m->op_prefix, m->batch.n_seqs, Hq,
                   c->num_key_value_heads, c->head_dim, mrl_model_attn_scale(c));
    run1(m, lin_p(full, a->att, p->wo, p->po, T, D, Q, 0), p->ho);           /* this rank's heads' part [T,D] */
    mrl_model_sp_reduce_scatter(m, full, a->h);
    k->add(a->h, x, tl * D);                                                  /* h = x + att Wo^T, [tl,D] */
    k->rmsnorm_fwd(a->ln2, a->rstd2, a->h, p->ln2, tl, D, eps);
    mrl_model_sp_gather(m, a->ln2, full);                                      /* ln2 [T,D] */
    mrl_gemm_desc gu[2] = {lin_p(a->gate, full, p->wg, p->pg, T, F, D, 0), lin_p(a->up, full, p->wu, p->pu, T, F, D, 0)};
    products(m, gu, (const uint16_t *[]){p->hg, p->hu}, 2);
    k->swiglu_fwd(a->act, a->gate, a->up, T * F);
    run1(m, lin_p(full, a->act, p->wd, p->pd, T, D, F, 0), p->hd);           /* this rank's slice's part [T,D] */
    mrl_model_sp_reduce_scatter(m, full, out);
    k->add(out, a->h, tl * D);                                                /* out = h + act Wd^T, [tl,D] */
}

void mrl_layer_forward(mrl_model *m, int l, int64_t T) {
    if (m->tp_seq) {
        sp_forward(m, l, T);
        return;
    }
    const mrl_model_config *c = &m->cfg;
    layer_acts *a = &m->la[l];
    if (m->lp[l].router) {
        mrl_moe_replay_at(m, a, l); /* the batch's routing, if any (mrl_batch.routing) */
        a->ep = mrl_moe_ep_layer(m, mrl_moe_ordinal(&m->cfg, l)); /* expert parallelism, if on */
    }
    int Hq = c->num_attention_heads, Hk = c->num_key_value_heads, cp = m->cp_size > 1 ? m->cp_size : 1;
    float scale = mrl_model_attn_scale(c);
    if (cp > 1) { /* context parallel (cp.c): this rank's heads of every token around attention */
        layer_acts mine = *a; /* q, k, v of this rank's tokens in the backward's scratch (free now) */
        mine.q = m->gs.dq, mine.k = m->gs.dk, mine.v = m->gs.dv;
        mrl_layer_qkv(m, &m->lp[l], &mine, m->xs[l], m->pos, T);
        mrl_model_cp_to_heads(m, mine.q, Hq, a->q);
        mrl_model_cp_to_heads(m, mine.k, Hk, a->k);
        mrl_model_cp_to_heads(m, mine.v, Hk, a->v);
        m->k->attn_fwd(a->att_h, a->lse, a->q, a->k, a->v, m->op_cu_seqlens, m->op_prefix, m->batch.n_seqs, Hq / cp,
                       Hk / cp, c->head_dim, scale);
        mrl_model_cp_to_tokens(m, a->att_h, Hq, a->att);
    } else {
        mrl_layer_forward_io(m, &m->lp[l], a, m->xs[l], m->xs[l + 1], T);
        return;
    }
    mrl_layer_out(m, &m->lp[l], a, m->xs[l], m->xs[l + 1], T);
}

void mrl_layer_forward_io(mrl_model *m, const layer_params *p, layer_acts *a, const float *x, float *out, int64_t T) {
    const mrl_model_config *c = &m->cfg;
    mrl_layer_qkv(m, p, a, x, m->pos, T);
    m->k->attn_fwd(a->att, a->lse, a->q, a->k, a->v, m->op_cu_seqlens, m->op_prefix, m->batch.n_seqs,
                   c->num_attention_heads, c->num_key_value_heads, c->head_dim, mrl_model_attn_scale(c)); /* [T,Q] */
    mrl_layer_out(m, p, a, x, out, T);
}

/* Back through q, k, v of T tokens from datt (in s->datt, [T,Q], the attention output's
 * gradient), ln [T,D] their input: the parameter gradients added, dln [T,D] = the input's
 * gradient (under tensor parallel this rank's heads' part). Shared by both backwards. */
static void qkv_backward(mrl_model *m, const layer_params *p, const layer_params *g, const layer_acts *a,
                         const grad_scratch *s, const float *ln, int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    int D = c->hidden_size, hd = c->head_dim, Hq = c->num_attention_heads, Hk = c->num_key_value_heads,
        Q = Hq * hd, K = Hk * hd;
    k->rope(s->dq, m->pos, m->rope_cos, m->rope_sin, T, Hq, hd, 1);
    k->rope(s->dk, m->pos, m->rope_cos, m->rope_sin, T, Hk, hd, 1);
    float *dq = s->dq, *dk = s->dk;
    if (a->qraw) { /* back through the per-head norms: datt, dk2 are free now */
        k->zero(s->datt, (int64_t)sizeof(float) * T * Q);
        k->zero(s->dk2, (int64_t)sizeof(float) * T * K);
        /* tensor parallel: each rank's heads give part of the shared norms' gradients, summed over the group */
        float *gq = s->dnorm ? s->dnorm : g->q_norm, *gk = s->dnorm ? s->dnorm + hd : g->k_norm;
        if (s->dnorm) k->zero(s->dnorm, (int64_t)sizeof(float) * 2 * hd);
        k->rmsnorm_bwd(s->datt, gq, s->dq, a->qraw, p->q_norm, a->rstdq, T * Hq, hd);
        k->rmsnorm_bwd(s->dk2, gk, s->dk, a->kraw, p->k_norm, a->rstdk, T * Hk, hd);
        if (s->dnorm) {
            mrl_model_tp_sum(m, s->dnorm, 2 * hd);
            k->add(g->q_norm, gq, hd);
            k->add(g->k_norm, gk, hd);
        }
        dq = s->datt;
        dk = s->dk2;
    }
    bias_grad(k, g->bq, dq, T, Q);
    bias_grad(k, g->bk, dk, T, K);
    bias_grad(k, g->bv, s->dv, T, K);
    mrl_gemm_desc qkv[4] = {lin_dw(g->wq, dq, ln, T, Q, D), lin_dw(g->wk, dk, ln, T, K, D),
                            lin_dw(g->wv, s->dv, ln, T, K, D),
                            lin_dx(s->dln, dq, p->wq, T, Q, D, 0)};     /* dln1 [T,D] = dq Wq ... */
    products(m, qkv, (const uint16_t *[]){NULL, NULL, NULL, p->hq}, 4);
    run1(m, lin_dx(s->dln, dk, p->wk, T, K, D, 1.0f), p->hk);            /* ... + dk Wk */
    run1(m, lin_dx(s->dln, s->dv, p->wv, T, K, D, 1.0f), p->hv);         /* ... + dv Wv */
    if (p->lora) { /* (lora.c) */
        const lora_layer *A = p->lora, *G = g->lora;
        mrl_lora_bwd(m, A->A[0], A->B[0], G->A[0], G->B[0], ln, dq, s->dln, T, Q, D, a->lora_u, s->lora_du);
        mrl_lora_bwd(m, A->A[1], A->B[1], G->A[1], G->B[1], ln, dk, s->dln, T, K, D, a->lora_u, s->lora_du);
        mrl_lora_bwd(m, A->A[2], A->B[2], G->A[2], G->B[2], ln, s->dv, s->dln, T, K, D, a->lora_u, s->lora_du);
    }
}

/* MLA's back through mla_proj from dq, dk, dv (s, [T,H,hd]): the parameter gradients added,
 * dln [T,D] = the gradient of ln, its input. */
static void mla_backward(mrl_model *m, const layer_params *p, const layer_params *g, const layer_acts *a,
                         const grad_scratch *s, const float *ln, int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    int D = c->hidden_size, H = c->num_attention_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
        dv = c->v_head_dim, rq = c->q_lora_rank, rkv = c->kv_lora_rank, Nq = H * (dn + dr), Nkv = H * (dn + dv);
    k->mla_qkv_bwd(s->mla_dqf, s->mla_dkvb, s->mla_dkr, s->dq, s->dk, s->dv, m->pos, m->rope_cos, m->rope_sin, T, H,
                   dn, dr, dv, c->head_dim, c->rope_interleave);
    /* kv_b_proj, then the latent's norm: dc = its input's gradient */
    mrl_gemm_desc kvb[2] = {lin_dw(g->wv, s->mla_dkvb, a->cn, T, Nkv, rkv), lin_dx(s->mla_dcn, s->mla_dkvb, p->wv, T, Nkv, rkv, 0)};
    products(m, kvb, (const uint16_t *[]){NULL, p->hv}, 2);
    k->zero(s->mla_dc, (int64_t)sizeof(float) * T * rkv);
    k->rmsnorm_bwd(s->mla_dc, g->kv_a_norm, s->mla_dcn, a->ckv, p->kv_a_norm, a->rstdc, T, rkv);
    k->copy_rows(s->mla_dkva, rkv + dr, s->mla_dc, rkv, T, rkv); /* kv_a_proj_with_mqa's output [dc | dkr] */
    k->copy_rows(s->mla_dkva + rkv, rkv + dr, s->mla_dkr, dr, T, dr);
    /* the queries: through q_b_proj and q_a_proj's norm to q_a_proj's output, or q_proj's */
    const float *dqin = s->mla_dqf, *Wqin = p->wq;
    const uint16_t *hqin = p->hq;
    float *gWqin = g->wq;
    int Nqin = Nq;
    if (rq) {
        mrl_gemm_desc qb[2] = {lin_dw(g->wq, s->mla_dqf, a->qan, T, Nq, rq), lin_dx(s->mla_dqan, s->mla_dqf, p->wq, T, Nq, rq, 0)};
        products(m, qb, (const uint16_t *[]){NULL, p->hq}, 2);
        k->zero(s->mla_dqa, (int64_t)sizeof(float) * T * rq);
        k->rmsnorm_bwd(s->mla_dqa, g->q_a_norm, s->mla_dqan, a->qa, p->q_a_norm, a->rstdqa, T, rq);
        dqin = s->mla_dqa, Wqin = p->wqa, hqin = p->hqa, gWqin = g->wqa, Nqin = rq;
    }
    mrl_gemm_desc in[3] = {lin_dw(gWqin, dqin, ln, T, Nqin, D), lin_dw(g->wk, s->mla_dkva, ln, T, rkv + dr, D),
                           lin_dx(s->dln, dqin, Wqin, T, Nqin, D, 0)}; /* dln = dq_in Wq_in ... */
    products(m, in, (const uint16_t *[]){NULL, NULL, hqin}, 3);
    run1(m, lin_dx(s->dln, s->mla_dkva, p->wk, T, rkv + dr, D, 1.0f), p->hk); /* ... + dkva Wkv_a */
}

/* Sequence parallel (sp_forward): in s->dx this rank's rows [tl,D] of dL/dx', out dL/dx. The
 * upstream rows are gathered for the products' backward (T rows), the norms' outputs gathered
 * again for their weight gradients, and the input gradients' partial sums reduce-scattered to
 * the rows before each norm's backward; the norms' weight gradients summed over the group. */
static void sp_backward(mrl_model *m, int l, int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    const layer_params *p = &m->lp[l], *g = &m->lg[l];
    const layer_acts *a = &m->la[l];
    const grad_scratch *s = &m->gs;
    int D = c->hidden_size, F = c->intermediate_size, hd = c->head_dim, Hq = c->num_attention_heads,
        Hk = c->num_key_value_heads, Q = Hq * hd;
    int64_t tl = m->sp_tl;
    float *full = s->sp_full;
    /* MLP: out = h + act Wd^T */
    mrl_model_sp_gather(m, s->dx, full);                                      /* dL/dout [T,D] */
    mrl_gemm_desc down[2] = {lin_dw(g->wd, full, a->act, T, D, F), lin_dx(s->df1, full, p->wd, T, D, F, 0)};
    products(m, down, (const uint16_t *[]){NULL, p->hd}, 2);
    k->swiglu_bwd(s->df1, s->df2, s->df1, a->gate, a->up, T * F);            /* dgate, dup [T,F] */
    mrl_model_sp_gather(m, a->ln2, full);                                      /* ln2 [T,D] again */
    mrl_gemm_desc gu[3] = {lin_dw(g->wg, s->df1, full, T, F, D), lin_dw(g->wu, s->df2, full, T, F, D),
                           lin_dx(s->dln, s->df1, p->wg, T, F, D, 0)};
    products(m, gu, (const uint16_t *[]){NULL, NULL, p->hg}, 3);
    run1(m, lin_dx(s->dln, s->df2, p->wu, T, F, D, 1.0f), p->hu);           /* dln2, this rank's part [T,D] */
    mrl_model_sp_reduce_scatter(m, s->dln, s->sp_loc);
    k->zero(s->sp_dw, (int64_t)sizeof(float) * D);
    k->rmsnorm_bwd(s->dx, s->sp_dw, s->sp_loc, a->h, p->ln2, a->rstd2, tl, D); /* dx = dL/dh [tl,D] */
    mrl_model_sp_norm_grad(m, g->ln2, D);
    /* attention: h = x + att Wo^T */
    mrl_model_sp_gather(m, s->dx, full);                                      /* dL/dh [T,D] */
    mrl_gemm_desc o[2] = {lin_dw(g->wo, full, a->att, T, D, Q), lin_dx(s->datt, full, p->wo, T, D, Q, 0)};
    products(m, o, (const uint16_t *[]){NULL, p->ho}, 2);
    k->attn_bwd(s->dq, s->dk, s->dv, s->datt, a->att, a->lse, a->q, a->k, a->v, m->op_cu_seqlens, m->op_prefix,
                m->batch.n_seqs, Hq, Hk, hd, mrl_model_attn_scale(c));
    mrl_model_sp_gather(m, a->ln1, full);                                      /* ln1 [T,D] again */
    qkv_backward(m, p, g, a, s, full, T);                                      /* dln1, this rank's part [T,D] */
    mrl_model_sp_reduce_scatter(m, s->dln, s->sp_loc);
    k->zero(s->sp_dw, (int64_t)sizeof(float) * D);
    k->rmsnorm_bwd(s->dx, s->sp_dw, s->sp_loc, m->xs[l], p->ln1, a->rstd1, tl, D); /* dx = dL/dx [tl,D] */
    mrl_model_sp_norm_grad(m, g->ln1, D);
}

/* In: gs.dx = dL/dx' [T,D]. Out: gs.dx = dL/dx; parameter gradients added. */
void mrl_layer_backward(mrl_model *m, int l, int64_t T) {
    if (m->tp_seq) {
        sp_backward(m, l, T);
        return;
    }
    mrl_layer_backward_io(m, &m->lp[l], &m->lg[l], &m->la[l], m->xs[l], T);
}

void mrl_layer_backward_io(mrl_model *m, const layer_params *p, const layer_params *g, const layer_acts *a,
                           const float *x, int64_t T) {
    const mrl_kernels *k = m->k;
    const mrl_model_config *c = &m->cfg;
    const grad_scratch *s = &m->gs;
    int D = c->hidden_size, F = c->intermediate_size, hd = c->head_dim, Hq = c->num_attention_heads,
        Hk = c->num_key_value_heads, Q = Hq * hd;
    if (p->router) { /* a sparse layer's MLP: dln = dL/dln2 */
        mrl_moe_backward(m, p, g, a, s->dx, s->dln, T);
    } else { /* MLP: x' = h + act Wd^T */
        mrl_gemm_desc down[2] = {lin_dw(g->wd, s->dx, a->act, T, D, F),     /* dWd [D,F] */
                                 lin_dx(s->df1, s->dx, p->wd, T, D, F, 0)}; /* dact [T,F] */
        products(m, down, (const uint16_t *[]){NULL, p->hd}, 2);
        const lora_layer *A = p->lora, *G = g->lora;
        if (A) mrl_lora_bwd(m, A->A[6], A->B[6], G->A[6], G->B[6], a->act, s->dx, s->df1, T, D, F, a->lora_u, s->lora_du);
        k->swiglu_bwd(s->df1, s->df2, s->df1, a->gate, a->up, T * F);        /* dgate, dup [T,F] */
        mrl_gemm_desc gu[3] = {lin_dw(g->wg, s->df1, a->ln2, T, F, D), lin_dw(g->wu, s->df2, a->ln2, T, F, D),
                               lin_dx(s->dln, s->df1, p->wg, T, F, D, 0)};  /* dln2 [T,D] = dgate Wg ... */
        products(m, gu, (const uint16_t *[]){NULL, NULL, p->hg}, 3);
        run1(m, lin_dx(s->dln, s->df2, p->wu, T, F, D, 1.0f), p->hu);        /* ... + dup Wu */
        if (A) {
            mrl_lora_bwd(m, A->A[4], A->B[4], G->A[4], G->B[4], a->ln2, s->df1, s->dln, T, F, D, a->lora_u, s->lora_du);
            mrl_lora_bwd(m, A->A[5], A->B[5], G->A[5], G->B[5], a->ln2, s->df2, s->dln, T, F, D, a->lora_u, s->lora_du);
        }
        mrl_model_tp_sum(m, s->dln, T * D);                                  /* (tensor parallel) */
    }
    k->rmsnorm_bwd(s->dx, g->ln2, s->dln, a->h, p->ln2, a->rstd2, T, D); /* dx = dL/dh */
    /* attention: h = x + att Wo^T */
    if (mrl_model_is_mla(c)) { /* o_proj read the heads' values without padding: datt padded with zeros */
        int dv = c->v_head_dim;
        mrl_gemm_desc o[2] = {lin_dw(g->wo, s->dx, a->att_v, T, D, Hq * dv), lin_dx(s->mla_datt, s->dx, p->wo, T, D, Hq * dv, 0)};
        products(m, o, (const uint16_t *[]){NULL, p->ho}, 2);
        k->zero(s->datt, (int64_t)sizeof(float) * T * Q);
        k->copy_rows(s->datt, hd, s->mla_datt, dv, T * Hq, dv);
        k->attn_bwd(s->dq, s->dk, s->dv, s->datt, a->att, a->lse, a->q, a->k, a->v, m->op_cu_seqlens, m->op_prefix,
                    m->batch.n_seqs, Hq, Hk, hd, mrl_model_attn_scale(c));
        mla_backward(m, p, g, a, s, a->ln1, T);
        k->rmsnorm_bwd(s->dx, g->ln1, s->dln, x, p->ln1, a->rstd1, T, D); /* dx = dL/dx */
        return;
    }
    mrl_gemm_desc o[2] = {lin_dw(g->wo, s->dx, a->att, T, D, Q),        /* dWo [D,Q] */
                          lin_dx(s->datt, s->dx, p->wo, T, D, Q, 0)};   /* datt [T,Q] */
    products(m, o, (const uint16_t *[]){NULL, p->ho}, 2);
    if (p->lora)
        mrl_lora_bwd(m, p->lora->A[3], p->lora->B[3], g->lora->A[3], g->lora->B[3], a->att, s->dx, s->datt, T, D, Q,
                     a->lora_u, s->lora_du);
    if (m->cp_size > 1) { /* context parallel (cp.c): in the attention's layout, and back */
        int cp = m->cp_size;
        mrl_model_cp_to_heads(m, s->datt, Hq, s->cp_datt);
        k->attn_bwd(s->cp_dq, s->cp_dk, s->cp_dv, s->cp_datt, a->att_h, a->lse, a->q, a->k, a->v, m->op_cu_seqlens,
                    m->op_prefix, m->batch.n_seqs, Hq / cp, Hk / cp, hd, mrl_model_attn_scale(c));
        mrl_model_cp_to_tokens(m, s->cp_dq, Hq, s->dq);
        mrl_model_cp_to_tokens(m, s->cp_dk, Hk, s->dk);
        mrl_model_cp_to_tokens(m, s->cp_dv, Hk, s->dv);
    } else {
        k->attn_bwd(s->dq, s->dk, s->dv, s->datt, a->att, a->lse, a->q, a->k, a->v, m->op_cu_seqlens,
                    m->op_prefix, m->batch.n_seqs, Hq, Hk, hd, mrl_model_attn_scale(c));
    }
    qkv_backward(m, p, g, a, s, a->ln1, T);
    mrl_model_tp_sum(m, s->dln, T * D);                                  /* (tensor parallel) */
    k->rmsnorm_bwd(s->dx, g->ln1, s->dln, x, p->ln1, a->rstd1, T, D); /* dx = dL/dx */
}
