/* GGUF reader (moonrl/gguf.h).
 *
 * Layout (GGUF v2 and v3, little-endian):
 *   "GGUF" u32 version u64 n_tensors u64 n_kv
 *   n_kv x   { string key, u32 type, value }       string = u64 len + bytes
 *            value: a scalar, a string, or u32 elem_type u64 count elems
 *   n_tensors x { string name, u32 n_dims, u64 dims[n_dims], u32 type, u64 offset }
 *   padding to general.alignment (default 32), then the tensor data; each
 *   tensor's offset is relative to the data's start and aligned.
 *
 * The header is read into one buffer (pread, growing as the parse goes), and
 * every length is checked against what is left of the file before anything
 * is allocated or read, so a corrupt count cannot ask for terabytes. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "moonrl/dtype.h"
#include "moonrl/gguf.h"
#include "kernels.h"
#include "base/parallel.h"
#include "io/write.h"
#include "base/error.h"

enum { GGUF_MAX_DIMS = 4, DEFAULT_ALIGNMENT = 32 };

typedef struct gguf_kv {
    char *key;
    int type;           /* the value's type */
    int elem_type;      /* arrays: the elements' type */
    int64_t count;      /* arrays: elements */
    int64_t at;         /* offset of the value (arrays: of the first element) in the header buffer */
    int64_t *str_at;    /* arrays of strings: offset of each element's u64 length */
} gguf_kv;

struct mrl_gguf {
    char *path;
    int fd;
    int64_t file_size;
    int version;
    uint8_t *hdr;       /* the header bytes [0, hdr_len) */
    int64_t hdr_len, hdr_cap;
    gguf_kv *kv;
    int64_t n_kv;
    mrl_gguf_tensor *tensors;
    int64_t n_tensors;
    int64_t data_start;
};

/* ---- types ---- */

typedef struct type_info {
    const char *name;
    int64_t block, bytes;
} type_info;

static const type_info *type_of(int t) {
    static const type_info f32 = {"F32", 1, 4}, f16 = {"F16", 1, 2}, bf16 = {"BF16", 1, 2},
                           q4_0 = {"Q4_0", 32, 18}, q4_1 = {"Q4_1", 32, 20}, q8_0 = {"Q8_0", 32, 34},
                           q4_k = {"Q4_K", 256, 144}, q5_k = {"Q5_K", 256, 176}, q6_k = {"Q6_K", 256, 210};
    switch (t) {
    case MRL_GGML_F32: return &f32;
    case MRL_GGML_F16: return &f16;
    case MRL_GGML_BF16: return &bf16;
    case MRL_GGML_Q4_0: return &q4_0;
    case MRL_GGML_Q4_1: return &q4_1;
    case MRL_GGML_Q8_0: return &q8_0;
    case MRL_GGML_Q4_K: return &q4_k;
    case MRL_GGML_Q5_K: return &q5_k;
    case MRL_GGML_Q6_K: return &q6_k;
    default: return NULL;
    }
}

/* Bytes of a scalar value type (0: not a fixed-size scalar). */
static int64_t scalar_bytes(int t) {
    switch (t) {
    case MRL_GGUF_UINT8: case MRL_GGUF_INT8: case MRL_GGUF_BOOL: return 1;
    case MRL_GGUF_UINT16: case MRL_GGUF_INT16: return 2;
    case MRL_GGUF_UINT32: case MRL_GGUF_INT32: case MRL_GGUF_FLOAT32: return 4;
    case MRL_GGUF_UINT64: case MRL_GGUF_INT64: case MRL_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* ---- the header cursor ---- */

typedef struct cursor {
    mrl_gguf *g;
    int64_t pos;
    const char *what; /* the field being read, for errors */
} cursor;

static mrl_status bad(const mrl_gguf *g, const char *fmt, const char *what, long long a, long long b) {
    char msg[256];
    snprintf(msg, sizeof msg, fmt, a, b);
    return mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: %s: %s", g->path, what, msg);
}

/* Make header bytes [c->pos, c->pos + n) available (read from the file). */
static mrl_status need(cursor *c, int64_t n) {
    mrl_gguf *g = c->g;
    if (n < 0 || c->pos + n > g->file_size)
        return bad(g, "needs %lld bytes at offset %lld, past the end of the file", c->what, (long long)n,
                   (long long)c->pos);
    int64_t end = c->pos + n;
    if (end <= g->hdr_len) return MRL_OK;
    if (end > g->hdr_cap) {
        int64_t cap = g->hdr_cap ? g->hdr_cap : 1 << 16;
        while (cap < end) cap *= 2;
        if (cap > g->file_size) cap = g->file_size;
        uint8_t *p = realloc(g->hdr, (size_t)cap);
        if (!p) return mrl_set_error(MRL_ERR_NOMEM, "%s: no memory for a GGUF header of %lld bytes", g->path,
                                     (long long)cap);
        g->hdr = p;
        g->hdr_cap = cap;
    }
    /* read ahead up to the buffer's end: the parse goes forward */
    int err;
    g->hdr_len += mrl_io_pread_all(g->fd, g->hdr + g->hdr_len, g->hdr_cap - g->hdr_len, g->hdr_len, &err);
    if (end > g->hdr_len)
        return mrl_set_error(MRL_ERR_IO, "%s: read failed at offset %lld (the file was cut short?)", g->path,
                             (long long)g->hdr_len);
    return MRL_OK;
}

static mrl_status get_u32(cursor *c, uint32_t *v) {
    mrl_status st = need(c, 4);
    if (st) return st;
    memcpy(v, c->g->hdr + c->pos, 4);
    c->pos += 4;
    return MRL_OK;
}

static mrl_status get_u64(cursor *c, uint64_t *v) {
    mrl_status st = need(c, 8);
    if (st) return st;
    memcpy(v, c->g->hdr + c->pos, 8);
    c->pos += 8;
    return MRL_OK;
}

/* A string: its bytes' offset in the header and its length (skipped over). */
static mrl_status get_string(cursor *c, int64_t *at, int64_t *len) {
    uint64_t n;
    mrl_status st = get_u64(c, &n);
    if (st) return st;
    if (n > (uint64_t)(c->g->file_size - c->pos))
        return bad(c->g, "a string of %lld bytes at offset %lld runs past the end of the file", c->what,
                   (long long)n, (long long)c->pos);
    if ((st = need(c, (int64_t)n))) return st;
    *at = c->pos;
    *len = (int64_t)n;
    c->pos += (int64_t)n;
    return MRL_OK;
}

static char *copy_string(const mrl_gguf *g, int64_t at, int64_t len) {
    char *s = malloc((size_t)len + 1);
    if (s) {
        memcpy(s, g->hdr + at, (size_t)len);
        s[len] = 0;
    }
    return s;
}

/* ---- parse ---- */

static mrl_status parse_value(cursor *c, gguf_kv *kv) {
    mrl_gguf *g = c->g;
    mrl_status st;
    if (kv->type == MRL_GGUF_STRING) {
        int64_t at, len;
        if ((st = get_string(c, &at, &len))) return st;
        kv->at = at - 8; /* the u64 length before the bytes */
        return MRL_OK;
    }
    if (kv->type != MRL_GGUF_ARRAY) {
        int64_t n = scalar_bytes(kv->type);
        if (!n) return bad(g, "value type %lld of key %lld is unknown", c->what, kv->type, 0);
        if ((st = need(c, n))) return st;
        kv->at = c->pos;
        c->pos += n;
        return MRL_OK;
    }
    uint32_t et;
    uint64_t count;
    if ((st = get_u32(c, &et)) || (st = get_u64(c, &count))) return st;
    kv->elem_type = (int)et;
    int64_t left = g->file_size - c->pos;
    if (et == MRL_GGUF_STRING) {
        if (count > (uint64_t)left / 8)
            return bad(g, "an array of %lld strings cannot fit in the %lld bytes left", c->what, (long long)count,
                       (long long)left);
        kv->count = (int64_t)count;
        kv->str_at = malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
        if (!kv->str_at) return mrl_set_error(MRL_ERR_NOMEM, "%s: no memory for %lld strings", g->path, (long long)count);
        for (uint64_t j = 0; j < count; j++) {
            int64_t at, len;
            kv->str_at[j] = c->pos;
            if ((st = get_string(c, &at, &len))) return st;
        }
        return MRL_OK;
    }
    int64_t size = scalar_bytes((int)et);
    if (!size) return bad(g, "array element type %lld is not supported (nested arrays?)%lld", c->what, et, 0);
    if (count > (uint64_t)left / (uint64_t)size)
        return bad(g, "an array of %lld elements cannot fit in the %lld bytes left", c->what, (long long)count,
                   (long long)left);
    kv->count = (int64_t)count;
    if ((st = need(c, (int64_t)count * size))) return st;
    kv->at = c->pos;
    c->pos += (int64_t)count * size;
    return MRL_OK;
}

static mrl_status parse_tensor(cursor *c, mrl_gguf_tensor *t) {
    mrl_gguf *g = c->g;
    int64_t at, len;
    mrl_status st = get_string(c, &at, &len);
    if (st) return st;
    if (!(t->name = copy_string(g, at, len))) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", g->path);
    uint32_t nd, type;
    if ((st = get_u32(c, &nd))) return st;
    if (nd < 1 || nd > GGUF_MAX_DIMS)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: tensor '%s' has %u dimensions (1..4)",
                             g->path, t->name, nd);
    t->ndim = (int)nd;
    t->numel = 1;
    for (uint32_t d = 0; d < nd; d++) {
        uint64_t n;
        if ((st = get_u64(c, &n))) return st;
        if (n < 1 || n > ((uint64_t)1 << 40) || (uint64_t)t->numel > ((uint64_t)1 << 50) / n)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: tensor '%s' dimension %u is %llu",
                                 g->path, t->name, d, (unsigned long long)n);
        t->shape[d] = (int64_t)n;
        t->numel *= (int64_t)n;
    }
    for (int d = t->ndim; d < GGUF_MAX_DIMS; d++) t->shape[d] = 1;
    uint64_t off;
    if ((st = get_u32(c, &type)) || (st = get_u64(c, &off))) return st;
    const type_info *ti = type_of((int)type);
    if (!ti)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: tensor '%s' has ggml type %u, which moonrl does not read "
                             "(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)", g->path, t->name, type);
    if (t->shape[0] % ti->block)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: tensor '%s' (%s) has rows of %lld, not a "
                             "multiple of its block of %lld", g->path, t->name, ti->name, (long long)t->shape[0],
                             (long long)ti->block);
    t->type = (int)type;
    t->type_name = ti->name;
    t->bytes = t->numel / ti->block * ti->bytes;
    t->offset = (int64_t)(off > ((uint64_t)1 << 62) ? ((uint64_t)1 << 62) : off); /* checked against the file below */
    return MRL_OK;
}

/* Tensor i is not where the running size says (data offsets, before data_start is added):
 * name the tensor it overlaps when there is one, else the offset it should have. */
static mrl_status misplaced(const mrl_gguf *g, int64_t i, int64_t expect) {
    const mrl_gguf_tensor *t = &g->tensors[i];
    for (int64_t j = 0; j < i; j++) {
        const mrl_gguf_tensor *o = &g->tensors[j];
        if (t->offset < o->offset + o->bytes && o->offset < t->offset + t->bytes)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: tensors '%s' (%s, %lld bytes at data "
                                 "offset %lld) and '%s' (%s, %lld bytes at data offset %lld) overlap: two tensors "
                                 "on the same bytes, or a type or shape that makes one longer than its place",
                                 g->path, o->name, o->type_name, (long long)o->bytes, (long long)o->offset, t->name,
                                 t->type_name, (long long)t->bytes, (long long)t->offset);
    }
    return mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: tensor '%s' is at data offset %lld, expected "
                         "%lld (each tensor starts where the one before it ends, aligned, as llama.cpp requires)",
                         g->path, t->name, (long long)t->offset, (long long)expect);
}

static int cmp_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The first of n names that appears twice (sorted, so a file of millions of them stays fast), or NULL. */
static const char *duplicate(const char **names, int64_t n) {
    qsort(names, (size_t)n, sizeof *names, cmp_name);
    for (int64_t i = 1; i < n; i++)
        if (!strcmp(names[i - 1], names[i])) return names[i];
    return NULL;
}

/* Every metadata key and tensor name once (llama.cpp refuses repeats): a repeated one would be
 * read as whichever copy a lookup finds first. */
static mrl_status unique_names(const mrl_gguf *g) {
    int64_t n = g->n_kv > g->n_tensors ? g->n_kv : g->n_tensors;
    const char **names = malloc(sizeof *names * (size_t)(n ? n : 1));
    if (!names) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", g->path);
    for (int64_t i = 0; i < g->n_kv; i++) names[i] = g->kv[i].key;
    const char *key = duplicate(names, g->n_kv), *name = NULL;
    if (!key) {
        for (int64_t i = 0; i < g->n_tensors; i++) names[i] = g->tensors[i].name;
        name = duplicate(names, g->n_tensors);
    }
    mrl_status st = MRL_OK;
    if (key) st = mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: metadata key '%s' appears twice", g->path, key);
    else if (name) st = mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: two tensors are named '%s'", g->path, name);
    free(names);
    return st;
}

static mrl_status parse(mrl_gguf *g) {
    cursor c = {g, 0, "the header"};
    uint32_t magic, version;
    mrl_status st;
    if ((st = get_u32(&c, &magic))) return st;
    if (magic != 0x46554747u) /* "GGUF" */
        return mrl_set_error(MRL_ERR_FORMAT, "%s: not a GGUF file (it does not start with the bytes 'GGUF')", g->path);
    if ((st = get_u32(&c, &version))) return st;
    if (version < 2 || version > 3)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: GGUF version %u (moonrl reads versions 2 and 3)", g->path,
                             version);
    g->version = (int)version;
    uint64_t n_tensors, n_kv;
    if ((st = get_u64(&c, &n_tensors)) || (st = get_u64(&c, &n_kv))) return st;
    int64_t left = g->file_size - c.pos;
    /* a pair takes at least 8 + 4 bytes, a tensor's info at least 8 + 4 + 8 + 4 + 8 */
    if (n_kv > (uint64_t)left / 12 || n_tensors > (uint64_t)left / 32)
        return bad(g, "%lld key/value pairs and %lld tensors cannot fit in the file", "the header",
                   (long long)n_kv, (long long)n_tensors);
    g->kv = calloc((size_t)(n_kv ? n_kv : 1), sizeof(gguf_kv));
    g->tensors = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof(mrl_gguf_tensor));
    if (!g->kv || !g->tensors) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < n_kv; i++) {
        gguf_kv *kv = &g->kv[g->n_kv];
        c.what = "a metadata key";
        int64_t at, len;
        uint32_t type;
        if ((st = get_string(&c, &at, &len))) return st;
        if (!(kv->key = copy_string(g, at, len))) return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", g->path);
        g->n_kv++;
        c.what = kv->key;
        if ((st = get_u32(&c, &type))) return st;
        kv->type = (int)type;
        if ((st = parse_value(&c, kv))) return st;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        c.what = "a tensor's info";
        if ((st = parse_tensor(&c, &g->tensors[g->n_tensors]))) {
            if (g->tensors[g->n_tensors].name) g->n_tensors++; /* freed with the rest */
            return st;
        }
        g->n_tensors++;
    }
    int64_t align = DEFAULT_ALIGNMENT;
    int64_t a = mrl_gguf_find_kv(g, "general.alignment");
    if (a >= 0) {
        double v;
        if (mrl_gguf_kv_number(g, a, -1, &v) || v < 1 || v > (1 << 20) || ((int64_t)v & ((int64_t)v - 1)))
            return mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: general.alignment is not a power of two "
                                 "up to 2^20", g->path);
        align = (int64_t)v;
    }
    g->data_start = (c.pos + align - 1) / align * align;
    /* llama.cpp's rule: the tensors' data follow one another in the order of their infos, each
     * starting where the one before it ends, rounded up to the alignment. Without it two infos
     * could name the same bytes, or a tensor whose type makes it longer than its place (a Q4_1
     * tensor relabelled F16) would read the next tensor's bytes as its own weights. */
    int64_t expect = 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        mrl_gguf_tensor *t = &g->tensors[i];
        if (t->offset % align || t->offset > g->file_size - g->data_start ||
            t->bytes > g->file_size - g->data_start - t->offset)
            return mrl_set_error(MRL_ERR_FORMAT, "%s: not a valid GGUF file: tensor '%s' (%lld bytes at data offset "
                                 "%lld) is not aligned to %lld or runs past the end of the file (%lld bytes)",
                                 g->path, t->name, (long long)t->bytes, (long long)t->offset, (long long)align,
                                 (long long)g->file_size);
        if (t->offset != expect) return misplaced(g, i, expect);
        expect = t->offset + (t->bytes + align - 1) / align * align;
    }
    for (int64_t i = 0; i < g->n_tensors; i++) g->tensors[i].offset += g->data_start;
    return unique_names(g);
}

mrl_status mrl_gguf_open(const char *path, mrl_gguf **out) {
    if (!path || !out) return mrl_set_error(MRL_ERR_INVALID, "gguf open: NULL argument");
    *out = NULL;
    mrl_gguf *g = calloc(1, sizeof *g);
    if (!g || !(g->path = strdup(path))) {
        free(g);
        return mrl_set_error(MRL_ERR_NOMEM, "gguf open: out of memory");
    }
    mrl_status st = mrl_io_open_read(path, &g->fd, &g->file_size);
    if (!st) st = parse(g);
    if (st) {
        mrl_gguf_close(g);
        return st;
    }
    *out = g;
    return MRL_OK;
}

void mrl_gguf_close(mrl_gguf *g) {
    if (!g) return;
    if (g->fd >= 0) close(g->fd);
    for (int64_t i = 0; i < g->n_kv; i++) {
        free(g->kv[i].key);
        free(g->kv[i].str_at);
    }
    for (int64_t i = 0; i < g->n_tensors; i++) free((char *)g->tensors[i].name);
    free(g->kv);
    free(g->tensors);
    free(g->hdr);
    free(g->path);
    free(g);
}

int mrl_gguf_version(const mrl_gguf *g) { return g ? g->version : 0; }

/* ---- metadata ---- */

int64_t mrl_gguf_kv_count(const mrl_gguf *g) { return g ? g->n_kv : 0; }

int64_t mrl_gguf_find_kv(const mrl_gguf *g, const char *key) {
    for (int64_t i = 0; g && key && i < g->n_kv; i++)
        if (!strcmp(g->kv[i].key, key)) return i;
    return -1;
}

static const gguf_kv *kv_at(const mrl_gguf *g, int64_t i) { return g && i >= 0 && i < g->n_kv ? &g->kv[i] : NULL; }

const char *mrl_gguf_kv_key(const mrl_gguf *g, int64_t i) { return kv_at(g, i) ? kv_at(g, i)->key : NULL; }
int mrl_gguf_kv_type(const mrl_gguf *g, int64_t i) { return kv_at(g, i) ? kv_at(g, i)->type : -1; }
int mrl_gguf_kv_array_type(const mrl_gguf *g, int64_t i) {
    return kv_at(g, i) && kv_at(g, i)->type == MRL_GGUF_ARRAY ? kv_at(g, i)->elem_type : -1;
}
int64_t mrl_gguf_kv_array_len(const mrl_gguf *g, int64_t i) {
    return kv_at(g, i) && kv_at(g, i)->type == MRL_GGUF_ARRAY ? kv_at(g, i)->count : 0;
}

static double number_at(const uint8_t *p, int type) {
    union { uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32; float f32;
            uint64_t u64; int64_t i64; double f64; } v;
    memcpy(&v, p, (size_t)scalar_bytes(type));
    switch (type) {
    case MRL_GGUF_UINT8: return v.u8;
    case MRL_GGUF_INT8: return v.i8;
    case MRL_GGUF_BOOL: return v.u8 != 0;
    case MRL_GGUF_UINT16: return v.u16;
    case MRL_GGUF_INT16: return v.i16;
    case MRL_GGUF_UINT32: return v.u32;
    case MRL_GGUF_INT32: return v.i32;
    case MRL_GGUF_FLOAT32: return v.f32;
    case MRL_GGUF_UINT64: return (double)v.u64;
    case MRL_GGUF_INT64: return (double)v.i64;
    default: return v.f64;
    }
}

mrl_status mrl_gguf_kv_number(const mrl_gguf *g, int64_t i, int64_t j, double *out) {
    const gguf_kv *kv = kv_at(g, i);
    if (!kv || !out) return mrl_set_error(MRL_ERR_INVALID, "gguf: no metadata pair %lld", (long long)i);
    int type = kv->type == MRL_GGUF_ARRAY ? kv->elem_type : kv->type;
    int64_t size = scalar_bytes(type);
    if (!size || (kv->type == MRL_GGUF_ARRAY) != (j >= 0) || (j >= 0 && j >= kv->count))
        return mrl_set_error(MRL_ERR_INVALID, "%s: metadata '%s' has no number at %lld", g->path, kv->key, (long long)j);
    *out = number_at(g->hdr + kv->at + (j >= 0 ? j * size : 0), type);
    return MRL_OK;
}

mrl_status mrl_gguf_kv_string(const mrl_gguf *g, int64_t i, int64_t j, const char **s, int64_t *len) {
    const gguf_kv *kv = kv_at(g, i);
    if (!kv || !s || !len) return mrl_set_error(MRL_ERR_INVALID, "gguf: no metadata pair %lld", (long long)i);
    int64_t at;
    if (kv->type == MRL_GGUF_STRING && j < 0) at = kv->at;
    else if (kv->type == MRL_GGUF_ARRAY && kv->elem_type == MRL_GGUF_STRING && j >= 0 && j < kv->count) at = kv->str_at[j];
    else return mrl_set_error(MRL_ERR_INVALID, "%s: metadata '%s' has no string at %lld", g->path, kv->key, (long long)j);
    uint64_t n;
    memcpy(&n, g->hdr + at, 8);
    *s = (const char *)g->hdr + at + 8;
    *len = (int64_t)n;
    return MRL_OK;
}

/* ---- tensors ---- */

int64_t mrl_gguf_tensor_count(const mrl_gguf *g) { return g ? g->n_tensors : 0; }

int64_t mrl_gguf_find_tensor(const mrl_gguf *g, const char *name) {
    for (int64_t i = 0; g && name && i < g->n_tensors; i++)
        if (!strcmp(g->tensors[i].name, name)) return i;
    return -1;
}

mrl_status mrl_gguf_tensor_info(const mrl_gguf *g, int64_t i, mrl_gguf_tensor *out) {
    if (!g || !out || i < 0 || i >= g->n_tensors)
        return mrl_set_error(MRL_ERR_INVALID, "gguf: no tensor %lld", (long long)i);
    *out = g->tensors[i];
    return MRL_OK;
}

/* ---- dequantization: ggml's dequantize_row_* in the same float operations ----
 * (fp-contract off: a fused multiply-add would round differently from
 * ggml's and numpy's separate multiply and subtract) */

#define DEQ __attribute__((optimize("fp-contract=off")))

static float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return mrl_f16_to_f32(h);
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4). */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

DEQ static void deq_q4_k(const uint8_t *b, float *y) {
    float d = h2f(b), min = h2f(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        float d1 = d * sc, m1 = min * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        float d2 = d * sc, m2 = min * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
    }
}

DEQ static void deq_q5_k(const uint8_t *b, float *y) {
    float d = h2f(b), min = h2f(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        float d1 = d * sc, m1 = min * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        float d2 = d * sc, m2 = min * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
}

DEQ static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = h2f(b + 208);
    for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

typedef struct deq_job {
    int type;
    const uint8_t *src;
    float *dst;
    int64_t block, bytes;
} deq_job;

static void deq_range(void *ctx, int64_t first, int64_t last) {
    const deq_job *j = ctx;
    for (int64_t i = first; i < last; i++) {
        const uint8_t *b = j->src + i * j->bytes;
        float *y = j->dst + i * j->block;
        switch (j->type) {
        case MRL_GGML_Q4_K: deq_q4_k(b, y); break;
        case MRL_GGML_Q5_K: deq_q5_k(b, y); break;
        case MRL_GGML_Q6_K: deq_q6_k(b, y); break;
        }
    }
}

mrl_status mrl_ggml_dequantize(int type, const void *src, int64_t src_bytes, float *dst, int64_t n) {
    const type_info *ti = type_of(type);
    if (!ti) return mrl_set_error(MRL_ERR_UNSUPPORTED, "dequantize: ggml type %d is not supported", type);
    if (!src || !dst || n < 0 || n % ti->block || src_bytes != n / ti->block * ti->bytes)
        return mrl_set_error(MRL_ERR_INVALID, "dequantize %s: %lld elements need %lld bytes, got %lld", ti->name,
                             (long long)n, (long long)(n / ti->block * ti->bytes), (long long)src_bytes);
    if (type == MRL_GGML_F32) memcpy(dst, src, (size_t)n * 4);
    else if (type == MRL_GGML_F16) mrl_convert_f16_to_f32(src, dst, n);
    else if (type == MRL_GGML_BF16) mrl_convert_bf16_to_f32(src, dst, n);
    else if (mrl_quant_block_bytes(type)) mrl_kernels_cpu_fast()->dequant(type, src, dst, n); /* (kernels.h's) */
    else {
        deq_job j = {type, src, dst, ti->block, ti->bytes};
        mrl_parallel_for(n / ti->block, 64, deq_range, &j);
    }
    return MRL_OK;
}

/* Tensor t's bytes as the file holds them into dst; a short read is an error naming it. */
static mrl_status read_bytes(const mrl_gguf *g, const mrl_gguf_tensor *t, void *dst) {
    int err;
    int64_t done = mrl_io_pread_all(g->fd, dst, t->bytes, t->offset, &err);
    if (done < t->bytes)
        return mrl_set_error(MRL_ERR_IO, "%s: reading tensor '%s' came back short at byte %lld of %lld (the file was "
                             "cut short?)", g->path, t->name, (long long)done, (long long)t->bytes);
    return MRL_OK;
}

mrl_status mrl_gguf_read_f32(const mrl_gguf *g, int64_t i, float *dst, int64_t numel) {
    if (!g || i < 0 || i >= g->n_tensors || !dst) return mrl_set_error(MRL_ERR_INVALID, "gguf read: no tensor %lld", (long long)i);
    const mrl_gguf_tensor *t = &g->tensors[i];
    if (numel != t->numel)
        return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s' has %lld elements, the buffer %lld", g->path, t->name,
                             (long long)t->numel, (long long)numel);
    /* F32 straight into dst; the others through a buffer of their bytes */
    uint8_t *raw = t->type == MRL_GGML_F32 ? (uint8_t *)dst : malloc((size_t)t->bytes);
    if (!raw) return mrl_set_error(MRL_ERR_NOMEM, "%s: no memory to read tensor '%s' (%lld bytes)", g->path, t->name,
                                   (long long)t->bytes);
    mrl_status st = read_bytes(g, t, raw);
    if (!st && t->type != MRL_GGML_F32) st = mrl_ggml_dequantize(t->type, raw, t->bytes, dst, t->numel);
    if (raw != (uint8_t *)dst) free(raw);
    /* a NaN or an infinity (in an F32 / F16 value or a block's scale) is a corrupt weight: said
     * here, naming the tensor, not as a NaN in the sampler at the first generation */
    for (int64_t k = 0; !st && k < t->numel; k++)
        if (!isfinite(dst[k]))
            st = mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s' (%s) holds %s at element %lld of %lld: a weight must "
                               "be finite (a corrupt file?)", g->path, t->name, t->type_name,
                               isnan(dst[k]) ? "a NaN" : "an infinity", (long long)k, (long long)t->numel);
    return st;
}

mrl_status mrl_gguf_read_raw(const mrl_gguf *g, int64_t i, void *dst, int64_t bytes) {
    if (!g || i < 0 || i >= g->n_tensors || !dst) return mrl_set_error(MRL_ERR_INVALID, "gguf read: no tensor %lld", (long long)i);
    const mrl_gguf_tensor *t = &g->tensors[i];
    if (bytes != t->bytes)
        return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s' has %lld bytes, the buffer %lld", g->path, t->name,
                             (long long)t->bytes, (long long)bytes);
    mrl_status st = read_bytes(g, t, dst);
    if (st) return st;
    int block = mrl_quant_block_bytes(t->type), halves = t->type == MRL_GGML_Q4_1 ? 2 : 1;
    const uint8_t *b = dst;
    for (int64_t k = 0; block && k < t->bytes / block; k++) /* (the weights of a block are finite when its scales are) */
        for (int h = 0; h < halves; h++) {
            uint16_t f;
            memcpy(&f, b + k * block + 2 * h, 2);
            if ((f & 0x7c00u) == 0x7c00u)
                return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s' (%s): block %lld's %s is %s: a weight must be "
                                     "finite (a corrupt file?)", g->path, t->name, t->type_name, (long long)k,
                                     h ? "minimum" : "scale", f & 0x3ffu ? "a NaN" : "an infinity");
        }
    return MRL_OK;
}
