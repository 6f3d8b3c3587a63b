/* Unicode NFC for the tokenizer's NFC normalizer: canonical decomposition,
 * canonical ordering, canonical composition (UAX #15), with the data of
 * nfc_tables.h. Text without any character that NFC could change (nearly
 * all text) is returned as is after one scan. */
#include <stdlib.h>
#include <string.h>
#include "nfc_tables.h"
#include "tok_internal.h"

#define N_OF(a) (sizeof(a) / sizeof(a)[0])

enum { S_BASE = 0xAC00, L_BASE = 0x1100, V_BASE = 0x1161, T_BASE = 0x11A7, L_COUNT = 19, V_COUNT = 21, T_COUNT = 28,
       N_COUNT = V_COUNT * T_COUNT, S_COUNT = L_COUNT * N_COUNT };

static int interesting(uint32_t cp) {
    size_t lo = 0, hi = N_OF(nfc_ranges);
    if (cp < nfc_ranges[0][0]) return 0;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < nfc_ranges[mid][0]) hi = mid;
        else if (cp > nfc_ranges[mid][1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

static uint32_t ccc(uint32_t cp) {
    size_t lo = 0, hi = N_OF(nfc_ccc);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < nfc_ccc[mid][0]) hi = mid;
        else if (cp > nfc_ccc[mid][0]) lo = mid + 1;
        else return nfc_ccc[mid][1];
    }
    return 0;
}

static const uint32_t *decomposition(uint32_t cp, uint32_t *n) {
    size_t lo = 0, hi = N_OF(nfc_decomp);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < nfc_decomp[mid][0]) hi = mid;
        else if (cp > nfc_decomp[mid][0]) lo = mid + 1;
        else {
            *n = nfc_decomp[mid][2];
            return nfc_decomp_pool + nfc_decomp[mid][1];
        }
    }
    return NULL;
}

/* The primary composite of a + b, or 0. */
static uint32_t compose(uint32_t a, uint32_t b) {
    if (a >= L_BASE && a < L_BASE + L_COUNT && b >= V_BASE && b < V_BASE + V_COUNT)
        return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT;
    if (a >= S_BASE && a < S_BASE + S_COUNT && (a - S_BASE) % T_COUNT == 0 && b > T_BASE && b < T_BASE + T_COUNT)
        return a + (b - T_BASE);
    size_t lo = 0, hi = N_OF(nfc_comp);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (a < nfc_comp[mid][0] || (a == nfc_comp[mid][0] && b < nfc_comp[mid][1])) hi = mid;
        else if (a > nfc_comp[mid][0] || b > nfc_comp[mid][1]) lo = mid + 1;
        else return nfc_comp[mid][2];
    }
    return 0;
}

typedef struct cps {
    uint32_t *data;
    size_t len, cap;
} cps;

static int cps_push(cps *v, uint32_t cp) {
    if (v->len == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 256;
        uint32_t *d = realloc(v->data, cap * sizeof *d);
        if (!d) return 0;
        v->data = d, v->cap = cap;
    }
    v->data[v->len++] = cp;
    return 1;
}

int tok_nfc(const char *s, size_t len, tok_arena *a, const char **out, size_t *out_len) {
    *out = s, *out_len = len;
    size_t i = 0;
    for (; i < len;) {
        if ((unsigned char)s[i] < 0xCC) { /* below U+0300: nothing to do */
            i += (unsigned char)s[i] < 0x80 ? 1 : 2;
            continue;
        }
        uint32_t cp;
        int n = tok_utf8_decode(s + i, &cp);
        if (interesting(cp)) break;
        i += (size_t)n;
    }
    if (i >= len) return 1;
    /* decompose everything, then reorder and compose */
    cps v = { 0 };
    int ok = 1;
    for (size_t j = 0; ok && j < len;) {
        uint32_t cp, dn;
        j += (size_t)tok_utf8_decode(s + j, &cp);
        const uint32_t *d;
        if (cp >= S_BASE && cp < S_BASE + S_COUNT) {
            uint32_t si = cp - S_BASE;
            ok = cps_push(&v, L_BASE + si / N_COUNT) && cps_push(&v, V_BASE + (si % N_COUNT) / T_COUNT);
            if (ok && si % T_COUNT) ok = cps_push(&v, T_BASE + si % T_COUNT);
        } else if ((d = decomposition(cp, &dn))) {
            for (uint32_t k = 0; ok && k < dn; k++) ok = cps_push(&v, d[k]);
        } else {
            ok = cps_push(&v, cp);
        }
    }
    /* canonical ordering: a stable sort of each run of non-starters by class */
    for (size_t j = 1; ok && j < v.len; j++) {
        uint32_t c = v.data[j], cc = ccc(c);
        if (!cc) continue;
        size_t k = j;
        while (k > 0 && ccc(v.data[k - 1]) > cc) {
            v.data[k] = v.data[k - 1];
            k--;
        }
        v.data[k] = c;
    }
    /* canonical composition */
    size_t w = 0;
    if (ok && v.len) {
        size_t starter = 0;
        uint32_t last = ccc(v.data[0]) ? 256 : 0;
        w = 1;
        for (size_t j = 1; j < v.len; j++) {
            uint32_t c = v.data[j], cc = ccc(c), comp = compose(v.data[starter], c);
            if (comp && (last < cc || last == 0)) {
                v.data[starter] = comp;
                continue;
            }
            if (cc == 0) starter = w;
            last = cc;
            v.data[w++] = c;
        }
    }
    char *d = ok ? tok_arena_alloc(a, w * 4 + 1) : NULL;
    if (d) {
        char *o = d;
        for (size_t j = 0; j < w; j++) o += tok_utf8_encode(v.data[j], o);
        *out = d, *out_len = (size_t)(o - d);
    }
    free(v.data);
    return d != NULL;
}
