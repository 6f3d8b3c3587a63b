/* The model's internals, shared by the files of core/model (not public;
 * the rest of the core sees the model through layer.h). */
#pragma once
#include <pthread.h>
#include <stdatomic.h>
#include "kernels.h"
#include "model/layer.h"
#include "runtime/device_internal.h"
#include "moonrl/model.h"

/* Gradient scratch of the backward, shared by all layers. */
typedef struct grad_scratch {
    float *dx;        /* [T,D] gradient of the residual stream */
    float *dln;       /* [T,D] gradient of a norm's output */
    float *df1, *df2; /* [T,F] */
    float *datt, *dq; /* [T,Q] */
    float *dk, *dv;   /* [T,K] */
    float *dk2;       /* [T,K] (qwen3 k norm) */
    float *dnorm;     /* [2*hd] (qwen3 under tensor parallel: this rank's heads' part of the per-head norms' gradients) */
    /* context parallel (cp.c): the attention's gradients in its layout [T whole, Q or K / cp]
     * (datt, dq, dk, dv are then this rank's tokens' [T, Q or K]), and a buffer to pack [T,Q] */
    float *cp_datt, *cp_dq, *cp_dk, *cp_dv, *cp_pack;
    /* sequence parallel (tp.c): a whole [T,D] (a norm's output gathered, an upstream gradient, a
     * partial sum), the staging of a gather [(1 + size) ceil(T / size) D], this rank's rows of a
     * reduce-scatter [ceil(T / size) D], a norm's weight gradient of this backward [D] */
    float *sp_full, *sp_stage, *sp_loc, *sp_dw;
    /* sparse layers (df1, df2 are then [A,Fe] when that is larger than [T,F]) */
    float *dye;       /* [A,D] d expert outputs, then d expert inputs */
    float *dlogit;    /* [T,E] d router logits */
    float *lora_du;   /* LoRA's backward: [rows, r] beside the layer's lora_u (lora.c) */
    /* multi-head latent attention (layer.c): the gradients of the attention output without its
     * padding [T,H*dv], of the queries before RoPE [T,H*(dn+dr)], of kv_b_proj's output
     * [T,H*(dn+dv)], of the rope key [T,dr], of the normed latent and the latent [T,rkv] each, of
     * kv_a_proj_with_mqa's output [T,rkv+dr], of q_a_proj's output normed and not [T,rq] each */
    float *mla_datt, *mla_dqf, *mla_dkvb, *mla_dkr, *mla_dcn, *mla_dc, *mla_dkva, *mla_dqan, *mla_dqa;
} grad_scratch;

/* The adapters (lora.c; moonrl/model.h's mrl_model_set_lora): their config, scale, buffers
 * and views (PEFT's names), each layer's table of pointers into the parameters (lp) and the
 * gradients (lg), a sink for the frozen norms' weight gradients (which the norms' backward
 * ops write; nothing reads them), on while `on`. */
struct mrl_lora {
    const mrl_model *m; /* whose architecture */
    mrl_lora_config cfg;
    float scale;
    int on;
    int64_t n;
    /* params, grads (NULL: an adapter set of its own, not trained) and sink: the data of these
     * buffers, on the model's device */
    mrl_buffer params_buf, grads_buf, sink_buf;
    float *params, *grads;
    mrl_param_view *views;
    int n_views;
    char *names;
    lora_layer *lp, *lg;
    int64_t *layer_off; /* [L + 1]: layer l's adapters are [layer_off[l], layer_off[l + 1]) */
    float *sink; /* (the model's own: nothing else trains) */
    int64_t sink_n;
    /* dropout (cfg.dropout > 0): on in the last forward (a training one), its masks' key, the
     * caller's key and the training forwards since it was given (mrl_model_set_training) */
    int dropping;
    uint64_t drop_key, drop_base, drop_count;
};

struct mrl_model {
    mrl_model_config cfg;
    int64_t n_params;
    float *params, *grads; /* grads: NULL until first used (mrl_model_ensure_grads) */
    /* where the buffers live (mrl_model_set_device): params, grads and w16 are the data of
     * these buffers, the activations (act_buf) and the RoPE tables too when the device is a
     * GPU (the op table k is then the device's, k->on_device); the host keeps the config,
     * the views and the layer tables */
    mrl_device device;
    mrl_buffer params_buf, grads_buf, w16_buf;
    mrl_param_view *views;
    int n_views;
    char *names;
    /* parameter pointers (p) and the matching gradient pointers (g, NULL until the gradients exist) */
    float *embed, *final_norm, *lm_head, *score;
    float *g_embed, *g_final_norm, *g_lm_head, *g_score;
    layer_params *lp, *lg;
    mtp_params mtp; /* (all NULL without num_nextn_predict_layers) */
    /* training it (mtp.c, mrl_model_set_mtp_loss): its weight, the last forward's loss, its
     * gradients' pointers, its layer's activations and its buffers (carved with the activations) */
    double mtp_weight, mtp_loss;
    mtp_params g_mtp;
    layer_acts mtp_a;
    float *mtp_e, *mtp_en, *mtp_hn, *mtp_cat, *mtp_x0, *mtp_out, *mtp_on, *mtp_rstd; /* [T,D].. [T,2D] [T,D]x3 [3T] */
    float *mtp_lp, *mtp_lse, *mtp_ent, *mtp_dlp, *mtp_dlnf;                        /* [T] x4, [T,D] */
    int32_t *mtp_next, *mtp_tgt;                                                   /* [T] x2 */
    const mrl_kernels *k;
    /* precision (moonrl/model.h): in bf16, w16 holds the bf16 copies the
     * products read (the parameters' layout; lp[l].hq .. hd and lm_head16
     * point into it), converted again by the first use after w16_stale is
     * set; w16_lock keeps two threads (trainer, engine) from converting at once */
    int dtype;
    uint16_t *w16;
    const uint16_t *lm_head16;
    _Atomic int w16_stale;
    _Atomic int64_t weights_gen; /* mrl_model_weights_changed calls: what a remote engine's sync compares */
    pthread_mutex_t w16_lock;
    /* from the first mrl_model_bf16_panels (the engine's): the same matrices
     * as bf16 weight panels, written by the same refresh as w16 */
    mrl_buffer p16_buf;
    int recompute;
    mrl_lora *lora; /* adapters (lora.c), or NULL */
    struct mrl_quant *quant; /* a quantized base (quant.c; its params a region, p_region), or NULL */
    int training;   /* mrl_model_set_training */
    float *lora_xd; /* LoRA's dropout: an adapter's masked input (the trainer's activations; NULL: none) */
    /* mixture of experts: the load-balancing loss of the last forward (moonrl/model.h):
     * over all sparse layers and tokens: picks of expert e, the sum of its
     * router probabilities, and aux_n = tokens * sparse layers */
    double aux_loss, aux_coef;
    double *aux_picks, *aux_psum; /* [E] each (a qwen3_moe model only) */
    int64_t aux_n;
    /* a pipeline stage's (pp.c): the statistics its next forward starts from (the stages
     * before's) or its next backward uses (the whole model's), [picks E, psum E, n] */
    double *aux_in;
    int aux_in_set;
    /* the experts each token went to in the last forward [T, n_moe, k] (mrl_model_get_routing),
     * and the replay counts (mrl_model_routing_replay_stats) */
    int16_t *route_used;
    int64_t replayed, replay_differ;
    /* expert parallelism (mrl_model_set_expert_parallel; NULL: off) */
    struct moe_ep *ep;
    int64_t head_chunk_setting; /* tokens per head chunk; 0 = automatic */
    /* RoPE tables [rope_len, hd/2] (cos and sin: rope_mem's data, on the model's device) */
    float *inv_freq, *rope_cos, *rope_sin;
    mrl_buffer rope_mem;
    int64_t rope_len;
    /* activations, for act_tokens tokens (act_buf is act_mem's data) */
    mrl_buffer act_mem;
    void *act_buf;
    int64_t act_tokens, head_chunk;
    float **xs;             /* [L+1] residual stream [T,D]: the input of each layer, then the last output */
    layer_acts *la;         /* [L] (all the same buffers when recomputing) */
    grad_scratch gs;
    float *lnf, *rstdf;     /* [T,D] [T] final norm */
    float *head_lse, *head_ent, *logits; /* [T] [T] [chunk,V] */
    uint16_t *logits16;     /* [chunk,V] dtype bf16: the dlogits' bf16 copy (else NULL) */
    int32_t *pos, *targets; /* [T] */
    /* the batch's arrays as the ops read them: the caller's, or (on a GPU) their copies in
     * the activations: tokens [T], cu_seqlens [n_seqs + 1], prefix [n_seqs] (NULL: none) */
    const int32_t *op_tokens, *op_cu_seqlens, *op_prefix;
    /* on a GPU only: the copies themselves; [T] floats each of the per-token values going
     * between the host and the ops (logprobs out / dlogprobs in, dentropy in, values out /
     * dvalues in); and host memory for the positions and targets the forward computes
     * [2T] before they go over */
    int32_t *dev_tokens, *dev_cu_seqlens, *dev_prefix;
    float *dev_io[3];
    int32_t *host_pos_targets;
    /* the last forward */
    mrl_batch batch;
    float inv_temp;
    int have_forward;
    int logits_kept; /* the forward's last head chunk's logits are still in `logits` */
    /* called by the backward as each range of the gradient buffer becomes final */
    mrl_grad_hook grad_hook;
    void *grad_hook_ctx;
    /* gradient windows (mrl_model_set_grad_windows): each part of the backward writes into a
     * window of its range lent by grad_acquire, not into `grads` (then never allocated) */
    mrl_grad_acquire grad_acquire;
    void *grad_acquire_ctx;
    /* sharded parameters (ZeRO-3, shard.c): params (and w16 in bf16) are the bases of regions
     * (core/base/mem.h) holding the rank's shard [shard_off, shard_off + shard_count) for the
     * run and, while in use, the ranges gathered into place; ahead_lo .. ahead_hi: a range whose
     * gather was started ahead of its use (none when equal) */
    struct mrl_mem_region *p_region, *w16_region;
    int64_t shard_off, shard_count;
    mrl_param_gather gather_start, gather_wait;
    void *gather_ctx;
    int64_t ahead_lo, ahead_hi;
    int head_kept; /* the head's part (a tied head's embedding too) still in use after the forward: its backward's */
    /* mrl_model_forward_top: called with each head chunk's logits [n, V] (host) and their lse */
    void (*head_tap)(void *ctx, const float *logits, const float *lse, int64_t row0, int64_t n, int64_t V);
    void *head_tap_ctx;
    int64_t gathered_peak; /* the most bytes of the regions beyond the shard's pages (mrl_model_gathered_bytes) */
    int shard_writer; /* this rank writes the files of mrl_model_save_dir_sharded */
    /* tensor parallel (tp.c): this rank's slices of each layer (cfg: the slices' config,
     * tp_cfg the whole model's); tp_sum sums a buffer over the group; a failure inside a
     * layer (which returns none) is kept in tp_failed for the forward or backward to return;
     * tp_gather brings the slices together for saving */
    int tp_rank, tp_size; /* 0 and 1 without */
    int tp_kv_copies;     /* ranks that hold each K/V head (more ranks than K/V heads), else 1 */
    int tp_vocab;         /* the embedding and head split by vocabulary (cfg.vocab_size: the rows here) */
    int tp_seq;           /* sequence parallel: the residual stream and norms on this rank's tokens */
    int64_t sp_t0, sp_tl; /* (the last forward's: rows [sp_t0, sp_t0 + sp_tl) of the batch) */
    float *tp_stats;      /* [3T (1 + tp_size)] with tp_vocab: the head's statistics, this rank's and the group's */
    int32_t *tp_ids;      /* [T] with tp_vocab: the batch's tokens as rows of this rank's slice, -1 others' */
    float *tp_host;       /* a GPU model's collectives' host staging (mrl_model_host_stage), tp_host_n floats */
    int64_t tp_host_n;
    mrl_model_config tp_cfg;
    mrl_tp_allreduce tp_sum;
    mrl_tp_reduce_scatter tp_rs; /* (sequence parallel's; NULL: the allreduce, its own rows kept) */
    mrl_tp_allgather tp_gather;
    void *tp_ctx;
    /* a GPU model's collectives on device memory (NCCL's; mrl_model_set_tp_device_group): the
     * layers' sums, the head's statistics and the engine's logits use them instead of staging
     * through tp_host; NULL: the host group's above */
    mrl_tp_allreduce tp_dsum;
    mrl_tp_allgather tp_dgather;
    void *tp_dctx;
    mrl_status tp_failed; /* (and context parallel's exchanges') */
    /* context parallel (cp.c, Ulysses): this rank's tokens [cp_t0, cp_t0 + cp_tl) of the last
     * forward's batch; the group's collectives; cp_out: [(1 + size) ceil(T / size)] floats to
     * gather the per-token outputs */
    int cp_rank, cp_size; /* 0 and 1 without */
    mrl_tp_allgather cp_gather;
    mrl_cp_alltoallv cp_a2a;
    void *cp_ctx;
    mrl_tp_allgather cp_dgather; /* a GPU model's on device memory (NCCL's; NULL: through the host) */
    mrl_cp_alltoallv cp_da2a;
    void *cp_dctx;
    int64_t cp_t0, cp_tl;
    float *cp_out;
    /* pipeline parallel (pp.c): this stage holds layers [pp_l0, pp_l0 + cfg.num_hidden_layers) of
     * the whole model's (pp_whole); the first stage the embedding, the last the final norm and head (a
     * tied head: its own copy of the embedding). A non-first stage's forward reads its input
     * rows from pp_in, a non-last stage's backward its output's gradient from pp_dy (both
     * borrowed, [pp_input_rows, D]). pp_slots: the activations of micro-batches in flight. */
    int pp_stage, pp_stages; /* 0 and 1 without */
    int pp_l0;
    /* pp_whole: the whole model's config (saved). A stage of a mixture of experts: its cfg says
     * which of its layers are sparse in its own numbering (mlp_only_layers, decoder_sparse_step
     * 1); pp_moe0 is the whole model's sparse layers before this stage and pp_moe_all all of
     * them: a batch's routing rows are the whole model's (moe.c) */
    mrl_model_config pp_whole;
    int pp_moe0, pp_moe_all;
    const float *pp_in, *pp_dy;
    mrl_pp_send pp_send; /* the pipeline's transfers (saving: the stages' tensors to the first) */
    mrl_pp_recv pp_recv;
    void *pp_ctx;
    struct pp_slot *pp_slots;
    int pp_nslots, pp_slot;
};

/* lora.c: the adapters' pointers into each layer's tables (again after the layout's pointers
 * were rebuilt: mrl_model_point_params), the frozen parameters' gradient pointers (NULL, the
 * norms' at the sink); their free */
void mrl_lora_point(mrl_model *m);
/* lora.c: a forward starts: dropout on for a training one, with new masks */
void mrl_lora_begin_forward(mrl_model *m);

/* pipeline parallel: this model holds the embedding (as the first stage), the head (the last) */
static inline int mrl_model_has_embed(const mrl_model *m) { return m->pp_stage == 0; }
static inline int mrl_model_has_head(const mrl_model *m) { return m->pp_stage >= m->pp_stages - 1; }
/* where the layers' parameters end (the final norm's offset; all of them on a stage without head) */
static inline int64_t mrl_model_layers_end(const mrl_model *m) {
    return m->final_norm ? m->final_norm - m->params : m->n_params;
}

/* layer l's range of the parameters [*lo, *hi): from its first norm to the next layer's (the last:
 * to where the layers end) */
static inline void mrl_model_layer_range(const mrl_model *m, int l, int64_t *lo, int64_t *hi) {
    *lo = m->lp[l].ln1 - m->params;
    *hi = l + 1 < m->cfg.num_hidden_layers ? m->lp[l + 1].ln1 - m->params : mrl_model_layers_end(m);
}

static inline float *grad_of(mrl_model *m, float *p) { return p ? m->grads + (p - m->params) : NULL; }

/* shard.c: with sharded parameters, make [lo, hi) of the parameters whole (pinned, gathered
 * into place, and its bf16 copies converted) for the computation that follows, starting the
 * gather of [next_lo, next_hi) ahead when next_hi > next_lo; unuse lets the range go again
 * (the pages outside the shard and other ranges in use are given back). Without sharding: nothing. */
mrl_status mrl_model_use(mrl_model *m, int64_t lo, int64_t hi, int64_t next_lo, int64_t next_hi);
void mrl_model_unuse(mrl_model *m, int64_t lo, int64_t hi);
/* shard.c: the head's part a forward kept in use for its backward let go (the next forward's
 * start; a change of dtype or device, whose copies and regions the part's pins would outlive) */
void mrl_model_head_unkeep(mrl_model *m);
/* shard.c: start the gather of [lo, hi) ahead of its use, when none is ahead (a failure is the
 * use's to report) */
void mrl_model_prefetch(mrl_model *m, int64_t lo, int64_t hi);
/* model.c: the layer tables' and the head's bf16 pointers at m->w16 (NULL: none), after the
 * parameters or their copies moved (mrl_model_point_params does it too) */
void mrl_model_point_w16(mrl_model *m);
/* quant.c: a quantized base's blocks let go (mrl_model_free); moved with the region to another
 * device (mrl_model_set_device) */
void mrl_model_quant_free(mrl_model *m);
mrl_status mrl_model_quant_move(mrl_model *m, mrl_device to);
/* quant.c: a bf16 quantized base's copies: the region, the other tensors' pinned and converted for
 * the model's life (mrl_model_set_dtype, mrl_model_set_device); the matrices' of [lo, hi) made
 * from their dequantized weights (mrl_model_use) */
mrl_status mrl_model_quant_w16(mrl_model *m);
void mrl_model_quant_bf16(mrl_model *m, int64_t lo, int64_t hi);
/* quant.c: a base stored in bf16 that no computation needs whole (its products read the copies):
 * mrl_model_use is then nothing, but for reads of the parameters (mrl_model_fetch, fetching) */
int mrl_model_quant_lazy(const mrl_model *m);
void mrl_model_quant_fetching(mrl_model *m, int on);
/* shard.c: the bf16 copies of a sharded model as a region (mrl_model_set_dtype) */
mrl_status mrl_model_shard_w16(mrl_model *m);
/* forward.c: the activation buffer's layout for T tokens at base (NULL: only count); its bytes */
int64_t mrl_model_layout_acts(mrl_model *m, int64_t T, char *base);
/* pp.c: the activation slots' buffers freed (mrl_model_free) */
void mrl_model_pp_free_slots(mrl_model *m);
/* model.c: the bf16 copies of [lo, hi) of the parameters (where the products read them) */
void mrl_model_bf16_convert_range(const mrl_model *m, const float *base, uint16_t *dst, int64_t lo, int64_t hi);
/* model.c: a model with zeroed parameters (alloc = alloc_layout, then
 * alloc_params); the views and layer tables only, no buffer (what loading
 * checks a file against before allocating); the parameter buffer of such a
 * model; the gradient buffer, created zeroed on first use (MRL_MEM_GRADS);
 * the documented init of one view, into dst (its numel floats) */
mrl_status mrl_model_alloc(const mrl_model_config *cfg, mrl_model **out);
mrl_status mrl_model_alloc_layout(const mrl_model_config *cfg, mrl_model **out);
/* the same for a pipeline stage (NULL, or stages 1: the whole model) */
mrl_status mrl_model_alloc_stage_layout(const mrl_model_config *cfg, const mrl_model_stage *stage, mrl_model **out);
mrl_status mrl_model_alloc_params(mrl_model *m);
/* model.c: the layout's pointers (views, layer tables) into the parameter buffer at base */
mrl_status mrl_model_point_params(mrl_model *m, float *base);
/* shard.c: a region in place of the parameter buffer, [offset, offset + count) pinned */
mrl_status mrl_model_alloc_shard(mrl_model *m, int64_t offset, int64_t count);
/* shard.c: the shard's parameters moved into a region on device `to` (mrl_model_set_device);
 * m->p_region, m->w16_region and m->w16 then point there, the layout's pointers not yet */
mrl_status mrl_model_move_shard(mrl_model *m, mrl_device to);
mrl_status mrl_model_ensure_grads(mrl_model *m);
/* model.c: with gradient windows, the gradient pointers of the range [lo, hi) of the layout
 * (layer l's when l >= 0, else the embedding, final norm, lm_head and value head that fall
 * in it) into the window w that holds it */
void mrl_model_point_window(mrl_model *m, int l, float *w, int64_t lo, int64_t hi);
void mrl_model_init_view(const mrl_model *m, const mrl_param_view *v, uint64_t *s, float *dst);
/* model.c: the parameters as host memory: m->params itself on the CPU, a
 * copy in *tmp on a GPU (the caller mrl_mem_frees *tmp); NULL when out of memory */
const float *mrl_model_host_params(mrl_model *m, float **tmp);
/* layer.c (and, in layer.h, the two halves the engine shares) */
void mrl_layer_forward(mrl_model *m, int l, int64_t T);
void mrl_layer_backward(mrl_model *m, int l, int64_t T);
/* The same for a layer of the caller's (the multi-token prediction layer's, mtp.c): parameters p,
 * gradients g, activations a, input x, output out; the plain path (no sequence or context
 * parallel, no routing replay or expert parallelism: a->replay and a->ep NULL). */
/* mtp.c: the multi-token prediction layer's training (mrl_model_set_mtp_loss): its buffers for
 * T tokens (base NULL: counted), its forward after the head's (m->lnf), and its backward from the
 * caller's dlogprobs into m->mtp_dlnf (the gradient of m->lnf through it), its weights' gradients
 * added. */
int64_t mrl_mtp_acts_layout(mrl_model *m, int64_t T, char *base);
mrl_status mrl_mtp_forward(mrl_model *m, int64_t T);
void mrl_mtp_backward(mrl_model *m, const float *dlogprobs, int64_t T);
void mrl_layer_forward_io(mrl_model *m, const layer_params *p, layer_acts *a, const float *x, float *out, int64_t T);
void mrl_layer_backward_io(mrl_model *m, const layer_params *p, const layer_params *g, const layer_acts *a,
                           const float *x, int64_t T);
/* layer.c: the products of one stage, fp32 together or bf16 one by one
 * (w16[i]: product i's weight as a bf16 copy, or NULL) */
void mrl_layer_products(const mrl_model *m, const mrl_gemm_desc *d, const uint16_t *const *w16, int n);
/* moe.c: a sparse layer's MLP. forward: out [T,D] += moe(a->ln2), filling
 * a->rprob .. ey. backward: from dy = dL/dout [T,D] into dln = dL/dln2
 * [T,D] (overwritten), the router's and experts' gradients added to g. */
void mrl_moe_forward(const mrl_model *m, const layer_params *p, layer_acts *a, float *out, int64_t T);
void mrl_moe_backward(mrl_model *m, const layer_params *p, const layer_params *g, const layer_acts *a,
                      const float *dy, float *dln, int64_t T);
/* moe.c: the experts' MLP over rows grouped by expert, expert e0 + i owning rows
 * eoff[i] .. eoff[i+1] of x [rows,D] (eoff[0] = 0): gate, up, act [rows,Fe] kept for the
 * backward, y [rows,D] out. The backward: dy [rows,D] in, overwritten by dx; df1, df2
 * [rows,Fe] scratch; the experts' gradients added to g. */
void mrl_moe_experts_forward(const mrl_model *m, const layer_params *p, int64_t e0, int64_t ne, const int32_t *eoff,
                             const float *x, float *gate, float *up, float *act, float *y, float *lora_u,
                             float *lora_xd);
void mrl_moe_experts_backward(const mrl_model *m, const layer_params *p, const layer_params *g, int64_t e0, int64_t ne,
                              const int32_t *eoff, const float *x, const float *gate, const float *up,
                              const float *act, float *dy, float *df1, float *df2, float *lora_u,
                              float *lora_du);
/* moe_ep.c: expert parallelism. forward: a->xe's rows to the ranks of their experts, their
 * outputs back into a->ey; backward: dye [A,D] (d ey) to the same ranks, d xe back into it.
 * A failure is kept in the model's EP state (mrl_moe_ep_status) and the layer's outputs are
 * then meaningless. layer: a->ep of sparse layer number ord of the trainer's forward. */
void mrl_moe_ep_forward(const mrl_model *m, const layer_params *p, layer_acts *a);
void mrl_moe_ep_backward(const mrl_model *m, const layer_params *p, const layer_params *g, const layer_acts *a,
                         float *dye);
struct moe_ep_layer *mrl_moe_ep_layer(const mrl_model *m, int ord);
/* the first failure of the exchanges since mrl_moe_ep_begin (MRL_OK: none, or no EP) */
void mrl_moe_ep_begin(const mrl_model *m);
mrl_status mrl_moe_ep_status(const mrl_model *m);
/* tp.c: room for n floats of host memory, kept with the model, for a GPU model's collectives
 * through the host (tensor and context parallel's); NULL when out of memory */
float *mrl_model_host_stage(mrl_model *m, int64_t n);
/* tp.c: buf (n floats) summed over the tensor-parallel group, in place (nothing without one);
 * a failure is kept for mrl_model_tp_status */
void mrl_model_tp_sum(const mrl_model *m, float *buf, int64_t n);
/* The vocabulary-parallel head and embedding (tp.c): a batch's targets as this rank's slice
 * reads them (-1 none, rows: another rank's); the group's statistics of the slices' head_fwd
 * (mine: [lse_r | H_r | logp_r] of T tokens; all: size times that) combined into the whole
 * vocabulary's lse, entropy and (lp not NULL) log-probs of the whole targets; the embedding's
 * gradient of this rank's rows from dx [T,D], in token order (ids: mrl_model_tp_ids'). */
void mrl_model_tp_targets(const mrl_model *m, const int32_t *whole, int32_t *local, int64_t T);
mrl_status mrl_model_tp_head_stats(mrl_model *m, float *mine, float *all, const int32_t *targets, int64_t T,
                                   float *lse, float *ent, float *lp);
void mrl_model_tp_embed_bwd(const mrl_model *m, float *g_embed, const float *dx, const int32_t *ids, int64_t T);
/* Sequence parallel (tp.c): every rank's rows [t0, t0 + tl) (mine: [tl, D]) into full [T, D];
 * full [T, D], partial on each rank, summed over the group, this rank's rows into mine [tl, D];
 * a norm's weight gradient of this rank's rows (sp_dw) summed over the group and added to g [n]. */
void mrl_model_sp_gather(const mrl_model *m, const float *mine, float *full);
void mrl_model_sp_reduce_scatter(const mrl_model *m, float *full, float *mine);
void mrl_model_sp_norm_grad(const mrl_model *m, float *g, int64_t n);
/* Context parallel (cp.c): rank r's tokens of a batch of T, [*t0, *t0 + return); local [Tl, H*hd]
 * rows to the attention's layout [T, H/size*hd] (this rank's heads, every token) and back; the
 * per-token outputs of every rank's tokens into whole[T]. Failures kept as tensor parallel's. */
int64_t mrl_model_cp_share(int rank, int size, int64_t T, int64_t *t0);
/* Every rank's share of T rows of `unit` floats (mine: this rank's, rank of size) into whole
 * [T, unit], through gather (an all-gather of equal pieces: each padded to ceil(T / size) rows in
 * stage, [(1 + size) ceil(T / size) unit]). Context parallel's outputs, sequence parallel's rows. */
mrl_status mrl_model_gather_shares(mrl_tp_allgather gather, void *ctx, int size, int rank, int64_t T, int64_t unit,
                                   const float *mine, float *stage, float *whole);
void mrl_model_cp_to_heads(const mrl_model *m, const float *local, int H, float *heads);
void mrl_model_cp_to_tokens(const mrl_model *m, const float *heads, int H, float *local);
void mrl_model_cp_gather(const mrl_model *m, const float *mine, float *whole);
void mrl_moe_ep_free(mrl_model *m);
/* moe.c: the load-balancing statistics of one sparse layer's forward, added
 * to the model's (aux_picks, aux_n); then the loss from them */
void mrl_moe_aux_add(mrl_model *m, const layer_acts *a, int64_t T);
void mrl_moe_aux_finish(mrl_model *m);
/* moe.c: the routing of sparse layer number `ord` of the forward (a->sel) into m->route_used,
 * with its replay counts */
void mrl_moe_record(mrl_model *m, const layer_acts *a, int64_t T, int ord);
/* moe.c: the number of sparse layers before layer l (its place in mrl_batch.routing's rows);
 * with l = num_hidden_layers, all of them */
int mrl_moe_ordinal(const mrl_model_config *c, int l);
/* moe.c: a->replay of sparse layer l for the forward of m->batch (NULL without routing) */
void mrl_moe_replay_at(const mrl_model *m, layer_acts *a, int l);
/* moe.c: MRL_OK when b->routing (if any) holds, for every token and sparse layer, k distinct
 * experts or k times -1; else MRL_ERR_INVALID naming the token, layer and entry */
mrl_status mrl_moe_check_routing(const mrl_model *m, const mrl_batch *b);
