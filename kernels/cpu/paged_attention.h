/* Paged attention on the CPU: attention of a batch of new query tokens
 * (prefill chunks and single-token decodes mixed) over each sequence's K/V
 * held in the blocks of a paged cache, and the write of new K/V into their
 * slots. Internal to the core (the engine and the model call it).
 *
 * Cache layout of ONE layer (see core/engine/kv_cache.h), fp32:
 *   k_cache: [num_blocks][Hk][hd][block_size]  (K transposed inside a block)
 *   v_cache: [num_blocks][Hk][block_size][hd]
 * slot s = block * block_size + offset.
 *
 * Batch: sequence i's queries are tokens query_start[i] .. query_start[i+1]
 * of q/out; its context after this step holds seq_lens[i] tokens (the new
 * ones included, their K/V already written). Query j of a chunk of n_q
 * tokens sits at position seq_lens[i] - n_q + j and attends to context
 * positions 0..that position (causal). GQA: query head h reads kv head
 * h / (Hq / Hk). Scores are scaled by `scale` (1/sqrt(hd) normally). */
#pragma once
#include <stdint.h>
#include "moonrl/status.h"

typedef struct mrl_paged_attn {
    float *out;                  /* [T, Hq, hd] */
    const float *q;              /* [T, Hq, hd] */
    const float *k_cache;        /* one layer: [num_blocks, Hk, hd, block_size] */
    const float *v_cache;        /* one layer: [num_blocks, Hk, block_size, hd] */
    const int32_t *block_tables; /* [n_seqs, max_blocks_per_seq] */
    const int32_t *seq_lens;     /* [n_seqs] */
    const int32_t *query_start;  /* [n_seqs + 1], query_start[0] = 0 */
    int n_seqs;
    int max_blocks_per_seq;
    int block_size;
    int Hq, Hk, hd;
    float scale;
    /* optional scratch for the fast version (the caller's activation
     * memory, so nothing is allocated per call): at least
     * mrl_paged_attention_workspace_bytes(this) bytes, 64-byte aligned;
     * NULL: the kernel allocates and frees its own. */
    void *workspace;
    int64_t workspace_bytes;
} mrl_paged_attn;

/* Plain loops, double accumulation: what the tests trust. */
mrl_status mrl_paged_attention_ref(const mrl_paged_attn *a);
/* AVX-512 / AVX2 chosen at run time, parallel over (sequence, kv head,
 * query tile) with mrl_parallel_for. Both check the shapes (Hq a multiple
 * of Hk, hd <= 1024, each sequence's queries <= its length <= its blocks'
 * capacity) and fail with MRL_ERR_INVALID; the fast one may fail with
 * MRL_ERR_NOMEM (its work list and score rows). */
mrl_status mrl_paged_attention(const mrl_paged_attn *a);
/* Bytes of workspace mrl_paged_attention needs for this batch (0 for bad
 * shapes); it grows with the number of sequences, Hq/Hk and the longest
 * context. */
int64_t mrl_paged_attention_workspace_bytes(const mrl_paged_attn *a);
/* "avx512", "avx2" or "sse" (plain C loops): the path mrl_paged_attention
 * takes here, the CPU kernels' one choice (mrl_cpu_isa_cap in cpu/isa.h
 * lowers it for tests). */
const char *mrl_paged_attention_isa(void);

/* Write the K/V rows of T new tokens ([T, Hk, hd] each) into their slots
 * (slot_mapping[T]; a negative slot skips the token). */
void mrl_paged_kv_write(float *k_cache, float *v_cache, const float *k, const float *v,
                        const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size);
