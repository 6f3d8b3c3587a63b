/* safetensors writer. Layout as the Python library writes it: tensors
 * ordered by dtype (widest alignment first, the order of the library's
 * Dtype enum, descending) then by name; the header is compact JSON with
 * __metadata__ first and the tensors in data order, padded with spaces so
 * the data region starts at a multiple of 8. Files are written to a
 * temporary name, fsync'ed and renamed into place. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "moonrl/safetensors.h"
#include "io/st_common.h"
#include "io/write.h"
#include "base/error.h"

typedef struct wtensor {
    char *name;
    mrl_dtype dtype;
    int ndim;
    int64_t shape[MRL_ST_MAX_DIMS];
    int64_t numel, bytes;
    const float *src; /* fp32 source, converted on write */
    const void *raw;  /* or bytes already in dtype */
    int64_t shard;    /* which file of a sharded directory */
    int64_t at;       /* stream: byte offset of the data in its file */
    int written;      /* stream: its data has been written */
} wtensor;

struct mrl_st_writer {
    wtensor *t;
    int64_t n, cap;
    char **meta; /* key0, value0, key1, value1, ... */
    int64_t nmeta;
};

mrl_status mrl_st_writer_create(mrl_st_writer **out) {
    if (!out) return mrl_set_error(MRL_ERR_INVALID, "st_writer_create: out is NULL");
    *out = calloc(1, sizeof **out);
    return *out ? MRL_OK : mrl_set_error(MRL_ERR_NOMEM, "st_writer_create: out of memory");
}

static void writer_clear(mrl_st_writer *w) {
    for (int64_t i = 0; i < w->n; i++) free(w->t[i].name);
    for (int64_t i = 0; i < 2 * w->nmeta; i++) free(w->meta[i]);
    free(w->t);
    free(w->meta);
}

void mrl_st_writer_free(mrl_st_writer *w) {
    if (!w) return;
    writer_clear(w);
    free(w);
}

/* Check name, dtype and shape and fill t's description (no data). */
static mrl_status describe(const char *name, mrl_dtype dtype, int ndim, const int64_t *shape, wtensor *t) {
    if (!name) return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: name must not be NULL");
    if (!name[0] || strcmp(name, "__metadata__") == 0)
        return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: invalid tensor name '%s'", name);
    if ((unsigned)dtype >= MRL_DTYPE_COUNT)
        return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: tensor '%s': unknown dtype %d", name, (int)dtype);
    if (ndim < 0 || ndim > MRL_ST_MAX_DIMS || (ndim > 0 && !shape))
        return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: tensor '%s': ndim %d outside [0, %d]", name, ndim, MRL_ST_MAX_DIMS);
    memset(t, 0, sizeof *t);
    t->dtype = dtype;
    t->ndim = ndim;
    t->numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || __builtin_mul_overflow(t->numel, shape[d], &t->numel))
            return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: tensor '%s': bad shape[%d] = %lld", name, d, (long long)shape[d]);
        t->shape[d] = shape[d];
    }
    if (__builtin_mul_overflow(t->numel, (int64_t)mrl_dtype_size(dtype), &t->bytes))
        return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: tensor '%s': too large", name);
    return MRL_OK;
}

/* Append t to w under a copy of name. */
static mrl_status push(mrl_st_writer *w, const char *name, wtensor t) {
    if (w->n == w->cap) {
        int64_t cap = w->cap ? 2 * w->cap : 64;
        wtensor *nt = realloc(w->t, (size_t)cap * sizeof *nt);
        if (!nt) return mrl_set_error(MRL_ERR_NOMEM, "st_writer_add: out of memory");
        w->t = nt;
        w->cap = cap;
    }
    if (!(t.name = mrl_st_strdup(name))) return mrl_set_error(MRL_ERR_NOMEM, "st_writer_add: out of memory");
    w->t[w->n++] = t;
    return MRL_OK;
}

/* Whether fp32 values can be stored as dtype, and the data's size: an error naming the tensor. */
static mrl_status check_data(const char *name, const wtensor *t, int from_f32, const void *data, int64_t raw_bytes) {
    if (from_f32 && t->dtype != MRL_DTYPE_F32 && t->dtype != MRL_DTYPE_BF16 && t->dtype != MRL_DTYPE_F16)
        return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: tensor '%s': fp32 data can be stored as F32, BF16 or F16, not %s",
                             name, mrl_dtype_name(t->dtype));
    if (!from_f32 && raw_bytes != t->bytes)
        return mrl_set_error(MRL_ERR_INVALID, "st_writer_add_raw: tensor '%s': %lld bytes given, the %s shape needs %lld",
                             name, (long long)raw_bytes, mrl_dtype_name(t->dtype), (long long)t->bytes);
    if (t->numel > 0 && !data) return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: tensor '%s': data is NULL", name);
    return MRL_OK;
}

/* from_f32: data holds fp32 values to convert; else bytes already in dtype. */
static mrl_status add(mrl_st_writer *w, const char *name, mrl_dtype dtype, int ndim, const int64_t *shape,
                      int from_f32, const void *data, int64_t raw_bytes) {
    if (!w) return mrl_set_error(MRL_ERR_INVALID, "st_writer_add: writer must not be NULL");
    wtensor t;
    mrl_status s = describe(name, dtype, ndim, shape, &t);
    if (!s) s = check_data(name, &t, from_f32, data, raw_bytes);
    if (s) return s;
    if (!data) data = ""; /* an empty tensor: never read */
    if (from_f32) t.src = data;
    else t.raw = data;
    return push(w, name, t);
}

mrl_status mrl_st_writer_add(mrl_st_writer *w, const char *name, mrl_dtype dtype, int ndim, const int64_t *shape,
                             const float *src) {
    return add(w, name, dtype, ndim, shape, 1, src, 0);
}

mrl_status mrl_st_writer_add_raw(mrl_st_writer *w, const char *name, mrl_dtype dtype, int ndim, const int64_t *shape,
                                 const void *data, int64_t bytes) {
    return add(w, name, dtype, ndim, shape, 0, data, bytes);
}

mrl_status mrl_st_writer_set_metadata(mrl_st_writer *w, const char *key, const char *value) {
    if (!w || !key || !value) return mrl_set_error(MRL_ERR_INVALID, "st_writer_set_metadata: arguments must not be NULL");
    char *v = mrl_st_strdup(value);
    if (!v) return mrl_set_error(MRL_ERR_NOMEM, "st_writer_set_metadata: out of memory");
    for (int64_t i = 0; i < w->nmeta; i++)
        if (strcmp(w->meta[2 * i], key) == 0) {
            free(w->meta[2 * i + 1]);
            w->meta[2 * i + 1] = v;
            return MRL_OK;
        }
    char **m = realloc(w->meta, (size_t)(w->nmeta + 1) * 2 * sizeof *m);
    char *k = mrl_st_strdup(key);
    if (!m || !k) {
        if (m) w->meta = m;
        free(k);
        free(v);
        return mrl_set_error(MRL_ERR_NOMEM, "st_writer_set_metadata: out of memory");
    }
    w->meta = m;
    m[2 * w->nmeta] = k;
    m[2 * w->nmeta + 1] = v;
    w->nmeta++;
    return MRL_OK;
}

/* --- a growable text buffer with JSON string escaping ------------------- */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

/* One number with a few characters around it (fmt's output under 64 bytes:
 * longer text goes through sb_str); past that the buffer is marked failed
 * rather than reading past tmp. */
static void sb_fmt(sbuf *b, const char *fmt, long long v) {
    char tmp[64];
    int n = snprintf(tmp, sizeof tmp, fmt, v);
    if (n < 0 || (size_t)n >= sizeof tmp) b->oom = 1;
    else sb_put(b, tmp, (size_t)n);
}

static void sb_json_string(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            sb_put(b, e, 2);
        } else if (c < 0x20) {
            char e[8];
            snprintf(e, sizeof e, "\\u%04x", c);
            sb_put(b, e, 6);
        } else {
            sb_put(b, (const char *)&c, 1);
        }
    }
    sb_put(b, "\"", 1);
}

/* --- ordering ---------------------------------------------------------- */
/* Rank of each dtype in the Python library's Dtype enum order (BOOL < U8 <
 * I8 < I16 < F16 < BF16 < I32 < F32 < F64 < I64); files list higher first. */
static int dtype_rank(mrl_dtype d) {
    static const int rank[MRL_DTYPE_COUNT] = {
        [MRL_DTYPE_BOOL] = 0, [MRL_DTYPE_U8] = 1, [MRL_DTYPE_I8] = 2,  [MRL_DTYPE_I16] = 3, [MRL_DTYPE_F16] = 4,
        [MRL_DTYPE_BF16] = 5, [MRL_DTYPE_I32] = 6, [MRL_DTYPE_F32] = 7, [MRL_DTYPE_F64] = 8, [MRL_DTYPE_I64] = 9,
    };
    return rank[d];
}

static int cmp_file_order(const void *a, const void *b) {
    const wtensor *x = *(const wtensor *const *)a, *y = *(const wtensor *const *)b;
    int rx = dtype_rank(x->dtype), ry = dtype_rank(y->dtype);
    if (rx != ry) return ry - rx;
    return strcmp(x->name, y->name);
}

static int cmp_name(const void *a, const void *b) {
    return strcmp((*(const wtensor *const *)a)->name, (*(const wtensor *const *)b)->name);
}

/* --- atomic file writing ----------------------------------------------- */
typedef struct afile {
    const char *path;
    char *tmp;
    int fd;
} afile;

static mrl_status af_open(afile *f, const char *path) {
    f->path = path;
    f->fd = -1;
    size_t n = strlen(path) + 32;
    f->tmp = malloc(n);
    if (!f->tmp) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    snprintf(f->tmp, n, "%s.tmp.%ld", path, (long)getpid());
    f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd < 0) {
        mrl_status s = mrl_set_error(MRL_ERR_IO, "%s: cannot create %s: %s", path, f->tmp, strerror(errno));
        free(f->tmp);
        f->tmp = NULL;
        return s;
    }
    return MRL_OK;
}

static mrl_status af_write(afile *f, const void *data, size_t n) { return mrl_io_write_all(f->fd, data, n, f->path); }

/* ok: fsync, close, rename into place; else remove the temporary file. */
static mrl_status af_finish(afile *f, mrl_status s) {
    if (f->fd >= 0) {
        if (!s && fsync(f->fd) != 0) s = mrl_set_error(MRL_ERR_IO, "%s: fsync failed: %s", f->path, strerror(errno));
        if (close(f->fd) != 0 && !s) s = mrl_set_error(MRL_ERR_IO, "%s: close failed: %s", f->path, strerror(errno));
        f->fd = -1;
        if (!s && rename(f->tmp, f->path) != 0)
            s = mrl_set_error(MRL_ERR_IO, "%s: rename from %s failed: %s", f->path, f->tmp, strerror(errno));
        if (s) unlink(f->tmp);
        if (!s) s = mrl_io_sync_parent(f->path); /* the new name itself survives a crash */
    }
    free(f->tmp);
    f->tmp = NULL;
    return s;
}

static mrl_status write_tensor_data(afile *f, const wtensor *t) {
    if (t->raw || t->dtype == MRL_DTYPE_F32) return af_write(f, t->raw ? t->raw : (const void *)t->src, (size_t)t->bytes);
    enum { CHUNK = 1 << 18 };
    uint16_t *buf = malloc(CHUNK * sizeof(uint16_t));
    if (!buf) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    mrl_status s = MRL_OK;
    for (int64_t i = 0; i < t->numel && !s; i += CHUNK) {
        int64_t k = t->numel - i < CHUNK ? t->numel - i : CHUNK;
        if (t->dtype == MRL_DTYPE_BF16) mrl_convert_f32_to_bf16(t->src + i, buf, k);
        else mrl_convert_f32_to_f16(t->src + i, buf, k);
        s = af_write(f, buf, (size_t)k * 2);
    }
    free(buf);
    return s;
}

/* The header of a file holding tensors list[0..n) (sorted here into file
 * order), padded so that the data starts at a multiple of 8; each tensor's
 * `at` becomes the byte offset of its data in the file. */
static mrl_status make_header(const mrl_st_writer *w, wtensor **list, int64_t n, const char *path, sbuf *h) {
    qsort(list, (size_t)n, sizeof *list, cmp_file_order);
    for (int64_t i = 1; i < n; i++)
        if (strcmp(list[i - 1]->name, list[i]->name) == 0 && list[i - 1]->dtype == list[i]->dtype)
            return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s' was added twice", path, list[i]->name);
    memset(h, 0, sizeof *h);
    sb_put(h, "\0\0\0\0\0\0\0\0", 8); /* the header's length, set below */
    sb_str(h, "{");
    if (w->nmeta > 0) {
        sb_str(h, "\"__metadata__\":{");
        for (int64_t i = 0; i < w->nmeta; i++) {
            if (i) sb_str(h, ",");
            sb_json_string(h, w->meta[2 * i]);
            sb_str(h, ":");
            sb_json_string(h, w->meta[2 * i + 1]);
        }
        sb_str(h, "}");
    }
    int64_t offset = 0;
    for (int64_t i = 0; i < n; i++) {
        wtensor *t = list[i];
        if (i || w->nmeta > 0) sb_str(h, ",");
        sb_json_string(h, t->name);
        sb_str(h, ":{\"dtype\":\"");
        sb_str(h, mrl_dtype_name(t->dtype));
        sb_str(h, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) sb_fmt(h, d ? ",%lld" : "%lld", t->shape[d]);
        sb_fmt(h, "],\"data_offsets\":[%lld,", offset);
        t->at = offset;
        offset += t->bytes;
        sb_fmt(h, "%lld]}", offset);
    }
    sb_str(h, "}");
    while (h->len % 8) sb_str(h, " ");
    if (h->oom) {
        free(h->p);
        h->p = NULL;
        return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    }
    for (int i = 0; i < 8; i++) h->p[i] = (char)((uint64_t)(h->len - 8) >> (8 * i));
    for (int64_t i = 0; i < n; i++) list[i]->at += (int64_t)h->len;
    return MRL_OK;
}

/* Write tensors list[0..n) (any order) to one file. */
static mrl_status write_file(const mrl_st_writer *w, wtensor **list, int64_t n, const char *path) {
    sbuf h;
    mrl_status s = make_header(w, list, n, path, &h);
    if (s) return s;
    afile f;
    s = af_open(&f, path);
    if (!s) s = af_write(&f, h.p, h.len);
    free(h.p);
    if (f.fd < 0) return s;
    for (int64_t i = 0; i < n && !s; i++) s = write_tensor_data(&f, list[i]);
    return af_finish(&f, s);
}

static wtensor **tensor_list(const mrl_st_writer *w) {
    wtensor **list = malloc((size_t)(w->n ? w->n : 1) * sizeof *list);
    if (list)
        for (int64_t i = 0; i < w->n; i++) list[i] = &w->t[i];
    return list;
}

static mrl_status check_unique(wtensor **list, int64_t n, const char *path) {
    qsort(list, (size_t)n, sizeof *list, cmp_name);
    for (int64_t i = 1; i < n; i++)
        if (strcmp(list[i - 1]->name, list[i]->name) == 0)
            return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s' was added twice", path, list[i]->name);
    return MRL_OK;
}

mrl_status mrl_st_writer_write(mrl_st_writer *w, const char *path) {
    if (!w || !path) return mrl_set_error(MRL_ERR_INVALID, "st_writer_write: writer and path must not be NULL");
    wtensor **list = tensor_list(w);
    if (!list) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    mrl_status s = check_unique(list, w->n, path);
    if (!s) s = write_file(w, list, w->n, path);
    free(list);
    return s;
}

static void shard_name(char *buf, size_t n, int64_t k, int64_t nshards) {
    snprintf(buf, n, "model-%05lld-of-%05lld.safetensors", (long long)k + 1, (long long)nshards);
}

/* The files of a directory being written: model.safetensors when one shard
 * holds everything, else shards named as Hugging Face names them. */
static char *file_path(const char *dir, int64_t k, int64_t nshards) {
    char name[64];
    if (nshards == 1) snprintf(name, sizeof name, "model.safetensors");
    else shard_name(name, sizeof name, k, nshards);
    return mrl_st_join(dir, name);
}

/* Shards of dir of another count than nshards (1: every shard): what an
 * earlier save of another size or shard limit left, which the new index does
 * not name (transformers' save_pretrained removes them likewise). */
static mrl_status remove_other_shards(const char *dir, int64_t nshards) {
    DIR *d = opendir(dir);
    if (!d) return mrl_set_error(MRL_ERR_IO, "%s: cannot list: %s", dir, strerror(errno));
    mrl_status s = MRL_OK;
    struct dirent *e;
    while (!s && (e = readdir(d))) {
        long long k, n;
        char again[64];
        if (sscanf(e->d_name, "model-%lld-of-%lld.safetensors", &k, &n) != 2 || n == nshards) continue;
        shard_name(again, sizeof again, k - 1, n); /* exactly the name, not model-1-of-3.safetensors.tmp.7 */
        if (strcmp(again, e->d_name) != 0) continue;
        char *path = mrl_st_join(dir, e->d_name);
        if (!path) s = mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
        else if (unlink(path) != 0 && errno != ENOENT)
            s = mrl_set_error(MRL_ERR_IO, "%s: cannot remove the shard of an earlier save: %s", path, strerror(errno));
        free(path);
    }
    closedir(d);
    return s;
}

/* After the tensor files of dir are in place: model.safetensors.index.json
 * naming each tensor's shard (byname sorted by name; as transformers writes
 * it: json.dumps(indent=2, sort_keys=True)), atomically, or for one file no
 * index; the other layout's leftover (an old index or single file, shards of
 * another count) removed. */
static mrl_status write_index(const char *dir, wtensor **byname, int64_t n, int64_t nshards) {
    char *index_path = mrl_st_join(dir, "model.safetensors.index.json");
    char *single_path = mrl_st_join(dir, "model.safetensors");
    mrl_status s = MRL_OK;
    if (!index_path || !single_path) s = mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    if (!s && nshards == 1) {
        if (unlink(index_path) != 0 && errno != ENOENT)
            s = mrl_set_error(MRL_ERR_IO, "%s: cannot remove the old index: %s", index_path, strerror(errno));
    } else if (!s) {
        int64_t total = 0;
        for (int64_t i = 0; i < n; i++) total += byname[i]->bytes;
        sbuf idx = {0};
        sb_str(&idx, "{\n  \"metadata\": {\n    \"total_size\": ");
        sb_fmt(&idx, "%lld\n  },\n  \"weight_map\": {", total);
        char name[64];
        for (int64_t i = 0; i < n; i++) {
            shard_name(name, sizeof name, byname[i]->shard, nshards);
            sb_str(&idx, i ? ",\n    " : "\n    ");
            sb_json_string(&idx, byname[i]->name);
            sb_str(&idx, ": ");
            sb_json_string(&idx, name);
        }
        sb_str(&idx, "\n  }\n}\n");
        if (idx.oom) s = mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
        afile f;
        if (!s) s = af_open(&f, index_path);
        if (!s) s = af_finish(&f, af_write(&f, idx.p, idx.len));
        free(idx.p);
        if (!s && unlink(single_path) != 0 && errno != ENOENT)
            s = mrl_set_error(MRL_ERR_IO, "%s: cannot remove the old single file: %s", single_path, strerror(errno));
    }
    if (!s) s = remove_other_shards(dir, nshards);
    free(index_path);
    free(single_path);
    return s;
}

static mrl_status make_dir(const char *dir) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return mrl_set_error(MRL_ERR_IO, "%s: cannot create directory: %s", dir, strerror(errno));
    return MRL_OK;
}

mrl_status mrl_st_writer_write_dir(mrl_st_writer *w, const char *dir, int64_t max_shard_bytes) {
    if (!w || !dir) return mrl_set_error(MRL_ERR_INVALID, "st_writer_write_dir: writer and dir must not be NULL");
    if (max_shard_bytes < 0)
        return mrl_set_error(MRL_ERR_INVALID, "st_writer_write_dir: max_shard_bytes must be >= 0 (got %lld)",
                             (long long)max_shard_bytes);
    mrl_status s = make_dir(dir);
    if (s) return s;
    wtensor **list = tensor_list(w);
    wtensor **part = malloc((size_t)(w->n ? w->n : 1) * sizeof *part); /* one file's, sorted into file order */
    if (!list || !part) s = mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    if (!s) s = check_unique(list, w->n, dir);
    /* greedy split in name order; a tensor larger than the limit gets a shard of its own */
    int64_t nshards = 1, size = 0;
    for (int64_t i = 0; i < w->n && !s; i++) {
        if (max_shard_bytes > 0 && size > 0 && size + list[i]->bytes > max_shard_bytes) {
            nshards++;
            size = 0;
        }
        list[i]->shard = nshards - 1;
        size += list[i]->bytes;
    }
    for (int64_t i = 0, k = 0; k < nshards && !s; k++) {
        int64_t j = i;
        while (j < w->n && list[j]->shard == k) j++;
        memcpy(part, list + i, (size_t)(j - i) * sizeof *part);
        char *p = file_path(dir, k, nshards);
        s = p ? write_file(w, part, j - i, p) : mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
        free(p);
        i = j;
    }
    if (!s) s = write_index(dir, list, w->n, nshards);
    free(list);
    free(part);
    return s;
}

/* --- streaming: one tensor at a time ------------------------------------ *
 * Every tensor is declared (name, dtype, shape: metadata only) before the
 * first is written, so that at the first write the shards, their names
 * (model-0000K-of-0000N needs N) and each file's header are known. The data
 * then goes straight to its place in its file (seek + the core's write
 * loop), in any order, so the caller holds one tensor at a time; a shard is
 * finished (fsync, rename) as soon as its last tensor is written. The other
 * way, data to a temporary file and the header at the end, would copy every
 * byte twice and could not name the files before the end. */
typedef struct sshard {
    afile f;     /* open from its first tensor written to its last */
    char *path;
    sbuf header; /* built at the freeze, written when the file is opened */
    int64_t left; /* tensors not yet written */
    int state;   /* 0: not started, 1: open, 2: finished */
} sshard;

struct mrl_st_stream {
    char *dir;
    int64_t max_shard_bytes;
    mrl_st_writer decl; /* the declared tensors, in order, and the metadata */
    wtensor **byname;   /* after the freeze: sorted by name, for the writes' lookups */
    sshard *shards;
    int64_t nshards;
    int frozen;   /* declarations closed, files planned */
    int failed;   /* an I/O error: only mrl_st_stream_free is left */
    int finished;
};

mrl_status mrl_st_stream_open(const char *dir, int64_t max_shard_bytes, mrl_st_stream **out) {
    if (!dir || !out) return mrl_set_error(MRL_ERR_INVALID, "st_stream_open: dir and out must not be NULL");
    *out = NULL;
    if (max_shard_bytes < 0)
        return mrl_set_error(MRL_ERR_INVALID, "%s: st_stream_open: max_shard_bytes must be >= 0 (got %lld)", dir,
                             (long long)max_shard_bytes);
    mrl_status s = make_dir(dir);
    if (s) return s;
    mrl_st_stream *st = calloc(1, sizeof *st);
    if (!st || !(st->dir = mrl_st_strdup(dir))) {
        free(st);
        return mrl_set_error(MRL_ERR_NOMEM, "st_stream_open: out of memory");
    }
    st->max_shard_bytes = max_shard_bytes;
    *out = st;
    return MRL_OK;
}

void mrl_st_stream_free(mrl_st_stream *st) {
    if (!st) return;
    for (int64_t k = 0; k < st->nshards; k++) {
        sshard *sh = &st->shards[k];
        if (sh->state == 1) af_finish(&sh->f, MRL_ERR_IO); /* unfinished: its temporary file removed */
        free(sh->path);
        free(sh->header.p);
    }
    free(st->shards);
    free(st->byname);
    writer_clear(&st->decl);
    free(st->dir);
    free(st);
}

static mrl_status stream_usable(const mrl_st_stream *st, const char *what) {
    if (!st) return mrl_set_error(MRL_ERR_INVALID, "st_stream_%s: stream is NULL", what);
    if (st->failed)
        return mrl_set_error(MRL_ERR_INVALID, "%s: st_stream_%s after an earlier write failed", st->dir, what);
    if (st->finished) return mrl_set_error(MRL_ERR_INVALID, "%s: st_stream_%s after st_stream_finish", st->dir, what);
    return MRL_OK;
}

mrl_status mrl_st_stream_declare(mrl_st_stream *st, const char *name, mrl_dtype dtype, int ndim, const int64_t *shape) {
    mrl_status s = stream_usable(st, "declare");
    if (s) return s;
    if (st->frozen)
        return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s' declared after the first write (declare every tensor first)",
                             st->dir, name ? name : "(null)");
    wtensor t;
    s = describe(name, dtype, ndim, shape, &t);
    return s ? s : push(&st->decl, name, t);
}

mrl_status mrl_st_stream_set_metadata(mrl_st_stream *st, const char *key, const char *value) {
    mrl_status s = stream_usable(st, "set_metadata");
    if (s) return s;
    if (st->frozen)
        return mrl_set_error(MRL_ERR_INVALID, "%s: metadata '%s' set after the first write", st->dir, key ? key : "(null)");
    return mrl_st_writer_set_metadata(&st->decl, key, value);
}

/* Close the declarations: check the names, split into shards in declaration
 * order, name the files and build their headers. */
static mrl_status freeze(mrl_st_stream *st) {
    if (st->frozen) return MRL_OK;
    mrl_st_writer *d = &st->decl;
    st->byname = tensor_list(d);
    if (!st->byname) return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    mrl_status s = check_unique(st->byname, d->n, st->dir);
    if (s) return s;
    /* greedy in declaration order, as huggingface_hub's split_torch_state_dict_into_shards
     * (state-dict order), so a caller writing in that order has one file open at a time */
    int64_t nshards = 1, size = 0;
    for (int64_t i = 0; i < d->n; i++) {
        if (st->max_shard_bytes > 0 && size > 0 && size + d->t[i].bytes > st->max_shard_bytes) {
            nshards++;
            size = 0;
        }
        d->t[i].shard = nshards - 1;
        size += d->t[i].bytes;
    }
    st->shards = calloc((size_t)nshards, sizeof *st->shards);
    wtensor **part = malloc((size_t)(d->n ? d->n : 1) * sizeof *part);
    if (!st->shards || !part) {
        free(part);
        return mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
    }
    st->nshards = nshards;
    for (int64_t i = 0, k = 0; k < nshards && !s; k++) {
        sshard *sh = &st->shards[k];
        int64_t j = i;
        while (j < d->n && d->t[j].shard == k) part[j - i] = &d->t[j], j++;
        sh->left = j - i;
        sh->path = file_path(st->dir, k, nshards);
        s = sh->path ? make_header(d, part, j - i, sh->path, &sh->header)
                     : mrl_set_error(MRL_ERR_NOMEM, "safetensors: out of memory");
        i = j;
    }
    free(part);
    if (!s) st->frozen = 1;
    return s;
}

/* Open shard sh's temporary file and write its header. */
static mrl_status shard_start(sshard *sh) {
    mrl_status s = af_open(&sh->f, sh->path);
    if (s) return s;
    sh->state = 1;
    s = af_write(&sh->f, sh->header.p, sh->header.len);
    free(sh->header.p);
    sh->header.p = NULL;
    return s;
}

static mrl_status shard_finish(sshard *sh, mrl_status s) {
    s = af_finish(&sh->f, s);
    sh->state = 2;
    return s;
}

static mrl_status stream_write(mrl_st_stream *st, const char *name, int from_f32, const void *data, int64_t size) {
    const char *what = from_f32 ? "write" : "write_raw";
    mrl_status s = stream_usable(st, what);
    if (s) return s;
    if (!name) return mrl_set_error(MRL_ERR_INVALID, "%s: st_stream_%s: name is NULL", st->dir, what);
    if ((s = freeze(st))) {
        st->failed = 1;
        return s;
    }
    wtensor key = {.name = (char *)name}, *kp = &key;
    wtensor **found = bsearch(&kp, st->byname, (size_t)st->decl.n, sizeof *st->byname, cmp_name);
    if (!found) return mrl_set_error(MRL_ERR_INVALID, "%s: st_stream_%s: tensor '%s' was not declared", st->dir, what, name);
    wtensor t = **found;
    if (t.written) return mrl_set_error(MRL_ERR_INVALID, "%s: st_stream_%s: tensor '%s' written twice", st->dir, what, name);
    if (from_f32 && size != t.numel)
        return mrl_set_error(MRL_ERR_INVALID, "%s: st_stream_write: tensor '%s' has %lld elements, the source %lld", st->dir,
                             name, (long long)t.numel, (long long)size);
    if ((s = check_data(name, &t, from_f32, data, size))) return s;
    sshard *sh = &st->shards[t.shard];
    if (sh->state == 0) s = shard_start(sh);
    if (!s && t.bytes > 0 && lseek(sh->f.fd, t.at, SEEK_SET) != t.at)
        s = mrl_set_error(MRL_ERR_IO, "%s: tensor '%s': seek to byte %lld failed: %s", sh->path, name, (long long)t.at,
                          strerror(errno));
    if (from_f32) t.src = data;
    else t.raw = data;
    if (!s && t.bytes > 0) s = write_tensor_data(&sh->f, &t);
    if (!s) {
        (*found)->written = 1;
        if (--sh->left == 0) s = shard_finish(sh, MRL_OK);
    }
    if (s) st->failed = 1;
    return s;
}

mrl_status mrl_st_stream_write(mrl_st_stream *st, const char *name, const float *src, int64_t numel) {
    return stream_write(st, name, 1, src, numel);
}

mrl_status mrl_st_stream_write_raw(mrl_st_stream *st, const char *name, const void *data, int64_t bytes) {
    return stream_write(st, name, 0, data, bytes);
}

mrl_status mrl_st_stream_finish(mrl_st_stream *st) {
    mrl_status s = stream_usable(st, "finish");
    if (s) return s;
    if ((s = freeze(st))) {
        st->failed = 1;
        return s;
    }
    for (int64_t i = 0; i < st->decl.n; i++)
        if (!st->decl.t[i].written)
            return mrl_set_error(MRL_ERR_INVALID, "%s: tensor '%s' was declared but not written (%lld declared)", st->dir,
                                 st->decl.t[i].name, (long long)st->decl.n);
    /* a shard of no tensor (nothing declared) is written here */
    for (int64_t k = 0; k < st->nshards && !s; k++)
        if (st->shards[k].state == 0) {
            s = shard_start(&st->shards[k]);
            s = shard_finish(&st->shards[k], s);
        }
    if (!s) s = write_index(st->dir, st->byname, st->decl.n, st->nshards);
    if (s) st->failed = 1;
    else st->finished = 1;
    return s;
}
