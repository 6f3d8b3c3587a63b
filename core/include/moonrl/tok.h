/* Tokenizers: Hugging Face `tokenizer.json` files, encoded and decoded
 * exactly as the Python `tokenizers` package does.
 *
 * Supported: model BPE (byte-level GPT-2 / Llama 3 / Qwen2 style, and
 * SentencePiece-style with byte_fallback as in Llama 2 / Mistral), merges as
 * "a b" strings or [a, b] pairs, ignore_merges; normalizers Prepend, Replace,
 * NFC (see below), Sequence; pre-tokenizers ByteLevel, Split (string or
 * regex, all behaviours, invert), Digits, Metaspace, Sequence; added tokens
 * with single_word / lstrip / rstrip / normalized; post-processors
 * TemplateProcessing, ByteLevel, Sequence; decoders ByteLevel, Replace,
 * ByteFallback, Fuse, Strip, Metaspace, Sequence.
 *
 * Text in is UTF-8. Invalid UTF-8 is first replaced the way Python's
 * bytes.decode('utf-8', errors='replace') does (one U+FFFD per maximal
 * invalid subsequence): encoding such bytes gives the ids that `tokenizers`
 * gives for that replaced str. NFC is applied as the identity: text that is
 * already in NFC (nearly all text) encodes identically.
 *
 * The file's truncation and padding settings are ignored (the caller cuts
 * and packs sequences).
 *
 * A handle may be used from several threads; calls on one handle serialize
 * (use one handle per thread to encode in parallel). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_tok mrl_tok;
typedef struct mrl_tok_stream mrl_tok_stream;

typedef enum mrl_tok_flags {
    MRL_TOK_ADD_SPECIAL = 1,   /* encode: add BOS/EOS per the post-processor (HF add_special_tokens) */
    MRL_TOK_PARSE_SPECIAL = 2, /* encode: match special added tokens in the text (HF default) */
    MRL_TOK_SKIP_SPECIAL = 4   /* decode: leave special tokens out (HF skip_special_tokens) */
} mrl_tok_flags;

/* Load `path`: a tokenizer.json file, or a directory holding one (and
 * optionally tokenizer_config.json, which names bos/eos). */
mrl_status mrl_tok_load(const char *path, mrl_tok **out);
void mrl_tok_free(mrl_tok *tok);

/* Encode text[0..len). Writes up to cap ids and stores the full count in
 * *n. When the count exceeds cap it returns MRL_ERR_INVALID, except for a
 * size query (ids == NULL, cap == 0), which returns MRL_OK. */
mrl_status mrl_tok_encode(mrl_tok *tok, const char *text, size_t len, int flags,
                          int32_t *ids, size_t cap, size_t *n);
/* Decode ids[0..n) to UTF-8. Writes up to cap bytes (no NUL added) and
 * stores the full byte count in *len; same size rules as mrl_tok_encode. */
mrl_status mrl_tok_decode(mrl_tok *tok, const int32_t *ids, size_t n, int flags,
                          char *buf, size_t cap, size_t *len);

/* Number of distinct ids (model vocabulary plus added tokens), as
 * get_vocab_size() in `tokenizers`. */
int32_t mrl_tok_vocab_size(const mrl_tok *tok);
/* The id of a token string (vocabulary or added), or -1. */
int32_t mrl_tok_token_to_id(const mrl_tok *tok, const char *token, size_t len);
/* The string of an id (pointer valid while tok lives), or NULL with *len 0.
 * As in tokenizers, an added token with normalized=true comes back in its
 * normalized form (Llama 2's "<s>" comes back as U+2581 then "<s>"). */
const char *mrl_tok_id_to_token(const mrl_tok *tok, int32_t id, size_t *len);
/* 1 when id is an added token marked special. */
int mrl_tok_is_special(const mrl_tok *tok, int32_t id);
/* BOS / EOS ids from tokenizer_config.json (else the post-processor's
 * template for BOS), -1 when unknown. */
int32_t mrl_tok_bos_id(const mrl_tok *tok);
int32_t mrl_tok_eos_id(const mrl_tok *tok);

/* Streaming decoder: feed one id at a time and get back only complete
 * UTF-8 text (bytes of an incomplete character are held back), the same
 * text as `tokenizers`' DecodeStream. Where DecodeStream fails for good (an
 * id that turns text already emitted into something else, e.g. a byte token
 * <0xE4> right after <0x41> under ByteFallback), the stream restarts its
 * context at that id and carries on. flags: MRL_TOK_SKIP_SPECIAL. */
mrl_status mrl_tok_stream_new(mrl_tok *tok, int flags, mrl_tok_stream **out);
void mrl_tok_stream_free(mrl_tok_stream *s);
/* Feed one id. *text points at the new text (valid until the next call on s)
 * and *len is its length, 0 when nothing is complete yet. */
mrl_status mrl_tok_stream_step(mrl_tok_stream *s, int32_t id, const char **text, size_t *len);
/* Forget all ids fed so far (start a new sequence). */
void mrl_tok_stream_reset(mrl_tok_stream *s);

#ifdef __cplusplus
}
#endif
