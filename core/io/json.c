/* Recursive-descent JSON parser into an arena. Strict RFC 8259, plus the
 * NaN / Infinity literals that Python's json module writes. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "json.h"
#include "write.h"
#include "base/error.h"

#define MAX_DEPTH 512

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    char data[];
} arena_chunk;

struct mrl_json_doc {
    arena_chunk *chunks;
    mrl_json *root;
};

typedef struct parser {
    const char *text, *end, *at;
    const char *source;
    mrl_json_doc *doc;
    int depth;
    char error[512];
} parser;

static void *arena_alloc(mrl_json_doc *doc, size_t bytes) {
    bytes = (bytes + 15) & ~(size_t)15;
    arena_chunk *c = doc->chunks;
    if (!c || c->cap - c->used < bytes) {
        size_t cap = bytes > (1u << 20) ? bytes : (1u << 20);
        arena_chunk *fresh = malloc(sizeof(arena_chunk) + cap);
        if (!fresh) return NULL;
        fresh->next = c;
        fresh->used = 0;
        fresh->cap = cap;
        doc->chunks = fresh;
        c = fresh;
    }
    void *p = c->data + c->used;
    c->used += bytes;
    return p;
}

static int fail(parser *p, const char *what) {
    if (p->error[0]) return 0;
    int line = 1, col = 1;
    for (const char *s = p->text; s < p->at && s < p->end; s++) {
        if (*s == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    snprintf(p->error, sizeof p->error, "%s:%d:%d: %s", p->source, line, col, what);
    return 0;
}

static void skip_ws(parser *p) {
    while (p->at < p->end && (*p->at == ' ' || *p->at == '\t' || *p->at == '\n' || *p->at == '\r')) p->at++;
}

static int hex4(const char *s, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

static size_t put_utf8(char *out, unsigned cp) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Parse a string starting at the opening quote; the decoded bytes never
 * exceed the raw length, so one allocation of that size suffices. */
static int parse_string(parser *p, const char **out, size_t *out_len) {
    const char *s = ++p->at;
    const char *q = s;
    while (q < p->end && *q != '"') {
        if (*q == '\\') q++;
        q++;
    }
    if (q >= p->end) return fail(p, "unterminated string");
    char *buf = arena_alloc(p->doc, (size_t)(q - s) + 1);
    if (!buf) return fail(p, "out of memory");
    size_t n = 0;
    while (p->at < q) {
        unsigned char c = (unsigned char)*p->at;
        if (c < 0x20) return fail(p, "control character in string");
        if (c != '\\') {
            buf[n++] = (char)c;
            p->at++;
            continue;
        }
        p->at++;
        char e = *p->at++;
        switch (e) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
            unsigned cp;
            if (q - p->at < 4 || !hex4(p->at, &cp)) return fail(p, "bad \\u escape");
            p->at += 4;
            if (cp >= 0xD800 && cp < 0xDC00 && q - p->at >= 6 && p->at[0] == '\\' && p->at[1] == 'u') {
                unsigned lo;
                if (hex4(p->at + 2, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    p->at += 6;
                }
            }
            /* a lone surrogate is kept as its 3-byte form (Python's surrogatepass) */
            n += put_utf8(buf + n, cp);
            break;
        }
        default: p->at--; return fail(p, "bad escape in string");
        }
    }
    buf[n] = 0;
    p->at = q + 1;
    *out = buf;
    *out_len = n;
    return 1;
}

static mrl_json *new_value(parser *p, mrl_json_type type) {
    mrl_json *v = arena_alloc(p->doc, sizeof *v);
    if (!v) {
        fail(p, "out of memory");
        return NULL;
    }
    memset(v, 0, sizeof *v);
    v->type = type;
    return v;
}

static mrl_json *parse_value(parser *p);

/* Items are gathered in a growable temporary array, then copied into the arena. */
typedef struct item_list {
    mrl_json **items;
    const char **keys;
    size_t *key_lengths;
    size_t count, cap;
} item_list;

static int list_push(item_list *l, mrl_json *item, const char *key, size_t key_len) {
    if (l->count == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        mrl_json **items = realloc(l->items, cap * sizeof *items);
        if (!items) return 0;
        l->items = items;
        const char **keys = realloc(l->keys, cap * sizeof *keys);
        if (!keys) return 0;
        l->keys = keys;
        size_t *lens = realloc(l->key_lengths, cap * sizeof *lens);
        if (!lens) return 0;
        l->key_lengths = lens;
        l->cap = cap;
    }
    l->items[l->count] = item;
    l->keys[l->count] = key;
    l->key_lengths[l->count] = key_len;
    l->count++;
    return 1;
}

static int list_finish(parser *p, item_list *l, mrl_json *v, int with_keys) {
    v->length = l->count;
    int ok = 1;
    if (l->count) {
        v->items = arena_alloc(p->doc, l->count * sizeof *v->items);
        if (v->items) memcpy(v->items, l->items, l->count * sizeof *v->items);
        else ok = 0;
        if (ok && with_keys) {
            v->keys = arena_alloc(p->doc, l->count * sizeof *v->keys);
            v->key_lengths = arena_alloc(p->doc, l->count * sizeof *v->key_lengths);
            if (v->keys && v->key_lengths) {
                memcpy(v->keys, l->keys, l->count * sizeof *v->keys);
                memcpy(v->key_lengths, l->key_lengths, l->count * sizeof *v->key_lengths);
            } else {
                ok = 0;
            }
        }
    }
    free(l->items);
    free(l->keys);
    free(l->key_lengths);
    return ok ? 1 : fail(p, "out of memory");
}

static mrl_json *parse_container(parser *p, int is_object) {
    mrl_json *v = new_value(p, is_object ? MRL_JSON_OBJECT : MRL_JSON_ARRAY);
    if (!v) return NULL;
    if (++p->depth > MAX_DEPTH) {
        fail(p, "nesting too deep");
        return NULL;
    }
    char close = is_object ? '}' : ']';
    item_list list = {0};
    p->at++;
    skip_ws(p);
    if (p->at < p->end && *p->at == close) {
        p->at++;
    } else {
        for (;;) {
            const char *key = NULL;
            size_t key_len = 0;
            skip_ws(p);
            if (is_object) {
                if (p->at >= p->end || *p->at != '"') {
                    fail(p, "expected a string key");
                    break;
                }
                if (!parse_string(p, &key, &key_len)) break;
                skip_ws(p);
                if (p->at >= p->end || *p->at != ':') {
                    fail(p, "expected ':' after key");
                    break;
                }
                p->at++;
            }
            mrl_json *item = parse_value(p);
            if (!item) break;
            if (!list_push(&list, item, key, key_len)) {
                fail(p, "out of memory");
                break;
            }
            skip_ws(p);
            if (p->at < p->end && *p->at == ',') {
                p->at++;
                continue;
            }
            if (p->at < p->end && *p->at == close) {
                p->at++;
                break;
            }
            fail(p, is_object ? "expected ',' or '}'" : "expected ',' or ']'");
            break;
        }
    }
    p->depth--;
    if (!list_finish(p, &list, v, is_object) || p->error[0]) return NULL;
    return v;
}

static int match_word(parser *p, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(p->end - p->at) >= n && memcmp(p->at, word, n) == 0) {
        p->at += n;
        return 1;
    }
    return 0;
}

static mrl_json *parse_number(parser *p) {
    const char *s = p->at;
    int integer = 1;
    if (s < p->end && *s == '-') s++;
    if (s >= p->end || *s < '0' || *s > '9') {
        fail(p, "unexpected character");
        return NULL;
    }
    if (*s == '0' && s + 1 < p->end && s[1] >= '0' && s[1] <= '9') {
        fail(p, "leading zero in number");
        return NULL;
    }
    while (s < p->end && *s >= '0' && *s <= '9') s++;
    if (s < p->end && *s == '.') {
        integer = 0;
        s++;
        if (s >= p->end || *s < '0' || *s > '9') {
            p->at = s;
            fail(p, "digit expected after '.'");
            return NULL;
        }
        while (s < p->end && *s >= '0' && *s <= '9') s++;
    }
    if (s < p->end && (*s == 'e' || *s == 'E')) {
        integer = 0;
        s++;
        if (s < p->end && (*s == '+' || *s == '-')) s++;
        if (s >= p->end || *s < '0' || *s > '9') {
            p->at = s;
            fail(p, "digit expected in exponent");
            return NULL;
        }
        while (s < p->end && *s >= '0' && *s <= '9') s++;
    }
    char tmp[64];
    size_t n = (size_t)(s - p->at);
    mrl_json *v = new_value(p, MRL_JSON_NUMBER);
    if (!v) return NULL;
    if (n < sizeof tmp) {
        memcpy(tmp, p->at, n);
        tmp[n] = 0;
        v->number = strtod(tmp, NULL);
        if (integer) {
            errno = 0;
            long long ll = strtoll(tmp, NULL, 10);
            if (errno == 0) {
                v->is_integer = 1;
                v->integer = ll;
            }
        }
    } else {
        char *big = malloc(n + 1);
        if (!big) {
            fail(p, "out of memory");
            return NULL;
        }
        memcpy(big, p->at, n);
        big[n] = 0;
        v->number = strtod(big, NULL);
        free(big);
    }
    p->at = s;
    return v;
}

static mrl_json *parse_value(parser *p) {
    skip_ws(p);
    if (p->at >= p->end) {
        fail(p, "unexpected end of input");
        return NULL;
    }
    char c = *p->at;
    if (c == '{') return parse_container(p, 1);
    if (c == '[') return parse_container(p, 0);
    if (c == '"') {
        mrl_json *v = new_value(p, MRL_JSON_STRING);
        if (!v || !parse_string(p, &v->string, &v->length)) return NULL;
        return v;
    }
    mrl_json *v = NULL;
    if (match_word(p, "true") || match_word(p, "false")) {
        v = new_value(p, MRL_JSON_BOOL);
        if (v) v->number = p->at[-1] == 'e' && p->at[-2] == 'u';
        return v;
    }
    if (match_word(p, "null")) return new_value(p, MRL_JSON_NULL);
    if (match_word(p, "NaN")) {
        v = new_value(p, MRL_JSON_NUMBER);
        if (v) v->number = NAN;
        return v;
    }
    int negative = match_word(p, "-Infinity");
    if (negative || match_word(p, "Infinity")) {
        v = new_value(p, MRL_JSON_NUMBER);
        if (v) v->number = negative ? -INFINITY : INFINITY;
        return v;
    }
    return parse_number(p);
}

mrl_status mrl_json_parse(const char *text, size_t len, const char *source, mrl_json_doc **out) {
    *out = NULL;
    mrl_json_doc *doc = calloc(1, sizeof *doc);
    if (!doc) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    parser p = {text, text + len, text, source ? source : "<json>", doc, 0, {0}};
    doc->root = parse_value(&p);
    if (doc->root) {
        skip_ws(&p);
        if (p.at < p.end) fail(&p, "unexpected content after the JSON value");
    }
    if (p.error[0] || !doc->root) {
        mrl_json_free(doc);
        return mrl_set_error(MRL_ERR_FORMAT, "%s", p.error[0] ? p.error : "invalid JSON");
    }
    *out = doc;
    return MRL_OK;
}

mrl_status mrl_json_parse_file(const char *path, mrl_json_doc **out) {
    *out = NULL;
    FILE *f;
    mrl_status opened = mrl_io_fopen_read(path, &f);
    if (opened) return opened;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (cap - len < 65536) {
            cap = cap ? cap * 2 : 1 << 20;
            char *grown = realloc(buf, cap);
            if (!grown) {
                free(buf);
                fclose(f);
                return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory reading", path);
            }
            buf = grown;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
    }
    int read_error = ferror(f);
    fclose(f);
    if (read_error) {
        free(buf);
        return mrl_set_error(MRL_ERR_IO, "%s: read error", path);
    }
    mrl_status st = mrl_json_parse(buf, len, path, out);
    free(buf);
    return st;
}

mrl_json *mrl_json_root(mrl_json_doc *doc) { return doc ? doc->root : NULL; }

void mrl_json_free(mrl_json_doc *doc) {
    if (!doc) return;
    arena_chunk *c = doc->chunks;
    while (c) {
        arena_chunk *next = c->next;
        free(c);
        c = next;
    }
    free(doc);
}

mrl_json *mrl_json_get(const mrl_json *obj, const char *key) {
    if (!obj || obj->type != MRL_JSON_OBJECT) return NULL;
    size_t n = strlen(key);
    /* the last duplicate wins, as in Python's json */
    for (size_t i = obj->length; i-- > 0;)
        if (obj->key_lengths[i] == n && memcmp(obj->keys[i], key, n) == 0) return obj->items[i];
    return NULL;
}

int mrl_json_get_number(const mrl_json *obj, const char *key, double *out) {
    mrl_json *v = mrl_json_get(obj, key);
    if (!v || v->type != MRL_JSON_NUMBER) return 0;
    *out = v->number;
    return 1;
}

int mrl_json_get_int(const mrl_json *obj, const char *key, int64_t *out) {
    mrl_json *v = mrl_json_get(obj, key);
    if (!v || v->type != MRL_JSON_NUMBER || !v->is_integer) return 0;
    *out = v->integer;
    return 1;
}

int mrl_json_get_bool(const mrl_json *obj, const char *key, int *out) {
    mrl_json *v = mrl_json_get(obj, key);
    if (!v || v->type != MRL_JSON_BOOL) return 0;
    *out = v->number != 0;
    return 1;
}

const char *mrl_json_get_string(const mrl_json *obj, const char *key) {
    mrl_json *v = mrl_json_get(obj, key);
    return v && v->type == MRL_JSON_STRING ? v->string : NULL;
}
