/* Tokenizer edge cases: empty text, only special tokens, buffer sizes,
 * streaming, invalid UTF-8, and errors for corrupt files. The comparison
 * with the Python package is tests/tok/ref_tokenizers.py. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "build_info.h"
#include "check.h"
#include "moonrl/tok.h"
#include "random.h"

#define FIX MRL_SOURCE_DIR "/tests/tok/fixtures/"
enum { BOTH = MRL_TOK_ADD_SPECIAL | MRL_TOK_PARSE_SPECIAL };

static char tmpdir[256];

static const char *write_file(const char *name, const char *text) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "wb");
    fputs(text, f);
    fclose(f);
    return path;
}

static mrl_status load_text(const char *text, mrl_tok **t) {
    return mrl_tok_load(write_file("tokenizer.json", text), t);
}

static void expect_error(const char *json, mrl_status want, const char *needle) {
    mrl_tok *t = (mrl_tok *)1;
    mrl_status st = load_text(json, &t);
    CHECK(st == want);
    CHECK(t == NULL);
    CHECK_STR_CONTAINS(mrl_last_error(), needle);
    CHECK_STR_CONTAINS(mrl_last_error(), "tokenizer.json");
}

static size_t encode(mrl_tok *t, const char *s, int flags, int32_t *ids, size_t cap) {
    size_t n = 0;
    CHECK_OK(mrl_tok_encode(t, s, strlen(s), flags, ids, cap, &n));
    return n;
}

static void test_errors(void) {
    mrl_tok *t = NULL;
    CHECK(mrl_tok_load(FIX "no-such-dir", &t) == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), "no-such-dir: cannot open");
    expect_error("{\"model\": ", MRL_ERR_FORMAT, ":1:11: unexpected end");
    expect_error("[1, 2]", MRL_ERR_FORMAT, "expected a JSON object");
    expect_error("{}", MRL_ERR_FORMAT, "missing \"model\"");
    expect_error("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", MRL_ERR_UNSUPPORTED, "WordPiece");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"x\"}}}", MRL_ERR_FORMAT, "model.vocab[\"a\"]");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -3}}}", MRL_ERR_FORMAT, "model.vocab[\"a\"]");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}",
                 MRL_ERR_FORMAT, "model.merges[0]");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"ab\"]}}", MRL_ERR_FORMAT,
                 "is not \"a b\"");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [7]}}", MRL_ERR_FORMAT,
                 "model.merges[0]");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"unk_token\": \"<unk>\"}}", MRL_ERR_FORMAT,
                 "unk_token");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"pre_tokenizer\": {\"type\": \"Split\","
                 " \"pattern\": {\"Regex\": \"(unclosed\"}, \"behavior\": \"Isolated\"}}",
                 MRL_ERR_FORMAT, "pre_tokenizer: bad regex");
    /* a byte that is no UTF-8 in the pattern: an error, not a read past it in PCRE2 (found by fuzzing) */
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"pre_tokenizer\": {\"type\": \"Split\","
                 " \"pattern\": {\"Regex\": \"'r\xff|'ve\"}, \"behavior\": \"Isolated\"}}",
                 MRL_ERR_FORMAT, "pre_tokenizer: bad regex");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"pre_tokenizer\": {\"type\": \"BertPreTokenizer\"}}",
                 MRL_ERR_UNSUPPORTED, "BertPreTokenizer");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"added_tokens\": [{\"content\": \"x\"}]}",
                 MRL_ERR_FORMAT, "added_tokens[0]");
    expect_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"post_processor\": {\"type\": \"TemplateProcessing\","
                 " \"single\": [{\"SpecialToken\": {\"id\": \"<s>\"}}], \"special_tokens\": {}}}",
                 MRL_ERR_FORMAT, "post_processor");
    /* a minimal valid file loads */
    CHECK_OK(load_text("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [[\"a\", \"b\"]]}}", &t));
    int32_t ids[8];
    CHECK(encode(t, "abba", 0, ids, 8) == 3 && ids[0] == 2 && ids[1] == 1 && ids[2] == 0);
    CHECK(encode(t, "zzz", 0, ids, 8) == 0); /* no unk token: unknown characters are dropped */
    mrl_tok_free(t);
}

static void test_edges(void) {
    mrl_tok *t = NULL;
    CHECK_OK(mrl_tok_load(FIX "llama3_split", &t));
    if (!t) return;
    int32_t ids[64];
    int32_t bos = mrl_tok_bos_id(t), eot = mrl_tok_eos_id(t);
    CHECK(bos == mrl_tok_token_to_id(t, "<|begin_of_text|>", 17));
    CHECK(eot == mrl_tok_token_to_id(t, "<|eot_id|>", 10) && eot >= 0);
    CHECK(mrl_tok_is_special(t, eot) && !mrl_tok_is_special(t, 200));
    /* empty text */
    CHECK(encode(t, "", MRL_TOK_PARSE_SPECIAL, ids, 64) == 0);
    CHECK(encode(t, "", BOTH, ids, 64) == 1 && ids[0] == bos);
    size_t n = 99;
    CHECK_OK(mrl_tok_encode(t, NULL, 0, 0, NULL, 0, &n));
    CHECK(n == 0);
    /* only special tokens */
    CHECK(encode(t, "<|eot_id|><|eot_id|>", MRL_TOK_PARSE_SPECIAL, ids, 64) == 2 && ids[0] == eot && ids[1] == eot);
    CHECK(encode(t, "<|eot_id|>", 0, ids, 64) > 1); /* not parsed: plain text */
    /* sizes: a query, then a buffer one too small */
    const char *text = "Hello world, this is a test.";
    size_t need = 0;
    CHECK_OK(mrl_tok_encode(t, text, strlen(text), BOTH, NULL, 0, &need));
    CHECK(need > 2);
    CHECK(mrl_tok_encode(t, text, strlen(text), BOTH, ids, need - 1, &n) == MRL_ERR_INVALID && n == need);
    CHECK_STR_CONTAINS(mrl_last_error(), "buffer");
    CHECK(encode(t, text, BOTH, ids, need) == need);
    char buf[256];
    size_t len = 0;
    CHECK_OK(mrl_tok_decode(t, ids, need, MRL_TOK_SKIP_SPECIAL, NULL, 0, &len));
    CHECK(len == strlen(text));
    CHECK(mrl_tok_decode(t, ids, need, MRL_TOK_SKIP_SPECIAL, buf, len - 1, &len) == MRL_ERR_INVALID);
    CHECK_OK(mrl_tok_decode(t, ids, need, MRL_TOK_SKIP_SPECIAL, buf, sizeof buf, &len));
    CHECK(len == strlen(text) && memcmp(buf, text, len) == 0);
    CHECK_OK(mrl_tok_decode(t, ids, 0, 0, buf, sizeof buf, &len));
    CHECK(len == 0);
    /* ids out of range are left out */
    int32_t odd[3] = { -5, 1 << 30, ids[1] };
    CHECK_OK(mrl_tok_decode(t, odd, 3, 0, buf, sizeof buf, &len));
    CHECK(len > 0 && len < 10);
    /* lookups */
    size_t tl;
    CHECK(mrl_tok_id_to_token(t, -1, &tl) == NULL && tl == 0);
    CHECK(mrl_tok_id_to_token(t, mrl_tok_vocab_size(t) + 100, &tl) == NULL);
    const char *s = mrl_tok_id_to_token(t, bos, &tl);
    CHECK(s && tl == 17 && memcmp(s, "<|begin_of_text|>", 17) == 0);
    CHECK(mrl_tok_token_to_id(t, "no such token", 13) == -1);
    /* invalid UTF-8 is repaired, never a crash */
    const char bad[] = "ab\xff\xfe\xc3 \xe4\xbd";
    CHECK_OK(mrl_tok_encode(t, bad, sizeof bad - 1, 0, ids, 64, &n));
    CHECK_OK(mrl_tok_decode(t, ids, n, 0, buf, sizeof buf, &len));
    CHECK(len == 2 + 3 * 4 + 1 && memcmp(buf, "ab\xef\xbf\xbd", 5) == 0);
    mrl_tok_free(t);
}

static void test_stream(void) {
    mrl_tok *t = NULL;
    CHECK_OK(mrl_tok_load(FIX "sentencepiece_bytefallback", &t));
    if (!t) return;
    const char *text = "héllo 😀 мир 汉字 done";
    int32_t ids[128];
    size_t n = encode(t, text, BOTH, ids, 128);
    mrl_tok_stream *s = NULL;
    CHECK_OK(mrl_tok_stream_new(t, MRL_TOK_SKIP_SPECIAL, &s));
    char out[256];
    size_t total = 0;
    for (int round = 0; round < 2; round++) {
        total = 0;
        for (size_t i = 0; i < n; i++) {
            const char *piece;
            size_t len;
            CHECK_OK(mrl_tok_stream_step(s, ids[i], &piece, &len));
            if (total + len < sizeof out) memcpy(out + total, piece, len), total += len;
        }
        CHECK(total == strlen(text) && memcmp(out, text, total) == 0);
        mrl_tok_stream_reset(s);
    }
    mrl_tok_stream_free(s);
    mrl_tok_free(t);
}

static int valid_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n) return 0;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xC0) != 0x80) return 0;
        i += k;
    }
    return 1;
}

/* Random bytes in, random ids out, on several fixtures: no error, no crash
 * (this runs under AddressSanitizer too), and decoded text is valid UTF-8. */
static void test_random(void) {
    static const char *names[] = { "gpt2_bytelevel", "llama3_split", "qwen2_split", "sentencepiece_bytefallback",
                                   "metaspace_digits", "var_splits", "var_prefix_space" };
    static const char *bits[] = { "<|endoftext|>", "<|eot_id|>", "<s>", "\xe2\x96\x81", " ", "\n", "\xf0\x9f\x98\x80",
                                  "\xff", "\xc3", "123", "ab", "\xd0\xbc\xd0\xb8", "<tool>", "[[L]]", "{R}", "\t" };
    for (size_t f = 0; f < sizeof names / sizeof *names; f++) {
        char path[512];
        snprintf(path, sizeof path, FIX "%s", names[f]);
        mrl_tok *t = NULL;
        CHECK_OK(mrl_tok_load(path, &t));
        if (!t) continue;
        mrl_tok_stream *st = NULL;
        CHECK_OK(mrl_tok_stream_new(t, 0, &st));
        static char text[1024], out[16384];
        static int32_t ids[2048];
        int32_t vs = mrl_tok_vocab_size(t);
        for (int round = 0; round < 60; round++) {
            size_t len = 0;
            int parts = (int)(rand_u64() % 40);
            for (int p = 0; p < parts; p++) {
                uint64_t r = rand_u64();
                const char *b = bits[r % (sizeof bits / sizeof *bits)];
                size_t bl = strlen(b);
                if ((r >> 8) % 4 == 0) text[len++] = (char)(r >> 16); /* a random byte */
                else memcpy(text + len, b, bl), len += bl;
            }
            size_t n = 0, out_len = 0;
            CHECK_OK(mrl_tok_encode(t, text, len, round % 4, ids, 2048, &n));
            CHECK_OK(mrl_tok_decode(t, ids, n, round % 2 ? MRL_TOK_SKIP_SPECIAL : 0, out, sizeof out, &out_len));
            CHECK(valid_utf8((const unsigned char *)out, out_len));
            for (size_t i = 0; i < 40; i++) ids[i] = (int32_t)(rand_u64() % (uint64_t)(vs + 10)) - 5; /* some out of range */
            CHECK_OK(mrl_tok_decode(t, ids, 40, 0, out, sizeof out, &out_len));
            CHECK(valid_utf8((const unsigned char *)out, out_len));
            for (size_t i = 0; i < 40; i++) {
                const char *piece;
                size_t pl;
                CHECK_OK(mrl_tok_stream_step(st, ids[i], &piece, &pl));
                CHECK(valid_utf8((const unsigned char *)piece, pl));
            }
        }
        mrl_tok_stream_free(st);
        mrl_tok_free(t);
    }
}

/* A batch gives what the texts give one by one. */
static void test_batch(void) {
    mrl_tok *t = NULL;
    CHECK_OK(mrl_tok_load(FIX "llama3_split", &t));
    if (!t) return;
    enum { N = 37 };
    static char storage[N][64];
    const char *texts[N];
    size_t lens[N], offsets[N + 1], total = 0;
    for (int i = 0; i < N; i++) {
        snprintf(storage[i], sizeof storage[i], "text %d: %s <|eot_id|> \xd0\xbc\xd0\xb8\xd1\x80 %d", i,
                 i % 3 ? "hello" : "", i * 7919);
        texts[i] = storage[i];
        lens[i] = strlen(storage[i]);
    }
    lens[5] = 0; /* an empty text */
    CHECK_OK(mrl_tok_encode_batch(t, texts, lens, N, BOTH, NULL, 0, offsets));
    total = offsets[N];
    int32_t *ids = malloc(total * sizeof *ids), one[128];
    CHECK(mrl_tok_encode_batch(t, texts, lens, N, BOTH, ids, total - 1, offsets) == MRL_ERR_INVALID);
    CHECK_OK(mrl_tok_encode_batch(t, texts, lens, N, BOTH, ids, total, offsets));
    for (int i = 0; i < N; i++) {
        size_t n = 0;
        CHECK_OK(mrl_tok_encode(t, texts[i], lens[i], BOTH, one, 128, &n));
        CHECK(offsets[i + 1] - offsets[i] == n && memcmp(ids + offsets[i], one, n * sizeof *one) == 0);
    }
    CHECK_OK(mrl_tok_encode_batch(t, NULL, NULL, 0, BOTH, NULL, 0, offsets));
    CHECK(offsets[0] == 0);
    free(ids);
    mrl_tok_free(t);
}

/* mrl_tok_max_text_bytes: the longest token string for a tokenizer that keeps all its text (3 times
 * it with NFC), 0 for one that can drop text; texts that pack many bytes into few tokens (runs of
 * spaces, decomposed Hangul, unknown characters) stay within the bound. */
static void test_max_text_bytes(void) {
    static const struct { const char *fixture; int bounded, nfc; } cases[] = {
        {"llama3_split", 1, 0},   {"qwen2_split", 1, 1},     {"sentencepiece_bytefallback", 1, 0},
        {"var_splits", 0, 0},     /* a Split that removes */
        {"var_punctuation", 0, 0}, /* WhitespaceSplit */
        {"gpt2_bytelevel", 0, 0}, /* added tokens that strip whitespace */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char path[256];
        snprintf(path, sizeof path, FIX "%s", cases[k].fixture);
        mrl_tok *t = NULL;
        CHECK_OK(mrl_tok_load(path, &t));
        if (!t) continue;
        size_t longest = 4, len;
        for (int32_t id = 0; id < 1 << 20; id++)
            if (mrl_tok_id_to_token(t, id, &len) && len > longest) longest = len;
        size_t got = mrl_tok_max_text_bytes(t);
        if (cases[k].bounded) CHECK(got == longest * (cases[k].nfc ? 3 : 1));
        else CHECK(got == 0);
        static char text[4096];
        const char *units[] = {" ", "\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", "\xf0\x9f\x98\x80", "\x01", "ab"};
        for (size_t u = 0; got && u < sizeof units / sizeof units[0]; u++) {
            size_t ulen = strlen(units[u]), len = 0;
            while (len + ulen < sizeof text) memcpy(text + len, units[u], ulen), len += ulen;
            size_t n = 0;
            CHECK_OK(mrl_tok_encode(t, text, len, 0, NULL, 0, &n));
            CHECK(len <= n * got);
        }
        mrl_tok_free(t);
    }
    CHECK(mrl_tok_max_text_bytes(NULL) == 0);
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/moonrl_test_tok_XXXXXX");
    if (!mkdtemp(tmpdir)) return 1;
    test_errors();
    test_edges();
    test_stream();
    test_random();
    test_batch();
    test_max_text_bytes();
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", tmpdir);
    unlink(path);
    rmdir(tmpdir);
    CHECK_DONE();
}
