/* core/io/json.c: the JSON reader under config.json, the safetensors
 * header and tokenizer.json. Input: any bytes, parsed as one document.
 * Properties: every string is NUL-terminated at its length; every object
 * key (without a NUL in it) looks up to a member with that key; typed
 * lookups agree with the member's type. */
#include <string.h>
#include "fuzz.h"
#include "io/json.h"

static void walk(const mrl_json *v, int depth) {
    FUZZ_ASSERT(depth <= 1024);
    switch (v->type) {
    case MRL_JSON_STRING:
        FUZZ_ASSERT(v->string && v->string[v->length] == 0);
        break;
    case MRL_JSON_ARRAY:
        for (size_t i = 0; i < v->length; i++) walk(v->items[i], depth + 1);
        break;
    case MRL_JSON_OBJECT:
        for (size_t i = 0; i < v->length; i++) {
            const char *key = v->keys[i];
            FUZZ_ASSERT(key[v->key_lengths[i]] == 0);
            if (strlen(key) == v->key_lengths[i]) {
                const mrl_json *m = mrl_json_get(v, key);
                FUZZ_ASSERT(m != NULL);
                double d;
                int64_t n;
                int b;
                FUZZ_ASSERT(mrl_json_get_number(v, key, &d) == (m->type == MRL_JSON_NUMBER));
                FUZZ_ASSERT(mrl_json_get_int(v, key, &n) == (m->type == MRL_JSON_NUMBER && m->is_integer));
                FUZZ_ASSERT(mrl_json_get_bool(v, key, &b) == (m->type == MRL_JSON_BOOL));
                FUZZ_ASSERT((mrl_json_get_string(v, key) != NULL) == (m->type == MRL_JSON_STRING));
            }
            walk(v->items[i], depth + 1);
        }
        break;
    default:
        break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mrl_json_doc *doc = NULL;
    if (mrl_json_parse((const char *)data, size, "fuzz.json", &doc) == MRL_OK) {
        FUZZ_ASSERT(mrl_json_root(doc) != NULL);
        walk(mrl_json_root(doc), 0);
    } else {
        FUZZ_ASSERT(doc == NULL);
    }
    mrl_json_free(doc);
    return 0;
}
