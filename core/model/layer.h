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
    /* the same seven matrices as weight panels (kernels.h), or NULL: the
     * engine's packed copies, read by the forward in place of the above */
    const float *pq, *pk, *pv, *po, *pg, *pu, *pd;
} layer_params;

/* One layer's saved activations for T tokens. */
typedef struct layer_acts {
    float *ln1, *rstd1;        /* [T,D] [T] */
    float *qraw, *kraw;        /* [T,Q] [T,K] projections before q/k norm (qwen3; NULL otherwise) */
    float *rstdq, *rstdk;      /* [T*Hq] [T*Hk] (qwen3) */
    float *q, *k, *v;          /* [T,Q] [T,K] [T,K], q and k after norm and RoPE */
    float *att, *lse;          /* [T,Q] attention output, [T,Hq] its log-sum-exp */
    float *h, *ln2, *rstd2;    /* [T,D] x + attention, [T,D], [T] */
    float *gate, *up, *act;    /* [T,F] each; act = silu(gate) * up */
} layer_acts;

/* The model's weights read from `base` (mrl_model_num_params floats in the
 * model's layout). */
typedef struct mrl_model_weights {
    const float *embed;      /* [V,D] */
    const float *final_norm; /* [D] */
    const float *lm_head;    /* [V,D] (the embedding when tied) */
} mrl_model_weights;

const mrl_kernels *mrl_model_kernels(const mrl_model *m);
/* Give the model a table of the caller's own (mrl_model_set_kernels names
 * the built-in ones): another backend's, or a test's that counts calls. */
void mrl_model_use_kernels(mrl_model *m, const mrl_kernels *k);
/* *out and layers[0 .. num_hidden_layers) (their panel pointers NULL)
 * pointing into base. */
void mrl_model_weights_at(const mrl_model *m, const float *base, mrl_model_weights *out, layer_params *layers);

/* The two halves of a layer's forward around attention (layer.c; the
 * trainer's own code, so that the engine and the trainer compute alike):
 * qkv fills a's ln1, rstd1, (qraw, kraw, rstdq, rstdk,) q, k, v for T tokens
 * at positions pos; out, once a->att holds the attention output, fills h,
 * ln2, rstd2, gate, up, act and out [T,D] (out may be x). */
void mrl_layer_qkv(const mrl_model *m, const layer_params *p, layer_acts *a, const float *x, const int32_t *pos,
                   int64_t T);
void mrl_layer_out(const mrl_model *m, const layer_params *p, layer_acts *a, const float *x, float *out,
                   int64_t T);
/* RoPE tables for positions < max_len (grown, never shrunk: a run_async
 * caller covers every position first, so that no other thread regrows them). */
mrl_status mrl_model_rope_prepare(mrl_model *m, int64_t max_len);
