/* A small JSON reader for the files moonrl parses in C: config.json,
 * safetensors headers, tokenizer.json. The whole document is parsed into one
 * arena; errors name the source, line and column. Internal to the core (not
 * part of the FFI surface). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "moonrl/status.h"

typedef enum mrl_json_type {
    MRL_JSON_NULL,
    MRL_JSON_BOOL,
    MRL_JSON_NUMBER,
    MRL_JSON_STRING,
    MRL_JSON_ARRAY,
    MRL_JSON_OBJECT
} mrl_json_type;

typedef struct mrl_json mrl_json;
struct mrl_json {
    mrl_json_type type;
    int is_integer;      /* a NUMBER written without fraction or exponent */
    double number;       /* NUMBER; BOOL as 0/1 */
    int64_t integer;     /* NUMBER when is_integer (exact up to int64) */
    const char *string;  /* STRING (UTF-8, NUL-terminated; may hold NULs) */
    size_t length;       /* STRING byte length; ARRAY / OBJECT item count */
    mrl_json **items;    /* ARRAY / OBJECT values */
    const char **keys;   /* OBJECT keys, parallel to items */
    size_t *key_lengths; /* OBJECT key byte lengths */
};

typedef struct mrl_json_doc mrl_json_doc;

/* Parse text[0..len). source names the text in error messages ("config.json"). */
mrl_status mrl_json_parse(const char *text, size_t len, const char *source, mrl_json_doc **out);
/* Read and parse a whole file. */
mrl_status mrl_json_parse_file(const char *path, mrl_json_doc **out);
mrl_json *mrl_json_root(mrl_json_doc *doc);
void mrl_json_free(mrl_json_doc *doc);

/* Object member by key, or NULL (also when obj is not an object). */
mrl_json *mrl_json_get(const mrl_json *obj, const char *key);
/* Typed lookups: return 1 and store the value when the member exists with
 * that type, 0 otherwise. */
int mrl_json_get_number(const mrl_json *obj, const char *key, double *out);
int mrl_json_get_int(const mrl_json *obj, const char *key, int64_t *out);
int mrl_json_get_bool(const mrl_json *obj, const char *key, int *out);
const char *mrl_json_get_string(const mrl_json *obj, const char *key);
