/* The model's narrow interface inside the core: what the generation engine
 * (core/engine/engine.c) needs to run the model's own layers over its paged
 * KV cache, and nothing of the model's private struct (model_internal.h,
 * which only the files of core/model include).
 *
 *   mrl_model_kernels    the op table the model was given (mrl_model_set_kernels,
 *                        mrl_model_use_kernels): the engine takes every op from
 *                        it too (paged attention, sampling, the products), so a
 *                        model set to the reference kernels generates with them
 *   mrl_model_weights_at the embedding, final norm, lm_head and each layer's
 *                        parameters as pointers into a buffer with the model's
 *                        layout (its own, or another: attach_params, a weight store)
 *   mrl_layer_qkv        a layer's forward up to attention: ln1, q/k/v, RoPE
 *   mrl_layer_out        the rest once attention is done: o-proj, residual, MLP
 *                        (under tensor parallel, its sums over the group: mrl_model_tp_status)
 *   mrl_model_rope_prepare   the RoPE tables mrl_layer_qkv reads, for positions < max_len
 *
 * The engine brings its own activations (layer_acts, carved from its
 * buffer) and may give each layer's matrices as weight panels (the p*
 * pointers of layer_params); the config, the parameter count and buffer
 * come from the public moonrl/model.h. */
#pragma once
#include "kernels.h"
#include "moonrl/model.h"

/* One layer's parameters (or gradients: same layout). Shapes: D hidden,
 * F intermediate, Q = Hq*hd, K = Hk*hd. NULL where the arch has none. */
typedef struct layer_params {
    float *ln1;         /* [D]   input_layernorm */
    float *wq, *bq;     /* [Q,D] [Q] */
    float *wk, *bk;     /* [K,D] [K] */
    float *wv, *bv;     /* [K,D] [K] */
    float *wo;          /* [D,Q] */
    float *q_norm;      /* [hd]  qwen3 */
    float *k_norm;      /* [hd]  qwen3 */
    float *ln2;         /* [D]   post_attention_layernorm */
    float *wg, *wu;     /* [F,D] gate_proj, up_proj */
    float *wd;          /* [D,F] down_proj */
    /* a sparse (mixture-of-experts) layer instead of wg, wu, wd (NULL then):
     * E experts of Fe = moe_intermediate_size, stacked in expert order */
    float *router;      /* [E,D]    mlp.gate.weight */
    float *ewg, *ewu;   /* [E,Fe,D] mlp.experts.{e}.gate_proj, up_proj */
    float *ewd;         /* [E,D,Fe] mlp.experts.{e}.down_proj */
    /* DeepSeek-V3's (moonrl/model.h; NULL otherwise): the router's choice bias and the shared
     * experts, one SwiGLU MLP of Fs = n_shared_experts * Fe */
    float *rbias;       /* [E]      mlp.gate.e_score_correction_bias (frozen: no gradient) */
    float *swg, *swu;   /* [Fs,D]   mlp.shared_experts.gate_proj, up_proj */
    float *swd;         /* [D,Fs]   mlp.shared_experts.down_proj */
    /* multi-head latent attention (deepseek_v3, moonrl/model.h; NULL otherwise): there wq is
     * q_proj or q_b_proj [H*(dn+dr), rq or D], wk kv_a_proj_with_mqa [rkv+dr, D], wv kv_b_proj
     * [H*(dn+dv), rkv] and wo [D, H*dv] (mrl_layer_matrices has their shapes), and */
    float *wqa;         /* [rq,D] q_a_proj (q_lora_rank > 0) */
    float *q_a_norm;    /* [rq]   q_a_layernorm */
    float *kv_a_norm;   /* [rkv]  kv_a_layernorm */
    /* the same seven matrices as weight panels, or NULL: the engine's
     * packed copies, read by the forward in place of the above. Their
     * layout is the model's dtype's: fp32 panels (float, MRL_PANEL) in
     * fp32, bf16 weight panels (uint32_t, MRL_PANEL16) in bf16 */
    const void *pq, *pk, *pv, *po, *pg, *pu, *pd;
    /* the same seven as bf16 copies [N,K] (the model's dtype bf16), or
     * NULL: what the products read then (layer.c) */
    const uint16_t *hq, *hk, *hv, *ho, *hg, *hu, *hd;
    const uint16_t *heg, *heu, *hed; /* the experts' (the router stays fp32) */
    const uint16_t *hqa;             /* MLA's q_a_proj (not one of the seven: no panels, blocks or adapters) */
    const uint16_t *hsg, *hsu, *hsd; /* the shared experts' */
    /* LoRA (moonrl/model.h, mrl_model_set_lora): this layer's adapters (their gradients in the
     * gradients' table), or NULL: none, or switched off */
    const struct lora_layer *lora;
    /* a quantized base's seven matrices read from their GGML blocks (the engine's steps of few
     * rows: the qgemm op), or NULL: the above */
    const struct quant_layer *quant;
} layer_params;

/* A quantized base's layer (quant.c, mrl_model_quant_layer): the seven matrices' blocks in
 * mrl_layer_matrices' order and their types (NULL and 0: a matrix not kept as blocks). */
typedef struct quant_layer {
    const void *w[7];
    int type[7];
} quant_layer;

/* One layer's adapters (or their gradients): A [r, in] and B [out, r] of each of the seven
 * matrices in mrl_layer_matrices' order (NULL: not targeted), and a sparse layer's experts'
 * gate, up, down as blocks [E, r, in] and [E, out, r]. */
typedef struct lora_layer {
    float *A[7], *B[7];
    float *eA[3], *eB[3];
} lora_layer;

/* LoRA's part of the products (lora.c), with an adapter set's rank r and scale s = alpha / r
 * (mrl_lora_fwd: ad's; mrl_lora_bwd: the model's own adapters'):
 *   mrl_lora_fwd   y [T,N] += s (x A^T) B^T     (u [T,r] scratch)
 *   mrl_lora_bwd   gB += s dy^T u, gA += du^T x, dx [T,K] += du A with du = s dy B, u = x A^T
 *                  (dx NULL: not wanted; u, du [T,r] scratch)
 * Plain fp32 products of the op table (the adapters are small; fp32 in a bf16 model too). */
void mrl_lora_fwd(const mrl_kernels *k, const mrl_lora *ad, const float *A, const float *B, const float *x, float *y,
                  int64_t T, int64_t N, int64_t K, float *u);
void mrl_lora_bwd(const mrl_model *m, const float *A, const float *B, float *gA, float *gB, const float *x,
                  const float *dy, float *dx, int64_t T, int64_t N, int64_t K, float *u, float *du);
/* Dropout (the model's own adapters in a training forward: mrl_lora_dropping): x [T,K] masked and
 * scaled into xd, the mask drawn for the adapter matrix A; NULL xd, or no dropout: x itself. */
int mrl_lora_dropping(const mrl_model *m);
const float *mrl_lora_drop(const mrl_model *m, const float *A, const float *x, float *xd, int64_t T, int64_t K);
/* The rank of the model's adapters (0: none); the floats of LoRA scratch a layer needs for T
 * tokens (mrl_layer_qkv / _out's a->lora_u: the engine's layout carves it too). */
int mrl_model_lora_rank(const mrl_model *m);
/* An adapter set's rank, and its layer l's table (lora.c). */
int mrl_lora_rank(const mrl_lora *ad);
const lora_layer *mrl_lora_layer(const mrl_lora *ad, int l);
/* The model's own adapters when on (what the layers read through lp[l].lora), else NULL. */
const mrl_lora *mrl_model_lora_on(const mrl_model *m);
/* Each layer's lora pointer of `layers` set to the model's adapters as they are (on or off). */
void mrl_model_lora_layers(const mrl_model *m, layer_params *layers);
int64_t mrl_model_lora_scratch(const mrl_model *m, int64_t T);

/* A quantized base (quant.c): layer l's parameters made whole for an engine step that reads the
 * model's own buffer (its matrices dequantized into place), and let go after it; nothing for
 * other models, whose parameters are whole. mrl_model_quantized_bytes (moonrl/model.h) says which. */
mrl_status mrl_model_layer_use(mrl_model *m, int l);
void mrl_model_layer_unuse(mrl_model *m, int l);
/* Layer l's matrices as blocks (a quantized base's, on its device; what an engine step of few
 * rows reads in place of making the layer whole); 0 for other models. */
int mrl_model_quant_layer(const mrl_model *m, int l, quant_layer *out);

/* The seven matrices of a layer (q, k, v, o, gate, up, down), the ones
 * weight panels hold: their weights in p (NULL: a sparse layer's MLP, whose
 * experts are read in place), p's panel pointer for each, shape [N,K]. One
 * list for the engine's fp32 panels and the model's bf16 ones. */
typedef struct mrl_layer_matrix {
    const float *w;
    const void **panels;
    int64_t N, K;
} mrl_layer_matrix;

static inline void mrl_layer_matrices(const mrl_model_config *c, layer_params *p, mrl_layer_matrix out[7]) {
    int64_t D = c->hidden_size, F = c->intermediate_size, H = c->num_attention_heads, Q = H * c->head_dim,
            Kv = (int64_t)c->num_key_value_heads * c->head_dim;
    if (c->arch == MRL_ARCH_DEEPSEEK_V3) { /* MLA: q (or q_b), kv_a_proj_with_mqa, kv_b_proj, o */
        int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, rkv = c->kv_lora_rank;
        out[0] = (mrl_layer_matrix){p->wq, &p->pq, H * (dn + dr), c->q_lora_rank ? c->q_lora_rank : D};
        out[1] = (mrl_layer_matrix){p->wk, &p->pk, rkv + dr, D};
        out[2] = (mrl_layer_matrix){p->wv, &p->pv, H * (dn + c->v_head_dim), rkv};
        out[3] = (mrl_layer_matrix){p->wo, &p->po, D, H * c->v_head_dim};
    } else {
        out[0] = (mrl_layer_matrix){p->wq, &p->pq, Q, D};
        out[1] = (mrl_layer_matrix){p->wk, &p->pk, Kv, D};
        out[2] = (mrl_layer_matrix){p->wv, &p->pv, Kv, D};
        out[3] = (mrl_layer_matrix){p->wo, &p->po, D, Q};
    }
    out[4] = (mrl_layer_matrix){p->wg, &p->pg, F, D};
    out[5] = (mrl_layer_matrix){p->wu, &p->pu, F, D};
    out[6] = (mrl_layer_matrix){p->wd, &p->pd, D, F};
}

/* A sparse layer's expert matrix j (0 gate_proj, 1 up_proj: [Fe, D]; 2 down_proj: [D, Fe]) as
 * [N, K]: what an expert's LoRA adapter of that matrix is shaped by. */
static inline void mrl_expert_matrix(const mrl_model_config *c, int j, int64_t *N, int64_t *K) {
    *N = j == 2 ? c->hidden_size : c->moe_intermediate_size;
    *K = j == 2 ? c->moe_intermediate_size : c->hidden_size;
}

/* Carving buffers (activations, gradients) out of one allocation: `ptr`
 * gets `count` elements of `type` at byte offset `off` of `base`, and `off`
 * moves on, 64-byte aligned. base NULL: only `off` moves (a first pass that
 * counts the bytes to allocate). The model's layouts and the engine's use it. */
#define MRL_LAYOUT_TAKE(base, off, ptr, type, count)                      \
    do {                                                                  \
        if (base) (ptr) = (type *)((base) + (off));                       \
        (off) += ((int64_t)sizeof(type) * (count) + 63) / 64 * 64;        \
    } while (0)

/* One layer's saved activations for T tokens. */
typedef struct layer_acts {
    float *ln1, *rstd1;        /* [T,D] [T] */
    float *qraw, *kraw;        /* [T,Q] [T,K] projections before q/k norm (qwen3; NULL otherwise) */
    float *rstdq, *rstdk;      /* [T*Hq] [T*Hk] (qwen3) */
    float *q, *k, *v;          /* [T,Q] [T,K] [T,K], q and k after norm and RoPE */
    float *att, *lse;          /* [T,Q] attention output, [T,Hq] its log-sum-exp */
    float *att_h;              /* context parallel (cp.c): the attention output as attention made it,
                                * [T whole, Q / cp] (q, k, v, lse are then in that layout too) */
    /* multi-head latent attention (deepseek_v3; NULL otherwise), kept for the backward: */
    float *qa, *qan, *rstdqa;  /* [T,rq] q_a_proj's output, normed; [T] (q_lora_rank > 0) */
    float *ckv, *cn, *rstdc;   /* [T,rkv] the latent, normed (kv_a_layernorm); [T] */
    float *att_v;              /* [T,H*dv] the attention output without its padding (o_proj's input) */
    /* and its forward's scratch (one for every layer): queries before RoPE, kv_a_proj_with_mqa's
     * output, the rope key, kv_b_proj's output */
    float *qf, *kva, *kr, *kvb; /* [T,H*(dn+dr)] [T,rkv+dr] [T,dr] [T,H*(dn+dv)] */
    /* the engine's absorbed form over a latent cache (engine.h, MRL_MLA_LATENT) when mla_absorbed
     * is 1 (2: att_v given, mrl_layer_out reads it as it is): qcat each head's [q_nope Wuk_h,
     * q_rope] before RoPE, qabs after, lat each token's cache row [c', rope(kr)], olat the
     * attention's output in the latent's space (W = rkv + dr) */
    int mla_absorbed;
    float *mla_qcat, *mla_qabs, *mla_lat, *mla_olat; /* [T,H,W] [T,H,W] [T,W] [T,H,rkv] */
    float *h, *ln2, *rstd2;    /* [T,D] x + attention, [T,D], [T] */
    float *gate, *up, *act;    /* [T,F] each; act = silu(gate) * up */
    /* a sparse layer: A = T*k assignments, token t's j-th pick is t*k + j;
     * the experts see their rows grouped, expert by expert, in token order */
    float *rprob;              /* [T,E] router softmax (fp32) */
    int32_t *sel;              /* [T,k] the experts picked, best first */
    float *rw;                 /* [T,k] their weights (renormalised when norm_topk_prob) */
    int32_t *row;              /* [A]   the grouped row of assignment t*k + j */
    int32_t *tok;              /* [A]   the token of each grouped row */
    int32_t *eoff;             /* [E+1] expert e's rows: eoff[e] .. eoff[e+1] */
    int32_t *rhow;             /* [T]   with replay: how each token was routed (moe_route's how) */
    float *xe;                 /* [A,D] ln2 of each grouped row */
    float *egate, *eup, *eact; /* [A,Fe] */
    float *ey;                 /* [A,D] each row's expert output, before weighting */
    float *sgate, *sup, *sact; /* [T,Fs] the shared experts' (DeepSeek-V3; NULL without them) */
    /* routing replay (the trainer's forward only; NULL: the router's own top-k): token t's
     * picks are replay[t * replay_stride .. + k) unless the first is -1 (mrl_batch.routing);
     * replay_differ counts the tokens whose replayed set differs from the own top-k */
    const int16_t *replay;
    int64_t replay_stride, replay_differ, replay_count;
    /* expert parallelism (the trainer's forward only; NULL: every expert here): this sparse
     * layer's state of the exchange with the other ranks (moe_ep.c) */
    struct moe_ep_layer *ep;
    /* LoRA's scratch, mrl_model_lora_scratch(T) floats (NULL: the model has no adapters), and
     * the engine's segments of rows with adapters of their own (NULL: the model's, p->lora) */
    float *lora_u;
    float *lora_xd; /* the trainer's: an adapter's input under dropout (NULL: none, the engine's) */
    const struct lora_seg *lora_segs;
    int n_lora_segs;
} layer_acts;

/* Rows [row0, row0 + rows) of a batch computed with adapter set ad (layer table L), or with
 * none (L NULL: the base). */
typedef struct lora_seg {
    int64_t row0, rows;
    const mrl_lora *ad;
    const lora_layer *L;
} lora_seg;

/* Multi-head latent attention (deepseek_v3; moonrl/model.h): its widths, and the attention's
 * scale, (dn + dr)^-1/2 times yarn's mscale(factor, mscale_all_dim)^2 (Transformers'
 * yarn_apply_mscale), 1/sqrt(head_dim) for the other architectures. rope_dim: the dimensions
 * RoPE turns (its tables' width: qk_rope_head_dim, else head_dim). */
static inline int mrl_model_is_mla(const mrl_model_config *c) { return c->arch == MRL_ARCH_DEEPSEEK_V3; }
static inline int mrl_model_rope_dim(const mrl_model_config *c) {
    return mrl_model_is_mla(c) ? c->qk_rope_head_dim : c->head_dim;
}
float mrl_model_attn_scale(const mrl_model_config *c);

/* The absorbed form's two ends (layer.c), for an engine step that mixes forms: qabs and lat of T
 * tokens from mla_proj's qf, cn and kr; att_v from olat. */
void mrl_layer_mla_absorb(const mrl_model *m, const layer_params *p, layer_acts *a, const int32_t *pos, int64_t T);
void mrl_layer_mla_unabsorb(const mrl_model *m, const layer_params *p, layer_acts *a, int64_t T);

/* Qwen3's per-head q/k norms (qwen3 and qwen3_moe) */
static inline int mrl_arch_qk_norm(int arch) { return arch == MRL_ARCH_QWEN3 || arch == MRL_ARCH_QWEN3_MOE; }

/* The sparse-layer fields of a (rprob .. ey) for T tokens carved from base
 * (NULL: only counted), each 64-byte aligned; returns the bytes (moe.c).
 * The trainer's and the engine's activation layouts both call it. */
int64_t mrl_moe_acts_layout(const mrl_model_config *c, layer_acts *a, int64_t T, char *base);

/* MLA's fields of a for T tokens carved from base (NULL: only counted; a model without MLA:
 * none, and with a base they are set NULL): what & 1 those kept for the backward (qa .. att_v),
 * what & 2 the scratch (qf .. kvb). Returns the bytes (layer.c); the trainer's and the engine's
 * activation layouts both call it. */
int64_t mrl_mla_acts_layout(const mrl_model_config *c, layer_acts *a, int64_t T, char *base, int what);

/* DeepSeek-V3's multi-token prediction layer (moonrl/model.h's num_nextn_predict_layers): the
 * previous position's final hidden state and the next token's embedding, each normed, through
 * eh_proj [D, 2D] (the embedding first), a decoder layer of its own, and a head of its own. */
typedef struct mtp_params {
    float *enorm, *hnorm, *eh_proj, *embed, *head_norm, *head; /* [D] [D] [D,2D] [V,D] [D] [V,D] */
    layer_params layer;
} mtp_params;
/* The model's MTP layer read from `base` (the model's layout; its fp32 weights, no copies or panels);
 * 0 (and *out zeroed) for a model without one. */
int mrl_model_mtp_at(const mrl_model *m, const float *base, mtp_params *out);

/* The model's weights read from `base` (mrl_model_num_params floats in the
 * model's layout). */
typedef struct mrl_model_weights {
    const float *embed;      /* [V,D] */
    const float *final_norm; /* [D] */
    const float *lm_head;    /* [V,D] (the embedding when tied) */
    const uint16_t *lm_head16; /* its bf16 copy (dtype bf16), or NULL */
    const uint32_t *lm_head_p16; /* and as bf16 weight panels (the engine's), or NULL */
} mrl_model_weights;

const mrl_kernels *mrl_model_kernels(const mrl_model *m);
/* Give the model a table of the caller's own (mrl_model_set_kernels names
 * the built-in ones): another backend's, or a test's that counts calls. */
void mrl_model_use_kernels(mrl_model *m, const mrl_kernels *k);
/* *out and layers[0 .. num_hidden_layers) (their panel pointers NULL)
 * pointing into base. */
void mrl_model_weights_at(const mrl_model *m, const float *base, mrl_model_weights *out, layer_params *layers);

/* bf16 (mrl_model_set_dtype): the copies are a buffer of n_params uint16
 * with the parameters' layout, of which only the matrices the products read
 * are converted (mrl_model_bf16_convert).
 *   mrl_model_bf16_params   the model's own copy, refreshed first if stale
 *                           (mrl_model_weights_changed); NULL in fp32
 *   mrl_model_bf16_convert  those matrices of base (model layout) into dst:
 *                           the refresh's one pass, and the engine's for a
 *                           buffer not the model's (attach_params, a weight store)
 *   mrl_model_weights16_at  the bf16 pointers of *out and layers (hq .. hd,
 *                           lm_head16) into base16; NULL base16 clears them */
const uint16_t *mrl_model_bf16_params(mrl_model *m);
void mrl_model_bf16_convert(const mrl_model *m, const float *base, uint16_t *dst);
void mrl_model_weights16_at(const mrl_model *m, const uint16_t *base16, mrl_model_weights *out,
                            layer_params *layers);

/* bf16 weight panels (kernels.h, MRL_PANEL16) of each layer's seven
 * matrices and the head: the layout the engine's few-row products read.
 *   mrl_model_bf16_panels       the model's own (CPU, dtype bf16), made on
 *                               the first call (NULL: no memory, or not a
 *                               bf16 model on the CPU) and from then on
 *                               written by the same refresh as the bf16
 *                               copies, so that an update costs no copy more
 *   mrl_model_panels16_bytes    their size
 *   mrl_model_bf16_pack_panels  the panels of w16 (a bf16 copy in the model's
 *                               layout) into p16: the engine's for a buffer
 *                               not the model's
 *   mrl_model_panels16_at       the panel pointers of layers (pq .. pd) and
 *                               out->lm_head_p16 into p16; NULL clears them */
const uint32_t *mrl_model_bf16_panels(mrl_model *m);
int64_t mrl_model_panels16_bytes(const mrl_model *m);
void mrl_model_bf16_pack_panels(const mrl_model *m, const uint16_t *w16, uint32_t *p16);
void mrl_model_panels16_at(const mrl_model *m, const uint32_t *p16, mrl_model_weights *out, layer_params *layers);

/* The two halves of a layer's forward around attention (layer.c; the
 * trainer's own code, so that the engine and the trainer compute alike):
 * qkv fills a's ln1, rstd1, (qraw, kraw, rstdq, rstdk,) q, k, v for T tokens
 * at positions pos; out, once a->att holds the attention output, fills h,
 * ln2, rstd2, gate, up, act and out [T,D] (out may be x); a sparse layer
 * fills rprob .. ey in place of gate, up, act (moe.c). */
void mrl_layer_qkv(const mrl_model *m, const layer_params *p, layer_acts *a, const float *x, const int32_t *pos,
                   int64_t T);
void mrl_layer_out(const mrl_model *m, const layer_params *p, layer_acts *a, const float *x, float *out,
                   int64_t T);
/* Tensor parallel (tp.c): a sum over the group that failed inside the layers since the last
 * call (the layers return none), then cleared; MRL_OK otherwise. A forward's (or an engine
 * step's) status after its layers. */
mrl_status mrl_model_tp_status(mrl_model *m);
/* Vocabulary-parallel embedding and head (tp.c; the model's when tensor parallel divides its
 * vocabulary, its config's vocab_size then this rank's rows of them, else 0 and whole):
 * mrl_model_tp_vocab gives the rows and the first one's id in *lo. tp_ids turns T tokens
 * (host memory) into rows of this rank's slice, -1 for the others' (ids: host memory; the
 * embedding's ops read them where the model computes). tp_embed fills x [T,D] with the
 * embedding rows of the tokens, each from the rank that holds it (summed over the group: the
 * others' rows are zeros); tp_logits puts the group's logits [S, rows] of S rows side by side
 * into whole [S, V] (all: [size * S * rows] of scratch), for the sampler. A GPU model's sums
 * and gathers go through the host. */
int mrl_model_tp_vocab(const mrl_model *m, int64_t *lo);
int mrl_model_whole_vocab(const mrl_model *m);
void mrl_model_tp_ids(const mrl_model *m, const int32_t *tokens, int32_t *ids, int64_t T);
void mrl_model_tp_embed(const mrl_model *m, float *x, const float *embed, const int32_t *ids, int64_t T);
/* The same without the sum: this rank's rows, zeros for the others' tokens. */
void mrl_model_tp_embed_rows(const mrl_model *m, float *x, const float *embed, const int32_t *ids, int64_t T);
mrl_status mrl_model_tp_logits(const mrl_model *m, const float *part, int64_t S, float *all, float *whole);
/* RoPE tables for positions < max_len (grown, never shrunk: a run_async
 * caller covers every position first, so that no other thread regrows them). */
mrl_status mrl_model_rope_prepare(mrl_model *m, int64_t max_len);
/* Where the RoPE tables are now (they move when regrown: a captured graph holding them is stale). */
const float *mrl_model_rope_cos(const mrl_model *m);
