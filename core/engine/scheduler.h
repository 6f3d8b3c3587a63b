/* Continuous-batching scheduler over a paged KV cache. Internal to the core.
 *
 * The loop the engine runs (the model plugs in between the two calls):
 *
 *     mrl_sched_add(s, &request, &req_id);          any time, any number
 *     while (mrl_sched_has_unfinished(s)) {
 *         const mrl_sched_batch *b;
 *         mrl_sched_schedule(s, &b);                 pick this step's tokens
 *         // model: for each layer, K/V of b's tokens -> the op table's
 *         //        paged_kv_write (slots b->slot_mapping), its paged_attn
 *         //        (b->block_tables, b->seq_lens, b->query_start), then logits
 *         //        [b->n_logits, vocab] for the tokens b->logits_indices
 *         mrl_sched_update(s, logits);               sample, append, stop
 *     }
 *     mrl_sched_output(s, req_id, j, ...);           tokens and log-probs
 *
 * Each step: first every running sequence gets its next tokens (1 for a
 * decode, a chunk for an unfinished prefill) in admission order, within the
 * step's token budget (max_num_batched_tokens); when the cache cannot give a
 * running sequence its blocks, the most recently admitted running sequence is
 * pre-empted (its blocks freed; it goes back to the front of the waiting
 * queue and is recomputed later from its prompt and the tokens it has
 * generated). Then, if nothing was pre-empted, waiting requests are admitted
 * first-come first-served while the budget, max_num_seqs and the free blocks
 * allow, their prompts prefilled in chunks (after the prefix cache has
 * supplied what it can). A request waits when the cache is short of blocks;
 * nothing is ever an out-of-memory failure.
 *
 * Groups (GRPO): a request with n > 1 samples is prefilled once, as one
 * sequence; when its prompt completes the sequence is forked n - 1 times
 * (sharing every block, the partial last one copied on write) and the n
 * samples draw their first tokens from the same logits row.
 *
 * Sampling: sample j of a request uses the stream
 * mrl_sample_stream_key(seed, step, prompt_index, j) at counter = number of
 * tokens it has generated, so outputs do not depend on the budget, the batch
 * composition or pre-emptions (with a model whose logits do not depend on
 * them: on the CPU, a recomputed prefill and a decode may differ in the last
 * bits of the logits).
 *
 * Stop conditions: max_new_tokens (or max_model_len), an EOS id, a stop token
 * id (the token is kept in the output in all three cases), or the caller's
 * flag (mrl_sched_stop, e.g. when its detokenizer sees a stop string), which
 * finishes the sample at the next schedule.
 *
 * Not thread-safe: one thread drives a scheduler and its cache (the kernels
 * it feeds run in parallel inside). */
#pragma once
#include <stdint.h>
#include "moonrl/engine.h"
#include "engine/kv_cache.h"
#include "kernels.h"

typedef struct mrl_sched mrl_sched;

typedef struct mrl_sched_config {
    int max_num_seqs;           /* running sequences at most (a group counts n) */
    int max_num_batched_tokens; /* tokens per step */
    int max_model_len;          /* prompt + generated tokens at most */
    int vocab_size;
} mrl_sched_config;

typedef struct mrl_sched_request {
    const int32_t *prompt;      /* copied */
    int prompt_len;             /* >= 1 */
    int n;                      /* samples sharing the prompt (>= 1) */
    int max_new_tokens;         /* >= 1 */
    const int32_t *eos_ids;     /* copied */
    int n_eos;
    const int32_t *stop_ids;    /* copied */
    int n_stop;
    mrl_sampling_params params;
    uint64_t seed;              /* stream key: (seed, step, prompt_index, first_sample + j) */
    int64_t step;
    int64_t prompt_index;
    int64_t first_sample;       /* sample j's stream index is first_sample + j */
    int top_logprobs;           /* 0..MRL_TOP_LOGPROBS_MAX most likely tokens kept per generated token */
    int adapter;                /* the LoRA adapter it is computed with (mrl_engine_request) */
    uint64_t kv_salt;           /* what else its K/V depend on (the adapter): 0, or its prefix-cache
                                 * blocks are shared only with requests of the same salt */
} mrl_sched_request;

/* One step's flat batch; the arrays belong to the scheduler and stay valid
 * until the next mrl_sched_update. Sequence i of the step holds the tokens
 * query_start[i] .. query_start[i+1] of the batch. */
typedef struct mrl_sched_batch {
    int n_tokens;
    int n_seqs;
    const int32_t *token_ids;    /* [n_tokens] */
    const int32_t *positions;    /* [n_tokens] */
    const int32_t *seq_index;    /* [n_tokens] which of the step's sequences */
    const int32_t *slot_mapping; /* [n_tokens] KV slot (block * block_size + offset) */
    const int32_t *query_start;  /* [n_seqs + 1] */
    const int32_t *seq_req;      /* [n_seqs] the request (id) and sample of each: what the */
    const int32_t *seq_sample;   /* engine's routing record files each token under */
    const int32_t *seq_lens;     /* [n_seqs] context length once this step's K/V is written */
    const int32_t *block_tables; /* [n_seqs, max_blocks_per_seq], unused entries 0 */
    int max_blocks_per_seq;
    int n_logits;
    const int32_t *logits_indices; /* [n_logits] batch tokens whose logits update() needs, in order */
    int n_prefill_tokens;        /* tokens of prompts (or recomputation) in this step */
    int n_decode_tokens;
} mrl_sched_batch;

typedef struct mrl_sched_stats {
    int64_t steps;
    int64_t prefill_tokens;     /* prompt / recomputed tokens run through the model */
    int64_t decode_tokens;
    int64_t prefix_hit_tokens;  /* prompt tokens the prefix cache supplied */
    int64_t preemptions;
    int64_t forks;
    int64_t generated_tokens;
    int64_t spec_drafts;        /* speculative decoding: draft tokens verified, and accepted */
    int64_t spec_accepted;
    int running, waiting, finished;
} mrl_sched_stats;

/* The scheduler uses (does not own) the cache. */
mrl_status mrl_sched_create(const mrl_sched_config *cfg, mrl_kv_cache *cache, mrl_sched **out);
void mrl_sched_destroy(mrl_sched *s);

/* Queue a request; *req_id numbers requests from 0. Fails (nothing queued)
 * on bad input or a request that could never fit the cache alone. */
mrl_status mrl_sched_add(mrl_sched *s, const mrl_sched_request *r, int *req_id);
/* The adapter request req_id was added with (mrl_sched_request.adapter). */
int mrl_sched_request_adapter(const mrl_sched *s, int req_id);
/* Ask sample j of a request to finish (MRL_FINISH_CALLER) at the next step. */
mrl_status mrl_sched_stop(mrl_sched *s, int req_id, int sample);
int mrl_sched_has_unfinished(const mrl_sched *s);
/* Samples not finished yet (waiting, running or not yet forked). */
int mrl_sched_num_unfinished(const mrl_sched *s);

/* Plan the next step. An empty batch (n_tokens 0) only when nothing is
 * unfinished. Must be followed by mrl_sched_update before the next call. */
mrl_status mrl_sched_schedule(mrl_sched *s, const mrl_sched_batch **batch);
/* logits [batch->n_logits, vocab_size] of the planned step: mark its K/V as
 * computed, sample, append, apply the stop conditions. */
mrl_status mrl_sched_update(mrl_sched *s, const float *logits);

/* The attention arguments of one layer for a step: q/out [n_tokens, Hq,
 * head_dim] (RoPE already applied to q and to the K written with
 * paged_kv_write), the cache's K/V of `layer`, the batch's block
 * tables, lengths and query offsets, scale 1/sqrt(head_dim), no workspace
 * (set args->workspace to reuse one). */
mrl_status mrl_sched_attn_args(const mrl_sched_batch *b, mrl_kv_cache *kv, int layer, int Hq, const float *q,
                               float *out, mrl_paged_attn *args);

/* Sample j of a request so far: generated tokens, their log-probs (under
 * the temperature-scaled, untruncated distribution; logprobs_processed
 * under the sampled one; either may be NULL), count and finish reason. */
mrl_status mrl_sched_output(const mrl_sched *s, int req_id, int sample, const int32_t **tokens,
                            const float **logprobs, const float **logprobs_processed, int *n, int *finish_reason);
/* The weights version each generated token of sample j was sampled with
 * (as many as mrl_sched_output's n): the version set by the last
 * mrl_sched_set_version before its step's update. */
mrl_status mrl_sched_output_versions(const mrl_sched *s, int req_id, int sample, const int64_t **versions);
void mrl_sched_set_version(mrl_sched *s, int64_t version);
/* The request's top_logprobs most likely tokens at each generated position of sample j, best
 * first (ties: the lower id), with their log-probs under the same distribution as the sampled
 * token's logprob: ids and lps [n, top] (n: mrl_sched_output's); top 0: none kept. */
mrl_status mrl_sched_output_top(const mrl_sched *s, int req_id, int sample, const int32_t **ids, const float **lps,
                                int *top);
/* 1 when every sample of the request has finished, 0 when one has not, -1
 * when there is no such request. */
int mrl_sched_request_done(const mrl_sched *s, int req_id);
/* Free the outputs of a finished request (all its samples finished): a
 * scheduler that runs for a whole job (requests added while others run, no
 * reset between them) holds only what is still wanted. Its outputs are gone
 * afterwards (mrl_sched_output fails for it). */
mrl_status mrl_sched_release(mrl_sched *s, int req_id);
/* The op table whose sample op draws the tokens (the model's, so that a
 * reference model samples with the reference kernels); NULL, the default:
 * the fast CPU table. */
void mrl_sched_set_kernels(mrl_sched *s, const mrl_kernels *k);
void mrl_sched_get_stats(const mrl_sched *s, mrl_sched_stats *out);

/* ---- speculative decoding with a draft token (the multi-token prediction layer, engine.c) ----
 * With mrl_sched_set_mtp on, each update also plans the MTP layer's rows (mrl_sched_mtp_plan):
 * every row of the step whose K/V is now computed and whose next token is known, that token
 * as its input; and, for each running sample that may take a draft (greedy or plain-temperature
 * sampling, no top_logprobs, room for the token), the row whose output drafts its next token.
 * mrl_sched_set_draft gives it; the next step then runs that sample's last token and the
 * draft together (two rows, two logits) and its update verifies the draft: greedy, accepted
 * when it is the row's own token; sampling, accepted with the probability the model gives it,
 * else a token of the rest of the distribution drawn (the draft's distribution is a point
 * mass: the standard rule's residual, so every token has the model's distribution), then a
 * token from the second row when it was accepted. The rejected draft's slot is given back. */
typedef struct mrl_sched_mtp {
    mrl_sched_batch batch;     /* token_ids: each row's next token; positions, slot_mapping, query_start,
                                * seq_lens, block_tables of its sample (no logits) */
    const int32_t *src_rows;   /* [batch.n_tokens] each row's row in the step's batch (its hidden state) */
    int n_drafts;
    const int32_t *draft_rows; /* [n_drafts] rows of batch whose output drafts a token */
    const int32_t *draft_seqs; /* [n_drafts] for mrl_sched_set_draft */
} mrl_sched_mtp;
void mrl_sched_set_mtp(mrl_sched *s, int on);
/* The last update's plan (valid until the next schedule). */
const mrl_sched_mtp *mrl_sched_mtp_plan(const mrl_sched *s);
void mrl_sched_set_draft(mrl_sched *s, int seq, int32_t token);
