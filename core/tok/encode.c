/* The tokenizer handle and encoding: added tokens are matched first (those
 * with normalized=false on the raw text, the others on the normalized text),
 * the text between them is normalized, pre-tokenized and BPE-encoded, and
 * the post-processor adds BOS/EOS when asked. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "base/parallel.h"
#include "tok_internal.h"
#include "base/error.h"

/* Word characters, for single_word tokens: as Unicode \w in the Rust regex
 * crate (alphabetic, marks, decimal digits, connector punctuation, joiners). */
static const char WORD_CHAR[] = "[" TOK_WORD_CLASS "]";

static const tok_added *g_sort_added;

static int cmp_added(const void *x, const void *y) {
    const tok_added *a = &g_sort_added[*(const int32_t *)x], *b = &g_sort_added[*(const int32_t *)y];
    unsigned char fa = (unsigned char)a->pattern[0], fb = (unsigned char)b->pattern[0];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (a->pattern_len != b->pattern_len) return a->pattern_len > b->pattern_len ? -1 : 1;
    return *(const int32_t *)x - *(const int32_t *)y;
}

static pthread_mutex_t sort_lock = PTHREAD_MUTEX_INITIALIZER;

/* Tokens with normalized=true are matched in their normalized form, as the
 * text they are found in is normalized. */
static mrl_status index_added(mrl_tok *t) {
    for (int i = 0; i < t->n_added; i++) {
        tok_added *a = &t->added[i];
        a->pattern = a->content, a->pattern_len = a->len;
        if (!a->normalized) continue;
        tok_arena arena = { 0 };
        const char *s;
        size_t n;
        char *p = NULL;
        if (tok_normalize(t, a->content, a->len, &arena, &s, &n) && n > 0 && (p = malloc(n + 1))) {
            memcpy(p, s, n);
            p[n] = 0;
        }
        tok_arena_free(&arena);
        if (!p) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
        a->pattern = p, a->pattern_len = n;
    }
    /* skip_special leaves out an id when the string it decodes from is the
     * content of a special token: as tokenizers does, which misses special
     * tokens that the normalizer changes (Llama 2's "<s>" stays). */
    for (int i = 0; i < t->n_added; i++) {
        tok_added *a = &t->added[i];
        int32_t k = tok_strmap_get(&t->added_index, a->pattern, a->pattern_len);
        if (a->special && k >= 0 && t->added[k].special) t->skip_special[a->id] = 1;
    }
    t->added_sorted = malloc((t->n_added + 1) * sizeof *t->added_sorted);
    if (!t->added_sorted) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    for (int i = 0; i < t->n_added; i++) t->added_sorted[i] = i;
    pthread_mutex_lock(&sort_lock);
    g_sort_added = t->added;
    qsort(t->added_sorted, t->n_added, sizeof *t->added_sorted, cmp_added);
    pthread_mutex_unlock(&sort_lock);
    int j = 0;
    for (int b = 0; b <= 256; b++) {
        while (j < t->n_added && (unsigned char)t->added[t->added_sorted[j]].pattern[0] < b) j++;
        t->added_bucket[b] = j;
    }
    t->added_bucket[256] = t->n_added;
    return MRL_OK;
}

mrl_status mrl_tok_load(const char *path, mrl_tok **out) {
    *out = NULL;
    if (!path) return mrl_set_error(MRL_ERR_INVALID, "mrl_tok_load: path is NULL");
    if (strlen(path) + sizeof "/tokenizer.json" > sizeof ((mrl_tok *)0)->path)
        return mrl_set_error(MRL_ERR_INVALID, "mrl_tok_load: path too long (%zu bytes): %.80s...", strlen(path), path);
    mrl_tok *t = calloc(1, sizeof *t);
    if (!t) return mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_load: out of memory");
    struct stat st_buf;
    if (stat(path, &st_buf) == 0 && S_ISDIR(st_buf.st_mode))
        snprintf(t->path, sizeof t->path, "%s/tokenizer.json", path);
    else
        snprintf(t->path, sizeof t->path, "%s", path);
    tok_byte_level_init();
    pthread_mutex_init(&t->lock, NULL);
    mrl_status st = tok_load_json(t, t->path);
    if (!st) st = index_added(t);
    if (!st && !tok_work_init(&t->work)) st = mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    int err;
    PCRE2_SIZE off;
    if (!st && !(t->word_re = pcre2_compile((PCRE2_SPTR)WORD_CHAR, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                                            &off, NULL)))
        st = mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    if (st) {
        mrl_tok_free(t);
        return st;
    }
    *out = t;
    return MRL_OK;
}

void mrl_tok_free(mrl_tok *t) {
    if (!t) return;
    tok_free_tables(t);
    free(t->added_sorted);
    tok_work_free(&t->work);
    if (t->word_re) pcre2_code_free(t->word_re);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

/* ---- added tokens ---- */

typedef struct seg {
    size_t start, end;
    int32_t id; /* an added token, or -1 for text */
} seg;

typedef struct segs {
    seg *data;
    size_t len, cap;
} segs;

static int segs_push(segs *v, size_t start, size_t end, int32_t id) {
    if (end <= start) return 1;
    if (v->len == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 16;
        seg *d = realloc(v->data, cap * sizeof *d);
        if (!d) return 0;
        v->data = d, v->cap = cap;
    }
    v->data[v->len++] = (seg){ start, end, id };
    return 1;
}

/* Is the character at s[at] a word character (WORD_CHAR)? */

static int word_char_at(const mrl_tok *t, tok_work *w, const char *s, size_t len, size_t at) {
    return pcre2_match(t->word_re, (PCRE2_SPTR)s, len, at, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, w->md, NULL) >= 0;
}

static uint32_t cp_before(const char *s, size_t at) {
    size_t i = at;
    while (i > 0 && ((unsigned char)s[i - 1] & 0xC0) == 0x80) i--;
    if (i > 0) i--;
    uint32_t cp;
    tok_utf8_decode(s + i, &cp);
    return cp;
}

static int match_ok(const tok_added *a, int want_normalized, int parse_special) {
    return a->normalized == want_normalized && (parse_special || !a->special);
}

/* Split s into text and the added tokens found in it. */
static int split_added(const mrl_tok *t, tok_work *w, const char *s, size_t len, int want_normalized, int parse_special,
                       segs *out) {
    size_t last = 0, i = 0;
    out->len = 0;
    if (t->n_added == 0) return segs_push(out, 0, len, -1);
    while (i < len) {
        unsigned char c = (unsigned char)s[i];
        int lo = t->added_bucket[c], hi = t->added_bucket[c + 1];
        const tok_added *hit = NULL;
        for (int k = lo; k < hi; k++) {
            const tok_added *a = &t->added[t->added_sorted[k]];
            if (a->pattern_len <= len - i && match_ok(a, want_normalized, parse_special) &&
                memcmp(s + i, a->pattern, a->pattern_len) == 0) {
                hit = a;
                break;
            }
        }
        if (!hit) {
            i++;
            continue;
        }
        size_t ms = i, me = i + hit->pattern_len;
        i = me;
        if (hit->single_word) {
            size_t before = ms ? ms - 1 : 0; /* the start of the character before the match */
            while (before > 0 && ((unsigned char)s[before] & 0xC0) == 0x80) before--;
            if (ms > 0 && word_char_at(t, w, s, len, before)) continue;
            if (me < len && word_char_at(t, w, s, len, me)) continue;
        }
        if (hit->lstrip)
            while (ms > last) {
                uint32_t cp = cp_before(s, ms);
                if (!tok_is_whitespace(cp)) break;
                ms -= (size_t)(cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4);
            }
        if (hit->rstrip)
            while (me < len) {
                uint32_t cp;
                int n = tok_utf8_decode(s + me, &cp);
                if (!tok_is_whitespace(cp)) break;
                me += (size_t)n;
            }
        if (!segs_push(out, last, ms, -1) || !segs_push(out, ms, me, hit->id)) return 0;
        last = i = me;
    }
    return segs_push(out, last, len, -1);
}

/* ---- encoding ---- */

static int encode_text(const mrl_tok *t, tok_work *w, const char *s, size_t len, int first, int parse_special,
                       tok_arena *a, tok_pieces *pieces, tok_ids *ids) {
    const char *ns;
    size_t nlen;
    segs inner = { 0 };
    int ok = tok_normalize(t, s, len, a, &ns, &nlen) && split_added(t, w, ns, nlen, 1, parse_special, &inner);
    for (size_t k = 0; ok && k < inner.len; k++) {
        seg g = inner.data[k];
        if (g.id >= 0) {
            ok = tok_ids_push(ids, g.id);
            continue;
        }
        pieces->len = 0;
        ok = tok_pretokenize(t, w, ns + g.start, g.end - g.start, first && g.start == 0, a, pieces);
        for (size_t p = 0; ok && p < pieces->len; p++)
            ok = tok_bpe_word(t, w, pieces->data[p].s, pieces->data[p].len, pieces->data[p].bytelevel, ids);
    }
    free(inner.data);
    return ok;
}

static mrl_status encode_one(const mrl_tok *t, tok_work *w, const char *text, size_t len, int flags, tok_ids *ids) {
    tok_buf fixed = { 0 };
    if (!tok_utf8_is_valid(text, len)) {
        if (!tok_utf8_lossy(text, len, &fixed)) return mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_encode: out of memory");
        text = fixed.data, len = fixed.len;
    }
    int parse_special = (flags & MRL_TOK_PARSE_SPECIAL) != 0;
    segs outer = { 0 };
    tok_arena arena = { 0 };
    tok_pieces pieces = { 0 };
    int ok = 1;
    if (flags & MRL_TOK_ADD_SPECIAL)
        for (int i = 0; ok && i < t->n_post_prefix; i++) ok = tok_ids_push(ids, t->post_prefix[i]);
    ok = ok && split_added(t, w, text, len, 0, parse_special, &outer);
    for (size_t k = 0; ok && k < outer.len; k++) {
        seg g = outer.data[k];
        if (g.id >= 0) ok = tok_ids_push(ids, g.id);
        else ok = encode_text(t, w, text + g.start, g.end - g.start, g.start == 0, parse_special, &arena, &pieces, ids);
    }
    if (flags & MRL_TOK_ADD_SPECIAL)
        for (int i = 0; ok && i < t->n_post_suffix; i++) ok = tok_ids_push(ids, t->post_suffix[i]);
    free(outer.data);
    free(pieces.data);
    tok_arena_free(&arena);
    tok_buf_free(&fixed);
    return ok ? MRL_OK : mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_encode: out of memory");
}

mrl_status mrl_tok_encode(mrl_tok *t, const char *text, size_t len, int flags, int32_t *ids, size_t cap, size_t *n) {
    if (n) *n = 0;
    if (!t || !n || (!text && len)) return mrl_set_error(MRL_ERR_INVALID, "mrl_tok_encode: NULL argument");
    tok_ids out = { 0 };
    pthread_mutex_lock(&t->lock);
    mrl_status st = encode_one(t, &t->work, text ? text : "", len, flags, &out);
    pthread_mutex_unlock(&t->lock);
    if (!st) {
        *n = out.len;
        if (ids == NULL && cap == 0) {
            /* a size query */
        } else if (out.len > cap || !ids) {
            st = mrl_set_error(MRL_ERR_INVALID, "mrl_tok_encode: the buffer holds %zu ids, the text needs %zu", cap,
                               out.len);
        } else if (out.len) {
            memcpy(ids, out.data, out.len * sizeof *ids);
        }
    }
    tok_ids_free(&out);
    return st;
}

/* ---- lookups ---- */

int32_t mrl_tok_vocab_size(const mrl_tok *t) { return t ? t->distinct_ids : 0; }

int32_t mrl_tok_token_to_id(const mrl_tok *t, const char *token, size_t len) {
    if (!t || !token) return -1;
    int32_t a = tok_strmap_get(&t->added_index, token, len);
    if (a >= 0) return t->added[a].id;
    return tok_strmap_get(&t->vocab, token, len);
}

const char *mrl_tok_id_to_token(const mrl_tok *t, int32_t id, size_t *len) {
    if (len) *len = 0;
    if (!t || id < 0 || id >= t->n_ids || !t->id_str[id]) return NULL;
    int32_t k = t->added_of_id[id];
    if (k >= 0) { /* as tokenizers: an added token in the form it is matched in (normalized when `normalized`) */
        if (len) *len = t->added[k].pattern_len;
        return t->added[k].pattern;
    }
    if (len) *len = t->id_len[id];
    return t->id_str[id];
}

/* Normalized text is at most as long as the strings of its tokens: byte-level BPE writes a byte as 1
 * or 2 bytes, Metaspace a space as 3, byte fallback a byte as 6, and an unknown character (4 bytes at
 * most) becomes the unknown token (4 at least below). Prepend and a Replace that lengthens only add
 * text; NFC shortens it 3 times at most (a Hangul syllable from three 3-byte jamo). What lets text
 * vanish leaves no bound: a split that removes what it matches, a Replace that shortens, an added
 * token that strips the whitespace beside it, fused unknown characters, and characters that neither
 * the vocabulary, byte fallback nor an unknown token covers (dropped). */
size_t mrl_tok_max_text_bytes(const mrl_tok *t) {
    if (!t) return 0;
    int every_byte = t->has_byte_level && t->byte_level_ids;
    if (!every_byte && t->byte_fallback) {
        every_byte = 1;
        for (int b = 0; b < 256; b++) every_byte &= t->byte_ids[b] >= 0;
    }
    if (!every_byte && (t->unk_id < 0 || t->fuse_unk)) return 0;
    for (int i = 0; i < t->n_pretoks; i++)
        if (t->pretoks[i].kind == PT_SPLIT && t->pretoks[i].behavior == SPLIT_REMOVED) return 0;
    size_t shrink = 1;
    for (int i = 0; i < t->n_norms; i++) {
        if (t->norms[i].kind == NORM_REPLACE && t->norms[i].blen < t->norms[i].alen) return 0;
        if (t->norms[i].kind == NORM_NFC) shrink = 3;
    }
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].lstrip || t->added[i].rstrip) return 0;
    size_t most = 4;
    for (int32_t id = 0; id < t->n_ids; id++) {
        size_t len;
        if (mrl_tok_id_to_token(t, id, &len) && len > most) most = len;
    }
    return most * shrink;
}

int mrl_tok_is_special(const mrl_tok *t, int32_t id) { return t && id >= 0 && id < t->n_ids && t->is_special[id]; }
int32_t mrl_tok_bos_id(const mrl_tok *t) { return t ? t->bos_id : -1; }
int32_t mrl_tok_eos_id(const mrl_tok *t) { return t ? t->eos_id : -1; }

/* ---- batches, encoded in parallel ---- */

typedef struct batch {
    const mrl_tok *t;
    const char *const *texts;
    const size_t *lens;
    int flags;
    tok_ids *out; /* one list per text */
    int failed;   /* set by any worker that ran out of memory */
} batch;

static void encode_range(void *ctx, int64_t begin, int64_t end) {
    batch *b = ctx;
    tok_work w;
    if (!tok_work_init(&w)) {
        __atomic_store_n(&b->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t i = begin; i < end; i++) {
        const char *text = b->texts[i] ? b->texts[i] : "";
        size_t len = b->texts[i] ? b->lens[i] : 0;
        if (encode_one(b->t, &w, text, len, b->flags, &b->out[i])) __atomic_store_n(&b->failed, 1, __ATOMIC_RELAXED);
    }
    tok_work_free(&w);
}

mrl_status mrl_tok_encode_batch(mrl_tok *t, const char *const *texts, const size_t *lens, size_t n, int flags,
                                int32_t *ids, size_t cap, size_t *offsets) {
    if (!t || !offsets || (n && (!texts || !lens)))
        return mrl_set_error(MRL_ERR_INVALID, "mrl_tok_encode_batch: NULL argument");
    offsets[0] = 0;
    if (n == 0) return MRL_OK;
    batch b = { t, texts, lens, flags, calloc(n, sizeof(tok_ids)), 0 };
    if (!b.out) return mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_encode_batch: out of memory");
    mrl_parallel_for((int64_t)n, 1, encode_range, &b);
    mrl_status st = MRL_OK;
    if (b.failed) st = mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_encode_batch: out of memory");
    for (size_t i = 0; i < n; i++) offsets[i + 1] = offsets[i] + b.out[i].len;
    size_t total = offsets[n];
    if (!st && !(ids == NULL && cap == 0)) {
        if (total > cap || !ids)
            st = mrl_set_error(MRL_ERR_INVALID, "mrl_tok_encode_batch: the buffer holds %zu ids, the texts need %zu",
                               cap, total);
        else
            for (size_t i = 0; i < n; i++)
                if (b.out[i].len) memcpy(ids + offsets[i], b.out[i].data, b.out[i].len * sizeof *ids);
    }
    for (size_t i = 0; i < n; i++) tok_ids_free(&b.out[i]);
    free(b.out);
    return st;
}
