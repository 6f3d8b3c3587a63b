/* GGUF reader: a small file built here (metadata of several types, an F32,
 * a Q8_0 and a Q4_K tensor) reads back; copies of it with two tensor infos
 * on the same bytes, a tensor relabelled to a longer type, an offset past
 * the running size, a NaN or an infinity in a tensor and a repeated name are
 * each an error naming the tensor; then a fuzzing campaign (run under
 * ASan and UBSan by the sanitize pass of the suite): thousands of copies of
 * it with random bytes changed, random 64-bit fields set to huge values and
 * random cuts. Each must either open (and every tensor then reads or fails
 * cleanly) or fail with an error naming the file: never a crash, an
 * out-of-bounds read or an unbounded allocation. The bit-exact checks of
 * every type against llama.cpp's gguf-py are in ref_gguf.py. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "moonrl/gguf.h"
#include "moonrl/status.h"
#include "check.h"
#include "random.h"

static char dir[64];

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *x, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, x, n);
    b->n += n;
}
static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(buf *b, const char *s) {
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void pad(buf *b, size_t align) {
    while (b->n % align) put(b, "", 1);
}

/* The file: 3 pairs, 3 tensors (F32 [8], Q8_0 [32 x 2], Q4_K [256]). */
static buf make_file(void) {
    buf b = {0};
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, 3); /* tensors */
    put_u64(&b, 3); /* pairs */
    put_str(&b, "general.architecture");
    put_u32(&b, MRL_GGUF_STRING);
    put_str(&b, "llama");
    put_str(&b, "llama.block_count");
    put_u32(&b, MRL_GGUF_UINT32);
    put_u32(&b, 2);
    put_str(&b, "tokenizer.ggml.tokens");
    put_u32(&b, MRL_GGUF_ARRAY);
    put_u32(&b, MRL_GGUF_STRING);
    put_u64(&b, 3);
    put_str(&b, "<s>");
    put_str(&b, "a");
    put_str(&b, "bc");
    /* tensor infos: name, n_dims, dims, type, offset (data offsets aligned to 32) */
    put_str(&b, "f32");
    put_u32(&b, 1);
    put_u64(&b, 8);
    put_u32(&b, MRL_GGML_F32);
    put_u64(&b, 0);
    put_str(&b, "q8");
    put_u32(&b, 2);
    put_u64(&b, 32);
    put_u64(&b, 2);
    put_u32(&b, MRL_GGML_Q8_0);
    put_u64(&b, 32);
    put_str(&b, "q4k");
    put_u32(&b, 1);
    put_u64(&b, 256);
    put_u32(&b, MRL_GGML_Q4_K);
    put_u64(&b, 32 + 96);
    pad(&b, 32);
    float f[8] = {1, -2, 0.5f, 3, 4, 5, 6, 7};
    put(&b, f, sizeof f);
    pad(&b, 32);
    for (int blk = 0; blk < 2; blk++) { /* Q8_0: d = 0.5 (fp16 0x3800), q = i - 16 */
        uint16_t d = 0x3800;
        put(&b, &d, 2);
        for (int i = 0; i < 32; i++) {
            int8_t q = (int8_t)(i - 16);
            put(&b, &q, 1);
        }
    }
    pad(&b, 32);
    uint8_t k[144] = {0};
    uint16_t one = 0x3C00; /* d = 1, dmin = 1 */
    memcpy(k, &one, 2);
    memcpy(k + 2, &one, 2);
    for (int i = 0; i < 12; i++) k[4 + i] = (uint8_t)(i + 1);
    for (int i = 0; i < 128; i++) k[16 + i] = (uint8_t)(i * 7);
    put(&b, k, sizeof k);
    return b;
}

static void write_file(const char *path, const uint8_t *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (n) fwrite(p, 1, n, f);
    fclose(f);
}

static void test_reads(const char *path) {
    mrl_gguf *g = NULL;
    CHECK_OK(mrl_gguf_open(path, &g));
    if (!g) return;
    CHECK(mrl_gguf_version(g) == 3);
    CHECK(mrl_gguf_kv_count(g) == 3 && mrl_gguf_tensor_count(g) == 3);
    int64_t i = mrl_gguf_find_kv(g, "llama.block_count");
    double v = 0;
    CHECK_OK(mrl_gguf_kv_number(g, i, -1, &v));
    CHECK(v == 2);
    const char *s;
    int64_t len;
    i = mrl_gguf_find_kv(g, "tokenizer.ggml.tokens");
    CHECK(mrl_gguf_kv_type(g, i) == MRL_GGUF_ARRAY && mrl_gguf_kv_array_len(g, i) == 3);
    CHECK_OK(mrl_gguf_kv_string(g, i, 2, &s, &len));
    CHECK(len == 2 && !memcmp(s, "bc", 2));
    CHECK(mrl_gguf_kv_string(g, i, 3, &s, &len) == MRL_ERR_INVALID); /* past the array */
    CHECK(mrl_gguf_kv_number(g, i, 0, &v) == MRL_ERR_INVALID);       /* strings are not numbers */
    float f[8], q8[64], q4k[256];
    CHECK_OK(mrl_gguf_read_f32(g, mrl_gguf_find_tensor(g, "f32"), f, 8));
    CHECK(f[1] == -2 && f[7] == 7);
    CHECK_OK(mrl_gguf_read_f32(g, mrl_gguf_find_tensor(g, "q8"), q8, 64));
    CHECK(q8[0] == -8 && q8[31] == 7.5f && q8[32] == -8);
    CHECK_OK(mrl_gguf_read_f32(g, mrl_gguf_find_tensor(g, "q4k"), q4k, 256));
    /* first sub-block: scale 1, min 5 (scales[0] = 1, scales[4] = 5); q = (0 * 7) & 15 = 0 -> -5 */
    CHECK(q4k[0] == -5.0f);
    CHECK(mrl_gguf_read_f32(g, mrl_gguf_find_tensor(g, "q4k"), q4k, 255) == MRL_ERR_INVALID);
    mrl_gguf_tensor t;
    CHECK_OK(mrl_gguf_tensor_info(g, mrl_gguf_find_tensor(g, "q8"), &t));
    CHECK(t.ndim == 2 && t.shape[0] == 32 && t.shape[1] == 2 && t.bytes == 68 && !strcmp(t.type_name, "Q8_0"));
    mrl_gguf_close(g);
}

/* A mutated file: opens and reads, or fails naming the file. */
static int try_file(const char *path) {
    mrl_gguf *g = NULL;
    mrl_status st = mrl_gguf_open(path, &g);
    if (st) {
        CHECK(strstr(mrl_last_error(), path) != NULL);
        return 0;
    }
    for (int64_t i = 0; i < mrl_gguf_kv_count(g); i++) {
        double v;
        const char *s;
        int64_t len;
        int64_t n = mrl_gguf_kv_array_len(g, i);
        mrl_gguf_kv_number(g, i, -1, &v);
        mrl_gguf_kv_string(g, i, -1, &s, &len);
        for (int64_t j = 0; j < n && j < 16; j++) {
            mrl_gguf_kv_number(g, i, j, &v);
            mrl_gguf_kv_string(g, i, j, &s, &len);
        }
    }
    for (int64_t i = 0; i < mrl_gguf_tensor_count(g); i++) {
        mrl_gguf_tensor t;
        if (mrl_gguf_tensor_info(g, i, &t) || t.numel > (1 << 22)) continue;
        float *dst = malloc((size_t)t.numel * sizeof(float));
        mrl_gguf_read_f32(g, i, dst, t.numel);
        free(dst);
    }
    mrl_gguf_close(g);
    return 1;
}

/* Where tensor `name`'s info is in the file: its n_dims field (after the name). */
static uint8_t *info_of(const buf *b, const char *name) {
    size_t n = strlen(name);
    for (size_t i = 0; i + 8 + n <= b->n; i++) {
        uint64_t len;
        memcpy(&len, b->p + i, 8);
        if (len == n && !memcmp(b->p + i + 8, name, n)) return b->p + i + 8 + n;
    }
    return NULL;
}
static uint8_t *type_field(const buf *b, const char *name) {
    uint8_t *p = info_of(b, name);
    uint32_t nd;
    memcpy(&nd, p, 4);
    return p + 4 + 8 * nd;
}
static void set_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void set_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* A copy of the good file changed by `mutate`: opening it (or reading `tensor`) fails with
 * MRL_ERR_FORMAT and a message holding each of `want` (NULL-terminated). */
static void refused(const char *path, const buf *good, void (*mutate)(buf *), const char *tensor,
                    const char *const *want) {
    buf b = {malloc(good->n + 64), good->n, good->n + 64};
    memcpy(b.p, good->p, good->n);
    mutate(&b);
    write_file(path, b.p, b.n);
    mrl_gguf *g = NULL;
    mrl_status st = mrl_gguf_open(path, &g);
    mrl_gguf_tensor t;
    if (!st && tensor && !mrl_gguf_tensor_info(g, mrl_gguf_find_tensor(g, tensor), &t)) {
        float out[256];
        st = mrl_gguf_read_f32(g, mrl_gguf_find_tensor(g, tensor), out, t.numel);
    }
    CHECK(st == MRL_ERR_FORMAT);
    for (int i = 0; want[i]; i++) CHECK_STR_CONTAINS(mrl_last_error(), want[i]);
    mrl_gguf_close(g);
    free(b.p);
}

/* two infos on the same bytes: q8 at f32's offset */
static void same_bytes(buf *b) { set_u64(type_field(b, "q8") + 4, 0); }
/* q8 (Q8_0, 68 bytes: 96 with padding) relabelled F16: 128 bytes, running into q4k at 128 */
static void relabelled(buf *b) { set_u32(type_field(b, "q8"), MRL_GGML_F16); }
/* q4k one aligned step further than the running size (32 more bytes of file so it fits) */
static void gap(buf *b) {
    set_u64(type_field(b, "q4k") + 4, 32 + 96 + 32);
    size_t n = b->n;
    memmove(b->p + n - 144 + 32, b->p + n - 144, 144);
    b->n += 32;
}
/* f32 [8] holds a NaN; q8's first block scale is fp16 infinity */
static size_t data_start(const buf *b) { return b->n - 144 - 128; } /* f32 (32 B), q8 (96 B), q4k (144 B) */
static void nan_f32(buf *b) {
    float x = NAN;
    memcpy(b->p + data_start(b) + 4 * 5, &x, 4);
}
static void inf_q8(buf *b) {
    uint16_t inf = 0x7C00;
    memcpy(b->p + data_start(b) + 32 + 34, &inf, 2); /* the second block's scale */
}
static void twin_names(buf *b) { memcpy(info_of(b, "f32") - 3, "q4k", 3); }

/* The tensors are checked against each other, and read values against NaN and infinity. */
static void test_checks(const char *path, const buf *good) {
    refused(path, good, same_bytes, NULL, (const char *const[]){path, "'f32'", "'q8'", "overlap", NULL});
    refused(path, good, relabelled, NULL, (const char *const[]){"'q8' (F16, 128 bytes", "'q4k'", "overlap", NULL});
    refused(path, good, gap, NULL, (const char *const[]){"tensor 'q4k' is at data offset 160, expected 128", NULL});
    refused(path, good, nan_f32, "f32", (const char *const[]){path, "tensor 'f32' (F32) holds a NaN at element 5", NULL});
    refused(path, good, inf_q8, "q8", (const char *const[]){"tensor 'q8' (Q8_0) holds an infinity at element 32", NULL});
    refused(path, good, twin_names, NULL, (const char *const[]){"two tensors are named 'q4k'", NULL});
}

static void test_fuzz(const char *path, const buf *good) {
    int opened = 0, runs = 3000;
    uint8_t *p = malloc(good->n);
    for (int r = 0; r < runs; r++) {
        memcpy(p, good->p, good->n);
        size_t n = good->n;
        uint64_t seed = rand_u64(); /* this run's mutation */
        int kind = (int)(seed >> 60) % 3;
        size_t at = (size_t)((seed >> 20) % good->n);
        if (kind == 0) { /* a few random bytes */
            for (int k = 0; k < 1 + (int)(seed % 4); k++) p[(at + 7 * k) % n] = (uint8_t)(seed >> (8 * k));
        } else if (kind == 1 && at + 8 <= n) { /* a huge 64-bit field */
            uint64_t big = ((seed >> 3) & 1) ? ~(uint64_t)0 >> (seed % 8) : (uint64_t)1 << (32 + seed % 31);
            memcpy(p + at, &big, 8);
        } else { /* cut short */
            n = at;
        }
        write_file(path, p, n);
        opened += try_file(path);
    }
    free(p);
    printf("fuzz: %d mutated files, %d opened, the others refused with an error\n", runs, opened);
    CHECK(opened > 0 && opened < runs);
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/moonrl-gguf-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    char path[128];
    snprintf(path, sizeof path, "%s/t.gguf", dir);
    buf good = make_file();
    write_file(path, good.p, good.n);
    test_reads(path);
    test_checks(path, &good);
    mrl_gguf *g = NULL;
    CHECK(mrl_gguf_open("/nonexistent/x.gguf", &g) == MRL_ERR_IO && strstr(mrl_last_error(), "/nonexistent/x.gguf"));
    CHECK(mrl_gguf_open(dir, &g) == MRL_ERR_IO); /* a directory */
    test_fuzz(path, &good);
    free(good.p);
    unlink(path);
    rmdir(dir);
    printf("%d checks, %d failed\n", check_count, check_failures);
    return check_failures != 0;
}
