/* Normalizers and pre-tokenizers: text -> normalized text -> pieces. */
#include <stdlib.h>
#include <string.h>
#include "tok_internal.h"

/* ---- normalizers ---- */

static int replace_all(const char *s, size_t len, const char *pat, size_t plen, const char *rep, size_t rlen,
                       tok_arena *a, const char **out, size_t *out_len) {
    size_t count = 0;
    for (size_t i = 0; i + plen <= len;) {
        if (s[i] == pat[0] && memcmp(s + i, pat, plen) == 0) count++, i += plen;
        else i++;
    }
    if (!count) {
        *out = s, *out_len = len;
        return 1;
    }
    size_t n = len - count * plen + count * rlen;
    char *d = tok_arena_alloc(a, n + 1), *o = d;
    if (!d) return 0;
    for (size_t i = 0; i < len;) {
        if (i + plen <= len && s[i] == pat[0] && memcmp(s + i, pat, plen) == 0) {
            memcpy(o, rep, rlen), o += rlen, i += plen;
        } else {
            *o++ = s[i++];
        }
    }
    *out = d, *out_len = n;
    return 1;
}

static char *prepend(const char *s, size_t len, const char *p, size_t plen, tok_arena *a) {
    char *d = tok_arena_alloc(a, plen + len + 1);
    if (d) {
        memcpy(d, p, plen);
        memcpy(d + plen, s, len);
    }
    return d;
}

int tok_normalize(const mrl_tok *t, const char *s, size_t len, tok_arena *a, const char **out, size_t *out_len) {
    for (int i = 0; i < t->n_norms; i++) {
        const tok_norm *n = &t->norms[i];
        if (n->kind == NORM_PREPEND && len > 0) {
            if (!(s = prepend(s, len, n->a, n->alen, a))) return 0;
            len += n->alen;
        } else if (n->kind == NORM_REPLACE) {
            if (!replace_all(s, len, n->a, n->alen, n->b, n->blen, a, &s, &len)) return 0;
        } else if (n->kind == NORM_NFC) {
            if (!tok_nfc(s, len, a, &s, &len)) return 0;
        }
    }
    *out = s, *out_len = len;
    return 1;
}

/* ---- splitting by a regex, with the behaviours of tokenizers' Split ---- */

typedef struct span {
    size_t start, end;
    int match;
} span;

typedef struct spans {
    span *data;
    size_t len, cap;
} spans;

static int spans_push(spans *v, size_t start, size_t end, int match) {
    if (v->len == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        span *d = realloc(v->data, cap * sizeof *d);
        if (!d) return 0;
        v->data = d, v->cap = cap;
    }
    v->data[v->len++] = (span){ start, end, match };
    return 1;
}

/* The pieces of s: the matches of re and the text between them, in order. */
static int find_matches(tok_work *w, pcre2_code *re, const char *s, size_t len, int invert, spans *out) {
    size_t pos = 0, prev = 0;
    out->len = 0;
    while (pos <= len) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, len, pos, PCRE2_NO_UTF_CHECK, w->md, NULL);
        if (rc < 0) break;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
        size_t ms = ov[0], me = ov[1];
        if (ms > prev && !spans_push(out, prev, ms, invert)) return 0;
        if (!spans_push(out, ms, me, !invert)) return 0;
        prev = me;
        if (me == ms) {
            if (ms >= len) break;
            size_t skip;
            int n = tok_utf8_valid_at((const unsigned char *)s + ms, len - ms, &skip);
            pos = ms + (n ? (size_t)n : 1);
        } else {
            pos = me;
        }
    }
    if (prev < len && !spans_push(out, prev, len, invert)) return 0;
    return 1;
}

static int split_piece(tok_work *w, const tok_pretok *p, const tok_piece *in, spans *sp, tok_pieces *out) {
    if (!find_matches(w, p->re, in->s, in->len, p->invert, sp)) return 0;
    span *v = sp->data;
    size_t n = sp->len, k = 0;
    /* rewrite the spans in place into the output ranges of the behaviour */
    switch (p->behavior) {
    case SPLIT_ISOLATED: k = n; break;
    case SPLIT_REMOVED:
        for (size_t i = 0; i < n; i++)
            if (!v[i].match) v[k++] = v[i];
        break;
    case SPLIT_MERGED_PREV: {
        int prev_match = 0;
        for (size_t i = 0; i < n; i++) {
            if (v[i].match && !prev_match && k > 0) v[k - 1].end = v[i].end;
            else v[k++] = v[i];
            prev_match = v[i].match;
        }
        break;
    }
    case SPLIT_MERGED_NEXT: {
        /* walk backwards: a match joins the piece after it */
        int prev_match = 0;
        size_t w = n;
        for (size_t i = n; i-- > 0;) {
            span cur = v[i];
            if (cur.match && !prev_match && w < n) v[w].start = cur.start;
            else v[--w] = cur;
            prev_match = cur.match;
        }
        memmove(v, v + w, (n - w) * sizeof *v);
        k = n - w;
        break;
    }
    case SPLIT_CONTIGUOUS: {
        int prev_match = 0;
        for (size_t i = 0; i < n; i++) {
            if (v[i].match == prev_match && k > 0) v[k - 1].end = v[i].end;
            else v[k++] = v[i];
            prev_match = v[i].match;
        }
        break;
    }
    }
    for (size_t i = 0; i < k; i++)
        if (v[i].end > v[i].start && !tok_pieces_push(out, in->s + v[i].start, v[i].end - v[i].start,
                                                      in->first && v[i].start == 0, in->bytelevel))
            return 0;
    return 1;
}

/* Map the raw bytes of a byte-level piece to their stand-in characters. */
static int materialize(tok_piece *p, tok_arena *a) {
    if (!p->bytelevel) return 1;
    char *d = tok_arena_alloc(a, p->len * 2 + 1), *o = d;
    if (!d) return 0;
    for (size_t i = 0; i < p->len; i++) o += tok_utf8_encode(tok_byte_to_cp[(unsigned char)p->s[i]], o);
    p->s = d, p->len = (size_t)(o - d), p->bytelevel = 0;
    return 1;
}

static int metaspace(tok_work *w, const tok_pretok *p, tok_piece *in, tok_arena *a, spans *sp, tok_pieces *out) {
    const char *s;
    size_t len;
    if (!replace_all(in->s, in->len, " ", 1, p->repl, (size_t)p->repl_len, a, &s, &len)) return 0;
    int starts = len >= (size_t)p->repl_len && memcmp(s, p->repl, p->repl_len) == 0;
    if (!starts && (p->prepend_scheme == PREPEND_ALWAYS || (p->prepend_scheme == PREPEND_FIRST && in->first))) {
        if (!(s = prepend(s, len, p->repl, p->repl_len, a))) return 0;
        len += p->repl_len;
    }
    tok_piece cur = { s, len, in->first, 0 };
    if (!p->split) return len ? tok_pieces_push(out, s, len, in->first, 0) : 1;
    tok_pretok rule = { .re = p->re, .behavior = SPLIT_MERGED_NEXT };
    return split_piece(w, &rule, &cur, sp, out);
}

int tok_pretokenize(const mrl_tok *t, tok_work *w, const char *s, size_t len, int first, tok_arena *a,
                    tok_pieces *out) {
    tok_pieces cur = { 0 }, next = { 0 };
    spans sp = { 0 };
    int ok = 1;
    if (len == 0) return 1;
    if (!tok_pieces_push(&cur, s, len, first, 0)) return 0;
    for (int i = 0; ok && i < t->n_pretoks; i++) {
        const tok_pretok *p = &t->pretoks[i];
        next.len = 0;
        for (size_t j = 0; ok && j < cur.len; j++) {
            tok_piece in = cur.data[j];
            if (!(ok = materialize(&in, a))) break;
            switch (p->kind) {
            case PT_BYTELEVEL:
                if (p->add_prefix_space && in.s[0] != ' ') {
                    if (!(ok = (in.s = prepend(in.s, in.len, " ", 1, a)) != NULL)) break;
                    in.len++;
                }
                in.bytelevel = 1;
                if (p->re) {
                    tok_pretok rule = { .re = p->re, .behavior = SPLIT_ISOLATED };
                    ok = split_piece(w, &rule, &in, &sp, &next);
                } else {
                    ok = tok_pieces_push(&next, in.s, in.len, in.first, 1);
                }
                break;
            case PT_SPLIT: ok = split_piece(w, p, &in, &sp, &next); break;
            case PT_METASPACE: ok = metaspace(w, p, &in, a, &sp, &next); break;
            }
        }
        tok_pieces tmp = cur;
        cur = next;
        next = tmp;
    }
    for (size_t j = 0; ok && j < cur.len; j++)
        ok = tok_pieces_push(out, cur.data[j].s, cur.data[j].len, cur.data[j].first, cur.data[j].bytelevel);
    free(cur.data);
    free(next.data);
    free(sp.data);
    return ok;
}
