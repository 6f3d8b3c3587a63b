/* KV cache block manager: accounting, fork and copy-on-write, prefix
 * caching with LRU eviction, out of blocks as a status, bad input. */
#include <stdlib.h>
#include "check.h"
#include "moonrl/status.h"
#include "moonrl/mem.h"
#include "engine/kv_cache.h"

#define BS 4

static mrl_kv_cache *make(int n_blocks, int prefix) {
    mrl_kv_cache_config cfg = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 2, .block_size = BS, .prefix_caching = prefix};
    cfg.budget_bytes = (int64_t)n_blocks * 2 * 2 * BS * 2 * 4 + 7; /* a few bytes over: still n_blocks */
    mrl_kv_cache *c = NULL;
    CHECK_OK(mrl_kv_cache_create(&cfg, &c));
    return c;
}

static int n_free(mrl_kv_cache *c) { return mrl_kv_cache_num_free(c); }

static void test_basic(void) {
    mrl_kv_cache *c = make(8, 0);
    CHECK(mrl_kv_cache_num_blocks(c) == 8);
    CHECK(mrl_kv_cache_block_bytes(c) == 2 * 2 * BS * 2 * 4);
    mrl_mem_stats ms;
    mrl_mem_get_stats(&ms);
    CHECK(ms.current[MRL_MEM_KV_CACHE] >= 8 * mrl_kv_cache_block_bytes(c));
    int s, t;
    int32_t slots[32];
    CHECK_OK(mrl_kv_cache_seq_new(c, &s));
    CHECK(mrl_kv_cache_blocks_needed(c, s, 5) == 2);
    CHECK_OK(mrl_kv_cache_append(c, s, 5, slots));
    CHECK(mrl_kv_cache_seq_len(c, s) == 5);
    const int32_t *tab;
    CHECK(mrl_kv_cache_seq_blocks(c, s, &tab) == 2);
    CHECK(slots[0] == tab[0] * BS && slots[4] == tab[1] * BS);
    CHECK(n_free(c) == 6);
    /* fork shares both blocks; appending copies the shared partial block */
    CHECK_OK(mrl_kv_cache_fork(c, s, &t));
    CHECK(n_free(c) == 6);
    CHECK(mrl_kv_cache_seq_len(c, t) == 5);
    float *k1 = mrl_kv_cache_k(c, 1);
    k1[(tab[1] * BS + 0) * 2] = 42.0f; /* token 4, layer 1 */
    int old_last = tab[1];
    CHECK(mrl_kv_cache_blocks_needed(c, t, 1) == 1);
    CHECK(mrl_kv_cache_blocks_needed(c, t, 4) == 2);
    CHECK_OK(mrl_kv_cache_append(c, t, 1, slots));
    const int32_t *tt;
    CHECK(mrl_kv_cache_seq_blocks(c, t, &tt) == 2);
    CHECK(tt[0] == tab[0]);
    CHECK(tt[1] != old_last);
    CHECK(slots[0] == tt[1] * BS + 1);
    CHECK(k1[(tt[1] * BS + 0) * 2] == 42.0f); /* the copy carries the data */
    /* the parent now owns its partial block alone: no copy */
    CHECK(mrl_kv_cache_blocks_needed(c, s, 1) == 0);
    mrl_kv_cache_stats st;
    mrl_kv_cache_get_stats(c, &st);
    CHECK(st.cow_copies == 1 && st.used_blocks == 3 && st.free_blocks == 5 && st.num_seqs == 2);
    /* out of blocks: a status, nothing changes */
    CHECK(mrl_kv_cache_blocks_needed(c, s, 100) > n_free(c));
    CHECK(mrl_kv_cache_append(c, s, 100, NULL) == MRL_ERR_NOMEM);
    CHECK_STR_CONTAINS(mrl_last_error(), "needs");
    CHECK(mrl_kv_cache_seq_len(c, s) == 5 && n_free(c) == 5);
    CHECK_OK(mrl_kv_cache_seq_free(c, s));
    CHECK(n_free(c) == 6); /* block 0 still held by t */
    CHECK_OK(mrl_kv_cache_seq_free(c, t));
    CHECK(n_free(c) == 8);
    /* bad input */
    CHECK(mrl_kv_cache_seq_free(c, t) == MRL_ERR_INVALID);
    CHECK(mrl_kv_cache_append(c, 1000, 1, NULL) == MRL_ERR_INVALID);
    CHECK(mrl_kv_cache_append(c, -1, 1, NULL) == MRL_ERR_INVALID);
    CHECK(mrl_kv_cache_blocks_needed(c, 77, 1) == -1);
    CHECK(mrl_kv_cache_fork(c, 3, &t) == MRL_ERR_INVALID);
    CHECK(mrl_kv_cache_k(c, 2) == NULL);
    mrl_kv_cache_destroy(c);
    mrl_kv_cache_config bad = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 8, .block_size = 16, .budget_bytes = 100};
    mrl_kv_cache *x = (mrl_kv_cache *)1;
    CHECK(mrl_kv_cache_create(&bad, &x) == MRL_ERR_INVALID && x == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), "budget_bytes=100");
    bad.budget_bytes = 1 << 20;
    bad.block_size = 0;
    CHECK(mrl_kv_cache_create(&bad, &x) == MRL_ERR_INVALID);
}

static void test_prefix(void) {
    mrl_kv_cache *c = make(6, 1);
    int32_t sys[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    int a, b, n;
    CHECK_OK(mrl_kv_cache_seq_new(c, &a));
    CHECK_OK(mrl_kv_cache_match_prefix(c, a, sys, 10, 100, &n));
    CHECK(n == 0);
    CHECK_OK(mrl_kv_cache_append(c, a, 10, NULL));
    CHECK_OK(mrl_kv_cache_commit(c, a, sys, 10));
    mrl_kv_cache_stats st;
    mrl_kv_cache_get_stats(c, &st);
    CHECK(st.cached_blocks == 2);
    const int32_t *ta;
    mrl_kv_cache_seq_blocks(c, a, &ta);
    int a0 = ta[0], a1 = ta[1];
    /* a second request with the same first 8 tokens, then different */
    int32_t other[9] = {1, 2, 3, 4, 5, 6, 7, 8, 99};
    CHECK_OK(mrl_kv_cache_seq_new(c, &b));
    CHECK_OK(mrl_kv_cache_match_prefix(c, b, other, 9, 100, &n));
    CHECK(n == 8);
    const int32_t *tb;
    CHECK(mrl_kv_cache_seq_blocks(c, b, &tb) == 2);
    CHECK(tb[0] == a0 && tb[1] == a1);
    CHECK(mrl_kv_cache_seq_len(c, b) == 8);
    CHECK(mrl_kv_cache_blocks_needed(c, b, 1) == 1); /* full shared block: no copy, a new block */
    CHECK_OK(mrl_kv_cache_seq_free(c, b));
    /* a different first block matches nothing; max_blocks caps */
    int32_t diff[8] = {1, 2, 3, 5, 5, 6, 7, 8};
    CHECK_OK(mrl_kv_cache_seq_new(c, &b));
    CHECK_OK(mrl_kv_cache_match_prefix(c, b, diff, 8, 100, &n));
    CHECK(n == 0);
    CHECK_OK(mrl_kv_cache_seq_free(c, b));
    CHECK_OK(mrl_kv_cache_seq_new(c, &b));
    CHECK_OK(mrl_kv_cache_match_prefix(c, b, sys, 10, 1, &n));
    CHECK(n == 4);
    CHECK(mrl_kv_cache_match_prefix(c, b, sys, 10, 1, &n) == MRL_ERR_INVALID); /* not empty */
    CHECK_OK(mrl_kv_cache_seq_free(c, b));
    /* freed: cached blocks stay, evictable, counted free */
    CHECK_OK(mrl_kv_cache_seq_free(c, a));
    CHECK(n_free(c) == 6);
    mrl_kv_cache_get_stats(c, &st);
    CHECK(st.cached_blocks == 2 && st.used_blocks == 0);
    /* a new request still finds them */
    CHECK_OK(mrl_kv_cache_seq_new(c, &b));
    CHECK_OK(mrl_kv_cache_match_prefix(c, b, sys, 10, 100, &n));
    CHECK(n == 8);
    CHECK(n_free(c) == 4);
    CHECK_OK(mrl_kv_cache_seq_free(c, b));
    /* fill the pool: never-used blocks go first, then LRU eviction takes the
     * last block of the freed sequence first */
    CHECK_OK(mrl_kv_cache_seq_new(c, &a));
    CHECK_OK(mrl_kv_cache_append(c, a, 4 * 4, NULL)); /* 4 free blocks */
    mrl_kv_cache_get_stats(c, &st);
    CHECK(st.evictions == 0 && st.cached_blocks == 2);
    CHECK_OK(mrl_kv_cache_append(c, a, 4, NULL));
    mrl_kv_cache_get_stats(c, &st);
    CHECK(st.evictions == 1 && st.cached_blocks == 1);
    CHECK_OK(mrl_kv_cache_seq_new(c, &b));
    CHECK_OK(mrl_kv_cache_match_prefix(c, b, sys, 10, 100, &n));
    CHECK(n == 4); /* the first block survived */
    CHECK_OK(mrl_kv_cache_seq_free(c, b));
    CHECK_OK(mrl_kv_cache_seq_free(c, a));
    mrl_kv_cache_get_stats(c, &st);
    CHECK(st.free_blocks == 6 && st.prefix_hit_tokens == 8 + 4 + 8 + 4);
    /* a fork commits the shared blocks once */
    CHECK_OK(mrl_kv_cache_seq_new(c, &a));
    int32_t toks[12] = {7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9};
    CHECK_OK(mrl_kv_cache_append(c, a, 6, NULL));
    CHECK_OK(mrl_kv_cache_fork(c, a, &b));
    CHECK_OK(mrl_kv_cache_commit(c, a, toks, 6));
    CHECK_OK(mrl_kv_cache_commit(c, b, toks, 6));
    CHECK(mrl_kv_cache_commit(c, b, toks, 7) == MRL_ERR_INVALID);
    mrl_kv_cache_destroy(c); /* with live sequences: frees everything */
}

int main(void) {
    test_basic();
    test_prefix();
    mrl_mem_stats ms;
    mrl_mem_get_stats(&ms);
    CHECK(ms.current[MRL_MEM_KV_CACHE] == 0);
    CHECK_DONE();
}
