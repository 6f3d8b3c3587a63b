/* core/tok/load.c: tokenizer.json (the BPE model, vocabulary and merges,
 * added tokens, normalizers, pre-tokenizers with their regexes, the
 * post-processor, decoders) and the tokenizer_config.json beside it; then
 * the tokenizer it makes, used. Input: tokenizer.json. Properties: encoding
 * gives the count a size query gave, and only ids that have a token;
 * decoding, streamed or not, never writes past the buffer it is given. */
#include <string.h>
#include "fuzz.h"
#include "moonrl/tok.h"

static const char *const texts[] = {
    "Hello, world! 123 4567",
    "  leading spaces\tand\ttabs\n\nnew lines\r\n",
    "<s>special</s> <|im_start|>user<|im_end|> <|endoftext|>",
    "caf\xc3\xa9 na\xc3\xafve \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x98\x80 e\xcc\x81",
    "bad utf-8: \xff\xfe \xc3 \xe4\xbd end",
    "",
};

static void use(mrl_tok *tok) {
    int32_t ids[4096];
    char buf[8192];
    for (size_t k = 0; k < sizeof texts / sizeof *texts; k++) {
        for (int flags = 0; flags < 4; flags++) {
            size_t n = 0, m = 0, len = strlen(texts[k]);
            if (mrl_tok_encode(tok, texts[k], len, flags, NULL, 0, &n) != MRL_OK) continue;
            if (n > sizeof ids / sizeof *ids) continue;
            FUZZ_ASSERT(mrl_tok_encode(tok, texts[k], len, flags, ids, sizeof ids / sizeof *ids, &m) == MRL_OK);
            FUZZ_ASSERT(m == n);
            for (size_t i = 0; i < n; i++) {
                size_t tl;
                FUZZ_ASSERT(mrl_tok_id_to_token(tok, ids[i], &tl) != NULL);
            }
            size_t out = 0;
            buf[100] = 'X';
            if (mrl_tok_decode(tok, ids, n, flags & 1 ? MRL_TOK_SKIP_SPECIAL : 0, buf, 100, &out) == MRL_OK)
                FUZZ_ASSERT(out <= 100);
            FUZZ_ASSERT(buf[100] == 'X');
            mrl_tok_decode(tok, ids, n, 0, buf, sizeof buf, &out);
        }
    }
    /* every id up to 300 (and some that are not), decoded one by one and streamed */
    int32_t n_ids = 0;
    for (int32_t id = -2; id < 300; id++) ids[n_ids++] = id;
    ids[n_ids++] = mrl_tok_vocab_size(tok);
    ids[n_ids++] = INT32_MAX;
    size_t out;
    mrl_tok_decode(tok, ids, (size_t)n_ids, 0, buf, sizeof buf, &out);
    mrl_tok_decode(tok, ids, (size_t)n_ids, MRL_TOK_SKIP_SPECIAL, buf, sizeof buf, &out);
    mrl_tok_stream *s;
    if (mrl_tok_stream_new(tok, 0, &s) == MRL_OK) {
        for (int32_t i = 0; i < n_ids; i++) {
            const char *text;
            size_t len;
            mrl_tok_stream_step(s, ids[i], &text, &len);
        }
        mrl_tok_stream_free(s);
    }
    for (int32_t id = 0; id < 300; id++) {
        size_t len;
        const char *t = mrl_tok_id_to_token(tok, id, &len);
        if (t) mrl_tok_token_to_id(tok, t, len);
        mrl_tok_is_special(tok, id);
    }
    mrl_tok_bos_id(tok);
    mrl_tok_eos_id(tok);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int ready;
    if (!ready) {
        static const uint8_t config[] = "{\"bos_token\": \"<s>\", \"eos_token\": {\"content\": \"</s>\"}}";
        fuzz_file("tokenizer_config.json", config, sizeof config - 1);
        ready = 1;
    }
    fuzz_file("tokenizer.json", data, size);
    mrl_tok *tok = NULL;
    if (mrl_tok_load(fuzz_dir(), &tok) != MRL_OK) {
        FUZZ_ASSERT(tok == NULL);
        return 0;
    }
    use(tok);
    mrl_tok_free(tok);
    return 0;
}
