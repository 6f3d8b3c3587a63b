/* The generation engine: what Lua calls. A model's inference path (the
 * same layers and kernels as the trainer's forward, with paged attention over
 * a paged KV cache) driven by a continuous-batching scheduler (chunked
 * prefill, GRPO groups prefilled once and forked, pre-emption and
 * recomputation when the cache is short: never an out-of-memory failure).
 *
 *     mrl_engine_config cfg; mrl_engine_config_default(&cfg);
 *     mrl_engine_create(model, &cfg, &e);      reads the model's own parameter
 *                                              buffer: no copy, an optimizer
 *                                              step is seen by the next step
 *     mrl_engine_add_request(e, &req, &id);    any number
 *     mrl_engine_run(e);                       (or mrl_engine_step in a loop)
 *     mrl_engine_get_output(e, id, j, ...);    tokens, log-probs, finish reason
 *     mrl_engine_reset(e);                     forget requests and cached prefixes
 *
 * Asynchronous RL: mrl_engine_run_async(e, threads) generates on a thread of
 * its own while the caller trains, mrl_engine_wait(e) joins it;
 * mrl_engine_swap_params(e, buf, n) switches the weights between steps
 * without dropping the requests in flight (below).
 *
 * Sampling of one row of fp32 logits, in this order (vLLM v1's sampler):
 *   1. temperature: x = logits / temperature; temperature < 1e-5 is greedy
 *      (argmax, the lowest token id among ties; the other knobs are ignored);
 *   2. min-p: keep tokens with p >= min_p * p_max (p = softmax(x));
 *   3. top-k: keep tokens whose x is >= the k-th largest x among those kept
 *      (ties with the k-th value are all kept, as in vLLM and HF);
 *   4. top-p: among those kept, renormalised, keep the smallest set of the
 *      most probable tokens whose mass reaches top_p (sorted by probability,
 *      ties by lower token id first; the token that crosses top_p is kept);
 *   5. draw from the kept tokens with one uniform u from the counter-based
 *      stream: the first token, in token-id order, whose cumulative mass
 *      exceeds u times the kept mass.
 * (HF's generate applies top-k, top-p, then min-p after temperature; the
 * orders differ only when min-p is combined with top-k or top-p.)
 *
 * Two log-probabilities come back for the sampled token:
 *   logprob            under softmax(logits / temperature) over the WHOLE
 *                      vocabulary, no truncation: what the trainer computes
 *                      for the same token at the same temperature, so the
 *                      one RL uses (importance ratios, KL);
 *   logprob_processed  under the distribution actually sampled from (after
 *                      min-p / top-k / top-p, renormalised), vLLM's
 *                      "processed_logprobs".
 * For greedy rows logprob is the log-softmax at temperature 1 and
 * logprob_processed is 0.
 *
 * Randomness: sample j of prompt i at training step s of a run seeded with
 * `seed` has the stream key mrl_sample_stream_key(seed, s, i, j); its n-th
 * generated token uses counter n. The uniform is a hash of (key, counter)
 * (splitmix64 finaliser), so a token never depends on which other requests
 * share the batch, on the batch order or on the thread count. */
#pragma once
#include <stdint.h>
#include "sampling.h"
#include "status.h"
#include "weight_store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the engine ---------------------------------------------------------- */

typedef struct mrl_engine mrl_engine;
typedef struct mrl_model mrl_model;
typedef struct mrl_lora mrl_lora;
typedef struct mrl_model_copy mrl_model_copy;

typedef struct mrl_engine_config {
    int64_t kv_cache_bytes;     /* KV cache pool (all layers, K and V; kv_cache_dtype below) */
    int block_size;             /* tokens per KV block */
    int max_num_seqs;           /* running sequences at most */
    int max_num_batched_tokens; /* tokens per step */
    int max_model_len;          /* prompt + generated tokens at most; 0: the model's max_position_embeddings */
    int prefix_caching;         /* 1: reuse the K/V of prompt prefixes seen before (until mrl_engine_reset) */
    int pack_weights;           /* 1 (default): keep the layers' weight matrices as panels (below) */
    int cuda_graphs;            /* 1 (default): on a GPU, steps of decodes only replay CUDA graphs, one per
                                 * (sequences, block-table width), captured at the second step of each */
    int kv_cache_dtype;         /* MRL_KV_AUTO (default): bf16 when the model's dtype is bf16 as the cache is
                                 * made (at the first request), fp32 otherwise; MRL_KV_FP32; MRL_KV_BF16 */
    int mla_cache;              /* a model with multi-head latent attention (deepseek_v3): MRL_MLA_LATENT
                                 * (default) or MRL_MLA_EXPANDED (below); other models: not read */
    int mtp;                    /* 1: speculative decoding with the model's multi-token prediction layer as
                                 * the draft (below); 0 (default): none */
} mrl_engine_config;

/* Speculative decoding (cfg.mtp; a model with num_nextn_predict_layers 1, moonrl/model.h; the CPU):
 * after each step the MTP layer runs over the step's rows whose next token is known (filling its
 * own layer of the KV cache) and drafts, from the last one, the token after a sample's next one
 * (its most likely); the next step runs that sample's last token and the draft together, and
 * verifies the draft against the model's own distribution: greedy, kept when it is the model's
 * token; sampling (temperature alone: the samples with top-k, top-p, min-p or top_logprobs take
 * no draft), kept with the probability the model gives it, else a token of the rest of the
 * model's distribution drawn, then one more token from the draft's row when it was kept. Every
 * token has the model's distribution and the model's log-prob; greedy outputs are the same tokens
 * as without it. One draft token a step (DeepSeek-V3's one MTP layer). mrl_engine_stats counts
 * the drafts and the accepted ones. */

/* The KV cache of multi-head latent attention (deepseek_v3; docs/models.md):
 *   MRL_MLA_LATENT    each token's normed latent and turned rope key, kv_lora_rank +
 *                     qk_rope_head_dim values a layer (one array, no V); the steps attend in the
 *                     absorbed form: each query head's nope part taken through kv_b_proj's key
 *                     rows into the latent's space, the attention over the latent rows
 *                     (mla_paged_attn), the output through kv_b_proj's value rows
 *   MRL_MLA_EXPANDED  every head's key and value, padded to the attention's head (2 * heads *
 *                     head_dim values a layer): the trainer's form, as the other models' cache */
enum { MRL_MLA_LATENT = 0, MRL_MLA_EXPANDED = 1 };

/* The KV cache's element: a bf16 cache holds each K and V value rounded to
 * bf16 (to nearest even), half the bytes a token (kv_cache_bytes then holds
 * twice the tokens), read exactly widened, scores and sums in fp32: what
 * vLLM and llama.cpp do with a 16-bit cache, and what a transformers model
 * in bfloat16 keeps. */
enum { MRL_KV_AUTO = 0, MRL_KV_FP32 = 1, MRL_KV_BF16 = 2 };

typedef enum mrl_finish_reason {
    MRL_FINISH_NONE = 0,   /* not finished */
    MRL_FINISH_LENGTH = 1, /* max_new_tokens or max_model_len */
    MRL_FINISH_EOS = 2,    /* an EOS id (kept in the output) */
    MRL_FINISH_STOP = 3,   /* a stop token id (kept in the output) */
    MRL_FINISH_CALLER = 4  /* mrl_engine_stop_sample (a stop string, an abort) */
} mrl_finish_reason;

typedef struct mrl_engine_request {
    const int32_t *prompt;   /* [prompt_len] token ids, copied */
    int prompt_len;          /* >= 1 */
    int n;                   /* samples of this prompt (>= 1): prefilled once */
    int max_new_tokens;      /* >= 1 */
    mrl_sampling_params params;
    const int32_t *eos_ids;  /* [n_eos], copied; may be NULL */
    int n_eos;
    const int32_t *stop_ids; /* [n_stop], copied; may be NULL */
    int n_stop;
    uint64_t seed;           /* sample j's stream: mrl_sample_stream_key(seed, step, prompt_index, first_sample + j) */
    int64_t step;
    int64_t prompt_index;
    int64_t first_sample;    /* 0 normally; k when a group's samples k.. come as their own request */
    int top_logprobs;        /* 0..MRL_TOP_LOGPROBS_MAX: keep that many most likely tokens a generated
                              * token (mrl_engine_get_output_top_logprobs); 0: none */
    int adapter;             /* 0: the model as it is (its own LoRA adapters, if on); k >= 1: the LoRA
                              * adapter set in slot k (mrl_engine_set_adapter) over the base instead */
} mrl_engine_request;

/* The most top_logprobs a request may ask for (OpenAI's limit). */
#define MRL_TOP_LOGPROBS_MAX 20

typedef struct mrl_engine_stats {
    int64_t steps;
    int64_t prefill_tokens;    /* prompt and recomputed tokens run through the model */
    int64_t decode_tokens;
    int64_t generated_tokens;
    int64_t prefix_hit_tokens; /* prompt tokens the prefix cache supplied */
    int64_t preemptions;
    int64_t forks;             /* group samples forked from a shared prompt */
    int64_t graph_launches;    /* decode steps run as a CUDA graph (a GPU), graphs captured, and */
    int64_t graph_captures;    /* captures that failed (that shape then runs without a graph) */
    int64_t graph_failures;
    int kv_blocks_total;
    int kv_blocks_used;
    int kv_blocks_free;
    int kv_block_size;
    int64_t kv_bytes_per_token; /* the cache's bytes a token holds, every layer's (a latent cache's: its rows) */
    int64_t spec_drafts;        /* speculative decoding (cfg.mtp): draft tokens verified, and accepted */
    int64_t spec_accepted;
    int running, waiting, finished;
} mrl_engine_stats;

/* Defaults: 256 MiB of KV cache, blocks of 16, 256 sequences, 2048 tokens a
 * step, the model's max_position_embeddings, prefix caching on, weight
 * panels on. */
void mrl_engine_config_default(mrl_engine_config *cfg);
/* An engine over `model` (borrowed: it must outlive the engine), reading the
 * model's parameter buffer (mrl_model_params): in place, or through weight
 * panels packed from it at the start of each round (below). Every size is
 * checked before anything is allocated: block_size in 1..4096, max_num_seqs
 * in 1..2^20, max_num_batched_tokens in 1..2^24, a KV cache and a step's
 * activations (max_num_batched_tokens, and max_num_seqs rows of logits) each
 * at most the machine's physical memory; else MRL_ERR_INVALID naming the
 * field and the numbers. */
mrl_status mrl_engine_create(mrl_model *model, const mrl_engine_config *cfg, mrl_engine **out);
void mrl_engine_free(mrl_engine *e);
/* Weight panels (pack_weights, the default). The layers' seven matrices are
 * copied once per generation round into the layout the decode products
 * read best (kernels.h, MRL_PANEL): a decode step multiplies a few dozen rows
 * by each matrix, and packing the matrix on every step (what OpenBLAS does)
 * costs as much as the arithmetic. They are packed again when a round starts
 * (a request added to an engine with none unfinished) after the model's own
 * weights changed (mrl_model_weights_changed: the contract of its bf16
 * copies, which optimizer steps, loads and Lua's Model:params() keep), every
 * round for another buffer's, and at mrl_engine_reset /
 * mrl_engine_attach_params / mrl_engine_swap_params: weights changed in
 * place while requests are running are not seen before the next round. The
 * copy is one pass over the weights and as much memory again as the layers'
 * matrices (MRL_MEM_PARAMS). A model in bf16 (mrl_model_set_dtype): the
 * panels are bf16 (kernels.h, MRL_PANEL16), of the layers' matrices and the
 * head, and the model keeps them itself beside its bf16 copies, written by
 * the same refresh after an update (mrl_model_refresh_bf16: no copy per
 * round; half the bytes of the copies again); an engine reading another
 * buffer packs its own when the round starts.
 * pack_weights = 0 reads the weights in place on every step instead. */

/* Read the weights from another buffer with the model's layout (n_params
 * floats, view offsets as in mrl_model_view): e.g. one that receives a
 * trainer's weights by broadcast in a separate engine process, or a copy
 * with the model's LoRA adapters merged in (whole weights: the model's own
 * adapters apply only to its own buffer). NULL goes back to the model's own buffer. Resets the engine (mrl_engine_reset):
 * cached prefixes came from other weights. */
mrl_status mrl_engine_attach_params(mrl_engine *e, const float *params, int64_t n_params);
/* Read a sharded bf16 model's compute copy (mrl_model_copy_create): its bf16
 * copies and panels as they are (refreshed by mrl_model_copy_refresh, then a
 * new round), its fp32 tensors where the products read fp32. NULL goes back to
 * the model's own buffer. Resets the engine as attach_params does. */
mrl_status mrl_engine_attach_copy(mrl_engine *e, const mrl_model_copy *c);
/* In-flight weight update (PipelineRL): read the weights from `params` (as
 * in attach_params: n_params floats in the model's layout; NULL: the model's
 * own buffer) for every FOLLOWING step, keeping every request, running
 * sequence and the KV cache as they are, so the K/V already computed under
 * the old weights (and cached prefixes, reused by later requests until
 * mrl_engine_reset) stay. Once it returns, nothing reads the old buffer any
 * more: the caller may overwrite or free it (the weight panels are repacked
 * from the new buffer before the next step). The new buffer is read in place
 * (embeddings, norms, lm_head; every matrix when pack_weights = 0) on every
 * step: it must stay valid, and should not change, while the engine runs. */
mrl_status mrl_engine_swap_params(mrl_engine *e, const float *params, int64_t n_params);
/* Weight versions (asynchronous RL). The engine records, with every token it
 * samples, the version of the weights it read: `version` as set here (0 at
 * creation; kept across reset and attach_params), or one taken from a
 * weight store it follows. */
mrl_status mrl_engine_set_version(mrl_engine *e, int64_t version);
int64_t mrl_engine_version(const mrl_engine *e);
/* Follow a weight store (moonrl/weight_store.h) as `reader` (NULL: stop):
 * before each step with requests in flight, a version published there newer
 * than the engine's is acquired and swapped in (as mrl_engine_swap_params:
 * requests and KV cache kept; PipelineRL's in-flight update), and becomes
 * the engine's version. The store's slot the engine read before is released
 * by that acquire; the reader must not acquire elsewhere meanwhile. Works
 * for a background run too (the store is polled by its thread). */
mrl_status mrl_engine_follow(mrl_engine *e, mrl_weight_store *ws, int reader);
/* The version each generated token of sample j of a request was sampled
 * with (mrl_engine_get_output's n_tokens of them), valid as its tokens. */
mrl_status mrl_engine_get_output_versions(mrl_engine *e, int req_id, int sample, const int64_t **versions);
/* Forget every request, finished or not (an aborted run's too), and every
 * cached prefix: call it when the weights have changed (e.g. after an
 * optimizer step) if prefix caching is on. Request ids restart at 0. */
mrl_status mrl_engine_reset(mrl_engine *e);

/* LoRA adapters served beside the model's weights (multi-LoRA, as vLLM's LoRA serving): slot k
 * (1 .. MRL_ENGINE_MAX_ADAPTERS) holds an adapter set of the model's architecture
 * (mrl_lora_create), read in place on every step (written between rounds like weights); NULL
 * empties the slot. A request naming slot k (mrl_engine_request.adapter) is computed with the base
 * weights and that adapter; one batch mixes requests of any slots (each adapter's two thin
 * products run on its own requests' rows) and their prefix-cache blocks are kept apart by slot.
 * A mixture-of-experts model serves its own adapters only (MRL_ERR_UNSUPPORTED). Not while a
 * background run is in progress; a slot must not be emptied while requests naming it are unfinished. */
#define MRL_ENGINE_MAX_ADAPTERS 64
mrl_status mrl_engine_set_adapter(mrl_engine *e, int slot, const mrl_lora *ad);

/* Queue a request; *req_id identifies it. Bad input (ids outside the
 * vocabulary, bad sampling params, a prompt + max_new_tokens longer than
 * max_model_len or than the whole cache) fails and queues nothing. */
mrl_status mrl_engine_add_request(mrl_engine *e, const mrl_engine_request *req, int *req_id);
/* One step: schedule, run the model over the step's tokens, sample.
 * *n_unfinished (may be NULL) gets the samples not finished yet. */
mrl_status mrl_engine_step(mrl_engine *e, int *n_unfinished);
/* Steps until every request is finished; checks mrl_stop_requested()
 * between steps and returns MRL_ERR_STOPPED (the requests stay queued). */
mrl_status mrl_engine_run(mrl_engine *e);

/* Background generation: mrl_engine_run on a new thread; returns at once.
 * That thread's kernels use `threads` (>= 1) OpenMP threads
 * (mrl_parallel_set_thread_threads), whatever the caller's count is or
 * becomes; the caller's count does not change. The outputs are the ones
 * mrl_engine_run gives (bit for bit: no result depends on a thread count).
 * Until mrl_engine_wait returns, every call that touches the engine's state
 * (add_request, step, run, reset, attach_params, swap_params, get_output,
 * stop_sample, run_async) fails with MRL_ERR_INVALID "engine busy: a
 * background run is in progress (mrl_engine_wait first)";
 * mrl_engine_get_stats and mrl_engine_num_unfinished return the counters as
 * of the run's latest step (a copy the thread publishes, never a racy read);
 * mrl_engine_free waits for the run first. A stop request
 * (mrl_stop_requested) ends it with MRL_ERR_STOPPED, as mrl_engine_run.
 * The model and the buffer the engine reads stay borrowed by the thread:
 * do not free the model, change its kernels, or write that buffer while it
 * runs (to train the model's own buffer meanwhile, swap the engine onto a
 * snapshot first: mrl_engine_swap_params before mrl_engine_run_async).
 * A training forward / backward of the same model on the caller's thread is
 * allowed: this call first extends the model's RoPE tables to
 * max_position_embeddings (max_position_embeddings * head_dim floats, once)
 * so that the forward never regrows the tables the thread reads.
 * Call the engine's functions from one thread (besides the background run). */
mrl_status mrl_engine_run_async(mrl_engine *e, int threads);
/* Join the background run; returns mrl_engine_run's status and, on failure,
 * sets its message as the CALLER's mrl_last_error. MRL_ERR_INVALID when no
 * run was started (or another thread is waiting). */
mrl_status mrl_engine_wait(mrl_engine *e);
/* 1 from mrl_engine_run_async until mrl_engine_wait has joined the run
 * (finished or not), else 0. */
int mrl_engine_running(const mrl_engine *e);
/* Ask a background run to return after the step it is in (MRL_OK, the
 * unfinished requests queued as they are, to go on with mrl_engine_step,
 * mrl_engine_run or another mrl_engine_run_async); returns at once: join it
 * with mrl_engine_wait. The caller's thread can so add requests and read the
 * finished ones of an engine that keeps generating whenever the caller does
 * something else (a rollout worker streaming batches, a server). No effect
 * without a run in progress. */
void mrl_engine_pause(mrl_engine *e);

/* ---- an engine that runs a whole job (no reset between requests) ------ */

/* 1 when every sample of the request has finished, 0 when one has not, -1
 * for no such request or a busy engine. */
int mrl_engine_request_done(mrl_engine *e, int req_id);
/* Free a finished request's outputs (its tokens, log-probs, versions); they
 * cannot be read afterwards. Fails for a request with samples unfinished. */
mrl_status mrl_engine_release(mrl_engine *e, int req_id);
/* Sample j of a request so far: pointers to its generated tokens and their
 * log-probs (under softmax(logits / temperature) over the whole vocabulary:
 * what the trainer's forward gives for the same tokens), valid until the
 * next step or reset; count and finish reason (mrl_finish_reason). Any
 * pointer may be NULL. */
mrl_status mrl_engine_get_output(mrl_engine *e, int req_id, int sample, const int32_t **tokens,
                                 const float **logprobs, int *n_tokens, int *finish_reason);
/* The request's top_logprobs most likely tokens at each generated position of sample j, best
 * first (ties: the lower id), and their log-probs under the distribution of the sampled token's
 * logprob (softmax(logits / temperature) over the whole vocabulary; temperature 1 when greedy):
 * ids and lps [n_tokens, *top], valid as mrl_engine_get_output's; *top = 0 (and NULL arrays)
 * when the request asked for none. */
mrl_status mrl_engine_get_output_top_logprobs(mrl_engine *e, int req_id, int sample, const int32_t **ids,
                                              const float **lps, int *top);
/* ---- routing record (mixture of experts; routing replay, R3) ----
 * With recording on, each request added afterwards keeps, for every token the engine runs
 * through the model (prompt tokens when prefilled, each generated token when it is fed back to
 * produce the next one, and again when a pre-empted sample is recomputed), the experts every
 * sparse layer sent it to: the picks a trainer replays (mrl_batch.routing) so that its forward
 * uses the experts the tokens were sampled with. Positions never run hold -1: prompt tokens a
 * cached prefix supplied and each sample's last token. Costs
 * (prompt + samples x max_new_tokens) x sparse layers x num_experts_per_tok int16 a request,
 * freed with it (reset, release). Off by default; no effect for a dense model. */
mrl_status mrl_engine_record_routing(mrl_engine *e, int on);
/* Sample j's routing so far: *n_positions = prompt_len + its generated tokens, and (out not
 * NULL, cap entries at least n_positions x mrl_model_num_moe_layers x num_experts_per_tok)
 * the rows of mrl_batch.routing for the sequence prompt + generated tokens, position by
 * position. MRL_ERR_INVALID for a request added with recording off. */
mrl_status mrl_engine_get_output_routing(mrl_engine *e, int req_id, int sample, int16_t *out, int64_t cap,
                                         int64_t *n_positions);
/* Finish sample j of a request at the next step (MRL_FINISH_CALLER), e.g.
 * when the caller's detokenizer sees a stop string. */
mrl_status mrl_engine_stop_sample(mrl_engine *e, int req_id, int sample);
/* Samples not finished yet. */
int mrl_engine_num_unfinished(const mrl_engine *e);
void mrl_engine_get_stats(const mrl_engine *e, mrl_engine_stats *out);

#ifdef __cplusplus
}
#endif
