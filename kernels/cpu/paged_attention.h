/* Paged attention on the CPU: attention of a batch of new query tokens
 * (prefill chunks and single-token decodes mixed) over each sequence's K/V
 * held in the blocks of a paged cache, and the write of new K/V into their
 * slots: the paged_attn, paged_attn_workspace and paged_kv_write ops of the
 * two tables (kernels.h, mrl_paged_attn). Internal.
 *
 * Cache layout of ONE layer (see core/engine/kv_cache.h), fp32, or bf16
 * (kv_bf16: uint16_t, the same layout; bf16 products where the CPU has
 * AVX512-BF16, below, else read widened, exactly; sums in fp32):
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
#include "kernels.h"

/* Plain loops, double accumulation: what the tests trust. Needs no workspace. */
mrl_status mrl_cpu_ref_paged_attn(const mrl_paged_attn *a);
int64_t mrl_cpu_ref_paged_attn_workspace(const mrl_paged_attn *a); /* 0 */
/* The ISA set's path (AVX-512 intrinsics; AVX2 and SSE from plain C loops),
 * parallel over (sequence, kv head, query tile). May fail with
 * MRL_ERR_NOMEM (its work list and score rows) when given no workspace. */
mrl_status mrl_cpu_fast_paged_attn(const mrl_paged_attn *a);
/* Bytes of workspace the fast version needs for this batch (0 for bad
 * shapes); it grows with the number of sequences, Hq/Hk and the longest
 * context. */
int64_t mrl_cpu_fast_paged_attn_workspace(const mrl_paged_attn *a);

/* With a bf16 cache on a CPU with AVX512-BF16 (block_size 16, hd a
 * multiple of 32) the fast version's two products take bf16 operands: q and
 * the softmax weights rounded to bf16, fp32 sums (paged_attention.c; the
 * latent cache's mla_paged_attn too, mla.c). 0 turns that off (the fp32
 * loops over the widened cache), for the tests; _on: whether it is on. */
void mrl_cpu_paged_attn_bf16_products(int on);
int mrl_cpu_paged_attn_bf16_products_on(void);
/* n fp32 values (s) rounded to bf16 pairs over their own front, (s[2i], s[2i+1]) a uint32_t each
 * (the last pair of an odd n padded with 0), as vdpbf16ps takes them; AVX512-BF16 only. */
uint32_t *mrl_cpu_bf16_pairs_in_place(float *s, int n);
/* Each of `rows` rows of n scores (s [rows, n]) as the softmax's weights, in place (fp32,
 * mrl_vexp_sum): the fast paged attentions' (paged_attn's and mla.c's). */
void mrl_cpu_softmax_rows(float *s, int rows, int n);
/* Whether the fast version takes the bf16 products for this batch. */
int mrl_cpu_paged_attn_takes_bf16_products(const mrl_paged_attn *a);

/* K/V of T tokens into their slots: one token after the other (reference),
 * the tokens spread over the cores (fast; slots are distinct, so the
 * writes never meet). */
void mrl_cpu_ref_paged_kv_write(float *k_cache, float *v_cache, const float *k, const float *v,
                                const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size);
void mrl_cpu_fast_paged_kv_write(float *k_cache, float *v_cache, const float *k, const float *v,
                                 const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size);
/* The same into a bf16 cache, each value rounded to nearest even. */
void mrl_cpu_ref_paged_kv_write_bf16(uint16_t *k_cache, uint16_t *v_cache, const float *k, const float *v,
                                     const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size);
void mrl_cpu_fast_paged_kv_write_bf16(uint16_t *k_cache, uint16_t *v_cache, const float *k, const float *v,
                                      const int32_t *slot_mapping, int64_t T, int Hk, int hd, int block_size);
