/* safetensors: write with the C writer and read back (single file and
 * sharded directory), then corrupt files: each must give an error naming
 * the file and the field at fault, never a crash (run under ASan too);
 * a file truncated while open: an error, not a SIGBUS. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include "moonrl/safetensors.h"
#include "moonrl/status.h"
#include "check.h"

static char dir[64];

static char *path_in(const char *name) {
    static char buf[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    fwrite(data, 1, n, f);
    fclose(f);
}

static void write_str(const char *path, const char *text) { write_bytes(path, text, strlen(text)); }

/* A file with header text h and `data` bytes of zeros after it. */
static const char *make(const char *name, const char *h, size_t data) {
    size_t hl = strlen(h);
    unsigned char *b = calloc(1, 8 + hl + data);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, h, hl);
    const char *p = path_in(name);
    write_bytes(p, b, 8 + hl + data);
    free(b);
    return p;
}

static void expect_error(const char *path, mrl_status want, const char *needle) {
    mrl_st *st = (mrl_st *)1;
    mrl_status s = mrl_st_open(path, &st);
    CHECK(s == want);
    CHECK(st == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), path);
    CHECK_STR_CONTAINS(mrl_last_error(), needle);
}

static void test_roundtrip(void) {
    float a[6] = {1, -2.5f, 3.14159265f, 1e-8f, 65504, -0.0f}, b[3] = {0.1f, 0.2f, 0.3f}, c = 7;
    int64_t sa[2] = {2, 3}, sb[1] = {3};
    int64_t ids[3] = {1, -2, 1LL << 40};
    mrl_st_writer *w;
    CHECK_OK(mrl_st_writer_create(&w));
    CHECK_OK(mrl_st_writer_add(w, "layer.a", MRL_DTYPE_F32, 2, sa, a));
    CHECK_OK(mrl_st_writer_add(w, "layer.b", MRL_DTYPE_BF16, 1, sb, b));
    CHECK_OK(mrl_st_writer_add(w, "layer.\"c\"", MRL_DTYPE_F16, 0, NULL, &c));
    CHECK_OK(mrl_st_writer_add_raw(w, "ids", MRL_DTYPE_I64, 1, sb, ids, sizeof ids));
    CHECK_OK(mrl_st_writer_set_metadata(w, "format", "pt"));
    CHECK_OK(mrl_st_writer_set_metadata(w, "format", "moonrl"));
    CHECK(mrl_st_writer_add(w, "bad", MRL_DTYPE_I32, 1, sb, b) == MRL_ERR_INVALID);
    CHECK(mrl_st_writer_add_raw(w, "bad", MRL_DTYPE_I64, 1, sb, ids, 8) == MRL_ERR_INVALID);
    CHECK(mrl_st_writer_add(w, "bad", MRL_DTYPE_F32, 1, sb, NULL) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "NULL");
    int64_t zero[2] = {0, 5};
    CHECK_OK(mrl_st_writer_add(w, "empty", MRL_DTYPE_BF16, 2, zero, NULL));
    CHECK_OK(mrl_st_writer_write(w, path_in("one.safetensors")));
    CHECK_OK(mrl_st_writer_write_dir(w, path_in("sharded"), 20));
    mrl_st_writer_free(w);

    const char *paths[2] = {path_in("one.safetensors"), path_in("sharded")};
    for (int k = 0; k < 2; k++) {
        mrl_st *st;
        CHECK_OK(mrl_st_open(paths[k], &st));
        if (!st) continue;
        CHECK(mrl_st_count(st) == 5);
        CHECK(strcmp(mrl_st_metadata(st, "format"), "moonrl") == 0);
        CHECK(mrl_st_metadata(st, "nope") == NULL);
        mrl_st_tensor t;
        CHECK_OK(mrl_st_info(st, 1, &t)); /* sorted by name: empty, ids, ... */
        CHECK(strcmp(t.name, "ids") == 0 && t.dtype == MRL_DTYPE_I64 && t.bytes == 24);
        CHECK(memcmp(t.data, ids, 24) == 0);
        float out[6];
        CHECK_OK(mrl_st_read_f32(st, "layer.a", out, 6));
        CHECK(memcmp(out, a, sizeof a) == 0);
        CHECK_OK(mrl_st_find(st, "layer.a", &t));
        CHECK(t.ndim == 2 && t.shape[0] == 2 && t.shape[1] == 3 && t.numel == 6);
        CHECK_OK(mrl_st_read_f32(st, "layer.b", out, 3));
        for (int i = 0; i < 3; i++) CHECK(out[i] == mrl_bf16_to_f32(mrl_f32_to_bf16(b[i])));
        CHECK_OK(mrl_st_read_f32(st, "layer.\"c\"", out, 1));
        CHECK(out[0] == 7);
        CHECK(mrl_st_read_f32(st, "layer.a", out, 5) == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), "layer.a");
        CHECK(mrl_st_read_f32(st, "ids", out, 3) == MRL_ERR_UNSUPPORTED);
        CHECK(mrl_st_find(st, "missing", &t) == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), "missing");
        CHECK(mrl_st_has(st, "layer.b") == 1 && mrl_st_has(st, "x") == 0);
        CHECK(mrl_st_info(st, 5, &t) == MRL_ERR_INVALID);
        CHECK_OK(mrl_st_find(st, "empty", &t));
        CHECK(t.numel == 0 && t.bytes == 0 && t.ndim == 2 && t.shape[1] == 5);
        mrl_st_close(st);
    }
    CHECK(access(path_in("sharded/model.safetensors.index.json"), F_OK) == 0);
    CHECK(access(path_in("sharded/model-00004-of-00004.safetensors"), F_OK) == 0);
    /* rewriting the directory unsharded replaces the index */
    CHECK_OK(mrl_st_writer_create(&w));
    CHECK_OK(mrl_st_writer_add(w, "x", MRL_DTYPE_F32, 1, sb, b));
    CHECK_OK(mrl_st_writer_write_dir(w, path_in("sharded"), 0));
    mrl_st_writer_free(w);
    mrl_st *st;
    CHECK_OK(mrl_st_open(path_in("sharded"), &st));
    CHECK(mrl_st_count(st) == 1);
    mrl_st_close(st);
}

static void test_corrupt(void) {
    char good[] = "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    mrl_st *st;
    CHECK_OK(mrl_st_open(make("good.safetensors", good, 8), &st));
    mrl_st_close(st);
    expect_error(path_in("absent.safetensors"), MRL_ERR_IO, "cannot open");
    write_bytes(path_in("short.safetensors"), "abc", 3);
    expect_error(path_in("short.safetensors"), MRL_ERR_FORMAT, "too short");
    expect_error(make("truncated.safetensors", good, 4), MRL_ERR_FORMAT, "'w'");
    unsigned char huge[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'};
    write_bytes(path_in("huge.safetensors"), huge, sizeof huge);
    expect_error(path_in("huge.safetensors"), MRL_ERR_FORMAT, "header length");
    expect_error(make("json.safetensors", "{\"w\":{\"dtype\":\"F32\",", 8), MRL_ERR_FORMAT, "json.safetensors");
    expect_error(make("notobj.safetensors", "[1,2]", 0), MRL_ERR_FORMAT, "JSON object");
    expect_error(make("dtype.safetensors", "{\"w\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8),
                 MRL_ERR_FORMAT, "unknown dtype 'Q4'");
    expect_error(make("range.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 8),
                 MRL_ERR_FORMAT, "outside the data region");
    expect_error(make("count.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 16),
                 MRL_ERR_FORMAT, "needs 12");
    expect_error(make("neg.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8),
                 MRL_ERR_FORMAT, "shape[0]");
    expect_error(make("rev.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 8),
                 MRL_ERR_FORMAT, "data_offsets");
    expect_error(make("over.safetensors",
                      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12),
                 MRL_ERR_FORMAT, "overlap");
    expect_error(make("dup.safetensors",
                      "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                      "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8),
                 MRL_ERR_FORMAT, "twice");
    expect_error(make("meta.safetensors", "{\"__metadata__\":{\"k\":1}}", 0), MRL_ERR_FORMAT, "'k'");
    expect_error(make("big.safetensors",
                      "{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]}}", 8),
                 MRL_ERR_FORMAT, "overflow");
    expect_error(make("dims.safetensors", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1),
                 MRL_ERR_UNSUPPORTED, "dimensions");
    /* an index naming a file outside the directory, or a tensor not in its shard */
    CHECK(mkdir(path_in("idx"), 0755) == 0);
    write_str(path_in("idx/model.safetensors.index.json"), "{\"weight_map\":{}}"); /* found by fuzzing */
    expect_error(path_in("idx"), MRL_ERR_FORMAT, "'weight_map' names no tensor");
    write_str(path_in("idx/model.safetensors.index.json"), "{\"weight_map\":{\"w\":\"../good.safetensors\"}}");
    expect_error(path_in("idx"), MRL_ERR_FORMAT, "weight_map entry 'w'");
    make("idx/s.safetensors", good, 8);
    write_str(path_in("idx/model.safetensors.index.json"), "{\"weight_map\":{\"v\":\"s.safetensors\"}}");
    expect_error(path_in("idx"), MRL_ERR_FORMAT, "tensor 'v'");
    expect_error(dir, MRL_ERR_IO, "no model.safetensors");
}

/* Open (and read every tensor of) the file if it opens; never crash. */
static int open_and_read(const char *path) {
    mrl_st *st;
    if (mrl_st_open(path, &st) != MRL_OK) {
        CHECK(strstr(mrl_last_error(), path) != NULL);
        return 0;
    }
    float buf[64];
    for (int64_t i = 0; i < mrl_st_count(st); i++) {
        mrl_st_tensor t;
        CHECK_OK(mrl_st_info(st, i, &t));
        if (t.numel <= 64) mrl_st_read_f32(st, t.name, buf, t.numel);
    }
    mrl_st_close(st);
    return 1;
}

/* Every truncation and random header mutations of a valid file. */
static void test_mutations(void) {
    float x[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    int64_t s1[2] = {3, 4}, s2[1] = {5};
    mrl_st_writer *w;
    CHECK_OK(mrl_st_writer_create(&w));
    CHECK_OK(mrl_st_writer_add(w, "a", MRL_DTYPE_F32, 2, s1, x));
    CHECK_OK(mrl_st_writer_add(w, "b", MRL_DTYPE_BF16, 1, s2, x));
    CHECK_OK(mrl_st_writer_add(w, "c", MRL_DTYPE_F16, 1, s2, x));
    CHECK_OK(mrl_st_writer_set_metadata(w, "format", "pt"));
    const char *path = path_in("m.safetensors");
    CHECK_OK(mrl_st_writer_write(w, path));
    mrl_st_writer_free(w);
    FILE *f = fopen(path, "rb");
    unsigned char orig[1024];
    size_t size = fread(orig, 1, sizeof orig, f);
    fclose(f);
    size_t hlen = orig[0] | (size_t)orig[1] << 8;
    const char *mpath = path_in("mut.safetensors");
    int opened = 0;
    for (size_t len = 0; len < size; len++) {
        write_bytes(mpath, orig, len);
        opened += open_and_read(mpath);
    }
    CHECK(opened == 0); /* every truncation cuts into a tensor */
    static const char alphabet[] = "0123456789-\"{}[],:.eE \\x";
    uint32_t r = 2024;
    unsigned char buf[1024];
    for (int iter = 0; iter < 3000; iter++) {
        memcpy(buf, orig, size);
        int edits = 1 + iter % 3;
        for (int e = 0; e < edits; e++) {
            r = r * 1103515245u + 12345u;
            size_t at = 8 + (r >> 8) % hlen;
            r = r * 1103515245u + 12345u;
            buf[at] = (r >> 16) % 4 == 0 ? (unsigned char)(r >> 8) : (unsigned char)alphabet[(r >> 8) % (sizeof alphabet - 1)];
        }
        write_bytes(mpath, buf, size);
        open_and_read(mpath);
    }
}

/* A file truncated by someone else while it is open (and mapped): reading
 * is an error naming the file, not a SIGBUS. F32 (read straight into dst)
 * and BF16 (read in chunks and converted). */
static void test_truncated_after_open(void) {
    enum { N = 65536 }; /* 256 KiB of F32, 128 KiB of BF16: many pages past the cut */
    float *x = malloc(sizeof(float) * N), *out = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) x[i] = (float)i;
    int64_t shape[1] = {N};
    const char *path = path_in("truncated.safetensors");
    mrl_st_writer *w;
    CHECK_OK(mrl_st_writer_create(&w));
    CHECK_OK(mrl_st_writer_add(w, "a", MRL_DTYPE_F32, 1, shape, x));
    CHECK_OK(mrl_st_writer_add(w, "b", MRL_DTYPE_BF16, 1, shape, x));
    CHECK_OK(mrl_st_writer_write(w, path));
    mrl_st_writer_free(w);
    mrl_st *st = NULL;
    CHECK_OK(mrl_st_open(path, &st));
    if (!st) goto done;
    CHECK_OK(mrl_st_read_f32(st, "a", out, N)); /* intact: reads as written */
    CHECK(out[N - 1] == (float)(N - 1));
    CHECK(truncate(path, 4096) == 0);
    const char *names[2] = {"a", "b"};
    for (int k = 0; k < 2; k++) {
        CHECK(mrl_st_read_f32(st, names[k], out, N) == MRL_ERR_IO);
        CHECK_STR_CONTAINS(mrl_last_error(), path);
        CHECK_STR_CONTAINS(mrl_last_error(), "truncated");
    }
    mrl_st_close(st);
done:
    free(x);
    free(out);
}

/* Range reads: slices at the start, middle, end and across rows of F32,
 * BF16 and F16 tensors equal the same slice of a full read, in one file and
 * through an index of 2 shards; every range outside the tensor is an error
 * naming the file, tensor and range. */
static void test_range(void) {
    enum { R = 7, C = 13 };
    float x[R * C];
    for (int i = 0; i < R * C; i++) x[i] = (float)(i * 0.37 - 11.5) * (i % 3 ? 1.0f : -1e-3f);
    int64_t s2[2] = {R, C}, s3[3] = {R, 1, C}, s1[1] = {3};
    int64_t ids[3] = {1, 2, 3};
    mrl_st_writer *w;
    CHECK_OK(mrl_st_writer_create(&w));
    CHECK_OK(mrl_st_writer_add(w, "w.f32", MRL_DTYPE_F32, 2, s2, x));
    CHECK_OK(mrl_st_writer_add(w, "w.bf16", MRL_DTYPE_BF16, 2, s2, x));
    CHECK_OK(mrl_st_writer_add(w, "w.f16", MRL_DTYPE_F16, 3, s3, x));
    CHECK_OK(mrl_st_writer_add_raw(w, "ids", MRL_DTYPE_I64, 1, s1, ids, sizeof ids));
    CHECK_OK(mrl_st_writer_write(w, path_in("range.safetensors")));
    /* bytes in name order: ids 24, w.bf16 182, w.f16 182 | w.f32 364: two shards */
    CHECK_OK(mrl_st_writer_write_dir(w, path_in("range_dir"), 400));
    mrl_st_writer_free(w);
    CHECK(access(path_in("range_dir/model-00002-of-00002.safetensors"), F_OK) == 0);
    CHECK(access(path_in("range_dir/model-00003-of-00003.safetensors"), F_OK) != 0);
    const char *paths[2] = {path_in("range.safetensors"), path_in("range_dir")};
    const char *names[3] = {"w.f32", "w.bf16", "w.f16"};
    for (int k = 0; k < 2; k++) {
        mrl_st *st = NULL;
        CHECK_OK(mrl_st_open(paths[k], &st));
        if (!st) continue;
        for (int n = 0; n < 3; n++) {
            mrl_st_tensor t;
            CHECK_OK(mrl_st_find(st, names[n], &t));
            float full[R * C], part[R * C + 1];
            CHECK_OK(mrl_st_read_f32(st, names[n], full, t.numel));
            int64_t m = t.numel;
            /* {first, count}: start, middle, across a row boundary (C = 13), the end, all, empty */
            int64_t ranges[][2] = {{0, 1}, {0, 5}, {2 * C + 3, 4}, {C - 2, 5}, {C - 1, C + 2}, {m - 3, 3}, {m - 1, 1},
                                   {0, m}, {m, 0}, {0, 0}, {17, 0}};
            for (size_t r = 0; r < sizeof ranges / sizeof ranges[0]; r++) {
                int64_t first = ranges[r][0], count = ranges[r][1];
                part[count] = 12345.f;
                CHECK_OK(mrl_st_read_f32_range(st, names[n], first, count, part));
                CHECK(memcmp(part, full + first, (size_t)count * sizeof(float)) == 0);
                CHECK(part[count] == 12345.f); /* nothing written past count */
            }
            /* out of range: each an error naming the file (the shard), tensor and range */
            const char *file = k == 0 ? paths[0] : t.shard == 0 ? "model-00001-of-00002" : "model-00002-of-00002";
            int64_t bad[][2] = {{-1, 1}, {0, -1}, {-5, -5}, {m - 2, 3}, {m + 1, 0}, {0, m + 1}, {INT64_MAX, 2},
                                {2, INT64_MAX}, {INT64_MIN, 1}, {INT64_MAX, INT64_MAX}};
            for (size_t r = 0; r < sizeof bad / sizeof bad[0]; r++) {
                char want[128];
                snprintf(want, sizeof want, "first=%lld count=%lld", (long long)bad[r][0], (long long)bad[r][1]);
                CHECK(mrl_st_read_f32_range(st, names[n], bad[r][0], bad[r][1], part) == MRL_ERR_INVALID);
                CHECK_STR_CONTAINS(mrl_last_error(), want);
                CHECK_STR_CONTAINS(mrl_last_error(), names[n]);
                CHECK_STR_CONTAINS(mrl_last_error(), file);
            }
            CHECK(mrl_st_read_f32_range(st, names[n], 0, 1, NULL) == MRL_ERR_INVALID);
            CHECK_STR_CONTAINS(mrl_last_error(), "NULL");
        }
        float out[4];
        CHECK(mrl_st_read_f32_range(st, "ids", 0, 1, out) == MRL_ERR_UNSUPPORTED);
        CHECK_STR_CONTAINS(mrl_last_error(), "'ids' is I64");
        CHECK(mrl_st_read_f32_range(st, "nope", 0, 1, out) == MRL_ERR_INVALID);
        CHECK_STR_CONTAINS(mrl_last_error(), "no tensor named 'nope'");
        mrl_st_close(st);
    }
}

/* bytes this process has read so far (read and pread calls) */
static long long bytes_read(void) {
    FILE *f = fopen("/proc/self/io", "r");
    long long v = -1;
    if (f) {
        if (fscanf(f, "rchar: %lld", &v) != 1) v = -1;
        fclose(f);
    }
    return v;
}

/* A range of a large tensor reads its bytes alone: measured by the bytes the
 * process read (/proc/self/io's rchar), and proven by a file truncated right
 * after the range: the range still reads, the whole tensor no longer does. */
static void test_range_reads_only_range(void) {
    enum { N = 1 << 21, FIRST = 1000003, COUNT = 1000 }; /* 8 MiB as F32, 4 MiB as BF16 */
    float *x = malloc(sizeof(float) * N), *out = malloc(sizeof(float) * COUNT);
    for (int i = 0; i < N; i++) x[i] = (float)(i % 4099) - 2000.5f;
    int64_t shape[2] = {N / 1024, 1024};
    const mrl_dtype dtypes[2] = {MRL_DTYPE_F32, MRL_DTYPE_BF16};
    for (int k = 0; k < 2; k++) {
        const char *path = path_in(k ? "big_bf16.safetensors" : "big_f32.safetensors");
        mrl_st_writer *w;
        CHECK_OK(mrl_st_writer_create(&w));
        CHECK_OK(mrl_st_writer_add(w, "big", dtypes[k], 2, shape, x));
        CHECK_OK(mrl_st_writer_write(w, path));
        mrl_st_writer_free(w);
        mrl_st *st = NULL;
        CHECK_OK(mrl_st_open(path, &st));
        if (!st) continue;
        long long size = (long long)mrl_dtype_size(dtypes[k]);
        long long before = bytes_read();
        CHECK_OK(mrl_st_read_f32_range(st, "big", FIRST, COUNT, out));
        long long delta = bytes_read() - before; /* the range, and the first /proc read's own text */
        CHECK(before >= 0 && delta >= COUNT * size && delta < COUNT * size + 4096);
        if (!(delta < COUNT * size + 4096)) fprintf(stderr, "read %lld bytes for a range of %lld\n", delta, COUNT * size);
        for (int i = 0; i < COUNT; i++)
            CHECK(out[i] == (k ? mrl_bf16_to_f32(mrl_f32_to_bf16(x[FIRST + i])) : x[FIRST + i]));
        mrl_st_tensor t;
        CHECK_OK(mrl_st_find(st, "big", &t));
        FILE *f = fopen(path, "rb");
        long long hl = 0;
        unsigned char h8[8];
        CHECK(f && fread(h8, 1, 8, f) == 8);
        if (f) fclose(f);
        for (int i = 7; i >= 0; i--) hl = hl << 8 | h8[i];
        CHECK(truncate(path, 8 + hl + (FIRST + COUNT) * size) == 0); /* the data region starts at 8 + hl */
        CHECK_OK(mrl_st_read_f32_range(st, "big", FIRST, COUNT, out));
        CHECK(out[COUNT - 1] == (k ? mrl_bf16_to_f32(mrl_f32_to_bf16(x[FIRST + COUNT - 1])) : x[FIRST + COUNT - 1]));
        float *all = malloc(sizeof(float) * N);
        CHECK(mrl_st_read_f32(st, "big", all, N) == MRL_ERR_IO);
        CHECK(mrl_st_read_f32_range(st, "big", FIRST, COUNT + 1, out) == MRL_ERR_IO);
        CHECK_STR_CONTAINS(mrl_last_error(), "truncated");
        free(all);
        mrl_st_close(st);
    }
    free(x);
    free(out);
}

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*n + 1);
    if (fread(b, 1, *n, f) != *n) *n = 0;
    b[*n] = 0;
    fclose(f);
    return b;
}

/* A sharded directory of 10,000 bytes or more: the index's total_size has 5 digits (its first
 * line was formatted into a 64-byte buffer, so a NUL and stack bytes replaced the '{' of
 * weight_map and the index did not parse) */
static void test_index_total_size(void) {
    enum { N = 2048 }; /* 8 KiB as F32 */
    float *x = calloc(N, sizeof(float));
    int64_t shape[1] = {N};
    const char *d = path_in("big_index");
    mrl_st_writer *w;
    CHECK_OK(mrl_st_writer_create(&w));
    CHECK_OK(mrl_st_writer_add(w, "a", MRL_DTYPE_F32, 1, shape, x));
    CHECK_OK(mrl_st_writer_add(w, "b", MRL_DTYPE_F32, 1, shape, x));
    CHECK_OK(mrl_st_writer_write_dir(w, d, 10000));
    mrl_st_writer_free(w);
    mrl_st *st = NULL;
    CHECK_OK(mrl_st_open(d, &st));
    CHECK(mrl_st_count(st) == 2);
    mrl_st_close(st);
    size_t n;
    char *index = (char *)slurp(path_in("big_index/model.safetensors.index.json"), &n);
    CHECK_STR_CONTAINS(index, "\"total_size\": 16384\n  },\n  \"weight_map\": {\n    \"a\": \"model-00001-of-00002.safetensors\"");
    free(index);
    free(x);
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/mrl_st_test_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    test_roundtrip();
    test_corrupt();
    test_mutations();
    test_truncated_after_open();
    test_range();
    test_range_reads_only_range();
    test_index_total_size();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) return 1;
    CHECK_DONE();
}
