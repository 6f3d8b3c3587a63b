/* safetensors reader: files are memory-mapped read-only and every header
 * field is checked against the file before anything is read through it.
 * Layout: u64 little-endian header length N, N bytes of JSON, then the data
 * region; each tensor's data_offsets are relative to the data region.
 *
 * mrl_st_read_f32 copies a tensor with pread from the file, not from the
 * mapping: a file truncated after it was opened (another process rewriting
 * a checkpoint) makes a read of the mapping past the new end raise SIGBUS,
 * while pread just comes back short, which is an error naming the file. The
 * copy costs the same (the kernel copies the page cache into dst either
 * way). A SIGBUS handler could guard the mapping instead, but a handler is
 * process-wide state shared with the host program and other threads.
 *
 * mrl_st_read_f32_range reads a slice of a tensor (flattened, row-major)
 * the same way, pread of that slice's bytes alone: a rank loading its shard
 * of a large checkpoint touches only its byte ranges, neither the rest of
 * the file nor a whole-tensor buffer. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "moonrl/safetensors.h"
#include "io/json.h"
#include "io/write.h"
#include "io/st_common.h"
#include "base/error.h"

enum { MAX_HEADER_BYTES = 100 * 1000 * 1000 }; /* the Python library's bound */

typedef struct st_file {
    char *path;
    int fd;              /* open for the reads (pread) */
    void *map;
    size_t size;
    const uint8_t *data; /* data region */
    uint64_t data_size;
    mrl_json_doc *doc;
    const mrl_json *metadata; /* __metadata__ object or NULL */
} st_file;

struct mrl_st {
    char *path;
    st_file *files;
    int nfiles;
    mrl_st_tensor *tensors; /* sorted by name */
    int64_t count, cap;
};

char *mrl_st_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

char *mrl_st_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t at = a;
    if (a > 0 && dir[a - 1] != '/') p[at++] = '/';
    memcpy(p + at, name, b + 1);
    return p;
}

static void file_close(st_file *f) {
    if (f->map) munmap(f->map, f->size);
    if (f->fd >= 0) close(f->fd);
    mrl_json_free(f->doc);
    free(f->path);
    memset(f, 0, sizeof *f);
}

void mrl_st_close(mrl_st *st) {
    if (!st) return;
    for (int i = 0; i < st->nfiles; i++) file_close(&st->files[i]);
    free(st->files);
    free(st->tensors);
    free(st->path);
    free(st);
}

static mrl_status add_tensor(mrl_st *st, const mrl_st_tensor *t) {
    if (st->count == st->cap) {
        int64_t cap = st->cap ? st->cap * 2 : 64;
        mrl_st_tensor *n = realloc(st->tensors, (size_t)cap * sizeof *n);
        if (!n) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
        st->tensors = n;
        st->cap = cap;
    }
    st->tensors[st->count++] = *t;
    return MRL_OK;
}

static int cmp_by_begin(const void *a, const void *b) {
    const int64_t *x = a, *y = b; /* (begin, end, index) triples */
    return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : (x[1] < y[1] ? -1 : x[1] > y[1]);
}

static int is_nonneg_int(const mrl_json *j) { return j && j->type == MRL_JSON_NUMBER && j->is_integer && j->integer >= 0; }

/* Parse one tensor entry of file f (index fi in st). */
static mrl_status parse_entry(mrl_st *st, st_file *f, int fi, const char *name, size_t name_len, const mrl_json *e,
                              int64_t *range) {
    const char *path = f->path;
    if (strlen(name) != name_len)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: a tensor name contains a NUL byte", path);
    if (!e || e->type != MRL_JSON_OBJECT)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': entry is not a JSON object", path, name);
    mrl_st_tensor t = {0};
    t.name = name;
    t.shard = fi;
    const char *dtype = mrl_json_get_string(e, "dtype");
    if (!dtype) return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': missing string field 'dtype'", path, name);
    int dt = mrl_dtype_parse(dtype);
    if (dt < 0) return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': unknown dtype '%s'", path, name, dtype);
    t.dtype = (mrl_dtype)dt;
    const mrl_json *shape = mrl_json_get(e, "shape");
    if (!shape || shape->type != MRL_JSON_ARRAY)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': missing array field 'shape'", path, name);
    if (shape->length > MRL_ST_MAX_DIMS)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: tensor '%s': %zu dimensions (at most %d)", path, name,
                             shape->length, MRL_ST_MAX_DIMS);
    t.ndim = (int)shape->length;
    int64_t numel = 1;
    for (int d = 0; d < t.ndim; d++) {
        if (!is_nonneg_int(shape->items[d]))
            return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name, d);
        t.shape[d] = shape->items[d]->integer;
        if (__builtin_mul_overflow(numel, t.shape[d], &numel))
            return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': shape overflows", path, name);
    }
    t.numel = numel;
    int64_t bytes;
    if (__builtin_mul_overflow(numel, (int64_t)mrl_dtype_size(t.dtype), &bytes))
        return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': shape overflows", path, name);
    t.bytes = bytes;
    const mrl_json *off = mrl_json_get(e, "data_offsets");
    if (!off || off->type != MRL_JSON_ARRAY || off->length != 2 || !is_nonneg_int(off->items[0]) ||
        !is_nonneg_int(off->items[1]))
        return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': 'data_offsets' must be [begin, end] of non-negative integers",
                             path, name);
    int64_t begin = off->items[0]->integer, end = off->items[1]->integer;
    if (begin > end || (uint64_t)end > f->data_size)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s': data_offsets [%lld, %lld] outside the data region of %llu bytes",
                             path, name, (long long)begin, (long long)end, (unsigned long long)f->data_size);
    if (end - begin != bytes)
        return mrl_set_error(MRL_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets [%lld, %lld] hold %lld bytes, but %s shape of %lld elements needs %lld",
                             path, name, (long long)begin, (long long)end, (long long)(end - begin), dtype,
                             (long long)numel, (long long)bytes);
    t.data = f->data + begin;
    range[0] = begin;
    range[1] = end;
    return add_tensor(st, &t);
}

/* Map and validate one file; its tensors are appended to st. */
static mrl_status open_file(mrl_st *st, const char *path) {
    st_file *files = realloc(st->files, (size_t)(st->nfiles + 1) * sizeof *files);
    if (!files) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    st->files = files;
    int fi = st->nfiles++;
    st_file *f = &files[fi];
    memset(f, 0, sizeof *f);
    f->fd = -1;
    f->path = mrl_st_strdup(path);
    if (!f->path) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    int fd;
    int64_t file_size;
    mrl_status opened = mrl_io_open_read(path, &fd, &file_size);
    if (opened) return opened;
    if (file_size < 8) {
        close(fd);
        return mrl_set_error(MRL_ERR_FORMAT, "%s: file of %lld bytes is too short for a safetensors header", path,
                             (long long)file_size);
    }
    f->size = (size_t)file_size;
    f->fd = fd;
    void *map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) return mrl_set_error(MRL_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
    f->map = map;
    const uint8_t *b = map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | b[i];
    if (hlen > MAX_HEADER_BYTES || hlen > f->size - 8)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: header length %llu is larger than the file (%zu bytes) allows", path,
                             (unsigned long long)hlen, f->size);
    if (hlen < 2 || b[8] != '{')
        return mrl_set_error(MRL_ERR_FORMAT, "%s: the header does not start with a JSON object", path);
    mrl_status s = mrl_json_parse((const char *)b + 8, (size_t)hlen, path, &f->doc);
    if (s) return s;
    f->data = b + 8 + hlen;
    f->data_size = f->size - 8 - hlen;
    const mrl_json *root = mrl_json_root(f->doc);
    if (!root || root->type != MRL_JSON_OBJECT)
        return mrl_set_error(MRL_ERR_FORMAT, "%s: the header is not a JSON object", path);
    int64_t *ranges = malloc((root->length ? root->length : 1) * 3 * sizeof(int64_t));
    if (!ranges) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    int64_t nr = 0;
    for (size_t i = 0; i < root->length && !s; i++) {
        const char *key = root->keys[i];
        const mrl_json *e = root->items[i];
        if (strcmp(key, "__metadata__") == 0) {
            if (e->type != MRL_JSON_OBJECT) {
                s = mrl_set_error(MRL_ERR_FORMAT, "%s: '__metadata__' is not an object", path);
                break;
            }
            for (size_t k = 0; k < e->length; k++)
                if (e->items[k]->type != MRL_JSON_STRING) {
                    s = mrl_set_error(MRL_ERR_FORMAT, "%s: __metadata__ value '%s' is not a string", path, e->keys[k]);
                    break;
                }
            f->metadata = e;
            continue;
        }
        s = parse_entry(st, f, fi, key, root->key_lengths[i], e, ranges + 3 * nr);
        if (!s) {
            ranges[3 * nr + 2] = st->count - 1;
            nr++;
        }
    }
    if (!s && nr > 1) {
        qsort(ranges, (size_t)nr, 3 * sizeof(int64_t), cmp_by_begin);
        for (int64_t i = 1; i < nr && !s; i++)
            if (ranges[3 * i] < ranges[3 * (i - 1) + 1])
                s = mrl_set_error(MRL_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap (data_offsets [%lld, %lld] and [%lld, %lld])",
                                  path, st->tensors[ranges[3 * (i - 1) + 2]].name, st->tensors[ranges[3 * i + 2]].name,
                                  (long long)ranges[3 * (i - 1)], (long long)ranges[3 * (i - 1) + 1],
                                  (long long)ranges[3 * i], (long long)ranges[3 * i + 1]);
    }
    free(ranges);
    return s;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const mrl_st_tensor *)a)->name, ((const mrl_st_tensor *)b)->name);
}

static int is_dir(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static int exists(const char *path) { return access(path, F_OK) == 0; }

/* Open the shards named by a model.safetensors.index.json. */
static mrl_status open_index(mrl_st *st, const char *dir, const char *index_path) {
    mrl_json_doc *doc = NULL;
    mrl_status s = mrl_json_parse_file(index_path, &doc);
    if (s) return s;
    const mrl_json *map = mrl_json_get(mrl_json_root(doc), "weight_map");
    if (!map || map->type != MRL_JSON_OBJECT || map->length == 0) {
        const char *why = map && map->type == MRL_JSON_OBJECT ? "'weight_map' names no tensor" /* (found by fuzzing) */
                                                               : "missing object 'weight_map'";
        mrl_json_free(doc);
        return mrl_set_error(MRL_ERR_FORMAT, "%s: %s", index_path, why);
    }
    for (size_t i = 0; i < map->length && !s; i++) {
        const mrl_json *v = map->items[i];
        if (v->type != MRL_JSON_STRING || strlen(v->string) != v->length || v->length == 0 || strchr(v->string, '/') ||
            strcmp(v->string, "..") == 0 || strcmp(v->string, ".") == 0) {
            s = mrl_set_error(MRL_ERR_FORMAT, "%s: weight_map entry '%s' must name a file in the directory", index_path,
                              map->keys[i]);
            break;
        }
        int seen = 0; /* open each shard once */
        for (size_t j = 0; j < i && !seen; j++) seen = strcmp(map->items[j]->string, v->string) == 0;
        if (seen) continue;
        char *p = mrl_st_join(dir, v->string);
        if (!p) s = mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
        else s = open_file(st, p);
        free(p);
    }
    if (!s) {
        if (st->count > 1) qsort(st->tensors, (size_t)st->count, sizeof *st->tensors, cmp_tensor_name);
        for (size_t i = 0; i < map->length && !s; i++) {
            mrl_st_tensor t;
            if (mrl_st_find(st, map->keys[i], &t) != MRL_OK ||
                strcmp(strrchr(st->files[t.shard].path, '/') + 1, map->items[i]->string) != 0)
                s = mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s' is not in its shard %s", index_path, map->keys[i],
                                  map->items[i]->string);
        }
    }
    mrl_json_free(doc);
    return s;
}

mrl_status mrl_st_open(const char *path, mrl_st **out) {
    if (!out || !path) return mrl_set_error(MRL_ERR_INVALID, "st_open: path and out must not be NULL");
    *out = NULL;
    mrl_st *st = calloc(1, sizeof *st);
    if (!st || !(st->path = mrl_st_strdup(path))) {
        free(st);
        return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    }
    mrl_status s;
    if (is_dir(path)) {
        char *index = mrl_st_join(path, "model.safetensors.index.json");
        char *single = mrl_st_join(path, "model.safetensors");
        if (!index || !single) s = mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
        else if (exists(index)) s = open_index(st, path, index);
        else if (exists(single)) s = open_file(st, single);
        else s = mrl_set_error(MRL_ERR_IO, "%s: no model.safetensors or model.safetensors.index.json in this directory", path);
        free(index);
        free(single);
    } else {
        s = open_file(st, path);
    }
    if (!s) {
        /* tensors is NULL for a file of no tensor, and qsort's array must not be */
        if (st->count > 1) qsort(st->tensors, (size_t)st->count, sizeof *st->tensors, cmp_tensor_name);
        for (int64_t i = 1; i < st->count && !s; i++)
            if (strcmp(st->tensors[i - 1].name, st->tensors[i].name) == 0)
                s = mrl_set_error(MRL_ERR_FORMAT, "%s: tensor '%s' appears twice (in %s and %s)", path, st->tensors[i].name,
                                  st->files[st->tensors[i - 1].shard].path, st->files[st->tensors[i].shard].path);
    }
    if (s) {
        mrl_st_close(st);
        return s;
    }
    *out = st;
    return MRL_OK;
}

int64_t mrl_st_count(const mrl_st *st) { return st ? st->count : 0; }

mrl_status mrl_st_info(const mrl_st *st, int64_t index, mrl_st_tensor *out) {
    if (!st || !out) return mrl_set_error(MRL_ERR_INVALID, "st_info: st and out must not be NULL");
    if (index < 0 || index >= st->count)
        return mrl_set_error(MRL_ERR_INVALID, "%s: tensor index %lld is outside [0, %lld)", st->path, (long long)index,
                             (long long)st->count);
    *out = st->tensors[index];
    return MRL_OK;
}

static const mrl_st_tensor *lookup(const mrl_st *st, const char *name) {
    int64_t lo = 0, hi = st->count;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->tensors[mid].name, name);
        if (c == 0) return &st->tensors[mid];
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return NULL;
}

mrl_status mrl_st_find(const mrl_st *st, const char *name, mrl_st_tensor *out) {
    if (!st || !name || !out) return mrl_set_error(MRL_ERR_INVALID, "st_find: arguments must not be NULL");
    const mrl_st_tensor *t = lookup(st, name);
    if (!t) return mrl_set_error(MRL_ERR_INVALID, "%s: no tensor named '%s'", st->path, name);
    *out = *t;
    return MRL_OK;
}

int mrl_st_has(const mrl_st *st, const char *name) { return st && name && lookup(st, name) != NULL; }

/* bytes of tensor t from its file, at byte `from` of the tensor, with pread (see the top) */
static mrl_status read_bytes(const mrl_st *st, const mrl_st_tensor *t, int64_t from, void *dst, int64_t bytes) {
    const st_file *f = &st->files[t->shard];
    int64_t at = (const uint8_t *)t->data - (const uint8_t *)f->map + from;
    int err;
    int64_t done = mrl_io_pread_all(f->fd, dst, bytes, at, &err);
    if (done == bytes) return MRL_OK;
    if (err)
        return mrl_set_error(MRL_ERR_IO, "%s: tensor '%s': read failed at byte %lld: %s", f->path, t->name,
                             (long long)(at + done), strerror(err));
    struct stat sb;
    long long now = fstat(f->fd, &sb) == 0 ? (long long)sb.st_size : -1;
    return mrl_set_error(MRL_ERR_IO, "%s: tensor '%s': the file ends at byte %lld, before the tensor's "
                         "data [%lld, %lld) (it was %zu bytes when opened: truncated since?)", f->path,
                         t->name, now, (long long)(at - from), (long long)(at - from + t->bytes), f->size);
}

/* elements [first, first + count) of tensor t (checked by the callers) as
 * fp32: only their bytes are read from the file. */
static mrl_status read_f32_at(const mrl_st *st, const mrl_st_tensor *t, int64_t first, int64_t count, float *dst) {
    if (t->dtype == MRL_DTYPE_F32) return read_bytes(st, t, 4 * first, dst, 4 * count);
    void (*conv)(const uint16_t *, float *, int64_t);
    if (t->dtype == MRL_DTYPE_BF16) conv = mrl_convert_bf16_to_f32;
    else if (t->dtype == MRL_DTYPE_F16) conv = mrl_convert_f16_to_f32;
    else return mrl_set_error(MRL_ERR_UNSUPPORTED, "%s: tensor '%s' is %s; only F32, BF16 and F16 convert to fp32",
                              st->files[t->shard].path, t->name, mrl_dtype_name(t->dtype));
    enum { CHUNK = 1 << 20 }; /* 16-bit values per read, converted (on all threads) as they come */
    int64_t cap = count < CHUNK ? count : CHUNK;
    uint16_t *tmp = malloc((size_t)(cap > 0 ? cap : 1) * 2);
    if (!tmp) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    mrl_status s = MRL_OK;
    for (int64_t i = 0; i < count && !s; i += cap) {
        int64_t k = count - i < cap ? count - i : cap;
        s = read_bytes(st, t, 2 * (first + i), tmp, 2 * k);
        if (!s) conv(tmp, dst + i, k);
    }
    free(tmp);
    return s;
}

mrl_status mrl_st_read_f32(const mrl_st *st, const char *name, float *dst, int64_t numel) {
    mrl_st_tensor t;
    mrl_status s = mrl_st_find(st, name, &t);
    if (s) return s;
    if (!dst && numel > 0) return mrl_set_error(MRL_ERR_INVALID, "st_read_f32: dst is NULL");
    if (numel != t.numel)
        return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s' has %lld elements, the destination %lld",
                             st->files[t.shard].path, name, (long long)t.numel, (long long)numel);
    return read_f32_at(st, &t, 0, numel, dst);
}

mrl_status mrl_st_read_f32_range(const mrl_st *st, const char *name, int64_t first, int64_t count, float *dst) {
    mrl_st_tensor t;
    mrl_status s = mrl_st_find(st, name, &t);
    if (s) return s;
    const char *path = st->files[t.shard].path;
    int64_t end = 0;
    if (first < 0 || count < 0 || __builtin_add_overflow(first, count, &end) || end > t.numel)
        return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s': range first=%lld count=%lld is outside its %lld elements%s",
                             path, name, (long long)first, (long long)count, (long long)t.numel,
                             first < 0 || count < 0 ? " (negative)" : end < first ? " (first + count overflows)" : "");
    if (!dst && count > 0)
        return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s': range first=%lld count=%lld: dst is NULL", path, name,
                             (long long)first, (long long)count);
    return read_f32_at(st, &t, first, count, dst);
}

const char *mrl_st_metadata(const mrl_st *st, const char *key) {
    if (!st || !key) return NULL;
    for (int i = 0; i < st->nfiles; i++) {
        const mrl_json *m = st->files[i].metadata;
        const mrl_json *v = m ? mrl_json_get(m, key) : NULL;
        if (v && v->type == MRL_JSON_STRING) return v->string;
    }
    return NULL;
}
