/* The JSON reader used for config.json, safetensors headers and tokenizer.json. */
#include "io/json.h"
#include "check.h"

static mrl_json_doc *parse(const char *text) {
    mrl_json_doc *doc = NULL;
    mrl_json_parse(text, strlen(text), "test.json", &doc);
    return doc;
}

int main(void) {
    mrl_json_doc *doc = parse("{\"a\": 1, \"b\": [true, false, null, -2.5e3], \"s\": \"x\\u00e9\\ud83d\\ude00\\n\","
                              " \"big\": 9007199254740993, \"a\": 2}");
    CHECK(doc != NULL);
    mrl_json *root = mrl_json_root(doc);
    int64_t i;
    CHECK(mrl_json_get_int(root, "a", &i) && i == 2); /* last duplicate wins */
    CHECK(mrl_json_get_int(root, "big", &i) && i == 9007199254740993LL);
    mrl_json *b = mrl_json_get(root, "b");
    CHECK(b && b->type == MRL_JSON_ARRAY && b->length == 4);
    CHECK(b->items[0]->type == MRL_JSON_BOOL && b->items[0]->number == 1);
    CHECK(b->items[1]->number == 0 && b->items[2]->type == MRL_JSON_NULL);
    CHECK(b->items[3]->number == -2500 && !b->items[3]->is_integer);
    const char *s = mrl_json_get_string(root, "s");
    CHECK(s && strcmp(s, "x\xc3\xa9\xf0\x9f\x98\x80\n") == 0);
    CHECK(mrl_json_get(root, "missing") == NULL);
    mrl_json_free(doc);

    /* errors name the source, line and column */
    const char *bad[] = {"{\"a\": }", "[1, 2", "{\"a\" 1}", "\"abc", "01", "[1,]", "{} x", "", "tru", "\"\\q\""};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        mrl_json_doc *d = NULL;
        CHECK(mrl_json_parse(bad[k], strlen(bad[k]), "bad.json", &d) == MRL_ERR_FORMAT);
        CHECK(d == NULL);
        CHECK_STR_CONTAINS(mrl_last_error(), "bad.json:1:");
    }
    mrl_json_doc *d = NULL;
    CHECK(mrl_json_parse("{\n  \"a\": [1,\n  x]}", 17, "multi.json", &d) == MRL_ERR_FORMAT);
    CHECK_STR_CONTAINS(mrl_last_error(), "multi.json:3:3");

    /* deep nesting is refused, not a stack overflow */
    char deep[5000];
    memset(deep, '[', sizeof deep - 1);
    deep[sizeof deep - 1] = 0;
    CHECK(mrl_json_parse(deep, strlen(deep), "deep.json", &d) == MRL_ERR_FORMAT);
    CHECK_STR_CONTAINS(mrl_last_error(), "too deep");

    CHECK(mrl_json_parse_file("/no/such/file.json", &d) == MRL_ERR_IO);
    CHECK_STR_CONTAINS(mrl_last_error(), "/no/such/file.json");
    CHECK_DONE();
}
