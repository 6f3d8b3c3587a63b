/* core/model/config.c: a model's config.json (the families, sizes,
 * rope_scaling, token ids, mixture-of-experts keys). Input: the file's
 * text. Properties: a config that parses and validates writes back as
 * config.json text that parses and validates again and writes back the
 * same text (what moonrl saves, it loads unchanged). */
#include <string.h>
#include "fuzz.h"
#include "moonrl/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mrl_model_config cfg, again;
    if (mrl_model_config_parse((const char *)data, size, "config.json", &cfg) != MRL_OK) return 0;
    if (mrl_model_config_validate(&cfg) != MRL_OK) return 0;
    static char text[1 << 16], text2[1 << 16];
    size_t len = 0, len2 = 0;
    FUZZ_ASSERT(mrl_model_config_to_json(&cfg, text, sizeof text, &len) == MRL_OK);
    FUZZ_ASSERT(len < sizeof text && strlen(text) == len);
    FUZZ_ASSERT(mrl_model_config_parse(text, len, "config.json (written back)", &again) == MRL_OK);
    FUZZ_ASSERT(mrl_model_config_validate(&again) == MRL_OK);
    FUZZ_ASSERT(mrl_model_config_to_json(&again, text2, sizeof text2, &len2) == MRL_OK);
    FUZZ_ASSERT(len == len2 && memcmp(text, text2, len) == 0);
    return 0;
}
