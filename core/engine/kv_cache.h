/* Paged KV cache: a pool of fixed-size blocks, block tables per sequence,
 * reference counts, fork with copy-on-write, and prefix caching of full
 * blocks across requests with LRU eviction. Internal to the core.
 *
 * Memory: one fp32 allocation (MRL_MEM_KV_CACHE; bf16 when cfg.bf16: half
 * the bytes a block, twice the blocks for a budget) sized from a byte budget.
 * Layout, per layer l (K and V separately):
 *   K of layer l: pool + (2*l)   * num_blocks * block_floats
 *   V of layer l: pool + (2*l+1) * num_blocks * block_floats
 * and inside a layer, block b, kv head h, token slot t, dim d:
 *   K: [b][h][d][t]   (transposed inside the block: the attention kernel
 *                      scores 16 keys with one vector per d)
 *   V: [b][h][t][d]
 * (a latent cache: one array a layer, laid out as V.)
 * block_floats = n_kv_heads * block_size * head_dim, so one block holds
 * block_size tokens of every layer and kv head (kernels/cpu/paged_attention.h
 * reads and writes it).
 * A slot number is block * block_size + offset (what the kernels take).
 *
 * Sequences are small integer ids handed out by the cache. A sequence owns
 * (shares) a list of blocks and knows how many of its tokens have slots.
 * Running out of blocks is never an error in the normal flow: the caller
 * asks mrl_kv_cache_blocks_needed() first and compares with
 * mrl_kv_cache_num_free(); mrl_kv_cache_append() is then guaranteed to
 * succeed (called without checking, it fails with MRL_ERR_NOMEM and changes
 * nothing).
 *
 * Prefix caching: once a block is full and its tokens are known
 * (mrl_kv_cache_commit), it is registered under the hash chain
 * h_i = H(h_{i-1}, tokens of block i) (64-bit, with the block's tokens kept
 * and compared on a hit). A new sequence whose tokens start the same way
 * picks these blocks up with mrl_kv_cache_match_prefix. A full block whose
 * reference count drops to 0 stays cached and evictable; eviction takes the
 * least recently freed first (and, within one freed sequence, its last
 * blocks first).
 *
 * Not thread-safe: one thread (the engine's) drives a cache. */
#pragma once
#include <stdint.h>
#include "kernels.h"
#include "moonrl/device.h"
#include "moonrl/status.h"

typedef struct mrl_kv_cache mrl_kv_cache;

typedef struct mrl_kv_cache_config {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int block_size;          /* tokens per block (16 is vLLM's default) */
    int64_t budget_bytes;    /* the pool gets floor(budget / block_bytes) blocks */
    int prefix_caching;      /* 1: register full blocks for reuse across requests */
    int bf16;                /* 1: the pool holds bf16 (uint16_t) instead of fp32 */
    int latent;              /* 1: one array a layer, not K and V (mrl_kv_cache_v NULL): rows of head_dim
                              * a token, [b][t][d] (n_kv_heads 1): multi-head latent attention's cache,
                              * the normed latent and the turned rope key (kernels.h, mla_paged_attn) */
    /* the table whose memory holds the pool (NULL: the CPU's): a GPU's
     * (k->on_device) puts it in device memory, and copy-on-write copies
     * blocks with its copy slot; the block tables stay on the host */
    const mrl_kernels *k;
    mrl_device device;       /* where that memory is (the table's device) */
} mrl_kv_cache_config;

typedef struct mrl_kv_cache_stats {
    int num_blocks;          /* pool size */
    int free_blocks;         /* allocatable now: never used + cached-but-unreferenced */
    int used_blocks;         /* referenced by at least one sequence */
    int cached_blocks;       /* registered in the prefix cache (referenced or not) */
    int num_seqs;            /* live sequences */
    int64_t prefix_hit_tokens;   /* tokens found in the prefix cache, total */
    int64_t prefix_query_tokens; /* tokens looked up, total */
    int64_t cow_copies;      /* copy-on-write block copies, total */
    int64_t evictions;       /* cached blocks evicted, total */
} mrl_kv_cache_stats;

mrl_status mrl_kv_cache_create(const mrl_kv_cache_config *cfg, mrl_kv_cache **out);
void mrl_kv_cache_destroy(mrl_kv_cache *c);
/* Forget every cached prefix: all blocks free again (their contents stay,
 * nothing is reallocated). Fails while a sequence is live. */
mrl_status mrl_kv_cache_clear(mrl_kv_cache *c);

/* Geometry and the pool (per-layer K and V base pointers, layout above). */
const mrl_kv_cache_config *mrl_kv_cache_get_config(const mrl_kv_cache *c);
int mrl_kv_cache_block_size(const mrl_kv_cache *c);
int mrl_kv_cache_num_blocks(const mrl_kv_cache *c);
int64_t mrl_kv_cache_block_bytes(const mrl_kv_cache *c); /* all layers, K and V */
void *mrl_kv_cache_k(mrl_kv_cache *c, int layer); /* float, or uint16_t when cfg.bf16 */
void *mrl_kv_cache_v(mrl_kv_cache *c, int layer);
/* Blocks that can be allocated now (free list + evictable cached blocks). */
int mrl_kv_cache_num_free(const mrl_kv_cache *c);
void mrl_kv_cache_get_stats(const mrl_kv_cache *c, mrl_kv_cache_stats *out);

/* A new empty sequence. */
mrl_status mrl_kv_cache_seq_new(mrl_kv_cache *c, int *seq);
/* A new sequence sharing every block (and the token count) of `parent`. */
mrl_status mrl_kv_cache_fork(mrl_kv_cache *c, int parent, int *child);
/* Drop the sequence: its blocks lose a reference; full cached blocks whose
 * count reaches 0 become evictable, the others return to the free list. */
mrl_status mrl_kv_cache_seq_free(mrl_kv_cache *c, int seq);

/* For an EMPTY sequence: what else than its tokens its K/V depend on (the LoRA adapter it is
 * computed with), as the start of its blocks' hash chain: blocks are shared only between
 * sequences of the same salt. 0 at mrl_kv_cache_seq_new; a fork keeps its parent's. */
mrl_status mrl_kv_cache_seq_salt(mrl_kv_cache *c, int seq, uint64_t salt);
/* For an EMPTY sequence: attach the longest run of cached full blocks
 * matching tokens[0..n), at most max_blocks of them; *n_cached = tokens
 * covered (a multiple of block_size). Looks only, allocates nothing. */
mrl_status mrl_kv_cache_match_prefix(mrl_kv_cache *c, int seq, const int32_t *tokens, int n,
                                     int max_blocks, int *n_cached);

/* New blocks that appending n tokens to seq would take (including a
 * copy-on-write of a shared partial last block). -1 for a bad seq. */
int mrl_kv_cache_blocks_needed(const mrl_kv_cache *c, int seq, int n);
/* Give the next n tokens of seq their slots (slots[n], may be NULL):
 * allocates blocks, copies a shared partial last block first. */
mrl_status mrl_kv_cache_append(mrl_kv_cache *c, int seq, int n, int32_t *slots);

/* Give back the slots of seq past its first n tokens (a rejected draft's, engine.c): blocks
 * wholly past them return to the pool. n at most the tokens with slots. */
mrl_status mrl_kv_cache_truncate(mrl_kv_cache *c, int seq, int n);

/* Tokens of seq with slots, its block count and its block table (valid
 * until the next call that changes the sequence). */
int mrl_kv_cache_seq_len(const mrl_kv_cache *c, int seq);
int mrl_kv_cache_seq_blocks(const mrl_kv_cache *c, int seq, const int32_t **table);

/* The first n tokens of seq are computed (their K/V written): register the
 * full blocks among them in the prefix cache. tokens[0..n) are the
 * sequence's tokens from position 0. No-op without prefix caching. */
mrl_status mrl_kv_cache_commit(mrl_kv_cache *c, int seq, const int32_t *tokens, int n);
