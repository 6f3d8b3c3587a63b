/* Loading tokenizer.json (and tokenizer_config.json) into the tables of
 * tok_internal.h. Every error names the file and the key at fault. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "io/json.h"
#include "moonrl/mem.h"
#include "tok_internal.h"
#include "base/error.h"

#define MAX_ID (1 << 24)

static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static int is_category(const char *name, size_t n) {
    static const char *const cats[] = {"L", "Lu", "Ll", "Lt", "Lm", "Lo", "L&", "Lc", "M", "Mn", "Mc", "Me", "N", "Nd",
                                       "Nl", "No", "P", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "S", "Sm", "Sc", "Sk",
                                       "So", "Z", "Zs", "Zl", "Zp", "C", "Cc", "Cf", "Cs", "Co", "Cn", "Any",
                                       /* binary properties, not scripts */
                                       "Alphabetic", "Alpha", "White_Space", "Uppercase", "Lowercase", "Emoji",
                                       "Emoji_Presentation", "Extended_Pictographic"};
    for (size_t i = 0; i < sizeof cats / sizeof *cats; i++)
        if (strlen(cats[i]) == n && !memcmp(cats[i], name, n)) return 1;
    return memchr(name, ':', n) || memchr(name, '=', n);
}


/* The patterns are written for Oniguruma; give PCRE2 the same meaning:
 * \p{Script} is the Script property there (PCRE2 also takes
 * Script_Extensions: U+3002 is Han to it), so write \p{sc:Script}; \s and
 * \w are White_Space and Unicode word characters there (PCRE2's \s also has
 * U+180E, its \w lacks marks), so spell them out. Returns 0 on OOM. */
static int onig_compat(const char *pat, size_t len, tok_buf *out) {
    int in_class = 0;
    for (size_t i = 0; i < len;) {
        char c = pat[i];
        if (c == '\\' && i + 1 < len) {
            char e = pat[i + 1];
            if ((e == 'p' || e == 'P') && i + 2 < len && pat[i + 2] == '{') {
                const char *name = pat + i + 3, *end = memchr(name, '}', len - (i + 3));
                int neg = end && end > name && name[0] == '^';
                if (end && !is_category(name + neg, (size_t)(end - name - neg))) {
                    if (!tok_buf_put(out, pat + i, 3) || (neg && !tok_buf_put(out, "^", 1)) ||
                        !tok_buf_put(out, "sc:", 3))
                        return 0;
                    i = (size_t)(name + neg - pat);
                    continue;
                }
            }
            const char *cls = e == 's' || e == 'S' ? TOK_SPACE_CLASS : e == 'w' || e == 'W' ? TOK_WORD_CLASS : NULL;
            int upper = e == 'S' || e == 'W';
            if (cls && !(in_class && upper)) { /* a negated one inside a class stays as PCRE2 reads it */
                int ok = in_class ? tok_buf_put(out, cls, strlen(cls))
                                  : tok_buf_put(out, upper ? "[^" : "[", upper ? 2 : 1) &&
                                        tok_buf_put(out, cls, strlen(cls)) && tok_buf_put(out, "]", 1);
                if (!ok) return 0;
                i += 2;
                continue;
            }
            if (!tok_buf_put(out, pat + i, 2)) return 0;
            i += 2;
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = 1;
            /* a ']' right after '[' or '[^' is a literal */
            size_t k = i + 1 + (i + 1 < len && pat[i + 1] == '^');
            size_t n = k < len && pat[k] == ']' ? k + 1 - i : k - i;
            if (!tok_buf_put(out, pat + i, n)) return 0;
            i += n;
            continue;
        }
        if (c == ']' && in_class) in_class = 0;
        if (!tok_buf_put(out, &c, 1)) return 0;
        i++;
    }
    return 1;
}

static mrl_status compile_re(const mrl_tok *t, const char *where, const char *pat, size_t len, int literal,
                             pcre2_code **out) {
    int err;
    PCRE2_SIZE off;
    tok_buf rewritten = { 0 };
    if (!literal) {
        if (!onig_compat(pat, len, &rewritten)) {
            tok_buf_free(&rewritten);
            return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
        }
        pat = rewritten.data ? rewritten.data : "", len = rewritten.len;
    }
    /* the pattern's UTF-8 is checked (a tokenizer.json may hold any bytes, and PCRE2 reads past
     * the end of an invalid sequence it was told not to check); found by fuzzing */
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, opts, &err, &off, NULL);
    tok_buf_free(&rewritten);
    if (!re) {
        char msg[256];
        pcre2_get_error_message(err, (PCRE2_UCHAR *)msg, sizeof msg);
        return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: bad regex at offset %zu: %s", t->path, where, (size_t)off, msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* falls back to the interpreter when JIT is unavailable */
    *out = re;
    return MRL_OK;
}

static const char *str_member(const mrl_json *o, const char *key, size_t *len) {
    mrl_json *v = mrl_json_get(o, key);
    if (!v || v->type != MRL_JSON_STRING) return NULL;
    if (len) *len = v->length;
    return v->string;
}

static int bool_member(const mrl_json *o, const char *key, int dflt) {
    int b;
    return mrl_json_get_bool(o, key, &b) ? b : dflt;
}

/* {"String": s} or {"Regex": r} */
static mrl_status pattern_of(const mrl_tok *t, const char *where, const mrl_json *o, const char **s, size_t *len,
                             int *is_regex) {
    mrl_json *p = mrl_json_get(o, "pattern");
    if ((*s = str_member(p, "String", len))) {
        *is_regex = 0;
        return MRL_OK;
    }
    if ((*s = str_member(p, "Regex", len))) {
        *is_regex = 1;
        return MRL_OK;
    }
    return mrl_set_error(MRL_ERR_FORMAT, "%s: %s.pattern: expected {\"String\": ...} or {\"Regex\": ...}", t->path,
                         where);
}

static int prepend_scheme_of(const mrl_json *o) {
    const char *s = str_member(o, "prepend_scheme", NULL);
    if (s) return !strcmp(s, "first") ? PREPEND_FIRST : !strcmp(s, "never") ? PREPEND_NEVER : PREPEND_ALWAYS;
    return bool_member(o, "add_prefix_space", 1) ? PREPEND_ALWAYS : PREPEND_NEVER;
}

static mrl_status replacement_of(const mrl_tok *t, const char *where, const mrl_json *o, char *repl, int *repl_len) {
    size_t n;
    const char *r = str_member(o, "replacement", &n);
    if (!r) r = "\xE2\x96\x81", n = 3;
    size_t skip;
    if (n == 0 || n > 4 || tok_utf8_valid_at((const unsigned char *)r, n, &skip) != (int)n)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: %s.replacement: must be one character", t->path, where);
    memcpy(repl, r, n);
    *repl_len = (int)n;
    return MRL_OK;
}

/* ---- normalizer ---- */

static mrl_status push_norm(mrl_tok *t, tok_norm n) {
    tok_norm *d = realloc(t->norms, (t->n_norms + 1) * sizeof *d);
    if (!d) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    t->norms = d;
    t->norms[t->n_norms++] = n;
    return MRL_OK;
}

static mrl_status load_normalizer(mrl_tok *t, const mrl_json *o, const char *where) {
    if (!o || o->type == MRL_JSON_NULL) return MRL_OK;
    const char *type = str_member(o, "type", NULL);
    if (!type) return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: missing \"type\"", t->path, where);
    if (!strcmp(type, "Sequence")) {
        mrl_json *list = mrl_json_get(o, "normalizers");
        if (!list || list->type != MRL_JSON_ARRAY)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: %s.normalizers: expected an array", t->path, where);
        for (size_t i = 0; i < list->length; i++) {
            mrl_status st = load_normalizer(t, list->items[i], where);
            if (st) return st;
        }
        return MRL_OK;
    }
    tok_norm n = { 0 };
    if (!strcmp(type, "Prepend")) {
        const char *p = str_member(o, "prepend", &n.alen);
        if (!p) return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: Prepend without \"prepend\"", t->path, where);
        n.kind = NORM_PREPEND;
        n.a = dup_n(p, n.alen);
    } else if (!strcmp(type, "Replace")) {
        const char *p, *c;
        int is_regex;
        mrl_status st = pattern_of(t, where, o, &p, &n.alen, &is_regex);
        if (st) return st;
        if (is_regex)
            return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: %s: Replace with a Regex pattern is not supported", t->path,
                                 where);
        if (!(c = str_member(o, "content", &n.blen)))
            return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: Replace without \"content\"", t->path, where);
        if (n.alen == 0) return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: Replace with an empty pattern", t->path, where);
        n.kind = NORM_REPLACE;
        n.a = dup_n(p, n.alen);
        n.b = dup_n(c, n.blen);
    } else if (!strcmp(type, "NFC")) {
        n.kind = NORM_NFC;
    } else {
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: %s: normalizer type \"%s\" is not supported", t->path, where,
                             type);
    }
    return push_norm(t, n);
}

/* ---- pre-tokenizer ---- */

static mrl_status push_pretok(mrl_tok *t, tok_pretok p) {
    tok_pretok *d = realloc(t->pretoks, (t->n_pretoks + 1) * sizeof *d);
    if (!d) {
        if (p.re) pcre2_code_free(p.re);
        return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    }
    t->pretoks = d;
    t->pretoks[t->n_pretoks++] = p;
    return MRL_OK;
}

static int behavior_of(const char *b) {
    if (!b || !strcmp(b, "Isolated")) return SPLIT_ISOLATED;
    if (!strcmp(b, "Removed")) return SPLIT_REMOVED;
    if (!strcmp(b, "MergedWithPrevious")) return SPLIT_MERGED_PREV;
    if (!strcmp(b, "MergedWithNext")) return SPLIT_MERGED_NEXT;
    if (!strcmp(b, "Contiguous")) return SPLIT_CONTIGUOUS;
    return -1;
}

static mrl_status load_pretok(mrl_tok *t, const mrl_json *o, const char *where) {
    if (!o || o->type == MRL_JSON_NULL) return MRL_OK;
    const char *type = str_member(o, "type", NULL);
    if (!type) return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: missing \"type\"", t->path, where);
    tok_pretok p = { 0 };
    mrl_status st;
    if (!strcmp(type, "Sequence")) {
        mrl_json *list = mrl_json_get(o, "pretokenizers");
        if (!list || list->type != MRL_JSON_ARRAY)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: %s.pretokenizers: expected an array", t->path, where);
        for (size_t i = 0; i < list->length; i++)
            if ((st = load_pretok(t, list->items[i], where))) return st;
        return MRL_OK;
    } else if (!strcmp(type, "ByteLevel")) {
        p.kind = PT_BYTELEVEL;
        p.add_prefix_space = bool_member(o, "add_prefix_space", 1);
        if (bool_member(o, "use_regex", 1) &&
            (st = compile_re(t, where, GPT2_PATTERN, sizeof GPT2_PATTERN - 1, 0, &p.re)))
            return st;
        t->has_byte_level = 1;
    } else if (!strcmp(type, "Split")) {
        const char *pat;
        size_t plen;
        int is_regex;
        if ((st = pattern_of(t, where, o, &pat, &plen, &is_regex))) return st;
        p.kind = PT_SPLIT;
        p.behavior = behavior_of(str_member(o, "behavior", NULL));
        if (p.behavior < 0) return mrl_set_error(MRL_ERR_FORMAT, "%s: %s.behavior: unknown value", t->path, where);
        p.invert = bool_member(o, "invert", 0);
        if ((st = compile_re(t, where, pat, plen, !is_regex, &p.re))) return st;
    } else if (!strcmp(type, "Digits")) {
        p.kind = PT_SPLIT;
        p.behavior = SPLIT_ISOLATED;
        int individual = bool_member(o, "individual_digits", 0);
        const char *pat = individual ? "\\p{N}" : "\\p{N}+";
        if ((st = compile_re(t, where, pat, strlen(pat), 0, &p.re))) return st;
    } else if (!strcmp(type, "Punctuation") || !strcmp(type, "Whitespace") || !strcmp(type, "WhitespaceSplit")) {
        /* as splits by a regex: Unicode or ASCII punctuation; runs of word
         * characters (Unicode \w) or of other non-space characters;
         * runs of White_Space, removed */
        const char *pat = type[0] == 'P' ? "[\\p{P}!-/:-@\\[-`{-~]"
                          : type[10]     ? "[" TOK_SPACE_CLASS "]+"
                                         : "[" TOK_WORD_CLASS "]+|[^" TOK_WORD_CLASS TOK_SPACE_CLASS "]+";
        p.kind = PT_SPLIT;
        p.behavior = type[0] == 'P' ? behavior_of(str_member(o, "behavior", NULL)) : SPLIT_REMOVED;
        p.invert = type[0] == 'W' && !type[10]; /* Whitespace keeps the matches */
        if (p.behavior < 0) return mrl_set_error(MRL_ERR_FORMAT, "%s: %s.behavior: unknown value", t->path, where);
        if ((st = compile_re(t, where, pat, strlen(pat), 0, &p.re))) return st;
    } else if (!strcmp(type, "Metaspace")) {
        p.kind = PT_METASPACE;
        if ((st = replacement_of(t, where, o, p.repl, &p.repl_len))) return st;
        p.prepend_scheme = prepend_scheme_of(o);
        p.split = bool_member(o, "split", 1);
        if ((st = compile_re(t, where, p.repl, (size_t)p.repl_len, 1, &p.re))) return st;
    } else {
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: %s: pre-tokenizer type \"%s\" is not supported", t->path, where,
                             type);
    }
    return push_pretok(t, p);
}

/* ---- decoder ---- */

static mrl_status push_dec(mrl_tok *t, tok_dec d) {
    tok_dec *n = realloc(t->decs, (t->n_decs + 1) * sizeof *n);
    if (!n) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    t->decs = n;
    t->decs[t->n_decs++] = d;
    return MRL_OK;
}

static mrl_status load_decoder(mrl_tok *t, const mrl_json *o, const char *where) {
    if (!o || o->type == MRL_JSON_NULL) return MRL_OK;
    t->has_decoder = 1;
    const char *type = str_member(o, "type", NULL);
    if (!type) return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: missing \"type\"", t->path, where);
    tok_dec d = { 0 };
    mrl_status st;
    if (!strcmp(type, "Sequence")) {
        mrl_json *list = mrl_json_get(o, "decoders");
        if (!list || list->type != MRL_JSON_ARRAY)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: %s.decoders: expected an array", t->path, where);
        for (size_t i = 0; i < list->length; i++)
            if ((st = load_decoder(t, list->items[i], where))) return st;
        return MRL_OK;
    } else if (!strcmp(type, "ByteLevel")) {
        d.kind = DEC_BYTELEVEL;
    } else if (!strcmp(type, "ByteFallback")) {
        d.kind = DEC_BYTEFALLBACK;
    } else if (!strcmp(type, "Fuse")) {
        d.kind = DEC_FUSE;
    } else if (!strcmp(type, "Replace")) {
        const char *p, *c;
        int is_regex;
        if ((st = pattern_of(t, where, o, &p, &d.alen, &is_regex))) return st;
        if (is_regex)
            return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: %s: Replace with a Regex pattern is not supported", t->path,
                                 where);
        if (!(c = str_member(o, "content", &d.blen)))
            return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: Replace without \"content\"", t->path, where);
        if (d.alen == 0) return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: Replace with an empty pattern", t->path, where);
        d.kind = DEC_REPLACE;
        d.a = dup_n(p, d.alen);
        d.b = dup_n(c, d.blen);
    } else if (!strcmp(type, "Strip")) {
        const char *c = str_member(o, "content", &d.alen);
        int64_t start = 0, stop = 0;
        mrl_json_get_int(o, "start", &start);
        mrl_json_get_int(o, "stop", &stop);
        if (!c || start < 0 || stop < 0 || start > 1 << 20 || stop > 1 << 20)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: %s: Strip needs \"content\" and non-negative start/stop", t->path,
                                 where);
        d.kind = DEC_STRIP;
        d.a = dup_n(c, d.alen);
        d.start = (int)start;
        d.stop = (int)stop;
    } else if (!strcmp(type, "Metaspace")) {
        d.kind = DEC_METASPACE;
        if ((st = replacement_of(t, where, o, d.repl, &d.repl_len))) return st;
        d.prepend_scheme = prepend_scheme_of(o);
    } else {
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: %s: decoder type \"%s\" is not supported", t->path, where, type);
    }
    return push_dec(t, d);
}

/* ---- post-processor: only the single-sequence template matters here ---- */

static mrl_status special_ids(mrl_tok *t, const mrl_json *specials, const char *name, int32_t *out, int *n, int cap) {
    mrl_json *e = mrl_json_get(specials, name);
    mrl_json *ids = mrl_json_get(e, "ids");
    if (!ids || ids->type != MRL_JSON_ARRAY)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor.special_tokens: no ids for \"%s\"", t->path, name);
    for (size_t i = 0; i < ids->length; i++) {
        mrl_json *v = ids->items[i];
        if (v->type != MRL_JSON_NUMBER || !v->is_integer || v->integer < 0 || v->integer >= MAX_ID || *n >= cap)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor.special_tokens.%s: bad id", t->path, name);
        out[(*n)++] = (int32_t)v->integer;
    }
    return MRL_OK;
}

static mrl_status token_pair_id(mrl_tok *t, const mrl_json *o, const char *key, int32_t *out, int *n) {
    mrl_json *pair = mrl_json_get(o, key);
    if (!pair || pair->type != MRL_JSON_ARRAY || pair->length != 2 || pair->items[1]->type != MRL_JSON_NUMBER ||
        pair->items[1]->integer < 0 || pair->items[1]->integer >= MAX_ID)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor.%s: expected [token, id]", t->path, key);
    out[(*n)++] = (int32_t)pair->items[1]->integer;
    return MRL_OK;
}

static mrl_status load_post(mrl_tok *t, const mrl_json *o) {
    if (!o || o->type == MRL_JSON_NULL) return MRL_OK;
    const char *type = str_member(o, "type", NULL);
    if (!type) return mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor: missing \"type\"", t->path);
    if (!strcmp(type, "Sequence")) {
        mrl_json *list = mrl_json_get(o, "processors");
        if (!list || list->type != MRL_JSON_ARRAY)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor.processors: expected an array", t->path);
        for (size_t i = 0; i < list->length; i++) {
            mrl_status st = load_post(t, list->items[i]);
            if (st) return st;
        }
        return MRL_OK;
    }
    if (!strcmp(type, "ByteLevel")) return MRL_OK; /* offsets only */
    if (!strcmp(type, "RobertaProcessing") || !strcmp(type, "BertProcessing")) {
        t->n_post_prefix = t->n_post_suffix = 0;
        mrl_status st = token_pair_id(t, o, "cls", t->post_prefix, &t->n_post_prefix);
        return st ? st : token_pair_id(t, o, "sep", t->post_suffix, &t->n_post_suffix);
    }
    if (strcmp(type, "TemplateProcessing"))
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: post_processor type \"%s\" is not supported", t->path, type);
    mrl_json *single = mrl_json_get(o, "single"), *specials = mrl_json_get(o, "special_tokens");
    if (!single || single->type != MRL_JSON_ARRAY)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor.single: expected an array", t->path);
    t->n_post_prefix = t->n_post_suffix = 0;
    int seen_a = 0;
    for (size_t i = 0; i < single->length; i++) {
        mrl_json *item = single->items[i];
        mrl_json *sp = mrl_json_get(item, "SpecialToken");
        if (sp) {
            const char *name = str_member(sp, "id", NULL);
            if (!name)
                return mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor.single[%zu]: SpecialToken without id", t->path,
                                     i);
            mrl_status st = seen_a ? special_ids(t, specials, name, t->post_suffix, &t->n_post_suffix, 8)
                                   : special_ids(t, specials, name, t->post_prefix, &t->n_post_prefix, 8);
            if (st) return st;
        } else if (mrl_json_get(item, "Sequence")) {
            seen_a = 1;
        } else {
            return mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor.single[%zu]: unknown item", t->path, i);
        }
    }
    return MRL_OK;
}

/* ---- model ---- */

static mrl_status set_id_string(mrl_tok *t, int32_t id, const char *s, size_t len) {
    if (t->id_str[id]) return MRL_OK; /* the first holder wins: added tokens, then the vocabulary */
    if (!(t->id_str[id] = dup_n(s, len))) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    t->id_len[id] = (uint32_t)len;
    t->distinct_ids++;
    return MRL_OK;
}

static mrl_status put_merge(mrl_tok *t, size_t rank, const char *a, size_t alen, const char *b, size_t blen,
                            char *scratch) {
    int32_t ia = tok_strmap_get(&t->vocab, a, alen), ib = tok_strmap_get(&t->vocab, b, blen);
    memcpy(scratch, a, alen);
    memcpy(scratch + alen, b, blen);
    int32_t in = tok_strmap_get(&t->vocab, scratch, alen + blen);
    if (ia < 0 || ib < 0 || in < 0)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: model.merges[%zu]: \"%.*s\" + \"%.*s\": %s not in the vocabulary",
                             t->path, rank, (int)alen, a, (int)blen, b,
                             ia < 0 ? "the left token is" : ib < 0 ? "the right token is" : "the merged token is");
    uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    size_t i = (key * 0x9E3779B97F4A7C15ull >> 20) & t->merge_mask;
    while (t->merge_keys[i] != UINT64_MAX) {
        if (t->merge_keys[i] == key) break; /* a repeated merge takes its last rank, as in tokenizers */
        i = (i + 1) & t->merge_mask;
    }
    t->merge_keys[i] = key;
    t->merge_rank[i] = (int32_t)rank;
    t->merge_new[i] = in;
    return MRL_OK;
}

static mrl_status load_model(mrl_tok *t, const mrl_json *m) {
    if (!m || m->type != MRL_JSON_OBJECT) return mrl_set_error(MRL_ERR_FORMAT, "%s: missing \"model\"", t->path);
    const char *type = str_member(m, "type", NULL);
    if (type && strcmp(type, "BPE"))
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: model.type \"%s\" is not supported (only BPE)", t->path, type);
    const char *pfx = str_member(m, "continuing_subword_prefix", NULL),
               *sfx = str_member(m, "end_of_word_suffix", NULL);
    if ((pfx && *pfx) || (sfx && *sfx))
        return mrl_set_error(MRL_ERR_UNSUPPORTED,
                             "%s: model: continuing_subword_prefix / end_of_word_suffix are not supported", t->path);
    mrl_json *dropout = mrl_json_get(m, "dropout");
    if (dropout && dropout->type == MRL_JSON_NUMBER && dropout->number > 0)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: model.dropout: BPE dropout is not supported", t->path);
    mrl_json *vocab = mrl_json_get(m, "vocab"), *merges = mrl_json_get(m, "merges");
    if (!vocab || vocab->type != MRL_JSON_OBJECT)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: model.vocab: expected an object", t->path);
    if (merges && merges->type != MRL_JSON_ARRAY)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: model.merges: expected an array", t->path);
    t->byte_fallback = bool_member(m, "byte_fallback", 0);
    t->ignore_merges = bool_member(m, "ignore_merges", 0);
    t->fuse_unk = bool_member(m, "fuse_unk", 0);
    if (!tok_strmap_init(&t->vocab, vocab->length)) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    for (size_t i = 0; i < vocab->length; i++) {
        mrl_json *v = vocab->items[i];
        if (v->type != MRL_JSON_NUMBER || !v->is_integer || v->integer < 0 || v->integer >= MAX_ID)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: model.vocab[\"%s\"]: id must be an integer in [0, %d)", t->path,
                                 vocab->keys[i], MAX_ID);
        if (!tok_strmap_put(&t->vocab, vocab->keys[i], vocab->key_lengths[i], (int32_t)v->integer))
            return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
        if (v->integer >= t->n_ids) t->n_ids = (int32_t)v->integer + 1;
    }
    const char *unk = str_member(m, "unk_token", NULL);
    t->unk_id = -1;
    if (unk && (t->unk_id = tok_strmap_get(&t->vocab, unk, strlen(unk))) < 0)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: model.unk_token \"%s\" is not in the vocabulary", t->path, unk);
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_ids[b] = tok_strmap_get(&t->vocab, name, 6);
    }
    size_t n_merges = merges ? merges->length : 0, slots = 16;
    while (slots < n_merges * 2 + 2) slots *= 2;
    t->merge_mask = slots - 1;
    t->merge_keys = mrl_mem_alloc(slots * sizeof *t->merge_keys, MRL_MEM_OTHER);
    t->merge_rank = mrl_mem_alloc(slots * sizeof *t->merge_rank, MRL_MEM_OTHER);
    t->merge_new = mrl_mem_alloc(slots * sizeof *t->merge_new, MRL_MEM_OTHER);
    if (!t->merge_keys || !t->merge_rank || !t->merge_new) return mrl_wrap_error(MRL_ERR_NOMEM, "%s", t->path);
    memset(t->merge_keys, 0xFF, slots * sizeof *t->merge_keys);
    char *scratch = NULL;
    size_t scratch_cap = 0;
    mrl_status st = MRL_OK;
    for (size_t r = 0; r < n_merges && !st; r++) {
        mrl_json *e = merges->items[r];
        const char *a, *b;
        size_t alen, blen;
        if (e->type == MRL_JSON_STRING) {
            const char *sp = memchr(e->string, ' ', e->length);
            if (!sp) {
                st = mrl_set_error(MRL_ERR_FORMAT, "%s: model.merges[%zu]: \"%s\" is not \"a b\"", t->path, r,
                                   e->string);
                break;
            }
            a = e->string, alen = (size_t)(sp - e->string), b = sp + 1, blen = e->length - alen - 1;
        } else if (e->type == MRL_JSON_ARRAY && e->length == 2 && e->items[0]->type == MRL_JSON_STRING &&
                   e->items[1]->type == MRL_JSON_STRING) {
            a = e->items[0]->string, alen = e->items[0]->length, b = e->items[1]->string, blen = e->items[1]->length;
        } else {
            st = mrl_set_error(MRL_ERR_FORMAT, "%s: model.merges[%zu]: expected \"a b\" or [a, b]", t->path, r);
            break;
        }
        if (alen + blen > scratch_cap) {
            scratch_cap = (alen + blen) * 2 + 64;
            char *s = realloc(scratch, scratch_cap);
            if (!s) {
                st = mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
                break;
            }
            scratch = s;
        }
        st = put_merge(t, r, a, alen, b, blen, scratch);
    }
    free(scratch);
    return st;
}

static mrl_status load_added(mrl_tok *t, const mrl_json *list) {
    if (!list || list->type == MRL_JSON_NULL) return MRL_OK;
    if (list->type != MRL_JSON_ARRAY)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: added_tokens: expected an array", t->path);
    t->added = calloc(list->length + 1, sizeof *t->added);
    if (!t->added || !tok_strmap_init(&t->added_index, list->length))
        return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    for (size_t i = 0; i < list->length; i++) {
        mrl_json *e = list->items[i];
        int64_t id;
        size_t len;
        const char *content = str_member(e, "content", &len);
        if (!content || !mrl_json_get_int(e, "id", &id) || id < 0 || id >= MAX_ID)
            return mrl_set_error(MRL_ERR_FORMAT,
                                 "%s: added_tokens[%zu]: needs \"content\" and an integer \"id\" in [0, %d)", t->path,
                                 i, MAX_ID);
        if (len == 0) continue;
        tok_added *a = &t->added[t->n_added];
        a->content = dup_n(content, len);
        if (!a->content) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
        a->len = len;
        a->id = (int32_t)id;
        a->special = bool_member(e, "special", 0);
        a->single_word = bool_member(e, "single_word", 0);
        a->lstrip = bool_member(e, "lstrip", 0);
        a->rstrip = bool_member(e, "rstrip", 0);
        a->normalized = bool_member(e, "normalized", !a->special);
        if (!tok_strmap_put(&t->added_index, content, len, t->n_added))
            return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
        t->n_added++;
        if (id >= t->n_ids) t->n_ids = (int32_t)id + 1;
    }
    return MRL_OK;
}

static mrl_status build_id_tables(mrl_tok *t) {
    size_t n = (size_t)t->n_ids + 1;
    t->id_str = calloc(n, sizeof *t->id_str);
    t->id_len = calloc(n, sizeof *t->id_len);
    t->is_special = calloc(n, 1);
    t->skip_special = calloc(n, 1);
    t->added_of_id = malloc(n * sizeof *t->added_of_id);
    if (!t->id_str || !t->id_len || !t->is_special || !t->skip_special || !t->added_of_id)
        return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", t->path);
    for (size_t i = 0; i < n; i++) t->added_of_id[i] = -1;
    mrl_status st;
    for (int i = 0; i < t->n_added; i++) {
        tok_added *a = &t->added[i];
        if ((st = set_id_string(t, a->id, a->content, a->len))) return st;
        t->added_of_id[a->id] = i;
        if (a->special) t->is_special[a->id] = 1;
    }
    for (size_t e = 0; e < t->vocab.count; e++)
        if ((st = set_id_string(t, t->vocab.values[e], t->vocab.keys[e], t->vocab.key_lens[e]))) return st;
    /* byte-level: the id of each byte's stand-in character */
    t->byte_level_ids = 1;
    for (int b = 0; b < 256; b++) {
        char c[4];
        int n = tok_utf8_encode(tok_byte_to_cp[b], c);
        t->byte_char_id[b] = tok_strmap_get(&t->vocab, c, n);
        if (t->byte_char_id[b] < 0) t->byte_level_ids = 0;
    }
    return MRL_OK;
}

static int32_t config_token_id(mrl_tok *t, const mrl_json *cfg, const char *key) {
    mrl_json *v = mrl_json_get(cfg, key);
    const char *s = NULL;
    size_t len = 0;
    if (v && v->type == MRL_JSON_STRING) s = v->string, len = v->length;
    else if (v && v->type == MRL_JSON_OBJECT) s = str_member(v, "content", &len);
    return s ? mrl_tok_token_to_id(t, s, len) : -1;
}

mrl_status tok_load_json(mrl_tok *t, const char *file) {
    mrl_json_doc *doc;
    mrl_status st = mrl_json_parse_file(file, &doc);
    if (st) return st;
    mrl_json *root = mrl_json_root(doc);
    if (root->type != MRL_JSON_OBJECT) st = mrl_set_error(MRL_ERR_FORMAT, "%s: expected a JSON object", file);
    if (!st) st = load_model(t, mrl_json_get(root, "model"));
    if (!st) st = load_added(t, mrl_json_get(root, "added_tokens"));
    if (!st) st = build_id_tables(t);
    if (!st) st = load_normalizer(t, mrl_json_get(root, "normalizer"), "normalizer");
    if (!st) st = load_pretok(t, mrl_json_get(root, "pre_tokenizer"), "pre_tokenizer");
    if (!st) st = load_post(t, mrl_json_get(root, "post_processor"));
    if (!st) st = load_decoder(t, mrl_json_get(root, "decoder"), "decoder");
    for (int i = 0; !st && i < t->n_post_prefix + t->n_post_suffix; i++) {
        int32_t id = i < t->n_post_prefix ? t->post_prefix[i] : t->post_suffix[i - t->n_post_prefix];
        if (id >= t->n_ids || !t->id_str[id])
            st = mrl_set_error(MRL_ERR_FORMAT, "%s: post_processor: id %d is not in the vocabulary", file, (int)id);
    }
    mrl_json_free(doc);
    if (st) return st;
    t->bos_id = t->n_post_prefix ? t->post_prefix[0] : -1;
    t->eos_id = -1;
    /* tokenizer_config.json beside it names bos / eos */
    char cfg_path[600];
    snprintf(cfg_path, sizeof cfg_path, "%s", file);
    char *slash = strrchr(cfg_path, '/');
    snprintf(slash ? slash + 1 : cfg_path, sizeof cfg_path - (slash ? (size_t)(slash + 1 - cfg_path) : 0),
             "tokenizer_config.json");
    struct stat cfg_stat; /* (a FIFO there is refused by the parse, never opened) */
    if (stat(cfg_path, &cfg_stat) == 0) {
        if ((st = mrl_json_parse_file(cfg_path, &doc))) return st;
        int32_t bos = config_token_id(t, mrl_json_root(doc), "bos_token");
        int32_t eos = config_token_id(t, mrl_json_root(doc), "eos_token");
        if (bos >= 0) t->bos_id = bos;
        if (eos >= 0) t->eos_id = eos;
        mrl_json_free(doc);
    }
    return MRL_OK;
}

void tok_free_tables(mrl_tok *t) {
    for (int32_t i = 0; i < t->n_ids + 1 && t->id_str; i++) free(t->id_str[i]);
    free(t->id_str);
    free(t->id_len);
    free(t->is_special);
    free(t->skip_special);
    free(t->added_of_id);
    tok_strmap_free(&t->vocab);
    tok_strmap_free(&t->added_index);
    mrl_mem_free(t->merge_keys);
    mrl_mem_free(t->merge_rank);
    mrl_mem_free(t->merge_new);
    for (int i = 0; i < t->n_norms; i++) free(t->norms[i].a), free(t->norms[i].b);
    free(t->norms);
    for (int i = 0; i < t->n_pretoks; i++)
        if (t->pretoks[i].re) pcre2_code_free(t->pretoks[i].re);
    free(t->pretoks);
    for (int i = 0; i < t->n_decs; i++) free(t->decs[i].a), free(t->decs[i].b);
    free(t->decs);
    for (int i = 0; i < t->n_added; i++) {
        if (t->added[i].pattern != t->added[i].content) free(t->added[i].pattern);
        free(t->added[i].content);
    }
    free(t->added);
}
