/* Internals of the tokenizer (core/tok): the loaded tokenizer.json as plain
 * tables, and the helpers the stages share. Not part of the FFI surface. */
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include "moonrl/tok.h"

/* ---- growable byte buffer and int32 list ---- */
typedef struct tok_buf {
    char *data;
    size_t len, cap;
} tok_buf;
int tok_buf_reserve(tok_buf *b, size_t extra);
int tok_buf_put(tok_buf *b, const void *p, size_t n);
void tok_buf_free(tok_buf *b);

typedef struct tok_ids {
    int32_t *data;
    size_t len, cap;
} tok_ids;
int tok_ids_push(tok_ids *v, int32_t id);
void tok_ids_free(tok_ids *v);

/* ---- string -> int32 hash map (open addressing; keys are copied) ---- */
typedef struct tok_strmap {
    uint32_t *slots; /* entry index + 1, 0 = empty */
    size_t mask;
    char **keys;
    uint32_t *key_lens;
    int32_t *values;
    size_t count, cap;
} tok_strmap;
int tok_strmap_init(tok_strmap *m, size_t expected);
/* Insert or overwrite; returns 0 on out-of-memory. */
int tok_strmap_put(tok_strmap *m, const char *k, size_t len, int32_t value);
/* Value or -1. */
int32_t tok_strmap_get(const tok_strmap *m, const char *k, size_t len);
void tok_strmap_free(tok_strmap *m);
uint64_t tok_hash(const char *s, size_t len);

/* ---- UTF-8 ---- */
/* Length of the valid UTF-8 sequence at s (1..4), or 0 if invalid there;
 * for invalid input, *skip is the maximal invalid subpart's length. */
int tok_utf8_valid_at(const unsigned char *s, size_t avail, size_t *skip);
/* Copy src to dst, replacing invalid subsequences with U+FFFD as Python's
 * errors='replace' and Rust's from_utf8_lossy do. Returns 0 on OOM. */
int tok_utf8_lossy(const char *src, size_t len, tok_buf *dst);
int tok_utf8_is_valid(const char *s, size_t len);
/* Decode one code point of valid UTF-8 at s; returns its byte length. */
int tok_utf8_decode(const char *s, uint32_t *cp);
int tok_utf8_encode(uint32_t cp, char *out);
int tok_is_whitespace(uint32_t cp);

/* White_Space and Unicode word characters (as Oniguruma's \s and \w, and
 * Rust's char::is_whitespace / regex \w), as the contents of a PCRE2
 * character class. */
#define TOK_SPACE_CLASS \
    "\\t-\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define TOK_WORD_CLASS "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}"

/* ---- pipeline stages ---- */
enum { NORM_PREPEND, NORM_REPLACE, NORM_NFC };
typedef struct tok_norm {
    int kind;
    char *a, *b; /* PREPEND: a; REPLACE: pattern a -> content b */
    size_t alen, blen;
} tok_norm;

enum { SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS };
enum { PT_BYTELEVEL, PT_SPLIT, PT_DIGITS, PT_METASPACE };
enum { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER };
typedef struct tok_pretok {
    int kind;
    pcre2_code *re;          /* SPLIT, DIGITS, BYTELEVEL with use_regex, METASPACE (its replacement) */
    int behavior, invert;    /* SPLIT / DIGITS */
    int add_prefix_space;    /* BYTELEVEL */
    char repl[8];            /* METASPACE replacement (UTF-8) */
    int repl_len, prepend_scheme, split;
} tok_pretok;

enum { DEC_BYTELEVEL, DEC_REPLACE, DEC_BYTEFALLBACK, DEC_FUSE, DEC_STRIP, DEC_METASPACE };
typedef struct tok_dec {
    int kind;
    char *a, *b; /* REPLACE: pattern a -> content b; STRIP: a = content char */
    size_t alen, blen;
    int start, stop; /* STRIP */
    char repl[8];    /* METASPACE */
    int repl_len, prepend_scheme;
} tok_dec;

typedef struct tok_added {
    char *content;
    size_t len;
    char *pattern; /* what is matched: content, normalized when `normalized` */
    size_t pattern_len;
    int32_t id;
    int special, single_word, lstrip, rstrip, normalized;
} tok_added;

/* A cached word: ids[off .. off+n) in the cache pool. */
typedef struct tok_cache {
    tok_strmap index; /* word -> entry number */
    uint32_t *off, *n;
    tok_ids pool;
    size_t entries;
} tok_cache;

/* What one encoding thread writes: regex match data and the word cache. */
typedef struct tok_work {
    pcre2_match_data *md;
    tok_cache cache;
} tok_work;
int tok_work_init(tok_work *w);
void tok_work_free(tok_work *w);

struct mrl_tok {
    char path[512];
    /* id -> token string (model vocabulary and added tokens) */
    char **id_str;
    uint32_t *id_len;
    int32_t n_ids;          /* max id + 1 */
    int32_t distinct_ids;   /* vocab size as tokenizers reports it */
    tok_strmap vocab;       /* model vocabulary */
    tok_strmap added_index; /* added token content -> index in added[] */
    /* merges: open addressing on (left id, right id) */
    uint64_t *merge_keys;
    int32_t *merge_rank, *merge_new;
    size_t merge_mask;
    int byte_fallback, ignore_merges, fuse_unk;
    int32_t unk_id;
    int32_t byte_ids[256];  /* <0xXX> ids for byte_fallback, -1 if absent */
    int byte_level_ids;     /* byte_char_id[] valid: every byte-level char is in the vocab */
    int32_t byte_char_id[256];
    int has_byte_level;     /* a ByteLevel pre-tokenizer maps bytes to chars */

    tok_norm *norms;
    int n_norms;
    tok_pretok *pretoks;
    int n_pretoks;
    tok_dec *decs;
    int n_decs;
    int has_decoder;

    tok_added *added;
    int n_added;
    int32_t *added_sorted;      /* indices into added[], by first byte, longest first */
    int32_t added_bucket[257];  /* added_sorted[added_bucket[b] .. added_bucket[b+1]) start with byte b */
    uint8_t *is_special;    /* per id: an added token marked special */
    uint8_t *skip_special;  /* per id: left out by MRL_TOK_SKIP_SPECIAL (see index_added) */
    int32_t *added_of_id;   /* per id: index in added[] or -1 */
    int32_t post_prefix[8], post_suffix[8];
    int n_post_prefix, n_post_suffix;
    int32_t bos_id, eos_id;

    pthread_mutex_t lock; /* guards work */
    tok_work work;        /* for mrl_tok_encode; batches make their own */
    pcre2_code *word_re; /* \w: what single_word tokens may not touch */
};

/* byte-level: the printable code point that stands for each byte */
extern uint32_t tok_byte_to_cp[256];
void tok_byte_level_init(void);
/* inverse: code point -> byte, or -1 */
int tok_cp_to_byte(uint32_t cp);

mrl_status tok_load_json(mrl_tok *t, const char *file);
void tok_free_tables(mrl_tok *t);

/* A piece of text under pre-tokenization; `first` marks the piece that
 * starts at offset 0 of the original text. */
typedef struct tok_piece {
    const char *s;
    size_t len;
    int first;
    int bytelevel; /* raw bytes that the byte-level alphabet still has to map */
} tok_piece;

typedef struct tok_pieces {
    tok_piece *data;
    size_t len, cap;
} tok_pieces;
int tok_pieces_push(tok_pieces *p, const char *s, size_t len, int first, int bytelevel);

/* Scratch memory whose blocks never move (pieces point into them). */
typedef struct tok_arena_block tok_arena_block;
typedef struct tok_arena {
    tok_arena_block *head;
} tok_arena;
char *tok_arena_alloc(tok_arena *a, size_t n);
void tok_arena_free(tok_arena *a);

/* Unicode NFC of s (s itself when already NFC, else an arena string). */
int tok_nfc(const char *s, size_t len, tok_arena *a, const char **out, size_t *out_len);
/* Normalize s into a fresh arena string. */
int tok_normalize(const mrl_tok *t, const char *s, size_t len, tok_arena *a, const char **out, size_t *out_len);
/* Pre-tokenize one segment: append the final pieces to out. */
int tok_pretokenize(const mrl_tok *t, tok_work *w, const char *s, size_t len, int first, tok_arena *a, tok_pieces *out);
/* BPE-encode one pre-tokenized piece, appending ids. */
int tok_bpe_word(const mrl_tok *t, tok_work *w, const char *s, size_t len, int bytelevel, tok_ids *out);
void tok_cache_free(tok_cache *c);
/* Decode tokens to text (the decoder chain plus lossy UTF-8). */
int tok_decode_ids(const mrl_tok *t, const int32_t *ids, size_t n, int flags, tok_buf *out);
