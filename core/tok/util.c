/* Shared helpers of the tokenizer: buffers, a string hash map, UTF-8
 * checking and lossy repair, the byte-level alphabet, a scratch arena. */
#include <stdlib.h>
#include <string.h>
#include "tok_internal.h"

int tok_buf_reserve(tok_buf *b, size_t extra) {
    if (b->cap - b->len >= extra) return 1;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < extra) cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) return 0;
    b->data = d;
    b->cap = cap;
    return 1;
}

int tok_buf_put(tok_buf *b, const void *p, size_t n) {
    if (!tok_buf_reserve(b, n + 1)) return 0;
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    return 1;
}

void tok_buf_free(tok_buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

int tok_ids_push(tok_ids *v, int32_t id) {
    if (v->len == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *d = realloc(v->data, cap * sizeof *d);
        if (!d) return 0;
        v->data = d;
        v->cap = cap;
    }
    v->data[v->len++] = id;
    return 1;
}

void tok_ids_free(tok_ids *v) {
    free(v->data);
    memset(v, 0, sizeof *v);
}

int tok_pieces_push(tok_pieces *p, const char *s, size_t len, int first, int bytelevel) {
    if (p->len == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        tok_piece *d = realloc(p->data, cap * sizeof *d);
        if (!d) return 0;
        p->data = d;
        p->cap = cap;
    }
    p->data[p->len++] = (tok_piece){ s, len, first, bytelevel };
    return 1;
}

/* ---- hash map ---- */

uint64_t tok_hash(const char *s, size_t len) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    uint64_t w = 0;
    memcpy(&w, s + i, len - i);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    return h;
}

int tok_strmap_init(tok_strmap *m, size_t expected) {
    memset(m, 0, sizeof *m);
    size_t slots = 16;
    while (slots < expected * 2) slots *= 2;
    m->slots = calloc(slots, sizeof *m->slots);
    m->mask = slots - 1;
    return m->slots != NULL;
}

static int strmap_grow(tok_strmap *m) {
    size_t slots = (m->mask + 1) * 2;
    uint32_t *fresh = calloc(slots, sizeof *fresh);
    if (!fresh) return 0;
    for (size_t e = 0; e < m->count; e++) {
        size_t i = tok_hash(m->keys[e], m->key_lens[e]) & (slots - 1);
        while (fresh[i]) i = (i + 1) & (slots - 1);
        fresh[i] = (uint32_t)e + 1;
    }
    free(m->slots);
    m->slots = fresh;
    m->mask = slots - 1;
    return 1;
}

int tok_strmap_put(tok_strmap *m, const char *k, size_t len, int32_t value) {
    size_t i = tok_hash(k, len) & m->mask;
    while (m->slots[i]) {
        uint32_t e = m->slots[i] - 1;
        if (m->key_lens[e] == len && memcmp(m->keys[e], k, len) == 0) {
            m->values[e] = value;
            return 1;
        }
        i = (i + 1) & m->mask;
    }
    if (m->count == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 64;
        char **keys = realloc(m->keys, cap * sizeof *keys);
        if (!keys) return 0;
        m->keys = keys;
        uint32_t *lens = realloc(m->key_lens, cap * sizeof *lens);
        if (!lens) return 0;
        m->key_lens = lens;
        int32_t *vals = realloc(m->values, cap * sizeof *vals);
        if (!vals) return 0;
        m->values = vals;
        m->cap = cap;
    }
    char *copy = malloc(len + 1);
    if (!copy) return 0;
    memcpy(copy, k, len);
    copy[len] = 0;
    size_t e = m->count++;
    m->keys[e] = copy;
    m->key_lens[e] = (uint32_t)len;
    m->values[e] = value;
    m->slots[i] = (uint32_t)e + 1;
    if (m->count * 2 > m->mask + 1) return strmap_grow(m);
    return 1;
}

int32_t tok_strmap_get(const tok_strmap *m, const char *k, size_t len) {
    if (!m->slots) return -1;
    size_t i = tok_hash(k, len) & m->mask;
    while (m->slots[i]) {
        uint32_t e = m->slots[i] - 1;
        if (m->key_lens[e] == len && memcmp(m->keys[e], k, len) == 0) return m->values[e];
        i = (i + 1) & m->mask;
    }
    return -1;
}

void tok_strmap_free(tok_strmap *m) {
    for (size_t e = 0; e < m->count; e++) free(m->keys[e]);
    free(m->keys);
    free(m->key_lens);
    free(m->values);
    free(m->slots);
    memset(m, 0, sizeof *m);
}

/* ---- UTF-8 ---- */

int tok_utf8_valid_at(const unsigned char *s, size_t avail, size_t *skip) {
    unsigned c = s[0];
    *skip = 1;
    if (c < 0x80) return 1;
    int n;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return 0;
    /* the maximal subpart: the lead byte plus each continuation that fits */
    size_t i = 1;
    for (; i < (size_t)n; i++) {
        if (i >= avail) break;
        unsigned d = s[i];
        if (i == 1 ? (d < lo || d > hi) : (d < 0x80 || d > 0xBF)) break;
    }
    if (i == (size_t)n) return n;
    *skip = i;
    return 0;
}

int tok_utf8_is_valid(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, skip;
    while (i < len) {
        if (u[i] < 0x80) { i++; continue; }
        int n = tok_utf8_valid_at(u + i, len - i, &skip);
        if (!n) return 0;
        i += n;
    }
    return 1;
}

int tok_utf8_lossy(const char *src, size_t len, tok_buf *dst) {
    const unsigned char *u = (const unsigned char *)src;
    size_t i = 0, skip;
    if (!tok_buf_reserve(dst, len + 1)) return 0;
    while (i < len) {
        int n = u[i] < 0x80 ? 1 : tok_utf8_valid_at(u + i, len - i, &skip);
        if (n) {
            if (!tok_buf_put(dst, src + i, n)) return 0;
            i += n;
        } else {
            if (!tok_buf_put(dst, "\xEF\xBF\xBD", 3)) return 0;
            i += skip;
        }
    }
    return 1;
}

int tok_utf8_decode(const char *s, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    if (u[0] < 0x80) { *cp = u[0]; return 1; }
    if (u[0] < 0xE0) { *cp = ((u[0] & 0x1Fu) << 6) | (u[1] & 0x3Fu); return 2; }
    if (u[0] < 0xF0) { *cp = ((u[0] & 0x0Fu) << 12) | ((u[1] & 0x3Fu) << 6) | (u[2] & 0x3Fu); return 3; }
    *cp = ((u[0] & 0x07u) << 18) | ((u[1] & 0x3Fu) << 12) | ((u[2] & 0x3Fu) << 6) | (u[3] & 0x3Fu);
    return 4;
}

int tok_utf8_encode(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { o[0] = 0xC0 | (cp >> 6); o[1] = 0x80 | (cp & 0x3F); return 2; }
    if (cp < 0x10000) {
        o[0] = 0xE0 | (cp >> 12); o[1] = 0x80 | ((cp >> 6) & 0x3F); o[2] = 0x80 | (cp & 0x3F);
        return 3;
    }
    o[0] = 0xF0 | (cp >> 18); o[1] = 0x80 | ((cp >> 12) & 0x3F);
    o[2] = 0x80 | ((cp >> 6) & 0x3F); o[3] = 0x80 | (cp & 0x3F);
    return 4;
}

/* Unicode White_Space (what Rust's char::is_whitespace and str::trim use). */
int tok_is_whitespace(uint32_t cp) {
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return 1;
    if (cp < 0x85) return 0;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* ---- byte-level alphabet (GPT-2): printable bytes stand for themselves,
 * the others for 256, 257, ... in byte order ---- */

uint32_t tok_byte_to_cp[256];
static int16_t cp_to_byte_small[512];
static pthread_once_t byte_level_once = PTHREAD_ONCE_INIT;

static void byte_level_build(void) {
    uint32_t next = 256;
    for (int i = 0; i < 512; i++) cp_to_byte_small[i] = -1;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        tok_byte_to_cp[b] = printable ? (uint32_t)b : next++;
        cp_to_byte_small[tok_byte_to_cp[b]] = (int16_t)b;
    }
}

void tok_byte_level_init(void) { pthread_once(&byte_level_once, byte_level_build); }

int tok_cp_to_byte(uint32_t cp) { return cp < 512 ? cp_to_byte_small[cp] : -1; }

/* ---- arena ---- */

struct tok_arena_block {
    tok_arena_block *next;
    size_t used, cap;
    char data[];
};

char *tok_arena_alloc(tok_arena *a, size_t n) {
    tok_arena_block *b = a->head;
    if (!b || b->cap - b->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        tok_arena_block *f = malloc(sizeof *f + cap);
        if (!f) return NULL;
        f->next = b;
        f->used = 0;
        f->cap = cap;
        a->head = b = f;
    }
    char *p = b->data + b->used;
    b->used += n;
    return p;
}

void tok_arena_free(tok_arena *a) {
    tok_arena_block *b = a->head;
    while (b) {
        tok_arena_block *n = b->next;
        free(b);
        b = n;
    }
    a->head = NULL;
}
