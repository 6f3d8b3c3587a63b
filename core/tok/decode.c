/* Decoding: ids -> token strings -> the decoder chain -> UTF-8 text, and the
 * streaming decoder that emits only complete characters. */
#include <stdlib.h>
#include <string.h>
#include "tok_internal.h"
#include "base/error.h"

/* A list of strings, stored back to back in one buffer. */
typedef struct strs {
    tok_buf bytes;
    size_t *off, *len;
    size_t n, cap;
} strs;

static int strs_push(strs *v, const char *s, size_t len) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        size_t *o = realloc(v->off, cap * sizeof *o);
        if (!o) return 0;
        v->off = o;
        size_t *l = realloc(v->len, cap * sizeof *l);
        if (!l) return 0;
        v->len = l;
        v->cap = cap;
    }
    v->off[v->n] = v->bytes.len;
    v->len[v->n] = len;
    v->n++;
    return tok_buf_put(&v->bytes, s, len);
}

/* Grow the last string by s. */
static int strs_append(strs *v, const char *s, size_t len) {
    v->len[v->n - 1] += len;
    return tok_buf_put(&v->bytes, s, len);
}

static void strs_free(strs *v) {
    tok_buf_free(&v->bytes);
    free(v->off);
    free(v->len);
    memset(v, 0, sizeof *v);
}

#define STR(v, i) ((v)->bytes.data + (v)->off[i])

static int byte_level(const strs *in, strs *out) {
    tok_buf raw = { 0 }, fixed = { 0 };
    int ok = 1;
    for (size_t i = 0; ok && i < in->n; i++) {
        const char *s = STR(in, i);
        size_t len = in->len[i], start = raw.len;
        for (size_t j = 0; ok && j < len;) {
            uint32_t cp;
            j += (size_t)tok_utf8_decode(s + j, &cp);
            int b = tok_cp_to_byte(cp);
            if (b < 0) { /* not in the alphabet: the token's own bytes */
                raw.len = start;
                ok = tok_buf_put(&raw, s, len);
                break;
            }
            unsigned char c = (unsigned char)b;
            ok = tok_buf_put(&raw, &c, 1);
        }
    }
    ok = ok && tok_utf8_lossy(raw.data ? raw.data : "", raw.len, &fixed) &&
         strs_push(out, fixed.data ? fixed.data : "", fixed.len);
    tok_buf_free(&raw);
    tok_buf_free(&fixed);
    return ok;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static int flush_bytes(tok_buf *pending, strs *out) {
    if (!pending->len) return 1;
    int ok;
    if (tok_utf8_is_valid(pending->data, pending->len)) {
        ok = strs_push(out, pending->data, pending->len);
    } else { /* one U+FFFD per byte, as tokenizers does */
        ok = strs_push(out, "", 0);
        for (size_t i = 0; ok && i < pending->len; i++) ok = strs_append(out, "\xEF\xBF\xBD", 3);
    }
    pending->len = 0;
    return ok;
}

static int byte_fallback(const strs *in, strs *out) {
    tok_buf pending = { 0 };
    int ok = 1;
    for (size_t i = 0; ok && i < in->n; i++) {
        const char *s = STR(in, i);
        size_t len = in->len[i];
        int hi, lo;
        if (len == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' && (hi = hexval(s[3])) >= 0 && (lo = hexval(s[4])) >= 0) {
            unsigned char c = (unsigned char)(hi * 16 + lo);
            ok = tok_buf_put(&pending, &c, 1);
        } else {
            ok = flush_bytes(&pending, out) && strs_push(out, s, len);
        }
    }
    ok = ok && flush_bytes(&pending, out);
    tok_buf_free(&pending);
    return ok;
}

static int replace_in(const char *s, size_t len, const char *pat, size_t plen, const char *rep, size_t rlen,
                      strs *out) {
    if (!strs_push(out, "", 0)) return 0;
    size_t i = 0, run = 0;
    while (i < len) {
        if (i + plen <= len && memcmp(s + i, pat, plen) == 0) {
            if (!strs_append(out, s + run, i - run) || !strs_append(out, rep, rlen)) return 0;
            i += plen;
            run = i;
        } else {
            i++;
        }
    }
    return strs_append(out, s + run, len - run);
}

static int strip(const tok_dec *d, const char *s, size_t len, strs *out) {
    size_t b = 0, e = len;
    for (int k = 0; k < d->start && b + d->alen <= e && memcmp(s + b, d->a, d->alen) == 0; k++) b += d->alen;
    for (int k = 0; k < d->stop && e >= b + d->alen && memcmp(s + e - d->alen, d->a, d->alen) == 0; k++) e -= d->alen;
    return strs_push(out, s + b, e - b);
}

static int metaspace(const tok_dec *d, size_t index, const char *s, size_t len, strs *out) {
    if (!strs_push(out, "", 0)) return 0;
    size_t run = 0, i = 0;
    while (i < len) {
        if (i + (size_t)d->repl_len <= len && memcmp(s + i, d->repl, d->repl_len) == 0) {
            if (!strs_append(out, s + run, i - run)) return 0;
            if (!(index == 0 && d->prepend_scheme != PREPEND_NEVER) && !strs_append(out, " ", 1)) return 0;
            i += d->repl_len;
            run = i;
        } else {
            i++;
        }
    }
    return strs_append(out, s + run, len - run);
}

static int apply_decoder(const tok_dec *d, const strs *in, strs *out) {
    switch (d->kind) {
    case DEC_BYTELEVEL: return byte_level(in, out);
    case DEC_BYTEFALLBACK: return byte_fallback(in, out);
    case DEC_FUSE:
        if (!strs_push(out, "", 0)) return 0;
        for (size_t i = 0; i < in->n; i++)
            if (!strs_append(out, STR(in, i), in->len[i])) return 0;
        return 1;
    default: break;
    }
    for (size_t i = 0; i < in->n; i++) {
        int ok = 1;
        if (d->kind == DEC_REPLACE) ok = replace_in(STR(in, i), in->len[i], d->a, d->alen, d->b, d->blen, out);
        else if (d->kind == DEC_STRIP) ok = strip(d, STR(in, i), in->len[i], out);
        else if (d->kind == DEC_METASPACE) ok = metaspace(d, i, STR(in, i), in->len[i], out);
        if (!ok) return 0;
    }
    return 1;
}

int tok_decode_ids(const mrl_tok *t, const int32_t *ids, size_t n, int flags, tok_buf *out) {
    strs a = { 0 }, b = { 0 };
    int ok = 1;
    for (size_t i = 0; ok && i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || !t->id_str[id]) continue; /* unknown ids are left out, as in tokenizers */
        if ((flags & MRL_TOK_SKIP_SPECIAL) && t->skip_special[id]) continue;
        int32_t k = t->added_of_id[id];
        if (k >= 0) /* added tokens decode in the form they are matched in (normalized when `normalized`) */
            ok = strs_push(&a, t->added[k].pattern, t->added[k].pattern_len);
        else
            ok = strs_push(&a, t->id_str[id], t->id_len[id]);
    }
    for (int k = 0; ok && k < t->n_decs; k++) {
        b.n = 0;
        b.bytes.len = 0;
        ok = apply_decoder(&t->decs[k], &a, &b);
        strs tmp = a;
        a = b;
        b = tmp;
    }
    tok_buf joined = { 0 };
    for (size_t i = 0; ok && i < a.n; i++) {
        if (i > 0 && !t->has_decoder) ok = tok_buf_put(&joined, " ", 1);
        ok = ok && tok_buf_put(&joined, STR(&a, i), a.len[i]);
    }
    ok = ok && tok_utf8_lossy(joined.data ? joined.data : "", joined.len, out);
    tok_buf_free(&joined);
    strs_free(&a);
    strs_free(&b);
    return ok;
}

static mrl_status copy_out(tok_buf *text, const char *fn, char *buf, size_t cap, size_t *len) {
    *len = text->len;
    if (buf == NULL && cap == 0) return MRL_OK;
    if (text->len > cap || !buf)
        return mrl_set_error(MRL_ERR_INVALID, "%s: the buffer holds %zu bytes, the text needs %zu", fn, cap, text->len);
    if (text->len) memcpy(buf, text->data, text->len);
    return MRL_OK;
}

mrl_status mrl_tok_decode(mrl_tok *t, const int32_t *ids, size_t n, int flags, char *buf, size_t cap, size_t *len) {
    if (len) *len = 0;
    if (!t || !len || (!ids && n)) return mrl_set_error(MRL_ERR_INVALID, "mrl_tok_decode: NULL argument");
    tok_buf text = { 0 };
    mrl_status st = tok_decode_ids(t, ids, n, flags, &text)
                        ? copy_out(&text, "mrl_tok_decode", buf, cap, len)
                        : mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_decode: out of memory");
    tok_buf_free(&text);
    return st;
}

/* ---- streaming ---- */

struct mrl_tok_stream {
    mrl_tok *tok;
    int flags;
    tok_ids ids;       /* the window of ids still needed for context */
    tok_buf prefix;    /* decode of ids[0 .. prefix_index) */
    size_t prefix_index;
    tok_buf text, out;
};

mrl_status mrl_tok_stream_new(mrl_tok *tok, int flags, mrl_tok_stream **out) {
    *out = NULL;
    if (!tok) return mrl_set_error(MRL_ERR_INVALID, "mrl_tok_stream_new: tok is NULL");
    mrl_tok_stream *s = calloc(1, sizeof *s);
    if (!s) return mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_stream_new: out of memory");
    s->tok = tok;
    s->flags = flags;
    *out = s;
    return MRL_OK;
}

void mrl_tok_stream_free(mrl_tok_stream *s) {
    if (!s) return;
    tok_ids_free(&s->ids);
    tok_buf_free(&s->prefix);
    tok_buf_free(&s->text);
    tok_buf_free(&s->out);
    free(s);
}

void mrl_tok_stream_reset(mrl_tok_stream *s) {
    if (!s) return;
    s->ids.len = 0;
    s->prefix.len = 0;
    s->prefix_index = 0;
}

static int ends_with_replacement(const tok_buf *b) {
    return b->len >= 3 && !memcmp(b->data + b->len - 3, "\xEF\xBF\xBD", 3);
}

static int decode_window(mrl_tok_stream *s, size_t from, tok_buf *into) {
    into->len = 0;
    return tok_decode_ids(s->tok, s->ids.data + from, s->ids.len - from, s->flags, into);
}

mrl_status mrl_tok_stream_step(mrl_tok_stream *s, int32_t id, const char **text, size_t *len) {
    *text = "";
    *len = 0;
    if (!s) return mrl_set_error(MRL_ERR_INVALID, "mrl_tok_stream_step: stream is NULL");
    int ok = 1;
    /* the text of the ids already seen is the prefix the next decode must extend */
    if (s->prefix.len == 0 && s->ids.len > 0) {
        ok = decode_window(s, 0, &s->text);
        if (ok && !ends_with_replacement(&s->text)) {
            s->prefix.len = 0;
            ok = tok_buf_put(&s->prefix, s->text.data, s->text.len);
            s->prefix_index = s->ids.len;
        }
    }
    ok = ok && tok_ids_push(&s->ids, id) && decode_window(s, 0, &s->text);
    if (!ok) return mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_stream_step: out of memory");
    if (s->text.len > s->prefix.len && !ends_with_replacement(&s->text) &&
        memcmp(s->text.data, s->prefix.data ? s->prefix.data : "", s->prefix.len) != 0) {
        /* The new id changed text already emitted (a byte token after
         * complete text, with ByteFallback). tokenizers' DecodeStream fails
         * from here on; restart the window at this id instead. */
        s->ids.data[0] = id;
        s->ids.len = 1;
        s->prefix.len = 0;
        s->prefix_index = 0;
        if (!decode_window(s, 0, &s->text)) return mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_stream_step: out of memory");
    }
    if (s->text.len > s->prefix.len && !ends_with_replacement(&s->text)) {
        s->out.len = 0;
        ok = tok_buf_put(&s->out, s->text.data + s->prefix.len, s->text.len - s->prefix.len);
        /* keep only the ids after the old prefix as context */
        size_t keep_from = s->prefix_index, new_index = s->ids.len - keep_from;
        memmove(s->ids.data, s->ids.data + keep_from, (s->ids.len - keep_from) * sizeof *s->ids.data);
        s->ids.len -= keep_from;
        ok = ok && decode_window(s, 0, &s->prefix);
        s->prefix_index = new_index;
        if (!ok) return mrl_set_error(MRL_ERR_NOMEM, "mrl_tok_stream_step: out of memory");
        *text = s->out.data;
        *len = s->out.len;
    }
    return MRL_OK;
}
