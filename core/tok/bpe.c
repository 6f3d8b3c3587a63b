/* The BPE model: one pre-tokenized word -> ids. Symbols form a linked list
 * over an array; a binary heap of candidate merges, ordered by (rank,
 * position), applies the lowest-ranked merge first, leftmost on ties, as
 * tokenizers does. Results are cached per word. */
#include <stdlib.h>
#include <string.h>
#include "tok_internal.h"

#define CACHE_MAX_WORD 256
#define CACHE_MAX_ENTRIES (1 << 19)

typedef struct sym {
    int32_t id, prev, next;
    uint32_t len; /* 0: merged away */
} sym;

typedef struct cand {
    int32_t rank, pos, new_id;
} cand;

static inline int merge_get(const mrl_tok *t, int32_t a, int32_t b, int32_t *rank, int32_t *new_id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = (key * 0x9E3779B97F4A7C15ull >> 20) & t->merge_mask;
    for (;;) {
        uint64_t k = t->merge_keys[i];
        if (k == key) {
            *rank = t->merge_rank[i];
            *new_id = t->merge_new[i];
            return 1;
        }
        if (k == UINT64_MAX) return 0;
        i = (i + 1) & t->merge_mask;
    }
}

static inline int cand_less(cand x, cand y) { return x.rank < y.rank || (x.rank == y.rank && x.pos < y.pos); }

static void heap_push(cand *h, size_t *n, cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(c, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static cand heap_pop(cand *h, size_t *n) {
    cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        if (l >= *n) break;
        m = l;
        if (l + 1 < *n && cand_less(h[l + 1], h[l])) m = l + 1;
        if (!cand_less(h[m], last)) break;
        h[i] = h[m];
        i = m;
    }
    h[i] = last;
    return top;
}

typedef struct word {
    sym *s;
    size_t n, cap;
    int32_t pending_unk; /* an unknown run not yet added (-1: none) */
    uint32_t pending_len;
} word;

static int word_add(word *w, int32_t id, uint32_t len) {
    if (w->n == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 64;
        sym *d = realloc(w->s, cap * sizeof *d);
        if (!d) return 0;
        w->s = d, w->cap = cap;
    }
    w->s[w->n] = (sym){ id, (int32_t)w->n - 1, (int32_t)w->n + 1, len };
    w->n++;
    return 1;
}

/* The initial symbols of a (materialized) word: one per character, with
 * byte fallback and unknown-token handling as in tokenizers. */
static int initial_symbols(const mrl_tok *t, const char *s, size_t len, word *w) {
    w->pending_unk = -1;
    for (size_t i = 0; i < len;) {
        size_t skip;
        int cl = tok_utf8_valid_at((const unsigned char *)s + i, len - i, &skip);
        if (!cl) cl = (int)skip; /* cannot happen: the text was repaired */
        int32_t id = tok_strmap_get(&t->vocab, s + i, (size_t)cl);
        if (id >= 0) {
            if (w->pending_unk >= 0 && !word_add(w, w->pending_unk, w->pending_len)) return 0;
            w->pending_unk = -1;
            if (!word_add(w, id, (uint32_t)cl)) return 0;
            i += cl;
            continue;
        }
        if (t->byte_fallback) {
            int all = 1;
            for (int b = 0; b < cl; b++) all &= t->byte_ids[(unsigned char)s[i + b]] >= 0;
            if (all) {
                for (int b = 0; b < cl; b++)
                    if (!word_add(w, t->byte_ids[(unsigned char)s[i + b]], 1)) return 0;
                i += cl;
                continue;
            }
        }
        if (t->unk_id >= 0) {
            if (w->pending_unk >= 0 && t->fuse_unk) {
                w->pending_len += (uint32_t)cl;
            } else {
                if (w->pending_unk >= 0 && !word_add(w, w->pending_unk, w->pending_len)) return 0;
                w->pending_unk = t->unk_id;
                w->pending_len = (uint32_t)cl;
            }
        }
        i += cl;
    }
    if (w->pending_unk >= 0 && !word_add(w, w->pending_unk, w->pending_len)) return 0;
    return 1;
}

static int merge_all(const mrl_tok *t, word *w) {
    if (w->n < 2) return 1;
    cand *heap = malloc(w->n * 2 * sizeof *heap + 16);
    size_t hn = 0, hcap = w->n * 2;
    if (!heap) return 0;
    sym *s = w->s;
    int32_t rank, nid;
    for (size_t i = 0; i + 1 < w->n; i++)
        if (merge_get(t, s[i].id, s[i + 1].id, &rank, &nid)) heap_push(heap, &hn, (cand){ rank, (int32_t)i, nid });
    while (hn) {
        cand c = heap_pop(heap, &hn);
        sym *a = &s[c.pos];
        if (a->len == 0 || a->next < 0) continue;
        sym *b = &s[a->next];
        int32_t r2, n2;
        if (!merge_get(t, a->id, b->id, &r2, &n2) || n2 != c.new_id || r2 != c.rank) continue;
        a->id = c.new_id;
        a->len += b->len;
        b->len = 0;
        a->next = b->next;
        if (a->next >= 0) s[a->next].prev = c.pos;
        if (hn + 2 > hcap) {
            hcap *= 2;
            cand *d = realloc(heap, hcap * sizeof *d);
            if (!d) {
                free(heap);
                return 0;
            }
            heap = d;
        }
        if (a->prev >= 0 && merge_get(t, s[a->prev].id, a->id, &rank, &nid))
            heap_push(heap, &hn, (cand){ rank, a->prev, nid });
        if (a->next >= 0 && merge_get(t, a->id, s[a->next].id, &rank, &nid))
            heap_push(heap, &hn, (cand){ rank, c.pos, nid });
    }
    free(heap);
    return 1;
}

static int cache_store(tok_cache *c, const char *key, size_t len, const int32_t *ids, size_t n) {
    if (c->entries >= CACHE_MAX_ENTRIES) {
        tok_strmap_free(&c->index);
        c->entries = 0;
        c->pool.len = 0;
    }
    if (!c->index.slots && !tok_strmap_init(&c->index, 4096)) return 0;
    if (c->entries % 4096 == 0) {
        size_t cap = c->entries + 4096;
        uint32_t *off = realloc(c->off, cap * sizeof *off);
        if (!off) return 0;
        c->off = off;
        uint32_t *cnt = realloc(c->n, cap * sizeof *cnt);
        if (!cnt) return 0;
        c->n = cnt;
    }
    c->off[c->entries] = (uint32_t)c->pool.len;
    c->n[c->entries] = (uint32_t)n;
    for (size_t i = 0; i < n; i++)
        if (!tok_ids_push(&c->pool, ids[i])) return 0;
    if (!tok_strmap_put(&c->index, key, len, (int32_t)c->entries)) return 0;
    c->entries++;
    return 1;
}

int tok_work_init(tok_work *w) {
    memset(w, 0, sizeof *w);
    return (w->md = pcre2_match_data_create(1, NULL)) != NULL;
}

void tok_work_free(tok_work *w) {
    if (w->md) pcre2_match_data_free(w->md);
    tok_cache_free(&w->cache);
    memset(w, 0, sizeof *w);
}

void tok_cache_free(tok_cache *c) {
    tok_strmap_free(&c->index);
    free(c->off);
    free(c->n);
    tok_ids_free(&c->pool);
    memset(c, 0, sizeof *c);
}

int tok_bpe_word(const mrl_tok *t, tok_work *wk, const char *s, size_t len, int bytelevel, tok_ids *out) {
    if (len == 0) return 1;
    int cacheable = len <= CACHE_MAX_WORD;
    tok_cache *cache = &wk->cache;
    if (cacheable && cache->entries) {
        int32_t e = tok_strmap_get(&cache->index, s, len);
        if (e >= 0) {
            const int32_t *ids = cache->pool.data + cache->off[e];
            for (uint32_t i = 0; i < cache->n[e]; i++)
                if (!tok_ids_push(out, ids[i])) return 0;
            return 1;
        }
    }
    word w = { 0 };
    char small[CACHE_MAX_WORD * 2 + 8], *mapped = NULL;
    const char *text = s;
    size_t text_len = len;
    int direct = bytelevel && t->byte_level_ids;
    if (bytelevel && (!direct || t->ignore_merges)) {
        /* the word in the byte-level alphabet */
        mapped = len <= CACHE_MAX_WORD ? small : malloc(len * 2 + 1);
        if (!mapped) return 0;
        char *o = mapped;
        for (size_t i = 0; i < len; i++) o += tok_utf8_encode(tok_byte_to_cp[(unsigned char)s[i]], o);
        text = mapped, text_len = (size_t)(o - mapped);
    }
    int ok = 1;
    int32_t whole = t->ignore_merges ? tok_strmap_get(&t->vocab, text, text_len) : -1;
    size_t start = out->len;
    if (whole >= 0) {
        ok = tok_ids_push(out, whole);
    } else {
        if (direct) {
            for (size_t i = 0; ok && i < len; i++) ok = word_add(&w, t->byte_char_id[(unsigned char)s[i]], 1);
        } else {
            ok = initial_symbols(t, text, text_len, &w);
        }
        if (ok && w.n) w.s[w.n - 1].next = -1;
        ok = ok && merge_all(t, &w);
        for (int32_t i = w.n ? 0 : -1; ok && i >= 0; i = w.s[i].next) ok = tok_ids_push(out, w.s[i].id);
    }
    if (ok && cacheable) ok = cache_store(cache, s, len, out->data + start, out->len - start);
    free(w.s);
    if (mapped && mapped != small) free(mapped);
    return ok;
}
