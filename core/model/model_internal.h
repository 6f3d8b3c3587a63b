/* The model's internals, shared by the files of core/model (not public;
 * the rest of the core sees the model through layer.h). */
#pragma once
#include "kernels.h"
#include "model/layer.h"
#include "moonrl/model.h"

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
/* layer.c (and, in layer.h, the two halves the engine shares) */
void mrl_layer_forward(mrl_model *m, int l, int64_t T);
void mrl_layer_backward(mrl_model *m, int l, int64_t T);
