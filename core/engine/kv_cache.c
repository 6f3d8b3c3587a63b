/* Paged KV cache block manager (see kv_cache.h for the layout and rules). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "engine/kv_cache.h"
#include "moonrl/mem.h"
#include "base/error.h"
#include "base/rng.h"
#include "runtime/device_internal.h"

typedef struct kv_seq {
    int live;
    int32_t *blocks; /* block table */
    int n_blocks, cap;
    int len;         /* tokens with slots */
    int n_hashed;    /* leading blocks whose chain hash is known */
    uint64_t last_hash;
    uint64_t salt;   /* the chain's start (mrl_kv_cache_seq_salt): 0, or what else the K/V depend on */
} kv_seq;

struct mrl_kv_cache {
    mrl_kv_cache_config cfg;
    int num_blocks;
    int64_t block_floats; /* elements of one block, one layer, K or V */
    int64_t elem;         /* bytes an element: 4 (fp32) or 2 (bf16) */
    char *pool; /* pool_buf's data: host or device memory (mrl_kv_cache_config.k) */
    mrl_buffer pool_buf;
    /* per block */
    int32_t *ref;
    uint8_t *hashed;
    uint64_t *hash;
    int32_t *tokens;      /* [num_blocks, block_size] when prefix caching */
    int32_t *lru_prev, *lru_next, *bucket_next;
    /* free list (stack) of unreferenced, unhashed blocks */
    int32_t *free_stack;
    int free_top;
    /* evictable (unreferenced, hashed) blocks, least recent at head */
    int lru_head, lru_tail, lru_count;
    int32_t *buckets;
    uint64_t bucket_mask;
    /* sequences */
    kv_seq *seqs;
    int n_seqs_cap, n_live;
    mrl_kv_cache_stats st;
};

static uint64_t block_hash(uint64_t prev, const int32_t *tok, int n) {
    uint64_t h = mrl_mix64(prev ^ 0x6b76636163686521ULL);
    for (int i = 0; i < n; i++) h = mrl_mix64(h ^ (uint32_t)tok[i]);
    return h;
}

/* ---- LRU and hash table ---- */

static void lru_remove(mrl_kv_cache *c, int b) {
    int p = c->lru_prev[b], n = c->lru_next[b];
    if (p >= 0) c->lru_next[p] = n; else c->lru_head = n;
    if (n >= 0) c->lru_prev[n] = p; else c->lru_tail = p;
    c->lru_prev[b] = c->lru_next[b] = -1;
    c->lru_count--;
}

static void lru_push_tail(mrl_kv_cache *c, int b) {
    c->lru_prev[b] = c->lru_tail;
    c->lru_next[b] = -1;
    if (c->lru_tail >= 0) c->lru_next[c->lru_tail] = b; else c->lru_head = b;
    c->lru_tail = b;
    c->lru_count++;
}

static int hash_find(const mrl_kv_cache *c, uint64_t h, const int32_t *tok) {
    int bs = c->cfg.block_size;
    for (int b = c->buckets[h & c->bucket_mask]; b >= 0; b = c->bucket_next[b])
        if (c->hash[b] == h && !memcmp(c->tokens + (int64_t)b * bs, tok, (size_t)bs * sizeof(int32_t)))
            return b;
    return -1;
}

static void hash_insert(mrl_kv_cache *c, int b, uint64_t h, const int32_t *tok) {
    int bs = c->cfg.block_size;
    c->hashed[b] = 1;
    c->hash[b] = h;
    memcpy(c->tokens + (int64_t)b * bs, tok, (size_t)bs * sizeof(int32_t));
    int32_t *head = &c->buckets[h & c->bucket_mask];
    c->bucket_next[b] = *head;
    *head = b;
    c->st.cached_blocks++;
}

static void hash_remove(mrl_kv_cache *c, int b) {
    int32_t *link = &c->buckets[c->hash[b] & c->bucket_mask];
    while (*link >= 0 && *link != b) link = &c->bucket_next[*link];
    if (*link == b) *link = c->bucket_next[b];
    c->bucket_next[b] = -1;
    c->hashed[b] = 0;
    c->st.cached_blocks--;
}

/* ---- blocks ---- */

int mrl_kv_cache_num_free(const mrl_kv_cache *c) { return c ? c->free_top + c->lru_count : 0; }

/* Caller has checked that a block is available. */
static int block_alloc(mrl_kv_cache *c) {
    int b;
    if (c->free_top > 0) {
        b = c->free_stack[--c->free_top];
    } else {
        b = c->lru_head;
        lru_remove(c, b);
        hash_remove(c, b);
        c->st.evictions++;
    }
    c->ref[b] = 1;
    return b;
}

static void block_release(mrl_kv_cache *c, int b) {
    if (--c->ref[b] > 0) return;
    if (c->hashed[b]) lru_push_tail(c, b);
    else c->free_stack[c->free_top++] = b;
}

/* The arrays a layer has: K and V, or a latent cache's one. */
static int arrays(const mrl_kv_cache *c) { return c->cfg.latent ? 1 : 2; }

static void block_copy(mrl_kv_cache *c, int dst, int src) {
    int64_t bb = c->block_floats * c->elem; /* bytes of one block, one layer, K or V */
    const mrl_kernels *k = c->cfg.k ? c->cfg.k : mrl_kernels_cpu_fast();
    for (int kv = 0; kv < arrays(c) * c->cfg.n_layers; kv++) {
        char *base = c->pool + (int64_t)kv * c->num_blocks * bb;
        k->copy(base + dst * bb, base + src * bb, bb);
    }
}

/* ---- create / destroy ---- */

/* Every block free and uncached (the pool's contents are left as they are). */
static void init_blocks(mrl_kv_cache *c) {
    int nb = c->num_blocks;
    for (int i = 0; i < nb; i++) { /* the stack pops block 0 first */
        c->free_stack[i] = nb - 1 - i;
        c->lru_prev[i] = c->lru_next[i] = c->bucket_next[i] = -1;
        c->ref[i] = 0;
        c->hashed[i] = 0;
    }
    c->free_top = nb;
    for (uint64_t i = 0; i <= c->bucket_mask; i++) c->buckets[i] = -1;
    c->lru_head = c->lru_tail = -1;
    c->lru_count = 0;
    c->st.cached_blocks = 0;
}

mrl_status mrl_kv_cache_create(const mrl_kv_cache_config *cfg, mrl_kv_cache **out) {
    if (!cfg || !out) return mrl_set_error(MRL_ERR_INVALID, "kv_cache_create: NULL argument");
    *out = NULL;
    if (cfg->n_layers <= 0 || cfg->n_kv_heads <= 0 || cfg->head_dim <= 0 || cfg->block_size <= 0 ||
        cfg->block_size > 4096)
        return mrl_set_error(MRL_ERR_INVALID,
                             "kv_cache_create: bad geometry (n_layers=%d n_kv_heads=%d head_dim=%d block_size=%d)",
                             cfg->n_layers, cfg->n_kv_heads, cfg->head_dim, cfg->block_size);
    int64_t block_floats = (int64_t)cfg->n_kv_heads * cfg->block_size * cfg->head_dim;
    int64_t elem = cfg->bf16 ? 2 : 4, block_bytes = block_floats * (cfg->latent ? 1 : 2) * cfg->n_layers * elem;
    int64_t nb = cfg->budget_bytes > 0 ? cfg->budget_bytes / block_bytes : 0;
    if (nb < 1)
        return mrl_set_error(MRL_ERR_INVALID,
                             "kv_cache_create: budget_bytes=%lld is below one block (%lld bytes)",
                             (long long)cfg->budget_bytes, (long long)block_bytes);
    if (nb > INT32_MAX / cfg->block_size) nb = INT32_MAX / cfg->block_size; /* slot numbers are int32 */
    mrl_kv_cache *c = calloc(1, sizeof(*c));
    if (!c) return mrl_set_error(MRL_ERR_NOMEM, "kv_cache_create: out of memory");
    c->cfg = *cfg;
    c->num_blocks = (int)nb;
    c->block_floats = block_floats;
    c->elem = elem;
    uint64_t nbuckets = 1;
    while (nbuckets < (uint64_t)nb) nbuckets <<= 1;
    c->bucket_mask = nbuckets - 1;
    if (mrl_buffer_alloc(cfg->device, (size_t)(nb * block_bytes), MRL_MEM_KV_CACHE, &c->pool_buf) == MRL_OK)
        c->pool = c->pool_buf.data;
    if (!c->pool) { /* the allocator's message says how much was asked (and how much there is) */
        char why[512]; /* (mrl_set_error writes the buffer mrl_last_error reads) */
        snprintf(why, sizeof why, "%s", mrl_last_error());
        mrl_status st = mrl_set_error(MRL_ERR_NOMEM, "kv_cache_create: a pool of %lld blocks: %s", (long long)nb, why);
        mrl_kv_cache_destroy(c);
        return st;
    }
    c->ref = mrl_mem_alloc((size_t)nb * sizeof(int32_t), MRL_MEM_OTHER);
    c->hashed = mrl_mem_alloc((size_t)nb, MRL_MEM_OTHER);
    c->hash = mrl_mem_alloc((size_t)nb * sizeof(uint64_t), MRL_MEM_OTHER);
    c->tokens = cfg->prefix_caching ? mrl_mem_alloc((size_t)nb * cfg->block_size * sizeof(int32_t), MRL_MEM_OTHER)
                                    : NULL;
    c->lru_prev = mrl_mem_alloc((size_t)nb * sizeof(int32_t), MRL_MEM_OTHER);
    c->lru_next = mrl_mem_alloc((size_t)nb * sizeof(int32_t), MRL_MEM_OTHER);
    c->bucket_next = mrl_mem_alloc((size_t)nb * sizeof(int32_t), MRL_MEM_OTHER);
    c->free_stack = mrl_mem_alloc((size_t)nb * sizeof(int32_t), MRL_MEM_OTHER);
    c->buckets = mrl_mem_alloc((size_t)nbuckets * sizeof(int32_t), MRL_MEM_OTHER);
    if (!c->pool || !c->ref || !c->hashed || !c->hash || (cfg->prefix_caching && !c->tokens) || !c->lru_prev ||
        !c->lru_next || !c->bucket_next || !c->free_stack || !c->buckets) {
        mrl_kv_cache_destroy(c);
        return mrl_set_error(MRL_ERR_NOMEM, "kv_cache_create: cannot allocate %lld blocks (%lld bytes)",
                             (long long)nb, (long long)(nb * block_bytes));
    }
    init_blocks(c);
    *out = c;
    return MRL_OK;
}

mrl_status mrl_kv_cache_clear(mrl_kv_cache *c) {
    if (!c) return mrl_set_error(MRL_ERR_INVALID, "kv_cache_clear: NULL cache");
    if (c->n_live > 0)
        return mrl_set_error(MRL_ERR_INVALID, "kv_cache_clear: %d sequences are still live", c->n_live);
    init_blocks(c);
    return MRL_OK;
}

void mrl_kv_cache_destroy(mrl_kv_cache *c) {
    if (!c) return;
    for (int i = 0; i < c->n_seqs_cap; i++) free(c->seqs[i].blocks);
    free(c->seqs);
    mrl_buffer_free(&c->pool_buf);
    mrl_mem_free(c->ref);
    mrl_mem_free(c->hashed);
    mrl_mem_free(c->hash);
    mrl_mem_free(c->tokens);
    mrl_mem_free(c->lru_prev);
    mrl_mem_free(c->lru_next);
    mrl_mem_free(c->bucket_next);
    mrl_mem_free(c->free_stack);
    mrl_mem_free(c->buckets);
    free(c);
}

const mrl_kv_cache_config *mrl_kv_cache_get_config(const mrl_kv_cache *c) { return &c->cfg; }
int mrl_kv_cache_block_size(const mrl_kv_cache *c) { return c->cfg.block_size; }
int mrl_kv_cache_num_blocks(const mrl_kv_cache *c) { return c->num_blocks; }
int64_t mrl_kv_cache_block_bytes(const mrl_kv_cache *c) {
    return c->block_floats * arrays(c) * c->cfg.n_layers * c->elem;
}

void *mrl_kv_cache_k(mrl_kv_cache *c, int layer) {
    if (!c || layer < 0 || layer >= c->cfg.n_layers) return NULL;
    return c->pool + (int64_t)(arrays(c) * layer) * c->num_blocks * c->block_floats * c->elem;
}

void *mrl_kv_cache_v(mrl_kv_cache *c, int layer) {
    if (!c || layer < 0 || layer >= c->cfg.n_layers || c->cfg.latent) return NULL;
    return c->pool + (int64_t)(2 * layer + 1) * c->num_blocks * c->block_floats * c->elem;
}

void mrl_kv_cache_get_stats(const mrl_kv_cache *c, mrl_kv_cache_stats *out) {
    *out = c->st;
    out->num_blocks = c->num_blocks;
    out->free_blocks = mrl_kv_cache_num_free(c);
    out->used_blocks = c->num_blocks - out->free_blocks;
    out->num_seqs = c->n_live;
}

/* ---- sequences ---- */

static kv_seq *get_seq(const mrl_kv_cache *c, int seq) {
    if (!c || seq < 0 || seq >= c->n_seqs_cap || !c->seqs[seq].live) return NULL;
    return &c->seqs[seq];
}

static mrl_status bad_seq(const char *fn, int seq) {
    return mrl_set_error(MRL_ERR_INVALID, "%s: no live sequence %d", fn, seq);
}

static mrl_status seq_reserve(kv_seq *s, int n_blocks) {
    if (n_blocks <= s->cap) return MRL_OK;
    int cap = s->cap ? s->cap : 8;
    while (cap < n_blocks) cap *= 2;
    int32_t *b = realloc(s->blocks, (size_t)cap * sizeof(int32_t));
    if (!b) return mrl_set_error(MRL_ERR_NOMEM, "kv_cache: cannot grow a block table to %d blocks", cap);
    s->blocks = b;
    s->cap = cap;
    return MRL_OK;
}

mrl_status mrl_kv_cache_seq_new(mrl_kv_cache *c, int *seq) {
    if (!c || !seq) return mrl_set_error(MRL_ERR_INVALID, "kv_cache_seq_new: NULL argument");
    int id = -1;
    for (int i = 0; i < c->n_seqs_cap; i++)
        if (!c->seqs[i].live) { id = i; break; }
    if (id < 0) {
        int cap = c->n_seqs_cap ? 2 * c->n_seqs_cap : 16;
        kv_seq *s = realloc(c->seqs, (size_t)cap * sizeof(kv_seq));
        if (!s) return mrl_set_error(MRL_ERR_NOMEM, "kv_cache_seq_new: out of memory");
        memset(s + c->n_seqs_cap, 0, (size_t)(cap - c->n_seqs_cap) * sizeof(kv_seq));
        id = c->n_seqs_cap;
        c->seqs = s;
        c->n_seqs_cap = cap;
    }
    kv_seq *s = &c->seqs[id];
    s->live = 1;
    s->n_blocks = s->len = s->n_hashed = 0;
    s->last_hash = s->salt = 0;
    c->n_live++;
    *seq = id;
    return MRL_OK;
}

mrl_status mrl_kv_cache_fork(mrl_kv_cache *c, int parent, int *child) {
    if (!get_seq(c, parent)) return bad_seq("kv_cache_fork", parent);
    if (!child) return mrl_set_error(MRL_ERR_INVALID, "kv_cache_fork: NULL child");
    int id;
    mrl_status st = mrl_kv_cache_seq_new(c, &id);
    if (st) return st;
    kv_seq *p = &c->seqs[parent], *s = &c->seqs[id]; /* after a possible realloc */
    if ((st = seq_reserve(s, p->n_blocks))) {
        mrl_kv_cache_seq_free(c, id);
        return st;
    }
    memcpy(s->blocks, p->blocks, (size_t)p->n_blocks * sizeof(int32_t));
    for (int i = 0; i < p->n_blocks; i++) c->ref[p->blocks[i]]++;
    s->n_blocks = p->n_blocks;
    s->len = p->len;
    s->n_hashed = p->n_hashed;
    s->last_hash = p->last_hash;
    s->salt = p->salt;
    *child = id;
    return MRL_OK;
}

mrl_status mrl_kv_cache_seq_free(mrl_kv_cache *c, int seq) {
    kv_seq *s = get_seq(c, seq);
    if (!s) return bad_seq("kv_cache_seq_free", seq);
    /* last blocks first: they end up nearer the LRU head, evicted first */
    for (int i = s->n_blocks - 1; i >= 0; i--) block_release(c, s->blocks[i]);
    s->n_blocks = s->len = s->n_hashed = 0;
    s->live = 0;
    c->n_live--;
    return MRL_OK;
}

mrl_status mrl_kv_cache_seq_salt(mrl_kv_cache *c, int seq, uint64_t salt) {
    kv_seq *s = get_seq(c, seq);
    if (!s) return bad_seq("kv_cache_seq_salt", seq);
    if (s->n_blocks || s->len)
        return mrl_set_error(MRL_ERR_INVALID, "kv_cache_seq_salt: sequence %d is not empty", seq);
    s->salt = s->last_hash = salt;
    return MRL_OK;
}

mrl_status mrl_kv_cache_match_prefix(mrl_kv_cache *c, int seq, const int32_t *tokens, int n, int max_blocks,
                                     int *n_cached) {
    kv_seq *s = get_seq(c, seq);
    if (!s) return bad_seq("kv_cache_match_prefix", seq);
    if (!n_cached || n < 0 || (n > 0 && !tokens))
        return mrl_set_error(MRL_ERR_INVALID, "kv_cache_match_prefix: bad arguments (n=%d)", n);
    if (s->n_blocks || s->len)
        return mrl_set_error(MRL_ERR_INVALID, "kv_cache_match_prefix: sequence %d is not empty", seq);
    *n_cached = 0;
    if (!c->cfg.prefix_caching) return MRL_OK;
    int bs = c->cfg.block_size, full = n / bs;
    if (max_blocks < full) full = max_blocks < 0 ? 0 : max_blocks;
    mrl_status st = seq_reserve(s, full);
    if (st) return st;
    uint64_t h = s->salt;
    int i = 0;
    for (; i < full; i++) {
        uint64_t hi = block_hash(h, tokens + (int64_t)i * bs, bs);
        int b = hash_find(c, hi, tokens + (int64_t)i * bs);
        if (b < 0) break;
        if (c->ref[b] == 0) lru_remove(c, b);
        c->ref[b]++;
        s->blocks[i] = b;
        h = hi;
    }
    s->n_blocks = s->n_hashed = i;
    s->len = i * bs;
    s->last_hash = h;
    c->st.prefix_hit_tokens += (int64_t)i * bs;
    c->st.prefix_query_tokens += n;
    *n_cached = i * bs;
    return MRL_OK;
}

int mrl_kv_cache_blocks_needed(const mrl_kv_cache *c, int seq, int n) {
    const kv_seq *s = get_seq(c, seq);
    if (!s || n < 0) return -1;
    if (n == 0) return 0;
    int bs = c->cfg.block_size;
    int64_t want = ((int64_t)s->len + n + bs - 1) / bs;
    int64_t need = want > s->n_blocks ? want - s->n_blocks : 0;
    if (s->len % bs && c->ref[s->blocks[s->n_blocks - 1]] > 1) need++;
    return need > (1 << 30) ? -1 : (int)need;
}

mrl_status mrl_kv_cache_append(mrl_kv_cache *c, int seq, int n, int32_t *slots) {
    kv_seq *s = get_seq(c, seq);
    if (!s) return bad_seq("kv_cache_append", seq);
    if (n < 0) return mrl_set_error(MRL_ERR_INVALID, "kv_cache_append: n=%d", n);
    int need = mrl_kv_cache_blocks_needed(c, seq, n);
    if (need < 0 || need > mrl_kv_cache_num_free(c))
        return mrl_set_error(MRL_ERR_NOMEM, "kv_cache_append: sequence %d needs %d blocks for %d tokens, %d free",
                             seq, need, n, mrl_kv_cache_num_free(c));
    if (n == 0) return MRL_OK;
    int bs = c->cfg.block_size;
    int want = (int)(((int64_t)s->len + n + bs - 1) / bs);
    mrl_status st = seq_reserve(s, want);
    if (st) return st;
    if (s->len % bs) {
        int last = s->blocks[s->n_blocks - 1];
        if (c->ref[last] > 1) { /* copy-on-write of the shared partial block */
            int b = block_alloc(c);
            block_copy(c, b, last);
            block_release(c, last);
            s->blocks[s->n_blocks - 1] = b;
            c->st.cow_copies++;
        }
    }
    while (s->n_blocks < want) s->blocks[s->n_blocks++] = block_alloc(c);
    if (slots)
        for (int i = 0; i < n; i++) {
            int pos = s->len + i;
            slots[i] = s->blocks[pos / bs] * bs + pos % bs;
        }
    s->len += n;
    return MRL_OK;
}

mrl_status mrl_kv_cache_truncate(mrl_kv_cache *c, int seq, int n) {
    kv_seq *s = get_seq(c, seq);
    if (!s) return bad_seq("kv_cache_truncate", seq);
    if (n < 0 || n > s->len) return mrl_set_error(MRL_ERR_INVALID, "kv_cache_truncate: %d tokens of %d", n, s->len);
    int bs = c->cfg.block_size, keep = (n + bs - 1) / bs;
    while (s->n_blocks > keep) block_release(c, s->blocks[--s->n_blocks]);
    s->len = n;
    return MRL_OK;
}

int mrl_kv_cache_seq_len(const mrl_kv_cache *c, int seq) {
    const kv_seq *s = get_seq(c, seq);
    return s ? s->len : -1;
}

int mrl_kv_cache_seq_blocks(const mrl_kv_cache *c, int seq, const int32_t **table) {
    const kv_seq *s = get_seq(c, seq);
    if (!s) return -1;
    if (table) *table = s->blocks;
    return s->n_blocks;
}

mrl_status mrl_kv_cache_commit(mrl_kv_cache *c, int seq, const int32_t *tokens, int n) {
    kv_seq *s = get_seq(c, seq);
    if (!s) return bad_seq("kv_cache_commit", seq);
    if (n < 0 || n > s->len || (n > 0 && !tokens))
        return mrl_set_error(MRL_ERR_INVALID, "kv_cache_commit: n=%d for sequence %d of %d tokens", n, seq, s->len);
    if (!c->cfg.prefix_caching) return MRL_OK;
    int bs = c->cfg.block_size, full = n / bs;
    for (int i = s->n_hashed; i < full; i++) {
        const int32_t *tok = tokens + (int64_t)i * bs;
        uint64_t h = block_hash(s->last_hash, tok, bs);
        int b = s->blocks[i];
        /* a block shared with a fork is registered once; an identical block
         * computed by another request stays private */
        if (!c->hashed[b] && hash_find(c, h, tok) < 0) hash_insert(c, b, h, tok);
        s->last_hash = h;
        s->n_hashed = i + 1;
    }
    return MRL_OK;
}
