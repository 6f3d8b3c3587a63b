/* The model's internals, shared by the files of core/model (not public). */
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
    float *qraw, *kraw;        /* [T,Q] [T,K] projections before q/k norm (qwen3) */
    float *rstdq, *rstdk;      /* [T*Hq] [T*Hk] (qwen3) */
    float *q, *k, *v;          /* [T,Q] [T,K] [T,K], q and k after norm and RoPE */
    float *att, *lse;          /* [T,Q] attention output, [T,Hq] its log-sum-exp */
    float *h, *ln2, *rstd2;    /* [T,D] x + attention, [T,D], [T] */
    float *gate, *up, *act;    /* [T,F] each; act = silu(gate) * up */
} layer_acts;

/* Gradient scratch of the backward, shared by all layers. */
typedef struct grad_scratch {
    float *dx;        /* [T,D] gradient of the residual stream */
    float *dln;       /* [T,D] gradient of a norm's output */
    float *df1, *df2; /* [T,F] */
    float *datt, *dq; /* [T,Q] */
    float *dk, *dv;   /* [T,K] */
    float *dk2;       /* [T,K] (qwen3 k norm) */
} grad_scratch;

struct mrl_model {
    mrl_model_config cfg;
    int64_t n_params;
    float *params, *grads; /* grads: NULL until first used (mrl_model_ensure_grads) */
    mrl_param_view *views;
    int n_views;
    char *names;
    /* parameter pointers (p) and the matching gradient pointers (g, NULL until the gradients exist) */
    float *embed, *final_norm, *lm_head, *score;
    float *g_embed, *g_final_norm, *g_lm_head, *g_score;
    layer_params *lp, *lg;
    const mrl_kernels *k;
    int recompute;
    int64_t head_chunk_setting; /* tokens per head chunk; 0 = automatic */
    /* RoPE tables [rope_len, hd/2] */
    float *inv_freq, *rope_cos, *rope_sin;
    int64_t rope_len;
    /* activations, for act_tokens tokens */
    void *act_buf;
    int64_t act_tokens, head_chunk;
    float **xs;             /* [L+1] residual stream [T,D]: the input of each layer, then the last output */
    layer_acts *la;         /* [L] (all the same buffers when recomputing) */
    grad_scratch gs;
    float *lnf, *rstdf;     /* [T,D] [T] final norm */
    float *head_lse, *head_ent, *logits; /* [T] [T] [chunk,V] */
    int32_t *pos, *targets; /* [T] */
    /* the last forward */
    mrl_batch batch;
    float inv_temp;
    int have_forward;
    int logits_kept; /* the forward's logits of the whole batch are still in `logits` (one head chunk) */
    /* called by the backward as each range of the gradient buffer becomes final */
    mrl_grad_hook grad_hook;
    void *grad_hook_ctx;
};

static inline float *grad_of(mrl_model *m, float *p) { return p ? m->grads + (p - m->params) : NULL; }

/* model.c: a model with zeroed parameters (alloc = alloc_layout, then
 * alloc_params); the views and layer tables only, no buffer (what loading
 * checks a file against before allocating); the parameter buffer of such a
 * model; the gradient buffer, created zeroed on first use (MRL_MEM_GRADS);
 * the documented init of one view */
mrl_status mrl_model_alloc(const mrl_model_config *cfg, mrl_model **out);
mrl_status mrl_model_alloc_layout(const mrl_model_config *cfg, mrl_model **out);
mrl_status mrl_model_alloc_params(mrl_model *m);
mrl_status mrl_model_ensure_grads(mrl_model *m);
void mrl_model_init_view(mrl_model *m, const mrl_param_view *v, uint64_t *s);
/* layer.c */
void mrl_layer_forward(mrl_model *m, int l, int64_t T);
void mrl_layer_backward(mrl_model *m, int l, int64_t T);
/* the two halves of a layer's forward around attention (the engine runs
 * paged attention between them); see layer.c */
void mrl_layer_qkv(const mrl_model *m, const layer_params *p, layer_acts *a, const float *x, const int32_t *pos,
                   int64_t T);
void mrl_layer_out(const mrl_model *m, const layer_params *p, layer_acts *a, const float *x, float *out,
                   int64_t T);
/* rope.c */
mrl_status mrl_model_rope_prepare(mrl_model *m, int64_t max_len);
