/* The transformer (Llama / Qwen2 / Qwen3 dense, Qwen3-MoE) trained on the CPU: forward
 * to per-token log-probs, entropy and values for a packed batch; backward
 * from their gradients into one gradient buffer.
 *
 * Memory: all parameters live in one fp32 allocation (MRL_MEM_PARAMS), the
 * gradients in a second one with the same layout (MRL_MEM_GRADS), created
 * on first use (mrl_model_grads or the first backward: a model that only
 * runs forwards or the engine never has one), the activations in a third
 * (MRL_MEM_ACTIVATIONS) sized for the largest batch seen. Each parameter is a named view (offset, shape) into them, named as
 * in Hugging Face checkpoints ("model.layers.0.self_attn.q_proj.weight").
 *
 * Batch layout (packed, no padding): tokens[n_tokens] holds the sequences
 * one after the other; sequence s is tokens[cu_seqlens[s] .. cu_seqlens[s+1])
 * with cu_seqlens[0] = 0 and cu_seqlens[n_seqs] = n_tokens. Positions restart
 * at 0 in each sequence and attention never crosses sequences.
 * targets[i] is the token whose log-prob output i holds (normally the next
 * token of the same sequence, tokens[i+1]); -1 means "no target" (the last
 * token of each sequence): its log-prob is 0 and its gradient is ignored.
 * Entropy and value are computed for every token.
 *
 * Shared prompts (optional prefix[n_seqs]): sequence s with prefix[s] = p >= 0
 * continues sequence p, an earlier one with no prefix of its own: its tokens
 * attend to all of p's tokens and then causally to their own, and its
 * positions go on from p's length. So G samples of one prompt are packed as
 * the prompt (once) followed by G short sequences, each "last prompt token +
 * response", and the prompt's rows are computed once instead of G times; the
 * gradients through the prompt's keys and values sum over the G samples. The
 * result equals packing each sample whole (tests/model/test_prefix.c). */
#pragma once
#include <stdint.h>
#include <stddef.h>
#include "dist.h"
#include "device.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mrl_model_arch {
    MRL_ARCH_LLAMA = 0, /* LlamaForCausalLM */
    MRL_ARCH_QWEN2 = 1, /* Qwen2ForCausalLM: q/k/v biases */
    MRL_ARCH_QWEN3 = 2, /* Qwen3ForCausalLM: q_norm / k_norm per head */
    MRL_ARCH_QWEN3_MOE = 3, /* Qwen3MoeForCausalLM: qwen3 attention, mixture-of-experts MLPs (below) */
    MRL_ARCH_DEEPSEEK_V3 = 4, /* DeepseekV3ForCausalLM: multi-head latent attention (below) */
    MRL_ARCH_COUNT = 5
} mrl_model_arch;

/* The names of an architecture in the formats moonrl reads and writes. */
typedef struct mrl_arch_names {
    const char *model_type; /* config.json's "model_type": "llama", "qwen2", "qwen3", "qwen3_moe" */
    const char *hf_class;   /* its classes' stem: "Qwen3Moe" (Qwen3MoeForCausalLM, ...ForSequenceClassification) */
    const char *gguf;       /* llama.cpp's general.architecture: "qwen3moe" */
} mrl_arch_names;

/* The names of architecture `arch` (mrl_model_arch); NULL for arch outside
 * 0 .. MRL_ARCH_COUNT - 1. The one table of them (core/model/config.c): the
 * config's parser and writer, the error messages and Lua (model.lua,
 * gguf.lua) all read it. */
const mrl_arch_names *mrl_model_arch_names(int arch);

typedef enum mrl_rope_scaling {
    MRL_ROPE_NONE = 0,
    MRL_ROPE_LLAMA3 = 1, /* rope_scaling {"rope_type": "llama3", ...} */
    MRL_ROPE_YARN = 2    /* rope_scaling {"rope_type": "yarn", ...} (Qwen's long context, DeepSeek-V3) */
} mrl_rope_scaling;

typedef enum mrl_kernel_backend {
    MRL_KERNELS_CPU_FAST = 0,     /* OpenBLAS + AVX2/AVX-512 kernels (default) */
    MRL_KERNELS_CPU_REFERENCE = 1 /* plain loops, trusted by the tests */
} mrl_kernel_backend;

/* The architecture, with the keys of a Hugging Face config.json. */
typedef struct mrl_model_config {
    int arch;                    /* mrl_model_arch */
    int vocab_size;
    int hidden_size;
    int intermediate_size;
    int num_hidden_layers;
    int num_attention_heads;
    int num_key_value_heads;
    int head_dim;                /* default hidden_size / num_attention_heads */
    int max_position_embeddings;
    int tie_word_embeddings;
    int attention_bias;          /* q/k/v biases (always on for Qwen2) */
    int value_head;              /* a scalar head score.weight [1, hidden] */
    int rope_scaling;            /* mrl_rope_scaling */
    int rope_original_max_position_embeddings;
    int bos_token_id;            /* -1 if absent */
    int eos_token_id;            /* -1 if absent (first one if a list) */
    double rms_norm_eps;
    double rope_theta;
    double rope_factor;
    double rope_low_freq_factor;
    double rope_high_freq_factor;
    /* yarn (Transformers' _compute_yarn_parameters): the ramp's bounds in rotations (beta_fast,
     * beta_slow: 32, 1), whether the correction range is rounded outward (truncate: 1), and
     * what cos and sin are multiplied by (attention_factor: given, or from factor, mscale and
     * mscale_all_dim as Transformers infers it; mscale, mscale_all_dim: 0 when absent) */
    double rope_beta_fast, rope_beta_slow, rope_attention_factor, rope_mscale, rope_mscale_all_dim;
    int rope_truncate;
    int rope_attention_factor_given; /* (written back only when config.json gave it) */
    double initializer_range;
    /* mixture of experts (qwen3_moe; all 0 for the dense families). A layer
     * l is sparse (mrl_model_layer_is_moe) when num_experts > 0, l is not in
     * mlp_only_layers and (l + 1) % decoder_sparse_step == 0: its MLP is then
     *   p = softmax(x Wr^T) over the experts (router mlp.gate.weight [E,D]),
     *   the num_experts_per_tok largest (ties: the lower expert index), their
     *   weights p renormalised to sum 1 when norm_topk_prob, and
     *   out = sum over them of weight * expert_e(x), each expert a SwiGLU MLP
     *   of moe_intermediate_size (mlp.experts.{e}.gate_proj/up_proj/down_proj).
     * Other layers keep the dense MLP of intermediate_size. The load-balancing
     * loss (Switch / Transformers' load_balancing_loss_func over all sparse
     * layers) enters the backward with router_aux_loss_coef when
     * output_router_logits is set (mrl_model_set_router_aux_coef overrides). */
    int num_experts;
    int num_experts_per_tok;
    int moe_intermediate_size;
    int norm_topk_prob;
    int decoder_sparse_step;     /* 1 when absent */
    int output_router_logits;
    double router_aux_loss_coef;
    uint64_t mlp_only_layers[16]; /* bit l: layer l keeps the dense MLP (layers < 1024) */
    /* multi-head latent attention (deepseek_v3; all 0 for the others), per layer and head:
     *   q   = q_b_proj(q_a_layernorm(q_a_proj(x))) when q_lora_rank > 0, else q_proj(x): [dn + dr]
     *   kv_a_proj_with_mqa(x) = [c (kv_lora_rank), kr (dr)], one for every head; c' = kv_a_layernorm(c)
     *   kv_b_proj(c') = [k_nope (dn), v (dv)]; k = [k_nope, rope(kr)], q = [q_nope, rope(q_rope)]
     * dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim. RoPE turns the dr part only
     * (its tables of dr dimensions), its pairs interleaved when rope_interleave (DeepSeek's
     * checkpoints); the scores are scaled by (dn + dr)^-1/2, times yarn's mscale(factor,
     * mscale_all_dim)^2 when given. head_dim is the attention's head, max(dn + dr, dv), q, k and
     * v padded with zeros to it (the parser sets it; config.json's head_dim, qk_rope_head_dim in
     * Transformers, is not read), and num_key_value_heads = num_attention_heads. */
    int q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave;
    /* DeepSeek-V3's mixture of experts (deepseek_v3 with num_experts = n_routed_experts > 0): the
     * layers from first_k_dense_replace on are sparse (and not in mlp_only_layers), each with
     *   s = sigmoid(x Wr^T) [E] (fp32); the choice scores s + e_score_correction_bias (a frozen
     *   [E] of the checkpoint's: it picks, it does not weigh); the E experts in n_group groups,
     *   each scored by the sum of its two best choices; the topk_group best groups; of their
     *   experts the num_experts_per_tok best choices (ties: the lower group, the lower expert);
     *   weights s at the picks, divided by their sum (+ 1e-20) when norm_topk_prob, times
     *   routed_scaling_factor; and out = the picks' weighted sum + the shared experts' output,
     *   one SwiGLU MLP of n_shared_experts * moe_intermediate_size (mlp.shared_experts.*). */
    int first_k_dense_replace, n_group, topk_group, n_shared_experts;
    double routed_scaling_factor;
    /* DeepSeek-V3's multi-token prediction (0 or 1 layer): model.layers.{num_hidden_layers}.*, the
     * previous position's final hidden state (normed, hnorm) and the next token's embedding
     * (embed_tokens of its own, normed, enorm) through eh_proj, a decoder layer and a head of
     * its own (shared_head.norm, shared_head.head): the next-but-one token. The generation engine
     * drafts with it (engine.h, mtp); the trainer's forward does not run it. A directory whose
     * config names it without its weights (Transformers drops them) loads without it. */
    int num_nextn_predict_layers;
} mrl_model_config;

/* 1 when layer l of this config has a mixture-of-experts MLP (above). */
int mrl_model_layer_is_moe(const mrl_model_config *cfg, int l);

/* One parameter: a view into the parameter (and gradient) buffer. */
typedef struct mrl_param_view {
    const char *name;  /* Hugging Face tensor name */
    int64_t offset;    /* in floats from the start of the buffer */
    int64_t numel;
    int ndim;          /* 1 or 2 */
    int64_t shape[2];
    int weight_decay;  /* 0 for biases and norm weights (HF convention) */
} mrl_param_view;

typedef struct mrl_model mrl_model;

/* A packed batch (see the layout above). The arrays are borrowed: they must
 * stay alive and unchanged until the backward of this forward. */
typedef struct mrl_batch {
    const int32_t *tokens;     /* [n_tokens] */
    const int32_t *targets;    /* [n_tokens], -1 = no target; NULL: all -1 */
    const int32_t *cu_seqlens; /* [n_seqs + 1] */
    int64_t n_tokens;
    int32_t n_seqs;
    const int32_t *prefix;     /* [n_seqs] or NULL: the sequence each continues, -1 none (above) */
    /* routing replay (a qwen3_moe model; NULL: every sparse layer picks its own experts): row t
     * holds, for each sparse layer in layer order, the num_experts_per_tok experts token t goes
     * to instead of the router's top-k, e.g. the generation engine's picks
     * (mrl_engine_get_output_routing), so that the trainer's forward runs the experts the
     * engine sampled with (R3, "routing replay"). The weights stay the trainer's own router
     * probabilities at those experts (renormalised when norm_topk_prob), so the router still
     * gets its gradient; the backward treats the picks as constants, as it does its own.
     * A row's layer entry of k times -1 keeps that layer's own top-k for the token (a position
     * the engine never ran: a cached prefix, a sample's last token). */
    const int16_t *routing;    /* [n_tokens, mrl_model_num_moe_layers, num_experts_per_tok] or NULL */
} mrl_batch;

/* Defaults for every field (a tiny Llama); then set what you need. */
void mrl_model_config_default(mrl_model_config *cfg);
/* Parse the text of a config.json. `source` names it in error messages.
 * Unsupported options (model_type, rope_scaling type, sliding window in use,
 * attention/mlp bias for Llama, ...) are MRL_ERR_UNSUPPORTED naming them. */
mrl_status mrl_model_config_parse(const char *json, size_t len, const char *source, mrl_model_config *cfg);
mrl_status mrl_model_config_load(const char *path, mrl_model_config *cfg);
/* Check a config (sizes, divisibility); called by mrl_model_create. */
mrl_status mrl_model_config_validate(const mrl_model_config *cfg);
/* The config as config.json text (Transformers-loadable): written into
 * buf[0..cap) NUL-terminated; *len gets the length. */
mrl_status mrl_model_config_to_json(const mrl_model_config *cfg, char *buf, size_t cap, size_t *len);

/* A model with random weights: every matrix and the embedding drawn from
 * normal(0, initializer_range), biases 0, norm weights 1, in view order
 * from one deterministic generator seeded by `seed`. */
mrl_status mrl_model_create(const mrl_model_config *cfg, uint64_t seed, mrl_model **out);
/* config.json + *.safetensors (sharded or not) from a Hugging Face directory.
 * Every tensor the config implies is checked against the file's names and
 * shapes before the parameters are allocated. */
mrl_status mrl_model_load_dir(const char *dir, mrl_model **out);
/* transformers' save_pretrained default max_shard_size ("5GB": 10^9 bytes a GB). */
#define MRL_MODEL_MAX_SHARD_BYTES 5000000000LL
/* config.json + the weights in F32, streamed one tensor at a time from the
 * parameters (no copy of the model is held): model.safetensors when they
 * fit in max_shard_bytes (0: no limit), else model-0000K-of-0000N.safetensors
 * filled in view order, as save_pretrained fills them, plus
 * model.safetensors.index.json. Shards of an earlier save with another
 * count are removed. */
mrl_status mrl_model_save_dir_sharded(mrl_model *m, const char *dir, int64_t max_shard_bytes);
/* mrl_model_save_dir_sharded with MRL_MODEL_MAX_SHARD_BYTES. */
mrl_status mrl_model_save_dir(mrl_model *m, const char *dir);
/* Replace every parameter with the floats of a raw little-endian f32 file
 * holding the views one after the other in view order (the buffer image). */
mrl_status mrl_model_load_raw(mrl_model *m, const char *path);
mrl_status mrl_model_save_raw(mrl_model *m, const char *path);
void mrl_model_free(mrl_model *m);

const mrl_model_config *mrl_model_get_config(const mrl_model *m);
int64_t mrl_model_num_params(const mrl_model *m);
/* The parameter buffer (n_params floats), in the memory of the model's
 * device: on a GPU a device pointer (read it with mrl_device_memcpy;
 * mrl_model_weights_changed after writing it). */
float *mrl_model_params(mrl_model *m);
/* The gradient buffer (n_params floats, the parameters' layout, on the
 * model's device), allocated zeroed on the first call; NULL (and an error)
 * when out of memory. */
float *mrl_model_grads(mrl_model *m);
int mrl_model_num_views(const mrl_model *m);
/* View i (0 <= i < num_views); MRL_ERR_INVALID when out of range. */
mrl_status mrl_model_view(const mrl_model *m, int i, mrl_param_view *out);
/* The view with this name; MRL_ERR_INVALID naming it when absent. */
mrl_status mrl_model_find_view(const mrl_model *m, const char *name, mrl_param_view *out);

/* LoRA (Hu et al. 2021, as PEFT computes it): each targeted projection y = x W^T becomes
 *   y = x W^T + (alpha / rank) (x A^T) B^T,   A [rank, in] and B [out, rank]
 * without W + BA ever formed. The adapters' parameters are one buffer of their own (in
 * layer order, each layer's targets in the order of the bits below, A then B; a sparse
 * layer's experts as blocks [E, rank, in] and [E, out, rank] per target), and so are their
 * gradients: with adapters on, the backward adds only to the adapters' gradients (the model's
 * own parameters are frozen: no gradient buffer, none computed), and the grad hook and
 * gradient windows name ranges of the adapters' buffer. Init as PEFT: A ~ U(-1/sqrt(in),
 * 1/sqrt(in)) from `seed`, B = 0 (the adapted model starts equal to the base). The views are
 * named as PEFT saves them ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").
 * Targets: the seven projections of every layer (the experts' gate, up and down follow the
 * MLP's bits; the router is never adapted). */
enum {
    MRL_LORA_Q = 1, MRL_LORA_K = 2, MRL_LORA_V = 4, MRL_LORA_O = 8,
    MRL_LORA_GATE = 16, MRL_LORA_UP = 32, MRL_LORA_DOWN = 64, MRL_LORA_ALL = 127
};
typedef struct mrl_lora_config {
    int rank;        /* >= 1 */
    double alpha;    /* the scale is alpha / rank */
    unsigned targets; /* MRL_LORA_* bits, at least one */
    uint64_t seed;   /* A's init, and the dropout masks' stream */
    double dropout;  /* 0 <= p < 1: in training forwards (mrl_model_set_training) each element of an
                      * adapter's input is zeroed with probability p, the rest scaled by 1 / (1 - p),
                      * as PEFT's lora_dropout; the backward sees the same masks */
} mrl_lora_config;
/* Adapters on (a whole model, on the CPU or a GPU: its buffers on the model's device, so set the
 * device first; MRL_ERR_UNSUPPORTED otherwise, naming why). */
mrl_status mrl_model_set_lora(mrl_model *m, const mrl_lora_config *cfg);
/* An adapter set of its own for model m's architecture, not the model's (no gradients): what an
 * engine serves beside the model's weights (mrl_engine_set_adapter), several of them in one
 * batch. Its parameters are laid out as the model's adapters are (the same views); it must not
 * outlive the model, nor be freed while an engine holds it. */
typedef struct mrl_lora mrl_lora;
mrl_status mrl_lora_create(const mrl_model *m, const mrl_lora_config *cfg, mrl_lora **out);
void mrl_lora_free(mrl_lora *ad);
const mrl_lora_config *mrl_lora_get_config(const mrl_lora *ad);
int64_t mrl_lora_num_params(const mrl_lora *ad);
float *mrl_lora_params(mrl_lora *ad);
int mrl_lora_num_views(const mrl_lora *ad);
mrl_status mrl_lora_view(const mrl_lora *ad, int i, mrl_param_view *out);
/* The adapters' config (NULL: none), parameter count, parameters and gradients (in the memory
 * of the model's device: mrl_device_memcpy reads a GPU's), views (0 <= i < count). */
const mrl_lora_config *mrl_model_lora(const mrl_model *m);
int64_t mrl_model_lora_num_params(const mrl_model *m);
float *mrl_model_lora_params(mrl_model *m);
float *mrl_model_lora_grads(mrl_model *m);
int mrl_model_lora_num_views(const mrl_model *m);
mrl_status mrl_model_lora_view(const mrl_model *m, int i, mrl_param_view *out);
/* The forwards from now on are training forwards (1: each followed by its backward; 0, the
 * default: evaluation, log-probs) — what LoRA's dropout applies in. The masks are drawn from the
 * adapters' seed, `key` and the training forwards since this call (1, 2, ...): a caller that gives
 * each micro-batch's key from its step (and rank) draws the same masks in a resumed run. */
void mrl_model_set_training(mrl_model *m, int on, uint64_t key);
/* Off (0) or back on (1) without freeing them: off, the model (and an engine's next step on it)
 * computes as its base: a reference policy that shares the policy's weights. The weights'
 * generation (mrl_model_weights_generation) stays as it is. */
void mrl_model_lora_enable(mrl_model *m, int on);
/* The parameters with the adapters merged into dst (host memory, mrl_model_num_params floats):
 * each adapted matrix W + (alpha / rank) B A, the rest copied (a merged model to save or serve). */
mrl_status mrl_model_lora_merged(mrl_model *m, float *dst);
/* The parameters of a model of config mc and of adapters cfg on it, counted without allocating
 * either (what `moonrl run ... --show-config` says of model.lora). */
mrl_status mrl_lora_count(const mrl_model_config *mc, const mrl_lora_config *cfg, int64_t *model_params,
                          int64_t *lora_params);
/* The adapters' parameters were written (an optimizer step, a load): the weights' generation
 * moves on (mrl_model_weights_generation) and nothing of the base is converted again. */
void mrl_model_lora_changed(mrl_model *m);

/* Keep only each layer's input in the forward and recompute the rest of
 * the layer in the backward (less activation memory, ~1/3 more compute). */
void mrl_model_set_recompute(mrl_model *m, int on);
/* The op table of a model on the CPU (MRL_KERNELS_*); MRL_ERR_INVALID for a
 * model on a GPU, which uses that device's. */
mrl_status mrl_model_set_kernels(mrl_model *m, int backend);
/* Move the model to a device (moonrl/device.h; every model starts on the
 * CPU): its parameters, gradients and bf16 copies go to that device's
 * memory, its activations and RoPE tables are made there, and its ops are
 * that device's kernels (on a GPU: kernels/cuda, with cuBLASLt). Batches
 * and the per-token arrays of mrl_model_forward / _backward stay host
 * memory: the forward copies the batch over and its outputs back (a few
 * floats a token, the loss boundary of docs/architecture.md). MRL_ERR_UNSUPPORTED for
 * a device not built or not present, and on a GPU for a mixture-of-experts
 * model or one with expert parallelism (they route on the host). */
mrl_status mrl_model_set_device(mrl_model *m, mrl_device device);
mrl_device mrl_model_get_device(const mrl_model *m);
/* Tokens whose full-vocabulary logits the head holds at a time (0, the
 * default: 128 MiB worth, at least 128 tokens). A batch of more tokens is
 * taken in even chunks of at most this many, and the backward recomputes
 * the logits of all of them but the last. */
void mrl_model_set_head_chunk(mrl_model *m, int64_t tokens);
/* Bytes of activations for a batch of n_tokens (with the current settings). */
int64_t mrl_model_activation_bytes(const mrl_model *m, int64_t n_tokens);
/* Free the activation buffer (it is reallocated by the next forward). */
void mrl_model_release_activations(mrl_model *m);

/* Forward a packed batch. Outputs, each [n_tokens], may be NULL when not
 * wanted: logprobs (log p(target), 0 where target = -1), entropy of the
 * predicted distribution, values (needs value_head). Logits are divided by
 * `temperature` (> 0; 1 for none) before the softmax. The full
 * [n_tokens, vocab] logits are never stored: the head works in token chunks. */
mrl_status mrl_model_forward(mrl_model *m, const mrl_batch *batch, float temperature,
                             float *logprobs, float *entropy, float *values);
/* mrl_model_forward (logprobs of the targets, may be NULL) that also gives the k (1..20) most
 * likely tokens at every position under softmax(logits / temperature): top_ids and top_lps
 * [n_tokens * k], best first (ties: the lower id); and, when target_ranks is given, each
 * target's rank in its position's distribution (1 + the tokens more likely; 0 where the target is
 * -1). A whole model on the CPU (what `moonrl serve` scores prompts with: echo and
 * prompt_logprobs). */
mrl_status mrl_model_forward_top(mrl_model *m, const mrl_batch *batch, float temperature, int k, float *logprobs,
                                 int32_t *top_ids, float *top_lps, int32_t *target_ranks);
/* Backward of the last forward, from dL/dlogprob, dL/dentropy, dL/dvalue per
 * token (each may be NULL: zero). Gradients are ADDED to the gradient buffer. */
mrl_status mrl_model_backward(mrl_model *m, const float *dlogprobs, const float *dentropy,
                              const float *dvalues);
/* A function the backward calls as each range of the gradient buffer
 * becomes final for this backward (no later part of it writes there): the
 * head, final norm and value head first, then the layers from the last to
 * the first, the embedding last; together the ranges cover the buffer once.
 * Gradient all-reduce starts bucket by bucket while the backward goes on
 * (mrl_dist_buckets_ready has this signature). Called on the calling
 * thread, between the layers. NULL: none. */
typedef void (*mrl_grad_hook)(void *ctx, int64_t offset, int64_t count);
void mrl_model_set_grad_hook(mrl_model *m, mrl_grad_hook hook, void *ctx);

/* Gradient windows (sharded gradients, ZeRO-2: mrl_dist_grad_shard): with
 * acquire set, the model has no gradient buffer. Before each part of the
 * backward (the head, final norm and value head; each layer; the embedding;
 * with a tied head the embedding is lent first, with the head) it asks
 * acquire(ctx, offset, count) for a zeroed window holding that range of the
 * parameters' layout (the ranges the grad hook names), writes the part's
 * gradients there, and the grad hook, which must be set, says when the range
 * is final: the window is then the lender's again. A NULL window fails the
 * backward (MRL_ERR_NOMEM naming the range). mrl_model_grads then fails
 * naming the windows. NULL acquire: the one gradient buffer (the default).
 * Where the windows' sums are collectives of the ranks (ZeRO-2), and likewise
 * a sharded model's gathers (ZeRO-3, below), every rank runs the same number
 * of forwards and backwards: a rank with no tokens left passes an empty
 * batch (n_tokens = n_seqs = 0, cu_seqlens = {0}), whose backward adds
 * nothing and still takes its part in the sums (as under expert
 * parallelism). */
typedef float *(*mrl_grad_acquire)(void *ctx, int64_t offset, int64_t count);
void mrl_model_set_grad_windows(mrl_model *m, mrl_grad_acquire acquire, void *ctx);

/* Sharded parameters (ZeRO-3, dist.zero=3). mrl_model_load_dir_shard loads
 * a Hugging Face directory holding only shard `index` of the parameters
 * (mrl_dist_group_shard(n_params, world, shards, index): a rank's shard of a
 * job of `world` ranks sharding over groups of `shards`; shards = world:
 * mrl_dist_shard's); value_head: with a value head
 * whatever config.json says, a critic made from a policy, its
 * score.weight the documented init where the files have none): the files are read by
 * range, and the parameter buffer is reserved address space of which only
 * the shard has memory (and the bf16 copies likewise, mrl_model_set_dtype).
 * Before the forward or backward reads a part of the model (the embedding,
 * each layer, the final norm and head), the part is gathered into place
 * with the gather functions (mrl_model_set_param_gather; the next part's
 * gather starts while this one computes), and its memory is given back once
 * the part is done: a rank holds its shard and a few parts. mrl_model_fetch /
 * mrl_model_drop do the same for any range (saving: every rank calls
 * mrl_model_save_dir_sharded, the rank with `writer` set writes the files).
 * The gathers are collectives: every rank runs the same forwards and
 * backwards. mrl_model_read_shard reads the shard again from a directory (a
 * checkpoint). A sharded model has no whole parameter buffer: reading
 * outside its shard and the parts in use faults; an engine reads a buffer of
 * its own (mrl_engine_attach_params). mrl_model_set_device moves the shard
 * to a GPU, whose regions are CUDA virtual memory. */
typedef mrl_status (*mrl_param_gather)(void *ctx, float *params, int64_t offset, int64_t count);
mrl_status mrl_model_load_dir_shard(const char *dir, int world, int shards, int index, int value_head,
                                    mrl_model **out);
mrl_status mrl_model_read_shard(mrl_model *m, const char *dir);
mrl_status mrl_model_set_param_gather(mrl_model *m, mrl_param_gather start, mrl_param_gather wait, void *ctx,
                                      int writer);
/* Tensor parallel (Megatron's, dist.tp): mrl_model_load_dir_tp loads rank `rank` of `size`'s
 * slices of every layer from a Hugging Face directory: its num_attention_heads / size query
 * heads and num_key_value_heads / size KV heads (the rows of q, k, v and their biases, the
 * columns of o_proj), intermediate_size / size of the MLP (the rows of gate and up, the
 * columns of down; of a sparse layer's every expert likewise, moe_intermediate_size / size),
 * and vocab_size / size rows of the embedding and the head when size divides the vocabulary
 * (else both whole); the norms, a router and a value head whole on every rank. Each slice
 * is read by range from the files. The model's config (mrl_model_get_config) is then the
 * slices' (heads, intermediate size and a divided vocabulary divided by size); the views keep
 * their Hugging Face names with the slices' shapes. The group's collectives are set before the
 * first forward (mrl_model_set_tp_group): allreduce sums n floats over the ranks in place,
 * called by every rank at the same points (the embedding's rows, after o_proj and down_proj in
 * the forward, after the input gradients of q, k, v and gate, up, Qwen3's per-head norm
 * gradients and the head's in the backward); allgather puts every rank's n floats of mine into
 * all (n * size, rank order): the forward gathers the head's softmax statistics of each slice
 * (3 floats a token, never the logits) and every rank combines them alike. So the log-probs,
 * entropy, values and the gradients of the whole parts are the same on every rank and each
 * slice's gradient is the slice of the whole model's. mrl_model_save_dir, which every rank of
 * the group calls, gathers each split tensor and rank 0 writes the whole model (the whole config
 * too). A sparse layer sums each rank's part of the experts' outputs with the same allreduce,
 * and in the backward the picks' weight gradients and the experts' input gradient. size must
 * divide the heads, the KV heads and the intermediate sizes the layers use (errors naming
 * them). The collectives take host buffers (a GPU model's also device ones:
 * mrl_model_set_tp_device_group). */
typedef mrl_status (*mrl_tp_allreduce)(void *ctx, float *buf, int64_t n);
typedef mrl_status (*mrl_tp_allgather)(void *ctx, const float *mine, int64_t n, float *all);
mrl_status mrl_model_load_dir_tp(const char *dir, int rank, int size, int value_head, mrl_model **out);
/* The same, its parameters sharded as mrl_model_load_dir_shard's (ZeRO-3 over the data-parallel
 * ranks that hold the same slices: shard `index` of `shards` over `world` of them); saving
 * (mrl_model_save_dir) then gathers each view over them and over the group, the first group's
 * rank 0 writing. */
mrl_status mrl_model_load_dir_tp_shard(const char *dir, int rank, int size, int world, int shards, int index,
                                       int value_head, mrl_model **out);
mrl_status mrl_model_set_tp_group(mrl_model *m, mrl_tp_allreduce allreduce, mrl_tp_allgather allgather, void *ctx);
/* The tensor-parallel size (1 without), and this rank in *rank; the whole model's config in *whole. */
int mrl_model_tp(const mrl_model *m, int *rank, mrl_model_config *whole);
/* A GPU model's group collectives on device memory (the same meanings as
 * mrl_model_set_tp_group's, with device pointers: moonrl/dist_nccl.h's mrl_nccl_tp_allreduce
 * and mrl_nccl_tp_allgather over an NCCL communicator of the group): the layers' sums and the
 * embedding's, the gathers of the head's statistics and of the engine's logits then stay on
 * the GPU (the statistics are combined on the host, 3 floats a token); without them (NULL) a GPU
 * model copies each buffer to host memory for the host group's collectives and back. Saving
 * uses the host group either way. A CPU model ignores them. */
mrl_status mrl_model_set_tp_device_group(mrl_model *m, mrl_tp_allreduce allreduce, mrl_tp_allgather allgather,
                                         void *ctx);
/* How tensor parallel splits m's view named `name`: 0 whole on every rank, 1 by rows, 2 by
 * columns (0 for any view of a model that is not tensor parallel). */
int mrl_model_tp_split(const mrl_model *m, const char *name);
/* With more ranks than K/V heads (size a multiple of num_key_value_heads), each rank holds one
 * K/V head, the one its query heads read, and size / num_key_value_heads ranks hold each:
 * mrl_model_tp_copies gives that many for k and v (1 for any other view, or without it). Their
 * gradients are then each rank's part: mrl_model_tp_sync_grads sums each K/V head's over the ranks
 * that hold it, once the update's backwards are done (a collective of the group; nothing
 * otherwise), in grads holding [offset, offset + count) of the layout (a ZeRO-2 shard's, the
 * same range on every rank of the group), or with grads NULL in the model's own gradients. */
int mrl_model_tp_copies(const mrl_model *m, const char *name);
mrl_status mrl_model_tp_sync_grads(mrl_model *m, float *grads, int64_t offset, int64_t count);
/* Context parallel (DeepSpeed-Ulysses, dist.cp): the `size` ranks of a group each hold the whole
 * model and run each batch together, rank `rank` taking its contiguous share of the batch's
 * tokens through every part of the model but attention; around attention, an all-to-all turns
 * the tokens' q, k and v into every token's rows of this rank's num_attention_heads / size query
 * heads and num_key_value_heads / size K/V heads (both must divide), and the attention's output
 * back. The forward takes the whole batch on every rank and returns the whole batch's per-token
 * outputs (gathered over the group); the backward takes the whole batch's upstream gradients and
 * leaves this rank's tokens' part of the parameter gradients, to be summed over the group (with
 * the data-parallel sums). alltoallv: `unit` floats a row, this rank sending send_counts[q] rows
 * to rank q (in rank order in send) and receiving recv_counts[q] from each into recv; allgather
 * as mrl_tp_allgather, on host memory (a GPU model's rows go through it). size 1 turns it off.
 * Dense models; a tensor-parallel one splits its
 * slices' heads (the ranks of a context-parallel group hold the same slices). */
typedef mrl_status (*mrl_cp_alltoallv)(void *ctx, const float *send, const int64_t *send_counts, float *recv,
                                       const int64_t *recv_counts, int64_t unit);
mrl_status mrl_model_set_cp_group(mrl_model *m, int rank, int size, mrl_tp_allgather allgather, mrl_cp_alltoallv alltoallv,
                                  void *ctx);
/* A GPU model's group collectives on device memory (the same meanings, device pointers:
 * moonrl/dist_nccl.h's mrl_nccl_tp_allgather and mrl_nccl_cp_alltoallv over an NCCL communicator
 * of the group): the all-to-alls around attention and the per-token outputs' gather then stay on
 * the GPUs (the outputs come to the host once gathered); NULL: through the host. A CPU model
 * ignores them. */
mrl_status mrl_model_set_cp_device_group(mrl_model *m, mrl_tp_allgather allgather, mrl_cp_alltoallv alltoallv,
                                         void *ctx);
/* Sequence parallel (Megatron's, dist.sequence_parallel) for a tensor-parallel model whose
 * vocabulary is split: the residual stream, the norms and their outputs on this rank's share of
 * the batch's tokens (all-gathered before the column-parallel products, the row-parallel ones'
 * partial sums reduce-scattered), so the activations between the products are 1 / size a rank
 * too. The outputs and the loss boundary are unchanged. on 0 turns it off. */
mrl_status mrl_model_set_sequence_parallel(mrl_model *m, int on);
/* The group's reduce-scatter for sequence parallel (ctx: mrl_model_set_tp_group's): buf holds
 * `size` equal pieces of n / size floats; afterwards this rank's piece (piece `rank`) holds the
 * sum over the ranks of theirs, in the allreduce's order (the others are left undefined). Without
 * it, sequence parallel sums whole rows with the allreduce and keeps its own. */
typedef mrl_status (*mrl_tp_reduce_scatter)(void *ctx, float *buf, int64_t n);
mrl_status mrl_model_set_tp_reduce_scatter(mrl_model *m, mrl_tp_reduce_scatter rs);
/* A tensor-parallel rank's slices (a pipeline stage's layers) read again from a Hugging Face
 * directory (a checkpoint's). */
mrl_status mrl_model_read_tp(mrl_model *m, const char *dir);
/* Pipeline parallel (dist.pp): stage `stage` of `stages` holds the whole model's layers
 * [first_layer, first_layer + layers) (its config's num_hidden_layers is then `layers`, its views
 * keep their Hugging Face names), stage 0 the embedding, the last stage the final norm, the head
 * and a value head; a tied head is the last stage's own copy of model.embed_tokens.weight, whose
 * gradient the caller sums with the first stage's before each update (so the copies stay equal).
 * mrl_model_load_dir_stage loads one from a whole model's directory (tp_size > 1: this tensor-
 * parallel rank's slices of it); the file's tensors of other stages are skipped. A mixture of
 * experts: the stage's config numbers its own layers (mlp_only_layers in its numbering,
 * decoder_sparse_step 1; saving writes the whole model's); its load-balancing statistics
 * (mrl_model_pp_aux_size doubles: each expert's picks, its summed router probabilities, the
 * token count) go with the rows: a non-first stage's forward starts from the stage before's
 * (mrl_model_pp_aux_set before it, mrl_model_pp_aux_get after the stage before's), so the last
 * stage's sums are the whole model's, one process's to the bit, and so is its
 * mrl_model_router_aux_loss; a non-last stage's backward takes the last stage's
 * (mrl_model_pp_aux_set before it; after a backward mrl_model_pp_aux_get gives them back, for
 * the stage before), whose counts the loss's gradient needs.
 * A non-first stage's forward reads its input rows [mrl_model_pp_rows, hidden] from x
 * (mrl_model_pp_set_input, borrowed until that forward) instead of the embedding; a non-last
 * stage's forward takes no outputs (all NULL) and leaves its last layer's output rows at
 * mrl_model_pp_output; its backward takes no per-token gradients (all NULL) but the next stage's
 * gradient of that output (mrl_model_pp_set_output_grad), and a non-first stage's leaves the
 * gradient of its input rows at mrl_model_pp_input_grad (both valid until the next forward or
 * backward in the same slot). The rows are the batch's tokens, or this rank's share under
 * context or sequence parallel. x and dy are host memory (a GPU stage copies them over); the
 * output and input gradient are in the model's memory (a GPU's: mrl_device_memcpy them to the
 * host). Activation slots (any model): mrl_model_pp_slots keeps n sets of
 * activations, mrl_model_pp_use_slot(i) makes set i the one the next forward fills and the next
 * backward reads, so that up to n micro-batches are between their forward and their backward
 * (1F1B). mrl_model_pp returns the stage count (1 without) and the stage in *out. */
typedef struct mrl_model_stage {
    int stage, stages;
    int first_layer, layers;
} mrl_model_stage;
mrl_status mrl_model_load_dir_stage(const char *dir, const mrl_model_stage *stage, int tp_rank, int tp_size,
                                    int value_head, mrl_model **out);
/* The same, its parameters sharded as mrl_model_load_dir_shard's (ZeRO-3 over the data-parallel
 * ranks that hold the same stage and slices: shard `index` of `shards` over `world` of them);
 * saving (mrl_model_save_dir, which every rank calls) gathers each view over them, the first
 * pipeline's ranks sending and writing. */
mrl_status mrl_model_load_dir_stage_shard(const char *dir, const mrl_model_stage *stage, int tp_rank, int tp_size,
                                          int world, int shards, int index, int value_head, mrl_model **out);
int mrl_model_pp(const mrl_model *m, mrl_model_stage *out);
/* the whole model's layer count (a stage's config has its own) */
int mrl_model_pp_layers(const mrl_model *m);
int64_t mrl_model_pp_rows(const mrl_model *m, const mrl_batch *b);
mrl_status mrl_model_pp_set_input(mrl_model *m, const float *x);
const float *mrl_model_pp_output(const mrl_model *m);
mrl_status mrl_model_pp_set_output_grad(mrl_model *m, const float *dy);
const float *mrl_model_pp_input_grad(const mrl_model *m);
int64_t mrl_model_pp_aux_size(const mrl_model *m); /* 0: not a mixture of experts' stage */
mrl_status mrl_model_pp_aux_get(const mrl_model *m, double *out);
mrl_status mrl_model_pp_aux_set(mrl_model *m, const double *in);
/* The pipeline's transfers, peers by stage (mrl_dist_pp_send and mrl_dist_pp_recv over its
 * communicator): mrl_model_save_dir, which every rank of every stage calls, sends each stage's
 * tensors (put together over its tensor-parallel group) to the first stage's rank 0, which writes
 * the whole model. send returns at once (its data copied), recv waits. */
typedef mrl_status (*mrl_pp_send)(void *ctx, const float *buf, int64_t n, int peer, int tag);
typedef mrl_status (*mrl_pp_recv)(void *ctx, float *buf, int64_t n, int peer, int tag);
mrl_status mrl_model_set_pp_group(mrl_model *m, mrl_pp_send send, mrl_pp_recv recv, void *ctx);
mrl_status mrl_model_pp_slots(mrl_model *m, int n);
mrl_status mrl_model_pp_use_slot(mrl_model *m, int i);

/* 1 and the shard when the parameters are sharded, else 0 */
int mrl_model_shard(const mrl_model *m, int64_t *offset, int64_t *count);
mrl_status mrl_model_fetch(mrl_model *m, int64_t offset, int64_t count);
/* A sharded model's parameter memory beyond its shard (the parts gathered into place and their
 * bf16 copies) now, and in *peak its most since the last call (which starts the next peak);
 * 0 for a model whose parameters are whole. */
int64_t mrl_model_gathered_bytes(mrl_model *m, int64_t *peak);
void mrl_model_drop(mrl_model *m, int64_t offset, int64_t count);

/* A quantized base (QLoRA): a model whose matrices stay in the GGML blocks of a GGUF file
 * (Q4_0, Q4_1, Q8_0: ggml's type numbers, moonrl/gguf.h), tensors[i] numel parameters from
 * the view it names (the view, or a layer's stacked experts) and its numel / 32
 * blocks in the file's order (host memory, copied; llama's q/k rows in Hugging Face's order).
 * The parameters are a region as a sharded model's: the other tensors have memory for the
 * model's life (the caller writes them, on the CPU, before mrl_model_set_device), a matrix only
 * while a forward, a backward or an engine step uses its layer, its weights dequantized into
 * place then by the kernels' dequant op (bf16: its copies made too). They are the bits of the
 * dequantized fp32 model: the model computes what that one does, holding its blocks, the other
 * tensors and a layer. The base is frozen (mrl_model_set_lora trains adapters over it); reading
 * a matrix outside its use faults: mrl_model_fetch / mrl_model_drop a range to read it.
 * mrl_model_quantized_bytes: the blocks' bytes (0: not a quantized base). */
typedef struct mrl_quant_tensor {
    const char *name; /* the view where it starts (mrl_model_view's names) */
    int64_t numel;    /* the view's, or a layer's experts' (one after the other from the first's) */
    int type;
    const void *blocks;
} mrl_quant_tensor;
mrl_status mrl_model_create_quantized(const mrl_model_config *cfg, const mrl_quant_tensor *tensors, int n,
                                      mrl_model **out);
int64_t mrl_model_quantized_bytes(const mrl_model *m);
/* A frozen base stored in bf16 ("stored in bf16 where model.dtype allows"): a bf16 model with LoRA
 * adapters keeps its layers' matrices (and an untied head) only as the bf16 copies its products
 * read; their fp32 weights are freed, the parameters becoming a region as a quantized base's (the
 * embedding, norms and biases stay fp32). The model computes as before, bit for bit. Its fp32
 * matrices are then its bf16 copies widened (mrl_model_fetch, saving, a merged copy). The dtype
 * stays bf16 and the model on its device from here on. mrl_model_frozen_bf16: 1 when so. */
mrl_status mrl_model_freeze_bf16(mrl_model *m);
int mrl_model_frozen_bf16(const mrl_model *m);
/* Every parameter into host (mrl_model_num_params floats): a copy of the buffer, or a quantized
 * or bf16-frozen base's made whole view by view where it is (mrl_model_fetch), copied and let go. */
mrl_status mrl_model_read_params(mrl_model *m, float *host);

/* The compute copy of a sharded model, for an engine that generates alone
 * (mrl_engine_attach_copy), on the model's device. Of a bf16 model: the bf16
 * copies of the layers' matrices and the head (and with MRL_MODEL_COPY_PANELS
 * their bf16 weight panels, MRL_PANEL16) whole, and in fp32 only the tensors
 * an engine reads in fp32 (the embedding, norms, biases, routers): a region
 * in the parameters' layout with memory there alone, about half the bytes
 * of an fp32 copy. Of an fp32 model, or with MRL_MODEL_COPY_FP32: every
 * tensor in fp32 (a whole copy). mrl_model_copy_refresh fills it from the
 * shards part by part as the forward gathers them (a collective, every rank
 * of the model's gathers calls it), so no rank ever holds the fp32 weights
 * whole outside the copy. The model must outlive the copy. */
typedef struct mrl_model_copy mrl_model_copy;
enum { MRL_MODEL_COPY_PANELS = 1, MRL_MODEL_COPY_FP32 = 2 };
mrl_status mrl_model_copy_create(mrl_model *m, int flags, mrl_model_copy **out);
mrl_status mrl_model_copy_refresh(mrl_model_copy *c);
/* its fp32 tensors (read only there), bf16 copies, panels (NULL: none) and bytes held */
const float *mrl_model_copy_params(const mrl_model_copy *c);
const uint16_t *mrl_model_copy_bf16(const mrl_model_copy *c);
const uint32_t *mrl_model_copy_panels(const mrl_model_copy *c);
int64_t mrl_model_copy_bytes(const mrl_model_copy *c);
void mrl_model_copy_free(mrl_model_copy *c);

/* Gradients = 0 (nothing to do while the buffer does not exist yet). */
void mrl_model_zero_grad(mrl_model *m);

/* ---- mixture of experts (qwen3_moe) ----
 * The load-balancing loss of the last forward, over its sparse layers (0 for
 * a dense model): E * sum_e f_e P_e, f_e the fraction of (token, layer)
 * picks of expert e (k per token and layer), P_e its mean router
 * probability, as Transformers' load_balancing_loss_func with no attention
 * mask (every packed token counts). Each backward adds the gradient of
 * coef * that loss (f_e held constant, as there) to the router gradients;
 * coef defaults to router_aux_loss_coef when output_router_logits, else 0.
 * The term is per backward: a step split into n micro-batches adds n of
 * them (each of its micro-batch's forward), as n HF forward/backward passes
 * with an unscaled aux term would. Under routing replay (mrl_batch.routing) f_e counts the
 * replayed picks, the experts that ran. */
double mrl_model_router_aux_loss(const mrl_model *m);
/* The number of sparse layers (0 for a dense model): the middle dimension of mrl_batch.routing.
 * A pipeline stage's is the whole model's (a batch's routing rows are the whole model's; the
 * stage reads and, in mrl_model_get_routing, writes only its own layers' columns, the others -1). */
int mrl_model_num_moe_layers(const mrl_model *m);
/* The experts the last forward sent each token to in each sparse layer, its own picks or the
 * replayed ones: [n_tokens, num_moe_layers, num_experts_per_tok] into out (cap entries at
 * least that many, else MRL_ERR_INVALID). */
mrl_status mrl_model_get_routing(const mrl_model *m, int16_t *out, int64_t cap);
/* Of the last forward's (token, sparse layer) pairs: how many were replayed (mrl_batch.routing
 * not -1), and of those how many name a different set of experts than the model's own top-k
 * would have (the train / inference routing mismatch that replay removes). */
void mrl_model_routing_replay_stats(const mrl_model *m, int64_t *replayed, int64_t *differ);
void mrl_model_set_router_aux_coef(mrl_model *m, double coef);
double mrl_model_router_aux_coef(const mrl_model *m);
/* Training the multi-token prediction layer (a model with num_nextn_predict_layers 1; weight 0,
 * the default: off, its weights untouched). With weight w > 0 each forward also runs the MTP layer
 * on every token t of a sequence (the final hidden state of t, the embedding of token t + 1) and
 * takes its log-prob of token t + 2; the backward then adds w times the main loss's own weight of
 * position t + 1 (the caller's dlogprobs[t + 1]) on that log-prob, through the MTP layer and into
 * the model (DeepSeek-V3's MTP objective, weighted as the main one: in SFT, w times the mean
 * cross-entropy of the next-but-one tokens). mrl_model_mtp_loss: the mean -log-prob of those
 * tokens, of the last backward's (over the tokens its loss weighs), or of a forward's after (all). The CPU, without tensor, context, pipeline or sequence parallel,
 * sharded parameters, gradient windows, LoRA or shared prompts (MRL_ERR_UNSUPPORTED naming it). */
mrl_status mrl_model_set_mtp_loss(mrl_model *m, double weight);
double mrl_model_mtp_loss(const mrl_model *m);
/* Expert parallelism over the ranks of d (a qwen3_moe model; d NULL: off, every expert here).
 * The experts of every sparse layer are cut over d's ranks in contiguous blocks
 * (mrl_dist_shard of num_experts: mrl_model_expert_range), and the forward and backward of
 * mrl_model_forward / mrl_model_backward send each token a rank routed to the rank of its
 * expert and the result back (all-to-all over d), so a rank runs only its own experts, on
 * every rank's tokens. The results equal one process's on all the ranks' tokens (to rounding:
 * the experts' products see other row counts). Every rank keeps all the weights: the engine,
 * checkpoints and saving are as without; a rank's expert gradients are its own experts' over
 * all ranks' tokens and zero for the rest, so summing the gradients over d's ranks (the
 * data-parallel all-reduce) gives every rank the whole gradient. While it is on, each forward
 * and backward is a collective of d: every rank runs the same sequence of them (one with
 * fewer tokens still takes part, one with none passes an empty batch: n_tokens = n_seqs = 0,
 * cu_seqlens = {0}, then still running the other ranks' rows through its experts), and a failed exchange is the call's error (the
 * communicator's timeout report). The router's load-balancing loss stays per rank. d must
 * outlive the setting (set NULL, or free the model, first). */
mrl_status mrl_model_set_expert_parallel(mrl_model *m, mrl_dist *d);
/* This rank's experts: first, count (all of them without expert parallelism); returns 1 when
 * expert parallelism is on. */
int mrl_model_expert_range(const mrl_model *m, int64_t *first, int64_t *count);

/* ---- precision (docs/architecture.md, "Precision") ----
 * MRL_MODEL_FP32 (the default): every product in fp32, as always.
 * MRL_MODEL_BF16: the parameter buffer stays the fp32 master copy (what
 * the optimizer steps, what is saved), and a bf16 copy of the matrices (the
 * seven of each layer, a sparse layer's experts, and the lm_head, the
 * embedding when tied; the MoE router stays fp32) is what
 * every matrix product reads: x W^T, dX = dY W and dW = dY^T X in each
 * layer and in the head's vocabulary chunks, activations rounded to bf16 on
 * their way in, sums in fp32. Norms, RoPE, attention (its q.k and p.v), the
 * head's softmax / log-prob / entropy, the value head and the losses stay
 * fp32. The generation engine reads the same bf16 copy.
 *
 * The copy is refreshed lazily, in one pass over the matrices, by the next
 * forward or engine step after mrl_model_weights_changed: call it after
 * writing the parameter buffer (an optimizer step, a load, a broadcast).
 * moonrl.optim's AdamW and moonrl.model's params() do (Lua). */
typedef enum mrl_model_precision {
    MRL_MODEL_FP32 = 0,
    MRL_MODEL_BF16 = 1
} mrl_model_precision;
/* Switch precision; bf16 allocates the copy (2 bytes a parameter, category
 * MRL_MEM_PARAMS), fp32 frees it. bf16 works on any CPU, but is fast only
 * where mrl_bf16_products() (moonrl/runtime.h) names a path. */
mrl_status mrl_model_set_dtype(mrl_model *m, int dtype);
int mrl_model_dtype(const mrl_model *m);
/* The parameter buffer was written: the bf16 copy is stale (nothing to do in fp32). */
void mrl_model_weights_changed(mrl_model *m);
/* How many times mrl_model_weights_changed was called: a copy of the weights elsewhere (a remote
 * engine's) taken at generation g is current while this is still g. */
int64_t mrl_model_weights_generation(const mrl_model *m);
/* Convert now if stale (the forward and the engine call it themselves). */
mrl_status mrl_model_refresh_bf16(mrl_model *m);

#ifdef __cplusplus
}
#endif
