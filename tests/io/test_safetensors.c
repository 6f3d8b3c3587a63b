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
#include "moonrl/mem.h"
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

/* Tensors "a" (F32) and "b" (dtype_b) of n values x each: one file at path, or with
 * max_shard >= 0 a directory of shards of at most max_shard bytes. */
static void write_ab(const char *path, mrl_dtype dtype_b, int64_t n, const float *x, int64_t max_shard) {
    int64_t shape[1] = {n};
    mrl_st_writer *w;
    CHECK_OK(mrl_st_writer_create(&w));
    CHECK_OK(mrl_st_writer_add(w, "a", MRL_DTYPE_F32, 1, shape, x));
    CHECK_OK(mrl_st_writer_add(w, "b", dtype_b, 1, shape, x));
    if (max_shard >= 0) CHECK_OK(mrl_st_writer_write_dir(w, path, max_shard));
    else CHECK_OK(mrl_st_writer_write(w, path));
    mrl_st_writer_free(w);
}

/* A file truncated by someone else while it is open (and mapped): reading
 * is an error naming the file, not a SIGBUS. F32 (read straight into dst)
 * and BF16 (read in chunks and converted). */
static void test_truncated_after_open(void) {
    enum { N = 65536 }; /* 256 KiB of F32, 128 KiB of BF16: many pages past the cut */
    float *x = malloc(sizeof(float) * N), *out = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) x[i] = (float)i;
    const char *path = path_in("truncated.safetensors");
    write_ab(path, MRL_DTYPE_BF16, N, x, -1);
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

/* --- the streamed writer -------------------------------------------------- */
typedef struct spec {
    const char *name;
    mrl_dtype dtype;
    int ndim;
    int64_t shape[2];
    int shard; /* expected: filled in declaration order, at most 600 bytes each */
} spec;

/* 590 | 526 | 598 bytes (in name order they would split differently: ids, lm_head, embed first) */
static const spec specs[] = {
    {"model.embed_tokens.weight", MRL_DTYPE_BF16, 2, {4, 8}, 1}, {"model.layers.0.mlp.weight", MRL_DTYPE_F32, 2, {16, 8}, 1},
    {"model.layers.0.norm.weight", MRL_DTYPE_F16, 1, {7}, 1},    {"model.layers.1.mlp.weight", MRL_DTYPE_F32, 2, {16, 8}, 2},
    {"model.layers.1.norm.weight", MRL_DTYPE_F16, 1, {7}, 2},    {"model.layers.2.mlp.weight", MRL_DTYPE_F32, 2, {16, 8}, 3},
    {"model.layers.2.norm.weight", MRL_DTYPE_F16, 1, {7}, 3},    {"lm_head.weight", MRL_DTYPE_BF16, 2, {4, 8}, 3},
    {"ids", MRL_DTYPE_I64, 1, {1}, 3},                           {"empty", MRL_DTYPE_F32, 2, {0, 3}, 3},
};
enum { NSPECS = sizeof specs / sizeof specs[0] };

static int64_t spec_numel(const spec *p) { return p->ndim == 1 ? p->shape[0] : p->shape[0] * p->shape[1]; }

/* tensor i's values, produced into one reused buffer (the stream keeps none) */
static float *values(int i, float *buf) {
    for (int64_t j = 0; j < spec_numel(&specs[i]); j++) buf[j] = (float)((j * 7 + i * 13) % 29 - 14) * (0.125f + (float)i);
    return buf;
}

/* tensor i as the bytes it is stored as */
static void stored(int i, uint8_t *out) {
    float v[128];
    values(i, v);
    int64_t n = spec_numel(&specs[i]);
    if (specs[i].dtype == MRL_DTYPE_F32) memcpy(out, v, (size_t)n * 4);
    else if (specs[i].dtype == MRL_DTYPE_BF16) mrl_convert_f32_to_bf16(v, (uint16_t *)out, n);
    else if (specs[i].dtype == MRL_DTYPE_F16) mrl_convert_f32_to_f16(v, (uint16_t *)out, n);
    else for (int64_t j = 0; j < n; j++) ((int64_t *)out)[j] = (1LL << 40) + i * 1000 + j;
}

static mrl_status stream_put(mrl_st_stream *st, int i) {
    float buf[128];
    if (specs[i].dtype == MRL_DTYPE_I64) {
        uint8_t raw[8];
        stored(i, raw);
        return mrl_st_stream_write_raw(st, specs[i].name, raw, 8);
    }
    return mrl_st_stream_write(st, specs[i].name, values(i, buf), spec_numel(&specs[i]));
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

static int files_in(const char *d) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "test $(ls -A %s | wc -l) -eq 0", d);
    return system(cmd) != 0;
}

/* Stream 10 tensors (F32 / BF16 / F16 from fp32, I64 raw, an empty one) into 3 shards, written
 * out of declaration order; each shard is in place once its last tensor is; read back through
 * the index: bytes as stored, each shard file byte-identical to mrl_st_writer_write's of the
 * same tensors; the index names each tensor's shard; misuse is an error naming the tensor. */
static void test_stream(void) {
    char d[256];
    snprintf(d, sizeof d, "%s", path_in("stream"));
    mrl_st_stream *st = NULL;
    CHECK(mrl_st_stream_open(d, -1, &st) == MRL_ERR_INVALID && st == NULL);
    CHECK_OK(mrl_st_stream_open(d, 600, &st));
    if (!st) return;
    CHECK_OK(mrl_st_stream_set_metadata(st, "format", "pt"));
    for (int i = 0; i < NSPECS; i++)
        CHECK_OK(mrl_st_stream_declare(st, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape));
    char f1[64], f2[64];
    snprintf(f1, sizeof f1, "stream/model-00001-of-00003.safetensors");
    snprintf(f2, sizeof f2, "stream/model-00002-of-00003.safetensors");
    CHECK(mrl_st_stream_write(st, "nope", NULL, 0) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "'nope' was not declared");
    CHECK_OK(stream_put(st, 2)); /* shard 1 backwards: each tensor at its place */
    CHECK_OK(stream_put(st, 1));
    CHECK(access(path_in(f1), F_OK) != 0);
    CHECK_OK(stream_put(st, 0));
    CHECK(access(path_in(f1), F_OK) == 0); /* finished with its last tensor */
    CHECK_OK(stream_put(st, 5));           /* shards 2 and 3 open together */
    CHECK_OK(stream_put(st, 3));
    CHECK(access(path_in(f2), F_OK) != 0);
    CHECK_OK(stream_put(st, 4));
    CHECK(access(path_in(f2), F_OK) == 0);
    CHECK(mrl_st_stream_finish(st) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "'model.layers.2.norm.weight' was declared but not written");
    float buf[128];
    CHECK(mrl_st_stream_write(st, specs[0].name, values(0, buf), 32) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "'model.embed_tokens.weight' written twice");
    CHECK(mrl_st_stream_write(st, "lm_head.weight", values(7, buf), 31) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "'lm_head.weight' has 32 elements, the source 31");
    CHECK(mrl_st_stream_write(st, "ids", buf, 1) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "not I64");
    CHECK(mrl_st_stream_write_raw(st, "ids", buf, 4) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "'ids': 4 bytes given");
    CHECK(mrl_st_stream_declare(st, "late", MRL_DTYPE_F32, 1, specs[8].shape) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "'late' declared after the first write");
    CHECK(mrl_st_stream_set_metadata(st, "k", "v") == MRL_ERR_INVALID);
    for (int i = 6; i < NSPECS; i++) CHECK_OK(stream_put(st, i));
    CHECK_OK(mrl_st_stream_finish(st));
    CHECK(mrl_st_stream_finish(st) == MRL_ERR_INVALID);
    mrl_st_stream_free(st);
    CHECK(access(path_in("stream/model.safetensors"), F_OK) != 0);

    mrl_st *r = NULL;
    CHECK_OK(mrl_st_open(d, &r));
    if (r) {
        CHECK(mrl_st_count(r) == NSPECS);
        CHECK(strcmp(mrl_st_metadata(r, "format"), "pt") == 0);
        for (int i = 0; i < NSPECS; i++) {
            mrl_st_tensor t;
            uint8_t want[512];
            stored(i, want);
            CHECK_OK(mrl_st_find(r, specs[i].name, &t));
            CHECK(t.dtype == specs[i].dtype && t.ndim == specs[i].ndim && t.shape[0] == specs[i].shape[0]);
            CHECK(t.bytes == spec_numel(&specs[i]) * (int64_t)mrl_dtype_size(specs[i].dtype));
            CHECK(memcmp(t.data, want, (size_t)t.bytes) == 0);
        }
        mrl_st_close(r);
    }
    size_t n;
    char *index = (char *)slurp(path_in("stream/model.safetensors.index.json"), &n);
    CHECK_STR_CONTAINS(index, "{\n  \"metadata\": {\n    \"total_size\": 1714\n  },\n  \"weight_map\": {\n    \"empty\": ");
    for (int i = 0; i < NSPECS; i++) {
        char entry[160];
        snprintf(entry, sizeof entry, "\"%s\": \"model-%05d-of-00003.safetensors\"", specs[i].name, specs[i].shard);
        CHECK_STR_CONTAINS(index, entry);
    }
    free(index);
    /* each shard as the all-at-once writer lays out the same tensors */
    for (int k = 1; k <= 3; k++) {
        mrl_st_writer *w;
        CHECK_OK(mrl_st_writer_create(&w));
        CHECK_OK(mrl_st_writer_set_metadata(w, "format", "pt"));
        uint8_t data[NSPECS][512];
        for (int i = 0; i < NSPECS; i++) {
            if (specs[i].shard != k) continue;
            stored(i, data[i]);
            int64_t bytes = spec_numel(&specs[i]) * (int64_t)mrl_dtype_size(specs[i].dtype);
            CHECK_OK(mrl_st_writer_add_raw(w, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape, data[i], bytes));
        }
        CHECK_OK(mrl_st_writer_write(w, path_in("ref.safetensors")));
        mrl_st_writer_free(w);
        char name[64];
        snprintf(name, sizeof name, "stream/model-%05d-of-00003.safetensors", k);
        size_t na, nb;
        uint8_t *a = slurp(path_in(name), &na), *b = slurp(path_in("ref.safetensors"), &nb);
        CHECK(a && b && na == nb && na > 0 && memcmp(a, b, na) == 0);
        free(a);
        free(b);
    }
}

/* A stream freed before its end leaves no file behind, a finished shard aside; one that fits
 * one file writes model.safetensors and removes an old index; a stream of no tensor writes an
 * empty file; a name declared twice is an error at the first write. */
static void test_stream_edges(void) {
    char d[256];
    snprintf(d, sizeof d, "%s", path_in("stream_abort"));
    mrl_st_stream *st = NULL;
    CHECK_OK(mrl_st_stream_open(d, 600, &st));
    for (int i = 0; i < NSPECS; i++)
        CHECK_OK(mrl_st_stream_declare(st, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape));
    CHECK_OK(stream_put(st, 3)); /* shard 2 started, not finished */
    CHECK(files_in(d));          /* its temporary file */
    mrl_st_stream_free(st);
    CHECK(!files_in(d));

    snprintf(d, sizeof d, "%s", path_in("stream_one"));
    CHECK(mkdir(d, 0755) == 0);
    write_str(path_in("stream_one/model.safetensors.index.json"), "{\"weight_map\":{\"old\":\"model-00001-of-00002.safetensors\"}}");
    CHECK_OK(mrl_st_stream_open(d, 0, &st));
    for (int i = 0; i < NSPECS; i++)
        CHECK_OK(mrl_st_stream_declare(st, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape));
    for (int i = NSPECS - 1; i >= 0; i--) CHECK_OK(stream_put(st, i));
    CHECK_OK(mrl_st_stream_finish(st));
    mrl_st_stream_free(st);
    CHECK(access(path_in("stream_one/model.safetensors.index.json"), F_OK) != 0);
    mrl_st *r = NULL;
    CHECK_OK(mrl_st_open(d, &r));
    CHECK(mrl_st_count(r) == NSPECS);
    mrl_st_close(r);

    CHECK_OK(mrl_st_stream_open(path_in("stream_none"), 0, &st));
    CHECK_OK(mrl_st_stream_finish(st));
    mrl_st_stream_free(st);
    CHECK_OK(mrl_st_open(path_in("stream_none/model.safetensors"), &r));
    CHECK(mrl_st_count(r) == 0);
    mrl_st_close(r);

    CHECK_OK(mrl_st_stream_open(path_in("stream_dup"), 0, &st));
    CHECK_OK(mrl_st_stream_declare(st, "a", MRL_DTYPE_F32, 0, NULL));
    CHECK_OK(mrl_st_stream_declare(st, "a", MRL_DTYPE_BF16, 0, NULL));
    float one = 1;
    CHECK(mrl_st_stream_write(st, "a", &one, 1) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "tensor 'a' was added twice");
    CHECK(mrl_st_stream_finish(st) == MRL_ERR_INVALID);
    mrl_st_stream_free(st);
    CHECK(!files_in(path_in("stream_dup")));
}

/* A sharded directory of 10,000 bytes or more: the index's total_size has 5 digits (its first
 * line was formatted into a 64-byte buffer, so a NUL and stack bytes replaced the '{' of
 * weight_map and the index did not parse) */
static void test_index_total_size(void) {
    enum { N = 2048 }; /* 8 KiB as F32 */
    float *x = calloc(N, sizeof(float));
    const char *d = path_in("big_index");
    write_ab(d, MRL_DTYPE_F32, N, x, 10000);
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

/* A streamed model is never held whole: 16 tensors of 4 MiB of fp32 (32 MiB as BF16, 4 shards)
 * produced one after the other into one buffer raise the resident peak by far less than the
 * model (a stream keeping its tensors' data would raise it by 32 MiB or more). */
static void test_stream_memory(void) {
    enum { T = 16, N = 1 << 20 };
    float *buf = malloc(sizeof(float) * N);
    memset(buf, 0, sizeof(float) * N); /* resident before the measure */
    int64_t shape[2] = {1024, N / 1024};
    mrl_st_stream *st = NULL;
    CHECK_OK(mrl_st_stream_open(path_in("stream_mem"), 8 << 20, &st));
    char name[32];
    for (int i = 0; i < T; i++) {
        snprintf(name, sizeof name, "layers.%d.w", i);
        CHECK_OK(mrl_st_stream_declare(st, name, MRL_DTYPE_BF16, 2, shape));
    }
    mrl_mem_reset_rss_peak();
    int64_t before = mrl_mem_rss_peak();
    for (int i = 0; i < T; i++) {
        for (int j = 0; j < N; j++) buf[j] = (float)(i * 3 + j % 7);
        snprintf(name, sizeof name, "layers.%d.w", i);
        CHECK_OK(mrl_st_stream_write(st, name, buf, N));
    }
    CHECK_OK(mrl_st_stream_finish(st));
    int64_t grew = mrl_mem_rss_peak() - before;
    mrl_st_stream_free(st);
    CHECK(before > 0 && grew < (8 << 20));
    if (!(grew < (8 << 20))) fprintf(stderr, "streaming 32 MiB raised the resident peak by %lld bytes\n", (long long)grew);
    mrl_st *r = NULL;
    CHECK_OK(mrl_st_open(path_in("stream_mem"), &r));
    CHECK(mrl_st_count(r) == T);
    CHECK_OK(mrl_st_read_f32_range(r, "layers.15.w", N - 2, 2, buf));
    CHECK(buf[0] == (float)(45 + (N - 2) % 7) && buf[1] == (float)(45 + (N - 1) % 7));
    mrl_st_close(r);
    CHECK(access(path_in("stream_mem/model-00004-of-00004.safetensors"), F_OK) == 0);
    free(buf);
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
    test_stream();
    test_stream_edges();
    test_stream_memory();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) return 1;
    CHECK_DONE();
}
